"""Start a private sparsekvd for one command (replay, demo, tests) and stop it after.

The daemon dies with the process that started it, even one killed by SIGKILL
(:func:`die_with_parent`), and a daemon that fails to start says why: the last lines it
wrote to stderr end the :class:`DaemonUnavailable` message.
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from sparsekv.client.errors import DaemonUnavailable
from sparsekv.proto.settings import STOP_TIMEOUT_S

PR_SET_PDEATHSIG = 1
TAIL_LINES = 5  # of the daemon's stderr, in the message of a failed start


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (``parent``: the
    parent's pid, to catch a death before the call). Call it in the child (a Popen
    ``preexec_fn``, or first thing in a multiprocessing target). The kernel sends the
    signal when the *thread* that forked the child exits: fork from one that outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the prctl
        os.kill(os.getpid(), sig)


class PrivateDaemon:
    """``with PrivateDaemon(pool_bytes=..., backend="cpu") as d: Client(d.run_dir)``.

    The daemon gets SIGTERM when this process dies (enter the ``with`` from a thread that
    stays in it: :func:`die_with_parent`). Its output goes to ``log_path`` when given, else
    only the last lines of its stderr are kept (for a failed start's message)."""

    def __init__(self, *, pool_bytes: int, backend: str = "cpu", extra_args=(), log_path: str | None = None,
                 start_timeout_s: float = 60.0, stop_timeout_s: float | None = None, env: dict | None = None):
        self.pool_bytes = pool_bytes
        self.backend = backend
        self.extra_args = list(extra_args)
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = STOP_TIMEOUT_S.get() if stop_timeout_s is None else stop_timeout_s
        self.env = env
        self.run_dir = ""
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "PrivateDaemon":
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # (a failure: no run dir made)
        self.run_dir = tempfile.mkdtemp(prefix="sparsekv-run-")
        cmd = [sys.executable, "-m", "sparsekv.daemon.main", "--run-dir", self.run_dir, "--backend", self.backend,
               "--pool-size", f"{self.pool_bytes}B", *self.extra_args]
        env = dict(os.environ if self.env is None else self.env)
        env.pop("NOTIFY_SOCKET", None)
        parent = os.getpid()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log if self.log_path else subprocess.PIPE,
                                     env=env, start_new_session=True,
                                     preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM))
        if not self.log_path:
            self._reader = threading.Thread(target=self._read_stderr, args=(self.proc.stderr,), daemon=True,
                                            name="private-sparsekvd-stderr")
            self._reader.start()
        try:
            self._wait_ready()
        except BaseException:  # a failed start, or Ctrl-C / SIGTERM while waiting: stop it, remove the run dir
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        sock = os.path.join(self.run_dir, "control.sock")
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(sock):
            if self.proc.poll() is not None:
                raise DaemonUnavailable(f"private sparsekvd exited with code {self.proc.returncode}: "
                                        + self.stderr_tail())
            if time.monotonic() > deadline:
                raise DaemonUnavailable(f"private sparsekvd did not start within {self.start_timeout_s} s")
            time.sleep(0.02)

    def _read_stderr(self, stream) -> None:
        with stream:
            for line in stream:
                self._tail.append(line.decode(errors="replace").rstrip())

    def stderr_tail(self) -> str:
        """The daemon's last lines on stderr (its warnings and errors, when it logged any),
        joined by " | ", from ``log_path`` when given. Call it once the daemon has exited."""
        if self._reader is not None:
            self._reader.join(timeout=2)
            lines = list(self._tail)
        else:
            try:
                with open(self.log_path, "rb") as fh:
                    fh.seek(max(0, os.fstat(fh.fileno()).st_size - 4096))
                    lines = fh.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
            except OSError:
                lines = []
        lines = [line for line in lines if line.strip()]
        lines = [line for line in lines if " INFO " not in line and " DEBUG " not in line] or lines
        return " | ".join(lines) if lines else "it wrote nothing on stderr"

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                # A daemon that does not stop: its threads' stacks to its log first
                # (SIGUSR2, daemon/main.py), so the hang can be read afterwards.
                sys.stderr.write(f"private sparsekvd (pid {self.proc.pid}) did not stop in "
                                 f"{self.stop_timeout_s} s after SIGTERM: stacks to its log, then SIGKILL\n")
                self.proc.send_signal(signal.SIGUSR2)
                time.sleep(0.5)
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
