"""Hidden states from another engine: the highway entering each engram layer, in a safetensors file.

    hw = en.load_highway("run.safetensors", model)      # checked against the model
    cap = en.Pipeline(model, "cpu").run(highway=hw)     # token ids come from the file
    en.save_highway("out.safetensors", {1: h1, 14: h14}, token_ids, dtype="bf16")

The format (docs/research.md has recipes for PyTorch hooks and TransformerLens):

    tensor                         shape          dtype
    engram.{layer_id}.highway_in   [T, hc, dim]   BF16 or F32   the hc streams entering block layer_id
    token_ids                      [T]            I64 (any integer type is read)
    token_mask                     [T]            BOOL or U8, optional (1 = live token)
    __metadata__ (strings):  format = "engram-highway", format_version = "1", producer, model,
                             dtype ("bf16" | "fp32"), layer_ids (JSON list), n_tokens, hc, dim

One sequence per file. A leading batch axis of 1 ([1, T, hc, dim], [1, T]) is accepted and
dropped. A capture saved by `Capture.save("x.safetensors")` is read as well: its
`L{layer_id}.highway.in` and `tokens.ids` / `tokens.mask` stand for the tensors above.

The file is read with `formats.safetensors` (the header parsed and checked by hand, the data
memory-mapped), so a file of any size opens at once and `chunk(layer_id, t0, t1)` touches only those tokens (bf16 is widened to fp32 per
chunk, exactly). Every check (names, ranks, dtypes, byte ranges, T across tensors; with a model:
its layers, hc, dim and token-id range) runs in `load_highway`, and each error names the tensor.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .errors import EngramError
from .formats.errors import EngramFileError, TruncatedFileError
from .formats.safetensors import SafetensorsFile, write_arrays

FORMAT = "engram-highway"
FORMAT_VERSION = "1"
TOKEN_IDS = "token_ids"
TOKEN_MASK = "token_mask"
_HIGHWAY_NAME = re.compile(r"^engram\.(\d+)\.highway_in$")
_CAPTURE_NAME = re.compile(r"^L(\d+)\.highway\.in$")

def highway_tensor_name(layer_id: int) -> str:
    return f"engram.{int(layer_id)}.highway_in"


class HighwayFileError(EngramError, ValueError):
    """A highway file that cannot be used: the message names the file and the tensor."""


# The highway file --------------------------------------------------------------------------------

class HighwayFile:
    """An opened highway file (see `load_highway`).

    path, metadata, producer, model_name
    layer_ids   engram layers it holds (model order when checked against a model, else ascending)
    n_tokens, hc, dim
    dtype       "bf16" | "fp32" (as stored)
    token_ids   int64 [T];  token_mask: bool [T] or None
    """

    def __init__(self, st: SafetensorsFile, names: dict[int, str], ids_name: str, mask_name: str | None):
        if not isinstance(st, SafetensorsFile):
            raise TypeError(f"st must be an opened SafetensorsFile (open highway files with load_highway), got "
                            f"{type(st).__name__}")
        self._st = st
        self.path = st.path
        self.metadata = dict(st.metadata)
        self._names = names                                     # layer id -> tensor name
        self.layer_ids = sorted(names)
        first = st.raw(names[self.layer_ids[0]])
        self.n_tokens, self.hc, self.dim = (int(x) for x in first.shape[-3:])
        self.dtype = "bf16" if st.tensors[names[self.layer_ids[0]]].type_name == "BF16" else "fp32"
        ids = st.raw(ids_name)
        self.token_ids = np.array(ids.reshape(-1), dtype=np.int64)          # [T]
        self.token_mask = None
        if mask_name is not None:
            self.token_mask = np.array(st.raw(mask_name).reshape(-1) != 0)  # [T] bool
        self.tensor_names = dict(names)
        self.token_ids_name, self.token_mask_name = ids_name, mask_name

    @property
    def producer(self) -> str:
        return self.metadata.get("producer", "unknown")

    @property
    def model_name(self) -> str:
        return self.metadata.get("model", "")

    def describe(self) -> str:
        """One line for capture meta and CLI output."""
        return (f"imported from {self.path} ({self.dtype}, {self.n_tokens} tokens, layers {self.layer_ids}, "
                f"producer {self.producer})")

    def __repr__(self) -> str:
        return f"HighwayFile({self.describe()})"

    def _layer_view(self, layer_id: int) -> np.ndarray:
        try:
            name = self._names[int(layer_id)]
        except (KeyError, ValueError, TypeError):
            raise KeyError(f"{self.path} has no highway for layer {layer_id}; it has layers {self.layer_ids}") from None
        a = self._st.raw(name)
        return a.reshape(a.shape[-3:])

    def raw(self, layer_id: int) -> np.ndarray:
        """The stored tensor of one layer [T, hc, dim], zero-copy (bf16 as uint16 words)."""
        return self._layer_view(layer_id)

    def chunk(self, layer_id: int, t0: int, t1: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens t0..t1-1 of one layer's highway as fp32 [t1-t0, hc, dim] (bf16 widened exactly);
        0 <= t0 < t1 <= n_tokens (integers)."""
        for name, v in (("t0", t0), ("t1", t1)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"chunk: {name} must be an integer, got {type(v).__name__} {v!r}")
        if not 0 <= t0 < t1 <= self.n_tokens:
            raise ValueError(f"chunk: tokens {t0}..{t1} is not a non-empty range inside [0, {self.n_tokens})")
        a = self._layer_view(layer_id)[t0:t1]
        if out is None:
            out = np.empty(a.shape, dtype=np.float32)
        if self.dtype == "bf16":
            out.view(np.uint32)[...] = a.astype(np.uint32) << np.uint32(16)
        else:
            out[...] = a
        return out

    def layer(self, layer_id: int) -> np.ndarray:
        """One layer's whole highway, fp32 [T, hc, dim] (a copy)."""
        if self.n_tokens == 0:
            return np.empty(self._layer_view(layer_id).shape, dtype=np.float32)
        return self.chunk(layer_id, 0, self.n_tokens)

    def highways(self) -> dict[int, np.ndarray]:
        """{layer_id: fp32 [T, hc, dim]} of every layer (copies: mind the size)."""
        return {lid: self.layer(lid) for lid in self.layer_ids}

    def check_model(self, model) -> "HighwayFile":
        """Check layers, hc, dim and token ids against `model`; orders layer_ids as the model does."""
        cfg = model.config
        where = self.path
        missing = [lid for lid in cfg.layer_ids if lid not in self._names]
        if missing:
            raise HighwayFileError(f"{where}: tensor {highway_tensor_name(missing[0])!r} is missing; the model's "
                                   f"engram layers are {list(cfg.layer_ids)}, the file has {self.layer_ids}")
        extra = [lid for lid in self.layer_ids if lid not in cfg.layer_ids]
        if extra:
            raise HighwayFileError(f"{where}: tensor {self._names[extra[0]]!r} is for layer {extra[0]}, which is not "
                                   f"an engram layer of the model (engram layers: {list(cfg.layer_ids)})")
        if (self.hc, self.dim) != (cfg.hc, cfg.dim):
            name = self._names[self.layer_ids[0]]
            raise HighwayFileError(f"{where}: tensor {name!r} is [T={self.n_tokens}, hc={self.hc}, dim={self.dim}] but the "
                                   f"model has hc={cfg.hc}, dim={cfg.dim}")
        vocab = model.hash_tables.token_map.size
        bad = (self.token_ids < 0) | (self.token_ids >= vocab)
        if bad.any():
            i = int(np.argmax(bad))
            raise HighwayFileError(f"{where}: tensor {self.token_ids_name!r}: token id {int(self.token_ids[i])} at "
                                   f"position {i} is outside the model's token map [0, {vocab})")
        self.layer_ids = list(cfg.layer_ids)
        return self

    def close(self) -> None:
        self._st.close()

    def __enter__(self) -> "HighwayFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _squeeze_batch(shape: tuple, rank: int) -> tuple | None:
    """shape without a leading batch axis of 1; None when it cannot be made rank `rank`."""
    if len(shape) == rank:
        return shape
    if len(shape) == rank + 1 and shape[0] == 1:
        return shape[1:]
    return None


