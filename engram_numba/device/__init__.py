"""Stage-independent device helpers: intrinsics (each with its simulator twin;
the Hopper cp.async / wgmma ones in `hopper`), device-array
conversion, prepared launches, CUDA graphs, uploads. (The compile-only checker reads the kernel
records, so it lives beside them: `engram_numba.stages.compile_check`.)

(Named `device`, not `cuda`: numba-cuda's import redirector takes over any module whose name
contains "numba.cuda", which `engram_numba.cuda` would.)"""
