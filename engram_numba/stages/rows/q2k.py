"""Q2_K rows: one 84-byte Q2_K super-block holds one 256-value table row.

Block layout (docs/math.md, section 4.1), bytes:
     0..15  scales  one byte per 16 values: low nibble = scale, high nibble = min
    16..79  qs      2-bit quants, four per byte
    80..81  d       fp16 super-scale of the scales
    82..83  dmin    fp16 super-scale of the mins
Value e (0..255): n = e//128, w = e%128, j = w//32, h = (w%32)//16, l = w%16
    sc = scales[8n + 2j + h];  q = (qs[32n + 16h + l] >> 2j) & 3
    y  = (d * (sc & 15)) * q - (dmin * (sc >> 4))        # fp32, in this order, no FMA

`dequantize` is the numpy reference (bit-exact with `gguf.quants.dequantize`); `dequantize_cpu`
is the @njit decoder; `quantize` is this package's own encoder (gguf-py has none for Q2_K).

The encoder, in three passes (the idea of llama.cpp's make_qkx2_quants, with its own choices):
  1. per 16-value sub-block, a float scale and min (min <= 0) that minimise the squared error for
     q in 0..3: a sweep of candidate step sizes, each followed by a least-squares refit;
  2. per row, fp16 super-scales d = max scale / 15 and dmin = max min / 15 (and a few nearby
     divisors, keeping whichever gives the row the least error);
  3. per sub-block, the 4-bit (scale, min) codes chosen by trying the codes within +-2 of the
     rounded ones, each with q re-rounded against the *decoded* fp32 step and offset, keeping the
     pair with the least squared error. Rounding scale and min to 4 bits independently costs
     about 3 % RMS on Gaussian rows and 8 % on heavy-tailed ones; this search wins most of it back.
Only squared error is minimised, with uniform weights: llama.cpp's reference encoder weights by |x|
and scores absolute error, while this toolkit reports relative RMS error (a sketch of that
weighting measured 0.30 against this encoder's 0.26 on Gaussian rows).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...bf16 import BF16, f32_to_bf16
from .encodings import ROW_VALUES

ENGRAM_ROW_BYTES = 84
_SCALES, _QS, _D, _DMIN = 0, 16, 80, 82


def check_blocks(blocks, name: str = "blocks") -> np.ndarray:
    """Validate a [n, 84] uint8 array of Q2_K blocks (or a flat byte buffer of whole blocks)."""
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8:
        raise ValueError(f"{name} must be uint8 Q2_K bytes, got dtype {blocks.dtype}")
    if blocks.ndim == 1:
        if blocks.size % ENGRAM_ROW_BYTES:
            raise ValueError(f"{name}: {blocks.size} bytes is not a whole number of {ENGRAM_ROW_BYTES}-byte Q2_K blocks")
        blocks = blocks.reshape(-1, ENGRAM_ROW_BYTES)
    if blocks.ndim != 2 or blocks.shape[1] != ENGRAM_ROW_BYTES:
        raise ValueError(f"{name} must be [n, {ENGRAM_ROW_BYTES}] Q2_K blocks, got shape {blocks.shape}")
    return blocks


def dequantize(blocks) -> np.ndarray:
    """Reference decoder: uint8 [n, 84] -> float32 [n, 256], written to be read."""
    blocks = check_blocks(blocks)
    n = blocks.shape[0]
    scales = blocks[:, _SCALES:_QS]                                      # [n, 16]
    qs = blocks[:, _QS:_D]                                               # [n, 64]
    d = np.ascontiguousarray(blocks[:, _D:_DMIN]).view(np.float16).astype(np.float32)       # [n, 1]
    dmin = np.ascontiguousarray(blocks[:, _DMIN:]).view(np.float16).astype(np.float32)      # [n, 1]

    e = np.arange(ROW_VALUES)
    half, w = e // 128, e % 128
    j, h, l = w // 32, (w % 32) // 16, w % 16
    sc = scales[:, 8 * half + 2 * j + h]                                 # [n, 256]
    q = (qs[:, 32 * half + 16 * h + l] >> (2 * j).astype(np.uint8)) & np.uint8(3)
    scale = d * (sc & 15).astype(np.float32)
    offset = dmin * (sc >> 4).astype(np.float32)
    return (scale * q.astype(np.float32) - offset).astype(np.float32).reshape(n, ROW_VALUES)


def dequantize_to_bf16(blocks) -> np.ndarray:
    """Reference rows as the projection sees them: uint16 bf16 words [n, 256]."""
    return f32_to_bf16(dequantize(blocks))


@njit(cache=True)
def _half_to_f32(lo, hi):  # pragma: no cover - jitted
    """IEEE fp16 bits (two little-endian bytes) -> fp32, exact (subnormals, inf, nan)."""
    bits = np.uint32(lo) | (np.uint32(hi) << np.uint32(8))
    sign = (bits >> np.uint32(15)) & np.uint32(1)
    exp = (bits >> np.uint32(10)) & np.uint32(0x1F)
    man = bits & np.uint32(0x3FF)
    if exp == 0:
        val = np.float32(man) * np.float32(2.0 ** -24)  # subnormal (or zero): exact in fp32
    elif exp == 31:
        val = np.float32(np.inf) if man == 0 else np.float32(np.nan)
    else:
        out_bits = np.uint32(((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13)))
        val = np.array([out_bits], dtype=np.uint32).view(np.float32)[0]
    return -val if sign else val


@njit(cache=True, parallel=True)
def _dequantize_rows(blocks, out):  # pragma: no cover - jitted
    for r in prange(blocks.shape[0]):
        d = _half_to_f32(blocks[r, _D], blocks[r, _D + 1])
        dmin = _half_to_f32(blocks[r, _DMIN], blocks[r, _DMIN + 1])
        for sub in range(16):  # sub-block = 8n + 2j + h
            half = sub // 8
            j = (sub % 8) // 2
            h = sub % 2
            sc = blocks[r, _SCALES + sub]
            scale = d * np.float32(sc & 15)
            offset = dmin * np.float32(sc >> 4)
            base = half * 128 + j * 32 + h * 16
            for l in range(16):
                q = (blocks[r, _QS + 32 * half + 16 * h + l] >> (2 * j)) & 3
                out[r, base + l] = scale * np.float32(q) - offset
    return out


def dequantize_cpu(blocks, out=None) -> np.ndarray:
    """@njit decoder, bit-exact with `dequantize`: uint8 [n, 84] -> float32 [n, 256]."""
    blocks = np.ascontiguousarray(check_blocks(blocks))
    if out is None:
        out = np.empty((blocks.shape[0], ROW_VALUES), dtype=np.float32)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32
              and out.shape == (blocks.shape[0], ROW_VALUES)):
        # The jitted loop does no bounds checks: a short `out` would be written past its end.
        raise ValueError(f"out must be float32 [{blocks.shape[0]}, {ROW_VALUES}], got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    return _dequantize_rows(blocks, out)


# Encoder -------------------------------------------------------------------------------------

_FIT_STEPS = 16          # candidate step sizes per sub-block: (3 - 0.5 + 0.1 k) / (max - min)
_CODE_RADIUS = 2         # 4-bit codes tried on each side of the rounded scale and min
# (divisor of the largest sub-block scale, of the largest min) -> super-scales d, dmin. The
# largest code need not be 15: a row whose big sub-blocks sit near 13/14 of the largest does
# better with d = max/14 or max/13. The first pair is the plain choice every row starts from.
_SUPER_DIVISORS = ((15, 15), (14, 15), (13, 15), (15, 14), (15, 13))
_F16_MAX = float(np.finfo(np.float16).max)


@njit(cache=True, nogil=True)
def _fit_subblock(x):  # pragma: no cover - jitted
    """Float (scale, m) with x ~ scale*q - m, q in 0..3, m >= 0, for one sub-block x [16] float64."""
    n = x.size
    xmin = min(x.min(), 0.0)  # Q2_K subtracts a non-negative min, so the offset can only go down
    xmax = x.max()
    m0 = -xmin if xmin < 0.0 else 0.0  # never -0.0: it would be stored as a negative fp16 dmin
    if xmax <= xmin:
        return 0.0, m0  # constant (or all-zero) sub-block: the min alone reproduces it
    sx = x.sum()
    qv = np.empty(n)  # [16] float64
    # Start from the plain min/max grid, so a sweep can only improve on it.
    best_scale = (xmax - xmin) / 3.0
    best_min = xmin
    best_err = 0.0
    for i in range(n):
        q = min(3.0, max(0.0, np.rint((x[i] - xmin) / best_scale)))
        diff = best_scale * q + xmin - x[i]
        best_err += diff * diff
    for k in range(_FIT_STEPS):
        inv_step = (2.5 + 0.1 * k) / (xmax - xmin)
        sq = 0.0
        sq2 = 0.0
        sxq = 0.0
        for i in range(n):
            q = min(3.0, max(0.0, np.rint(inv_step * (x[i] - xmin))))
            qv[i] = q
            sq += q
            sq2 += q * q
            sxq += q * x[i]
        det = n * sq2 - sq * sq
        if det <= 0.0:
            continue  # every value on one level: the refit is singular
        scale = (n * sxq - sx * sq) / det
        mn = (sq2 * sx - sq * sxq) / det
        if mn > 0.0:
            mn = 0.0  # a positive offset cannot be stored; refit the scale alone
            scale = sxq / sq2
        if scale <= 0.0:
            continue
        err = 0.0
        for i in range(n):
            diff = scale * qv[i] + mn - x[i]
            err += diff * diff
        if err < best_err:
            best_err = err
            best_scale = scale
            best_min = mn
    return best_scale, (-best_min if best_min < 0.0 else 0.0)


@njit(cache=True, parallel=True)
def _fit_rows(rows, scale, m):  # pragma: no cover - jitted
    """rows [n, 256] float32 -> float sub-block scale [n, 16] and min m [n, 16] (float64)."""
    for r in prange(rows.shape[0]):
        for j in range(16):
            s, mm = _fit_subblock(rows[r, 16 * j:16 * j + 16].astype(np.float64))
            scale[r, j] = s
            m[r, j] = mm


@njit(cache=True, nogil=True)
def _levels_error(x, step, offset, q_out):  # pragma: no cover - jitted
    """Nearest q in 0..3 for each x [16] under decode y = step*q - offset (fp32, as the decoder
    computes it); writes q_out [16] and returns the squared error in float64."""
    err = 0.0
    inv_step = 1.0 / np.float64(step) if step > 0.0 else 0.0  # q = 0 when the step is zero
    for i in range(x.size):
        q = min(3.0, max(0.0, np.rint((np.float64(x[i]) + offset) * inv_step)))
        y = step * np.float32(q) - offset  # float32 * float32 - float32, no FMA: the decoder's value
        diff = np.float64(y) - np.float64(x[i])
        err += diff * diff
        q_out[i] = np.uint8(q)
    return err


@njit(cache=True, parallel=True)
def _choose_codes(rows, scale, m, d, dmin, radius, codes, q, err):  # pragma: no cover - jitted
    """Pick each sub-block's 4-bit scale and min codes given the row's fp16 super-scales.

    rows [n, 256] f32; scale, m [n, 16] f64; d, dmin [n] f32 (exact fp16 values; a row with a
    non-finite one is skipped with err = inf);
    out: codes [n, 16] uint8 (scale | min << 4), q [n, 256] uint8, err [n] f64 squared error.
    """
    for r in prange(rows.shape[0]):
        if not (np.isfinite(d[r]) and np.isfinite(dmin[r])):
            err[r] = np.inf
            continue
        trial = np.empty(16, dtype=np.uint8)
        total = 0.0
        for j in range(16):
            x = rows[r, 16 * j:16 * j + 16]
            c0 = 0 if d[r] == 0.0 else int(min(15.0, np.rint(scale[r, j] / d[r])))
            m0 = 0 if dmin[r] == 0.0 else int(min(15.0, np.rint(m[r, j] / dmin[r])))
            c_hi = 0 if d[r] == 0.0 else min(15, c0 + radius)
            m_hi = 0 if dmin[r] == 0.0 else min(15, m0 + radius)
            best = np.inf
            for c in range(max(0, c0 - radius), c_hi + 1):
                step = d[r] * np.float32(c)
                for mc in range(max(0, m0 - radius), m_hi + 1):
                    e = _levels_error(x, step, dmin[r] * np.float32(mc), trial)
                    if e < best:
                        best = e
                        codes[r, j] = np.uint8(c | (mc << 4))
                        q[r, 16 * j:16 * j + 16] = trial
            total += best
        err[r] = total


def _pack_blocks(codes, q, d, dmin) -> np.ndarray:
    """Assemble Q2_K blocks [n, 84] uint8 from codes [n, 16] uint8 (scale | min << 4), quants
    q [n, 256] in 0..3 and fp16 super-scales d, dmin [n]."""
    n = codes.shape[0]
    out = np.empty((n, ENGRAM_ROW_BYTES), dtype=np.uint8)
    out[:, _SCALES:_QS] = codes
    # Value e = 128n + 32j + 16h + l sits in byte 32n + 16h + l at bits 2j.
    q5 = np.asarray(q, dtype=np.uint8).reshape(n, 2, 4, 2, 16)         # [n, half, j, h, l]
    qs = q5[:, :, 0] | (q5[:, :, 1] << 2) | (q5[:, :, 2] << 4) | (q5[:, :, 3] << 6)  # [n, half, h, l]
    out[:, _QS:_D] = qs.reshape(n, 64)
    out[:, _D:_DMIN] = np.asarray(d, dtype=np.float16).reshape(n, 1).view(np.uint8)
    out[:, _DMIN:] = np.asarray(dmin, dtype=np.float16).reshape(n, 1).view(np.uint8)
    return out


def _check_rows(rows) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.dtype == BF16:
        rows = rows.astype(np.float32)  # ml_dtypes.bfloat16 is not a numpy floating subtype
    if not np.issubdtype(rows.dtype, np.floating):
        raise ValueError(
            f"rows must be float32 values (a floating dtype), got dtype {rows.dtype}"
            + (" (bf16 words? widen them with bf16_to_f32 first)" if rows.dtype == np.uint16 else ""))
    if rows.ndim != 2 or rows.shape[1] != ROW_VALUES:
        raise ValueError(f"rows must be [n, {ROW_VALUES}] (one Q2_K block per row), got shape {rows.shape}")
    with np.errstate(over="ignore"):
        rows = np.ascontiguousarray(rows, dtype=np.float32)
    finite = np.isfinite(rows)
    if not finite.all():
        r, c = np.argwhere(~finite)[0]
        raise ValueError(f"rows must be finite in float32, got {rows[r, c]} at row {r}, value {c}")
    return rows


def quantize(rows) -> np.ndarray:
    """Encode rows float32 [n, 256] as Q2_K blocks uint8 [n, 84] (see the module docstring).

    Any floating dtype is accepted and taken as float32. Raises ValueError for a wrong dtype or
    shape, a value that is not finite in float32, or a row that needs a super-scale beyond fp16
    (d holds sub-block ranges up to about 3 * 15 * 65504 = 2.9e6, dmin minima down to about
    -15 * 65504 = -9.8e5). Rows so small that the fp16 super-scales underflow (below about 1e-7)
    decode to zeros, as they would in llama.cpp.
    """
    rows = _check_rows(rows)
    n = rows.shape[0]
    scale = np.zeros((n, 16), dtype=np.float64)
    m = np.zeros((n, 16), dtype=np.float64)
    if n:
        _fit_rows(rows, scale, m)
    max_scale = scale.max(axis=1, initial=0.0)    # [n]
    max_m = m.max(axis=1, initial=0.0)            # [n]

    best_err = np.full(n, np.inf)
    codes = np.zeros((n, 16), dtype=np.uint8)
    q = np.zeros((n, ROW_VALUES), dtype=np.uint8)
    d = np.zeros(n, dtype=np.float16)
    dmin = np.zeros(n, dtype=np.float16)
    for k, (div_d, div_m) in enumerate(_SUPER_DIVISORS):
        with np.errstate(over="ignore"):
            d_try = (max_scale / div_d).astype(np.float16)     # [n]
            dmin_try = (max_m / div_m).astype(np.float16)      # [n]
        if k == 0:
            # The smallest super-scales of all candidates: if these overflow, nothing fits.
            for name, sup in (("d", d_try), ("dmin", dmin_try)):
                if not np.isfinite(sup).all():
                    r = int(np.argmax(~np.isfinite(sup)))
                    raise ValueError(
                        f"row {r} (max |value| {float(np.abs(rows[r]).max()):.6g}) needs an fp16 "
                        f"super-scale {name} above the fp16 maximum {_F16_MAX:.6g}")
        codes_try = np.zeros_like(codes)
        q_try = np.zeros_like(q)
        err_try = np.full(n, np.inf)
        if n:
            _choose_codes(rows, scale, m, d_try.astype(np.float32), dmin_try.astype(np.float32),
                          _CODE_RADIUS, codes_try, q_try, err_try)
        better = err_try < best_err
        if k == 0:
            better[:] = True  # every row takes the first candidate, even one with zero error
        best_err[better] = err_try[better]
        codes[better] = codes_try[better]
        q[better] = q_try[better]
        d[better] = d_try[better]
        dmin[better] = dmin_try[better]
    return _pack_blocks(codes, q, d, dmin)
