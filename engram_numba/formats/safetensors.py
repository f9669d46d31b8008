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

from .errors import BadTensorError, EngramFileError, OverlappingTensorsError, SafetensorsHeaderError, TruncatedFileError
from .gguf import TensorInfo, check_regular_file
from .jsonsafe import load_json, short_repr

MAX_HEADER_BYTES = 100 * 2**20     # the safetensors library's own limit
MAX_HEADER_DEPTH = 8               # {name: {"shape": [...]}} nests 3 deep
MAX_AXES = 64                      # numpy's own limit on the number of axes
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

    Refused, as the safetensors library refuses them: a header length past the file or over
    MAX_HEADER_BYTES, a header that is not UTF-8 JSON starting with '{', a key repeated in the
    header, `__metadata__` that is not a string -> string map, an entry whose dtype, shape or
    offsets do not agree, more than MAX_AXES axes, and a data section that the tensors do not
    cover exactly (a hole, an overlap, bytes after the last tensor, or a header length that lands
    in the header's padding and so shifts every tensor).
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
        if len(text) != n:
            raise TruncatedFileError(f"{self.path}: the header claims {n:,} bytes but only {len(text):,} could be read")
        self.header_bytes, self.data_start = n, 8 + n
        if not text.startswith(b"{"):
            raise SafetensorsHeaderError(f"{self.path}: the header is not JSON: it does not start with '{{' (not a "
                                         "safetensors file, or a wrong header length)")
        header = load_json(text, self.path, SafetensorsHeaderError, max_depth=MAX_HEADER_DEPTH, what="header")
        if not isinstance(header, dict):
            raise SafetensorsHeaderError(f"{self.path}: the header is a JSON {type(header).__name__}, not an object")
        meta = header.pop("__metadata__", None)
        if meta is None:
            meta = {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise SafetensorsHeaderError(f"{self.path}: __metadata__ must be an object of strings to strings")
        self.metadata = meta
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry, shard)
        self._check_coverage()
        self.shard = shard
        self._map = None
        self._buf = None

    def _check_coverage(self) -> None:
        """The tensors must tile the data section [0, size - 8 - N) exactly, as the safetensors
        library requires: sorted by begin, each starts where the previous ended."""
        data_len = self.size - self.data_start
        spans = sorted(((i.offset - self.data_start, i.offset - self.data_start + i.nbytes, i.name)
                        for i in self.tensors.values()), key=lambda s: (s[0], s[1]))
        pos, prev = 0, None
        for begin, end, name in spans:
            if begin < pos:
                raise OverlappingTensorsError(
                    f"{self.path}: the data of tensor {_q(name)} (bytes {begin}..{end} of the data section) overlaps "
                    f"tensor {_q(prev)} (which runs to {pos}): overlapping or aliased tensor data is refused")
            if begin > pos:
                raise SafetensorsHeaderError(
                    f"{self.path}: bytes {pos}..{begin} of the data section belong to no tensor (a hole before "
                    f"tensor {_q(name)}); a safetensors file's tensors cover its data exactly")
            pos, prev = end, name
        if pos != data_len:
            raise SafetensorsHeaderError(
                f"{self.path}: the tensors cover {pos:,} bytes of data but the file has {data_len:,} after its "
                f"{self.header_bytes:,}-byte header: "
                + ("bytes after the last tensor, or a header length that falls short of the header" if pos < data_len
                   else "the data is cut short"))

    def _entry(self, name: str, entry, shard: int) -> TensorInfo:
        where = f"{self.path}: tensor {_q(name)}"
        if not isinstance(entry, dict):
            raise SafetensorsHeaderError(f"{where}: its header entry is not an object")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise SafetensorsHeaderError(f"{where}: dtype {_short(dtype)} is not a safetensors dtype this reader "
                                         f"knows ({', '.join(DTYPES)})")
        if not isinstance(shape, list):
            raise SafetensorsHeaderError(f"{where}: shape {_short(shape)} is not a list of non-negative integers")
        if len(shape) > MAX_AXES:
            raise SafetensorsHeaderError(f"{where}: shape has {len(shape):,} axes, more than {MAX_AXES}")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
            raise SafetensorsHeaderError(f"{where}: shape {_short(shape)} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2 or
                not all(isinstance(x, int) and not isinstance(x, bool) for x in offs) or not 0 <= offs[0] <= offs[1]):
            raise SafetensorsHeaderError(f"{where}: data_offsets {_short(offs)} is not [begin, end] with "
                                         "0 <= begin <= end")
        n = DTYPES[dtype][0]
        for x in shape:
            n *= x
            if n > self.size:          # no tensor holds more bytes than the file
                break
        if offs[1] - offs[0] != n:
            need = f"{n:,}" if n <= self.size else "more than the file holds"
            raise SafetensorsHeaderError(f"{where}: data_offsets {offs} span {offs[1] - offs[0]:,} bytes but "
                                         f"{dtype} {_short(shape)} needs {need}")
        start = self.data_start + offs[0]
        if start + n > self.size:
            raise TruncatedFileError(f"{where} ({dtype} {_short(shape)}) needs bytes {start:,}..{start + n:,} but the "
                                     f"file ends at byte {self.size:,}: its data runs past the file")
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
        if info.type_name == "BOOL" and b.size and int(b.max()) > 1:
            i = int(np.argmax(b > 1))
            raise BadTensorError(f"{self.path}: tensor {_q(name)} is BOOL but element {i} is the byte {int(b[i])}; "
                                 "a BOOL byte is 0 or 1")
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


def _q(name) -> str:
    """A tensor name quoted for a message, cut short when long."""
    return short_repr(name, 80)


def _short(value) -> str:
    return short_repr(value, 60)


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
