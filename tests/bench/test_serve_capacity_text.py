"""The arithmetic of ``sparsekv bench serve`` (torch-free): the capacity by hand, the
parts' bounds, and the capacity as printed: one unit (GB = 1e9 bytes) on every line, so
that a reader dividing the printed figures gets the printed batches; the host's share
shown in both units."""

import re

import pytest

from sparsekv.bench.serve_capacity import PRESETS, Deployment, Shapes, bounds, capacity, capacity_text


def test_capacity_matches_the_arithmetic_by_hand():
    sh = PRESETS["v32"]
    # weights per GPU: attention a layer = fused x-proj 2304 x 7168 + fused q-proj 32768 x 1536 + o_proj
    # 7168 x 16384 (FP8) + W_UK and W_UV 2 x 128 x 512 x 256 bytes (bf16); routed 58 layers x 32 experts x
    # 3 x 7168 x 2048; shared + router 58 x (3 x 7168 x 2048 + 2 x 7168 x 256); dense 3 x 3 x 7168 x 18432;
    # embedding and head 2 x 2 x 129280 x 7168
    attn = 2304 * 7168 + 32768 * 1536 + 7168 * 16384 + 2 * 128 * 512 * 256
    weights = (61 * attn + 58 * 32 * 3 * 7168 * 2048 + 58 * (3 * 7168 * 2048 + 2 * 7168 * 256)
               + 3 * 3 * 7168 * 18432 + 2 * 2 * 129280 * 7168)
    free = 141e9 - weights - 5e9
    cap = capacity(sh, 131072, Deployment())
    assert cap["weights_bytes"] == weights == 102_689_931_264
    assert cap["gpu_hbm"] == 131072 * 61 * (656 + 132)
    # offloaded, in HBM: indexer keys, the hot region (656 B a row + 9 B of residency state a
    # slot) and the step's slot of each column (4 B), a layer each; once: 4096 staging rows a layer
    assert cap["offload_hbm"] == 131072 * 61 * 132 + 61 * 2048 * (656 + 9) + 61 * 2048 * 4
    assert cap["offload_fixed_hbm"] == 4096 * 61 * 656
    assert cap["gpu"] == int(free // (131072 * 61 * 788)) == 5
    assert cap["offload"] == min(int((free - 4096 * 61 * 656) // cap["offload_hbm"]),
                                 int(256 * 2**30 // (131072 * 61 * 656))) == 29
    wide = capacity(sh, 131072, Deployment(), region_rows=4096)  # hot regions of 4096 rows: 164 MB a request
    assert wide["offload_hbm"] == 131072 * 61 * 132 + 61 * 4096 * (656 + 9) + 61 * 2048 * 4
    assert wide["offload"] == int((free - 4096 * 61 * 656) // wide["offload_hbm"]) == 27
    small_host = capacity(sh, 131072, Deployment(host_bytes=64 * 2**30))
    assert small_host["offload"] == 64 * 2**30 // (131072 * 61 * 656) == 13
    assert small_host["offload_limited_by"] == "host memory"


def test_bounds_are_bytes_at_the_hbm_rate_or_flops_at_the_peaks():
    sh = PRESETS["v32"]
    b = bounds(sh, 64, 32768, misses_per_layer=1000)
    assert b["moe"] == pytest.approx(1e6 * 33 * 3 * 7168 * 2048 / 4.8e12 + 1e6 * 7168 * 256 * 2 / 4.8e12)  # router: bf16
    assert b["indexer"] == pytest.approx(1e6 * 64 * 32768 * (132 + 4) / 4.8e12)
    assert b["topk"] == pytest.approx(1e6 * 64 * 32768 * 4 / 4.8e12)
    assert b["swap_in"] == pytest.approx(1e6 * 1000 * 656 / 55e9)
    assert bounds(sh, 1, 32768)["swap_in"] is None
    # the new token's latent, rope and indexer key read in bf16, its 656-byte row and 132-byte key written
    assert b["write"] == pytest.approx(1e6 * 64 * (2 * (512 + 64 + 128) + 656 + 132) / 4.8e12)
    assert len(sh.expert_counts(1)) == 8  # batch 1: 8 pairs, 8 experts read


def test_the_printed_figures_divide_to_the_printed_batches():
    text = capacity_text(Shapes(), [32768, 131072], Deployment(), region_rows=2560)
    head, *lines = text.splitlines()
    free = float(re.search(r"= ([\d.]+) GB free", head).group(1))
    host = float(re.search(r"host ([\d.]+) GB \(256 GiB\)", head).group(1))
    assert host == 274.9 and free == 33.3  # 256 GiB; 141 - 102.7 - 5
    for line, context in zip(lines, (32768, 131072)):
        m = re.search(r"all on GPU ([\d.]+) GB a request -> batch (\d+); offloaded ([\d.]+) GB HBM once \(staging\), "
                      r"then ([\d.]+) GB HBM \+ ([\d.]+) GB host a request -> batch (\d+)", line)
        gpu_req, gpu_batch, off_once, off_hbm, off_host, off_batch = (float(g) for g in m.groups())
        cap = capacity(Shapes(), context, Deployment(), region_rows=2560)
        assert (gpu_batch, off_batch) == (cap["gpu"], cap["offload"])
        assert gpu_batch == int(free / gpu_req)
        assert off_batch == min(int((free - off_once) / off_hbm), int(host / off_host))
