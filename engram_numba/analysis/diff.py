"""Diff two captures point by point: how far apart two runs are at every stage boundary.

    report = diff(cap_reference, cap_cuda)
    report            # an HTML table in Jupyter, a text table in a terminal (print(report))
    report.plot()     # relative error along the stages, one line per engram layer

For every capture point both runs hold: shapes and dtypes, how many elements are exactly equal,
max absolute and max relative difference, relative L2 (||a - b|| / ||a||), the largest distance in
ulps of the array's own precision (bf16 words: bf16 ulps; fp32: fp32 ulps; integers: none), and
the first differing index (and, when a capture's meta carries token strings, which token that
is: "[5, 2] (token 5 'the')"). Integer points (row ids, raw Q2_K bytes) are expected to be equal;
float points carry their error bars.
"""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass
from typing import Mapping

import numpy as np

from ..bf16 import bf16_to_f32, bf16_ulp_distance, f32_ulp_distance

# Arrays of these points are bf16 words (uint16), not integers.
BF16_POINTS = ("rows.bf16", "proj.kv", "gate.key", "gate.value")


def _kind(name: str, arr: np.ndarray) -> str:
    if arr.dtype == np.uint16 and any(name.endswith(p) for p in BF16_POINTS):
        return "bf16"
    if arr.dtype.name == "bfloat16":
        return "bf16"
    if np.issubdtype(arr.dtype, np.floating):
        return "fp32" if arr.dtype == np.float32 else str(arr.dtype)
    return "int"


