"""The projection in numpy: kv = bf16(x @ wkv^T), fp32 accumulation in k order (docs/math.md).

Every float reduction runs in one fixed order (sequential, left to right, in fp32, via
`np.cumsum`), so the reference is deterministic and any other backend's distance from it can be
stated in ulps. Nothing here is compiled, so nothing here can be fast-math'd.
"""
from __future__ import annotations

import numpy as np

from ...bf16 import bf16_to_f32, f32_to_bf16


def _sequential_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis in fp32, strictly left to right."""
    if v.shape[-1] == 0:
        return np.zeros(v.shape[:-1], dtype=np.float32)
    return np.cumsum(v, axis=-1, dtype=np.float32)[..., -1]


def projection_reference(x_bf16: np.ndarray, wkv_bf16: np.ndarray, token_block: int = 8) -> np.ndarray:
    """kv = bf16(x @ wkv^T): x [T, K] and wkv [N, K] bf16 words; fp32 accumulation over k in
    order 0..K-1 (each bf16 x bf16 product is exact in fp32, so only the sums round)."""
    x = bf16_to_f32(x_bf16)      # [T, K]
    w = bf16_to_f32(wkv_bf16)    # [N, K]
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"projection needs x [T, K] and wkv [N, K], got {x.shape} and {w.shape}")
    T, N = x.shape[0], w.shape[0]
    acc = np.empty((T, N), dtype=np.float32)
    # Blocks of tokens and outputs keep the [t, n, k] product array small.
    n_block = max(1, (1 << 22) // max(1, token_block * w.shape[1]))
    for t0 in range(0, T, token_block):
        for n0 in range(0, N, n_block):
            prod = x[t0:t0 + token_block, None, :] * w[None, n0:n0 + n_block, :]
            acc[t0:t0 + token_block, n0:n0 + n_block] = _sequential_sum(prod)
    return f32_to_bf16(acc)


def projection_exact(x_bf16: np.ndarray, wkv_bf16: np.ndarray) -> np.ndarray:
    """The projection with float64 accumulation, rounded once to bf16: the order-free answer
    that every fp32 summation order is measured against."""
    return f32_to_bf16(bf16_to_f32(x_bf16).astype(np.float64) @ bf16_to_f32(wkv_bf16).astype(np.float64).T)


def split_kv(kv_bf16: np.ndarray, hc: int):
    """kv [T, (hc+1)*dim] -> key [T, hc, dim] and value [T, dim] (bf16 words, views)."""
    T, N = kv_bf16.shape
    if N % (hc + 1):
        raise ValueError(f"kv width {N} is not a multiple of hc + 1 = {hc + 1}")
    dim = N // (hc + 1)
    return kv_bf16[:, : hc * dim].reshape(T, hc, dim), kv_bf16[:, hc * dim:]
