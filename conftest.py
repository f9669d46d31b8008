"""Test tiers (see docs/design.md): exact CPU tests, the @cuda.jit kernels under numba's simulator,
compile-only (tests/test_compile_tier.py, in a subprocess with the simulator off), and the `gpu`
tier, which runs only on a real GPU.

Without a GPU the simulator is switched on here, before anything imports numba.cuda; set
NUMBA_ENABLE_CUDASIM yourself to force either way.
"""
import os
import pathlib

from engram_numba._target import gpu_device_present  # (importing engram_numba picks the target too)

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0" if gpu_device_present() else "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent
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


# GPU-tier results ---------------------------------------------------------------------------
# tests/gpu_run.sh sets ENGRAM_GPU_RESULTS; every gpu test's outcome and the figures it records
# (max errors, shapes) are written there at the end, for tests/gpu_results/.
_GPU_RECORDS: list = []
_GPU_OUTCOMES: dict = {}


@pytest.fixture
def gpu_record(request):
    """Call gpu_record(stage=..., shape=..., max_err=..., unit=..., ok=...) to log a figure."""
    def record(**fields):
        fields.setdefault("test", request.node.nodeid)
        fields.setdefault("module", request.node.module.__name__)
        _GPU_RECORDS.append({k: (v.item() if hasattr(v, "item") else v) for k, v in fields.items()})
    return record


def pytest_runtest_logreport(report):
    if "gpu" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        _GPU_OUTCOMES[report.nodeid] = report.outcome
        if report.outcome != "skipped":
            # rewritten after every gpu test, so a run cut short by a time limit keeps what ran
            _write_gpu_summary(exitstatus=-1)


def pytest_sessionfinish(session, exitstatus):
    _write_gpu_summary(int(exitstatus))


def _write_gpu_summary(exitstatus: int) -> None:
    path = os.environ.get("ENGRAM_GPU_RESULTS")
    if not path:
        return
    import json
    import platform
    device = "none"
    try:
        if _real_gpu():
            from numba import cuda
            name = cuda.get_current_device().name
            device = name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # pragma: no cover
        device = f"unknown ({exc})"
    counts = {k: sum(1 for v in _GPU_OUTCOMES.values() if v == k) for k in ("passed", "failed", "skipped")}
    # Test modules may also keep their own RESULTS list of summaries.
    import sys
    records = list(_GPU_RECORDS)
    for name, mod in sorted(sys.modules.items()):
        if not name.rsplit(".", 1)[-1].startswith("test_"):
            continue
        for attr in ("RESULTS", "GPU_RESULTS"):
            if isinstance(getattr(mod, attr, None), list):
                records.extend(dict(r, module=name) for r in getattr(mod, attr))
    summary = {"commit": os.environ.get("ENGRAM_COMMIT", "unknown"), "device": device,
               "python": platform.python_version(), "exitstatus": int(exitstatus),
               "finished": exitstatus != -1, **counts,
               "outcomes": _GPU_OUTCOMES, "records": records}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
