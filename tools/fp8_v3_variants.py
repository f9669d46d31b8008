"""gemv_fp8_v3's shape, chosen by measurement: each (warps a block, ring slots a warp) variant built
by the same factory as the registered kernel (`cuda_gemv_fp8.make_gemv_fp8_v3`), checked and timed
beside gemv_fp8_v2 (the FP8 default).

    # no GPU: registers and spills of each variant for sm_90a (the compile tier's way)
    python tools/fp8_v3_variants.py --compile
    # on the H200 (wheels installed as docs/gpu.md says): at K = 6144, N = 25600, T = 1, 4, 8 every
    # variant's output against gemv_fp8_v2's (bf16 ulp distance, every output) and against the
    # float64 yardstick on 256 sampled rows; then CUDA-event medians with L2 flushed between runs
    python3 tools/fp8_v3_variants.py --run --out $OUT/fp8_v3_variants.json

A variant that fails the yardstick check is reported and not timed. The figures are kernel times (no
launch overhead); the floor is the weight bytes over the measured device copy rate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

# (warps a block, ring slots a warp); the first is the registered gemv_fp8_v3
VARIANTS = [(2, 4), (1, 4), (1, 6), (2, 3), (2, 6), (4, 3), (4, 4)]
TOKENS = (1, 4, 8)
N, K = 25600, 6144


def name_of(v) -> str:
    return "gemv_fp8_v3[split=%d,stages=%d]" % v


def compile_report(variants) -> list[dict]:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    from numba import cuda

    from engram_numba.stages import compile_check as cc
    from engram_numba.stages.proj import cuda_gemv_fp8 as C
    from engram_numba.stages.proj import records
    cc._patch_current_device()
    rows = []
    for v in variants:
        k = C.make_gemv_fp8_v3(*v)
        ptx, _ = cuda.compile_ptx(k.py_func, tuple(records._FP8_FAST_ARGS), cc=cc.CC,
                                  launch_bounds=k.targetoptions.get("launch_bounds"))
        rep = cc.ptxas_report(ptx)
        row = dict(variant=name_of(v), registers=rep["registers"],
                   spill_bytes=rep.get("spill_stores", -1) + rep.get("spill_loads", -1),
                   shared_bytes=C.v3_shared_bytes(*v))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def run(variants, out_path: Path | None) -> dict:
    import numpy as np
    from numba import cuda

    from engram_numba.bench.decode import random_fp8_weight
    from engram_numba.bench.timing import DeviceTimer, commit, device_name, measure_copy_gbps
    from engram_numba.bench.validate import projection_agrees
    from engram_numba.bf16 import bf16_ulp_distance, f32_to_bf16
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj import cuda_gemv_fp8 as C
    from engram_numba.stages.proj import reference as R
    from engram_numba.stages.proj.cuda_common import cdiv, flat_u32
    from engram_numba.stages.proj.launch import prepare_project_q

    rng = np.random.default_rng(20261202)
    t0 = time.time()
    timer = DeviceTimer()
    copy_gbps = measure_copy_gbps(timer)
    codes, scales = random_fp8_weight(rng, N, K)
    cd, sd = cuda.to_device(codes), cuda.to_device(scales)
    sample = np.sort(rng.choice(N, 256, replace=False))
    # the sampled rows' exact weights as bf16 (exact in bf16: wkv_fp8_bf16 of those rows with their scale rows)
    wb_rows = np.concatenate([R.wkv_fp8_bf16(codes[n:n + 1], scales[n // 32:n // 32 + 1]) for n in sample])
    wbytes = N * K + cdiv(N, 32) * (K // 32)
    res = {"commit": commit(), "device": device_name(), "copy_gbps": copy_gbps, "shape": [K, N], "l2": "cold",
           "floor_us": wbytes / copy_gbps / 1e3, "rows": []}

    def save():
        res["seconds"] = round(time.time() - t0, 1)
        if out_path:
            out_path.write_text(json.dumps(res, indent=1))

    built = {name_of(v): (v, C.make_gemv_fp8_v3(*v)) for v in variants}
    for T in TOKENS:
        xh = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05)
        x = cuda.to_device(xh)
        ref = R.projection_exact(xh, wb_rows)
        o2 = cuda.device_array((T, N), np.uint16)
        v2 = prepare_project_q(x, cd, sd, o2, weight="fp8", version="gemv_fp8_v2")
        v2()
        want = o2.copy_to_host()
        ok, agree = projection_agrees(want[:, sample], ref)
        us = timer(v2, iters=30)
        res["rows"].append(dict(kernel="gemv_fp8_v2", T=T, us=round(us, 2), valid=ok, vs_reference=agree,
                                pct_of_floor=round(100 * res["floor_us"] / us, 1)))
        print(json.dumps(res["rows"][-1]), flush=True)
        for name, (v, kernel) in built.items():
            split, _ = v
            o = cuda.device_array((T, N), np.uint16)
            launch = PreparedLaunch(name, kernel, (cdiv(N, C.V3_ROWS), cdiv(T, C.V3_TOKENS)), 32 * split, 0,
                                    (flat_u32(x), flat_u32(cd), sd, o, T, K), o)
            launch()
            got = o.copy_to_host()
            ok, agree = projection_agrees(got[:, sample], ref)
            d = bf16_ulp_distance(got, want)
            row = dict(kernel=name, T=T, valid=ok, vs_reference=agree, max_ulp_vs_v2=int(d.max()),
                       frac_differs_from_v2=float((d > 0).mean()))
            if ok:
                us = timer(launch, iters=30)
                row.update(us=round(us, 2), pct_of_floor=round(100 * res["floor_us"] / us, 1))
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
    save()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="registers and spills, no GPU needed")
    ap.add_argument("--run", action="store_true", help="check and time every variant on the GPU")
    ap.add_argument("--only", type=int, default=len(VARIANTS), help="the first N variants")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.compile or args.run):
        print("error: say --compile or --run", file=sys.stderr)
        return 2
    variants = VARIANTS[:max(1, args.only)]
    if args.compile:
        compile_report(variants)
    if args.run:
        run(variants, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
