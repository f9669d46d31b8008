"""The projection in @njit: same signature as the reference, and bit-identical to it (numba
compiles without fast-math, so the fp32 sums keep the reference's k order)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...bf16 import bf16_word_to_f32 as _bf16_to_f32
from ...bf16 import f32_to_bf16_word as _f32_to_bf16


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
