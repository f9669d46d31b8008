"""Q3_K, Q4_K and Q8_0 rows: the other GGML types published schema-A tables use.

One 256-value table row is one Q3_K or Q4_K super-block, or eight Q8_0 blocks of 32 values.
The numpy decoders below are written to be read and are bit-exact with `gguf.quants.dequantize`
(the tests check it; gguf-py is not needed at runtime). Every product in them is exact in fp32
(a code of at most 8 bits times an fp16 value of 11 significant bits times a 6-bit scale), so
the only rounding before bf16 is Q4_K's final subtraction, done after the products as gguf-py
does. docs/math.md section 4 draws the layouts.

Q3_K, 110 bytes (value e = 0..255; n = e//128, w = e%128, j = w//32, h = (w%32)//16, l = w%16):
     0..31   hmask   high bit of each 3-bit code: bit (4n + j) of hmask[w % 32]
    32..95   qs      low 2 bits: (qs[32n + 16h + l] >> 2j) & 3
    96..107  scales  sixteen 6-bit scales, s = e // 16: low 4 bits in nibble s//8 of byte s%8,
                     high 2 bits at bit 2*(s//4) of byte 8 + s%4; the scale is that minus 32
   108..109  d       fp16
    q = low - (0 if high bit else 4)  (-4..3);   y = (d * scale) * q
Q4_K, 144 bytes (s = e // 32, l = e % 32):
     0..1 d, 2..3 dmin (fp16);  4..15 scales: eight 6-bit scales sc and mins m
                     s < 4: sc = b[s] & 63,  m = b[s+4] & 63
                     s >= 4: sc = (b[s+4] & 15) | (b[s-4] >> 6) << 4,  m = (b[s+4] >> 4) | (b[s] >> 6) << 4
    16..143  qs      4-bit codes: q = (qs[32*(s//2) + l] >> 4*(s%2)) & 15
    y = (d * sc) * q - (dmin * m)
Q8_0, 34 bytes a block, 8 blocks a row (block b = e // 32, i = e % 32):
    bytes 0..1 d (fp16), 2..33 q[32] (int8);   y = d * q[i]

`quantize_q8_0` is ggml's (and gguf-py's) Q8_0 encoder, bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .encodings import ROW_VALUES
from .q2k import _half_to_f32

Q3_K_BYTES = 110
Q4_K_BYTES = 144
Q8_0_BLOCK_VALUES = 32
Q8_0_BLOCK_BYTES = 34
Q8_0_ROW_BYTES = ROW_VALUES // Q8_0_BLOCK_VALUES * Q8_0_BLOCK_BYTES   # 272

# Q3_K byte offsets
_Q3_HMASK, _Q3_QS, _Q3_SCALES, _Q3_D = 0, 32, 96, 108
# Q4_K byte offsets
_Q4_D, _Q4_DMIN, _Q4_SCALES, _Q4_QS = 0, 2, 4, 16


def _check(raw, name: str, width: int, what: str) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"{name} must be uint8 {what} bytes, got dtype {raw.dtype}")
    if raw.ndim != 2 or raw.shape[1] != width:
        raise ValueError(f"{name} must be uint8 [n, {width}] {what} rows, got shape {raw.shape}")
    return raw


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian fp16 bytes -> float32 [..., 1], exact."""
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32)


_E = np.arange(ROW_VALUES)   # value index within a row


# Q3_K -------------------------------------------------------------------------------------------

