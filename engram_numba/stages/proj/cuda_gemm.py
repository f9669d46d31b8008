"""GEMM kernels of the projection: kv = bf16(x @ wkv^T) for many tokens (prefill, corpus runs).

Shapes and argument conventions in `cuda_common`; numerics as in `cuda_gemv` (gemm_v1 and gemm_v2
add in k order and are bit-exact with the reference; gemm_v3 sums inside the tensor core).

Kernel versions (llm.c style: v1 stays, the teaching baseline and a second reference)
  gemm_v1  naive: one thread per output (t, n), loops over k.
  gemm_v2  tiled SIMT GEMM: block tile 128 x 128 (T x N), BK = 16, 256 threads each owning an
           8 x 8 fp32 micro-tile in registers (rows ty*4+i and 64+ty*4+i, columns likewise, so
           every operand fetch is one LDS.128), bf16 tiles widened to fp32 when staged in shared
           memory (x tile transposed [BK][BM], weight tile [BK][BN]), two shared buffers with the
           next tile's global loads in flight during the current tile's 1024 FMAs, one barrier a
           tile; edge rows are clamped (read, never written), a K tail is zero-filled.
  gemm_v3  gemm_v2's tiling on the tensor cores: mma.sync m16n8k16 bf16 -> fp32 (inline PTX,
           `intrinsics.mma_bf16_16816`), BK = 32, 8 warps of 64 x 32, bf16 tiles copied to
           shared memory as they are (padded rows: conflict-free fragment loads).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, types

from ...device.intrinsics import (SIMULATOR, bf16_bits_to_f32, bf16x2_hi, bf16x2_lo, device_function, f32_to_bf16_bits,
                                load_f32x4, load_u32x4, mma_bf16_16816, store_u32x4)
from .cuda_common import ALIGN, INLINE, bounds, cdiv


# ---- gemm_v1: the naive kernel --------------------------------------------------------------------

NAIVE_BLOCK_2D = (32, 8)      # 32 columns x 8 tokens


@cuda.jit
def _gemm_v1(x, wkv, out):
    # x: uint16 [T, K]; wkv: uint16 [N, K]; out: uint16 [T, N]
    n, t = cuda.grid(2)
    if n >= wkv.shape[0] or t >= x.shape[0]:
        return
    acc = float32(0.0)
    for k in range(x.shape[1]):
        acc += bf16_bits_to_f32(x[t, k]) * bf16_bits_to_f32(wkv[n, k])
    out[t, n] = f32_to_bf16_bits(acc)



# ---- gemm_v2: tiled SIMT GEMM, 8x8 register micro-tiles ------------------------------------------
#
# Thread (tx, ty) = (tid & 15, tid >> 4) owns output rows m0 + {ty*4 + i, 64 + ty*4 + i} and columns
# n0 + {tx*4 + j, 64 + tx*4 + j} (i, j < 4): per k step it reads two float4 of the x tile and two
# of the weight tile (4 LDS.128) for 64 FMAs. The split 4 + 4 (not 8 adjacent) keeps a warp's B
# reads within 16 consecutive float4 (no bank conflict) and its A reads at two broadcast addresses.
# Staging: thread tid loads 16-byte chunk (tid >> 7) of tile row (tid & 127) of both x and wkv.
# Rows past T (or N) are clamped to the last row; a chunk past K (K % 16 == 8) is zero-filled.

GEMM_BM = 128
GEMM_BN = 128
GEMM_BK = 16
GEMM_THREADS = 256
_GEMM_TILE = GEMM_BK * GEMM_BM          # fp32 values of one staged tile (x and weight alike)
_GEMM_SMEM = 2 * _GEMM_TILE             # two buffers
_U_BM = np.uint64(GEMM_BM)


@device_function
def _stage_tile(s, base, row, c, v0, v1, v2, v3):
    """8 bf16 of chunk c (k = 8c .. 8c+7, relative to the tile) of tile row `row` -> s[base +
    (8c + q) * 128 + row], fp32: the transposed [BK][128] layout the k loop reads."""
    # uint64 indices: numba adds no negative-index wraparound code for unsigned ones
    o = np.uint64(base + c * (8 * GEMM_BM) + row)
    s[o] = bf16x2_lo(v0)
    s[o + _U_BM] = bf16x2_hi(v0)
    s[o + _U_BM * np.uint64(2)] = bf16x2_lo(v1)
    s[o + _U_BM * np.uint64(3)] = bf16x2_hi(v1)
    s[o + _U_BM * np.uint64(4)] = bf16x2_lo(v2)
    s[o + _U_BM * np.uint64(5)] = bf16x2_hi(v2)
    s[o + _U_BM * np.uint64(6)] = bf16x2_lo(v3)
    s[o + _U_BM * np.uint64(7)] = bf16x2_hi(v3)


@cuda.jit(**bounds(GEMM_THREADS, 2))
def _gemm_v2(x32, w32, out, T, K):
    # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
    As = cuda.shared.array(_GEMM_SMEM, float32, alignment=ALIGN)   # [2][BK][BM] x tile^T
    Bs = cuda.shared.array(_GEMM_SMEM, float32, alignment=ALIGN)   # [2][BK][BN] weight tile^T
    tid = cuda.threadIdx.x
    tx = tid & 15
    ty = tid >> 4
    N = out.shape[1]
    K8 = K >> 3
    m0 = cuda.blockIdx.y * GEMM_BM
    n0 = cuda.blockIdx.x * GEMM_BN
    lrow = tid & (GEMM_BM - 1)
    lch = tid >> 7
    a_src = np.int64(min(m0 + lrow, T - 1)) * K8 + lch    # 16-byte chunk index of the x row
    b_src = np.int64(min(n0 + lrow, N - 1)) * K8 + lch

    acc = cuda.local.array((8, 8), float32)
    for i in range(8):
        for j in range(8):
            acc[i, j] = float32(0.0)

    n_tiles = (K8 + 1) >> 1
    # prologue: tile 0 into buffer 0
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.uint32(0)
    if lch < K8:
        a0, a1, a2, a3 = load_u32x4(x32, a_src)
        b0, b1, b2, b3 = load_u32x4(w32, b_src)
    _stage_tile(As, 0, lrow, lch, a0, a1, a2, a3)
    _stage_tile(Bs, 0, lrow, lch, b0, b1, b2, b3)
    cuda.syncthreads()

    for kt in range(n_tiles):
        cur = (kt & 1) * _GEMM_TILE
        nxt = _GEMM_TILE - cur
        more = kt + 1 < n_tiles
        # next tile's global loads go out now and land during this tile's FMAs
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.uint32(0)
        if more and 2 * (kt + 1) + lch < K8:
            a0, a1, a2, a3 = load_u32x4(x32, a_src + 2 * (kt + 1))
            b0, b1, b2, b3 = load_u32x4(w32, b_src + 2 * (kt + 1))
        # 4 k steps a trip: 256 FMAs between loop-counter updates
        for kk in range(0, GEMM_BK, 4):
            fa = (cur + kk * GEMM_BM) >> 2          # float4 index of k row kk of the tile
            _k_step(acc, As, Bs, fa, tx, ty)
            _k_step(acc, As, Bs, fa + GEMM_BM // 4, tx, ty)
            _k_step(acc, As, Bs, fa + GEMM_BM // 2, tx, ty)
            _k_step(acc, As, Bs, fa + 3 * GEMM_BM // 4, tx, ty)
        if more:
            # buffer nxt was last read in tile kt-1, before the barrier that ended it
            _stage_tile(As, nxt, lrow, lch, a0, a1, a2, a3)
            _stage_tile(Bs, nxt, lrow, lch, b0, b1, b2, b3)
        cuda.syncthreads()

    for i in range(8):
        t = m0 + (i >> 2) * 64 + ty * 4 + (i & 3)
        if t < T:
            for j in range(8):
                n = n0 + (j >> 2) * 64 + tx * 4 + (j & 3)
                if n < N:
                    out[t, n] = f32_to_bf16_bits(acc[i, j])


@device_function(**INLINE)
def _k_step(acc, As, Bs, fa, tx, ty):
    """One k step of the 8x8 micro-tile: 4 LDS.128, 64 FMAs. fa: float4 index of the k row."""
    p0, p1, p2, p3 = load_f32x4(As, fa + ty)
    p4, p5, p6, p7 = load_f32x4(As, fa + 16 + ty)
    q0, q1, q2, q3 = load_f32x4(Bs, fa + tx)
    q4, q5, q6, q7 = load_f32x4(Bs, fa + 16 + tx)
    _fma_row(acc, 0, p0, q0, q1, q2, q3, q4, q5, q6, q7)
    _fma_row(acc, 1, p1, q0, q1, q2, q3, q4, q5, q6, q7)
    _fma_row(acc, 2, p2, q0, q1, q2, q3, q4, q5, q6, q7)
    _fma_row(acc, 3, p3, q0, q1, q2, q3, q4, q5, q6, q7)
    _fma_row(acc, 4, p4, q0, q1, q2, q3, q4, q5, q6, q7)
    _fma_row(acc, 5, p5, q0, q1, q2, q3, q4, q5, q6, q7)
    _fma_row(acc, 6, p6, q0, q1, q2, q3, q4, q5, q6, q7)
    _fma_row(acc, 7, p7, q0, q1, q2, q3, q4, q5, q6, q7)


@device_function(**INLINE)
def _fma_row(acc, i, p, q0, q1, q2, q3, q4, q5, q6, q7):
    acc[i, 0] += p * q0
    acc[i, 1] += p * q1
    acc[i, 2] += p * q2
    acc[i, 3] += p * q3
    acc[i, 4] += p * q4
    acc[i, 5] += p * q5
    acc[i, 6] += p * q6
    acc[i, 7] += p * q7



# ---- gemm_v3: tensor cores, mma.sync m16n8k16 bf16 -> fp32 -------------------------------------
#
# Block tile 128 x 128 (T x N), BK = 32, 8 warps as 2 (T) x 4 (N), each warp a 64 x 32 tile of
# 4 x 4 m16n8 mma tiles (64 fp32 accumulators a lane). The tiles stay bf16 in shared memory
# (uint32 bf16x2 words, [128 rows][16 words + 4 pad]): the operands go to the tensor core as they
# are, so staging is a copy. A fragment word is row g (+8), word t (+4) of the tile, so the 32
# lanes of a warp read rows g = 0..7 at words t = 0..3; with a 20-word row stride those are 32
# different banks. Two shared buffers, the next tile's global loads in flight during the current
# tile's 32 mma, one barrier a tile; edges as in gemm_v2 (clamped rows, zero-filled K tail).

MMA_BM = 128
MMA_BN = 128
MMA_BK = 32
MMA_THREADS = 256
_MMA_ROW = MMA_BK // 2 + 4                  # words a tile row: 16 of k, 4 of padding
_MMA_TILE = MMA_BM * _MMA_ROW               # words a tile (x and weight alike)
_MMA_SMEM = 2 * _MMA_TILE                   # two buffers
_MMA_SCRATCH = 6 * MMA_THREADS if SIMULATOR else 1   # the simulator's mma exchanges fragments here


@device_function
def _mma_stage(s, buf, q, v0, v1, v2, v3):
    """16-byte chunk q (row q >> 2, chunk q & 3) of a tile -> buffer buf, as bf16x2 words."""
    store_u32x4(s, buf * (_MMA_TILE // 4) + (q >> 2) * (_MMA_ROW // 4) + (q & 3), v0, v1, v2, v3)


@cuda.jit(**bounds(MMA_THREADS, 2))
def _gemm_v3(x32, w32, out, T, K):
    # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
    As = cuda.shared.array(_MMA_SMEM, types.uint32, alignment=ALIGN)   # [2][128][20] x tile
    Bs = cuda.shared.array(_MMA_SMEM, types.uint32, alignment=ALIGN)   # [2][128][20] weight
    scratch = cuda.shared.array(_MMA_SCRATCH, types.uint32)
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    g = lane >> 2
    t4 = lane & 3
    wm = (warp >> 2) * 64                   # the warp's first tile row (tokens)
    wn = (warp & 3) * 32                    # and column (outputs)
    N = out.shape[1]
    K8 = K >> 3
    m0 = cuda.blockIdx.y * MMA_BM
    n0 = cuda.blockIdx.x * MMA_BN
    # staging: thread tid copies chunks q = tid and tid + 256 (rows q >> 2, 16-byte chunk q & 3)
    q0 = tid
    q1 = tid + MMA_THREADS
    ax0 = np.int64(min(m0 + (q0 >> 2), T - 1)) * K8 + (q0 & 3)
    ax1 = np.int64(min(m0 + (q1 >> 2), T - 1)) * K8 + (q1 & 3)
    bx0 = np.int64(min(n0 + (q0 >> 2), N - 1)) * K8 + (q0 & 3)
    bx1 = np.int64(min(n0 + (q1 >> 2), N - 1)) * K8 + (q1 & 3)
    # fragment word offsets (uint64: no wraparound code) of row g, word t of the warp's tiles
    a_off = np.uint64((wm + g) * _MMA_ROW + t4)
    b_off = np.uint64((wn + g) * _MMA_ROW + t4)

    acc = cuda.local.array((4, 4, 4), float32)      # [m tile][n tile][c0..c3]
    for i in range(4):
        for j in range(4):
            for c in range(4):
                acc[i, j, c] = float32(0.0)
    af = cuda.local.array(16, types.uint32)         # [m tile][a0..a3]
    bf = cuda.local.array(8, types.uint32)          # [n tile][b0, b1]

    n_tiles = (K8 + 3) >> 2
    # prologue: tile 0 into buffer 0
    v0 = v1 = v2 = v3 = w0 = w1 = w2 = w3 = np.uint32(0)
    y0 = y1 = y2 = y3 = z0 = z1 = z2 = z3 = np.uint32(0)
    if (q0 & 3) < K8:
        v0, v1, v2, v3 = load_u32x4(x32, ax0)
        w0, w1, w2, w3 = load_u32x4(w32, bx0)
        y0, y1, y2, y3 = load_u32x4(x32, ax1)
        z0, z1, z2, z3 = load_u32x4(w32, bx1)
    _mma_stage(As, 0, q0, v0, v1, v2, v3)
    _mma_stage(Bs, 0, q0, w0, w1, w2, w3)
    _mma_stage(As, 0, q1, y0, y1, y2, y3)
    _mma_stage(Bs, 0, q1, z0, z1, z2, z3)
    cuda.syncthreads()

    for kt in range(n_tiles):
        buf = kt & 1
        more = kt + 1 < n_tiles
        v0 = v1 = v2 = v3 = w0 = w1 = w2 = w3 = np.uint32(0)
        y0 = y1 = y2 = y3 = z0 = z1 = z2 = z3 = np.uint32(0)
        nk = 4 * (kt + 1)                           # 16-byte chunk offset of the next tile
        if more and nk + (q0 & 3) < K8:
            v0, v1, v2, v3 = load_u32x4(x32, ax0 + nk)
            w0, w1, w2, w3 = load_u32x4(w32, bx0 + nk)
            y0, y1, y2, y3 = load_u32x4(x32, ax1 + nk)
            z0, z1, z2, z3 = load_u32x4(w32, bx1 + nk)
        base = np.uint64(buf * _MMA_TILE)
        for ks in range(2):                         # two k16 steps a tile
            for i in range(4):
                o = base + a_off + np.uint64(i * 16 * _MMA_ROW + ks * 8)
                af[4 * i] = As[o]
                af[4 * i + 1] = As[o + np.uint64(8 * _MMA_ROW)]
                af[4 * i + 2] = As[o + np.uint64(4)]
                af[4 * i + 3] = As[o + np.uint64(8 * _MMA_ROW + 4)]
            for j in range(4):
                o = base + b_off + np.uint64(j * 8 * _MMA_ROW + ks * 8)
                bf[2 * j] = Bs[o]
                bf[2 * j + 1] = Bs[o + np.uint64(4)]
            for i in range(4):
                for j in range(4):
                    d0, d1, d2, d3 = mma_bf16_16816(
                        af[4 * i], af[4 * i + 1], af[4 * i + 2], af[4 * i + 3], bf[2 * j], bf[2 * j + 1],
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3], scratch)
                    acc[i, j, 0] = d0
                    acc[i, j, 1] = d1
                    acc[i, j, 2] = d2
                    acc[i, j, 3] = d3
        if more:
            # buffer 1 - buf was last read in tile kt-1, before the barrier that ended it
            _mma_stage(As, 1 - buf, q0, v0, v1, v2, v3)
            _mma_stage(Bs, 1 - buf, q0, w0, w1, w2, w3)
            _mma_stage(As, 1 - buf, q1, y0, y1, y2, y3)
            _mma_stage(Bs, 1 - buf, q1, z0, z1, z2, z3)
        cuda.syncthreads()

    for i in range(4):
        for h in range(2):                          # rows g and g + 8 of the m tile
            t = m0 + wm + i * 16 + h * 8 + g
            if t < T:
                for j in range(4):
                    n = n0 + wn + j * 8 + 2 * t4
                    if n < N:
                        out[t, n] = f32_to_bf16_bits(acc[i, j, 2 * h])
                    if n + 1 < N:
                        out[t, n + 1] = f32_to_bf16_bits(acc[i, j, 2 * h + 1])


# ---- launch --------------------------------------------------------------------------------------

def geometry_v1(T: int, N: int):
    return (cdiv(N, NAIVE_BLOCK_2D[0]), cdiv(T, NAIVE_BLOCK_2D[1])), NAIVE_BLOCK_2D


def geometry_v2(T: int, N: int):
    return (cdiv(N, GEMM_BN), cdiv(T, GEMM_BM)), GEMM_THREADS


def geometry_v3(T: int, N: int):
    return (cdiv(N, MMA_BN), cdiv(T, MMA_BM)), MMA_THREADS
