"""The projection on the GPU: kv = bf16(x @ wkv^T), fp32 accumulation (SPEC section 4).

x: bf16 words uint16 [T, K] (T tokens, K = n_hash_cols*256), wkv: bf16 words uint16 [N, K]
(row-major, K contiguous: an "NT" product), kv: bf16 words uint16 [T, N] (N = dim*(hc+1)).
Released shapes: K = 6144, N = 25600, T = 1 (decode) .. 4096 (prefill). K must be a multiple of 8
(every row starts on a 16-byte boundary); T and N are arbitrary.

Every bf16 x bf16 product is exact in fp32, so an fp32 FMA and a separate multiply and add give the
same bits: the only rounding is in the sums, and the versions differ only by summation order.
gemv_v1, gemm_v1 and gemm_v2 add each output's products in k order 0..K-1, as
`reference.projection_reference` does, and reproduce it bit for bit; the others split the sum
(per thread, per warp, per block, or inside the tensor core) and land within 1 bf16 ulp of the
exact answer except where the sum cancels to far below the size of its terms (see the tests).

Kernel versions (llm.c style: v1 of each family stays, the teaching baseline and a second reference)
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

  gemv_v4  tensor-core GEMV: mma m16n8k16 with x's (up to) 16 tokens as M, so one weight pass
           serves a decode batch of 2-16 tokens at streaming cost; 16-byte loads of weight and
           x feed the fragments in a permuted k order (see its section).

Launcher: `project(x, wkv, out=None, *, stream=0, version=None)`; `version=None` takes
`pick_version(T)`: DEFAULT_GEMV at T = 1, DEFAULT_SMALL_BATCH for 2 <= T <= GEMV_MAX_TOKENS,
DEFAULT_GEMM above (choices made from the codegen and a bandwidth/latency estimate, to be
re-checked against the GPU tier's per-version timings). `version=` forces one by name
(`VERSIONS`; every version handles every shape). `launch_config(version, T, N)` gives the grid
and block each launch uses.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, types

from .compile_check import CompileTarget
from .devarray import as_device_array, data_address
from .launch import NoLaunch, PreparedLaunch
from .intrinsics import (device_function, SIMULATOR, bf16_bits_to_f32, bf16x2_hi, bf16x2_lo, f32_to_bf16_bits,
                         load_f32x4, load_u32x4, mma_bf16_16816, store_f32x4, store_u32x4, warp_sum)

# 16-byte vector access to shared memory needs a 16-byte aligned array; the simulator refuses any
# alignment argument (and needs none).
_ALIGN = None if SIMULATOR else 16


# Device helpers whose array indices must fold to constants are force-inlined (an out-of-line call
# would pass the register arrays through local memory); the simulator's jit has no such option.
_INLINE = {} if SIMULATOR else {"forceinline": True}

# warp_sum's scratch: one slot a thread in the simulator, unused (1 slot) on the GPU
_WARP_SCRATCH = 256 if SIMULATOR else 1


def _bounds(threads: int, blocks_per_sm: int) -> dict:
    """cuda.jit options capping registers so `blocks_per_sm` blocks fit an SM (65536 registers);
    the simulator's jit takes no launch bounds."""
    return {} if SIMULATOR else {"launch_bounds": (threads, blocks_per_sm)}


# ---- gemv_v1 / gemm_v1: the naive kernels --------------------------------------------------------

