"""daemon/outbox.py and its eviction callback (daemon/control_socket.py): past the total
of queued replies the connection with the most bytes queued goes, the one being sent to
only when it would be the heaviest; past its own cap a connection goes whatever the others
hold. An evicted connection takes no more replies and is closed once."""

import socket
from types import SimpleNamespace

import pytest

import helpers
import zmtp_peer
from sparsekv.daemon import outbox
from sparsekv.daemon.control_socket import ControlSocket
from sparsekv.daemon.outbox import NotReading, Outboxes


class Blocked:
    """A socket whose peer reads nothing: every send would block."""

    def sendmsg(self, bufs):
        raise BlockingIOError


@pytest.fixture
def small_caps(monkeypatch):
    monkeypatch.setattr(outbox, "MAX_OUT_BYTES", 1000)
    monkeypatch.setattr(outbox, "MAX_OUT_TOTAL", 1500)


def test_past_the_total_the_heaviest_other_queue_is_dropped_and_its_connection_closed(small_caps):
    evicted = []
    everyone = Outboxes(evict=lambda o, why: evicted.append((o, why)))
    a, b, c = (everyone.new(Blocked()) for _ in range(3))
    a.write([b"x" * 900])
    b.write([b"y" * 500])
    c.write([b"z" * 300])  # 1700 > 1500: a (900, the heaviest) goes
    assert evicted and evicted[0][0] is a and "900 bytes" in evicted[0][1]
    assert (a.bytes, b.bytes, c.bytes, everyone.total) == (0, 500, 300, 800)
    assert everyone.queued == {b, c}


def test_the_connection_being_sent_to_goes_when_it_would_be_the_heaviest(small_caps):
    evicted = []
    everyone = Outboxes(evict=lambda o, why: evicted.append(o))
    a, b = everyone.new(Blocked()), everyone.new(Blocked())
    a.write([b"x" * 600])
    b.write([b"y" * 500])
    with pytest.raises(NotReading):
        b.write([b"y" * 450])  # b would hold 950 > a's 600: b is the one not reading most
    assert not evicted and (a.bytes, b.bytes, everyone.total) == (600, 500, 1100)


def test_its_own_cap_closes_a_connection_whatever_the_others_hold(small_caps):
    everyone = Outboxes(evict=lambda o, why: pytest.fail("nothing is evicted for a connection's own cap"))
    a = everyone.new(Blocked())
    a.write([b"x" * 800])
    with pytest.raises(NotReading):
        a.write([b"x" * 300])
    assert a.bytes == 800


def test_without_an_evict_callback_the_connection_being_sent_to_goes(small_caps):
    everyone = Outboxes()
    a, b = everyone.new(Blocked()), everyone.new(Blocked())
    a.write([b"x" * 900])
    with pytest.raises(NotReading):
        b.write([b"y" * 700])
    assert (a.bytes, b.bytes) == (900, 0)


class Recording:
    """A socket whose peer reads: ``take`` bytes a call (None: all), recorded in order."""

    def __init__(self, take=None):
        self.take, self.sent = take, bytearray()

    def sendmsg(self, bufs):
        data = b"".join(bytes(b) for b in bufs)
        n = len(data) if self.take is None else min(self.take, len(data))
        self.sent += data[:n]
        return n


def test_an_evicted_connection_takes_no_more_replies_before_it_is_closed(small_caps):
    """Its stream was cut mid-message: until the loop's callback closes it, a reply to it
    would follow the cut-off message's first bytes."""
    evicted = []  # the daemon's loop closes the connection later (call_soon)
    everyone = Outboxes(evict=lambda o, why: evicted.append(o))
    sock = Recording(take=10)
    a, b = everyone.new(sock), everyone.new(Blocked())
    a.write([b"x" * 900])  # 10 bytes of the message out, 890 queued
    b.write([b"y" * 700])  # 1590 > 1500: a's queue goes, mid-message
    assert evicted == [a]
    sock.take = None  # its peer reads now
    with pytest.raises(OSError):
        a.write([b"next message"])
    assert bytes(sock.sent) == b"x" * 10


def test_a_connection_is_evicted_once(small_caps):
    """A reply to it before the loop closed it queues nothing, so it is not evicted again."""
    evicted = []
    everyone = Outboxes(evict=lambda o, why: evicted.append(o))
    a, b, c = (everyone.new(Blocked()) for _ in range(3))
    a.write([b"x" * 900])
    b.write([b"y" * 700])  # a goes
    with pytest.raises(OSError):
        a.write([b"x" * 800])  # a reply to it before the loop closed it
    c.write([b"z" * 100])
    assert evicted == [a]


def test_two_light_non_readers_do_not_get_a_heavier_reader_closed(small_caps):
    """Connections of one uid count as one: its 910 bytes over two connections outweigh the
    reader's 600, so its heavier connection goes, not the reader."""
    evicted = []
    everyone = Outboxes(evict=lambda o, why: evicted.append(o))
    reader = everyone.new(Recording(take=0), uid=1000)  # an engine reading a large reply slowly
    reader.write([b"k" * 600])
    hostile = [everyone.new(Blocked(), uid=2000) for _ in range(2)]
    hostile[0].write([b"h" * 550])
    hostile[1].write([b"h" * 360])  # 1510 > 1500: the reader (600) is the heaviest connection
    assert evicted == [hostile[0]] and reader.bytes == 600 and hostile[1].bytes == 360


def test_a_uid_holding_the_most_loses_its_own_connection_when_it_sends(small_caps):
    """The connection being sent to is closed when its uid holds the most and it is that
    uid's heaviest; a lighter connection of the same uid is evicted in its place."""
    evicted = []
    everyone = Outboxes(evict=lambda o, why: evicted.append(o))
    other = everyone.new(Blocked(), uid=1)
    other.write([b"o" * 300])
    light, heavy = everyone.new(Blocked(), uid=2), everyone.new(Blocked(), uid=2)
    light.write([b"l" * 200])
    heavy.write([b"h" * 700])
    with pytest.raises(NotReading):
        heavy.write([b"h" * 301])  # uid 2 would hold 1201 of 1501; heavy (1001) is its heaviest
    assert not evicted
    light.write([b"l" * 301])  # uid 2 again the most; its heaviest other connection (heavy) goes
    assert evicted == [heavy] and light.bytes == 501


def test_a_connection_gone_before_its_eviction_is_carried_out_is_not_counted_again(tmp_path):
    """Its queue dropped for another's reply, its close left to the loop; the peer hangs up
    first: the loop's callback finds it gone and counts and logs nothing more."""
    callbacks = []
    loop = SimpleNamespace(call_soon=lambda f, *a: callbacks.append((f, a)))
    path = str(tmp_path / "control.sock")
    cs = ControlSocket(path, on_message=lambda *a: None, on_closed=lambda ident: None).open(loop)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(zmtp_peer.GREETING + zmtp_peer.READY)
        helpers.wait_for(lambda: cs.poll() >= 0 and len(cs._conns) == 1, what="the connection admitted")
        [c] = cs._conns.values()
        cs._evicted(c.out, "dropped for another's reply")
        s.close()
        helpers.wait_for(lambda: cs.poll() >= 0 and not cs._conns, what="the hang-up seen")
        for f, a in callbacks:
            f(*a)
        assert cs.counts["not_reading"] == 0
    finally:
        cs.close()
