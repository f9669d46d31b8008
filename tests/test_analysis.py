"""engram_numba.stats and engram_numba.plots on synthetic captures (and on the tiny model's
capture when data/tiny_v41.gguf is there).

The synthetic captures carry the documented point names, shapes and dtypes; their gates lie on
the gate's curve (docs/math.md section 6) of random dots (some inside the clamp), masked tokens have gate 0, and
their row ids come from the real hasher on the tiny hash tables, whose small primes collide.
Run with MPLBACKEND=Agg (set below too, before pyplot is imported).
"""
import os

os.environ.setdefault("MPLBACKEND", "Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import matplotlib  # noqa: E402
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from engram_numba.analysis import plots, stats  # noqa: E402
from engram_numba.config import GATE_CLAMP  # noqa: E402
from engram_numba.fixtures import tiny_hash_tables  # noqa: E402
from engram_numba.stages.hash.cpu import hash_tokens  # noqa: E402
from engram_numba.capture import Capture  # noqa: E402


def _curve(dot):
    g = np.copysign(np.sqrt(np.maximum(np.abs(dot), GATE_CLAMP)), dot)
    return 1.0 / (1.0 + np.exp(-g))


def synthetic_capture(rng, T=40, hc=4, n_masked=None, vocab=12) -> Capture:
    """A Capture of the points stats/plots read, for the tiny tables' layers (1, 4), 6 hash columns.

    Tokens come from a small vocabulary so n-grams repeat (reuse) and the tiny primes collide."""
    tables = tiny_hash_tables()
    token_ids = rng.choice(rng.permutation(64)[:vocab], size=T).astype(np.int64)      # [T]
    mask = np.ones(T, dtype=bool)
    n_masked = max(1, T // 10) if n_masked is None else n_masked
    mask[rng.choice(np.arange(1, T), size=n_masked, replace=False)] = False
    all_ids = hash_tokens(tables, token_ids, mask)                                     # [T, L, C]
    arrays = {"tokens.ids": token_ids, "tokens.mask": mask}
    for li, lid in enumerate(tables.layer_ids):
        dot = (rng.standard_normal((T, hc)) * rng.uniform(0.3, 2.0, size=hc)).astype(np.float32)  # [T, hc]
        tiny = rng.random((T, hc)) < 0.08                   # some tokens inside the clamp
        dot[tiny] = (rng.standard_normal(int(tiny.sum())) * 3e-7).astype(np.float32)
        gate = _curve(dot.astype(np.float64)).astype(np.float32)                        # [T, hc]
        gate[~mask] = 0.0
        arrays[f"L{lid}.hash.ids"] = np.ascontiguousarray(all_ids[:, li, :])          # [T, C] int64
        arrays[f"L{lid}.gate.dot"] = dot
        arrays[f"L{lid}.gate.gate"] = gate
    return Capture(arrays, meta={"backends": {s: "reference" for s in ("hash", "rows", "proj", "gate")},
                                 "layer_ids": list(tables.layer_ids), "n_tokens": T})


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# Gate statistics ---------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [14, 97])
def test_gate_stats_match_numpy_over_live_tokens(rng, T):
    cap = synthetic_capture(rng, T=T)
    st = stats.gate_stats(cap, bins=20)
    live = cap["tokens.mask"]
    assert st.layers == [1, 4]
    assert len(st) == 2 * 4 and st.n_masked == int((~live).sum()) > 0
    for lid in st.layers:
        gate, dot = cap[f"L{lid}.gate.gate"], cap[f"L{lid}.gate.dot"]
        for c in range(4):
            r = st[lid, c]
            g = gate[live, c].astype(np.float64)
            d = dot[live, c].astype(np.float64)
            assert r.n == live.sum() and r.n_masked == (~live).sum() and r.masked_nonzero == 0
            np.testing.assert_allclose([r.mean, r.std, r.min, r.max], [g.mean(), g.std(), g.min(), g.max()],
                                       rtol=1e-12)
            np.testing.assert_allclose([r.q05, r.q25, r.q50, r.q75, r.q95],
                                       np.quantile(g, [0.05, 0.25, 0.5, 0.75, 0.95]), rtol=1e-12)
            counts, edges = st.histogram(lid, c)
            ref_counts, ref_edges = np.histogram(g, bins=20, range=(0, 1))
            np.testing.assert_array_equal(counts, ref_counts)
            np.testing.assert_allclose(edges, ref_edges)
            assert counts.sum() == r.n
            assert r.n_clamped == np.count_nonzero(np.abs(d) < 1e-6)
            assert r.clamp_frac == pytest.approx(r.n_clamped / r.n)
            assert r.dot_mean_abs == pytest.approx(np.abs(d).mean(), rel=1e-12)
            assert (r.dot_min, r.dot_max) == (pytest.approx(d.min()), pytest.approx(d.max()))
    # the synthetic capture does put tokens inside the clamp
    assert sum(r.n_clamped for r in st) > 0


def test_masked_tokens_are_excluded_and_nan_per_token(rng):
    cap = synthetic_capture(rng, T=50, n_masked=10)
    st = stats.gate_stats(cap)
    live = cap["tokens.mask"]
    g_all = cap["L1.gate.gate"]
    # the zeros of masked tokens would pull every statistic down
    assert st[1, 0].mean > g_all[:, 0].mean() and st[1, 0].min > 0.0
    pt = st.per_token(1)
    assert pt.shape == (50, 4) and pt.dtype == np.float32
    assert np.isnan(pt[~live]).all()
    np.testing.assert_array_equal(pt[live], g_all[live])
    pt[:] = 7.0                                             # a copy: the statistics keep their data
    assert np.isnan(st.per_token(1)[~live]).all()
    d = st.per_token(4, "dot")
    assert np.isnan(d[~live]).all() and np.array_equal(d[live], cap["L4.gate.dot"][live])
    with pytest.raises(KeyError, match="layers are"):
        st.per_token(9)


def test_masked_nonzero_gate_and_nonfinite_are_reported(rng):
    cap = synthetic_capture(rng, T=30, n_masked=3)
    arrays = dict(cap)
    gate = arrays["L4.gate.gate"].copy()
    dead = np.flatnonzero(~arrays["tokens.mask"])
    gate[dead[0], 2] = 0.25                                 # a backend bug: masked but gated
    live0 = np.flatnonzero(arrays["tokens.mask"])[0]
    gate[live0, 1] = np.nan
    arrays["L4.gate.gate"] = gate
    st = stats.gate_stats(Capture(arrays))
    assert st[4, 2].masked_nonzero == 1 and st[4, 2].n == 27
    assert st[4, 1].n_nonfinite == 1 and st[4, 1].n == 26 and np.isfinite(st[4, 1].mean)
    text = str(st)
    assert "L4 stream 2: 1 masked token(s) with a non-zero gate" in text
    assert "L4 stream 1: 1 non-finite gate value(s) left out" in text
    assert "background:#fff4e5" in st._repr_html_()


def test_without_mask_or_dot_points(rng):
    cap = synthetic_capture(rng, T=20, n_masked=0)
    arrays = {k: v for k, v in cap.items() if k not in ("tokens.mask", "L1.gate.dot")}
    st = stats.gate_stats(arrays)                           # a plain dict works too
    assert st.n_masked == 0 and st[1, 0].n == 20
    assert np.isnan(st[1, 0].dot_mean_abs) and np.isnan(st[1, 0].clamp_frac)
    assert np.isfinite(st[4, 0].dot_mean_abs)
    row = [line for line in str(st).splitlines() if line.startswith("L1 ")][0]
    assert row.split()[-2:] == ["-", "-"]                   # mean|dot| and clamp% unknown
    with pytest.raises(KeyError, match="gate.dot"):
        st.per_token(1, "dot")
    fig = plots.gate_vs_dot(arrays)                         # the panels say the dot is missing
    assert isinstance(fig, Figure) and len(fig.axes) == 2 * arrays["L1.gate.gate"].shape[1]


def test_gate_stats_errors_and_layer_selection(rng):
    cap = synthetic_capture(rng, T=16)
    with pytest.raises(KeyError, match="no `L\\{id\\}.gate.gate`"):
        stats.gate_stats({"tokens.ids": cap["tokens.ids"]})
    with pytest.raises(ValueError, match="bins"):
        stats.gate_stats(cap, bins=0)
    with pytest.raises(KeyError, match="layer\\(s\\) \\[7\\]"):
        stats.gate_stats(cap, layer_ids=[7])
    assert stats.gate_stats(cap, layer_ids=[4]).layers == [4]
    st = stats.gate_stats(cap, bins=10)
    counts, edges = st.histogram(1, 3, bins=5)              # re-binned from the per-token values
    assert edges.size == 6 and counts.sum() == st[1, 3].n
    with pytest.raises(KeyError, match="stream 9"):
        st[1, 9]


def test_gate_stats_text_html_and_records_show_the_numbers(rng):
    cap = synthetic_capture(rng, T=40)
    st = stats.gate_stats(cap)
    text, page = str(st), st._repr_html_()
    assert text == st.table() == repr(st)
    assert "40 tokens, 4 masked (excluded)" in text and "reference" in text
    for col in ("layer", "stream", "n", "mean", "std", "q05", "q50", "q95", "min", "max", "clamp%"):
        assert col in text.splitlines()[1]
    lines = text.splitlines()
    assert len(lines) == 3 + 8                              # header, columns, rule, 2 layers x 4 streams
    for r in st:
        for v in (r.mean, r.std, r.q05, r.q50, r.q95, r.min, r.max):
            assert f"{v:.4f}" in text and f"{v:.4f}" in page
        assert f"{100 * r.clamp_frac:.1f}" in text
    assert page.startswith("<table>") and page.count("<tr>") == 1 + 8
    recs = st.to_records()
    assert len(recs) == 8 and recs[0]["layer"] == 1 and recs[4]["layer"] == 4
    assert {"n", "mean", "std", "q05", "q25", "q50", "q75", "q95", "n_masked", "clamp_frac"} <= set(recs[0])
    assert "hist_counts" not in recs[0]
    assert sum(st.to_records(histograms=True)[3]["hist_counts"]) == st[1, 3].n


def test_gate_stats_of_a_saved_capture(rng, tmp_path):
    cap = synthetic_capture(rng, T=25)
    cap.save(tmp_path / "cap.npz")
    a, b = stats.gate_stats(cap), stats.gate_stats(Capture.load(tmp_path / "cap.npz"))
    assert a.to_records(histograms=True) == b.to_records(histograms=True)


# Row-id reuse --------------------------------------------------------------------------------------

def _windows_by_hand(ids, mask, M, pad):
    """docs/math.md section 3.1, one position at a time."""
    out = []
    for p in range(len(ids)):
        tok, blocked = [], False
        for s in range(M):
            blocked = blocked or p < s or not mask[p - s]
            tok.append(pad if blocked else int(ids[p - s]))
        out.append(tuple(tok))
    return out


def test_ngram_windows_sticky_blocking():
    w = stats.ngram_windows([5, 6, 7, 8, 9], [True, True, False, True, True], 4, pad_id=2)
    np.testing.assert_array_equal(w, [[5, 2, 2, 2], [6, 5, 2, 2], [2, 2, 2, 2], [8, 2, 2, 2], [9, 8, 2, 2]])
    w = stats.ngram_windows([5, 6], None, 3)                # unknown pad: a value no token has
    np.testing.assert_array_equal(w, [[5, -2, -2], [6, 5, -2]])
    w = stats.ngram_windows([1, 3], None, 2, pad_id=0, token_map=np.array([0, 10, 20, 30]))
    np.testing.assert_array_equal(w, [[10, 0], [30, 10]])


@pytest.mark.parametrize("include_masked", [False, True])
def test_row_id_reuse_exact_against_brute_force(rng, include_masked):
    tables = tiny_hash_tables()
    cap = synthetic_capture(rng, T=120, vocab=10)
    reuse = stats.row_id_reuse(cap, tables=tables, include_masked=include_masked)
    assert reuse.exact and reuse.layers == [1, 4] and reuse.n_heads == 2 and reuse.max_ngram_size == 4
    ids_tok, mask = cap["tokens.ids"], cap["tokens.mask"]
    windows = _windows_by_hand(tables.token_map[ids_tok], mask, 4, tables.pad_id)
    keep = np.ones(120, bool) if include_masked else mask
    total_collisions = 0
    for lid in (1, 4):
        ids = cap[f"L{lid}.hash.ids"]
        assert len(reuse[lid]) == 6
        for col, c in enumerate(reuse[lid]):
            order = col // 2 + 2
            toks = np.flatnonzero(keep)
            ctx = [windows[t][:order] for t in toks]
            col_ids = [int(ids[t, col]) for t in toks]
            assert (c.order, c.head, c.n_tokens) == (order, col % 2, len(toks))
            assert c.distinct_ids == len(set(col_ids))
            assert c.distinct_contexts == len(set(ctx))
            assert c.inconsistent == 0                      # the rebuilt windows are what was hashed
            assert c.collisions == len(set(ctx)) - len(set(col_ids)) >= 0
            pairs = sum(1 for i in range(len(toks)) for j in range(i)
                        if col_ids[i] == col_ids[j] and ctx[i] != ctx[j])
            assert c.colliding_pairs == pairs
            hist = c.reuse_hist
            assert (np.arange(hist.size) * hist).sum() == len(toks) and hist.sum() == c.distinct_ids
            assert c.max_reuse == max(col_ids.count(i) for i in set(col_ids))
            total_collisions += c.collisions
    assert total_collisions > 0                             # primes 67..113 must collide on 120 tokens
    recs = reuse.to_records()
    assert len(recs) == 12 and {"layer", "col", "distinct_ids", "collisions", "reused_ids"} <= set(recs[0])
    text = str(reuse)
    assert "contexts exact" in text and len(text.splitlines()) == 3 + 12
    assert str(recs[0]["distinct_ids"]) in text.splitlines()[3].split()
    assert reuse._repr_html_().count("<tr") == 1 + 12


def test_row_id_reuse_approximate_and_inconsistent(rng):
    cap = synthetic_capture(rng, T=60)
    exact = stats.row_id_reuse(cap, tables=tiny_hash_tables())
    approx = stats.row_id_reuse(cap)                        # raw ids, pad unknown, n_heads = 6 // 3
    assert not approx.exact and approx.n_heads == 2 and "approximate" in str(approx)
    for lid in (1, 4):
        for a, e in zip(approx[lid], exact[lid]):
            # the unknown pad only splits contexts (the real pad id may also occur in the text)
            assert a.distinct_ids == e.distinct_ids and a.collisions >= e.collisions
    # ids that no longer follow their contexts (e.g. replaced by a hook) are flagged
    arrays = dict(cap)
    arrays["L1.hash.ids"] = rng.permutation(arrays["L1.hash.ids"], axis=0)
    bad = stats.row_id_reuse(Capture(arrays), tables=tiny_hash_tables())
    assert sum(c.inconsistent for c in bad[1]) > 0 and "warning:" in str(bad)
    with pytest.raises(ValueError, match="orders"):
        stats.row_id_reuse(cap, max_ngram_size=5)           # 6 columns do not split into 4 orders
    with pytest.raises(KeyError, match="tokens.ids"):
        stats.row_id_reuse({"L1.hash.ids": cap["L1.hash.ids"]})


# Plots ---------------------------------------------------------------------------------------------

def test_gate_heatmap_labels_tokens_and_marks_masked(rng):
    cap = synthetic_capture(rng, T=14)
    labels = [f"w{t}" for t in range(14)]
    fig = plots.gate_heatmap(cap, token_labels=labels)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 3                               # 2 layers + the colorbar
    bottom = fig.axes[1]
    assert [t.get_text() for t in bottom.get_xticklabels()] == labels
    dead = np.flatnonzero(~cap["tokens.mask"])
    red = [i for i, t in enumerate(bottom.get_xticklabels()) if t.get_color() == plots._MASK_RED]
    assert red == list(dead)
    assert any(p.get_hatch() == "///" for p in bottom.patches)
    assert fig.axes[2].get_ylabel() == "gate"               # the colorbar
    # default labels: the token ids; only the layer asked for
    fig = plots.gate_heatmap(cap, layer_ids=[4])
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [str(i) for i in cap["tokens.ids"]]
    with pytest.raises(ValueError, match="labels"):
        plots.gate_heatmap(cap, token_labels=["a"])


@pytest.mark.slow
def test_gate_heatmap_long_sequence_and_given_axes(rng):
    cap = synthetic_capture(rng, T=300)
    fig = plots.gate_heatmap(cap)
    labels = fig.axes[1].get_xticklabels()
    # too many for every id: positions at a round step (300 / 64 -> every 5th)
    assert [t.get_text() for t in labels] == [str(p) for p in range(0, 300, 5)]
    assert fig.axes[1].get_xlabel() == "token position"
    words = [f"w{t}" for t in range(300)]
    labels = plots.gate_heatmap(cap, token_labels=words).axes[1].get_xticklabels()
    assert [t.get_text() for t in labels] == words[::5]
    f2, axes = plt.subplots(2, 1)
    assert plots.gate_heatmap(cap, ax=axes) is f2
    with pytest.raises(ValueError, match="2 panel"):
        plots.gate_heatmap(cap, ax=axes[0])


@pytest.mark.slow
def test_gate_histogram_gate_vs_dot_and_reuse_plot(rng):
    cap = synthetic_capture(rng, T=80)
    fig = plots.gate_histogram(cap, bins=40)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    for a in fig.axes:
        assert len(a.patches) == 4                          # one step line (StepPatch) per stream
    st = stats.gate_stats(cap)
    assert isinstance(plots.gate_histogram(st), Figure)
    fig = plots.gate_vs_dot(cap)
    assert isinstance(fig, Figure) and len(fig.axes) == 2 * 4          # one panel per layer and stream
    assert [a.get_title(loc="left") for a in fig.axes[:2]] == ["L1 stream 0", "L1 stream 1"]
    assert any(t.get_text().startswith("clamped: ") for t in fig.axes[0].get_legend().get_texts())
    assert isinstance(plots.gate_vs_dot(cap, xscale="symlog"), Figure)
    with pytest.raises(ValueError, match="xscale"):
        plots.gate_vs_dot(cap, xscale="log")
    fig = plots.row_id_reuse_plot(cap, tables=tiny_hash_tables())
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert len(fig.axes[0].patches) == 3 * 6                # tokens, contexts, ids per column
    reuse = stats.row_id_reuse(cap)
    assert isinstance(plots.row_id_reuse_plot(reuse), Figure)
    _, one = plt.subplots()
    fig = plots.gate_histogram(cap, layer_ids=[1], ax=one)
    assert fig is one.figure


# The tiny model's capture ------------------------------------------------------------------------

@pytest.mark.slow
def test_stats_and_plots_on_the_tiny_model_capture():
    from engram_numba import fixtures
    if not fixtures.TINY_PATH.exists():
        pytest.skip(f"{fixtures.TINY_PATH} is missing: build it with `engram-numba make-fixture`")
    from engram_numba.formats.schema_a import load_gguf
    from engram_numba.pipeline import Pipeline
    model = load_gguf(fixtures.TINY_PATH)
    cap = Pipeline(model, "reference").run(fixtures.TINY_TOKENS, token_mask=fixtures.TINY_MASK)
    st = stats.gate_stats(cap)
    assert st.layers == list(model.config.layer_ids) and st.n_masked == 1
    for r in st:
        assert r.n == 13 and r.masked_nonzero == 0 and r.n_nonfinite == 0 and 0.0 < r.min <= r.max < 1.0
        g = cap[f"L{r.layer}.gate.gate"][fixtures.TINY_MASK, r.stream].astype(np.float64)
        assert r.mean == pytest.approx(g.mean(), rel=1e-12)
    # every live gate lies on the gate's curve (docs/math.md section 6) of its dot
    for lid in st.layers:
        live = fixtures.TINY_MASK
        np.testing.assert_allclose(cap[f"L{lid}.gate.gate"][live],
                                   _curve(cap[f"L{lid}.gate.dot"][live].astype(np.float64)), rtol=1e-6)
    reuse = stats.row_id_reuse(cap, tables=model.hash_tables)
    assert all(c.inconsistent == 0 and c.n_tokens == 13 for cols in reuse.values() for c in cols)
    words = [f"t{int(i)}" for i in fixtures.TINY_TOKENS]
    fig = plots.gate_heatmap(cap, token_labels=words)
    assert [t.get_text() for t in fig.axes[len(st.layers) - 1].get_xticklabels()] == words
    for fn in (plots.gate_histogram, plots.gate_vs_dot):
        assert isinstance(fn(cap), Figure)
    assert isinstance(plots.row_id_reuse_plot(cap, tables=model.hash_tables), Figure)


@pytest.mark.slow
def test_heatmap_window_stride_rolling_and_synthetic_titles(rng):
    cap = synthetic_capture(rng, T=120)
    cap = Capture(dict(cap), {"synthetic_model": True, "highway": "synthetic (N(0,1))"})
    fig = plots.gate_heatmap(cap, window=(10, 50))
    assert "tokens 10..49" in fig.axes[0].get_title(loc="left")
    assert "synthetic model, synthetic highway" in fig._suptitle.get_text()
    im = fig.axes[0].get_images()[0]
    assert im.get_array().shape[1] == 40
    fig = plots.gate_heatmap(cap, rolling=8, stride=4)
    assert fig.axes[0].get_images()[0].get_array().shape[1] == 30
    assert "rolling mean over 8" in fig.axes[0].get_title(loc="left")
    # the rolling mean of live tokens: a hand check at one position
    st = stats.gate_stats(cap)
    g = st.per_token(1)[:, 0]
    want = np.nanmean(g[1:9])
    got = fig.axes[0].get_images()[0].get_array()[0, 2]      # shown position 8 = mean of tokens 1..8
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for bad in ({"window": (5, 5)}, {"window": (0, 999)}, {"stride": 0}, {"rolling": 1.5}):
        with pytest.raises(ValueError):
            plots.gate_heatmap(cap, **bad)
    plain = Capture(dict(cap), {"highway": "given"})
    assert plots.gate_heatmap(plain)._suptitle is None


def test_special_tokens_are_drawn_with_glyphs_the_font_has(rng):
    """DeepSeek's '<｜begin▁of▁sentence｜>' uses a fullwidth bar the default font lacks: the
    figures show '|' instead of missing-glyph boxes."""
    from matplotlib.font_manager import FontProperties, findfont
    from matplotlib.ft2font import FT2Font
    cap = synthetic_capture(rng, T=6)
    cap.meta["token_strings"] = ["<｜begin▁of▁sentence｜>", "the", " cat", "é", "<｜end▁of▁sentence｜>", "."]
    fig = plots.gate_heatmap(cap)
    labels = [t.get_text() for a in fig.axes for t in a.get_xticklabels()]
    assert "<|begin▁of▁sentence|>" in labels and "<|end▁of▁sentence|>" in labels
    font = FT2Font(findfont(FontProperties(family=matplotlib.rcParams["font.family"])))
    for label in labels:
        assert all(ch.isspace() or font.get_char_index(ord(ch)) for ch in label), label
    assert plots.font_safe("\uffff") == "\\uffff"


def test_symlog_dot_ticks_do_not_crowd_zero(rng):
    cap = synthetic_capture(rng, T=30)
    fig = plots.gate_vs_dot(cap, xscale="symlog")
    for a in fig.axes:
        texts = [t.get_text() for t in a.get_xticklabels()]
        if "0" in texts:
            assert not any(t in ("1e-6", "-1e-6") for t in texts), texts


def test_diff_plot_of_identical_runs_draws_no_negative_axis_and_says_so(rng):
    from engram_numba.analysis.diff import diff
    cap = synthetic_capture(rng, T=8)
    top, bottom = diff(cap, cap).plot()
    assert top.get_ylim() == (0.0, 1.0) and len(top.get_yticks()) == 0
    assert any("bit-identical" in t.get_text() for t in top.texts)
    assert any("no element differs" in t.get_text() for t in bottom.texts)
    assert "\n" in top.get_title()       # two lines: fits a panel half a figure wide
