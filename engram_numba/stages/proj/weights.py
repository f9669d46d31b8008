"""The projection weight `wkv` [N, K] in every stored encoding, turned into the bf16 words the
projection multiplies by (docs/math.md section 5, docs/numerics.md).

    wkv_to_bf16(raw, encoding, scales=None, chunk_rows=1024) -> uint16 [N, K] bf16 words
    encode_wkv_fp8(w float32 [N, K]) -> (codes uint8 [N, K], scales uint8 [ceil(N/32), ceil(K/32)])

encodings (`WKV_ENCODINGS`), and what `raw` is for each:
    "bf16"  uint16 [N, K] bf16 words (or an ml_dtypes.bfloat16 view): returned as is, no copy
    "f16"   float16 [N, K]: rounded to bf16, to nearest even. F16 keeps 11 significant bits and
            bf16 8, so a value moves by up to half a bf16 ulp (relative 2^-8) unless its last 3
            significant bits are zero; F16's range lies inside bf16's, so nothing overflows
    "f32"   float32 [N, K]: rounded to bf16, to nearest even
    "q2k"   uint8 [N, K/256*84]: each row K/256 Q2_K blocks; values rounded to bf16 as the tables are
    "q8_0"  uint8 [N, K/32*34]: each row K/32 Q8_0 blocks; values rounded to bf16
    "fp8"   uint8 [N, K] e4m3 codes (or an ml_dtypes.float8_e4m3fn view) and `scales` uint8
            [ceil(N/32), ceil(K/32)] e8m0 bytes (or a float8_e8m0fnu view), one per 32 x 32 tile:
            value = e4m3(code) * 2^(scale - 127), exact in bf16 for scale bytes 3..246 (as FP8 rows)
Every decode but bf16's runs `chunk_rows` rows at a time into the preallocated result, so the
peak host memory is the bf16 result plus a few chunk-sized fp32 temporaries.
"""
from __future__ import annotations

import numpy as np

from ...bf16 import BF16, f32_to_bf16
from ..rows.fp8 import E4M3_VALUES, E8M0_VALUES, fp8_scale_exponents, quantize_with_exponents
from ..rows.kquants import Q8_0_BLOCK_BYTES, Q8_0_BLOCK_VALUES, dequantize_q8_0_cpu
from ..rows.q2k import ENGRAM_ROW_BYTES as Q2K_BLOCK_BYTES
from ..rows.q2k import dequantize_cpu as q2k_dequantize_cpu

WKV_ENCODINGS = ("bf16", "f16", "f32", "q2k", "q8_0", "fp8")
# the wkv encoding of a GGUF tensor type (fp8 has no GGUF type: ds4 files store wkv as F16)
WKV_ENCODING_OF_GGML_TYPE = {"BF16": "bf16", "F16": "f16", "F32": "f32", "Q2_K": "q2k", "Q8_0": "q8_0"}
TILE = 32   # fp8 wkv: one e8m0 scale per 32 x 32 tile


def _fail(encoding: str, what: str, raw) -> ValueError:
    return ValueError(f"wkv of encoding {encoding!r} must be {what}, got {getattr(raw, 'dtype', type(raw).__name__)} "
                      f"{list(getattr(raw, 'shape', ()))}")


def _bytes(a, names: tuple) -> np.ndarray | None:
    """uint8 bytes of a, when a is uint8 or an ml_dtypes view named in `names`; else None."""
    if a.dtype == np.uint8:
        return a
    if a.dtype.name in names:
        return a.view(np.uint8)
    return None


