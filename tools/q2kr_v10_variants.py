"""gemv_q2k_v10's (or, --version v11 / v12, gemv_q2k_v11's / v12's) variants on the H200: each (warps a
block, unit slots a warp, blocks an SM, pairj, early, split[, v11, dd_once[, v12, zfill]]) shape built from
the registered kernel's factory (`cuda_gemv_q2kr._make_gemv10`), checked bit for bit against gemv_q2k_v4
on every output, and only then timed beside v9 (the T = 1 default) and v4 (and, for v11, v10; for v12, v11).

    # no GPU: registers, spills and shared memory of each variant for sm_90a (the compile tier's way)
    python tools/q2kr_v10_variants.py --compile
    # on the H200 (wheels installed as docs/gpu.md says), < 2 minutes: every output of every variant
    # against gemv_q2k_v4 at K = 6144, N = 25600, T = 1, 4, 8 and at three odd small shapes, alone and
    # as the two-layer launch; then CUDA-event medians (DeviceTimer, L2 flushed) at T = 1 of every
    # variant and of v9 and v4, single and two-layer; JSON and a text table into --out (a folder)
    python3 tools/q2kr_v10_variants.py --run --out $OUT
    # gemv_q2k_v11 and its variants instead (v11_variants.json / .txt; v10 timed beside it at T = 1, 4, 8)
    python3 tools/q2kr_v10_variants.py --version v11 --run --out $OUT
    # gemv_q2k_v12 and its variants (v12_variants.json / .txt; v11, v9, v4 timed beside it at T = 1, 4, 8)
    python3 tools/q2kr_v10_variants.py --version v12 --run --out $OUT

The variants separate v10's changes: pairj (sub-blocks decoded in pairs, the mma alternating between
the two accumulator chains) against v9's decode order with v10's 16-byte fragment stores; early (the
ring issues the next copy before decoding, halving the start burst); split (a unit copied as two
groups, the first block decoded once its 2 KB have landed). A variant
that differs from v4 in any output, or fails, is reported (with the error) and not timed; the rest go
on. Figures are kernel times (no launch overhead); the floor is the weight bytes over the measured
device copy rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

# (warps a block, unit slots a warp, blocks an SM, pairj, early, split); the first is the registered
# gemv_q2k_v10 (its two-layer launch has its own shape, V10_PAIR_SHAPE, timed as "gemv_q2k_v10").
VARIANTS = [(2, 2, 14, True, True, True),      # v10 as registered: pairj, early ring, split copies
            (2, 2, 14, True, False, False),    # pairj alone (v9's ring)
            (2, 2, 14, False, False, False),   # v9's decode order and ring, v10's 16-byte epilogue only
            (2, 2, 14, True, True, False),     # early without split
            (2, 3, 10, True, True, True),      # the registered pair shape as a single launch (95 registers)
            (2, 2, 14, False, True, True)]     # the ring changes without pairj
# gemv_q2k_v11: v10's shapes with v11's decode (the 7th field) and the d/dmin plane copied once
# (dd_once, the 8th); the registered gemv_q2k_v11 (V11_SHAPE: dd_once) is timed as itself
VARIANTS_V11 = [(2, 2, 14, True, True, True, True, False),     # v11's decode alone (each lane copies its g's dd)
                (2, 3, 10, True, True, True, True, True),      # its pair shape as a single launch
                (2, 2, 14, True, False, False, True, False)]   # v11's decode on v9's ring
# gemv_q2k_v12: v11's shapes with v12's tables (the 9th field) and branch-free zero-fill copies (zfill,
# the 10th); the registered gemv_q2k_v12 (V12_SHAPE: split copies) is timed as itself
VARIANTS_V12 = [(2, 2, 14, True, True, False, False, True, True, True),   # one commit group a unit
                (2, 3, 10, True, True, False, False, True, True, True),   # 3 slots, one group a unit
                (3, 2, 10, True, True, True, False, True, True, True)]    # 3 warps a block: 64 registers, 30 warps an SM
# the versions timed beside each family's registered kernel (single and pair at T = 1; single at T = 4, 8)
BASELINES = {"v10": ("gemv_q2k_v9", "gemv_q2k_v4"),
             "v11": ("gemv_q2k_v10", "gemv_q2k_v9", "gemv_q2k_v4"),
             "v12": ("gemv_q2k_v11", "gemv_q2k_v9", "gemv_q2k_v4")}
VER = "v10"                        # the family this run builds (main's --version)
CHECK_TOKENS = (1, 4, 8)
ODD_SHAPES = [(3, 3328, 13),               # a pad block, rows past N, warp 1 with one unit and empty shares
              (9, 1536, 40),               # 2 token groups, 3 units: warp 1 has none
              (2, 6656, 40)]               # 13 units: 4-unit shares
N, K = 25600, 6144


def name_of(v) -> str:
    fam = "v12" if len(v) > 8 and v[8] else ("v11" if len(v) > 6 and v[6] else "v10")
    return fam + "[team=%d,stages=%d,per_sm=%d,pairj=%d,early=%d,split=%d%s%s]" % (
        tuple(v[:6]) + (",dd_once=%d" % v[7] if len(v) > 7 else "", ",zfill=%d" % v[9] if len(v) > 9 else ""))


def compile_report(variants) -> list[dict]:
    """v8's compile report (tools/q2kr_v8_variants.py) on v10's factory."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from q2kr_v8_variants import compile_report as report
    return report(variants, family="v10", label=name_of)


