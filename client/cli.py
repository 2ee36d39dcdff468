"""``sparsekv``: the user command line (stats, clients, replay, trace synth, demo)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from .client import default_run_dir


def _stats_query(run_dir: str, command: str, timeout_s: float = 5.0) -> str:
    path = os.path.join(run_dir, "stats.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        s.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode()
    except (FileNotFoundError, ConnectionRefusedError):
        raise SystemExit(f"sparsekv: no daemon at {path} (is sparsekvd running with --run-dir {run_dir}?)") from None
    except socket.timeout:
        raise SystemExit(f"sparsekv: daemon at {path} did not answer within {timeout_s} s") from None
    finally:
        s.close()


def cmd_stats(a) -> int:
    what = "json" if a.json else "prometheus" if a.prometheus else "stats"
    sys.stdout.write(_stats_query(a.run_dir, what))
    return 0


def cmd_clients(a) -> int:
    sys.stdout.write(_stats_query(a.run_dir, "clients"))
    return 0


def cmd_replay(a) -> int:
    from .replay import replay, save_result, summary_line  # noqa: PLC0415
    from .trace import Trace, TraceError  # noqa: PLC0415

    try:
        trace = Trace.load(a.trace)
    except TraceError as e:
        print(f"sparsekv replay: {e}", file=sys.stderr)
        return 2
    from .errors import BadRequest  # noqa: PLC0415

    try:
        summary, result = replay(trace, transport=a.transport, backend=a.backend, verify=a.verify,
                                 connect=a.connect, daemon_log=a.daemon_log)
    except (ValueError, BadRequest) as e:
        # BadRequest: the trace's content breaks the contract (duplicate ids in a row,
        # state rows outside max_reqs, too many tokens per state row): a bad trace file.
        print(f"sparsekv replay: {e}", file=sys.stderr)
        return 2
    save_result(a.out, result)
    print(summary_line(summary))
    return 1 if a.verify and summary["mismatched_rows"] else 0


def cmd_trace_synth(a) -> int:
    from .trace import TraceError, synth  # noqa: PLC0415

    keys = ("steps", "batch", "top_k", "region_stride", "max_reqs", "host_rows", "row_bytes", "num_layers",
            "overlap", "context", "lifetime", "arrive", "pad", "invalidate", "out_of_range", "share_prefix", "seed")
    try:
        tr = synth(**{k: getattr(a, k) for k in keys})
    except (TraceError, ValueError) as e:
        print(f"sparsekv trace synth: {e}", file=sys.stderr)
        return 2
    tr.save(a.out)
    live = tr.state_rows >= 0
    print(json.dumps({"out": a.out, "steps": tr.steps, "batch": tr.batch, "top_k": tr.top_k,
                      "live_rows": int(live.sum()), "resets": int(tr.reset.sum()),
                      "invalidations": int((tr.invalidate >= 0).sum())}))
    return 0


def cmd_demo(a) -> int:
    from .demo import format_table, run_demo  # noqa: PLC0415

    s = run_demo(backend=a.backend, steps=a.steps, progress=not a.quiet)
    sys.stdout.write(format_table(s))
    return 1 if s["mismatched_rows"] else 0


def cmd_bench(a) -> int:
    from .bench import format_results, run_bench  # noqa: PLC0415

    which = a.which or ["resolve", "gather", "transport"]
    unknown = set(which) - {"resolve", "gather", "transport", "cuda_transport"}
    if unknown:
        print(f"sparsekv bench: unknown benchmark(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    sys.stdout.write(format_results(run_bench(which)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsekv", description="sparsekv user commands")
    sub = p.add_subparsers(dest="cmd", required=True)

    def run_dir_arg(q):
        q.add_argument("--run-dir", default=default_run_dir(), help="the daemon's run dir (default %(default)s)")

    q = sub.add_parser("stats", help="counters of a running daemon")
    run_dir_arg(q)
    g = q.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true")
    g.add_argument("--prometheus", action="store_true")
    q.set_defaults(fn=cmd_stats)

    q = sub.add_parser("clients", help="one line per connected client")
    run_dir_arg(q)
    q.set_defaults(fn=cmd_clients)

    q = sub.add_parser("replay", help="drive the stack with a recorded trace")
    q.add_argument("trace", metavar="TRACE.npz")
    q.add_argument("--out", required=True, metavar="RESULT.npz")
    q.add_argument("--transport", choices=["inproc", "zmq", "doorbell"], default="inproc")
    q.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    q.add_argument("--verify", action="store_true", help="fill the pool with a known pattern and check every hot row")
    q.add_argument("--connect", metavar="RUN_DIR", help="use this running daemon instead of a private one")
    q.add_argument("--daemon-log", metavar="FILE", help="log of the private daemon")
    q.set_defaults(fn=cmd_replay)

    q = sub.add_parser("trace", help="trace tools")
    tsub = q.add_subparsers(dest="trace_cmd", required=True)
    s = tsub.add_parser("synth", help="generate a synthetic decode trace")
    s.add_argument("--out", required=True, metavar="TRACE.npz")
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
        ("seed", int, 0, "random seed"),
    ):
        s.add_argument(f"--{name}", type=typ, default=default, help=f"{help_text} (default {default})")
    s.set_defaults(fn=cmd_trace_synth)

    q = sub.add_parser("bench", help="speed figures, each against a baseline measured in the same run")
    q.add_argument("which", nargs="*", metavar="NAME",
                   help="resolve, gather, transport (cpu; the default set) or cuda_transport (needs a GPU)")
    q.set_defaults(fn=cmd_bench)

    q = sub.add_parser("demo", help="two TP ranks against a private daemon on a synthetic decode")
    q.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    q.add_argument("--steps", type=int, default=None)
    q.add_argument("--quiet", action="store_true", help="no progress output")
    q.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
