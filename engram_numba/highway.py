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

The reader parses the safetensors header itself and memory-maps the data, so a file of any size
opens at once and `chunk(layer_id, t0, t1)` touches only those tokens (bf16 is widened to fp32 per
chunk, exactly). Every check (names, ranks, dtypes, byte ranges, T across tensors; with a model:
its layers, hc, dim and token-id range) runs in `load_highway`, and each error names the tensor.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import numpy as np

FORMAT = "engram-highway"
FORMAT_VERSION = "1"
TOKEN_IDS = "token_ids"
TOKEN_MASK = "token_mask"
_HIGHWAY_NAME = re.compile(r"^engram\.(\d+)\.highway_in$")
_CAPTURE_NAME = re.compile(r"^L(\d+)\.highway\.in$")

# safetensors dtype name -> numpy dtype the bytes are viewed as (BF16 as uint16 words)
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8,
}
_NUMPY_TO_SAFETENSORS = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                         np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
                         np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
                         np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
MAX_HEADER_BYTES = 100 << 20


def highway_tensor_name(layer_id: int) -> str:
    return f"engram.{int(layer_id)}.highway_in"


class HighwayFileError(ValueError):
    """A highway file that cannot be used: the message names the file and the tensor."""


# A minimal safetensors reader and writer ---------------------------------------------------------

