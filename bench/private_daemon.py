"""Start a private sparsekvd for one command (replay, demo, tests) and stop it after."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from sparsekv.client.errors import DaemonUnavailable
from sparsekv.proto.settings import STOP_TIMEOUT_S


class PrivateDaemon:
    """``with PrivateDaemon(pool_bytes=..., backend="cpu") as d: Client(d.run_dir)``."""

    def __init__(self, *, pool_bytes: int, backend: str = "cpu", extra_args=(), log_path: str | None = None,
                 start_timeout_s: float = 60.0, stop_timeout_s: float | None = None, env: dict | None = None):
        self.pool_bytes = pool_bytes
        self.backend = backend
        self.extra_args = list(extra_args)
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        if stop_timeout_s is None:
            stop_timeout_s = STOP_TIMEOUT_S.get()
        self.stop_timeout_s = stop_timeout_s
        self.env = env
        self.run_dir = ""
        self.proc: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> "PrivateDaemon":
        self.run_dir = tempfile.mkdtemp(prefix="sparsekv-run-")
        cmd = [sys.executable, "-m", "sparsekv.daemon.main", "--run-dir", self.run_dir, "--backend", self.backend,
               "--pool-size", f"{self.pool_bytes}B", *self.extra_args]
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ if self.env is None else self.env)
        env.pop("NOTIFY_SOCKET", None)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log, env=env, start_new_session=True)
        sock = os.path.join(self.run_dir, "control.sock")
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(sock):
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise DaemonUnavailable(f"private sparsekvd exited with code {self.proc.returncode}"
                                        + (f"; see {self.log_path}" if self.log_path else ""))
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise DaemonUnavailable(f"private sparsekvd did not start within {self.start_timeout_s} s")
            time.sleep(0.02)
        return self

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
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
