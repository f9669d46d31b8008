"""The gate in @njit: same signature and result type as the reference (the sums keep its order,
and the sigmoid is evaluated in float64 and rounded once, as there)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ...bf16 import bf16_word_to_f32 as _bf16_to_f32
from ...bf16 import f32_to_bf16_word as _f32_to_bf16
from ...config import GATE_CLAMP, NORM_EPS
from ..proj.reference import split_kv
from .reference import RESIDUALS, GateResult, check_eps


@njit(cache=True, parallel=True)
def _gate(highway, key, value, w, live, bf16_residual, eps, new, dot_out, gate_out):  # pragma: no cover
    T, hc, dim = highway.shape
    dim32 = np.float32(dim)
    for t in prange(T):
        for c in range(hc):
            h = np.empty(dim, dtype=np.float32)
            for d in range(dim):
                h[d] = highway[t, c, d]
                if bf16_residual:
                    h[d] = _bf16_to_f32(_f32_to_bf16(h[d]))
            hk = np.float32(0.0)
            hh = np.float32(0.0)
            kk = np.float32(0.0)
            for d in range(dim):
                k = _bf16_to_f32(key[t, c, d])
                hk += (h[d] * w[c, d]) * k
                hh += h[d] * h[d]
                kk += k * k
            inv_h = np.float32(1.0) / np.float32(math.sqrt(hh / dim32 + eps))
            inv_k = np.float32(1.0) / np.float32(math.sqrt(kk / dim32 + eps))
            dot = hk * inv_h * inv_k / np.float32(math.sqrt(dim32))
            g = np.float32(math.copysign(math.sqrt(max(abs(dot), np.float32(GATE_CLAMP))), dot))
            gate = np.float32(1.0 / (1.0 + math.exp(-np.float64(g))))  # as the reference: f64, rounded once
            if not live[t]:
                gate = np.float32(0.0)
            dot_out[t, c] = dot
            gate_out[t, c] = gate
            for d in range(dim):
                if not live[t]:
                    new[t, c, d] = highway[t, c, d]
                else:
                    y = h[d] + gate * _bf16_to_f32(value[t, d])
                    if bf16_residual:
                        y = _bf16_to_f32(_f32_to_bf16(y))
                    new[t, c, d] = y


def gate_cpu(highway, kv_bf16, q_weight, k_weight, token_mask=None, residual: str = "fp32",
             eps: float = NORM_EPS) -> GateResult:
    """docs/math.md section 6 in @njit; same signature and result as `reference.gate_reference`."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
    eps = check_eps(eps)
    highway = np.ascontiguousarray(highway, dtype=np.float32)
    T, hc, dim = highway.shape
    key, value = split_kv(np.ascontiguousarray(kv_bf16, dtype=np.uint16), hc)
    w = (np.asarray(q_weight, np.float32) * np.asarray(k_weight, np.float32)).astype(np.float32)
    live = np.ones(T, dtype=np.bool_) if token_mask is None else np.asarray(token_mask, dtype=np.bool_)
    new = np.empty_like(highway)
    dot = np.empty((T, hc), dtype=np.float32)
    gate = np.empty((T, hc), dtype=np.float32)
    _gate(highway, np.ascontiguousarray(key), np.ascontiguousarray(value), w, live, residual == "bf16",
          np.float32(eps), new, dot, gate)
    return GateResult(highway=new, dot=dot, gate=gate)
