"""Statistics of a captured run: how the gate behaves, and how the hash tables are used.

    st = gate_stats(cap)          # every engram layer and stream of a Capture
    st                            # an HTML table in Jupyter, a text table in a terminal
    st.per_token(1)               # [T, hc] gate of layer 1, NaN at masked tokens
    st.histogram(1, stream=0)     # (counts, edges) over [0, 1]
    en.gate_histogram(st)         # the figure (plots import stats; stats never import plots)

    reuse = row_id_reuse(cap, tables=model.hash_tables)
    print(reuse)                  # per layer and hash column: tokens, distinct ids, collisions
    en.row_id_reuse_plot(reuse)   # its figure

Both read only the documented capture points (`tokens.ids`, `tokens.mask`, `L{id}.hash.ids`,
`L{id}.gate.dot`, `L{id}.gate.gate`), so they work on any `Capture` or plain dict of arrays,
from any backend, loaded from disk or not.

Masked (dead) tokens: the gate is exactly 0 there by definition (docs/math.md, section 6), and the dot is
still computed but unused, so both are left out of every statistic and counted on their own.
A masked token whose gate is not 0 is counted too (`masked_nonzero`): it means a backend bug.
"""
from __future__ import annotations

import html
import re
from dataclasses import asdict, dataclass, field
from typing import Mapping

import numpy as np

from .._argcheck import need_capture, need_int, need_int_list

from ..config import GATE_CLAMP, RELEASED_MAX_NGRAM_SIZE
from ..stages.hash.cpu import DEAD
from ..stages.hash.cpu import ngram_windows as ngram_windows_of

QUANTILES = (0.05, 0.25, 0.50, 0.75, 0.95)
_GATE_POINT = re.compile(r"^L(\d+)\.gate\.gate$")
_HASH_POINT = re.compile(r"^L(\d+)\.hash\.ids$")

# Stands in for the pad in reconstructed n-gram windows when the pad id is not known. It is no
# token id (ids are >= 0) and differs from the hasher's DEAD (-1).
UNKNOWN_PAD = -2


def _layers_with(capture: Mapping, pattern: re.Pattern) -> list[int]:
    """Layer ids of the points matching `pattern`, in the capture's (firing) order."""
    need_capture(capture)
    out = []
    for name in capture:
        m = pattern.match(name)
        if m and int(m.group(1)) not in out:
            out.append(int(m.group(1)))
    return out


def _live_mask(capture: Mapping, n_tokens: int) -> np.ndarray:
    """tokens.mask [T] bool; every token live when the capture did not keep it."""
    if "tokens.mask" not in capture:
        return np.ones(n_tokens, dtype=bool)
    mask = np.asarray(capture["tokens.mask"], dtype=bool)
    if mask.shape != (n_tokens,):
        raise ValueError(f"tokens.mask has shape {mask.shape} but the gate has {n_tokens} tokens")
    return mask


def _nan_if_empty(fn, x):
    return float(fn(x)) if x.size else float("nan")


# Gate statistics -----------------------------------------------------------------------------

def state_equal(a, b, skip=()) -> bool:
    """Two statistics objects hold the same state: same class, and every attribute (but `skip`)
    equal, arrays by value (NaN equal to NaN), nested dicts, lists and objects likewise."""
    def same(x, y):
        if type(x) is not type(y):
            return False
        if isinstance(x, np.ndarray):
            return x.shape == y.shape and x.dtype == y.dtype and bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        if isinstance(x, float):
            return x == y or (x != x and y != y)
        if hasattr(x, "__dict__") and not callable(x):
            return same(vars(x), vars(y))
        return bool(x == y)
    if type(a) is not type(b):
        return NotImplemented
    va = {k: v for k, v in vars(a).items() if k not in skip}
    vb = {k: v for k, v in vars(b).items() if k not in skip}
    return same(va, vb)


