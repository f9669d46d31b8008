"""Engram weights in antirez's ds4 GGUFs (schema B, docs/formats.md section 4): DeepSeek's FP8
rows kept untouched.

Per layer L: `blk.L.engram_embd.weight` I8 ne [264, rows] (each row 256 e4m3 codes then 8 e8m0
scales: the rows stage's "fp8" layout), `blk.L.engram_kv.weight` F16 ne [6144, 25600] (= wkv),
`blk.L.engram_q_norm.weight` / `engram_k_norm.weight` F32 ne [5120, 4] (the gate vectors, not
norms). Keys `deepseek41.engram.{encoding, layer_ids, rows, primes, multipliers,
compressed_vocab_size, pad_id, token_map}`; there is no head_count, max_ngram_size or offsets:

    max_ngram_size = multipliers per layer
    heads          = primes per layer / (max_ngram_size - 1)
    offsets        = exclusive prefix sums of each layer's primes (sum = rows[layer], exactly)

Every count is checked, the encoding is checked by name (the 4-bit `lloyd4_e5m3_32_r136` variant
is refused by name), and `general.architecture` must be deepseek41.
"""
from __future__ import annotations

import numpy as np

from ..config import EngramConfig
from ..stages.hash.tables import EngramHashTables, offsets_from_primes
from .errors import (BadMetadataError, BadTensorError, HashConstantsError, MissingKeyError, MissingTensorError,
                     RowCountMismatchError, TokenMapError, UnsupportedEncodingError, UnsupportedQuantError)
from .gguf import GGML_TYPES, GGUFTensorSpec, TensorInfo, _PLAIN_DTYPES, write_gguf_raw
from .model import FP8_ROW_BYTES, EngramLayer, EngramModelBase, check_constant_sums, widen_gate
from .schema_a import ARCH, check_architecture, int_array_key, other_engram_keys, read_hc
from .split import GGUFContainer, open_gguf_container

PREFIX = ARCH + ".engram."
ENCODING_FP8 = "e4m3_e8m0_32_row264"
REFUSED_ENCODINGS = {
    "lloyd4_e5m3_32_r136": "ds4's 4-bit variant (Lloyd-Max codebook, 136 bytes a row): a different encoding, "
                           "not decoded by this toolkit",
}
K_ENCODING, K_LAYER_IDS, K_ROWS = "encoding", "layer_ids", "rows"
K_PRIMES, K_MULTIPLIERS, K_VOCAB = "primes", "multipliers", "compressed_vocab_size"
K_PAD, K_TOKEN_MAP = "pad_id", "token_map"
KEYS = (K_ENCODING, K_LAYER_IDS, K_ROWS, K_PRIMES, K_MULTIPLIERS, K_VOCAB, K_PAD, K_TOKEN_MAP)
HEAD_DIM = 256
TABLE_TYPES = ("I8",)
WKV_TYPES = {"F16": "f16", "BF16": "bf16", "F32": "f32"}
GATE_TYPES = ("F32", "F16", "BF16")


def is_schema_b(kv) -> bool:
    return PREFIX + K_ENCODING in kv


def tensor_names(layer_id: int) -> dict[str, str]:
    """GGUF tensor names of one engram layer in schema B."""
    return {"table": f"blk.{layer_id}.engram_embd.weight", "wkv": f"blk.{layer_id}.engram_kv.weight",
            "q": f"blk.{layer_id}.engram_q_norm.weight", "k": f"blk.{layer_id}.engram_k_norm.weight"}


class SchemaBLayer(EngramLayer):
    def __init__(self, model: "SchemaBModel", layer_id: int, index: int):
        names = tensor_names(layer_id)
        self.table_info, self.wkv_info = model.tensors[names["table"]], model.tensors[names["wkv"]]
        self.q_info, self.k_info = model.tensors[names["q"]], model.tensors[names["k"]]
        n_rows = int(self.table_info.ne[1])
        cfg = model.config
        super().__init__(
            layer_id, index,
            table=model._bytes(self.table_info).reshape(n_rows, FP8_ROW_BYTES),      # uint8 [rows, 264]
            table_encoding="fp8",
            wkv_raw=model._view(self.wkv_info), wkv_encoding=WKV_TYPES[self.wkv_info.type_name],
            wkv_shape=self.wkv_info.shape,
            q_weight=lambda: widen_gate(model._view(self.q_info).reshape(cfg.hc, cfg.dim), self.q_info.type_name),
            k_weight=lambda: widen_gate(model._view(self.k_info).reshape(cfg.hc, cfg.dim), self.k_info.type_name),
            names=names)


