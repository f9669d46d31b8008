"""GEMVs straight on a Q2_K `wkv`: kv = bf16(x @ W^T) for a few tokens, decoding W in registers.

The weight stays in its file encoding on the device: wkv_raw uint8 [N, K/256*84], row n holding
K/256 Q2_K blocks (one block = 256 consecutive k, layout in `engram_numba.stages.rows.q2k`),
51.6 MB at the released shape against 315 MB as bf16. x is bf16 words uint16 [T, K], out bf16
words uint16 [T, N]; accumulation is fp32 and the result is rounded to bf16 once.

Two numeric paths (docs/numerics.md, "Weights read in their file encoding"):
- bf16-rounded weights (v1, v2): each weight is decoded with the reference decoder's fp32
  operations, `(d*sc)*q - dmin*m`, and rounded to bf16: exactly the bf16 `wkv` that today's
  projection reads (`wkv_bf16()`), so these are the same math as `gemv_v*` up to summation order.
- exact weights, factored (v3): per 16-value sub-block, sum(x*w) = d*sc*sum(x*q) - dmin*m*sum(x)
  with nothing rounded but the fp32 sums. Its yardstick is bf16(x . w_exact) in float64, and its
  distance from the bf16-weight projection is a property of the data, measured by the tests.

Kernel versions (llm.c style: v1 stays, the teaching baseline and a second reference)
  gemv_q2k_v1  naive: one thread per output column n and 8 tokens at a time; per sub-block the 4
               values a weight can take (q = 0..3) are decoded and rounded to bf16, each weight
               picks its own; products added in k order 0..K-1: bit-identical to
               `projection_reference(x, wkv_bf16)`.
  gemv_q2k_v2  tensor cores with the weight as the A operand: a block owns 16 rows and 8 tokens,
               its 8 warps split K; lane (g, t) decodes rows g and g+8 of its 64-value quarter of
               each block (one 16-value sub-block per j) through a byte_perm table of the
               sub-block's 4 bf16-rounded values, and feeds them with x's matching values to
               mma.m16n8k16 (x's 8 tokens are the mma's N, so T = 1..8 cost one weight pass); two
               independent accumulator chains (even / odd sub-blocks) halve the mma dependency.
  gemv_q2k_v3  v2's streaming, factored: A is sc*q (an exact small integer in bf16, from a 16-entry
               table), so one mma chain sums a whole block and only d scales it; the min term
               dmin * sum_j m_j * sum(x over sub-block j) is three more mma (the fp32 sub-block
               sums of x split exactly into three bf16 parts).
Each version's kernel, geometry (`geometry_naive`, `geometry_tc`) and argument types are in its
record (records.py); the stage's launcher (`cuda_common.prepare`) builds the launch.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, types

from ...device.intrinsics import (SIMULATOR, bf16_bits_to_f32, bf16x2_hi, bf16x2_lo, byte_perm, cvt_pack_bf16x2,
                                  device_function, f16_bits_to_f32, f32_as_u32, f32_to_bf16_bits, load_u32x4,
                                  mma_bf16_16816, mul_rn, round_to_bf16, sub_rn, u32_as_f32)
from .gemv_common import f16x2_to_f32x2
from .cuda_common import INLINE, bounds, cdiv

BLOCK_VALUES = 256          # one Q2_K block: 256 consecutive k of one row
BLOCK_BYTES = 84
BLOCK_WORDS = BLOCK_BYTES // 4


# ---- gemv_q2k_v1: the naive kernel ----------------------------------------------------------------

NAIVE_THREADS = 128
NAIVE_TOKENS = 8            # tokens accumulated together (registers); more tokens loop


@cuda.jit
def _gemv_q2k_v1(x, wq, out):
    # x: uint16 [T, K]; wq: uint8 [N, K/256*84] Q2_K blocks; out: uint16 [T, N]
    n = cuda.grid(1)
    if n >= wq.shape[0]:
        return
    T = x.shape[0]
    n_blocks = x.shape[1] // BLOCK_VALUES
    acc = cuda.local.array(NAIVE_TOKENS, float32)
    lut = cuda.local.array(4, float32)
    for t0 in range(0, T, NAIVE_TOKENS):
        nt = min(NAIVE_TOKENS, T - t0)
        for i in range(NAIVE_TOKENS):
            acc[i] = float32(0.0)
        for blk in range(n_blocks):
            b = blk * BLOCK_BYTES
            d = f16_bits_to_f32(np.uint32(wq[n, b + 80]) | (np.uint32(wq[n, b + 81]) << np.uint32(8)))
            dmin = f16_bits_to_f32(np.uint32(wq[n, b + 82]) | (np.uint32(wq[n, b + 83]) << np.uint32(8)))
            for s in range(16):                     # sub-block s holds k = 16s .. 16s+15 of the block
                sc = np.uint32(wq[n, b + s])
                scale = mul_rn(d, np.float32(sc & np.uint32(15)))
                offset = mul_rn(dmin, np.float32(sc >> np.uint32(4)))
                for q in range(4):                  # the reference decoder's fp32 value, rounded to bf16
                    lut[q] = round_to_bf16(sub_rn(mul_rn(scale, np.float32(q)), offset))
                qs = b + 16 + 32 * (s >> 3) + 16 * (s & 1)
                shift = np.uint32(2 * ((s >> 1) & 3))
                k0 = blk * BLOCK_VALUES + 16 * s
                for l in range(16):
                    w = lut[(np.uint32(wq[n, qs + l]) >> shift) & np.uint32(3)]
                    for t in range(nt):
                        acc[t] += bf16_bits_to_f32(x[t0 + t, k0 + l]) * w
        for t in range(nt):
            out[t0 + t, n] = f32_to_bf16_bits(acc[t])


# ---- gemv_q2k_v2 / v3: tensor cores, the weight decoded into the A operand ------------------------
#
# mma.m16n8k16 computes D[16 x 8] += A[16 x 16] B[16 x 8]. Here A's 16 rows are 16 weight rows
# (n0 + g and n0 + g + 8 for lane g = lane >> 2), B's 8 columns are 8 tokens (token g of lane g),
# and the 16 k of one mma can be any 16 values of the row as long as a lane's A and B words name
# the same ones. Lane (g, t = lane & 3) takes, in every Q2_K block, the quarter (n, h) = (t >> 1,
# t & 1): values e = 128n + 32j + 16h + l for j, l. For fixed j these 16 values are one sub-block
# (one scale byte, codes at bit 2j of 16 consecutive qs bytes = 4 words) and 16 consecutive x
# values (two 16-byte loads), so a lane reads, per row and block, 4 qs words, the 2 words with its
# 4 scale bytes and the d/dmin word (7 aligned 4-byte loads: a block's 84 bytes keep it 4-byte
# aligned only), and feeds 16 mma: for (j, i), qs word i gives values l = 4i..4i+3 as two bf16x2
# words (a0/a2 for row g, a1/a3 for row g+8), x words 2i and 2i+1 are b0/b1.
#
# A block of TC_THREADS threads owns TC_ROWS rows and TC_TOKENS tokens; its TC_WARPS warps split
# the K/256 blocks into contiguous runs, each warp loading TC_UNROLL blocks (42 words a lane)
# before decoding any, so a block is about one DRAM round trip. The warps' fp32 fragments are
# summed through shared memory in warp order (deterministic). Rows past N and tokens past T read
# the last one / zeros and are dropped; a block index past the warp's run loads zeros (decodes to
# 0 and adds nothing), so every warp reaches every mma (the simulator's mma twin needs that).

TC_THREADS = 256
TC_WARPS = TC_THREADS // 32
TC_ROWS = 16
TC_TOKENS = 8
TC_UNROLL = 3               # blocks a warp loads before decoding (3 x 8 warps = K/256 at the released K)
TC_BLOCKS_PER_SM = 2
_RED = TC_WARPS * 32 * 4    # fp32 fragments [warp][lane][c0..c3]
_SCRATCH = 6 * TC_THREADS if SIMULATOR else 1
_WV = 14 * TC_UNROLL        # words a lane holds per trip: [u][row a: 4 qs, 2 scale, dd; row b: same]


@device_function(**INLINE)
def small_u32_to_f32(v):
    """An integer 0 <= v < 2^23 as fp32, exactly: 2^23 + v has v in its mantissa (an I2F
    conversion is quarter rate on sm_90; this is a logic op and an add)."""
    return u32_as_f32(np.uint32(0x4B000000) | np.uint32(v)) - np.float32(8388608.0)


@device_function(**INLINE)
def pick4(lo, hi, word, shift):
    """4 values from the 4 bytes of `word` (2-bit codes at bit `shift`) through a 4-entry bf16
    table (lo = the entries' low bytes, hi = their high bytes) -> two bf16x2 words (values 0, 1
    and 2, 3). The same trick as the rows stage's Q2_K decoder."""
    v = (np.uint32(word) >> np.uint32(shift)) & np.uint32(0x03030303)     # byte i = code q_i
    # byte i = q_i | (q_i + 4) << 4: byte_perm nibbles selecting (lo byte, hi byte) of entry q_i
    s = np.uint32(np.uint32(v * np.uint32(0x11)) + np.uint32(0x40404040))
    return byte_perm(lo, hi, s), byte_perm(lo, hi, s >> np.uint32(16))


