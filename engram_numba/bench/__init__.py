"""The benchmark suite (`engram-numba bench`): every stage and kernel version against its floor
and the PyTorch/cuBLAS baseline, on a GPU. See suite.py."""
