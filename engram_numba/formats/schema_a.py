"""Engram weights in a GGUF file (schema A, docs/formats.md): memory-mapped reading and writing.

Schema A is the layout of the llama.cpp / ik_llama.cpp converters: per layer `engram_embd`
(the table: Q2_K, Q3_K, Q4_K or Q8_0), `engram_wkv` (Q2_K, Q8_0, BF16, F16 or F32) and the gate
vectors `engram_q` / `engram_k`, with nine `deepseek41.engram.*` keys. The file may be one GGUF
or the shards of a split GGUF (formats/split.py).

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

import dataclasses
import pathlib
from collections.abc import Mapping

import numpy as np

from ..config import EngramConfig
from ..stages.hash.tables import EngramHashTables
from ..stages.rows.q2k import ENGRAM_ROW_BYTES
from .describe import describe, describe_dict
from .errors import (BadMagicError, BadMetadataError, BadTensorError, EngramFileError, HashConstantsError,
                     MissingKeyError, MissingTensorError, RowCountMismatchError, TruncatedFileError,
                     UnsupportedQuantError, UnsupportedVersionError, WrongArchitectureError)
from .gguf import (GGML_TYPES, GGUFTensorSpec, StringArray, TensorInfo, _PLAIN_DTYPES, write_gguf_raw)
from .model import (GGML_TABLE_ENCODINGS, GGML_WKV_ENCODINGS, EngramLayer, EngramModelBase, EngramRowReader,
                    check_constant_sums, widen_gate)
from .split import GGUFContainer, open_gguf_container

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
ENGRAM_KEYS = (K_LAYER_IDS, K_HEAD_COUNT, K_KEY_LENGTH, K_MAX_NGRAM) + CONSTANT_KEYS   # the nine


def tensor_names(layer_id: int) -> dict[str, str]:
    """GGUF tensor names of one engram layer."""
    return {
        "table": f"blk.{layer_id}.engram_embd.weight",
        "wkv": f"blk.{layer_id}.engram_wkv.weight",
        "q": f"blk.{layer_id}.engram_q.weight",
        "k": f"blk.{layer_id}.engram_k.weight",
    }


WKV_TYPES = tuple(GGML_WKV_ENCODINGS)          # Q2_K, Q8_0, BF16, F16, F32
GATE_TYPES = ("F32", "F16", "BF16")
TABLE_TYPES = tuple(GGML_TABLE_ENCODINGS)      # Q2_K, Q3_K, Q4_K, Q8_0


def other_engram_keys(kv, known=()) -> list[str]:
    """Metadata keys that mention engram but are not schema A's or B's (third-party spellings such
    as deepseek41.engram_layer_ids, engram_num_embeddings, engram_pad_token_id)."""
    known = set(known)
    return [k for k in kv if "engram" in k.lower() and k not in known]


def check_architecture(container, path: str, expected: str, also=()) -> None:
    """general.architecture must name the model: a llama (or any other) GGUF is refused."""
    arch = container.kv.get("general.architecture")
    if arch is None:
        raise MissingKeyError(f"{path}: metadata key 'general.architecture' is missing (expected {expected!r})")
    if arch != expected and arch not in also:
        raise WrongArchitectureError(
            f"{path}: general.architecture is {arch!r}, expected {expected!r} (DeepSeek-V4.1 with Engram): this "
            "is not an Engram model")


# The model ----------------------------------------------------------------------------------

class EngramLayerFile(EngramLayer):
    """One engram layer of a schema-A file, as views of the memory maps (nothing is read until used)."""

    def __init__(self, model: "EngramModel", layer_id: int, index: int):
        names = tensor_names(layer_id)
        self.table_info = model.tensors[names["table"]]
        self.wkv_info = model.tensors[names["wkv"]]
        self.q_info = model.tensors[names["q"]]
        self.k_info = model.tensors[names["k"]]
        encoding, row_bytes = GGML_TABLE_ENCODINGS[self.table_info.type_name]
        n_rows = int(self.table_info.ne[1])
        cfg = model.config
        super().__init__(
            layer_id, index,
            table=model._bytes(self.table_info).reshape(n_rows, row_bytes),          # uint8 [rows, row_bytes]
            table_encoding=encoding,
            wkv_raw=model._tensor_view(self.wkv_info), wkv_encoding=GGML_WKV_ENCODINGS[self.wkv_info.type_name],
            wkv_shape=self.wkv_info.shape,
            q_weight=lambda: self._gate(model, self.q_info, cfg), k_weight=lambda: self._gate(model, self.k_info, cfg),
            names=names)

    @staticmethod
    def _gate(model, info: TensorInfo, cfg) -> np.ndarray:
        return widen_gate(model._tensor_view(info).reshape(cfg.hc, cfg.dim), info.type_name)


class EngramModel(EngramModelBase):
    """An opened schema-A Engram GGUF, one file or a split (see `load_gguf`, `load_model`).

    path, version, alignment, data_offset (of the first shard)
    kv          every metadata key -> python value / numpy array (a view of the map) / StringArray
    kv_types    key -> GGUF type name ("u32", "arr[u64]", ...)
    tensors     tensor index: name -> TensorInfo (every tensor in every shard, engram or not)
    shards      the files, in order (one for a single GGUF)
    config      EngramConfig (dim, hc, layer_ids, max_ngram_size, n_heads, head_dim)
    hash_tables EngramHashTables, validated against every table's row count
    layers      layer id -> EngramLayerFile
    """

    def __init__(self, path, *, key_prefix: str = KEY_PREFIX, validate: bool = True,
                 container: GGUFContainer | None = None):
        self._init_common(path, validate)
        self.key_prefix = key_prefix
        self._container = container if container is not None else open_gguf_container(path)
        c = self._container
        self.path = c.path
        self.shards = c.shard_paths
        self.kv, self.kv_types, self.tensors = c.kv, c.kv_types, c.tensors
        self.version, self.alignment, self.data_offset = c.version, c.alignment, c.data_offset
        self._map = c.shards[0]._map
        self.checks = list(c.checks)
        check_architecture(c, self.path, key_prefix.rstrip("."),
                           also=(OLD_KEY_PREFIX.rstrip("."),) if key_prefix == KEY_PREFIX else ())
        self.config, self.hash_tables = self._read_engram()
        self.synthetic = str(self.kv.get("general.name", "")).startswith("engram-numba tiny")
        self.layers = {lid: EngramLayerFile(self, lid, i) for i, lid in enumerate(self.config.layer_ids)}
        encodings = sorted({lf.table_encoding for lf in self.layers.values()})
        self.config = dataclasses.replace(self.config, table_type="/".join(encodings))
        kind = f"split gguf ({len(self.shards)} shards, schema A" if c.split else "gguf (schema A"
        self.format = f"{kind}, {'/'.join(encodings)} tables)"   # file format and table encoding

    # raw access
    def _bytes(self, info: TensorInfo) -> np.ndarray:
        self._check_open()
        return self._container.tensor_bytes(info)

    def _tensor_view(self, info: TensorInfo) -> np.ndarray:
        """Zero-copy view: numpy shape for plain types, [rows, bytes per row] uint8 for quants."""
        raw = self._bytes(info)
        dt = _PLAIN_DTYPES.get(info.type_name)
        if dt is not None:
            return raw.view(dt).reshape(info.shape)
        _, block_values, block_bytes = GGML_TYPES[info.type_name]
        return raw.reshape(*info.shape[:-1], info.shape[-1] // block_values * block_bytes)

    def _release(self) -> None:
        self._container.close()
        self._map = None

    @property
    def _buf(self):  # kept for callers of the single-file reader
        return None if self._closed else self._container.shards[0].buf

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
        others = other_engram_keys(self.kv, [self.key_prefix + k for k in ENGRAM_KEYS])
        if others:
            raise MissingKeyError(
                f"{self.path}: metadata key {full!r} is missing: the file has none of schema A's nine "
                f"{self.key_prefix}engram.* keys it needs, but has other Engram keys, third-party spellings that "
                f"neither schema A nor schema B reads: {', '.join(others[:12])}{', ...' if len(others) > 12 else ''}")
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
        return int_array_key(self.path, self.key_prefix + name, self._key(name), self.kv_types, expect, expect_text)

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
        hc = read_hc(self.path, self.tensors, [(tensor_names(l)["q"], tensor_names(l)["k"]) for l in layer_ids],
                     dim, f"{self.key_prefix}{K_EMBEDDING_LENGTH}")
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
        return config, self._hash_tables(config, layer_ids, multipliers, primes, offsets, token_map, pad_id)

    def _hash_tables(self, config, layer_ids, multipliers, primes, offsets, token_map, pad_id) -> EngramHashTables:
        p = self.key_prefix
        # Sums in exact integers first: int64 sums that wrap would pass every later check.
        try:
            sums = check_constant_sums(self.path, layer_ids, primes, offsets, what=f"primes ({p}{K_PRIMES})")
        except HashConstantsError as exc:
            if self._validate:
                raise
            self.problems.append(str(exc).split(": ", 1)[-1])
            sums = None
        try:
            tables = EngramHashTables(layer_ids=layer_ids, multipliers=multipliers, primes=primes,
                                      offsets=offsets, token_map=token_map, pad_id=pad_id)
        except ValueError as exc:
            raise HashConstantsError(f"{self.path}: bad hash constants: {exc}") from None
        rows = []
        for li, lid in enumerate(layer_ids):
            self._check_layer_tensors(config, lid)
            info = self.tensors[tensor_names(lid)["table"]]
            have = int(info.ne[1])
            want = sums[li] if sums is not None else None
            if want is not None and have != want:
                msg = (f"layer {lid}: its primes ({p}{K_PRIMES}) sum to {want} rows but "
                       f"{info.name} has {have} rows")
                if self._validate:
                    raise RowCountMismatchError(f"{self.path}: {msg}")
                self.problems.append(msg)
            rows.append(have)
        if sums is not None:
            try:
                tables.validate(rows if self._validate else None)
            except ValueError as exc:
                if self._validate:
                    raise HashConstantsError(f"{self.path}: bad hash constants: {exc}") from None
                self.problems.append(f"bad hash constants: {exc}")
        self.row_sums = sums   # exact per-layer prime sums (None when they overflow int64)
        return tables

    def _check_layer_tensors(self, config: EngramConfig, lid: int) -> None:
        names = tensor_names(lid)
        table = self.tensors[names["table"]]
        if table.type_name not in TABLE_TYPES:
            raise UnsupportedQuantError(
                f"{self.path}: tensor {table.name!r} is {table.type_name}; supported table types: "
                f"{', '.join(TABLE_TYPES)}")
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


def int_array_key(path: str, full: str, v, kv_types, expect: int | None, expect_text: str = "") -> np.ndarray:
    """A numeric metadata array as a fresh int64 [n] (aligned, owned) array; uint64 values past
    int64 are refused by value (never wrapped to negative)."""
    if isinstance(v, list) and all(isinstance(x, np.ndarray) for x in v):  # array of arrays
        v = np.concatenate(v) if v else np.zeros(0, np.int64)
    if isinstance(v, int) and not isinstance(v, bool):
        v = np.array([v])
    if not isinstance(v, np.ndarray) or not np.issubdtype(v.dtype, np.integer):
        raise BadMetadataError(f"{path}: {full} must be an integer array, got {kv_types[full]}")
    if v.dtype == np.uint64 and v.size and int(v.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(v > np.uint64(np.iinfo(np.int64).max)))
        raise BadMetadataError(f"{path}: {full}[{i}] = {int(v[i])} does not fit in int64")
    if expect is not None and v.size != expect:
        raise BadMetadataError(f"{path}: {full} has {v.size} entries, expected {expect_text} = {expect}")
    return np.array(v, dtype=np.int64)


def read_hc(path: str, tensors, gate_pairs, dim: int, dim_from: str) -> int:
    """hc from the gate vectors' shapes (ggml ne [dim, hc]; a 1-D vector is hc = 1), checked
    equal across every gate tensor."""
    hc, first = None, None
    for pair in gate_pairs:
        for name in pair:
            info = tensors[name]
            ne = info.ne if len(info.ne) == 2 else info.ne + (1,)
            if len(info.ne) > 2 or ne[0] != dim:
                raise BadTensorError(
                    f"{path}: tensor {info.name!r} has ggml ne {list(info.ne)}, expected [dim={dim}, hc] "
                    f"(dim from {dim_from})")
            if hc is None:
                hc, first = int(ne[1]), info.name
            elif ne[1] != hc:
                raise BadTensorError(
                    f"{path}: tensor {info.name!r} has ggml ne {list(info.ne)}, expected [{dim}, {hc}] "
                    f"(hc = {hc} from {first})")
    return hc


def load_gguf(path, *, key_prefix: str = KEY_PREFIX, validate: bool = True) -> EngramModel:
    """Open a schema-A Engram GGUF (one file, or any shard of a split) memory-mapped; reads only
    the headers and metadata. `load_model` opens every format.

    key_prefix: the architecture prefix of the Engram keys ('deepseek41.'; files made with the
    older converters use 'deepseek4.').
    validate=False: open a file whose hash constants disagree with each other or with the table
    row counts (shapes must still be right); the problems are listed in `model.problems`, for
    `describe` to show. Never hash with such a model."""
    from .._argcheck import need_path
    return EngramModel(need_path(path), key_prefix=key_prefix, validate=validate)


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

    layers: layer id -> {"table": uint8 [rows, row_bytes] (84 for Q2_K; 110, 144, 272 for Q3_K, Q4_K,
    Q8_0 with "table_type"), "wkv": [N, K] uint16 (BF16) / float32 (F32) / float16 (F16) or uint8
    [N, K/256*84] (Q2_K; Q8_0 [N, K/32*34] with "wkv_type": "Q8_0"), "q_weight", "k_weight":
    float32 [hc, dim]}, optionally "wkv_type", "table_type", "q_type", "k_type" to name the ggml
    type explicitly.
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
            row_bytes = GGML_TABLE_ENCODINGS.get(table_type, (None, ENGRAM_ROW_BYTES))[1]
            if table.dtype != np.uint8 or table.shape != (want_rows, row_bytes):
                raise ValueError(f"layer {lid} table must be uint8 [{want_rows}, {row_bytes}] "
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
    from .._argcheck import need_path
    need_path(path)
    if not isinstance(config, EngramConfig):
        raise TypeError(f"config must be an EngramConfig, got {type(config).__name__}")
    if not isinstance(hash_tables, EngramHashTables):
        raise TypeError(f"hash_tables must be an EngramHashTables, got {type(hash_tables).__name__}")
    if not isinstance(layers, Mapping):
        raise TypeError(f"layers must be a dict of layer id -> weights, got {type(layers).__name__}")
    kvs, tensors = build_gguf_entries(config, hash_tables, layers, name=name, key_prefix=key_prefix,
                                      omit_keys=omit_keys, kv_overrides=kv_overrides, check=check)
    return write_gguf_raw(path, kvs, tensors)


__all__ = [
    "EngramModel", "EngramLayerFile", "EngramRowReader", "TensorInfo", "StringArray", "GGUFTensorSpec",
    "load_gguf", "write_gguf", "write_gguf_raw", "build_gguf_entries", "describe", "describe_dict", "tensor_names",
    "EngramFileError", "BadMagicError", "UnsupportedVersionError", "TruncatedFileError", "MissingKeyError",
    "BadMetadataError", "HashConstantsError", "RowCountMismatchError", "MissingTensorError",
    "BadTensorError", "UnsupportedQuantError", "WrongArchitectureError",
]
