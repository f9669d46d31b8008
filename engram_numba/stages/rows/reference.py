"""The rows stage in numpy: gather raw rows by id, decode them to the projection's bf16 input.

    gather_reference(table, row_ids)     raw rows [n, row_bytes] uint8 of a [rows, row_bytes] table
    decode_reference(raw, encoding)      raw rows -> float32 [n, 256], the exact decoded values
    rows_reference(raw, encoding)        raw rows -> bf16 words [n, 256] (round to nearest even)

Each encoding's decoder is written to be read (encodings.py lists them; q2k.py holds Q2_K's,
kquants.py Q3_K's, Q4_K's and Q8_0's, fp8.py FP8's). The K-quant decoders are bit-exact with
`gguf.quants.dequantize`; FP8 is decoded from its bit layout.
"""
from __future__ import annotations

import numpy as np

from ...bf16 import f32_to_bf16
from .encodings import get_encoding
from .fp8 import decode_fp8_reference
from .kquants import dequantize_q3_k, dequantize_q4_k, dequantize_q8_0
from .q2k import dequantize as _q2k_dequantize

# encoding -> numpy decoder: uint8 [n, row_bytes] -> float32 [n, 256]
DECODERS = {"q2k": _q2k_dequantize, "q3_k": dequantize_q3_k, "q4_k": dequantize_q4_k, "q8_0": dequantize_q8_0,
            "fp8": decode_fp8_reference}


def check_raw_rows(raw, encoding: str) -> np.ndarray:
    """raw as uint8 [n, row_bytes] of `encoding`, or a ValueError naming what is wrong."""
    enc = get_encoding(encoding)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != enc.row_bytes:
        raise ValueError(f"raw {enc.name} rows must be uint8 [n, {enc.row_bytes}], got {raw.dtype} {list(raw.shape)}")
    return raw


def gather_reference(table: np.ndarray, row_ids) -> np.ndarray:
    """Raw rows [n, row_bytes] of the given row ids from a [rows, row_bytes] table (or memory map)."""
    row_ids = np.asarray(row_ids, dtype=np.int64).ravel()
    n_rows = table.shape[0]
    bad = (row_ids < 0) | (row_ids >= n_rows)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"row id {int(row_ids[i])} at index {i} is outside the table's [0, {n_rows}) rows")
    return np.asarray(table[row_ids], dtype=np.uint8)


def decode_reference(raw: np.ndarray, encoding: str = "q2k") -> np.ndarray:
    """Raw rows [n, row_bytes] uint8 -> their exact values, float32 [n, 256]."""
    raw = check_raw_rows(raw, encoding)
    try:
        decoder = DECODERS[encoding]
    except KeyError:
        raise ValueError(f"no numpy decoder for encoding {encoding!r}") from None
    return decoder(raw)


def rows_reference(raw: np.ndarray, encoding: str = "q2k") -> np.ndarray:
    """Raw rows [n, row_bytes] -> the projection's input rows, bf16 words [n, 256]."""
    return f32_to_bf16(decode_reference(raw, encoding))


def flatten_rows(rows_bf16: np.ndarray, n_tokens: int) -> np.ndarray:
    """[T*C, 256] rows -> projection input x [T, C*256]; element col*256 + d of a token's x is
    value d of its column-col row."""
    return rows_bf16.reshape(n_tokens, -1)
