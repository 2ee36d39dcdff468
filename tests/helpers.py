"""Shared test helpers: small layouts, a reference-model replay, byte checks, a rank
running in its own process, raw socket helpers and polling.

Imported by test modules as ``helpers`` (pytest puts ``tests/`` on ``sys.path`` through
``tests/conftest.py``); rank processes start from a forkserver that imported this module
with that path.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import glob
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

from sparsekv.bench.verify import count_mismatches, pattern
from sparsekv.client import Client, DaemonUnavailable, SparseKVError
from sparsekv.daemon.backends import CpuBackend, run_dir_tag
from sparsekv.daemon.pool import HostPool
from sparsekv.daemon.residency.contract import RegionModel
from sparsekv.daemon.server import Daemon
from sparsekv.proto import Layout, decode, encode

PY = sys.executable
# Rank processes fork from a server process (one per test process, started at the first
# rank) that has imported this module and the client once: a rank starts in milliseconds
# instead of the ~0.3 s of CPU of a new interpreter, and inherits none of a test's threads
# or sockets.
RANKS = mp.get_context("forkserver")
RANKS.set_forkserver_preload(["helpers"])
# SPARSEKV_LONG=1 (`make soak`): property tests draw many more examples.
LONG = os.environ.get("SPARSEKV_LONG", "") not in ("", "0")


def examples(default: int, long: int) -> int:
    """A hypothesis ``max_examples``: ``default`` in the everyday suite (seconds on 2
    cores), ``long`` under ``SPARSEKV_LONG=1``."""
    return long if LONG else default


def layout(**kw) -> Layout:
    """A tiny valid layout; keyword arguments override fields."""
    base = dict(num_layers=2, row_bytes=32, top_k=4, region_stride=8, max_reqs=4, host_rows=64)
    base.update(kw)
    return Layout(**base).validate()


@contextlib.contextmanager
def short_tmpdir(prefix: str = "skv-"):
    """A temp dir with a short path: AF_UNIX socket paths must stay under 108 bytes, which
    pytest's ``tmp_path`` (long test names) does not guarantee."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


_KEEP_OPEN: list = []


def soak_worker_loop(open_client, start, work, ev, counts: dict) -> None:
    """The life of a soak worker (tests/soak/chaos_worker.py, chaos_pair.py), for ever:
    ``open_client()`` a client, ``start(client)`` (attach, fill: returns the attachment),
    report "attached" (with the time the loss it recovers from began), then ``work(client,
    att)`` until something fails. A lost daemon is reported once per loss ("lost", with
    ``counts``' checks, rows and bad), any other failure as "error"; the client is closed
    and the loop begins again."""
    lost_at = None
    attaches = 0  # this process's attaches so far (an error event says which one failed)
    while True:
        client = None
        try:
            client = open_client()
            att = start(client)
            attaches += 1
            ev("attached", after_loss=lost_at)
            lost_at = None
            work(client, att)
        except DaemonUnavailable as e:
            if lost_at is None:
                lost_at = time.time()
                ev("lost", msg=str(e)[:200], checks=counts["checks"], rows=counts["rows"], bad=counts["bad"])
        except Exception as e:  # noqa: BLE001 - a failure of the run: record it, carry on
            where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)]
            extra = {"status": e.status} if hasattr(e, "status") else {}  # a CUDA error's code
            attach_mod = sys.modules.get("sparsekv.client.cuda_attach")  # loaded by a cuda rank only
            if attach_mod is not None:  # lost daemons' arenas this process still maps
                extra["arenas_left_mapped"] = len(attach_mod._left_mapped)
            # which daemon answered (alive now?), after how many good attaches and which loss
            dpid = (getattr(client, "info", None) or {}).get("daemon_pid")
            if dpid:
                try:
                    os.kill(dpid, 0)
                    extra["daemon_alive"] = True
                except ProcessLookupError:
                    extra["daemon_alive"] = False
                except PermissionError:
                    extra["daemon_alive"] = True
            extra.update(daemon_pid=dpid, attaches_before=attaches, lost_at=lost_at)
            ev("error", type=type(e).__name__, msg=str(e)[:300], where=where[-8:], **extra)
            time.sleep(0.2)
        finally:
            if client is not None:
                client.close()
        time.sleep(0.02)


def stacks_on_sigusr2(path: str) -> None:
    """A test worker process: ``kill -USR2`` writes its threads' stacks to ``path``."""
    f = open(path, "a")  # noqa: SIM115 - open for the process's life
    _KEEP_OPEN.append(f)
    faulthandler.register(signal.SIGUSR2, file=f, all_threads=True)


