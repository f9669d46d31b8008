"""gemv_q2k_v8's shape, chosen by measurement: each (warps a block, unit slots a warp, blocks an SM)
variant built from the same factory as the registered kernel, checked and timed side by side.

    # no GPU: registers, spills and shared memory of each variant for sm_90a (the compile tier's way)
    python tools/q2kr_v8_variants.py --compile
    # on the H200 (wheels installed as docs/gpu.md says): every output of every variant against
    # gemv_q2k_v4 bit for bit at K = 6144, N = 25600, T = 1, 4, 8, alone and as the two-layer pool,
    # then CUDA-event medians with L2 flushed between runs, beside v4 and v7; JSON to --out
    python3 tools/q2kr_v8_variants.py --run --out $OUT/v8_variants.json

A variant that differs from v4 in any output is reported and not timed. The figures are kernel
times (no launch overhead); the floor is the weight bytes over the measured device copy rate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

# (warps a block, unit slots a warp, blocks an SM); the first is the registered gemv_q2k_v8
# Compile tier (sm_90a): (1, 3, 16) 123 registers, (1, 2, 25) 72 and (3, 2, 8) 80, none spilling;
# (2, 2, 12) spills 36 bytes (single launch), (6, 2, 4) 36-108. At T <= 8 one layer is 1600 items
# and the two-layer pool 3200: (1, 2, 25) holds the whole pool in one round (24 warps an SM),
# (1, 3, 16) runs it in two with 12 warps an SM and 2 units in flight each.
VARIANTS = [(1, 3, 16), (1, 2, 25), (3, 2, 8), (2, 2, 12), (1, 4, 14), (2, 3, 8), (6, 2, 4)]
TOKENS = (1, 4, 8)
N, K = 25600, 6144


def name_of(v) -> str:
    return "v8[team=%d,stages=%d,per_sm=%d]" % v


def compile_report(variants, family: str = "v8", label=None) -> list[dict]:
    """Registers, spills and shared memory (sm_90a) of each variant's single and two-layer kernels,
    built by the q2k_r factory of `family` (v8 or v9: `_make_gemv8` / `_make_gemv9`)."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    from numba import cuda

    from engram_numba.stages import compile_check as cc
    from engram_numba.stages.proj import cuda_gemv_q2kr as C
    from engram_numba.stages.proj import records
    cc._patch_current_device()
    rows = []
    for v in variants:
        gemv, pair = getattr(C, f"_make_gemv{family[1:]}")(*v)
        for form, k, args in (("single", gemv, records._Q2K_FAST_ARGS), ("pair", pair, records._Q2KR_PAIR_ARGS)):
            ptx, _ = cuda.compile_ptx(k.py_func, tuple(args), cc=cc.CC,
                                      launch_bounds=k.targetoptions.get("launch_bounds"))
            rep = cc.ptxas_report(ptx)
            row = dict(variant=(label or name_of)(v), form=form, registers=rep["registers"],
                       spill_bytes=rep.get("spill_stores", -1) + rep.get("spill_loads", -1),
                       shared_bytes=getattr(C, f"{family}_shared_bytes")(v[0], v[1]), warps_an_sm=v[0] * v[2])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def run(variants, out_path: Path | None) -> dict:
    import numpy as np
    from numba import cuda

    from engram_numba.bench.timing import DeviceTimer, commit, device_name, measure_copy_gbps
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj import cuda_gemv_q2kr as C
    from engram_numba.stages.proj.cuda_common import flat_u32
    from engram_numba.stages.proj.launch import prepare_project_q
    from engram_numba.stages.proj.tests.test_proj_quant import random_q2k, random_x

    rng = np.random.default_rng(20261202)
    t0 = time.time()
    timer = DeviceTimer()
    copy_gbps = measure_copy_gbps(timer)
    raws = [random_q2k(rng, N, K) for _ in range(2)]
    w = [C.repack_on_device(cuda.to_device(r), N, K) for r in raws]
    pair = cuda.device_array((2 * w[0].shape[0], w[0].shape[1]), np.uint8)
    pair[:w[0].shape[0]].copy_to_device(w[0])
    pair[w[0].shape[0]:].copy_to_device(w[1])
    wbytes = N * (K // 256) * 84
    res = {"commit": commit(), "device": device_name(), "copy_gbps": copy_gbps, "shape": [K, N], "l2": "cold",
           "floor_us_one_layer": wbytes / copy_gbps / 1e3, "rows": []}

    def save():
        res["seconds"] = round(time.time() - t0, 1)
        if out_path:
            out_path.write_text(json.dumps(res, indent=1))

    from engram_numba.bf16 import bf16_to_f32, bf16_ulp_distance, f32_to_bf16
    from engram_numba.stages.proj import reference as R
    # layer a's bf16 weights in float64, for the yardstick (R.projection_exact, the weight converted once)
    wb64 = bf16_to_f32(R.wkv_q2k_bf16(raws[0], K)).astype(np.float64)
    built = {name_of(v): (v, C._make_gemv8(*v)) for v in variants}
    for T in TOKENS:
        xh = [random_x(rng, T, K) for _ in range(2)]
        xs = [cuda.to_device(x) for x in xh]
        want, launches = [], {}
        for i in range(2):
            o = cuda.device_array((T, N), np.uint16)
            launches.setdefault("gemv_q2k_v4", []).append(
                prepare_project_q(xs[i], w[i], None, o, weight="q2k_r", version="gemv_q2k_v4"))
            launches["gemv_q2k_v4"][-1]()
            want.append(o.copy_to_host())
        for ref in ("gemv_q2k_v7",):
            o = cuda.device_array((T, N), np.uint16)
            launches[ref] = [prepare_project_q(xs[0], w[0], None, o, weight="q2k_r", version=ref)]
        # every output of v4 (and so of each variant equal to it) against the float64 yardstick
        ulp = bf16_ulp_distance(want[0], f32_to_bf16(bf16_to_f32(xh[0]).astype(np.float64) @ wb64.T))
        res["rows"].append(dict(kernel="gemv_q2k_v4", T=T, check="every output vs projection_exact (float64)",
                                max_ulp=int(ulp.max()), outputs_off_by_1=int((ulp == 1).sum()), outputs=int(ulp.size)))
        print(json.dumps(res["rows"][-1]), flush=True)
        pair_v4 = C.prepare_pair("gemv_q2k_v4", xs[0], xs[1], pair, cuda.device_array((T, N), np.uint16),
                                 cuda.device_array((T, N), np.uint16))
        for name, launch in (("gemv_q2k_v4", launches["gemv_q2k_v4"][0]), ("gemv_q2k_v7", launches["gemv_q2k_v7"][0]),
                             ("gemv_q2k_v4[2 layers]", pair_v4)):
            us = timer(launch, iters=30)
            layers = 2 if "2 layers" in name else 1
            res["rows"].append(dict(kernel=name, T=T, us=round(us, 2),
                                    pct_of_floor=round(100 * layers * res["floor_us_one_layer"] / us, 1)))
            print(json.dumps(res["rows"][-1]), flush=True)
        for name, (v, (gemv, gemv_pair)) in built.items():
            team, _, per_sm = v
            o = cuda.device_array((T, N), np.uint16)
            single = PreparedLaunch(name, gemv, (C.v8_grid(T, N, 1, per_sm),), team * 32, 0,
                                    (flat_u32(xs[0]), flat_u32(w[0]), o, T, K), o)
            oa, ob = cuda.device_array((T, N), np.uint16), cuda.device_array((T, N), np.uint16)
            two = PreparedLaunch(name + "[2 layers]", gemv_pair, (C.v8_grid(T, N, 2, per_sm),), team * 32, 0,
                                 (flat_u32(xs[0]), flat_u32(xs[1]), pair.reshape(pair.size).view(np.uint32),
                                  oa, ob, T, K), (oa, ob))
            single()
            two()
            differ = int((o.copy_to_host() != want[0]).sum())
            pair_differ = int((oa.copy_to_host() != want[0]).sum() + (ob.copy_to_host() != want[1]).sum())
            for form, launch, layers in (("single", single, 1), ("pair", two, 2)):
                row = dict(kernel=name, form=form, T=T, grid=launch.grid[0], outputs_differing_from_v4=differ,
                           pair_outputs_differing_from_v4=pair_differ)
                if differ == 0 and pair_differ == 0:
                    us = timer(launch, iters=30)
                    row.update(us=round(us, 2), pct_of_floor=round(100 * layers * res["floor_us_one_layer"] / us, 1))
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            save()
    save()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="registers and spills of each variant (no GPU needed)")
    ap.add_argument("--run", action="store_true", help="check against v4 and time each variant (GPU)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for --run")
    ap.add_argument("--only", type=int, default=None, help="the first N variants only")
    a = ap.parse_args(argv)
    variants = VARIANTS[:a.only] if a.only else VARIANTS
    if not (a.compile or a.run):
        ap.error("pass --compile or --run")
    if a.compile:
        compile_report(variants)
    if a.run:
        run(variants, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
