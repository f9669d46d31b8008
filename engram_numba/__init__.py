"""engram_numba: the Engram module of DeepSeek-V4.1-Flash as numpy, @njit and @cuda.jit stages."""
from __future__ import annotations


def _select_cuda_target() -> None:
    """With no NVIDIA device on this machine, run the @cuda.jit kernels in numba's simulator.

    numba reads NUMBA_ENABLE_CUDASIM once, when numba.cuda is first imported, so this must run
    before that; an explicit setting (either way) is always respected. `SIMULATOR` below says
    which target is in use, and the pipeline's cuda backend says so when it starts.
    """
    import os
    import pathlib
    if "NUMBA_ENABLE_CUDASIM" not in os.environ and not any(
            pathlib.Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")):
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _check_numba_cuda() -> None:
    # The built-in numba.cuda of older numba releases lacks what the kernels use (and is
    # deprecated); the kernels are written against NVIDIA's numba-cuda package.
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


_select_cuda_target()
_check_numba_cuda()

from numba.cuda import config as _numba_config  # noqa: E402

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)  # True: kernels run in numba's CUDA simulator

from .config import EngramConfig  # noqa: E402
from .hash import EngramHasher, EngramHashTables, hash_tokens  # noqa: E402

__version__ = "0.1.0"
__all__ = ["SIMULATOR", "EngramConfig", "EngramHashTables", "EngramHasher", "hash_tokens", "__version__"]
