"""Where the control socket's hop runs (proto/cpus.py): CPU lists, warm CPU loops
(SCHED_IDLE, one per CPU, gone with their parent), the daemon's loop thread pinned, and a
client that runs no thread of its own (its thread reads and writes its socket)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

import helpers
from sparsekv.client import Client
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.daemon.config import Config, ConfigError
from sparsekv.proto.cpus import CpuWarmer, check_cpus_usable, format_cpu_list, parse_cpu_list

LAYOUT = helpers.layout(num_layers=1, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
ALLOWED = sorted(os.sched_getaffinity(0))
NOWHERE = min((os.cpu_count() or 1) + 100, 1023)  # a CPU this machine does not have
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs (one for I/O, one for the rest)")


def test_cpu_lists_parse_fold_and_name_what_is_wrong():
    assert parse_cpu_list("") == ()
    assert parse_cpu_list(" 3 ") == (3,)
    assert parse_cpu_list("4-6,1,5") == (1, 4, 5, 6)
    assert format_cpu_list((1, 4, 5, 6, 9)) == "1,4-6,9"
    assert format_cpu_list(()) == ""
    assert parse_cpu_list(format_cpu_list((0, 2, 3, 7, 8, 9))) == (0, 2, 3, 7, 8, 9)
    for bad, says in (("x", "'x' is not a CPU number"), ("3-1", "runs backwards"), ("1,,2", "'' is not"),
                      ("-1", "'-1' is not"), ("1024", "beyond the 1024 CPUs a thread")):
        with pytest.raises(ValueError, match=says):
            parse_cpu_list(bad, "io_cpus")
    with pytest.raises(ValueError, match=f"io_cpus names CPU\\(s\\) {NOWHERE}, which this process cannot run on"):
        check_cpus_usable((ALLOWED[0], NOWHERE), "io_cpus")
    check_cpus_usable(ALLOWED, "io_cpus")
    assert os.sched_getaffinity(0) == set(ALLOWED)  # tried on a thread of its own


def test_cpu_settings_from_a_file_name_the_file_and_take_a_bare_number(tmp_path):
    from sparsekv.daemon.config import load

    f = tmp_path / "d.toml"
    f.write_text('io_cpus = 63\nwarm_cpus = "62-63"\n')
    cfg = load(environ={"SPARSEKV_CONFIG": str(f)})
    assert (cfg.io_cpus, cfg.warm_cpus) == ("63", "62-63")
    f.write_text('warm_cpus = "62-x"\n')
    with pytest.raises(ConfigError, match=f"config file {f}: bad value for warm_cpus: .*'62-x' is not a CPU"):
        load(environ={"SPARSEKV_CONFIG": str(f)})
    f.write_text('warm_cpus = [62, 63]\n')
    with pytest.raises(ConfigError, match="a CPU list is text such as"):
        load(environ={"SPARSEKV_CONFIG": str(f)})


def test_config_checks_the_cpu_settings():
    for name in ("io_cpus", "warm_cpus"):
        with pytest.raises(ConfigError, match=f"{name}: 'a' is not a CPU"):
            Config(**{name: "a"}).validate()
    assert Config(io_cpus="1", warm_cpus="0-1").validate().warm_cpus == "0-1"


def _policy_and_cpus(pid: int) -> tuple[int, set]:
    return os.sched_getscheduler(pid), os.sched_getaffinity(pid)


def test_warm_loops_run_at_idle_priority_on_their_cpu_and_stop():
    cpu = ALLOWED[-1]
    with CpuWarmer([cpu]) as w:
        assert w.running() == 1
        (pid,) = w.pids
        assert _policy_and_cpus(pid) == (os.SCHED_IDLE, {cpu})
        # It spins: soon never asleep (state R whenever looked at; whether it gets the CPU
        # depends on what else runs there, at idle priority next to nothing). Before
        # that it may sleep between tries of its autogroup's nice (rate-limited).
        deadline, streak = time.monotonic() + 15, 0
        while streak < 5:
            assert time.monotonic() < deadline, "the warm loop does not spin"
            streak = streak + 1 if psutil.Process(pid).status() == psutil.STATUS_RUNNING else 0
            time.sleep(0.05)
        if os.path.exists(f"/proc/{pid}/autogroup"):
            with open(f"/proc/{pid}/autogroup") as f:
                assert f.read().split()[-1] == "19"  # its session's group weighs next to nothing
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_warm_loop_refuses_a_cpu_outside_the_affinity_before_starting_any():
    with pytest.raises(ValueError, match="warm_cpus names CPU"):
        CpuWarmer([ALLOWED[0], NOWHERE]).start()


def test_warm_loops_start_only_from_the_main_thread():
    import threading

    got = []
    t = threading.Thread(target=lambda: got.append(pytest.raises(RuntimeError, CpuWarmer([ALLOWED[0]]).start)))
    t.start()
    t.join()
    assert got and "main one" in str(got[0].value)


def test_warm_loops_die_with_the_process_that_started_them(tmp_path):
    code = textwrap.dedent(f"""
        import os, sys, time
        from sparsekv.proto.cpus import CpuWarmer
        w = CpuWarmer([{ALLOWED[-1]}]).start()
        print(w.pids[0], flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        loop = int(p.stdout.readline())
        assert psutil.Process(loop).ppid() == p.pid
        p.send_signal(signal.SIGKILL)  # no cleanup of its own: PR_SET_PDEATHSIG does it
        p.wait()
        deadline = time.monotonic() + 10
        while psutil.pid_exists(loop) and psutil.Process(loop).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the warm loop outlived its parent"
            time.sleep(0.05)
    finally:
        p.kill()
        p.wait()


@needs_two_cpus
def test_daemon_pins_its_loop_thread_and_warms_cpus(tmp_path):
    io = ALLOWED[-1]
    with PrivateDaemon(pool_bytes=64 << 20, backend="cpu", extra_args=["--io-cpus", str(io), "--warm-cpus", str(io)],
                       log_path=str(tmp_path / "d.log")) as d, Client(d.run_dir, timeout_s=10) as c:
        c.attach(LAYOUT, engine="w")
        c.step(0, [0])
        assert int(c.topk(0, 0, np.array([[0, 1, 2, 3]], np.int32)).misses[0]) == 4
        pid = d.proc.pid
        assert os.sched_getaffinity(pid) == {io}  # the loop's thread reads the control socket
        s = c.stats()
        assert (s["io_cpus"], s["warm_cpus"], s["warm_cpus_running"]) == (str(io), str(io), 1)
        loops = [p for p in psutil.Process(pid).children() if "sparsekv-warm-cpu" in " ".join(p.cmdline())]
        assert len(loops) == 1 and _policy_and_cpus(loops[0].pid) == (os.SCHED_IDLE, {io})
        assert loops[0].name() == f"skv-warm-cpu{io}"  # what top and pgrep show
        assert os.sched_getaffinity(0) == set(ALLOWED)  # the client's thread untouched
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in loops)


