"""The @njit backend of every Engram stage: same signatures as `reference`, compiled.

The integer stages (hash, dequant) are exact. The float stages accumulate in the reference's
order (sequential fp32, and numba compiles without fast-math, so LLVM may not reorder), which
makes the projection bit-identical to `reference.projection_reference` and the gate's `dot` and
`gate` identical too (the sigmoid is evaluated in float64 and rounded once, in both).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .bf16 import f32_to_bf16
from .config import GATE_CLAMP, NORM_EPS
from .hash import hash_tokens
from .q2k import dequantize_cpu
from .reference import RESIDUALS, GateResult, split_kv

__all__ = ["hash_cpu", "rows_cpu", "projection_cpu", "gate_cpu"]


def hash_cpu(tables, token_ids, token_mask=None):
    """Row ids [T, L, C] int64 (the @njit hasher of `hash.py`)."""
    return hash_tokens(tables, token_ids, token_mask)


def rows_cpu(blocks):
    """Q2_K blocks [n, 84] -> bf16 words [n, 256]."""
    return f32_to_bf16(dequantize_cpu(blocks))


@njit(cache=True, inline="always")
def _bf16_to_f32(word):  # pragma: no cover - jitted
    return np.array([np.uint32(word) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]


@njit(cache=True, inline="always")
def _f32_to_bf16(x):  # pragma: no cover - jitted
    u = np.array([x], dtype=np.float32).view(np.uint32)[0]
    if x != x:
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True, parallel=True)
def _projection(x, w, out):  # pragma: no cover - jitted
    T, K = x.shape
    N = w.shape[0]
    xf = np.empty((T, K), dtype=np.float32)
    for t in range(T):
        for k in range(K):
            xf[t, k] = _bf16_to_f32(x[t, k])
    for n in prange(N):
        wf = np.empty(K, dtype=np.float32)
        for k in range(K):
            wf[k] = _bf16_to_f32(w[n, k])
        for t in range(T):
            acc = np.float32(0.0)
            for k in range(K):  # k order 0..K-1, as the reference
                acc += xf[t, k] * wf[k]
            out[t, n] = _f32_to_bf16(acc)
    return out


def projection_cpu(x_bf16, wkv_bf16):
    """kv [T, N] bf16 = bf16(x [T, K] @ wkv [N, K]^T), fp32 accumulation in k order."""
    x = np.ascontiguousarray(x_bf16, dtype=np.uint16)
    w = np.ascontiguousarray(wkv_bf16, dtype=np.uint16)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"projection needs x [T, K] and wkv [N, K], got {x.shape} and {w.shape}")
    return _projection(x, w, np.empty((x.shape[0], w.shape[0]), dtype=np.uint16))


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
    """SPEC section 5 in @njit; same signature and result as `reference.gate_reference`."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
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
