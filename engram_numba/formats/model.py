"""What every format's model shares: the row reader, the layer, the wkv decoding and cache, the
exact checks of the hash constants, and the base class with `rows`, `close` and the context
manager (docs/formats.md, "The model object").

A loader (schema A, schema B, the HF checkpoint) fills in `config`, `hash_tables`, `layers`,
`tensors`, `kv`, `format` and `shards`; everything downstream (`Pipeline`, `EngramV41`, `info`,
the statistics) reads only those.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..config import check_layer_id
from ..stages.hash.tables import INT64_MAX
from ..stages.proj.weights import WKV_ENCODING_OF_GGML_TYPE, WKV_ENCODINGS, wkv_to_bf16
from ..stages.rows.encodings import ENCODINGS
from .errors import EngramFileError, HashOverflowError
from .rowcheck import nonfinite_rows


# Views of the stages' encoding tables (the rows stage owns the table encodings, the proj stage
# the wkv encodings): ggml type -> (table encoding, bytes of one 256-value row), and so on.
GGML_TABLE_ENCODINGS = {e.ggml_type: (e.name, e.row_bytes) for e in ENCODINGS.values() if e.ggml_type}
FP8_ROW_BYTES = ENCODINGS["fp8"].row_bytes   # 256 e4m3 codes, then 8 e8m0 scales (one per 32 values)
ROW_BYTES = {e.name: e.row_bytes for e in ENCODINGS.values()}
GGML_WKV_ENCODINGS = WKV_ENCODING_OF_GGML_TYPE   # ggml type -> wkv encoding


# The row reader ------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _gather_rows(table, ids, out):  # pragma: no cover - jitted
    """out[i] = table[ids[i]] for a uint8 [rows, row_bytes] table. Checks every id before copying
    anything; returns the index of the first bad id, or -1."""
    n_rows = table.shape[0]
    for i in range(ids.size):
        if ids[i] < 0 or ids[i] >= n_rows:
            return i
    width = table.shape[1]
    for i in range(ids.size):
        r = ids[i]
        for b in range(width):
            out[i, b] = table[r, b]
    return -1


@njit(cache=True, nogil=True)
def _gather_rows_split(codes, scales, ids, out):  # pragma: no cover - jitted
    """out[i] = codes[ids[i]] ++ scales[ids[i]]: the 264-byte fp8 row of a checkpoint that keeps
    codes [rows, 256] and scales [rows, 8] in two tensors."""
    n_rows = codes.shape[0]
    for i in range(ids.size):
        if ids[i] < 0 or ids[i] >= n_rows:
            return i
    wc, ws = codes.shape[1], scales.shape[1]
    for i in range(ids.size):
        r = ids[i]
        for b in range(wc):
            out[i, b] = codes[r, b]
        for b in range(ws):
            out[i, wc + b] = scales[r, b]
    return -1


class EngramRowReader:
    """Gathers raw rows of one layer's table by row id, straight from the memory map.

    table:  uint8 [rows, row_bytes] in the encoding's row layout, or (with `scales`) the fp8 codes
            [rows, 256] of a checkpoint that keeps the scales [rows, 8] apart; `read` then returns
            whole 264-byte rows (codes, then scales), the rows stage's fp8 layout.
    """

    def __init__(self, layer_id: int, table: np.ndarray, encoding: str = "q2k", scales: np.ndarray | None = None):
        self.layer_id = int(layer_id)
        self.encoding = encoding
        self._table = table    # uint8 [rows, row_bytes] (or fp8 codes [rows, 256]), a view of the map
        self._scales = scales  # None, or uint8 [rows, 8]
        self.n_rows = int(table.shape[0])
        self.row_bytes = int(table.shape[1]) + (0 if scales is None else int(scales.shape[1]))

    def _flat_ids(self, ids) -> tuple[np.ndarray, tuple]:
        ids = np.asarray(ids)
        if ids.size and not (np.issubdtype(ids.dtype, np.integer) and ids.dtype != np.bool_):
            raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
        flat = ids.reshape(-1)
        if flat.dtype == np.uint64:
            # Values past INT64_MAX would turn negative in int64: check them before converting.
            big = flat > np.uint64(INT64_MAX)
            if big.any():
                self._bad(flat, int(np.argmax(big)), ids.shape)
        return np.ascontiguousarray(flat, dtype=np.int64), ids.shape

    def read(self, ids, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `ids` (any integer dtype and shape) -> uint8 [ids.size, row_bytes], C order.

        Raises ValueError naming the first out-of-range id (negative ids never wrap around, and a
        uint64 id past int64 is reported as the value it is)."""
        flat, shape = self._flat_ids(ids)
        n, width = flat.size, self.row_bytes
        if out is None:
            out = np.empty((n, width), dtype=np.uint8)
        elif (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (n, width)
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(
                f"out must be a writeable C-contiguous uint8 array of shape ({n}, {width}), got "
                f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
        if self._scales is None:
            bad = _gather_rows(self._table, flat, out)
        else:
            bad = _gather_rows_split(self._table, self._scales, flat, out)
        if bad >= 0:
            self._bad(flat, bad, shape)
        return out

    def check(self, ids) -> np.ndarray:
        """bool [ids.size]: True where the row decodes to a NaN or infinite value (an e4m3 NaN code,
        an e8m0 scale byte 255, an fp8 value past fp32's range, an inf/NaN fp16 scale). The rows
        stage decodes such rows to NaN/inf as stored; this is how to find them first."""
        flat, shape = self._flat_ids(ids)
        return nonfinite_rows(self.read(flat), self.encoding)

    def _bad(self, flat, i: int, shape) -> None:
        where = f"flat index {i}" if len(shape) <= 1 else f"flat index {i} (index {np.unravel_index(i, shape)})"
        raise ValueError(
            f"row id {int(flat[i])} at {where} is outside layer {self.layer_id}'s table: "
            f"valid row ids are [0, {self.n_rows})")

    def __repr__(self) -> str:
        return f"EngramRowReader(layer {self.layer_id}, {self.n_rows} rows, {self.encoding})"


# wkv -------------------------------------------------------------------------------------------

# The layer -------------------------------------------------------------------------------------

class EngramLayer:
    """One engram layer's weights as zero-copy views: the model protocol's layer, the one type
    every loader fills (schema A, schema B, the HF checkpoint, the bench's synthetic models) and
    every consumer reads field by field (`Pipeline`, `EngramV41`, `info`, the statistics).

    layer_id, index (position in config.layer_ids), n_rows
    table           uint8 [rows, row_bytes] raw rows (fp8 checkpoint: the codes [rows, 256])
    table_scales    None, or uint8 [rows, 8] (fp8 checkpoint: the e8m0 scales)
    table_encoding  a table encoding of the rows stage (`stages.rows.encodings.ENCODINGS`:
                    "q2k" | "q3_k" | "q4_k" | "q8_0" | "fp8")
    wkv_raw         the stored projection (see `wkv_raw`)
    wkv_encoding    a wkv encoding of the proj stage (`stages.proj.weights.WKV_ENCODINGS`:
                    "bf16" | "f16" | "f32" | "q2k" | "q8_0" | "fp8")
    wkv_scales      fp8: uint8 [ceil(N/32), K/32] e8m0 tile scales; else None
    q_weight, k_weight  float32 [hc, dim] (arrays, or callables that read them on first use)
    Encodings are checked here, so a misspelt one fails when the model opens, naming the layer.
    """

    layer_id: int
    index: int
    n_rows: int
    table: np.ndarray
    table_scales: np.ndarray | None
    table_encoding: str
    wkv_encoding: str
    wkv_scales: np.ndarray | None

    def __init__(self, layer_id: int, index: int, *, table: np.ndarray, table_encoding: str,
                 wkv_raw: np.ndarray, wkv_encoding: str, q_weight, k_weight, table_scales=None,
                 wkv_scales=None, wkv_shape: tuple[int, int] | None = None, names: dict | None = None):
        if table_encoding not in ENCODINGS:
            raise ValueError(f"engram layer {layer_id}: unknown table encoding {table_encoding!r}; encodings are "
                             f"{list(ENCODINGS)}")
        if wkv_encoding not in WKV_ENCODINGS:
            raise ValueError(f"engram layer {layer_id}: unknown wkv encoding {wkv_encoding!r}; encodings are "
                             f"{list(WKV_ENCODINGS)}")
        if table_scales is not None and table_encoding != "fp8":
            raise ValueError(f"engram layer {layer_id}: separate table scales are for fp8 tables, not {table_encoding}")
        if wkv_scales is not None and wkv_encoding != "fp8":
            raise ValueError(f"engram layer {layer_id}: wkv scales are for an fp8 wkv, not {wkv_encoding}")
        self.layer_id = int(layer_id)
        self.index = int(index)
        self.table = table
        self.table_scales = table_scales
        self.table_encoding = table_encoding
        self.n_rows = int(table.shape[0])
        self.wkv_encoding = wkv_encoding
        self.wkv_scales = wkv_scales
        self.wkv_shape = wkv_shape           # (N, K) of the decoded projection
        self.names = dict(names or {})       # role -> tensor name in the file
        self._wkv_raw = wkv_raw
        self._q, self._k = q_weight, k_weight
        self._wkv_bf16 = None

    @property
    def row_bytes(self) -> int:
        return ROW_BYTES[self.table_encoding]

    @property
    def wkv_raw(self) -> np.ndarray:
        """The stored projection, zero-copy: [N, K] uint16 bf16 words (bf16), float16 (f16),
        float32 (f32), uint8 [N, K/256*84] (q2k), uint8 [N, K/32*34] (q8_0), or the fp8 codes
        uint8 [N, K] with `wkv_scales` uint8 [N/32, K/32] (fp8)."""
        return self._wkv_raw

    @property
    def wkv_type(self) -> str:
        """The stored projection's type in the file's own spelling (kept for schema A's callers)."""
        if self.wkv_encoding == "fp8":
            return "F8_E4M3"          # DeepSeek's safetensors dtype (no GGUF type holds it)
        return {enc: t for t, enc in WKV_ENCODING_OF_GGML_TYPE.items()}[self.wkv_encoding]

    def wkv_bf16(self, chunk_rows: int = 1024) -> np.ndarray:
        """The projection as the GEMM uses it: uint16 bf16 words [N, K], decoded once (in row
        chunks, so peak host memory stays near the result) and cached on the layer. BF16 is the
        stored bytes (zero-copy); FP8 and the GGML types are exact or rounded as docs/numerics.md says
        (F16 and F32 are rounded to bf16, to nearest even)."""
        if self._wkv_bf16 is None:
            self._wkv_bf16 = wkv_to_bf16(self._wkv_raw, self.wkv_encoding, scales=self.wkv_scales,
                                         chunk_rows=chunk_rows)
        return self._wkv_bf16

    @property
    def q_weight(self) -> np.ndarray:
        """float32 [hc, dim]."""
        return self._q() if callable(self._q) else self._q

    @property
    def k_weight(self) -> np.ndarray:
        """float32 [hc, dim]."""
        return self._k() if callable(self._k) else self._k

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layer {self.layer_id}: {self.n_rows} rows, {self.table_encoding} table, "
                f"{self.wkv_encoding} wkv)")


def widen_gate(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Gate vectors as float32: F32 as is (zero-copy), BF16 widened exactly, F16 widened exactly."""
    if type_name == "F32":
        return raw
    if type_name == "BF16":
        return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return raw.astype(np.float32)


# Exact checks of the hash constants ----------------------------------------------------------------

def check_constant_sums(path: str, layer_ids, primes: np.ndarray, offsets: np.ndarray | None = None,
                        what: str = "primes") -> list[int]:
    """Each layer's primes summed in exact integers: its row count. Raises HashOverflowError when
    a row count (the largest row id + 1) does not fit in int64, before any int64 arithmetic could
    wrap. Returns the row counts as Python ints."""
    out = []
    flat = np.asarray(primes).reshape(len(layer_ids), -1)
    for li, lid in enumerate(layer_ids):
        total = 0
        for col, p in enumerate(flat[li].tolist()):
            total += int(p)
            if total > INT64_MAX:
                raise HashOverflowError(
                    f"{path}: the {what} of layer {lid} summed up to column {col} give {total}, more than "
                    f"int64 holds ({INT64_MAX}): row ids of that layer would overflow")
        out.append(total)
    if offsets is not None:
        offs = np.asarray(offsets).reshape(len(layer_ids), -1)
        for li, lid in enumerate(layer_ids):
            for col, (o, p) in enumerate(zip(offs[li].tolist(), flat[li].tolist())):
                if int(o) + int(p) > INT64_MAX:
                    raise HashOverflowError(
                        f"{path}: offset {int(o)} + prime {int(p)} of layer {lid} column {col} is more than "
                        f"int64 holds ({INT64_MAX}): row ids of that layer would overflow")
    return out


# The model base ---------------------------------------------------------------------------------

class EngramModelBase:
    """What every format's model has (the model protocol, docs/formats.md).

    path, format, config, hash_tables, layers, tensors, kv, kv_types, shards, problems,
    tokenizer_path; rows(layer_id), close(), context manager.
    """

    path: str
    format: str
    tokenizer_path: str | None = None

    def _init_common(self, path, validate: bool) -> None:
        self.path = str(path)
        self.problems: list[str] = []   # what validate=False let through
        self._validate = validate
        self._readers: dict[int, EngramRowReader] = {}
        self._closed = False
        self.kv: dict = {}
        self.kv_types: dict = {}
        self.tensors: dict = {}
        self.shards: list[str] = [self.path]
        self.checks: list[dict] = []    # format-specific checks that passed, for `info`
        self.synthetic = False          # True for the toolkit's own tiny fixtures (plots say so)

    def _problem(self, exc_type, message: str) -> None:
        """Raise under validate=True; otherwise remember the problem for `describe`."""
        if self._validate:
            raise exc_type(f"{self.path}: {message}")
        self.problems.append(message)

    def _check_open(self) -> None:
        if self._closed:
            raise EngramFileError(f"{self.path}: the model is closed")

    def rows(self, layer_id: int) -> EngramRowReader:
        """The row reader of one layer's table."""
        lid = check_layer_id(layer_id)
        if lid not in self.layers:
            raise ValueError(f"layer id {layer_id} is not an engram layer of {self.path} "
                             f"(engram layers: {list(self.config.layer_ids)})")
        self._check_open()
        if lid not in self._readers:
            lf = self.layers[lid]
            self._readers[lid] = EngramRowReader(lid, lf.table, lf.table_encoding, lf.table_scales)
        return self._readers[lid]

    def close(self) -> None:
        """Drop this model's hold on its maps. Arrays already taken from it stay valid (they keep
        the mapping alive until they are freed)."""
        self._closed = True
        self._readers.clear()
        self._release()

    def _release(self) -> None:  # a format drops its maps here
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}({self.path!r}: {self.format}; dim {c.dim}, hc {c.hc}, "
                f"layers {list(c.layer_ids)}, {len(self.tensors)} tensors)")
