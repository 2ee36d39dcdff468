"""``sparsekvd``: the per-node daemon's entry point."""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import signal
import sys

from . import config as config_mod
from .backends import make_backend
from .notify import Notifier
from .pool import HostPool, PoolError

log = logging.getLogger("sparsekv")


def setup_logging(level: str) -> None:
    # journald adds the time; a terminal user wants it.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekvd", description="sparsekv per-node KV-cache daemon")
    config_mod.add_arguments(p)
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    return p


class RunDirLock:
    """An exclusive lock on RUN_DIR/sparsekvd.lock held for the daemon's life: a second
    daemon on the same run dir is refused instead of stealing its sockets."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, mode=0o755, exist_ok=True)
        self.path = os.path.join(run_dir, "sparsekvd.lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise RuntimeError(f"another sparsekvd (pid {other}) serves {run_dir}") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = -1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_mod.load(args)
    except config_mod.ConfigError as e:
        print(f"sparsekvd: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(cfg.to_toml())
        return 0
    setup_logging(cfg.log_level)
    notifier = Notifier()
    try:
        lock = RunDirLock(cfg.run_dir)
    except (RuntimeError, OSError) as e:
        log.error("%s", e)
        return 1
    pool = backend = None
    try:
        notifier.status(f"pre-faulting host pool of {config_mod.format_size(cfg.pool_size)}")

        def progress(frac: float) -> None:
            msg = f"pre-faulting host pool: {frac * 100:.0f}%"
            notifier.status(msg)
            log.debug(msg)

        pool = HostPool(cfg.pool_size, cfg.prefault_threads, progress)
        notifier.status("starting backend")
        backend = make_backend(cfg, pool)
        from .server import Daemon  # noqa: PLC0415 - imports zmq only when serving

        daemon = Daemon(cfg.run_dir, backend, pool, max_clients=cfg.max_clients,
                        reap_interval_s=cfg.reap_interval_s, notifier=notifier,
                        busy_poll_us=cfg.busy_poll_us if cfg.busy_poll_us >= 0
                        else (1000 if backend.name == "cuda" else 0))
        return _run(daemon)
    except (PoolError, RuntimeError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    finally:
        if backend is not None:
            backend.close()
        if pool is not None:
            pool.close()
        lock.release()
        notifier.close()


def _run(daemon) -> int:
    try:
        import uvloop  # noqa: PLC0415

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio works too
        runner = asyncio.run

    async def go():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        await daemon.serve()

    runner(go())
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
