"""GEMV kernels of the projection: kv = bf16(x @ wkv^T) for few tokens, weight-bandwidth bound.

Shapes and argument conventions in `cuda_common`. Every bf16 x bf16 product is exact in fp32, so
an fp32 FMA and a separate multiply and add give the same bits: the versions differ only by
summation order. gemv_v1 adds each output's products in k order 0..K-1, as the numpy reference
does, and reproduces it bit for bit; the others split the sum (per thread, per warp, per block, or
inside the tensor core) and land within 1 bf16 ulp of the exact answer except where the sum
cancels to far below the size of its terms (docs/numerics.md).

Kernel versions (llm.c style: v1 stays, the teaching baseline and a second reference)
  gemv_v1  naive: one thread per output column n, loops over tokens and k, bf16 scalar loads.
  gemv_v2  weight-streaming GEMV for TB tokens at once (TB in 1, 2, 4, 8; a grid row per group of
           TB tokens): 8 warps a block, GEMV_ROWS_PER_WARP weight rows a warp whose 16-byte loads
           are issued together, x staged in shared memory as fp32 (split into two 4-value halves
           per 16-byte chunk so each lane's LDS.128 is conflict-free), fp32 FMA per lane, one
           shuffle reduction per (row, token), one bf16 store per (row, token).
  gemv_v3  v2 with K split over the whole block instead of rows over warps: 4 rows a block, each
           thread 3 chunks of each (12 16-byte weight loads issued together, one trip at the
           released K), x read from global (L1) and reused over the 4 rows, partial sums
           reduced through shared memory then shuffles. 6400 short blocks at the released N
           instead of 800 long ones, so the machine stays full to the end (see its section).
  gemv_v4  tensor-core GEMV: mma m16n8k16 with x's (up to) 16 tokens as M, so one weight pass
           serves a decode batch of 2-16 tokens at streaming cost; 16-byte loads of weight and
           x feed the fragments in a permuted k order (see its section).
The records (records.py) carry each version's kernel, geometry and argument types; the stage's
one launcher (`cuda_common.prepare`) builds the launch.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, types

from ...device.intrinsics import (SIMULATOR, bf16_bits_to_f32, bf16x2_hi, bf16x2_lo, device_function, f32_to_bf16_bits,
                                load_f32x4, load_u32x4, mma_bf16_16816, store_f32x4, warp_sum)
from .cuda_common import ALIGN, INLINE, WARP_SCRATCH, bounds, cdiv


# ---- gemv_v1: the naive kernel ----------- --------------------------------------------------------

NAIVE_THREADS = 128


@cuda.jit
def _gemv_v1(x, wkv, out):
    # x: uint16 [T, K]; wkv: uint16 [N, K]; out: uint16 [T, N]
    n = cuda.grid(1)
    if n >= wkv.shape[0]:
        return
    for t in range(x.shape[0]):
        acc = float32(0.0)
        for k in range(x.shape[1]):
            acc += bf16_bits_to_f32(x[t, k]) * bf16_bits_to_f32(wkv[n, k])
        out[t, n] = f32_to_bf16_bits(acc)


# ---- gemv_v2: stream the weight once per group of TB tokens ---------------------------------------
#
# Decode reads 315 MB of weight for 157 M multiply-adds: the only cost that matters is keeping
# enough 16-byte weight loads in flight. Lane l of a warp takes 16-byte chunks j = l, l+32, ... of
# its rows, so each warp load instruction covers 512 contiguous bytes of one row, and the
# GEMV_ROWS_PER_WARP rows' loads are issued back to back before any arithmetic (4 x 16 B a lane in
# flight). x is read TB*8 values per weight chunk from shared memory, where chunk j of token t
# keeps its values 0-3 at float4 slot t*2*KC8 + j and 4-7 at t*2*KC8 + KC8 + j: consecutive
# lanes read consecutive 16-byte slots, so an LDS.128 has no bank conflict. x is staged KC values
# at a time (KC*TB fp32 = 32 KiB), one pass for the released K at TB = 1.

GEMV_THREADS = 256
GEMV_WARPS = GEMV_THREADS // 32
GEMV_ROWS_PER_WARP = 4
GEMV_ROWS_PER_BLOCK = GEMV_WARPS * GEMV_ROWS_PER_WARP
GEMV_SMEM_FLOATS = 8192                 # x staging buffer: KC * TB fp32 values
GEMV_TOKEN_BLOCKS = (1, 2, 4, 8)        # the TB specialisations


def _make_gemv_v2(TB):
    KC = GEMV_SMEM_FLOATS // TB         # x values staged per pass (a multiple of 8)
    KC8 = KC // 8                       # 16-byte x chunks per pass
    XS = TB * KC
    R = GEMV_ROWS_PER_WARP
    RT = R * TB                         # accumulators a lane (<= 32: one lane writes each)
    RW = 4 * R                          # weight words a lane holds per chunk step
    ROWS = GEMV_ROWS_PER_BLOCK
    THREADS = GEMV_THREADS
    assert not SIMULATOR or THREADS <= WARP_SCRATCH

    @cuda.jit
    def gemv_v2(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
        xs = cuda.shared.array(XS, float32, alignment=ALIGN)   # [TB][2][KC8][4] fp32
        scratch = cuda.shared.array(WARP_SCRATCH, float32)      # warp_sum's (simulator only)
        tid = cuda.threadIdx.x
        lane = tid & 31
        N = out.shape[1]
        K8 = K >> 3
        t0 = cuda.blockIdx.y * TB
        row0 = cuda.blockIdx.x * ROWS + (tid >> 5) * R
        # Rows past N re-read row N-1 (valid memory) so every lane runs the same code and reaches
        # the shuffles; their sums are dropped.
        wrow = cuda.local.array(R, types.int64)                  # first 16-byte chunk of each row
        for r in range(R):
            wrow[r] = np.int64(min(row0 + r, N - 1)) * K8
        acc = cuda.local.array(RT, float32)                      # [R][TB]
        for i in range(RT):
            acc[i] = float32(0.0)
        wv = cuda.local.array(RW, types.uint32)
        for c0 in range(0, K8, KC8):
            nc = min(KC8, K8 - c0)
            cuda.syncthreads()                                   # the previous pass is done with xs
            for i in range(tid, TB * nc, THREADS):
                t = i // nc
                j = i - t * nc
                v0 = v1 = v2 = v3 = np.uint32(0)                 # tokens past T multiply as 0
                if t0 + t < T:
                    v0, v1, v2, v3 = load_u32x4(x32, np.int64(t0 + t) * K8 + c0 + j)
                store_f32x4(xs, t * (2 * KC8) + j, bf16x2_lo(v0), bf16x2_hi(v0),
                            bf16x2_lo(v1), bf16x2_hi(v1))
                store_f32x4(xs, t * (2 * KC8) + KC8 + j, bf16x2_lo(v2), bf16x2_hi(v2),
                            bf16x2_lo(v3), bf16x2_hi(v3))
            cuda.syncthreads()
            for j in range(lane, nc, 32):
                for r in range(R):
                    w0, w1, w2, w3 = load_u32x4(w32, wrow[r] + c0 + j)
                    wv[4 * r] = w0
                    wv[4 * r + 1] = w1
                    wv[4 * r + 2] = w2
                    wv[4 * r + 3] = w3
                for t in range(TB):
                    a0, a1, a2, a3 = load_f32x4(xs, t * (2 * KC8) + j)
                    a4, a5, a6, a7 = load_f32x4(xs, t * (2 * KC8) + KC8 + j)
                    for r in range(R):
                        s = acc[r * TB + t]
                        s += a0 * bf16x2_lo(wv[4 * r])
                        s += a1 * bf16x2_hi(wv[4 * r])
                        s += a2 * bf16x2_lo(wv[4 * r + 1])
                        s += a3 * bf16x2_hi(wv[4 * r + 1])
                        s += a4 * bf16x2_lo(wv[4 * r + 2])
                        s += a5 * bf16x2_hi(wv[4 * r + 2])
                        s += a6 * bf16x2_lo(wv[4 * r + 3])
                        s += a7 * bf16x2_hi(wv[4 * r + 3])
                        acc[r * TB + t] = s
        for r in range(R):
            for t in range(TB):
                total = warp_sum(acc[r * TB + t], scratch)
                # (row r, token t) is written by lane r*TB + t: up to 32 stores in parallel
                if lane == r * TB + t and row0 + r < N and t0 + t < T:
                    out[t0 + t, row0 + r] = f32_to_bf16_bits(total)

    return gemv_v2


_gemv_v2 = {tb: _make_gemv_v2(tb) for tb in GEMV_TOKEN_BLOCKS}


# ---- gemv_v3: K split over the whole block, a few rows a block ----------------------------------
#
# gemv_v2 gives each warp whole rows: 24 dependent trips of 4 loads a row at the released K, and
# only ~1.2 row groups per resident warp over the whole kernel, so its last wave runs long with the
# machine half empty. Here a block of 256 threads owns GEMV3_ROWS rows and splits K across all its
# threads: thread tid takes 16-byte chunks j = tid + 256u (u < GEMV3_UNROLL, 768 chunks = one trip
# at K = 6144), and issues all GEMV3_ROWS * GEMV3_UNROLL weight loads (12 x 16 B) before any math.
# A block is then a single round trip to DRAM and there are N / GEMV3_ROWS = 6400 of them, so
# blocks retire continuously and the tail is one short block. x chunks come straight from global
# memory (L1/L2: x is 12 KiB a token) and are reused by the block's rows from registers. Each
# thread's R*TB partial sums go through shared memory transposed ([R*TB][256]); warp w then sums
# outputs w, w + 8, ...: 8 partials a lane, then a shuffle reduction.

GEMV3_ROWS = 4
GEMV3_UNROLL = 3
GEMV3_THREADS = 256


def _make_gemv_v3(TB):
    R = GEMV3_ROWS
    U = GEMV3_UNROLL
    THREADS = GEMV3_THREADS
    STRIDE = THREADS * U
    RT = R * TB                         # outputs a block
    RED = RT * THREADS                  # fp32 partial sums, transposed
    WARPS = THREADS // 32
    OUT_TRIPS = (RT + WARPS - 1) // WARPS
    WV = 4 * R * U                      # weight words a thread holds per trip
    assert U == 3, "gemv_v3's trip is written out for 3 chunks a thread"
    assert not SIMULATOR or THREADS <= WARP_SCRATCH

    @device_function(**INLINE)
    def load_rows(wv, u, w32, wrow, j, K8):
        """Chunk j of the block's R rows -> wv[u] (zeros past K)."""
        for r in range(R):
            w0 = w1 = w2 = w3 = np.uint32(0)
            if j < K8:
                w0, w1, w2, w3 = load_u32x4(w32, wrow[r] + j)
            wv[4 * (u * R + r)] = w0
            wv[4 * (u * R + r) + 1] = w1
            wv[4 * (u * R + r) + 2] = w2
            wv[4 * (u * R + r) + 3] = w3

    @device_function(**INLINE)
    def fma_rows(acc, wv, u, x32, xrow, j):
        """acc[r, t] += x[t, chunk j] . wv[u, r] for every token and row (8 FMAs each)."""
        for t in range(TB):
            x0, x1, x2, x3 = load_u32x4(x32, xrow[t] + j)
            a0 = bf16x2_lo(x0)
            a1 = bf16x2_hi(x0)
            a2 = bf16x2_lo(x1)
            a3 = bf16x2_hi(x1)
            a4 = bf16x2_lo(x2)
            a5 = bf16x2_hi(x2)
            a6 = bf16x2_lo(x3)
            a7 = bf16x2_hi(x3)
            for r in range(R):
                b = 4 * (u * R + r)
                s = acc[r * TB + t]
                s += a0 * bf16x2_lo(wv[b])
                s += a1 * bf16x2_hi(wv[b])
                s += a2 * bf16x2_lo(wv[b + 1])
                s += a3 * bf16x2_hi(wv[b + 1])
                s += a4 * bf16x2_lo(wv[b + 2])
                s += a5 * bf16x2_hi(wv[b + 2])
                s += a6 * bf16x2_lo(wv[b + 3])
                s += a7 * bf16x2_hi(wv[b + 3])
                acc[r * TB + t] = s

    @cuda.jit
    def gemv_v3(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
        red = cuda.shared.array(RED, float32)            # [RT][THREADS]
        scratch = cuda.shared.array(WARP_SCRATCH, float32)  # warp_sum's (simulator only)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        N = out.shape[1]
        K8 = K >> 3
        t0 = cuda.blockIdx.y * TB
        n0 = cuda.blockIdx.x * R
        # rows past N / tokens past T re-read the last one (valid memory); their sums are dropped
        wrow = cuda.local.array(R, types.int64)
        for r in range(R):
            wrow[r] = np.int64(min(n0 + r, N - 1)) * K8
        xrow = cuda.local.array(TB, types.int64)
        for t in range(TB):
            xrow[t] = np.int64(min(t0 + t, T - 1)) * K8
        acc = cuda.local.array(RT, float32)              # [R][TB]
        for i in range(RT):
            acc[i] = float32(0.0)
        wv = cuda.local.array(WV, types.uint32)          # [U][R][4]
        # the U = 3 chunk steps are spelled out so every wv/acc index is a constant (registers)
        for j0 in range(tid, K8, STRIDE):
            load_rows(wv, 0, w32, wrow, j0, K8)
            load_rows(wv, 1, w32, wrow, j0 + THREADS, K8)
            load_rows(wv, 2, w32, wrow, j0 + 2 * THREADS, K8)
            fma_rows(acc, wv, 0, x32, xrow, j0)
            if j0 + THREADS < K8:
                fma_rows(acc, wv, 1, x32, xrow, j0 + THREADS)
            if j0 + 2 * THREADS < K8:
                fma_rows(acc, wv, 2, x32, xrow, j0 + 2 * THREADS)
        for o in range(RT):
            red[o * THREADS + tid] = acc[o]
        cuda.syncthreads()
        for k in range(OUT_TRIPS):
            o = warp + WARPS * k
            s = float32(0.0)
            if o < RT:
                for i in range(THREADS // 32):
                    s += red[o * THREADS + lane + 32 * i]
            total = warp_sum(s, scratch)                 # every warp calls it, even without an output
            if lane == 0 and o < RT:
                r = o // TB
                t = o - r * TB
                if n0 + r < N and t0 + t < T:
                    out[t0 + t, n0 + r] = f32_to_bf16_bits(total)

    return gemv_v3


_gemv_v3 = {tb: _make_gemv_v3(tb) for tb in GEMV_TOKEN_BLOCKS}


# ---- gemv_v4: tensor-core GEMV, up to 16 tokens a weight pass ------------------------------------
#
# A decode batch (T = 7, 16) costs the SIMT GEMVs 8-16 FMAs per weight value; the tensor core does
# them for free, leaving the weight stream as the only cost. The trick that keeps the weight loads
# 16 bytes wide: a dot product does not care in which order its k terms come, so a lane may feed
# the mma any k values as long as its A (x) and B (weight) fragments agree. Lane (g, t) loads one
# 16-byte chunk c (k = 8c .. 8c+7) of weight rows g (+8, +16, +24: GEMV4_NTILES n8 tiles) and of
# tokens g and g+8 of x, and runs two m16n8k16 per tile: words 0-1 of the chunks in the k slots
# (2t, 2t+1 | 2t+8, 2t+9) of the first, words 2-3 in the second. A warp load instruction then reads
# 64 contiguous bytes of each of 8 rows. The 32 (warp, t) positions of a block split K (chunk
# c = cb + 4*warp + t + 32u), each lane issuing GEMV4_UNROLL chunks of loads before its mmas; the
# 8 warps' fp32 fragments are summed through shared memory in a fixed order at the end. Tokens
# past T (and rows past N) read the last one and are dropped; a chunk past K is zero-filled.

GEMV4_TOKENS = 16                   # tokens a weight pass (the mma's M)
GEMV4_NTILES = 4                    # n8 tiles a block: 32 weight rows
GEMV4_UNROLL = 2                    # chunks a lane loads per trip
GEMV4_THREADS = 256
GEMV4_ROWS = 8 * GEMV4_NTILES
_GEMV4_RED = GEMV4_THREADS * 4 * GEMV4_NTILES     # fp32 [warp][tile][lane][c0..c3]
_GEMV4_WV = 4 * GEMV4_NTILES * GEMV4_UNROLL       # weight words a lane holds per trip
_GEMV4_XV = 8 * GEMV4_UNROLL                      # x words (tokens g, g+8) per trip
_GEMV4_SCRATCH = 6 * GEMV4_THREADS if SIMULATOR else 1
_GEMV4_OUT_TRIPS = (4 * GEMV4_NTILES * 32) // GEMV4_THREADS   # fragment elements a thread sums


@cuda.jit(**bounds(GEMV4_THREADS, 3))
def _gemv_v4(x32, w32, out, T, K):
    # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
    red = cuda.shared.array(_GEMV4_RED, float32)
    scratch = cuda.shared.array(_GEMV4_SCRATCH, types.uint32)
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    g = lane >> 2
    pos = warp * 4 + (lane & 3)                     # this lane's chunk column, 0..31
    N = out.shape[1]
    K8 = K >> 3
    t0 = cuda.blockIdx.y * GEMV4_TOKENS
    n0 = cuda.blockIdx.x * GEMV4_ROWS
    x_lo = np.int64(min(t0 + g, T - 1)) * K8
    x_hi = np.int64(min(t0 + g + 8, T - 1)) * K8
    wrow = cuda.local.array(GEMV4_NTILES, types.int64)
    for i in range(GEMV4_NTILES):
        wrow[i] = np.int64(min(n0 + 8 * i + g, N - 1)) * K8
    acc = cuda.local.array((GEMV4_NTILES, 4), float32)
    for i in range(GEMV4_NTILES):
        for c in range(4):
            acc[i, c] = float32(0.0)
    wv = cuda.local.array(_GEMV4_WV, types.uint32)  # [u][tile][word]
    xv = cuda.local.array(_GEMV4_XV, types.uint32)  # [u][lo, hi][word]
    # the trip count depends only on K: every lane of the block reaches every mma together
    for cb in range(0, K8, 32 * GEMV4_UNROLL):
        for u in range(GEMV4_UNROLL):
            c = cb + pos + 32 * u
            ok = c < K8
            for i in range(GEMV4_NTILES):
                w0 = w1 = w2 = w3 = np.uint32(0)
                if ok:
                    w0, w1, w2, w3 = load_u32x4(w32, wrow[i] + c)
                b = 4 * (u * GEMV4_NTILES + i)
                wv[b] = w0
                wv[b + 1] = w1
                wv[b + 2] = w2
                wv[b + 3] = w3
            l0 = l1 = l2 = l3 = h0 = h1 = h2 = h3 = np.uint32(0)
            if ok:
                l0, l1, l2, l3 = load_u32x4(x32, x_lo + c)
                h0, h1, h2, h3 = load_u32x4(x32, x_hi + c)
            xv[8 * u] = l0
            xv[8 * u + 1] = l1
            xv[8 * u + 2] = l2
            xv[8 * u + 3] = l3
            xv[8 * u + 4] = h0
            xv[8 * u + 5] = h1
            xv[8 * u + 6] = h2
            xv[8 * u + 7] = h3
        for u in range(GEMV4_UNROLL):
            for i in range(GEMV4_NTILES):
                b = 4 * (u * GEMV4_NTILES + i)
                for half in range(2):               # words 0-1, then 2-3 of the chunk
                    q = 2 * half
                    d0, d1, d2, d3 = mma_bf16_16816(
                        xv[8 * u + q], xv[8 * u + 4 + q], xv[8 * u + q + 1], xv[8 * u + 4 + q + 1],
                        wv[b + q], wv[b + q + 1], acc[i, 0], acc[i, 1], acc[i, 2], acc[i, 3], scratch)
                    acc[i, 0] = d0
                    acc[i, 1] = d1
                    acc[i, 2] = d2
                    acc[i, 3] = d3
    for i in range(GEMV4_NTILES):
        for c in range(4):
            red[((warp * GEMV4_NTILES + i) * 32 + lane) * 4 + c] = acc[i, c]
    cuda.syncthreads()
    # element e = (tile, lane, c) of the block's fragments: summed over the 8 warps in order
    for k in range(_GEMV4_OUT_TRIPS):
        e = tid + GEMV4_THREADS * k
        s = float32(0.0)
        for w in range(GEMV4_THREADS // 32):
            s += red[w * (GEMV4_NTILES * 128) + e]
        i = e >> 7
        el = (e >> 2) & 31
        c = e & 3
        t = t0 + (el >> 2) + 8 * (c >> 1)
        n = n0 + 8 * i + 2 * (el & 3) + (c & 1)
        if t < T and n < N:
            out[t, n] = f32_to_bf16_bits(s)




# ---- launch geometry: (T, N) -> (grid, block), named by the records ------------------------------

def token_block(T: int) -> int:
    """The TB specialisation of gemv_v2/gemv_v3 for T tokens: the smallest that holds them, else the
    largest (then the grid has ceil(T/8) token groups, each streaming the weight once)."""
    for tb in GEMV_TOKEN_BLOCKS:
        if T <= tb:
            return tb
    return GEMV_TOKEN_BLOCKS[-1]


def geometry_v1(T: int, N: int):
    return cdiv(N, NAIVE_THREADS), NAIVE_THREADS


def geometry_v2(T: int, N: int):
    return (cdiv(N, GEMV_ROWS_PER_BLOCK), cdiv(T, token_block(T))), GEMV_THREADS


def geometry_v3(T: int, N: int):
    return (cdiv(N, GEMV3_ROWS), cdiv(T, token_block(T))), GEMV3_THREADS


def geometry_v4(T: int, N: int):
    return (cdiv(N, GEMV4_ROWS), cdiv(T, GEMV4_TOKENS)), GEMV4_THREADS
