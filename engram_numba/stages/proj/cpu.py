"""The projection in @njit: same signature as the reference, and bit-identical to it (numba
compiles without fast-math, so the fp32 sums keep the reference's k order). The same holds for
`projection_deepseek_fp8_cpu`, the twin of DeepSeek's FP8 arithmetic in the reference."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ...bf16 import bf16_word_to_f32 as _bf16_to_f32
from ...bf16 import f32_to_bf16_word as _f32_to_bf16
from ..rows.fp8 import E4M3_VALUES, E8M0_VALUES
from .reference import check_deepseek_fp8_args


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


def projection_blas(x_bf16, wkv_bf16=None, *, wkv_f32=None):
    """kv [T, N] bf16 = bf16(x [T, K] @ wkv [N, K]^T) at BLAS speed: numpy's fp32 matmul (sgemm)
    over the bf16 values widened to fp32 (exact), one round to bf16 at the end.

    Not bit-identical to the reference: BLAS adds the K products in its own blocked order (with
    FMA, possibly split over threads), so an output can land on the neighbouring bf16 value where
    the fp32 sum sits near a rounding boundary (docs/numerics.md states the distance), and since
    BLAS chooses its kernels by shape, a token's result can change with T by the same ulp. Give
    `wkv_f32` ([N, K] fp32, e.g. `bf16_to_f32(wkv)` kept between calls) to skip widening the
    weight on every call."""
    from ...bf16 import bf16_to_f32, f32_to_bf16
    x = np.asarray(x_bf16)
    if wkv_f32 is None:
        if wkv_bf16 is None:
            raise TypeError("projection_blas needs wkv_bf16 or wkv_f32")
        wkv_f32 = bf16_to_f32(np.asarray(wkv_bf16, dtype=np.uint16))
    if x.ndim != 2 or wkv_f32.ndim != 2 or x.shape[1] != wkv_f32.shape[1]:
        raise ValueError(f"projection needs x [T, K] and wkv [N, K], got {x.shape} and {wkv_f32.shape}")
    if wkv_f32.dtype != np.float32:
        raise ValueError(f"wkv_f32 must be float32, got {wkv_f32.dtype}")
    acc = bf16_to_f32(np.ascontiguousarray(x, dtype=np.uint16)) @ wkv_f32.T     # [T, N] fp32
    return f32_to_bf16(acc)


# DeepSeek's own arithmetic for an FP8 wkv: the @njit twin of reference.projection_deepseek_fp8 ---

@njit(cache=True, inline="always")
def _ceil_log2(r):  # pragma: no cover - jitted
    """ceil(log2 r) for a positive float: frexp gives r = m * 2^e with 0.5 <= m < 1 (the same
    exponent DeepSeek reads off the fp32 bits: e - 1 at a power of two, e otherwise)."""
    m, e = math.frexp(r)
    return e - 1 if m == 0.5 else e


@njit(cache=True, inline="always")
def _e4m3_round(v):  # pragma: no cover - jitted
    """Nearest e4m3 value of a float with |v| <= 448, ties to even: 4 significant bits, a step of
    2^(e-4) (v = m * 2^e, 0.5 <= |m| < 1), never finer than e4m3's subnormal step 2^-9. Exact in
    float64 (np.rint rounds half to even)."""
    a = abs(v)
    if a == 0.0:
        return v
    m, e = math.frexp(a)
    step = max(e - 4, -9)
    r = math.ldexp(np.rint(math.ldexp(a, -step)), step)
    return -r if v < 0 else r


@njit(cache=True, parallel=True)
def _act_quant(x, q, s):  # pragma: no cover - jitted
    T, K = x.shape
    for t in prange(T):
        for b in range(K // 32):
            amax = np.float32(0.0)
            for k in range(32 * b, 32 * b + 32):
                amax = max(amax, abs(_bf16_to_f32(x[t, k])))
            amax = max(amax, np.float32(1e-4))
            scale = np.float32(math.ldexp(1.0, _ceil_log2(np.float64(amax / np.float32(448.0)))))
            s[t, b] = scale
            for k in range(32 * b, 32 * b + 32):
                v = _bf16_to_f32(x[t, k]) / scale                     # fp32, exact (a power of two)
                v = min(max(v, np.float32(-448.0)), np.float32(448.0))
                q[t, k] = np.float32(_e4m3_round(np.float64(v)))


@njit(cache=True, parallel=True)
def _deepseek_fp8(q, s, codes, s_w, e4m3, out):  # pragma: no cover - jitted
    T, K = q.shape
    N = codes.shape[0]
    KB = K // 32
    for n in prange(N):
        qw = np.empty(K, dtype=np.float32)
        for k in range(K):
            qw[k] = e4m3[codes[n, k]]
        for t in range(T):
            acc = np.float32(0.0)
            for b in range(KB):
                partial = np.float32(0.0)
                for k in range(32 * b, 32 * b + 32):        # k in order inside the block
                    partial += q[t, k] * qw[k]
                acc += (partial * s[t, b]) * s_w[n // 32, b]   # blocks in K order
            out[t, n] = _f32_to_bf16(acc)
    return out


def act_quant_cpu(x_bf16):
    """@njit twin of reference.act_quant_reference: (q [T, K], s [T, K/32]) fp32."""
    x = np.ascontiguousarray(x_bf16, dtype=np.uint16)
    T, K = x.shape
    q = np.empty((T, K), dtype=np.float32)
    s = np.empty((T, K // 32), dtype=np.float32)
    _act_quant(x, q, s)
    return q, s


def projection_deepseek_fp8_cpu(x_bf16, wkv_codes, wkv_scales):
    """kv [T, N] bf16 words by DeepSeek's FP8 arithmetic, bit-identical to
    `reference.projection_deepseek_fp8` (same arguments)."""
    codes = np.asarray(wkv_codes)
    codes = codes.view(np.uint8) if codes.dtype.name == "float8_e4m3fn" else codes
    sc = np.asarray(wkv_scales)
    sc = sc.view(np.uint8) if sc.dtype.name == "float8_e8m0fnu" else sc
    x = np.asarray(x_bf16)
    check_deepseek_fp8_args(x, codes, sc)
    q, s = act_quant_cpu(x)
    out = np.empty((x.shape[0], codes.shape[0]), dtype=np.uint16)
    return _deepseek_fp8(q, s, np.ascontiguousarray(codes), E8M0_VALUES[sc], E4M3_VALUES, out)
