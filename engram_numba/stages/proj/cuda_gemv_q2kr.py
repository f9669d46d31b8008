"""GEMVs on a `q2k_r` wkv (a Q2_K wkv re-laid out at load, `q2k_r.py`), and the kernels that make it.

    prepare_repack(raw, packed, N, K)      Q2_K blocks uint8 [N, K/256*84] -> q2k_r, on the device
    prepare_decode_q2k_r(packed, out)      q2k_r -> bf16 words uint16 [N, K], through the GEMV's decode
    gemv_q2k_v4 .. v12                     kv = bf16(x @ W^T) for a few tokens, W read as q2k_r

The math is gemv_q2k_v2's (bf16-rounded weights: each weight is the reference decoder's fp32 value
`(d*sc)*q - dmin*m` rounded to bf16, picked from a byte_perm table of the sub-block's 4 values, fed
with x's 8 tokens as N to mma.m16n8k16, fp32 accumulation, kv rounded once): the same product as
the bf16 projection of `wkv_bf16()`, up to summation order. What changes is how the weight arrives:

Kernel versions (the Q2_K file-layout versions v1..v3 live in cuda_gemv_q2k.py). A block owns one
16-row tile and 8 tokens; its warps split the tile's 512-k units; their fp32 fragments are summed
through shared memory in warp order (deterministic). Each has a two-layer launch (`prepare_pair`,
blockIdx.z picks the layer) giving each layer the bits of its own launch.
  gemv_q2k_v4  6 warps, each issuing the 16-byte loads of its 2 units into registers (six a lane a
               unit, each of the first five a contiguous 512 bytes of the warp) before decoding any:
               5.4 KB a warp in flight, 160 registers, 2 blocks an SM. The default for q2k_r at
               T > 1 and in the simulator (the fastest of v4..v7 on the H200 at T = 1, 4, 8, by 2-4%).
  gemv_q2k_v5  12 warps of one unit each: 79 registers, 2 blocks (24 warps) an SM.
  gemv_q2k_v6  4 warps of 3 units whose loads land in shared memory by cp.async, each lane copying
               the chunks it will read (no barrier in the stream), one commit group a unit, decoding
               unit i once only the later units are in flight: 80 registers, 36 KB of slots (5 blocks
               an SM fit).
  gemv_q2k_v7  v4 with a third of its integer instructions (pair-word tables, raw prmt, mul.hi
               selectors and shifts, fma table entries, warp-uniform skips): bit-identical to v4,
               143 registers, not faster on the H200.
  gemv_q2k_v8  v4's shares and summation order (bit-identical to v4) scheduled for latency: a
               persistent grid of one-warp blocks (by default), each taking items (tile, token group,
               layer) b, b + grid, ..., each warp streaming its units through a 3-slot cp.async ring
               (2 units in flight while it decodes one, across item boundaries) with v7's decode:
               123 registers, no spills, 16 blocks an SM; ~765 SASS instructions a unit against
               v7's 691 (the ring's bookkeeping). Its two-layer launch has its own shape
               (V8_PAIR_SHAPE). 44.4 us at T = 1 on the H200 against v4's 45.5; both layers 71.7
               against 82.4 (the T = 1 default until v9).
  gemv_q2k_v9  v4's shares and summation order (bit-identical to v4) on small blocks: one item a
               block of 2 warps (3 shares each), each warp streaming its fixed list of units
               through a 2-slot cp.async ring (no cursor across items), the 6 share fragments
               added in order after one barrier, v7's decode with y3 as one fma: 72 registers,
               no spills, 14 blocks (28 warps) an SM, so the 1,600 items at T <= 8 are resident
               at once; 764 SASS instructions in its unit loop (v8's loop: 1003, 743 of them
               every unit; v7: 691 a unit). Its two-layer launch has its own shape
               (V9_PAIR_SHAPE: 3 slots, 10 blocks an SM). The default at T = 1 on a GPU: 41.3 us
               on the H200 against v8's 44.4, both layers 68.6 against 72.2. Nsight Compute:
               21.8 warps an SM (v8 11.5), ~2 instructions a cycle an SM as v8, no pipe past
               42% and half the issue slots empty: dependency-bound (docs/design.md).
  gemv_q2k_v10 v9 (bit-identical to v4) with sub-blocks decoded in pairs, their mma alternating
               between the two chains; the ring's next copy issued before the decode (half the
               grid's start burst) and split in two groups (a warp starts on its first 2 KB); the
               share fragments as one 16-byte shared access a lane: 72 registers, no spills, 764
               SASS instructions a unit. Its two-layer launch: 3 slots, 10 blocks an SM
               (V10_PAIR_SHAPE). On the H200 level with v9: 38.9 us against 39.2 at T = 1
               (L2 flushed by reading), both layers 65.7 against 66.1, every switch alone within
               1 us (bench/results/h200_q2kr_v10_variants_813426d.txt). Kept for comparison.
  gemv_q2k_v11 v10 (bit-identical to v4) with each sub-block table built in 10 instructions, not 12
               (d*sc and -dmin*m each one exact fma on the nibble's 2^23 + n), and each unit's d/dmin
               plane copied once by lanes 0..7 and read by the 4 lanes of a g after a warp barrier
               (every lane copying its g's chunk was 55-65% of v9's and v10's excess shared-memory
               wavefronts, Nsight Compute): 72 registers, no spills, 746 SASS instructions a unit
               (737 without the shared d/dmin copy). Its two-layer launch: v10's pair shape. Picked
               by name. H200: 38.4 us at T = 1 (v9 39.3) in v12's run.
  gemv_q2k_v12 v11 (bit-identical to v4) with table entry 0 taken as -dmin*m itself (v11's
               fma(0, d*sc, -dmin*m) is always that value) and the ring's copies without a branch
               (zero-filling cp.async where there is nothing to copy): 72 registers, no spills, 714 SASS
               instructions a unit. Its selectors stay v11's: why no re-layout of the quant plane
               removes their shifts is in its section. Two-layer launch: v11's pair shape. H200, L2
               flushed: 37.6 us at T = 1 (v11 38.4, v9 39.3), both layers 64.4 (v9 66.0), T = 4 / 8
               39.2 / 40.0 (VERSION=v12 tools/gpu_dev_q2kr_variants.sh): the default for 1..8 tokens
               on a GPU and so the decode graph's two-layer launch.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, types

from ...device.devarray import data_address
from ...device.hopper import cp_async_16, cp_async_commit, cp_async_waiter
from ...device.intrinsics import (SIMULATOR, add_rn, byte_perm, cvt_pack_bf16x2, device_function, f32_to_bf16_bits,
                                  load_f32x4, load_u32x4, mma_bf16_16816, mul_rn, store_f32x4, store_u32x4, sub_rn,
                                  u32_as_f32)
from ...device.launch import PreparedLaunch
from .cuda_bits import fma_rn, prmt, umulhi
from .cuda_common import ALIGN, INLINE, bounds, cdiv, check_bf16_matrix, flat_u32
from .cuda_gemv_q2k import lut_rounded, mma_subblock, pick4, x_words
from .gemv_common import f16x2_to_f32x2
from .q2k_r import BLOCK_VALUES, DD_OFFSET, SC_OFFSET, TILE_ROWS, UNIT_BLOCKS, UNIT_BYTES, UNIT_VALUES, q2k_r_shape

BLOCK_WORDS = 21                    # an 84-byte Q2_K block in uint32 words
UNIT_CHUNKS = UNIT_BYTES // 16      # 168 sixteen-byte chunks a unit
SC_CHUNK, DD_CHUNK = SC_OFFSET // 16, DD_OFFSET // 16


# ---- the repack, on the device --------------------------------------------------------------------
# One thread per (tile, unit, lane): it writes the lane's 4 quant chunks and its scale chunk, and
# lanes with t = 0 the d/dmin chunk of their g (q2k_r.py's layout, bit for bit).

REPACK_THREADS = 128


@cuda.jit
def _repack(raw32, packed32, N, KB, NU):
    # raw32: uint32 [N*KB*21] flat Q2_K blocks; packed32: uint32 [ceil(N/16)*NU*672] flat q2k_r
    i = cuda.grid(1)
    NT = (N + TILE_ROWS - 1) // TILE_ROWS
    if i >= NT * NU * 32:
        return
    lane = i & 31
    unit_global = i >> 5                       # tile * NU + unit
    tile = unit_global // NU
    unit = unit_global - tile * NU
    g = lane >> 2
    t = lane & 3
    n = t >> 1
    h = t & 1
    base16 = np.int64(unit_global) * UNIT_CHUNKS
    sel = np.uint32(0x6420 + 0x1111 * h)       # scale bytes h, h+2 of word 2n; h, h+2 of word 2n+1
    s0 = s1 = s2 = s3 = np.uint32(0)
    d0 = d1 = d2 = d3 = np.uint32(0)
    for b in range(UNIT_BLOCKS):
        blk = unit * UNIT_BLOCKS + b
        for p in range(2):
            row = tile * TILE_ROWS + g + 8 * p
            q0 = q1 = q2 = q3 = sc = dd = np.uint32(0)
            if row < N and blk < KB:
                w = (np.int64(row) * KB + blk) * BLOCK_WORDS
                qw = w + 4 + 8 * n + 4 * h
                q0, q1, q2, q3 = raw32[qw], raw32[qw + 1], raw32[qw + 2], raw32[qw + 3]
                sc = byte_perm(raw32[w + 2 * n], raw32[w + 2 * n + 1], sel)
                dd = raw32[w + 20]
            store_u32x4(packed32, base16 + (b * 2 + p) * 32 + lane, q0, q1, q2, q3)
            k = b * 2 + p
            if k == 0:
                s0, d0 = sc, dd
            elif k == 1:
                s1, d1 = sc, dd
            elif k == 2:
                s2, d2 = sc, dd
            else:
                s3, d3 = sc, dd
    store_u32x4(packed32, base16 + SC_CHUNK + lane, s0, s1, s2, s3)
    if t == 0:
        store_u32x4(packed32, base16 + DD_CHUNK + g, d0, d1, d2, d3)


def prepare_repack(raw, packed, N: int, K: int, *, stream=0) -> PreparedLaunch:
    """A launch writing q2k_r `packed` (device uint8 [ceil(N/16), ceil(K/512)*2688]) from the Q2_K
    blocks `raw` (device uint8 [N, K/256*84], 4-byte aligned); both checked here."""
    if K <= 0 or K % BLOCK_VALUES:
        raise ValueError(f"K = {K} must be a positive multiple of {BLOCK_VALUES} for Q2_K weights")
    want_raw = (N, K // BLOCK_VALUES * 84)
    if raw.dtype != np.uint8 or tuple(raw.shape) != want_raw or not raw.is_c_contiguous():
        raise ValueError(f"raw must be C-contiguous uint8 {list(want_raw)} Q2_K blocks, got {raw.dtype} {list(raw.shape)}")
    want = q2k_r_shape(N, K)
    if packed.dtype != np.uint8 or tuple(packed.shape) != want or not packed.is_c_contiguous():
        raise ValueError(f"packed must be C-contiguous uint8 {list(want)} (q2k_r), got {packed.dtype} "
                         f"{list(packed.shape)}")
    if data_address(raw) % 4 or data_address(packed) % 16:
        raise ValueError("the repack reads raw as 4-byte words and writes packed as 16-byte chunks: raw must be "
                         "4-byte and packed 16-byte aligned")
    NU = want[1] // UNIT_BYTES
    raw32 = raw.reshape(raw.size).view(np.uint32)
    packed32 = packed.reshape(packed.size).view(np.uint32)
    grid = cdiv(want[0] * NU * 32, REPACK_THREADS)
    return PreparedLaunch("repack_q2k_r", _repack, grid, REPACK_THREADS, stream,
                          (raw32, packed32, N, K // BLOCK_VALUES, NU), packed)


def repack_on_device(raw, N: int, K: int, *, stream=0):
    """Q2_K device blocks -> a new device q2k_r array (see prepare_repack)."""
    packed = cuda.device_array(q2k_r_shape(N, K), dtype=np.uint8, stream=stream)
    return prepare_repack(raw, packed, N, K, stream=stream)()


# ---- decode to bf16, through the GEMV's own decode path -----------------------------------------
# One thread per (tile, unit, lane): it decodes the values the GEMV's lane would feed to its mma
# (rows g and g+8, its quarter of both blocks) with the same table and picks, and stores them.

@cuda.jit
def _decode(packed32, out32, N, K, NU):
    # packed32: uint32 flat q2k_r; out32: uint32 [N*K/2] flat bf16 words
    i = cuda.grid(1)
    NT = (N + TILE_ROWS - 1) // TILE_ROWS
    if i >= NT * NU * 32:
        return
    lane = i & 31
    unit_global = i >> 5
    tile = unit_global // NU
    unit = unit_global - tile * NU
    g = lane >> 2
    t = lane & 3
    KB = K // BLOCK_VALUES
    base16 = np.int64(unit_global) * UNIT_CHUNKS
    s0, s1, s2, s3 = load_u32x4(packed32, base16 + SC_CHUNK + lane)
    d0, d1, d2, d3 = load_u32x4(packed32, base16 + DD_CHUNK + g)
    for b in range(UNIT_BLOCKS):
        blk = unit * UNIT_BLOCKS + b
        for p in range(2):
            row = tile * TILE_ROWS + g + 8 * p
            k = b * 2 + p
            sw = s0 if k == 0 else (s1 if k == 1 else (s2 if k == 2 else s3))
            dw = d0 if k == 0 else (d1 if k == 1 else (d2 if k == 2 else d3))
            if row < N and blk < KB:
                q0, q1, q2, q3 = load_u32x4(packed32, base16 + k * 32 + lane)
                d, dmin = f16x2_to_f32x2(dw)
                for j in range(4):
                    lo, hi = lut_rounded((sw >> np.uint32(8 * j)) & np.uint32(0xFF), d, dmin)
                    a0, c0 = pick4(lo, hi, q0, 2 * j)
                    a1, c1 = pick4(lo, hi, q1, 2 * j)
                    a2, c2 = pick4(lo, hi, q2, 2 * j)
                    a3, c3 = pick4(lo, hi, q3, 2 * j)
                    # values 128n + 32j + 16h + (0..15) of the block: 32 bytes, two 16-byte stores
                    v16 = (np.int64(row) * K + blk * BLOCK_VALUES + 128 * (t >> 1) + 32 * j + 16 * (t & 1)) >> 3
                    store_u32x4(out32, v16, a0, c0, a1, c1)
                    store_u32x4(out32, v16 + 1, a2, c2, a3, c3)


def prepare_decode_q2k_r(packed, out, *, stream=0) -> PreparedLaunch:
    """A launch decoding the q2k_r weight `packed` into bf16 words `out` (device uint16 [N, K])."""
    N, K = out.shape
    want = q2k_r_shape(N, K)
    if packed.dtype != np.uint8 or tuple(packed.shape) != want:
        raise ValueError(f"a q2k_r weight for out [N, K] = {[N, K]} must be uint8 {list(want)}, got "
                         f"{packed.dtype} {list(packed.shape)}")
    if data_address(packed) % 16 or data_address(out) % 16:
        raise ValueError("the q2k_r decode reads and writes 16-byte chunks: packed and out must be 16-byte aligned")
    NU = want[1] // UNIT_BYTES
    grid = cdiv(want[0] * NU * 32, REPACK_THREADS)
    return PreparedLaunch("decode_q2k_r", _decode, grid, REPACK_THREADS, stream,
                          (packed.reshape(packed.size).view(np.uint32), flat_u32(out), N, K, NU), out)


# ---- gemv_q2k_v4 ---------------------------------------------------------------------------------

V4_TOKENS = 8                # tokens a block (the mma's N)
V7_SHAPE = (6, 2, 2)         # gemv_q2k_v7: v4's warps, units a warp and blocks an SM


@device_function(**INLINE)
def _sub(c0, c1, c2, c3, sa, sb, j, da, dmina, db, dminb, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3,
         x32, xv, ok_x, scratch):
    """Sub-block j of the lane's quarter of one block, rows g and g+8 (scale byte j of sa / sb)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x_words(x32, xv, ok_x)
    sh = np.uint32(8 * j)
    lo_a, hi_a = lut_rounded((sa >> sh) & np.uint32(0xFF), da, dmina)
    lo_b, hi_b = lut_rounded((sb >> sh) & np.uint32(0xFF), db, dminb)
    return mma_subblock(c0, c1, c2, c3, lo_a, hi_a, lo_b, hi_b, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 2 * j,
                        x0, x1, x2, x3, x4, x5, x6, x7, scratch)


