"""``sparsekvd``: the per-node daemon's entry point.

Start: configuration, run-dir lock, a check that the backend can start at all (before
minutes of pre-faulting), the pool, the backend, then serving. SIGTERM/SIGINT stop
cleanly at any point (during the pre-fault too); SIGHUP (settings are read at start
only) and SIGUSR1 are logged and ignored; SIGUSR2 writes every thread's stack to the log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import grp
import logging
import os
import resource
import signal
import sys
import time

import uvloop

from sparsekv.proto.cpus import CpuWarmer, format_cpu_list, keep_off
from sparsekv.proto.settings import format_size

from . import config as config_mod
from . import start_checks
from .backends import cuda_unavailable, make_backend
from .notify import Notifier
from .pinned import PinError, PoolPinner
from .pool import ALIGN_BYTES, HostPool, PoolError
from .run_dir_lock import RunDirLock, SettingRefused
from .server import Daemon
from .store_room import StoreRoom
from .stats import package_version

log = logging.getLogger("sparsekv")

# The daemon's CUDA environment, set by main() before CUDA starts (never at import: it
# would pass to every CUDA process an importer starts). The environment's own setting wins.
CUDA_ENV = {
    # Hardware work queues (8 by default, 32 at most): a doorbell rank's stream waits while
    # its engine computes, and a stream sharing its queue would wait behind it (under MPS:
    # deploy/README.md).
    "CUDA_DEVICE_MAX_CONNECTIONS": "32",
    # Kernels load with their module, not at first launch: lazy loading is documented to
    # wait for work in flight, such as a doorbell stream parked on its bell.
    "CUDA_MODULE_LOADING": "EAGER",
}


def set_cuda_environment() -> None:
    for key, value in CUDA_ENV.items():
        os.environ.setdefault(key, value)


# Asked of systemd (EXTEND_TIMEOUT_USEC) at each pre-fault progress report, about once a
# second: a start that keeps moving is never killed by TimeoutStartSec=, a stuck one is.
START_EXTEND_S = 60.0
PROGRESS_LOG_INTERVAL_S = 5.0  # pre-fault progress lines in the log (STATUS= gets every one)
MIN_OPEN_FILES = 4096  # below this the daemon warns: every client connection takes two (its socket, a pidfd)


def log_open_files_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one, and log the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    now = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= now:
        now = soft
    else:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (now, hard))
        except (ValueError, OSError):  # a hard limit above fs.nr_open: keep what we have
            now = soft
    if now != soft:
        log.info("open files: soft limit raised from %d to %d (the hard limit)", soft, now)
    else:
        log.info("open files: soft limit %d (hard %d)", now, hard)
    if now < MIN_OPEN_FILES:
        log.warning("open files: the limit %d is low: each client connection takes two (its socket and a pidfd), "
                    "and new connections are held off near the limit; raise LimitNOFILE= (the unit sets 65536) or ulimit -Hn to at least %d",
                    now, MIN_OPEN_FILES)


# -- logging ------------------------------------------------------------------------------
_SYSLOG_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


def _syslog_priority(levelno: int) -> int:
    return next((prio for level, prio in _SYSLOG_PRIORITIES if levelno >= level), 7)


class JournalFormatter(logging.Formatter):
    """sd-daemon(3) style for journald: every line (journald makes one entry per line)
    starts with ``<N>``, its syslog priority, and carries no time (journald adds it)."""

    def __init__(self):
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


class UtcFormatter(logging.Formatter):
    """For terminals and files: an ISO 8601 UTC time first (``2025-01-31T12:00:00.123Z``)."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt=None) -> str:  # noqa: N802 - logging's name
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def on_journald(stream, environ=None) -> bool:
    """True when ``$JOURNAL_STREAM`` ("dev:inode") names the very file ``stream`` writes
    to (a child whose stderr was redirected inherits the variable, not the stream)."""
    environ = os.environ if environ is None else environ
    dev, _, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, AttributeError, ValueError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


def log_handler(stream=None, environ=None) -> logging.Handler:
    """A stderr handler with the journald or the timestamped format, whichever fits."""
    stream = sys.stderr if stream is None else stream
    h = logging.StreamHandler(stream)
    h.setFormatter(JournalFormatter() if on_journald(stream, environ) else UtcFormatter())
    return h


