"""One GEMM launch of each named FP8 version (DeepSeek's arithmetic, cuda_fp8_wgmma.py) at the released
shape (K = 6144, N = 25600) and T tokens, for Nsight Compute. Names are records (gemm_fp8_v6, ...) or
specialisations (`V6_CANDIDATES`, `V7_CANDIDATES` names, e.g. 'gemm_fp8_v7[s5/grid/n128]'). Each launch
(act_quant + GEMM) runs twice to warm up; then each GEMM once between `cuda.profiling()`, so ncu
(with --profile-from-start off) sees exactly one launch a version and needs no launch counts:

    python3 tools/fp8_ncu.py [--tokens 4096] [versions ...]        (default: gemm_fp8_v7)

tools/gpu_ncu_fp8_v7.sh runs it under ncu with the pipe, issue and stall metrics.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from fp8_dev import K_REL, N_REL, _fp8_weight, _prepare, _x_rows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("versions", nargs="*", default=["gemm_fp8_v7"])
    a = ap.parse_args(argv)
    rng = np.random.default_rng(2026)
    codes, scales = _fp8_weight(rng, N_REL, K_REL)
    d_codes, d_scales = cuda.to_device(codes), cuda.to_device(scales)
    x = cuda.to_device(_x_rows(rng, a.tokens, K_REL, True))
    launches = []
    for v in a.versions:
        try:
            launch = _prepare(v, x, d_codes, d_scales, cuda.device_array((a.tokens, N_REL), np.uint16))
            for _ in range(2):
                launch()
            cuda.synchronize()
            launches.append(launch)
        except Exception as exc:             # one failing version must not stop the others
            print(f"{v}: FAILED {type(exc).__name__}: {exc}"[:800], flush=True)
    with cuda.profiling():                  # ncu --profile-from-start off sees these launches only
        for launch in launches:
            launch.gemm()
        cuda.synchronize()
    print("profiled", [(launch.name, launch.grid, launch.block) for launch in launches], flush=True)
    return 0 if len(launches) == len(a.versions) else 1


if __name__ == "__main__":
    raise SystemExit(main())
