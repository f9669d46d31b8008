"""Figures of a captured run: the gate per token, its distribution, its curve, and hash reuse.

    import engram_numba as en
    en.gate_heatmap(cap, token_labels=words)       # streams x tokens, one panel per layer
    en.gate_histogram(cap)                         # gate distribution per layer, a line per stream
    en.gate_vs_dot(cap)                            # gate against dot, over the gate's curve
    en.row_id_reuse_plot(cap, tables=model.hash_tables)

Every function takes a `Capture` (or a dict of arrays with the documented point names), draws
into `ax` (one Axes, or one per panel) or `fig` when given, else into a new figure, and returns
the Figure. Nothing here calls plt.show(): in Jupyter the figure shows itself, in a script call
`fig.savefig(...)`. Masked tokens are left out of the statistics and drawn as such (see stats).
The stage-by-stage error plot is `DiffReport.plot` (analysis/diff.py).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..config import GATE_CLAMP
from .stats import GateStats, RowIdReuse, gate_stats, row_id_reuse

_MASK_GREY = "#cfcfcf"
_MASK_EDGE = "#6b6b6b"
_MASK_RED = "#c0392b"



_FONT_CHECK = None


def font_safe(label: str) -> str:
    """`label` with every character the figures' font cannot draw replaced by one it can: its
    NFKC form when drawable (DeepSeek's fullwidth '｜' in '<｜begin▁of▁sentence｜>' becomes '|'),
    else a \\uXXXX escape, so no label shows missing-glyph boxes."""
    global _FONT_CHECK
    import unicodedata
    if _FONT_CHECK is None:
        try:
            import matplotlib
            from matplotlib.font_manager import FontProperties, findfont
            from matplotlib.ft2font import FT2Font
            font = FT2Font(findfont(FontProperties(family=matplotlib.rcParams["font.family"])))
            _FONT_CHECK = lambda ch: ch.isspace() or font.get_char_index(ord(ch)) != 0   # noqa: E731
        except Exception:   # pragma: no cover - no font to ask: leave labels as they are
            _FONT_CHECK = lambda ch: True   # noqa: E731
    out = []
    for ch in str(label):
        if _FONT_CHECK(ch):
            out.append(ch)
            continue
        alt = unicodedata.normalize("NFKC", ch)
        out.append(alt if alt and all(_FONT_CHECK(c) for c in alt) else f"\\u{ord(ch):04x}")
    return "".join(out)


def _panels(n: int, ax=None, fig=None, *, nrows: int, ncols: int, figsize, **subplot_kw):
    """(figure, [n axes]) from `ax` (one Axes or a sequence of n), `fig`, or a new figure."""
    import matplotlib.pyplot as plt
    if ax is not None:
        axes = list(np.ravel(ax)) if isinstance(ax, (Sequence, np.ndarray)) else [ax]
        if len(axes) != n:
            raise ValueError(f"this figure has {n} panel(s) (one per engram layer) but got {len(axes)} axes")
        return axes[0].figure, axes
    if fig is None:
        fig = plt.figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return fig, list(axes.ravel())[:n]


def _stats_of(capture, bins: int = 20):
    """GateStats of a capture; GateStats and corpus statistics (StreamingGateStats) as they are."""
    if isinstance(capture, GateStats) or hasattr(capture, "fine"):
        return capture
    return gate_stats(capture, bins=bins)


def _say_highway(fig, st) -> None:
    """A line under the figure when the highway was synthetic (the gate then reflects only the rows)."""
    if getattr(st, "highway_is_synthetic", False):
        fig.text(0.0, -0.01, "highway: SYNTHETIC (N(0,1) draws, no transformer blocks): the gate reflects the "
                 "table rows, not a real model's hidden states", fontsize=7, color="#8a4b00", ha="left", va="top")


def _pick_layers(st: GateStats, layer_ids) -> list[int]:
    if layer_ids is None:
        return st.layers
    layer_ids = [int(x) for x in np.atleast_1d(layer_ids)]
    for lid in layer_ids:
        if lid not in st.layers:
            raise KeyError(f"layer {lid} has no gate in this capture; layers are {st.layers}")
    return layer_ids


def synthetic_note(capture) -> str:
    """' (synthetic model, synthetic highway)' or the part that applies, from a capture's meta: a
    figure made from the tiny fixture model or a random highway says so in its title."""
    meta = getattr(capture, "meta", None) or {}
    parts = []
    if meta.get("synthetic_model"):
        parts.append("synthetic model")
    if str(meta.get("highway", "")).startswith("synthetic"):
        parts.append("synthetic highway")
    return f" ({', '.join(parts)})" if parts else ""


def _suptitle(fig, what: str, capture) -> None:
    note = synthetic_note(capture)
    if note:
        fig.suptitle(what + note, fontsize=10)


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[(start, stop)] of the runs of True in a 1-D bool array."""
    d = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


def _nice_step(at_least: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that is >= at_least."""
    decade = 1
    while True:
        for m in (1, 2, 5):
            if m * decade >= at_least:
                return m * decade
        decade *= 10


# Gate per token --------------------------------------------------------------------------------

def _window_gates(st: GateStats, layers, window, stride: int, rolling: int):
    """Per layer the [T', hc] gate (NaN at masked tokens) of the tokens shown, the shown tokens'
    positions and their mask, after a window (t0, t1), a trailing rolling mean over `rolling`
    positions (masked tokens left out of each mean; a window of only masked tokens stays NaN) and
    a stride."""
    T = st.n_tokens
    t0, t1 = (0, T) if window is None else (int(window[0]), int(window[1]))
    if not 0 <= t0 < t1 <= T:
        raise ValueError(f"window must be (t0, t1) with 0 <= t0 < t1 <= {T} tokens, got {window!r}")
    for name, v in (("stride", stride), ("rolling", rolling)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    pos = np.arange(t0, t1)
    out = {}
    for lid in layers:
        g = st.per_token(lid)[t0:t1]                         # [t1-t0, hc], NaN at masked tokens
        if rolling > 1:
            live = np.isfinite(g)
            csum = np.cumsum(np.where(live, g, 0.0), axis=0, dtype=np.float64)
            ccnt = np.cumsum(live, axis=0)
            lo = np.maximum(np.arange(len(g)) - rolling + 1, 0)
            prev = lambda a: np.where(lo[:, None] > 0, a[np.maximum(lo - 1, 0)], 0)   # noqa: E731
            n = ccnt - prev(ccnt)
            with np.errstate(invalid="ignore", divide="ignore"):
                g = ((csum - prev(csum)) / n).astype(np.float32)
            g[n == 0] = np.nan
        out[lid] = g[::stride]
    mask = st.mask[t0:t1]
    if rolling > 1:
        mask = np.ones_like(mask)                            # a rolling mean is a measurement at every position
    return out, pos[::stride], mask[::stride]


def gate_heatmap(capture, layer_ids=None, token_labels=None, cmap: str = "viridis", annotate: bool | None = None,
                 max_labels: int = 64, window=None, stride: int = 1, rolling: int = 1, ax=None, fig=None):
    """The gate of every token and stream: one panel per engram layer, streams down, tokens across.

    token_labels: one string per token (e.g. decoded text) for the x axis; by default the token
                  strings the capture's meta carries (a run with a tokenizer), else the token
                  ids. Every token is labelled up to `max_labels` tokens, beyond that a subset.
    annotate:     write each gate value in its cell (default: when there are <= 16 tokens shown).
    window, stride, rolling: for long captures: show tokens window = (t0, t1) only, every
                  `stride`-th token, and/or a trailing rolling mean over `rolling` tokens (masked
                  ones left out of each mean; the title says which).
    Masked tokens are greyed and hatched (their gate is 0 by definition, not a measurement) and
    their labels are red. A figure of a synthetic model or highway says so in its title.
    """
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt

    st = _stats_of(capture)
    layers = _pick_layers(st, layer_ids)
    gates, shown, mask = _window_gates(st, layers, window, stride, rolling)
    T = len(shown)
    if token_labels is None:
        ids = st.token_ids
        plain = stride == 1 and rolling == 1
        if st.token_strings is not None and T <= max_labels and plain:
            labels = st.token_labels()
            token_labels, xlabel = [labels[t] for t in shown], "token"
        elif ids is not None and T <= max_labels and plain:
            token_labels, xlabel = [str(int(ids[t])) for t in shown], "token id"
        else:  # a sparse row of ids says nothing; positions do
            token_labels, xlabel = [str(t) for t in shown], "token position"
    else:
        token_labels = [str(x) for x in token_labels]
        if len(token_labels) != st.n_tokens:
            raise ValueError(f"token_labels has {len(token_labels)} labels for {st.n_tokens} tokens")
        token_labels = [token_labels[t] for t in shown]
        xlabel = "token"
    how = []
    if window is not None:
        how.append(f"tokens {shown[0]}..{int(window[1]) - 1}")
    if rolling > 1:
        how.append(f"rolling mean over {rolling} tokens")
    if stride > 1:
        how.append(f"every {stride}th token")
    if annotate is None:
        annotate = T <= 16
    hc_max = max(st.streams(lid) for lid in layers)
    width = float(np.clip(2.5 + 0.32 * min(T, max_labels), 6.0, 18.0))
    height = len(layers) * (0.38 * hc_max + 0.9) + 1.1
    fig, axes = _panels(len(layers), ax, fig, nrows=len(layers), ncols=1, figsize=(width, height), sharex=True)

    cm = plt.get_cmap(cmap).with_extremes(bad=_MASK_GREY)  # masked tokens are NaN in per_token
    im = None
    for a, lid in zip(axes, layers):
        g = gates[lid]                                       # [T shown, hc], NaN at masked tokens
        hc = g.shape[1]
        im = a.imshow(np.ma.masked_invalid(g.T), cmap=cm, vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest", extent=(-0.5, T - 0.5, hc - 0.5, -0.5))
        for start, stop in _runs(~mask):
            a.add_patch(mpatches.Rectangle((start - 0.5, -0.5), stop - start, hc, fill=False, hatch="///",
                                           edgecolor=_MASK_EDGE, linewidth=0.0))
        if annotate:
            for t in np.flatnonzero(mask):
                for c in range(hc):
                    v = g[t, c]
                    a.text(t, c, f"{v:.2f}", ha="center", va="center", fontsize=7,
                           color="black" if v > 0.6 else "white")
        a.set_yticks(range(hc), [f"stream {c}" for c in range(hc)], fontsize=8)
        a.set_title(f"L{lid} gate" + (f"  ({int((~mask).sum())} masked token(s), hatched)" if (~mask).any() else "")
                    + (f"  [{'; '.join(how)}]" if how else ""), fontsize=10, loc="left")

    bottom = axes[-1]
    step = 1 if T <= max_labels else _nice_step(T / max_labels)
    ticks = np.arange(0, T, step)
    sparse_positions = step > 1 and xlabel == "token position"
    bottom.set_xticks(ticks, [font_safe(token_labels[t]) for t in ticks], rotation=0 if sparse_positions else 90,
                      fontsize=8 if T <= 32 or step > 1 else 7)
    for tick_label, t in zip(bottom.get_xticklabels(), ticks):
        if not mask[t]:
            tick_label.set_color(_MASK_RED)
    bottom.set_xlabel(xlabel + ("" if step == 1 or xlabel == "token position" else f" (every {step}th labelled)"))
    for a in axes[:-1]:
        a.tick_params(axis="x", labelbottom=False)
    fig.colorbar(im, ax=axes, label="gate", fraction=0.04 if len(axes) > 1 else 0.05, pad=0.01)
    _say_highway(fig, st)
    if (~mask).any():
        axes[0].legend(handles=[mpatches.Patch(facecolor=_MASK_GREY, edgecolor=_MASK_EDGE, hatch="///",
                                               label="masked (gate = 0, excluded)")],
                       loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False, borderaxespad=0.1)
    _suptitle(fig, "gate per token and stream", capture)
    return fig


# Gate distribution -----------------------------------------------------------------------------

def gate_histogram(capture, bins: int = 40, layer_ids=None, density: bool = False, ax=None, fig=None):
    """The gate's distribution over live tokens: one panel per engram layer, a step line per stream.

    capture: a Capture, or the `GateStats` of one (`GateStats.plot` calls this).
    The dotted line at 0.5 is where a zero dot puts the gate (the clamp keeps it at ~0.50025).
    """
    st = _stats_of(capture, bins)
    layers = _pick_layers(st, layer_ids)
    fig, axes = _panels(len(layers), ax, fig, nrows=1, ncols=len(layers), figsize=(4.8 * len(layers) + 0.6, 3.6),
                        sharey=True)
    for a, lid in zip(axes, layers):
        for c in range(st.streams(lid)):
            counts, edges = st.histogram(lid, c, bins=bins)
            r = st[lid, c]
            y = counts / max(counts.sum(), 1) / np.diff(edges) if density else counts
            a.stairs(y, edges, linewidth=1.4, label=f"stream {c}: n={r.n}, mean {r.mean:.3f}")
        a.axvline(0.5, color="grey", linestyle=":", linewidth=1.0, label="0.5: dot = 0 (clamped)")
        a.set_xlim(0.0, 1.0)
        a.set_xlabel("gate")
        a.set_title(f"L{lid}" + (f"  ({st.n_masked} masked token(s) excluded)" if st.n_masked else ""),
                    fontsize=10, loc="left")
        a.legend(fontsize=7, loc="best")
        a.grid(True, alpha=0.3)
    _say_highway(fig, st)
    axes[0].set_ylabel("density" if density else "tokens")
    if not density:
        from matplotlib.ticker import MaxNLocator
        axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    _suptitle(fig, "gate distribution", capture)
    return fig


# Gate against dot ------------------------------------------------------------------------------

def _gate_curve(x: np.ndarray) -> np.ndarray:
    """docs/math.md section 6: sigmoid(copysign(sqrt(max(|x|, 1e-6)), x)), in float64."""
    g = np.copysign(np.sqrt(np.maximum(np.abs(x), GATE_CLAMP)), x)
    return 1.0 / (1.0 + np.exp(-g))


def gate_vs_dot(capture, layer_ids=None, xscale: str = "linear", ax=None, fig=None):
    """Every live token's gate against its dot, one panel per engram layer and stream (layers down,
    streams across), over the curve sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) that the gate
    must lie on.

    The clamp region |dot| < 1e-6 is shaded; on a linear axis it is far too narrow to see, so
    points inside it are also ringed in red and counted in the legend. xscale="symlog" (linear
    within +-1e-6) shows the region at its true place. `ax`: layers x streams Axes.
    """
    if xscale not in ("linear", "symlog"):
        raise ValueError(f"xscale must be 'linear' or 'symlog', got {xscale!r}")
    st = _stats_of(capture)
    layers = _pick_layers(st, layer_ids)
    hc = max(st.streams(lid) for lid in layers)
    fig, axes = _panels(len(layers) * hc, ax, fig, nrows=len(layers), ncols=hc,
                        figsize=(3.4 * hc + 0.6, 3.0 * len(layers) + 0.6), sharey=True)
    for li, lid in enumerate(layers):
        g = st.per_token(lid)                                # [T, hc] NaN at masked tokens
        try:
            d = st.per_token(lid, "dot")
        except KeyError:
            d = None
        for c in range(hc):
            a = axes[li * hc + c]
            a.set_title(f"L{lid} stream {c}", fontsize=9, loc="left")
            if d is None or c >= g.shape[1]:
                a.text(0.5, 0.5, f"L{lid}.gate.dot was not captured" if d is None else "no such stream",
                       ha="center", va="center", transform=a.transAxes, fontsize=8)
                continue
            live = np.isfinite(d[:, c]) & np.isfinite(g[:, c])
            x, y = d[live, c], g[live, c]
            lo, hi = (float(x.min()), float(x.max())) if x.size else (-1.0, 1.0)
            span = max(hi - lo, 1e-3)
            lo, hi = min(lo - 0.05 * span, -1e-3), max(hi + 0.05 * span, 1e-3)
            # dense near 0, where the curve is steepest (slope ~ 1/sqrt|x|), plus the clamp corners
            near = np.geomspace(1e-9, max(-lo, hi), 400)
            xs = np.unique(np.concatenate([np.linspace(lo, hi, 801), near, -near, [0.0, GATE_CLAMP, -GATE_CLAMP]]))
            xs = xs[(xs >= lo) & (xs <= hi)]
            a.plot(xs, _gate_curve(xs), color="black", linewidth=1.0, zorder=1,
                   label="sigmoid(sign·sqrt(max(|dot|, 1e-6)))")
            a.axvspan(-GATE_CLAMP, GATE_CLAMP, color="tab:red", alpha=0.25, zorder=0, label="clamp |dot| < 1e-6")
            a.axvline(0.0, color="tab:red", linewidth=0.6, linestyle=":", zorder=0)
            a.scatter(x, y, s=14, alpha=0.75, zorder=2, color=f"C{c}", label=f"{x.size} live tokens")
            clamped = np.abs(x) < GATE_CLAMP
            a.scatter(x[clamped], y[clamped], s=60, facecolors="none", edgecolors="tab:red", linewidths=1.2,
                      zorder=3, label=f"clamped: {int(clamped.sum())}")
            if xscale == "symlog":
                a.set_xscale("symlog", linthresh=GATE_CLAMP)
                # every third decade: matplotlib's default labels every decade and they overlap
                big = max(-lo, hi)
                # from 1e-3: ±1e-6 sits at the edge of the linear region, so close to 0 that its
                # label ran into 0's ("-1e-60"); the clamp band is named in the legend
                decades = [10.0 ** e for e in range(-3, int(np.ceil(np.log10(big))) + 1, 3)]
                ticks = sorted([-v for v in decades if v <= -lo] + [0.0] + [v for v in decades if v <= hi])
                a.set_xticks(ticks, ["0" if t == 0 else f"{'-' if t < 0 else ''}1e{int(round(np.log10(abs(t))))}"
                                     for t in ticks])
            a.set_xlim(lo, hi)
            a.set_ylim(0.0, 1.0)
            a.legend(fontsize=6, loc="upper left")
            a.grid(True, alpha=0.3)
        axes[li * hc].set_ylabel("gate")
    for a in axes[(len(layers) - 1) * hc:]:
        a.set_xlabel("dot (before the signed sqrt)")
    _suptitle(fig, "gate against dot" + (f" ({st.n_masked} masked token(s) excluded)" if st.n_masked else ""),
              capture)
    _say_highway(fig, st)
    return fig


# Hash table use -------------------------------------------------------------------------------

def row_id_reuse_plot(capture, ax=None, fig=None, **reuse_kwargs):
    """Per engram layer and hash column: tokens, distinct n-gram contexts and distinct row ids.

    capture: a Capture (then `reuse_kwargs` go to `stats.row_id_reuse`, e.g. tables=...), or a
    `RowIdReuse`. Where the ids bar is lower than the contexts bar, different contexts shared a
    row (a hash collision; the number above the bar). Contexts below tokens is plain repetition
    in the text, which the hash keeps together by design.
    """
    reuse = capture if isinstance(capture, RowIdReuse) else row_id_reuse(capture, **reuse_kwargs)
    layers = reuse.layers
    C = len(reuse[layers[0]])
    fig, axes = _panels(len(layers), ax, fig, nrows=len(layers), ncols=1,
                        figsize=(float(np.clip(2.0 + 0.42 * C, 7.0, 16.0)), 2.9 * len(layers) + 0.5), sharex=True)
    x = np.arange(C)
    w = 0.38
    for a, lid in zip(axes, layers):
        cols = reuse[lid]
        tokens = np.array([c.n_tokens for c in cols])
        ctx = np.array([c.distinct_contexts for c in cols])
        ids = np.array([c.distinct_ids for c in cols])
        a.bar(x, tokens, width=0.9, color="#e6e6e6", edgecolor="#bdbdbd", label="tokens")
        a.bar(x - w / 2, ctx, width=w, color="tab:blue", label="distinct contexts")
        a.bar(x + w / 2, ids, width=w, color="tab:orange", label="distinct row ids")
        for c in cols:
            if c.collisions:
                a.annotate(f"-{c.collisions}", (c.col + w / 2, c.distinct_ids), xytext=(0, 2),
                           textcoords="offset points", ha="center", va="bottom", fontsize=7, color="tab:red")
        # order boundaries: each order's heads are one group
        for b in range(reuse.n_heads, C, reuse.n_heads):
            a.axvline(b - 0.5, color="grey", linewidth=0.8, linestyle="--")
        top = max(int(tokens.max()) if tokens.size else 1, 1)
        for o in range(reuse.max_ngram_size - 1):
            a.text(o * reuse.n_heads + (reuse.n_heads - 1) / 2, top * 1.08, f"{o + 2}-gram", ha="center",
                   va="bottom", fontsize=8)
        a.set_ylim(0, top * 1.22)
        n_coll = sum(c.collisions for c in cols)
        a.set_title(f"L{lid}: {n_coll} collision(s) over {C} hash columns"
                    + ("" if reuse.exact else " (approximate contexts)"), fontsize=10, loc="left")
        a.set_ylabel("count")
        a.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="per column",
                   title_fontsize=7, frameon=False)
    axes[0].text(1.01, 0.45, "red -k: k contexts\nmerged into other\ncontexts' row ids", transform=axes[0].transAxes,
                 fontsize=7, color="tab:red", va="top")
    bottom = axes[-1]
    bottom.set_xticks(x, [f"{c.col}\nh{c.head}" for c in reuse[layers[-1]]], fontsize=7)
    bottom.set_xlabel("hash column (head within its n-gram order)")
    for a in axes[:-1]:
        a.tick_params(axis="x", labelbottom=False)
    if not isinstance(capture, RowIdReuse):
        _suptitle(fig, "hash-table row use", capture)
    return fig


# Corpus statistics ---------------------------------------------------------------------------------

def corpus_token_plot(stats, layer_ids=None, min_count: int = 5, label_top: int = 8, ax=None, fig=None):
    """Per compressed token of a corpus (`corpus_stats`): mean gate (over streams) against
    occurrences, one panel per engram layer; the most frequent tokens are labelled with their
    strings. Tokens seen fewer than `min_count` times are left out (their mean is noise)."""
    from ..text import token_label
    layers = _pick_layers(stats, layer_ids)
    fig, axes = _panels(len(layers), ax, fig, nrows=1, ncols=len(layers), figsize=(4.8 * len(layers) + 0.6, 3.8),
                        sharey=True)
    for a, lid in zip(axes, layers):
        rows = stats.top_tokens(lid, None, k=stats.compressed_vocab, by="count", min_count=min_count)
        if not rows:
            a.text(0.5, 0.5, f"no token seen {min_count}+ times", ha="center", va="center", transform=a.transAxes)
            continue
        counts = np.array([r["count"] for r in rows])
        means = np.array([r["mean_gate"] for r in rows])
        a.scatter(counts, means, s=10, alpha=0.6)
        for r in rows[:label_top]:
            name = token_label(r["token"]) if r["token"] is not None else str(r["compressed_id"])
            a.annotate(font_safe(name[:12]), (r["count"], r["mean_gate"]), fontsize=7, xytext=(3, 2), textcoords="offset points")
        a.set_xscale("log")
        a.axhline(0.5, color="grey", linestyle=":", linewidth=1.0)
        a.set_xlabel("occurrences (log)")
        a.set_title(f"L{lid}: {len(rows)} compressed tokens seen >= {min_count}x", fontsize=10, loc="left")
        a.grid(True, alpha=0.3)
    axes[0].set_ylabel("mean gate (over streams)")
    _say_highway(fig, stats)
    return fig


def corpus_columns_plot(stats, ax=None, fig=None):
    """Per engram layer and hash column of a corpus: distinct contexts of the column's order
    (tracked), the distinct row ids they hash to, and distinct row ids read; collisions above."""
    cols = stats.columns()
    layers = stats.layer_ids
    C = stats.n_hash_cols
    fig, axes = _panels(len(layers), ax, fig, nrows=len(layers), ncols=1,
                        figsize=(float(np.clip(2.0 + 0.42 * C, 7.0, 16.0)), 2.9 * len(layers) + 0.5), sharex=True)
    x = np.arange(C)
    w = 0.38
    for a, lid in zip(axes, layers):
        rs = [r for r in cols if r["layer"] == lid]
        ctx = np.array([r.get("distinct_contexts", 0) for r in rs])
        ids = np.array([r["distinct_ids"] for r in rs])
        a.bar(x - w / 2, ctx, width=w, color="tab:blue", label="distinct contexts (tracked)")
        a.bar(x + w / 2, ids, width=w, color="tab:orange", label="distinct row ids")
        for r in rs:
            if r.get("collisions"):
                a.annotate(f"-{r['collisions']}", (r["col"] + w / 2, r["distinct_ids"]), xytext=(0, 2),
                           textcoords="offset points", ha="center", va="bottom", fontsize=7, color="tab:red")
        exact = all(r.get("exact", True) for r in rs)
        a.set_title(f"L{lid}: {sum(r.get('collisions', 0) for r in rs)} collision(s) over {stats.n_tokens - stats.n_masked}"
                    f" live tokens" + ("" if exact else " (context table pruned: lower bounds)"), fontsize=10, loc="left")
        a.set_ylabel("count")
        a.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[-1].set_xticks(x, [f"{r['col']}\nh{r['head']}" for r in cols if r["layer"] == layers[-1]], fontsize=7)
    axes[-1].set_xlabel("hash column (head within its n-gram order)")
    return fig
