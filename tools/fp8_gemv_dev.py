"""gemv_fp8_v6 and its variants (and, asked for by name, gemv_fp8_v5's and gemv_fp8_v4's) on the H200:
each checked, then timed beside gemv_fp8_v5 (the FP8 default for 1..8 tokens), gemv_fp8_v2 and cuBLAS on
the decoded bf16 weight, at K = 6144, N = 25600, T = 1, 4, 8.

    # no GPU: registers and spills of each variant for sm_90a (the compile tier's way)
    python tools/fp8_gemv_dev.py --compile
    # on the H200, from the repository root with PYTHONPATH set (about a minute; --budget caps it)
    timeout 110 python3 tools/fp8_gemv_dev.py --run --out $OUT
    # v5's variants instead of v6's
    timeout 150 python3 tools/fp8_gemv_dev.py --run --out $OUT --only gemv_fp8_v5 'v5[u8]' 'v5[u3,4/SM]'
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
device copy rate. Then, checked (not timed): the registered v5, every v6 run (and v4 if run) at an odd
shape, K - 32 and N - 7, T = 1, 4, 8 and 9 (two token groups), each against v2 bit for bit (v4: the
yardstick only); v5 and every v6 against v2 bit for bit at the released shape on x of large dynamic
range (tokens at 2^40 .. 2^-60 with values spread over 2^-24 of that, zeros, a zero token) and at
the e8m0 ends (every tile scale byte 246 with x ~ 2^-24, then 8 with x ~ 2^24), T = 1, 4, 8. A v6 time
is its one launch (no x_f16 launch: the x_f16 / gemv columns stay empty). Writes $OUT/fp8_gemv_dev.json
and $OUT/fp8_gemv_dev.txt (the table), also printed at the end.
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
    "gemv_fp8_v5": (4, 3),         # as registered (V5_UNROLL, V5_BLOCKS_PER_SM)
    "v5[u8]": (8, 3),
    "v5[u4]": (4, 3),
    "v5[u8,2/SM]": (8, 2),
    "v5[u3,4/SM]": (3, 4),         # 64 registers: 3.03 waves of 528 blocks at the released shape (3/SM: 4.04)
}
# name -> (teams of 8 warps a block, tiles of codes a warp loads a trip, blocks an SM, tiles of codes asked
# of L2 before the copy of x); the first is the registered gemv_fp8_v6
V6_VARIANTS = {
    "gemv_fp8_v6": (3, 4, 1, 8),
    "v6[3t,u3]": (3, 3, 1, 8),
    "v6[3t,u4,pf0]": (3, 4, 1, 0),        # no L2 prefetch under the copy of x
    "v6[3t,u4,pf16]": (3, 4, 1, 16),
    "v6[2t,u4]": (2, 4, 1, 8),            # 16 warps an SM, 128 registers
    "v6[2t,u6]": (2, 6, 1, 8),
    "v6[1t,u4,2/SM]": (1, 4, 2, 8),       # 264 blocks, each its own x copy
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
        elif name in V6_VARIANTS:
            teams, unroll, bps, pf = V6_VARIANTS[name]
            k = C.make_gemv_fp8_v6(teams, unroll, bps, pf)
            argtypes = records._FP8_V6_ARGS
        else:
            warps, bps, hint, skip, depth = VARIANTS[name]
            k = C.make_gemv_fp8_v4(warps, hint, skip, bps, depth)
            argtypes = records._FP8_FAST_ARGS
        ptx, _ = cuda.compile_ptx(k.py_func, tuple(argtypes), cc=cc.CC,
                                  launch_bounds=k.targetoptions.get("launch_bounds"))
        rep = cc.ptxas_report(ptx)
        row = dict(variant=name, shape=V5_VARIANTS.get(name) or V6_VARIANTS.get(name) or VARIANTS[name],
                   registers=rep["registers"],
                   spill_bytes=rep.get("spill_stores", -1) + rep.get("spill_loads", -1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(res) -> str:
    head = (f"{'kernel':<16} {'T':>2} {'us':>8} {'%floor':>7} {'GB/s':>7} {'x_f16':>6} {'gemv':>7}  {'valid':<5} "
            f"{'ulp>1 ref':>9} {'maxulp v2':>9} {'differs v2':>10}  note")
    lines = [f"FP8 GEMV at K = {K}, N = {N} on {res.get('device')} ({res.get('commit')}): floor "
             f"{res.get('floor_us', 0):.1f} us = {res.get('weight_bytes', 0) / 1e6:.1f} MB at the copy rate "
             f"{res.get('copy_gbps', 0):.0f} GB/s; L2 flushed between runs; target: v6 under v5 at T = 1, 4, 8 "
             f"(v5 52.5 us at T = 1 = 70.6% of the floor in the main bench)", head]
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
                     f"{r.get('frac_differs_from_v2', float('nan')):>10.2e}  {r.get('error', '')[:60] or 'grid ' + r.get('grid', '?')}")
    for c in res.get("odd_shape_checks", []):
        extra = (f", differs from v2 on {c['differs_from_v2']} of {c['outputs']} outputs"
                 if "differs_from_v2" in c else "")
        lines.append(f"odd shape {c['shape']} (T, K, N): {c['kernel']} valid={c['valid']} "
                     f"(> 1 ulp on {c['vs_reference'].get('frac_gt_1ulp', float('nan')):.2e} of sampled outputs){extra}"
                     + (f"; ERROR {c['error'][:80]}" if c.get("error") else ""))
    for c in res.get("wide_x_checks", []):
        lines.append(f"wide-range x at T = {c['T']}: {c['kernel']} differs from v2 on {c['differs_from_v2']} of "
                     f"{c['outputs']} outputs (max {c['max_ulp_vs_v2']} ulp), valid={c['valid']}")
    for c in res.get("extreme_scale_checks", []):
        lines.append(f"e8m0 end (scale byte {c['scale_byte']}, x ~ 2^{c['x_exp']}) at T = {c['T']}: {c['kernel']} differs "
                     f"from v2 on {c['differs_from_v2']} of {c['outputs']} outputs; v2 finite: {c['v2_finite']}"
                     + (f"; ERROR {c['error']}" if c.get("error") else ""))
    bad = [c for key in ("odd_shape_checks", "wide_x_checks", "extreme_scale_checks") for c in res.get(key, [])
           if c.get("differs_from_v2", 0) or c.get("error") or not c.get("valid", True)]
    lines.append(f"bit checks: {len(bad)} failing of "
                 f"{sum(len(res.get(k, [])) for k in ('odd_shape_checks', 'wide_x_checks', 'extreme_scale_checks'))}"
                 + (": " + ", ".join(f"{c['kernel']}@{c.get('shape', c.get('T'))}" for c in bad[:8]) if bad else ""))
    for key in ("odd_shape_checks_error", "wide_x_checks_error", "extreme_scale_checks_error"):
        if key in res:
            lines.append(f"{key}: {res[key]}")
    lines.append("reading: v5 and v6 rows want 'differs v2' 0.00e+00 (bit-identical to v2) and a v6 us under v5's "
                 "at each T (one launch against v5's two; no partial wave); v5's x_f16 + gemv ~ its us less the gap "
                 "between its two launches; variants: " + ", ".join(
                     f"{n} = {dict(zip(('teams', 'unroll', 'blocks_per_sm', 'prefetch_tiles'), v))}"
                     for n, v in res.get("v6_variants", {}).items()))
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
           "skipped": [], "v6_variants": {n: V6_VARIANTS[n] for n in names if n in V6_VARIANTS}}

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

    def v6_launch(name, xd, cdd, sdd, o):
        if name == "gemv_fp8_v6":
            return P.prepare_project_q(xd, cdd, sdd, o, weight="fp8", version="gemv_fp8_v6")
        teams, unroll, bps, pf = V6_VARIANTS[name]
        if name not in built:
            built[name] = C.make_gemv_fp8_v6(teams, unroll, bps, pf)
        from engram_numba.stages import registry
        return C.launcher_v6(registry.get("proj", "gemv_fp8_v6"), xd, cdd, sdd, o, kernel=built[name], teams=teams,
                             blocks_per_sm=bps)

    def named_launch(name, xd, cdd, sdd, o):
        """Any kernel by name on any inputs (the checks' shapes): v6 variants built here, the rest registered."""
        if name in V6_VARIANTS:
            return v6_launch(name, xd, cdd, sdd, o)
        if name in V5_VARIANTS and name != "gemv_fp8_v5":
            if name not in built:
                built[name] = C.make_gemv_fp8_v5(*V5_VARIANTS[name])
            from engram_numba.stages import registry
            return C.launcher_v5(registry.get("proj", "gemv_fp8_v5"), xd, cdd, sdd, o, kernel=built[name])
        return P.prepare_project_q(xd, cdd, sdd, o, weight="fp8", version=name)

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
    v6s = [(n, (lambda n: lambda T, o: v6_launch(n, xs[T], cd, sd, o))(n)) for n in names if n in V6_VARIANTS]
    kernels = ([("gemv_fp8_v2", by_version("gemv_fp8_v2"))] + v5s[:1] + v6s[:1] + [("cublas_v1", cublas)] + v6s[1:]
               + v5s[1:] + v4s)
    res["variants"] = {n: (dict(zip(("unroll", "blocks_per_sm"), V5_VARIANTS[n])) if n in V5_VARIANTS else
                           dict(zip(("teams", "unroll", "blocks_per_sm", "prefetch_tiles"), V6_VARIANTS[n]))
                           if n in V6_VARIANTS else
                           dict(zip(("warps", "blocks_per_sm", "hint", "skip_empty", "depth"), VARIANTS[n])))
                       for n in names}
    protected = ("gemv_fp8_v2", "gemv_fp8_v5", "gemv_fp8_v6", "cublas_v1")
    for name, make in kernels:
        if time.time() - t0 > budget_s and name not in protected:
            res["skipped"].append(name)
            print(f"skip {name}: past the {budget_s:.0f} s budget", flush=True)
            continue
        for T in TOKENS:
            row = dict(kernel=name, T=T)
            try:
                o = cuda.device_array((T, N), np.uint16)
                launch = make(T, o)
                row["grid"] = str(getattr(launch, "grid", "?"))
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
    # the registered v5, every v6 run (and v4 if run) at an odd shape too (7 rows and one scale tile cut
    # off: a last group past N, a last step of one tile) and T = 1, 4, 8, 9 (two token groups): checked,
    # not timed; v5 and v6 also against v2 bit for bit
    bit_kernels = ["gemv_fp8_v5"] + [n for n in names if n in V6_VARIANTS]
    try:
        No, Ko = N - 7, K - 32
        co, so = np.ascontiguousarray(codes[:No, :Ko]), np.ascontiguousarray(scales[:, :Ko // 32])
        cdo, sdo = cuda.to_device(co), cuda.to_device(so)
        samp = sample[sample < No]
        wb_o = np.concatenate([R.wkv_fp8_bf16(co[n:n + 1], so[n // 32:n // 32 + 1]) for n in samp])
        odd = bit_kernels + (["gemv_fp8_v4"] if "gemv_fp8_v4" in names else [])
        for T in (1, 4, 8, 9):
            xh = f32_to_bf16(rng.standard_normal((T, Ko)).astype(np.float32) * 0.05)
            xo = cuda.to_device(xh)
            o2 = cuda.device_array((T, No), np.uint16)
            P.prepare_project_q(xo, cdo, sdo, o2, weight="fp8", version="gemv_fp8_v2")()
            want2 = o2.copy_to_host()
            for kname in odd:
                c = dict(kernel=kname, shape=[T, Ko, No])
                try:
                    o = cuda.device_array((T, No), np.uint16)
                    named_launch(kname, xo, cdo, sdo, o)()
                    got = o.copy_to_host()
                    ok, agree = projection_agrees(got[:, samp], R.projection_exact(xh, wb_o))
                    c.update(valid=ok, vs_reference=agree)
                    if kname in bit_kernels:
                        c.update(differs_from_v2=int((got != want2).sum()), outputs=int(got.size))
                except Exception as e:                  # one kernel's failure must not end the checks
                    c.update(valid=False, error=f"{type(e).__name__}: {e}", vs_reference={})
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
        o = cuda.device_array((T, N), np.uint16)
        P.prepare_project_q(xw, cd, sd, o, weight="fp8", version="gemv_fp8_v2")()
        ref2 = o.copy_to_host()
        yard = R.projection_exact(xh, wb_rows)
        res["wide_x_checks"] = []
        for kname in bit_kernels:
            c = dict(kernel=kname, T=T, magnitudes=mags.tolist())
            try:
                o = cuda.device_array((T, N), np.uint16)
                named_launch(kname, xw, cd, sd, o)()
                got = o.copy_to_host()
                ok, agree = projection_agrees(got[:, sample], yard)
                d = bf16_ulp_distance(got, ref2)
                c.update(valid=ok, vs_reference=agree, differs_from_v2=int((got != ref2).sum()),
                         outputs=int(got.size), max_ulp_vs_v2=int(d.max()))
            except Exception as e:
                c.update(valid=False, error=f"{type(e).__name__}: {e}", differs_from_v2=-1, outputs=0, max_ulp_vs_v2=-1)
            res["wide_x_checks"].append(c)
            print(json.dumps(c), flush=True)
    except Exception as e:
        res["wide_x_checks_error"] = f"{type(e).__name__}: {e}"
    save()
    # the e8m0 ends at the released shape: every tile scale 2^119 with x ~ 2^-24, then 2^-119 with x ~ 2^24
    # (v5's first form overflowed the former), T = 1, 4, 8: v5 and every v6 against v2 bit for bit
    try:
        res["extreme_scale_checks"] = []
        for sbyte, xexp in ((246, -24), (8, 24)):
            sdx = cuda.to_device(np.full_like(scales, sbyte))
            for T in TOKENS:
                xh = f32_to_bf16((rng.standard_normal((T, K)) * 2.0 ** xexp).astype(np.float32))
                xe = cuda.to_device(xh)
                o = cuda.device_array((T, N), np.uint16)
                P.prepare_project_q(xe, cd, sdx, o, weight="fp8", version="gemv_fp8_v2")()
                ref2 = o.copy_to_host()
                fin = bool(((ref2 & 0x7F80) != 0x7F80).all())
                for kname in bit_kernels:
                    c = dict(kernel=kname, T=T, scale_byte=sbyte, x_exp=xexp, v2_finite=fin)
                    try:
                        o = cuda.device_array((T, N), np.uint16)
                        named_launch(kname, xe, cd, sdx, o)()
                        got = o.copy_to_host()
                        c.update(differs_from_v2=int((got != ref2).sum()), outputs=int(got.size))
                    except Exception as e:
                        c.update(error=f"{type(e).__name__}: {e}", differs_from_v2=-1, outputs=0)
                    res["extreme_scale_checks"].append(c)
                    print(json.dumps(c), flush=True)
    except Exception as e:
        res["extreme_scale_checks_error"] = f"{type(e).__name__}: {e}"
    save()
    print(table(res), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="registers and spills, no GPU needed")
    ap.add_argument("--run", action="store_true", help="check and time every kernel on the GPU")
    ap.add_argument("--only", nargs="*", default=None,
                    help=f"variant names (default: the registered v5 and all of v6's); v6: {list(V6_VARIANTS)}, "
                         f"v5: {list(V5_VARIANTS)}, v4: {list(VARIANTS)}")
    ap.add_argument("--budget", type=float, default=55.0,
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
    names = args.only if args.only else ["gemv_fp8_v5"] + list(V6_VARIANTS)
    if "gemv_fp8_v5" not in names:
        names = ["gemv_fp8_v5"] + names                 # the registered v5 always runs
    bad = [n for n in names if n not in VARIANTS and n not in V5_VARIANTS and n not in V6_VARIANTS]
    if bad:
        print(f"error: unknown variants {bad}; known: {list(V6_VARIANTS) + list(V5_VARIANTS) + list(VARIANTS)}",
              file=sys.stderr)
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
