"""gemv_q2k_v9's shape, to be chosen by measurement: each (warps a block, unit slots a warp, blocks an
SM) variant built from the same factory as the registered kernel, checked bit for bit against
gemv_q2k_v4 and only then timed, beside v4 and v8 (the registered versions).

    # no GPU: registers, spills and shared memory of each variant for sm_90a (the compile tier's way)
    python tools/q2kr_v9_variants.py --compile
    # on the H200 (wheels installed as docs/gpu.md says): every output of every variant against
    # gemv_q2k_v4 at K = 6144, N = 25600, T = 1, 4, 8, alone and as the two-layer launch, then
    # CUDA-event medians with L2 flushed between runs, beside v4 and v8; JSON to --out
    python3 tools/q2kr_v9_variants.py --run --out $OUT/v9_variants.json

A variant that differs from v4 in any output is reported and not timed. The figures are kernel
times (no launch overhead); the floor is the weight bytes over the measured device copy rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

# (warps a block, unit slots a warp, blocks an SM); the first is the registered gemv_q2k_v9. At T <= 8
# one layer is 1,600 items (one a block): (2, 2, 14) holds them in one round at 28 warps an SM.
VARIANTS = [(2, 2, 14), (2, 3, 10), (3, 2, 9), (3, 2, 8), (1, 2, 20), (1, 3, 16)]
TOKENS = (1, 4, 8)
N, K = 25600, 6144


def name_of(v) -> str:
    return "v9[team=%d,stages=%d,per_sm=%d]" % v


def compile_report(variants) -> list[dict]:
    """v8's compile report (tools/q2kr_v8_variants.py) on v9's factory."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from q2kr_v8_variants import compile_report as report
    return report(variants, family="v9", label=name_of)


def run(variants, out_path: Path | None) -> dict:
    import numpy as np
    from numba import cuda

    from engram_numba.bench.timing import DeviceTimer, commit, device_name, measure_copy_gbps
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj import cuda_gemv_q2kr as C
    from engram_numba.stages.proj.cuda_common import cdiv, flat_u32
    from engram_numba.stages.proj.launch import prepare_project_q
    from engram_numba.stages.proj.tests.test_proj_quant import random_q2k, random_x

    rng = np.random.default_rng(20261203)
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

    def timed(row, launch, layers):
        us = timer(launch, iters=30)
        row.update(us=round(us, 2), pct_of_floor=round(100 * layers * res["floor_us_one_layer"] / us, 1))
        res["rows"].append(row)
        print(json.dumps(row), flush=True)

    built = {name_of(v): (v, C._make_gemv9(*v)) for v in variants}
    for T in TOKENS:
        xs = [cuda.to_device(random_x(rng, T, K)) for _ in range(2)]
        want = []
        for i in range(2):                         # the yardstick: v4 on each layer alone
            o = cuda.device_array((T, N), np.uint16)
            prepare_project_q(xs[i], w[i], None, o, weight="q2k_r", version="gemv_q2k_v4")()
            want.append(o.copy_to_host())
        for ref in ("gemv_q2k_v4", "gemv_q2k_v8"):
            o = cuda.device_array((T, N), np.uint16)
            single = prepare_project_q(xs[0], w[0], None, o, weight="q2k_r", version=ref)
            oa, ob = cuda.device_array((T, N), np.uint16), cuda.device_array((T, N), np.uint16)
            two = C.prepare_pair(ref, xs[0], xs[1], pair, oa, ob)
            timed(dict(kernel=ref, form="single", T=T), single, 1)
            timed(dict(kernel=ref, form="pair", T=T), two, 2)
        grid = (cdiv(N, C.TILE_ROWS), cdiv(T, C.V4_TOKENS))
        for name, (v, (gemv, gemv_pair)) in built.items():
            team = v[0]
            o = cuda.device_array((T, N), np.uint16)
            single = PreparedLaunch(name, gemv, grid, team * 32, 0, (flat_u32(xs[0]), flat_u32(w[0]), o, T, K), o)
            oa, ob = cuda.device_array((T, N), np.uint16), cuda.device_array((T, N), np.uint16)
            two = PreparedLaunch(name + "[2 layers]", gemv_pair, grid + (2,), team * 32, 0,
                                 (flat_u32(xs[0]), flat_u32(xs[1]), pair.reshape(pair.size).view(np.uint32),
                                  oa, ob, T, K), (oa, ob))
            single()
            two()
            differ = int((o.copy_to_host() != want[0]).sum())
            pair_differ = int((oa.copy_to_host() != want[0]).sum() + (ob.copy_to_host() != want[1]).sum())
            for form, launch, layers in (("single", single, 1), ("pair", two, 2)):
                row = dict(kernel=name, form=form, T=T, outputs_differing_from_v4=differ,
                           pair_outputs_differing_from_v4=pair_differ)
                if differ == 0 and pair_differ == 0:
                    timed(row, launch, layers)
                else:
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
