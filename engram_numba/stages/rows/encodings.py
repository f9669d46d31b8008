"""The table encodings the rows stage decodes: one row of `head_dim` = 256 values each.

An encoding names how one table row is stored: its bytes per row, the GGUF/ggml tensor type that
holds it (when it comes from a GGUF), and which decoder turns it into the projection's bf16
input. The rows stage's three backends and its kernel records are keyed by these names.
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


ENCODINGS: dict[str, RowEncoding] = {
    "q2k": RowEncoding("q2k", "Q2_K", 84, "one Q2_K super-block a row: 4-bit sub-block scales and mins, "
                                          "2-bit quants, fp16 d and dmin"),
}


def get_encoding(name: str) -> RowEncoding:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"unknown table encoding {name!r}; encodings are {sorted(ENCODINGS)}") from None


def random_raw_rows(encoding: str, n: int, rng) -> "np.ndarray":
    """n random raw rows uint8 [n, row_bytes] of `encoding` that decode to finite values (the
    bench's and the GPU tests' tables: random bytes, with every scale field made finite)."""
    import numpy as np
    enc = get_encoding(encoding)
    raw = rng.integers(0, 256, (n, enc.row_bytes), dtype=np.uint8)
    if encoding == "q2k":
        raw[:, 80:84] = (rng.standard_normal((n, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return raw


def encoding_of_ggml_type(type_name: str) -> RowEncoding | None:
    for enc in ENCODINGS.values():
        if enc.ggml_type == type_name:
            return enc
    return None
