"""Engram weights in a GGUF file (schema A, docs/formats.md): memory-mapped reading and writing.

Opening a file parses only the header, the metadata and the tensor index, straight off a
memory map. Large numeric metadata arrays (the 129,280-entry token map) are one `frombuffer`
slice each rather than one Python object per element, which is what makes gguf-py's reader take
seconds; tensor data is not touched until a caller asks for it, so a file whose tables are
tens of GB opens in milliseconds and a row gather faults in only the pages it reads.

    >>> with load_gguf("model.gguf") as model:
    ...     rows = model.rows(1).read(row_ids[:, 0, :])     # uint8 [n, 84] Q2_K blocks
    ...     wkv = model.layers[1].wkv_bf16()                # uint16 [N, K] bf16 words

`write_gguf` writes the same layout (deterministically: same inputs, same bytes);
`build_gguf_entries` + `write_gguf_raw` are its two halves, exposed so tests can write
deliberately broken files. `describe` renders a model for `engram-numba info`.
"""

import os
import pathlib

import numpy as np
from numba import njit

from ..config import EngramConfig, check_layer_id
from ..stages.hash.tables import EngramHashTables
from ..stages.proj.weights import WKV_ENCODING_OF_GGML_TYPE, wkv_to_bf16
from ..stages.rows.q2k import ENGRAM_ROW_BYTES
from .errors import (BadMagicError, BadMetadataError, BadTensorError, EngramFileError, HashConstantsError,
                     MissingKeyError, MissingTensorError, RowCountMismatchError, TruncatedFileError,
                     UnsupportedQuantError, UnsupportedVersionError)
from .gguf import (GGML_TYPES, GGUF_MAGIC, GGUFTensorSpec, StringArray, TensorInfo,
                   _PLAIN_DTYPES, _parse_header, human_bytes, write_gguf_raw)

ARCH = "deepseek41"
KEY_PREFIX = ARCH + "."
OLD_KEY_PREFIX = "deepseek4."

# Keys relative to the architecture prefix.
K_EMBEDDING_LENGTH = "embedding_length"
K_LAYER_IDS = "engram.layer_ids"
K_HEAD_COUNT = "engram.head_count"
K_KEY_LENGTH = "engram.key_length"
K_MAX_NGRAM = "engram.max_ngram_size"
K_MULTIPLIERS = "engram.multipliers"
K_PRIMES = "engram.primes"
K_OFFSETS = "engram.offsets"
K_TOKEN_MAP = "engram.token_map"
K_PAD_ID = "engram.pad_id"
SHAPE_KEYS = (K_EMBEDDING_LENGTH, K_LAYER_IDS, K_HEAD_COUNT, K_KEY_LENGTH, K_MAX_NGRAM)
CONSTANT_KEYS = (K_MULTIPLIERS, K_PRIMES, K_OFFSETS, K_TOKEN_MAP, K_PAD_ID)


def tensor_names(layer_id: int) -> dict[str, str]:
    """GGUF tensor names of one engram layer."""
    return {
        "table": f"blk.{layer_id}.engram_embd.weight",
        "wkv": f"blk.{layer_id}.engram_wkv.weight",
        "q": f"blk.{layer_id}.engram_q.weight",
        "k": f"blk.{layer_id}.engram_k.weight",
    }


WKV_TYPES = ("Q2_K", "BF16", "F16", "F32")
GATE_TYPES = ("F32", "F16", "BF16")
TABLE_TYPES = ("Q2_K",)


