"""``--verify``'s pattern pool (bench/verify.py) in bounded pieces: found by a review, a
layout of 64 KiB rows made 4 GiB of uint64 at once for a 512 MiB pool (MemoryError), and a
larger one would have been killed."""

import numpy as np

import helpers
from sparsekv.bench import verify


class Recorder:
    """A client whose writes are checked against the pattern and measured, not kept."""

    def __init__(self, layout):
        self.layout, self.largest, self.rows = layout, 0, 0

    def write(self, rows, data, layers=None):
        layers = range(self.layout.num_layers) if layers is None else layers
        assert data.shape == (len(layers), len(rows), self.layout.row_bytes)
        for i, layer in enumerate(layers):
            assert np.array_equal(data[i], verify.pattern(layer, rows, self.layout.row_bytes))
        self.largest = max(self.largest, data.nbytes)
        self.rows += len(rows) * len(layers)


def test_fill_pool_makes_and_writes_bounded_pieces(monkeypatch):
    made = []
    real = verify.pattern
    monkeypatch.setattr(verify, "pattern", lambda layer, rows, rb: made.append(len(rows) * rb) or real(layer, rows, rb))
    for lay in (helpers.layout(num_layers=1, row_bytes=65536, host_rows=256),
                helpers.layout(num_layers=17, row_bytes=4 << 20, host_rows=1),  # a write a layer
                helpers.layout(num_layers=3, row_bytes=32, host_rows=20000)):
        client = Recorder(lay)
        made.clear()
        verify.fill_pool(client, lay)
        assert client.rows == lay.host_rows * lay.num_layers  # every row of every layer, once
        assert max(made) <= max(verify.PATTERN_BYTES, lay.row_bytes)
        assert client.largest <= max(verify.WRITE_BYTES, lay.row_bytes * max(1, verify.PATTERN_BYTES // lay.row_bytes))


def test_count_mismatches_compares_in_bounded_pieces_and_still_counts(monkeypatch):
    lay = helpers.layout(num_layers=1, row_bytes=1 << 20, host_rows=16, top_k=8, region_stride=8, max_reqs=1)
    ids = np.arange(8)
    slab = verify.pattern(0, ids, lay.row_bytes)[None, None]  # [layers, state rows, slots, row_bytes]
    slots = np.arange(8)[None]
    made = []
    real = verify.pattern
    monkeypatch.setattr(verify, "pattern", lambda layer, rows, rb: made.append(len(rows) * rb) or real(layer, rows, rb))
    assert verify.count_mismatches(slab, [0], np.array([0]), ids[None], slots, lay.host_rows) == 0
    assert sum(made) == 8 * lay.row_bytes and max(made) <= verify.PATTERN_BYTES  # 8 MiB of rows, 4 MiB at most at once
    slab[0, 0, 3, 5] ^= 1
    assert verify.count_mismatches(slab, [0], np.array([0]), ids[None], slots, lay.host_rows) == 1