@device_function(**INLINE)
def _block(c0, c1, c2, c3, e0, e1, e2, e3, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, sa, sb, dda, ddb,
           x32, xv, ok_x, scratch):
    """One block: sub-blocks j = 0, 2 into (c), 1, 3 into (e) (two independent mma chains)."""
    da, dmina = f16x2_to_f32x2(dda)
    db, dminb = f16x2_to_f32x2(ddb)
    c0, c1, c2, c3 = _sub(c0, c1, c2, c3, sa, sb, 0, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                          qb0, qb1, qb2, qb3, x32, xv, ok_x, scratch)
    e0, e1, e2, e3 = _sub(e0, e1, e2, e3, sa, sb, 1, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                          qb0, qb1, qb2, qb3, x32, xv + 4, ok_x, scratch)
    c0, c1, c2, c3 = _sub(c0, c1, c2, c3, sa, sb, 2, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                          qb0, qb1, qb2, qb3, x32, xv + 8, ok_x, scratch)
    e0, e1, e2, e3 = _sub(e0, e1, e2, e3, sa, sb, 3, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                          qb0, qb1, qb2, qb3, x32, xv + 12, ok_x, scratch)
    return c0, c1, c2, c3, e0, e1, e2, e3


@device_function(**INLINE)
def _load_unit(w32, base16, lane, g, ok):
    """The lane's 24 words of one unit: quant chunks (b, p) = (0,0), (0,1), (1,0), (1,1), then its
    scale chunk and its g's d/dmin chunk; zeros when the unit is not the warp's."""
    z = np.uint32(0)
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = z
    e0 = e1 = e2 = e3 = s0 = s1 = s2 = s3 = d0 = d1 = d2 = d3 = z
    if ok:
        a0, a1, a2, a3 = load_u32x4(w32, base16 + lane)
        b0, b1, b2, b3 = load_u32x4(w32, base16 + 32 + lane)
        c0, c1, c2, c3 = load_u32x4(w32, base16 + 64 + lane)
        e0, e1, e2, e3 = load_u32x4(w32, base16 + 96 + lane)
        s0, s1, s2, s3 = load_u32x4(w32, base16 + SC_CHUNK + lane)
        d0, d1, d2, d3 = load_u32x4(w32, base16 + DD_CHUNK + g)
    return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3,
            s0, s1, s2, s3, d0, d1, d2, d3)


@device_function(**INLINE)
def _unit(c0, c1, c2, c3, e0, e1, e2, e3, wv, x32, xv, KB, blk0, ok_tok, scratch):
    """The two blocks of one loaded unit (wv: _load_unit's 24 words)."""
    (a0, a1, a2, a3, b0, b1, b2, b3, g0, g1, g2, g3, h0, h1, h2, h3,
     s0, s1, s2, s3, d0, d1, d2, d3) = wv
    c0, c1, c2, c3, e0, e1, e2, e3 = _block(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                            s0, s1, d0, d1, x32, xv, ok_tok and blk0 < KB, scratch)
    return _block(c0, c1, c2, c3, e0, e1, e2, e3, g0, g1, g2, g3, h0, h1, h2, h3,
                  s2, s3, d2, d3, x32, xv + 32, ok_tok and blk0 + 1 < KB, scratch)


def _make_gemv(warps: int, units: int, blocks_per_sm: int):
    """A q2k_r GEMV whose blocks have `warps` warps on one 16-row tile, each warp loading `units`
    (1 or 2) units of its K share before decoding them."""
    threads = warps * 32
    red_size = warps * 32 * 4
    scratch_size = 6 * threads if SIMULATOR else 1

    @device_function(**INLINE)
    def body(x32, w32, w16, out, T, K, red, scratch):
        """The block's tile (blockIdx.x) and token group (blockIdx.y) of one layer's weight, whose
        units start at 16-byte chunk w16 of w32."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        KB = K // BLOCK_VALUES
        NU = (K + UNIT_VALUES - 1) // UNIT_VALUES
        tile = cuda.blockIdx.x
        tok = cuda.blockIdx.y * V4_TOKENS + g
        ok_tok = tok < T
        x16 = np.int64(min(tok, T - 1)) * (K >> 3)             # token row, in 16-byte units
        xoff = 16 * (t >> 1) + 2 * (t & 1)                      # the lane's quarter of a block, 16-byte units
        per = (NU + warps - 1) // warps
        per = (per + units - 1) // units * units                # uniform trips: every warp reaches every mma
        u_begin = warp * per
        u_end = min(u_begin + per, NU)
        tile16 = w16 + np.int64(tile) * NU * UNIT_CHUNKS
        z = float32(0.0)
        c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
        for s in range(0, per, units):
            u0 = u_begin + s
            wa = _load_unit(w32, tile16 + np.int64(u0) * UNIT_CHUNKS, lane, g, u0 < u_end)
            if units == 2:
                wb = _load_unit(w32, tile16 + np.int64(u0 + 1) * UNIT_CHUNKS, lane, g, u0 + 1 < u_end)
            blk = u0 * UNIT_BLOCKS
            c0, c1, c2, c3, e0, e1, e2, e3 = _unit(c0, c1, c2, c3, e0, e1, e2, e3, wa, x32, x16 + 32 * blk + xoff,
                                                   KB, blk, ok_tok and u0 < u_end, scratch)
            if units == 2:
                c0, c1, c2, c3, e0, e1, e2, e3 = _unit(c0, c1, c2, c3, e0, e1, e2, e3, wb, x32,
                                                       x16 + 32 * (blk + 2) + xoff, KB, blk + 2,
                                                       ok_tok and u0 + 1 < u_end, scratch)
        base = (warp * 32 + lane) * 4
        red[base] = c0 + e0
        red[base + 1] = c1 + e1
        red[base + 2] = c2 + e2
        red[base + 3] = c3 + e3
        cuda.syncthreads()
        if tid < 128:
            s_ = float32(0.0)
            for w in range(warps):
                s_ += red[w * 128 + tid]
            el = tid >> 2
            c = tid & 3
            row = tile * TILE_ROWS + (el >> 2) + 8 * (c >> 1)
            tk = cuda.blockIdx.y * V4_TOKENS + 2 * (el & 3) + (c & 1)
            if row < N and tk < T:
                out[tk, row] = f32_to_bf16_bits(s_)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat x; w32: uint32 flat q2k_r [ceil(N/16) * NU * 672]; out: uint16 [T, N]
        red = cuda.shared.array(red_size, float32)               # [warp][lane][c0..c3]
        scratch = cuda.shared.array(scratch_size, types.uint32)  # the mma twin's (simulator only)
        body(x32, w32, np.int64(0), out, T, K, red, scratch)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv_pair(x32a, x32b, w32, outa, outb, T, K):
        # two layers in one launch (blockIdx.z): w32 holds layer a's q2k_r then layer b's, same shape;
        # x32a/b: their inputs, outa/b: uint16 [T, N] each
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        if cuda.blockIdx.z == 0:
            body(x32a, w32, np.int64(0), outa, T, K, red, scratch)
        else:
            layer16 = np.int64((outb.shape[1] + TILE_ROWS - 1) // TILE_ROWS) * \
                ((K + UNIT_VALUES - 1) // UNIT_VALUES) * UNIT_CHUNKS
            body(x32b, w32, layer16, outb, T, K, red, scratch)

    return gemv, gemv_pair


# ---- gemv_q2k_v6: the loads land in shared memory (cp.async), not in registers -------------------
# Each lane copies exactly the six chunks of a unit it will read (its four quant chunks, its scale
# chunk, its g's d/dmin chunk: the four lanes of a g each copy that one, a single coalesced request)
# into its own slots, so a lane's cp.async.wait_group alone makes its data visible to it: no warp
# or block barrier in the stream. A warp issues its CP_UNITS units (one commit group each) and then
# computes unit i after waiting until only the later units' groups are in flight. The registers no
# longer hold the data in flight, so more blocks fit an SM (shared memory is the limit), and every
# warp of every resident block has its whole K share on the way at once.

CP_WARPS = 4                 # K = 6144 is 12 units: 3 a warp
CP_UNITS = 3                 # units a warp has in flight (written out below)
CP_BLOCKS_PER_SM = 6         # the register bound; 36 KB of slots a block lets 5 share an SM
CP_SLOT_WORDS = 6 * 32 * 4   # one unit of one warp: [chunk c][lane] 16-byte slots


@device_function(**INLINE)
def _cp_unit(sm, slot, w32, base16, lane, g, ok):
    """The lane's cp.async of one unit into slot `slot` (zeros when not `ok`), one commit group."""
    n = 16 if ok else 0
    src = base16 if ok else np.int64(0)
    off = slot * (CP_SLOT_WORDS * 4) + lane * 16
    cp_async_16(sm, off, w32, src + lane, n)
    cp_async_16(sm, off + 512, w32, src + 32 + lane, n)
    cp_async_16(sm, off + 1024, w32, src + 64 + lane, n)
    cp_async_16(sm, off + 1536, w32, src + 96 + lane, n)
    cp_async_16(sm, off + 2048, w32, src + SC_CHUNK + lane, n)
    cp_async_16(sm, off + 2560, w32, src + DD_CHUNK + g, n)
    cp_async_commit()


@device_function(**INLINE)
def _smem_unit(sm, slot, lane):
    """The lane's 24 words of the unit in slot `slot` (the order `_load_unit` returns)."""
    q = slot * (CP_SLOT_WORDS // 4) + lane           # 16-byte index of chunk 0
    a0, a1, a2, a3 = load_u32x4(sm, q)
    b0, b1, b2, b3 = load_u32x4(sm, q + 32)
    c0, c1, c2, c3 = load_u32x4(sm, q + 64)
    e0, e1, e2, e3 = load_u32x4(sm, q + 96)
    s0, s1, s2, s3 = load_u32x4(sm, q + 128)
    d0, d1, d2, d3 = load_u32x4(sm, q + 160)
    return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3,
            s0, s1, s2, s3, d0, d1, d2, d3)


