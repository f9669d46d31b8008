"""Before numba is used: pick the CUDA target and a fork-safe CPU threading layer.

Run once, first thing, by `engram_numba/__init__.py`.

CUDA target. Without an NVIDIA device the @cuda.jit kernels run in numba's CUDA simulator.
numba reads NUMBA_ENABLE_CUDASIM once, when `numba.cuda` is first imported; an explicit setting
(either way) is always respected. If numba.cuda was already imported with the real target on a
machine without a GPU (the user imported numba.cuda before engram_numba), the simulator can no
longer be switched on: the kernels are then unavailable, and `SIMULATOR` is False with
`CUDA_AVAILABLE` False; the cuda backend says so when asked for.

Threading layer. The cpu backend's parallel @njit kernels use numba's threading layer; with GNU
OpenMP ("omp"), a process forked after they ran dies ("fork() called from a process already
using GNU OpenMP"), which breaks `multiprocessing` with the default fork start method. Unless
the user chose a layer (NUMBA_THREADING_LAYER), numba is asked to prefer "tbb" (fork-safe, when
installed), then "workqueue" (fork-safe, always present), then "omp".
"""
from __future__ import annotations

import os
import pathlib
import sys

_GPU_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def gpu_device_present() -> bool:
    return any(pathlib.Path(p).exists() for p in _GPU_NODES)


def select() -> None:
    changed = False
    if "NUMBA_ENABLE_CUDASIM" not in os.environ and "numba.cuda" not in sys.modules and not gpu_device_present():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        changed = True
    if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
        os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = "tbb workqueue omp"
        changed = True
    if changed and "numba" in sys.modules:
        # numba read the environment when it was imported (numba.cuda shares numba.core.config):
        # have it read it again, so that `import numba` before engram_numba changes nothing
        from numba.core import config
        config.reload_config()


def check_numba_cuda():
    """numba.cuda, checked to be NVIDIA's numba-cuda; an ImportError that says how to fix it."""
    try:
        from numba import cuda
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "engram_numba needs NVIDIA's numba-cuda: pip install 'numba-cuda[cu13]==0.30.4' "
            f"(importing numba.cuda failed: {exc})") from exc
    impl = getattr(cuda, "implementation", None)
    if impl != "NVIDIA":  # pragma: no cover - depends on the environment
        raise ImportError(
            "numba.cuda resolves to numba's built-in CUDA target, not NVIDIA's numba-cuda "
            f"(cuda.implementation = {impl!r}). Install it with: pip install 'numba-cuda[cu13]==0.30.4'")
    return cuda
