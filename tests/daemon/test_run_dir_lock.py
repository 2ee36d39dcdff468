"""The run dir and its lock (daemon/run_dir_lock.py ``check_run_dir``, ``RunDirLock``): the run dir
must be the daemon's own, the lock is never followed through a link, and a lock file
replaced while it is being locked is not taken (found by an adversarial review); an
operator connection closed without an answer is "busy", not an empty success."""

from __future__ import annotations

import os

import pytest

import fake_stats
from sparsekv.cli.health import READY, StatsSocketError, probe, stats_query
from sparsekv.daemon import run_dir_lock as lock_mod
from sparsekv.daemon.run_dir_lock import RunDirLock


def test_a_lock_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    victim = tmp_path / "victim.conf"
    victim.write_text("secret\n")
    (run / "sparsekvd.lock").symlink_to(victim)
    with pytest.raises(RuntimeError, match="is a symbolic link: refused"):
        RunDirLock(str(run))
    assert victim.read_text() == "secret\n"


def test_a_run_dir_too_long_for_its_sockets_is_refused_before_anything_is_made(tmp_path):
    run = tmp_path / ("x" * 100)
    with pytest.raises(RuntimeError, match=r"too long for its sockets: .* a UNIX socket path at most 107"):
        RunDirLock(str(run))
    assert not run.exists()


def test_a_run_dir_that_is_a_file_or_under_one_is_refused_naming_it(tmp_path):
    """Found by a review: a file as the run dir failed as a bare "[Errno 17] File exists"."""
    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(RuntimeError, match=f"run dir {f} is not a directory"):
        RunDirLock(str(f))
    with pytest.raises(RuntimeError, match=f"run dir {f}/sub cannot be made: Not a directory"):
        RunDirLock(str(f / "sub"))
    assert f.read_text() == ""


def test_a_run_dir_every_user_may_write_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(RuntimeError, match=r"writable by every user \(mode 0777\)"):
        RunDirLock(str(run))
    assert not (run / "sparsekvd.lock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the run dir to another uid")
def test_a_run_dir_of_another_user_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chown(run, 65534, 65534)
    with pytest.raises(RuntimeError, match="belongs to uid 65534"):
        RunDirLock(str(run))


def test_a_lock_file_replaced_while_it_is_being_locked_is_not_taken(tmp_path, monkeypatch):
    """A stopping daemon unlinks its lock; one that opened the old file just before, and
    locks it, must not go on: a third one may hold the new file at the path."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    path = run / "sparsekvd.lock"
    real = lock_mod.fcntl.flock
    third = []

    def flock(fd, op):
        if not third:  # the holder stopped (unlinked) and a third daemon locked a new file
            os.unlink(path)
            fd3 = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            os.write(fd3, b"4242\n")
            real(fd3, lock_mod.fcntl.LOCK_EX | lock_mod.fcntl.LOCK_NB)
            third.append(fd3)
        return real(fd, op)

    monkeypatch.setattr(lock_mod.fcntl, "flock", flock)
    try:
        with pytest.raises(RuntimeError, match=r"another sparsekvd \(pid 4242\)"):
            RunDirLock(str(run))
    finally:
        for fd in third:
            os.close(fd)


def test_an_answer_closed_without_a_word_is_busy_and_the_daemon_alive(tmp_path):
    """The daemon's operator connections all taken: it accepts and closes at once."""
    with fake_stats.fake_stats_socket(str(tmp_path), lambda c: c.close()):
        with pytest.raises(StatsSocketError) as ei:
            stats_query(str(tmp_path), "json", 2.0)
        assert ei.value.kind == "busy" and "without an answer" in str(ei.value)
        assert probe(str(tmp_path), 2.0).code == READY


# The directories a daemon makes are removed at its release, when empty; only those it made
# (found by an adversarial review of that change: races and links could remove others').
def test_a_directory_another_process_made_meanwhile_is_not_removed(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    real = os.mkdir

    def raced(path, mode=0o777):
        if str(path) == str(shared):  # the other process makes it between the look and the mkdir
            real(path)
        return real(path, mode)

    monkeypatch.setattr(lock_mod.os, "mkdir", raced)
    lock = RunDirLock(str(shared / "run"))
    assert [m[0] for m in lock.made] == [str(shared / "run")]
    lock.release()
    assert shared.is_dir() and not (shared / "run").exists()


def test_a_run_dir_whose_link_now_points_elsewhere_is_not_removed(tmp_path):
    for v in ("v1", "v2"):
        (tmp_path / v).mkdir()
    cur = tmp_path / "current"
    cur.symlink_to(tmp_path / "v1")
    lock = RunDirLock(str(cur / "run"))
    (tmp_path / "v2" / "run").mkdir()
    cur.unlink()
    cur.symlink_to(tmp_path / "v2")  # repointed while the daemon runs
    lock.release()
    assert (tmp_path / "v2" / "run").is_dir()  # not the one it made: it stays


def test_a_run_dir_removed_by_a_daemon_stopping_is_made_again_by_one_starting(tmp_path, monkeypatch):
    run = tmp_path / "run"
    first = RunDirLock(str(run))
    real_open = os.open
    state = {"stopped": False}

    def open_after_the_other_stops(path, *a, **kw):
        if not state["stopped"]:  # the first daemon releases between the second's look and its open
            state["stopped"] = True
            first.release()
        return real_open(path, *a, **kw)

    monkeypatch.setattr(lock_mod.os, "open", open_after_the_other_stops)
    second = RunDirLock(str(run))
    assert [m[0] for m in second.made] == [str(run)]  # made again, now the second one's
    assert (run / "sparsekvd.lock").is_file()
    second.release()
    assert not run.exists()


def test_the_sockets_a_killed_daemon_left_go_when_the_next_takes_the_lock(tmp_path):
    """Found by an adversarial review: a daemon stopped while pre-faulting left the sockets
    of the one killed before it (they went only once a daemon served), and a client read
    a stale control.sock.busy as a daemon short of descriptors. Taking the lock removes
    them; a file that is no socket is not the lock's to remove."""
    import socket

    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    for name in ("control.sock.busy", "stats.sock", "fds.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(run / name))
        s.close()
    (run / "notes").write_text("an operator's\n")
    lock = RunDirLock(str(run))
    try:
        assert sorted(os.listdir(run)) == ["notes", "sparsekvd.lock"]
    finally:
        lock.release()
    assert os.listdir(run) == ["notes"]