def _make_gemv_cp():
    """gemv_q2k_v6 and its two-layer launch (module doc, "gemv_q2k_v6")."""
    warps = CP_WARPS
    threads = warps * 32
    red_size = warps * 32 * 4
    scratch_size = 6 * threads if SIMULATOR else 1
    slots = warps * CP_UNITS * CP_SLOT_WORDS
    wait2 = cp_async_waiter(2)
    wait1 = cp_async_waiter(1)
    wait0 = cp_async_waiter(0)

    @device_function(**INLINE)
    def body(x32, w32, w16, out, T, K, red, scratch, sm):
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        KB = K // BLOCK_VALUES
        NU = (K + UNIT_VALUES - 1) // UNIT_VALUES
        tile = cuda.blockIdx.x
        tok = cuda.blockIdx.y * V4_TOKENS + g
        ok_tok = tok < T
        x16 = np.int64(min(tok, T - 1)) * (K >> 3)
        xoff = 16 * (t >> 1) + 2 * (t & 1)
        per = (NU + warps - 1) // warps
        per = (per + CP_UNITS - 1) // CP_UNITS * CP_UNITS
        u_begin = warp * per
        u_end = min(u_begin + per, NU)
        tile16 = w16 + np.int64(tile) * NU * UNIT_CHUNKS
        slot0 = warp * CP_UNITS
        z = float32(0.0)
        c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
        for s in range(0, per, CP_UNITS):
            u0 = u_begin + s
            _cp_unit(sm, slot0, w32, tile16 + np.int64(u0) * UNIT_CHUNKS, lane, g, u0 < u_end)
            _cp_unit(sm, slot0 + 1, w32, tile16 + np.int64(u0 + 1) * UNIT_CHUNKS, lane, g, u0 + 1 < u_end)
            _cp_unit(sm, slot0 + 2, w32, tile16 + np.int64(u0 + 2) * UNIT_CHUNKS, lane, g, u0 + 2 < u_end)
            blk = u0 * UNIT_BLOCKS
            wait2()
            c0, c1, c2, c3, e0, e1, e2, e3 = _unit(c0, c1, c2, c3, e0, e1, e2, e3, _smem_unit(sm, slot0, lane),
                                                   x32, x16 + 32 * blk + xoff, KB, blk, ok_tok and u0 < u_end,
                                                   scratch)
            wait1()
            c0, c1, c2, c3, e0, e1, e2, e3 = _unit(c0, c1, c2, c3, e0, e1, e2, e3, _smem_unit(sm, slot0 + 1, lane),
                                                   x32, x16 + 32 * (blk + 2) + xoff, KB, blk + 2,
                                                   ok_tok and u0 + 1 < u_end, scratch)
            wait0()
            c0, c1, c2, c3, e0, e1, e2, e3 = _unit(c0, c1, c2, c3, e0, e1, e2, e3, _smem_unit(sm, slot0 + 2, lane),
                                                   x32, x16 + 32 * (blk + 4) + xoff, KB, blk + 4,
                                                   ok_tok and u0 + 2 < u_end, scratch)
        base = (warp * 32 + lane) * 4
        red[base] = c0 + e0
        red[base + 1] = c1 + e1
        red[base + 2] = c2 + e2
        red[base + 3] = c3 + e3
        cuda.syncthreads()
        if tid < 128:
            s_ = float32(0.0)
            for w in range(warps):
                s_ += red[w * 128 + tid]
            el = tid >> 2
            c = tid & 3
            row = tile * TILE_ROWS + (el >> 2) + 8 * (c >> 1)
            tk = cuda.blockIdx.y * V4_TOKENS + 2 * (el & 3) + (c & 1)
            if row < N and tk < T:
                out[tk, row] = f32_to_bf16_bits(s_)

    @cuda.jit(**bounds(threads, CP_BLOCKS_PER_SM))
    def gemv(x32, w32, out, T, K):
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        sm = cuda.shared.array(slots, types.uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(slots, types.uint32)
        body(x32, w32, np.int64(0), out, T, K, red, scratch, sm)

    @cuda.jit(**bounds(threads, CP_BLOCKS_PER_SM))
    def gemv_pair(x32a, x32b, w32, outa, outb, T, K):
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        sm = cuda.shared.array(slots, types.uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(slots, types.uint32)
        if cuda.blockIdx.z == 0:
            body(x32a, w32, np.int64(0), outa, T, K, red, scratch, sm)
        else:
            layer16 = np.int64((outb.shape[1] + TILE_ROWS - 1) // TILE_ROWS) * \
                ((K + UNIT_VALUES - 1) // UNIT_VALUES) * UNIT_CHUNKS
            body(x32b, w32, layer16, outb, T, K, red, scratch, sm)

    return gemv, gemv_pair


# ---- gemv_q2k_v7: v4's stream and math, a third of its integer instructions -------------------------
# v4 spends ~30 SASS instructions a mma on decoding, two thirds of them on the integer pipe (half
# the FP32 pipe's rate on sm_90). v7 keeps every value, product and sum of v4 (so its kv is v4's,
# bit for bit) and cuts:
#   - the table: a sub-block's 4 bf16 values stay as the two words cvt.rn.bf16x2 packs (entry q at
#     bytes 2q, 2q+1), so a value's selector byte is 34q + 16 (`pick4p`) and the two byte_perm
#     that split the table into low / high bytes go; y0 = 0*s - o and y2 = 2*s - o are one fma
#     each (0*s and 2*s are exact, so fma rounds them as the multiply-then-subtract does);
#   - the picks: raw `prmt` (libdevice's byte_perm masks every selector first: one LOP3 a prmt),
#     the selector of values 2, 3 by mul.hi on the FP32 pipe instead of a shift;
#   - the predicates: on the GPU a warp with no unit left (or the zero pad block of an odd K/256)
#     skips it with a warp-uniform branch, so x is loaded unconditionally (tokens past T read the
#     last token and are dropped at the store) and nothing is zero-filled. The simulator's mma
#     twin needs every thread at every mma, so there the zero-fill path of v4 stays.
# Per 4-block trip of a warp (64 mma, sm_90a SASS, tools/sass_count_q2kr.py): 1382 instructions
# against v4's 1916, 521 on the integer pipe against 1178. On the H200 it runs at v4's speed or
# 1-3 us slower (records.py): the issue rate of the decode is not what holds these GEMVs at a
# quarter of the copy floor.

# pick4p's selectors: v = codes | SEL_BIAS (bits disjoint from the codes' 0x03030303, so | is +);
# v * 0x22 + SEL_LO_ADD has 2q | (2q + 1) << 4 in bytes 0, 1 (values 0, 1), and
# mul.hi(v, 0x220000) the same for values 2, 3 in its low 16 bits: SEL_BIAS * 0x220000 =
# 0x1010 << 32 + 0x68000000, the + 0x1010 carried in with no add (and no 64-bit addend to build).
SEL_BIAS = 0x0078F400
SEL_LO_ADD = (0x10101010 - SEL_BIAS * 0x22) % (1 << 16)     # only bits 0..15 select: no wrap-around
SEL_HI_MUL = 0x220000
NIB_MAGIC = 0x4B000000                 # 2^23 as fp32 bits: a small integer in its low mantissa bits


@device_function(**INLINE)
def nibble_f32(n4, j, magic):
    """Byte j of n4 (each byte < 16) as fp32, exactly: one prmt puts it under 2^23's exponent
    (magic = NIB_MAGIC, held in a register: see `opaque_zero`)."""
    return u32_as_f32(prmt(n4, magic, np.uint32(0x7440 + j))) - np.float32(8388608.0)


@device_function(**INLINE)
def opaque_zero(T):
    """0, computed from the launch's T so that ptxas keeps the constants added to it in one
    register for the whole kernel (as two-constant LOP3 / PRMT operands it rebuilds them with a MOV
    before every use, ~100 MOVs a trip)."""
    return np.uint32(np.uint64(T) >> np.uint64(48))


@device_function(**INLINE)
def lut_pairs(sc_lo, sc_hi, d, dmin):
    """The 4 values a sub-block's weights take (lut_rounded's: the reference decoder's fp32 values
    rounded to bf16; sc_lo, sc_hi the scale byte's nibbles as fp32) as the pair words
    (y0 | y1 << 16, y2 | y3 << 16)."""
    scale = mul_rn(d, sc_lo)
    offset = mul_rn(dmin, sc_hi)
    neg = -offset
    y0 = fma_rn(np.float32(0.0), scale, neg)       # == sub_rn(mul_rn(scale, 0), offset), -0 and NaN included
    y1 = sub_rn(scale, offset)
    y2 = fma_rn(np.float32(2.0), scale, neg)       # 2*scale is exact (|scale| < 2^20)
    y3 = sub_rn(mul_rn(scale, np.float32(3.0)), offset)
    return cvt_pack_bf16x2(y0, y1), cvt_pack_bf16x2(y2, y3)


@device_function(**INLINE)
def pick4p(p01, p23, word, shift, bias):
    """pick4 on the pair words of lut_pairs: 4 values from the 4 bytes of `word` (2-bit codes at
    bit `shift`) -> two bf16x2 words (values 0, 1 and 2, 3). The shift is a mul.hi too; bias =
    SEL_BIAS in a register."""
    w = np.uint32(word) if shift == 0 else umulhi(word, np.uint32(1 << (32 - shift)))
    v = (w & np.uint32(0x03030303)) | bias
    s = np.uint32(np.uint32(v * np.uint32(0x22)) + np.uint32(SEL_LO_ADD))
    s2 = umulhi(v, np.uint32(SEL_HI_MUL))
    return prmt(p01, p23, s), prmt(p01, p23, s2)


@device_function(**INLINE)
def _mma_sub7(c0, c1, c2, c3, pa01, pa23, pb01, pb23, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, shift,
              x0, x1, x2, x3, x4, x5, x6, x7, bias, scratch):
    """mma_subblock on pick4p's tables."""
    a0, a1 = pick4p(pa01, pa23, qa0, shift, bias)
    b0, b1 = pick4p(pb01, pb23, qb0, shift, bias)
    c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x0, x1, c0, c1, c2, c3, scratch)
    a0, a1 = pick4p(pa01, pa23, qa1, shift, bias)
    b0, b1 = pick4p(pb01, pb23, qb1, shift, bias)
    c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x2, x3, c0, c1, c2, c3, scratch)
    a0, a1 = pick4p(pa01, pa23, qa2, shift, bias)
    b0, b1 = pick4p(pb01, pb23, qb2, shift, bias)
    c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x4, x5, c0, c1, c2, c3, scratch)
    a0, a1 = pick4p(pa01, pa23, qa3, shift, bias)
    b0, b1 = pick4p(pb01, pb23, qb3, shift, bias)
    return mma_bf16_16816(a0, b0, a1, b1, x6, x7, c0, c1, c2, c3, scratch)


@device_function(**INLINE)
def _x16(x32, v4, ok):
    """16 consecutive x values at 16-byte index v4: unconditional loads on the GPU (the caller keeps
    v4 in bounds), zeros when not `ok` in the simulator."""
    if SIMULATOR:
        return x_words(x32, v4, ok)
    a0, a1, a2, a3 = load_u32x4(x32, v4)
    b0, b1, b2, b3 = load_u32x4(x32, v4 + 1)
    return a0, a1, a2, a3, b0, b1, b2, b3


@device_function(**INLINE)
def _sub7(c0, c1, c2, c3, la, ha, lb, hb, j, da, dmina, db, dminb, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3,
          x32, xv, ok_x, bias, magic, scratch):
    """Sub-block j of the lane's quarter of one block, rows g and g+8 (la/ha, lb/hb: their scale
    bytes' low / high nibbles, byte j each)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x16(x32, xv, ok_x)
    pa01, pa23 = lut_pairs(nibble_f32(la, j, magic), nibble_f32(ha, j, magic), da, dmina)
    pb01, pb23 = lut_pairs(nibble_f32(lb, j, magic), nibble_f32(hb, j, magic), db, dminb)
    return _mma_sub7(c0, c1, c2, c3, pa01, pa23, pb01, pb23, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 2 * j,
                     x0, x1, x2, x3, x4, x5, x6, x7, bias, scratch)


@device_function(**INLINE)
def _block7(c0, c1, c2, c3, e0, e1, e2, e3, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, sa, sb, dda, ddb,
            x32, xv, ok_x, bias, magic, scratch):
    """_block with v7's decode: sub-blocks 0, 2 into (c), 1, 3 into (e)."""
    da, dmina = f16x2_to_f32x2(dda)
    db, dminb = f16x2_to_f32x2(ddb)
    m = np.uint32(0x0F0F0F0F)
    la, ha = sa & m, (sa >> np.uint32(4)) & m
    lb, hb = sb & m, (sb >> np.uint32(4)) & m
    c0, c1, c2, c3 = _sub7(c0, c1, c2, c3, la, ha, lb, hb, 0, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv, ok_x, bias, magic, scratch)
    e0, e1, e2, e3 = _sub7(e0, e1, e2, e3, la, ha, lb, hb, 1, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv + 4, ok_x, bias, magic, scratch)
    c0, c1, c2, c3 = _sub7(c0, c1, c2, c3, la, ha, lb, hb, 2, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv + 8, ok_x, bias, magic, scratch)
    e0, e1, e2, e3 = _sub7(e0, e1, e2, e3, la, ha, lb, hb, 3, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv + 12, ok_x, bias, magic, scratch)
    return c0, c1, c2, c3, e0, e1, e2, e3


@device_function(**INLINE)
def _unit7(c0, c1, c2, c3, e0, e1, e2, e3, wv, x32, xv, KB, blk0, ok_tok, bias, magic, scratch):
    """_unit with v7's decode. On the GPU the caller runs it only for a unit of the warp's share
    (warp-uniform), and the unit's second block only when it is inside K (warp-uniform too)."""
    (a0, a1, a2, a3, b0, b1, b2, b3, g0, g1, g2, g3, h0, h1, h2, h3,
     s0, s1, s2, s3, d0, d1, d2, d3) = wv
    c0, c1, c2, c3, e0, e1, e2, e3 = _block7(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                             s0, s1, d0, d1, x32, xv, ok_tok and blk0 < KB, bias, magic, scratch)
    if SIMULATOR or blk0 + 1 < KB:
        c0, c1, c2, c3, e0, e1, e2, e3 = _block7(c0, c1, c2, c3, e0, e1, e2, e3, g0, g1, g2, g3, h0, h1, h2, h3,
                                                 s2, s3, d2, d3, x32, xv + 32, ok_tok and blk0 + 1 < KB, bias, magic,
                                                 scratch)
    return c0, c1, c2, c3, e0, e1, e2, e3


def _make_gemv7(warps: int, units: int, blocks_per_sm: int):
    """gemv_q2k_v7 and its two-layer launch: v4's blocks and stream (`warps` warps on one 16-row
    tile, each loading `units` units of its K share before decoding them) with v7's decode."""
    threads = warps * 32
    red_size = warps * 32 * 4
    scratch_size = 6 * threads if SIMULATOR else 1

    @device_function(**INLINE)
    def body(x32, w32, w16, out, T, K, red, scratch):
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        KB = K // BLOCK_VALUES
        NU = (K + UNIT_VALUES - 1) // UNIT_VALUES
        tile = cuda.blockIdx.x
        tok = cuda.blockIdx.y * V4_TOKENS + g
        ok_tok = tok < T
        x16 = np.int64(min(tok, T - 1)) * (K >> 3)             # tokens past T read the last one
        xoff = 16 * (t >> 1) + 2 * (t & 1)
        per = (NU + warps - 1) // warps
        per = (per + units - 1) // units * units
        u_begin = warp * per
        u_end = min(u_begin + per, NU)
        tile16 = w16 + np.int64(tile) * NU * UNIT_CHUNKS
        zero = opaque_zero(T)
        bias = np.uint32(SEL_BIAS) + zero        # + (not |): LLVM would reassociate an | into the picks
        magic = np.uint32(NIB_MAGIC) + zero
        z = float32(0.0)
        c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
        for s in range(0, per, units):
            u0 = u_begin + s
            blk = u0 * UNIT_BLOCKS
            if SIMULATOR:                   # v4's zero-filled path: every thread reaches every mma
                wa = _load_unit(w32, tile16 + np.int64(u0) * UNIT_CHUNKS, lane, g, u0 < u_end)
                if units == 2:
                    wb = _load_unit(w32, tile16 + np.int64(u0 + 1) * UNIT_CHUNKS, lane, g, u0 + 1 < u_end)
                c0, c1, c2, c3, e0, e1, e2, e3 = _unit7(c0, c1, c2, c3, e0, e1, e2, e3, wa, x32,
                                                        x16 + 32 * blk + xoff, KB, blk, ok_tok and u0 < u_end,
                                                        bias, magic, scratch)
                if units == 2:
                    c0, c1, c2, c3, e0, e1, e2, e3 = _unit7(c0, c1, c2, c3, e0, e1, e2, e3, wb, x32,
                                                            x16 + 32 * (blk + 2) + xoff, KB, blk + 2,
                                                            ok_tok and u0 + 1 < u_end, bias, magic, scratch)
            else:                           # loads from units inside the weight, decode only the warp's
                wa = _load_unit(w32, tile16 + np.int64(min(u0, NU - 1)) * UNIT_CHUNKS, lane, g, True)
                if units == 2:
                    wb = _load_unit(w32, tile16 + np.int64(min(u0 + 1, NU - 1)) * UNIT_CHUNKS, lane, g, True)
                if u0 < u_end:
                    c0, c1, c2, c3, e0, e1, e2, e3 = _unit7(c0, c1, c2, c3, e0, e1, e2, e3, wa, x32,
                                                            x16 + 32 * blk + xoff, KB, blk, True, bias, magic, scratch)
                if units == 2 and u0 + 1 < u_end:
                    c0, c1, c2, c3, e0, e1, e2, e3 = _unit7(c0, c1, c2, c3, e0, e1, e2, e3, wb, x32,
                                                            x16 + 32 * (blk + 2) + xoff, KB, blk + 2, True, bias, magic,
                                                            scratch)
        base = (warp * 32 + lane) * 4
        red[base] = c0 + e0
        red[base + 1] = c1 + e1
        red[base + 2] = c2 + e2
        red[base + 3] = c3 + e3
        cuda.syncthreads()
        if tid < 128:
            s_ = float32(0.0)
            for w in range(warps):
                s_ += red[w * 128 + tid]
            el = tid >> 2
            c = tid & 3
            row = tile * TILE_ROWS + (el >> 2) + 8 * (c >> 1)
            tk = cuda.blockIdx.y * V4_TOKENS + 2 * (el & 3) + (c & 1)
            if row < N and tk < T:
                out[tk, row] = f32_to_bf16_bits(s_)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat x; w32: uint32 flat q2k_r [ceil(N/16) * NU * 672]; out: uint16 [T, N]
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        body(x32, w32, np.int64(0), out, T, K, red, scratch)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv_pair(x32a, x32b, w32, outa, outb, T, K):
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        if cuda.blockIdx.z == 0:
            body(x32a, w32, np.int64(0), outa, T, K, red, scratch)
        else:
            layer16 = np.int64((outb.shape[1] + TILE_ROWS - 1) // TILE_ROWS) * \
                ((K + UNIT_VALUES - 1) // UNIT_VALUES) * UNIT_CHUNKS
            body(x32b, w32, layer16, outb, T, K, red, scratch)

    return gemv, gemv_pair


# ---- gemv_q2k_v8: persistent blocks, a cp.async ring a warp, v7's decode ----------------------------
# v4..v7 give each block one tile and have it load, then decode: at 2 blocks an SM the SM idles on
# DRAM latency between a block's loads and its mma, and 1600 blocks over 264 slots leave a near-empty
# last wave. v8 keeps v4's K shares and summation order (so its kv is v4's, bit for bit) and
# changes how they are scheduled:
#   - a block is a team of V8_TEAM warps that splits each item (one tile of 16 rows, one group of 8
#     tokens, one layer) along v4's 6 K shares: warp w takes shares w * 6/team .. (w+1) * 6/team - 1,
#     each summed in its own two mma chains (c: sub-blocks 0, 2; e: 1, 3) exactly as v4's warp of
#     that share does;
#   - the grid is persistent: min(items, SMs x V8_BLOCKS_PER_SM) blocks, block b taking items b,
#     b + grid, ...; the two-layer launch is one pool of both layers' items;
#   - each warp streams its units (one unit = 16 rows x 512 k, 2688 bytes) through a ring of
#     V8_STAGES shared-memory slots by cp.async: each lane copies the six chunks it will read (v6's
#     slots: no barrier in the stream), the copy of unit j + stages is issued as soon as unit j is
#     decoded and `cp.async.wait_group stages-1` waits only for the oldest, across share and item
#     boundaries, so a warp always has stages-1 units in flight while it decodes;
#   - the decode is v7's (pair-word tables, raw prmt, warp-uniform skips of units past K and of the
#     zero pad block), reading one block's words from shared memory at a time (few registers);
#   - the 6 shares' fragments are added in share order from 0.0, as v4's reduction does: in
#     registers when one warp holds all six (team 1), else through shared memory (two buffers, one
#     barrier an item).

V8_TEAM = 1                  # warps a block: one warp sums all 6 shares of its item, in registers
V8_STAGES = 3                # unit slots a warp: 2 units in flight while it decodes a third
V8_BLOCKS_PER_SM = 16        # the register bound (128 a thread; it takes 123, no spills); 9 KB of slots a block
# the two-layer launch's shape: 2 slots a warp and 25 one-warp blocks an SM (80 registers a thread).
# Same values and order, so the same kv bits; measured on the H200 (L2 cold, T = 1, both wkv):
# 71.7 us against 81.2 with the single launch's shape and 82.4 for v4's two-layer launch. Alone it is
# slower (52.0 us against 44.4): one layer's 1,600 items leave the pool's 3,300 slots half empty.
V8_PAIR_SHAPE = (1, 2, 25)
SIM_PERSISTENT_BLOCKS = 2    # the simulator's "SM count x blocks an SM": several items a block


@device_function(**INLINE)
def _cp_job(sm, off, w32, base16, lane, g, ok):
    """The lane's cp.async of its six chunks of one unit (v6's `_cp_unit` order) into the slot at
    byte `off`, as one commit group. Not `ok`: the group is empty on the GPU (the decode skips the
    unit), zeros in the simulator (whose mma twin needs every thread at every mma)."""
    if SIMULATOR:
        n = 16 if ok else 0
        src = base16 if ok else np.int64(0)
        cp_async_16(sm, off, w32, src + lane, n)
        cp_async_16(sm, off + 512, w32, src + 32 + lane, n)
        cp_async_16(sm, off + 1024, w32, src + 64 + lane, n)
        cp_async_16(sm, off + 1536, w32, src + 96 + lane, n)
        cp_async_16(sm, off + 2048, w32, src + SC_CHUNK + lane, n)
        cp_async_16(sm, off + 2560, w32, src + DD_CHUNK + g, n)
    elif ok:
        cp_async_16(sm, off, w32, base16 + lane, 16)
        cp_async_16(sm, off + 512, w32, base16 + 32 + lane, 16)
        cp_async_16(sm, off + 1024, w32, base16 + 64 + lane, 16)
        cp_async_16(sm, off + 1536, w32, base16 + 96 + lane, 16)
        cp_async_16(sm, off + 2048, w32, base16 + SC_CHUNK + lane, 16)
        cp_async_16(sm, off + 2560, w32, base16 + DD_CHUNK + g, 16)
    cp_async_commit()


@device_function(**INLINE)
def _unit8(c0, c1, c2, c3, e0, e1, e2, e3, sm, q, x32, xv, KB, blk0, ok_x, bias, magic, scratch):
    """v7's `_unit7` on the unit in a shared-memory slot (q: the lane's 16-byte index of chunk 0),
    loading one block's words at a time; the second block only inside K on the GPU."""
    s0, s1, _, _ = load_u32x4(sm, q + 128)
    d0, d1, _, _ = load_u32x4(sm, q + 160)
    a0, a1, a2, a3 = load_u32x4(sm, q)
    b0, b1, b2, b3 = load_u32x4(sm, q + 32)
    c0, c1, c2, c3, e0, e1, e2, e3 = _block7(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                             s0, s1, d0, d1, x32, xv, ok_x and blk0 < KB, bias, magic, scratch)
    if SIMULATOR or blk0 + 1 < KB:
        _, _, s2, s3 = load_u32x4(sm, q + 128)         # the second block's scale and d/dmin words, now
        _, _, d2, d3 = load_u32x4(sm, q + 160)
        a0, a1, a2, a3 = load_u32x4(sm, q + 64)
        b0, b1, b2, b3 = load_u32x4(sm, q + 96)
        c0, c1, c2, c3, e0, e1, e2, e3 = _block7(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                                 s2, s3, d2, d3, x32, xv + 32, ok_x and blk0 + 1 < KB, bias, magic,
                                                 scratch)
    return c0, c1, c2, c3, e0, e1, e2, e3


@device_function(**INLINE)
def udiv32(a, b):
    """a // b for 0 <= a, b < 2^32, as a 32-bit division (inline; a 64-bit one is a call)."""
    return np.int64(np.uint32(np.uint32(a) // np.uint32(b)))


@device_function(**INLINE)
def _next_item(layer, grp, tile, G, NT, NG):
    """(layer, token group, tile) of the item G items on (tile fastest): steps, no division (the
    steps are few: G is at most the number of items)."""
    tile += G
    while tile >= NT:
        tile -= NT
        grp += 1
    while grp >= NG:
        grp -= NG
        layer += 1
    return layer, grp, tile


def _make_gemv8(team: int, stages: int, blocks_per_sm: int):
    """gemv_q2k_v8 and its two-layer launch (the section's comment): blocks of `team` warps (1, 2, 3
    or 6) sharing each item's 6 K shares, `stages` unit slots a warp."""
    if 6 % team or stages < 2:
        raise ValueError(f"gemv_q2k_v8 needs a team of 1, 2, 3 or 6 warps and >= 2 stages, got {team}, {stages}")
    if blocks_per_sm * (v8_shared_bytes(team, stages) + 1024) > SM_SHARED_BYTES:
        raise ValueError(f"{blocks_per_sm} gemv_q2k_v8 blocks of {team} warps x {stages} slots need "
                         f"{blocks_per_sm * (v8_shared_bytes(team, stages) + 1024)} bytes of shared memory an SM "
                         f"(an SM has {SM_SHARED_BYTES})")
    threads = team * 32
    shares = 6 // team                             # K shares a warp
    slot_words = stages * team * CP_SLOT_WORDS
    red_size = 2 * 6 * 128 if team > 1 else 1      # [buffer][share][lane][c0..c3] fp32
    scratch_size = 6 * threads if SIMULATOR else 1
    wait_oldest = cp_async_waiter(stages - 1)

    def make_body(two_layers: bool):
        return _make_body8(two_layers, team, stages, shares, threads, wait_oldest)

    body1, body2 = make_body(False), make_body(True)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat x; w32: uint32 flat q2k_r [ceil(N/16) * NU * 672]; out: uint16 [T, N]
        sm = cuda.shared.array(slot_words, types.uint32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(slot_words, types.uint32)
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        body1(x32, x32, w32, out, out, T, K, 1, sm, red, scratch)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv_pair(x32a, x32b, w32, outa, outb, T, K):
        # both layers' items in one persistent pool; w32 holds layer a's q2k_r then layer b's
        sm = cuda.shared.array(slot_words, types.uint32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(slot_words, types.uint32)
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        body2(x32a, x32b, w32, outa, outb, T, K, 2, sm, red, scratch)

    return gemv, gemv_pair


def _make_body8(two_layers: bool, team: int, stages: int, shares: int, threads: int, wait_oldest):
    """gemv_q2k_v8's block body; two_layers: items of both layers (x and out picked per item)."""

    @device_function(**INLINE)
    def body(x32a, x32b, w32, outa, outb, T, K, nlayers, sm, red, scratch):
        # x32a/b: uint32 flat x of layer a / b; w32: uint32 flat q2k_r of the layers, one after the
        # other; outa/b: uint16 [T, N]; nlayers: 1 (a only) or 2
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = 0 if team == 1 else tid >> 5        # 0 as a constant: warp-uniform to the compiler
        g = lane >> 2
        t = lane & 3
        N = outa.shape[1]
        KB = K // BLOCK_VALUES
        NU = (K + UNIT_VALUES - 1) // UNIT_VALUES
        NT = (N + TILE_ROWS - 1) // TILE_ROWS
        NG = (T + V4_TOKENS - 1) // V4_TOKENS
        per = (NU + 5) // 6
        per = (per + 1) // 2 * 2                   # v4's share: units a warp of its 6
        jpi = shares * per                         # unit jobs a warp an item
        u_first = warp * shares * per
        G = cuda.gridDim.x
        b = cuda.blockIdx.x
        layer16 = np.int64(NT) * NU * UNIT_CHUNKS
        xoff = 16 * (t >> 1) + 2 * (t & 1)
        slot0 = warp * stages
        zero = opaque_zero(T)
        bias = np.uint32(SEL_BIAS) + zero
        magic = np.uint32(NIB_MAGIC) + zero
        # item b = (layer, token group, tile), tile fastest; later items are stepped to, not divided out
        # (32-bit divisions: a 64-bit one is a call, and a kernel with a call keeps the global
        # memory descriptor in ordinary registers, two moves to uniform ones before every load)
        layer = udiv32(b, NT * NG)
        grp = udiv32(b - layer * NT * NG, NT)
        tile = b - (layer * NG + grp) * NT
        # the issue cursor runs `stages` jobs ahead of the decode: its item and unit
        ilayer, igrp, itile, ik = layer, grp, tile, 0
        ibase = ilayer * layer16 + (np.int64(itile) * NU + u_first) * UNIT_CHUNKS   # its unit's first chunk
        for islot in range(stages):                # the ring's first units (empty groups past the last item)
            _cp_job(sm, ((slot0 + islot) * 192 + lane) * 16, w32, ibase, lane, g,
                    ilayer < nlayers and u_first + ik < NU)
            ik += 1
            ibase += UNIT_CHUNKS
            if ik == jpi:
                ik = 0
                ilayer, igrp, itile = _next_item(ilayer, igrp, itile, G, NT, NG)
                ibase = ilayer * layer16 + (np.int64(itile) * NU + u_first) * UNIT_CHUNKS
        # the decoded item's x row: the lane's token (past T: the last one, dropped at the store)
        tok = grp * V4_TOKENS + g
        xrow = np.int64(min(tok, T - 1)) * (K >> 3) + xoff + 64 * u_first
        z = float32(0.0)
        c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
        f0 = f1 = f2 = f3 = z                       # team 1: the item's sum over shares so far
        k = 0                                      # the decoded unit's index in the warp's shares
        ku = 0                                     # ... in its share
        sh = 0                                     # ... the share's index among the warp's
        slot = 0
        rb = 0                                     # team > 1: the item's reduction buffer
        while layer < nlayers:                     # this warp's items b, b + G, ... one unit a trip
            wait_oldest()                          # this unit has landed (stages-1 younger in flight)
            u = u_first + k
            blk = u * UNIT_BLOCKS
            if (SIMULATOR or u < NU) and (not two_layers or layer == 0):
                c0, c1, c2, c3, e0, e1, e2, e3 = _unit8(c0, c1, c2, c3, e0, e1, e2, e3, sm,
                                                        (slot0 + slot) * 192 + lane, x32a, xrow + 64 * k,
                                                        KB, blk, tok < T and u < NU, bias, magic, scratch)
            elif (SIMULATOR or u < NU) and two_layers:
                # layer b: its own copy of the decode, so that x's loads stay global ones (a load
                # through a pointer picked from two is a generic one)
                c0, c1, c2, c3, e0, e1, e2, e3 = _unit8(c0, c1, c2, c3, e0, e1, e2, e3, sm,
                                                        (slot0 + slot) * 192 + lane, x32b, xrow + 64 * k,
                                                        KB, blk, tok < T and u < NU, bias, magic, scratch)
            # the slot is free: the unit `stages` jobs on
            _cp_job(sm, ((slot0 + slot) * 192 + lane) * 16, w32, ibase, lane, g,
                    ilayer < nlayers and u_first + ik < NU)
            ik += 1
            ibase += UNIT_CHUNKS
            if ik == jpi:
                ik = 0
                ilayer, igrp, itile = _next_item(ilayer, igrp, itile, G, NT, NG)
                ibase = ilayer * layer16 + (np.int64(itile) * NU + u_first) * UNIT_CHUNKS
            slot = 0 if slot == stages - 1 else slot + 1
            k += 1
            ku += 1
            if ku == per:                          # the end of a share: v4's fragment of its warp
                if team == 1:
                    f0 += c0 + e0
                    f1 += c1 + e1
                    f2 += c2 + e2
                    f3 += c3 + e3
                else:
                    base = rb + (warp * shares + sh) * 128 + lane * 4
                    red[base] = c0 + e0
                    red[base + 1] = c1 + e1
                    red[base + 2] = c2 + e2
                    red[base + 3] = c3 + e3
                c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
                ku = 0
                sh += 1
                if k == jpi:                       # the end of the item: its 6 shares in order
                    out = outa if layer == 0 else outb
                    if team == 1:
                        row = tile * TILE_ROWS + g
                        tk = grp * V4_TOKENS + 2 * t
                        if row < N and tk < T:
                            out[tk, row] = f32_to_bf16_bits(f0)
                        if row < N and tk + 1 < T:
                            out[tk + 1, row] = f32_to_bf16_bits(f1)
                        if row + 8 < N and tk < T:
                            out[tk, row + 8] = f32_to_bf16_bits(f2)
                        if row + 8 < N and tk + 1 < T:
                            out[tk + 1, row + 8] = f32_to_bf16_bits(f3)
                        f0 = f1 = f2 = f3 = z
                    else:
                        cuda.syncthreads()         # every share's fragment is in red[buffer]
                        for el4 in range(tid, 128, threads):
                            s_ = float32(0.0)
                            for s in range(6):
                                s_ += red[rb + s * 128 + el4]
                            el = el4 >> 2
                            c = el4 & 3
                            row = tile * TILE_ROWS + (el >> 2) + 8 * (c >> 1)
                            tk = grp * V4_TOKENS + 2 * (el & 3) + (c & 1)
                            if row < N and tk < T:
                                out[tk, row] = f32_to_bf16_bits(s_)
                        rb = 768 - rb              # the next item's buffer: no second barrier
                    k = 0
                    sh = 0
                    layer, grp, tile = _next_item(layer, grp, tile, G, NT, NG)
                    tok = grp * V4_TOKENS + g
                    xrow = np.int64(min(tok, T - 1)) * (K >> 3) + xoff + 64 * u_first

    return body


# ---- gemv_q2k_v9: small blocks, one item each, a static cp.async ring, v7's decode -------------------
# v8 is issue-bound at 11.6 warps an SM (123 registers) and spends ~70 instructions a unit on its
# persistent ring's bookkeeping. v9 keeps v4's K shares and summation order (so its kv is v4's, bit
# for bit) and v8's decode from shared memory, but gives each block one item (tile, token group,
# layer) and a team of V9_TEAM warps that split its 6 shares (3 each: 6 units at K = 6144), so that
# at T <= 8 the 1,600 items are 3,200 warps, ~24 an SM, in one round:
#   - a warp's units are a fixed list (its shares, in order): the ring has no cursor to carry across
#     items, only a slot index and a unit counter; unit k + stages is copied as soon as unit k is
#     decoded, `cp.async.wait_group stages-1` waits for the oldest;
#   - the launch bounds cap registers for V9_BLOCKS_PER_SM blocks an SM (72 a thread at 2 warps x 14);
#   - warp 0 sums its shares' fragments in registers from 0.0 in share order, the other warps store
#     theirs in shared memory, and after one barrier warp 0 adds them in share order: v4's sum;
#   - the table's y3 = 3*s - o is one fma (3*s is exact, as 2*s is for y2), one multiply fewer a
#     table than v7's; the loop's counters are 32-bit values (a 64-bit step is two instructions).
# Jobs past the warp's units or past K are empty commit groups on the GPU and skipped
# warp-uniformly. The simulator's mma twin needs every thread of the block at every mma: there the
# warps run the jobs below the first warp's count together, zero-filled where not their own, and
# skip the rest together (so a small K simulates only the units that exist).

V9_TEAM = 2                  # warps a block: 3 of v4's 6 K shares each
V9_STAGES = 2                # unit slots a warp: 1 unit in flight while it decodes one
V9_BLOCKS_PER_SM = 14        # the register bound: 72 a thread; 12 KB of slots a block


@device_function(**INLINE)
def lut_pairs9(sc_lo, sc_hi, d, dmin):
    """lut_pairs with y3 = fma(3, scale, -offset): scale = d * sc_lo is exact (11 x 4 bits), so is
    3 * scale, and one rounding of 3*scale - offset is sub_rn(mul_rn(scale, 3), offset)."""
    scale = mul_rn(d, sc_lo)
    offset = mul_rn(dmin, sc_hi)
    neg = -offset
    y0 = fma_rn(np.float32(0.0), scale, neg)
    y1 = sub_rn(scale, offset)
    y2 = fma_rn(np.float32(2.0), scale, neg)
    y3 = fma_rn(np.float32(3.0), scale, neg)
    return cvt_pack_bf16x2(y0, y1), cvt_pack_bf16x2(y2, y3)


@device_function(**INLINE)
def _sub9(c0, c1, c2, c3, la, ha, lb, hb, j, da, dmina, db, dminb, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3,
          x32, xv, ok_x, bias, magic, scratch):
    """_sub7 on lut_pairs9's tables."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x16(x32, xv, ok_x)
    pa01, pa23 = lut_pairs9(nibble_f32(la, j, magic), nibble_f32(ha, j, magic), da, dmina)
    pb01, pb23 = lut_pairs9(nibble_f32(lb, j, magic), nibble_f32(hb, j, magic), db, dminb)
    return _mma_sub7(c0, c1, c2, c3, pa01, pa23, pb01, pb23, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 2 * j,
                     x0, x1, x2, x3, x4, x5, x6, x7, bias, scratch)


@device_function(**INLINE)
def _block9(c0, c1, c2, c3, e0, e1, e2, e3, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, sa, sb, dda, ddb,
            x32, xv, ok_x, bias, magic, scratch):
    """_block7 on lut_pairs9's tables: sub-blocks 0, 2 into (c), 1, 3 into (e)."""
    da, dmina = f16x2_to_f32x2(dda)
    db, dminb = f16x2_to_f32x2(ddb)
    m = np.uint32(0x0F0F0F0F)
    la, ha = sa & m, (sa >> np.uint32(4)) & m
    lb, hb = sb & m, (sb >> np.uint32(4)) & m
    c0, c1, c2, c3 = _sub9(c0, c1, c2, c3, la, ha, lb, hb, 0, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv, ok_x, bias, magic, scratch)
    e0, e1, e2, e3 = _sub9(e0, e1, e2, e3, la, ha, lb, hb, 1, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv + 4, ok_x, bias, magic, scratch)
    c0, c1, c2, c3 = _sub9(c0, c1, c2, c3, la, ha, lb, hb, 2, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv + 8, ok_x, bias, magic, scratch)
    e0, e1, e2, e3 = _sub9(e0, e1, e2, e3, la, ha, lb, hb, 3, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                           qb0, qb1, qb2, qb3, x32, xv + 12, ok_x, bias, magic, scratch)
    return c0, c1, c2, c3, e0, e1, e2, e3


@device_function(**INLINE)
def _unit9(c0, c1, c2, c3, e0, e1, e2, e3, sm, q, x32, xv, ok_x, second, bias, magic, scratch):
    """_unit8 with _block9: the unit in a shared-memory slot, one block's words at a time; its
    second block only when `second` (not the zero pad block past K) on the GPU."""
    s0, s1, _, _ = load_u32x4(sm, q + 128)
    d0, d1, _, _ = load_u32x4(sm, q + 160)
    a0, a1, a2, a3 = load_u32x4(sm, q)
    b0, b1, b2, b3 = load_u32x4(sm, q + 32)
    c0, c1, c2, c3, e0, e1, e2, e3 = _block9(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                             s0, s1, d0, d1, x32, xv, ok_x, bias, magic, scratch)
    if SIMULATOR or second:
        _, _, s2, s3 = load_u32x4(sm, q + 128)
        _, _, d2, d3 = load_u32x4(sm, q + 160)
        a0, a1, a2, a3 = load_u32x4(sm, q + 64)
        b0, b1, b2, b3 = load_u32x4(sm, q + 96)
        c0, c1, c2, c3, e0, e1, e2, e3 = _block9(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                                 s2, s3, d2, d3, x32, xv + 32, ok_x and second, bias, magic,
                                                 scratch)
    return c0, c1, c2, c3, e0, e1, e2, e3


def v9_shared_bytes(team: int, stages: int) -> int:
    """Shared memory of one gemv_q2k_v9 block: the warps' unit slots and the other warps' share
    fragments."""
    return stages * team * CP_SLOT_WORDS * 4 + 6 * 128 * 4


def _make_gemv9(team: int, stages: int, blocks_per_sm: int):
    """gemv_q2k_v9 and its two-layer launch (the section's comment): blocks of `team` warps (1, 2, 3
    or 6) on one item, `stages` unit slots a warp, launch bounds for `blocks_per_sm` blocks an SM."""
    if 6 % team or stages < 2:
        raise ValueError(f"gemv_q2k_v9 needs a team of 1, 2, 3 or 6 warps and >= 2 stages, got {team}, {stages}")
    if blocks_per_sm * (v9_shared_bytes(team, stages) + 1024) > SM_SHARED_BYTES:
        raise ValueError(f"{blocks_per_sm} gemv_q2k_v9 blocks of {team} warps x {stages} slots need "
                         f"{blocks_per_sm * (v9_shared_bytes(team, stages) + 1024)} bytes of shared memory an SM "
                         f"(an SM has {SM_SHARED_BYTES})")
    threads = team * 32
    shares = 6 // team
    slot_words = stages * team * CP_SLOT_WORDS
    red_size = 6 * 128                             # [share][lane][c0..c3] fp32
    scratch_size = 6 * threads if SIMULATOR else 1
    wait_oldest = cp_async_waiter(stages - 1)

    @device_function(**INLINE)
    def body(x32, w32, w16, out, T, K, sm, red, scratch):
        """The block's item: tile blockIdx.x, token group blockIdx.y of the weight whose units start
        at 16-byte chunk w16 of w32."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = 0 if team == 1 else tid >> 5
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        KB = K // BLOCK_VALUES
        NU = (K + UNIT_VALUES - 1) // UNIT_VALUES
        tile = cuda.blockIdx.x
        grp = cuda.blockIdx.y
        per = (NU + 5) // 6
        per = (per + 1) // 2 * 2                   # v4's share: units a warp of its 6
        jobs = shares * per                        # this warp's units: shares warp*shares .. in order
        u_first = warp * jobs
        live = max(min(jobs, NU - u_first), 0)     # its units inside the weight (the rest: skipped)
        wnext = w16 + (np.int64(tile) * NU + u_first) * UNIT_CHUNKS    # the next unit to copy
        qs = warp * (stages * 192) + lane          # the lane's 16-byte index of slot 0's chunk 0
        zero = opaque_zero(T)
        bias = np.uint32(SEL_BIAS) + zero
        magic = np.uint32(NIB_MAGIC) + zero
        for s in range(stages):                    # the ring's first units
            _cp_job(sm, (qs + s * 192) * 16, w32, wnext, lane, g, s < live)
            wnext += UNIT_CHUNKS
        tok = grp * V4_TOKENS + g
        xk = np.int64(min(tok, T - 1)) * (K >> 3) + 16 * (t >> 1) + 2 * (t & 1) + 64 * u_first
        # the loop's counters as 32-bit values (numba's ints are 64-bit: two instructions a step)
        pad = np.int32(NU - 1 - u_first if KB & 1 else -1)   # the warp's unit whose second block is the pad
        live = np.int32(live)
        jobs = np.int32(jobs)
        per = np.int32(per)
        nu = np.int32(NU)
        qs = np.int32(qs)
        qlast = np.int32(qs + (stages - 1) * 192)
        z = float32(0.0)
        c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
        ku = np.int32(0)
        sh = warp * shares                         # the share being summed (v4's index)
        q = qs
        k = np.int32(0)
        while k < jobs:
            wait_oldest()                          # unit k has landed (stages-1 younger in flight)
            if k < live or (SIMULATOR and k < nu):  # the simulator: block-uniform (its mma twin syncs)
                c0, c1, c2, c3, e0, e1, e2, e3 = _unit9(c0, c1, c2, c3, e0, e1, e2, e3, sm, q, x32, xk,
                                                        tok < T and k < live, k != pad, bias, magic, scratch)
            # the slot is free: the unit `stages` on
            _cp_job(sm, q * 16, w32, wnext, lane, g, np.int32(k + stages) < live)
            wnext += UNIT_CHUNKS
            xk += 64
            q = qs if q == qlast else np.int32(q + 192)
            k = np.int32(k + 1)
            ku = np.int32(ku + 1)
            if ku == per:                          # the end of a share: v4's fragment of its warp
                base = sh * 128 + lane * 4
                red[base] = c0 + e0
                red[base + 1] = c1 + e1
                red[base + 2] = c2 + e2
                red[base + 3] = c3 + e3
                c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
                ku = np.int32(0)
                sh += 1
        if team > 1:
            cuda.syncthreads()                     # every share's fragment is in red
        if warp == 0:
            f0 = f1 = f2 = f3 = z
            for s in range(6):                     # v4's sum: from 0.0, shares in order
                f0 += red[s * 128 + lane * 4]
                f1 += red[s * 128 + lane * 4 + 1]
                f2 += red[s * 128 + lane * 4 + 2]
                f3 += red[s * 128 + lane * 4 + 3]
            row = tile * TILE_ROWS + g
            tk = grp * V4_TOKENS + 2 * t
            if row < N and tk < T:
                out[tk, row] = f32_to_bf16_bits(f0)
            if row < N and tk + 1 < T:
                out[tk + 1, row] = f32_to_bf16_bits(f1)
            if row + 8 < N and tk < T:
                out[tk, row + 8] = f32_to_bf16_bits(f2)
            if row + 8 < N and tk + 1 < T:
                out[tk + 1, row + 8] = f32_to_bf16_bits(f3)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat x; w32: uint32 flat q2k_r [ceil(N/16) * NU * 672]; out: uint16 [T, N]
        sm = cuda.shared.array(slot_words, types.uint32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(slot_words, types.uint32)
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        body(x32, w32, np.int64(0), out, T, K, sm, red, scratch)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv_pair(x32a, x32b, w32, outa, outb, T, K):
        # two layers in one launch (blockIdx.z): w32 holds layer a's q2k_r then layer b's, same shape
        sm = cuda.shared.array(slot_words, types.uint32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(slot_words, types.uint32)
        red = cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        if cuda.blockIdx.z == 0:
            body(x32a, w32, np.int64(0), outa, T, K, sm, red, scratch)
        else:
            layer16 = np.int64((outb.shape[1] + TILE_ROWS - 1) // TILE_ROWS) * \
                ((K + UNIT_VALUES - 1) // UNIT_VALUES) * UNIT_CHUNKS
            body(x32b, w32, layer16, outb, T, K, sm, red, scratch)

    return gemv, gemv_pair


# ---- gemv_q2k_v10: v9 with the two mma chains interleaved mma by mma -------------------------------
# Nsight Compute on v9 at T = 1 (10.6 warp-cycles an issued instruction, 5.5 warps a scheduler): the
# stalls are spread over long scoreboard (2.0: x's global loads), wait (1.7: fixed-latency
# dependencies), dispatch (1.6) and math-pipe throttle (1.5); no single pipe or memory bound. v9's
# warp decodes a block as 4 sub-blocks, each 4 mma in one accumulator chain (c for j = 0, 2; e for
# 1, 3) fed by picks computed just before each mma: every instruction depends on the one before it
# and each mma on the last. v10 keeps v9's blocks, ring, shares and summation order (so its kv is
# v4's, bit for bit: each chain still adds the same mma in the same order) and changes the decode
# and the epilogue:
#   - sub-blocks j and j + 1 are decoded together (`pairj`): their four tables and both x rows are
#     built first, then the mma alternate c, e, c, e, ... so that two independent mma and two
#     independent pick chains are in flight at every step (the q words are the same for both: only
#     the shift of the codes differs);
#   - the share fragments go through shared memory as one 16-byte store / load a lane (v9: four
#     4-byte accesses at a 16-byte stride, a 4-way bank conflict each);
#   - the ring issues the copy of unit k + stages - 1 before decoding unit k, into the slot unit
#     k - 1 freed (`early`; v9 issues unit k + stages after the decode, into unit k's slot): as many
#     units in flight while a warp decodes, but the grid's start burst (every warp's first copies
#     at once, 17 MB for v9's 2 slots: ~4 us of DRAM before the last warp can start) is halved;
#   - each unit is copied as two commit groups (`split`): the first block's quant chunks with the
#     scale and d/dmin chunks, then the second block's, so a warp starts on its first 2 KB.
# All the waits stay per lane (each lane waits for the copies it issued and reads only those).
# The factory takes v9's (team, stages, blocks an SM) and the three switches, so that the H200 can
# time each change apart (tools/q2kr_v10_variants.py); ptxas keeps the freedom to reorder the
# independent mma: at 72 registers it still runs most of a chain's 4 mma back to back.

V10_SHAPE = (2, 2, 14, True, True, True)        # (warps a block, unit slots a warp, blocks an SM, pairj, early, split)
V10_PAIR_SHAPE = (2, 3, 10, True, True, True)   # the two-layer launch: v9's pair shape (3 slots, 10 blocks an SM)


@device_function(**INLINE)
def _pair10(c0, c1, c2, c3, e0, e1, e2, e3, la, ha, lb, hb, j, da, dmina, db, dminb,
            qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, x32, xv, ok_x, bias, magic, scratch):
    """Sub-blocks j (into c) and j + 1 (into e) of the lane's quarter of one block, rows g and g+8,
    their mma alternating: each chain gets v9's mma in v9's order."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x16(x32, xv, ok_x)
    y0, y1, y2, y3, y4, y5, y6, y7 = _x16(x32, xv + 4, ok_x)
    ca01, ca23 = lut_pairs9(nibble_f32(la, j, magic), nibble_f32(ha, j, magic), da, dmina)
    cb01, cb23 = lut_pairs9(nibble_f32(lb, j, magic), nibble_f32(hb, j, magic), db, dminb)
    ea01, ea23 = lut_pairs9(nibble_f32(la, j + 1, magic), nibble_f32(ha, j + 1, magic), da, dmina)
    eb01, eb23 = lut_pairs9(nibble_f32(lb, j + 1, magic), nibble_f32(hb, j + 1, magic), db, dminb)
    sc = 2 * j
    se = 2 * j + 2
    a0, a1 = pick4p(ca01, ca23, qa0, sc, bias)
    b0, b1 = pick4p(cb01, cb23, qb0, sc, bias)
    c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x0, x1, c0, c1, c2, c3, scratch)
    a0, a1 = pick4p(ea01, ea23, qa0, se, bias)
    b0, b1 = pick4p(eb01, eb23, qb0, se, bias)
    e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y0, y1, e0, e1, e2, e3, scratch)
    a0, a1 = pick4p(ca01, ca23, qa1, sc, bias)
    b0, b1 = pick4p(cb01, cb23, qb1, sc, bias)
    c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x2, x3, c0, c1, c2, c3, scratch)
    a0, a1 = pick4p(ea01, ea23, qa1, se, bias)
    b0, b1 = pick4p(eb01, eb23, qb1, se, bias)
    e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y2, y3, e0, e1, e2, e3, scratch)
    a0, a1 = pick4p(ca01, ca23, qa2, sc, bias)
    b0, b1 = pick4p(cb01, cb23, qb2, sc, bias)
    c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x4, x5, c0, c1, c2, c3, scratch)
    a0, a1 = pick4p(ea01, ea23, qa2, se, bias)
    b0, b1 = pick4p(eb01, eb23, qb2, se, bias)
    e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y4, y5, e0, e1, e2, e3, scratch)
    a0, a1 = pick4p(ca01, ca23, qa3, sc, bias)
    b0, b1 = pick4p(cb01, cb23, qb3, sc, bias)
    c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x6, x7, c0, c1, c2, c3, scratch)
    a0, a1 = pick4p(ea01, ea23, qa3, se, bias)
    b0, b1 = pick4p(eb01, eb23, qb3, se, bias)
    e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y6, y7, e0, e1, e2, e3, scratch)
    return c0, c1, c2, c3, e0, e1, e2, e3


