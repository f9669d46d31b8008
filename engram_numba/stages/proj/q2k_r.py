"""`q2k_r`: a Q2_K `wkv` re-laid out once, at load, for the GEMV that streams it (numpy reference).

A file's Q2_K row is K/256 blocks of 84 bytes (16 scale bytes, 64 quant bytes, fp16 d and dmin;
`engram_numba.stages.rows.q2k`). An 84-byte block is only 4-byte aligned, so a kernel reading it
in place issues 4-byte loads and wastes half of every sector it touches across two blocks. `q2k_r`
keeps the same bytes (2.625 bits a weight) but moves them so that every load of the GEMV is 16 bytes
wide and a warp's loads are contiguous, in the order its mma fragments use them.

Layout. Rows are grouped in tiles of 16 (`TILE_ROWS`, the mma's M) and each row's blocks in pairs
(`UNIT_BLOCKS`): one *unit* is 16 rows x 512 k = 2688 bytes, and the array is uint8
[ceil(N/16), ceil(K/512) * 2688], units of a tile in k order. Rows past N and the odd block past
K/256 (when K/256 is odd) are zero bytes (they decode to 0 and are never written out). In a unit,
lane (g, t) of the warp that reads it (g = lane >> 2 picks rows g and g + 8 of the tile, t = lane & 3
picks the quarter (n, h) = (t >> 1, t & 1) of every block: values 128n + 32j + 16h + l, j, l < 4, 16)
finds:
    bytes    0 .. 2047  quants: 16-byte chunk ((b * 2 + p) * 32 + lane) = quant bytes 32n + 16h ..
                        +15 of block b (0, 1 of the unit) of row g + 8p (the 16 values l of each j)
    bytes 2048 .. 2559  scales: chunk `lane`, word (b * 2 + p) = the 4 scale bytes 8n + 2j + h,
                        j = 0..3 (byte j), of block b of row g + 8p
    bytes 2560 .. 2687  d/dmin: chunk g, word (b * 2 + p) = bytes 80..83 (fp16 d, fp16 dmin) of
                        block b of row g + 8p (the 4 lanes of a g read the same chunk)
So a lane makes six 16-byte loads a unit: four quant chunks, one scale chunk, one d/dmin chunk,
and each of the first five is a warp-wide contiguous 512 bytes. The repack is a permutation of
bytes: `unpack_q2k_r(repack_q2k_r(raw, K), N, K)` gives `raw` back, so the decoded weights are
the file's, bit for bit. The GPU builds the same bytes (`cuda_gemv_q2kr.prepare_repack`).
"""
from __future__ import annotations

import numpy as np

BLOCK_VALUES, BLOCK_BYTES = 256, 84
TILE_ROWS = 16
UNIT_BLOCKS = 2
UNIT_VALUES = UNIT_BLOCKS * BLOCK_VALUES                     # 512 k
UNIT_BYTES = TILE_ROWS * UNIT_BLOCKS * BLOCK_BYTES           # 2688
QS_BYTES, SC_BYTES, DD_BYTES = 2048, 512, 128                # the three planes of a unit
SC_OFFSET, DD_OFFSET = QS_BYTES, QS_BYTES + SC_BYTES


