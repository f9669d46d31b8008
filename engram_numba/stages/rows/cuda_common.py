"""What the rows stage's kernels share (cuda_q2k.py, cuda_kquants.py, cuda_fp8.py).

Every decode kernel writes bf16 words, uint16 [n, 256] (seen by the fast kernels as a flat
uint32 array of bf16 pairs), and comes in two forms: `decode` (raw rows [n, row_bytes] in order)
and `gather` (rows of a device table picked by an int32/int64 id array [n], with 64-bit address
arithmetic). A gathered out-of-range id reads nothing: its output row is NaN (0x7FC0 words) and
a device counter is incremented, which the launcher turns into a ValueError (as cuda_q2k does).

Two layers' gathers can be one launch (`prepare_pair`, for records with a `gather_pair` kernel:
Q2_K v2/v3): the first half of the blocks gathers table a, the second half table b, each row as
the one-table gather writes it (the one-token decode gathers both engram layers so).

Launch shapes:
  v1 (naive) one thread per output value, 256 threads a block (one row a block).
  fast       8 lanes per row, 256 threads a block (32 rows a block); lane t of a row writes 4
             16-byte chunks of 8 values.

`prepare` is the stage's one launcher: it reads a kernel record (kernel {"decode", "gather"},
geometry, argument form, alignment). The argument form `record.args` is "<view>[,<extra>]":
  view   how the kernels see the rows: "u8" (the uint8 rows as given; out stays uint16 [n, 256]),
         "u16" / "u32" (a [rows, row_bytes/2 or /4] view), "u32_flat" (one flat uint32 array);
         every view but "u8" writes the flat uint32 view of out (`out_words`)
  extra  what the gather takes before the ids: "" nothing, "rows" the table's row count (int64),
         "scales" the scale array and the scales' first column in view units (FP8: inline in
         bytes 256..263 of each row, or a separate [rows, 8] array)
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from ...device.devarray import data_address
from ...device.intrinsics import device_function, store_u32x4
from ...device.launch import PreparedLaunch
from ..registry import Spec
from .encodings import ROW_VALUES

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


def geometry_naive(n: int) -> tuple[int, int]:
    """(blocks, threads) covering n rows with a thread per value."""
    return (n * ROW_VALUES + THREADS_V1 - 1) // THREADS_V1, THREADS_V1


def geometry_lanes(rows_per_group: int = 1):
    """n -> (blocks, threads) covering n rows with 8 lanes per group of `rows_per_group` rows."""
    rows_per_block = THREADS_FAST // LANES_PER_ROW * rows_per_group

    def geometry(n: int) -> tuple[int, int]:
        return (n + rows_per_block - 1) // rows_per_block, THREADS_FAST
    geometry.__name__ = f"geometry_lanes_{rows_per_group}"
    return geometry


geometry_fast = geometry_lanes(1)

INLINE_SCALE_BYTE = 256          # an FP8 row's scales start at byte 256 of its 264


def _view(src, how: str):
    if how == "u8":
        return src
    if how == "u16":
        return src.view(np.uint16)
    if how == "u32":
        return src.view(np.uint32)
    if how == "u32_flat":
        return src.view(np.uint32).reshape(src.shape[0] * src.shape[1] // 4)
    raise ValueError(f"unknown rows argument view {how!r}")


def prepare(rec, src, out, *, ids=None, bad_count=None, stream=0, scales=None) -> PreparedLaunch:
    """The launch of kernel record `rec`. ids None: decode the rows src [n, row_bytes] in order into
    out [n, 256] (uint16, device); else gather rows ids [n] (int32/int64, device) of the table src,
    counting out-of-range ids into bad_count (uint32 [1]). `scales`: a separate [rows, 8] scale
    array (FP8 gathers only). Arguments are checked by `launch.py`."""
    how, _, extra = rec.args.partition(",")
    if scales is not None and (ids is None or extra != "scales"):
        raise ValueError(f"{rec.name}: separate scales are for the gather of FP8 rows; decode takes whole rows")
    if how != "u8" and not (data_address(src) % rec.align == 0 and data_address(out) % 16 == 0
                            and (scales is None or data_address(scales) % 4 == 0)):
        raise ValueError(f"{rec.name} reads whole {rec.align}-byte units and writes 16-byte chunks: the input "
                         f"must be {rec.align}-byte and out 16-byte aligned; use version='{rec.encoding}_v1' or an "
                         "aligned copy")
    n = out.shape[0]
    blocks, threads = rec.geometry(n)
    view = _view(src, how)
    dst = out if how == "u8" else out_words(out)
    if ids is None:
        return PreparedLaunch(rec.name, rec.kernel["decode"], blocks, threads, stream, (view, dst), out)
    if extra == "":
        lead = ()
    elif extra == "rows":
        lead = (np.int64(src.shape[0]),)
    elif extra == "scales":
        unit = 1 if how == "u8" else 4
        lead = ((view, np.int64(INLINE_SCALE_BYTE // unit)) if scales is None
                else (_view(scales, how), np.int64(0)))
    else:
        raise ValueError(f"unknown rows argument form {rec.args!r}")
    return PreparedLaunch(rec.name, rec.kernel["gather"], blocks, threads, stream,
                          (view,) + lead + (ids, dst, bad_count), out)


def specs(rec_kernel: dict, src_t, out_t, extra: tuple = ()) -> tuple:
    """The compile-tier specialisations of a decode/gather pair: decode, and gather with int32 and
    int64 ids; src_t / out_t the view types, `extra` the gather's arguments before the ids."""
    out = [Spec(".decode", rec_kernel["decode"], (src_t, out_t))]
    for ids_t, tag in ID_TYPES:
        out.append(Spec(f".gather[{tag}]", rec_kernel["gather"], (src_t,) + tuple(extra) + (ids_t, out_t, U32_1D)))
    if "gather_pair" in rec_kernel:
        for ids_t, tag in ID_TYPES:
            out.append(Spec(f".gather_pair[{tag}]", rec_kernel["gather_pair"], (src_t, src_t, ids_t, out_t, out_t, U32_1D)))
    return tuple(out)