@device_function(**INLINE)
def _block10(c0, c1, c2, c3, e0, e1, e2, e3, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, sa, sb, dda, ddb,
             x32, xv, ok_x, bias, magic, scratch):
    """_block9 with sub-blocks (0, 1) and then (2, 3) decoded as pairs (`_pair10`)."""
    da, dmina = f16x2_to_f32x2(dda)
    db, dminb = f16x2_to_f32x2(ddb)
    m = np.uint32(0x0F0F0F0F)
    la, ha = sa & m, (sa >> np.uint32(4)) & m
    lb, hb = sb & m, (sb >> np.uint32(4)) & m
    c0, c1, c2, c3, e0, e1, e2, e3 = _pair10(c0, c1, c2, c3, e0, e1, e2, e3, la, ha, lb, hb, 0, da, dmina, db,
                                             dminb, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, x32, xv, ok_x, bias,
                                             magic, scratch)
    return _pair10(c0, c1, c2, c3, e0, e1, e2, e3, la, ha, lb, hb, 2, da, dmina, db, dminb,
                   qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, x32, xv + 8, ok_x, bias, magic, scratch)


@device_function(**INLINE)
def _cp_job_split(sm, off, w32, base16, lane, g, ok):
    """`_cp_job` as two commit groups: the first block's quant chunks with the scale and d/dmin
    chunks, then the second block's quant chunks (so the first block can be decoded before the
    second has landed)."""
    if SIMULATOR:
        n = 16 if ok else 0
        src = base16 if ok else np.int64(0)
        cp_async_16(sm, off, w32, src + lane, n)
        cp_async_16(sm, off + 512, w32, src + 32 + lane, n)
        cp_async_16(sm, off + 2048, w32, src + SC_CHUNK + lane, n)
        cp_async_16(sm, off + 2560, w32, src + DD_CHUNK + g, n)
        cp_async_commit()
        cp_async_16(sm, off + 1024, w32, src + 64 + lane, n)
        cp_async_16(sm, off + 1536, w32, src + 96 + lane, n)
    else:
        if ok:
            cp_async_16(sm, off, w32, base16 + lane, 16)
            cp_async_16(sm, off + 512, w32, base16 + 32 + lane, 16)
            cp_async_16(sm, off + 2048, w32, base16 + SC_CHUNK + lane, 16)
            cp_async_16(sm, off + 2560, w32, base16 + DD_CHUNK + g, 16)
        cp_async_commit()
        if ok:
            cp_async_16(sm, off + 1024, w32, base16 + 64 + lane, 16)
            cp_async_16(sm, off + 1536, w32, base16 + 96 + lane, 16)
    cp_async_commit()


