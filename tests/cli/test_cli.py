"""``sparsekv trace synth`` and ``sparsekv replay`` as commands (DESIGN §6): the one-line
JSON summary printed last, the result file's arrays, identical results through both
transports (and equal to the reference model), clear exit-2 errors for bad traces and
arguments (checked before any work), progress on stderr."""

import io
import json
import time

import numpy as np
import pytest

import cli_inproc
import helpers
from sparsekv.bench.bench import output_problem
from sparsekv.bench.synth import synth
from sparsekv.bench.trace import Trace
from sparsekv.cli.progress import Progress

SYNTH = ["--steps", 30, "--batch", 4, "--top-k", 16, "--region-stride", 32, "--max-reqs", 8, "--host-rows", 2048,
         "--row-bytes", 32, "--num-layers", 2, "--context", 150, "--lifetime", 12, "--invalidate", 0.2,
         "--out-of-range", 0.01, "--seed", 4]


def summary_of(r) -> dict:
    """The last stdout line, which must be the JSON summary."""
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    s = json.loads(last)
    for key in ("steps", "hits", "misses", "mismatched_rows"):
        assert key in s, key
    return s


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    r = cli_inproc.run("trace", "synth", "--out", path, *SYNTH)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert (info["steps"], info["batch"], info["top_k"]) == (30, 4, 16)
    assert info["resets"] > 0 and info["live_rows"] > 0
    return path


