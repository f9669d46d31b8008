"""GGUF files, format only: a memory-mapped header parser and a writer (docs/formats.md).

Parsing reads the header, the metadata and the tensor index straight off a memory map. Large
numeric metadata arrays (a 129,280-entry token map) are one `frombuffer` slice each rather than
one Python object per element (which is what makes gguf-py's reader take seconds); string arrays
are decoded on demand. Tensor data is never touched here: `TensorInfo` says where it is.

Every length the header claims is checked before anything is copied or allocated: against the
end of the file, against a budget for the whole header (`MAX_HEADER_BYTES`) and, for one string,
`MAX_STRING_BYTES`; arrays of arrays nest at most `MAX_ARRAY_DEPTH` deep; `general.alignment`
must be a u32 (or u64) power of two; two tensors whose data overlap are refused. `GGUFFile`
opens one file (a regular file only: a FIFO, a folder or a missing path is a named error, checked
before anything opens it).

`write_gguf_raw` writes a GGUF from explicit parts with no checks on what they mean (the Engram
schemas sit on top of it, and the tests use it to write deliberately broken files).
"""
from __future__ import annotations

import os
import pathlib
import stat
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from .errors import (BadMagicError, BadMetadataError, BadTensorError, EngramFileError, MissingFileError,
                     NotARegularFileError, OverlappingTensorsError, TruncatedFileError, UnsupportedVersionError)

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
SUPPORTED_VERSIONS = (2, 3)  # v2 and v3 share the little-endian layout read here
DEFAULT_ALIGNMENT = 32

# Limits on what a header may claim, checked before anything is copied. A real Engram GGUF's
# header (tokenizer included) is a few MB; its longest string (a chat template, or a whole
# tokenizer.json some converters embed) is well under a few MB.
MAX_HEADER_BYTES = 512 * 2**20    # metadata + tensor index of one file
MAX_STRING_BYTES = 64 * 2**20     # one GGUF string (a key, a value, a tensor name)
MAX_ARRAY_DEPTH = 4               # arrays of arrays of ... (GGUF files in the wild use 1)
ALIGNMENT_TYPES = ("u32", "u64")  # general.alignment is a u32 in the GGUF spec

# GGUF value and tensor types ------------------------------------------------------------------

# GGUF metadata value types: code -> (short name, numpy dtype or None).
_VT_STRING, _VT_ARRAY = 8, 9
_VALUE_TYPES: dict[int, tuple[str, Any]] = {
    0: ("u8", np.dtype("<u1")), 1: ("i8", np.dtype("<i1")),
    2: ("u16", np.dtype("<u2")), 3: ("i16", np.dtype("<i2")),
    4: ("u32", np.dtype("<u4")), 5: ("i32", np.dtype("<i4")),
    6: ("f32", np.dtype("<f4")), 7: ("bool", np.dtype("u1")),
    8: ("str", None), 9: ("arr", None),
    10: ("u64", np.dtype("<u8")), 11: ("i64", np.dtype("<i8")), 12: ("f64", np.dtype("<f8")),
}
_VT_CODE = {name: code for code, (name, _) in _VALUE_TYPES.items()}

# ggml tensor types: name -> (code, values per block, bytes per block). Codes as in ggml.h.
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q8_1": (9, 32, 40),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210), "Q8_K": (15, 256, 292), "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74),
    "IQ3_XXS": (18, 256, 98), "IQ1_S": (19, 256, 50), "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110),
    "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136), "I8": (24, 1, 1), "I16": (25, 1, 2),
    "I32": (26, 1, 4), "I64": (27, 1, 8), "F64": (28, 1, 8), "IQ1_M": (29, 256, 56),
    "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66), "MXFP4": (39, 32, 17),
}
_GGML_BY_CODE = {code: name for name, (code, _, _) in GGML_TYPES.items()}
# numpy element type of the unquantised types; everything else is viewed as raw bytes.
_PLAIN_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
                 "F64": np.dtype("<f8"), "I8": np.dtype("i1"), "I16": np.dtype("<i2"),
                 "I32": np.dtype("<i4"), "I64": np.dtype("<i8")}