@device_function(**INLINE)
def _dd_once(sm, off, w32, base16, lane, ok):
    """The unit's d/dmin plane (8 chunks) copied once: lane L < 8 copies chunk L to its own slot's
    d/dmin position (off + 2560), where lanes with g = L read it (after a warp barrier)."""
    if SIMULATOR:
        live = ok and lane < 8
        cp_async_16(sm, off + 2560, w32, (base16 + DD_CHUNK + lane) if live else np.int64(0), 16 if live else 0)
    elif ok and lane < 8:
        cp_async_16(sm, off + 2560, w32, base16 + DD_CHUNK + lane, 16)


@device_function(**INLINE)
def _cp_job_dd(sm, off, w32, base16, lane, g, ok):
    """`_cp_job` with the d/dmin plane copied once (`_dd_once`)."""
    if SIMULATOR:
        n = 16 if ok else 0
        src = base16 if ok else np.int64(0)
        cp_async_16(sm, off, w32, src + lane, n)
        cp_async_16(sm, off + 512, w32, src + 32 + lane, n)
        cp_async_16(sm, off + 1024, w32, src + 64 + lane, n)
        cp_async_16(sm, off + 1536, w32, src + 96 + lane, n)
        cp_async_16(sm, off + 2048, w32, src + SC_CHUNK + lane, n)
    elif ok:
        cp_async_16(sm, off, w32, base16 + lane, 16)
        cp_async_16(sm, off + 512, w32, base16 + 32 + lane, 16)
        cp_async_16(sm, off + 1024, w32, base16 + 64 + lane, 16)
        cp_async_16(sm, off + 1536, w32, base16 + 96 + lane, 16)
        cp_async_16(sm, off + 2048, w32, base16 + SC_CHUNK + lane, 16)
    _dd_once(sm, off, w32, base16, lane, ok)
    cp_async_commit()