def run(variants, out_dir: Path | None) -> dict:
    import numpy as np
    from numba import cuda

    from engram_numba.bench.timing import DeviceTimer, commit, device_name, measure_copy_gbps
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj import cuda_gemv_q2kr as C
    from engram_numba.stages.proj.cuda_common import cdiv, flat_u32
    from engram_numba.stages.proj.launch import prepare_project_q
    from engram_numba.stages.proj.tests.test_proj_quant import random_q2k, random_x

    rng = np.random.default_rng(20261210)
    t0 = time.time()
    timer = DeviceTimer()
    copy_gbps = measure_copy_gbps(timer)
    wbytes = N * (K // 256) * 84
    res = {"commit": commit(), "device": device_name(), "copy_gbps": round(copy_gbps, 1), "shape": [K, N],
           "floor_us_one_layer": round(wbytes / copy_gbps / 1e3, 2), "checks": [], "timings": [], "errors": []}

    def save():
        res["seconds"] = round(time.time() - t0, 1)
        if out_dir:
            (out_dir / f"{VER}_variants.json").write_text(json.dumps(res, indent=1))

    made = {}

    def layers(n, k):
        """Two layers' q2k_r weights and their pair buffer (made once a shape)."""
        if (n, k) not in made:
            w = [C.repack_on_device(cuda.to_device(random_q2k(rng, n, k)), n, k) for _ in range(2)]
            pair = cuda.device_array((2 * w[0].shape[0], w[0].shape[1]), np.uint8)
            pair[:w[0].shape[0]].copy_to_device(w[0])
            pair[w[0].shape[0]:].copy_to_device(w[1])
            made[(n, k)] = (w, pair)
        return made[(n, k)]

    def v4_outputs(xs, w, T, n):
        want = []
        for i in range(2):
            o = cuda.device_array((T, n), np.uint16)
            prepare_project_q(xs[i], w[i], None, o, weight="q2k_r", version="gemv_q2k_v4")()
            want.append(o.copy_to_host())
        return want

    def launches(label, gemv, gemv_pair, team, xs, w, pair, T, n, k):
        grid = (cdiv(n, C.TILE_ROWS), cdiv(T, C.V4_TOKENS))
        o = cuda.device_array((T, n), np.uint16)
        single = PreparedLaunch(label, gemv, grid, team * 32, 0, (flat_u32(xs[0]), flat_u32(w[0]), o, T, k), o)
        oa, ob = cuda.device_array((T, n), np.uint16), cuda.device_array((T, n), np.uint16)
        two = PreparedLaunch(label + "[2 layers]", gemv_pair, grid + (2,), team * 32, 0,
                             (flat_u32(xs[0]), flat_u32(xs[1]), pair.reshape(pair.size).view(np.uint32), oa, ob,
                              T, k), (oa, ob))
        return single, two, o, (oa, ob)

    # the candidates: each variant (single and two-layer kernels of its own shape) and the registered
    # gemv_q2k_v10 (its pair kernel has V10_PAIR_SHAPE), all team 2 (launch_config's block)
    reg = f"gemv_q2k_{VER}"
    reg_shape, reg_pair_shape = {"v10": (C.V10_SHAPE, C.V10_PAIR_SHAPE), "v11": (C.V11_SHAPE, C.V11_PAIR_SHAPE),
                                 "v12": (C.V12_SHAPE, C.V12_PAIR_SHAPE)}[VER]
    res["version"] = reg
    cands = {reg: (reg_shape, C.KERNELS[reg], C.PAIR_KERNELS[reg])}
    for v in variants:
        try:
            g, gp = C._make_gemv10(*v)
            cands[name_of(v)] = (v, g, gp)
        except Exception as e:                      # a shape the factory refuses: recorded, the rest go on
            res["errors"].append(dict(kernel=name_of(v), stage="build", error=repr(e)))
    bad = set()

    # 1. bits: every output against v4, released shape (T = 1, 4, 8) and odd small shapes
    shapes = [(T, K, N) for T in CHECK_TOKENS] + ODD_SHAPES
    for T, k, n in shapes:
        try:
            w, pair = layers(n, k)
            xs = [cuda.to_device(random_x(rng, T, k)) for _ in range(2)]
            want = v4_outputs(xs, w, T, n)
        except Exception as e:
            res["errors"].append(dict(kernel="gemv_q2k_v4", stage=f"yardstick {T}x{k}x{n}", error=repr(e)))
            continue
        for name, (v, g, gp) in cands.items():
            row = dict(kernel=name, shape=[T, k, n])
            try:
                single, two, o, (oa, ob) = launches(name, g, gp, v[0], xs, w, pair, T, n, k)
                single()
                two()
                row["outputs_differing_from_v4"] = int((o.copy_to_host() != want[0]).sum())
                row["pair_outputs_differing_from_v4"] = int((oa.copy_to_host() != want[0]).sum()
                                                            + (ob.copy_to_host() != want[1]).sum())
                if row["outputs_differing_from_v4"] or row["pair_outputs_differing_from_v4"]:
                    bad.add(name)
            except Exception as e:
                row["error"] = repr(e)
                res["errors"].append(dict(kernel=name, stage=f"check {T}x{k}x{n}", error=traceback.format_exc(-3)))
                bad.add(name)
            res["checks"].append(row)
            print(json.dumps(row), flush=True)
        save()

    # 2. time at T = 1: the baselines and every variant whose every output was v4's
    T = 1
    w, pair = layers(N, K)
    xs = [cuda.to_device(random_x(rng, T, K)) for _ in range(2)]
    floor = res["floor_us_one_layer"]

    def timed(name, form, launch, nl, extra=None, T=1):
        row = dict(kernel=name, form=form, T=T, **(extra or {}))
        try:
            us = timer(launch, iters=30)
            row.update(us=round(us, 2), pct_of_floor=round(100 * nl * floor / us, 1))
        except Exception as e:
            row["error"] = repr(e)
            res["errors"].append(dict(kernel=name, stage=f"time {form}", error=traceback.format_exc(-3)))
        res["timings"].append(row)
        print(json.dumps(row), flush=True)

    for ref in BASELINES[VER]:
        o = cuda.device_array((T, N), np.uint16)
        oa, ob = cuda.device_array((T, N), np.uint16), cuda.device_array((T, N), np.uint16)
        timed(ref, "single", prepare_project_q(xs[0], w[0], None, o, weight="q2k_r", version=ref), 1)
        timed(ref, "pair", C.prepare_pair(ref, xs[0], xs[1], pair, oa, ob), 2)
    for name, (v, g, gp) in cands.items():
        if name in bad:
            continue
        try:
            single, two, _, _ = launches(name, g, gp, v[0], xs, w, pair, T, N, K)
        except Exception as e:
            res["errors"].append(dict(kernel=name, stage="time launches", error=repr(e)))
            continue
        info = {}
        try:                                        # registers / local memory as compiled here (one overload)
            ov = next(iter(g.overloads.values()))
            info = dict(registers=int(ov.regs_per_thread), local_bytes=int(ov.local_mem_per_thread))
        except Exception:
            pass
        timed(name, "single", single, 1, info)
        pair_shape = reg_pair_shape if name == reg else v
        timed(name, "pair", two, 2, dict(pair_shape=list(pair_shape)))
        save()
    # 3. the registered single launches at T = 4, 8 (where v4 is the default), same weights
    for T2 in (4, 8):
        x2 = cuda.to_device(random_x(rng, T2, K))
        for ref in ((reg,) if VER != "v10" else ()) + BASELINES[VER] + (("gemv_q2k_v10",) if VER == "v10" else ()):
            if ref in bad:
                continue
            try:
                o = cuda.device_array((T2, N), np.uint16)
                launch = prepare_project_q(x2, w[0], None, o, weight="q2k_r", version=ref)
            except Exception as e:
                res["errors"].append(dict(kernel=ref, stage=f"time T={T2}", error=repr(e)))
                continue
            timed(ref, "single", launch, 1, T=T2)
        save()
    res["not_timed_differ_or_failed"] = sorted(bad)
    save()
    if out_dir:
        (out_dir / f"{VER}_variants.txt").write_text(table(res))
    print(table(res), flush=True)
    return res


def table(res: dict) -> str:
    """The timings at T = 1 as text, fastest single launch first, and the bit checks in one line each."""
    lines = [f"{res.get('version', 'gemv_q2k_v10')} variants, {res['device']} at {res['commit']}: K x N = {res['shape']}, T = 1, L2 flushed, "
             f"one-layer floor {res['floor_us_one_layer']} us (copy {res['copy_gbps']} GB/s)", ""]
    by, more = {}, {}
    for r in res["timings"]:
        if r["T"] == 1:
            by.setdefault(r["kernel"], {})[r["form"]] = r
        else:
            more.setdefault(r["kernel"], {})[r["T"]] = r
    order = sorted(by, key=lambda k: by[k].get("single", {}).get("us", 1e9))
    lines.append(f"{'kernel':68s} {'single us':>10s} {'pair us':>9s} {'regs':>5s}")
    for k in order:
        s, p = by[k].get("single", {}), by[k].get("pair", {})
        lines.append(f"{k:68s} {s.get('us', s.get('error', '-'))!s:>10.10s} {p.get('us', p.get('error', '-'))!s:>9.9s} "
                     f"{s.get('registers', '')!s:>5s}")
    if more:
        lines += ["", "registered kernels, single launch, T = 4 / 8 (us):"]
        for k, rows in more.items():
            lines.append(f"  {k:20s} " + "  ".join(f"T={t}: {r.get('us', r.get('error', '-'))}" for t, r in sorted(rows.items())))
    lines += ["", "bits against gemv_q2k_v4 (outputs differing single / two-layer; all must be 0):"]
    for r in res["checks"]:
        lines.append(f"  {r['kernel']:68s} {'x'.join(map(str, r['shape'])):>14s} "
                     f"{r.get('outputs_differing_from_v4', 'ERR')!s:>6s} {r.get('pair_outputs_differing_from_v4', 'ERR')!s:>6s}")
    if res["errors"]:
        lines += ["", f"errors ({len(res['errors'])}): see {VER}_variants.json"]
        lines += [f"  {e['kernel']} [{e['stage']}]: {e['error'].strip().splitlines()[-1][:150]}" for e in res["errors"]]
    lines.append(f"not timed (differ or failed): {res.get('not_timed_differ_or_failed', [])}; {res.get('seconds')} s")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="registers and spills of each variant (no GPU needed)")
    ap.add_argument("--run", action="store_true", help="check against v4 and time each variant (GPU)")
    ap.add_argument("--out", type=Path, default=None, help="folder for --run's <version>_variants.json / .txt")
    ap.add_argument("--only", type=int, default=None, help="the first N variants only")
    ap.add_argument("--version", choices=("v10", "v11", "v12"), default="v10",
                    help="the family: v10 (default), v11 or v12")
    a = ap.parse_args(argv)
    global VER
    VER = a.version
    pool = {"v10": VARIANTS, "v11": VARIANTS_V11, "v12": VARIANTS_V12}[VER]
    variants = pool[:a.only] if a.only else pool
    if not (a.compile or a.run):
        ap.error("pass --compile or --run")
    if a.compile:
        compile_report(variants)
    if a.run:
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
        run(variants, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
