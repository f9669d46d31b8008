"""The four stages of the Engram path, one folder each: hash, rows, proj, gate.

Each folder holds the stage's numpy reference (`reference.py`, written to be read), its @njit
version (`cpu.py`), its @cuda.jit kernels (`cuda_*.py`, numbered versions, naive v1 kept) with
their launchers (`launch.py`), its kernel records (`records.py`) and its tests (`tests/`). The
hash runs on the CPU by design, so it has no kernels. `registry.py` defines the kernel records;
`catalog.py` loads every stage's records for the tools that walk them all.

This package imports nothing on its own: import the module you need.
"""
from .registry import BACKENDS, STAGES  # noqa: F401  (constants only)