def q2k_r_shape(N: int, K: int) -> tuple[int, int]:
    """The uint8 shape of a q2k_r weight of N rows and K (a multiple of 256) columns."""
    return -(-N // TILE_ROWS), -(-K // UNIT_VALUES) * UNIT_BYTES


def _check_raw(raw, K: int) -> np.ndarray:
    raw = np.asarray(raw)
    if K <= 0 or K % BLOCK_VALUES:
        raise ValueError(f"K = {K} must be a positive multiple of {BLOCK_VALUES} for Q2_K weights")
    want = K // BLOCK_VALUES * BLOCK_BYTES
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != want:
        raise ValueError(f"Q2_K weights for K = {K} must be uint8 [N, {want}], got {raw.dtype} {list(raw.shape)}")
    return raw


def repack_q2k_r(raw, K: int) -> np.ndarray:
    """Q2_K blocks uint8 [N, K/256*84] -> q2k_r uint8 [ceil(N/16), ceil(K/512)*2688] (module doc)."""
    raw = _check_raw(raw, K)
    N = raw.shape[0]
    NT, width = q2k_r_shape(N, K)
    NU = width // UNIT_BYTES
    blocks = np.zeros((NT * TILE_ROWS, NU * UNIT_BLOCKS, BLOCK_BYTES), np.uint8)
    blocks[:N, :K // BLOCK_VALUES] = raw.reshape(N, K // BLOCK_VALUES, BLOCK_BYTES)
    # row = 16 tile + 8 p + g, block = 2 unit + b
    v = blocks.reshape(NT, 2, 8, NU, UNIT_BLOCKS, BLOCK_BYTES)                 # [tile, p, g, unit, b, byte]
    qs = v[..., 16:80].reshape(NT, 2, 8, NU, UNIT_BLOCKS, 4, 16)              # [.., t = 2n + h, l]
    qs = qs.transpose(0, 3, 4, 1, 2, 5, 6)                                    # [tile, unit, b, p, g, t, l]
    sc = v[..., 0:16].reshape(NT, 2, 8, NU, UNIT_BLOCKS, 2, 4, 2)             # [.., n, j, h]
    sc = sc.transpose(0, 3, 2, 5, 7, 4, 1, 6)                                 # [tile, unit, g, n, h, b, p, j]
    dd = v[..., 80:84].transpose(0, 3, 2, 4, 1, 5)                            # [tile, unit, g, b, p, 4]
    out = np.concatenate([qs.reshape(NT, NU, QS_BYTES), sc.reshape(NT, NU, SC_BYTES),
                          dd.reshape(NT, NU, DD_BYTES)], axis=2)
    return np.ascontiguousarray(out.reshape(NT, NU * UNIT_BYTES))


def unpack_q2k_r(packed, N: int, K: int) -> np.ndarray:
    """The inverse of `repack_q2k_r`: q2k_r bytes -> Q2_K blocks uint8 [N, K/256*84]."""
    packed = np.asarray(packed)
    if K <= 0 or K % BLOCK_VALUES:
        raise ValueError(f"K = {K} must be a positive multiple of {BLOCK_VALUES} for Q2_K weights")
    want = q2k_r_shape(N, K)
    if packed.dtype != np.uint8 or packed.shape != want:
        raise ValueError(f"a q2k_r weight of N = {N}, K = {K} must be uint8 {list(want)}, "
                         f"got {packed.dtype} {list(packed.shape)}")
    NT, NU = want[0], want[1] // UNIT_BYTES
    u = packed.reshape(NT, NU, UNIT_BYTES)
    blocks = np.empty((NT, 2, 8, NU, UNIT_BLOCKS, BLOCK_BYTES), np.uint8)
    qs = u[..., :QS_BYTES].reshape(NT, NU, UNIT_BLOCKS, 2, 8, 4, 16)
    blocks[..., 16:80] = qs.transpose(0, 3, 4, 1, 2, 5, 6).reshape(NT, 2, 8, NU, UNIT_BLOCKS, 64)
    sc = u[..., SC_OFFSET:DD_OFFSET].reshape(NT, NU, 8, 2, 2, UNIT_BLOCKS, 2, 4)   # [tile, unit, g, n, h, b, p, j]
    blocks[..., 0:16] = sc.transpose(0, 6, 2, 1, 5, 3, 7, 4).reshape(NT, 2, 8, NU, UNIT_BLOCKS, 16)
    dd = u[..., DD_OFFSET:].reshape(NT, NU, 8, UNIT_BLOCKS, 2, 4)                   # [tile, unit, g, b, p, 4]
    blocks[..., 80:84] = dd.transpose(0, 4, 2, 1, 3, 5)
    full = blocks.reshape(NT * TILE_ROWS, NU * UNIT_BLOCKS * BLOCK_BYTES)
    return np.ascontiguousarray(full[:N, :K // BLOCK_VALUES * BLOCK_BYTES])


def wkv_q2k_r_bf16(packed, N: int, K: int) -> np.ndarray:
    """The bf16 weights a q2k_r wkv holds, uint16 [N, K]: its Q2_K blocks decoded as the file's."""
    from .reference import wkv_q2k_bf16
    return wkv_q2k_bf16(unpack_q2k_r(packed, N, K), K)
