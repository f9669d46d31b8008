"""The table encodings the rows stage decodes: one row of `head_dim` = 256 values each.

An encoding names how one table row is stored: its bytes per row, the GGUF/ggml tensor type that
holds it (when it comes from a GGUF), and which decoder turns it into the projection's bf16
input. The rows stage's three backends and its kernel records are keyed by these names
(docs/math.md section 4 gives every layout):

    q2k    Q2_K   84 B   one super-block: 4-bit sub-block scales and mins, 2-bit codes
    q3_k   Q3_K  110 B   one super-block: 6-bit sub-block scales, 3-bit codes (2 + a high-bit mask)
    q4_k   Q4_K  144 B   one super-block: 6-bit sub-block scales and mins, 4-bit codes
    q8_0   Q8_0  272 B   8 blocks of 32: fp16 scale + 32 int8 codes each
    fp8    --    264 B   256 e4m3 codes, then 8 e8m0 scales (one per 32 values), as ds4 stores them
"""
from __future__ import annotations

from dataclasses import dataclass

ROW_VALUES = 256


@dataclass(frozen=True)
class RowEncoding:
    name: str           # the stage's key: "q2k", ...
    ggml_type: str      # the GGUF tensor type that stores it ("" when none)
    row_bytes: int      # bytes of one 256-value row
    description: str
    fast_align: int = 4  # input alignment (bytes) the fast kernels need; unaligned views take v1


ENCODINGS: dict[str, RowEncoding] = {
    "q2k": RowEncoding("q2k", "Q2_K", 84, "one Q2_K super-block a row: 4-bit sub-block scales and mins, "
                                          "2-bit quants, fp16 d and dmin"),
    "q3_k": RowEncoding("q3_k", "Q3_K", 110, "one Q3_K super-block a row: 3-bit quants (2 low bits + a "
                                             "high-bit mask), 6-bit signed sub-block scales, fp16 d",
                        fast_align=2),
    "q4_k": RowEncoding("q4_k", "Q4_K", 144, "one Q4_K super-block a row: 4-bit quants, 6-bit sub-block "
                                             "scales and mins, fp16 d and dmin", fast_align=16),
    "q8_0": RowEncoding("q8_0", "Q8_0", 272, "8 Q8_0 blocks a row: fp16 d and 32 int8 quants each"),
    "fp8": RowEncoding("fp8", "", 264, "256 FP8 e4m3 codes then 8 e8m0 power-of-two scales, one per 32 "
                                       "values (DeepSeek's checkpoint, ds4 GGUFs)"),
}


def get_encoding(name: str) -> RowEncoding:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"unknown table encoding {name!r}; encodings are {sorted(ENCODINGS)}") from None


def _small_f16_bytes(rng, shape) -> "np.ndarray":
    """fp16 values N(0, 0.01) as little-endian bytes [..., 2]: finite scales of a realistic size."""
    import numpy as np
    return (rng.standard_normal(shape) * 0.01).astype(np.float16).view(np.uint8).reshape(*shape[:-1], -1)


def random_raw_rows(encoding: str, n: int, rng) -> "np.ndarray":
    """n random raw rows uint8 [n, row_bytes] of `encoding` that decode to finite values (the
    bench's and the GPU tests' tables: random bytes, with every scale field made finite).

    K-quants and Q8_0: random codes and sub-block scales, fp16 super-scales N(0, 0.01).
    fp8: random e4m3 codes other than the two NaN codes (0x7F, 0xFF), scale bytes 100..150
    (2^-27 .. 2^23, inside the range where every value is exact in bf16)."""
    import numpy as np
    enc = get_encoding(encoding)
    raw = rng.integers(0, 256, (n, enc.row_bytes), dtype=np.uint8)
    if encoding == "q2k":
        raw[:, 80:84] = _small_f16_bytes(rng, (n, 2))
    elif encoding == "q3_k":
        raw[:, 108:110] = _small_f16_bytes(rng, (n, 1))
    elif encoding == "q4_k":
        raw[:, 0:4] = _small_f16_bytes(rng, (n, 2))
    elif encoding == "q8_0":
        blocks = raw.reshape(n, 8, 34)
        blocks[:, :, 0:2] = _small_f16_bytes(rng, (n, 8, 1))
    elif encoding == "fp8":
        codes = raw[:, :256]
        codes[(codes & 0x7F) == 0x7F] ^= np.uint8(1)              # 0x7F/0xFF (NaN) -> 0x7E/0xFE
        raw[:, 256:] = rng.integers(100, 151, (n, 8), dtype=np.uint8)
    return raw


def encoding_of_ggml_type(type_name: str) -> RowEncoding | None:
    for enc in ENCODINGS.values():
        if enc.ggml_type and enc.ggml_type == type_name:
            return enc
    return None
