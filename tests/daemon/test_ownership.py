"""Engines belong to their creator: an engine records the uid and gid the kernel reported
for its first rank; another rank joins as the same uid, or, as root or a member of the
daemon's admin group (``Daemon(admin_gid=...)``), only when its ATTACH names the owner
(``owner_uid``): a privileged engine never trusts rows another user planted under a name
it took first. Anyone else gets PERMISSION_DENIED, whatever layout it sends, and the
message names neither the owner nor the layout; the owner (and root naming it) still get
LAYOUT_MISMATCH with the layout. Requests that act on an engine (STEP, TOPK, WRITE, STAGE)
reach only the sender's own attachment."""

import contextlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import helpers
from helpers import request
from sparsekv.daemon import sessions as sessions_mod
from sparsekv.daemon.engine import Owner
from sparsekv.daemon.peers import process_groups
from sparsekv.proto import ERROR_HINTS, ErrorCode, MsgType

ADMIN = 4242


@pytest.fixture
def make_dm(tmp_path):
    """``make_dm(admin_gid)``: an in-process daemon (helpers.inproc_daemon), closed after."""
    with contextlib.ExitStack() as stack:
        yield lambda admin_gid=None: stack.enter_context(helpers.inproc_daemon(tmp_path, admin_gid=admin_gid))


@pytest.fixture
def dm(make_dm):
    return make_dm(admin_gid=ADMIN)


