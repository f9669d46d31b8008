"""The projection in numpy: kv = bf16(x @ wkv^T), fp32 accumulation in k order (docs/math.md).

`projection_deepseek_fp8` is DeepSeek's own arithmetic for an FP8 wkv (docs/math.md section 5.4):
e4m3 activations with power-of-two scales per 32 values, fp32 partial sums per 32-wide K block.

Every float reduction runs in one fixed order (sequential, left to right, in fp32, via
`np.cumsum`), so the reference is deterministic and any other backend's distance from it can be
stated in ulps. Nothing here is compiled, so nothing here can be fast-math'd.
"""
from __future__ import annotations

import numpy as np

from ...bf16 import bf16_to_f32, f32_to_bf16
from ..rows.fp8 import E4M3_VALUES, E8M0_VALUES, ceil_log2_f32, e4m3_round


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


# DeepSeek's own arithmetic for an FP8 wkv (docs/math.md section 5.4) --------------------------

ACT_BLOCK = 32            # activation quantisation group and K block of the accumulation
ACT_AMAX_FLOOR = np.float32(1e-4)


def act_quant_reference(x_bf16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's act_quant: x [T, K] bf16 words (K % 32 == 0) -> (q [T, K] fp32 e4m3 values,
    s [T, K/32] fp32 powers of two) with x ~ q * s per group of 32 consecutive values:
    amax floored at 1e-4, s = 2^ceil(log2(amax / 448)) (ceil-log2 from the fp32 bits),
    q = e4m3 round-to-nearest-even of clamp(x / s, -448, 448)."""
    x = bf16_to_f32(x_bf16)                                              # [T, K]
    T, K = x.shape
    groups = x.reshape(T, K // ACT_BLOCK, ACT_BLOCK)                     # [T, K/32, 32]
    amax = np.maximum(np.abs(groups).max(axis=2), ACT_AMAX_FLOOR)        # [T, K/32]
    s = np.ldexp(np.float32(1.0), ceil_log2_f32(amax / np.float32(448.0))).astype(np.float32)
    q = e4m3_round(np.clip(groups / s[:, :, None], -448.0, 448.0).astype(np.float32))
    return q.reshape(T, K), s


def projection_deepseek_fp8(x_bf16: np.ndarray, wkv_codes: np.ndarray, wkv_scales: np.ndarray,
                            token_block: int = 8) -> np.ndarray:
    """kv [T, N] bf16 words computed as DeepSeek's released code does for an FP8 wkv:
    x [T, K] bf16 words; wkv_codes [N, K] e4m3 codes (uint8, or a float8_e4m3fn view);
    wkv_scales [ceil(N/32), K/32] e8m0 bytes, one per 32 x 32 tile.
      1. act_quant (above): per token and 32 values, q_x and a power-of-two s_x;
      2. for each K block of 32, in K order: partial = sum of q_x * q_w over the block in fp32
         (sequentially, k in order), acc += (partial * s_x) * s_w; the result rounded to bf16 once.
    The products q_x * q_w (4 significant bits each) are exact in fp32; only the sums round."""
    codes = np.asarray(wkv_codes)
    codes = codes.view(np.uint8) if codes.dtype.name == "float8_e4m3fn" else codes
    sc = np.asarray(wkv_scales)
    sc = sc.view(np.uint8) if sc.dtype.name == "float8_e8m0fnu" else sc
    x_bf16 = np.asarray(x_bf16)
    check_deepseek_fp8_args(x_bf16, codes, sc)
    T, K = x_bf16.shape
    N = codes.shape[0]
    KB = K // ACT_BLOCK
    q, s = act_quant_reference(x_bf16)                                   # [T, K], [T, KB]
    s_w = E8M0_VALUES[sc]                                                # [ceil(N/32), KB]
    acc = np.empty((T, N), dtype=np.float32)
    n_block = max(ACT_BLOCK, ((1 << 22) // max(1, token_block * K)) // ACT_BLOCK * ACT_BLOCK)
    for n0 in range(0, N, n_block):
        n1 = min(N, n0 + n_block)
        qw = E4M3_VALUES[codes[n0:n1]]                                   # [n, K] fp32
        sw = s_w[np.arange(n0, n1) // ACT_BLOCK]                         # [n, KB]
        for t0 in range(0, T, token_block):
            t1 = min(T, t0 + token_block)
            prod = q[t0:t1, None, :] * qw[None, :, :]                    # [t, n, K], exact
            partial = _sequential_sum(prod.reshape(t1 - t0, n1 - n0, KB, ACT_BLOCK))   # [t, n, KB]
            scaled = (partial * s[t0:t1, None, :]) * sw[None, :, :]      # exact (powers of two)
            acc[t0:t1, n0:n1] = _sequential_sum(scaled)                  # blocks in K order
    return f32_to_bf16(acc)


def check_deepseek_fp8_args(x_bf16, codes, scales) -> None:
    """Shapes and dtypes of projection_deepseek_fp8's inputs, or a ValueError naming the problem."""
    if x_bf16.dtype != np.uint16 or x_bf16.ndim != 2:
        raise ValueError(f"x must be bf16 words uint16 [T, K], got {x_bf16.dtype} {list(x_bf16.shape)}")
    T, K = x_bf16.shape
    if K % ACT_BLOCK:
        raise ValueError(f"x has K = {K} values a token; DeepSeek's FP8 arithmetic needs K % {ACT_BLOCK} == 0")
    if codes.dtype != np.uint8 or codes.ndim != 2 or codes.shape[1] != K:
        raise ValueError(f"wkv_codes must be uint8 e4m3 codes [N, K={K}], got {codes.dtype} {list(codes.shape)}")
    want = (-(-codes.shape[0] // ACT_BLOCK), K // ACT_BLOCK)
    if scales.dtype != np.uint8 or scales.shape != want:
        raise ValueError(f"wkv_scales must be uint8 e8m0 [{want[0]}, {want[1]}] (one per 32 x 32 tile), got "
                         f"{scales.dtype} {list(scales.shape)}")
