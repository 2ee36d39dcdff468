"""The daemon's run dir, taken at start: checked to be the daemon's own, made when it is
missing (and removed again when empty at release), and locked for the daemon's life
(``sparsekvd.lock``) so that a second daemon on it is refused; and :class:`SettingRefused`,
the start refusals no restart changes (exit code 2)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from sparsekv.proto.run_dir import lock_holder

UNIX_PATH_MAX = 107  # bytes of a UNIX socket's path (sun_path's 108, its NUL included)
# The sockets the daemon binds in its run dir (and the names it binds them under first).
SOCKET_NAMES = ("control.sock", "control.sock.new", "control.sock.busy", "stats.sock", "fds.sock", "fds.sock.new")


class SettingRefused(RuntimeError):
    """A start refused for a setting that no restart would change (a run dir that is a
    file, CPUs this process may not use, a pool larger than the machine's RAM): exit code
    2, which the systemd unit does not restart. Other refusals exit 1 and are retried."""


def check_run_dir(run_dir: str) -> None:
    """The run dir must be the daemon's own: a directory owned by its user (or root) that
    others cannot write to, or another user could plant its lock as a link or replace its
    sockets (SettingRefused naming what is wrong)."""
    st = os.stat(run_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise SettingRefused(f"run dir {run_dir} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise SettingRefused(f"run dir {run_dir} belongs to uid {st.st_uid}, not to this daemon's user "
                           f"({os.geteuid()}) or root: use a directory of the daemon's own")
    if st.st_mode & stat.S_IWOTH:
        raise SettingRefused(f"run dir {run_dir} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o}): "
                           "another user could replace its sockets; use a directory of the daemon's own (chmod o-w)")
    if not os.access(run_dir, os.W_OK | os.X_OK):  # (before minutes of pre-faulting, not at the sockets' bind)
        raise SettingRefused(f"run dir {run_dir} is not writable by this daemon's user")
    for name in SOCKET_NAMES:  # a daemon's own left ones are replaced; anything else is not its to remove
        path = os.path.join(run_dir, name)
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SettingRefused(f"{path} is not a socket a daemon left: remove it (the daemon binds a socket there)")


def _path_refusal(run_dir: str) -> str | None:
    """What is wrong with ``run_dir``'s path itself: too long for its sockets, or not a
    directory (a setting either way); None when nothing."""
    longest = os.path.join(os.path.abspath(run_dir), "control.sock.busy")
    if len(os.fsencode(longest)) > UNIX_PATH_MAX:
        return (f"run dir {run_dir} is too long for its sockets: {longest} has {len(os.fsencode(longest))} bytes, "
                f"a UNIX socket path at most {UNIX_PATH_MAX}")
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        return f"run dir {run_dir} is not a directory"
    return None


def run_dir_refusal(run_dir: str) -> tuple[str, int] | None:
    """What :class:`RunDirLock` would refuse in ``run_dir`` as it is now, and the start's
    exit code (2: a setting; 1: may pass later), without making or locking anything
    (``--print-config``); None when nothing is seen."""
    if (why := _path_refusal(run_dir)) is not None:
        return why, 2
    d = os.path.abspath(run_dir)
    while not os.path.lexists(d):
        d = os.path.dirname(d)
    if d != os.path.abspath(run_dir):  # made at start, under d (RunDirLock._make's codes)
        if os.path.isdir(d):
            return None if os.access(d, os.W_OK | os.X_OK) else (f"run dir {run_dir} cannot be made: {d} is not "
                                                                  "writable by this user", 1)
        if os.path.islink(d) and not os.path.exists(d):
            return f"run dir {run_dir} cannot be made: {d} is a link to nothing", 1
        return f"run dir {run_dir} cannot be made: {d} is not a directory", 2
    try:
        check_run_dir(run_dir)
    except SettingRefused as e:
        return str(e), 2
    lock = os.path.join(run_dir, "sparsekvd.lock")
    if os.path.islink(lock):
        return f"{lock} is a symbolic link: refused", 2
    if os.path.lexists(lock):
        st = os.lstat(lock)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return f"{lock} is not a regular file of this daemon's user: refused", 2
        pid = lock_holder(run_dir)
        if pid is not None:
            return f"another sparsekvd (pid {pid or '?'}) holds {run_dir} (serving it, or starting)", 1
    return None


class RunDirLock:
    """An exclusive lock on RUN_DIR/sparsekvd.lock held for the daemon's life: a second
    daemon on the same run dir is refused instead of stealing its sockets. The lock is a
    regular file of the daemon's user, never followed through a link; the file locked is
    the one at the path (a daemon stopping unlinks it: one that opened it just before
    locks the next file instead)."""

    def __init__(self, run_dir: str):
        if (why := _path_refusal(run_dir)) is not None:
            raise SettingRefused(why)
        # The directories this daemon made (path, device, inode; deepest first), removed again
        # at release when empty and still the ones it made: a refused start leaves none behind.
        self.made: list[tuple[str, int, int]] = []
        self._make(run_dir)
        self.path = os.path.join(run_dir, "sparsekvd.lock")
        for _ in range(8):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except FileNotFoundError:  # a daemon stopping removed the run dir it had made: make it again
                self._make(run_dir)
                continue
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise SettingRefused(f"{self.path} is a symbolic link: refused") from None
                if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # (an immutable or read-only dir)
                    raise SettingRefused(f"cannot make its lock file {self.path}: {e.strerror}: the run dir must be "
                                         "writable by the daemon's user") from None
                if e.errno == errno.EISDIR:
                    raise SettingRefused(f"{self.path} is not a regular file of this daemon's user: refused") from None
                raise
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                os.close(fd)
                raise SettingRefused(f"{self.path} is not a regular file of this daemon's user: refused")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise RuntimeError(f"another sparsekvd (pid {other}) holds {run_dir} (serving it, or starting)") \
                    from None
            try:
                now = os.lstat(self.path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                break
            os.close(fd)  # unlinked by the daemon that held it since we opened it: lock the next one
        else:
            raise RuntimeError(f"could not lock {self.path}: it was replaced 8 times while locking")
        self.fd = fd
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        # The sockets a daemon killed on this run dir left go now, not once this one serves:
        # meanwhile a client finds none and says this one is starting (a stale .busy had
        # it say "short of descriptors"), and a stop before serving leaves the dir clean.
        for name in SOCKET_NAMES:
            path = os.path.join(run_dir, name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):  # (anything else: check_run_dir refuses it)
                    os.unlink(path)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        if self.fd >= 0:
            try:
                os.unlink(self.path)
            except OSError:  # gone already, or a run dir made read-only meanwhile: the lock ends with the fd
                pass
            os.close(self.fd)
            self.fd = -1
            for d, dev, ino in self.made:
                try:
                    st = os.lstat(d)
                    if (st.st_dev, st.st_ino) != (dev, ino):  # not the one it made (a link in the path moved)
                        break
                    os.rmdir(d)
                except OSError:  # something in it (a client's file, a socket left): it stays
                    break

    def _make(self, run_dir: str) -> None:
        """Make the run dir's missing directories, each counted as this daemon's only when its
        own ``mkdir`` made it (another process may make one at the same time), then check it."""
        missing = []
        d = os.path.abspath(run_dir)
        while not os.path.lexists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                continue
            except OSError as e:  # under a file: no restart makes it (a permission may come with a mount)
                raise (SettingRefused if e.errno == errno.ENOTDIR else RuntimeError)(
                    f"run dir {run_dir} cannot be made: {e.strerror}") from None
            st = os.lstat(d)
            self.made.insert(0, (d, st.st_dev, st.st_ino))
        check_run_dir(run_dir)
