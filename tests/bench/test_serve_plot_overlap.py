"""``bench serve --plot``: the lines are the configs at the run's ``--layer-overlap`` (the
ones the headline figures come from), whatever that overlap is. matplotlib is replaced by
a recorder: the test checks what is plotted, not the picture."""

import sys
import types

from sparsekv.bench.serve_report import Result, plot


def fake_matplotlib(monkeypatch) -> list:
    lines: list = []

    class Ax:
        def plot(self, x, y, **kw):
            lines.append((kw.get("label"), list(x), list(y)))

        def __getattr__(self, name):
            return lambda *a, **k: None

    class Fig:
        def tight_layout(self):
            pass

        def savefig(self, *a, **k):
            pass

    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda *a, **k: None
    plt = types.ModuleType("matplotlib.pyplot")
    plt.subplots = lambda rows, cols, **k: (Fig(), [[Ax() for _ in range(cols)] for _ in range(rows)])
    plt.close = lambda *a: None
    mpl.pyplot = plt
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    return lines


def test_the_plot_draws_the_runs_layer_overlap_not_a_fixed_one(monkeypatch, tmp_path):
    """A run at --layer-overlap 0.7 (every config at 0.7, one more at 0.5): a line per
    mode from the 0.7 configs, the 0.5 one left out."""
    lines = fake_matplotlib(monkeypatch)
    results = [Result(m, 32768, b, 0.7, p50_us=1000.0 * b) for m in ("gpu", "daemon") for b in (1, 4)]
    results.append(Result("daemon", 32768, 4, 0.5, p50_us=5000.0))
    assert plot(results, str(tmp_path / "p.png"), 0.7) is None
    assert sorted(label for label, _, _ in lines) == ["daemon", "gpu"]
    assert all(x == [1, 4] for _, x, _ in lines)
