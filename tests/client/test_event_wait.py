"""A cuda rank's host-side wait for a daemon's GPU work (client/cuda_attach.py
``_wait_event``) is never unbounded: a dead daemon's event may never complete, so the
wait asks whether the daemon is still there and gives up with DaemonUnavailable. Runs
without a GPU (the event is a stand-in)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from sparsekv.client import cuda_attach
from sparsekv.client.errors import DaemonUnavailable


def attachment(done):
    return SimpleNamespace(_events=SimpleNamespace(done=done))


def test_an_event_that_never_completes_ends_in_daemon_unavailable_once_the_daemon_is_gone():
    checks = []

    def still_there():
        checks.append(time.monotonic())
        if len(checks) == 2:
            raise DaemonUnavailable("sparsekvd is gone (pid 1 exited)")

    t0 = time.monotonic()
    # The event "completes" after 3 s: a wait that stopped asking would return then, and
    # fail the test, instead of hanging it.
    with pytest.raises(DaemonUnavailable, match="gone"):
        cuda_attach.CudaAttachment._wait_event(attachment(lambda e: time.monotonic() - t0 > 3), 3, still_there)
    assert len(checks) == 2
    assert checks[0] - t0 >= cuda_attach.EVENT_CHECK_S * 0.9  # asked once a slice, not in a busy loop
    assert checks[1] - checks[0] >= cuda_attach.EVENT_CHECK_S * 0.9


def test_an_event_that_completes_returns_without_asking():
    polls = []

    def done(e):
        polls.append(e)
        return len(polls) >= 5

    cuda_attach.CudaAttachment._wait_event(attachment(done), 7, lambda: pytest.fail("asked while the event was done"))
    assert polls == [7] * 5


def test_a_daemon_whose_gpu_work_never_ends_is_given_up_on_after_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="did not finish within 0.6 s"):
        cuda_attach.CudaAttachment._wait_event(attachment(lambda e: time.monotonic() - t0 > 5), 1, lambda: None,
                                               timeout_s=0.6)
    assert 0.6 <= time.monotonic() - t0 < 4.5  # gave up: did not wait for the event (5 s)


class FakeCudaAttachment:
    def __init__(self):
        self.closed_with = []

    def close(self, wait_s=None):
        self.closed_with.append(wait_s)


@pytest.mark.parametrize("gone", [False, True])
def test_closing_a_client_whose_daemon_is_gone_waits_for_the_gpu_a_bounded_time(tmp_path, gone):
    from sparsekv.client import client as client_mod

    c = client_mod.Client(str(tmp_path))
    att = c.attachment = FakeCudaAttachment()
    c._gone = "sparsekvd is gone (pid 1 exited)" if gone else None
    c.close()
    assert att.closed_with == [client_mod.GONE_CLOSE_WAIT_S if gone else None]
    assert c.attachment is None


class Arena:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


class Mark:
    """A stream mark (an event): done when told."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def stub_attachment(finishes: bool, mark=None, registered=None):
    """The parts of a CudaAttachment that close() touches, the GPU wait stood in for.
    ``registered``: its step blocks page-locked here (a top-k went from the GPU)."""
    return SimpleNamespace(_arena=Arena(), _blocks_mm=None, _events=None, device=0, _registered=registered,
                           _stream_done_within=lambda wait_s: finishes, _stream_mark=lambda: mark)


@pytest.mark.parametrize("finishes", [True, False])
def test_a_gone_daemons_arena_is_unmapped_only_once_the_stream_is_done(finishes, monkeypatch):
    """close() after the daemon is gone: unmapped at once when the stream's work ends in
    time; else left mapped with a mark of that work, and the next attach's sweep unmaps
    it once the mark is done (not before)."""
    monkeypatch.setattr(cuda_attach, "_left_mapped", [])
    mark = Mark()
    att = stub_attachment(finishes, mark)
    arena = att._arena
    cuda_attach.CudaAttachment.close(att, wait_s=0.1)
    assert arena.closed == (1 if finishes else 0)  # else left mapped: work may still read it
    assert att._arena is None and att.slab is None
    assert cuda_attach.sweep_left_mapped() == (0 if finishes else 1)  # the work still runs
    assert arena.closed == (1 if finishes else 0)
    mark.done = True
    assert cuda_attach.sweep_left_mapped() == 0
    assert arena.closed == 1  # once, either way


