"""Tensor maps for Hopper's tensor memory accelerator (TMA), made on the host.

A TMA copy (`hopper.tma_load_2d`) moves a whole box of a 2-D row-major tensor from global to
shared memory with one instruction of one thread, zero-filling the parts of the box that lie past
the tensor's edges, and reports the bytes to an mbarrier. What it reads is described by a 128-byte
*tensor map* (the driver's `CUtensorMap`): the tensor's address, shape and row stride, the box,
and the swizzle it writes shared memory in. numba-cuda has no API for it, so `tensor_map_2d` calls
the driver's `cuTensorMapEncodeTiled` through ctypes and uploads the 128 bytes to a device array;
a kernel receives that array and passes it to `tma_load_2d` (PTX reads a tensor map from global
memory as well as from a kernel parameter).

A tensor map holds the tensor's device address: it is valid only while that array lives, and for
that array only. `TensorMap` keeps a reference to the array, and its device bytes (`.device`, what
a prepared launch holds) keep a reference to the map.

With the 128-byte swizzle (`SWIZZLE_128B`, what the wgmma kernels read), the box's inner extent
must be 128 bytes at most (64 bf16 values), and TMA writes row r's 16-byte chunk c at chunk
c ^ (r % 8) of its 128-byte row, within 1024-byte atoms: the layout `hopper.wgmma_descriptor`'s
128-byte swizzle mode reads, when the destination is 1024-byte aligned.

In numba's simulator there is no driver: the 128 bytes hold a key into a table of this process's
maps, and `hopper.tma_load_2d`'s twin copies the box from the array itself, swizzled the same way.
"""
from __future__ import annotations

import ctypes
import itertools

import numpy as np

from .intrinsics import SIMULATOR

SWIZZLE_NONE = 0
SWIZZLE_128B = 3
MAP_BYTES = 128

# CUtensorMapDataType values for element sizes 1, 2 and 4 bytes (unsigned: TMA only moves bytes)
_DATA_TYPE = {1: 0, 2: 1, 4: 2}

_SIM_MAPS: dict = {}
_SIM_KEYS = itertools.count(1)


class TensorMap:
    """A 2-D tensor map of a row-major device array `array` [rows, cols] and a box of
    `box_rows` x `box_cols` elements, swizzled `swizzle` (SWIZZLE_NONE or SWIZZLE_128B).
    `device` is the uint8 [128] device array a kernel passes to `tma_load_2d`; `box_bytes` what
    one copy reports to its mbarrier (the whole box, zero-filled parts included)."""

    def __init__(self, array, box_rows: int, box_cols: int, swizzle: int = SWIZZLE_128B, stream=0):
        shape = tuple(int(s) for s in array.shape)
        if len(shape) != 2:
            raise ValueError(f"tensor_map_2d: a 2-D array, got shape {shape}")
        esize = int(np.dtype(array.dtype).itemsize)
        if esize not in _DATA_TYPE:
            raise ValueError(f"tensor_map_2d: elements of 1, 2 or 4 bytes, got {array.dtype}")
        rows, cols = shape
        row_bytes = cols * esize
        strides = getattr(array, "strides", None)
        if strides is not None and tuple(strides) != (row_bytes, esize):
            raise ValueError(f"tensor_map_2d: a C-contiguous array, got strides {tuple(strides)}")
        if row_bytes % 16:
            raise ValueError(f"tensor_map_2d: a row must be a multiple of 16 bytes ({cols} x {esize} = {row_bytes})")
        if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256):
            raise ValueError(f"tensor_map_2d: box {box_rows} x {box_cols}: each side 1..256 elements")
        if (box_cols * esize) % 16:
            raise ValueError(f"tensor_map_2d: a box row must be a multiple of 16 bytes ({box_cols} x {esize})")
        if swizzle == SWIZZLE_128B and box_cols * esize > 128:
            raise ValueError(f"tensor_map_2d: with the 128-byte swizzle a box row is at most 128 bytes "
                             f"({box_cols} x {esize})")
        if swizzle not in (SWIZZLE_NONE, SWIZZLE_128B):
            raise ValueError(f"tensor_map_2d: swizzle {swizzle} (SWIZZLE_NONE or SWIZZLE_128B)")
        self.array, self.shape, self.esize = array, shape, esize
        self.box_rows, self.box_cols, self.swizzle = int(box_rows), int(box_cols), int(swizzle)
        self.box_bytes = self.box_rows * self.box_cols * esize
        host = np.zeros(MAP_BYTES, np.uint8)
        if SIMULATOR:
            key = next(_SIM_KEYS)
            _SIM_MAPS[key] = self
            host[:8] = np.frombuffer(np.uint64(key).tobytes(), np.uint8)
        else:
            host[:] = _encode_tiled(array, esize, rows, cols, row_bytes, self.box_rows, self.box_cols, self.swizzle)
        from numba import cuda
        self.host = host
        # on the launch's stream: a copy on the legacy default stream would wait for every other stream
        self.device = cuda.to_device(host, stream=stream)
        self.device.tensor_map = self      # whoever holds the device bytes keeps the map and the array alive


def tensor_map_2d(array, box_rows: int, box_cols: int, swizzle: int = SWIZZLE_128B, stream=0) -> TensorMap:
    """The tensor map of a 2-D row-major device array for boxes of box_rows x box_cols elements, its
    128 bytes copied to the device on `stream` (the stream of the launches that will read it)."""
    return TensorMap(array, box_rows, box_cols, swizzle, stream)


def pack_maps(*maps: TensorMap, stream=0):
    """Several maps in one device array, map i at byte 128 i (for a kernel that takes them as one
    argument), copied on `stream`; the array keeps the maps, and through them their arrays (and the
    host bytes the copy reads), alive."""
    from numba import cuda
    host = np.concatenate([m.host for m in maps])
    dev = cuda.to_device(host, stream=stream)
    dev.tensor_maps, dev.host = maps, host
    return dev


def sim_map(tmap_bytes) -> TensorMap:
    """The simulator's map behind the 128 bytes a kernel was given (its key in the first 8)."""
    key = int(np.asarray(tmap_bytes).reshape(-1).view(np.uint8)[:8].copy().view(np.uint64)[0])
    if key not in _SIM_MAPS:
        raise RuntimeError("tma_load_2d: the tensor-map argument is not a map made by tensor_map_2d")
    return _SIM_MAPS[key]


_ENCODE = None


def _driver_encode():
    global _ENCODE
    if _ENCODE is None:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _ENCODE = f
    return _ENCODE


def _encode_tiled(array, esize, rows, cols, row_bytes, box_rows, box_cols, swizzle) -> np.ndarray:
    """cuTensorMapEncodeTiled for a [rows, cols] tensor (dimension 0 the contiguous one)."""
    address = int(array.__cuda_array_interface__["data"][0])
    if address % 16:
        raise ValueError(f"tensor_map_2d: the array's data must be 16-byte aligned (address % 16 = {address % 16})")
    # a CUtensorMap is 64-byte aligned: encode into an aligned window of a larger buffer
    buf = np.zeros(MAP_BYTES + 64, np.uint8)
    at = (-buf.ctypes.data) % 64
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # no interleave, L2 promotion of 256 bytes, out-of-bounds elements read as zeros
    rc = _driver_encode()(buf.ctypes.data + at, _DATA_TYPE[esize], 2, address, dims, strides, box, elem,
                          0, swizzle, 3, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for a [{rows}, {cols}] tensor of "
                           f"{esize}-byte elements, box {box_rows} x {box_cols}, swizzle {swizzle}")
    return buf[at:at + MAP_BYTES].copy()
