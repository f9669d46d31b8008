"""Launchers of the rows stage on the GPU: decode raw rows in order, or gather rows of a device
table by id, in any encoding the registry has kernels for.

    decode_rows(raw, out=None, *, encoding="q2k", stream=0, version=None)       -> out
    gather_rows(table, row_ids, out=None, *, encoding="q2k", stream=0, version=None,
                check=True, bad_count=None, scales=None)                        -> out
    prepare_decode / prepare_gather                                             -> PreparedLaunch
    prepare_gather_pair(table_a, table_b, row_ids, out_a, out_b, *, encoding="q2k", stream=0,
                        version=None, bad_count=None)  -> PreparedLaunch (two tables, one launch)
    has_gather_pair(rec)                            -> whether record `rec` has that launch

raw / table: device uint8 [n, row_bytes] (C-contiguous); out: device uint16 [n, 256] bf16 words.
FP8 tables whose e8m0 scales are a separate tensor (DeepSeek's checkpoint) are gathered from
table = the codes [rows, 256] and scales = the scale bytes [rows, 8]; scales=None reads them from
bytes 256..263 of a [rows, 264] table.
`version` names a record of the rows stage ("q2k_v3"); None takes the record whose default rule
holds (the fast kernels need aligned input, `RowEncoding.fast_align` bytes: 4 for most, 2 for
q3_k, 16 for q4_k, and 16-byte aligned output; an unaligned view falls back to the naive
kernel, while asking for a fast one by name is refused).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...device.checks import INTEGER, check_array
from ...device.devarray import as_device_array, data_address
from ...device.intrinsics import SIMULATOR
from ...device.launch import NoLaunch
from .. import registry
from . import records  # noqa: F401  (registers the rows kernels)
from .encodings import ROW_VALUES, get_encoding


def _check_array(a, name: str, dtype, ndim: int, width=None):
    shape = (None, width) if width is not None else (None,) * ndim
    return check_array(a, name, dtype, shape=shape, doc=f"[n, {width}]" if width is not None else "[n]")


def _output(out, n: int, stream):
    if out is None:
        return cuda.device_array((n, ROW_VALUES), dtype=np.uint16, stream=stream)
    out = as_device_array(out, "out")
    _check_array(out, "out", np.uint16, 2, ROW_VALUES)
    if out.shape[0] != n:
        raise ValueError(f"out has {out.shape[0]} rows, the input gives {n}")
    return out


def pick(encoding: str, version, src=None, out=None, scales=None) -> registry.KernelRecord:
    """The record to run: `version` by name (it must decode `encoding`), or the default."""
    if version is not None:
        rec = registry.get("rows", version)
        if rec.encoding != encoding:
            raise ValueError(f"rows kernel {version!r} decodes {rec.encoding!r} rows, not {encoding!r}; "
                             f"{encoding} versions are {registry.names('rows', encoding)}")
        return rec
    align = get_encoding(encoding).fast_align
    aligned = src is None or (data_address(src) % align == 0 and data_address(out) % 16 == 0
                              and (scales is None or data_address(scales) % 4 == 0))
    return registry.default("rows", {"encoding": encoding, "aligned": aligned, "simulator": SIMULATOR})


def prepare_decode(raw, out=None, *, encoding: str = "q2k", stream=0, version=None):
    """Validate once; returns a PreparedLaunch that decodes raw rows [n, row_bytes] into out."""
    enc = get_encoding(encoding)
    raw = as_device_array(raw, "raw")
    _check_array(raw, "raw", np.uint8, 2, enc.row_bytes)
    n = raw.shape[0]
    rec = pick(encoding, version)                  # a bad version name fails before any allocation
    out = _output(out, n, stream)
    rec = pick(encoding, version, raw, out)
    if n == 0:
        return NoLaunch(rec.name, out)
    return rec.prepare(raw, out, stream=stream)


def decode_rows(raw, out=None, *, encoding: str = "q2k", stream=0, version=None):
    """Raw rows [n, row_bytes] (device uint8) -> bf16 rows [n, 256] (device uint16), bit-identical
    to the reference. Returns out (allocated on `stream` when not given)."""
    return prepare_decode(raw, out, encoding=encoding, stream=stream, version=version)()


def _first_bad(ids: np.ndarray, n_rows: int):
    bad = (ids < 0) | (ids >= n_rows)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    return i, int(ids[i]), int(bad.sum())


def _bad_id_error(found, n_rows: int) -> ValueError:
    i, rid, count = found
    return ValueError(f"row id {rid} at index {i} is outside the table's [0, {n_rows}) rows "
                      f"({count} out-of-range id{'s' if count != 1 else ''})")


_SCRATCH: dict = {}


def _scratch_counter():
    """A device uint32 [1] that unchecked launches add their bad-id counts to (never read)."""
    ctx = cuda.current_context() if not SIMULATOR else None
    key = id(ctx)
    if key not in _SCRATCH:
        _SCRATCH[key] = cuda.to_device(np.zeros(1, np.uint32))
    return _SCRATCH[key]


def _sync(stream):
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()


def _check_table(table, encoding: str, scales):
    """(table, scales) as checked device arrays: table uint8 [rows, row_bytes], or for fp8 with
    separate scales, codes [rows, 256] and scales [rows, 8]."""
    enc = get_encoding(encoding)
    table = as_device_array(table, "table")
    if scales is None:
        _check_array(table, "table", np.uint8, 2, enc.row_bytes)
        return table, None
    if encoding != "fp8":
        raise ValueError(f"scales= is for fp8 tables whose e8m0 scales are a separate [rows, 8] tensor; "
                         f"{encoding} rows carry their own scales")
    _check_array(table, "table (fp8 codes, scales given separately)", np.uint8, 2, 256)
    scales = as_device_array(scales, "scales")
    _check_array(scales, "scales", np.uint8, 2, 8)
    if scales.shape[0] != table.shape[0]:
        raise ValueError(f"scales has {scales.shape[0]} rows, the table of codes {table.shape[0]}")
    return table, scales


def prepare_gather(table, row_ids, out=None, *, encoding: str = "q2k", stream=0, version=None, bad_count=None,
                   scales=None):
    """Validate once; a PreparedLaunch that gathers rows `row_ids` (device int32/int64 [n]) of the
    device table [rows, row_bytes] into out, adding out-of-range ids to `bad_count` (device uint32
    [1]; a shared scratch counter when None). Nothing is synchronised: safe in a graph capture.
    scales: for fp8 only, the e8m0 bytes [rows, 8] when `table` holds the codes [rows, 256]."""
    table, scales = _check_table(table, encoding, scales)
    row_ids = as_device_array(row_ids, "row_ids")
    _check_array(row_ids, "row_ids", (np.int32, np.int64), 1)
    if bad_count is not None:
        bad_count = as_device_array(bad_count, "bad_count")
        check_array(bad_count, "bad_count", np.uint32, shape=(1,))
    n = row_ids.shape[0]
    pick(encoding, version)
    out = _output(out, n, stream)
    rec = pick(encoding, version, table, out, scales)
    if n == 0:
        return NoLaunch(rec.name, out)
    extra = {} if scales is None else {"scales": scales}
    return rec.prepare(table, out, ids=row_ids, bad_count=bad_count if bad_count is not None else _scratch_counter(),
                       stream=stream, **extra)


def has_gather_pair(rec) -> bool:
    """Whether rows record `rec` gathers two tables in one launch (`prepare_gather_pair`)."""
    return isinstance(rec.kernel, dict) and "gather_pair" in rec.kernel


def prepare_gather_pair(table_a, table_b, row_ids, out_a, out_b, *, encoding: str = "q2k", stream=0, version=None,
                        bad_count=None):
    """Validate once; a PreparedLaunch that gathers rows row_ids[:n] of table_a into out_a [n, 256]
    and row_ids[n:] of table_b into out_b [n, 256] (row_ids device int32/int64 [2n]) in one launch,
    bit-identical to two `prepare_gather` launches of the same record, out-of-range ids added to
    `bad_count` (device uint32 [1]; a shared scratch counter when None). The record (`version`,
    or the default for these arrays, which must be the same for both tables) must have a
    two-table gather (`has_gather_pair`): ValueError otherwise, before any launch. Nothing is
    synchronised: safe in a graph capture."""
    from .cuda_common import prepare_pair
    tables = [_check_table(t, encoding, None)[0] for t in (table_a, table_b)]
    row_ids = as_device_array(row_ids, "row_ids")
    _check_array(row_ids, "row_ids", (np.int32, np.int64), 1)
    if bad_count is not None:
        bad_count = as_device_array(bad_count, "bad_count")
        check_array(bad_count, "bad_count", np.uint32, shape=(1,))
    n2 = row_ids.shape[0]
    if n2 % 2:
        raise ValueError(f"row_ids must hold layer a's n ids then layer b's n: an even count, got {n2}")
    n = n2 // 2
    pick(encoding, version)
    outs = []
    for name, o in (("out_a", out_a), ("out_b", out_b)):
        o = as_device_array(o, name)
        check_array(o, name, np.uint16, shape=(n, ROW_VALUES), doc=f"[n={n}, {ROW_VALUES}]")
        outs.append(o)
    recs = [pick(encoding, version, t, o) for t, o in zip(tables, outs)]
    if recs[0] is not recs[1]:
        raise ValueError(f"the two tables would take different rows kernels ({recs[0].name}, {recs[1].name}): "
                         "an unaligned view? gather them one by one")
    rec = recs[0]
    if not has_gather_pair(rec):
        raise ValueError(f"rows kernel {rec.name} has no two-table gather; gather the tables one by one")
    if n == 0:
        return NoLaunch(f"{rec.name}[2 layers]", tuple(outs))
    return prepare_pair(rec, tables[0], tables[1], row_ids, outs[0], outs[1],
                        bad_count=bad_count if bad_count is not None else _scratch_counter(), stream=stream)


def gather_rows(table, row_ids, out=None, *, encoding: str = "q2k", stream=0, version=None, check=True,
                bad_count=None, scales=None):
    """Rows `row_ids` of a device-resident table -> bf16 rows on the device.

    table: device uint8 [rows, row_bytes], C-contiguous (any size: addresses are 64-bit).
    row_ids: int32/int64 [n] device array, or a host numpy integer array [n], which is range-checked
      on the host (ValueError naming the first bad id, before any copy or launch) and then copied.
    out: optional device uint16 [n, 256]. Returns out.
    An out-of-range device id reads nothing; its row is written as NaN (0x7FC0) and counted. With
    check=True the launcher synchronizes the stream after the launch and raises ValueError naming
    the first bad index and id. bad_count: an optional device uint32 [1] counter the kernel adds the
    bad ids to; when given, the launcher neither zeroes nor reads it and never synchronizes (safe
    inside a CUDA graph capture): the caller owns the check.
    scales: fp8 only: the e8m0 scale bytes [rows, 8] (device) of a table of codes [rows, 256], as
    DeepSeek's checkpoint stores them; None reads the scales from bytes 256..263 of each row.
    """
    table, scales = _check_table(table, encoding, scales)
    n_rows = table.shape[0]
    host_ids = isinstance(row_ids, np.ndarray)
    if host_ids:
        check_array(row_ids, "row_ids", INTEGER, 1, doc="[n] (reshape(-1) it)", contiguous=False)
        pick(encoding, version)
        if out is not None:
            _output(out, row_ids.shape[0], stream)   # argument errors first, then the ids' range
        found = _first_bad(row_ids, n_rows)
        if found is not None:
            raise _bad_id_error(found, n_rows)
        dtype = np.int32 if row_ids.dtype == np.int32 else np.int64
        row_ids = cuda.to_device(np.ascontiguousarray(row_ids, dtype=dtype), stream=stream)
    own_counter = bad_count is None
    if own_counter and check and not host_ids:
        bad_count = cuda.to_device(np.zeros(1, np.uint32), stream=stream)  # read back below
    launch = prepare_gather(table, row_ids, out, encoding=encoding, stream=stream, version=version,
                            bad_count=bad_count, scales=scales)
    out = launch()
    if own_counter and check and not host_ids and row_ids.shape[0]:
        count = bad_count.copy_to_host(stream=stream)
        _sync(stream)
        if count[0]:
            ids = row_ids.copy_to_host(stream=stream)
            _sync(stream)
            found = _first_bad(ids, n_rows)
            raise _bad_id_error(found if found is not None else (-1, -1, int(count[0])), n_rows)
    return out
