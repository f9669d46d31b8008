"""FP8 rows: 256 e4m3 codes and 8 e8m0 scales (one per 32 values), 264 bytes a row.

DeepSeek's checkpoint stores the engram tables this way (codes [rows, 256] and scales [rows, 8]
as two tensors); ds4 GGUFs keep the same bytes as one 264-byte row, codes first. The rows stage's
raw row of encoding "fp8" is always the 264-byte layout (`assemble_rows_fp8` builds it).

Values (docs/math.md section 4.5), from the bit layout:
    e4m3 code b: sign = bit 7, E = bits 6..3, M = bits 2..0
        E > 0: (8 + M) * 2^(E - 10)      E = 0: M * 2^-9      0x7F, 0xFF: NaN (no infinity)
    e8m0 byte e: 2^(e - 127); 255 is NaN
    value = e4m3(code) * e8m0(scale of its 32-group), one fp32 multiply.
For scale bytes 3..246 every value is exact in bf16 (4 significant bits times a power of two), so
the fp32 product and its bf16 rounding change nothing. Outside that range: bytes 0..2 put the
smallest codes below bf16's subnormal step (they round, to nearest even); bytes 247..254 push the
largest codes past fp32's range (they become +-inf). A NaN code or a NaN scale (byte 255) gives a
NaN value: the decoders produce the fp32 NaN 0x7FFFFFFF, which every backend carries through the
multiply unchanged and rounds to the bf16 word 0x7FFF, so NaN words match bit for bit.

    decode_fp8_reference(raw [n, 264]) -> float32 [n, 256]      numpy, written to be read
    decode_fp8_cpu(raw [n, 264])       -> float32 [n, 256]      @njit, bit-identical
    encode_rows_fp8(x [n, 256])        -> (codes [n, 256], scales [n, 8]) uint8
    assemble_rows_fp8(codes, scales)   -> raw [n, 264];  split_rows_fp8(raw) -> (codes, scales)
    e4m3_encode / e4m3_round / ceil_log2_f32 / fp8_scale_exponents: the pieces the encoders and
    DeepSeek's activation quantisation (stages/proj) share.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .encodings import ROW_VALUES

GROUP = 32                        # values per e8m0 scale
ROW_SCALES = ROW_VALUES // GROUP  # 8
FP8_ROW_BYTES = ROW_VALUES + ROW_SCALES   # 264 (encodings.ENCODINGS["fp8"].row_bytes)
E4M3_MAX = 448.0
NAN_F32_BITS = 0x7FFFFFFF         # the NaN the decoders produce (the GPU's canonical fp32 NaN)
E8M0_NAN = 255
E4M3_NAN_CODES = (0x7F, 0xFF)


def _e4m3_value_table() -> np.ndarray:
    """float32 [256]: the value of every e4m3 code, from the bit layout."""
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    E = (code >> 3) & 0xF
    M = code & 0x7
    mag = np.where(E > 0, (8 + M) * np.exp2(E - 10.0), M * 2.0 ** -9)
    values = (sign * mag).astype(np.float32)
    values[[0x7F, 0xFF]] = np.uint32(NAN_F32_BITS).view(np.float32)
    return values


def _e8m0_value_table() -> np.ndarray:
    """float32 [256]: 2^(e - 127) for e = 0..254 (2^-127 is an fp32 subnormal, exact); 255 is NaN."""
    values = np.empty(256, dtype=np.float32)
    values[:E8M0_NAN] = np.exp2(np.arange(E8M0_NAN) - 127.0)
    values[E8M0_NAN] = np.uint32(NAN_F32_BITS).view(np.float32)
    return values


E4M3_VALUES = _e4m3_value_table()   # [256] float32, code -> value
E8M0_VALUES = _e8m0_value_table()   # [256] float32, byte -> scale


# Rows: checks, split and assembly -------------------------------------------------------------

def check_rows_fp8(raw, name: str = "raw") -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = _as_bytes(raw, name)
    if raw.ndim != 2 or raw.shape[1] != FP8_ROW_BYTES:
        raise ValueError(f"{name} must be uint8 [n, {FP8_ROW_BYTES}] fp8 rows (256 e4m3 codes, then 8 e8m0 "
                         f"scales), got shape {raw.shape}")
    return raw


def _as_bytes(a, name: str) -> np.ndarray:
    """ml_dtypes float8 views (float8_e4m3fn, float8_e8m0fnu) and int8 as their uint8 bytes."""
    if a.dtype.itemsize == 1 and a.dtype.kind in "iuV" or a.dtype.name.startswith("float8"):
        return a.view(np.uint8)
    raise ValueError(f"{name} must be uint8 bytes (or an fp8/int8 view of them), got dtype {a.dtype}")


def split_rows_fp8(raw) -> tuple[np.ndarray, np.ndarray]:
    """264-byte rows [n, 264] -> (codes [n, 256], scales [n, 8]) uint8 views."""
    raw = check_rows_fp8(raw)
    return raw[:, :ROW_VALUES], raw[:, ROW_VALUES:]


def assemble_rows_fp8(codes, scales, out: np.ndarray | None = None) -> np.ndarray:
    """codes [n, 256] e4m3 + scales [n, 8] e8m0 (uint8, or ml_dtypes fp8 views) -> 264-byte rows
    [n, 264] uint8, codes first (the ds4 layout and the rows stage's raw fp8 row)."""
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    codes = codes if codes.dtype == np.uint8 else _as_bytes(codes, "codes")
    scales = scales if scales.dtype == np.uint8 else _as_bytes(scales, "scales")
    if codes.ndim != 2 or codes.shape[1] != ROW_VALUES:
        raise ValueError(f"codes must be [n, {ROW_VALUES}] e4m3 bytes, got shape {codes.shape}")
    if scales.shape != (codes.shape[0], ROW_SCALES):
        raise ValueError(f"scales must be [n={codes.shape[0]}, {ROW_SCALES}] e8m0 bytes, got shape {scales.shape}")
    if out is None:
        out = np.empty((codes.shape[0], FP8_ROW_BYTES), dtype=np.uint8)
    out[:, :ROW_VALUES] = codes
    out[:, ROW_VALUES:] = scales
    return out


# Decoders -------------------------------------------------------------------------------------

def decode_fp8_reference(raw) -> np.ndarray:
    """264-byte fp8 rows [n, 264] -> float32 [n, 256], value = e4m3(code) * e8m0(scale of its group)."""
    codes, scale_bytes = split_rows_fp8(raw)                  # [n, 256], [n, 8]
    group = np.arange(ROW_VALUES) // GROUP                    # [256] value -> its scale
    with np.errstate(over="ignore"):      # scale bytes >= 247 overflow the largest codes to +-inf
        return E4M3_VALUES[codes] * E8M0_VALUES[scale_bytes][:, group]   # fp32 * fp32, rounded once


@njit(cache=True, inline="always")
def e4m3_value_f64(code):  # pragma: no cover - jitted
    """Value of one non-NaN e4m3 code as float64 (exact), from its bits."""
    mag = np.int64(code) & 0x7F
    E = mag >> 3
    M = mag & 7
    v = math.ldexp(np.float64(8 + M), E - 10) if E > 0 else math.ldexp(np.float64(M), -9)
    return -v if np.int64(code) & 0x80 else v


@njit(cache=True, inline="always")
def e8m0_value_f64(byte):  # pragma: no cover - jitted
    """2^(e - 127) of one non-NaN e8m0 byte (e < 255) as float64 (exact)."""
    return math.ldexp(1.0, np.int64(byte) - 127)


@njit(cache=True, parallel=True)
def _decode_rows(raw, out, out_bits):  # pragma: no cover - jitted
    # The product of two exact values is exact in float64; rounding it to fp32 once is what the
    # reference's fp32 multiply does. NaN values are written as bits (0x7FFFFFFF), not computed.
    for r in prange(raw.shape[0]):
        for g in range(ROW_SCALES):
            sb = raw[r, ROW_VALUES + g]
            s = e8m0_value_f64(sb) if sb != E8M0_NAN else 0.0
            for i in range(GROUP):
                e = g * GROUP + i
                c = raw[r, e]
                if sb == E8M0_NAN or (c & 0x7F) == 0x7F:
                    out_bits[r, e] = np.uint32(NAN_F32_BITS)
                else:
                    out[r, e] = np.float32(e4m3_value_f64(c) * s)
    return out


def decode_fp8_cpu(raw, out=None) -> np.ndarray:
    """@njit decoder, bit-exact with `decode_fp8_reference`: uint8 [n, 264] -> float32 [n, 256]."""
    raw = np.ascontiguousarray(check_rows_fp8(raw))
    if out is None:
        out = np.empty((raw.shape[0], ROW_VALUES), dtype=np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (raw.shape[0], ROW_VALUES)):
        raise ValueError(f"out must be float32 [{raw.shape[0]}, {ROW_VALUES}]")
    return _decode_rows(raw, out, out.view(np.uint32))


# Encoding: e4m3 rounding and power-of-two scales -----------------------------------------------

def ceil_log2_f32(r) -> np.ndarray:
    """ceil(log2 r) of positive fp32 values, read off the bits: the unbiased exponent, plus 1 if
    the mantissa is non-zero (DeepSeek's rule for normal numbers). Subnormals are handled exactly
    (frexp) and give exponents below -126. int32, same shape."""
    r = np.ascontiguousarray(r, dtype=np.float32)
    bits = r.view(np.uint32)
    exp_field = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32)
    out = exp_field - 127 + ((bits & np.uint32(0x7FFFFF)) != 0).astype(np.int32)
    sub = exp_field == 0
    if sub.any():
        m, e = np.frexp(r[sub].astype(np.float64))               # r = m * 2^e, 0.5 <= m < 1
        out[sub] = np.where(m == 0.5, e - 1, e)
    return out