def setup_logging(level: str) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_sparsekvd", False):
            root.removeHandler(h)
    h = log_handler()
    h._sparsekvd = True
    root.addHandler(h)
    root.setLevel(getattr(logging, level.upper()))


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: "--pool-s" would take another meaning, or none, once a setting is added.
    p = argparse.ArgumentParser(prog="sparsekvd", description="sparsekv per-node KV-cache daemon. Settings: "
                                "defaults < TOML file < SPARSEKV_<NAME> environment < these flags.",
                                allow_abbrev=False)
    config_mod.add_arguments(p)
    p.add_argument("--print-config", action="store_true",
                   help="print the effective settings as TOML, each with where it came from "
                   "(default / file / env / flag), run the start's checks that make nothing, and exit: 0, or the "
                   "start's exit code with each refusal on stderr")
    p.add_argument("--version", action="version", version=f"sparsekvd {package_version()}",
                   help="print the version and exit")
    return p


class _Interrupted(BaseException):
    """SIGTERM/SIGINT during start. A BaseException, like KeyboardInterrupt: no
    ``except Exception`` on the way may swallow it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StartSignals:
    """Signal handling until the event loop takes over (a context manager). SIGTERM/SIGINT
    raise :class:`_Interrupted` at once inside :meth:`interruptible` (the pool's
    pre-fault), elsewhere at the next :meth:`check`. SIGHUP is logged and ignored (SIGUSR1
    too, by the handler ``main`` set before)."""

    def __init__(self):
        self.requested: int | None = None
        self._interruptible = False
        self._saved: dict[int, object] = {}

    def __enter__(self) -> "StartSignals":
        for sig, fn in ((signal.SIGTERM, self._on_stop), (signal.SIGINT, self._on_stop), (signal.SIGHUP, self._on_hup)):
            self._saved[sig] = signal.signal(sig, fn)
        return self

    def __exit__(self, *exc) -> None:
        for sig, fn in self._saved.items():
            signal.signal(sig, fn)
        self._saved.clear()

    def _on_stop(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = signum
            log.info("%s during start: stopping", signal.Signals(signum).name)
        if self._interruptible:
            self._interruptible = False  # once: never inside the clean-up that follows
            raise _Interrupted(signum)

    def _on_hup(self, signum, frame) -> None:
        log_ignored(signal.SIGHUP)

    @contextlib.contextmanager
    def interruptible(self):
        self.check()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def check(self) -> None:
        if self.requested is not None:
            raise _Interrupted(self.requested)


def log_ignored(sig: signal.Signals) -> None:
    """SIGHUP and SIGUSR1 (whose default would kill the daemon without its clean-up)."""
    if sig == signal.SIGHUP:
        log.warning("SIGHUP ignored: settings are read only at start (restart sparsekvd to change them); "
                    "logs go to stderr, nothing to reopen")
    else:
        log.warning("%s ignored (SIGUSR2 writes every thread's stack to the log; SIGTERM stops)", sig.name)


def pool_pinner(cfg):
    """A :class:`~sparsekv.daemon.pinned.PoolPinner` for the pool when the cuda backend will
    serve it, as ``pin_pool_at_start`` says: ``1`` chunk by chunk while it is pre-faulted,
    ``after`` once it is; ``0``: None (each engine's range is page-locked at its attach)."""
    if cfg.pin_pool_at_start == "0" or cfg.backend not in ("auto", "cuda") or cuda_unavailable() is not None:
        return None
    return PoolPinner(cfg.pool_size, max_chunk_bytes=cfg.pin_chunk_bytes, while_faulting=cfg.pin_pool_at_start == "1")


def _group_exists(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
    except KeyError:
        return False
    return True


def join_dashed_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--pool-size -1GiB`` as ``--pool-size=-1GiB``: argparse reads a value that starts with
    ``-`` and a digit as a flag ("expected one argument"); joined, the setting's own check
    names what is wrong with it."""
    takes_value = {s for a in parser._actions if a.option_strings and a.nargs is None and a.const is None
                   for s in a.option_strings}
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in takes_value and len(arg) > 1 and arg[0] == "-" and (arg[1].isdigit() or arg[1] == "."):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_dashed_values(parser, list(sys.argv[1:] if argv is None else argv)))
    try:
        cfg, sources = config_mod.load_with_sources(args)
    except config_mod.ConfigError as e:
        print(f"sparsekvd: {e}", file=sys.stderr)
        return 2
    if cfg.backend != "cpu":
        set_cuda_environment()  # before anything asks CUDA about devices
    if args.print_config:
        sys.stdout.write(cfg.to_toml(sources) + "".join(f"# {line}\n" for line in config_mod.unknown_env()))
        return start_checks.would_start(cfg, sources)
    setup_logging(cfg.log_level)
    refusals = start_checks.settings_refusals(cfg, sources)  # (would_start's order: settings, backend, lock, port, RAM)
    if refusals:
        for why in refusals:
            log.error("cannot start: %s", why)
        return 2
    # Its default would kill the daemon without its clean-up; StartSignals and the loop keep it so.
    signal.signal(signal.SIGUSR1, lambda signum, frame: log_ignored(signal.SIGUSR1))
    for line in config_mod.unknown_env():
        log.warning("%s", line)
    for line in config_mod.moot_settings(cfg, sources):
        log.warning("%s", line)
    if cfg.admin_gid >= 0 and not _group_exists(cfg.admin_gid):
        log.warning("admin_gid %d (%s) names no group on this host: no client is an admin through it",
                    cfg.admin_gid, sources.get("admin_gid", "default"))
    log_open_files_limit()
    refusal = start_checks.backend_refusal(cfg, sources)
    if refusal is not None:
        log.error("cannot start: %s", refusal[0])
        return refusal[1]
    notifier = Notifier()
    with StartSignals() as signals:
        try:
            lock = RunDirLock(cfg.run_dir)
        except (RuntimeError, OSError) as e:
            log.error("cannot start: %s (run_dir: %s)", e, sources.get("run_dir", "default"))
            return 2 if isinstance(e, SettingRefused) else 1
        refusal = start_checks.metrics_port_refusal(cfg, sources)  # after the lock: a second daemon is told so first
        if refusal is None and (why := start_checks.pool_room_refusal(cfg, sources)) is not None:
            refusal = (why, 1)
        if refusal is not None:
            log.error("cannot start: %s", refusal[0])
            lock.release()
            return refusal[1]
        pool = backend = pool_region = pinner = warmer = None
        try:
            warmer, io_cpus = place_io(cfg, sources)
            size = format_size(cfg.pool_size)
            if tail := cfg.pool_size % ALIGN_BYTES:  # engine ranges are whole 2 MiB pieces of it
                log.warning("pool_size %s (%s) is not a multiple of %s: its last %s never hold an engine's range",
                            size, sources.get("pool_size", "default"), format_size(ALIGN_BYTES), format_size(tail))
            log.info("sparsekvd %s (pid %d) on %s: pre-faulting host pool of %s", package_version(), os.getpid(),
                     cfg.run_dir, size)
            notifier.extend_timeout(START_EXTEND_S, status=f"pre-faulting host pool of {size}")
            last_log = [time.monotonic()]
            pinner = pool_pinner(cfg)
            doing = "pre-faulting and page-locking" if pinner is not None and pinner.while_faulting else "pre-faulting"

            def progress(frac: float) -> None:
                msg = f"{doing} host pool of {size}: {frac * 100:.0f}%"
                notifier.extend_timeout(START_EXTEND_S, status=msg)
                now = time.monotonic()
                if now - last_log[0] >= PROGRESS_LOG_INTERVAL_S and frac < 1.0:  # the pool logs its end
                    last_log[0] = now
                    log.info("%s", msg)

            with signals.interruptible():
                pool = HostPool(cfg.pool_size, cfg.prefault_threads, progress, on_faulted=pinner,
                                backing=cfg.pool_backing)
            signals.check()
            if pinner is not None:
                t0 = time.monotonic()

                def locked(frac: float) -> None:
                    notifier.extend_timeout(START_EXTEND_S,
                                            status=f"page-locking host pool of {size}: {frac * 100:.0f}%")

                with signals.interruptible():
                    pool_region = pinner.finish(locked)
                signals.check()
                log.info("host pool of %s page-locked for the GPUs (%d chunks, %.2f s in cudaHostRegister; "
                         "%.2f s after the pre-fault)", size, len(pool_region.chunks), pool_region.register_s,
                         time.monotonic() - t0)
            if io_cpus:
                keep_off(io_cpus)  # the backend's threads: off the loop's CPUs (serve() moves the loop there)
            notifier.extend_timeout(START_EXTEND_S, status="starting backend")
            backend = make_backend(cfg, pool, pool_region)
            signals.check()
            if backend.name == "cpu" and (ignored := config_mod.cuda_settings_ignored(sources)):
                log.warning("%s", ignored)
            busy_poll_us = cfg.busy_poll_us if cfg.busy_poll_us >= 0 else (1000 if backend.name == "cuda" else 0)
            daemon = Daemon(cfg.run_dir, backend, pool, max_clients=cfg.max_clients,
                            reap_interval_s=cfg.reap_interval_s, notifier=notifier, busy_poll_us=busy_poll_us,
                            metrics_port=cfg.metrics_port, admin_gid=cfg.admin_gid if cfg.admin_gid >= 0 else None,
                            max_clients_per_uid=cfg.uid_client_cap,
                            max_pool_bytes_per_uid=cfg.max_pool_bytes_per_uid,
                            max_blocks_per_uid=cfg.max_blocks_per_uid, max_rank_bytes_per_uid=cfg.uid_slab_cap,
                            max_connections_per_uid=cfg.uid_connection_cap, hello_timeout_s=cfg.hello_timeout_s,
                            idle_timeout_s=cfg.idle_timeout_s, inflight_bytes=cfg.inflight_bytes,
                            io_cpus=io_cpus, warmer=warmer)
            daemon.engine_requests.max_slab_bytes = cfg.max_slab_bytes
            daemon.engine_requests.tp_max_lag = cfg.tp_max_lag
            daemon.engines.tp_ledger.cap = cfg.tp_max_lag_bytes
            daemon.engines.store_room = StoreRoom(cfg.max_store_bytes, cfg.max_store_share_per_uid)
            return _run(daemon, signals)
        except _Interrupted:
            notifier.stopping()
            log.info("stopped before serving")
            return 0
        except (PoolError, PinError, RuntimeError, OSError, ValueError) as e:
            log.error("cannot start: %s", e)
            return 2 if isinstance(e, SettingRefused) else 1
        finally:
            # Each step by itself: after a fatal error (a lost GPU context) one may fail,
            # and the exit code must still say why the daemon stopped, not this.
            if pool_region is None and pinner is not None:
                pool_region = pinner.region  # a start stopped while the pool was registered
            for what, part in (("backend", backend), ("pool's page-locking", pool_region), ("pool", pool),
                               ("warm CPU loops", warmer)):
                if part is None:
                    continue
                if part is pool_region and backend is not None and not backend.may_free_pinned():
                    continue  # cudaHostUnregister would wait for a stream that did not drain
                try:
                    part.close()
                except Exception:  # noqa: BLE001
                    log.exception("closing the %s failed", what)
            lock.release()
            notifier.close()


def place_io(cfg, sources: dict) -> tuple:
    """The daemon's ``io_cpus`` (checked against the CPUs it may run on) and its warm CPU
    loops, started (proto/cpus.py). SettingRefused naming what is wrong and where the
    setting came from."""
    io_cpus, warm, quota = start_checks.check_cpu_lists(cfg, sources)
    warmer = None
    if quota is not None:
        log.warning("warm_cpus: the %d loops spend %d of the %g CPUs of run time this cgroup's cpu.max allows; "
                    "raise the CPU limit by as many CPUs", len(warm), len(warm), quota)
    if warm:
        warmer = CpuWarmer(warm).start()
        log.info("CPU(s) %s kept warm: an idle-priority busy loop each (pids %s)", format_cpu_list(warm),
                 " ".join(map(str, warmer.pids)))
    if warm and os.sched_getaffinity(0) <= set(warm):
        log.warning("warm_cpus %s covers every CPU this daemon may run on: every one of them spins",
                    format_cpu_list(warm))
    if io_cpus:
        cold = sorted(set(io_cpus) - set(warm))
        log.log(logging.WARNING if cold and warm else logging.INFO, "the loop thread (control socket) on CPU(s) %s%s",
                format_cpu_list(io_cpus),
                f"; {format_cpu_list(cold)} not in warm_cpus (a halted CPU is slow to wake in a VM)" if cold else "")
    return warmer, io_cpus


GIL_SWITCH_S = 0.0005


def _run(daemon, signals: StartSignals) -> int:
    def stop(sig: signal.Signals) -> None:
        log.info("%s: stopping", sig.name)
        daemon.stop()

    # The loop serves every client: while a worker thread runs Python (a heavy request) the
    # loop waits for the GIL at most this long, not 5 ms.
    sys.setswitchinterval(GIL_SWITCH_S)

    async def go():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop, sig)
        for sig in (signal.SIGHUP, signal.SIGUSR1):
            loop.add_signal_handler(sig, log_ignored, sig)
        # `kill -USR2 <pid>`: every thread's stack to stderr (the journal), for a stuck daemon.
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        if signals.requested is not None:  # arrived between the last check and the handlers above
            daemon.stop()
        await daemon.serve()

    uvloop.run(go())
    if daemon.exit_code:
        log.critical("stopped: exit code %d", daemon.exit_code)
        return daemon.exit_code
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