NAIVE_THREADS = 128
NAIVE_BLOCK_2D = (32, 8)      # gemm_v1: 32 columns x 8 tokens


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
    assert not SIMULATOR or THREADS <= _WARP_SCRATCH

    @cuda.jit
    def gemv_v2(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
        xs = cuda.shared.array(XS, float32, alignment=_ALIGN)   # [TB][2][KC8][4] fp32
        scratch = cuda.shared.array(_WARP_SCRATCH, float32)      # warp_sum's (simulator only)
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


def _gemv_token_block(T: int) -> int:
    """The TB specialisation for T tokens: the smallest that holds them, else the largest (then
    the grid has ceil(T/8) token groups, each streaming the weight once)."""
    for tb in GEMV_TOKEN_BLOCKS:
        if T <= tb:
            return tb
    return GEMV_TOKEN_BLOCKS[-1]


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
    assert not SIMULATOR or THREADS <= _WARP_SCRATCH

    @device_function(**_INLINE)
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

    @device_function(**_INLINE)
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
        scratch = cuda.shared.array(_WARP_SCRATCH, float32)  # warp_sum's (simulator only)
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


@cuda.jit(**_bounds(GEMV4_THREADS, 3))
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


@cuda.jit(**_bounds(GEMM_THREADS, 2))
def _gemm_v2(x32, w32, out, T, K):
    # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
    As = cuda.shared.array(_GEMM_SMEM, float32, alignment=_ALIGN)   # [2][BK][BM] x tile^T
    Bs = cuda.shared.array(_GEMM_SMEM, float32, alignment=_ALIGN)   # [2][BK][BN] weight tile^T
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


@device_function(**_INLINE)
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


@device_function(**_INLINE)
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


@cuda.jit(**_bounds(MMA_THREADS, 2))
def _gemm_v3(x32, w32, out, T, K):
    # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
    As = cuda.shared.array(_MMA_SMEM, types.uint32, alignment=_ALIGN)   # [2][128][20] x tile
    Bs = cuda.shared.array(_MMA_SMEM, types.uint32, alignment=_ALIGN)   # [2][128][20] weight
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


# ---- launchers -----------------------------------------------------------------------------------

def _check_bf16_matrix(a, name: str, shape_doc: str):
    if a.dtype != np.dtype(np.uint16):
        raise ValueError(f"{name} must be bf16 words (uint16) {shape_doc}, got dtype {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D {shape_doc}, got shape {tuple(a.shape)}")
    if not a.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")


def _flat_u32(a):
    """uint16 [R, K] C-contiguous -> uint32 [R*K/2], zero-copy (bf16 pairs, low index in the low half)."""
    rows, k = a.shape
    return a.view(np.uint32).reshape(rows * (k // 2))


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def launch_config(version: str, T: int, N: int):
    """(grid, block) the launcher uses for `version` at T tokens and N outputs."""
    if version == "gemv_v1":
        return _cdiv(N, NAIVE_THREADS), NAIVE_THREADS
    if version == "gemm_v1":
        return (_cdiv(N, NAIVE_BLOCK_2D[0]), _cdiv(T, NAIVE_BLOCK_2D[1])), NAIVE_BLOCK_2D
    if version == "gemv_v2":
        return (_cdiv(N, GEMV_ROWS_PER_BLOCK), _cdiv(T, _gemv_token_block(T))), GEMV_THREADS
    if version == "gemv_v3":
        return (_cdiv(N, GEMV3_ROWS), _cdiv(T, _gemv_token_block(T))), GEMV3_THREADS
    if version == "gemv_v4":
        return (_cdiv(N, GEMV4_ROWS), _cdiv(T, GEMV4_TOKENS)), GEMV4_THREADS
    if version == "gemm_v2":
        return (_cdiv(N, GEMM_BN), _cdiv(T, GEMM_BM)), GEMM_THREADS
    if version == "gemm_v3":
        return (_cdiv(N, MMA_BN), _cdiv(T, MMA_BM)), MMA_THREADS
    raise ValueError(f"version must be one of {sorted(VERSIONS)}, got {version!r}")


def _kernel_for(version: str, T: int):
    """The compiled kernel object each version launches for T tokens."""
    if version == "gemv_v2":
        return _gemv_v2[_gemv_token_block(T)]
    if version == "gemv_v3":
        return _gemv_v3[_gemv_token_block(T)]
    return {"gemv_v1": _gemv_v1, "gemm_v1": _gemm_v1, "gemv_v4": _gemv_v4, "gemm_v2": _gemm_v2,
            "gemm_v3": _gemm_v3}[version]


def _kernel_args(version: str, x, wkv, out):
    """The arguments each version takes: the naive ones read the uint16 matrices, the fast ones
    flat uint32 views (16-byte loads) plus T and K."""
    if version in NAIVE_VERSIONS:
        return (x, wkv, out)
    T, K = x.shape
    return (_flat_u32(x), _flat_u32(wkv), out, T, K)


VERSIONS = ("gemv_v1", "gemv_v2", "gemv_v3", "gemv_v4", "gemm_v1", "gemm_v2", "gemm_v3")
NAIVE_VERSIONS = ("gemv_v1", "gemm_v1")     # plain uint16 loads: any alignment
DEFAULT_GEMV = "gemv_v3"            # T = 1: 6400 short weight-streaming blocks
DEFAULT_SMALL_BATCH = "gemv_v4"     # 2 <= T <= GEMV_MAX_TOKENS: ceil(T/16) weight passes
DEFAULT_GEMM = "gemm_v3"            # above: tensor-core tiles
GEMV_MAX_TOKENS = 32                # 2 passes of gemv_v4 (~2 x 80 us) vs gemm_v3's latency-bound
                                    # ~200 us at T <= 128 (estimates; see the GPU tier's timings)


def pick_version(T: int, simulator: bool = SIMULATOR) -> str:
    """The default kernel for T tokens (16-byte aligned inputs).

    In numba's simulator the naive kernels are the default: their one-thread-per-output loops
    cost ~2 us a multiply-add there, while the fast versions' barriers, shuffles and mma twins
    cost 10-100x more (the tests still run every version explicitly)."""
    if simulator:
        return "gemv_v1" if T <= 1 else "gemm_v1"
    if T <= 1:
        return DEFAULT_GEMV
    return DEFAULT_SMALL_BATCH if T <= GEMV_MAX_TOKENS else DEFAULT_GEMM


def prepare_project(x, wkv, out=None, *, stream=0, version=None):
    """Validate once and return a `PreparedLaunch` of kv = bf16(x @ wkv^T); `.out` is kv.

    x: device uint16 [T, K] bf16 words; wkv: device uint16 [N, K]; both C-contiguous, K % 8 == 0.
    out: optional device uint16 [T, N] to fill (allocated on `stream` when None). Returns out.
    version: None picks `pick_version(T)` (GEMVs up to GEMV_MAX_TOKENS tokens, GEMM above); a name
    from VERSIONS forces that kernel (every version handles every T). The fast versions read x
    and wkv with 16-byte loads: for inputs whose data is not 16-byte aligned (an odd slice) the
    default falls back to the naive kernel and an explicit fast version is refused.
    """
    x = as_device_array(x, "x")
    wkv = as_device_array(wkv, "wkv")
    _check_bf16_matrix(x, "x", "[T, K]")
    _check_bf16_matrix(wkv, "wkv", "[N, K]")
    T, K = x.shape
    N = wkv.shape[0]
    if wkv.shape[1] != K:
        raise ValueError(f"x is [T, K] = {tuple(x.shape)} but wkv is [N, K] = {tuple(wkv.shape)}: K differs")
    if K % 8 or K == 0:
        raise ValueError(f"K = {K} must be a positive multiple of 8 (rows are read as 16-byte chunks)")
    if out is None:
        out = cuda.device_array((T, N), dtype=np.uint16, stream=stream)
    else:
        out = as_device_array(out, "out")
        _check_bf16_matrix(out, "out", "[T, N]")
        if tuple(out.shape) != (T, N):
            raise ValueError(f"out must be [T, N] = {(T, N)}, got {tuple(out.shape)}")
    aligned = data_address(x) % 16 == 0 and data_address(wkv) % 16 == 0
    if version is None:
        version = pick_version(T) if aligned else ("gemv_v1" if T <= GEMV_MAX_TOKENS else "gemm_v1")
    elif version not in VERSIONS:
        raise ValueError(f"version must be one of {sorted(VERSIONS)} (or None), got {version!r}")
    elif version not in NAIVE_VERSIONS and not aligned:
        raise ValueError(f"{version} reads x and wkv as 16-byte chunks; their data must be 16-byte "
                         "aligned (use a naive version or an aligned copy)")
    if not (T and N):
        return NoLaunch(version, out)
    grid, block = launch_config(version, T, N)
    return PreparedLaunch(version, _kernel_for(version, T), grid, block, stream,
                          _kernel_args(version, x, wkv, out), out)


def project(x, wkv, out=None, *, stream=0, version=None):
    """kv = bf16(x @ wkv^T) on the device, fp32 accumulation.

    x: device uint16 [T, K] bf16 words; wkv: device uint16 [N, K]; both C-contiguous, K % 8 == 0.
    out: optional device uint16 [T, N] to fill (allocated on `stream` when None). Returns out.
    version: None picks `pick_version(T)`; a name from VERSIONS forces that kernel. To launch the
    same shapes repeatedly (decode), keep `prepare_project(...)` and call it.
    """
    return prepare_project(x, wkv, out, stream=stream, version=version)()


# ---- compile-only tier ---------------------------------------------------------------------------

_U16_2D = types.uint16[:, ::1]
_FAST_ARGS = (types.uint32[::1], types.uint32[::1], _U16_2D, types.int64, types.int64)

COMPILE_TARGETS = [
    CompileTarget("projection.gemv_v1", _gemv_v1, (_U16_2D, _U16_2D, _U16_2D), spill_free=False),
    CompileTarget("projection.gemm_v1", _gemm_v1, (_U16_2D, _U16_2D, _U16_2D), spill_free=False),
    *[CompileTarget(f"projection.gemv_v2[TB={tb}]", _gemv_v2[tb], _FAST_ARGS) for tb in GEMV_TOKEN_BLOCKS],
    *[CompileTarget(f"projection.gemv_v3[TB={tb}]", _gemv_v3[tb], _FAST_ARGS) for tb in GEMV_TOKEN_BLOCKS],
    CompileTarget("projection.gemv_v4", _gemv_v4, _FAST_ARGS),
    CompileTarget("projection.gemm_v2", _gemm_v2, _FAST_ARGS),
    CompileTarget("projection.gemm_v3", _gemm_v3, _FAST_ARGS),
]
