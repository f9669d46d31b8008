"""safetensors files, read by hand (docs/formats.md section 5.3): the header parsed and checked,
the data memory-mapped, tensors as zero-copy numpy views.

    bytes 0..7      u64 little-endian N, the header's length
    bytes 8..8+N    JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
    bytes 8+N..     the data; a tensor is [8+N+begin, 8+N+end)

safetensors' own numpy API cannot load F8_E4M3 / F8_E8M0, so this reader never asks it to: it maps
the bytes and views them (`raw` gives uint8 / the plain numpy dtype; `array` gives ml_dtypes'
float8_e4m3fn, float8_e8m0fnu and bfloat16). Checked before anything is mapped: the header length
(at most MAX_HEADER_BYTES and inside the file), the JSON, each entry's dtype, shape and offsets
(begin <= end, end - begin = the bytes its shape needs, inside the file), and that no two tensors'
bytes overlap. `write_safetensors` writes the same layout (the header padded with spaces to a
multiple of 8, as the safetensors library does).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .errors import EngramFileError, SafetensorsHeaderError, TruncatedFileError
from .gguf import TensorInfo, check_no_overlap, check_regular_file

MAX_HEADER_BYTES = 100 * 2**20     # the safetensors library's own limit
# dtype -> (bytes per element, numpy dtype of the raw view, ml_dtypes name of the typed view or None)
DTYPES: dict[str, tuple[int, str, str | None]] = {
    "BOOL": (1, "?", None), "U8": (1, "u1", None), "I8": (1, "i1", None),
    "F8_E4M3": (1, "u1", "float8_e4m3fn"), "F8_E5M2": (1, "u1", "float8_e5m2"), "F8_E8M0": (1, "u1", "float8_e8m0fnu"),
    "U16": (2, "<u2", None), "I16": (2, "<i2", None), "F16": (2, "<f2", None), "BF16": (2, "<u2", "bfloat16"),
    "U32": (4, "<u4", None), "I32": (4, "<i4", None), "F32": (4, "<f4", None),
    "U64": (8, "<u8", None), "I64": (8, "<i8", None), "F64": (8, "<f8", None),
}


class SafetensorsFile:
    """One safetensors file: header parsed and checked, data memory-mapped.

    path, size, header_bytes (N), data_start (8 + N), metadata (the "__metadata__" dict)
    tensors: name -> TensorInfo (type_name = the safetensors dtype, offset absolute, .shard as given)
    """

    def __init__(self, path, shard: int = 0, what: str = "safetensors file"):
        self.path = str(path)
        self.size = int(check_regular_file(self.path, what).st_size)
        if self.size < 8:
            raise TruncatedFileError(f"{self.path}: {self.size} bytes is shorter than a safetensors header "
                                     "length (8 bytes): the file is cut short")
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > MAX_HEADER_BYTES:
                    raise SafetensorsHeaderError(
                        f"{self.path}: the header claims {n:,} bytes, more than a safetensors header may have "
                        f"({MAX_HEADER_BYTES:,}): not a safetensors file, or a corrupted length")
                if 8 + n > self.size:
                    raise TruncatedFileError(f"{self.path}: the header claims {n:,} bytes but the file has "
                                             f"{self.size - 8:,} after the length: the file is cut short")
                text = f.read(n)
        except OSError as exc:
            raise EngramFileError(f"{self.path}: cannot be read: {exc.strerror or exc}") from None
        self.header_bytes, self.data_start = n, 8 + n
        try:
            header = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsHeaderError(f"{self.path}: the header is not JSON (not valid JSON: {exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsHeaderError(f"{self.path}: the header is a JSON {type(header).__name__}, not an object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise SafetensorsHeaderError(f"{self.path}: __metadata__ is not an object")
        self.metadata = meta
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry, shard)
        check_no_overlap(self.tensors.values(), self.path)
        self.shard = shard
        self._map = None
        self._buf = None

    def _entry(self, name: str, entry, shard: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise SafetensorsHeaderError(f"{where}: its header entry is not an object")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise SafetensorsHeaderError(f"{where}: dtype {dtype!r} is not a safetensors dtype this reader knows "
                                         f"({', '.join(DTYPES)})")
        if (not isinstance(shape, list) or
                not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)):
            raise SafetensorsHeaderError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2 or
                not all(isinstance(x, int) and not isinstance(x, bool) for x in offs) or not 0 <= offs[0] <= offs[1]):
            raise SafetensorsHeaderError(f"{where}: data_offsets {offs!r} is not [begin, end] with 0 <= begin <= end")
        n = DTYPES[dtype][0]
        for x in shape:
            n *= x
        if offs[1] - offs[0] != n:
            raise SafetensorsHeaderError(f"{where}: data_offsets {offs} span {offs[1] - offs[0]:,} bytes but "
                                         f"{dtype} {shape} needs {n:,}")
        start = self.data_start + offs[0]
        if start + n > self.size:
            raise TruncatedFileError(f"{where} ({dtype} {shape}) needs bytes {start:,}..{start + n:,} but the file "
                                     f"ends at byte {self.size:,}: its data runs past the file")
        return TensorInfo(name, -1, dtype, tuple(reversed(shape)), tuple(shape), start, n, shard)

    def _live(self) -> np.ndarray:
        if self._buf is None:
            try:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            except OSError as exc:
                raise EngramFileError(f"{self.path}: cannot be mapped: {exc.strerror or exc}") from None
            self._buf = self._map.view(np.ndarray)
        return self._buf

    def map(self) -> None:
        """Map the file now (opening a model maps every shard it reads)."""
        self._live()

    def raw(self, name: str) -> np.ndarray:
        """The tensor as a zero-copy view: its shape, raw numpy dtype (uint8 for F8_*, uint16 for BF16)."""
        info = self.tensors[name]
        b = self._live()[info.offset:info.offset + info.nbytes]
        return b.view(np.dtype(DTYPES[info.type_name][1])).reshape(info.shape)

    def array(self, name: str) -> np.ndarray:
        """The tensor typed: ml_dtypes float8_e4m3fn / float8_e8m0fnu / bfloat16 views for those dtypes."""
        raw = self.raw(name)
        typed = DTYPES[self.tensors[name].type_name][2]
        if typed is None:
            return raw
        import ml_dtypes
        return raw.view(getattr(ml_dtypes, typed))

    def close(self) -> None:
        self._buf = None
        self._map = None


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> Path:
    """Write a safetensors file. tensors: name -> (dtype, shape, data) with data any array whose
    raw bytes are the tensor (or None: a hole of its size, for sparse test files). Tensors are laid
    out in the order given; same inputs give the same bytes."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    plan, pos = [], 0
    for name, (dtype, shape, data) in tensors.items():
        n = DTYPES[dtype][0]
        for x in shape:
            n *= int(x)
        if data is not None and np.asarray(data).nbytes != n:
            raise ValueError(f"tensor {name!r}: {np.asarray(data).nbytes} bytes of data for {dtype} {list(shape)} ({n})")
        header[name] = {"dtype": dtype, "shape": [int(x) for x in shape], "data_offsets": [pos, pos + n]}
        plan.append((pos, data))
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        start = 8 + len(text)
        for off, data in plan:
            if data is not None:
                f.seek(start + off)
                f.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        f.truncate(start + pos)
    return path


_NUMPY_DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                 np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
                 np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
                 np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def write_arrays(path, arrays: dict, metadata: dict | None = None, bf16_names=()) -> Path:
    """`write_safetensors` for plain numpy arrays: the dtype follows the array's; uint16 arrays
    named in `bf16_names`, and ml_dtypes.bfloat16 arrays, are stored as BF16."""
    tensors = {}
    bf16_names = set(bf16_names)
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        if a.dtype.name == "bfloat16":
            a, dt = a.view(np.uint16), "BF16"
        elif name in bf16_names:
            if a.dtype != np.uint16:
                raise ValueError(f"{name}: bf16 words must be uint16, got {a.dtype}")
            dt = "BF16"
        else:
            dt = _NUMPY_DTYPES.get(a.dtype)
            if dt is None:
                raise ValueError(f"{name}: dtype {a.dtype} cannot be written to safetensors")
        tensors[name] = (dt, a.shape, a)
    return write_safetensors(path, tensors, metadata)


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