# The model ----------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _gather_rows(table, ids, out):  # pragma: no cover - jitted
    """out[i] = table[ids[i]] for uint8 [rows, 84] blocks. Checks every id before copying
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


class EngramRowReader:
    """Gathers raw Q2_K blocks of one layer's table by row id, straight from the memory map."""

    def __init__(self, layer_id: int, table: np.ndarray):
        self.layer_id = int(layer_id)
        self._table = table  # uint8 [rows, 84], a view of the map
        self.n_rows = int(table.shape[0])

    def read(self, ids, out: np.ndarray | None = None) -> np.ndarray:
        """Blocks of rows `ids` (any integer dtype and shape) -> uint8 [ids.size, 84], C order.

        Raises ValueError naming the first out-of-range id (negative ids never wrap around)."""
        ids = np.asarray(ids)
        if ids.size and not (np.issubdtype(ids.dtype, np.integer) and ids.dtype != np.bool_):
            raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
        flat = ids.reshape(-1)
        if flat.dtype == np.uint64:
            # Values past INT64_MAX would turn negative in int64: check them before converting.
            big = flat > np.uint64(np.iinfo(np.int64).max)
            if big.any():
                self._bad(flat, int(np.argmax(big)), ids.shape)
        flat = np.ascontiguousarray(flat, dtype=np.int64)
        n = flat.size
        if out is None:
            out = np.empty((n, ENGRAM_ROW_BYTES), dtype=np.uint8)
        elif (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (n, ENGRAM_ROW_BYTES)
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(
                f"out must be a writeable C-contiguous uint8 array of shape ({n}, {ENGRAM_ROW_BYTES}), got "
                f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
        bad = _gather_rows(self._table, flat, out)
        if bad >= 0:
            self._bad(flat, bad, ids.shape)
        return out

    def _bad(self, flat, i: int, shape) -> None:
        where = f"flat index {i}" if len(shape) <= 1 else f"flat index {i} (index {np.unravel_index(i, shape)})"
        raise ValueError(
            f"row id {int(flat[i])} at {where} is outside layer {self.layer_id}'s table: "
            f"valid row ids are [0, {self.n_rows})")

    def __repr__(self) -> str:
        return f"EngramRowReader(layer {self.layer_id}, {self.n_rows} rows)"


class EngramLayerFile:
    """One engram layer's tensors, as views of the memory map (nothing is read until used)."""

    table_encoding = "q2k"   # the rows stage's encoding of this table (schema A: Q2_K only, for now)

    def __init__(self, model: "EngramModel", layer_id: int, index: int):
        self._model = model
        self.layer_id = int(layer_id)
        self.index = int(index)  # position in config.layer_ids
        self.names = tensor_names(layer_id)
        self.table_info = model.tensors[self.names["table"]]
        self.wkv_info = model.tensors[self.names["wkv"]]
        self.q_info = model.tensors[self.names["q"]]
        self.k_info = model.tensors[self.names["k"]]
        self.n_rows = int(self.table_info.ne[1])
        self.wkv_type = self.wkv_info.type_name
        self.table = model._bytes(self.table_info).reshape(self.n_rows, ENGRAM_ROW_BYTES)  # uint8 [rows, 84]

    @property
    def wkv_raw(self) -> np.ndarray:
        """The stored projection, zero-copy: [N, K] uint16 bf16 words (BF16), float16 (F16),
        float32 (F32), or uint8 [N, K/256*84] Q2_K blocks (Q2_K)."""
        return self._model._tensor_view(self.wkv_info)

    def wkv_bf16(self, chunk_rows: int = 1024) -> np.ndarray:
        """The projection as the GEMM uses it: uint16 bf16 words [N, K] (zero-copy for BF16; F16
        and F32 rounded to bf16; Q2_K decoded), `chunk_rows` rows at a time (stages/proj/weights.py)."""
        return wkv_to_bf16(self.wkv_raw, WKV_ENCODING_OF_GGML_TYPE[self.wkv_type], chunk_rows=chunk_rows)

    def _gate(self, info: TensorInfo) -> np.ndarray:
        raw = self._model._tensor_view(info).reshape(self._model.config.hc, self._model.config.dim)
        if info.type_name == "F32":
            return raw
        if info.type_name == "BF16":
            return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return raw.astype(np.float32)

    @property
    def q_weight(self) -> np.ndarray:
        """float32 [hc, dim]."""
        return self._gate(self.q_info)

    @property
    def k_weight(self) -> np.ndarray:
        """float32 [hc, dim]."""
        return self._gate(self.k_info)

    def __repr__(self) -> str:
        return f"EngramLayerFile(layer {self.layer_id}: {self.n_rows} rows, wkv {self.wkv_type})"


class EngramModel:
    """An opened Engram GGUF (see `load_gguf`).

    path, version, alignment, data_offset
    kv          every metadata key -> python value / numpy array (a view of the map) / StringArray
    kv_types    key -> GGUF type name ("u32", "arr[u64]", ...)
    tensors     tensor index: name -> TensorInfo (every tensor in the file, engram or not)
    config      EngramConfig (dim, hc, layer_ids, max_ngram_size, n_heads, head_dim)
    hash_tables EngramHashTables, validated against every table's row count
    layers      layer id -> EngramLayerFile
    """

    def __init__(self, path, *, key_prefix: str = KEY_PREFIX, validate: bool = True):
        self.path = str(path)
        self.format = "gguf (schema A, q2k tables)"   # what `load_model` opened: file format and table encoding
        self.synthetic = False                         # True for the toolkit's own tiny fixture (set below)
        self.key_prefix = key_prefix
        self.problems: list[str] = []  # what validate=False let through
        self._validate = validate
        size = os.path.getsize(self.path)
        if size < 24:
            with open(self.path, "rb") as f:
                head = f.read(4)
            if head != GGUF_MAGIC[:len(head)] or not head:
                raise BadMagicError(f"{self.path}: not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")
            raise TruncatedFileError(f"{self.path}: {size} bytes is shorter than a GGUF header (24 bytes): "
                                     "the header is cut short")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._map.view(np.ndarray)  # plain ndarray (numba-friendly) sharing the map
        self._buf = buf
        (self.version, self.kv, self.kv_types, self.tensors, self.data_offset,
         self.alignment) = _parse_header(buf, self.path)
        self.config, self.hash_tables = self._read_engram()
        self.synthetic = str(self.kv.get("general.name", "")).startswith("engram-numba tiny")
        self.layers = {lid: EngramLayerFile(self, lid, i) for i, lid in enumerate(self.config.layer_ids)}
        self._readers: dict[int, EngramRowReader] = {}

    # raw access
    def _live_buf(self) -> np.ndarray:
        if self._buf is None:
            raise EngramFileError(f"{self.path}: the model is closed")
        return self._buf

    def _bytes(self, info: TensorInfo) -> np.ndarray:
        return self._live_buf()[info.offset:info.offset + info.nbytes]

    def _tensor_view(self, info: TensorInfo) -> np.ndarray:
        """Zero-copy view: numpy shape for plain types, [rows, bytes per row] uint8 for quants."""
        raw = self._bytes(info)
        dt = _PLAIN_DTYPES.get(info.type_name)
        if dt is not None:
            return raw.view(dt).reshape(info.shape)
        _, block_values, block_bytes = GGML_TYPES[info.type_name]
        return raw.reshape(*info.shape[:-1], info.shape[-1] // block_values * block_bytes)

    # metadata
    def _key(self, name: str):
        full = self.key_prefix + name
        if full in self.kv:
            return self.kv[full]
        missing_consts = [self.key_prefix + k for k in CONSTANT_KEYS if self.key_prefix + k not in self.kv]
        old = OLD_KEY_PREFIX + name
        if old in self.kv and self.key_prefix != OLD_KEY_PREFIX:
            raise MissingKeyError(
                f"{self.path}: metadata key {full!r} is missing; the file uses the old prefix "
                f"{OLD_KEY_PREFIX!r} (it has {old!r}). Re-convert the model, or pass "
                f"key_prefix={OLD_KEY_PREFIX!r} to load_gguf to read it as it is")
        if name in CONSTANT_KEYS and all(self.key_prefix + k in self.kv for k in SHAPE_KEYS):
            raise MissingKeyError(
                f"{self.path}: metadata key {full!r} is missing: the file has the Engram shape keys but lacks "
                f"the hash constants (missing: {', '.join(missing_consts)}); re-convert with a converter that "
                "writes all five")
        raise MissingKeyError(f"{self.path}: metadata key {full!r} is missing")

    def _int_key(self, name: str) -> int:
        v = self._key(name)
        if isinstance(v, np.ndarray) and v.size == 1 and np.issubdtype(v.dtype, np.integer):
            v = int(v[0])
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadMetadataError(
                f"{self.path}: {self.key_prefix + name} must be an integer, got {self.kv_types[self.key_prefix + name]} {v!r}")
        return v

    def _int_array(self, name: str, expect: int | None, expect_text: str = "") -> np.ndarray:
        """A numeric array key as a fresh int64 [n] (aligned, owned) array."""
        full = self.key_prefix + name
        v = self._key(name)
        if isinstance(v, list) and all(isinstance(x, np.ndarray) for x in v):  # array of arrays
            v = np.concatenate(v) if v else np.zeros(0, np.int64)
        if isinstance(v, int) and not isinstance(v, bool):
            v = np.array([v])
        if not isinstance(v, np.ndarray) or not np.issubdtype(v.dtype, np.integer):
            raise BadMetadataError(f"{self.path}: {full} must be an integer array, got {self.kv_types[full]}")
        if v.dtype == np.uint64 and v.size and int(v.max()) > np.iinfo(np.int64).max:
            i = int(np.argmax(v > np.uint64(np.iinfo(np.int64).max)))
            raise BadMetadataError(f"{self.path}: {full}[{i}] = {int(v[i])} does not fit in int64")
        if expect is not None and v.size != expect:
            raise BadMetadataError(f"{self.path}: {full} has {v.size} entries, expected {expect_text} = {expect}")
        return np.array(v, dtype=np.int64)

    def _read_engram(self) -> tuple[EngramConfig, EngramHashTables]:
        p = self.key_prefix
        dim = self._int_key(K_EMBEDDING_LENGTH)
        layer_ids = tuple(int(x) for x in self._int_array(K_LAYER_IDS, None))
        n_heads = self._int_key(K_HEAD_COUNT)
        head_dim = self._int_key(K_KEY_LENGTH)
        max_ngram = self._int_key(K_MAX_NGRAM)
        if not layer_ids:
            raise BadMetadataError(f"{self.path}: {p}{K_LAYER_IDS} is empty")
        for k in CONSTANT_KEYS:  # report missing constants before any tensor problem
            self._key(k)

        for lid in layer_ids:
            for name in tensor_names(lid).values():
                if name not in self.tensors:
                    raise MissingTensorError(
                        f"{self.path}: tensor {name!r} of engram layer {lid} is missing "
                        f"(layer ids from {p}{K_LAYER_IDS}: {list(layer_ids)})")
        hc = self._read_hc(layer_ids, dim)
        try:
            config = EngramConfig(dim=dim, hc=hc, layer_ids=layer_ids, max_ngram_size=max_ngram,
                                  n_heads=n_heads, head_dim=head_dim)
        except ValueError as exc:
            raise BadMetadataError(f"{self.path}: the Engram shape keys do not make a valid config: {exc}") from None

        L, M, H, O = config.n_layers, max_ngram, n_heads, config.n_orders
        multipliers = self._int_array(K_MULTIPLIERS, L * M, f"layers*max_ngram_size = {L}*{M}").reshape(L, M)
        primes = self._int_array(K_PRIMES, L * O * H, f"layers*orders*heads = {L}*{O}*{H}").reshape(L, O, H)
        offsets = self._int_array(K_OFFSETS, L * O * H, f"layers*orders*heads = {L}*{O}*{H}").reshape(L, O * H)
        token_map = self._int_array(K_TOKEN_MAP, None)
        if token_map.size == 0:
            raise BadMetadataError(f"{self.path}: {p}{K_TOKEN_MAP} is empty")
        pad_id = self._int_key(K_PAD_ID)
        try:
            tables = EngramHashTables(layer_ids=layer_ids, multipliers=multipliers, primes=primes,
                                      offsets=offsets, token_map=token_map, pad_id=pad_id)
        except ValueError as exc:
            raise HashConstantsError(f"{self.path}: bad hash constants: {exc}") from None

        rows = []
        for li, lid in enumerate(layer_ids):
            self._check_layer_tensors(config, lid)
            info = self.tensors[tensor_names(lid)["table"]]
            have, want = int(info.ne[1]), int(tables.table_rows[li])
            if have != want:
                msg = (f"layer {lid}: its primes ({p}{K_PRIMES}) sum to {want} rows but "
                       f"{info.name} has {have} rows")
                if self._validate:
                    raise RowCountMismatchError(f"{self.path}: {msg}")
                self.problems.append(msg)
            rows.append(have)
        try:
            tables.validate(rows if self._validate else None)
        except ValueError as exc:
            if self._validate:
                raise HashConstantsError(f"{self.path}: bad hash constants: {exc}") from None
            self.problems.append(f"bad hash constants: {exc}")
        return config, tables

    def _read_hc(self, layer_ids, dim: int) -> int:
        hc = None
        for lid in layer_ids:
            names = tensor_names(lid)
            for key in ("q", "k"):
                info = self.tensors[names[key]]
                ne = info.ne if len(info.ne) == 2 else info.ne + (1,)  # a 1-D gate vector is hc = 1
                if len(info.ne) > 2 or ne[0] != dim:
                    raise BadTensorError(
                        f"{self.path}: tensor {info.name!r} has ggml ne {list(info.ne)}, expected "
                        f"[dim={dim}, hc] (dim from {self.key_prefix}{K_EMBEDDING_LENGTH})")
                if hc is None:
                    hc = int(ne[1])
                elif ne[1] != hc:
                    raise BadTensorError(
                        f"{self.path}: tensor {info.name!r} has ggml ne {list(info.ne)}, expected [{dim}, {hc}] "
                        f"(hc = {hc} from blk.{layer_ids[0]}.engram_q.weight)")
        return hc

    def _check_layer_tensors(self, config: EngramConfig, lid: int) -> None:
        names = tensor_names(lid)
        table = self.tensors[names["table"]]
        if table.type_name not in TABLE_TYPES:
            raise UnsupportedQuantError(
                f"{self.path}: tensor {table.name!r} is {table.type_name}; only "
                f"{', '.join(TABLE_TYPES)} tables are supported for now")
        if len(table.ne) != 2 or table.ne[0] != config.head_dim:
            raise BadTensorError(
                f"{self.path}: tensor {table.name!r} has ggml ne {list(table.ne)}, expected "
                f"[{config.head_dim}, rows]")
        wkv = self.tensors[names["wkv"]]
        if wkv.type_name not in WKV_TYPES:
            raise UnsupportedQuantError(
                f"{self.path}: tensor {wkv.name!r} is {wkv.type_name}; supported projection types: "
                f"{', '.join(WKV_TYPES)}")
        want = (config.proj_in, config.proj_out)
        if wkv.ne != want:
            raise BadTensorError(
                f"{self.path}: tensor {wkv.name!r} has ggml ne {list(wkv.ne)}, expected "
                f"[K=n_hash_cols*head_dim={config.proj_in}, N=dim*(hc+1)={config.proj_out}]")
        for key in ("q", "k"):
            info = self.tensors[names[key]]
            if info.type_name not in GATE_TYPES:
                raise UnsupportedQuantError(
                    f"{self.path}: tensor {info.name!r} is {info.type_name}; gate vectors must be "
                    f"{', '.join(GATE_TYPES)}")

    # public API
    def rows(self, layer_id: int) -> EngramRowReader:
        """The row reader of one layer's table."""
        lid = check_layer_id(layer_id)
        if lid not in self.layers:
            raise ValueError(f"layer id {layer_id} is not an engram layer of {self.path} "
                             f"(engram layers: {list(self.config.layer_ids)})")
        self._live_buf()
        if lid not in self._readers:
            self._readers[lid] = EngramRowReader(lid, self.layers[lid].table)
        return self._readers[lid]

    def close(self) -> None:
        """Drop this model's hold on the map. Arrays already taken from it stay valid (they keep
        the mapping alive until they are freed)."""
        self._buf = None
        self._map = None
        self._readers.clear()

    def __enter__(self) -> "EngramModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"EngramModel({self.path!r}: dim {c.dim}, hc {c.hc}, layers {list(c.layer_ids)}, "
                f"{len(self.tensors)} tensors)")


def load_gguf(path, *, key_prefix: str = KEY_PREFIX, validate: bool = True) -> EngramModel:
    """Open an Engram GGUF (schema A) memory-mapped; reads only the header and metadata.

    key_prefix: the architecture prefix of the Engram keys ('deepseek41.'; files made with the
    older converters use 'deepseek4.').
    validate=False: open a file whose hash constants disagree with each other or with the table
    row counts (shapes must still be right); the problems are listed in `model.problems`, for
    `describe` to show. Never hash with such a model."""
    return EngramModel(path, key_prefix=key_prefix, validate=validate)


def _infer_type(arr: np.ndarray, explicit: str | None, what: str) -> str:
    if explicit is not None:
        return explicit
    by_dtype = {np.dtype(np.uint16): "BF16", np.dtype(np.float32): "F32",
                np.dtype(np.float16): "F16", np.dtype(np.uint8): "Q2_K"}
    if arr.dtype not in by_dtype:
        raise ValueError(f"{what}: cannot infer a ggml type from dtype {arr.dtype} "
                         "(uint16 -> BF16, float32 -> F32, float16 -> F16, uint8 -> Q2_K)")
    return by_dtype[arr.dtype]


def _ne_of(arr: np.ndarray, type_name: str) -> tuple[int, ...]:
    """ggml ne of an array holding a tensor of `type_name` (quantised: uint8 [..., bytes per row])."""
    _, block_values, block_bytes = GGML_TYPES[type_name]
    shape = list(arr.shape)
    if block_values > 1:
        if shape[-1] % block_bytes:
            raise ValueError(f"{shape[-1]} bytes per row is not a whole number of {type_name} blocks ({block_bytes} B)")
        shape[-1] = shape[-1] // block_bytes * block_values
    return tuple(int(x) for x in reversed(shape))


def _gate_array(arr, type_name: str | None) -> tuple[np.ndarray, str]:
    arr = np.asarray(arr)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    t = _infer_type(arr, type_name, "gate vector")
    return arr, t


def build_gguf_entries(config: EngramConfig, hash_tables: EngramHashTables, layers: dict, *,
                       name: str = "engram", key_prefix: str = KEY_PREFIX, omit_keys=(),
                       kv_overrides: dict | None = None, check: bool = True):
    """-> (kvs, tensors) for `write_gguf_raw`.

    layers: layer id -> {"table": uint8 [rows, 84], "wkv": [N, K] uint16 (BF16) / float32 (F32) /
    float16 (F16) or uint8 [N, K/256*84] (Q2_K), "q_weight", "k_weight": float32 [hc, dim]},
    optionally "wkv_type", "table_type", "q_type", "k_type" to name the ggml type explicitly.
    omit_keys: full key names to leave out. kv_overrides: full key -> (type name, value), replacing
    or adding entries (the test suite's way to write wrong lengths or types).
    check: verify shapes against config and hash_tables before writing.
    """
    t = hash_tables
    p = key_prefix
    kvs = [
        ("general.architecture", "str", p.rstrip(".")),
        ("general.name", "str", name),
        (p + K_EMBEDDING_LENGTH, "u32", config.dim),
        (p + K_LAYER_IDS, "arr[i32]", np.asarray(config.layer_ids, dtype=np.int64)),
        (p + K_HEAD_COUNT, "u32", config.n_heads),
        (p + K_KEY_LENGTH, "u32", config.head_dim),
        (p + K_MAX_NGRAM, "u32", config.max_ngram_size),
        (p + K_MULTIPLIERS, "arr[u64]", t.multipliers.ravel()),
        (p + K_PRIMES, "arr[u64]", t.primes.ravel()),
        (p + K_OFFSETS, "arr[u64]", t.offsets.ravel()),
        (p + K_TOKEN_MAP, "arr[i32]", t.token_map),
        (p + K_PAD_ID, "u32", t.pad_id),
    ]
    overrides = dict(kv_overrides or {})
    out_kvs = []
    for key, tname, value in kvs:
        if key in omit_keys:
            continue
        if key in overrides:
            tname, value = overrides.pop(key)
        out_kvs.append((key, tname, value))
    out_kvs += [(k, tn, v) for k, (tn, v) in overrides.items() if k not in omit_keys]

    if check and tuple(layers) != tuple(config.layer_ids):
        raise ValueError(f"layers has ids {list(layers)}, config.layer_ids is {list(config.layer_ids)} (same order)")
    tensors = []
    for li, lid in enumerate(layers):
        spec = layers[lid]
        names = tensor_names(lid)
        table = np.asarray(spec["table"])
        table_type = spec.get("table_type", "Q2_K")
        wkv = np.asarray(spec["wkv"])
        wkv_type = _infer_type(wkv, spec.get("wkv_type"), f"layer {lid} wkv")
        q, q_type = _gate_array(spec["q_weight"], spec.get("q_type"))
        k, k_type = _gate_array(spec["k_weight"], spec.get("k_type"))
        if check:
            want_rows = int(t.table_rows[t.layer_index(lid)])
            if table.dtype != np.uint8 or table.shape != (want_rows, ENGRAM_ROW_BYTES):
                raise ValueError(f"layer {lid} table must be uint8 [{want_rows}, {ENGRAM_ROW_BYTES}] "
                                 f"(rows = sum of its primes), got {table.dtype} {table.shape}")
            wkv_ne = _ne_of(wkv, wkv_type)
            if wkv_ne != (config.proj_in, config.proj_out):
                raise ValueError(f"layer {lid} wkv has ggml ne {list(wkv_ne)}, expected "
                                 f"[{config.proj_in}, {config.proj_out}] (numpy [N, K] = "
                                 f"[{config.proj_out}, {config.proj_in}])")
            for what, arr in (("q_weight", q), ("k_weight", k)):
                if arr.shape != (config.hc, config.dim):
                    raise ValueError(f"layer {lid} {what} must be [hc, dim] = [{config.hc}, {config.dim}], got {arr.shape}")
        tensors += [
            GGUFTensorSpec(names["table"], table_type, _ne_of(table, table_type), table),
            GGUFTensorSpec(names["wkv"], wkv_type, _ne_of(wkv, wkv_type), wkv),
            GGUFTensorSpec(names["q"], q_type, _ne_of(q, q_type), q),
            GGUFTensorSpec(names["k"], k_type, _ne_of(k, k_type), k),
        ]
    return out_kvs, tensors


def write_gguf(path, config: EngramConfig, hash_tables: EngramHashTables, layers: dict, *,
               name: str = "engram", key_prefix: str = KEY_PREFIX, omit_keys=(),
               kv_overrides: dict | None = None, check: bool = True) -> pathlib.Path:
    """Write an Engram GGUF (schema A): the nine engram keys, embedding_length,
    general.architecture and general.name, and four tensors per layer (see build_gguf_entries
    for `layers`). Same inputs give the same bytes."""
    kvs, tensors = build_gguf_entries(config, hash_tables, layers, name=name, key_prefix=key_prefix,
                                      omit_keys=omit_keys, kv_overrides=kv_overrides, check=check)
    return write_gguf_raw(path, kvs, tensors)


# describe ------------------------------------------------------------------------------------

def _short_value(value, limit: int = 4) -> str:
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (np.ndarray, list, StringArray)):
        n = len(value)
        head = [value[i] for i in range(min(n, limit))]
        head = [int(x) if isinstance(x, np.integer) else float(x) if isinstance(x, np.floating) else x
                for x in head]
        body = ", ".join(repr(x) if isinstance(x, str) else str(x) for x in head)
        return f"{n} entries [{body}{', ...' if n > limit else ''}]"
    return str(value)


def _json_value(value, limit: int = 8):
    if isinstance(value, (np.ndarray, list, StringArray)):
        n = len(value)
        head = [value[i] for i in range(min(n, limit))]
        head = [int(x) if isinstance(x, (np.integer, bool)) else float(x) if isinstance(x, np.floating) else
                (x if isinstance(x, (str, int, float)) else str(x)) for x in head]
        return {"count": n, "head": head}
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def describe_dict(model: EngramModel) -> dict:
    """What `describe` shows, as plain data (`engram-numba info --json`)."""
    c, t = model.config, model.hash_tables
    checks = []
    for li, lid in enumerate(c.layer_ids):
        want, have = int(t.table_rows[li]), model.layers[lid].n_rows
        checks.append({"check": f"layer {lid}: primes sum vs table rows", "primes_sum": want, "table_rows": have,
                       "ok": want == have})
    return {
        "file": model.path, "format": model.format,
        "gguf": {"version": model.version, "alignment": model.alignment, "data_offset": model.data_offset},
        "config": {"dim": c.dim, "hc": c.hc, "layer_ids": list(c.layer_ids), "max_ngram_size": c.max_ngram_size,
                   "n_heads": c.n_heads, "head_dim": c.head_dim, "n_hash_cols": c.n_hash_cols,
                   "proj_in": c.proj_in, "proj_out": c.proj_out, "eps": c.eps},
        "hash": {"raw_vocab": int(t.token_map.size), "compressed_vocab": int(t.compressed_vocab_size),
                 "pad_id": int(t.pad_id), "table_rows": [int(r) for r in t.table_rows]},
        "layers": {str(lid): {"table_encoding": lf.table_encoding, "table_rows": lf.n_rows, "wkv_type": lf.wkv_type}
                   for lid, lf in model.layers.items()},
        "metadata": {k: {"type": model.kv_types[k], "value": _json_value(v)} for k, v in model.kv.items()},
        "tensors": [{"name": n, "type": i.type_name, "shape": list(i.shape), "ne": list(i.ne), "offset": i.offset,
                     "bytes": i.nbytes} for n, i in model.tensors.items()],
        "checks": checks + [{"check": "cuda gate kernels need dim % 8 == 0", "ok": c.dim % 8 == 0}],
        "problems": list(model.problems),
    }


def describe(model: EngramModel) -> str:
    """Human-readable summary of an opened model, for `engram-numba info FILE`."""
    c, t = model.config, model.hash_tables
    lines = [f"file      {model.path}",
             f"format    GGUF v{model.version}, alignment {model.alignment}, data at byte {model.data_offset}",
             "", "configuration",
             f"  dim {c.dim}   hc {c.hc}   layers {list(c.layer_ids)}   max_ngram_size {c.max_ngram_size} "
             f"(orders {c.n_orders})   heads {c.n_heads}   head_dim {c.head_dim}",
             f"  n_hash_cols {c.n_hash_cols}   projection K {c.proj_in} -> N {c.proj_out}   "
             f"token map {t.token_map.size} raw -> {t.compressed_vocab_size} compressed, pad {t.pad_id}",
             "", f"metadata ({len(model.kv)} keys)"]
    w = max((len(k) for k in model.kv), default=0)
    for key, value in model.kv.items():
        lines.append(f"  {key:<{w}}  {model.kv_types[key]:<9} {_short_value(value)}")
    lines += ["", f"tensors ({len(model.tensors)})"]
    w = max((len(n) for n in model.tensors), default=0)
    for name, info in model.tensors.items():
        lines.append(f"  {name:<{w}}  {info.type_name:<5} numpy {str(list(info.shape)):<14} "
                     f"ne {str(list(info.ne)):<14} {human_bytes(info.nbytes)}")
    lines += ["", "cuda backend: the gate kernels need dim % 8 == 0: "
              + ("met" if c.dim % 8 == 0 else f"NOT met (dim {c.dim}): use the reference or cpu backend for the gate")]
    lines += ["", "primes vs table rows"]
    for li, lid in enumerate(c.layer_ids):
        want = int(t.table_rows[li])
        have = model.layers[lid].n_rows
        lines.append(f"  layer {lid}: primes sum {want}, table rows {have}  {'OK' if want == have else 'MISMATCH'}")
    if model.problems:
        lines += ["", "problems (opened with validate=False)"] + [f"  {m}" for m in model.problems]
    return "\n".join(lines)


__all__ = [
    "EngramModel", "EngramLayerFile", "EngramRowReader", "TensorInfo", "StringArray", "GGUFTensorSpec",
    "load_gguf", "write_gguf", "write_gguf_raw", "build_gguf_entries", "describe", "describe_dict", "tensor_names",
    "EngramFileError", "BadMagicError", "UnsupportedVersionError", "TruncatedFileError", "MissingKeyError",
    "BadMetadataError", "HashConstantsError", "RowCountMismatchError", "MissingTensorError",
    "BadTensorError", "UnsupportedQuantError",
]
