"""DeepSeek's own checkpoint (docs/formats.md section 5): safetensors shards, their index,
`config.json` and `tokenizer.json`.

    model = load_hf("DeepSeek-V4.1-Flash/")                 # or .../model.safetensors.index.json
    model.layers[1].table          # uint8 [rows, 256] e4m3 codes, a view of shard 47's map
    model.layers[1].table_scales   # uint8 [rows, 8] e8m0 scales (one per 32 values)
    model.rows(1).read(ids)        # uint8 [n, 264]: codes then scales, the rows stage's fp8 rows

Per engram layer L the checkpoint holds `layers.L.engram.{embed.weight (F8_E4M3 [rows, 256]),
embed.scale (F8_E8M0 [rows, 8]), wkv.weight (F8_E4M3 [N, K]), wkv.scale (F8_E8M0 [N/32, K/32]),
q_weight, k_weight (BF16 [hc, dim])}`. There is no hash metadata: the configuration comes from
`config.json` (top level or under `text_config`), the primes and multipliers from the released
recipes (stages/hash/tables.py), the compressed token map from `tokenizer.json`
(formats/tokenmap.py). Opening reads the index, config.json, the headers of the shards that hold
engram tensors and the tokenizer; every tensor stays a zero-copy view of its shard's map.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import NORM_EPS, RAW_PAD_ID, EngramConfig
from ..stages.hash.tables import INT64_MAX, EngramHashTables, build_multipliers, build_primes, offsets_from_primes
from .errors import (BadMetadataError, BadTensorError, EngramFileError, HashConstantsError, HashOverflowError,
                     MissingFileError, MissingKeyError, MissingShardError, MissingTensorError, RowCountMismatchError,
                     TokenMapError, UnsupportedQuantError)
from .gguf import check_regular_file
from .model import EngramLayer, EngramModelBase, check_constant_sums, widen_gate
from .jsonsafe import load_json, short_repr
from .safetensors import SafetensorsFile, write_safetensors
from .tokenmap import compressed_token_map

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
FP8_GROUP = 32
MAX_JSON_BYTES = 64 * 2**20     # config.json and the index (DeepSeek's index is about 8 MB at most)

# config.json keys: (key, required)
CONFIG_KEYS = (("hidden_size", True), ("hc_mult", False), ("engram_layer_ids", True),
               ("engram_max_ngram_size", True), ("engram_n_heads", True), ("engram_head_dim", True),
               ("engram_vocab_size", True), ("engram_num_embeddings", False), ("engram_pad_token_id", False),
               ("engram_compressed_vocab_size", False), ("rms_norm_eps", False), ("vocab_size", False))


def _read_bytes(path, limit: int) -> bytes:
    """A small file's bytes; a file larger than `limit` is refused before it is read."""
    size = check_regular_file(path, "file").st_size
    if size > limit:
        raise BadMetadataError(f"{path}: {size:,} bytes, more than a {Path(path).name} can sensibly be "
                               f"({limit:,}); not the checkpoint's file")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise EngramFileError(f"{path}: cannot be read: {exc.strerror or exc}") from None


def tensor_names(layer_id: int) -> dict[str, str]:
    """Checkpoint tensor names of one engram layer."""
    p = f"layers.{layer_id}.engram."
    return {"table": p + "embed.weight", "table_scale": p + "embed.scale", "wkv": p + "wkv.weight",
            "wkv_scale": p + "wkv.scale", "q": p + "q_weight", "k": p + "k_weight"}


def is_hf_checkpoint(path) -> bool:
    p = Path(path)
    if p.is_dir():
        return (p / INDEX_NAME).is_file() or (p / SINGLE_NAME).is_file()
    return p.name.endswith(".index.json") or p.name.endswith(".safetensors")


