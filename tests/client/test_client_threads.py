"""A Client serves one thread at a time (client/connection.py ``_turn``): a request from a
second thread while another thread's is being sent or waited for is refused at once,
typed, before anything is sent; a Client handed over between requests works."""

import contextlib
import threading

import pytest

from sparsekv.client import BadRequest, Client, ClientInUse
from sparsekv.proto import ErrorCode


@contextlib.contextmanager
def turn_held_elsewhere(c: Client):
    """Another thread holds ``c``'s turn (as a request in flight does: its send and its
    wait) for the body, then lets it go."""
    held, done = threading.Event(), threading.Event()

    def hold():
        with c._turn():
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10)
        yield
    finally:
        done.set()
        t.join(10)


def test_a_second_thread_is_refused_while_one_thread_has_its_turn(module_daemon):
    """Found by an adversarial review: four threads' lookups and releases on one Client
    raised RuntimeError from the socket's poll (untyped), and a lookup whose reply its
    thread never read left its blocks pinned."""
    with Client(module_daemon.run_dir, name="threads", timeout_s=10) as c:
        with turn_held_elsewhere(c):
            sent = c._next_id
            with pytest.raises(BadRequest, match="in use by another thread") as e:
                c.stats()
            assert e.value.code == ErrorCode.BAD_ARGUMENT
            assert c._next_id == sent  # refused before anything went out
        assert c.stats()["clients"] >= 1  # its turn over: served


def test_close_from_another_thread_during_a_request_is_refused_and_the_request_ends_well(module_daemon):
    """Found by an adversarial review: close() from a second thread while a request was in
    flight pulled the socket from under it (the request raised an untyped AttributeError)."""
    with Client(module_daemon.run_dir, name="closer", timeout_s=10) as c:
        with turn_held_elsewhere(c):
            with pytest.raises(ClientInUse, match="in use by another thread"):
                c.close()
            assert c._sock is not None and c.info  # nothing of the connection closed
        assert c.stats()["clients"] >= 1
        c.close()
    assert c._sock is None


def test_a_client_handed_to_another_thread_between_requests_works(module_daemon):
    with Client(module_daemon.run_dir, name="handover", timeout_s=10) as c:
        c.stats()
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("stats", c.stats()))
        t.start()
        t.join(10)
        assert out["stats"]["clients"] >= 1
        c.stats()  # and back


def test_blocks_without_a_store_is_not_attached_saying_why(module_daemon):
    """Found by an adversarial review: ``c.blocks`` was None without a store, so
    ``c.blocks.alloc(1)`` raised AttributeError (before attach, without block_size, after
    detach and after close)."""
    from sparsekv.client import NotAttached

    import helpers

    with Client(module_daemon.run_dir, name="noblocks", timeout_s=10) as c:
        with pytest.raises(NotAttached, match="it is not attached"):
            c.blocks.alloc(1)
        c.attach(helpers.layout(), engine="noblocks")
        with pytest.raises(NotAttached, match="its engine has no block store"):
            c.blocks.alloc(1)
        c.detach()
        with pytest.raises(NotAttached, match="it is not attached"):
            c.blocks.alloc(1)
    with pytest.raises(NotAttached, match="it is not attached"):
        c.blocks.alloc(1)  # closed


def test_a_pendings_wait_refused_for_another_threads_turn_can_be_made_again(module_daemon):
    """Found by a review: the refusal was kept as the request's own error, so every later
    wait raised it and the reply stayed unread."""
    import helpers

    with Client(module_daemon.run_dir, name="pending", timeout_s=10) as c:
        lay = helpers.layout()
        c.attach(lay, engine="pending")
        c.step(0, [0, 1])
        p = c.submit_topk(0, 0, [[1, 2, 3, 4], [5, 6, 7, 8]])
        with turn_held_elsewhere(c):
            with pytest.raises(ClientInUse):
                p.wait()
        r = p.wait()  # the client free again: its reply
        assert (r.slots >= 0).all() and int(r.misses.sum()) == 8