@pytest.fixture(scope="module")
def inproc_result(trace_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("inproc") / "r.npz"
    s = summary_of(cli_inproc.run("replay", trace_path, "--out", out, "--transport", "inproc", "--verify"))
    return s, np.load(out)


def test_trace_synth_writes_the_documented_trace_format(trace_path):
    z = np.load(trace_path)
    assert z["topk"].dtype == np.int32 and z["topk"].shape == (30, 4, 16)
    assert z["state_rows"].dtype == np.int32 and z["state_rows"].shape == (30, 4)
    assert z["reset"].dtype == bool and z["reset"].shape == (30, 4)
    assert z["invalidate"].dtype == np.int32 and z["invalidate"].shape[:2] == (30, 4)
    assert {k: int(z[k]) for k in ("region_stride", "host_rows", "max_reqs", "row_bytes", "num_layers")} == {
        "region_stride": 32, "host_rows": 2048, "max_reqs": 8, "row_bytes": 32, "num_layers": 2}


def test_replay_inproc_prints_summary_and_writes_result(inproc_result):
    s, z = inproc_result
    assert s["steps"] == 30 and s["transport"] == "inproc"
    assert s["mismatched_rows"] == 0 and s["verified"] is True
    assert z["slots"].dtype == np.int32 and z["slots"].shape == (30, 4, 16)
    assert z["misses"].dtype == np.int32 and z["misses"].shape == (30, 4)
    assert s["misses"] == int(z["misses"].sum())
    assert s["hits"] > 0 and s["misses"] > 0


def test_replay_inproc_equals_the_reference_model(trace_path, inproc_result):
    slots, misses = helpers.reference_replay(Trace.load(str(trace_path)))
    np.testing.assert_array_equal(inproc_result[1]["slots"], slots)
    np.testing.assert_array_equal(inproc_result[1]["misses"], misses)


def test_replay_zmq_verify_matches_inproc_exactly(trace_path, inproc_result, tmp_path):
    out = tmp_path / "zmq.npz"
    s = summary_of(helpers.run_cli("replay", trace_path, "--out", out, "--transport", "zmq", "--verify"))
    assert s["transport"] == "zmq" and s["mismatched_rows"] == 0
    z = np.load(out)
    np.testing.assert_array_equal(z["slots"], inproc_result[1]["slots"])
    np.testing.assert_array_equal(z["misses"], inproc_result[1]["misses"])
    for key in ("steps", "hits", "misses", "out_of_range"):
        assert s[key] == inproc_result[0][key], key


def test_replay_connects_to_a_running_daemon(trace_path, inproc_result, daemon, tmp_path):
    out = tmp_path / "c.npz"
    s = summary_of(helpers.run_cli("replay", trace_path, "--out", out, "--transport", "zmq", "--verify",
                                   "--connect", daemon.run_dir))
    assert s["mismatched_rows"] == 0
    np.testing.assert_array_equal(np.load(out)["slots"], inproc_result[1]["slots"])
    stats = helpers.stats_json(daemon.run_dir)
    assert stats["misses"] == s["misses"] and stats["hits"] == s["hits"]
    assert stats["engines"] == 0  # the replay detached


@pytest.mark.parametrize("extra", [["--ranks", "2"], ["--ranks", "3", "--tp"]], ids=["separate", "tp group"])
def test_replay_with_several_ranks_gives_every_rank_the_single_ranks_slots(trace_path, inproc_result, tmp_path,
                                                                         extra):
    # Every rank sends every step (in a TP group one resolve serves them all); every
    # rank's rows are verified and its slots compared with rank 0's, saved.
    out = tmp_path / "ranks.npz"
    s = summary_of(helpers.run_cli("replay", trace_path, "--out", out, "--transport", "zmq", "--verify", *extra))
    assert s["mismatched_rows"] == 0 and s["ranks_differing"] == 0
    assert s["ranks"] == int(extra[1]) and s["tp_group"] == ("--tp" in extra)
    z = np.load(out)
    np.testing.assert_array_equal(z["slots"], inproc_result[1]["slots"])
    np.testing.assert_array_equal(z["misses"], inproc_result[1]["misses"])


@pytest.mark.parametrize("args, words", [
    (["--ranks", "2"], "sparsekv replay: --ranks needs a daemon: add --transport zmq or doorbell\n"),
    (["--transport", "zmq", "--tp"], "sparsekv replay: --tp needs --ranks 2 or more\n"),
    (["--transport", "zmq", "--ranks", "0"], "ranks must lie in [1, 64], got 0"),
    (["--transport", "zmq", "--ranks", "two"], "a whole number of ranks is needed, got 'two'")])
def test_bad_rank_options_are_refused(trace_path, tmp_path, args, words):
    r = cli_inproc.run("replay", trace_path, "--out", tmp_path / "r.npz", *args)
    assert r.returncode == 2 and words in r.stderr and not (tmp_path / "r.npz").exists()


@pytest.mark.parametrize("option", ["--connect", "--daemon-log"])
def test_daemon_options_without_a_daemon_transport_are_refused(trace_path, tmp_path, option):
    r = cli_inproc.run("replay", trace_path, "--out", tmp_path / "r.npz", option, tmp_path / "x")
    assert r.returncode == 2 and not (tmp_path / "r.npz").exists()
    assert r.stderr == f"sparsekv replay: {option} needs a daemon: add --transport zmq or doorbell\n"


def test_replay_without_verify_reports_no_mismatch_count(trace_path, tmp_path):
    s = summary_of(cli_inproc.run("replay", trace_path, "--out", tmp_path / "r.npz"))
    assert s["verified"] is False and s["mismatched_rows"] is None


def _save(path, **over):
    tr = synth(steps=3, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, row_bytes=16, num_layers=1,
               seed=1)
    arrays = dict(topk=tr.topk, state_rows=tr.state_rows, reset=tr.reset, invalidate=tr.invalidate,
                  region_stride=8, host_rows=256, max_reqs=4, row_bytes=16, num_layers=1)
    arrays.update(over)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return path


def _dup_topk():
    tr = synth(steps=3, batch=2, top_k=4, region_stride=8, max_reqs=4, host_rows=256, row_bytes=16, num_layers=1,
               arrive=1.0, pad=0.0, seed=1)
    topk = tr.topk.copy()
    topk[1, 0, :2] = 17  # a live row naming one host row twice
    assert tr.state_rows[1, 0] >= 0
    return topk


BAD_TRACES = {
    "missing file": (lambda p: p.parent / "nope.npz", "cannot read trace"),
    "not an archive": (lambda p: (p.write_text("hello"), p)[1], "is not an .npz archive"),
    "bare npy": (lambda p: (np.save(p.with_suffix(".npy"), np.arange(3)), p.with_suffix(".npy"))[1],
                 "is not an .npz archive"),
    "missing array": (lambda p: _save(p, reset=None), "lacks ['reset']"),
    "wrong shape": (lambda p: _save(p, state_rows=np.zeros((3, 5), np.int32)), "state_rows must be [3, 2]"),
    "array for a scalar": (lambda p: _save(p, host_rows=np.arange(2)), "host_rows must be an integer scalar"),
    "id past int32": (lambda p: _save(p, topk=np.full((3, 2, 4), 2**32 + 5, np.int64)), "topk holds 4294967301, outside int32"),
    "pool past the memory": (lambda p: _save(p, host_rows=np.int64(2**30), row_bytes=np.int64(4096)),
                             "needs more host memory than this machine has"),
    "text array": (lambda p: _save(p, topk=np.full((3, 2, 4), "x")), "topk must hold integers"),
    "float ids": (lambda p: _save(p, topk=np.zeros((3, 2, 4), np.float32)), "topk must hold integers, got float32"),
    "bad layout scalars": (lambda p: _save(p, region_stride=2), "region_stride"),
    "state row beyond max_reqs": (lambda p: _save(p, state_rows=np.full((3, 2), 9, np.int32)), "state row 9"),
    "duplicate ids in a row": (lambda p: _save(p, topk=_dup_topk()), "step 1: top-k row 0 names the same host row twice"),
}


# Every case on inproc; on zmq the ones refused by the daemon rather than by the loader.
BAD_TRACE_RUNS = [(c, "inproc") for c in BAD_TRACES] + [
    (c, "zmq") for c in ("duplicate ids in a row", "state row beyond max_reqs")]


@pytest.mark.parametrize("case, transport", BAD_TRACE_RUNS)
def test_bad_trace_exits_2_with_a_message(tmp_path, case, transport):
    make, words = BAD_TRACES[case]
    path = make(tmp_path / "bad.npz")
    r = cli_inproc.run("replay", path, "--out", tmp_path / "r.npz", "--transport", transport)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("sparsekv replay: ") and words in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "r.npz").exists()