def _as_float(arr: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bf16":
        return bf16_to_f32(arr.view(np.uint16)).astype(np.float64)
    return arr.astype(np.float64)


@dataclass
class DiffRow:
    name: str
    shape_a: tuple
    shape_b: tuple
    dtype: str
    kind: str              # "int", "bf16", "fp32"
    n: int                 # elements compared (0 when shapes differ)
    n_equal: int           # exactly equal elements (bitwise for floats, NaN == NaN)
    max_abs: float
    max_rel: float         # max |a-b| / max(|a|, tiny) over elements
    rel_l2: float          # ||a - b||_2 / ||a||_2
    max_ulp: float         # in the array's own precision; nan for integers
    first_diff: tuple | None  # index of the first differing element

    @property
    def equal(self) -> bool:
        return self.n > 0 and self.n_equal == self.n and self.shape_a == self.shape_b


def diff_arrays(name: str, a: np.ndarray, b: np.ndarray) -> DiffRow:
    """Compare one point's arrays."""
    a, b = np.asarray(a), np.asarray(b)
    kind = _kind(name, a)
    if a.shape != b.shape or a.dtype != b.dtype:
        return DiffRow(name, a.shape, b.shape, f"{a.dtype}/{b.dtype}", kind, 0, 0, np.nan, np.nan, np.nan,
                       np.nan, None)
    if kind in ("bf16", "int"):
        same = a.view(np.uint16) == b.view(np.uint16) if kind == "bf16" else a == b
    else:
        same = (a == b) | (np.isnan(a) & np.isnan(b))
    n, n_equal = int(a.size), int(same.sum())
    first = None
    if n_equal < n:
        first = tuple(int(i) for i in np.unravel_index(int(np.argmin(same.ravel())), a.shape))
    fa, fb = _as_float(a, kind), _as_float(b, kind)
    d = np.abs(fa - fb)
    finite = np.isfinite(d)
    max_abs = float(d[finite].max()) if finite.any() else (0.0 if n == n_equal else np.nan)
    denom = np.maximum(np.abs(fa), np.finfo(np.float32).tiny)
    max_rel = float((d / denom)[finite].max()) if finite.any() else max_abs
    norm = float(np.sqrt((fa[finite] ** 2).sum())) if finite.any() else 0.0
    rel_l2 = float(np.sqrt((d[finite] ** 2).sum()) / norm) if norm > 0 else (0.0 if max_abs == 0 else np.inf)
    if kind == "bf16":
        max_ulp = float(bf16_ulp_distance(a, b).max()) if n else 0.0
    elif kind == "fp32":
        max_ulp = float(f32_ulp_distance(a, b).max()) if n else 0.0
    else:
        max_ulp = np.nan
    return DiffRow(name, a.shape, b.shape, str(a.dtype), kind, n, n_equal, max_abs, max_rel, rel_l2, max_ulp, first)


class DiffReport:
    """The rows of a diff, in the capture's firing order."""

    def __init__(self, rows: list[DiffRow], label_a: str = "a", label_b: str = "b",
                 only_a: list[str] | None = None, only_b: list[str] | None = None,
                 token_strings: list[str] | None = None):
        self.rows = rows
        self.token_strings = token_strings      # one per token, from a capture's meta (or None)
        self.label_a, self.label_b = label_a, label_b
        self.only_a, self.only_b = only_a or [], only_b or []
        self.model_warning: str | None = None   # set when the two captures come from different models

    def __getitem__(self, name: str) -> DiffRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no point {name!r} in this diff")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def all_equal(self) -> bool:
        return all(r.equal for r in self.rows)

    def to_records(self) -> list[dict]:
        return [asdict(r) for r in self.rows]

    _COLUMNS = ("point", "shape", "kind", "equal", "max abs", "max rel", "rel L2", "max ulp", "first diff")

    def _cells(self, r: DiffRow) -> list[str]:
        shape = "x".join(map(str, r.shape_a)) if r.shape_a == r.shape_b else f"{r.shape_a} vs {r.shape_b}"
        if r.n == 0:
            return [r.name, shape, r.dtype, "shape/dtype differ", "", "", "", "", ""]
        pct = 100.0 * r.n_equal / r.n
        eq = "all" if r.n_equal == r.n else f"{r.n_equal}/{r.n} ({pct:.1f}%)"
        g = (lambda v: "0" if v == 0 else f"{v:.3g}")
        ulp = "" if r.kind == "int" else ("0" if r.max_ulp == 0 else f"{r.max_ulp:.0f} {r.kind}")
        return [r.name, shape, r.kind, eq, g(r.max_abs), g(r.max_rel), g(r.rel_l2), ulp,
                "" if r.first_diff is None else str(list(r.first_diff)) + self._token_note(r)]

    def token_of(self, row: DiffRow) -> int | None:
        """The token (position) holding a point's first differing element, when the point is per token."""
        if row.first_diff is None or not row.first_diff or not self.token_strings:
            return None
        T = len(self.token_strings)
        lead, idx = row.shape_a[0], row.first_diff[0]
        if lead == T:
            return int(idx)
        if T and lead % T == 0:                  # rows.*: [T*C, ...], row t*C + c
            return int(idx) // (lead // T)
        return None

    def _token_note(self, row: DiffRow) -> str:
        t = self.token_of(row)
        if t is None:
            return ""
        from ..text import token_label
        return f" (token {t} {token_label(self.token_strings[t])!r})"

    def __str__(self) -> str:
        table = [list(self._COLUMNS)] + [self._cells(r) for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(self._COLUMNS))]
        lines = [f"diff: {self.label_a} vs {self.label_b}"]
        for j, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        for side, names in ((self.label_a, self.only_a), (self.label_b, self.only_b)):
            if names:
                lines.append(f"only in {side}: {', '.join(names)}")
        if self.model_warning:
            lines.append(f"warning: {self.model_warning}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._COLUMNS)
        body = []
        for r in self.rows:
            style = "" if r.equal else ' style="background:#fff4e5"'
            body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>")
        cap = f"<caption>{html.escape(self.label_a)} vs {html.escape(self.label_b)}</caption>"
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

    def plot(self, ax=None, metric: str = "rel_l2"):
        """Where two runs part, along the stages: two panels sharing the x axis (the points in
        firing order, without the layer prefix), one line per engram layer.

        top:    `metric` of the float points on a log axis. A point equal in both runs has no
                error to draw: it is marked with a hollow marker on the panel's bottom edge and the
                line is broken there (no invented floor, no V shapes through exact points).
        bottom: the share of elements that differ, for every point, integer ones included (a
                changed row id or raw byte shows up here).
        ax: two Axes (top, bottom), or None for a new figure. Returns the (top, bottom) Axes.
        """
        import matplotlib.pyplot as plt
        from matplotlib.transforms import blended_transform_factory
        if ax is None:
            _, ax = plt.subplots(2, 1, figsize=(9, 5.2), sharex=True, height_ratios=(2, 1),
                                 layout="constrained")
        top, bottom = ax
        layers: dict[str, list[DiffRow]] = {}
        for r in self.rows:
            layers.setdefault(r.name.split(".", 1)[0] if r.name.startswith("L") else "inputs", []).append(r)
        order: list[str] = []
        for rows in layers.values():
            for r in rows:
                short = r.name.split(".", 1)[1] if r.name.startswith("L") else r.name
                if short not in order:
                    order.append(short)
        xpos = {name: i for i, name in enumerate(order)}
        edge = blended_transform_factory(top.transData, top.transAxes)
        width = 0.8 / max(len(layers), 1)
        for k, (layer, rows) in enumerate(layers.items()):
            colour = f"C{k}"
            xs, ys, exact_x = [], [], []
            for r in rows:
                short = r.name.split(".", 1)[1] if r.name.startswith("L") else r.name
                x = xpos[short]
                if r.n and r.kind != "int":
                    v = float(getattr(r, metric))
                    if r.equal or v == 0.0:
                        exact_x.append(x)
                        xs.append(x)
                        ys.append(np.nan)          # breaks the line: nothing to draw for an exact point
                    else:
                        xs.append(x)
                        ys.append(v)
                frac = 1.0 - r.n_equal / r.n if r.n else 1.0
                bottom.bar(x - 0.4 + width * (k + 0.5), frac, width=width, color=colour,
                           label=layer if k < 10 and x == xpos[order[0]] else None)
            if xs:
                top.plot(xs, ys, marker="o", color=colour, label=layer)
            if exact_x:
                top.scatter(exact_x, [0.0] * len(exact_x), transform=edge, marker="o", s=36, facecolors="none",
                            edgecolors=colour, clip_on=False, zorder=3)
        if not any(np.isfinite(line.get_ydata()).any() for line in top.get_lines()):
            # nothing to scale: no invented numbers on the axis (a linear one would run negative)
            top.set_ylim(0.0, 1.0)
            top.set_yticks([])
            top.text(0.5, 0.5, "every float point is bit-identical in both runs", transform=top.transAxes,
                     ha="center", va="center")
        else:
            top.set_yscale("log")
        top.set_ylabel(metric.replace("_", " "))
        top.set_title(f"{self.label_a} vs {self.label_b}: where the runs part\n(hollow marker on the axis = "
                      "bit-identical)", fontsize=10)
        top.legend(fontsize=8)
        top.grid(True, which="both", alpha=0.3)
        bottom.set_ylim(0.0, 1.05)
        if all(r.n and r.n_equal == r.n for r in self.rows):
            bottom.text(0.5, 0.5, "no element differs at any point", transform=bottom.transAxes, ha="center",
                        va="center")
        bottom.set_ylabel("share of elements\nthat differ")
        bottom.set_xticks(range(len(order)), order, rotation=30, ha="right")
        bottom.grid(True, axis="y", alpha=0.3)
        return top, bottom


def diff(a: Mapping, b: Mapping, names=None, label_a: str | None = None, label_b: str | None = None) -> DiffReport:
    """Compare two captures (or dicts of arrays) at every point both hold, or at those `names`
    keeps: a point name, a glob pattern ("L*.gate.*"), a list of them, or a predicate."""
    from .._argcheck import need_capture
    need_capture(a, "a")
    need_capture(b, "b")

    def label(cap, default):
        meta = getattr(cap, "meta", {}) or {}
        backends = meta.get("backends")
        if isinstance(backends, dict):
            vals = set(backends.values())
            return vals.pop() if len(vals) == 1 else ",".join(f"{k}={v}" for k, v in backends.items())
        return default
    common = [k for k in a if k in b]
    if names is None:
        keys = common
    else:   # a name, a glob pattern ("L*.gate.*"), a list of them, or a predicate, as names_filter
        from ..capture import match_names
        keep = match_names(names, common, what="names")
        keys = [k for k in common if keep(k)]
    rows = [diff_arrays(k, a[k], b[k]) for k in keys]
    strings = None
    for cap in (a, b):
        s = (getattr(cap, "meta", {}) or {}).get("token_strings")
        if isinstance(s, list):
            strings = s
            break
    report = DiffReport(rows, label_a or label(a, "a"), label_b or label(b, "b"),
                        only_a=[k for k in a if k not in b] if names is None else [],
                        only_b=[k for k in b if k not in a] if names is None else [], token_strings=strings)
    from ..identity import identity_mismatch
    ids = [(getattr(cap, "meta", {}) or {}).get("model_identity") for cap in (a, b)]
    differ = identity_mismatch(*ids)
    if differ:
        report.model_warning = f"the two captures come from different models (their {', '.join(differ)} differ)"
    return report