def _layer_names(st, pattern, path) -> dict[int, str]:
    """layer id -> tensor name; two spellings of one layer ('engram.1' and 'engram.01') are refused."""
    names: dict[int, str] = {}
    for name in st.tensors:
        m = pattern.match(name)
        if m:
            lid = int(m.group(1))
            if lid in names:
                raise HighwayFileError(f"{path}: tensors {names[lid]!r} and {name!r} are both layer {lid}'s highway")
            names[lid] = name
    return names


def load_highway(path, model=None) -> HighwayFile:
    """Open and check a highway file (module doc: the format); with `model`, also its layers,
    hc, dim and token ids. Errors name the file and the tensor."""
    from ._argcheck import need_model, need_path
    p = Path(need_path(path))
    if model is not None:
        need_model(model)
    if not p.exists():
        raise HighwayFileError(f"highway file {p} does not exist")
    if p.is_dir():
        raise HighwayFileError(f"highway file {p} is a directory")
    try:
        st = SafetensorsFile(p, what="highway file")
    except TruncatedFileError as exc:
        raise HighwayFileError(f"{exc} (a truncated or corrupt file)") from None
    except EngramFileError as exc:
        raise HighwayFileError(str(exc)) from None
    names = _layer_names(st, _HIGHWAY_NAME, p)
    ids_name, mask_name = TOKEN_IDS, TOKEN_MASK
    if not names:                                   # a capture saved as safetensors?
        names = _layer_names(st, _CAPTURE_NAME, p)
        ids_name, mask_name = "tokens.ids", "tokens.mask"
    if not names:
        found = ", ".join(list(st.tensors)[:8]) or "none"
        raise HighwayFileError(f"{p}: no tensor named engram.{{layer_id}}.highway_in (tensors found: {found})")
    T = hc = dim = None
    dtypes = set()
    for lid in sorted(names):
        name = names[lid]
        dtype, shape = st.tensors[name].type_name, st.tensors[name].shape
        sq = _squeeze_batch(shape, 3)
        if sq is None:
            hint = ("; one sequence per file (save hidden[b] for each batch row b)"
                    if len(shape) == 4 else "")
            raise HighwayFileError(f"{p}: tensor {name!r} has shape {list(shape)}, expected [T, hc, dim]{hint}")
        if dtype not in ("BF16", "F32"):
            raise HighwayFileError(f"{p}: tensor {name!r} is {dtype}; a highway is stored as BF16 or F32")
        if T is None:
            T, hc, dim = sq
        elif sq != (T, hc, dim):
            first = names[sorted(names)[0]]
            raise HighwayFileError(f"{p}: tensor {name!r} has shape {list(sq)} but {first!r} has {[T, hc, dim]}")
        dtypes.add(dtype)
    if len(dtypes) > 1:
        raise HighwayFileError(f"{p}: the highway tensors mix dtypes {sorted(dtypes)}; store every layer in one dtype")
    if ids_name not in st.tensors:
        raise HighwayFileError(f"{p}: tensor {ids_name!r} ([T] int64 token ids) is missing; it must come with the highway")
    dtype, shape = st.tensors[ids_name].type_name, st.tensors[ids_name].shape
    sq = _squeeze_batch(shape, 1)
    if dtype not in ("I64", "I32", "I16", "I8", "U32", "U16", "U8"):
        raise HighwayFileError(f"{p}: tensor {ids_name!r} is {dtype}; token ids must be integers (I64)")
    if sq != (T,):
        raise HighwayFileError(f"{p}: tensor {ids_name!r} has shape {list(shape)} but the highway has T={T} tokens")
    if mask_name in st.tensors:
        dtype, shape = st.tensors[mask_name].type_name, st.tensors[mask_name].shape
        if dtype not in ("BOOL", "U8"):
            raise HighwayFileError(f"{p}: tensor {mask_name!r} is {dtype}; a token mask is BOOL or U8 (1 = live token)")
        if _squeeze_batch(shape, 1) != (T,):
            raise HighwayFileError(f"{p}: tensor {mask_name!r} has shape {list(shape)} but the highway has T={T} tokens")
        try:
            m = st.raw(mask_name).view(np.uint8)
        except EngramFileError as exc:
            raise HighwayFileError(str(exc)) from None
        if m.size and int(m.max()) > 1:
            raise HighwayFileError(f"{p}: tensor {mask_name!r} holds values other than 0 and 1")
    else:
        mask_name = None
    hw = HighwayFile(st, names, ids_name, mask_name)
    if model is not None:
        hw.check_model(model)
    return hw


