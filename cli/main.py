"""``sparsekv``: the user command line (stats, clients, blocks, top, health, replay, trace synth,
demo, bench).

A common mistake (no daemon, a wrong run dir, a pool too small for a layout, no
permission on a socket) ends the command with one line on stderr and a non-zero exit,
never a traceback: :func:`main` turns those errors into that line. Output piped to a
reader that leaves (``sparsekv top | head``) ends the command silently with 141, as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import time
from importlib import metadata

from sparsekv.bench.bench import add_arguments as add_bench_arguments
from sparsekv.bench.bench import output_problem
from sparsekv.bench.bench import run_args as run_bench_args
from sparsekv.bench.replay import replay, save_result
from sparsekv.bench.synth import synth
from sparsekv.bench.trace import Trace
from sparsekv.client.client import default_run_dir
from sparsekv.client.errors import BadRequest, SparseKVError
from sparsekv.proto import LIMITS
from sparsekv.proto.cpus import CpuWarmer, check_cpus_usable, format_cpu_list, parse_cpu_list
from sparsekv.proto.settings import SettingError, parse_dir
from .demo import DEFAULTS as DEMO_DEFAULTS, format_table, run_demo
from .health import StatsSocketError, exit_code, probe, stats_query
from .progress import Progress
from .top import parse_clients, run_top


class UsageError(ValueError):
    """A bad argument: the command exits 2 with this message."""


class Terminated(BaseException):
    """SIGTERM: unwinds like Ctrl-C, so a private daemon and demo ranks are stopped."""


def _version() -> str:
    try:
        return metadata.version("sparsekv")
    except metadata.PackageNotFoundError:
        return "unknown"


def run_dir_path(text: str) -> str:
    """``--run-dir`` as the daemon reads its run dir (``parse_dir``): ``~`` expanded, absolute;
    empty refused."""
    try:
        return parse_dir(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_output(path: str, what: str = "--out", replaced: bool = True) -> None:
    """Refuse, before any work, an output path that cannot be written (``output_problem``)."""
    why = output_problem(path, what, replaced)
    if why:
        raise UsageError(why)


MAX_SECONDS = 86400.0  # --timeout-s / --interval-s: at most a day (a socket timeout or sleep past ~1e10 s overflows)


def seconds(text: str) -> float:
    """An argparse type: a number of seconds in (0, :data:`MAX_SECONDS`]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds is needed, got {text!r}") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"a number of seconds in (0, {MAX_SECONDS:g}] is needed, got {text!r}")
    return value


def rank_count(text: str) -> int:
    """``--ranks``: a whole number of ranks in [1, LIMITS.max_tp_size]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of ranks is needed, got {text!r}") from None
    if not 1 <= value <= LIMITS.max_tp_size:
        raise argparse.ArgumentTypeError(f"ranks must lie in [1, {LIMITS.max_tp_size}], got {value}")
    return value


def cmd_stats(a) -> int:
    what = "json" if a.json else "prometheus" if a.prometheus else "stats"
    sys.stdout.write(stats_query(a.run_dir, what, a.timeout_s))
    return 0


FREE_TEXT = ("name", "engine", "device")  # columns of the clients / blocks tables a client names: always text


def _json_value(key: str, text: str):
    """A cell of the clients or blocks table as JSON: ``attached`` as a boolean, ``-``
    (none) as null except in ``name``, where it is the empty name, the rest of the text a
    client chose (:data:`FREE_TEXT`) as it is, decimal numbers elsewhere as numbers."""
    if key == "attached":
        return text == "yes"
    if text == "-":  # (no engine, device or name is "-": proto.args.engine_name, hello_text)
        return "" if key == "name" else None
    if key in FREE_TEXT:
        return text
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else text


def cmd_clients(a) -> int:
    """``clients`` and ``blocks``: the stats socket's table, or a JSON list of its lines."""
    text = stats_query(a.run_dir, a.table, a.timeout_s)
    if a.json:
        clients = [{k: _json_value(k, v) for k, v in c.items()} for c in parse_clients(text)]
        text = json.dumps(clients) + "\n"
    sys.stdout.write(text)
    return 0


def cmd_top(a) -> int:
    return run_top(a.run_dir, a.interval_s, once=a.once, timeout_s=a.timeout_s)


def cmd_health(a) -> int:
    h = probe(a.run_dir, a.timeout_s)
    code = exit_code(h, a.live)
    if not a.quiet:
        print(h.message, file=sys.stdout if code == 0 else sys.stderr)
    return code


