"""What a table (or wkv) encoding costs at the gate: the same tokens through two models (say the
FP8 checkpoint and a Q2_K GGUF), compared stage by stage.

    cost = gate_cost(cap_fp8, cap_q2k, label_a="fp8", label_b="q2k")
    print(cost)             # per layer: relative L2 along rows -> kv -> dot -> gate -> highway,
                            # and how many live (token, stream) dots changed sign
    cost.to_records()

A sign flip of the gate's dot puts the gate on the other side of 0.5 (the gate is a sigmoid of the
signed square root of the dot, docs/math.md section 6): the one error that changes what the layer
does rather than how much. Masked tokens are left out (their gate is 0 in both runs). Both runs
must hold the points `L{id}.rows.bf16`, `proj.kv`, `gate.dot`, `gate.gate`, `highway.out` and
should use the same tokens, mask and highway (Pipeline.run's synthetic highway is the same for the
same token count).
"""
from __future__ import annotations

import html
import re
from dataclasses import asdict, dataclass
from typing import Mapping

import numpy as np

from .diff import diff_arrays

CHAIN = ("rows.bf16", "proj.kv", "gate.dot", "gate.gate", "highway.out")
_DOT = re.compile(r"^L(\d+)\.gate\.dot$")


@dataclass
class LayerGateCost:
    layer_id: int
    rel_l2: dict            # point -> ||b - a|| / ||a|| along CHAIN
    live: int               # live (token, stream) pairs
    sign_flips: int         # live pairs whose dot has the other sign
    gate_mean_abs: float    # mean |gate_b - gate_a| over live pairs
    gate_max_abs: float

    @property
    def flip_fraction(self) -> float:
        return self.sign_flips / self.live if self.live else float("nan")


class GateCost:
    """Per engram layer, what running model b instead of model a changes (see the module doc)."""

    def __init__(self, layers: list[LayerGateCost], label_a: str, label_b: str):
        self.layers = layers
        self.label_a, self.label_b = label_a, label_b

    def __getitem__(self, layer_id: int) -> LayerGateCost:
        for lc in self.layers:
            if lc.layer_id == layer_id:
                return lc
        raise KeyError(f"no engram layer {layer_id} in this comparison")

    def to_records(self) -> list[dict]:
        return [dict(asdict(lc), flip_fraction=lc.flip_fraction) for lc in self.layers]

    _COLUMNS = ("layer", *(f"rel L2 {p}" for p in CHAIN), "dot sign flips", "mean |d gate|", "max |d gate|")

    def _cells(self, lc: LayerGateCost) -> list[str]:
        return ([str(lc.layer_id)] + [f"{lc.rel_l2[p]:.3g}" for p in CHAIN]
                + [f"{lc.sign_flips}/{lc.live} ({100 * lc.flip_fraction:.2f}%)", f"{lc.gate_mean_abs:.3g}",
                   f"{lc.gate_max_abs:.3g}"])

    def __str__(self) -> str:
        table = [list(self._COLUMNS)] + [self._cells(lc) for lc in self.layers]
        widths = [max(len(row[i]) for row in table) for i in range(len(self._COLUMNS))]
        lines = [f"gate cost: {self.label_b} instead of {self.label_a}"]
        for j, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(lc)) + "</tr>"
                       for lc in self.layers)
        cap = f"<caption>{html.escape(self.label_b)} instead of {html.escape(self.label_a)}</caption>"
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def gate_cost(a: Mapping, b: Mapping, label_a: str = "a", label_b: str = "b") -> GateCost:
    """Compare two captures of the same tokens (see the module docstring); a is the reference."""
    from .._argcheck import need_capture
    need_capture(a, "a")
    need_capture(b, "b")
    layers = []
    for name in a:
        m = _DOT.match(name)
        if not m:
            continue
        lid = int(m.group(1))
        p = f"L{lid}."
        missing = [p + q for q in CHAIN if p + q not in a or p + q not in b]
        if missing:
            raise ValueError(f"both captures need {missing} (run Pipeline.run without a names_filter that drops them)")
        rel = {q: diff_arrays(p + q, a[p + q], b[p + q]).rel_l2 for q in CHAIN}
        dot_a, dot_b = np.asarray(a[p + "gate.dot"]), np.asarray(b[p + "gate.dot"])
        if dot_a.shape != dot_b.shape:
            raise ValueError(f"{p}gate.dot has shape {dot_a.shape} in one run and {dot_b.shape} in the other")
        mask = np.asarray(a["tokens.mask"], bool) if "tokens.mask" in a else np.ones(dot_a.shape[0], bool)
        live = np.broadcast_to(mask[:, None], dot_a.shape)
        flips = live & (np.signbit(dot_a) != np.signbit(dot_b)) & (dot_a != 0) & (dot_b != 0)
        dg = np.abs(np.asarray(b[p + "gate.gate"], np.float64) - np.asarray(a[p + "gate.gate"], np.float64))[live]
        layers.append(LayerGateCost(lid, rel, int(live.sum()), int(flips.sum()),
                                    float(dg.mean()) if dg.size else float("nan"),
                                    float(dg.max()) if dg.size else float("nan")))
    if not layers:
        raise ValueError("no L{id}.gate.dot point in the first capture")
    return GateCost(layers, label_a, label_b)
