"""Development run of DeepSeek's FP8 projection on Hopper (gemm_fp8_v1 .. _v8): validated, then timed.

    python tools/fp8_dev.py [--out DIR] [--tokens 1,3,...] [--versions gemm_fp8_v3,...] [--smoke]

One batch: an FP8 wkv at the released shape (K = 6144, N = 25600; e4m3 codes of normal draws,
e8m0 tile scales 2^-9..2^-6) and, for every T:
  1. act_quant on the device against `cpu.act_quant_cpu` on all of x: codes and scales bit for bit;
  2. every FP8 version against `cpu.projection_deepseek_fp8_cpu` (DeepSeek's arithmetic, k in
     order inside each block of 32) on sampled token rows: bf16 ulps (max, share of outputs that
     differ) and the relative L2 distance of the fp32 values; and both against the exact product
     of the same weights (float64, rounded once), next to the CPU twin's own distance to it. A
     version is valid when the naive gemm_fp8_v1 is bit-identical to the twin and every
     tensor-core version is within docs/numerics.md's bound (relative L2 <= 2e-3, at most 10 % of
     the outputs differing), on both kinds of x, and act_quant is bit-exact;
  3. only then the timing of the valid versions (CUDA events, L2 flushed, median): act_quant +
     GEMM (what a projection costs), the GEMM alone, act_quant alone, and in the same process the
     bf16 gemm_v4 on the same weights decoded to bf16 and cuBLAS (torch) on them, with each
     version's ratio to both (`speedup_vs_gemm_v4`, `speedup_vs_cublas_bf16`).
x is made of engram rows (FP8 table values, so act_quant is lossless) for the timing and half the
checks, and of plain normal draws (act_quant rounds) for the others. Results go to DIR/fp8_dev.json
(rewritten after every T) and a table is printed last (also written to DIR/fp8_dev.txt); the exit
status is 1 if any check failed. A version that raises (compile, launch) is recorded under "errors"
and counted invalid; the others still run.
gemm_fp8_v6 in --versions brings its specialisations (`cuda_fp8_wgmma.V6_CANDIDATES`: ring depth,
k tiles a loop iteration) along, each validated and timed beside it, and every v6 kernel's outputs
are compared bit for bit with gemm_fp8_v5's (same MMAs, same promotion: they must be identical).
gemm_fp8_v7 likewise brings `cuda_fp8_wgmma.V7_CANDIDATES` (one CTA a tile instead of the persistent
grid, two n64 partial tiles a warpgroup, a 4-stage ring; v6 then runs without its own), and every v7
kernel's outputs are compared bit for bit with gemm_fp8_v6's when v6 runs too (column "=ref"):
required of the n128 kernels (v6's MMAs and fma, the products made elsewhere), recorded only for the
n64x2 ones (another MMA shape: the tensor core's order inside a block may differ; they are held to
the twin bound like the others). gemm_fp8_v8 brings `cuda_fp8_tma.V8_CANDIDATES`, and every v8 kernel's
outputs must equal gemm_fp8_v7's bit for bit when v7 runs too (the same m64n128 MMAs and fma).
--smoke runs the wiring in numba's simulator at tiny shapes (meaningless times).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import sys

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:          # run as a script: the package beside tools/
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

K_REL, N_REL = 6144, 25600
TOKENS = (1, 3, 17, 128, 130, 256, 512, 1024, 4096)
VERSIONS = ("gemm_fp8_v1", "gemm_fp8_v2", "gemm_fp8_v3", "gemm_fp8_v4", "gemm_fp8_v5", "gemm_fp8_v6", "gemm_fp8_v7",
            "gemm_fp8_v8")
# not records: v4's schedule on v3's two warpgroups of m64n128 (256 threads, 225 registers), timed
# beside v4 to separate what the deeper stream buys from what 4 warps a scheduler buy; and v5 with its
# refill issued under the stage's first two MMAs (more instructions, less idle issue at a stage's start)
EXPERIMENTS = ("gemm_fp8_v4[n128]", "gemm_fp8_v5[refill_under_mma]")


def _v6_candidates() -> tuple:
    from engram_numba.stages.proj.cuda_fp8_wgmma import V6_CANDIDATES
    return tuple(V6_CANDIDATES)


def _v7_candidates() -> tuple:
    from engram_numba.stages.proj.cuda_fp8_wgmma import V7_CANDIDATES
    return tuple(V7_CANDIDATES)


def _v8_candidates() -> tuple:
    from engram_numba.stages.proj.cuda_fp8_tma import V8_CANDIDATES
    return tuple(V8_CANDIDATES)


SAMPLE_ROWS = 24
MAX_REL_L2, MAX_SHARE_DIFFER = 2e-3, 0.10      # docs/numerics.md's bound against the twin (tensor-core versions)


def _fp8_weight(rng, N, K):
    import ml_dtypes
    w = np.clip(rng.standard_normal((N, K), dtype=np.float32) * np.float32(64.0), -448, 448)
    codes = w.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scales = rng.integers(118, 122, (-(-N // 32), K // 32), dtype=np.uint8)
    return np.ascontiguousarray(codes), scales


def _x_rows(rng, T, K, fp8_values: bool):
    from engram_numba.bf16 import f32_to_bf16
    if fp8_values:       # engram rows as the FP8 checkpoint stores them: e4m3 x a power of two per 32
        from engram_numba.fixtures import realistic_rows
        from engram_numba.stages.rows.fp8 import assemble_rows_fp8, encode_rows_fp8
        from engram_numba.stages.rows.reference import rows_reference
        n = T * K // 256
        codes, scales = encode_rows_fp8(realistic_rows(rng, n))
        return rows_reference(assemble_rows_fp8(codes, scales), "fp8").reshape(T, K)
    return f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32))


def _distance(got, want) -> dict:
    from engram_numba.bf16 import bf16_to_f32, bf16_ulp_distance
    d = bf16_ulp_distance(got, want)
    g, w = bf16_to_f32(got).astype(np.float64), bf16_to_f32(want).astype(np.float64)
    return {"max_ulp": int(d.max()), "share_differ": float((d > 0).mean()),
            "share_over_1ulp": float((d > 1).mean()),
            "rel_l2": float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300)),
            "nan": int(np.isnan(g).sum())}


def _valid(version: str, d: dict) -> bool:
    if version == "gemm_fp8_v1":       # the twin's loops: bit-identical by construction
        return d["max_ulp"] == 0 and d["nan"] == 0
    return d["rel_l2"] <= MAX_REL_L2 and d["share_differ"] <= MAX_SHARE_DIFFER and d["nan"] == 0


_V5_RUM = []


def _v5_refill_under_mma():
    """One kernel object for every T (numba compiles once per kernel object)."""
    if not _V5_RUM:
        from engram_numba.stages.proj import cuda_fp8_wgmma as F
        _V5_RUM.append(F.make_kernel_v5(True))
    return _V5_RUM[0]


def _prepare(version, x, codes, scales, out):
    """The launch of a record (act_quant + GEMM), or of an experiment: v4's launch with its GEMM kernel swapped."""
    from engram_numba.stages.proj.launch import prepare_project_q
    if version not in EXPERIMENTS and "[" not in version:
        return prepare_project_q(x, codes, scales, out, weight="fp8", version=version)
    from engram_numba.device.launch import PreparedLaunch, allow_dynamic_shared
    from engram_numba.stages.proj import cuda_fp8_wgmma as F
    record = version.split("[")[0]
    if record == "gemm_fp8_v8":                 # the record's launcher on the specialisation
        from engram_numba.stages import registry
        from engram_numba.stages.proj import cuda_fp8_tma as V8
        return V8.launcher_v8(registry.get("proj", record), x, codes, scales, out, variant=V8.V8_CANDIDATES[version])
    base = prepare_project_q(x, codes, scales, out, weight="fp8", version=record)
    if record == "gemm_fp8_v7":                 # likewise, with its own grid (persistent or one CTA a tile)
        v = F.V7_CANDIDATES[version]
        kernel = F.kernel_v7(v)
        args = base.gemm.args
        grid, threads, smem = F.geometry_v7(x.shape[0], out.shape[1], v)
        allow_dynamic_shared(kernel, args, smem)
        gemm = PreparedLaunch(version, kernel, grid, threads, 0, args, out, sharedmem=smem)
        return F.Fp8GemmLaunch(version, base.quant, gemm, out, base.x_codes, base.x_scales, base.w_scales)
    if record == "gemm_fp8_v6":                 # a specialisation: the record's launch, its kernel swapped
        v = F.V6_CANDIDATES[version]
        kernel = F.kernel_v6(v)
        args = base.gemm.args
        allow_dynamic_shared(kernel, args, v.smem_bytes)
        gemm = PreparedLaunch(version, kernel, base.grid, v.threads, 0, args, out, sharedmem=v.smem_bytes)
        return F.Fp8GemmLaunch(version, base.quant, gemm, out, base.x_codes, base.x_scales, base.w_scales)
    if record == "gemm_fp8_v4":
        kernel, smem = F.make_kernel_v4(128), F.V4_SMEM_BYTES
    else:
        kernel, smem = _v5_refill_under_mma(), F.SMEM_BYTES
    args = base.gemm.args
    allow_dynamic_shared(kernel, args, smem)
    gemm = PreparedLaunch(version, kernel, base.grid, 256, 0, args, out, sharedmem=smem)
    return F.Fp8GemmLaunch(version, base.quant, gemm, out, base.x_codes, base.x_scales, base.w_scales)


