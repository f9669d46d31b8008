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


# ---- weights stored in their file encoding (q2k, fp8) ---------------------------------------------
#
# Two yardsticks per encoding: the bf16 weights today's projection reads (`wkv_*_bf16`, the
# reference decoder's fp32 value rounded to bf16), and the exact weights the format stands for
# (`wkv_*_exact`, float64, nothing rounded). The weight-decoding GEMVs that round each weight to
# bf16 are measured against the first through `projection_reference` / `projection_exact`; the
# factored Q2_K GEMV against `projection_exact_weights(x, wkv_q2k_exact(...))`.

def _q2k_parts(raw, K: int):
    """uint8 [N, K/256*84] -> (d*sc [N, K/16], dmin*m [N, K/16] float64, q [N, K] uint8)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    N = raw.shape[0]
    if K % 256 or raw.shape[1] != K // 256 * 84:
        raise ValueError(f"Q2_K weights for K = {K} must be uint8 [N, {K // 256 * 84}], got {raw.shape}")
    blocks = raw.reshape(N * (K // 256), 84)
    d = blocks[:, 80:82].copy().view(np.float16).astype(np.float64)          # [n, 1]
    dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float64)
    sc = blocks[:, :16]
    e = np.arange(256)
    half, w = e // 128, e % 128
    j, h, l = w // 32, (w % 32) // 16, w % 16
    q = (blocks[:, 16 + 32 * half + 16 * h + l] >> (2 * j).astype(np.uint8)) & np.uint8(3)   # [n, 256]
    scale = d * (sc & 15).astype(np.float64)                                 # [n, 16] sub-block s = e // 16
    offset = dmin * (sc >> 4).astype(np.float64)
    return scale.reshape(N, K // 16), offset.reshape(N, K // 16), q.reshape(N, K)


def wkv_q2k_exact(raw, K: int) -> np.ndarray:
    """The weights a Q2_K wkv stands for, float64 [N, K]: d*sc*q - dmin*m with nothing rounded."""
    scale, offset, q = _q2k_parts(raw, K)
    N = q.shape[0]
    return (np.repeat(scale, 16, axis=1) * q - np.repeat(offset, 16, axis=1)).reshape(N, K)


def wkv_q2k_bf16(raw, K: int) -> np.ndarray:
    """The bf16 weights today's projection reads, uint16 [N, K]: the reference decoder's fp32
    value (`rows.q2k.dequantize`), rounded to bf16 (= schema A's `wkv_bf16()`)."""
    from ..rows.q2k import dequantize
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    N = raw.shape[0]
    if K % 256 or raw.shape[1] != K // 256 * 84:
        raise ValueError(f"Q2_K weights for K = {K} must be uint8 [N, {K // 256 * 84}], got {raw.shape}")
    return f32_to_bf16(dequantize(raw.reshape(-1, 84)).reshape(N, K))


def wkv_q2k_abs_terms(raw, K: int) -> np.ndarray:
    """|d*sc*q| + |dmin*m| per weight, float64 [N, K]: the size of the two terms the factored form
    adds (its fp32 summation noise scales with these, not with |w|)."""
    scale, offset, q = _q2k_parts(raw, K)
    N = q.shape[0]
    return (np.abs(np.repeat(scale, 16, axis=1)) * q + np.abs(np.repeat(offset, 16, axis=1))).reshape(N, K)


def _fp8_values(codes, scales):
    import ml_dtypes
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    scales = np.ascontiguousarray(scales, dtype=np.uint8)
    N, K = codes.shape
    if K % 32 or scales.shape != (-(-N // 32), K // 32):
        raise ValueError(f"FP8 weights [N, K] = {codes.shape} need K % 32 == 0 and scales [ceil(N/32), K/32] = "
                         f"{[-(-N // 32), K // 32]}, got {list(scales.shape)}")
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)                              # exact
    s = np.where(scales == 255, np.float32(np.nan),
                 np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32))  # exact
    return v, np.repeat(np.repeat(s, 32, axis=0)[:N], 32, axis=1)


def wkv_fp8_exact(codes, scales) -> np.ndarray:
    """e4m3(codes) * e8m0(scale of the 32 x 32 tile), float64 [N, K] (nothing rounded)."""
    v, s = _fp8_values(codes, scales)
    return v.astype(np.float64) * s.astype(np.float64)


def wkv_fp8_bf16(codes, scales) -> np.ndarray:
    """The same weights as bf16 words uint16 [N, K]: the fp32 product rounded to bf16, which is
    exact for scale bytes 3..246 (docs/math.md 4.4)."""
    v, s = _fp8_values(codes, scales)
    with np.errstate(over="ignore", under="ignore"):
        return f32_to_bf16(v * s)


def projection_exact_weights(x_bf16: np.ndarray, w: np.ndarray) -> np.ndarray:
    """bf16(x . w) with float64 accumulation, for weights w float64 [N, K] (exact decoded values)."""
    return f32_to_bf16(bf16_to_f32(x_bf16).astype(np.float64) @ np.asarray(w, dtype=np.float64).T)
