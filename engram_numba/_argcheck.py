"""Type checks for the public face: a wrong-typed argument is a TypeError that names the
parameter and what it takes, raised before any work (never an AttributeError from deep inside).
The rule and the array / integer checks live in `engram_numba.device.checks`; these call them."""
from __future__ import annotations

import os
from collections.abc import Mapping


def need_path(path, param: str = "path"):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{param} must be a path (str or os.PathLike), got {type(path).__name__}")
    return path


def need_model(model, param: str = "model", needs=("config", "hash_tables", "layers")):
    """An opened model: anything with the attributes `needs` (a path is named as such)."""
    if isinstance(model, (str, bytes, os.PathLike)):
        raise TypeError(f"{param} must be an opened model, got the path {str(model)[:80]!r}: "
                        "open it with engram_numba.load_model(path)")
    if not all(hasattr(model, a) for a in needs):
        raise TypeError(f"{param} must be an opened model (engram_numba.load_model), got {type(model).__name__}")
    return model


def need_capture(capture, param: str = "capture"):
    """A Capture or a dict of name -> array."""
    if not isinstance(capture, Mapping):
        raise TypeError(f"{param} must be a Capture (or a dict of point name -> array), got {type(capture).__name__}")
    bad = next((k for k in capture if not isinstance(k, str)), None)
    if bad is not None:
        raise TypeError(f"{param} keys must be point names (str), got {type(bad).__name__} {bad!r}")
    return capture


def need_int(value, param: str, lo: int | None = None):
    """An integer (numpy integers too; never a bool or a float, which would be truncated)."""
    from .device.checks import check_int
    return check_int(value, param, lo)


def need_int_list(values, param: str) -> list[int]:
    """A list of integers (a str or a single number is refused, never iterated or truncated)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{param} must be a list of integers, got {type(values).__name__} {values!r}")
    return [need_int(x, f"{param} entries") for x in values]
