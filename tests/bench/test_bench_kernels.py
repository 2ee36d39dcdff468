"""sparsekv bench kernels: the step plans it times, its table, and (cuda) a small run; the GPU
benches refused in one line where they cannot run; what ``sparsekv bench latest`` writes."""

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from sparsekv.bench import kernels as bk
from sparsekv.bench import kernels_scattered as ks
from sparsekv.bench import latest
from sparsekv.cli.main import main


def test_step_plans_look_like_a_decode_steps_misses():
    """Each request's misses: the asked share of top-k, sorted by host row (as skv_resolve
    leaves them), distinct, inside whole blocks that no other request owns; distinct slots
    in the request's own region."""
    rng = np.random.default_rng(1)
    host_rows = 64 * 40 * bk.BLOCK_ROWS
    rows, slots, misses = bk.step_plans(rng, host_rows, 3, batch=8, top_k=256, miss_rate=0.1)
    assert rows.shape == slots.shape == (3, 8, 256) and misses.shape == (3, 8)
    assert (misses == round(0.1 * 256)).all()
    for i in range(3):
        owner = {}
        for b in range(8):
            m = misses[i, b]
            r = rows[i, b, :m]
            assert (np.diff(r) > 0).all() and r.min() >= 0 and r.max() < host_rows
            assert (rows[i, b, m:] == -1).all()
            for blk in set((r // bk.BLOCK_ROWS).tolist()):
                assert owner.setdefault(blk, b) == b
            sl = slots[i, b, :m]
            assert len(set(sl.tolist())) == m and (sl // bk.STRIDE == b).all()


def test_the_resolve_sequence_is_a_cycle_that_keeps_the_asked_share():
    """Each batch keeps 90 % of its predecessor's ids (the first of the last's: a graph
    replaying them stays in the steady state); ids are distinct within a row and stay in
    the row's own range."""
    rng = np.random.default_rng(2)
    seq = bk.resolve_sequence(rng, steps=16, batch=3, top_k=256, kept=0.9, span=4096)
    keep = int(0.9 * 256)
    assert len(seq) == 16
    for i, x in enumerate(seq):
        assert x.shape == (3, 256) and x.dtype == np.int32
        prev = seq[i - 1]
        for b in range(3):
            assert len(set(x[b].tolist())) == 256
            assert (x[b] // 4096 == b).all()
            assert len(set(x[b].tolist()) & set(prev[b].tolist())) == keep
    with pytest.raises(ValueError):
        bk.resolve_sequence(rng, steps=2, batch=1, top_k=256)


def test_the_table_lists_every_row_and_the_headline_keys():
    r = {"_rows": [("gather", "40.0 GB/s", "1 us")], "gather_vs_bulk": 0.7, "resolve_us_b64": 20.0,
         "pool_ready_GiBps": 25.0, "gather_vs_bulk_scattered": 0.71}
    text = bk.table(r)
    assert "| gather | 40.0 GB/s | 1 us |" in text
    assert "gather_vs_bulk 0.7" in text and "pool_ready_GiBps 25.0" in text and "gather_vs_bulk_scattered 0.71" in text


def test_variants_differ_from_the_default_and_a_quick_run_times_the_thread_counts():
    default = SimpleNamespace(threads=1024, hash_scale=4, lru_smem=True, owner_smem=True)
    quick = bk.variant_options(default, quick=True)
    assert quick == [("256 threads", {"threads": 256}), ("512 threads", {"threads": 512}),
                     ("768 threads", {"threads": 768})]
    full = dict(bk.variant_options(default))
    assert full["new lru scattered to global memory"] == {"lru_smem": False}
    assert full["owners read from global memory"] == {"owner_smem": False}
    assert full["hash table x2"] == {"hash_scale": 2}
    assert len(full) == len(bk.variant_options(default)) and set(dict(quick)) < set(full)


def test_the_json_is_replaced_whole_and_leaves_out_the_rows(tmp_path):
    path = tmp_path / "k.json"
    bk.write_json(str(path), {"resolve_us_b64": 13.9, "_rows": [("a", "b", "c")]})
    bk.write_json(str(path), {"resolve_us_b64": 13.8, "gather_vs_bulk": 0.8, "_rows": []})
    assert json.loads(path.read_text()) == {"gather_vs_bulk": 0.8, "resolve_us_b64": 13.8}
    assert [p.name for p in tmp_path.iterdir()] == ["k.json"]


@pytest.mark.cuda
def test_a_small_run_on_the_gpu():
    """Every figure of a small run, the scattered workloads on 8,192-row windows (a 1 GiB
    pool holds no 131,072-row ones: that shape is skipped, its row says why)."""
    shapes = (ks.Shape("w8k", 8192, 1, False, "8,192-row windows"), ks.Shape("w8k_r8", 8192, 8, True, "runs of 8"),
              ks.SCATTERED_SHAPES[0])
    variants = [v for v in ks.GATHER_VARIANTS if v[0] in ("t512", "unroll2")]
    r = bk.run(pool_gib=1.0, layers=4, blocks=(32, 64), both_pool_modes=True, resolve_variants=False,
               gather_variants=variants, scattered_shapes=shapes)
    for k in ("gather_vs_bulk", "resolve_us_b64", "pool_ready_GiBps", "pool_ready_again_GiBps", "pool_ready_after_fault_GiBps",
              "gather_request_order_GBps",
              "gather_request_order_32blocks_one_registration_GBps", "resolve_us_b64_eager",
              "gather_request_order_t512_GBps", "gather_request_order_unroll2_GBps", "gather_adjacent_rows_GBps",
              "gather_vs_bulk_scattered", "gather_w8k_GBps", "gather_w8k_64blocks_GBps", "gather_w8k_t512_GBps",
              "gather_w8k_unroll2_GBps", "gather_w8k_r8_GBps", "gather_w8k_r8_unroll2_GBps"):
        assert r[k] > 0, k
    assert not any(k.startswith("gather_w128k") for k in r)
    assert [v for w, v, _ in r["_rows"] if w == "gather, w128k"] == ["skipped"]
    assert r["gather_vs_bulk_scattered"] == pytest.approx(r["gather_w8k_GBps"] / r["bulk_h2d_GBps"], abs=2e-3)
    assert r["pool_backing"] == "anon_thp"
    assert r["kernels_step_bytes"] == 64 * round(0.1 * 2048) * 656


@pytest.mark.parametrize("argv", [["kernels"], ["kernels", "--kernels-quick"], ["cuda_transport"],
                                  ["latest", "--json", "latest.json"]])
def test_gpu_benches_without_cupy_end_in_one_line_and_a_non_zero_exit(argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError, as on a machine without it
    assert main(["bench", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"sparsekv bench {argv[0]}: needs CuPy and an NVIDIA GPU (pip install 'sparsekv[cuda]')\n"


def test_an_output_in_a_missing_directory_is_refused_before_any_work(tmp_path, capsys):
    assert main(["bench", "kernels", "--json", str(tmp_path / "no" / "k.json")]) == 2
    assert capsys.readouterr().err == f"sparsekv bench kernels: --json {tmp_path}/no/k.json: directory " \
                                      f"{tmp_path}/no does not exist\n"
    assert main(["bench", "kernels", "--json", str(tmp_path)]) == 2  # a directory
    assert capsys.readouterr().err == f"sparsekv bench kernels: --json {tmp_path} is a directory; name a file\n"


def test_file_options_of_other_benches_are_refused(capsys):
    assert main(["bench", "resolve", "--json", "r.json"]) == 2
    assert capsys.readouterr().err == "sparsekv bench resolve: --json is an option of decode or serve or kernels or latest\n"
    assert main(["bench", "kernels", "--merge", "x.json"]) == 2
    assert capsys.readouterr().err == "sparsekv bench kernels: --merge is an option of latest\n"


def test_latest_merges_the_figures_and_keeps_what_ran_before_a_failure(tmp_path, monkeypatch):
    """sparsekv bench latest: each transport run's numbers under its prefix, the headline
    hand-off from the warm-io run, the merged files' numbers, written after each run."""
    runs = []

    def fake(steps, warm_io=False, device_wait=False):
        runs.append((warm_io, device_wait))
        if device_wait:
            raise RuntimeError("no second rank")
        return {"bench": "cuda_transport", "warm_io": warm_io, "zmq_handoff_p50_us": 200.0 - 50 * warm_io,
                "daemon_host_us_per_step": 40.0, "io_cpus": "daemon 3, client 2"}

    monkeypatch.setattr(latest, "bench_cuda_transport", fake)
    (tmp_path / "decode.json").write_text(json.dumps({"doorbell_overhead_us_per_layer": 1.2, "decode_paired": True}))
    out = tmp_path / "latest.json"
    a = SimpleNamespace(json_path=str(out), merge=[str(tmp_path / "decode.json"), str(tmp_path / "none.json")],
                        commit="abc1234")
    assert latest.run_args(a) == 1 and runs == [(False, False), (True, False), (False, True)]
    d = json.loads(out.read_text())
    assert d["commit"] == "abc1234" and d["doorbell_overhead_us_per_layer"] == 1.2 and "decode_paired" not in d
    assert d["zmq_handoff_cold_p50_us"] == 200.0 and d["zmq_handoff_p50_us"] == 150.0
    assert d["cuda_transport_zmq_handoff_p50_us"] == 200.0 and d["cuda_transport_warm_io_zmq_handoff_p50_us"] == 150.0
    assert not any(k.startswith("cuda_transport_dw_run_") for k in d) and "cuda_transport_io_cpus" not in d


@pytest.mark.parametrize("argv, err", [
    (["decode", "--host-gib", "300"], "sparsekv bench decode: --host-gib is an option of sparsekv bench serve"),
    (["kernels", "--region-rows", "3000"], "sparsekv bench kernels: --region-rows is an option of sparsekv bench serve "
                                           "or decode"),
    (["resolve", "--contexts", "32k"], "sparsekv bench resolve: --contexts is an option of sparsekv bench serve"),
    (["kernels", "--batches", "4"], "sparsekv bench kernels: --batches is an option of sparsekv bench decode or serve"),
    (["serve", "--paired"], "sparsekv bench serve: --paired is an option of sparsekv bench decode"),
    (["latest", "--pool-gib", "3"], "sparsekv bench latest: --pool-gib is an option of sparsekv bench kernels"),
    (["decode", "--kernels-quick"], "sparsekv bench decode: --kernels-quick is an option of sparsekv bench kernels"),
])
def test_options_of_other_benches_are_refused_not_ignored(capsys, argv, err):
    assert main(["bench", *argv]) == 2
    assert capsys.readouterr().err == err + "\n"
