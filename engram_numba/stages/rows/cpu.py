"""The rows stage in @njit: raw rows -> bf16 rows, bit-exact with the reference.

The host gather by id is `formats`' row reader (an @njit copy out of the memory map); decoding
is each encoding's @njit decoder (q2k.py for Q2_K, kquants.py for Q3_K, Q4_K and Q8_0, fp8.py for FP8).
"""
from __future__ import annotations

from ...bf16 import f32_to_bf16
from .fp8 import decode_fp8_cpu
from .kquants import dequantize_q3_k_cpu, dequantize_q4_k_cpu, dequantize_q8_0_cpu
from .q2k import dequantize_cpu as _q2k_dequantize_cpu
from .reference import check_raw_rows

# encoding -> @njit decoder: uint8 [n, row_bytes] -> float32 [n, 256]
DECODERS = {"q2k": _q2k_dequantize_cpu, "q3_k": dequantize_q3_k_cpu, "q4_k": dequantize_q4_k_cpu,
            "q8_0": dequantize_q8_0_cpu, "fp8": decode_fp8_cpu}


def decode_cpu(raw, encoding: str = "q2k"):
    """Raw rows [n, row_bytes] uint8 -> float32 [n, 256] (@njit, parallel over rows)."""
    raw = check_raw_rows(raw, encoding)
    try:
        decoder = DECODERS[encoding]
    except KeyError:
        raise ValueError(f"no @njit decoder for encoding {encoding!r}") from None
    return decoder(raw)


def rows_cpu(raw, encoding: str = "q2k"):
    """Raw rows [n, row_bytes] -> bf16 words [n, 256]."""
    return f32_to_bf16(decode_cpu(raw, encoding))