def save_highway(path, highways: dict, token_ids, token_mask=None, *, dtype: str = "bf16",
                 producer: str = "engram_numba", model: str = "", extra_metadata: dict | None = None) -> Path:
    """Write a highway file: highways {layer_id: [T, hc, dim]} (fp32, or bf16 as ml_dtypes.bfloat16
    or uint16 words), token_ids [T] int, optional token_mask [T] bool. dtype "bf16" rounds fp32 to
    nearest even; "fp32" widens bf16 exactly."""
    from .bf16 import f32_to_bf16
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype must be 'bf16' or 'fp32', got {dtype!r}")
    if not highways:
        raise ValueError("highways is empty: give {layer_id: [T, hc, dim]} for at least one layer")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"token_ids must be 1-D integers, got {ids.dtype}{list(ids.shape)}")
    arrays: dict = {}
    shape = None
    for lid, h in highways.items():
        name = highway_tensor_name(lid)
        a = np.asarray(h)
        if a.ndim != 3 or a.shape[0] != ids.size:
            raise ValueError(f"{name}: expected [T={ids.size}, hc, dim], got {list(a.shape)}")
        if shape is not None and a.shape != shape:
            raise ValueError(f"{name}: shape {list(a.shape)} differs from the other layers' {list(shape)}")
        shape = a.shape
        is_bf16 = a.dtype.name == "bfloat16" or a.dtype == np.uint16
        words = a.view(np.uint16) if is_bf16 else None
        if dtype == "bf16":
            arrays[name] = words if is_bf16 else f32_to_bf16(np.asarray(a, dtype=np.float32))
        else:
            arrays[name] = ((words.astype(np.uint32) << np.uint32(16)).view(np.float32) if is_bf16
                            else np.asarray(a, dtype=np.float32))
    arrays[TOKEN_IDS] = ids.astype(np.int64)
    if token_mask is not None:
        m = np.asarray(token_mask)
        if m.shape != ids.shape or m.dtype != np.bool_:
            raise ValueError(f"token_mask must be bool [{ids.size}], got {m.dtype}{list(m.shape)}")
        arrays[TOKEN_MASK] = m
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "producer": producer, "model": model,
            "dtype": dtype, "layer_ids": json.dumps([int(x) for x in highways]), "n_tokens": str(ids.size),
            "hc": str(shape[1]), "dim": str(shape[2])}
    meta.update({str(k): str(v) for k, v in (extra_metadata or {}).items()})
    bf16_names = [highway_tensor_name(lid) for lid in highways] if dtype == "bf16" else []
    return write_arrays(path, arrays, meta, bf16_names=bf16_names)