def read_config(path: Path) -> tuple[dict, dict]:
    """-> (values, where) for CONFIG_KEYS: each from the top level or from `text_config`
    (`where[key]` says which); a key in both places must agree."""
    check_regular_file(path, "config")
    cfg = load_json(_read_bytes(path, MAX_JSON_BYTES), str(path), BadMetadataError)
    if not isinstance(cfg, dict):
        raise BadMetadataError(f"{path}: not a JSON object")
    nested = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    values, where = {}, {}
    for key, required in CONFIG_KEYS:
        top, sub = cfg.get(key), nested.get(key)
        if top is not None and sub is not None and top != sub:
            raise BadMetadataError(f"{path}: {key} is {short_repr(top)} at the top level but {short_repr(sub)} under "
                                   "text_config")
        if top is not None:
            values[key], where[key] = top, key
        elif sub is not None:
            values[key], where[key] = sub, f"text_config.{key}"
        elif required:
            raise MissingKeyError(f"{path}: key {key!r} is missing (looked at the top level and under text_config)")
    return values, where


class HFLayer(EngramLayer):
    pass


class HFCheckpointModel(EngramModelBase):
    """An opened DeepSeek HF checkpoint (see the module docstring)."""

    hash_source = "config.json and the released recipes; token map from tokenizer.json"

    def __init__(self, path, *, validate: bool = True, token_map_cache=None):
        p = Path(path)
        if p.is_dir():
            folder = p
            index = p / INDEX_NAME if (p / INDEX_NAME).exists() else None
        elif p.name.endswith(".safetensors"):
            folder, index = p.parent, (p.parent / INDEX_NAME if (p.parent / INDEX_NAME).exists() else None)
        else:
            folder, index = p.parent, p
        self._init_common(folder if index is None else index, validate)
        self.folder = folder
        self.index_path = None if index is None else str(index)
        self._files: dict[str, SafetensorsFile] = {}
        self.weight_map, all_shards = self._read_index(index, p)
        self.config_path = folder / CONFIG_NAME
        if not self.config_path.exists():
            raise MissingFileError(f"{self.config_path} does not exist: an HF checkpoint's configuration comes from "
                                   "its config.json")
        values, where = read_config(self.config_path)
        self.kv = {where[k]: v for k, v in values.items()}
        self.kv_types = {k: "json" for k in self.kv}
        tok = folder / TOKENIZER_NAME
        if not tok.exists():
            raise MissingFileError(f"{tok} does not exist: the compressed token map of an HF checkpoint is built "
                                   "from its tokenizer.json")
        self.tokenizer_path = str(tok)
        self.config = self._config(values, where)
        self.layers = {}
        self._open_tensors()
        self.shards = [f.path for f in self._files.values()]
        self.hash_tables = self._hash(values, where, token_map_cache)
        self.format = f"hf safetensors ({len(all_shards)} shard{'s' if len(all_shards) != 1 else ''}, fp8 tables)"

    # index and files
    def _read_index(self, index: Path | None, given: Path) -> tuple[dict, list[str]]:
        if index is None:
            single = self.folder / SINGLE_NAME if not given.name.endswith(".safetensors") else given
            if not single.exists():
                raise MissingFileError(f"{self.folder}: neither {INDEX_NAME} nor {SINGLE_NAME} is there")
            f = self._file(single.name)
            return {name: single.name for name in f.tensors}, [single.name]
        check_regular_file(index, "index")
        data = load_json(_read_bytes(index, MAX_JSON_BYTES), str(index), BadMetadataError)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise BadMetadataError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        for name, shard in wm.items():
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise BadMetadataError(f"{index}: tensor {name!r} maps to {shard!r}, not a file name in the folder")
        return wm, sorted(set(wm.values()))

    def _file(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            path = self.folder / shard
            if not path.exists():
                raise MissingShardError(f"{path} does not exist: {self.index_path or self.folder} names it as the "
                                        "shard of engram tensors")
            self._files[shard] = SafetensorsFile(path, shard=len(self._files), what="shard")
        return self._files[shard]

    def _info(self, name: str):
        shard = self.weight_map.get(name)
        if shard is None:
            raise MissingTensorError(f"{self.path}: tensor {name!r} is not in the index's weight_map")
        f = self._file(shard)
        if name not in f.tensors:
            raise MissingTensorError(f"{f.path}: tensor {name!r} is named in {self.path} but absent from its shard")
        return f, f.tensors[name]

    def _release(self) -> None:
        for f in self._files.values():
            f.close()

    # configuration
    def _int(self, values, where, key, lo=1) -> int:
        v = values[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise BadMetadataError(f"{self.config_path}: {where[key]} must be an integer >= {lo}, got {short_repr(v)}")
        return v

    def _config(self, values, where) -> EngramConfig:
        ids = values["engram_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise BadMetadataError(f"{self.config_path}: {where['engram_layer_ids']} must be a non-empty list of "
                                   f"integers, got {short_repr(ids)}")
        dim = self._int(values, where, "hidden_size")
        hc = self._int(values, where, "hc_mult") if "hc_mult" in values else None
        if hc is None:   # from the gate vectors' shape [hc, dim]
            f, info = self._info(tensor_names(ids[0])["q"])
            hc = int(info.shape[0]) if len(info.shape) == 2 else 1
        eps = values.get("rms_norm_eps", NORM_EPS)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise BadMetadataError(f"{self.config_path}: {where['rms_norm_eps']} must be a number, got {short_repr(eps)}")
        try:
            return EngramConfig(dim=dim, hc=hc, layer_ids=tuple(ids),
                                max_ngram_size=self._int(values, where, "engram_max_ngram_size", 2),
                                n_heads=self._int(values, where, "engram_n_heads"),
                                head_dim=self._int(values, where, "engram_head_dim"), eps=float(eps),
                                table_type="fp8")
        except ValueError as exc:
            raise BadMetadataError(f"{self.config_path}: the engram keys do not make a valid config: {exc}") from None

    # tensors
    def _open_tensors(self) -> None:
        cfg = self.config
        for li, lid in enumerate(cfg.layer_ids):
            names = tensor_names(lid)
            infos = {role: self._info(name) for role, name in names.items()}
            t_f, t_i = infos["table"]
            s_f, s_i = infos["table_scale"]
            self._expect(t_i, ("F8_E4M3",), None, f"[rows, {cfg.head_dim}]", cols=cfg.head_dim)
            rows = int(t_i.shape[0])
            self._expect(s_i, ("F8_E8M0",), (rows, cfg.head_dim // FP8_GROUP),
                         f"[rows={rows}, head_dim/32={cfg.head_dim // FP8_GROUP}]")
            w_f, w_i = infos["wkv"]
            N, K = cfg.proj_out, cfg.proj_in
            self._expect(w_i, ("F8_E4M3", "BF16"), (N, K), f"[N=dim*(hc+1)={N}, K=n_hash_cols*head_dim={K}]")
            wkv_scales, wkv_enc = None, "bf16"
            if w_i.type_name == "F8_E4M3":
                ws_f, ws_i = infos["wkv_scale"]
                tiles = (-(-N // FP8_GROUP), -(-K // FP8_GROUP))
                self._expect(ws_i, ("F8_E8M0",), tiles, f"[ceil(N/32)={tiles[0]}, ceil(K/32)={tiles[1]}]")
                wkv_scales, wkv_enc = ws_f.raw(ws_i.name), "fp8"
            gates = {}
            for role in ("q", "k"):
                g_f, g_i = infos[role]
                self._expect(g_i, ("BF16", "F32", "F16"), (cfg.hc, cfg.dim), f"[hc={cfg.hc}, dim={cfg.dim}]")
                gates[role] = (g_f, g_i)
            for f in {id(x[0]): x[0] for x in infos.values()}.values():
                f.map()
                self.tensors.update(f.tensors)
            self.layers[lid] = HFLayer(
                lid, li, table=t_f.raw(t_i.name), table_scales=s_f.raw(s_i.name), table_encoding="fp8",
                wkv_raw=w_f.raw(w_i.name), wkv_encoding=wkv_enc, wkv_scales=wkv_scales, wkv_shape=(N, K),
                q_weight=self._gate_loader(*gates["q"]), k_weight=self._gate_loader(*gates["k"]), names=names)

    @staticmethod
    def _gate_loader(f, info):
        return lambda: widen_gate(f.raw(info.name), {"BF16": "BF16", "F32": "F32", "F16": "F16"}[info.type_name])

    def _expect(self, info, dtypes, shape, shape_text, cols=None) -> None:
        where = f"{self._files_path(info)}: tensor {info.name!r}"
        if info.type_name not in dtypes:
            raise UnsupportedQuantError(f"{where} is {info.type_name}; expected {' or '.join(dtypes)}")
        ok = (tuple(info.shape) == tuple(shape)) if shape is not None else (len(info.shape) == 2 and info.shape[1] == cols)
        if not ok:
            raise BadTensorError(f"{where} has shape {list(info.shape)}, expected {shape_text}")

    def _files_path(self, info) -> str:
        return next(f.path for f in self._files.values() if f.shard == info.shard)

    # the hash
    def _hash(self, values, where, cache) -> EngramHashTables:
        cfg = self.config
        vocab = self._int(values, where, "engram_vocab_size", 2)
        if vocab > INT64_MAX // 2:
            raise HashOverflowError(f"{self.config_path}: {where['engram_vocab_size']} = {vocab} leaves no room for "
                                    "primes above it in int64")
        n_ids = self._int(values, where, "vocab_size") if "vocab_size" in values else None
        tok = compressed_token_map(self.tokenizer_path, None, cache)
        if n_ids is not None and n_ids > tok.size:
            # ids past the tokenizer's last are padding (DeepSeek pads 128,815 tokens to 129,280);
            # a vocab_size far past the tokenizer is a wrong file, refused before any work
            if n_ids > max(2 * tok.size, tok.size + 65536):
                raise BadMetadataError(f"{self.config_path}: {where['vocab_size']} = {n_ids:,} but {self.tokenizer_path} "
                                       f"has {tok.size:,} token ids: far more ids than the tokenizer can account for")
            tok = compressed_token_map(self.tokenizer_path, n_ids, cache)
        V = int(tok.max()) + 1
        want_v = values.get("engram_compressed_vocab_size")
        if want_v is not None and want_v != V:
            msg = (f"{self.tokenizer_path}: the compressed token map built from it has {V} ids, but {self.config_path} "
                   f"says {where['engram_compressed_vocab_size']} = {want_v}: this tokenizer is not the model's (or "
                   "the recipe differs); the hash multipliers depend on this number")
            if self._validate:
                raise TokenMapError(msg)
            self.problems.append(msg)
        if want_v is not None:
            self.checks.append({"check": f"token map: {tok.size} raw ids -> {V} compressed, "
                                         f"{where['engram_compressed_vocab_size']} = {want_v}", "ok": want_v == V})
        raw_pad = values.get("engram_pad_token_id", RAW_PAD_ID)
        if isinstance(raw_pad, bool) or not isinstance(raw_pad, int) or not 0 <= raw_pad < tok.size:
            raise BadMetadataError(f"{self.config_path}: engram_pad_token_id {short_repr(raw_pad)} is not a raw token id "
                                   f"in [0, {tok.size})")
        try:
            primes = build_primes(cfg.n_layers, cfg.max_ngram_size, cfg.n_heads, vocab)
        except OverflowError:
            raise HashOverflowError(f"{self.config_path}: the primes above engram_vocab_size = {vocab} do not fit "
                                    "in int64") from None
        sums = check_constant_sums(str(self.config_path), cfg.layer_ids, primes,
                                   what=f"primes (from engram_vocab_size = {vocab})")
        self.row_sums = sums
        for lid, want in zip(cfg.layer_ids, sums):
            have = self.layers[lid].n_rows
            if have != want:
                self._problem(RowCountMismatchError,
                              f"layer {lid}: the primes from {where['engram_vocab_size']} = {vocab} sum to {want} "
                              f"rows but {tensor_names(lid)['table']} has {have}")
        num = values.get("engram_num_embeddings")
        if num is not None:
            nominal = vocab * cfg.n_hash_cols
            self.checks.append({"check": f"engram_num_embeddings = {num} vs engram_vocab_size * n_hash_cols = "
                                         f"{nominal} (the nominal table size; the real row counts are the primes "
                                         "sums)", "ok": num == nominal or num in sums})
        try:
            tables = EngramHashTables(
                layer_ids=cfg.layer_ids, multipliers=build_multipliers(cfg.layer_ids, cfg.max_ngram_size, V),
                primes=primes, offsets=offsets_from_primes(primes), token_map=tok, pad_id=int(tok[raw_pad]))
            tables.validate()
        except ValueError as exc:
            raise HashConstantsError(f"{self.path}: bad hash constants: {exc}") from None
        return tables


def load_hf(path, *, validate: bool = True, token_map_cache=None) -> HFCheckpointModel:
    """Open a DeepSeek HF checkpoint: its folder, or its model.safetensors.index.json.
    token_map_cache: a folder to keep the compressed token map in (else it is cached in memory only)."""
    return HFCheckpointModel(path, validate=validate, token_map_cache=token_map_cache)


# Writing ------------------------------------------------------------------------------------------

def write_hf_checkpoint(folder, config: dict, layers: dict, tokenizer_json, *, n_shards: int | None = None,
                        holes: bool = False) -> Path:
    """Write a DeepSeek-style checkpoint folder: `model-0000k-of-0000N.safetensors` (the engram of
    each layer in its own shard unless n_shards says otherwise), the index, `config.json` (as given)
    and `tokenizer.json`. layers: layer id -> {"embed_codes" uint8 [rows, 256], "embed_scales"
    uint8 [rows, 8], "wkv_codes" uint8 [N, K], "wkv_scales" uint8 [N/32, K/32], "q_weight",
    "k_weight" bf16 words uint16 [hc, dim]} (holes=True: every array may be a shape tuple instead,
    written as a hole). Same inputs give the same bytes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lids = list(layers)
    n = len(lids) if n_shards is None else int(n_shards)
    weight_map, total = {}, 0
    for si in range(n):
        shard = f"model-{si + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for li in range(si * len(lids) // n, (si + 1) * len(lids) // n):
            lid = lids[li]
            spec, names = layers[lid], tensor_names(lid)
            for role, key, dtype in (("table", "embed_codes", "F8_E4M3"), ("table_scale", "embed_scales", "F8_E8M0"),
                                     ("wkv", "wkv_codes", "F8_E4M3"), ("wkv_scale", "wkv_scales", "F8_E8M0"),
                                     ("q", "q_weight", "BF16"), ("k", "k_weight", "BF16")):
                v = spec[key]
                if isinstance(v, tuple):
                    if not holes:
                        raise ValueError(f"layer {lid} {key}: a shape is only allowed with holes=True")
                    tensors[names[role]] = (dtype, v, None)
                else:
                    arr = np.ascontiguousarray(v)
                    tensors[names[role]] = (dtype, arr.shape, arr)
                weight_map[names[role]] = shard
        write_safetensors(folder / shard, tensors)
        total += (folder / shard).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    tok = tokenizer_json if isinstance(tokenizer_json, (bytes, bytearray)) else str(tokenizer_json).encode()
    (folder / TOKENIZER_NAME).write_bytes(tok)
    return folder


__all__ = ["HFCheckpointModel", "load_hf", "write_hf_checkpoint", "tensor_names", "read_config", "is_hf_checkpoint",
           "EngramFileError"]