def wkv_to_bf16(raw, encoding: str, scales=None, chunk_rows: int = 1024) -> np.ndarray:
    """The stored projection `raw` in `encoding` -> bf16 words uint16 [N, K] (see the module
    docstring for each encoding's input). Checks everything before allocating the result;
    a ValueError names the encoding and what was expected."""
    if encoding not in WKV_ENCODINGS:
        raise ValueError(f"unknown wkv encoding {encoding!r}; encodings are {list(WKV_ENCODINGS)}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    if scales is not None and encoding != "fp8":
        raise ValueError(f"scales are the tile scales of an fp8 wkv; a {encoding} wkv has none")
    raw = np.asarray(raw)
    if raw.ndim != 2:
        raise _fail(encoding, "a 2-D [N, ...] array", raw)

    if encoding == "bf16":
        if raw.dtype == BF16:
            return raw.view(np.uint16)
        if raw.dtype != np.uint16:
            raise _fail(encoding, "uint16 bf16 words (or ml_dtypes.bfloat16) [N, K]", raw)
        return raw                                                  # zero-copy

    N = raw.shape[0]
    if encoding in ("f16", "f32"):
        want = np.float16 if encoding == "f16" else np.float32
        if raw.dtype != want:
            raise _fail(encoding, f"{np.dtype(want).name} [N, K]", raw)
        K = raw.shape[1]

        def decode(r0, r1):
            return f32_to_bf16(raw[r0:r1].astype(np.float32))        # f16 -> f32 is exact: one rounding
    elif encoding == "q2k":
        if raw.dtype != np.uint8 or raw.shape[1] % Q2K_BLOCK_BYTES:
            raise _fail(encoding, f"uint8 [N, K/256*{Q2K_BLOCK_BYTES}] Q2_K blocks", raw)
        K = raw.shape[1] // Q2K_BLOCK_BYTES * 256

        def decode(r0, r1):
            blocks = np.ascontiguousarray(raw[r0:r1]).reshape(-1, Q2K_BLOCK_BYTES)
            return f32_to_bf16(q2k_dequantize_cpu(blocks)).reshape(r1 - r0, K)
    elif encoding == "q8_0":
        if raw.dtype != np.uint8 or raw.shape[1] % Q8_0_BLOCK_BYTES:
            raise _fail(encoding, f"uint8 [N, K/32*{Q8_0_BLOCK_BYTES}] Q8_0 blocks", raw)
        K = raw.shape[1] // Q8_0_BLOCK_BYTES * Q8_0_BLOCK_VALUES

        def decode(r0, r1):
            return f32_to_bf16(dequantize_q8_0_cpu(np.ascontiguousarray(raw[r0:r1])))
    else:                                                            # fp8
        codes = _bytes(raw, ("float8_e4m3fn",))
        if codes is None:
            raise _fail(encoding, "uint8 e4m3 codes (or ml_dtypes.float8_e4m3fn) [N, K]", raw)
        K = codes.shape[1]
        want = (-(-N // TILE), -(-K // TILE))
        if scales is None:
            raise ValueError(f"an fp8 wkv needs its tile scales: uint8 e8m0 [{want[0]}, {want[1]}] (one per 32 x 32 tile)")
        s = np.asarray(scales)
        sb = _bytes(s, ("float8_e8m0fnu",))
        if sb is None or sb.shape != want:
            raise ValueError(f"fp8 wkv tile scales must be uint8 e8m0 (or ml_dtypes.float8_e8m0fnu) "
                             f"[{want[0]}, {want[1]}] for a [{N}, {K}] wkv, got {s.dtype} {list(s.shape)}")
        k_tile = np.arange(K) // TILE                                 # [K] value -> its tile column

        def decode(r0, r1):
            scale = E8M0_VALUES[sb[np.arange(r0, r1) // TILE]][:, k_tile]   # [r, K] fp32 powers of two
            with np.errstate(over="ignore"):
                return f32_to_bf16(E4M3_VALUES[codes[r0:r1]] * scale)

    out = np.empty((N, K), dtype=np.uint16)                           # [N, K] bf16 words
    for r0 in range(0, N, chunk_rows):
        r1 = min(N, r0 + chunk_rows)
        out[r0:r1] = decode(r0, r1)
    return out


def encode_wkv_fp8(w) -> tuple[np.ndarray, np.ndarray]:
    """float32 [N, K] -> (codes uint8 [N, K], scales uint8 [ceil(N/32), ceil(K/32)]): DeepSeek's
    weight layout, one e8m0 power-of-two scale per 32 x 32 tile, chosen as for FP8 rows (the
    smallest 2^k with tile amax / 2^k <= 448), codes rounded to the nearest e4m3 value, ties to
    even. For fixtures and tests; raises ValueError for a non-finite value or a wrong shape."""
    w = np.asarray(w)
    if w.dtype.kind != "f":
        raise ValueError(f"w must be floating-point values, got dtype {w.dtype}")
    with np.errstate(over="ignore"):
        w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be [N, K], got shape {w.shape}")
    bad = ~np.isfinite(w)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"w must be finite in float32, got {w[r, c]} at [{r}, {c}]")
    N, K = w.shape
    tn, tk = -(-N // TILE), -(-K // TILE)
    padded = np.zeros((tn * TILE, tk * TILE), np.float32)
    padded[:N, :K] = np.abs(w)
    amax = padded.reshape(tn, TILE, tk, TILE).max(axis=(1, 3))        # [tn, tk]
    k = fp8_scale_exponents(amax)                                     # [tn, tk]
    per_value = k[np.arange(N) // TILE][:, np.arange(K) // TILE]      # [N, K]
    return quantize_with_exponents(w, per_value), (k + 127).astype(np.uint8)
