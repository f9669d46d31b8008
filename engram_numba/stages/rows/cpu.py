"""The rows stage in @njit: raw rows -> bf16 rows, bit-exact with the reference.

The host gather by id is `formats`' row reader (an @njit copy out of the memory map); decoding
is each encoding's @njit decoder (q2k.py for Q2_K).
"""
from __future__ import annotations

from ...bf16 import f32_to_bf16
from .encodings import get_encoding
from .q2k import dequantize_cpu as _q2k_dequantize_cpu

DECODERS = {"q2k": _q2k_dequantize_cpu}   # encoding -> @njit decoder: uint8 [n, row_bytes] -> float32 [n, 256]


def decode_cpu(raw, encoding: str = "q2k"):
    """Raw rows [n, row_bytes] uint8 -> float32 [n, 256] (@njit, parallel over rows)."""
    get_encoding(encoding)
    try:
        decoder = DECODERS[encoding]
    except KeyError:
        raise ValueError(f"no @njit decoder for encoding {encoding!r}") from None
    return decoder(raw)


def rows_cpu(raw, encoding: str = "q2k"):
    """Raw rows [n, row_bytes] -> bf16 words [n, 256]."""
    return f32_to_bf16(decode_cpu(raw, encoding))
