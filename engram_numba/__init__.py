"""engram_numba: the Engram module of DeepSeek-V4.1-Flash as numpy, @njit and @cuda.jit stages."""
from __future__ import annotations


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


_check_numba_cuda()

from .config import EngramConfig  # noqa: E402
from .hash import EngramHasher, EngramHashTables, hash_tokens  # noqa: E402

__version__ = "0.1.0"
__all__ = ["EngramConfig", "EngramHashTables", "EngramHasher", "hash_tokens", "__version__"]