def prepare_pair(rec, table_a, table_b, ids, out_a, out_b, *, bad_count, stream=0) -> PreparedLaunch:
    """One launch gathering rows ids[:n] of table_a into out_a and ids[n:] of table_b into out_b
    (ids [2n] device int32/int64; out-of-range ids counted into bad_count), each row as record
    `rec`'s gather writes it; the launch is named "<rec.name>[2 layers]". The record must have a
    `gather_pair` kernel taking the tables as they are (no extra arguments). Arguments are
    checked by `launch.prepare_gather_pair`."""
    how, _, extra = rec.args.partition(",")
    if "gather_pair" not in rec.kernel or extra or how == "u8":
        raise ValueError(f"rows kernel {rec.name} has no two-table gather")
    for what, a in (("table_a", table_a), ("table_b", table_b)):
        if data_address(a) % rec.align:
            raise ValueError(f"{rec.name} reads whole {rec.align}-byte units: {what} must be {rec.align}-byte aligned")
    for what, a in (("out_a", out_a), ("out_b", out_b)):
        if data_address(a) % 16:
            raise ValueError(f"{rec.name} writes 16-byte chunks: {what} must be 16-byte aligned")
    blocks, threads = rec.geometry(out_a.shape[0])
    return PreparedLaunch(f"{rec.name}[2 layers]", rec.kernel["gather_pair"], 2 * blocks, threads, stream,
                          (_view(table_a, how), _view(table_b, how), ids, out_words(out_a), out_words(out_b),
                           bad_count), (out_a, out_b))


def out_words(out):
    """The flat uint32 view [n*128] of out (uint16 [n, 256]) that the fast kernels store into."""
    return out.view(np.uint32).reshape(out.shape[0] * OUT_WORDS)
