"""What the rows stage's kernels share (cuda_q2k.py, cuda_kquants.py, cuda_fp8.py).

Every decode kernel writes bf16 words, uint16 [n, 256] (seen by the fast kernels as a flat
uint32 array of bf16 pairs), and comes in two forms: `decode` (raw rows [n, row_bytes] in order)
and `gather` (rows of a device table picked by an int32/int64 id array [n], with 64-bit address
arithmetic). A gathered out-of-range id reads nothing: its output row is NaN (0x7FC0 words) and
a device counter is incremented, which the launcher turns into a ValueError (as cuda_q2k does).

Launch shapes:
  v1 (naive) one thread per output value, 256 threads a block (one row a block).
  fast       8 lanes per row, 256 threads a block (32 rows a block); lane t of a row writes 4
             16-byte chunks of 8 values.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from ...device.intrinsics import device_function, store_u32x4

ROW_VALUES = 256
OUT_WORDS = ROW_VALUES // 2      # 128 bf16x2 words a row
OUT_CHUNKS = ROW_VALUES // 8     # 32 16-byte chunks a row
LANES_PER_ROW = 8
THREADS_V1 = 256
THREADS_FAST = 256
NAN_BF16 = 0x7FC0                # the row written for an out-of-range id
NAN_BF16X2 = 0x7FC07FC0

# argument types of the compile-only tier
U8_2D = types.uint8[:, ::1]
U16_2D = types.uint16[:, ::1]
U32_2D = types.uint32[:, ::1]
U32_1D = types.uint32[::1]
ID_TYPES = ((types.int32[::1], "i32"), (types.int64[::1], "i64"))


def make_naive_kernels(value):
    """The v1 (naive) pair of an encoding: `value(raw, r, e)` -> the bf16 word of value e of row r
    (r may be 64-bit); one thread per output value.

        decode(raw uint8 [n, row_bytes], out uint16 [n, 256])
        gather(table uint8 [rows, row_bytes], ids int32/int64 [n], out uint16 [n, 256], bad uint32 [1])
    """
    @cuda.jit
    def decode(raw, out):
        i = cuda.grid(1)
        if i >= raw.shape[0] * ROW_VALUES:
            return
        out[i // ROW_VALUES, i % ROW_VALUES] = value(raw, i // ROW_VALUES, i % ROW_VALUES)

    @cuda.jit
    def gather(table, ids, out, bad):
        i = cuda.grid(1)
        if i >= ids.shape[0] * ROW_VALUES:
            return
        r = i // ROW_VALUES
        e = i % ROW_VALUES
        rid = np.int64(ids[r])
        if rid < 0 or rid >= table.shape[0]:
            out[r, e] = NAN_BF16
            if e == 0:
                cuda.atomic.add(bad, 0, np.uint32(1))
            return
        out[r, e] = value(table, rid, e)

    return decode, gather


@device_function
def nan_lane(out32, dst, t):
    """Lane t's share (chunks t, t+8, t+16, t+24) of a NaN row dst of out32 (flat uint32)."""
    nan2 = np.uint32(NAN_BF16X2)
    base = dst * OUT_CHUNKS + t
    store_u32x4(out32, base, nan2, nan2, nan2, nan2)
    store_u32x4(out32, base + 8, nan2, nan2, nan2, nan2)
    store_u32x4(out32, base + 16, nan2, nan2, nan2, nan2)
    store_u32x4(out32, base + 24, nan2, nan2, nan2, nan2)


def launch_config(n: int, fast: bool) -> tuple[int, int]:
    """(blocks, threads) covering n rows: a thread per value (v1), or 8 lanes per row (fast)."""
    if not fast:
        return (n * ROW_VALUES + THREADS_V1 - 1) // THREADS_V1, THREADS_V1
    rows_per_block = THREADS_FAST // LANES_PER_ROW
    return (n + rows_per_block - 1) // rows_per_block, THREADS_FAST


def out_words(out):
    """The flat uint32 view [n*128] of out (uint16 [n, 256]) that the fast kernels store into."""
    return out.view(np.uint32).reshape(out.shape[0] * OUT_WORDS)