@device_function(**INLINE)
def _cp_job_split_dd(sm, off, w32, base16, lane, g, ok):
    """`_cp_job_split` with the d/dmin plane copied once (`_dd_once`), in the first group."""
    if SIMULATOR:
        n = 16 if ok else 0
        src = base16 if ok else np.int64(0)
        cp_async_16(sm, off, w32, src + lane, n)
        cp_async_16(sm, off + 512, w32, src + 32 + lane, n)
        cp_async_16(sm, off + 2048, w32, src + SC_CHUNK + lane, n)
        _dd_once(sm, off, w32, base16, lane, ok)
        cp_async_commit()
        cp_async_16(sm, off + 1024, w32, src + 64 + lane, n)
        cp_async_16(sm, off + 1536, w32, src + 96 + lane, n)
    else:
        if ok:
            cp_async_16(sm, off, w32, base16 + lane, 16)
            cp_async_16(sm, off + 512, w32, base16 + 32 + lane, 16)
            cp_async_16(sm, off + 2048, w32, base16 + SC_CHUNK + lane, 16)
        _dd_once(sm, off, w32, base16, lane, ok)
        cp_async_commit()
        if ok:
            cp_async_16(sm, off + 1024, w32, base16 + 64 + lane, 16)
            cp_async_16(sm, off + 1536, w32, base16 + 96 + lane, 16)
    cp_async_commit()


def _make_unit10(pairj: bool, mid_wait=None, block=None):
    """_unit9 with `_block10` (pairj) or v9's `_block9` (or `block`: v11's); `mid_wait` (split
    copies): the wait for the second block's group, before its words are read."""
    if block is None:
        block = _block10 if pairj else _block9
    split = mid_wait is not None
    if not split:
        mid_wait = cp_async_waiter(0)      # never called (numba needs a function to close over)

    @device_function(**INLINE)
    def unit(c0, c1, c2, c3, e0, e1, e2, e3, sm, q, qd, x32, xv, ok_x, second, bias, magic, scratch):
        # qd: the 16-byte index of the lane's d/dmin chunk (q + 160, or its g's copy: dd_once)
        s0, s1, _, _ = load_u32x4(sm, q + 128)
        d0, d1, _, _ = load_u32x4(sm, qd)
        a0, a1, a2, a3 = load_u32x4(sm, q)
        b0, b1, b2, b3 = load_u32x4(sm, q + 32)
        c0, c1, c2, c3, e0, e1, e2, e3 = block(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                               s0, s1, d0, d1, x32, xv, ok_x, bias, magic, scratch)
        if split:
            mid_wait()
        if SIMULATOR or second:
            _, _, s2, s3 = load_u32x4(sm, q + 128)
            _, _, d2, d3 = load_u32x4(sm, qd)
            a0, a1, a2, a3 = load_u32x4(sm, q + 64)
            b0, b1, b2, b3 = load_u32x4(sm, q + 96)
            c0, c1, c2, c3, e0, e1, e2, e3 = block(c0, c1, c2, c3, e0, e1, e2, e3, a0, a1, a2, a3, b0, b1, b2, b3,
                                                   s2, s3, d2, d3, x32, xv + 32, ok_x and second, bias, magic,
                                                   scratch)
        return c0, c1, c2, c3, e0, e1, e2, e3

    return unit


v10_shared_bytes = v9_shared_bytes     # the same slots and share fragments


