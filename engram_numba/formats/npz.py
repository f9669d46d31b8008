"""Reading .npz files (captures, statistics) without letting a member's header decide what is
allocated: each member's declared dtype and shape are checked against the bytes the member
holds (and against what deflate can give) before numpy reads it. Problems raise the caller's
error class, naming the file and the member."""
from __future__ import annotations

import tokenize
import zipfile
import zlib

import numpy as np

MAX_NPY_HEADER = 65536
DEFLATE_MAX_RATIO = 1100        # deflate never inflates one byte into more than about 1032
MAX_AXES = 64
# what zipfile, zlib and numpy's .npy reader raise on damaged input (an "encrypted" flag bit is a
# RuntimeError, an unknown compression method a NotImplementedError, a damaged .npy header dict a
# SyntaxError or tokenize.TokenError)
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, TypeError, SyntaxError,
                tokenize.TokenError, RuntimeError, NotImplementedError, KeyError, MemoryError)


def open_npz(path, error: type[Exception]) -> tuple[zipfile.ZipFile, dict]:
    """(the open zip, member name without '.npy' -> ZipInfo); a member that is not .npy is refused."""
    try:
        zf = zipfile.ZipFile(path)
    except _READ_ERRORS as exc:
        raise error(f"{path}: not a readable .npz (zip): {str(exc)[:120]} (cut short or corrupt?)") from None
    members = {}
    for info in zf.infolist():
        if not info.filename.endswith(".npy"):
            zf.close()
            raise error(f"{path}: member {info.filename[:80]!r} is not an .npy array")
        members[info.filename[:-4]] = info
    return zf, members


def member_header(zf, info, path, error) -> tuple[tuple, np.dtype]:
    """(shape, dtype) a member declares, checked against the bytes it holds."""
    from numpy.lib import format as npf
    key = info.filename[:-4]
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise error(f"{path}: member {key!r} is stored uncompressed but its sizes disagree "
                    f"({info.file_size:,} vs {info.compress_size:,})")
    if (info.compress_type == zipfile.ZIP_DEFLATED
            and info.file_size > DEFLATE_MAX_RATIO * max(info.compress_size, 1) + 2**20):
        raise error(f"{path}: member {key!r} claims {info.file_size:,} bytes from {info.compress_size:,} compressed: "
                    "more than compression can give")
    try:
        with zf.open(info) as f:
            version = npf.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = npf.read_array_header_1_0(f, max_header_size=MAX_NPY_HEADER)
            elif version in ((2, 0), (3, 0)):
                shape, _, dtype = npf.read_array_header_2_0(f, max_header_size=MAX_NPY_HEADER)
            else:
                raise error(f"{path}: member {key!r} has .npy version {version}")
    except _READ_ERRORS as exc:
        raise error(f"{path}: member {key!r} cannot be read: {str(exc)[:120]}") from None
    if dtype.hasobject:
        raise error(f"{path}: member {key!r} holds Python objects; only numbers and strings are read")
    if len(shape) > MAX_AXES:
        raise error(f"{path}: member {key!r} has {len(shape)} axes")
    n = dtype.itemsize
    for x in shape:
        n *= int(x)
    if n > info.file_size:
        raise error(f"{path}: member {key!r} declares {dtype}{list(shape)[:6]} ({n:,} bytes) but holds "
                    f"{info.file_size:,}: cut short or corrupt")
    return tuple(int(x) for x in shape), dtype


def read_member(zf, info, path, error) -> np.ndarray:
    """One member as an array, after `member_header`'s checks."""
    from numpy.lib import format as npf
    member_header(zf, info, path, error)
    try:
        with zf.open(info) as f:
            return npf.read_array(f, allow_pickle=False, max_header_size=MAX_NPY_HEADER)
    except _READ_ERRORS as exc:
        raise error(f"{path}: member {info.filename[:-4]!r} cannot be read: {str(exc)[:120]}") from None


WRITE_SLICE = 4 << 20           # bytes handed to one write of a member's data


def write_npy(f, array) -> None:
    """`np.lib.format.write_array(f, array)` for a zip member opened for writing (`zf.open(name, "w")`),
    the same bytes, without holding the GIL for the data: numpy's writer copies a non-file target's
    data into bytes objects of 16 MB under the GIL (~16 ms each, a stall for every other thread of
    the process); here the .npy header is written, then the array's own memory in slices of
    WRITE_SLICE bytes, whose CRC, deflate and file write release the GIL. A non-contiguous array is
    made contiguous first (one copy); object arrays are refused."""
    from numpy.lib import format as npf
    a = np.asanyarray(array)
    if a.dtype.hasobject:
        raise ValueError("write_npy: object arrays cannot be written without pickle")
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        a = np.ascontiguousarray(a)
    head = npf.header_data_from_array_1_0(a)
    try:
        npf.write_array_header_1_0(f, head)          # what write_array writes when the header fits
    except ValueError:
        npf.write_array_header_2_0(f, head)
    flat = a.reshape(-1, order="F" if (a.flags.f_contiguous and not a.flags.c_contiguous) else "C")
    data = memoryview(flat.view(np.uint8) if flat.size else np.zeros(0, np.uint8))
    for i in range(0, data.nbytes, WRITE_SLICE):
        f.write(data[i:i + WRITE_SLICE])
