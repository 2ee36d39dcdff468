"""The client's session over its own ZMTP connection, against a real daemon: a request cut
half way by an exception (Ctrl-C, a signal handler's) ends the session at once and writes
no wrong row; a forked child may not use (nor end) its parent's session; a header over the
limit is refused before it is sent; a Pending's error reply is raised by every wait; a daemon
killed while a large WRITE waits for room is noticed within seconds."""

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

import helpers
from sparsekv.client import BadRequest, Client, DaemonUnavailable, SparseKVError
from sparsekv.proto import LIMITS, ErrorCode
from test_liveness import run_dir, start, stop  # noqa: F401 - the fixture


class Cutting:
    """A socket whose next ``sendmsg`` of a message stops (KeyboardInterrupt) ``left``
    bytes before its end, as a signal handler's exception would."""

    def __init__(self, sock, left: int):
        self.sock, self.left, self.armed = sock, left, True

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def sendmsg(self, bufs):
        total = sum(len(b) for b in bufs)
        if not self.armed:
            return self.sock.sendmsg(bufs)
        if total <= self.left:
            self.armed = False
            raise KeyboardInterrupt
        return self.sock.sendmsg([b"".join(bytes(b) for b in bufs)[:total - self.left]])


def test_a_write_cut_by_an_exception_ends_the_session_and_writes_no_wrong_row(run_dir):  # noqa: F811
    p = start(run_dir)
    try:
        lay = helpers.layout(host_rows=64, row_bytes=32, index_groups=((0, 1),))
        with Client(run_dir, timeout_s=5) as other:
            other.attach(lay)
            helpers.fill(other, lay)
            c = Client(run_dir, timeout_s=5).connect()
            c.attach(lay)
            c._sock.sock = Cutting(c._sock.sock, 20)  # the last 20 bytes of the next message stay unsent
            rows = np.arange(8, dtype=np.int32)
            with pytest.raises(KeyboardInterrupt):
                c.write(rows, np.zeros((lay.num_layers, 8, 32), np.uint8))
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable, match="cut short by KeyboardInterrupt while being sent.*create a new"):
                c.stats()  # not written after the cut: the daemon would take it for the WRITE's last bytes
            assert time.monotonic() - t0 < 2.0  # (not the 5 s timeout)
            c.close()
            other.step(0, [0])
            r = other.topk(0, 0, [[0, 1, 6, 7]])
            assert helpers.bad_rows(other.attachment.slab, range(lay.num_layers), np.array([0]),
                                    np.array([[0, 1, 6, 7]]), r.slots, 64) == 0
            helpers.wait_for(lambda: other.stats()["clients"] == 1, 5, what="the cut client's session to end")
    finally:
        stop(p)


@contextlib.contextmanager
def a_pending_topk(run_dir):
    """A daemon, a client attached to it and a TOPK of step 0 not waited for; the daemon
    stopped at the end."""
    p = start(run_dir)
    try:
        c = Client(run_dir, timeout_s=5).connect()
        c.attach(helpers.layout())
        c.step(0, [0])
        yield c, c.submit_topk(0, 0, [[1, 2, 3, 4]])
    finally:
        stop(p)


def test_a_forked_child_cannot_use_or_end_its_parents_session(run_dir):  # noqa: F811
    """A child forked from a process with a Client shares its connection: a request of the
    child's would mix with the parent's on the stream, its close() would say goodbye for
    the parent. The child is refused, and its close() leaves the parent's session alone."""
    with a_pending_topk(run_dir) as (c, pending):
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            for request in (c.stats, pending.wait, c.flush):  # a request, a read of the parent's reply, a flush
                try:
                    request()
                    code |= 1
                except SparseKVError as e:
                    code |= 0 if "forked child must create a Client" in str(e) and e.code.name == "NOT_HELLO" else 2
                except BaseException:  # noqa: BLE001 - reported by the exit code
                    code |= 4
            c.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert pending.wait().slots.shape == (1, 4)
        assert c.stats()["attached"] == 1
        c.close()


def test_a_header_over_the_limit_is_refused_here_not_left_to_time_out(run_dir):  # noqa: F811
    """The daemon drops a header over ``max_header_bytes`` unread: its answer cannot name the
    request, which would wait ``timeout_s`` for a reply and blame the daemon."""
    p = start(run_dir)
    try:
        t0 = time.monotonic()
        with pytest.raises(BadRequest, match="TOO_LARGE: a request header of .* bytes exceeds"):
            c = Client(run_dir, timeout_s=5)
            c.name = "x" * LIMITS.max_header_bytes  # past the client's own check of the name
            c.connect()
        assert time.monotonic() - t0 < 1.0
        with Client(run_dir, timeout_s=5) as c:
            assert c.stats()["clients"] == 1
    finally:
        stop(p)


def test_a_pending_whose_reply_was_an_error_raises_it_again(run_dir):  # noqa: F811
    """Its reply is read once: a second ``wait()`` must not wait ``timeout_s`` for another
    and blame the daemon."""
    p = start(run_dir)
    try:
        with Client(run_dir, timeout_s=5) as c:
            c.attach(helpers.layout())
            c.step(0, [0])
            pending = c.submit_topk(0, 0, [[1, 1, 2, 3]])
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(BadRequest, match="DUPLICATE_IDS"):
                    pending.wait()
                assert time.monotonic() - t0 < 2.0  # (not the 5 s timeout)
            c.step(1, [0])
            assert c.topk(1, 0, [[1, 2, 3, 4]]).slots.shape == (1, 4)
    finally:
        stop(p)


def test_a_daemon_killed_while_a_write_waits_for_room_is_noticed_within_seconds(run_dir):  # noqa: F811
    """Stopped, its socket full under a large WRITE, then killed: the send's liveness checks
    say it is gone (it never reads the rest), and close() returns at once."""
    p = start(run_dir, "--pool-size", "64MiB")
    try:
        lay = helpers.layout(host_rows=1024, row_bytes=4096)
        c = Client(run_dir, timeout_s=30).connect()
        c.attach(lay)
        os.kill(p.pid, signal.SIGSTOP)
        threading.Timer(0.3, os.kill, (p.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match=f"sparsekvd is gone \\(pid {p.pid} exited\\)"):
            c.write(np.arange(1024, dtype=np.int32), np.zeros((lay.num_layers, 1024, 4096), np.uint8))  # 8 MiB
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        c.close()
        assert time.monotonic() - t0 < 0.2
    finally:
        stop(p)


def test_a_client_not_connected_says_so_with_a_code_of_its_own(tmp_path):
    """Found by an integrator's review: it raised the base error with INTERNAL ("the daemon
    hit a bug; see its log"), before and after close()."""
    c = Client(str(tmp_path))
    with pytest.raises(SparseKVError, match="client is not connected; call connect") as e:
        c.stats()
    assert e.value.code == ErrorCode.NOT_HELLO


def test_a_pending_request_of_a_closed_client_says_the_client_is_closed(run_dir):  # noqa: F811
    """Found by a review: it raised DaemonUnavailable (INTERNAL), the daemon serving on."""
    with a_pending_topk(run_dir) as (c, pending):
        c.close()
        with pytest.raises(SparseKVError, match=r"client is not connected \(closed since the request was made\)") as e:
            pending.wait()
        assert e.value.code == ErrorCode.NOT_HELLO and not isinstance(e.value, DaemonUnavailable)