def test_doorbell_transport_on_cpu_is_refused_with_exit_2(trace_path, tmp_path):
    r = cli_inproc.run("replay", trace_path, "--out", tmp_path / "r.npz", "--transport", "doorbell")
    assert r.returncode == 2 and "sparsekv replay:" in r.stderr and "Traceback" not in r.stderr


def test_trace_synth_with_impossible_parameters_exits_2(tmp_path):
    r = cli_inproc.run("trace", "synth", "--out", tmp_path / "t.npz", "--batch", 9, "--max-reqs", 4)
    assert r.returncode == 2 and "batch 9 exceeds max_reqs 4" in r.stderr
    assert not (tmp_path / "t.npz").exists()


@pytest.mark.parametrize("args, words", [
    (["--overlap", 1.5], "overlap is a probability in [0, 1], got 1.5"),
    (["--pad", -0.1], "pad is a probability in [0, 1], got -0.1"),
    (["--steps", 0], "steps must be >= 1, got 0"),
    (["--context", -5], "context must be >= 1, got -5"),
    (["--seed", -1], "seed must be >= 0, got -1"),
    (["--region-stride", 8, "--top-k", 16], "do not make a valid layout"),
    (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
    (["--steps", 10**11], "this machine has room for"),  # refused before its 745 TiB are asked for
])
def test_trace_synth_refuses_a_bad_argument_in_one_line(tmp_path, args, words):
    r = cli_inproc.run("trace", "synth", "--out", tmp_path / "t.npz", *args)
    assert r.returncode == 2 and r.stderr.startswith("sparsekv trace synth: ") and words in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "t.npz").exists()


def test_output_paths_are_checked_before_any_work(trace_path, tmp_path):
    t0 = time.monotonic()  # 10**7 steps would run for hours: the refusal comes first
    r = helpers.run_cli("trace", "synth", "--steps", 10**7, "--out", tmp_path / "nope" / "t.npz")
    assert r.returncode == 2 and "directory" in r.stderr and "does not exist" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30
    r = cli_inproc.run("replay", trace_path, "--out", tmp_path, "--transport", "zmq")
    assert r.returncode == 2 and r.stderr == f"sparsekv replay: --out {tmp_path} is a directory; name a file\n"
    r = cli_inproc.run("replay", trace_path, "--out", tmp_path / "r.npz", "--daemon-log", tmp_path / "no" / "d.log")
    assert r.returncode == 2 and "--daemon-log" in r.stderr and not (tmp_path / "r.npz").exists()


@pytest.mark.parametrize("case", ["empty", "name too long", "symlink", "fifo", "the trace itself"])
def test_an_output_that_would_fail_or_replace_something_else_is_refused_before_any_work(trace_path, tmp_path, case):
    """Found by an adversarial review: an empty or overlong --out (its temporary name longer
    still) failed after the whole replay; a device, FIFO or symlink given as --out was
    replaced by the rename (as root, --out /dev/null replaced /dev/null); --out naming
    the trace overwrote it."""
    import os

    target = tmp_path / "elsewhere.npz"
    out, words = {
        "empty": ("", "--out is empty; name a file"),
        "name too long": (tmp_path / ("a" * 250 + ".npz"), "its file name is 254 bytes; at most 243 here"),
        "symlink": (tmp_path / "link.npz", "is a symbolic link, which the output would replace"),
        "fifo": (tmp_path / "fifo.npz", "is not a regular file, which the output would replace"),
        "the trace itself": (trace_path, "is the trace being replayed; name another file"),
    }[case]
    if case == "symlink":
        os.symlink(target, out)
    elif case == "fifo":
        os.mkfifo(out)
    before = os.stat(trace_path).st_mtime_ns
    r = cli_inproc.run("replay", trace_path, "--out", out)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not target.exists() and os.stat(trace_path).st_mtime_ns == before
    if case != "the trace itself":
        r = cli_inproc.run("trace", "synth", "--out", out, *SYNTH)
        assert r.returncode == 2 and words in r.stderr, r.stderr
    if case == "fifo":  # a log is appended to, but a FIFO's open would wait for a reader: refused too
        assert output_problem(str(out), "--daemon-log", replaced=False) == f"--daemon-log {out} is a FIFO; name a file"


