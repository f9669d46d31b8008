"""gemv_fp8_v5 and its variants (and, asked for by name, gemv_fp8_v4's) on the H200: each checked,
then timed beside gemv_fp8_v2 (the FP8 default) and cuBLAS on the decoded bf16 weight, at K = 6144,
N = 25600, T = 1, 4, 8.

    # no GPU: registers and spills of each variant for sm_90a (the compile tier's way)
    python tools/fp8_gemv_dev.py --compile
    # on the H200, from the repository root with PYTHONPATH set (about a minute; --budget caps it)
    timeout 150 python3 tools/fp8_gemv_dev.py --run --out $OUT
    # v4's variants as well (add about 40 s)
    timeout 200 python3 tools/fp8_gemv_dev.py --run --out $OUT --only gemv_fp8_v5 gemv_fp8_v4 'v4[depth3]'

Checks, every kernel and T before it is timed: its output against gemv_fp8_v2's on every element
(bf16 ulp distance and the share of outputs whose bits differ: v5 claims 0, bit for bit; v3, v4 sum
in other orders) and against the float64 yardstick on 256 sampled rows
(`bench.validate.projection_agrees`: > 1 ulp on under 0.1% of them, relative L2 under 2^-8). A
kernel that fails a check is reported and not timed; a kernel that raises is reported with its error
and the others still run. Times are kernel medians by CUDA events with L2 flushed between runs
(`bench.timing.DeviceTimer`); a v5 time is both of its launches (x_f16_kernel, then the GEMV), and
each is also timed alone (columns x_f16, gemv). The floor is the weight's bytes over the measured
device copy rate. Then, checked (not timed): the registered v5 (and v4 if run) at an odd shape, K - 32
and N - 7, T = 3 and 9 (two token groups), and v5 against v2 bit for bit at the released shape on x
of large dynamic range (tokens at 2^40 .. 2^-60 with values spread over 2^-24 of that, zeros, a zero
token). Writes $OUT/fp8_gemv_dev.json and $OUT/fp8_gemv_dev.txt (the table), also printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

# name -> (warps a block, blocks an SM, PTX cache qualifiers of the codes' loads, skip empty groups,
# steps in flight a warp); the first is the registered gemv_fp8_v4
VARIANTS = {
    "gemv_fp8_v4": (16, 1, "L1::no_allocate", False, 2),
    "v4[depth3]": (16, 1, "L1::no_allocate", False, 3),
    "v4[L2::256B]": (16, 1, "L1::no_allocate.L2::256B", False, 2),
    "v4[skip_empty]": (16, 1, "L1::no_allocate", True, 2),
    "v4[8w x 2]": (8, 2, "L1::no_allocate", False, 2),
    "v4[nc]": (16, 1, "", False, 2),
    "v4[12w,depth3]": (12, 1, "L1::no_allocate", False, 3),
}
# name -> (tiles of codes a warp loads a trip, blocks an SM the registers are bounded for); the first is
# the registered gemv_fp8_v5 (unroll 8 at 3 blocks spills 32 bytes: timed to see what that costs)
V5_VARIANTS = {
    "gemv_fp8_v5": (6, 3),
    "v5[u8]": (8, 3),
    "v5[u4]": (4, 3),
    "v5[u8,2/SM]": (8, 2),
    "v5[u3,4/SM]": (3, 4),         # 64 registers: 3.03 waves of 528 blocks at the released shape (3/SM: 4.04)
}
TOKENS = (1, 4, 8)
N, K = 25600, 6144          # --shape K N changes them (a smoke test in the simulator)


def compile_report(names) -> list[dict]:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    from numba import cuda

    from engram_numba.stages import compile_check as cc
    from engram_numba.stages.proj import cuda_gemv_fp8 as C
    from engram_numba.stages.proj import records
    cc._patch_current_device()
    rows = []
    for name in names:
        if name in V5_VARIANTS:
            k = C.make_gemv_fp8_v5(*V5_VARIANTS[name])
            argtypes = records._FP8_V5_ARGS
        else:
            warps, bps, hint, skip, depth = VARIANTS[name]
            k = C.make_gemv_fp8_v4(warps, hint, skip, bps, depth)
            argtypes = records._FP8_FAST_ARGS
        ptx, _ = cuda.compile_ptx(k.py_func, tuple(argtypes), cc=cc.CC,
                                  launch_bounds=k.targetoptions.get("launch_bounds"))
        rep = cc.ptxas_report(ptx)
        row = dict(variant=name, shape=V5_VARIANTS.get(name) or VARIANTS[name], registers=rep["registers"],
                   spill_bytes=rep.get("spill_stores", -1) + rep.get("spill_loads", -1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(res) -> str:
    head = (f"{'kernel':<16} {'T':>2} {'us':>8} {'%floor':>7} {'GB/s':>7} {'x_f16':>6} {'gemv':>7}  {'valid':<5} "
            f"{'ulp>1 ref':>9} {'maxulp v2':>9} {'differs v2':>10}  note")
    lines = [f"FP8 GEMV at K = {K}, N = {N} on {res.get('device')} ({res.get('commit')}): floor "
             f"{res.get('floor_us', 0):.1f} us = {res.get('weight_bytes', 0) / 1e6:.1f} MB at the copy rate "
             f"{res.get('copy_gbps', 0):.0f} GB/s; L2 flushed between runs; target <= 52.5 us at T = 1", head]
    for r in res["rows"]:
        us = f"{r['us']:.2f}" if "us" in r else "-"
        pct = f"{r['pct_of_floor']:.1f}" if "pct_of_floor" in r else "-"
        gbps = f"{r['gbps']:.0f}" if "gbps" in r else "-"
        vr = r.get("vs_reference", {})
        xf = f"{r['us_x_f16']:.2f}" if "us_x_f16" in r else "-"
        gm = f"{r['us_gemv']:.2f}" if "us_gemv" in r else "-"
        lines.append(f"{r['kernel']:<16} {r['T']:>2} {us:>8} {pct:>7} {gbps:>7} {xf:>6} {gm:>7}  "
                     f"{str(r.get('valid', '-')):<5} "
                     f"{vr.get('frac_gt_1ulp', float('nan')):>9.2e} {r.get('max_ulp_vs_v2', '-'):>9} "
                     f"{r.get('frac_differs_from_v2', float('nan')):>10.2e}  {r.get('error', '')[:60]}")
    for c in res.get("odd_shape_checks", []):
        extra = (f", differs from v2 on {c['differs_from_v2']} of {c['outputs']} outputs"
                 if "differs_from_v2" in c else "")
        lines.append(f"odd shape {c['shape']} (T, K, N): {c['kernel']} valid={c['valid']} "
                     f"(> 1 ulp on {c['vs_reference']['frac_gt_1ulp']:.2e} of sampled outputs){extra}")
    for c in res.get("wide_x_checks", []):
        lines.append(f"wide-range x at T = {c['T']}: {c['kernel']} differs from v2 on {c['differs_from_v2']} of "
                     f"{c['outputs']} outputs (max {c['max_ulp_vs_v2']} ulp), valid={c['valid']}")
    for key in ("odd_shape_checks_error", "wide_x_checks_error"):
        if key in res:
            lines.append(f"{key}: {res[key]}")
    lines.append("reading: v5 rows want 'differs v2' 0.00e+00 (bit-identical to v2) and us <= 52.5 at T = 1 "
                 "(v2's at T = 4, 8 or less); x_f16 + gemv ~ us less the gap between the two launches")
    lines.append(f"done in {res.get('seconds', 0)} s; skipped: {res.get('skipped', [])}")
    return "\n".join(lines)


def run(names, out_dir: Path | None, budget_s: float) -> dict:
    import numpy as np
    from numba import cuda

    from engram_numba.bench.decode import random_fp8_weight
    from engram_numba.bench.timing import DeviceTimer, commit, device_name, measure_copy_gbps
    from engram_numba.bench.validate import projection_agrees
    from engram_numba.bf16 import bf16_ulp_distance, f32_to_bf16
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj import cuda_gemv_fp8 as C
    from engram_numba.stages.proj import launch as P
    from engram_numba.stages.proj import reference as R
    from engram_numba.stages.proj.cuda_common import flat_u32

    t0 = time.time()
    rng = np.random.default_rng(20261202)
    timer = DeviceTimer()
    copy_gbps = measure_copy_gbps(timer)
    codes, scales = random_fp8_weight(rng, N, K)
    cd, sd = cuda.to_device(codes), cuda.to_device(scales)
    sample = np.sort(rng.choice(N, min(N, 256), replace=False))
    wb_rows = np.concatenate([R.wkv_fp8_bf16(codes[n:n + 1], scales[n // 32:n // 32 + 1]) for n in sample])
    wbytes = N * K + scales.size
    res = {"commit": commit(), "device": device_name(), "copy_gbps": copy_gbps, "shape": [K, N], "l2": "cold",
           "weight_bytes": wbytes, "floor_us": wbytes / copy_gbps / 1e3, "variants": {}, "rows": [],
           "skipped": []}

    def save():
        res["seconds"] = round(time.time() - t0, 1)
        if out_dir:
            (out_dir / "fp8_gemv_dev.json").write_text(json.dumps(res, indent=1))
            (out_dir / "fp8_gemv_dev.txt").write_text(table(res) + "\n")

    xs, refs, want = {}, {}, {}
    for T in TOKENS:
        xh = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05)
        xs[T] = cuda.to_device(xh)
        refs[T] = R.projection_exact(xh, wb_rows)                       # float64, rounded once: [T, 256]

    built = {}

    def v4_launch(name, T, o):
        warps, bps, hint, skip, depth = VARIANTS[name]
        if name == "gemv_fp8_v4":
            return P.prepare_project_q(xs[T], cd, sd, o, weight="fp8", version="gemv_fp8_v4")
        if name not in built:                           # one compile a variant, not one a T
            built[name] = C.make_gemv_fp8_v4(warps, hint, skip, bps, depth)
        kernel = built[name]
        grid, block = C.geometry_v4(T, N, warps, bps)
        return PreparedLaunch(name, kernel, grid, block, 0, (flat_u32(xs[T]), flat_u32(cd), sd, o, T, K), o)

    def by_version(version):
        return lambda T, o: P.prepare_project_q(xs[T], cd, sd, o, weight="fp8", version=version)

    def v5_launch(name, T, o):
        if name == "gemv_fp8_v5":
            return P.prepare_project_q(xs[T], cd, sd, o, weight="fp8", version="gemv_fp8_v5")
        if name not in built:
            built[name] = C.make_gemv_fp8_v5(*V5_VARIANTS[name])
        from engram_numba.stages import registry
        return C.launcher_v5(registry.get("proj", "gemv_fp8_v5"), xs[T], cd, sd, o, kernel=built[name])

    wbd = None

    def cublas(T, o):
        nonlocal wbd
        if wbd is None:
            wbd = cuda.device_array((N, K), np.uint16)
            P.prepare_wkv_to_bf16(cd, sd, wbd, weight="fp8")()
        return P.prepare_project(xs[T], wbd, o, version="cublas_v1")

    # the baselines and the registered v5 first: the budget cuts the other variants, never them
    v5s = [(n, (lambda n: lambda T, o: v5_launch(n, T, o))(n)) for n in names if n in V5_VARIANTS]
    v4s = [(n, (lambda n: lambda T, o: v4_launch(n, T, o))(n)) for n in names if n in VARIANTS]
    kernels = [("gemv_fp8_v2", by_version("gemv_fp8_v2"))] + v5s[:1] + [("cublas_v1", cublas)] + v5s[1:] + v4s
    res["variants"] = {n: (dict(zip(("unroll", "blocks_per_sm"), V5_VARIANTS[n])) if n in V5_VARIANTS else
                           dict(zip(("warps", "blocks_per_sm", "hint", "skip_empty", "depth"), VARIANTS[n])))
                       for n in names}
    for name, make in kernels:
        if time.time() - t0 > budget_s and name not in ("gemv_fp8_v2", "gemv_fp8_v5", "cublas_v1"):
            res["skipped"].append(name)
            print(f"skip {name}: past the {budget_s:.0f} s budget", flush=True)
            continue
        for T in TOKENS:
            row = dict(kernel=name, T=T)
            try:
                o = cuda.device_array((T, N), np.uint16)
                launch = make(T, o)
                launch()
                cuda.synchronize()
                got = o.copy_to_host()
                ok, agree = projection_agrees(got[:, sample], refs[T])
                row.update(valid=ok, vs_reference=agree)
                if name == "gemv_fp8_v2":
                    want[T] = got
                elif T in want:
                    d = bf16_ulp_distance(got, want[T])
                    row.update(max_ulp_vs_v2=int(d.max()), frac_differs_from_v2=float((d > 0).mean()),
                               bit_identical_to_v2=bool((got == want[T]).all()),
                               nan_outputs=int(((got & 0x7FFF) > 0x7F80).sum()))
                if ok:
                    us = timer(launch, iters=30)
                    row.update(us=round(us, 2), pct_of_floor=round(100 * res["floor_us"] / us, 1),
                               gbps=round(wbytes / us / 1e3, 1))
                    if hasattr(launch, "prep"):         # v5: each of its two launches alone
                        row.update(us_x_f16=round(timer(launch.prep, iters=30), 2),
                                   us_gemv=round(timer(launch.gemv, iters=30), 2))
                else:
                    row["error"] = "failed the yardstick check: not timed"
            except Exception as e:                      # one kernel's failure must not end the run
                row.update(valid=False, error=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc(limit=6))
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            save()
    # the registered v5 (and v4 if run) at an odd shape too (7 rows and one scale tile cut off: a last
    # group past N, a last step of one tile) and T = 3, 9 (two token groups): checked, not timed; v5
    # also against v2 bit for bit
    try:
        No, Ko = N - 7, K - 32
        co, so = np.ascontiguousarray(codes[:No, :Ko]), np.ascontiguousarray(scales[:, :Ko // 32])
        cdo, sdo = cuda.to_device(co), cuda.to_device(so)
        samp = sample[sample < No]
        wb_o = np.concatenate([R.wkv_fp8_bf16(co[n:n + 1], so[n // 32:n // 32 + 1]) for n in samp])
        odd = ["gemv_fp8_v5"] + (["gemv_fp8_v4"] if "gemv_fp8_v4" in names else [])
        for T in (3, 9):
            xh = f32_to_bf16(rng.standard_normal((T, Ko)).astype(np.float32) * 0.05)
            xo = cuda.to_device(xh)
            o2 = cuda.device_array((T, No), np.uint16)
            P.prepare_project_q(xo, cdo, sdo, o2, weight="fp8", version="gemv_fp8_v2")()
            for kname in odd:
                o = cuda.device_array((T, No), np.uint16)
                P.prepare_project_q(xo, cdo, sdo, o, weight="fp8", version=kname)()
                got = o.copy_to_host()
                ok, agree = projection_agrees(got[:, samp], R.projection_exact(xh, wb_o))
                c = dict(kernel=kname, shape=[T, Ko, No], valid=ok, vs_reference=agree)
                if kname == "gemv_fp8_v5":
                    c.update(differs_from_v2=int((got != o2.copy_to_host()).sum()), outputs=int(got.size))
                res.setdefault("odd_shape_checks", []).append(c)
                print(json.dumps(res["odd_shape_checks"][-1]), flush=True)
    except Exception as e:
        res["odd_shape_checks_error"] = f"{type(e).__name__}: {e}"
    save()
    # v5 against v2 bit for bit on x of large dynamic range at the released shape (T = 4: a zero token)
    try:
        T = 4
        mags = np.array([40, -60, 0, 20])
        v = rng.standard_normal((T, K)) * 2.0 ** rng.integers(-24, 1, (T, K)) * 2.0 ** mags[:, None]
        v[rng.random((T, K)) < 0.1] = 0.0
        v[2] = 0.0
        xh = f32_to_bf16(v.astype(np.float32))
        xw = cuda.to_device(xh)
        outs = {}
        for kname in ("gemv_fp8_v2", "gemv_fp8_v5"):
            o = cuda.device_array((T, N), np.uint16)
            P.prepare_project_q(xw, cd, sd, o, weight="fp8", version=kname)()
            outs[kname] = o.copy_to_host()
        got, ref2 = outs["gemv_fp8_v5"], outs["gemv_fp8_v2"]
        ok, agree = projection_agrees(got[:, sample], R.projection_exact(xh, wb_rows))
        d = bf16_ulp_distance(got, ref2)
        res["wide_x_checks"] = [dict(kernel="gemv_fp8_v5", T=T, magnitudes=mags.tolist(), valid=ok,
                                     vs_reference=agree, differs_from_v2=int((got != ref2).sum()),
                                     outputs=int(got.size), max_ulp_vs_v2=int(d.max()))]
        print(json.dumps(res["wide_x_checks"][-1]), flush=True)
    except Exception as e:
        res["wide_x_checks_error"] = f"{type(e).__name__}: {e}"
    save()
    print(table(res), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="registers and spills, no GPU needed")
    ap.add_argument("--run", action="store_true", help="check and time every kernel on the GPU")
    ap.add_argument("--only", nargs="*", default=None,
                    help=f"variant names (default: all of v5's); v5: {list(V5_VARIANTS)}, v4: {list(VARIANTS)}")
    ap.add_argument("--budget", type=float, default=70.0,
                    help="seconds after which the remaining variants are skipped (never v2, v5, cuBLAS)")
    ap.add_argument("--shape", type=int, nargs=2, metavar=("K", "N"), default=None,
                    help="another shape than the released K = 6144, N = 25600 (simulator smoke tests)")
    ap.add_argument("--tokens", type=int, nargs="*", default=None, help="token counts (default 1 4 8)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="folder for fp8_gemv_dev.json / .txt (default: $OUT)")
    args = ap.parse_args(argv)
    if not (args.compile or args.run):
        print("error: say --compile or --run", file=sys.stderr)
        return 2
    global N, K, TOKENS
    if args.shape:
        K, N = args.shape
    if args.tokens:
        TOKENS = tuple(args.tokens)
    names = args.only if args.only else list(V5_VARIANTS)
    if "gemv_fp8_v5" not in names:
        names = ["gemv_fp8_v5"] + names                 # the registered v5 always runs
    bad = [n for n in names if n not in VARIANTS and n not in V5_VARIANTS]
    if bad:
        print(f"error: unknown variants {bad}; known: {list(V5_VARIANTS) + list(VARIANTS)}", file=sys.stderr)
        return 2
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.compile:
        compile_report(names)
    if args.run:
        run(names, args.out, args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
