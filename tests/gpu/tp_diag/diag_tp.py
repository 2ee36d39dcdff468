import os, sys
import numpy as np
sys.path.insert(0, "tests/client"); sys.path.insert(0, "tests")
import torch
from test_doorbell import ARENA, layout, reference, steps, dev, pattern
from test_doorbell_tp import group
from sparsekv.bench.private_daemon import PrivateDaemon

lay = layout()
plan = steps(lay, 10, seed=5)
want = reference(lay, plan, positions=False)
with PrivateDaemon(pool_bytes=lay.pool_bytes + (8 << 20), backend="cuda", extra_args=ARENA,
                   log_path=os.environ.get("SPARSEKV_TEST_DAEMON_LOG")) as d:
    clients, handles = group(d.run_dir, lay)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    prev = {}
    for t, (state, reset, inval, req, per_group, _table) in enumerate(plan):
        for h, s in zip(handles, streams):
            with torch.cuda.stream(s):
                h.begin_step(dev(state, torch), dev(reset, torch), dev(inval, torch))
        for g, layers in enumerate(lay.groups):
            for layer in layers:
                got = []
                for h, s in zip(handles, streams):
                    with torch.cuda.stream(s):
                        got.append(h.swap_in(dev(req, torch), None, dev(per_group[g].copy(), torch), layer=layer))
                torch.cuda.synchronize()
                exp, ids = want[t][layer]
                line = []
                for r, (h, x) in enumerate(zip(handles, got)):
                    idx = x.cpu().numpy()
                    ok = idx >= 0
                    rows = h.kv(layer)[torch.as_tensor(idx[ok]).long().cuda()].cpu().numpy()
                    pat = pattern(layer, ids[ok], lay.row_bytes)
                    bad = (rows != pat).any(axis=1)
                    seen = prev.get((r, layer), set())
                    fresh = np.array([int(i) not in seen for i in ids[ok].ravel()]) if bad.size else np.zeros(0, bool)
                    line.append(f"r{r}: idx_eq={np.array_equal(idx, exp)} valid={ok.sum()} bad={bad.sum()} "
                                f"bad_new={int((bad & fresh).sum())} bad_old={int((bad & ~fresh).sum())}")
                    prev[(r, layer)] = seen | set(int(i) for i in ids[ok].ravel())
                if t == 0 or "bad=0 " not in line[0] or "bad=0 " not in line[1]:
                    print(f"step {t} layer {layer}: " + " | ".join(line), flush=True)
    print("done", len(plan), "steps", flush=True)
    for h in handles:
        try:
            h.check()
        except Exception as e:
            print("check:", type(e).__name__, e)
        h.close()
    for c in clients:
        c.close()
