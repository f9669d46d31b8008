"""Where a GEMM's time goes between its k loop and what each tile pays once, at T = 4096, N = 25600 (the released
outputs): gemm_v12 (the record), gemm_v10 (gemm_v4's grid), the 128 x 320 tile on that grid and cuBLAS, each
timed at K = 3072, 6144, 12288 and 24576 (the bench's DeviceTimer: L2 flushed, median), after gemm_v10's and
the wide grid's outputs are checked against gemm_v12's, every element. The step between two K is the k loop's
cost; what is left at K = 3072 after one step, the cost outside it. Prints a row a K and a line fit a kernel;
writes $OUT/kscale.json. Needs the H200 (about 50 s):

    python3 tools/proj_kscale.py            (from the repository root, PYTHONPATH set as in docs/gpu.md)
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

import numpy as np  # noqa: E402

T, N = 4096, 25600
KS = (3072, 6144, 12288, 24576)
KERNELS = ("gemm_v12", "gemm_v10", "wide_grid", "cublas_v1")


def main() -> int:
    from numba import cuda

    from engram_numba.bench.timing import DeviceTimer
    from engram_numba.bf16 import f32_to_bf16
    from engram_numba.stages.proj import cuda_wgmma as W
    from engram_numba.stages.proj.launch import prepare_project

    timer = DeviceTimer()
    rng = np.random.default_rng(0)
    res = []
    for K in KS:
        x = cuda.to_device(f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32)))
        w = cuda.to_device(f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05)))
        makers = {"gemm_v12": lambda o: prepare_project(x, w, o, version="gemm_v12"),
                  "gemm_v10": lambda o: W.prepare_variant("gemm_v10", W.TMA_STORE_TILE, x, w, o),
                  "wide_grid": lambda o: W.prepare_variant("wide", W.TMA_WIDE_TILE, x, w, o),
                  "cublas_v1": lambda o: prepare_project(x, w, o, version="cublas_v1")}
        outs, row = {}, {"K": K}
        for name in KERNELS:
            o = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
            launch = makers[name](o)
            launch()
            cuda.synchronize()
            outs[name] = o.copy_to_host()
            row[name] = round(timer(launch, iters=10 if K >= 12288 else 20), 1)
        for name in ("gemm_v10", "wide_grid"):      # whole tiles, the same k order: gemm_v12's bits
            row[f"{name}_differs"] = int(np.count_nonzero(outs[name] != outs["gemm_v12"]))
        row["v12_x_cublas"] = round(row["gemm_v12"] / row["cublas_v1"], 4)
        print(row, flush=True)
        res.append(row)
    for name in KERNELS:
        a, b = np.polyfit([r["K"] for r in res], [r[name] for r in res], 1)
        print(f"{name:10s} t = {a * 1000:.2f} us per 1000 k + {b:.1f} us", flush=True)
    Path(os.environ.get("OUT", ".")).joinpath("kscale.json").write_text(json.dumps(res, indent=1))
    return 0 if all(r["gemm_v10_differs"] == 0 and r["wide_grid_differs"] == 0 for r in res) else 1


if __name__ == "__main__":
    raise SystemExit(main())
