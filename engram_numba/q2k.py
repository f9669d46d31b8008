"""Q2_K rows: one 84-byte Q2_K super-block holds one 256-value table row.

Block layout (SPEC section 3), bytes:
     0..15  scales  one byte per 16 values: low nibble = scale, high nibble = min
    16..79  qs      2-bit quants, four per byte
    80..81  d       fp16 super-scale of the scales
    82..83  dmin    fp16 super-scale of the mins
Value e (0..255): n = e//128, w = e%128, j = w//32, h = (w%32)//16, l = w%16
    sc = scales[8n + 2j + h];  q = (qs[32n + 16h + l] >> 2j) & 3
    y  = (d * (sc & 15)) * q - (dmin * (sc >> 4))        # fp32, in this order, no FMA

`dequantize` is the numpy reference (bit-exact with `gguf.quants.dequantize`); `dequantize_cpu`
is the @njit decoder; `quantize` is this package's own encoder (gguf-py has none for Q2_K).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .bf16 import f32_to_bf16

ENGRAM_ROW_BYTES = 84
ROW_VALUES = 256
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
    return _dequantize_rows(blocks, out)