@pytest.fixture
def proc():
    """A live process to stand for a client (its pid is what the kernel reports)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def connect(dm, ident, pid, uid, gid=None):
    """HELLO from process ``pid`` running as ``uid`` / ``gid`` (gid = uid when None)."""
    gid = uid if gid is None else gid
    h, _ = request(dm, ident, MsgType.HELLO, {"pid": pid, "rank": 0, "device": "cpu", "name": ""},
                   peer=helpers.peer(pid, uid, gid))
    assert h["ok"], h
    return dm.sessions[ident]


def attach(dm, ident, engine="e", owner_uid=None, **kw):
    fields = {"engine": engine, "layout": helpers.layout(**kw).to_wire()}
    if owner_uid is not None:
        fields["owner_uid"] = owner_uid
    return request(dm, ident, MsgType.ATTACH, fields)[0]


def assert_denied(h):
    assert h["ok"] is False and h["code"] == int(ErrorCode.PERMISSION_DENIED), h
    assert ERROR_HINTS[ErrorCode.PERMISSION_DENIED] in h["msg"]
    said = h["msg"].split(" (")[0]  # what the daemon says of this engine, before the hint
    assert "1000" not in said and "top_k" not in said and "region_stride" not in said, said


def test_engine_records_the_uid_and_gid_of_its_creator(dm, proc):
    connect(dm, b"A", proc.pid, 1000, 100)
    assert attach(dm, b"A")["ok"]
    assert dm.engines.space("e").owner == Owner(1000, 100)


def test_same_uid_joins_another_uid_is_denied_whatever_the_layout(dm, proc):
    connect(dm, b"A", proc.pid, 1000)
    assert attach(dm, b"A")["ok"]
    connect(dm, b"B", proc.pid, 1000, 555)  # same uid, another primary group
    assert attach(dm, b"B")["ok"]
    connect(dm, b"C", proc.pid, 2000)
    used = dm.pool.used_bytes
    same, other = attach(dm, b"C"), attach(dm, b"C", top_k=2)
    assert_denied(same)
    assert_denied(other)
    # indistinguishable: the same code and words whatever the stranger's layout
    assert same["msg"] == other["msg"]
    assert dm.sessions[b"C"].state is None and len(dm.engines.space("e").ranks) == 2
    assert dm.pool.used_bytes == used
    assert len(helpers.shm_slabs(dm.run_dir, dm.run_dir)) == 2  # no slab for the refused rank
    assert dm.snapshot()["errors_by_code"] == {"PERMISSION_DENIED": 2}
    assert attach(dm, b"C", engine="mine", top_k=2)["ok"]  # its own engine, any layout


def test_owner_still_gets_layout_mismatch_with_the_layout(dm, proc):
    connect(dm, b"A", proc.pid, 1000)
    connect(dm, b"B", proc.pid, 1000)
    assert attach(dm, b"A")["ok"]
    h = attach(dm, b"B", top_k=2)
    assert h["code"] == int(ErrorCode.LAYOUT_MISMATCH) and "top_k" in h["msg"], h


def test_root_joins_another_users_engine_only_naming_its_owner(dm, proc):
    connect(dm, b"A", proc.pid, 1000)
    assert attach(dm, b"A")["ok"]
    connect(dm, b"R", proc.pid, 0)
    # A name another user took first is not joined by accident (its rows and cached blocks
    # are that user's): refused, naming the owner to root, and nothing changed.
    h = attach(dm, b"R")
    assert h["code"] == int(ErrorCode.PERMISSION_DENIED) and "owner_uid=1000" in h["msg"], h
    h = attach(dm, b"R", owner_uid=2000)
    assert h["code"] == int(ErrorCode.PERMISSION_DENIED) and "belongs to uid 1000, not uid 2000" in h["msg"], h
    assert dm.sessions[b"R"].state is None and len(dm.engines.space("e").ranks) == 1
    h = attach(dm, b"R", owner_uid=1000, top_k=2)
    assert h["code"] == int(ErrorCode.LAYOUT_MISMATCH) and "top_k" in h["msg"]  # root may see it
    assert attach(dm, b"R", owner_uid=1000)["ok"]


def test_owner_uid_must_be_the_owner_of_an_engine_or_of_a_new_one(dm, proc):
    connect(dm, b"A", proc.pid, 1000)
    assert attach(dm, b"A", owner_uid=1000)["ok"]  # its own new engine, named as such
    connect(dm, b"B", proc.pid, 1000)
    h = attach(dm, b"B", owner_uid=0)
    assert h["code"] == int(ErrorCode.PERMISSION_DENIED) and "attach without owner_uid" in h["msg"], h
    h = attach(dm, b"B", engine="new", owner_uid=2000)  # would be uid 1000's, not 2000's
    assert h["code"] == int(ErrorCode.BAD_ARGUMENT) and "does not exist" in h["msg"], h
    assert "new" not in dm.engines
    for bad in (-1, 1 << 32, "1000", 1.0, True):
        h = attach(dm, b"B", owner_uid=bad)
        assert h["code"] == int(ErrorCode.BAD_ARGUMENT) and "owner_uid must be a uid" in h["msg"], (bad, h)
    # A stranger naming the owner gets nothing more than without it.
    connect(dm, b"C", proc.pid, 2000)
    assert_denied(attach(dm, b"C", owner_uid=1000))


def test_admin_group_as_primary_gid_joins(dm, proc):
    connect(dm, b"A", proc.pid, 1000)
    assert attach(dm, b"A")["ok"]
    connect(dm, b"M", proc.pid, 3000, ADMIN)
    assert attach(dm, b"M")["code"] == int(ErrorCode.PERMISSION_DENIED)
    assert attach(dm, b"M", owner_uid=1000)["ok"]


def test_admin_group_as_supplementary_group_joins(dm, proc, monkeypatch):
    seen = []

    def groups(pid):
        seen.append(pid)
        return frozenset({7, ADMIN}) if pid == proc.pid else frozenset()

    monkeypatch.setattr(sessions_mod, "process_groups", groups)
    connect(dm, b"A", proc.pid, 1000)
    assert attach(dm, b"A")["ok"]
    connect(dm, b"M", proc.pid, 3000, 3000)
    assert attach(dm, b"M", owner_uid=1000)["ok"] and seen == [proc.pid]


def test_without_an_admin_group_nobody_else_joins(make_dm, proc):
    dm = make_dm(admin_gid=None)
    connect(dm, b"A", proc.pid, 1000)
    assert attach(dm, b"A")["ok"]
    connect(dm, b"M", proc.pid, 3000, ADMIN)
    assert_denied(attach(dm, b"M", owner_uid=1000))
    connect(dm, b"R", proc.pid, 0)
    assert attach(dm, b"R", owner_uid=1000)["ok"]


def test_supplementary_groups_are_not_trusted_once_the_process_is_gone(dm, monkeypatch):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        connect(dm, b"A", os.getpid(), 1000)
        assert attach(dm, b"A")["ok"]
        connect(dm, b"M", p.pid, 3000)
        p.kill()
        p.wait()
        # /proc would now describe whatever process took the pid: never trusted
        monkeypatch.setattr(sessions_mod, "process_groups", lambda pid: frozenset({ADMIN}))
        assert dm.sessions[b"M"].watch.exited()
        assert_denied(attach(dm, b"M"))
    finally:
        p.kill()
        p.wait()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_admin_group_is_read_from_the_real_process(dm):
    """A real process of uid 3000 with the admin group only as a supplementary group."""
    p = subprocess.Popen(["setpriv", "--reuid=3000", "--regid=3000", f"--groups={ADMIN}", "sleep", "120"])
    try:
        helpers.wait_for(lambda: process_groups(p.pid) == {ADMIN}, what="setpriv to set the child's groups")
        connect(dm, b"A", os.getpid(), 1000)
        assert attach(dm, b"A")["ok"]
        connect(dm, b"M", p.pid, 3000)
        assert attach(dm, b"M", owner_uid=1000)["ok"]
    finally:
        p.kill()
        p.wait()


def test_requests_reach_only_the_senders_own_attachment(dm, proc):
    lay = helpers.layout()
    connect(dm, b"A", proc.pid, 1000)
    assert attach(dm, b"A", engine="a")["ok"]
    a_pool = dm.engines.space("a").pool
    rows = np.arange(4, dtype=np.int32)
    data = np.full((lay.num_layers, 4, lay.row_bytes), 0xAB, np.uint8)
    assert request(dm, b"A", MsgType.WRITE, {"layers": None}, {"rows": rows, "data": data})[0]["ok"]
    connect(dm, b"B", proc.pid, 2000)
    # not attached: nothing of anyone else's engine is reachable
    for t, fields, arrays in (
        (MsgType.WRITE, {"layers": None}, {"rows": rows, "data": np.zeros_like(data)}),
        (MsgType.STEP, {"step": 0}, {"state_rows": np.array([0], np.int32)}),
        (MsgType.TOPK, {"step": 0, "group": 0}, {"topk": rows[None, :]}),
        (MsgType.STAGE, {"layers": None}, {"rows": rows}),
    ):
        h, _ = request(dm, b"B", t, fields, arrays)
        assert h["code"] == int(ErrorCode.NOT_ATTACHED), h
    # attached to its own engine: it reads and writes only that engine's rows
    assert attach(dm, b"B", engine="b")["ok"]
    assert request(dm, b"B", MsgType.WRITE, {"layers": None}, {"rows": rows, "data": np.zeros_like(data)})[0]["ok"]
    assert (a_pool[:, :4] == 0xAB).all()
    assert request(dm, b"B", MsgType.STEP, {"step": 0}, {"state_rows": np.array([0], np.int32)})[0]["ok"]
    h, arrays = request(dm, b"B", MsgType.TOPK, {"step": 0, "group": 0}, {"topk": rows[None, :]})
    assert h["ok"] and arrays["misses"][0] == 4
    b_slab = dm.sessions[b"B"].state.slab
    assert not (b_slab == 0xAB).any()


def test_an_attach_refused_for_its_owner_uid_releases_no_kept_engine(make_dm, proc):
    """A new name with another uid's owner_uid is refused before make_room: it released
    other users' kept engines (their cached blocks) first, on every retry."""
    dm = make_dm(admin_gid=None)
    small = helpers.layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=2, host_rows=64)
    connect(dm, b"V", proc.pid, 2000)
    h = request(dm, b"V", MsgType.ATTACH, {"engine": "victim", "layout": small.to_wire(), "blocks": {"block_size": 4}})[0]
    assert h["ok"], h
    h, a = request(dm, b"V", MsgType.BLOCK_ALLOC, {"n": 1})
    assert h["ok"], h
    h = request(dm, b"V", MsgType.BLOCK_COMMIT, {}, {"blocks": a["blocks"], "hashes": np.array([[7, 7]], np.int64)})[0]
    assert h["ok"], h
    assert request(dm, b"V", MsgType.DETACH)[0]["ok"]
    assert "victim" in dm.engines  # kept for its cached block
    big = helpers.layout(num_layers=2, row_bytes=16, top_k=4, region_stride=8, max_reqs=2,
                         host_rows=dm.pool.size_bytes // 32 - 1024)  # fits only once the victim's range is free
    connect(dm, b"A", proc.pid, 1000)
    h = request(dm, b"A", MsgType.ATTACH, {"engine": "new", "layout": big.to_wire(), "owner_uid": 3000})[0]
    assert h["code"] == int(ErrorCode.BAD_ARGUMENT) and "does not exist" in h["msg"], h
    assert "victim" in dm.engines and "new" not in dm.engines


def test_fence_events_must_be_a_list_of_event_handles(dm, proc):
    """Found by an adversarial review: junk fence_events ([b"x"]) were answered ok on the cpu
    backend (which has no use for them) and would reach cudaIpcOpenEventHandle on cuda."""
    connect(dm, b"A", proc.pid, 1000)
    fields = {"engine": "e", "layout": helpers.layout().to_wire()}
    for bad in ([b"x"], [], b"\0" * 64, [b"\0" * 64] * 257, [b"\0" * 64, "h"], [b"\0" * 65]):
        h = request(dm, b"A", MsgType.ATTACH, {**fields, "fence_events": bad})[0]
        assert h["code"] == int(ErrorCode.BAD_ARGUMENT) and "fence_events must be a list of 1 to 256" in h["msg"], \
            (bad, h)
    assert dm.sessions[b"A"].state is None
    assert request(dm, b"A", MsgType.ATTACH, {**fields, "fence_events": [b"\0" * 64] * 16})[0]["ok"]  # cpu: ignored