@needs_two_cpus
def test_daemon_refuses_io_cpus_it_cannot_use(tmp_path):
    """A bad setting: exit code 2 (the unit does not restart it), naming where it came from
    (found by an operator's review: exit 1, restarted into the same refusal)."""
    for args, says in ((["--io-cpus", str(NOWHERE)], "io_cpus names CPU"),
                       (["--io-cpus", format_cpu_list(ALLOWED)], "leave some for its other threads"),
                       (["--warm-cpus", str(NOWHERE)], "warm_cpus names CPU")):
        log = tmp_path / f"d{len(says)}.log"
        with pytest.raises(Exception, match="exited with code 2"):
            with PrivateDaemon(pool_bytes=64 << 20, backend="cpu", extra_args=args, log_path=str(log)):
                pass
        name = args[0][2:].replace("-", "_")
        assert says in log.read_text() and f"({name}: flag {args[0]})" in log.read_text()


def test_a_client_runs_no_thread_of_its_own(tmp_path):
    """The engine's thread writes each request and reads its reply (client/wire.py): an
    engine process pinned to some CPUs has nothing else to place."""
    with PrivateDaemon(pool_bytes=64 << 20, backend="cpu", log_path=str(tmp_path / "d.log")) as d:
        code = textwrap.dedent(f"""
            import os
            import numpy as np
            from sparsekv.client import Client
            import helpers
            before = sorted(os.listdir("/proc/self/task"))
            with Client({d.run_dir!r}, timeout_s=10) as c:
                c.attach(helpers.layout(num_layers=1, row_bytes=32, top_k=4, region_stride=8, max_reqs=2,
                                        host_rows=64), engine="k")
                c.step(0, [0])
                assert int(c.topk(0, 0, np.array([[0, 1, 2, 3]], np.int32)).misses[0]) == 4
                during = sorted(os.listdir("/proc/self/task"))
            assert during == before, (before, during)
            print("ok")
        """)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(helpers.__file__),
                                                             os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_daemon_refuses_warm_loops_that_would_eat_its_cpu_quota(monkeypatch):
    from sparsekv.daemon import main as main_mod
    from sparsekv.daemon import start_checks

    monkeypatch.setattr(start_checks, "cpu_quota", lambda: 2.0)
    with pytest.raises(main_mod.SettingRefused, match=r"would spend 2 of the 2 CPUs of run time.*\(warm_cpus: file x\)"):
        main_mod.place_io(Config(warm_cpus=f"{ALLOWED[0]},{ALLOWED[-1]}" if len(ALLOWED) > 1 else "0-1").validate(),
                          {"warm_cpus": "file x"})