@device_function(**INLINE)
def table_bytes(p01, p23):
    """Entries (e0 | e1 << 16, e2 | e3 << 16) -> the (lo bytes, hi bytes) words pick4 reads."""
    return byte_perm(p01, p23, 0x6420), byte_perm(p01, p23, 0x7531)


@device_function(**INLINE)
def lut_rounded(sc, d, dmin):
    """The 4 values a sub-block's weights can take, decoded as the reference does (fp32, no FMA)
    and rounded to bf16, as pick4's table."""
    scale = mul_rn(d, small_u32_to_f32(sc & np.uint32(15)))
    offset = mul_rn(dmin, small_u32_to_f32(sc >> np.uint32(4)))
    # 0*scale stays a multiply (-0 for a negative scale, NaN for an infinite one), as in the reference
    y0 = sub_rn(mul_rn(scale, np.float32(0.0)), offset)
    y1 = sub_rn(scale, offset)
    y2 = sub_rn(mul_rn(scale, np.float32(2.0)), offset)
    y3 = sub_rn(mul_rn(scale, np.float32(3.0)), offset)
    return table_bytes(cvt_pack_bf16x2(y0, y1), cvt_pack_bf16x2(y2, y3))


@device_function(**INLINE)
def x_words(x32, v4, ok):
    """16 consecutive x values of one token (two 16-byte loads at 16-byte index v4), or zeros."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.uint32(0)
    if ok:
        a0, a1, a2, a3 = load_u32x4(x32, v4)
        b0, b1, b2, b3 = load_u32x4(x32, v4 + 1)
    return a0, a1, a2, a3, b0, b1, b2, b3


@device_function(**INLINE)
def mma_subblock(c0, c1, c2, c3, lo_a, hi_a, lo_b, hi_b, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, shift,
                 x0, x1, x2, x3, x4, x5, x6, x7, scratch):
    """The 4 mma of one sub-block: qs words i = 0..3 (values 4i..4i+3 of rows g and g+8) against
    x words 2i, 2i+1, accumulated into (c0..c3)."""
    pa0, pa1 = pick4(lo_a, hi_a, qa0, shift)
    pb0, pb1 = pick4(lo_b, hi_b, qb0, shift)
    c0, c1, c2, c3 = mma_bf16_16816(pa0, pb0, pa1, pb1, x0, x1, c0, c1, c2, c3, scratch)
    pa0, pa1 = pick4(lo_a, hi_a, qa1, shift)
    pb0, pb1 = pick4(lo_b, hi_b, qb1, shift)
    c0, c1, c2, c3 = mma_bf16_16816(pa0, pb0, pa1, pb1, x2, x3, c0, c1, c2, c3, scratch)
    pa0, pa1 = pick4(lo_a, hi_a, qa2, shift)
    pb0, pb1 = pick4(lo_b, hi_b, qb2, shift)
    c0, c1, c2, c3 = mma_bf16_16816(pa0, pb0, pa1, pb1, x4, x5, c0, c1, c2, c3, scratch)
    pa0, pa1 = pick4(lo_a, hi_a, qa3, shift)
    pb0, pb1 = pick4(lo_b, hi_b, qb3, shift)
    return mma_bf16_16816(pa0, pb0, pa1, pb1, x6, x7, c0, c1, c2, c3, scratch)


@device_function(**INLINE)
def load_block_words(wv, u, w32, row_a, row_b, blk, ok, qoff, soff):
    """Lane's 7 words of block `blk` of rows a and b (word offsets row_a, row_b) -> wv[14u ...]."""
    base = 14 * u
    if ok:
        pa = row_a + blk * BLOCK_WORDS
        pb = row_b + blk * BLOCK_WORDS
        wv[base + 0] = w32[pa + qoff]
        wv[base + 1] = w32[pa + qoff + 1]
        wv[base + 2] = w32[pa + qoff + 2]
        wv[base + 3] = w32[pa + qoff + 3]
        wv[base + 4] = w32[pa + soff]
        wv[base + 5] = w32[pa + soff + 1]
        wv[base + 6] = w32[pa + 20]
        wv[base + 7] = w32[pb + qoff]
        wv[base + 8] = w32[pb + qoff + 1]
        wv[base + 9] = w32[pb + qoff + 2]
        wv[base + 10] = w32[pb + qoff + 3]
        wv[base + 11] = w32[pb + soff]
        wv[base + 12] = w32[pb + soff + 1]
        wv[base + 13] = w32[pb + 20]
    else:
        for i in range(14):
            wv[base + i] = np.uint32(0)


