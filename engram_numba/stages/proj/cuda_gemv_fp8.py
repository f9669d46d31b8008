"""GEMVs straight on an FP8 `wkv`: e4m3 codes with one e8m0 scale per 32 x 32 tile.

The weight stays as stored in DeepSeek's checkpoint: codes uint8 [N, K] (e4m3, docs/math.md 4.4)
and scales uint8 [ceil(N/32), K/32] (e8m0: 2^(s-127), 255 = NaN), 157 MB at the released shape
against 315 MB as bf16. w[n, k] = e4m3(codes[n, k]) * e8m0(scales[n // 32, k // 32]).

Numerics: an e4m3 value times a power of two is exact in bf16 (scale bytes 3..246, math 4.4), so
there is no weight rounding to choose: both versions compute the projection of the exact weights,
which is also today's bf16 projection of `wkv_bf16()`. gemv_fp8_v1 adds in k order and is
bit-identical to `projection_reference(x, wkv_fp8_bf16(codes, scales))`; gemv_fp8_v2 sums in other
orders (within 1 bf16 ulp of the float64 product where fp32 summation noise is under half an ulp).

Kernel versions
  gemv_fp8_v1  naive: one thread per output column n, 8 tokens at a time, each weight decoded in
               fp32 (exact), products added in k order.
  gemv_fp8_v2  tensor cores, the weight as the A operand: a block owns 16 rows and 8 tokens, its 8
               warps split K into runs of 32-wide tiles; lane (g, t) loads 8 codes of rows g and
               g+8 (one 8-byte load each) and 8 x values of token g per tile, converts the codes
               with cvt.rn.f16x2.e4m3x2 (exact) to bf16, and runs 2 mma per tile; the tile's fp32
               result is scaled by its e8m0 scale (a power of two, exact) into the accumulator.
`dequant_kernel` decodes the whole wkv to bf16 (the engine's path for many tokens, into a GEMM).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, types

from ...device.intrinsics import (SIMULATOR, bf16_bits_to_f32, bf16x2_hi, bf16x2_lo, cvt_pack_bf16x2, device_function,
                                  f32_to_bf16_bits, load_u32x4, mma_bf16_16816, round_to_bf16, u32_as_f32)
from .gemv_common import e4m3x4_to_bf16x2x2, load_u32x2
from ...device.launch import PreparedLaunch
from .cuda_common import INLINE, bounds, cdiv

TILE = 32                   # scale tile: 32 rows x 32 k


@device_function(**INLINE)
def e8m0_to_f32(s):
    """e8m0 byte -> 2^(s-127) as fp32, exactly (s = 0 is the subnormal 2^-127; 255 is NaN)."""
    s = np.uint32(s)
    bits = s << np.uint32(23)
    if s == np.uint32(0):
        bits = np.uint32(0x00400000)
    if s == np.uint32(255):
        bits = np.uint32(0x7FC00000)
    return u32_as_f32(bits)


@device_function(**INLINE)
def e4m3_to_f32(c):
    """e4m3 code -> its value in fp32, exactly (docs/math.md 4.4; 0x7F and 0xFF are NaN)."""
    c = np.uint32(c)
    e = (c >> np.uint32(3)) & np.uint32(15)
    m = c & np.uint32(7)
    if e == np.uint32(0):
        v = np.float32(m) * np.float32(0.001953125)                            # m * 2^-9
    else:
        v = np.float32(m + np.uint32(8)) * u32_as_f32((e + np.uint32(117)) << np.uint32(23))   # (8+m) 2^(e-10)
    if (c & np.uint32(0x7F)) == np.uint32(0x7F):
        v = u32_as_f32(np.uint32(0x7FC00000))
    if c & np.uint32(0x80):
        v = -v
    return v


# ---- gemv_fp8_v1: the naive kernel ----------------------------------------------------------------

NAIVE_THREADS = 128
NAIVE_TOKENS = 8


@cuda.jit
def _gemv_fp8_v1(x, codes, scales, out):
    # x: uint16 [T, K]; codes: uint8 [N, K]; scales: uint8 [ceil(N/32), K/32]; out: uint16 [T, N]
    n = cuda.grid(1)
    if n >= codes.shape[0]:
        return
    T, K = x.shape
    acc = cuda.local.array(NAIVE_TOKENS, float32)
    for t0 in range(0, T, NAIVE_TOKENS):
        nt = min(NAIVE_TOKENS, T - t0)
        for i in range(NAIVE_TOKENS):
            acc[i] = float32(0.0)
        for kt in range(K // TILE):
            scale = e8m0_to_f32(scales[n // TILE, kt])
            for l in range(TILE):
                k = kt * TILE + l
                # exact in bf16 for scale bytes 3..246; rounded like the reference's bf16 weights outside
                w = round_to_bf16(e4m3_to_f32(codes[n, k]) * scale)
                for t in range(nt):
                    acc[t] += bf16_bits_to_f32(x[t0 + t, k]) * w
        for t in range(nt):
            out[t0 + t, n] = f32_to_bf16_bits(acc[t])


# ---- gemv_fp8_v2: tensor cores --------------------------------------------------------------------
#
# The mma's A[16 x 16] is 16 weight rows (n0 + g, n0 + g + 8 for lane g = lane >> 2), B[16 x 8] is
# 8 tokens, and the 16 k of one mma are any 16 values on which a lane's A and B words agree. In a
# 32-wide k tile, lane t takes values 8t .. 8t+7: mma 0 gets values 8t..8t+3 (codes word 0, x words
# 0-1), mma 1 values 8t+4..8t+7. All four t lanes then stay inside one tile, whose scale is one
# power of two for rows g and g+8 alike (the 16 rows of a block lie in one 32-row tile), so the
# tile's fp32 result is scaled once. A warp loads FP8_UNROLL tiles of codes (8 bytes a row a lane)
# before converting any.

FP8_THREADS = 256
FP8_WARPS = FP8_THREADS // 32
FP8_ROWS = 16
FP8_TOKENS = 8
FP8_UNROLL = 8
FP8_BLOCKS_PER_SM = 3
_RED = FP8_WARPS * 32 * 4
_SCRATCH = 6 * FP8_THREADS if SIMULATOR else 1
_WV = 4 * FP8_UNROLL          # code words a lane holds per trip: [u][row a: 2, row b: 2]


@device_function(**INLINE)
def load_tile_codes(wv, u, w64, row_a, row_b, kt, ok, t):
    """Lane's 8 codes of tile kt in rows a and b (8-byte units row_a, row_b) -> wv[4u ...]."""
    b = 4 * u
    if ok:
        wv[b], wv[b + 1] = load_u32x2(w64, row_a + 4 * kt + t)
        wv[b + 2], wv[b + 3] = load_u32x2(w64, row_b + 4 * kt + t)
    else:
        wv[b] = wv[b + 1] = wv[b + 2] = wv[b + 3] = np.uint32(0)