def run(out_dir: Path, tokens, smoke: bool, versions=VERSIONS + EXPERIMENTS) -> list:
    from numba import cuda

    from engram_numba.stages.proj import cpu as C
    from engram_numba.stages.proj import reference as R
    from engram_numba.stages.proj.cuda_fp8_wgmma import prepare_act_quant, scales_by_row, stage_scales_shape
    from engram_numba.stages.proj.launch import prepare_project
    from engram_numba.bench.timing import DeviceTimer

    K, N = (K_REL, N_REL) if not smoke else (512, 136)
    rng = np.random.default_rng(2026)
    codes, scales = _fp8_weight(rng, N, K)
    w_bf16 = R.wkv_fp8_bf16(codes, scales)                          # exact
    w_exact = R.wkv_fp8_exact(codes, scales)                        # float64 [N, K]
    d_codes, d_scales, d_wbf = cuda.to_device(codes), cuda.to_device(scales), cuda.to_device(w_bf16)
    timer = DeviceTimer()
    records = []
    bf16_versions = ("gemm_v4", "cublas_v1") if not smoke else ("gemm_v1",)
    for T in tokens:
        rec = {"T": T, "K": K, "N": N, "flops": 2 * T * K * N}
        valid = {v: True for v in versions}
        aq_ok = True
        for kind in ("fp8_rows", "normal"):
            x = _x_rows(rng, T, K, kind == "fp8_rows")
            dx = cuda.to_device(x)
            # 1. act_quant, all of x
            q_want, s_want = C.act_quant_cpu(x)
            qd = cuda.device_array((T, K), np.uint8)
            sd = cuda.to_device(np.zeros(stage_scales_shape(T, K), np.float32))
            prepare_act_quant(dx, qd, sd)()
            from engram_numba.stages.rows.fp8 import E4M3_VALUES
            q_got = E4M3_VALUES[qd.copy_to_host()]
            rec[f"act_quant_{kind}_bit_exact"] = bool(np.array_equal(q_got.view(np.uint32) & 0x7FFFFFFF,
                                                                     q_want.view(np.uint32) & 0x7FFFFFFF)
                                                      and np.array_equal(np.signbit(q_got), np.signbit(q_want))
                                                      and np.array_equal(scales_by_row(sd.copy_to_host(), K), s_want))
            aq_ok = aq_ok and rec[f"act_quant_{kind}_bit_exact"]
            # 2. the GEMMs on sampled rows
            rows = np.unique(np.r_[0, T - 1, rng.integers(0, T, SAMPLE_ROWS)])[:SAMPLE_ROWS]
            twin = C.projection_deepseek_fp8_cpu(x[rows], codes, scales)
            exact = R.projection_exact_weights(x[rows], w_exact)
            rec[f"cpu_twin_vs_exact_{kind}"] = _distance(twin, exact)
            outs = {}
            for v in versions:
                try:
                    out = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
                    launch = _prepare(v, dx, d_codes, d_scales, out)
                    launch()
                    cuda.synchronize()
                    got = out.copy_to_host()[rows]
                except Exception as exc:      # one failing version must not stop the others
                    rec.setdefault("errors", {})[v] = f"{kind}: {type(exc).__name__}: {exc}"[:1500]
                    print(f"T={T} {kind}: {v} FAILED: {rec['errors'][v]}", flush=True)
                    valid[v] = False
                    continue
                outs[v] = got
                rec[f"{v}_vs_cpu_twin_{kind}"] = _distance(got, twin)
                valid[v] = valid[v] and _valid(v, rec[f"{v}_vs_cpu_twin_{kind}"])
                rec[f"{v}_vs_exact_{kind}"] = _distance(got, exact)
            # v6 is v5's arithmetic on the same MMAs: its outputs must be v5's, bit for bit
            for v in versions:
                if v.startswith("gemm_fp8_v6") and v in outs and "gemm_fp8_v5" in outs:
                    same = bool(np.array_equal(outs[v], outs["gemm_fp8_v5"]))
                    rec[f"{v}_bit_identical_to_v5_{kind}"] = same
                    valid[v] = valid[v] and same
            # v7 is v6's arithmetic (n128: the same MMAs and fma; n64x2: recorded, not required)
            for v in versions:
                if v.startswith("gemm_fp8_v7") and v in outs and "gemm_fp8_v6" in outs:
                    same = bool(np.array_equal(outs[v], outs["gemm_fp8_v6"]))
                    rec[f"{v}_bit_identical_to_v6_{kind}"] = same
                    if "n64x2" not in v:
                        valid[v] = valid[v] and same
            # v8 is v7's arithmetic on the same n128 MMAs and fma: its outputs must be v7's, bit for bit
            for v in versions:
                if v.startswith("gemm_fp8_v8") and v in outs and "gemm_fp8_v7" in outs:
                    same = bool(np.array_equal(outs[v], outs["gemm_fp8_v7"]))
                    rec[f"{v}_bit_identical_to_v7_{kind}"] = same
                    valid[v] = valid[v] and same
            print(f"T={T} {kind}: " + json.dumps({k: v for k, v in rec.items() if kind in k}), flush=True)
        rec["act_quant_bit_exact"] = aq_ok
        rec["valid"] = {v: bool(ok and aq_ok) for v, ok in valid.items()}
        # 3. timing of the valid versions (x: FP8 rows; the last x drawn above is "normal": draw the rows again)
        x = cuda.to_device(_x_rows(rng, T, K, True))
        times = {}
        launch = None
        for v in versions:
            if not rec["valid"][v]:
                continue
            try:
                out = cuda.device_array((T, N), np.uint16)
                launch = _prepare(v, x, d_codes, d_scales, out)
                iters = 3 if v == "gemm_fp8_v1" and T >= 512 else 50     # the naive kernel: seconds a call at T = 4096
                times[v] = timer(launch, iters=iters)
                times[v + ".gemm"] = timer(launch.gemm, iters=iters)
            except Exception as exc:
                rec.setdefault("errors", {})[v] = f"timing: {type(exc).__name__}: {exc}"[:1500]
                print(f"T={T}: {v} timing FAILED: {rec['errors'][v]}", flush=True)
                times.pop(v, None)
        if launch is not None:
            times["act_quant"] = timer(launch.quant)
        for v in bf16_versions:
            try:
                out = cuda.device_array((T, N), np.uint16)
                times[v] = timer(prepare_project(x, d_wbf, out, version=v))
            except Exception as exc:
                rec.setdefault("errors", {})[v] = f"timing: {type(exc).__name__}: {exc}"[:1500]
        rec["time_us"] = {k: round(t, 2) for k, t in times.items()}
        rec["tflops"] = {k: round(rec["flops"] / t / 1e6, 1) for k, t in times.items() if k != "act_quant"}
        timed = [v for v in versions if v in times]
        if "gemm_v4" in times:
            rec["speedup_vs_gemm_v4"] = {v: round(times["gemm_v4"] / times[v], 3) for v in timed}
        if "cublas_v1" in times:
            rec["speedup_vs_cublas_bf16"] = {v: round(times["cublas_v1"] / times[v], 3) for v in timed}
        records.append(rec)
        (out_dir / "fp8_dev.json").write_text(json.dumps(records, indent=1))
        print(f"T={T} times " + json.dumps(rec["time_us"]), flush=True)
    return records