@device_function(**INLINE)
def sum16(x0, x1, x2, x3, x4, x5, x6, x7):
    """fp32 sum of the 16 bf16 values in 8 words, left to right."""
    s = bf16x2_lo(x0)
    s += bf16x2_hi(x0)
    s += bf16x2_lo(x1)
    s += bf16x2_hi(x1)
    s += bf16x2_lo(x2)
    s += bf16x2_hi(x2)
    s += bf16x2_lo(x3)
    s += bf16x2_hi(x3)
    s += bf16x2_lo(x4)
    s += bf16x2_hi(x4)
    s += bf16x2_lo(x5)
    s += bf16x2_hi(x5)
    s += bf16x2_lo(x6)
    s += bf16x2_hi(x6)
    s += bf16x2_lo(x7)
    s += bf16x2_hi(x7)
    return s


@device_function(**INLINE)
def split3(s):
    """fp32 s -> three bf16 words (hi, mid, lo) with hi + mid + lo == s exactly: each part takes
    the next 8 significant bits (truncation keeps every remainder exact in fp32)."""
    hi = f32_as_u32(s) & np.uint32(0xFFFF0000)
    r = s - u32_as_f32(hi)
    mid = f32_as_u32(r) & np.uint32(0xFFFF0000)
    lo = f32_as_u32(r - u32_as_f32(mid)) & np.uint32(0xFFFF0000)
    return hi >> np.uint32(16), mid >> np.uint32(16), lo >> np.uint32(16)


