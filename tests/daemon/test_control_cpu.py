"""Where the ZeroMQ I/O threads run (proto/affinity.py): the daemon's ``control_cpu`` puts
its event-loop thread and its I/O threads on one CPU and leaves every other thread the
whole set; ``Client(cpu=...)`` puts the client's I/O thread there. Checked from the
kernel's view of each thread (/proc/PID/task/TID)."""

import os
import threading

import numpy as np
import pytest

import helpers
from sparsekv.client import Client
from sparsekv.client.errors import BadRequest
from sparsekv.client.private_daemon import PrivateDaemon
from sparsekv.daemon.config import Config, ConfigError
from sparsekv.proto import affinity

LAYOUT = helpers.layout(num_layers=1, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")


def _threads(pid: int) -> dict[int, tuple[str, set[int]]]:
    """tid -> (name, CPUs it may run on), as the kernel says."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            cpus = os.sched_getaffinity(int(tid))
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        out[int(tid)] = (name, set(cpus))
    return out


def _io_threads(pid: int) -> list[set[int]]:
    return [cpus for name, cpus in _threads(pid).values() if name.startswith("ZMQbg/IO")]


def test_control_cpu_is_checked_against_this_process_cpus():
    with pytest.raises(ConfigError, match="control_cpu"):
        Config(control_cpu=-2).validate()
    missing = max(CPUS) + 1
    with pytest.raises(ConfigError, match=f"control_cpu {missing} is not among the CPUs"):
        Config(control_cpu=missing).validate()
    assert Config(control_cpu=CPUS[0]).validate().control_cpu == CPUS[0]


@needs_two
def test_daemon_pins_its_loop_and_io_threads_and_no_other_thread(tmp_path):
    cpu = CPUS[-1]
    with PrivateDaemon(pool_bytes=64 << 20, backend="cpu", extra_args=["--control-cpu", str(cpu)],
                       log_path=str(tmp_path / "d.log")) as d:
        with Client(d.run_dir, timeout_s=10) as c:
            c.attach(LAYOUT, engine="pin")
            c.step(0, [0])
            r = c.topk(0, 0, np.array([[0, 1, 2, 3]], np.int32))
            assert int(r.misses[0]) == 4  # served as ever
            threads = _threads(d.proc.pid)
    main_name, main_cpus = threads[d.proc.pid]
    assert main_cpus == {cpu}, threads
    io = [cpus for name, cpus in threads.values() if name.startswith("ZMQbg/IO")]
    assert io and all(cpus == {cpu} for cpus in io), threads
    # Threads started after the pin (the connection guard's, at least) have the whole set.
    others = [cpus for tid, (name, cpus) in threads.items() if tid != d.proc.pid and not name.startswith("ZMQbg")]
    assert others and all(cpus == set(CPUS) for cpus in others), threads


@needs_two
def test_client_io_thread_on_the_cpu_asked_for_and_gone_at_close(tmp_path):
    cpu = CPUS[-1]
    with PrivateDaemon(pool_bytes=64 << 20, backend="cpu", log_path=str(tmp_path / "d.log")) as d:
        before = len([c for c in _io_threads(os.getpid()) if c == {cpu}])
        c = Client(d.run_dir, timeout_s=10, cpu=cpu).connect()
        try:
            c.attach(LAYOUT, engine="pin")
            assert len([x for x in _io_threads(os.getpid()) if x == {cpu}]) == before + 1
            assert os.sched_getaffinity(0) == set(CPUS)  # the caller's thread is left alone
        finally:
            c.close()
        assert len([x for x in _io_threads(os.getpid()) if x == {cpu}]) == before  # its own context ended


def test_client_cpu_refused_with_a_typed_error(monkeypatch):
    with pytest.raises(BadRequest, match="is not among the CPUs"):
        Client("/nonexistent", cpu=max(CPUS) + 1)
    monkeypatch.setenv("SPARSEKV_CLIENT_CPU", "two")
    with pytest.raises(BadRequest, match="SPARSEKV_CLIENT_CPU must be a CPU number"):
        Client("/nonexistent")
    monkeypatch.setenv("SPARSEKV_CLIENT_CPU", str(CPUS[0]))
    assert Client("/nonexistent").cpu == CPUS[0]


def test_a_cuda_rank_follows_a_caller_pinned_to_one_cpu(monkeypatch):
    monkeypatch.delenv("SPARSEKV_CLIENT_CPU", raising=False)
    seen = {}

    def in_thread():
        affinity.pin_thread(CPUS[-1])
        seen["cuda"] = Client("/nonexistent", device="cuda:0").cpu
        seen["cpu"] = Client("/nonexistent").cpu

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen == {"cuda": CPUS[-1], "cpu": None}
    assert Client("/nonexistent", device="cuda:0").cpu is (CPUS[0] if len(CPUS) == 1 else None)


def test_unpinned_threads_get_the_whole_set_back():
    seen = {}

    def child():
        seen["child"] = set(os.sched_getaffinity(0))

    def pinned():
        affinity.pin_thread(CPUS[-1])
        seen["pinned"] = set(os.sched_getaffinity(0))
        t = threading.Thread(target=affinity.unpinned(child))
        t.start()
        t.join()
        affinity.release_thread()
        seen["released"] = set(os.sched_getaffinity(0))

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    assert seen == {"pinned": {CPUS[-1]}, "child": set(CPUS), "released": set(CPUS)}


def test_cpu_ranges_are_written_compactly():
    assert affinity._ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert affinity._ranges({3}) == "3"


@pytest.mark.cuda
@pytest.mark.skipif(len(CPUS) < 4, reason="a pinned transport run needs four CPUs")
def test_a_tiny_pinned_transport_bench_on_the_gpu():
    from sparsekv.client.bench import bench_cuda_transport, pinning_cpus

    r = bench_cuda_transport(steps=20, device_wait=True, pinned=True)
    assert r["pinned_cpus"] == list(pinning_cpus())
    for k in ("zmq_handoff_p50_us", "zmq_device_wait_p50_us", "bare_zmq_event_rtt_p50_us", "daemon_host_us_per_step"):
        assert r[k] > 0, (k, r)
    assert os.sched_getaffinity(0) == set(CPUS)  # the bench let go of this thread
