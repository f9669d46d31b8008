"""Q2_K blocks -> bf16 rows on the GPU: the dequant stage, plain and gathered by row id.

One 84-byte Q2_K block decodes to one 256-value table row (layout in `engram_numba.stages.rows.q2k`). The
output is bf16 words, uint16 [n, 256], bit-identical to `reference.rows_reference` for every
block whose fp16 d and dmin are finite. (Blocks with an inf/NaN d or dmin decode to NaN in the same
places; only the NaN payload can differ, since the GPU's fp32 unit returns one canonical NaN where
x86 propagates the operand's.) Bit-exactness needs the fp32 math of the reference, in its order and
without FMA contraction: scale = d*(sc & 15), offset = dmin*(sc >> 4), y = scale*q - offset, each
via `mul_rn`/`sub_rn`, then one round-to-nearest-even to bf16.

Kernel versions (llm.c style: never delete v1, it is the teaching baseline and a second reference)
  v1  naive: one thread per output value, reads its bytes straight from the uint8 block array,
      writes one uint16 (256 threads a block, one block a row).
  v2  8 lanes per row (4 rows a warp, 32 rows a 256-thread block), 32 values a lane: 5 uint32
      loads a lane from a uint32 [n, 21] view; the 4 possible values of each 16-value sub-block
      (q = 0..3) are rounded once (pack_bf16x2) into a byte_perm lookup table, so 8 values cost
      ~8 integer ops; four 16-byte stores a lane, each warp store covering whole 64-byte runs.
  v3  v2 rounding with one `cvt.rn.bf16x2.f32` per pair (cvt_pack_bf16x2) instead of the integer
      round-to-nearest-even: half the instructions of v2 (PTX: 263 against 524 a thread).
  v4  v3 with ROWS_PER_GROUP_V4 rows per 8-lane group and every load of those rows issued before
      any decoding (gather: all row ids, then all table words), for more bytes in flight a thread
      when occupancy alone does not hide DRAM latency.
Each version exists twice: `dequant` (blocks [n, 84] in order) and `gather` (rows of a device
table [rows, 84] picked by an int32/int64 row id array [n], with 64-bit address arithmetic so a
30 GiB table works). A gathered out-of-range id reads nothing: its output row is NaN (0x7FC0
words) and a device counter is incremented, which the launcher turns into a ValueError.
v2 and v3 also have `gather_pair`: two tables' gathers in one launch (ids [2n]: table a's n, then
table b's; the first half of the blocks gathers table a), each row as `gather` writes it, for the
one-token decode, whose two per-layer gathers are a block each and pure latency.

Why the v2 lane mapping. Value e of a row sits in output chunk c = e // 8 (16 bytes, 32 chunks a
row). Chunk c's codes are bits 2j.. of qs bytes 32n + 16h + 8(c & 1) + 0..7 with n = c >> 4,
h = (c >> 1) & 1, j = (c >> 2) & 3, and its scale byte is sub-block c >> 1. The four chunks that
differ only in j read the same 8 qs bytes (2 words), so lane t of a group takes chunks
c = (t & 3) + 16 (t >> 2) + 4k, k = 0..3: 2 qs words, the 2 scale words holding its 4 scale bytes,
and the d/dmin word, i.e. 5 loads for 32 values.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from ...device.intrinsics import (byte_perm, cvt_pack_bf16x2, device_function, f16_bits_to_f32, f32_to_bf16_bits, mul_rn,
                                pack_bf16x2, store_u32x4, sub_rn)
from .cuda_common import make_naive_kernels
from .encodings import ROW_VALUES
from .q2k import ENGRAM_ROW_BYTES

ROW_WORDS = ENGRAM_ROW_BYTES // 4      # 21 uint32 words a block; rows are 4-byte aligned (84 = 4*21)
OUT_WORDS = ROW_VALUES // 2            # 128 bf16x2 words a row
OUT_CHUNKS = ROW_VALUES // 8           # 32 16-byte chunks a row
LANES_PER_ROW = 8                      # v2/v3: a group of 8 lanes decodes one row
THREADS_V1 = 256
THREADS_FAST = 256                     # 32 rows a block (v2), 32*R rows a block (v3)
ROWS_PER_GROUP_V4 = 2
NAN_BF16 = 0x7FC0                      # the row written for an out-of-range id
NAN_BF16X2 = 0x7FC07FC0
_D_WORD = 20                           # bytes 80..83: d (low half), dmin (high half)
_QS_WORD = 4                           # bytes 16..79: qs


# ---- v1: one thread per value ------------------------------------------------------------------

@device_function
def _value_v1(blocks, r, e):
    """bf16 word of value e of block r of a uint8 [rows, 84] array (r may be 64-bit)."""
    half = e // 128
    w = e % 128
    j = w // 32
    h = (w % 32) // 16
    l = w % 16
    sc = np.uint32(blocks[r, 8 * half + 2 * j + h])
    q = (np.uint32(blocks[r, 16 + 32 * half + 16 * h + l]) >> np.uint32(2 * j)) & np.uint32(3)
    d = f16_bits_to_f32(np.uint32(blocks[r, 80]) | (np.uint32(blocks[r, 81]) << np.uint32(8)))
    dmin = f16_bits_to_f32(np.uint32(blocks[r, 82]) | (np.uint32(blocks[r, 83]) << np.uint32(8)))
    scale = mul_rn(d, np.float32(sc & np.uint32(15)))
    offset = mul_rn(dmin, np.float32(sc >> np.uint32(4)))
    return f32_to_bf16_bits(sub_rn(mul_rn(scale, np.float32(q)), offset))


_dequant_v1, _gather_v1 = make_naive_kernels(_value_v1)


# ---- v2..v4: 8 lanes a row, byte_perm lookup tables --------------------------------------------

@device_function
def _load_lane_words(w32, src, t):
    """The 5 words lane t of a group needs from row src of a uint32 [rows, 21] view."""
    qw = _QS_WORD + 8 * (t >> 2) + 2 * (t & 3)
    sw = 2 * (t >> 2)
    return w32[src, qw], w32[src, qw + 1], w32[src, sw], w32[src, sw + 1], w32[src, _D_WORD]


@device_function
def _pick4(lo, hi, word, shift):
    """4 values from the 4 qs bytes of `word` (codes at bit `shift`) -> two bf16x2 words."""
    v = (np.uint32(word) >> np.uint32(shift)) & np.uint32(0x03030303)   # byte i = code q_i
    # byte i = q_i | (q_i + 4) << 4: nibble pairs that select (lo byte, hi byte) of entry q_i
    s = np.uint32(np.uint32(v * np.uint32(0x11)) + np.uint32(0x40404040))
    return byte_perm(lo, hi, s), byte_perm(lo, hi, s >> np.uint32(16))


@device_function
def _nan_lane(out32, dst, t):
    chunk = dst * OUT_CHUNKS + (t & 3) + 16 * (t >> 2)
    nan2 = np.uint32(NAN_BF16X2)
    store_u32x4(out32, chunk, nan2, nan2, nan2, nan2)
    store_u32x4(out32, chunk + 4, nan2, nan2, nan2, nan2)
    store_u32x4(out32, chunk + 8, nan2, nan2, nan2, nan2)
    store_u32x4(out32, chunk + 12, nan2, nan2, nan2, nan2)


def _make_fast(pack, rows_per_group):
    """The 8-lanes-a-row kernels (dequant, gather), rounding pairs of fp32 values to a bf16x2
    word with `pack` (pack_bf16x2 or cvt_pack_bf16x2) and decoding `rows_per_group` rows per
    8-lane group with every load issued before any decoding."""

    @device_function
    def sub_block_lut(sc, d, dmin):
        # The 4 possible bf16 values of a sub-block (q = 0..3) as a byte_perm table: lo holds
        # their low bytes, hi their high bytes, entry q in byte q.
        scale = mul_rn(d, np.float32(np.uint32(sc & np.uint32(15))))
        offset = mul_rn(dmin, np.float32(np.uint32(sc >> np.uint32(4))))
        # scale*q - offset for each q as the reference computes it. 0*scale stays a multiply
        # (-0 for a negative scale, NaN for an infinite one); 1*scale is scale bit for bit.
        y0 = sub_rn(mul_rn(scale, np.float32(0.0)), offset)
        y1 = sub_rn(scale, offset)
        y2 = sub_rn(mul_rn(scale, np.float32(2.0)), offset)
        y3 = sub_rn(mul_rn(scale, np.float32(3.0)), offset)
        p01 = pack(y0, y1)
        p23 = pack(y2, y3)
        return byte_perm(p01, p23, 0x6420), byte_perm(p01, p23, 0x7531)

    @device_function
    def decode_chunk(sc, d, dmin, qa, qb, q_shift, out32, chunk):
        # One 16-byte chunk: 8 values of one sub-block, codes at bit q_shift of the qs words
        # qa (values 0-3) and qb (values 4-7).
        lo, hi = sub_block_lut(sc, d, dmin)
        o0, o1 = _pick4(lo, hi, qa, q_shift)
        o2, o3 = _pick4(lo, hi, qb, q_shift)
        store_u32x4(out32, chunk, o0, o1, o2, o3)

    @device_function
    def decode_lane(qa, qb, s01, s23, dd, out32, dst, t):
        # Lane t's 4 chunks (j = 0..3) of output row dst, written out by hand: numba's pipeline
        # leaves a range(4) loop rolled. The lane's scale bytes are bytes c1 and c1 + 2 of s01
        # (j = 0, 1) and s23 (j = 2, 3), c1 = (t >> 1) & 1.
        d = f16_bits_to_f32(np.uint32(dd) & np.uint32(0xFFFF))
        dmin = f16_bits_to_f32(np.uint32(dd) >> np.uint32(16))
        sc_shift = np.uint32(8 * ((t >> 1) & 1))
        s01 = np.uint32(np.uint32(s01) >> sc_shift)
        s23 = np.uint32(np.uint32(s23) >> sc_shift)
        chunk = dst * OUT_CHUNKS + (t & 3) + 16 * (t >> 2)
        decode_chunk(s01 & np.uint32(0xFF), d, dmin, qa, qb, 0, out32, chunk)
        decode_chunk((s01 >> np.uint32(16)) & np.uint32(0xFF), d, dmin, qa, qb, 2, out32, chunk + 4)
        decode_chunk(s23 & np.uint32(0xFF), d, dmin, qa, qb, 4, out32, chunk + 8)
        decode_chunk((s23 >> np.uint32(16)) & np.uint32(0xFF), d, dmin, qa, qb, 6, out32, chunk + 12)

    @device_function
    def gather_lane(w32, src, out32, row, t, bad):
        # lane t's share of output row `row` from table row src (NaN and counted when out of range)
        if src < 0 or src >= w32.shape[0]:
            _nan_lane(out32, row, t)
            if t == 0:
                cuda.atomic.add(bad, 0, np.uint32(1))
            return
        qa, qb, s01, s23, dd = _load_lane_words(w32, src, t)
        decode_lane(qa, qb, s01, s23, dd, out32, row, t)

    if rows_per_group == 1:
        @cuda.jit
        def dequant(w32, out32):
            # w32: uint32 [n, 21] view of the blocks; out32: uint32 [n*128] view of the rows
            tid = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
            row = tid >> 3
            if row >= w32.shape[0]:
                return
            t = np.int32(tid & 7)
            qa, qb, s01, s23, dd = _load_lane_words(w32, row, t)
            decode_lane(qa, qb, s01, s23, dd, out32, row, t)

        @cuda.jit
        def gather(w32, ids, out32, bad):
            # w32: uint32 [rows, 21] view of the table; ids: int32/int64 [n];
            # out32: uint32 [n*128]; bad: uint32 [1] count of out-of-range ids
            tid = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
            row = tid >> 3
            if row >= ids.shape[0]:
                return
            t = np.int32(tid & 7)
            src = np.int64(ids[row])
            if src < 0 or src >= w32.shape[0]:
                _nan_lane(out32, row, t)
                if t == 0:
                    cuda.atomic.add(bad, 0, np.uint32(1))
                return
            qa, qb, s01, s23, dd = _load_lane_words(w32, src, t)
            decode_lane(qa, qb, s01, s23, dd, out32, row, t)

        @cuda.jit
        def gather_pair(w32a, w32b, ids, out32a, out32b, bad):
            # two layers' gathers in one launch (one decode token's): ids [2n], layer a's n ids
            # then layer b's; the first half of the blocks gathers layer a (table w32a into
            # out32a), the second half layer b, each row exactly as `gather` does it
            n = ids.shape[0] >> 1
            rows_per_block = cuda.blockDim.x >> 3
            half = (n + rows_per_block - 1) // rows_per_block
            blk = np.int64(cuda.blockIdx.x)
            layer_b = blk >= half
            if layer_b:
                blk -= half
            tid = blk * cuda.blockDim.x + cuda.threadIdx.x
            row = tid >> 3
            if row >= n:
                return
            t = np.int32(tid & 7)
            # one call per layer, not a select between the arrays: a selected pointer loses its
            # global address space (generic ST.E.128 stores instead of STG.E.128)
            if layer_b:
                gather_lane(w32b, np.int64(ids[n + row]), out32b, row, t, bad)
            else:
                gather_lane(w32a, np.int64(ids[row]), out32a, row, t, bad)

        return dequant, gather, gather_pair

    R = rows_per_group

    # A block of G = blockDim/8 groups owns R*G consecutive rows; group g takes rows g, g + G, ...
    # so each load instruction of the block still reads G consecutive rows. The (R, 5) local
    # arrays are indexed by unrolled constants only, so they live in registers.
    @cuda.jit
    def dequant(w32, out32):
        groups = cuda.blockDim.x >> 3
        t = np.int32(cuda.threadIdx.x & 7)
        row0 = np.int64(cuda.blockIdx.x) * groups * R + (cuda.threadIdx.x >> 3)
        n = w32.shape[0]
        words = cuda.local.array((R, 5), types.uint32)
        for r in range(R):
            row = row0 + r * groups
            if row < n:
                qa, qb, s01, s23, dd = _load_lane_words(w32, row, t)
                words[r, 0] = qa
                words[r, 1] = qb
                words[r, 2] = s01
                words[r, 3] = s23
                words[r, 4] = dd
        for r in range(R):
            row = row0 + r * groups
            if row < n:
                decode_lane(words[r, 0], words[r, 1], words[r, 2], words[r, 3], words[r, 4],
                            out32, row, t)

    @cuda.jit
    def gather(w32, ids, out32, bad):
        groups = cuda.blockDim.x >> 3
        t = np.int32(cuda.threadIdx.x & 7)
        row0 = np.int64(cuda.blockIdx.x) * groups * R + (cuda.threadIdx.x >> 3)
        n = ids.shape[0]
        n_table = w32.shape[0]
        src = cuda.local.array(R, types.int64)
        for r in range(R):
            row = row0 + r * groups
            src[r] = np.int64(ids[row]) if row < n else np.int64(-1)
        words = cuda.local.array((R, 5), types.uint32)
        for r in range(R):
            if src[r] >= 0 and src[r] < n_table:
                qa, qb, s01, s23, dd = _load_lane_words(w32, src[r], t)
                words[r, 0] = qa
                words[r, 1] = qb
                words[r, 2] = s01
                words[r, 3] = s23
                words[r, 4] = dd
        for r in range(R):
            row = row0 + r * groups
            if row < n:
                if src[r] >= 0 and src[r] < n_table:
                    decode_lane(words[r, 0], words[r, 1], words[r, 2], words[r, 3], words[r, 4],
                                out32, row, t)
                else:
                    _nan_lane(out32, row, t)
                    if t == 0:
                        cuda.atomic.add(bad, 0, np.uint32(1))

    return dequant, gather


_dequant_v2, _gather_v2, _gather_pair_v2 = _make_fast(pack_bf16x2, 1)
_dequant_v3, _gather_v3, _gather_pair_v3 = _make_fast(cvt_pack_bf16x2, 1)
_dequant_v4, _gather_v4 = _make_fast(cvt_pack_bf16x2, ROWS_PER_GROUP_V4)