class SafetensorsFile:
    """The header of a .safetensors file and zero-copy views of its tensors (memory-mapped).

    tensors: name -> (dtype name, shape tuple, (begin, end) byte offsets into the data)
    metadata: the `__metadata__` strings (empty dict when absent)
    """

    def __init__(self, path):
        self.path = str(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HighwayFileError(f"{self.path}: {size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise HighwayFileError(f"{self.path}: not a safetensors file (header length {n} does not fit "
                                       f"its {size} bytes)")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HighwayFileError(f"{self.path}: not a safetensors file (its header is not JSON: {exc})") from None
        if not isinstance(header, dict):
            raise HighwayFileError(f"{self.path}: not a safetensors file (header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise HighwayFileError(f"{self.path}: __metadata__ must be an object of strings")
        self.metadata = {str(k): str(v) for k, v in meta.items()}
        self.data_offset = 8 + n
        data_size = size - self.data_offset
        self.tensors: dict[str, tuple[str, tuple, tuple]] = {}
        for name, info in header.items():
            try:
                dtype, shape, (b, e) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise HighwayFileError(f"{self.path}: tensor {name!r} has a malformed header entry {info!r}") from None
            if dtype not in SAFETENSORS_DTYPES:
                raise HighwayFileError(f"{self.path}: tensor {name!r} has dtype {dtype}, which this reader does not know")
            want = math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
            if not (0 <= b <= e <= data_size) or e - b != want:
                raise HighwayFileError(f"{self.path}: tensor {name!r} ({dtype} {list(shape)}) has byte range "
                                       f"[{b}, {e}) but needs {want} bytes inside the {data_size} data bytes "
                                       "(a truncated or corrupt file)")
            self.tensors[name] = (dtype, shape, (int(b), int(e)))
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self.data_offset else np.zeros(0, np.uint8)

    def array(self, name: str) -> np.ndarray:
        """A read-only view [shape] of one tensor (BF16 as uint16 words, F8 as uint8 codes)."""
        dtype, shape, (b, e) = self.tensors[name]
        raw = self._map[self.data_offset + b:self.data_offset + e]
        return np.asarray(raw).view(SAFETENSORS_DTYPES[dtype]).reshape(shape)

    def close(self) -> None:
        self._map = None


def write_safetensors(path, arrays: dict, metadata: dict | None = None, bf16_names=()) -> Path:
    """Write numpy arrays to a .safetensors file, streaming each tensor (no copy of the whole file
    in memory). uint16 arrays named in `bf16_names`, and ml_dtypes.bfloat16 arrays, are stored as
    BF16; `metadata` values are written as strings."""
    path = Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    plan = []
    offset = 0
    bf16_names = set(bf16_names)
    for name, arr in arrays.items():
        a = np.asarray(arr)
        if a.dtype.name == "bfloat16":
            a, dt = a.view(np.uint16), "BF16"
        elif name in bf16_names:
            if a.dtype != np.uint16:
                raise ValueError(f"{name}: bf16 words must be uint16, got {a.dtype}")
            dt = "BF16"
        else:
            dt = _NUMPY_TO_SAFETENSORS.get(a.dtype)
            if dt is None:
                raise ValueError(f"{name}: dtype {a.dtype} cannot be written to safetensors")
        a = np.ascontiguousarray(a)
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        plan.append(a)
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)                     # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in plan:
            if a.nbytes:
                f.write(memoryview(a.reshape(-1)).cast("B"))
    return path


def is_safetensors(path) -> bool:
    """True when the file's first 8 bytes are a plausible safetensors header length followed by '{'."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 0 < n <= MAX_HEADER_BYTES


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
        self._st = st
        self.path = st.path
        self.metadata = dict(st.metadata)
        self._names = names                                     # layer id -> tensor name
        self.layer_ids = sorted(names)
        first = st.array(names[self.layer_ids[0]])
        self.n_tokens, self.hc, self.dim = (int(x) for x in first.shape[-3:])
        self.dtype = "bf16" if st.tensors[names[self.layer_ids[0]]][0] == "BF16" else "fp32"
        ids = st.array(ids_name)
        self.token_ids = np.array(ids.reshape(-1), dtype=np.int64)          # [T]
        self.token_mask = None
        if mask_name is not None:
            self.token_mask = np.array(st.array(mask_name).reshape(-1) != 0)  # [T] bool
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
        a = self._st.array(name)
        return a.reshape(a.shape[-3:])

    def raw(self, layer_id: int) -> np.ndarray:
        """The stored tensor of one layer [T, hc, dim], zero-copy (bf16 as uint16 words)."""
        return self._layer_view(layer_id)

    def chunk(self, layer_id: int, t0: int, t1: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens t0..t1-1 of one layer's highway as fp32 [t1-t0, hc, dim] (bf16 widened exactly)."""
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


def load_highway(path, model=None) -> HighwayFile:
    """Open and check a highway file (module doc: the format); with `model`, also its layers,
    hc, dim and token ids. Errors name the file and the tensor."""
    p = Path(path)
    if not p.exists():
        raise HighwayFileError(f"highway file {p} does not exist")
    if p.is_dir():
        raise HighwayFileError(f"highway file {p} is a directory")
    st = SafetensorsFile(p)
    names = {}
    for name in st.tensors:
        m = _HIGHWAY_NAME.match(name)
        if m:
            names[int(m.group(1))] = name
    ids_name, mask_name = TOKEN_IDS, TOKEN_MASK
    if not names:                                   # a capture saved as safetensors?
        for name in st.tensors:
            m = _CAPTURE_NAME.match(name)
            if m:
                names[int(m.group(1))] = name
        ids_name, mask_name = "tokens.ids", "tokens.mask"
    if not names:
        found = ", ".join(list(st.tensors)[:8]) or "none"
        raise HighwayFileError(f"{p}: no tensor named engram.{{layer_id}}.highway_in (tensors found: {found})")
    T = hc = dim = None
    dtypes = set()
    for lid in sorted(names):
        name = names[lid]
        dtype, shape, _ = st.tensors[name]
        sq = _squeeze_batch(shape, 3)
        if sq is None:
            hint = (f"; one sequence per file (save hidden[b] for each batch row b)"
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
    dtype, shape, _ = st.tensors[ids_name]
    sq = _squeeze_batch(shape, 1)
    if dtype not in ("I64", "I32", "I16", "I8", "U32", "U16", "U8"):
        raise HighwayFileError(f"{p}: tensor {ids_name!r} is {dtype}; token ids must be integers (I64)")
    if sq != (T,):
        raise HighwayFileError(f"{p}: tensor {ids_name!r} has shape {list(shape)} but the highway has T={T} tokens")
    if mask_name in st.tensors:
        dtype, shape, _ = st.tensors[mask_name]
        if dtype not in ("BOOL", "U8"):
            raise HighwayFileError(f"{p}: tensor {mask_name!r} is {dtype}; a token mask is BOOL or U8 (1 = live token)")
        if _squeeze_batch(shape, 1) != (T,):
            raise HighwayFileError(f"{p}: tensor {mask_name!r} has shape {list(shape)} but the highway has T={T} tokens")
        m = st.array(mask_name)
        if dtype == "U8" and m.size and int(m.max()) > 1:
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
    return write_safetensors(path, arrays, meta, bf16_names=bf16_names)