@pytest.mark.parametrize("finishes", [True, False])
def test_step_blocks_a_copy_from_the_gpu_may_still_write_stay_until_the_stream_is_done(finishes, monkeypatch):
    """Step blocks page-locked for top-k copies from the GPU: unregistered at close when
    the stream's work has ended, else kept (registered, mapped) with the arena until the
    sweep finds that work done."""
    monkeypatch.setattr(cuda_attach, "_left_mapped", [])
    mark, blocks = Mark(), Arena()  # (anything with close())
    att = stub_attachment(finishes, mark, registered=blocks)
    cuda_attach.CudaAttachment.close(att, wait_s=0.1)
    assert blocks.closed == (1 if finishes else 0) and att._registered is None
    assert cuda_attach.sweep_left_mapped() == (0 if finishes else 2)  # the arena and the blocks
    mark.done = True
    assert cuda_attach.sweep_left_mapped() == 0
    assert blocks.closed == 1 and att._arena is None


def _refused_attach(monkeypatch, daemon_gone_at: str | None):
    """A Client whose ATTACH is granted but whose IPC open fails with
    cudaErrorInvalidResourceHandle; the daemon is gone from the start (``daemon_gone_at
    == "check"``), found gone by the DETACH (``"detach"``), or alive (None). Returns the
    client, what it sent, and the attach's exception."""
    from sparsekv.client import client as client_mod
    from sparsekv.client.errors import SparseKVError
    from sparsekv.proto import Layout

    class CudaError(RuntimeError):
        status = 400

    def refuse(*a, **kw):
        raise CudaError("cudaErrorInvalidResourceHandle: invalid resource handle")

    monkeypatch.setattr(client_mod, "CudaAttachment", refuse)
    c = client_mod.Client("/nonexistent", device="cuda:0")
    c._sock = SimpleNamespace(close=lambda linger=0: None)
    sent = []

    def call(t, fields=None):
        sent.append(t.name)
        if t.name == "DETACH" and daemon_gone_at == "detach":
            c._lost("sparsekvd is gone (pid 4242 exited)")
        return {"handles": {"kind": "cuda_ipc", "bus_id": "0000:00:06.0"}}, None

    monkeypatch.setattr(c, "_call", call)
    monkeypatch.setattr(client_mod, "fetch_fds", lambda run_dir, h, timeout_s: {})
    monkeypatch.setattr(c, "_check_daemon",
                        lambda: "sparsekvd is gone (pid 4242 exited)" if daemon_gone_at == "check" else None)
    lay = Layout(num_layers=1, row_bytes=16, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
    with pytest.raises(SparseKVError) as ei:
        c.attach(lay, engine="e")
    return c, sent, ei.value


def test_an_attach_whose_device_memory_cannot_be_mapped_gives_the_rank_back_with_a_typed_error(monkeypatch):
    """The daemon granted the rank and lives, the IPC open here failed (a CUDA error): the
    rank is detached again, and the caller gets DeviceMappingFailed naming the GPU and
    the CUDA error."""
    from sparsekv.client.errors import DeviceMappingFailed

    c, sent, e = _refused_attach(monkeypatch, None)
    assert type(e) is DeviceMappingFailed
    assert sent == ["ATTACH", "DETACH"] and c.attachment is None
    assert "0000:00:06.0" in str(e) and "cudaErrorInvalidResourceHandle" in str(e)
    assert e.status == 400


@pytest.mark.parametrize("gone_at", ["check", "detach"])
def test_an_attach_whose_daemon_died_before_the_ipc_open_says_daemon_unavailable(monkeypatch, gone_at):
    """The daemon was killed between its ATTACH reply and this process's IPC open: the
    handle of an exited exporter never opens (the cuda chaos soak, docs/PERF.md session
    9). That is a lost daemon, not a mapping problem: DaemonUnavailable, whether the
    daemon's process is seen gone at once or only the DETACH finds it; no DETACH is sent
    to a daemon known gone."""
    c, sent, e = _refused_attach(monkeypatch, gone_at)
    assert type(e) is DaemonUnavailable
    assert "pid 4242 exited" in str(e) and "could not map its device memory" in str(e)
    assert sent == (["ATTACH"] if gone_at == "check" else ["ATTACH", "DETACH"])
    assert c._sock is None and c._gone is not None  # every later request says so too


def test_after_a_failure_to_page_lock_the_step_blocks_the_rank_takes_no_gpu_top_k(monkeypatch, caplog):
    """The step blocks are page-locked in the client at the first top-k from the GPU; if
    that fails the rank says so once and says it takes no top-k from the GPU from then on
    (the client then copies such a top-k to the host: Client.submit_topk asks this before
    any block is touched)."""
    tries = []

    def refuse(mm, device):
        tries.append(device)
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    monkeypatch.setattr(cuda_attach, "_RegisteredBlocks", refuse)
    att = SimpleNamespace(_blocks_mm=object(), _fence=[0] * 16, _registered=None, _register_failed=False, device=0)
    takes = cuda_attach.CudaAttachment.takes_device_topk.fget
    with caplog.at_level("WARNING", logger="sparsekv.client"):
        assert takes(att) is False and takes(att) is False
    assert tries == [0]  # tried once
    assert sum("could not page-lock the step blocks" in r.message for r in caplog.records) == 1
    ok = SimpleNamespace(_blocks_mm=object(), _fence=[0] * 16, _registered=None, _register_failed=False, device=0)
    monkeypatch.setattr(cuda_attach, "_RegisteredBlocks", lambda mm, device: ("registered", device))
    assert takes(ok) is True and ok._registered == ("registered", 0)
    assert takes(SimpleNamespace(_blocks_mm=object(), _fence=None, _register_failed=False)) is False  # no fences


@pytest.mark.parametrize("transport", ["zmq", "doorbell"])
def test_a_doorbell_attach_without_its_step_blocks_gives_the_rank_back(monkeypatch, transport):
    """The fd socket could not hand over the rank's descriptors (busy past its retries, say).
    A zmq rank goes on, its top-k batches sent as arrays; a doorbell rank's error record and
    TP stop word live in those step blocks, so without them its handle could neither report
    a device error nor see its group stop: the rank is detached and the error raised."""
    from sparsekv.client import client as client_mod
    from sparsekv.client.errors import QuotaExceeded
    from sparsekv.proto import Layout

    made = []
    monkeypatch.setattr(client_mod, "CudaAttachment", lambda *a, **kw: made.append(kw) or SimpleNamespace())
    c = client_mod.Client("/nonexistent", device="cuda:0")
    c._sock = SimpleNamespace(close=lambda linger=0: None)
    sent = []

    def call(t, fields=None):
        sent.append(t.name)
        return {"handles": {"kind": "cuda_ipc", "bus_id": "0000:00:06.0"}}, None

    def busy(run_dir, h, timeout_s):
        raise QuotaExceeded("busy: uid 1000 has 64 fd socket connections open, its share of the 256; try again")

    monkeypatch.setattr(c, "_call", call)
    monkeypatch.setattr(c, "_check_daemon", lambda: None)  # the daemon is there (busy, not gone)
    monkeypatch.setattr(client_mod, "fetch_fds", busy)
    lay = Layout(num_layers=1, row_bytes=16, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
    if transport == "zmq":
        c.attach(lay, engine="e", transport=transport)
        assert sent == ["ATTACH"] and made and made[0]["fds"] == {}
        return
    with pytest.raises(QuotaExceeded, match="busy"):
        c.attach(lay, engine="e", transport=transport)
    assert sent == ["ATTACH", "DETACH"] and not made and c.attachment is None