def table(records, versions=VERSIONS + EXPERIMENTS) -> str:
    """One line a (T, version): us of act_quant + GEMM and of the GEMM alone ('-' when invalid, so not
    timed), TF/s and ratio to gemm_v4 and to cuBLAS bf16 (act_quant + GEMM against them), the
    distance to the twin on normal x (max ulp, share differing, rel L2), whether the outputs equal
    gemm_fp8_v5's (v6 kernels) or gemm_fp8_v6's (v7 kernels) bit for bit, and valid; then the bf16
    baselines and act_quant."""
    lines = [f"{'T':>5s} {'version':34s} {'us':>9s} {'gemm us':>9s} {'TF/s':>7s} {'x v4':>6s} {'x cuBLAS':>8s}  "
             f"{'vs twin (max ulp, share, rel L2)':34s} {'=ref':>4s} valid"]
    for r in records:
        t = r["time_us"]
        for v in versions:
            c = r.get(f"{v}_vs_cpu_twin_normal", {})
            same = [r[k] for k in (f"{v}_bit_identical_to_v5_fp8_rows", f"{v}_bit_identical_to_v5_normal",
                                   f"{v}_bit_identical_to_v6_fp8_rows", f"{v}_bit_identical_to_v6_normal",
                                   f"{v}_bit_identical_to_v7_fp8_rows", f"{v}_bit_identical_to_v7_normal") if k in r]
            tw = f"{c.get('max_ulp')} {c.get('share_differ', 0):.2e} {c.get('rel_l2', 0):.1e}" if c else "-"
            us = f"{t[v]:9.1f}" if v in t else f"{'-':>9s}"
            gus = f"{t[v + '.gemm']:9.1f}" if v + ".gemm" in t else f"{'-':>9s}"
            tf = f"{r['tflops'][v]:7.1f}" if v in r.get("tflops", {}) else f"{'-':>7s}"
            x4 = r.get("speedup_vs_gemm_v4", {}).get(v)
            xc = r.get("speedup_vs_cublas_bf16", {}).get(v)
            lines.append(f"{r['T']:5d} {v:34s} {us} {gus} {tf} {x4 if x4 is not None else '-':>6} "
                         f"{xc if xc is not None else '-':>8}  {tw:34s} {('yes' if all(same) else 'NO') if same else '-':>4s} "
                         f"{r['valid'].get(v)}" + (f"  ERROR {r['errors'][v][:120]}" if v in r.get("errors", {}) else ""))
        lines.append(f"{r['T']:5d} {'(bf16 gemm_v4 / cuBLAS / act_quant)':34s} "
                     + " / ".join(f"{t.get(k, float('nan')):.1f}" for k in ("gemm_v4", "cublas_v1", "act_quant")) + " us")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for fp8_dev.json")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default %s)" % (TOKENS,))
    ap.add_argument("--versions", default=",".join(VERSIONS + EXPERIMENTS),
                    help="comma-separated FP8 versions (default all, with the experiments %s)" % (EXPERIMENTS,))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the simulator)")
    ap.add_argument("--no-candidates", action="store_true", help="gemm_fp8_v6, _v7 and _v8 without their specialisations")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = tuple(int(t) for t in a.tokens.split(",")) if a.tokens else ((3, 17) if a.smoke else TOKENS)
    t0 = time.time()
    versions = tuple(v for v in a.versions.split(",") if v)
    # v6's specialisations were timed at 2a6d9a6 (the one-loader-warp ones cannot launch): beside v7,
    # which brings its own, only v6 itself runs (the reference v7's outputs are compared with)
    if "gemm_fp8_v6" in versions and "gemm_fp8_v7" not in versions and not a.no_candidates:
        versions += tuple(c for c in _v6_candidates() if c not in versions)
    if "gemm_fp8_v7" in versions and not a.no_candidates:
        versions += tuple(c for c in _v7_candidates() if c not in versions)
    if "gemm_fp8_v8" in versions and not a.no_candidates:
        versions += tuple(c for c in _v8_candidates() if c not in versions)
    known = VERSIONS + EXPERIMENTS + _v6_candidates() + _v7_candidates() + _v8_candidates()
    unknown = [v for v in versions if v not in known]
    if unknown:
        print(f"error: unknown FP8 version(s) {unknown}; known: {list(known)}")
        return 2
    records = run(out, tokens, a.smoke, versions)
    text = table(records, versions)
    print(text)
    (out / "fp8_dev.txt").write_text(text + "\n")
    print(f"done in {time.time() - t0:.0f} s")
    return 0 if all(all(r["valid"].values()) for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