def cmd_warm_cpus(a) -> int:
    """Keep CPUs from halting until SIGTERM or SIGINT (proto/cpus.py CpuWarmer): for the
    client side of deploy/README.md "Warm CPUs" where the daemon cannot (another pod's
    cpuset), or as a systemd unit of its own (deploy/sparsekv-warm-cpus@.service)."""
    try:  # exit 1, as for a CPU the loops cannot run on
        cpus = parse_cpu_list(a.cpus, "CPUS")
    except ValueError as e:
        return _fail("sparsekv warm-cpus", str(e))
    if not cpus:
        return _fail("sparsekv warm-cpus", "CPUS: name at least one CPU (e.g. 62 or 62-63)")
    try:  # before CpuWarmer.start, which names the daemon's warm_cpus setting
        check_cpus_usable(cpus, "CPUS")
    except ValueError as e:
        return _fail("sparsekv warm-cpus", str(e))
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    with CpuWarmer(cpus) as w:
        print(f"sparsekv warm-cpus: CPU(s) {format_cpu_list(cpus)} kept warm (pids "
              f"{' '.join(map(str, w.pids))}); SIGTERM or Ctrl-C stops", flush=True)
        while not stop:
            if w.running() < len(cpus) and not stop:  # (systemctl stop signals the loops too)
                raise RuntimeError(f"a loop exited ({w.running()} of {len(cpus)} left)")
            time.sleep(0.5)
    return 0


def cmd_replay(a) -> int:
    if a.transport == "inproc" and (a.connect or a.daemon_log or a.ranks > 1):
        what = "--connect" if a.connect else "--daemon-log" if a.daemon_log else "--ranks"
        raise UsageError(f"{what} needs a daemon: add --transport zmq or doorbell")
    if a.tp and a.ranks < 2:
        raise UsageError("--tp needs --ranks 2 or more")
    check_output(a.out)
    if _same_file(a.out, a.trace):
        raise UsageError(f"--out {a.out} is the trace being replayed; name another file")
    if a.daemon_log:
        if a.connect:
            raise UsageError("--daemon-log is the private daemon's log: with --connect there is none")
        check_output(a.daemon_log, "--daemon-log", replaced=False)
        for other, name in ((a.trace, "the trace being replayed"), (a.out, "--out")):
            if _same_file(a.daemon_log, other):
                raise UsageError(f"--daemon-log {a.daemon_log} is {name}; name another file")
    trace = Trace.load(a.trace)
    bar = None if a.quiet else Progress("replay", trace.steps)
    summary, result = replay(trace, transport=a.transport, backend=a.backend, verify=a.verify, connect=a.connect,
                             daemon_log=a.daemon_log, slab=a.slab, prefetch=a.prefetch, ranks=a.ranks, tp=a.tp,
                             progress=bar and bar.update)
    if bar:
        bar.close()
    save_result(a.out, result)
    print(json.dumps(summary))  # the last line: the summary
    return 1 if ((a.verify and summary["mismatched_rows"]) or summary["guard_bytes_changed"]
                 or summary.get("ranks_differing")) else 0


SYNTH_KEYS = ("steps", "batch", "top_k", "region_stride", "max_reqs", "host_rows", "row_bytes", "num_layers",
              "overlap", "context", "lifetime", "arrive", "pad", "invalidate", "out_of_range", "share_prefix",
              "block_size", "spec", "seed")


def cmd_trace_synth(a) -> int:
    check_output(a.out)
    bar = None if a.quiet else Progress("trace synth", a.steps)
    tr = synth(**{k: getattr(a, k) for k in SYNTH_KEYS}, progress=bar and bar.update)
    if bar:
        bar.close()
    tr.save(a.out)
    live = tr.state_rows >= 0
    print(json.dumps({"out": a.out, "steps": tr.steps, "batch": tr.batch, "top_k": tr.top_k,
                      "live_rows": int(live.sum()), "resets": int(tr.reset.sum()),
                      "invalidations": int((tr.invalidate >= 0).sum()), "block_size": tr.block_size}))
    return 0