@device_function(**INLINE)
def tile_mma(c0, c1, c2, c3, wa0, wa1, wb0, wb1, x32, xv, ok_x, s, scratch):
    """One 32-wide tile: 2 mma on the exact bf16 codes, then acc += scale * tile sum."""
    x0 = x1 = x2 = x3 = np.uint32(0)
    if ok_x:
        x0, x1, x2, x3 = load_u32x4(x32, xv)
    z = float32(0.0)
    pa0, pa1 = e4m3x4_to_bf16x2x2(wa0)
    pb0, pb1 = e4m3x4_to_bf16x2x2(wb0)
    d0, d1, d2, d3 = mma_bf16_16816(pa0, pb0, pa1, pb1, x0, x1, z, z, z, z, scratch)
    pa0, pa1 = e4m3x4_to_bf16x2x2(wa1)
    pb0, pb1 = e4m3x4_to_bf16x2x2(wb1)
    d0, d1, d2, d3 = mma_bf16_16816(pa0, pb0, pa1, pb1, x2, x3, d0, d1, d2, d3, scratch)
    scale = e8m0_to_f32(s)
    return c0 + scale * d0, c1 + scale * d1, c2 + scale * d2, c3 + scale * d3


@cuda.jit(**bounds(FP8_THREADS, FP8_BLOCKS_PER_SM))
def _gemv_fp8_v2(x32, w64, scales, out, T, K):
    # x32: uint32 [T*K/2] flat view of x; w64: uint32 [N*K/4] flat view of the codes (read as
    # 8-byte pairs); scales: uint8 [ceil(N/32), K/32]; out: uint16 [T, N]
    red = cuda.shared.array(_RED, float32)
    scratch = cuda.shared.array(_SCRATCH, types.uint32)
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    g = lane >> 2
    t = lane & 3
    N = out.shape[1]
    n_tiles = K >> 5
    n0 = cuda.blockIdx.x * FP8_ROWS
    tok = cuda.blockIdx.y * FP8_TOKENS + g
    ok_tok = tok < T
    x16 = np.int64(min(tok, T - 1)) * (K >> 3)              # token row in 16-byte units
    row_a = np.int64(min(n0 + g, N - 1)) * (K >> 3)         # codes row in 8-byte units
    row_b = np.int64(min(n0 + g + 8, N - 1)) * (K >> 3)
    srow = n0 // TILE
    per = (n_tiles + FP8_WARPS - 1) // FP8_WARPS            # tiles a warp owns (uniform trip count)
    k_begin = warp * per
    k_end = min(k_begin + per, n_tiles)
    c0 = c1 = c2 = c3 = float32(0.0)
    wv = cuda.local.array(_WV, types.uint32)
    for s0 in range(0, per, FP8_UNROLL):
        kt0 = k_begin + s0
        for u in range(FP8_UNROLL):
            load_tile_codes(wv, u, w64, row_a, row_b, kt0 + u, kt0 + u < k_end, t)
        for u in range(FP8_UNROLL):
            kt = kt0 + u
            ok = kt < k_end
            s = scales[srow, kt] if ok else np.uint8(127)
            c0, c1, c2, c3 = tile_mma(c0, c1, c2, c3, wv[4 * u], wv[4 * u + 1], wv[4 * u + 2], wv[4 * u + 3],
                                      x32, x16 + 4 * kt + t, ok_tok and ok, s, scratch)
    base = (warp * 32 + lane) * 4
    red[base] = c0
    red[base + 1] = c1
    red[base + 2] = c2
    red[base + 3] = c3
    cuda.syncthreads()
    if tid < 128:
        s = float32(0.0)
        for w in range(FP8_WARPS):
            s += red[w * 128 + tid]
        el = tid >> 2
        c = tid & 3
        row = n0 + (el >> 2) + 8 * (c >> 1)
        tk = cuda.blockIdx.y * FP8_TOKENS + 2 * (el & 3) + (c & 1)
        if row < N and tk < T:
            out[tk, row] = f32_to_bf16_bits(s)


