"""@cuda.jit kernels, one module per stage. GPU-only intrinsics live in `intrinsics.py`."""
