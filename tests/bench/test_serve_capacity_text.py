"""The capacity arithmetic ``sparsekv bench serve`` prints (torch-free): one unit (GB =
1e9 bytes) on every line, so that a reader dividing the printed figures gets the printed
batches; the host's share shown in both units."""

import re

from sparsekv.bench.serve_capacity import Deployment, Shapes, capacity, capacity_text


def test_the_printed_figures_divide_to_the_printed_batches():
    text = capacity_text(Shapes(), [32768, 131072], Deployment(), region_rows=2560)
    head, *lines = text.splitlines()
    free = float(re.search(r"= ([\d.]+) GB free", head).group(1))
    host = float(re.search(r"host ([\d.]+) GB \(256 GiB\)", head).group(1))
    assert host == 274.9 and free == 33.3  # 256 GiB; 141 - 102.7 - 5
    for line, context in zip(lines, (32768, 131072)):
        m = re.search(r"all on GPU ([\d.]+) GB a request -> batch (\d+); offloaded ([\d.]+) GB HBM \+ ([\d.]+) GB "
                      r"host a request -> batch (\d+)", line)
        gpu_req, gpu_batch, off_hbm, off_host, off_batch = (float(g) for g in m.groups())
        cap = capacity(Shapes(), context, Deployment(), region_rows=2560)
        assert (gpu_batch, off_batch) == (cap["gpu"], cap["offload"])
        assert gpu_batch == int(free / gpu_req) and off_batch == min(int(free / off_hbm), int(host / off_host))
