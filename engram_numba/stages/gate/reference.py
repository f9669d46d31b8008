"""The gate and highway update in numpy (docs/math.md, "Gate"), all in fp32, fixed order.

    gate_reference(highway [T, hc, dim] fp32, kv [T, (hc+1)*dim] bf16 words, q_weight, k_weight)
        -> GateResult(highway [T, hc, dim], dot [T, hc], gate [T, hc]); the input is not changed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...bf16 import bf16_to_f32, round_f32_through_bf16
from ...config import GATE_CLAMP, NORM_EPS
from ..proj.reference import _sequential_sum, split_kv

RESIDUALS = ("fp32", "bf16")


def check_eps(eps) -> float:
    """eps as a float, or a TypeError/ValueError naming it: every backend checks it the same way
    (a negative or NaN eps would give NaN gates)."""
    import math
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return float(eps)


# 4. Gate and highway update ------------------------------------------------------------------

@dataclass
class GateResult:
    highway: np.ndarray  # [T, hc, dim] fp32, the updated streams
    dot: np.ndarray      # [T, hc] fp32, the normalised dot before the signed sqrt
    gate: np.ndarray     # [T, hc] fp32, sigmoid(signed sqrt(dot)); 0 for masked tokens


def gate_reference(highway: np.ndarray, kv_bf16: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray,
                   token_mask=None, residual: str = "fp32", eps: float = NORM_EPS) -> GateResult:
    """docs/math.md section 6, all in fp32. Returns a new highway; the input is not changed.

    residual="fp32": the engine's FP32 highway, no rounding.
    residual="bf16": DeepSeek's reference: h is a bf16 value and the update is rounded back to
    bf16 (nearest even). The streams stay in an fp32 container holding bf16-exact values.
    """
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
    eps = check_eps(eps)
    highway = np.asarray(highway, dtype=np.float32)
    T, hc, dim = highway.shape
    key_bf16, value_bf16 = split_kv(kv_bf16, hc)
    h = round_f32_through_bf16(highway) if residual == "bf16" else highway.copy()
    k = bf16_to_f32(key_bf16)                               # [T, hc, dim]
    v = bf16_to_f32(value_bf16)                             # [T, dim]
    w = (np.asarray(q_weight, np.float32) * np.asarray(k_weight, np.float32))[None]  # [1, hc, dim]
    f32 = np.float32
    dim32, eps32 = f32(dim), f32(eps)

    hk = _sequential_sum((h * w) * k)                       # [T, hc]
    hh = _sequential_sum(h * h)
    kk = _sequential_sum(k * k)
    inv_h = f32(1.0) / np.sqrt(hh / dim32 + eps32)
    inv_k = f32(1.0) / np.sqrt(kk / dim32 + eps32)
    dot = hk * inv_h * inv_k / np.sqrt(dim32)               # [T, hc]
    g = np.copysign(np.sqrt(np.maximum(np.abs(dot), f32(GATE_CLAMP))), dot)
    # The sigmoid is evaluated in float64 and rounded once: that is the correctly rounded fp32
    # sigmoid (but for a ~2^-29 chance), so every backend agrees on the gate given the same dot;
    # an fp32 expf would add 1-2 ulps that depend on whose libm ran it.
    gate = (1.0 / (1.0 + np.exp(-g.astype(np.float64)))).astype(np.float32)
    if token_mask is not None:
        live = np.asarray(token_mask, dtype=bool)
        gate = np.where(live[:, None], gate, f32(0.0))
    else:
        live = np.ones(T, dtype=bool)

    new = h + gate[:, :, None] * v[:, None, :]
    if residual == "bf16":
        new = round_f32_through_bf16(new)
    new = np.where(live[:, None, None], new, highway)       # masked tokens: streams untouched
    return GateResult(highway=new.astype(np.float32), dot=dot.astype(np.float32), gate=gate.astype(np.float32))