def _make_gemv10(team: int, stages: int, blocks_per_sm: int, pairj: bool = True, early: bool = False,
                 split: bool = False, v11: bool = False, dd_once: bool = False, v12: bool = False,
                 zfill: bool = False):
    """gemv_q2k_v10 and its two-layer launch (the section's comment): v9's blocks of `team` warps (1,
    2, 3 or 6) on one item, `stages` unit slots a warp, launch bounds for `blocks_per_sm` blocks an
    SM; `pairj`: sub-blocks decoded in pairs, their mma alternating between the two chains; `early`:
    the copy of unit k + stages - 1 is issued before unit k is decoded (into the slot unit k - 1
    freed), not after: as many units in flight during a decode as v9's ring with one slot more,
    and a start burst of stages - 1 units a warp instead of stages; `split` (with early): each unit
    copied as two commit groups (`_cp_job_split`), its first block decoded once the first has
    landed: a warp's first wait is for 2 KB, not 2.6. `v11`: gemv_q2k_v11's decode (`_block11`;
    its section's comment) in the same blocks and ring. `dd_once` (with early): a unit's d/dmin plane
    (8 chunks, one a g) is copied once, by lanes 0..7, and each lane reads its g's copy after a warp
    barrier (`_cp_job_dd`), instead of every lane copying its g's chunk into its own slot. `v12`:
    gemv_q2k_v12's tables (`_block12`); `zfill` (with dd_once): the copies without a branch, zero
    fills where there is nothing to copy (`_cp_job_zf`; gemv_q2k_v12's section)."""
    if zfill and not dd_once:
        raise ValueError("gemv_q2k_v12's branch-free copies (zfill) copy the d/dmin plane once (dd_once=True)")
    if split and not early:
        raise ValueError("gemv_q2k_v10's split copies need the early ring (early=True)")
    if dd_once and not early:
        raise ValueError("gemv_q2k_v10's shared d/dmin copy (dd_once) needs the early ring (early=True)")
    if 6 % team or stages < 2:
        raise ValueError(f"gemv_q2k_v10 needs a team of 1, 2, 3 or 6 warps and >= 2 stages, got {team}, {stages}")
    if blocks_per_sm * (v9_shared_bytes(team, stages) + 1024) > SM_SHARED_BYTES:
        raise ValueError(f"{blocks_per_sm} gemv_q2k_v10 blocks of {team} warps x {stages} slots need "
                         f"{blocks_per_sm * (v9_shared_bytes(team, stages) + 1024)} bytes of shared memory an SM "
                         f"(an SM has {SM_SHARED_BYTES})")
    threads = team * 32
    shares = 6 // team
    slot_words = stages * team * CP_SLOT_WORDS
    red_size = 6 * 128                             # [share][lane][c0..c3] fp32: one 16-byte slot a lane
    scratch_size = 6 * threads if SIMULATOR else 1
    decode = _block12 if v12 else (_block11 if v11 else None)
    if split:                                      # two groups a unit: units k .. k+stages-2 pending at the top
        wait_oldest = cp_async_waiter(2 * stages - 3)            # the first group of unit k has landed
        unit10 = _make_unit10(pairj, cp_async_waiter(2 * stages - 2),   # ... its second (k + stages - 1 issued)
                              decode)
        job = _cp_job_split_zf if zfill else (_cp_job_split_dd if dd_once else _cp_job_split)
    else:
        wait_oldest = cp_async_waiter(stages - 2 if early else stages - 1)
        unit10 = _make_unit10(pairj, None, decode)
        job = _cp_job_zf if zfill else (_cp_job_dd if dd_once else _cp_job)
    ahead = stages - 1 if early else stages        # units copied before the first decode

    @device_function(**INLINE)
    def body(x32, w32, w16, out, T, K, sm, red, scratch):
        """v9's body (its comments there) with unit10 and 16-byte fragment stores."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = 0 if team == 1 else tid >> 5
        g = lane >> 2
        t = lane & 3
        N = out.shape[1]
        KB = K // BLOCK_VALUES
        NU = (K + UNIT_VALUES - 1) // UNIT_VALUES
        tile = cuda.blockIdx.x
        grp = cuda.blockIdx.y
        per = (NU + 5) // 6
        per = (per + 1) // 2 * 2                   # v4's share: units a warp of its 6
        jobs = shares * per
        u_first = warp * jobs
        live = max(min(jobs, NU - u_first), 0)
        wnext = w16 + (np.int64(tile) * NU + u_first) * UNIT_CHUNKS
        qs = warp * (stages * 192) + lane
        zero = opaque_zero(T)
        bias = np.uint32(SEL_BIAS) + zero
        magic = np.uint32(NIB_MAGIC) + zero
        for s in range(ahead):
            job(sm, (qs + s * 192) * 16, w32, wnext, lane, g, s < live)
            wnext += UNIT_CHUNKS
        tok = grp * V4_TOKENS + g
        xk = np.int64(min(tok, T - 1)) * (K >> 3) + 16 * (t >> 1) + 2 * (t & 1) + 64 * u_first
        pad = np.int32(NU - 1 - u_first if KB & 1 else -1)
        live = np.int32(live)
        jobs = np.int32(jobs)
        per = np.int32(per)
        nu = np.int32(NU)
        qs = np.int32(qs)
        qlast = np.int32(qs + (stages - 1) * 192)
        ddoff = np.int32(160 + g - lane if dd_once else 160)   # the lane's d/dmin chunk, from its slot's chunk 0
        z = float32(0.0)
        c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
        ku = np.int32(0)
        sh = warp * shares
        q = qs
        qfree = qlast                              # early: the slot unit k - 1 freed (none yet: the last)
        k = np.int32(0)
        while k < jobs:
            wait_oldest()                          # unit k has landed
            if dd_once:                            # ... lanes 0..7's d/dmin copies too, for every lane; and
                if SIMULATOR:                      # every lane is done with the slot the next copy overwrites
                    cuda.syncthreads()             # (the simulator has no syncwarp; its loop is block-uniform)
                else:
                    cuda.syncwarp()
            if early:                              # unit k + stages - 1 into the free slot, then decode k
                job(sm, qfree * 16, w32, wnext, lane, g, np.int32(k + stages - 1) < live)
                wnext += UNIT_CHUNKS
            if k < live or (SIMULATOR and k < nu):
                c0, c1, c2, c3, e0, e1, e2, e3 = unit10(c0, c1, c2, c3, e0, e1, e2, e3, sm, q,
                                                        q + ddoff, x32, xk,
                                                        tok < T and k < live, k != pad, bias, magic, scratch)
            if not early:                          # v9: unit k + stages into the slot just decoded
                _cp_job(sm, q * 16, w32, wnext, lane, g, np.int32(k + stages) < live)
                wnext += UNIT_CHUNKS
            xk += 64
            qfree = q
            q = qs if q == qlast else np.int32(q + 192)
            k = np.int32(k + 1)
            ku = np.int32(ku + 1)
            if ku == per:                          # the end of a share: v4's fragment of its warp
                store_f32x4(red, sh * 32 + lane, c0 + e0, c1 + e1, c2 + e2, c3 + e3)
                c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = z
                ku = np.int32(0)
                sh += 1
        if team > 1:
            cuda.syncthreads()
        if warp == 0:
            f0 = f1 = f2 = f3 = z
            for s in range(6):                     # v4's sum: from 0.0, shares in order
                r0, r1, r2, r3 = load_f32x4(red, s * 32 + lane)
                f0 += r0
                f1 += r1
                f2 += r2
                f3 += r3
            row = tile * TILE_ROWS + g
            tk = grp * V4_TOKENS + 2 * t
            if row < N and tk < T:
                out[tk, row] = f32_to_bf16_bits(f0)
            if row < N and tk + 1 < T:
                out[tk + 1, row] = f32_to_bf16_bits(f1)
            if row + 8 < N and tk < T:
                out[tk, row + 8] = f32_to_bf16_bits(f2)
            if row + 8 < N and tk + 1 < T:
                out[tk + 1, row + 8] = f32_to_bf16_bits(f3)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat x; w32: uint32 flat q2k_r [ceil(N/16) * NU * 672]; out: uint16 [T, N]
        sm = cuda.shared.array(slot_words, types.uint32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(slot_words, types.uint32)
        red = cuda.shared.array(red_size, float32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        body(x32, w32, np.int64(0), out, T, K, sm, red, scratch)

    @cuda.jit(**bounds(threads, blocks_per_sm))
    def gemv_pair(x32a, x32b, w32, outa, outb, T, K):
        # two layers in one launch (blockIdx.z): w32 holds layer a's q2k_r then layer b's, same shape
        sm = cuda.shared.array(slot_words, types.uint32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(slot_words, types.uint32)
        red = cuda.shared.array(red_size, float32, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(red_size, float32)
        scratch = cuda.shared.array(scratch_size, types.uint32)
        if cuda.blockIdx.z == 0:
            body(x32a, w32, np.int64(0), outa, T, K, sm, red, scratch)
        else:
            layer16 = np.int64((outb.shape[1] + TILE_ROWS - 1) // TILE_ROWS) * \
                ((K + UNIT_VALUES - 1) // UNIT_VALUES) * UNIT_CHUNKS
            body(x32b, w32, layer16, outb, T, K, sm, red, scratch)

    return gemv, gemv_pair


# ---- gemv_q2k_v11: v10 with fewer instructions a weight ---------------------------------------------
# v9 / v10 execute 764 SASS instructions a unit (24 a mma): per 4 weights of a quant word and sub-block
# j, a shift (mul.hi, j > 0), a LOP3 (mask | bias), an IMAD and an IMAD.HI (the two prmt selectors)
# and the two prmt; per table (a row's sub-block) two nibble floats (prmt + FADD each), two FMUL,
# four fma/add and two cvt. v11 keeps v10's blocks, ring, shares, values and summation order (its kv
# is v4's, bit for bit) and builds the same selectors and tables with fewer instructions:
#   - selectors: the codes of sub-block j masked to bits 0, 8, 16, 24 (no bias) and one
#     `mad.wide.u32` by 0x00220022 plus 0x1010 in each half: its low word holds the selector of
#     values 0, 1 (2q, 2q + 1 in nibbles 0..3) and its high word that of values 2, 3 (the cross
#     products land in bits 16..31 of each word, which prmt ignores, and stay under 2^32: no carry
#     into the high word). j = 3 needs no shift: the codes at bits 6, 14, 22, 30 are masked in place
#     and each selector is one `mad.hi.u32` (by 0x88000000 and 0x8800, + 0x1010). Per quant word and
#     its 4 sub-blocks: 11 selector instructions against 15 (`pick4w`);
#   - tables: a nibble's float is 2^23 + n (one prmt under 2^23's exponent, as v7's) and the fma
#     d * (2^23 + sc) - d * 2^23 (the second term one multiply a block row) is d*sc exactly (an
#     11-bit by 4-bit product), so the FADD that took 2^23 away goes; -dmin*m likewise: 10
#     instructions a table against 12 (`lut_pairs11`). Only the sign of a zero table entry can
#     differ from v10's (+0 where v10 had -0), and a zero weight adds a zero product to an fp32
#     sum that starts at +0: the kv bits are the same;
#   - the d/dmin plane (128 bytes a unit, one 16-byte chunk a g) is copied once, by lanes 0..7 into
#     their own slots' d/dmin position (`_cp_job_dd`), and each lane reads its g's copy after a
#     `syncwarp` that follows its wait (v10: each lane copies its g's chunk, 4 copies of each, and
#     Nsight Compute counts that cp.async at 32 shared wavefronts where 4 would do: 55-65% of the
#     kernel's excess wavefronts). The same barrier orders the next copy into a slot after every
#     lane's reads of it. Needs the early ring (the copy into the freed slot comes after the wait).
# Per unit (sm_90a SASS, tools/sass_count_q2kr.py): 746 instructions (v10: 764; 737 without the
# shared d/dmin copy: its barrier and the separate d/dmin reads cost 9). The selector path (15 of
# the 23 instructions of a quant word's 4 sub-blocks are selector arithmetic) stays v10's: its
# per-sub-block shift could go only for j = 3 (codes at bits 6, 14, 22, 30, each selector one
# mad.hi by 0x88000000 / 0x8800), and ptxas gives mad.hi's addend a 64-bit register pair (two MOVs
# each) while no bias OR-ed into the codes serves both multipliers (searched exhaustively); the
# one-instruction pair of selectors by mad.wide.u32 (by 0x00220022 plus 0x1010 in each half) is
# split by ptxas into IMAD.WIDE + IADD3 + IADD3.X. Neither is fewer instructions.


TWO23 = 8388608.0


@device_function(**INLINE)
def lut_pairs11(msc, mm, d, nd23, ndmin, dmin23):
    """lut_pairs9's pair words from the nibble floats msc = 2^23 + sc, mm = 2^23 + m (nd23 = -d*2^23,
    ndmin = -dmin, dmin23 = dmin*2^23): scale = d*sc and -offset = -dmin*m, each one exact fma."""
    scale = fma_rn(d, msc, nd23)
    neg = fma_rn(ndmin, mm, dmin23)
    y0 = fma_rn(np.float32(0.0), scale, neg)
    y1 = add_rn(scale, neg)
    y2 = fma_rn(np.float32(2.0), scale, neg)
    y3 = fma_rn(np.float32(3.0), scale, neg)
    return cvt_pack_bf16x2(y0, y1), cvt_pack_bf16x2(y2, y3)


@device_function(**INLINE)
def _nib_f(n4, j, magic):
    """Byte j of n4 (< 16) under 2^23's exponent: 2^23 + n as fp32 (one prmt)."""
    return u32_as_f32(prmt(n4, magic, np.uint32(0x7440 + j)))


V11_SHAPE = V10_SHAPE + (True, True)            # v10's blocks and ring, v11's decode, d/dmin copied once
V11_PAIR_SHAPE = V10_PAIR_SHAPE + (True, True)


# ---- gemv_q2k_v12: v11 with fewer instructions a unit -------------------------------------------------
# v11 keeps 746 SASS instructions a unit. v12 keeps its blocks, ring, shares, values and summation
# order (its kv is v4's, bit for bit) and removes two costs that are not the decode's arithmetic:
#   - y0: v11's table entry 0 is fma(0, scale, neg), and neg = fma(-dmin, 2^23 + m, dmin*2^23) is
#     never -0 (an exact zero sum is +0), so 0*scale + neg is neg itself in every case: the entry is
#     neg, one fma fewer a table (`lut_pairs12`, the same bits as lut_pairs11);
#   - the ring's copies carry no branch: a copy outside the warp's units (or, for the d/dmin plane,
#     by a lane past 7) is a zero-filling cp.async of a chunk inside the weight (src-size 0) into
#     the lane's own slot, where nothing reads it (`_cp_job_zf`, `_cp_job_split_zf`). v11's copies
#     sit in two or three predicated regions a unit, each with its branch, its reconvergence
#     barrier, its address arithmetic and the no-op loads ptxas pads a cp.async group with.
# What it does not change, and why (checked for this version): the prmt selectors stay v11's
# (per quant word and sub-block j: a LOP3 of the masked codes with a bias, one IMAD and one IMAD.HI,
# and for j > 0 a shift). A selector (16 bits, the codes of a bf16 pair each in two nibbles) needs
# a multiply to duplicate its codes; the low word of a multiply sees only the low bits of its operand,
# so a selector from IMAD's low word needs its first code at bit 0 or 1, and one from IMAD.HI needs
# both codes at bit 6 or above: in any dense packing of 16 codes a word, the codes at bits 2..5 need
# a shift whatever the layout. One IMAD.WIDE for both selectors of a word use (its low and high
# word) would need the selector constant 0x1010 of each half from bias bits OR-ed into the codes,
# and no such bias exists (exhaustive over the 2^24 free-bit patterns, for the pair-word, byte-swapped
# and split table layouts and codes at bits 0 or 1 of each byte); with the constant as a 64-bit
# addend ptxas emits IMAD.WIDE + IADD3 + IADD3.X. A LOP3-masked word serves two selectors only as
# v11's j = 0 does (IMAD's pair at bits 0, 8, IMAD.HI's at 16, 24) or as codes at 6, 14 and 22, 30
# (two IMAD.HI, and no common bias exists: exhaustive again); any other selector costs its own
# LOP3. Counting per quant word (8 selectors, 8 multiplies): 3 for the unshifted word's j = 0 use,
# then each further two-selector use needs a shifted copy (1 + 3) and each one-selector one a LOP3
# and a multiply (2): 15 with 0..3 shifts, v11's count. So no re-layout of the quant plane (a
# `q2k_r2`) lowers the selector cost in this instruction set; v12 keeps q2k_r.


@device_function(**INLINE)
def lut_pairs12(msc, mm, d, nd23, ndmin, dmin23):
    """lut_pairs11 with entry 0 = neg (neg is never -0, so fma(0, scale, neg) is neg): one fma fewer,
    the same bits."""
    scale = fma_rn(d, msc, nd23)
    neg = fma_rn(ndmin, mm, dmin23)
    y1 = add_rn(scale, neg)
    y2 = fma_rn(np.float32(2.0), scale, neg)
    y3 = fma_rn(np.float32(3.0), scale, neg)
    return cvt_pack_bf16x2(neg, y1), cvt_pack_bf16x2(y2, y3)


