"""FP8 rows (e4m3 codes, an e8m0 scale per 32 values) -> bf16 rows on the GPU, in order or
gathered by row id.

Layouts (engram_numba/stages/rows/fp8.py): a raw fp8 row is 264 bytes, 256 e4m3 codes then 8
e8m0 scales (ds4's layout, the rows stage's raw row). DeepSeek's checkpoint keeps the scales in a
separate [rows, 8] tensor: the gather kernels take the codes and the scales as two arrays plus the
scales' column offset, so one kernel reads both layouts:
    inline    codes = scales = the [rows, 264] table, scales start at byte 256 (word 64)
    separate  codes [rows, 256], scales [rows, 8], scales start at byte 0
Values: v = e4m3(code) * e8m0(scale), one fp32 multiply (exact for scale bytes 3..246; outside,
IEEE rounding, the same as the reference's), then one rounding to bf16. A NaN code (0x7F, 0xFF)
or scale (255) gives the fp32 NaN 0x7FFFFFFF, which the GPU's multiply keeps, and the bf16 word
0x7FFF: bit-identical to the reference, NaN words included.

Kernel versions
  v1  naive: one thread per output value, reads its code and scale bytes from uint8 arrays.
  v2  8 lanes per row; lane t writes chunks c = t + 8k (k = 0..3), so the 8 lanes of a row store
      128 contiguous bytes per instruction. A lane reads its 8 code words (2 a chunk) and the 2
      scale words of the row, all issued before any decoding; e4m3 -> fp32 by bit arithmetic
      (the normal codes' exponent is E + 120, mantissa M << 20), cvt.rn.bf16x2 per pair.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...device.intrinsics import (cvt_pack_bf16x2, device_function, f32_to_bf16_bits, mul_rn, store_u32x4,
                                  u32_as_f32)
from .cuda_common import INLINE_SCALE_BYTE, NAN_BF16, OUT_CHUNKS, nan_lane
from .encodings import ROW_VALUES
from .fp8 import FP8_ROW_BYTES, NAN_F32_BITS

INLINE_SCALE_WORD = INLINE_SCALE_BYTE // 4


# ---- value helpers -------------------------------------------------------------------------------

@device_function
def e4m3_to_f32(code):
    """fp32 value of an e4m3 code (uint32 0..255): NaN codes give 0x7FFFFFFF."""
    c = np.uint32(code)
    mag = c & np.uint32(0x7F)
    if mag < np.uint32(8):
        v = np.float32(mag) * np.float32(0.001953125)          # E = 0: M * 2^-9, exact
    else:
        v = u32_as_f32((mag << np.uint32(20)) + np.uint32(120 << 23))
    if mag == np.uint32(0x7F):
        v = u32_as_f32(np.uint32(NAN_F32_BITS))
    elif c & np.uint32(0x80):
        v = -v
    return v


@device_function
def e8m0_to_f32(byte):
    """fp32 value 2^(e-127) of an e8m0 byte (e = 0: the subnormal 2^-127; 255: NaN 0x7FFFFFFF)."""
    e = np.uint32(byte)
    bits = e << np.uint32(23)
    if e == np.uint32(0):
        bits = np.uint32(0x00400000)
    if e == np.uint32(255):
        bits = np.uint32(NAN_F32_BITS)
    return u32_as_f32(bits)


# ---- v1: one thread per value --------------------------------------------------------------------

@device_function
def _value_v1(codes, scales, soff, r, e):
    """bf16 word of value e of row r: code codes[r, e], scale scales[r, soff + e // 32]."""
    v = e4m3_to_f32(codes[r, e])
    s = e8m0_to_f32(scales[r, soff + e // 32])
    return f32_to_bf16_bits(mul_rn(v, s))


@cuda.jit
def _decode_v1(raw, out):
    # raw: uint8 [n, 264]; out: uint16 [n, 256]
    i = cuda.grid(1)
    if i >= raw.shape[0] * ROW_VALUES:
        return
    r = i // ROW_VALUES
    e = i % ROW_VALUES
    out[r, e] = _value_v1(raw, raw, INLINE_SCALE_BYTE, r, e)


@cuda.jit
def _gather_v1(codes, scales, soff, ids, out, bad):
    # codes: uint8 [rows, >=256]; scales: uint8 [rows, soff+8]; ids: int32/int64 [n];
    # out: uint16 [n, 256]; bad: uint32 [1]
    i = cuda.grid(1)
    if i >= ids.shape[0] * ROW_VALUES:
        return
    r = i // ROW_VALUES
    e = i % ROW_VALUES
    rid = np.int64(ids[r])
    if rid < 0 or rid >= codes.shape[0]:
        out[r, e] = NAN_BF16
        if e == 0:
            cuda.atomic.add(bad, 0, np.uint32(1))
        return
    out[r, e] = _value_v1(codes, scales, soff, rid, e)


# ---- v2: 8 lanes a row ---------------------------------------------------------------------------

@device_function
def _decode_chunk(wa, wb, s, out32, chunk):
    """8 codes (bytes of the words wa, wb) times the scale s -> one 16-byte chunk of bf16."""
    a = np.uint32(wa)
    b = np.uint32(wb)
    o0 = cvt_pack_bf16x2(mul_rn(e4m3_to_f32(a & np.uint32(0xFF)), s),
                         mul_rn(e4m3_to_f32((a >> np.uint32(8)) & np.uint32(0xFF)), s))
    o1 = cvt_pack_bf16x2(mul_rn(e4m3_to_f32((a >> np.uint32(16)) & np.uint32(0xFF)), s),
                         mul_rn(e4m3_to_f32(a >> np.uint32(24)), s))
    o2 = cvt_pack_bf16x2(mul_rn(e4m3_to_f32(b & np.uint32(0xFF)), s),
                         mul_rn(e4m3_to_f32((b >> np.uint32(8)) & np.uint32(0xFF)), s))
    o3 = cvt_pack_bf16x2(mul_rn(e4m3_to_f32((b >> np.uint32(16)) & np.uint32(0xFF)), s),
                         mul_rn(e4m3_to_f32(b >> np.uint32(24)), s))
    store_u32x4(out32, chunk, o0, o1, o2, o3)


@device_function
def _lane_v2(codes32, scales32, soff_w, src, out32, dst, t):
    """Lane t of row src: chunks c = t + 8k, code words 2c and 2c + 1, scale group c >> 2 =
    (t >> 2) + 2k, i.e. byte (t >> 2) + 2 (k & 1) of scale word k >> 1."""
    w0 = codes32[src, 2 * t]
    w1 = codes32[src, 2 * t + 1]
    w2 = codes32[src, 2 * t + 16]
    w3 = codes32[src, 2 * t + 17]
    w4 = codes32[src, 2 * t + 32]
    w5 = codes32[src, 2 * t + 33]
    w6 = codes32[src, 2 * t + 48]
    w7 = codes32[src, 2 * t + 49]
    s_lo = np.uint32(scales32[src, soff_w])
    s_hi = np.uint32(scales32[src, soff_w + 1])
    sh = np.uint32(8 * (t >> 2))
    base = dst * OUT_CHUNKS + t
    _decode_chunk(w0, w1, e8m0_to_f32((s_lo >> sh) & np.uint32(0xFF)), out32, base)
    _decode_chunk(w2, w3, e8m0_to_f32((s_lo >> (sh + np.uint32(16))) & np.uint32(0xFF)), out32, base + 8)
    _decode_chunk(w4, w5, e8m0_to_f32((s_hi >> sh) & np.uint32(0xFF)), out32, base + 16)
    _decode_chunk(w6, w7, e8m0_to_f32((s_hi >> (sh + np.uint32(16))) & np.uint32(0xFF)), out32, base + 24)


@cuda.jit
def _decode_v2(raw32, out32):
    # raw32: uint32 [n, 66] view of the 264-byte rows; out32: uint32 [n*128]
    tid = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    row = tid >> 3
    if row >= raw32.shape[0]:
        return
    _lane_v2(raw32, raw32, INLINE_SCALE_WORD, row, out32, row, np.int32(tid & 7))


@cuda.jit
def _gather_v2(codes32, scales32, soff_w, ids, out32, bad):
    # codes32: uint32 [rows, 66 or 64]; scales32: uint32 [rows, soff_w+2]; ids: int32/int64 [n];
    # out32: uint32 [n*128]; bad: uint32 [1]
    tid = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
    row = tid >> 3
    if row >= ids.shape[0]:
        return
    t = np.int32(tid & 7)
    src = np.int64(ids[row])
    if src < 0 or src >= codes32.shape[0]:
        nan_lane(out32, row, t)
        if t == 0:
            cuda.atomic.add(bad, 0, np.uint32(1))
        return
    _lane_v2(codes32, scales32, soff_w, src, out32, row, t)


assert FP8_ROW_BYTES == 4 * (INLINE_SCALE_WORD + 2)
