"""GEMVs straight on an FP8 `wkv`: e4m3 codes with one e8m0 scale per 32 x 32 tile.

The weight stays as stored in DeepSeek's checkpoint: codes uint8 [N, K] (e4m3, docs/math.md 4.4)
and scales uint8 [ceil(N/32), K/32] (e8m0: 2^(s-127), 255 = NaN), 157 MB at the released shape
against 315 MB as bf16. w[n, k] = e4m3(codes[n, k]) * e8m0(scales[n // 32, k // 32]).

Numerics: an e4m3 value times a power of two is exact in bf16 (scale bytes 3..246, math 4.4), so
there is no weight rounding to choose: every version computes the projection of the exact weights,
which is also today's bf16 projection of `wkv_bf16()`. gemv_fp8_v1 adds in k order and is
bit-identical to `projection_reference(x, wkv_fp8_bf16(codes, scales))`; gemv_fp8_v2 sums in other
orders (within 1 bf16 ulp of the float64 product where fp32 summation noise is under half an ulp),
and so do gemv_fp8_v3 and gemv_fp8_v4, in yet other orders (not bit-identical to v2 or each other);
gemv_fp8_v5 sums in v2's order on operands scaled by powers of two: v2's bits; gemv_fp8_v6 is v5's
arithmetic rearranged over the machine: v5's bits.

Kernel versions
  gemv_fp8_v1  naive: one thread per output column n, 8 tokens at a time, each weight decoded in
               fp32 (exact), products added in k order.
  gemv_fp8_v2  tensor cores, the weight as the A operand: a block owns 16 rows and 8 tokens, its 8
               warps split K into runs of 32-wide tiles; lane (g, t) loads 8 codes of rows g and
               g+8 (one 8-byte load each) and 8 x values of token g per tile, converts the codes
               with cvt.rn.f16x2.e4m3x2 (exact) to bf16, and runs 2 mma per tile; the tile's fp32
               result is scaled by its e8m0 scale (a power of two, exact) into the accumulator.
  gemv_fp8_v3  tensor cores, x as the A operand and the codes as B: a block owns 32 rows (one
               scale-tile row) and 8 tokens, its 2 warps each half of K; lane (g, t) reads 16
               contiguous codes of each of its 4 rows a 64-wide step (one 16-byte chunk each,
               lanes t = 0, 1 in one scale tile and 2, 3 in the next, kept apart by A's two row
               halves), copied by cp.async into a 4-slot ring in shared memory (3 steps in flight);
               4 mma a row group and step, each tile's fp32 sum scaled by its e8m0 scale into the
               accumulator, the two warps' sums added in order at the end. One wave at the
               released shape (800 blocks).
  gemv_fp8_v4  v3's fragments and tile sums in a persistent grid: one block of 16 warps an SM, each
               block an equal run of 8-row groups walked a scale-tile row (a chunk) at a time, every
               warp 1/16 of K of every chunk; codes by 16-byte ld.global.nc.L1::no_allocate straight
               into registers two steps ahead, x from L1; the warps' sums added in warp order in
               shared memory once a chunk (not bit-identical to v2 or v3). On the H200 73.5 us at
               T = 1 against v2's 56.8 (bench/results/h200_fp8_gemv_dev_9c531d5.txt): the bytes in
               flight were not v2's limit; the e4m3 -> bf16 conversion's instructions are (128 of a
               step's 309).
  gemv_fp8_v5  v2 on f16 operands: the codes by one cvt.rn.f16x2.e4m3x2 a pair (exact; v2 also widens
               them to fp32 and packs them to bf16), x as an f16 copy scaled by a power of two a
               token (`x_f16_kernel`, launched first), undone on the block sums; v2's grid, loads, k
               partition and order, so bit-identical to v2 (conditions at the kernel); a trip wholly
               inside K runs without checks. 179 SASS instructions a 6-tile trip (0.058 a weight,
               v2 0.150), 80 registers, no spills.
  gemv_fp8_v6  v5 in one launch and without a partial wave: each block copies its tokens' x to f16 x 2^s
               in shared memory (v5's shifts) while its first codes load, then its teams of 8 warps (each
               v5's block) work an even share of the 16-row groups; a block an SM at most (no block waits
               for a slot), so the copy is made once a block. v5's bits. 80 registers, no spills, 169
               SASS instructions a 4-tile trip (v5 130; 12 of them R2UR, see the kernel). Slower than
               v5 on the H200 (59.5 against 53.0 us at T = 1; its record), so picked by name.
`dequant_kernel` decodes the whole wkv to bf16 (the engine's path for many tokens, into a GEMM).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, types

from ...device.intrinsics import (SIMULATOR, bf16_bits_to_f32, bf16x2_hi, bf16x2_lo, cvt_pack_bf16x2, device_function,
                                  f32_as_u32,
                                  f32_to_bf16_bits, load_u32x4, mma_bf16_16816, mma_f16_16816, round_to_bf16,
                                  store_u32x4, u32_as_f32)
from ...device.hopper import cp_async_16, cp_async_commit, cp_async_waiter, named_barrier_sync, shared_address
from .gemv_common import (cvt_pack_f16x2, e4m3x4_to_bf16x2x2, e4m3x4_to_f16x2x2, load_u32x2, prefetch_l2,
                          stream_loader)
from ...device.launch import PreparedLaunch
from .cuda_common import ALIGN, INLINE, bounds, cdiv

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


# ---- gemv_fp8_v3: 16-byte codes through a cp.async ring, x as A, one wave ---------------------------
#
# v2 is latency-bound: 8-byte loads with nothing in flight behind them, and 1,600 blocks at 3 an SM
# (4.04 waves). v3 swaps the mma's operands so that a lane's codes come from one weight row: B[16 x 8]
# is 8 weight rows (lane (g, t) holds row g's codes for k slots 2t, 2t+1, 2t+8, 2t+9) and A[16 x 16]
# is x. The 16 k of one mma are again any 16 values the lanes agree on: in a 64-wide step lane t
# reads the 16 contiguous codes k = 16t .. 16t+15 of its row (one 16-byte chunk), and mma q of the
# step takes codes 4q .. 4q+3 of every lane. Lanes t = 0, 1 then lie in scale tile 2s, lanes 2, 3 in
# tile 2s+1; the two tiles are kept apart by A's two halves of rows: A row g is token g's x on the
# k of lanes 0 and 1 (zero on lanes 2, 3), A row g+8 the same token's x on lanes 2 and 3. D[g][n] is
# then token g's tile-2s sum of row n and D[g+8][n] its tile-(2s+1) sum, each scaled by its own
# power of two into the fp32 accumulator (the 4 mma of a step chained from 0.0: each tile's sum is a
# 32-term fp32 mma sum, as v2's, in another order, so v3 is not bit-identical to v2).
#
# A block owns 32 rows (one scale-tile row: four such 8-row groups n0 + 8j + g sharing every x
# fragment and both scales of a step) and one group of 8 tokens; its V3_SPLIT warps split K's steps
# into equal runs (warp w the w-th), and their fp32 sums are added in warp order through shared
# memory at the end (one barrier). Each lane copies its four 16-byte chunks of a step into its own
# shared-memory slot by cp.async (zero-filled past N and K) and reads back only what it copied, so
# the ring needs no barrier: V3_STAGES steps a warp, V3_STAGES-1 of them in flight while it decodes
# one. At the released shape and T <= 8 that is 800 blocks of 2 warps, all resident at once (102
# registers and 17 KB of shared memory a block leave room for 9 an SM: 1,188 on 132 SMs), every warp
# streaming the same 48 steps: one wave, no tail. Each further group of 8 tokens is another pass
# over the weight (as in v2), and from T = 9 the blocks no longer fit in one wave.

V3_SPLIT = 2                  # warps a block, each a run of K's steps
V3_THREADS = 32 * V3_SPLIT
V3_GROUPS = 4                 # 8-row groups a block
V3_ROWS = 8 * V3_GROUPS       # weight rows a block: one scale tile
V3_TOKENS = 8
V3_STEP = 64                  # k a step: 16 codes a lane and row, two scale tiles
V3_STAGES = 4                 # ring slots a warp (2 KB each)
_V3_REGISTERS = 128           # the register bound a thread: 512 threads an SM
_V3_SLOT16 = 32 * V3_GROUPS   # 16-byte chunks a slot: 4 rows a lane x 32 lanes


@device_function(**INLINE)
def _v3_issue(sm, q, w32, r0, r1, r2, r3, rows_ok, s, s_end, s_pad, K16, t):
    """The lane's cp.async of step s (its chunk of each of its 4 rows: chunk index r_j + 4s; zeros
    past N (rows_ok bit j clear) and K) into the slot whose 16-byte index is q, as one commit group:
    empty past the warp's last step s_end, zeros up to s_pad in the simulator (whose mma needs
    every warp of the block at every step)."""
    if s < s_end:
        ok_k = 4 * s + t < K16
        kc = 4 * s if ok_k else 4 * s - 2           # past K only on lanes t = 2, 3: an in-row address
        cp_async_16(sm, 16 * q, w32, r0 + kc, 16 if ok_k and rows_ok & 1 else 0)
        cp_async_16(sm, 16 * (q + 32), w32, r1 + kc, 16 if ok_k and rows_ok & 2 else 0)
        cp_async_16(sm, 16 * (q + 64), w32, r2 + kc, 16 if ok_k and rows_ok & 4 else 0)
        cp_async_16(sm, 16 * (q + 96), w32, r3 + kc, 16 if ok_k and rows_ok & 8 else 0)
    elif SIMULATOR and s < s_pad:
        for j in range(V3_GROUPS):
            cp_async_16(sm, 16 * (q + 32 * j), w32, r0, 0)
    cp_async_commit()


@device_function(**INLINE)
def _v3_mma4(w0, w1, w2, w3, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, lo4, hi4, lo5, hi5, lo6, hi6, lo7, hi7,
             scratch):
    """One 8-row group's step: its lane's 16 codes (w0..w3) against the step's A fragments (lo: the
    x words on rows g, hi: on rows g+8), 4 chained mma from 0.0 -> (tile 2s: d0, d1; 2s+1: d2, d3)."""
    z = float32(0.0)
    p0, p1 = e4m3x4_to_bf16x2x2(w0)
    d0, d1, d2, d3 = mma_bf16_16816(lo0, hi0, lo1, hi1, p0, p1, z, z, z, z, scratch)
    p0, p1 = e4m3x4_to_bf16x2x2(w1)
    d0, d1, d2, d3 = mma_bf16_16816(lo2, hi2, lo3, hi3, p0, p1, d0, d1, d2, d3, scratch)
    p0, p1 = e4m3x4_to_bf16x2x2(w2)
    d0, d1, d2, d3 = mma_bf16_16816(lo4, hi4, lo5, hi5, p0, p1, d0, d1, d2, d3, scratch)
    p0, p1 = e4m3x4_to_bf16x2x2(w3)
    return mma_bf16_16816(lo6, hi6, lo7, hi7, p0, p1, d0, d1, d2, d3, scratch)


@device_function(**INLINE)
def _v3_store(out, tok, row, N, c0, c1):
    if row < N:
        out[tok, row] = f32_to_bf16_bits(c0)
    if row + 1 < N:
        out[tok, row + 1] = f32_to_bf16_bits(c1)


def v3_shared_bytes(split: int, stages: int) -> int:
    """Shared memory of one gemv_fp8_v3 block of `split` warps with `stages` slots a warp."""
    return split * stages * _V3_SLOT16 * 16 + (split - 1) * 32 * 8 * 4


def make_gemv_fp8_v3(split: int = V3_SPLIT, stages: int = V3_STAGES):
    """gemv_fp8_v3's kernel with `split` warps a block (each a run of K's steps) and `stages` ring
    slots a warp (the registered kernel: V3_SPLIT, V3_STAGES; tools/fp8_v3_variants.py times others)."""
    if split < 1 or stages < 2:
        raise ValueError(f"gemv_fp8_v3 needs >= 1 warp a block and >= 2 ring slots, got {split}, {stages}")
    threads = 32 * split
    sm_words = split * stages * _V3_SLOT16 * 4
    red_size = max(1, (split - 1) * 32 * 8)
    scratch_size = 6 * threads if SIMULATOR else 1
    wait_oldest = cp_async_waiter(stages - 1)

    @cuda.jit(**bounds(threads, max(1, 65536 // (_V3_REGISTERS * threads))))
    def _gemv_fp8_v3(x32, w32, scales, out, T, K):
        # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/4] flat view of the codes (read as
        # 16-byte chunks); scales: uint8 [ceil(N/32), K/32]; out: uint16 [T, N]
        sm = cuda.shared.array(sm_words, types.uint32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(sm_words, types.uint32)
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        n0 = cuda.blockIdx.x * V3_ROWS                          # < N: the grid has no block past N
        K16 = K >> 4                                            # 16-byte chunks a codes row
        NS = (K + V3_STEP - 1) // V3_STEP
        per = (NS + split - 1) // split                       # steps a warp (the last one's run may be short)
        s_begin = warp * per
        s_end = min(s_begin + per, NS)
        s_pad = s_begin + per
        NKT = K >> 5                                            # scale tiles a row
        rows_ok = 0                                             # bit j: row n0 + 8j + g inside N
        for j in range(V3_GROUPS):
            if n0 + 8 * j + g < N:
                rows_ok |= 1 << j
        # the lane's chunk of step 0 in each row (a row past N is clamped to N-1 and reads nothing)
        r0 = np.int64(min(n0 + g, N - 1)) * K16 + t
        r1 = np.int64(min(n0 + 8 + g, N - 1)) * K16 + t
        r2 = np.int64(min(n0 + 16 + g, N - 1)) * K16 + t
        r3 = np.int64(min(n0 + 24 + g, N - 1)) * K16 + t
        tok = cuda.blockIdx.y * V3_TOKENS + g
        ok_tok = tok < T
        xr = np.int64(min(tok, T - 1)) * (K >> 3) + 2 * t       # x's 16-byte index of the lane's step-0 k
        srow_scales = scales[n0 // TILE]                        # the block's scale row [K/32]
        mlo = np.uint32(0xFFFFFFFF) if t < 2 else np.uint32(0)  # the lane's k are in tile 2s (else 2s+1)
        mhi = ~mlo
        q0 = warp * (stages * _V3_SLOT16) + lane             # the lane's 16-byte index in the warp's slot 0
        for st in range(stages):                             # the ring's first steps
            _v3_issue(sm, q0 + st * _V3_SLOT16, w32, r0, r1, r2, r3, rows_ok, s_begin + st, s_end, s_pad, K16, t)
        z = float32(0.0)
        # token g; rows n0 + 8j + 2t (e_j) and + 1 (f_j)
        e0 = f0 = e1 = f1 = e2 = f2 = e3 = f3 = z
        stage = 0
        for s in range(s_begin, s_pad):
            wait_oldest()                                   # step s has landed
            if SIMULATOR or s < s_end:
                q = q0 + stage * _V3_SLOT16
                x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = np.uint32(0)
                if ok_tok and s < s_end and 4 * s + t < K16:
                    x0, x1, x2, x3 = load_u32x4(x32, xr + 8 * s)
                    x4, x5, x6, x7 = load_u32x4(x32, xr + 8 * s + 1)
                kt = 2 * s
                if SIMULATOR and kt >= NKT:                     # a padding step (simulator only)
                    sa = float32(1.0)
                else:
                    sa = e8m0_to_f32(srow_scales[kt])
                sb = e8m0_to_f32(srow_scales[kt + 1]) if kt + 1 < NKT else float32(1.0)
                l0, h0, l1, h1 = x0 & mlo, x0 & mhi, x1 & mlo, x1 & mhi
                l2, h2, l3, h3 = x2 & mlo, x2 & mhi, x3 & mlo, x3 & mhi
                l4, h4, l5, h5 = x4 & mlo, x4 & mhi, x5 & mlo, x5 & mhi
                l6, h6, l7, h7 = x6 & mlo, x6 & mhi, x7 & mlo, x7 & mhi
                a0, a1, a2, a3 = load_u32x4(sm, q)
                d0, d1, d2, d3 = _v3_mma4(a0, a1, a2, a3, l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5, l6, h6, l7,
                                          h7, scratch)
                e0 = e0 + sa * d0 + sb * d2
                f0 = f0 + sa * d1 + sb * d3
                a0, a1, a2, a3 = load_u32x4(sm, q + 32)
                d0, d1, d2, d3 = _v3_mma4(a0, a1, a2, a3, l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5, l6, h6, l7,
                                          h7, scratch)
                e1 = e1 + sa * d0 + sb * d2
                f1 = f1 + sa * d1 + sb * d3
                a0, a1, a2, a3 = load_u32x4(sm, q + 64)
                d0, d1, d2, d3 = _v3_mma4(a0, a1, a2, a3, l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5, l6, h6, l7,
                                          h7, scratch)
                e2 = e2 + sa * d0 + sb * d2
                f2 = f2 + sa * d1 + sb * d3
                a0, a1, a2, a3 = load_u32x4(sm, q + 96)
                d0, d1, d2, d3 = _v3_mma4(a0, a1, a2, a3, l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5, l6, h6, l7,
                                          h7, scratch)
                e3 = e3 + sa * d0 + sb * d2
                f3 = f3 + sa * d1 + sb * d3
                # the slot is read: the step `stages` on
                _v3_issue(sm, q, w32, r0, r1, r2, r3, rows_ok, s + stages, s_end, s_pad, K16, t)
            stage = 0 if stage == stages - 1 else stage + 1
        # the warps' runs added in K order: warp 0's sums + warp 1's + ...
        if warp > 0:
            base = ((warp - 1) * 32 + lane) * 8
            red[base] = e0
            red[base + 1] = f0
            red[base + 2] = e1
            red[base + 3] = f1
            red[base + 4] = e2
            red[base + 5] = f2
            red[base + 6] = e3
            red[base + 7] = f3
        cuda.syncthreads()
        if warp == 0:
            for w in range(split - 1):
                base = (w * 32 + lane) * 8
                e0 += red[base]
                f0 += red[base + 1]
                e1 += red[base + 2]
                f1 += red[base + 3]
                e2 += red[base + 4]
                f2 += red[base + 5]
                e3 += red[base + 6]
                f3 += red[base + 7]
            if ok_tok:
                _v3_store(out, tok, n0 + 2 * t, N, e0, f0)
                _v3_store(out, tok, n0 + 8 + 2 * t, N, e1, f1)
                _v3_store(out, tok, n0 + 16 + 2 * t, N, e2, f2)
                _v3_store(out, tok, n0 + 24 + 2 * t, N, e3, f3)

    return _gemv_fp8_v3


_gemv_fp8_v3 = make_gemv_fp8_v3()


# ---- gemv_fp8_v4: v3's fragments, a persistent block an SM, 16 warps splitting K ---------------------
#
# v2 and v3 are issue-latency bound, not bandwidth bound: v2 runs 0.150 SASS instructions a weight at
# 24 warps an SM with a partial fifth wave, v3 0.153 at 12 warps an SM. v4 keeps v3's mma fragments
# and numerics (x as A, rows g / g+8 token g on scale tiles 2s / 2s+1; a lane's 16 contiguous codes
# of its row as B for 4 mma; each tile's fp32 mma sum scaled once by its power of two) and changes
# where the work goes:
# - one block an SM (grid = the SM count x token groups), V4_WARPS warps: block b owns the 8-row
#   groups [b*NG/B, (b+1)*NG/B) of the NG = ceil(N/8) groups (24 or 25 at the released shape: every
#   SM streams the same bytes within 3%, no partial wave);
# - the block walks its groups one scale-tile row (a chunk: 4 groups, 32 rows) at a time, the first
#   and last chunk partial (a group outside the block's range loads nothing; its mma run on stale
#   codes into sums no store reads, unless skip_empty puts a warp-uniform branch around them); every
#   warp runs the same run of 64-wide steps of every chunk (warp w
#   steps [w*SPW, (w+1)*SPW), SPW = ceil(K/64 / warps)), so the two scale bytes of a step are shared
#   by the 4 groups and x's 8 words by 16 mma;
# - the codes come straight into registers by 16-byte `ld.global.nc` loads that skip L1 (x stays
#   there: every warp re-reads x, a block's warps all of it), V4_DEPTH steps in flight a warp (a
#   slot is refilled `depth` steps on as soon as its step's mma are issued; the loop is unrolled by
#   the depth so the slots stay in fixed registers): 2 x 2 KB a warp, 64 KB an SM;
# - at a chunk's end each warp leaves its 8 sums a lane in shared memory (two buffers: one barrier
#   a chunk) and 256 threads add the warps' sums in warp order (deterministic, as v3's two warps)
#   and store the chunk's 32 rows x 8 tokens.
# Each tile's sum is v3's (the same 4 chained mma in the same k order); what differs from v3 is how
# the tiles' scaled sums are grouped (a run of SPW steps a warp, then the warps in order).

V4_WARPS = 16                 # warps a block (one block an SM)
V4_GROUPS = 4                 # 8-row groups a chunk: one scale-tile row
V4_TOKENS = 8
V4_HINT = "L1::no_allocate"   # the codes' load: read once, kept out of L1
V4_DEPTH = 2                  # steps of codes in flight a warp (2 KB each)
SIM_V4_BLOCKS = 3             # blocks of a simulated launch (the GPU: one an SM)
_SM_COUNT: list = []


def make_gemv_fp8_v4(warps: int = V4_WARPS, hint: str = V4_HINT, skip_empty: bool = False, blocks_per_sm: int = 1,
                     depth: int = V4_DEPTH):
    """gemv_fp8_v4's kernel with `warps` warps a block (each a run of K's steps of every chunk), the
    PTX cache qualifiers `hint` on the codes' 16-byte loads, and with skip_empty a warp-uniform
    branch around each group's mma (a group outside the block's rows runs none; but ptxas then
    recomputes the masked x words in every branch: about a quarter more SASS instructions a step). The
    registered kernel: V4_WARPS, V4_HINT, no skip, one block an SM (blocks_per_sm only sets the
    register bound; the launch's grid says how many blocks run), V4_DEPTH steps of codes in flight a
    warp (2 or 3: 16 registers a step); tools/fp8_gemv_dev.py times others."""
    if warps < 1 or warps > 32 or depth not in (2, 3):
        raise ValueError(f"gemv_fp8_v4 needs 1..32 warps a block and 2 or 3 steps in flight, got {warps}, {depth}")
    threads = 32 * warps
    load16 = stream_loader(hint)
    red_words = 2 * warps * 32 * 8                          # two buffers of 8 sums a lane
    scratch_size = 6 * threads if SIMULATOR else 1

    @device_function(**INLINE)
    def group_mask(c, gb0, gb1, g, N):
        """Bit j: the lane's row c*32 + 8j + g of chunk c is the block's and inside N (its codes are
        loaded); bit 4 + j: group 4c + j is the block's (its mma runs)."""
        m = 0
        for j in range(V4_GROUPS):
            gj = 4 * c + j
            if gj >= gb0 and gj < gb1:
                m |= 1 << (4 + j)
                if 8 * gj + g < N:
                    m |= 1 << j
        return np.int32(m)

    @device_function(**INLINE)
    def load_chunk(w32, base, stride8, m, A, B, C, D):
        """The lane's codes at 16-byte index base (+ j * stride8: 8 rows on) of the groups j whose bit
        is in m; a group left out keeps its old codes (its mma does not run, or its row is past N: a
        D column no store reads)."""
        if m & 1:
            A = load16(w32, base)
        if m & 2:
            B = load16(w32, base + stride8)
        if m & 4:
            C = load16(w32, base + 2 * stride8)
        if m & 8:
            D = load16(w32, base + 3 * stride8)
        return A, B, C, D

    @device_function(**INLINE)
    def step(acc, A, B, C, D, x32, xi, scales, srow, kt, ok_w, ok_k, kt1_ok, mlo, mhi, m, scratch):
        """One 64-wide step of the chunk (scale tiles kt, kt+1 of tile row srow; the lane's x at 16-byte
        index xi): acc (e0, f0, .. e3, f3) += the 4 groups' scaled tile sums. ok_w: the warp's step is
        inside K; ok_k: the lane's 16 k are (else its codes came from 32 k back in the row and its x is
        masked to zero); kt1_ok: tile kt+1 is inside K. A token past T reads token T-1's x: its D rows
        are never stored."""
        e0, f0, e1, f1, e2, f2, e3, f3 = acc
        if SIMULATOR or ok_w:
            x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = np.uint32(0)
            sa = sb = float32(1.0)
            if ok_w:
                if not ok_k:
                    xi -= np.uint64(4)                  # 32 k back: 4 x units of 8 values
                    mhi = np.uint32(0)
                x0, x1, x2, x3 = load_u32x4(x32, xi)
                x4, x5, x6, x7 = load_u32x4(x32, xi + np.uint64(1))
                # unsigned indices: no negative-index wraparound code
                sa = e8m0_to_f32(scales[srow, kt])
                if kt1_ok:
                    sb = e8m0_to_f32(scales[srow, kt + np.uint32(1)])
            l0, h0, l1, h1 = x0 & mlo, x0 & mhi, x1 & mlo, x1 & mhi
            l2, h2, l3, h3 = x2 & mlo, x2 & mhi, x3 & mlo, x3 & mhi
            l4, h4, l5, h5 = x4 & mlo, x4 & mhi, x5 & mlo, x5 & mhi
            l6, h6, l7, h7 = x6 & mlo, x6 & mhi, x7 & mlo, x7 & mhi
            if SIMULATOR or not skip_empty or m & 16:
                d0, d1, d2, d3 = _v3_mma4(A[0], A[1], A[2], A[3], l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5,
                                          l6, h6, l7, h7, scratch)
                e0 = e0 + sa * d0 + sb * d2
                f0 = f0 + sa * d1 + sb * d3
            if SIMULATOR or not skip_empty or m & 32:
                d0, d1, d2, d3 = _v3_mma4(B[0], B[1], B[2], B[3], l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5,
                                          l6, h6, l7, h7, scratch)
                e1 = e1 + sa * d0 + sb * d2
                f1 = f1 + sa * d1 + sb * d3
            if SIMULATOR or not skip_empty or m & 64:
                d0, d1, d2, d3 = _v3_mma4(C[0], C[1], C[2], C[3], l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5,
                                          l6, h6, l7, h7, scratch)
                e2 = e2 + sa * d0 + sb * d2
                f2 = f2 + sa * d1 + sb * d3
            if SIMULATOR or not skip_empty or m & 128:
                d0, d1, d2, d3 = _v3_mma4(D[0], D[1], D[2], D[3], l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5,
                                          l6, h6, l7, h7, scratch)
                e3 = e3 + sa * d0 + sb * d2
                f3 = f3 + sa * d1 + sb * d3
        return e0, f0, e1, f1, e2, f2, e3, f3

    @device_function(**INLINE)
    def chunk_out(red, acc, chunk, tid, warp, lane, out, r0, row_lo, row_hi, tok0, T):
        """The chunk's sums: each warp's into shared memory, then the warps' added in order and stored."""
        buf = (chunk & 1) * (warps * 256)
        base = buf + (warp * 32 + lane) * 8
        e0, f0, e1, f1, e2, f2, e3, f3 = acc
        red[base] = e0
        red[base + 1] = f0
        red[base + 2] = e1
        red[base + 3] = f1
        red[base + 4] = e2
        red[base + 5] = f2
        red[base + 6] = e3
        red[base + 7] = f3
        cuda.syncthreads()
        for o in range(tid, 256, threads):
            tk = o >> 5                                     # token of the group of 8
            r = o & 31                                      # row of the chunk
            src = buf + ((tk * 4 + ((r & 7) >> 1)) * 8 + 2 * (r >> 3) + (r & 1))
            s = float32(0.0)
            for w in range(warps):
                s += red[src + w * 256]
            row = r0 + r
            if row >= row_lo and row < row_hi and tok0 + tk < T:
                out[tok0 + tk, row] = f32_to_bf16_bits(s)

    @device_function(**INLINE)
    def prefetch(w32, S0, S1, S2, S3, lc, ls, lm, lbase, n_w, n_x, SPW, stride8, K16w, s_begin, t, g, N, gb0, gb1):
        """Load step (lc, ls) into the slot S (lanes past K: 32 k back in the row, their x is masked),
        then move (lc, ls) on a step."""
        i32 = np.int32
        if ls == SPW:
            ls = i32(0)
            lc = i32(lc + 1)
            lm = group_mask(lc, gb0, gb1, g, N)
            lbase = np.int64(lc * 32 + g) * K16w + 4 * s_begin + t
        if ls < n_w:
            S0, S1, S2, S3 = load_chunk(w32, lbase + (4 * ls if ls < n_x else 4 * ls - 2), stride8, lm,
                                        S0, S1, S2, S3)
        ls = i32(ls + 1)
        return S0, S1, S2, S3, lc, ls, lm, lbase

    @device_function(**INLINE)
    def slot(it, n_iter, acc, S0, S1, S2, S3, lc, ls, lm, lbase, cc, cs, cm, w32, x32, scales, out, red, scratch,
             x_base, kt_base, NKT, n_w, n_x, SPW, stride8, K16w, s_begin, t, g, N, gb0, gb1, mlo, mhi, tid, warp,
             lane, row_lo, row_hi, tok0, T):
        """Step `it` (if any) from slot S: its mma into acc, the slot refilled `depth` steps on, and at a
        chunk's end the chunk's sums stored."""
        i32 = np.int32
        if it < n_iter:
            kt = i32(kt_base + 2 * cs)
            acc = step(acc, S0, S1, S2, S3, x32, x_base + np.uint64(8 * cs), scales, np.uint32(cc), np.uint32(kt),
                       cs < n_w, cs < n_x, kt + 1 < NKT, mlo, mhi, cm, scratch)
            S0, S1, S2, S3, lc, ls, lm, lbase = prefetch(w32, S0, S1, S2, S3, lc, ls, lm, lbase, n_w, n_x, SPW,
                                                         stride8, K16w, s_begin, t, g, N, gb0, gb1)
            cs = i32(cs + 1)
            if cs == SPW:
                chunk_out(red, acc, cc, tid, warp, lane, out, cc * 32, row_lo, row_hi, tok0, T)
                z = float32(0.0)
                acc = (z, z, z, z, z, z, z, z)
                cs = i32(0)
                cc = i32(cc + 1)
                cm = group_mask(cc, gb0, gb1, g, N)
        return acc, S0, S1, S2, S3, lc, ls, lm, lbase, cc, cs, cm

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def _gemv_fp8_v4(x32, w32, scales, out, T, K):
        # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/4] flat view of the codes (read as
        # 16-byte chunks); scales: uint8 [ceil(N/32), K/32]; out: uint16 [T, N]
        red = cuda.shared.array(red_words, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        NG = (N + 7) >> 3                                   # 8-row groups
        nb = cuda.gridDim.x
        b = cuda.blockIdx.x
        gb0 = (np.int64(b) * NG) // nb                      # the block's groups [gb0, gb1)
        gb1 = (np.int64(b + 1) * NG) // nb
        if gb1 <= gb0:
            return
        c_first = gb0 >> 2                                  # its chunks (scale-tile rows) [c_first, c_last]
        n_chunks = ((gb1 + 3) >> 2) - c_first
        row_lo = gb0 * 8
        row_hi = min(gb1 * 8, N)
        # numba widens integer sums to 64 bits: the step loop's counters are cast back to 32 bits
        # (K < 2^26) so that its compares and sums stay one instruction each
        i32 = np.int32
        K16 = i32(K >> 4)
        NS = i32((K + 63) >> 6)                             # 64-wide steps
        SPW = i32((NS + (warps - 1)) // warps)              # steps a warp a chunk
        s_begin = i32(warp * SPW)
        n_w = i32(max(0, min(SPW, NS - s_begin)))          # of them inside K (the warp's)
        n_x = i32(max(0, min(SPW, (K16 - t + 3) // 4 - s_begin)))   # whose 16 codes a lane has inside K
        NKT = i32(K >> 5)
        n_iter = i32(n_chunks * SPW)
        tok0 = cuda.blockIdx.y * V4_TOKENS
        tok = tok0 + g
        x_base = np.uint64(min(tok, T - 1) * (K >> 3) + 2 * t + 8 * s_begin)   # x's 16-byte index, step 0
        kt_base = i32(2 * s_begin)
        K16w = np.int64(K16)
        stride8 = 8 * K16w                                  # 8 rows of codes, 16-byte units
        mlo = np.uint32(0xFFFFFFFF) if t < 2 else np.uint32(0)
        mhi = ~mlo
        z = float32(0.0)
        acc = (z, z, z, z, z, z, z, z)
        # loads run `depth` steps ahead of the mma: (lc, ls) the next step to load, (cc, cs) the next
        # to compute; each side's chunk state (group mask, the lane's codes index) changes once a chunk
        lc = i32(c_first)
        ls = i32(0)
        lm = group_mask(lc, gb0, gb1, g, N)
        lbase = np.int64(lc * 32 + g) * K16w + 4 * s_begin + t
        z4 = (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
        A0 = A1 = A2 = A3 = B0 = B1 = B2 = B3 = C0 = C1 = C2 = C3 = z4
        A0, A1, A2, A3, lc, ls, lm, lbase = prefetch(w32, A0, A1, A2, A3, lc, ls, lm, lbase, n_w, n_x, SPW, stride8,
                                                     K16w, s_begin, t, g, N, gb0, gb1)
        B0, B1, B2, B3, lc, ls, lm, lbase = prefetch(w32, B0, B1, B2, B3, lc, ls, lm, lbase, n_w, n_x, SPW, stride8,
                                                     K16w, s_begin, t, g, N, gb0, gb1)
        if depth >= 3:
            C0, C1, C2, C3, lc, ls, lm, lbase = prefetch(w32, C0, C1, C2, C3, lc, ls, lm, lbase, n_w, n_x, SPW,
                                                         stride8, K16w, s_begin, t, g, N, gb0, gb1)
        cc = i32(c_first)
        cs = i32(0)
        cm = group_mask(cc, gb0, gb1, g, N)
        for it in range(i32(0), n_iter, i32(depth)):
            # `depth` slots in turn, each: its step's mma, then the step `depth` on into the slot
            acc, A0, A1, A2, A3, lc, ls, lm, lbase, cc, cs, cm = slot(
                it, n_iter, acc, A0, A1, A2, A3, lc, ls, lm, lbase, cc, cs, cm, w32, x32, scales, out, red, scratch,
                x_base, kt_base, NKT, n_w, n_x, SPW, stride8, K16w, s_begin, t, g, N, gb0, gb1, mlo, mhi, tid, warp,
                lane, row_lo, row_hi, tok0, T)
            acc, B0, B1, B2, B3, lc, ls, lm, lbase, cc, cs, cm = slot(
                it + 1, n_iter, acc, B0, B1, B2, B3, lc, ls, lm, lbase, cc, cs, cm, w32, x32, scales, out, red,
                scratch, x_base, kt_base, NKT, n_w, n_x, SPW, stride8, K16w, s_begin, t, g, N, gb0, gb1, mlo, mhi, tid,
                warp, lane, row_lo, row_hi, tok0, T)
            if depth >= 3:
                acc, C0, C1, C2, C3, lc, ls, lm, lbase, cc, cs, cm = slot(
                    it + 2, n_iter, acc, C0, C1, C2, C3, lc, ls, lm, lbase, cc, cs, cm, w32, x32, scales, out, red,
                    scratch, x_base, kt_base, NKT, n_w, n_x, SPW, stride8, K16w, s_begin, t, g, N, gb0, gb1, mlo, mhi,
                    tid, warp, lane, row_lo, row_hi, tok0, T)

    return _gemv_fp8_v4


_gemv_fp8_v4 = make_gemv_fp8_v4()


# ---- gemv_fp8_v5: v2 on fp16 operands ------------------------------------------------------------
#
# v2's decode of a code word is 2 cvt.rn.f16x2.e4m3x2, 4 widenings to fp32 and 2 packs to bf16: the
# e4m3 values are exact in f16 already (normal, 2^-9 .. 448), so v5 stops after the first step and
# runs mma.m16n8k16 on f16 operands. x (bf16) must then be f16 too: bf16's 8-bit significand fits
# f16's 11 bits, not its exponent range, so `x_f16_kernel` (one block a token, launched before the
# GEMV) scales token t by 2^s_t, a power of two chosen from the token's largest magnitude
# (2^15 <= max|x| 2^s < 2^16 < f16's 65504; s in [-113, 126], 126 for a zero token), writes x 2^s_t
# as f16 [T, K] (rounded to nearest even: exact for every scaled value >= 2^-17, i.e. all but those
# under ~2^-32 of the token's largest) and s_t into an int32 [T]. The GEMV keeps v2's arithmetic:
# the same grid, loads (8-byte codes, 16-byte x), k partition into mma slots, tiles of a warp added
# in k order, scale products and warp order; each tile's mma result is multiplied by its token's
# 2^-s_t before the tile's scale (exact: it gives back v2's tile sum), so the accumulators, block
# sums and rounding are v2's. (Applying 2^-s_t to the block sums instead, as v5 first did, let the
# scaled tile sums overflow at huge tile scales, e.g. 2^119 with x ~ 2^-24, where v2's stay finite.) Two schedule changes leave that order alone: a warp loads V5_UNROLL = 4 tiles of
# codes a trip (v2 8: 8 spill here, the x loads being hoisted too), and a trip wholly inside K runs
# unchecked (unsigned scale indices, no masking: a token past T reads token T-1's x, whose D columns
# are never stored).
# Every product in the mma is 2^s_t times v2's, exact in both; power-of-two scaling commutes with
# fp32 rounding, so the tile sums are 2^s_t times v2's (they stay under 2^31: scaled |x| < 2^16, codes
# <= 448, 32 terms) and, unless v2's tile sum is an fp32 subnormal, 2^-s_t gives v2's back exactly:
# the outputs are v2's bit for bit, given the tensor core sums f16 products as it sums bf16 ones (the
# simulator's mma does; the H200's did at the released shape). NaN codes (0x7F / 0xFF, absent
# from checkpoints) become f16 NaN: their rows' outputs are NaN, as in v2. x with inf or NaN: the
# token's s comes from exponent 255 (-113), its finite values still scale exactly, inf and NaN stay.

XF16_THREADS = 256
V5_S_MAX = 126                # 2^-s stays a normal fp32 (s >= -113 from bf16's largest exponent)
XF16_CACHE = 4                # 16-byte units of x a thread keeps in registers between the two passes
_XF16_WORDS = 4 * XF16_CACHE


@device_function(**INLINE)
def _max_magnitude(m, w0, w1, w2, w3):
    """m and the bf16 magnitudes (sign cleared: ordered as the values' magnitudes) of 4 words."""
    for w in (w0, w1, w2, w3):
        a = w & np.uint32(0x7FFF7FFF)
        m = max(m, a & np.uint32(0xFFFF), a >> np.uint32(16))
    return m


@device_function(**INLINE)
def _store_f16(h32, i, scale, w0, w1, w2, w3):
    store_u32x4(h32, i, cvt_pack_f16x2(bf16x2_lo(w0) * scale, bf16x2_hi(w0) * scale),
                cvt_pack_f16x2(bf16x2_lo(w1) * scale, bf16x2_hi(w1) * scale),
                cvt_pack_f16x2(bf16x2_lo(w2) * scale, bf16x2_hi(w2) * scale),
                cvt_pack_f16x2(bf16x2_lo(w3) * scale, bf16x2_hi(w3) * scale))


@cuda.jit
def x_f16_kernel(x32, h32, xs, K):
    # x32: uint32 [T*K/2] flat view of x (bf16 [T, K]); h32: the same of the f16 copy; xs: int32 [T].
    # One block a token: its largest magnitude (the first XF16_CACHE units of each thread loaded at
    # once and kept; the rest, K > 8192, loaded twice), reduced in two barriers, then the copy.
    red = cuda.shared.array(XF16_THREADS, types.uint32)
    v = cuda.local.array(_XF16_WORDS, types.uint32)
    tid = cuda.threadIdx.x
    tok = cuda.blockIdx.x
    n16 = K >> 3                                            # 16-byte units a token
    base = np.int64(tok) * n16
    for j in range(XF16_CACHE):
        i = tid + j * XF16_THREADS
        if i < n16:
            v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3] = load_u32x4(x32, base + i)
        else:
            v[4 * j] = v[4 * j + 1] = v[4 * j + 2] = v[4 * j + 3] = np.uint32(0)
    m = np.uint32(0)
    for j in range(XF16_CACHE):
        m = _max_magnitude(m, v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3])
    for i in range(tid + XF16_CACHE * XF16_THREADS, n16, XF16_THREADS):
        w0, w1, w2, w3 = load_u32x4(x32, base + i)
        m = _max_magnitude(m, w0, w1, w2, w3)
    red[tid] = m
    cuda.syncthreads()
    if tid < 32:                                            # each of 32 slots: the max of 8 (only it reads its own)
        for q in range(1, XF16_THREADS // 32):
            m = max(m, red[tid + 32 * q])
        red[tid] = m
    cuda.syncthreads()
    for q in range(32):
        m = max(m, red[q])
    e = np.int32(max(m >> np.uint32(7), np.uint32(1))) - 127      # largest exponent (a subnormal: -126)
    s = min(15 - e, V5_S_MAX)
    scale = u32_as_f32(np.uint32(127 + s) << np.uint32(23))
    for j in range(XF16_CACHE):
        i = tid + j * XF16_THREADS
        if i < n16:
            _store_f16(h32, base + i, scale, v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3])
    for i in range(tid + XF16_CACHE * XF16_THREADS, n16, XF16_THREADS):
        w0, w1, w2, w3 = load_u32x4(x32, base + i)
        _store_f16(h32, base + i, scale, w0, w1, w2, w3)
    if tid == 0:
        xs[tok] = s


@device_function(**INLINE)
def tile_mma_f16(c0, c1, c2, c3, wa0, wa1, wb0, wb1, h32, xv, ok_x, s, u0, u1, scratch):
    """v2's `tile_mma` on f16 operands: the codes as f16 (one cvt a code pair), x's f16 copy; the
    tile's sums of tokens 2t and 2t+1 (the lane's D columns) are multiplied by their 2^-s (u0, u1,
    exact) before the tile's scale, so the accumulators hold v2's values."""
    x0 = x1 = x2 = x3 = np.uint32(0)
    if ok_x:
        x0, x1, x2, x3 = load_u32x4(h32, xv)
    z = float32(0.0)
    pa0, pa1 = e4m3x4_to_f16x2x2(wa0)
    pb0, pb1 = e4m3x4_to_f16x2x2(wb0)
    d0, d1, d2, d3 = mma_f16_16816(pa0, pb0, pa1, pb1, x0, x1, z, z, z, z, scratch)
    pa0, pa1 = e4m3x4_to_f16x2x2(wa1)
    pb0, pb1 = e4m3x4_to_f16x2x2(wb1)
    d0, d1, d2, d3 = mma_f16_16816(pa0, pb0, pa1, pb1, x2, x3, d0, d1, d2, d3, scratch)
    scale = e8m0_to_f32(s)
    return c0 + scale * (d0 * u0), c1 + scale * (d1 * u1), c2 + scale * (d2 * u0), c3 + scale * (d3 * u1)


V5_UNROLL = 4                 # tiles of codes a warp loads before converting any (v2: 8; 8 spills here;
                              # 4 ran fastest on the H200: 52.7 us at T = 1 against 57.6 with 6)
V5_BLOCKS_PER_SM = 3          # the register bound: 85 a thread at 3 blocks of 256 (v2's)


def make_gemv_fp8_v5(unroll: int = V5_UNROLL, blocks_per_sm: int = V5_BLOCKS_PER_SM):
    """The v5 GEMV with `unroll` tiles of codes loaded a trip (v2: 8) and registers bounded for
    `blocks_per_sm` blocks of 256 threads an SM; registered: V5_UNROLL, V5_BLOCKS_PER_SM.
    tools/fp8_gemv_dev.py times others."""
    if unroll < 1 or blocks_per_sm < 1:
        raise ValueError(f"gemv_fp8_v5 needs unroll >= 1 and blocks_per_sm >= 1, got {unroll}, {blocks_per_sm}")
    wv_len = 4 * unroll                                     # code words a lane holds a trip

    @cuda.jit(**bounds(FP8_THREADS, blocks_per_sm))
    def _gemv_fp8_v5(h32, w64, scales, xs, out, T, K):
        # h32: uint32 [T*K/2] flat view of x's f16 copy (x_f16_kernel); w64: uint32 [N*K/4] flat view of
        # the codes (read as 8-byte pairs); scales: uint8 [ceil(N/32), K/32]; xs: int32 [T] (token t's
        # copy is x 2^xs[t]); out: uint16 [T, N]. Everything but the operands' type and the last multiply
        # is _gemv_fp8_v2.
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
        wv = cuda.local.array(wv_len, types.uint32)
        srow_u = np.uint64(srow)
        tk0 = min(cuda.blockIdx.y * FP8_TOKENS + 2 * t, T - 1)      # the lane's D columns: tokens 2t, 2t+1
        tk1 = min(tk0 + 1, T - 1)
        u0 = u32_as_f32(np.uint32(127 - xs[tk0]) << np.uint32(23))     # 2^-s, exact (s in [-113, 126])
        u1 = u32_as_f32(np.uint32(127 - xs[tk1]) << np.uint32(23))
        for s0 in range(0, per, unroll):
            kt0 = k_begin + s0
            if kt0 + unroll <= k_end:
                # a whole trip inside K: no checks (a token past T reads token T-1's x: its D columns are
                # never stored), unsigned scale indices (no negative-index wraparound code)
                for u in range(unroll):
                    load_tile_codes(wv, u, w64, row_a, row_b, kt0 + u, True, t)
                for u in range(unroll):
                    kt = kt0 + u
                    s = scales[srow_u, np.uint64(kt)]
                    c0, c1, c2, c3 = tile_mma_f16(c0, c1, c2, c3, wv[4 * u], wv[4 * u + 1], wv[4 * u + 2],
                                                  wv[4 * u + 3], h32, x16 + 4 * kt + t, True, s, u0, u1, scratch)
            else:
                for u in range(unroll):
                    load_tile_codes(wv, u, w64, row_a, row_b, kt0 + u, kt0 + u < k_end, t)
                for u in range(unroll):
                    kt = kt0 + u
                    ok = kt < k_end
                    s = scales[srow, kt] if ok else np.uint8(127)
                    c0, c1, c2, c3 = tile_mma_f16(c0, c1, c2, c3, wv[4 * u], wv[4 * u + 1], wv[4 * u + 2],
                                                  wv[4 * u + 3], h32, x16 + 4 * kt + t, ok_tok and ok, s, u0, u1,
                                                  scratch)
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


    return _gemv_fp8_v5


_gemv_fp8_v5 = make_gemv_fp8_v5()

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


def geometry_x_f16(T: int, K: int):
    return T, XF16_THREADS


class Fp8GemvV5Launch:
    """x_f16_kernel (x -> its scaled f16 copy and shifts, workspaces allocated at prepare), then
    _gemv_fp8_v5; calling it launches both and returns `out`."""

    __slots__ = ("name", "prep", "gemv", "out", "grid", "block", "x16", "xs")

    def __init__(self, name, prep, gemv, out, x16, xs):
        self.name, self.prep, self.gemv, self.out, self.x16, self.xs = name, prep, gemv, out, x16, xs
        self.grid, self.block = gemv.grid, gemv.block

    def __call__(self):
        self.prep()
        self.gemv()
        return self.out

    def __repr__(self) -> str:
        return f"Fp8GemvV5Launch({self.name}: x_f16 {self.prep.grid} + gemv {self.grid})"


def launcher_v5(rec, x, codes, scales, out, *, stream=0, kernel=None) -> Fp8GemvV5Launch:
    """The records' launcher for gemv_fp8_v5 (`prepare_project_q` has checked the shapes: x [T, K]
    bf16, codes [N, K] uint8, scales [ceil(N/32), K/32] uint8, out [T, N]); the f16 copy of x and
    the shifts are allocated here, once per prepared launch. kernel: another build of the GEMV with
    v5's arguments (tools/fp8_gemv_dev.py)."""
    from ...device.devarray import data_address
    T, K = x.shape
    N = codes.shape[0]
    if data_address(x) % 16 or data_address(codes) % 8:
        raise ValueError(f"{rec.name} reads x as 16-byte chunks and the codes as 8-byte units: x must be 16-byte "
                         "and the codes 8-byte aligned (use gemv_fp8_v1 or an aligned copy)")
    x16 = cuda.device_array((T, K), dtype=np.uint16, stream=stream)
    xs = cuda.device_array(T, dtype=np.int32, stream=stream)
    x32, h32 = x.view(np.uint32).reshape(T * K // 2), x16.view(np.uint32).reshape(T * K // 2)
    grid, block = geometry_x_f16(T, K)
    prep = PreparedLaunch("x_f16", x_f16_kernel, grid, block, stream, (x32, h32, xs, K), (x16, xs))
    grid, block = geometry_tc(T, N)
    gemv = PreparedLaunch(rec.name, kernel or _gemv_fp8_v5, grid, block, stream,
                          (h32, codes.view(np.uint32).reshape(N * K // 4), scales, xs, out, T, K), out)
    return Fp8GemvV5Launch(rec.name, prep, gemv, out, x16, xs)


def geometry_v3(T: int, N: int):
    return (cdiv(N, V3_ROWS), cdiv(T, V3_TOKENS)), V3_THREADS


def sm_count() -> int:
    """Blocks of a gemv_fp8_v4 launch a token group: the device's SMs (SIM_V4_BLOCKS simulated)."""
    if SIMULATOR:
        return SIM_V4_BLOCKS
    if not _SM_COUNT:
        _SM_COUNT.append(int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SM_COUNT[0]


def v4_blocks(N: int, blocks_per_sm: int = 1) -> int:
    """Blocks of a token group: blocks_per_sm an SM, never more than the 8-row groups."""
    return max(1, min(sm_count() * blocks_per_sm, cdiv(N, 8)))


def geometry_v4(T: int, N: int, warps: int = V4_WARPS, blocks_per_sm: int = 1):
    return (v4_blocks(N, blocks_per_sm), cdiv(T, V4_TOKENS)), 32 * warps


# ---- gemv_fp8_v6: v5 in one launch, a block an SM, teams of 8 warps --------------------------------
#
# v5 is two launches (x_f16_kernel, then the GEMV: ~2.5-3 us of the 52.5 at T = 1) and its 1,600
# blocks fill 396 slots 4.04 times: a fifth wave of 16 blocks runs alone at the end. v6 keeps v5's
# arithmetic (the same shifts s_t, f16 copy, mma, k partition, tile order, scale products and warp
# order: v5's bits, hence v2's) and changes where the work runs:
# - One launch: every block makes its own f16 copy of its token group's x in shared memory (x is only
#   T x K bf16: 12 KB a token at the released shape) after issuing its first trip of weight loads:
#   pass 1 reads the tokens' x for their largest magnitudes (a thread's maxima per token, reduced
#   through shared memory in two barriers into s_t, as x_f16_kernel), pass 2 reads x again (L1/L2)
#   and stores x 2^s_t as f16. The warps then read their x fragments from shared memory (each token's
#   row padded by 64 bytes: the 8 tokens of a fragment load land on different banks).
# - A grid of at most `blocks_per_sm` x SMs blocks, each an even share of the 16-row groups (at the
#   released shape and one block an SM: 12 or 13 of the 1,600), worked by `teams` teams of 8 warps:
#   team i takes the block's groups i, i + teams, ...; a team is v5's block (its 8 warps split K as
#   v2's do, their sums added in warp order through shared memory, a named barrier a team), so the
#   x copy is made once a block, not once a group. No block waits for a slot: no partial wave; what
#   is left unequal is a team's last group (13 groups over 3 teams: 5, 4, 4).
# The simulator's mma needs every warp of the block at each call: there every team runs the block's
# largest group count (the surplus groups compute and store nothing).
# SASS (tools/sass_count_fp8.py): a whole 4-tile trip is 169 instructions a warp against v5's 130, 12
# of them R2UR: once the kernel has the copy's global loads of x, ptxas keeps the global-memory
# descriptor in ordinary registers and re-stages it into uniform ones before each batch of code loads
# (without those loads: 155 and none; ld.global.nc code loads or uniform copy loops did not help).

V6_TEAMS = 3                  # teams of 8 warps a block (768 threads: v5's 24 warps an SM)
V6_UNROLL = 4                 # v5's
V6_BLOCKS_PER_SM = 1
V6_PREFETCH = 8               # tiles of codes a warp asks L2 for before the copy of x (two trips of 4)
_V6_PAD = 16                  # words after each token's f16 row in shared memory (bank spread)
_V6_SM_BYTES = 227 * 1024     # shared memory a block may take on sm_90 (an SM has 228 KB)
_V6_MRED = FP8_TOKENS * 32    # the maxima's second stage: 32 a token
_V6_SCRATCH = 6 * FP8_THREADS * 4 if SIMULATOR else 1      # the simulator's mma, up to 4 teams


@device_function(**INLINE)
def _team_barrier(team):
    """bar.sync 1 + team for a team's 256 threads, with the barrier id a constant in each branch (a
    register id makes ptxas reserve all 16 barriers)."""
    if team == 0:
        named_barrier_sync(1, FP8_THREADS)
    elif team == 1:
        named_barrier_sync(2, FP8_THREADS)
    elif team == 2:
        named_barrier_sync(3, FP8_THREADS)
    else:
        named_barrier_sync(4, FP8_THREADS)


def v6_shared_words(T: int, K: int, teams: int) -> int:
    """Dynamic shared words of a v6 block: up to 3 words skipped so that the rest starts 16-byte aligned
    (numba declares the dynamic array 4-byte aligned, after the static ones), the f16 x of min(T, 8)
    tokens (rows padded), then one region that holds the threads' per-token maxima first and the
    teams' warp sums after."""
    tg = min(T, FP8_TOKENS)
    return 3 + tg * (K // 2 + _V6_PAD) + max(teams * _RED, tg * FP8_THREADS * teams)     # 3: the alignment slack


def make_gemv_fp8_v6(teams: int = V6_TEAMS, unroll: int = V6_UNROLL, blocks_per_sm: int = V6_BLOCKS_PER_SM,
                     prefetch_tiles: int = None):
    """The v6 kernel: blocks of `teams` x 8 warps, `unroll` tiles of codes loaded a trip, registers bounded
    for `blocks_per_sm` such blocks an SM. tools/fp8_gemv_dev.py times other shapes (V6_VARIANTS)."""
    if teams < 1 or unroll < 1 or blocks_per_sm < 1 or teams > 4:
        raise ValueError(f"gemv_fp8_v6 needs 1 <= teams <= 4, unroll >= 1, blocks_per_sm >= 1; got {teams}, "
                         f"{unroll}, {blocks_per_sm}")
    nthr = FP8_THREADS * teams
    wv_len = 4 * unroll
    prefetch_tiles = V6_PREFETCH if prefetch_tiles is None else prefetch_tiles

    @cuda.jit(**bounds(nthr, blocks_per_sm))
    def _gemv_fp8_v6(x32, w64, scales, out, T, K):
        # x32: uint32 [T*K/2] flat view of x (bf16 [T, K]); w64: uint32 [N*K/4] flat view of the codes
        # (read as 8-byte pairs); scales: uint8 [ceil(N/32), K/32]; out: uint16 [T, N]. Dynamic shared:
        # v6_shared_words(T, K, teams) words.
        smd = cuda.shared.array(0, types.uint32)
        # x's rows are read and written 16 bytes at a time: start them at a 16-byte shared address
        smw = smd[np.int64((np.uint32(16) - (shared_address(smd) & np.uint32(15))) & np.uint32(15)) >> 2:]
        mred = cuda.shared.array(_V6_MRED, types.uint32)
        xsh = cuda.shared.array(FP8_TOKENS, types.int32)
        scratch = cuda.shared.array(_V6_SCRATCH, types.uint32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        team = warp >> 3
        wl = warp - team * FP8_WARPS                            # the warp's K share (v2's warp index)
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        n_tiles = K >> 5
        K8 = K >> 3                                             # 16-byte units a token row
        xrow = (K >> 1) + _V6_PAD                               # words a token row in shared memory
        ty0 = cuda.blockIdx.y * FP8_TOKENS
        tg = min(FP8_TOKENS, T - ty0)                           # the block's tokens
        reg = tg * xrow                                         # word offset of the maxima / warp sums
        # the block's 16-row groups: an even share
        G = (N + FP8_ROWS - 1) >> 4                           # 16-row groups
        nb = cuda.gridDim.x
        b = cuda.blockIdx.x
        base = G // nb
        rem = G - base * nb
        gb = b * base + min(b, rem)
        ge = gb + base + (1 if b < rem else 0)
        n_it = (ge - gb + teams - 1) // teams                   # groups of the busiest team
        per = (n_tiles + FP8_WARPS - 1) >> 3
        k_begin = wl * per
        k_end = min(k_begin + per, n_tiles)
        wv = cuda.local.array(wv_len, types.uint32)
        # the first group's first codes asked of L2 (DRAM's latency runs under the copy of x, no register
        # held): lane t the 32-byte sector of tiles t, t + 4, ... of its two rows
        if gb + team < ge:
            n0 = (gb + team) * FP8_ROWS
            ra = np.int64(min(n0 + g, N - 1)) * (K >> 2)        # in 4-byte units of w64
            rb = np.int64(min(n0 + g + 8, N - 1)) * (K >> 2)
            for j in range(prefetch_tiles // 4):
                kt = k_begin + t + 4 * j
                if kt < k_end:
                    prefetch_l2(w64, ra + 8 * kt)
                    prefetch_l2(w64, rb + 8 * kt)
        # x -> f16 x 2^s_t in shared memory: pass 1, the tokens' largest magnitudes
        for tk in range(tg):
            xb = np.int64(ty0 + tk) * K8
            m = np.uint32(0)
            for i in range(tid, K8, nthr):
                w0, w1, w2, w3 = load_u32x4(x32, xb + i)
                m = _max_magnitude(m, w0, w1, w2, w3)
            smw[reg + tk * nthr + tid] = m
        cuda.syncthreads()
        if tid < tg * 32:
            tk = tid >> 5
            m = np.uint32(0)
            for q in range(lane, nthr, 32):
                m = max(m, smw[reg + tk * nthr + q])
            mred[tid] = m
        cuda.syncthreads()
        if tid < tg:
            m = np.uint32(0)
            for q in range(32):
                m = max(m, mred[tid * 32 + q])
            e = np.int32(max(m >> np.uint32(7), np.uint32(1))) - 127          # x_f16_kernel's shift
            xsh[tid] = min(15 - e, V5_S_MAX)
        cuda.syncthreads()
        # pass 2: the copy (x read again: L1 / L2)
        for tk in range(tg):
            xb = np.int64(ty0 + tk) * K8
            scale = u32_as_f32(np.uint32(127 + xsh[tk]) << np.uint32(23))
            for i in range(tid, K8, nthr):
                w0, w1, w2, w3 = load_u32x4(x32, xb + i)
                _store_f16(smw, ((tk * xrow) >> 2) + i, scale, w0, w1, w2, w3)
        cuda.syncthreads()
        x16 = (min(g, tg - 1) * xrow) >> 2                      # token g's row in 16-byte units
        tk0 = min(2 * t, tg - 1)                                 # the lane's D columns: tokens 2t, 2t+1
        tk1 = min(tk0 + 1, tg - 1)
        u0 = u32_as_f32(np.uint32(127 - xsh[tk0]) << np.uint32(23))
        u1 = u32_as_f32(np.uint32(127 - xsh[tk1]) << np.uint32(23))
        rbase = reg + team * _RED
        for it in range(n_it):
            gi = gb + team + teams * it
            if gi < ge or SIMULATOR:                          # (the simulator: every team at every mma)
                grp = min(gi, G - 1)
                n0 = grp * FP8_ROWS
                row_a = np.int64(min(n0 + g, N - 1)) * (K >> 3)
                row_b = np.int64(min(n0 + g + 8, N - 1)) * (K >> 3)
                srow = n0 >> 5
                srow_u = np.uint64(srow)
                c0 = c1 = c2 = c3 = float32(0.0)
                for s0 in range(0, per, unroll):
                    kt0 = k_begin + s0
                    if kt0 + unroll <= k_end:
                        for u in range(unroll):
                            load_tile_codes(wv, u, w64, row_a, row_b, kt0 + u, True, t)
                        for u in range(unroll):
                            kt = kt0 + u
                            s = scales[srow_u, np.uint64(kt)]
                            c0, c1, c2, c3 = tile_mma_f16(c0, c1, c2, c3, wv[4 * u], wv[4 * u + 1], wv[4 * u + 2],
                                                          wv[4 * u + 3], smw, x16 + 4 * kt + t, True, s, u0, u1,
                                                          scratch)
                    else:
                        for u in range(unroll):
                            load_tile_codes(wv, u, w64, row_a, row_b, kt0 + u, kt0 + u < k_end, t)
                        for u in range(unroll):
                            kt = kt0 + u
                            ok = kt < k_end
                            s = scales[srow, kt] if ok else np.uint8(127)
                            c0, c1, c2, c3 = tile_mma_f16(c0, c1, c2, c3, wv[4 * u], wv[4 * u + 1], wv[4 * u + 2],
                                                          wv[4 * u + 3], smw, x16 + 4 * kt + t, ok, s, u0, u1,
                                                          scratch)
                # the team's 8 warp sums, added in warp order (v2's), through its region
                rb = rbase + (wl * 32 + lane) * 4
                smw[rb] = f32_as_u32(c0)
                smw[rb + 1] = f32_as_u32(c1)
                smw[rb + 2] = f32_as_u32(c2)
                smw[rb + 3] = f32_as_u32(c3)
                _team_barrier(team)
                tt = tid - team * FP8_THREADS
                if tt < 128:
                    s = float32(0.0)
                    for w in range(FP8_WARPS):
                        s += u32_as_f32(smw[rbase + w * 128 + tt])
                    el = tt >> 2
                    c = tt & 3
                    row = n0 + (el >> 2) + 8 * (c >> 1)
                    tk = ty0 + 2 * (el & 3) + (c & 1)
                    if gi < ge and row < N and tk < T:
                        out[tk, row] = f32_to_bf16_bits(s)
                _team_barrier(team)          # the region is free for the next group

    return _gemv_fp8_v6


_gemv_fp8_v6 = make_gemv_fp8_v6()


def v6_blocks_per_sm(T: int, K: int, teams: int, blocks_per_sm: int) -> int:
    """Blocks of this shape an SM holds: the register bound's count, fewer if shared memory runs out."""
    nbytes = 4 * v6_shared_words(T, K, teams) + 4 * (FP8_TOKENS * 33) + 1024   # + static + the driver's 1 KB
    return max(1, min(blocks_per_sm, (228 * 1024) // nbytes))


def geometry_v6(T: int, N: int, K: int = 6144, teams: int = V6_TEAMS, blocks_per_sm: int = V6_BLOCKS_PER_SM):
    """(grid, block, dynamic shared bytes) of a v6 launch: every block resident at once (at most the SMs x
    the blocks an SM holds, never more than the 16-row groups), a grid row a token group."""
    nb = max(1, min(sm_count() * v6_blocks_per_sm(T, K, teams, blocks_per_sm), cdiv(N, FP8_ROWS)))
    return (nb, cdiv(T, FP8_TOKENS)), FP8_THREADS * teams, 4 * v6_shared_words(T, K, teams)


def launcher_v6(rec, x, codes, scales, out, *, stream=0, kernel=None, teams: int = V6_TEAMS,
                blocks_per_sm: int = V6_BLOCKS_PER_SM) -> PreparedLaunch:
    """The records' launcher for gemv_fp8_v6 (`prepare_project_q` has checked the shapes); one launch.
    kernel (with its teams, blocks_per_sm): another build (tools/fp8_gemv_dev.py's variants)."""
    from ...device.devarray import data_address
    from ...device.launch import allow_dynamic_shared
    T, K = x.shape
    N = codes.shape[0]
    if data_address(x) % 16 or data_address(codes) % 8:
        raise ValueError(f"{rec.name} reads x as 16-byte chunks and the codes as 8-byte units: x must be 16-byte "
                         "and the codes 8-byte aligned (use gemv_fp8_v1 or an aligned copy)")
    grid, block, nbytes = geometry_v6(T, N, K, teams, blocks_per_sm)
    if nbytes > _V6_SM_BYTES:
        raise ValueError(f"{rec.name}: x of {min(T, FP8_TOKENS)} tokens x K = {K} takes {nbytes} bytes of shared "
                         f"memory with {teams} teams, over the {_V6_SM_BYTES} a block may have (use gemv_fp8_v5)")
    kernel = kernel or _gemv_fp8_v6
    args = (x.view(np.uint32).reshape(T * K // 2), codes.view(np.uint32).reshape(N * K // 4), scales, out, T, K)
    allow_dynamic_shared(kernel, args, nbytes)
    return PreparedLaunch(rec.name, kernel, grid, block, stream, args, out, sharedmem=nbytes)
