"""Argument checks of the device-facing functions (the stage launchers, device tables), with one rule:

- a **TypeError** when an argument is the wrong kind of thing: not an array, the wrong dtype, the
  wrong number of dimensions, a bool or a float where an integer goes;
- a **ValueError** when it is the right kind with a wrong value: a shape that does not fit the other
  arguments, a layout that is not C-contiguous, a number out of range, a choice that is not offered.

Every message names the parameter, and every check runs before any copy or launch. The public
face's checks (`engram_numba._argcheck`) follow the same rule and call these.
"""
from __future__ import annotations

import numpy as np

INTEGER = "integer"          # dtype= for any integer dtype (not bool)


def _dtype_ok(dt: np.dtype, want) -> bool:
    if isinstance(want, str) and want == INTEGER:
        return np.issubdtype(dt, np.integer)
    if isinstance(want, tuple):
        return any(dt == np.dtype(w) for w in want)
    return dt == np.dtype(want)


def _dtype_name(want) -> str:
    if isinstance(want, str) and want == INTEGER:
        return "an integer array"
    if isinstance(want, tuple):
        return " or ".join(np.dtype(w).name for w in want)
    return np.dtype(want).name


def _shape_doc(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(int(s)) for s in shape) + "]"


def _c_contiguous(a) -> bool:
    if hasattr(a, "is_c_contiguous"):               # numba device arrays (and the simulator's)
        return bool(a.is_c_contiguous())
    flags = getattr(a, "flags", None)
    if flags is not None:
        return bool(flags["C_CONTIGUOUS"] if isinstance(flags, dict) else flags.c_contiguous)
    return True


def check_array(a, name: str, dtype=None, ndim: int | None = None, shape=None, *, what: str | None = None,
                doc: str | None = None, contiguous: bool = True):
    """`a` (a numpy or device array) as the parameter `name` takes it; returns `a`.

    dtype: a dtype, a tuple of the dtypes allowed, or INTEGER; ndim: the number of dimensions;
    shape: the extents, None for any (implies ndim); what: how the messages name the dtype (e.g.
    "bf16 words (uint16)"); doc: how they name the shape (e.g. "[T, K]"); contiguous: C order."""
    if not (hasattr(a, "dtype") and hasattr(a, "shape")):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    want = what or (_dtype_name(dtype) if dtype is not None else "an array")
    if dtype is not None and not _dtype_ok(np.dtype(a.dtype), dtype):
        raise TypeError(f"{name} must be {want}, got {a.dtype}")
    if shape is not None:
        ndim = len(shape)
    desc = doc or (_shape_doc(shape) if shape is not None else "")
    got = tuple(int(s) for s in a.shape)
    if ndim is not None and len(got) != ndim:
        raise TypeError(f"{name} must be {ndim}-D, {want}{' ' + desc if desc else ''}, got shape {got}")
    if shape is not None and any(s is not None and int(s) != g for s, g in zip(shape, got)):
        raise ValueError(f"{name} must be {want} {desc}, got shape {got}")
    if contiguous and not _c_contiguous(a):
        raise ValueError(f"{name} must be C-contiguous")
    return a


def check_int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (numpy integers too; never a bool or a float, which would be truncated) in
    [lo, hi] where given; returns it as an int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return int(value)


def check_choice(value, name: str, choices, *, optional: bool = False):
    """One of `choices` (or None when optional); returns it."""
    if optional and value is None:
        return None
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}{' or None' if optional else ''}, got {value!r}")
    return value