class SchemaBModel(EngramModelBase):
    """An opened ds4 GGUF (schema B), one file or a split; see the module docstring."""

    def __init__(self, path, *, validate: bool = True, container: GGUFContainer | None = None):
        self._init_common(path, validate)
        self._container = container if container is not None else open_gguf_container(path)
        c = self._container
        self.path, self.shards = c.path, c.shard_paths
        self.kv, self.kv_types, self.tensors = c.kv, c.kv_types, c.tensors
        self.version, self.alignment, self.data_offset = c.version, c.alignment, c.data_offset
        self.checks = list(c.checks)
        check_architecture(c, self.path, ARCH)
        self.config, self.hash_tables = self._read()
        self.layers = {lid: SchemaBLayer(self, lid, i) for i, lid in enumerate(self.config.layer_ids)}
        kind = f"split gguf ({len(self.shards)} shards, schema B / ds4" if c.split else "gguf (schema B / ds4"
        self.format = f"{kind}, fp8 tables)"

    def _bytes(self, info: TensorInfo) -> np.ndarray:
        self._check_open()
        return self._container.tensor_bytes(info)

    def _view(self, info: TensorInfo) -> np.ndarray:
        return self._bytes(info).view(_PLAIN_DTYPES[info.type_name]).reshape(info.shape)

    def _release(self) -> None:
        self._container.close()

    # metadata
    def _key(self, name: str):
        full = PREFIX + name
        if full in self.kv:
            return self.kv[full]
        others = other_engram_keys(self.kv, [PREFIX + k for k in KEYS])
        hint = (f"; the file has other Engram keys, third-party spellings this reader does not read: "
                f"{', '.join(others[:12])}" if others else "")
        raise MissingKeyError(f"{self.path}: metadata key {full!r} is missing (a schema-B / ds4 file carries "
                              f"{', '.join(PREFIX + k for k in KEYS)}){hint}")

    def _ints(self, name: str) -> np.ndarray:
        return int_array_key(self.path, PREFIX + name, self._key(name), self.kv_types, None)

    def _int(self, name: str) -> int:
        v = self._key(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadMetadataError(f"{self.path}: {PREFIX + name} must be an integer, got {self.kv_types[PREFIX + name]} {v!r}")
        return v

    def _read(self) -> tuple[EngramConfig, EngramHashTables]:
        p = PREFIX
        encoding = self._key(K_ENCODING)
        if encoding in REFUSED_ENCODINGS:
            raise UnsupportedEncodingError(
                f"{self.path}: {p}{K_ENCODING} is {encoding!r}, {REFUSED_ENCODINGS[encoding]}; this toolkit reads "
                f"{ENCODING_FP8!r} (FP8 rows)")
        if encoding != ENCODING_FP8:
            raise UnsupportedEncodingError(
                f"{self.path}: {p}{K_ENCODING} is {encoding!r}, not an encoding this toolkit knows (it reads "
                f"{ENCODING_FP8!r})")
        layer_ids = tuple(int(x) for x in self._ints(K_LAYER_IDS))
        if not layer_ids:
            raise BadMetadataError(f"{self.path}: {p}{K_LAYER_IDS} is empty")
        L = len(layer_ids)
        rows = self._ints(K_ROWS)
        multipliers = self._ints(K_MULTIPLIERS)
        primes = self._ints(K_PRIMES)
        token_map = self._ints(K_TOKEN_MAP)
        vocab = self._int(K_VOCAB)
        pad_id = self._int(K_PAD)
        if rows.size != L:
            raise BadMetadataError(f"{self.path}: {p}{K_ROWS} has {rows.size} entries, expected one per layer = {L}")
        if multipliers.size % L or multipliers.size // L < 2:
            raise BadMetadataError(
                f"{self.path}: {p}{K_MULTIPLIERS} has {multipliers.size} entries, not max_ngram_size (>= 2) per "
                f"layer for {L} layers")
        M = multipliers.size // L
        if primes.size % L:
            raise BadMetadataError(f"{self.path}: {p}{K_PRIMES} has {primes.size} entries, not a whole number "
                                   f"per layer for {L} layers")
        cols = primes.size // L
        if cols == 0 or cols % (M - 1):
            raise BadMetadataError(
                f"{self.path}: {p}{K_PRIMES} has {cols} per layer, not a multiple of max_ngram_size - 1 = {M - 1} "
                f"(max_ngram_size = {M}, from {p}{K_MULTIPLIERS} per layer)")
        H = cols // (M - 1)
        if token_map.size == 0:
            raise BadMetadataError(f"{self.path}: {p}{K_TOKEN_MAP} is empty")

        for lid in layer_ids:
            for name in tensor_names(lid).values():
                if name not in self.tensors:
                    raise MissingTensorError(f"{self.path}: tensor {name!r} of engram layer {lid} is missing "
                                             f"(layer ids from {p}{K_LAYER_IDS}: {list(layer_ids)})")
        first_q = self.tensors[tensor_names(layer_ids[0])["q"]]
        dim = self.kv.get(ARCH + ".embedding_length", first_q.ne[0])
        dim_from = f"{ARCH}.embedding_length" if ARCH + ".embedding_length" in self.kv else first_q.name
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise BadMetadataError(f"{self.path}: {ARCH}.embedding_length must be an integer, got {dim!r}")
        hc = read_hc(self.path, self.tensors, [(tensor_names(l)["q"], tensor_names(l)["k"]) for l in layer_ids],
                     dim, dim_from)
        try:
            config = EngramConfig(dim=dim, hc=hc, layer_ids=layer_ids, max_ngram_size=M, n_heads=H, head_dim=HEAD_DIM,
                                  table_type="fp8")
        except ValueError as exc:
            raise BadMetadataError(f"{self.path}: the schema-B keys do not make a valid config: {exc}") from None

        primes = primes.reshape(L, M - 1, H)
        multipliers = multipliers.reshape(L, M)
        sums = None
        try:
            sums = check_constant_sums(self.path, layer_ids, primes, what=f"primes ({p}{K_PRIMES})")
        except HashConstantsError as exc:
            if self._validate:
                raise
            self.problems.append(str(exc).split(": ", 1)[-1])
        self.row_sums = sums
        for li, lid in enumerate(layer_ids):
            self._check_layer_tensors(config, lid)
            have = int(self.tensors[tensor_names(lid)["table"]].ne[1])
            if int(rows[li]) != have:
                self._problem(RowCountMismatchError,
                              f"layer {lid}: {p}{K_ROWS} says {int(rows[li])} rows but "
                              f"{tensor_names(lid)['table']} has {have}")
            if sums is not None and sums[li] != have:
                self._problem(RowCountMismatchError,
                              f"layer {lid}: its primes ({p}{K_PRIMES}) sum to {sums[li]} rows but "
                              f"{tensor_names(lid)['table']} has {have} rows")
        if int(token_map.max()) + 1 != vocab:
            self._problem(TokenMapError,
                          f"{p}{K_TOKEN_MAP} gives {int(token_map.max()) + 1} compressed ids (largest id "
                          f"{int(token_map.max())}) but {p}{K_VOCAB} is {vocab}")
        try:
            tables = EngramHashTables(layer_ids=layer_ids, multipliers=multipliers, primes=primes,
                                      offsets=offsets_from_primes(primes),  # exact: sums checked above
                                      token_map=token_map, pad_id=pad_id)
        except ValueError as exc:
            raise HashConstantsError(f"{self.path}: bad hash constants: {exc}") from None
        if sums is not None:
            try:
                tables.validate()
            except ValueError as exc:
                self._problem(HashConstantsError, f"bad hash constants: {exc}")
        self.checks.append({"check": f"schema B: max_ngram_size {M} (multipliers per layer), heads {H} (primes per "
                                     f"layer / {M - 1}), offsets recomputed, rows = primes sums, compressed vocab "
                                     f"{vocab}", "ok": not self.problems})
        return config, tables

    def _check_layer_tensors(self, config: EngramConfig, lid: int) -> None:
        names = tensor_names(lid)
        table = self.tensors[names["table"]]
        if table.type_name not in TABLE_TYPES:
            raise UnsupportedQuantError(f"{self.path}: tensor {table.name!r} is {table.type_name}; a schema-B table "
                                        "is I8 (the FP8 bytes, 264 a row)")
        if len(table.ne) != 2 or table.ne[0] != FP8_ROW_BYTES:
            raise BadTensorError(f"{self.path}: tensor {table.name!r} has ggml ne {list(table.ne)}, expected "
                                 f"[{FP8_ROW_BYTES}, rows] (256 e4m3 codes + 8 e8m0 scales a row)")
        wkv = self.tensors[names["wkv"]]
        if wkv.type_name not in WKV_TYPES:
            raise UnsupportedQuantError(f"{self.path}: tensor {wkv.name!r} is {wkv.type_name}; supported: "
                                        f"{', '.join(WKV_TYPES)}")
        if wkv.ne != (config.proj_in, config.proj_out):
            raise BadTensorError(f"{self.path}: tensor {wkv.name!r} has ggml ne {list(wkv.ne)}, expected "
                                 f"[K=n_hash_cols*head_dim={config.proj_in}, N=dim*(hc+1)={config.proj_out}]")
        for key in ("q", "k"):
            info = self.tensors[names[key]]
            if info.type_name not in GATE_TYPES:
                raise UnsupportedQuantError(f"{self.path}: tensor {info.name!r} is {info.type_name}; gate vectors "
                                            f"must be {', '.join(GATE_TYPES)}")


def load_schema_b(path, *, validate: bool = True) -> SchemaBModel:
    """Open a ds4 (schema B) GGUF, one file or any shard of a split."""
    return SchemaBModel(path, validate=validate)


def build_schema_b_entries(config: EngramConfig, hash_tables: EngramHashTables, layers: dict, *,
                           name: str = "engram", encoding: str = ENCODING_FP8, omit_keys=(),
                           kv_overrides: dict | None = None, check: bool = True):
    """-> (kvs, tensors) for `write_gguf_raw` / `write_split_gguf`.

    layers: layer id -> {"rows_fp8": uint8 [rows, 264] (codes then scales), "wkv": float16 [N, K],
    "q_weight", "k_weight": float32 [hc, dim]}."""
    t = hash_tables
    kvs = [
        ("general.architecture", "str", ARCH),
        ("general.name", "str", name),
        (ARCH + ".embedding_length", "u32", config.dim),
        (PREFIX + K_ENCODING, "str", encoding),
        (PREFIX + K_LAYER_IDS, "arr[u32]", np.asarray(config.layer_ids)),
        (PREFIX + K_ROWS, "arr[u32]", t.table_rows),
        (PREFIX + K_PRIMES, "arr[u32]", t.primes.ravel()),
        (PREFIX + K_MULTIPLIERS, "arr[u64]", t.multipliers.ravel()),
        (PREFIX + K_VOCAB, "u32", t.compressed_vocab_size),
        (PREFIX + K_PAD, "u32", t.pad_id),
        (PREFIX + K_TOKEN_MAP, "arr[u32]", t.token_map),
    ]
    overrides = dict(kv_overrides or {})
    out = []
    for key, tname, value in kvs:
        if key in omit_keys:
            continue
        if key in overrides:
            tname, value = overrides.pop(key)
        out.append((key, tname, value))
    out += [(k, tn, v) for k, (tn, v) in overrides.items() if k not in omit_keys]
    tensors = []
    for li, lid in enumerate(layers):
        spec, names = layers[lid], tensor_names(lid)
        rows_fp8 = np.ascontiguousarray(spec["rows_fp8"], dtype=np.uint8)
        wkv = np.ascontiguousarray(spec["wkv"], dtype=np.float16)
        q = np.ascontiguousarray(spec["q_weight"], dtype=np.float32)
        k = np.ascontiguousarray(spec["k_weight"], dtype=np.float32)
        if check:
            want_rows = int(t.table_rows[li])
            if rows_fp8.shape != (want_rows, FP8_ROW_BYTES):
                raise ValueError(f"layer {lid} rows_fp8 must be uint8 [{want_rows}, {FP8_ROW_BYTES}], got {rows_fp8.shape}")
            if wkv.shape != (config.proj_out, config.proj_in):
                raise ValueError(f"layer {lid} wkv must be [N, K] = [{config.proj_out}, {config.proj_in}], got {wkv.shape}")
        tensors += [
            GGUFTensorSpec(names["table"], "I8", (rows_fp8.shape[1], rows_fp8.shape[0]), rows_fp8),
            GGUFTensorSpec(names["wkv"], "F16", (wkv.shape[1], wkv.shape[0]), wkv),
            GGUFTensorSpec(names["q"], "F32", (q.shape[1], q.shape[0]), q),
            GGUFTensorSpec(names["k"], "F32", (k.shape[1], k.shape[0]), k),
        ]
    return out, tensors


def write_schema_b_gguf(path, config: EngramConfig, hash_tables: EngramHashTables, layers: dict, **kw):
    """Write a ds4-style GGUF (schema B); same inputs give the same bytes."""
    kvs, tensors = build_schema_b_entries(config, hash_tables, layers, **kw)
    return write_gguf_raw(path, kvs, tensors)


__all__ = ["SchemaBModel", "SchemaBLayer", "load_schema_b", "write_schema_b_gguf", "build_schema_b_entries",
           "tensor_names", "is_schema_b", "ENCODING_FP8", "REFUSED_ENCODINGS", "GGML_TYPES"]
