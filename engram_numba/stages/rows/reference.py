"""The rows stage in numpy: gather raw rows by id, decode them to the projection's bf16 input.

    gather_reference(table, row_ids)     raw rows [n, row_bytes] uint8 of a [rows, row_bytes] table
    decode_reference(raw, encoding)      raw rows -> float32 [n, 256], the exact decoded values
    rows_reference(raw, encoding)        raw rows -> bf16 words [n, 256] (round to nearest even)

Each encoding's decoder is written to be read (encodings.py lists them; q2k.py holds Q2_K's).
"""
from __future__ import annotations

import numpy as np

from ...bf16 import f32_to_bf16
from .encodings import get_encoding
from .q2k import dequantize as _q2k_dequantize

DECODERS = {"q2k": _q2k_dequantize}   # encoding -> numpy decoder: uint8 [n, row_bytes] -> float32 [n, 256]


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
    get_encoding(encoding)
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
