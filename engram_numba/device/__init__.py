"""Stage-independent device helpers: intrinsics (each with its simulator twin), device-array
conversion, prepared launches, CUDA graphs, and the compile-only checker.

(Named `device`, not `cuda`: numba-cuda's import redirector takes over any module whose name
contains "numba.cuda", which `engram_numba.cuda` would.)"""