def ggml_type_name(code: int) -> str:
    return _GGML_BY_CODE.get(int(code), f"type{int(code)}")


def ggml_nbytes(type_name: str, ne) -> int | None:
    """Bytes of a tensor of ggml shape `ne`; None for a type whose block size is unknown."""
    info = GGML_TYPES.get(type_name)
    if info is None:
        return None
    _, block_values, block_bytes = info
    n = 1
    for x in ne:
        n *= int(x)
    return n // block_values * block_bytes


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index.

    ne      ggml shape, fastest dimension first ([256, rows] for a table)
    shape   numpy shape of the values, ne reversed ([rows, 256])
    offset  absolute byte offset of the data in its file
    nbytes  bytes of data (None for a type this reader does not know)
    shard   index of the file that holds it (0 for a single file; a split model's shards and a
            safetensors checkpoint's files are numbered in name order)
    """

    name: str
    type_code: int
    type_name: str
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    nbytes: int | None
    shard: int = 0


class StringArray:
    """A GGUF string array decoded on demand (a tokenizer's 129k strings cost nothing to open)."""

    def __init__(self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
        self._buf, self._starts, self._lengths = buf, starts, lengths  # int64 [n] each

    def __len__(self) -> int:
        return self._starts.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s, n = int(self._starts[i]), int(self._lengths[i])
        return bytes(self._buf[s:s + n]).decode("utf-8", errors="replace")

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def tolist(self) -> list[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


@njit(cache=True, nogil=True)
def _scan_strings(buf, off, count, starts, lengths):  # pragma: no cover - jitted
    """Walk `count` GGUF strings (u64 length + bytes) from `off`; returns the end offset, or -1
    when one runs past the buffer."""
    size = buf.size
    for i in range(count):
        if off + 8 > size:
            return -1
        n = np.int64(0)
        for b in range(8):
            n |= np.int64(buf[off + b]) << (8 * b)
        off += 8
        if n < 0 or off + n > size:
            return -1
        starts[i] = off
        lengths[i] = n
        off += n
    return off


# Header parser --------------------------------------------------------------------------------

class _Cursor:
    """Sequential little-endian reads over the mapped bytes with end-of-file and budget checks."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf, self.size, self.pos, self.path = buf, buf.size, 0, path
        self.budget = min(self.size, MAX_HEADER_BYTES)  # the header must end before this byte
        self.what = "the GGUF header"

    def need(self, n: int) -> None:
        """n more bytes must lie inside the file (fixed-size reads)."""
        if n < 0 or self.pos + n > self.size:
            raise TruncatedFileError(
                f"{self.path}: file ends at byte {self.size} while reading {self.what} "
                f"(needs bytes {self.pos}..{self.pos + n}): the header is cut short")

    def claim(self, n: int, what: str) -> None:
        """A length read from the file: n bytes must lie inside the file and inside the header
        budget. Checked before anything of that size is copied or allocated."""
        self.need(n)
        if self.pos + n > self.budget:
            raise BadMetadataError(
                f"{self.path}: {self.what} claims {what} of {n:,} bytes at byte {self.pos:,}, past the "
                f"{self.budget:,} bytes a GGUF header may take (MAX_HEADER_BYTES): a corrupted length")

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return out[0] if len(out) == 1 else out

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING_BYTES:
            self.need(n)  # past the end of the file: say truncated
            raise BadMetadataError(
                f"{self.path}: {self.what} holds a string of {n:,} bytes, more than the {MAX_STRING_BYTES:,} "
                "a GGUF string may have here (MAX_STRING_BYTES): a corrupted length")
        self.claim(n, "a string")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 0):
        """One metadata value -> (python value or numpy array, type name)."""
        if vtype not in _VALUE_TYPES:
            raise BadMetadataError(f"{self.path}: {self.what} has unknown GGUF value type {vtype}")
        name, dtype = _VALUE_TYPES[vtype]
        if vtype == _VT_STRING:
            return self.string(), "str"
        if vtype == _VT_ARRAY:
            itype, count = self.unpack("<IQ")
            if itype not in _VALUE_TYPES:
                raise BadMetadataError(f"{self.path}: {self.what} is an array of unknown GGUF value type {itype}")
            iname, idtype = _VALUE_TYPES[itype]
            if idtype is not None:
                # The whole array is one view of the map: no per-element Python objects.
                self.claim(count * idtype.itemsize, f"an array of {count:,} {iname}")
                arr = np.frombuffer(self.buf, dtype=idtype, count=count, offset=self.pos)
                self.pos += count * idtype.itemsize
                if itype == 7:
                    arr = arr.astype(bool)
                return arr, f"arr[{iname}]"
            if itype == _VT_STRING:
                # every string takes at least its 8-byte length: check the count before allocating
                self.claim(count * 8, f"an array of {count:,} strings")
                if count <= 64:
                    return [self.string() for _ in range(count)], "arr[str]"
                starts = np.empty(count, dtype=np.int64)
                lengths = np.empty(count, dtype=np.int64)
                end = _scan_strings(self.buf, self.pos, count, starts, lengths)
                if end < 0:
                    self.need(self.size + 1)  # raises with the key being read
                self.claim(end - self.pos, f"an array of {count:,} strings")
                self.pos = int(end)
                return StringArray(self.buf, starts, lengths), "arr[str]"
            # Arrays of arrays are rare: parse them one element at a time, to a bounded depth.
            if depth + 1 >= MAX_ARRAY_DEPTH:
                raise BadMetadataError(
                    f"{self.path}: {self.what} nests arrays more than {MAX_ARRAY_DEPTH} deep (MAX_ARRAY_DEPTH)")
            self.claim(count * 12, f"an array of {count:,} arrays")  # each inner array: type + count
            items = [self.value(itype, depth + 1)[0] for _ in range(count)]
            return items, "arr[arr]"
        self.need(dtype.itemsize)
        v = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0]
        self.pos += dtype.itemsize
        if vtype == 7:
            return bool(v), name
        return (float(v) if dtype.kind == "f" else int(v)), name


def _parse_header(buf: np.ndarray, path: str):
    """-> (version, kv dict, kv type names, tensor index, data offset, alignment)."""
    cur = _Cursor(buf, path)
    if buf.size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        got = bytes(buf[:4])
        raise BadMagicError(f"{path}: not a GGUF file (starts with {got!r}, expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(f"{path}: a big-endian GGUF; only little-endian files are supported")
        raise UnsupportedVersionError(
            f"{path}: GGUF version {version} is not supported (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    n_tensors, n_kv = cur.unpack("<QQ")

    kv: dict[str, Any] = {}
    kv_types: dict[str, str] = {}
    for i in range(n_kv):
        cur.what = f"metadata entry #{i} of {n_kv}"
        key = cur.string()
        cur.what = f"metadata key {key!r}"
        vtype = cur.unpack("<I")
        value, tname = cur.value(vtype)
        if key in kv:
            raise BadMetadataError(f"{path}: metadata key {key!r} appears twice")
        kv[key], kv_types[key] = value, tname

    raw_tensors = []
    for i in range(n_tensors):
        cur.what = f"tensor record #{i} of {n_tensors}"
        name = cur.string()
        cur.what = f"the record of tensor {name!r}"
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= 4:
            raise BadTensorError(f"{path}: tensor {name!r} has {n_dims} dimensions (ggml allows 1..4)")
        ne = tuple(int(x) for x in cur.unpack(f"<{n_dims}Q")) if n_dims > 1 else (int(cur.unpack("<Q")),)
        type_code, rel_offset = cur.unpack("<IQ")
        raw_tensors.append((name, ne, type_code, rel_offset))

    alignment = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in kv and kv_types["general.alignment"] not in ALIGNMENT_TYPES:
        raise BadMetadataError(
            f"{path}: general.alignment is stored as {kv_types['general.alignment']} {alignment!r}; it must be a "
            f"{' or '.join(ALIGNMENT_TYPES)} (a bool or another type is not read as an alignment)")
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise BadMetadataError(f"{path}: general.alignment = {alignment!r} is not a positive power of two")
    data_offset = -(-cur.pos // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, ne, type_code, rel_offset in raw_tensors:
        if name in tensors:
            raise BadTensorError(f"{path}: tensor {name!r} appears twice in the tensor index")
        tname = ggml_type_name(type_code)
        block = GGML_TYPES.get(tname)
        if block is not None and ne[0] % block[1]:
            raise BadTensorError(
                f"{path}: tensor {name!r} ({tname}) has ne[0] = {ne[0]}, not a whole number of "
                f"{block[1]}-value blocks")
        nbytes = ggml_nbytes(tname, ne)
        if rel_offset % alignment:
            raise BadTensorError(
                f"{path}: tensor {name!r} data offset {rel_offset} is not a multiple of the alignment {alignment}")
        start = data_offset + rel_offset
        if nbytes is not None and start + nbytes > buf.size:
            raise TruncatedFileError(
                f"{path}: tensor {name!r} ({tname}, ne {list(ne)}) needs bytes {start}..{start + nbytes} "
                f"but the file ends at byte {buf.size}: the file is truncated")
        tensors[name] = TensorInfo(name, type_code, tname, ne, tuple(reversed(ne)), start, nbytes)
    check_no_overlap(tensors.values(), path)
    return version, kv, kv_types, tensors, data_offset, alignment


def check_no_overlap(infos, path: str) -> None:
    """Refuse two tensors whose byte ranges overlap (one aliased offset would put one tensor's
    values on another's bytes and change results silently). Zero-byte tensors and tensors of an
    unknown type (no known size) are left out."""
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in infos if i.nbytes)
    prev_end, prev_name = -1, None
    for start, end, name in spans:
        if start < prev_end:
            raise OverlappingTensorsError(
                f"{path}: the data of tensor {name!r} (bytes {start}..{end}) overlaps tensor {prev_name!r} "
                f"(which runs to byte {prev_end}): overlapping or aliased tensor data is refused")
        if end > prev_end:
            prev_end, prev_name = end, name


# Opening a file ------------------------------------------------------------------------------

def check_regular_file(path, what: str = "model file") -> os.stat_result:
    """stat() a path (never open() it: opening a FIFO blocks) and refuse what is not a regular
    file with a named error."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MissingFileError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise NotARegularFileError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise NotARegularFileError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise NotARegularFileError(f"{what} {path} is {kind}; only regular files are read")
    return st


class GGUFFile:
    """One GGUF file, memory-mapped, its header parsed (tensor data untouched).

    path, size, version, alignment, data_offset
    kv, kv_types   metadata (values are python values, numpy views of the map, or StringArray)
    tensors        name -> TensorInfo (offsets absolute in this file; .shard as given)
    buf            the whole file as a uint8 ndarray (a view of the map); None once closed
    """

    def __init__(self, path, shard: int = 0, what: str = "model file"):
        self.path = str(path)
        st = check_regular_file(self.path, what)
        self.size = int(st.st_size)
        if self.size < 24:
            try:
                with open(self.path, "rb") as f:
                    head = f.read(4)
            except OSError as exc:
                raise EngramFileError(f"{self.path}: cannot be read: {exc.strerror or exc}") from None
            if head != GGUF_MAGIC[:len(head)] or not head:
                raise BadMagicError(f"{self.path}: not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")
            raise TruncatedFileError(f"{self.path}: {self.size} bytes is shorter than a GGUF header (24 bytes): "
                                     "the header is cut short")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as exc:
            raise EngramFileError(f"{self.path}: cannot be mapped: {exc.strerror or exc}") from None
        self.buf = self._map.view(np.ndarray)  # plain ndarray (numba-friendly) sharing the map
        (self.version, self.kv, self.kv_types, tensors, self.data_offset,
         self.alignment) = _parse_header(self.buf, self.path)
        if shard:
            tensors = {n: TensorInfo(i.name, i.type_code, i.type_name, i.ne, i.shape, i.offset, i.nbytes, shard)
                       for n, i in tensors.items()}
        self.tensors = tensors
        self.shard = shard

    def close(self) -> None:
        self.buf = None
        self._map = None

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}: v{self.version}, {len(self.kv)} keys, {len(self.tensors)} tensors)"


# Writing ------------------------------------------------------------------------------------

@dataclass
class GGUFTensorSpec:
    """A tensor to write: ggml type name, ggml `ne`, and its bytes (any array whose raw bytes are
    the data). data=None writes a hole of the tensor's size (a sparse file region)."""

    name: str
    type_name: str
    ne: tuple[int, ...]
    data: np.ndarray | None = None


def _pack_value(tname: str, value) -> bytes:
    if tname == "str":
        b = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(b)) + b
    if tname.startswith("arr[") and tname.endswith("]"):
        sub = tname[4:-1]
        if sub == "str":
            return struct.pack("<IQ", _VT_STRING, len(value)) + b"".join(_pack_value("str", s) for s in value)
        dtype = _VALUE_TYPES[_VT_CODE[sub]][1]
        arr = np.asarray(value)
        if arr.size and np.issubdtype(arr.dtype, np.integer) and np.issubdtype(dtype, np.integer):
            lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
            if int(arr.min()) < lo or int(arr.max()) > hi:
                raise ValueError(f"values [{int(arr.min())}, {int(arr.max())}] do not fit GGUF type {sub}")
        return struct.pack("<IQ", _VT_CODE[sub], arr.size) + np.ascontiguousarray(arr.ravel(), dtype=dtype).tobytes()
    if tname not in _VT_CODE or tname in ("arr",):
        raise ValueError(f"unknown GGUF value type {tname!r}")
    dtype = _VALUE_TYPES[_VT_CODE[tname]][1]
    if dtype.kind in "iu" and not np.iinfo(dtype).min <= int(value) <= np.iinfo(dtype).max:
        raise ValueError(f"{value} does not fit GGUF type {tname}")
    return np.array(value, dtype=dtype).tobytes()


def _value_type_code(tname: str) -> int:
    return _VT_ARRAY if tname.startswith("arr[") else _VT_CODE[tname]


def write_gguf_raw(path, kvs, tensors, *, alignment: int = DEFAULT_ALIGNMENT, version: int = GGUF_VERSION,
                   magic: bytes = GGUF_MAGIC) -> pathlib.Path:
    """Write a GGUF from explicit parts, with no checks on what they mean.

    kvs: sequence of (key, type name, value); type names are u8 i8 u16 i16 u32 i32 u64 i64 f32
    f64 bool str and arr[<type>]. tensors: sequence of GGUFTensorSpec, written in order, each
    padded to `alignment`. Add general.alignment to kvs yourself when alignment is not 32.
    """
    path = pathlib.Path(path)
    head = bytearray(magic)
    head += struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, tname, value in kvs:
        head += _pack_value("str", key) + struct.pack("<I", _value_type_code(tname)) + _pack_value(tname, value)
    rel = 0
    plan = []
    for t in tensors:
        nbytes = ggml_nbytes(t.type_name, t.ne)
        if nbytes is None:
            raise ValueError(f"tensor {t.name!r}: unknown ggml type {t.type_name!r}")
        if t.data is not None and t.data.nbytes != nbytes:
            raise ValueError(f"tensor {t.name!r}: {t.data.nbytes} bytes of data for {t.type_name} ne {list(t.ne)} "
                             f"({nbytes} bytes)")
        head += _pack_value("str", t.name) + struct.pack("<I", len(t.ne))
        head += struct.pack(f"<{len(t.ne)}Q", *t.ne) + struct.pack("<IQ", GGML_TYPES[t.type_name][0], rel)
        plan.append((rel, nbytes, t.data))
        rel += -(-nbytes // alignment) * alignment
    data_offset = -(-len(head) // alignment) * alignment
    head += bytes(data_offset - len(head))
    with open(path, "wb") as f:
        f.write(head)
        for start, nbytes, data in plan:
            f.seek(data_offset + start)
            if data is not None:
                f.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            pad = -nbytes % alignment
            if pad and data is not None:
                f.write(bytes(pad))
        # A trailing hole is not allocated by seek alone; truncate sets the size.
        f.truncate(data_offset + rel)
    return path


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n} B"  # pragma: no cover