def wait_for(pred, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"):
    """Poll ``pred`` until it returns a truthy value; return it, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def request(dm, ident: bytes, msg_type, fields=None, arrays=None, *, req_id: int = 1, peer=None):
    """One request through ``dm.handle`` (a ``Daemon`` driven in this process, no sockets)
    from the connection ``ident``; returns the reply's (header, arrays). ``peer``: the
    connection's credentials (``helpers.peer(pid)``), as the control socket reads them
    when it accepts a connection; None: none (a request from the daemon's own process)."""
    frames = [bytes(f) for f in encode(msg_type, req_id, fields, arrays)]
    return decode([bytes(f) for f in dm.handle(ident, frames, peer=peer)])


def peer(pid: int, uid: int | None = None, gid: int | None = None):
    """The credentials of a connection from process ``pid`` running as ``uid`` / ``gid``
    (this process's when None)."""
    from sparsekv.daemon.peers import Peer
    return Peer(os.getuid() if uid is None else uid, os.getgid() if gid is None else gid, pid, True)


def shm_slabs(run_dir: str, shm_dir: str = "/dev/shm") -> list[str]:
    """The cpu backend's slabs of the daemon serving ``run_dir``: the memfds it holds
    (``memfd:sparsekv-<tag>-<client id>``) and any file of the run dir's prefix in
    ``shm_dir`` (the daemon makes none there: one would be a slab that outlives it)."""
    return sorted(shm_files(run_dir, shm_dir) + slab_memfds(run_dir))


def shm_files(run_dir: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Files of ``run_dir``'s prefix in ``shm_dir``."""
    return glob.glob(os.path.join(shm_dir, f"sparsekv-{run_dir_tag(run_dir)}-*"))


def slab_memfds(run_dir: str, pid: int | None = None) -> list[str]:
    """The names of the memfds of ``run_dir``'s tag that process ``pid`` holds open, once
    each (an ``mmap`` object holds a descriptor of its own) (default: the pid in ``run_dir/sparsekvd.lock``, a daemon's; without that file this
    process's, where an in-process daemon runs)."""
    if pid is None:
        try:
            with open(os.path.join(run_dir, "sparsekvd.lock")) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pid = os.getpid()
    prefix = f"/memfd:sparsekv-{run_dir_tag(run_dir)}-"
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []  # no such process (any more)
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            out.add(target[1:].removesuffix(" (deleted)"))
    return sorted(out)


# -- expected bytes ----------------------------------------------------------------------
def gen_pattern(layer: int, rows, row_bytes: int, gen=None) -> np.ndarray:
    """The bytes of host ``rows`` of ``layer``: the ``--verify`` pattern for generation 0,
    a different pattern for each later generation (rows rewritten by a test)."""
    rows = np.asarray(rows, dtype=np.int64)
    g = np.zeros(rows.shape[0], np.int64) if gen is None else np.asarray(gen, np.int64)[rows]
    out = np.empty((rows.shape[0], row_bytes), np.uint8)
    for v in np.unique(g):
        sel = g == v
        # Layer numbers far beyond any layout give each generation its own bytes.
        out[sel] = pattern(layer + 7919 * int(v), rows[sel], row_bytes)
    return out


def bad_rows(slab, layers, state_rows, topk, slots, host_rows: int, gen=None) -> int:
    """Hot rows (per layer and valid column) whose bytes differ from ``gen_pattern``, plus
    valid columns that got no slot. Like ``bench.verify.count_mismatches``, with
    generations of rewritten rows."""
    bad = 0
    row_bytes = slab.shape[-1]
    for b in np.flatnonzero(np.asarray(state_rows) >= 0):
        ids = np.asarray(topk[b])
        ok = (ids >= 0) & (ids < host_rows)
        bad += int((slots[b][ok] < 0).sum()) * len(layers)
        ok &= slots[b] >= 0
        for layer in layers:
            got = _host(slab[layer, int(state_rows[b]), slots[b][ok]])
            bad += int((got != gen_pattern(layer, ids[ok], row_bytes, gen)).any(axis=1).sum())
    return bad


def _host(rows) -> np.ndarray:
    """Rows read from a slab as NumPy (a torch tensor on the GPU: cuda backend)."""
    return rows if isinstance(rows, np.ndarray) else rows.cpu().numpy()


def bad_rows_between(slab, layers, state_rows, topk, slots, host_rows: int, lo, hi) -> int:
    """``bad_rows`` where a row may hold any generation from ``lo[row]`` to ``hi[row]``
    (rewrites racing the read from another process), plus valid columns with no slot."""
    bad = 0
    row_bytes = slab.shape[-1]
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    for b in np.flatnonzero(np.asarray(state_rows) >= 0):
        ids = np.asarray(topk[b])
        ok = (ids >= 0) & (ids < host_rows)
        bad += int((slots[b][ok] < 0).sum()) * len(layers)
        ok &= slots[b] >= 0
        rows = ids[ok]
        for layer in layers:
            got = _host(slab[layer, int(state_rows[b]), slots[b][ok]])
            wrong = (got != gen_pattern(layer, rows, row_bytes, lo)).any(axis=1)
            for i in np.flatnonzero(wrong):
                r = rows[i : i + 1]
                for g in range(int(lo[r[0]]) + 1, int(hi[r[0]]) + 1):
                    if (got[i] == gen_pattern(layer, r, row_bytes, np.full(host_rows, g))[0]).all():
                        wrong[i] = False
                        break
            bad += int(wrong.sum())
    return bad


def fill(client, lay: Layout, gen=None) -> None:
    """Write ``gen_pattern`` into every host row of every layer through ``client.write``."""
    rows = np.arange(lay.host_rows, dtype=np.int32)
    client.write(rows, np.stack([gen_pattern(layer, rows, lay.row_bytes, gen) for layer in range(lay.num_layers)]))


# -- the reference model driven like a replay ---------------------------------------------
def reference_replay(trace) -> tuple[np.ndarray, np.ndarray]:
    """Replay ``trace`` (one index group) through ``RegionModel``: returns (slots, misses)
    as the contract says they must be. Order within a step as the engine documents:
    resets, then invalidations, then the batch rows' top-k in batch order."""
    regions = [RegionModel(trace.region_stride) for _ in range(trace.max_reqs)]
    slots = np.full(trace.topk.shape, -1, np.int32)
    misses = np.zeros(trace.topk.shape[:2], np.int32)
    for t in range(trace.steps):
        rows = trace.state_rows[t]
        for b in np.flatnonzero(trace.reset[t] & (rows >= 0)):
            regions[rows[b]].reset()
        for b in np.flatnonzero(rows >= 0):
            inval = trace.invalidate[t, b]
            regions[rows[b]].invalidate([int(r) for r in inval if r >= 0])
        for b in np.flatnonzero(rows >= 0):
            s, plan, _ = regions[rows[b]].resolve(trace.topk[t, b], trace.host_rows)
            slots[t, b] = s
            misses[t, b] = len(plan)
    return slots, misses


# -- one engine rank in its own process ------------------------------------------------
def _rank_server(conn, run_dir: str, rank: int, name: str) -> None:
    """Child process: one Client, driven by commands from the test over ``conn``. Every
    byte check happens here, on this process's own mapping of its hot slab."""
    client = Client(run_dir, rank=rank, name=name, timeout_s=20)
    att = None
    gen = None
    step_rows = np.empty(0, np.int32)
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                client.close()
                conn.send(("ok", None))
                return
            if cmd == "connect":
                client.connect()
                out = {"pid": os.getpid(), "client_id": client.info["client_id"]}
            elif cmd == "attach":
                att = client.attach(Layout.from_wire(args["layout"]), engine=args["engine"],
                                    tp_size=args.get("tp_size", 1))
                gen = np.zeros(att.layout.host_rows, np.int64)
                out = {"slab_shape": list(att.slab.shape)}
            elif cmd == "fill":
                fill(client, att.layout, gen)
                out = None
            elif cmd == "write":  # rewrite rows with the next generation of bytes
                rows = np.asarray(args["rows"], np.int32)
                layers = args.get("layers")
                new_gen = gen.copy()
                new_gen[rows] += 1
                lays = range(att.layout.num_layers) if layers is None else layers
                data = np.stack([gen_pattern(layer, rows, att.layout.row_bytes, new_gen) for layer in lays])
                out = client.write(rows, data, layers)
                gen = new_gen
            elif cmd == "gen":  # another rank rewrote rows: expect their new bytes
                gen[np.asarray(args["rows"])] += 1
                out = None
            elif cmd == "step":
                client.step(args["step"], args["state_rows"], args.get("reset"), args.get("invalidate"))
                step_rows = np.asarray(args["state_rows"])
                out = None
            elif cmd == "topk":
                r = client.topk(args["step"], args["group"], args["topk"], args.get("state_rows"))
                state_rows = args.get("state_rows")
                state_rows = step_rows if state_rows is None else state_rows
                layers = att.layout.groups[args["group"]]
                topk = np.asarray(args["topk"])
                bad = bad_rows(att.slab, layers, np.asarray(state_rows), topk, r.slots, att.layout.host_rows, gen)
                if not gen.any():  # nothing rewritten: the project's own --verify check applies too
                    bad += count_mismatches(att.slab, layers, np.asarray(state_rows), topk, r.slots,
                                            att.layout.host_rows)
                out = {"slots": np.array(r.slots), "misses": np.array(r.misses), "hits": r.hits,
                       "out_of_range": r.out_of_range, "bad": bad}
            elif cmd == "stage":
                nbytes = client.stage(args["rows"], args.get("layers"))
                rows = np.asarray(args["rows"])
                lays = range(att.layout.num_layers) if args.get("layers") is None else args["layers"]
                out = {"bytes": nbytes,
                       "staged_ok": all(np.array_equal(att.staging[layer, : rows.size],
                                                       gen_pattern(layer, rows, att.layout.row_bytes, gen))
                                        for layer in lays),
                       "staging": np.array(att.staging)}
            elif cmd == "detach":
                client.detach()
                att = None
                out = None
            elif cmd == "stats":
                out = client.stats()
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", out))
        except SparseKVError as e:
            conn.send(("err", {"type": type(e).__name__, "code": e.code.name, "msg": e.args[0]}))
        except Exception as e:  # noqa: BLE001 - report, keep serving
            conn.send(("exc", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class RankError(Exception):
    def __init__(self, info: dict):
        super().__init__(f"{info['type']} {info['code']}: {info['msg']}")
        self.type, self.code, self.msg = info["type"], info["code"], info["msg"]


class RankProc:
    """A TP rank in a process of its own; ``call`` runs one command there and returns its
    result, raises :class:`RankError` for a typed client error."""

    def __init__(self, run_dir: str, rank: int, name: str = ""):
        self.conn, child = RANKS.Pipe()
        self.proc = RANKS.Process(target=_rank_server, args=(child, run_dir, rank, name or f"rank{rank}"),
                                  daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid

    def call(self, cmd: str, timeout_s: float = 30.0, **args):
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"rank process did not answer {cmd!r} within {timeout_s} s")
        status, out = self.conn.recv()
        if status == "err":
            raise RankError(out)
        if status == "exc":
            raise AssertionError(f"rank process failed on {cmd!r}: {out}")
        return out

    def kill(self) -> None:
        """SIGKILL, then reap it (a zombie still looks alive to ``psutil``)."""
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except Exception:  # noqa: BLE001 - kill below
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


# -- sockets and commands ----------------------------------------------------------------
def stats_query(run_dir: str, command: str, timeout_s: float = 5.0) -> str:
    """One request on the stats socket; returns the whole answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(os.path.join(run_dir, "stats.sock"))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while b := s.recv(65536):
            chunks.append(b)
        return b"".join(chunks).decode()
    finally:
        s.close()


def stats_json(run_dir: str) -> dict:
    return json.loads(stats_query(run_dir, "json"))


def run_cli(*args, env=None, timeout_s: float = 60.0, module: str = "sparsekv.cli.main") -> subprocess.CompletedProcess:
    """Run ``python -m MODULE ARGS`` and capture its output."""
    return subprocess.run([PY, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


@contextlib.contextmanager
def inproc_daemon(path, max_clients: int = 3, pool_bytes: int = 8 << 20, **daemon_kw):
    """A ``Daemon`` on the cpu backend driven in this process through ``handle()`` (no
    sockets; ``request`` sends it one), with its run dir and shared-memory files under
    ``path``; every session detached and everything closed afterwards."""
    pool = HostPool(pool_bytes, threads=1)
    backend = CpuBackend(str(path), shm_dir=str(path))
    d = Daemon(str(path), backend, pool, max_clients=max_clients, **daemon_kw)
    try:
        yield d
    finally:
        for s in list(d.sessions.values()):
            d.sessions.detach(s)
        backend.close()
        pool.close()


@contextlib.contextmanager
def serving_daemon(pool_bytes: int = 8 << 20, backend_cls=None, before_stop=None, join_s: float = 10.0, **daemon_kw):
    """A ``Daemon`` (cpu backend, or ``backend_cls(run_dir, shm_dir=run_dir)``) serving a
    short run dir from a thread of this process, its sockets real. Yields it with
    ``thread``, ``box`` (``loop``, and ``error`` if serving failed) and ``call_soon(fn)``
    (run ``fn`` on its loop). Stopped after (``before_stop()`` first, if given), then its
    backend and pool closed."""
    with short_tmpdir() as run_dir:
        pool = HostPool(pool_bytes, threads=1)
        backend = (backend_cls or CpuBackend)(run_dir, shm_dir=run_dir)
        d = Daemon(run_dir, backend, pool, **daemon_kw)
        ready, box = threading.Event(), {}

        async def run():
            box["loop"] = asyncio.get_running_loop()
            await d.serve(on_ready=ready.set)

        def thread():
            try:
                asyncio.run(run())
            except BaseException as e:  # noqa: BLE001 - reported by the test
                box["error"] = e
                ready.set()

        t = threading.Thread(target=thread, daemon=True)
        t.start()
        assert ready.wait(10) and "error" not in box, box
        d.thread, d.box = t, box
        d.call_soon = lambda fn: box["loop"].call_soon_threadsafe(fn)
        try:
            yield d
        finally:
            if before_stop is not None:
                before_stop(d)
            if t.is_alive():
                d.call_soon(d.stop)
                t.join(join_s)
            backend.close()
            pool.close()


# -- clients as other users (root, setpriv) -------------------------------------------------
def as_user(uid: int | None, groups=()) -> list[str]:
    """The command prefix that runs a program as ``uid`` (its gid the same number, only
    ``groups`` as supplementary groups); nothing for None. ``setpriv`` execs in place, so
    the process keeps the pid the test sees."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"]


@functools.cache
def why_not_other_users() -> str | None:
    """Why clients cannot be run as other users here, or None (then they can). Asked once
    a process: the answer takes a process of its own."""
    if os.geteuid() != 0:
        return "needs root to run clients as other users"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux)"
    r = subprocess.run([*as_user(65534), sys.executable, "-c", "import zmq, sparsekv.proto"], cwd="/tmp",
                       capture_output=True)
    return None if r.returncode == 0 else "this interpreter cannot run as another user"


def open_to_other_users(run_dir: str, *names: str) -> None:
    """Let other users reach a private daemon's sockets (its run dir is 0700), as the
    daemon's group may in a deployment."""
    os.chmod(run_dir, 0o755)
    for name in names or ("control.sock",):
        os.chmod(os.path.join(run_dir, name), 0o666)


# The start of a script that speaks the wire protocol by hand (no Client): a DEALER on
# ``run_dir``'s control socket (the script sets ``run_dir`` first) and ``call(type,
# fields)``, one request and its reply header.
RAW_CALL = r"""
import zmq
from sparsekv.proto import decode, encode
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(f"ipc://{run_dir}/control.sock")
def call(t, fields):
    s.send_multipart(encode(t, 1, fields))
    if not s.poll(10000):
        raise SystemExit("no reply")
    return decode(s.recv_multipart())[0]
"""

RAW_CLIENT = r"""
import json, sys
from sparsekv.proto import MsgType
run_dir, claimed, steps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
""" + RAW_CALL + r"""
print(json.dumps(call(MsgType.HELLO, {"pid": claimed, "rank": 0, "device": "cpu", "name": "raw"})), flush=True)
for engine, layout, *more in steps:
    print(json.dumps(call(MsgType.ATTACH, {"engine": engine, "layout": layout, **(more[0] if more else {})})),
          flush=True)
sys.stdin.read()  # until the test closes stdin or kills us
"""


def raw_client(run_dir, claimed_pid, steps, uid=None, groups=()):
    """A process (as ``uid``) that says HELLO (claiming ``claimed_pid``) and ATTACHes
    ``steps`` ([engine, layout wire] or [engine, layout wire, more fields]) over the control socket, then waits until its stdin
    closes; returns (process, replies): the HELLO's and each ATTACH's reply."""
    p = subprocess.Popen([*as_user(uid, groups), sys.executable, "-c", RAW_CLIENT, run_dir, str(claimed_pid),
                          json.dumps(steps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/tmp")
    replies = []
    for _ in range(1 + len(steps)):
        line = p.stdout.readline()
        assert line, f"raw client exited with {p.wait()}"
        replies.append(json.loads(line))
    return p, replies


def registry_attach(reg, *args, **kw):
    """An attach in one call, as the daemon runs it: begin_attach, prepare, commit (abort on error)."""
    p = reg.begin_attach(*args, **kw)
    try:
        reg.prepare(p)
        return reg.commit(p)
    except BaseException:
        reg.abort(p)
        raise


def vm(pid: int, key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of process ``pid`` in bytes (``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "dsa_decode")


def load_example(name: str):
    """Module ``name`` of examples/dsa_decode (not a package: loaded from its file; it
    needs torch)."""
    spec = importlib.util.spec_from_file_location(f"dsa_decode_{name}", os.path.join(EXAMPLE_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