def _make_block11(lut):
    """v11's decode of a block (two sub-block pairs, each pair's four tables, picks and mma in v10's
    order) on the table builder `lut` (lut_pairs11's arguments and values): `_block11` and `_block12`."""

    @device_function(**INLINE)
    def pair(c0, c1, c2, c3, e0, e1, e2, e3, la, ha, lb, hb, j, da, nda, ndmina, dmina23, db, ndb, ndminb,
             dminb23, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, x32, xv, ok_x, bias, magic, scratch):
        x0, x1, x2, x3, x4, x5, x6, x7 = _x16(x32, xv, ok_x)
        y0, y1, y2, y3, y4, y5, y6, y7 = _x16(x32, xv + 4, ok_x)
        ca01, ca23 = lut(_nib_f(la, j, magic), _nib_f(ha, j, magic), da, nda, ndmina, dmina23)
        cb01, cb23 = lut(_nib_f(lb, j, magic), _nib_f(hb, j, magic), db, ndb, ndminb, dminb23)
        ea01, ea23 = lut(_nib_f(la, j + 1, magic), _nib_f(ha, j + 1, magic), da, nda, ndmina, dmina23)
        eb01, eb23 = lut(_nib_f(lb, j + 1, magic), _nib_f(hb, j + 1, magic), db, ndb, ndminb, dminb23)
        je = j + 1
        a0, a1 = pick4p(ca01, ca23, qa0, 2 * j, bias)
        b0, b1 = pick4p(cb01, cb23, qb0, 2 * j, bias)
        c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x0, x1, c0, c1, c2, c3, scratch)
        a0, a1 = pick4p(ea01, ea23, qa0, 2 * je, bias)
        b0, b1 = pick4p(eb01, eb23, qb0, 2 * je, bias)
        e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y0, y1, e0, e1, e2, e3, scratch)
        a0, a1 = pick4p(ca01, ca23, qa1, 2 * j, bias)
        b0, b1 = pick4p(cb01, cb23, qb1, 2 * j, bias)
        c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x2, x3, c0, c1, c2, c3, scratch)
        a0, a1 = pick4p(ea01, ea23, qa1, 2 * je, bias)
        b0, b1 = pick4p(eb01, eb23, qb1, 2 * je, bias)
        e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y2, y3, e0, e1, e2, e3, scratch)
        a0, a1 = pick4p(ca01, ca23, qa2, 2 * j, bias)
        b0, b1 = pick4p(cb01, cb23, qb2, 2 * j, bias)
        c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x4, x5, c0, c1, c2, c3, scratch)
        a0, a1 = pick4p(ea01, ea23, qa2, 2 * je, bias)
        b0, b1 = pick4p(eb01, eb23, qb2, 2 * je, bias)
        e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y4, y5, e0, e1, e2, e3, scratch)
        a0, a1 = pick4p(ca01, ca23, qa3, 2 * j, bias)
        b0, b1 = pick4p(cb01, cb23, qb3, 2 * j, bias)
        c0, c1, c2, c3 = mma_bf16_16816(a0, b0, a1, b1, x6, x7, c0, c1, c2, c3, scratch)
        a0, a1 = pick4p(ea01, ea23, qa3, 2 * je, bias)
        b0, b1 = pick4p(eb01, eb23, qb3, 2 * je, bias)
        e0, e1, e2, e3 = mma_bf16_16816(a0, b0, a1, b1, y6, y7, e0, e1, e2, e3, scratch)
        return c0, c1, c2, c3, e0, e1, e2, e3

    @device_function(**INLINE)
    def block(c0, c1, c2, c3, e0, e1, e2, e3, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, sa, sb, dda, ddb,
              x32, xv, ok_x, bias, magic, scratch):
        da, dmina = f16x2_to_f32x2(dda)
        db, dminb = f16x2_to_f32x2(ddb)
        nda = mul_rn(da, np.float32(-TWO23))
        ndb = mul_rn(db, np.float32(-TWO23))
        dmina23 = mul_rn(dmina, np.float32(TWO23))
        dminb23 = mul_rn(dminb, np.float32(TWO23))
        m = np.uint32(0x0F0F0F0F)
        la, ha = sa & m, (sa >> np.uint32(4)) & m
        lb, hb = sb & m, (sb >> np.uint32(4)) & m
        c0, c1, c2, c3, e0, e1, e2, e3 = pair(c0, c1, c2, c3, e0, e1, e2, e3, la, ha, lb, hb, 0,
                                              da, nda, -dmina, dmina23, db, ndb, -dminb, dminb23,
                                              qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, x32, xv, ok_x, bias,
                                              magic, scratch)
        return pair(c0, c1, c2, c3, e0, e1, e2, e3, la, ha, lb, hb, 2,
                    da, nda, -dmina, dmina23, db, ndb, -dminb, dminb23,
                    qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, x32, xv + 8, ok_x, bias, magic, scratch)

    return block


_block11 = _make_block11(lut_pairs11)     # gemv_q2k_v11's decode
_block12 = _make_block11(lut_pairs12)


@device_function(**INLINE)
def _cp_job_zf(sm, off, w32, base16, lane, g, ok):
    """`_cp_job_dd` without a branch: when not `ok` every copy is a zero fill (src-size 0) from a
    chunk inside the weight; lanes past 7 zero-fill their own d/dmin position (never read)."""
    n = np.uint32(16) if ok else np.uint32(0)
    src = base16 if ok else np.int64(0)
    cp_async_16(sm, off, w32, src + lane, n)
    cp_async_16(sm, off + 512, w32, src + 32 + lane, n)
    cp_async_16(sm, off + 1024, w32, src + 64 + lane, n)
    cp_async_16(sm, off + 1536, w32, src + 96 + lane, n)
    cp_async_16(sm, off + 2048, w32, src + SC_CHUNK + lane, n)
    cp_async_16(sm, off + 2560, w32, src + DD_CHUNK + (lane & 7), n if lane < 8 else np.uint32(0))
    cp_async_commit()


@device_function(**INLINE)
def _cp_job_split_zf(sm, off, w32, base16, lane, g, ok):
    """`_cp_job_split_dd` without a branch (`_cp_job_zf`'s zero fills), in its two commit groups."""
    n = np.uint32(16) if ok else np.uint32(0)
    src = base16 if ok else np.int64(0)
    cp_async_16(sm, off, w32, src + lane, n)
    cp_async_16(sm, off + 512, w32, src + 32 + lane, n)
    cp_async_16(sm, off + 2048, w32, src + SC_CHUNK + lane, n)
    cp_async_16(sm, off + 2560, w32, src + DD_CHUNK + (lane & 7), n if lane < 8 else np.uint32(0))
    cp_async_commit()
    cp_async_16(sm, off + 1024, w32, src + 64 + lane, n)
    cp_async_16(sm, off + 1536, w32, src + 96 + lane, n)
    cp_async_commit()

# (warps, slots, blocks an SM, pairj, early, split, v11, dd_once, v12, zfill)
V12_SHAPE = V10_SHAPE + (False, True, True, True)
V12_PAIR_SHAPE = V10_PAIR_SHAPE + (False, True, True, True)


_SM_COUNT = []
SM_SHARED_BYTES = 228 * 1024      # shared memory an sm_90 SM holds (1 KB of it reserved a block)


def v8_shared_bytes(team: int, stages: int) -> int:
    """Shared memory of one gemv_q2k_v8 block: the warps' unit slots and the reduction buffers."""
    return stages * team * CP_SLOT_WORDS * 4 + (2 * 6 * 128 * 4 if team > 1 else 0)


def persistent_blocks(items: int, blocks_per_sm: int = V8_BLOCKS_PER_SM) -> int:
    """A persistent grid for `items` equal items: the fewest rounds the resident blocks (the
    device's SMs x blocks_per_sm; the simulator: 2) need, then as few blocks as give every block
    that many rounds or one fewer (1600 items on 1584 slots: 800 blocks of 2, not 16 blocks
    running a second round alone)."""
    if SIMULATOR:
        slots = SIM_PERSISTENT_BLOCKS
    else:
        if not _SM_COUNT:
            _SM_COUNT.append(int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
        slots = _SM_COUNT[0] * blocks_per_sm
    rounds = cdiv(max(items, 1), slots)
    return cdiv(max(items, 1), rounds)


def v8_grid(T: int, N: int, nlayers: int = 1, blocks_per_sm: int = V8_BLOCKS_PER_SM) -> int:
    """gemv_q2k_v8's block count for T tokens and N rows (nlayers = 2: the two-layer launch)."""
    return persistent_blocks(nlayers * cdiv(N, TILE_ROWS) * cdiv(T, V4_TOKENS), blocks_per_sm)


# name -> (warps a block, units a warp loads at once, blocks an SM)
SHAPES = {"gemv_q2k_v4": (6, 2, 2), "gemv_q2k_v5": (12, 1, 2), "gemv_q2k_v6": (CP_WARPS, CP_UNITS, CP_BLOCKS_PER_SM),
          "gemv_q2k_v7": V7_SHAPE}
_BUILT = {name: _make_gemv(*SHAPES[name]) for name in ("gemv_q2k_v4", "gemv_q2k_v5")}
_BUILT["gemv_q2k_v6"] = _make_gemv_cp()
_BUILT["gemv_q2k_v7"] = _make_gemv7(*V7_SHAPE)
# persistent versions: name -> (warps a block, unit slots a warp, blocks an SM)
PERSISTENT = {"gemv_q2k_v8": (V8_TEAM, V8_STAGES, V8_BLOCKS_PER_SM)}
PERSISTENT_PAIR = {"gemv_q2k_v8": V8_PAIR_SHAPE}         # the two-layer launch's own shape
_BUILT["gemv_q2k_v8"] = (_make_gemv8(*PERSISTENT["gemv_q2k_v8"])[0], _make_gemv8(*V8_PAIR_SHAPE)[1])
SHAPES["gemv_q2k_v9"] = (V9_TEAM, V9_STAGES, V9_BLOCKS_PER_SM)   # per-item blocks: (warps, unit slots, blocks an SM)
V9_PAIR_SHAPE = (V9_TEAM, 3, 10)    # the two-layer launch: 3 slots, 10 blocks an SM (68.6 us on the H200 against 72.0)
_BUILT["gemv_q2k_v9"] = (_make_gemv9(*SHAPES["gemv_q2k_v9"])[0], _make_gemv9(*V9_PAIR_SHAPE)[1])
SHAPES["gemv_q2k_v10"] = V10_SHAPE  # (warps, unit slots, blocks an SM, pairj, early, split); two layers: V10_PAIR_SHAPE
_BUILT["gemv_q2k_v10"] = (_make_gemv10(*V10_SHAPE)[0], _make_gemv10(*V10_PAIR_SHAPE)[1])
SHAPES["gemv_q2k_v11"] = V11_SHAPE  # v10's shape, v11's decode and d/dmin copy; two layers: V11_PAIR_SHAPE
_BUILT["gemv_q2k_v11"] = (_make_gemv10(*V11_SHAPE)[0], _make_gemv10(*V11_PAIR_SHAPE)[1])
SHAPES["gemv_q2k_v12"] = V12_SHAPE  # v11's blocks and ring, v12's tables and branch-free copies; two layers: V12_PAIR_SHAPE
_BUILT["gemv_q2k_v12"] = (_make_gemv10(*V12_SHAPE)[0], _make_gemv10(*V12_PAIR_SHAPE)[1])
KERNELS = {name: built[0] for name, built in _BUILT.items()}
PAIR_KERNELS = {name: built[1] for name, built in _BUILT.items()}


def launch_config(version: str, T: int, N: int, nlayers: int = 1):
    """(grid, block) of `version` for T tokens, N rows and nlayers layers in one launch (the
    per-tile versions put the layer on grid z)."""
    if version in SHAPES:
        return (cdiv(N, TILE_ROWS), cdiv(T, V4_TOKENS)), SHAPES[version][0] * 32
    if version in PERSISTENT:
        team, _, per_sm = (PERSISTENT_PAIR if nlayers == 2 else PERSISTENT)[version]
        return (v8_grid(T, N, nlayers, per_sm),), team * 32
    raise ValueError(f"no q2k_r GEMV version {version!r}")


def geometry(version: str):
    """(T, N) -> (grid, block) of `version`: one block per 16-row tile and 8-token group, or a
    persistent grid (gemv_q2k_v8)."""
    if version not in SHAPES and version not in PERSISTENT:
        raise ValueError(f"no q2k_r GEMV version {version!r}")

    def geometry_q2kr(T: int, N: int):
        return launch_config(version, T, N)

    return geometry_q2kr


# the engine's build kernels, named for the compile tier (records.py)
repack_kernel = _repack
decode_kernel = _decode


def prepare_pair(version: str, xa, xb, wkv_pair, outa, outb, *, stream=0) -> PreparedLaunch:
    """Two layers' projections in one launch: wkv_pair is device uint8 [2*ceil(N/16), ceil(K/512)*2688],
    layer a's q2k_r then layer b's; xa, xb uint16 [T, K]; outa, outb uint16 [T, N]. Each layer's kv
    is bit-identical to `version` run on it alone (same blocks, same order)."""
    from .q2k_r import q2k_r_shape
    for name, a in (("xa", xa), ("xb", xb), ("outa", outa), ("outb", outb)):
        check_bf16_matrix(a, name, "")
    if tuple(xa.shape) != tuple(xb.shape) or tuple(outa.shape) != tuple(outb.shape) or xa.shape[0] != outa.shape[0]:
        raise ValueError(f"the pair's inputs must share [T, K] and outputs [T, N]: xa {list(xa.shape)}, xb "
                         f"{list(xb.shape)}, outa {list(outa.shape)}, outb {list(outb.shape)}")
    T, K = xa.shape
    N = outa.shape[1]
    nt, width = q2k_r_shape(N, K)
    if wkv_pair.dtype != np.uint8 or tuple(wkv_pair.shape) != (2 * nt, width) or not wkv_pair.is_c_contiguous():
        raise ValueError(f"wkv_pair must be C-contiguous uint8 {[2 * nt, width]} (two q2k_r weights), got "
                         f"{wkv_pair.dtype} {list(wkv_pair.shape)}")
    if any(data_address(a) % 16 for a in (xa, xb, wkv_pair)):
        raise ValueError(f"{version} reads x and the weights as 16-byte chunks: they must be 16-byte aligned")
    grid, block = launch_config(version, T, N, nlayers=2)
    grid = grid if version in PERSISTENT else grid + (2,)
    w32 = wkv_pair.reshape(wkv_pair.size).view(np.uint32)
    return PreparedLaunch(f"{version}[2 layers]", PAIR_KERNELS[version], grid, block, stream,
                          (flat_u32(xa), flat_u32(xb), w32, outa, outb, T, K), (outa, outb))
