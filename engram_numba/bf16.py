"""bfloat16 as uint16 words.

numpy has no bf16 dtype, so every bf16 array in this package is a `uint16` array of the raw
bits; `as_bfloat16` shows it to users as an `ml_dtypes.bfloat16` view (no copy). Rounding from
fp32 is round-to-nearest-even, the rounding torch and the GPU's `cvt.rn.bf16.f32` use.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import njit

BF16 = np.dtype(ml_dtypes.bfloat16)


def f32_to_bf16(x) -> np.ndarray:
    """Round fp32 values to bf16 (nearest even); returns uint16 words of the same shape.

    NaN stays NaN (quiet), infinities stay infinite, and values that overflow bf16 round to inf,
    as on the GPU.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bf16_to_f32(words) -> np.ndarray:
    """Widen bf16 words (uint16) to fp32, exactly."""
    words = np.asarray(words)
    if words.dtype == BF16:
        words = words.view(np.uint16)
    if words.dtype != np.uint16:
        raise TypeError(f"bf16 words must be uint16 (or ml_dtypes.bfloat16), got {words.dtype}")
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_f32_through_bf16(x) -> np.ndarray:
    """fp32 -> bf16 -> fp32: the value a bf16 tensor would hold."""
    return bf16_to_f32(f32_to_bf16(x))


def as_bfloat16(words) -> np.ndarray:
    """A zero-copy `ml_dtypes.bfloat16` view of uint16 words, for display and arithmetic."""
    words = np.asarray(words)
    if words.dtype == BF16:
        return words
    if words.dtype != np.uint16:
        raise TypeError(f"bf16 words must be uint16, got {words.dtype}")
    return words.view(BF16)


def bf16_ordinal(words) -> np.ndarray:
    """Map bf16 words to integers whose differences count ulps (sign-magnitude -> two's complement).

    +0 and -0 both map to 0, so they are 0 ulps apart.
    """
    w = np.asarray(words).view(np.uint16).astype(np.int32)
    mag = w & 0x7FFF
    return np.where(w & 0x8000, -mag, mag)


def bf16_ulp_distance(a_words, b_words) -> np.ndarray:
    """Element-wise distance between two bf16 word arrays, in bf16 ulps."""
    return np.abs(bf16_ordinal(a_words) - bf16_ordinal(b_words))


def f32_ulp_distance(a, b) -> np.ndarray:
    """Element-wise distance between two fp32 arrays, in fp32 ulps."""
    def ordinal(x):
        i = np.ascontiguousarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordinal(a) - ordinal(b))


# Scalar versions for @njit code (the cpu backends): the same bits as the array functions above.

@njit(cache=True, inline="always")
def bf16_word_to_f32(word):  # pragma: no cover - jitted
    """One bf16 word (uint16) -> its fp32 value, exactly."""
    return np.array([np.uint32(word) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]


@njit(cache=True, inline="always")
def f32_to_bf16_word(x):  # pragma: no cover - jitted
    """One fp32 value -> the nearest-even bf16 word (NaN stays a quiet NaN)."""
    u = np.array([x], dtype=np.float32).view(np.uint32)[0]
    if x != x:
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
