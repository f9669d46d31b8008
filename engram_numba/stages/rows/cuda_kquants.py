"""Q3_K, Q4_K and Q8_0 rows -> bf16 rows on the GPU, in order or gathered by row id.

Layouts and value formulas: engram_numba/stages/rows/kquants.py (docs/math.md section 4). Every
product in them is exact in fp32, so the kernels match the reference bit for bit with plain
round-to-nearest multiplies (`mul_rn`; Q4_K's one subtraction is `sub_rn`, kept apart from the
product so no fused multiply-add can skip a rounding), then one rounding to bf16. A block with an
inf/NaN fp16 scale decodes to NaN in the reference's places; only the NaN payload can differ (the
GPU's fp32 unit returns one canonical NaN), as for Q2_K.

Kernel versions, per encoding ("q3_k_v1", "q3_k_v2", "q4_k_v1", ...):
  v1  naive: one thread per output value, its bytes read straight from the uint8 rows.
  v2  8 lanes per row (cuda_common), every load of a lane issued before any decoding, 16-byte
      stores of 8 bf16 values:
      q8_0  lane t decodes block t (34 bytes at byte 34t, so only 2-byte aligned): 9 word loads
            cover it; byte_perm(w[k], w[k+1], 0x5432 or 0x7654) realigns the int8 codes.
      q4_k  lane t reads the 16-byte header (d, dmin, 12 scale bytes) and qs bytes 16t..16t+15 with
            two 16-byte loads (rows are 144 = 9 x 16 bytes: the table must be 16-byte aligned);
            the low nibbles are 16 values of sub-block 2(t >> 1), the high ones 16 of the next.
      q3_k  rows are 110 bytes, so only 2-byte aligned: 15 halfword loads a lane (8 qs bytes, 8
            hmask bytes, the 12 scale bytes, d), the lane mapping of cuda_q2k (chunks
            (t & 3) + 16 (t >> 2) + 4j, which read the same qs and hmask bytes for j = 0..3).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...device.intrinsics import (byte_perm, cvt_pack_bf16x2, device_function, f16_bits_to_f32, f32_to_bf16_bits,
                                  load_u32x4, mul_rn, store_u32x4, sub_rn)
from .cuda_common import OUT_CHUNKS, make_naive_kernels, nan_lane
from .kquants import Q4_K_BYTES

Q4_K_CHUNKS = Q4_K_BYTES // 16                   # 9 16-byte chunks a Q4_K row


# ---- v1 value functions: bf16 word of value e of row r of a uint8 [rows, row_bytes] array ----------

@device_function
def _u16(raw, r, o):
    return np.uint32(raw[r, o]) | (np.uint32(raw[r, o + 1]) << np.uint32(8))


@device_function
def _q3_k_value(raw, r, e):
    half = e // 128
    w = e % 128
    j = w // 32
    h = (w % 32) // 16
    l = w % 16
    s = e // 16
    low4 = (np.uint32(raw[r, 96 + s % 8]) >> np.uint32(4 * (s // 8))) & np.uint32(0xF)
    high2 = (np.uint32(raw[r, 104 + s % 4]) >> np.uint32(2 * (s // 4))) & np.uint32(3)
    scale = np.int32(low4 | (high2 << np.uint32(4))) - np.int32(32)
    low = (np.uint32(raw[r, 32 + 32 * half + 16 * h + l]) >> np.uint32(2 * j)) & np.uint32(3)
    high = (np.uint32(raw[r, 16 * h + l]) >> np.uint32(4 * half + j)) & np.uint32(1)
    q = np.int32(low) - np.int32(4) + np.int32(4 * high)
    dl = mul_rn(f16_bits_to_f32(_u16(raw, r, 108)), np.float32(scale))
    return f32_to_bf16_bits(mul_rn(dl, np.float32(q)))


@device_function
def _q4_k_value(raw, r, e):
    s = e // 32
    l = e % 32
    if s < 4:
        sc = np.uint32(raw[r, 4 + s]) & np.uint32(63)
        m = np.uint32(raw[r, 8 + s]) & np.uint32(63)
    else:
        sc = (np.uint32(raw[r, 8 + s]) & np.uint32(0xF)) | ((np.uint32(raw[r, s]) >> np.uint32(6)) << np.uint32(4))
        m = (np.uint32(raw[r, 8 + s]) >> np.uint32(4)) | ((np.uint32(raw[r, 4 + s]) >> np.uint32(6)) << np.uint32(4))
    q = (np.uint32(raw[r, 16 + 32 * (s // 2) + l]) >> np.uint32(4 * (s % 2))) & np.uint32(0xF)
    scale = mul_rn(f16_bits_to_f32(_u16(raw, r, 0)), np.float32(sc))
    offset = mul_rn(f16_bits_to_f32(_u16(raw, r, 2)), np.float32(m))
    return f32_to_bf16_bits(sub_rn(mul_rn(scale, np.float32(q)), offset))


@device_function
def _q8_0_value(raw, r, e):
    o = 34 * (e // 32)
    c = np.int32(raw[r, o + 2 + e % 32])
    q = c - np.int32(256) if c >= 128 else c
    return f32_to_bf16_bits(mul_rn(f16_bits_to_f32(_u16(raw, r, o)), np.float32(q)))


# ---- v2 lanes: (src view, row, out32, dst row, lane t) -------------------------------------------

@device_function
def _sext8(byte):
    """A byte (uint32 0..255) as the int8 it encodes, in fp32."""
    b = np.int32(byte)
    return np.float32(b - ((b & np.int32(0x80)) << np.int32(1)))


@device_function
def _q8_0_words(wa, wb, wc, sel, d, out32, chunk):
    # 8 int8 codes: the 4 of byte_perm(wa, wb, sel), then the 4 of byte_perm(wb, wc, sel)
    x = byte_perm(wa, wb, sel)
    y = byte_perm(wb, wc, sel)
    o0 = cvt_pack_bf16x2(mul_rn(d, _sext8(x & np.uint32(0xFF))), mul_rn(d, _sext8((x >> np.uint32(8)) & np.uint32(0xFF))))
    o1 = cvt_pack_bf16x2(mul_rn(d, _sext8((x >> np.uint32(16)) & np.uint32(0xFF))), mul_rn(d, _sext8(x >> np.uint32(24))))
    o2 = cvt_pack_bf16x2(mul_rn(d, _sext8(y & np.uint32(0xFF))), mul_rn(d, _sext8((y >> np.uint32(8)) & np.uint32(0xFF))))
    o3 = cvt_pack_bf16x2(mul_rn(d, _sext8((y >> np.uint32(16)) & np.uint32(0xFF))), mul_rn(d, _sext8(y >> np.uint32(24))))
    store_u32x4(out32, chunk, o0, o1, o2, o3)


@device_function
def _q8_0_lane(w32, src, out32, dst, t):
    """Lane t: block t of row src of a uint32 [rows, 68] view. The block's 34 bytes start at byte
    34t = 4 w + 2 (t & 1): the 9 words from w = (17 t) >> 1 hold them; d is the low (t even) or
    high (t odd) half of the first, and the codes are realigned by byte_perm."""
    w = (17 * t) >> 1
    w0 = np.uint32(w32[src, w])
    w1 = np.uint32(w32[src, w + 1])
    w2 = np.uint32(w32[src, w + 2])
    w3 = np.uint32(w32[src, w + 3])
    w4 = np.uint32(w32[src, w + 4])
    w5 = np.uint32(w32[src, w + 5])
    w6 = np.uint32(w32[src, w + 6])
    w7 = np.uint32(w32[src, w + 7])
    w8 = np.uint32(w32[src, w + 8])
    odd = t & 1
    d = f16_bits_to_f32((w0 >> np.uint32(16)) if odd else (w0 & np.uint32(0xFFFF)))
    sel = np.uint32(0x7654) if odd else np.uint32(0x5432)
    base = dst * OUT_CHUNKS + 4 * t
    _q8_0_words(w0, w1, w2, sel, d, out32, base)
    _q8_0_words(w2, w3, w4, sel, d, out32, base + 1)
    _q8_0_words(w4, w5, w6, sel, d, out32, base + 2)
    _q8_0_words(w6, w7, w8, sel, d, out32, base + 3)


@device_function
def _scale_byte(h1, h2, h3, i):
    """Byte i (0..11) of the 12 scale bytes held in the words h1, h2, h3."""
    word = h1 if i < 4 else (h2 if i < 8 else h3)
    return (np.uint32(word) >> np.uint32(8 * (i & 3))) & np.uint32(0xFF)


@device_function
def _q4_k_sub(h0, h1, h2, h3, s):
    """(scale, offset) fp32 of Q4_K sub-block s from the header words."""
    if s < 4:
        sc = _scale_byte(h1, h2, h3, s) & np.uint32(63)
        m = _scale_byte(h1, h2, h3, s + 4) & np.uint32(63)
    else:
        hi = _scale_byte(h1, h2, h3, s + 4)
        sc = (hi & np.uint32(0xF)) | ((_scale_byte(h1, h2, h3, s - 4) >> np.uint32(6)) << np.uint32(4))
        m = (hi >> np.uint32(4)) | ((_scale_byte(h1, h2, h3, s) >> np.uint32(6)) << np.uint32(4))
    d = f16_bits_to_f32(np.uint32(h0) & np.uint32(0xFFFF))
    dmin = f16_bits_to_f32(np.uint32(h0) >> np.uint32(16))
    return mul_rn(d, np.float32(sc)), mul_rn(dmin, np.float32(m))


@device_function
def _q4_k_nibbles(qa, qb, sh, scale, offset, out32, chunk):
    """8 values from the 4-bit codes at bit `sh` of the 8 bytes of qa, qb -> one 16-byte chunk."""
    a = np.uint32(qa) >> np.uint32(sh)
    b = np.uint32(qb) >> np.uint32(sh)
    f = np.uint32(0xF)
    o0 = cvt_pack_bf16x2(sub_rn(mul_rn(scale, np.float32(a & f)), offset),
                         sub_rn(mul_rn(scale, np.float32((a >> np.uint32(8)) & f)), offset))
    o1 = cvt_pack_bf16x2(sub_rn(mul_rn(scale, np.float32((a >> np.uint32(16)) & f)), offset),
                         sub_rn(mul_rn(scale, np.float32((a >> np.uint32(24)) & f)), offset))
    o2 = cvt_pack_bf16x2(sub_rn(mul_rn(scale, np.float32(b & f)), offset),
                         sub_rn(mul_rn(scale, np.float32((b >> np.uint32(8)) & f)), offset))
    o3 = cvt_pack_bf16x2(sub_rn(mul_rn(scale, np.float32((b >> np.uint32(16)) & f)), offset),
                         sub_rn(mul_rn(scale, np.float32((b >> np.uint32(24)) & f)), offset))
    store_u32x4(out32, chunk, o0, o1, o2, o3)


@device_function
def _q4_k_lane(w32, src, out32, dst, t):
    """Lane t: qs bytes 16t..16t+15 of row src of a flat uint32 [rows*36] view (16-byte chunk
    9 src + 1 + t): low nibbles are values 64c + 16(t & 1) + 0..15 of sub-block 2c, high nibbles
    the same positions of sub-block 2c + 1, c = t >> 1."""
    h0, h1, h2, h3 = load_u32x4(w32, src * Q4_K_CHUNKS)
    q0, q1, q2, q3 = load_u32x4(w32, src * Q4_K_CHUNKS + 1 + t)
    c = t >> 1
    scale_lo, offset_lo = _q4_k_sub(h0, h1, h2, h3, 2 * c)
    scale_hi, offset_hi = _q4_k_sub(h0, h1, h2, h3, 2 * c + 1)
    base = dst * OUT_CHUNKS + 8 * c + 2 * (t & 1)
    _q4_k_nibbles(q0, q1, 0, scale_lo, offset_lo, out32, base)
    _q4_k_nibbles(q2, q3, 0, scale_lo, offset_lo, out32, base + 1)
    _q4_k_nibbles(q0, q1, 4, scale_hi, offset_hi, out32, base + 4)
    _q4_k_nibbles(q2, q3, 4, scale_hi, offset_hi, out32, base + 5)


@device_function
def _q3_k_chunk(qa, qb, ma, mb, j, n, dl, out32, chunk):
    """8 values of sub-block 8n + 2j + h: low bits at bit 2j of the qs bytes qa, qb, high bit at
    bit 4n + j of the hmask bytes ma, mb; q = low - 4 + 4 * high; y = dl * q."""
    qs_ = np.uint32(2 * j)
    ms = np.uint32(4 * n + j)
    lo_a = (np.uint32(qa) >> qs_) & np.uint32(0x03030303)
    lo_b = (np.uint32(qb) >> qs_) & np.uint32(0x03030303)
    hi_a = (np.uint32(ma) >> ms) & np.uint32(0x01010101)
    hi_b = (np.uint32(mb) >> ms) & np.uint32(0x01010101)
    # byte i of (low | high << 2) is the 3-bit code c_i; q_i = c_i - 4
    ca = lo_a | (hi_a << np.uint32(2))
    cb = lo_b | (hi_b << np.uint32(2))
    f = np.uint32(0xFF)
    four = np.float32(4.0)
    o0 = cvt_pack_bf16x2(mul_rn(dl, np.float32(ca & f) - four), mul_rn(dl, np.float32((ca >> np.uint32(8)) & f) - four))
    o1 = cvt_pack_bf16x2(mul_rn(dl, np.float32((ca >> np.uint32(16)) & f) - four),
                         mul_rn(dl, np.float32(ca >> np.uint32(24)) - four))
    o2 = cvt_pack_bf16x2(mul_rn(dl, np.float32(cb & f) - four), mul_rn(dl, np.float32((cb >> np.uint32(8)) & f) - four))
    o3 = cvt_pack_bf16x2(mul_rn(dl, np.float32((cb >> np.uint32(16)) & f) - four),
                         mul_rn(dl, np.float32(cb >> np.uint32(24)) - four))
    store_u32x4(out32, chunk, o0, o1, o2, o3)


@device_function
def _q3_k_dl(d, sw0, sw1, sw2, j, n, h):
    """dl = d * (scale - 32) of sub-block s = 8n + 2j + h (scale bytes in the words sw0..sw2):
    low 4 bits in nibble n of byte 2j + h, high 2 bits at bit 2(2n + j//2) of byte 8 + 2(j&1) + h."""
    lo_byte = _scale_byte(sw0, sw1, sw2, 2 * j + h)
    hi_byte = _scale_byte(sw0, sw1, sw2, 8 + 2 * (j & 1) + h)
    low4 = (lo_byte >> np.uint32(4 * n)) & np.uint32(0xF)
    high2 = (hi_byte >> np.uint32(2 * (2 * n + (j >> 1)))) & np.uint32(3)
    return mul_rn(d, np.float32(np.int32(low4 | (high2 << np.uint32(4))) - np.int32(32)))


@device_function
def _q3_k_lane(w16, src, out32, dst, t):
    """Lane t of row src of a uint16 [rows, 55] view: n = t >> 2, h = (t >> 1) & 1, values
    16h + 8(t & 1) + 0..7 of each 32-value group j of half n (chunks (t & 3) + 16n + 4j)."""
    n = t >> 2
    h = (t >> 1) & 1
    qo = 16 + 16 * n + 8 * h + 4 * (t & 1)       # qs bytes 32 + 32n + 16h + 8(t&1) + 0..7
    mo = 8 * h + 4 * (t & 1)                     # hmask bytes 16h + 8(t&1) + 0..7
    qa = np.uint32(w16[src, qo]) | (np.uint32(w16[src, qo + 1]) << np.uint32(16))
    qb = np.uint32(w16[src, qo + 2]) | (np.uint32(w16[src, qo + 3]) << np.uint32(16))
    ma = np.uint32(w16[src, mo]) | (np.uint32(w16[src, mo + 1]) << np.uint32(16))
    mb = np.uint32(w16[src, mo + 2]) | (np.uint32(w16[src, mo + 3]) << np.uint32(16))
    sw0 = np.uint32(w16[src, 48]) | (np.uint32(w16[src, 49]) << np.uint32(16))
    sw1 = np.uint32(w16[src, 50]) | (np.uint32(w16[src, 51]) << np.uint32(16))
    sw2 = np.uint32(w16[src, 52]) | (np.uint32(w16[src, 53]) << np.uint32(16))
    d = f16_bits_to_f32(w16[src, 54])
    base = dst * OUT_CHUNKS + (t & 3) + 16 * n
    _q3_k_chunk(qa, qb, ma, mb, 0, n, _q3_k_dl(d, sw0, sw1, sw2, 0, n, h), out32, base)
    _q3_k_chunk(qa, qb, ma, mb, 1, n, _q3_k_dl(d, sw0, sw1, sw2, 1, n, h), out32, base + 4)
    _q3_k_chunk(qa, qb, ma, mb, 2, n, _q3_k_dl(d, sw0, sw1, sw2, 2, n, h), out32, base + 8)
    _q3_k_chunk(qa, qb, ma, mb, 3, n, _q3_k_dl(d, sw0, sw1, sw2, 3, n, h), out32, base + 12)


def _make_v2(lane):
    @cuda.jit
    def decode(src, out32):
        # src: the encoding's view of the rows (see each lane); out32: uint32 [n*128]
        tid = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        row = tid >> 3
        if row >= out32.shape[0] // 128:
            return
        lane(src, row, out32, row, np.int32(tid & 7))

    @cuda.jit
    def gather(src, n_table, ids, out32, bad):
        # src: the table's view; n_table: its rows; ids: int32/int64 [n]; out32: uint32 [n*128]
        tid = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        row = tid >> 3
        if row >= ids.shape[0]:
            return
        t = np.int32(tid & 7)
        rid = np.int64(ids[row])
        if rid < 0 or rid >= n_table:
            nan_lane(out32, row, t)
            if t == 0:
                cuda.atomic.add(bad, 0, np.uint32(1))
            return
        lane(src, rid, out32, row, t)

    return decode, gather


# (decode in order, gather by id) of each version; records.py names them "<encoding>_v<N>"
q3_k_v1 = make_naive_kernels(_q3_k_value)
q3_k_v2 = _make_v2(_q3_k_lane)
q4_k_v1 = make_naive_kernels(_q4_k_value)
q4_k_v2 = _make_v2(_q4_k_lane)
q8_0_v1 = make_naive_kernels(_q8_0_value)
q8_0_v2 = _make_v2(_q8_0_lane)