@device_function(**INLINE)
def int_pair_bf16(m0, m1):
    """Two small integers (< 256) as an exact bf16x2 word (m0 in the low half)."""
    return (f32_as_u32(small_u32_to_f32(m0)) >> np.uint32(16)) | (f32_as_u32(small_u32_to_f32(m1)) & np.uint32(0xFFFF0000))


def _make_tc(factored: bool):
    """gemv_q2k_v2 (factored=False: bf16-rounded weights) or gemv_q2k_v3 (factored)."""
    U = TC_UNROLL
    assert U == 3, "the trip below is written out for 3 blocks"

    @device_function(**INLINE)
    def sub_rounded(c0, c1, c2, c3, s_a, s_b, shj, da, dmina, db, dminb, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3,
                    j2, x32, xv, ok_x, scratch):
        """Sub-block j (codes at bit j2 = 2j) of rows g and g+8 with bf16-rounded weights."""
        x0, x1, x2, x3, x4, x5, x6, x7 = x_words(x32, xv, ok_x)          # issued first: L1 latency hides
        lo_a, hi_a = lut_rounded((s_a >> shj) & np.uint32(0xFF), da, dmina)
        lo_b, hi_b = lut_rounded((s_b >> shj) & np.uint32(0xFF), db, dminb)
        return mma_subblock(c0, c1, c2, c3, lo_a, hi_a, lo_b, hi_b, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, j2,
                            x0, x1, x2, x3, x4, x5, x6, x7, scratch)

    @device_function(**INLINE)
    def block_rounded(c0, c1, c2, c3, e0, e1, e2, e3, wv, u, x32, xv, ok_x, sh, scratch, lut_s):
        """One Q2_K block with bf16-rounded weights. Sub-blocks j = 0, 2 accumulate into (c), j = 1, 3
        into (e): two independent mma chains, half the dependent latency."""
        b = 14 * u
        qa0, qa1, qa2, qa3, sa0, sa1 = wv[b], wv[b + 1], wv[b + 2], wv[b + 3], wv[b + 4], wv[b + 5]
        qb0, qb1, qb2, qb3, sb0, sb1 = wv[b + 7], wv[b + 8], wv[b + 9], wv[b + 10], wv[b + 11], wv[b + 12]
        da, dmina = f16x2_to_f32x2(wv[b + 6])
        db, dminb = f16x2_to_f32x2(wv[b + 13])
        # scale byte 8n + 2j + h: word soff + (j >> 1), bits 16 (j & 1) + 8h
        sh1 = sh + np.uint32(16)
        c0, c1, c2, c3 = sub_rounded(c0, c1, c2, c3, sa0, sb0, sh, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                                     qb0, qb1, qb2, qb3, 0, x32, xv, ok_x, scratch)
        e0, e1, e2, e3 = sub_rounded(e0, e1, e2, e3, sa0, sb0, sh1, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                                     qb0, qb1, qb2, qb3, 2, x32, xv + 4, ok_x, scratch)
        c0, c1, c2, c3 = sub_rounded(c0, c1, c2, c3, sa1, sb1, sh, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                                     qb0, qb1, qb2, qb3, 4, x32, xv + 8, ok_x, scratch)
        e0, e1, e2, e3 = sub_rounded(e0, e1, e2, e3, sa1, sb1, sh1, da, dmina, db, dminb, qa0, qa1, qa2, qa3,
                                     qb0, qb1, qb2, qb3, 6, x32, xv + 12, ok_x, scratch)
        return c0, c1, c2, c3, e0, e1, e2, e3

    @device_function(**INLINE)
    def block_factored(c0, c1, c2, c3, e0_, e1_, e2_, e3_, wv, u, x32, xv, ok_x, sh, scratch, lut_s):
        """One Q2_K block, factored: d * sum(x * sc*q) - dmin * sum_j m_j * sum(x over sub-block j)."""
        b = 14 * u
        qa0, qa1, qa2, qa3, sa0, sa1 = wv[b], wv[b + 1], wv[b + 2], wv[b + 3], wv[b + 4], wv[b + 5]
        qb0, qb1, qb2, qb3, sb0, sb1 = wv[b + 7], wv[b + 8], wv[b + 9], wv[b + 10], wv[b + 11], wv[b + 12]
        da, dmina = f16x2_to_f32x2(wv[b + 6])
        db, dminb = f16x2_to_f32x2(wv[b + 13])
        z = float32(0.0)
        d0 = d1 = d2 = d3 = z
        # the j = 0..3 sub-blocks spelled out: their m codes and x sums become mma operands below
        sc_a = (sa0 >> sh) & np.uint32(0xFF)
        sc_b = (sb0 >> sh) & np.uint32(0xFF)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_words(x32, xv, ok_x)
        sx0 = sum16(x0, x1, x2, x3, x4, x5, x6, x7)
        ma0, mb0 = sc_a >> np.uint32(4), sc_b >> np.uint32(4)
        ia, ib = 2 * (sc_a & np.uint32(15)), 2 * (sc_b & np.uint32(15))
        d0, d1, d2, d3 = mma_subblock(d0, d1, d2, d3, lut_s[ia], lut_s[ia + 1], lut_s[ib], lut_s[ib + 1],
                                      qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 0,
                                      x0, x1, x2, x3, x4, x5, x6, x7, scratch)
        sh1 = sh + np.uint32(16)
        sc_a = (sa0 >> sh1) & np.uint32(0xFF)
        sc_b = (sb0 >> sh1) & np.uint32(0xFF)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_words(x32, xv + 4, ok_x)
        sx1 = sum16(x0, x1, x2, x3, x4, x5, x6, x7)
        ma1, mb1 = sc_a >> np.uint32(4), sc_b >> np.uint32(4)
        ia, ib = 2 * (sc_a & np.uint32(15)), 2 * (sc_b & np.uint32(15))
        d0, d1, d2, d3 = mma_subblock(d0, d1, d2, d3, lut_s[ia], lut_s[ia + 1], lut_s[ib], lut_s[ib + 1],
                                      qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 2,
                                      x0, x1, x2, x3, x4, x5, x6, x7, scratch)
        sc_a = (sa1 >> sh) & np.uint32(0xFF)
        sc_b = (sb1 >> sh) & np.uint32(0xFF)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_words(x32, xv + 8, ok_x)
        sx2 = sum16(x0, x1, x2, x3, x4, x5, x6, x7)
        ma2, mb2 = sc_a >> np.uint32(4), sc_b >> np.uint32(4)
        ia, ib = 2 * (sc_a & np.uint32(15)), 2 * (sc_b & np.uint32(15))
        d0, d1, d2, d3 = mma_subblock(d0, d1, d2, d3, lut_s[ia], lut_s[ia + 1], lut_s[ib], lut_s[ib + 1],
                                      qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 4,
                                      x0, x1, x2, x3, x4, x5, x6, x7, scratch)
        sc_a = (sa1 >> sh1) & np.uint32(0xFF)
        sc_b = (sb1 >> sh1) & np.uint32(0xFF)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_words(x32, xv + 12, ok_x)
        sx3 = sum16(x0, x1, x2, x3, x4, x5, x6, x7)
        ma3, mb3 = sc_a >> np.uint32(4), sc_b >> np.uint32(4)
        ia, ib = 2 * (sc_a & np.uint32(15)), 2 * (sc_b & np.uint32(15))
        d0, d1, d2, d3 = mma_subblock(d0, d1, d2, d3, lut_s[ia], lut_s[ia + 1], lut_s[ib], lut_s[ib + 1],
                                      qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 6,
                                      x0, x1, x2, x3, x4, x5, x6, x7, scratch)
        # min term: A2[row, k] = m codes of the lane's 4 sub-blocks (k slots 2t, 2t+1 <- j = 0, 1;
        # 2t+8, 2t+9 <- j = 2, 3), B2[k, token g] = the same sub-blocks' x sums, in 3 exact parts
        a0 = int_pair_bf16(ma0, ma1)
        a1 = int_pair_bf16(mb0, mb1)
        a2 = int_pair_bf16(ma2, ma3)
        a3 = int_pair_bf16(mb2, mb3)
        h0, m0, l0 = split3(sx0)
        h1, m1, l1 = split3(sx1)
        h2, m2, l2 = split3(sx2)
        h3, m3, l3 = split3(sx3)
        s16 = np.uint32(16)
        e0, e1, e2, e3 = mma_bf16_16816(a0, a1, a2, a3, h0 | (h1 << s16), h2 | (h3 << s16), z, z, z, z, scratch)
        e0, e1, e2, e3 = mma_bf16_16816(a0, a1, a2, a3, m0 | (m1 << s16), m2 | (m3 << s16), e0, e1, e2, e3, scratch)
        e0, e1, e2, e3 = mma_bf16_16816(a0, a1, a2, a3, l0 | (l1 << s16), l2 | (l3 << s16), e0, e1, e2, e3, scratch)
        # c0, c1 are row g's (tokens 2t, 2t+1), c2, c3 row g+8's
        c0 += da * d0 - dmina * e0
        c1 += da * d1 - dmina * e1
        c2 += db * d2 - dminb * e2
        c3 += db * d3 - dminb * e3
        return c0, c1, c2, c3, e0_, e1_, e2_, e3_

    block = block_factored if factored else block_rounded

    @cuda.jit(**bounds(TC_THREADS, TC_BLOCKS_PER_SM))
    def gemv_q2k_tc(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/256*21] flat view of the Q2_K wkv;
        # out: uint16 [T, N]
        red = cuda.shared.array(_RED, float32)                   # [warp][lane][c0..c3]
        scratch = cuda.shared.array(_SCRATCH, types.uint32)      # the mma twin's (simulator only)
        lut_s = cuda.shared.array(32, types.uint32)              # v3: bf16(sc * q) tables, 16 codes
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        if factored:
            if tid < 16:
                e0 = np.uint32(0)
                e1 = f32_as_u32(small_u32_to_f32(tid)) >> np.uint32(16)
                e2 = f32_as_u32(small_u32_to_f32(2 * tid)) >> np.uint32(16)
                e3 = f32_as_u32(small_u32_to_f32(3 * tid)) >> np.uint32(16)
                lo, hi = table_bytes(e0 | (e1 << np.uint32(16)), e2 | (e3 << np.uint32(16)))
                lut_s[2 * tid] = lo
                lut_s[2 * tid + 1] = hi
            cuda.syncthreads()
        N = out.shape[1]
        n_blocks = K >> 8
        row_words = n_blocks * BLOCK_WORDS
        n0 = cuda.blockIdx.x * TC_ROWS
        tok = cuda.blockIdx.y * TC_TOKENS + g
        ok_tok = tok < T
        x16 = np.int64(min(tok, T - 1)) * (K >> 3)             # token row, in 16-byte units
        row_a = np.int64(min(n0 + g, N - 1)) * row_words
        row_b = np.int64(min(n0 + g + 8, N - 1)) * row_words
        qoff = 4 + 8 * (t >> 1) + 4 * (t & 1)                   # qs words of quarter (n, h) = (t>>1, t&1)
        soff = 2 * (t >> 1)                                     # the 2 words holding its scale bytes
        sh = np.uint32(8 * (t & 1))
        xoff = 16 * (t >> 1) + 2 * (t & 1)                      # its x values in a block, 16-byte units
        per = (n_blocks + TC_WARPS - 1) // TC_WARPS             # blocks a warp owns (uniform trip count)
        b_begin = warp * per
        b_end = min(b_begin + per, n_blocks)
        c0 = c1 = c2 = c3 = float32(0.0)
        f0 = f1 = f2 = f3 = float32(0.0)                        # v2's second mma chain (v3: unused)
        wv = cuda.local.array(_WV, types.uint32)
        for s0 in range(0, per, U):
            blk0 = b_begin + s0
            load_block_words(wv, 0, w32, row_a, row_b, blk0, blk0 < b_end, qoff, soff)
            load_block_words(wv, 1, w32, row_a, row_b, blk0 + 1, blk0 + 1 < b_end, qoff, soff)
            load_block_words(wv, 2, w32, row_a, row_b, blk0 + 2, blk0 + 2 < b_end, qoff, soff)
            c0, c1, c2, c3, f0, f1, f2, f3 = block(c0, c1, c2, c3, f0, f1, f2, f3, wv, 0, x32, x16 + 32 * blk0 + xoff,
                                                   ok_tok and blk0 < b_end, sh, scratch, lut_s)
            c0, c1, c2, c3, f0, f1, f2, f3 = block(c0, c1, c2, c3, f0, f1, f2, f3, wv, 1, x32,
                                                   x16 + 32 * (blk0 + 1) + xoff, ok_tok and blk0 + 1 < b_end, sh,
                                                   scratch, lut_s)
            c0, c1, c2, c3, f0, f1, f2, f3 = block(c0, c1, c2, c3, f0, f1, f2, f3, wv, 2, x32,
                                                   x16 + 32 * (blk0 + 2) + xoff, ok_tok and blk0 + 2 < b_end, sh,
                                                   scratch, lut_s)
        base = (warp * 32 + lane) * 4
        red[base] = c0 + f0
        red[base + 1] = c1 + f1
        red[base + 2] = c2 + f2
        red[base + 3] = c3 + f3
        cuda.syncthreads()
        if tid < 128:
            # fragment element (lane l, c) summed over the warps in order
            s = float32(0.0)
            for w in range(TC_WARPS):
                s += red[w * 128 + tid]
            el = tid >> 2
            c = tid & 3
            row = n0 + (el >> 2) + 8 * (c >> 1)
            tk = cuda.blockIdx.y * TC_TOKENS + 2 * (el & 3) + (c & 1)
            if row < N and tk < T:
                out[tk, row] = f32_to_bf16_bits(s)

    return gemv_q2k_tc


_gemv_q2k_v2 = _make_tc(False)
_gemv_q2k_v3 = _make_tc(True)


def geometry_naive(T: int, N: int):
    return cdiv(N, NAIVE_THREADS), NAIVE_THREADS


def geometry_tc(T: int, N: int):
    return (cdiv(N, TC_ROWS), cdiv(T, TC_TOKENS)), TC_THREADS