def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """The sixteen signed sub-block scales of Q3_K blocks: scales bytes [n, 12] -> int32 [n, 16]."""
    s = np.arange(16)
    low = (scales[:, s % 8] >> (4 * (s // 8))) & 0xF
    high = (scales[:, 8 + s % 4] >> (2 * (s // 4))) & 0x3
    return (low | (high << 4)).astype(np.int32) - 32


def dequantize_q3_k(raw) -> np.ndarray:
    """Reference decoder: Q3_K rows uint8 [n, 110] -> float32 [n, 256]."""
    raw = _check(raw, "raw", Q3_K_BYTES, "Q3_K")
    hmask = raw[:, _Q3_HMASK:_Q3_QS]                                   # [n, 32]
    qs = raw[:, _Q3_QS:_Q3_SCALES]                                     # [n, 64]
    scale = q3_k_scales(raw[:, _Q3_SCALES:_Q3_D]).astype(np.float32)   # [n, 16]
    d = _f16(raw[:, _Q3_D:])                                           # [n, 1]

    half, w = _E // 128, _E % 128
    j, h, l = w // 32, (w % 32) // 16, w % 16
    low = (qs[:, 32 * half + 16 * h + l] >> (2 * j)) & 3                # [n, 256]
    high = (hmask[:, w % 32] >> (4 * half + j)) & 1
    q = (low.astype(np.int32) - 4 * (1 - high.astype(np.int32))).astype(np.float32)
    dl = d * scale                                                      # [n, 16], exact
    return dl[:, _E // 16] * q                                          # exact


# Q4_K -------------------------------------------------------------------------------------------

def q4_k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K blocks: scales bytes [n, 12] -> (sc, m) int32 [n, 8]."""
    b = scales.astype(np.int32)
    sc = np.empty((b.shape[0], 8), dtype=np.int32)
    m = np.empty_like(sc)
    for s in range(8):
        if s < 4:
            sc[:, s] = b[:, s] & 63
            m[:, s] = b[:, s + 4] & 63
        else:
            sc[:, s] = (b[:, s + 4] & 0xF) | ((b[:, s - 4] >> 6) << 4)
            m[:, s] = (b[:, s + 4] >> 4) | ((b[:, s] >> 6) << 4)
    return sc, m


def dequantize_q4_k(raw) -> np.ndarray:
    """Reference decoder: Q4_K rows uint8 [n, 144] -> float32 [n, 256]."""
    raw = _check(raw, "raw", Q4_K_BYTES, "Q4_K")
    d = _f16(raw[:, _Q4_D:_Q4_DMIN])                                   # [n, 1]
    dmin = _f16(raw[:, _Q4_DMIN:_Q4_SCALES])                           # [n, 1]
    sc, m = q4_k_scales_mins(raw[:, _Q4_SCALES:_Q4_QS])                # [n, 8] each
    qs = raw[:, _Q4_QS:]                                               # [n, 128]

    s, l = _E // 32, _E % 32
    q = ((qs[:, 32 * (s // 2) + l] >> (4 * (s % 2))) & 0xF).astype(np.float32)   # [n, 256]
    scale = d * sc.astype(np.float32)                                   # [n, 8], exact
    offset = dmin * m.astype(np.float32)                                # [n, 8], exact
    return scale[:, s] * q - offset[:, s]                               # one rounding: the subtraction


# Q8_0 -------------------------------------------------------------------------------------------

def _check_q8_0(raw, name: str = "raw") -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"{name} must be uint8 Q8_0 bytes, got dtype {raw.dtype}")
    if raw.ndim != 2 or raw.shape[1] % Q8_0_BLOCK_BYTES:
        raise ValueError(f"{name} must be uint8 [n, 34*blocks] Q8_0 rows, got shape {raw.shape}")
    return raw


def dequantize_q8_0(raw) -> np.ndarray:
    """Reference decoder: Q8_0 rows uint8 [n, 34*B] (B blocks of 32 values; a table row is
    B = 8, 272 bytes) -> float32 [n, 32*B]."""
    raw = _check_q8_0(raw)
    n, B = raw.shape[0], raw.shape[1] // Q8_0_BLOCK_BYTES
    blocks = raw.reshape(n, B, Q8_0_BLOCK_BYTES)
    d = _f16(blocks[:, :, 0:2])                                         # [n, B, 1]
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).astype(np.float32)   # [n, B, 32]
    return (d * q).reshape(n, B * Q8_0_BLOCK_VALUES)                    # exact


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: to the nearest integer, halves away from zero (ggml's Q8_0 rounding), exactly
    (the fraction a - floor(a) is exact in fp32, unlike floor(a + 0.5))."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.sign(v) * (fl + (a - fl >= np.float32(0.5)).astype(v.dtype))


def quantize_q8_0(x) -> np.ndarray:
    """float32 [n, k] (k % 32 == 0) -> Q8_0 rows uint8 [n, k/32*34], as ggml quantizes: per block
    d = amax / 127 (fp32), codes roundf(x * (1/d)) (halves away from zero; 0 when d = 0), d stored
    as fp16. Raises ValueError for a non-finite value or a block whose d overflows fp16."""
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise ValueError(f"x must be floating-point values, got dtype {x.dtype}")
    with np.errstate(over="ignore"):
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % Q8_0_BLOCK_VALUES:
        raise ValueError(f"x must be [n, k] with k a multiple of {Q8_0_BLOCK_VALUES}, got shape {x.shape}")
    bad = ~np.isfinite(x)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"x must be finite in float32, got {x[r, c]} at row {r}, value {c}")
    n, k = x.shape
    blocks = x.reshape(n * k // Q8_0_BLOCK_VALUES, Q8_0_BLOCK_VALUES)   # [n*B, 32]
    d = np.abs(blocks).max(axis=1, keepdims=True, initial=0.0) / np.float32(127)   # [n*B, 1] fp32
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = _roundf(blocks * inv).astype(np.int8)                           # |q| <= 127
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
    if not np.isfinite(d16).all():
        i = int(np.argmax(~np.isfinite(d16).ravel()))
        raise ValueError(f"row {i // (k // 32)}, block {i % (k // 32)}: max |x| "
                         f"{float(d[i, 0]) * 127:.6g} needs an fp16 scale above the fp16 maximum 65504")
    out = np.empty((n * k // Q8_0_BLOCK_VALUES, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(n, k // Q8_0_BLOCK_VALUES * Q8_0_BLOCK_BYTES)


# @njit decoders (bit-exact with the numpy ones) --------------------------------------------------

@njit(cache=True, parallel=True)
def _q3_k_rows(raw, out):  # pragma: no cover - jitted
    for r in prange(raw.shape[0]):
        d = _half_to_f32(raw[r, _Q3_D], raw[r, _Q3_D + 1])
        for sub in range(16):                       # sub-block = 8n + 2j + h
            half = sub // 8
            j = (sub % 8) // 2
            h = sub % 2
            low4 = (raw[r, _Q3_SCALES + sub % 8] >> (4 * (sub // 8))) & 0xF
            high2 = (raw[r, _Q3_SCALES + 8 + sub % 4] >> (2 * (sub // 4))) & 0x3
            dl = d * np.float32(np.int32(low4 | (high2 << 4)) - 32)
            base = half * 128 + j * 32 + h * 16
            for l in range(16):
                low = (raw[r, _Q3_QS + 32 * half + 16 * h + l] >> (2 * j)) & 3
                high = (raw[r, _Q3_HMASK + 16 * h + l] >> (4 * half + j)) & 1
                q = np.int32(low) - (0 if high else 4)
                out[r, base + l] = dl * np.float32(q)
    return out


@njit(cache=True, inline="always")
def _q4_k_scale_min(raw, r, s):  # pragma: no cover - jitted
    b = _Q4_SCALES
    if s < 4:
        return raw[r, b + s] & 63, raw[r, b + s + 4] & 63
    sc = (raw[r, b + s + 4] & 0xF) | ((raw[r, b + s - 4] >> 6) << 4)
    m = (raw[r, b + s + 4] >> 4) | ((raw[r, b + s] >> 6) << 4)
    return sc, m


@njit(cache=True, parallel=True)
def _q4_k_rows(raw, out):  # pragma: no cover - jitted
    for r in prange(raw.shape[0]):
        d = _half_to_f32(raw[r, _Q4_D], raw[r, _Q4_D + 1])
        dmin = _half_to_f32(raw[r, _Q4_DMIN], raw[r, _Q4_DMIN + 1])
        for s in range(8):
            sc, m = _q4_k_scale_min(raw, r, s)
            scale = d * np.float32(sc)
            offset = dmin * np.float32(m)
            for l in range(32):
                q = (raw[r, _Q4_QS + 32 * (s // 2) + l] >> (4 * (s % 2))) & 0xF
                out[r, 32 * s + l] = scale * np.float32(q) - offset
    return out


@njit(cache=True, parallel=True)
def _q8_0_rows(raw, out):  # pragma: no cover - jitted
    n_blocks = raw.shape[1] // Q8_0_BLOCK_BYTES
    for r in prange(raw.shape[0]):
        for b in range(n_blocks):
            o = b * Q8_0_BLOCK_BYTES
            d = _half_to_f32(raw[r, o], raw[r, o + 1])
            for i in range(Q8_0_BLOCK_VALUES):
                c = np.int32(raw[r, o + 2 + i])
                q = c - 256 if c >= 128 else c
                out[r, b * Q8_0_BLOCK_VALUES + i] = d * np.float32(q)
    return out


def _run(kernel, raw, values: int, out):
    raw = np.ascontiguousarray(raw)
    if out is None:
        out = np.empty((raw.shape[0], values), dtype=np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (raw.shape[0], values)):
        raise ValueError(f"out must be float32 [{raw.shape[0]}, {values}]")   # the loops do no bounds checks
    return kernel(raw, out)


def dequantize_q3_k_cpu(raw, out=None) -> np.ndarray:
    """@njit Q3_K decoder, bit-exact with `dequantize_q3_k`: uint8 [n, 110] -> float32 [n, 256]."""
    return _run(_q3_k_rows, _check(raw, "raw", Q3_K_BYTES, "Q3_K"), ROW_VALUES, out)


def dequantize_q4_k_cpu(raw, out=None) -> np.ndarray:
    """@njit Q4_K decoder, bit-exact with `dequantize_q4_k`: uint8 [n, 144] -> float32 [n, 256]."""
    return _run(_q4_k_rows, _check(raw, "raw", Q4_K_BYTES, "Q4_K"), ROW_VALUES, out)


def dequantize_q8_0_cpu(raw, out=None) -> np.ndarray:
    """@njit Q8_0 decoder, bit-exact with `dequantize_q8_0`: uint8 [n, 34*B] -> float32 [n, 32*B]."""
    raw = _check_q8_0(raw)
    return _run(_q8_0_rows, raw, raw.shape[1] // Q8_0_BLOCK_BYTES * Q8_0_BLOCK_VALUES, out)