# ---- the whole wkv to bf16 (the engine's many-token path) ----------------------------------------

DEQUANT_THREADS = 256


@cuda.jit
def dequant_kernel(w32, scales, out32, K):
    # w32: uint32 [N*K/4] codes; scales: uint8 [ceil(N/32), K/32]; out32: uint32 [N*K/2] bf16 pairs
    i = cuda.grid(1)
    if i >= w32.shape[0]:
        return
    e = np.int64(i) * 4
    row = e // K
    col = e - row * K
    s = e8m0_to_f32(scales[row // TILE, col // TILE])
    p, q = e4m3x4_to_bf16x2x2(w32[i])
    out32[2 * i] = cvt_pack_bf16x2(bf16x2_lo(p) * s, bf16x2_hi(p) * s)
    out32[2 * i + 1] = cvt_pack_bf16x2(bf16x2_lo(q) * s, bf16x2_hi(q) * s)


def prepare_dequant(codes, scales, out, *, stream=0) -> PreparedLaunch:
    """codes uint8 [N, K], scales uint8 [ceil(N/32), K/32], out uint16 [N, K] (all device, checked
    by the caller) -> a launch writing the exact bf16 weights into out."""
    N, K = codes.shape
    w32 = codes.view(np.uint32).reshape(N * K // 4)
    out32 = out.view(np.uint32).reshape(N * K // 2)
    return PreparedLaunch("fp8_wkv_dequant", dequant_kernel, cdiv(N * K // 4, DEQUANT_THREADS), DEQUANT_THREADS,
                          stream, (w32, scales, out32, K), out)


# ---- launch --------------------------------------------------------------------------------------

def geometry_naive(T: int, N: int):
    return cdiv(N, NAIVE_THREADS), NAIVE_THREADS


def geometry_tc(T: int, N: int):
    return (cdiv(N, FP8_ROWS), cdiv(T, FP8_TOKENS)), FP8_THREADS
