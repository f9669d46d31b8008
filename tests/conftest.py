"""Test tiers (see DESIGN.md): exact CPU tests, the @cuda.jit kernels under numba's simulator,
compile-only (tests/test_compile_sm90.py, in a subprocess with the simulator off), and the `gpu`
tier, which runs only on a real GPU.

Without a GPU the simulator is switched on here, before anything imports numba.cuda; set
NUMBA_ENABLE_CUDASIM yourself to force either way.
"""
import os
import pathlib


def _gpu_present() -> bool:
    return pathlib.Path("/dev/nvidia0").exists() or pathlib.Path("/dev/nvidiactl").exists()


os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0" if _gpu_present() else "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO / "data"


def _real_gpu() -> bool:
    from numba import cuda
    from numba.cuda import config
    return not config.ENABLE_CUDASIM and cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _real_gpu():
        return
    skip = pytest.mark.skip(reason="gpu tier: needs a real CUDA GPU (run tests/gpu_run.sh on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def simulator() -> bool:
    from numba.cuda import config
    return bool(config.ENABLE_CUDASIM)
