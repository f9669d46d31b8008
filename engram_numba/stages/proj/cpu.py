"""The projection in @njit: same signature as the reference, and bit-identical to it (numba
compiles without fast-math, so the fp32 sums keep the reference's k order)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...bf16 import bf16_word_to_f32 as _bf16_to_f32
from ...bf16 import f32_to_bf16_word as _f32_to_bf16


_GROUP = 8   # tokens accumulated side by side: independent fp32 chains, each in the reference's k order


@njit(cache=True, parallel=True)
def _projection(x, w, out):  # pragma: no cover - jitted
    T, K = x.shape
    N = w.shape[0]
    G = _GROUP
    TG = (T + G - 1) // G
    # Tokens in groups of 8, k-major inside a group: one output row's 8 sums advance together
    # (8 independent dependency chains instead of one), every sum still strictly in k order, so
    # the result stays bit-identical to the reference.
    xt = np.zeros((TG, K, G), dtype=np.float32)
    for t in range(T):
        for k in range(K):
            xt[t // G, k, t % G] = _bf16_to_f32(x[t, k])
    for n in prange(N):
        wf = np.empty(K, dtype=np.float32)
        for k in range(K):
            wf[k] = _bf16_to_f32(w[n, k])
        for g in range(TG):
            xg = xt[g]
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            a4 = np.float32(0.0)
            a5 = np.float32(0.0)
            a6 = np.float32(0.0)
            a7 = np.float32(0.0)
            for k in range(K):  # k order 0..K-1, as the reference
                wk = wf[k]
                a0 += xg[k, 0] * wk
                a1 += xg[k, 1] * wk
                a2 += xg[k, 2] * wk
                a3 += xg[k, 3] * wk
                a4 += xg[k, 4] * wk
                a5 += xg[k, 5] * wk
                a6 += xg[k, 6] * wk
                a7 += xg[k, 7] * wk
            t0 = g * G
            out[t0, n] = _f32_to_bf16(a0)
            if t0 + 1 < T:
                out[t0 + 1, n] = _f32_to_bf16(a1)
            if t0 + 2 < T:
                out[t0 + 2, n] = _f32_to_bf16(a2)
            if t0 + 3 < T:
                out[t0 + 3, n] = _f32_to_bf16(a3)
            if t0 + 4 < T:
                out[t0 + 4, n] = _f32_to_bf16(a4)
            if t0 + 5 < T:
                out[t0 + 5, n] = _f32_to_bf16(a5)
            if t0 + 6 < T:
                out[t0 + 6, n] = _f32_to_bf16(a6)
            if t0 + 7 < T:
                out[t0 + 7, n] = _f32_to_bf16(a7)
    return out


def projection_cpu(x_bf16, wkv_bf16):
    """kv [T, N] bf16 = bf16(x [T, K] @ wkv [N, K]^T), fp32 accumulation in k order."""
    x = np.ascontiguousarray(x_bf16, dtype=np.uint16)
    w = np.ascontiguousarray(wkv_bf16, dtype=np.uint16)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"projection needs x [T, K] and wkv [N, K], got {x.shape} and {w.shape}")
    return _projection(x, w, np.empty((x.shape[0], w.shape[0]), dtype=np.uint16))