@pytest.mark.parametrize("case", ["log is the trace", "log is --out", "log with --connect", "out ends with /",
                                  "out under a file", "empty --connect"])
def test_replay_refuses_outputs_that_would_clobber_its_input_or_fail_late(trace_path, tmp_path, case):
    """Found by an adversarial review: --daemon-log naming the trace appended the log to
    it (exit 0); naming --out lost the log; with --connect no log was made; an --out
    ending with / ran the whole replay, then failed; --connect "" asked the node's daemon."""
    import os

    args, words = {
        "log is the trace": (["--daemon-log", trace_path], "is the trace being replayed; name another file"),
        "log is --out": (["--daemon-log", tmp_path / "r.npz"], "is --out; name another file"),
        "log with --connect": (["--daemon-log", tmp_path / "d.log", "--connect", tmp_path],
                               "with --connect there is none"),
        "out ends with /": (["--out", f"{tmp_path}/new.npz/"], "ends with /; name a file"),
        "out under a file": (["--out", f"{trace_path}/r.npz"], f"{trace_path} is not a directory"),
        "empty --connect": (["--connect", ""], "argument --connect: an empty path"),
    }[case]
    out = [] if "--out" in args else ["--out", tmp_path / "r.npz"]
    before = os.stat(trace_path)
    r = cli_inproc.run("replay", trace_path, *out, *args, "--transport", "zmq")
    assert r.returncode == 2 and words in r.stderr and r.stderr.count("\n") == 1, r.stderr
    after = os.stat(trace_path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert not (tmp_path / "r.npz").exists() and not (tmp_path / "d.log").exists()


def test_a_demo_too_large_for_this_machine_is_refused_before_anything_starts():
    """Found by an adversarial review: the daemon and both ranks started, then each rank
    printed a traceback of the refusal of its trace, exit 1."""
    r = cli_inproc.run("demo", "--backend", "cpu", "--steps", 99999999999999)
    assert r.returncode == 2 and r.stderr.startswith("sparsekv demo: the demo's two ranks' traces of "), r.stderr
    assert "this machine has room for" in r.stderr and r.stderr.count("\n") == 1


def test_replay_and_synth_print_progress_on_stderr_without_carriage_returns(trace_path, tmp_path):
    r = helpers.run_cli("replay", trace_path, "--out", tmp_path / "r.npz")
    assert r.returncode == 0 and "\r" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("replay: 30/30 steps (100 %")
    r = helpers.run_cli("trace", "synth", "--out", tmp_path / "t.npz", *SYNTH)
    assert r.returncode == 0 and r.stderr.splitlines()[-1].startswith("trace synth: 30/30 steps (100 %")
    r = helpers.run_cli("replay", trace_path, "--out", tmp_path / "r.npz", "--quiet")
    assert r.returncode == 0 and r.stderr == ""


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    out = io.StringIO()
    p = Progress("replay", 4, every_s=0.0, stream=out)
    for n in range(1, 5):
        p.update(n)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and lines[0].startswith("replay: 1/4 steps (25 %")
    assert len(lines) == 5 and lines[-1].startswith("replay: 4/4 steps (100 %")
    tty = _Tty()
    p = Progress("replay", 4, stream=tty)
    p.update(4)
    p.close()
    assert tty.getvalue() == "\rreplay [" + "#" * 30 + "] 4/4\n"


def test_replay_help_says_what_each_transport_is():
    r = cli_inproc.run("replay", "--help")
    assert r.returncode == 0 and "designed, not built" not in r.stdout
    assert "doorbell: a daemon driven from the GPU" in " ".join(r.stdout.split())


def test_a_demo_rank_that_ends_without_its_result_fails_the_demo_at_once(monkeypatch):
    """Found by an adversarial review: the demo waited 600 s for each rank's result, and a
    longer run ended with "unexpected Empty". It waits as long as the ranks run, and
    fails once one has ended without a result (killed: nothing of its own to send)."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from sparsekv.cli import demo

    monkeypatch.setattr(demo, "RESULT_POLL_S", 0.05)
    results = mp.get_context("spawn").Queue()
    running = SimpleNamespace(is_alive=lambda: True, exitcode=None)
    killed = SimpleNamespace(is_alive=lambda: False, exitcode=-9)
    results.put({"rank": 0})
    assert demo._result(results, [running, killed]) == {"rank": 0}  # a result waiting: taken
    with pytest.raises(RuntimeError, match="a demo rank ended with exit code -9 before its result"):
        demo._result(results, [running, killed])