def cmd_demo(a) -> int:
    if a.steps < 1:
        raise UsageError("--steps must be >= 1")
    s = run_demo(backend=a.backend, steps=a.steps, progress=not a.quiet)
    sys.stdout.write(format_table(s))
    return 1 if s["mismatched_rows"] else 0


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr (and exit 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help (unless the help already says it, or
    the option is required, a switch, or has no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.required or any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sparsekv", description="sparsekv user commands", formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"sparsekv {_version()}", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)

    def run_dir_arg(q, timeout_s: float = 5.0):
        q.add_argument("--run-dir", default=default_run_dir(), type=run_dir_path,
                       help="the daemon's run dir ($SPARSEKV_RUN_DIR, else $RUNTIME_DIRECTORY, else /run/sparsekv)")
        q.add_argument("--timeout-s", type=seconds, default=timeout_s, metavar="S",
                       help="give up when the daemon has not answered after this many seconds")

    q = command("stats", "counters of a running daemon")
    run_dir_arg(q)
    g = q.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    g.add_argument("--prometheus", action="store_true", help="Prometheus text exposition format")
    q.set_defaults(fn=cmd_stats)

    q = command("clients", "one line per connected client")
    run_dir_arg(q)
    q.add_argument("--json", action="store_true", help="a JSON list of clients (one object each) instead of the table")
    q.set_defaults(fn=cmd_clients, table="clients")

    q = command("blocks", "one line per engine with a block store: its block size and indexer key bytes, its blocks "
                "free, cached, referenced, evictable, private and reserved (DESIGN §9)")
    run_dir_arg(q)
    q.add_argument("--json", action="store_true", help="a JSON list of engines (one object each) instead of the table")
    q.set_defaults(fn=cmd_clients, table="blocks")

    q = command("top", "a live view of a running daemon: rates per second, latency, pool, clients")
    run_dir_arg(q)
    q.add_argument("--interval-s", type=seconds, default=1.0, metavar="S", help="seconds between frames")
    q.add_argument("--once", action="store_true", help="print one frame (after one interval) and exit")
    q.set_defaults(fn=cmd_top)

    q = command("health", "probe a daemon: exit 0 ready, 1 alive but not ready (starting), 2 unreachable")
    run_dir_arg(q, timeout_s=1.0)
    q.add_argument("--live", action="store_true",
                   help="liveness: exit 0 also while the daemon starts (pre-faulting its pool)")
    q.add_argument("--quiet", action="store_true", help="print nothing; the exit code says it all")
    q.set_defaults(fn=cmd_health)

    q = command("warm-cpus", "keep CPUs from halting (an idle-priority busy loop each) until stopped; "
                             "deploy/README.md \"Warm CPUs\"")
    q.add_argument("cpus", metavar="CPUS", help="CPU list, e.g. 62 or 62-63 or 2,5")
    q.set_defaults(fn=cmd_warm_cpus)

    q = command("replay", "drive the stack with a recorded trace")
    q.add_argument("trace", metavar="TRACE.npz",
                   help="a trace file, host rows or positions (sparsekv trace synth, DESIGN §6, docs/TRACES.md)")
    q.add_argument("--out", required=True, metavar="RESULT.npz", help="where to write the slots and misses")
    q.add_argument("--transport", choices=["inproc", "zmq", "doorbell"], default="inproc",
                   help="inproc: the engine in this process (cpu); zmq: a daemon over its socket; doorbell: a "
                        "daemon driven from the GPU through the engine's handle (needs --backend cuda)")
    q.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="backend of the private daemon (inproc: cpu only)")
    q.add_argument("--verify", action="store_true", help="fill the pool with a known pattern and check every hot row")
    q.add_argument("--slab", choices=["daemon", "engine"], default="daemon",
                   help="engine: the hot rows in a buffer this process owns, as an engine's KV cache would "
                        "(zmq or doorbell), with guard bytes around them checked unchanged")
    q.add_argument("--prefetch", action="store_true",
                   help="attach with prefetch and replay each step as index group 0, then as group 1 the next "
                        "step's rows (fetched ahead from group 0's); DESIGN §4")
    q.add_argument("--ranks", type=rank_count, default=1, metavar="N",
                   help="N rank clients of one engine send every step in turn (zmq or doorbell; on cuda rank r on "
                        "GPU r modulo the GPUs seen); rank 0's results are saved, every rank's must equal them "
                        "(ranks_differing) and --verify checks every rank's rows")
    q.add_argument("--tp", action="store_true",
                   help="the ranks form a TP group (attach tp_size: one resolve for them all, DESIGN §5.6; cpu, or cuda on the doorbell with every rank on one GPU)")
    q.add_argument("--connect", metavar="RUN_DIR", type=run_dir_path,
                   help="use this running daemon instead of a private one (default: a private daemon)")
    q.add_argument("--daemon-log", metavar="FILE",
                   help="log of the private daemon (default: discarded; a failed start shows its last lines)")
    q.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    q.set_defaults(fn=cmd_replay)

    q = command("trace", "trace tools")
    tsub = q.add_subparsers(dest="trace_cmd", required=True, metavar="TOOL")
    s = tsub.add_parser("synth", help="generate a synthetic decode trace", formatter_class=_HelpFormatter,
                        description="generate a synthetic decode trace (docs/TRACES.md \"Generating traces\")")
    s.add_argument("--out", required=True, metavar="TRACE.npz", help="where to write the trace")
    for name, typ, default, help_text in (
        ("steps", int, 200, "decode steps"),
        ("batch", int, 8, "batch rows per step"),
        ("top-k", int, 256, "columns per top-k row"),
        ("region-stride", int, 512, "hot slots per request"),
        ("max-reqs", int, 16, "request state rows"),
        ("host-rows", int, 65536, "host rows per layer"),
        ("row-bytes", int, 656, "bytes per KV row"),
        ("num-layers", int, 2, "layers of the index group"),
        ("overlap", float, 0.8, "fraction of a request's top-k kept from its previous step"),
        ("context", int, 2048, "mean context length (rows) of a new request"),
        ("lifetime", int, 64, "mean decode steps of a request"),
        ("arrive", float, 0.5, "chance per free batch row and step that a request arrives"),
        ("pad", float, 0.1, "chance a live request is a padding row for a step"),
        ("invalidate", float, 0.05, "chance per request and step that one of its rows is rewritten"),
        ("out-of-range", float, 0.0005, "chance per column of an out-of-range id"),
        ("share-prefix", float, 0.1, "chance a new request shares a live one's prefix rows"),
        ("block-size", int, 0, "tokens per block: > 0 writes a position trace (topk holds logical positions, "
                               "mapped through a per-request block table; docs/TRACES.md); 0: host rows"),
        ("spec", float, 0.0, "chance per step that a live request takes a second batch row (speculative "
                             "decoding: same state row, another top-k); needs region-stride >= 2 * top-k"),
        ("seed", int, 0, "random seed"),
    ):
        s.add_argument(f"--{name}", type=typ, default=default, help=help_text)
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    s.set_defaults(fn=cmd_trace_synth)

    q = command("bench", "speed figures, each against a baseline measured in the same run")
    add_bench_arguments(q)
    q.set_defaults(fn=run_bench_args)

    q = command("demo", "two TP ranks against a private daemon on a synthetic decode")
    q.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="backend of the private daemon; auto: cuda when a GPU is usable, else cpu")
    q.add_argument("--steps", type=int, default=DEMO_DEFAULTS["steps"], help="decode steps")
    q.add_argument("--quiet", action="store_true", help="no progress output")
    q.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    try:
        parser = build_parser()  # (its defaults read SPARSEKV_* settings)
    except SettingError as e:
        return _fail("sparsekv", str(e), 2)
    a = parser.parse_args(argv)
    what = f"sparsekv {a.cmd}" + (f" {a.trace_cmd}" if a.cmd == "trace" else "")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return a.fn(a)
    except (ValueError, BadRequest) as e:
        # A bad argument or trace (TraceError), or a trace whose content breaks the
        # contract (BadRequest: duplicate ids in a row, a state row beyond max_reqs).
        return _fail(what, str(e), 2)
    except (StatsSocketError, SparseKVError, RuntimeError) as e:
        # The daemon refused (its code and message; DaemonUnavailable: none to ask), a demo
        # rank or a warm-cpus loop failed, a GPU refused.
        return _fail(what, str(e))
    except BrokenPipeError:
        # The reader went away (``sparsekv top | head``): end quietly, as a tool killed by
        # SIGPIPE would, with stdout pointed at /dev/null so that the exit's flush cannot
        # raise again.
        _drop_stdout()
        return 128 + signal.SIGPIPE
    except PermissionError as e:
        return _fail(what, f"permission denied: {e.filename or e}")
    except OSError as e:
        return _fail(what, f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 128 + signal.SIGTERM
    except Exception as e:  # noqa: BLE001 - a bug: still one line, with the error's type to report
        return _fail(what, f"unexpected {type(e).__name__}: {e}")


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: the same path, or (both there) one inode."""
    return os.path.abspath(a) == os.path.abspath(b) or (os.path.exists(a) and os.path.exists(b)
                                                          and os.path.samefile(a, b))


def _drop_stdout() -> None:
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture): nothing is flushed to a pipe
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _terminate(*_) -> None:
    raise Terminated()


def _fail(what: str, message: str, code: int = 1) -> int:
    print(f"{what}: {' '.join(message.split())}", file=sys.stderr)  # one line, whatever the message holds
    return code


if __name__ == "__main__":
    sys.exit(main())
