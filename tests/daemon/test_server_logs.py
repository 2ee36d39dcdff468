"""What the daemon logs about clients, at which level: a refused ATTACH (POOL_FULL, a
layout mismatch) is a WARNING; a clean exit (DETACH, then the process ends) is INFO
throughout; only a client that dies attached is a WARNING."""

import re

import pytest

import helpers
from sparsekv.client import Client, LayoutMismatch, PoolFull

LINE = re.compile(r"^\S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+): (.*)$")


def log_lines(daemon, tmp_path) -> list[tuple[str, str, str]]:
    out = []
    for line in (tmp_path / "sparsekvd.log").read_text().splitlines():
        m = LINE.match(line)
        if m:
            out.append(m.groups())
    return out


def wait_log(daemon, tmp_path, pred, what):
    return helpers.wait_for(lambda: [x for x in log_lines(daemon, tmp_path) if pred(x)], 10, what=what)


def test_attach_refused_for_pool_full_is_a_warning(daemon, tmp_path):
    big = helpers.layout(host_rows=1 << 20, row_bytes=64)  # 128 MiB; the pool has 64
    with Client(daemon.run_dir, name="big") as c:
        with pytest.raises(PoolFull):
            c.attach(big, engine="huge")
    (level, name, msg), = wait_log(daemon, tmp_path, lambda x: "refused" in x[2], "the refusal in the log")
    assert level == "WARNING" and name == "sparsekv.server"
    assert "engine 'huge'" in msg and "POOL_FULL" in msg and "64MiB" in msg


def test_attach_refused_for_another_layout_is_a_warning(daemon, tmp_path):
    with Client(daemon.run_dir) as a, Client(daemon.run_dir, rank=1) as b:
        a.attach(helpers.layout(), engine="e")
        with pytest.raises(LayoutMismatch):
            b.attach(helpers.layout(top_k=2), engine="e")
    (level, _, msg), = wait_log(daemon, tmp_path, lambda x: "refused" in x[2], "the refusal in the log")
    assert level == "WARNING" and "LAYOUT_MISMATCH" in msg


def test_clean_client_exit_is_info_and_a_crash_is_a_warning(daemon, tmp_path, spawn_rank):
    clean = spawn_rank(daemon.run_dir, 0, name="clean")
    cid = clean.call("connect")["client_id"]
    clean.call("attach", layout=helpers.layout().to_wire(), engine="e")
    clean.call("detach")
    clean.close()  # the process exits; the reaper notices
    # Client.close() says goodbye (BYE); a client that could not is found by the reaper.
    wait_log(daemon, tmp_path, lambda x: x[2].startswith(f"client {cid} (pid")
             and ("exited" in x[2] or "said goodbye" in x[2]), "the exit")
    mine = [x for x in log_lines(daemon, tmp_path) if x[2].startswith(f"client {cid} ")]
    assert all(level == "INFO" for level, _, _ in mine), mine
    assert any("detached from engine 'e'" in msg for _, _, msg in mine)

    crash = spawn_rank(daemon.run_dir, 1, name="crash")
    cid = crash.call("connect")["client_id"]
    crash.call("attach", layout=helpers.layout().to_wire(), engine="e")
    crash.kill()
    (level, _, msg), = wait_log(daemon, tmp_path, lambda x: x[2].startswith(f"client {cid} (pid") and "gone" in x[2],
                                "the reaper")
    assert level == "WARNING" and "engine 'e'" in msg