def test_bench_io_placement_is_an_option_of_cuda_transport_only(capsys, monkeypatch):
    from sparsekv.bench import bench
    from sparsekv.cli.main import main

    assert main(["bench", "resolve", "--io", "warm"]) == 2
    assert "--io is an option of cuda_transport" in capsys.readouterr().err
    with pytest.raises(ValueError, match="io must be one of both, installed, warm"):
        bench.run_bench(["cuda_transport"], io="hot")
    # both: one run as installed, then one placed (where 3 CPUs can be used)
    runs = []
    monkeypatch.setattr(bench, "bench_cuda_transport", lambda warm_io=False: runs.append(warm_io) or {"w": warm_io})
    out = bench.run_bench(["cuda_transport"])
    assert runs == ([False, True] if len(ALLOWED) >= 3 else [False]) and [r["w"] for r in out] == runs
    runs.clear()
    bench.run_bench(["cuda_transport"], io="warm")
    assert runs == [True]


def test_the_warm_cpus_command_runs_until_sigterm_and_takes_its_loops_along():
    cpu = ALLOWED[-1]
    p = subprocess.Popen([sys.executable, "-m", "sparsekv.cli.main", "warm-cpus", str(cpu)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert f"CPU(s) {cpu} kept warm" in line, line + p.stderr.read()
        (loop,) = [c for c in psutil.Process(p.pid).children() if c.name() == f"skv-warm-cpu{cpu}"]
        assert _policy_and_cpus(loop.pid) == (os.SCHED_IDLE, {cpu})
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        assert not psutil.pid_exists(loop.pid) or loop.status() == psutil.STATUS_ZOMBIE
    finally:
        p.kill()
        p.wait()
    r = subprocess.run([sys.executable, "-m", "sparsekv.cli.main", "warm-cpus", ""], capture_output=True, text=True)
    assert r.returncode == 1 and "name at least one CPU" in r.stderr
    # A CPU it cannot run on: exit 1 as well, naming its argument, not the daemon's setting
    r = subprocess.run([sys.executable, "-m", "sparsekv.cli.main", "warm-cpus", str(NOWHERE)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stderr.startswith(f"sparsekv warm-cpus: CPUS names CPU(s) {NOWHERE}"), r.stderr


def _exited(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@needs_two_cpus
def test_a_warm_loop_someone_killed_is_started_again(tmp_path):
    io = ALLOWED[-1]
    log = tmp_path / "d.log"
    with PrivateDaemon(pool_bytes=64 << 20, backend="cpu", log_path=str(log),
                       extra_args=["--warm-cpus", str(io), "--reap-interval-s", "0.2"]) as d, \
            Client(d.run_dir, timeout_s=10) as c:
        (first,) = [p for p in psutil.Process(d.proc.pid).children() if p.name() == f"skv-warm-cpu{io}"]
        first.kill()
        # Its exit is the kernel's work, slow for an idle-class task pinned to a busy CPU:
        # waited apart (generously), then the daemon's part within its own bound.
        deadline = time.monotonic() + 60
        while not _exited(first):
            assert time.monotonic() < deadline, "the killed warm loop did not exit"
            time.sleep(0.05)
        deadline = time.monotonic() + 15
        while c.stats()["warm_cpus_revived"] < 1:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        while True:  # the new loop names itself once its interpreter has started
            loops = [p for p in psutil.Process(d.proc.pid).children() if p.name() == f"skv-warm-cpu{io}"
                     and p.status() != psutil.STATUS_ZOMBIE]
            if loops:
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert len(loops) == 1 and loops[0].pid != first.pid
        assert c.stats()["warm_cpus_running"] == 1
        assert f"the warm loop of CPU {io} had exited (killed by SIGKILL): started again" in log.read_text()
