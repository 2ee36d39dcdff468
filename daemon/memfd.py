"""Host shared memory with no name: memfds (a rank's cpu slab, a cuda rank's pinned step
blocks), and the files an older daemon of the same run dir left in ``shm_dir``."""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import os

log = logging.getLogger("sparsekv.backend")


def run_dir_tag(run_dir: str) -> str:
    """Short stable tag of a run dir, so two daemons never touch each other's files."""
    return hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:10]


def remove_stale(prefix: str) -> None:
    """Remove files ``prefix*`` left by a daemon of this run dir that died (an older
    version); the caller made sure no daemon serves this run dir."""
    for stale in glob.glob(prefix + "*"):
        log.warning("removing stale shared-memory file %s", stale)
        try:
            os.unlink(stale)
        except OSError:
            pass


_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def new_memfd(name: str, nbytes: int) -> int:
    """A memfd of ``nbytes`` (close-on-exec) whose pages are reserved now (``OSError`` here,
    not SIGBUS later), sealed against any change of size (a client cannot shrink it)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