@dataclass
class StreamGateStats:
    """The gate (and dot) of one stream of one engram layer, over live tokens only."""

    layer: int
    stream: int
    n: int                 # live tokens with a finite gate: what every statistic below is over
    n_masked: int          # masked tokens, left out
    masked_nonzero: int    # masked tokens whose gate is not exactly 0 (should be 0)
    n_nonfinite: int       # live tokens whose gate is NaN/inf, left out (should be 0)
    mean: float
    std: float             # population std (ddof=0)
    min: float
    max: float
    q05: float             # np.quantile, linear interpolation
    q25: float
    q50: float
    q75: float
    q95: float
    dot_mean_abs: float    # mean |dot| over live tokens (nan when the dot was not captured)
    dot_min: float
    dot_max: float
    n_clamped: int         # live tokens with |dot| < 1e-6: the clamp set g = +-1e-3, gate ~ 0.50025
    clamp_frac: float      # n_clamped / live tokens with a finite dot
    hist_counts: np.ndarray = field(repr=False)  # [bins] int64, gate over [0, 1]


class GateStats:
    """Gate statistics of every engram layer and stream of one capture (see `gate_stats`)."""

    def __init__(self, rows: list[StreamGateStats], gates: dict[int, np.ndarray],
                 dots: dict[int, np.ndarray | None], mask: np.ndarray, bins: int, label: str = "",
                 token_ids: np.ndarray | None = None, token_strings: list[str] | None = None, highway: str = ""):
        self.rows = rows
        self.token_ids = token_ids          # [T] int64 when the capture kept tokens.ids
        self.token_strings = token_strings  # one string per token when the run had a tokenizer
        self.highway = highway              # the capture's meta["highway"] ("synthetic ..." when drawn)
        self._gates = gates            # {layer: [T, hc] fp32}, as captured (masked rows 0)
        self._dots = dots              # {layer: [T, hc] fp32 or None}
        self.mask = mask               # [T] bool, True = live
        self.bins = bins
        self.edges = np.linspace(0.0, 1.0, bins + 1)  # [bins + 1]
        self.label = label

    def __eq__(self, other):
        """Equal when built from the same gates, dots, mask, tokens and settings."""
        return state_equal(self, other)

    __hash__ = None

    # access ---------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return list(self._gates)

    @property
    def n_tokens(self) -> int:
        return int(self.mask.size)

    @property
    def n_masked(self) -> int:
        return int((~self.mask).sum())

    def streams(self, layer_id: int) -> int:
        return int(self._layer_gate(layer_id).shape[1])

    def __getitem__(self, key) -> StreamGateStats:
        """st[layer_id, stream] -> that stream's StreamGateStats."""
        layer_id, stream = key
        for r in self.rows:
            if r.layer == layer_id and r.stream == stream:
                return r
        raise KeyError(f"no statistics for layer {layer_id} stream {stream}; layers are {self.layers}")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def _layer_gate(self, layer_id: int) -> np.ndarray:
        try:
            return self._gates[int(layer_id)]
        except KeyError:
            raise KeyError(f"layer {layer_id} has no gate in this capture; layers are {self.layers}") from None

    def per_token(self, layer_id: int, what: str = "gate") -> np.ndarray:
        """[T, hc] float32 copy of the gate (or, what="dot", the dot), NaN at masked tokens."""
        if what == "gate":
            arr = self._layer_gate(layer_id)
        elif what == "dot":
            self._layer_gate(layer_id)
            arr = self._dots.get(int(layer_id))
            if arr is None:
                raise KeyError(f"the capture holds no L{layer_id}.gate.dot")
        else:
            raise ValueError(f"what must be 'gate' or 'dot', got {what!r}")
        out = np.array(arr, dtype=np.float32, copy=True)
        out[~self.mask] = np.nan
        return out

    def histogram(self, layer_id: int, stream: int, bins: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(counts [bins] int64, edges [bins + 1]) of one stream's gate over [0, 1], live tokens.
        The counts sum to the stream's `n` (the last bin includes 1.0)."""
        if bins is None or bins == self.bins:
            return self[int(layer_id), int(stream)].hist_counts.copy(), self.edges.copy()
        g = self.per_token(layer_id)[:, stream]
        return np.histogram(g[np.isfinite(g)], bins=bins, range=(0.0, 1.0))

    # reports ---------------------------------------------------------------------------------
    def to_records(self, histograms: bool = False) -> list[dict]:
        """One flat dict per (layer, stream), e.g. for pandas.DataFrame; `histograms=True` adds
        the counts as a list (edges are `self.edges`)."""
        out = []
        for r in self.rows:
            d = asdict(r)
            counts = d.pop("hist_counts")
            if histograms:
                d["hist_counts"] = [int(c) for c in counts]
            out.append(d)
        return out

    _COLUMNS = ("layer", "stream", "n", "mean", "std", "q05", "q50", "q95", "min", "max", "mean|dot|", "clamp%")

    @staticmethod
    def _f(v: float, digits: int = 4) -> str:
        return "-" if not np.isfinite(v) else f"{v:.{digits}f}"

    def _cells(self, r: StreamGateStats) -> list[str]:
        f = self._f
        clamp = "-" if not np.isfinite(r.clamp_frac) else f"{100.0 * r.clamp_frac:.1f}"
        return [f"L{r.layer}", str(r.stream), str(r.n), f(r.mean), f(r.std), f(r.q05), f(r.q50), f(r.q95),
                f(r.min), f(r.max), f(r.dot_mean_abs, 3), clamp]

    @property
    def highway_is_synthetic(self) -> bool:
        return self.highway.startswith("synthetic")

    def token_labels(self) -> list[str]:
        """One printable label per token: its string (spaces as '␣') when known, else its id,
        else its position."""
        from ..text import token_label
        if self.token_strings is not None and len(self.token_strings) == self.n_tokens:
            return [token_label(s) for s in self.token_strings]
        if self.token_ids is not None:
            return [str(int(i)) for i in self.token_ids]
        return [str(t) for t in range(self.n_tokens)]

    def _header(self) -> str:
        who = f" ({self.label})" if self.label else ""
        hw = ""
        if self.highway:
            hw = ("; highway: SYNTHETIC (N(0,1) draws, no transformer blocks)" if self.highway_is_synthetic
                  else f"; highway: {self.highway}")
        return (f"gate statistics{who}: {self.n_tokens} tokens, {self.n_masked} masked (excluded), "
                f"layers {self.layers}{hw}")

    def per_token_table(self, max_tokens: int = 64, stream_mean: bool = False) -> str:
        """The gate of every token (rows) per layer and stream (columns), with the token's id and
        string; masked tokens show '-'. stream_mean=True: one column per layer (mean over streams)."""
        labels = self.token_labels()
        head = ["pos", "id", "token"]
        cols = []
        for lid in self.layers:
            g = self.per_token(lid)                             # [T, hc] NaN at masked
            if stream_mean:
                head.append(f"L{lid} mean")
                cols.append(np.nanmean(np.where(np.isfinite(g), g, np.nan), axis=1, keepdims=True)
                            if g.size else g[:, :1])
            else:
                head += [f"L{lid}.s{c}" for c in range(g.shape[1])]
                cols.append(g)
        values = np.concatenate(cols, axis=1) if cols else np.zeros((self.n_tokens, 0))
        T = min(self.n_tokens, max_tokens)
        ids = self.token_ids if self.token_ids is not None else np.full(self.n_tokens, -1)
        table = [head] + [[str(t), str(int(ids[t])) if ids[t] >= 0 else "-", labels[t][:16]]
                          + [("-" if not np.isfinite(v) else f"{v:.3f}") for v in values[t]] for t in range(T)]
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines = [f"gate per token ({'strings' if self.token_strings is not None else 'no tokenizer: ids'}"
                 + (", highway SYNTHETIC" if self.highway_is_synthetic else "") + ")"]
        for j, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        if self.n_tokens > T:
            lines.append(f"... {self.n_tokens - T} more tokens")
        return "\n".join(lines)

    def top_tokens(self, layer_id: int, stream: int | None = None, k: int = 10, lowest: bool = False) -> list[dict]:
        """The k live tokens with the highest (lowest=True: lowest) gate in one layer (stream None:
        the mean over streams): position, token_id, token (string or None), gate."""
        g = self.per_token(layer_id)
        v = np.nanmean(g, axis=1) if stream is None else g[:, int(stream)]
        live = np.flatnonzero(np.isfinite(v))
        order = live[np.lexsort((live, v[live] if lowest else -v[live]))][:k]
        strings = self.token_strings if self.token_strings is not None and len(self.token_strings) == self.n_tokens \
            else None
        return [{"position": int(t), "token_id": None if self.token_ids is None else int(self.token_ids[t]),
                 "token": None if strings is None else strings[t], "gate": float(v[t])} for t in order]

    def _warnings(self) -> list[str]:
        out = []
        for r in self.rows:
            if r.masked_nonzero:
                out.append(f"L{r.layer} stream {r.stream}: {r.masked_nonzero} masked token(s) with a non-zero gate")
            if r.n_nonfinite:
                out.append(f"L{r.layer} stream {r.stream}: {r.n_nonfinite} non-finite gate value(s) left out")
        return out

    def table(self) -> str:
        table = [list(self._COLUMNS)] + [self._cells(r) for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self._COLUMNS))]
        lines = [self._header()]
        for j, row in enumerate(table):
            lines.append("  ".join(c.rjust(w) if j and i > 1 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [f"warning: {w}" for w in self._warnings()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._COLUMNS)
        body = []
        for r in self.rows:
            bad = r.masked_nonzero or r.n_nonfinite
            style = ' style="background:#fff4e5"' if bad else ""
            body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>")
        cap = f"<caption>{html.escape(self._header())}</caption>"
        warn = "".join(f"<p>warning: {html.escape(w)}</p>" for w in self._warnings())
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{warn}"


def _stream_stats(layer_id: int, stream: int, gate: np.ndarray, dot: np.ndarray | None, live: np.ndarray,
                  edges_bins: int) -> StreamGateStats:
    """gate, dot: [T] of one stream; live: [T] bool."""
    g_all = np.asarray(gate, dtype=np.float64)
    g_live = g_all[live]
    finite = np.isfinite(g_live)
    g = g_live[finite]                                      # [n] the values every statistic is over
    masked_nonzero = int(np.count_nonzero(g_all[~live] != 0.0))
    q = np.quantile(g, QUANTILES) if g.size else np.full(len(QUANTILES), np.nan)
    counts, _ = np.histogram(g, bins=edges_bins, range=(0.0, 1.0))
    if dot is not None:
        d = np.asarray(dot, dtype=np.float64)[live]
        d = d[np.isfinite(d)]
        absd = np.abs(d)
        n_clamped = int(np.count_nonzero(absd < GATE_CLAMP))
        clamp_frac = n_clamped / d.size if d.size else float("nan")
        dot_stats = (_nan_if_empty(np.mean, absd), _nan_if_empty(np.min, d), _nan_if_empty(np.max, d))
    else:
        n_clamped, clamp_frac, dot_stats = 0, float("nan"), (float("nan"),) * 3
    return StreamGateStats(
        layer=layer_id, stream=stream, n=int(g.size), n_masked=int((~live).sum()), masked_nonzero=masked_nonzero,
        n_nonfinite=int((~finite).sum()),
        mean=_nan_if_empty(np.mean, g), std=_nan_if_empty(np.std, g),
        min=_nan_if_empty(np.min, g), max=_nan_if_empty(np.max, g),
        q05=float(q[0]), q25=float(q[1]), q50=float(q[2]), q75=float(q[3]), q95=float(q[4]),
        dot_mean_abs=dot_stats[0], dot_min=dot_stats[1], dot_max=dot_stats[2],
        n_clamped=n_clamped, clamp_frac=clamp_frac, hist_counts=counts.astype(np.int64))


def gate_stats(capture: Mapping, bins: int = 20, layer_ids=None) -> GateStats:
    """Statistics of the gate of every engram layer (points `L{id}.gate.gate`) and stream.

    capture: a `Capture` (or any mapping of point name -> array) holding `L{id}.gate.gate`
             [T, hc]; `tokens.mask` [T] and `L{id}.gate.dot` [T, hc] are used when present.
    bins:    histogram bins over [0, 1].
    Masked tokens are left out of every statistic (and counted in `n_masked`).
    """
    bins = need_int(bins, "bins", 1)
    found = _layers_with(capture, _GATE_POINT)
    if layer_ids is None:
        layer_ids = found
    else:
        layer_ids = need_int_list(layer_ids, "layer_ids")
        missing = [lid for lid in layer_ids if lid not in found]
        if missing:
            raise KeyError(f"no L{{id}}.gate.gate for layer(s) {missing}; the capture has it for {found}")
    if not layer_ids:
        raise KeyError("the capture holds no `L{id}.gate.gate` point (was it filtered out by names_filter?)")
    gates, dots, rows = {}, {}, []
    mask = None
    for lid in layer_ids:
        gate = np.asarray(capture[f"L{lid}.gate.gate"])        # [T, hc] fp32
        if gate.ndim != 2:
            raise ValueError(f"L{lid}.gate.gate must be [T, hc], got shape {gate.shape}")
        if mask is None:
            mask = _live_mask(capture, gate.shape[0])
        elif gate.shape[0] != mask.size:
            raise ValueError(f"L{lid}.gate.gate has {gate.shape[0]} tokens, other layers {mask.size}")
        dot = capture.get(f"L{lid}.gate.dot") if hasattr(capture, "get") else None
        if dot is not None:
            dot = np.asarray(dot)                               # [T, hc] fp32
            if dot.shape != gate.shape:
                raise ValueError(f"L{lid}.gate.dot has shape {dot.shape}, the gate {gate.shape}")
        gates[lid], dots[lid] = gate, dot
        for c in range(gate.shape[1]):
            rows.append(_stream_stats(lid, c, gate[:, c], None if dot is None else dot[:, c], mask, bins))
    meta = getattr(capture, "meta", None) or {}
    token_ids = np.asarray(capture["tokens.ids"], dtype=np.int64) if "tokens.ids" in capture else None
    strings = meta.get("token_strings")
    if not isinstance(strings, list) or len(strings) != mask.size:
        strings = None
    return GateStats(rows, gates, dots, mask, bins, label=_capture_label(capture), token_ids=token_ids,
                     token_strings=strings, highway=str(meta.get("highway", "")))


def _capture_label(capture: Mapping) -> str:
    meta = getattr(capture, "meta", None) or {}
    backends = meta.get("backends")
    if isinstance(backends, dict):
        vals = set(backends.values())
        return vals.pop() if len(vals) == 1 else ",".join(f"{k}={v}" for k, v in backends.items())
    return ""


# Row-id reuse and hash collisions ----------------------------------------------------------

def ngram_windows(token_ids, token_mask=None, max_ngram_size: int = RELEASED_MAX_NGRAM_SIZE,
                  pad_id: int | None = None, token_map=None) -> np.ndarray:
    """The n-gram window the hasher folds at every position: [T, max_ngram_size] int64, where
    column s is the token s places back (docs/math.md, section 3.1).

    With `token_map` (raw -> compressed) the ids are compressed first, as the hasher does, and
    `pad_id` is the compressed pad; without it the raw ids are used and `pad_id` must be given
    in raw ids (2 in the release). With no `pad_id`, blocked slots take `UNKNOWN_PAD` (-2).
    Assumes the tokens start the sequence (a decode step's look-back into its prefill is not
    in a capture).
    """
    raw = np.asarray(token_ids)
    if raw.ndim != 1 or (raw.size and (raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer))):
        raise TypeError(f"token_ids must be 1-D integers, got {raw.dtype}{list(raw.shape)}")
    ids = raw.astype(np.int64)                              # [T]
    T = ids.size
    live = np.ones(T, dtype=bool) if token_mask is None else np.asarray(token_mask, dtype=bool)
    if token_map is not None:
        ids = np.asarray(token_map, dtype=np.int64)[ids]
    pad = UNKNOWN_PAD if pad_id is None else int(pad_id)
    out = np.empty((T, max_ngram_size), dtype=np.int64)
    history = np.where(live, ids, DEAD)                     # dead tokens block the windows
    ngram_windows_of(history, 0, T, max_ngram_size, pad, out)
    return out


@dataclass
class ColumnReuse:
    """How one hash column's row ids are shared by the tokens of one capture."""

    layer: int
    col: int
    order: int              # n-gram size of this column: col // n_heads + 2
    head: int               # col % n_heads
    n_tokens: int           # tokens counted (live ones unless include_masked)
    distinct_ids: int
    distinct_contexts: int  # distinct n-gram windows of size `order`
    collisions: int         # distinct (context, id) pairs - distinct ids: contexts lost to a shared id
    colliding_pairs: int    # token pairs with different contexts but the same row id
    inconsistent: int       # distinct (context, id) pairs - distinct contexts: should be 0 (else the
                            # reconstructed contexts are not what was hashed, or the ids were replaced)
    max_reuse: int          # most tokens sharing one row id
    reuse_hist: np.ndarray = field(repr=False)  # [max_reuse + 1] int64: [k] = ids used by exactly k tokens

    @property
    def reused_ids(self) -> int:
        """Row ids read by more than one token."""
        return int(self.reuse_hist[2:].sum())


def _n_distinct_rows(a: np.ndarray) -> int:
    return int(np.unique(a, axis=0).shape[0]) if a.shape[0] else 0


def _pairs(counts: np.ndarray) -> int:
    counts = counts.astype(np.int64)
    return int((counts * (counts - 1) // 2).sum())


def _column_reuse(layer_id: int, col: int, n_heads: int, ids: np.ndarray, windows: np.ndarray) -> ColumnReuse:
    """ids: [n] this column's row ids; windows: [n, max_ngram_size]."""
    order = col // n_heads + 2
    ctx = windows[:, :order]                                # [n, order]
    n = ids.size
    if n == 0:
        return ColumnReuse(layer_id, col, order, col % n_heads, 0, 0, 0, 0, 0, 0, 0, np.zeros(1, np.int64))
    uniq_ids, id_counts = np.unique(ids, return_counts=True)
    pairs, pair_counts = np.unique(np.column_stack([ctx, ids]), axis=0, return_counts=True)
    n_ctx = _n_distinct_rows(ctx)
    return ColumnReuse(
        layer=layer_id, col=col, order=order, head=col % n_heads, n_tokens=int(n),
        distinct_ids=int(uniq_ids.size), distinct_contexts=n_ctx,
        collisions=int(pairs.shape[0] - uniq_ids.size),
        # same-id pairs minus same-(context, id) pairs = same id, different context
        colliding_pairs=_pairs(id_counts) - _pairs(pair_counts),
        inconsistent=int(pairs.shape[0] - n_ctx),
        max_reuse=int(id_counts.max()),
        reuse_hist=np.bincount(id_counts).astype(np.int64))


class RowIdReuse(dict):
    """{layer_id: [ColumnReuse per hash column]} with a table, HTML and a plot (see `row_id_reuse`)."""

    def __init__(self, columns: dict[int, list[ColumnReuse]], n_tokens: int, n_masked: int,
                 include_masked: bool, exact: bool, pad_id, n_heads: int, max_ngram_size: int):
        super().__init__(columns)
        self.n_tokens, self.n_masked, self.include_masked = n_tokens, n_masked, include_masked
        self.exact = exact            # contexts are exactly what the hasher folded (token_map and pad known)
        self.pad_id, self.n_heads, self.max_ngram_size = pad_id, n_heads, max_ngram_size

    @property
    def layers(self) -> list[int]:
        return list(self.keys())

    def to_records(self, histograms: bool = False) -> list[dict]:
        out = []
        for cols in self.values():
            for c in cols:
                d = asdict(c)
                hist = d.pop("reuse_hist")
                d["reused_ids"] = c.reused_ids
                if histograms:
                    d["reuse_hist"] = [int(x) for x in hist]
                out.append(d)
        return out

    _COLUMNS = ("layer", "col", "order", "head", "tokens", "ids", "contexts", "collisions", "coll.pairs",
                "reused ids", "max reuse", "inconsistent")

    @staticmethod
    def _cells(c: ColumnReuse) -> list[str]:
        return [f"L{c.layer}", str(c.col), f"{c.order}-gram", str(c.head), str(c.n_tokens), str(c.distinct_ids),
                str(c.distinct_contexts), str(c.collisions), str(c.colliding_pairs), str(c.reused_ids),
                str(c.max_reuse), str(c.inconsistent)]

    def _header(self) -> str:
        who = "all tokens" if self.include_masked else f"live tokens ({self.n_masked} masked left out)"
        how = ("contexts exact (token_map and pad known)" if self.exact else
               "contexts approximate: " + ("raw ids, " if self.pad_id is not None else "raw ids, pad unknown, ")
               + "collisions may be over-counted")
        return f"row-id reuse over {who} of {self.n_tokens}; {how}"

    def table(self) -> str:
        table = [list(self._COLUMNS)] + [self._cells(c) for cols in self.values() for c in cols]
        widths = [max(len(row[i]) for row in table) for i in range(len(self._COLUMNS))]
        lines = [self._header()]
        for j, row in enumerate(table):
            lines.append("  ".join(c.rjust(w) if j and i > 3 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        bad = sum(c.inconsistent for cols in self.values() for c in cols)
        if bad:
            lines.append(f"warning: {bad} context(s) map to more than one row id: the reconstructed n-grams are "
                         "not what was hashed (wrong pad/token_map, a capture that does not start the "
                         "sequence, or replaced hash.ids)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._COLUMNS)
        body = []
        for cols in self.values():
            for c in cols:
                style = ' style="background:#fff4e5"' if c.collisions or c.inconsistent else ""
                body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(x)}</td>" for x in self._cells(c))
                            + "</tr>")
        cap = f"<caption>{html.escape(self._header())}</caption>"
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def row_id_reuse(capture: Mapping, *, tables=None, pad_id: int | None = None, token_map=None,
                 n_heads: int | None = None, max_ngram_size: int | None = None,
                 include_masked: bool = False) -> RowIdReuse:
    """Per engram layer and hash column: how many tokens, how many distinct row ids, how the ids
    are shared, and how many n-gram contexts were merged by the hash (collisions).

    A column of order n hashes the n-gram window ending at each position (col // n_heads + 2
    tokens). The same window always gives the same id, so distinct ids <= distinct windows, and
    `collisions` = distinct (window, id) pairs - distinct ids counts windows that lost their own
    row to another window's (0 when the hash separated everything in this capture).

    The windows are rebuilt from `tokens.ids` and `tokens.mask` with the sticky (docs/math.md, section 3.1)
    blocking. They are exact with `tables` (an `EngramHashTables`: token_map, compressed pad,
    n_heads and max_ngram_size), or with both `token_map` and `pad_id`. Otherwise they are raw-id
    windows: raw ids that share a compressed id, and (without `pad_id`) a real pad token in the
    text, make distinct windows that the hasher sees as one, so collisions can be over-counted.
    Without `tables`, n_heads = C // (max_ngram_size - 1) with max_ngram_size 4 by default.

    include_masked: also count masked tokens (their window is all pad, so they share one id).
    """
    if tables is not None:
        from ..stages.hash.tables import EngramHashTables
        if not isinstance(tables, EngramHashTables):
            raise TypeError(f"tables must be an EngramHashTables (model.hash_tables), got {type(tables).__name__}")
        token_map = tables.token_map if token_map is None else token_map
        pad_id = tables.pad_id if pad_id is None else pad_id
        n_heads = tables.n_heads if n_heads is None else n_heads
        max_ngram_size = tables.max_ngram_size if max_ngram_size is None else max_ngram_size
    layer_ids = _layers_with(capture, _HASH_POINT)
    if not layer_ids:
        raise KeyError("the capture holds no `L{id}.hash.ids` point (was it filtered out by names_filter?)")
    if "tokens.ids" not in capture:
        raise KeyError("row_id_reuse needs `tokens.ids` in the capture to rebuild the n-gram contexts")
    token_ids = np.asarray(capture["tokens.ids"], dtype=np.int64)   # [T]
    T = token_ids.size
    live = _live_mask(capture, T)
    C = int(np.asarray(capture[f"L{layer_ids[0]}.hash.ids"]).shape[1])
    if n_heads is None:
        max_ngram_size = RELEASED_MAX_NGRAM_SIZE if max_ngram_size is None else int(max_ngram_size)
        if C % (max_ngram_size - 1):
            raise ValueError(f"{C} hash columns do not split into {max_ngram_size - 1} orders; "
                             "pass n_heads or max_ngram_size (or tables)")
        n_heads = C // (max_ngram_size - 1)
    elif max_ngram_size is None:
        if C % int(n_heads):
            raise ValueError(f"{C} hash columns are not a multiple of n_heads={n_heads}")
        max_ngram_size = C // int(n_heads) + 1
    n_heads, max_ngram_size = int(n_heads), int(max_ngram_size)
    if C != n_heads * (max_ngram_size - 1):
        raise ValueError(f"hash.ids has {C} columns, but n_heads={n_heads} and max_ngram_size={max_ngram_size} "
                         f"make {n_heads * (max_ngram_size - 1)}")
    windows = ngram_windows(token_ids, live, max_ngram_size, pad_id, token_map)   # [T, M]
    keep = np.ones(T, dtype=bool) if include_masked else live
    columns = {}
    for lid in layer_ids:
        ids = np.asarray(capture[f"L{lid}.hash.ids"], dtype=np.int64)   # [T, C]
        if ids.shape != (T, C):
            raise ValueError(f"L{lid}.hash.ids has shape {ids.shape}, expected ({T}, {C})")
        columns[lid] = [_column_reuse(lid, c, n_heads, ids[keep, c], windows[keep]) for c in range(C)]
    return RowIdReuse(columns, n_tokens=T, n_masked=int((~live).sum()), include_masked=include_masked,
                      exact=token_map is not None and pad_id is not None, pad_id=pad_id,
                      n_heads=n_heads, max_ngram_size=max_ngram_size)
