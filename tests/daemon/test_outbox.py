"""daemon/outbox.py: past the total of queued replies the connection with the most bytes
queued goes, the one being sent to only when it would be the heaviest; past its own cap a
connection goes whatever the others hold."""

import pytest

from sparsekv.daemon import outbox
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