def fp8_scale_exponents(amax) -> np.ndarray:
    """The e8m0 exponent k (scale 2^k) of groups with these fp32 amax values: the smallest k with
    amax / 2^k <= 448, i.e. k = ceil(log2(amax / 448)), limited to e8m0's [-127, 127]; an all-zero
    group takes k = 0. int32."""
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(under="ignore"):
        ratio = amax / np.float32(E4M3_MAX)
    k = np.zeros(amax.shape, dtype=np.int32)
    pos = ratio > 0
    if pos.any():
        k[pos] = ceil_log2_f32(ratio[pos])
    return np.clip(k, -127, 127)


def e4m3_encode(v) -> np.ndarray:
    """fp32 values with |v| <= 448 -> the e4m3 code of the nearest e4m3 value, ties to even
    (uint8). Normal range: round the fp32 mantissa to 3 bits (a carry moves to the exponent);
    below 2^-6 (subnormal e4m3): round v * 2^9 to an integer M, so the code is M. The sign bit is
    kept, also for values that round to zero."""
    v = np.ascontiguousarray(v, dtype=np.float32)
    if not np.all(np.abs(v) <= np.float32(E4M3_MAX)):
        raise ValueError("e4m3_encode takes finite values with |v| <= 448 (clamp first)")
    u = v.view(np.uint32) & np.uint32(0x7FFFFFFF)                            # |v| bits
    a = u.view(np.float32)
    normal = ((u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
    sub = np.rint(a * np.float32(512.0)).astype(np.uint32)                    # RNE, 0..8
    code = np.where(a < np.float32(2.0 ** -6), sub, normal).astype(np.uint8)
    return code | ((v.view(np.uint32) >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)


def e4m3_round(v) -> np.ndarray:
    """fp32 values with |v| <= 448 -> the nearest e4m3 value (ties to even), as fp32."""
    return E4M3_VALUES[e4m3_encode(v)]


def _check_finite(x, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise ValueError(f"{what} must be floating-point values, got dtype {x.dtype}")
    with np.errstate(over="ignore"):
        x = np.ascontiguousarray(x, dtype=np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what} must be finite in float32, got {x[idx]} at index {idx}")
    return x


def quantize_with_exponents(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    """e4m3 codes of x / 2^k (k broadcast to x), clamped to +-448 first: uint8, x's shape."""
    with np.errstate(under="ignore"):
        scaled = np.ldexp(x, -k.astype(np.int32)).astype(np.float32)           # exact unless subnormal
    return e4m3_encode(np.clip(scaled, -E4M3_MAX, E4M3_MAX))


def encode_rows_fp8(x) -> tuple[np.ndarray, np.ndarray]:
    """Rows float32 [n, 256] -> (codes uint8 [n, 256], scales uint8 [n, 8]), a faithful FP8
    encoder: per group of 32 values the power-of-two scale 2^k with k = ceil(log2(amax / 448))
    (so the group's largest value fits e4m3's 448), then each x / 2^k rounded to the nearest e4m3
    value, ties to even. Decoding gives back x to within half an e4m3 step (3 mantissa bits).
    Raises ValueError for a wrong shape or a non-finite value."""
    x = _check_finite(x, "rows")
    if x.ndim != 2 or x.shape[1] != ROW_VALUES:
        raise ValueError(f"rows must be [n, {ROW_VALUES}], got shape {x.shape}")
    n = x.shape[0]
    groups = x.reshape(n, ROW_SCALES, GROUP)                                   # [n, 8, 32]
    k = fp8_scale_exponents(np.abs(groups).max(axis=2, initial=0.0))           # [n, 8]
    codes = quantize_with_exponents(groups, k[:, :, None]).reshape(n, ROW_VALUES)
    return codes, (k + 127).astype(np.uint8)
