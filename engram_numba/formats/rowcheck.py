"""Which stored rows decode to values that are not finite (docs/formats.md, "Rows that decode to NaN").

A row is flagged when any of its 256 values would decode to NaN or +-inf:
    fp8    an e4m3 code 0x7F or 0xFF (NaN), an e8m0 scale byte 255 (NaN), or a finite code times
           its scale at or past 2^128 (overflows fp32 and bf16)
    q2k, q3_k, q4_k, q8_0
           an fp16 super-scale (d, dmin) that is inf or NaN (finite fp16 scales times the small
           integer codes of these formats always stay finite)
The check reads only the bytes it names, in numpy, a chunk of rows at a time; it never decodes.
"""
from __future__ import annotations

import numpy as np

# fp16 fields of one 256-value row, as byte offsets of each (little-endian) fp16 word.
FP16_FIELDS: dict[str, tuple[int, ...]] = {
    "q2k": (80, 82),                          # d, dmin after scales[16] and qs[64]
    "q3_k": (108,),                           # d after hmask[32], qs[64], scales[12]
    "q4_k": (0, 2),                           # d, dmin first
    "q8_0": tuple(34 * b for b in range(8)),  # each of the 8 blocks starts with its d
}
FP8_CODES = 256
FP8_SCALES = 8
FP8_GROUP = 32

# |value| of each e4m3 code (sign dropped), float64; NaN codes as NaN.
_E4M3_ABS = np.zeros(256, dtype=np.float64)
for _b in range(256):
    _e, _m = (_b >> 3) & 15, _b & 7
    _E4M3_ABS[_b] = (8 + _m) * 2.0 ** (_e - 10) if _e else _m * 2.0 ** -9
_E4M3_ABS[0x7F] = _E4M3_ABS[0xFF] = np.nan


def _fp16_nonfinite(raw: np.ndarray, offsets) -> np.ndarray:
    bad = np.zeros(raw.shape[0], dtype=bool)
    for off in offsets:
        word = raw[:, off].astype(np.uint16) | (raw[:, off + 1].astype(np.uint16) << 8)
        bad |= (word & 0x7C00) == 0x7C00                 # exponent all ones: inf or NaN
    return bad


def _fp8_nonfinite(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n = codes.shape[0]
    mag = _E4M3_ABS[codes].reshape(n, FP8_SCALES, FP8_GROUP)              # [n, 8, 32] float64
    nan_code = np.isnan(mag).any(axis=(1, 2))
    group_max = np.nanmax(np.where(np.isnan(mag), 0.0, mag), axis=2)       # [n, 8]
    e = scales.astype(np.int64)
    nan_scale = (e == 255).any(axis=1)
    # value = code * 2^(e-127): it overflows fp32 when group_max * 2^(e-127) >= 2^128
    with np.errstate(over="ignore"):
        big = (group_max * np.exp2((e - 127).astype(np.float64)) >= 2.0 ** 128) & (e != 255)
    return nan_code | nan_scale | big.any(axis=1)


def nonfinite_rows(table: np.ndarray, encoding: str, scales: np.ndarray | None = None) -> np.ndarray:
    """bool [rows]: True where the row decodes to a NaN or infinite value.

    table: uint8 [rows, row_bytes] raw rows (for "fp8" either the 264-byte rows, or the 256 codes
    with `scales` uint8 [rows, 8] beside them)."""
    table = np.asarray(table)
    if encoding == "fp8":
        if scales is None:
            return _fp8_nonfinite(table[:, :FP8_CODES], table[:, FP8_CODES:FP8_CODES + FP8_SCALES])
        return _fp8_nonfinite(table, np.asarray(scales))
    try:
        offsets = FP16_FIELDS[encoding]
    except KeyError:
        raise ValueError(f"no row check for encoding {encoding!r}; encodings are "
                         f"{sorted(FP16_FIELDS) + ['fp8']}") from None
    return _fp16_nonfinite(table, offsets)


def count_nonfinite_rows(table: np.ndarray, encoding: str, scales: np.ndarray | None = None,
                         chunk_rows: int = 1 << 16) -> tuple[int, int]:
    """(number of flagged rows, first flagged row id or -1) over a whole table, a chunk at a time
    (reads every row's scale bytes: ~94 GiB for a released FP8 table, so `info` scans only small
    tables unless asked)."""
    n, first = 0, -1
    for r0 in range(0, table.shape[0], chunk_rows):
        r1 = min(table.shape[0], r0 + chunk_rows)
        bad = nonfinite_rows(table[r0:r1], encoding, None if scales is None else scales[r0:r1])
        k = int(bad.sum())
        if k and first < 0:
            first = r0 + int(np.argmax(bad))
        n += k
    return n, first
