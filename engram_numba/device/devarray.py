"""Device arrays in, from any library: one conversion and one set of messages for every launcher.

numba's own device arrays (and the simulator's) pass through; anything with
`__cuda_array_interface__` (CuPy, PyTorch, JAX) becomes a zero-copy numba view; an object that only
speaks DLPack goes through CuPy when it is installed. Host numpy arrays are refused with a
TypeError that names the argument, because launching on one would copy it both ways every call.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import config


def is_device_array(a) -> bool:
    """numba's device arrays, the simulator's included."""
    return bool(getattr(a, "__cuda_ndarray__", False))


def is_device_like(a) -> bool:
    """Anything `as_device_array` would take."""
    return (is_device_array(a) or hasattr(a, "__cuda_array_interface__")
            or (hasattr(a, "__dlpack__") and not isinstance(a, np.ndarray)))


def as_device_array(a, name: str, *, optional: bool = False):
    """A numba device array viewing `a` (no copy), or a TypeError naming `name`."""
    if a is None:
        if optional:
            return None
        raise TypeError(f"{name} is required, got None")
    if is_device_array(a):
        return a
    if hasattr(a, "__cuda_array_interface__") and not config.ENABLE_CUDASIM:
        return cuda.as_cuda_array(a)
    if isinstance(a, np.ndarray):
        raise TypeError(f"{name} is a host numpy array; pass a device array (numba.cuda.to_device({name}), "
                        f"or a CuPy/PyTorch/JAX array)")
    if hasattr(a, "__dlpack__") and not config.ENABLE_CUDASIM:
        try:
            import cupy
        except ImportError:
            raise TypeError(f"{name} only offers DLPack; install CuPy, or pass an object with "
                            f"__cuda_array_interface__ (numba, CuPy, PyTorch and JAX arrays have it)") from None
        return cuda.as_cuda_array(cupy.from_dlpack(a))
    raise TypeError(f"{name} must be a device array (numba, or anything with __cuda_array_interface__), "
                    f"got {type(a).__name__}")


def data_address(a) -> int:
    """Where an array's data starts: for alignment checks and as the identity of its memory."""
    if a.size == 0:
        return 0
    if config.ENABLE_CUDASIM:
        return int(a.__array_interface__["data"][0])  # the simulator's arrays live on the host
    return int(a.device_ctypes_pointer.value or 0)
