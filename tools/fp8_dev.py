"""Development run of DeepSeek's FP8 projection on Hopper (gemm_fp8_v2 / _v3): validated, then timed.

    python tools/fp8_dev.py [--out DIR] [--tokens 1,3,...] [--smoke]

One batch: an FP8 wkv at the released shape (K = 6144, N = 25600; e4m3 codes of normal draws,
e8m0 tile scales 2^-9..2^-6) and, for every T:
  1. act_quant on the device against `cpu.act_quant_cpu` on all of x: codes and scales bit for bit;
  2. every FP8 version against `cpu.projection_deepseek_fp8_cpu` (DeepSeek's arithmetic, k in
     order inside each block of 32) on sampled token rows: bf16 ulps (max, share of outputs that
     differ) and the relative L2 distance of the fp32 values; and both against the exact product
     of the same weights (float64, rounded once), next to the CPU twin's own distance to it;
  3. only then the timing (CUDA events, L2 flushed, median): act_quant + GEMM (what a projection
     costs), the GEMM alone, act_quant alone, and in the same process the bf16 gemm_v4 on the
     same weights decoded to bf16 and cuBLAS (torch) on them.
x is made of engram rows (FP8 table values, so act_quant is lossless) for the timing and half the
checks, and of plain normal draws (act_quant rounds) for the others. Results go to DIR/fp8_dev.json
(rewritten after every T) and a table is printed last. --smoke runs the wiring in numba's
simulator at tiny shapes (meaningless times).
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
VERSIONS = ("gemm_fp8_v2", "gemm_fp8_v3")
SAMPLE_ROWS = 24


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


def run(out_dir: Path, tokens, smoke: bool) -> list:
    from numba import cuda

    from engram_numba.bf16 import bf16_to_f32
    from engram_numba.stages.proj import cpu as C
    from engram_numba.stages.proj import reference as R
    from engram_numba.stages.proj.cuda_fp8_wgmma import prepare_act_quant, scales_by_row, stage_scales_shape
    from engram_numba.stages.proj.launch import prepare_project, prepare_project_q
    from .timing import DeviceTimer

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
            # 2. the GEMMs on sampled rows
            rows = np.unique(np.r_[0, T - 1, rng.integers(0, T, SAMPLE_ROWS)])[:SAMPLE_ROWS]
            twin = C.projection_deepseek_fp8_cpu(x[rows], codes, scales)
            exact = R.projection_exact_weights(x[rows], w_exact)
            rec[f"cpu_twin_vs_exact_{kind}"] = _distance(twin, exact)
            for v in VERSIONS:
                out = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
                launch = prepare_project_q(dx, d_codes, d_scales, out, weight="fp8", version=v)
                launch()
                cuda.synchronize()
                got = out.copy_to_host()[rows]
                rec[f"{v}_vs_cpu_twin_{kind}"] = _distance(got, twin)
                rec[f"{v}_vs_exact_{kind}"] = _distance(got, exact)
            print(f"T={T} {kind}: " + json.dumps({k: v for k, v in rec.items() if kind in k}), flush=True)
        # 3. timing (x: FP8 rows, the last x drawn above is "normal": draw the rows again)
        x = cuda.to_device(_x_rows(rng, T, K, True))
        times = {}
        for v in VERSIONS:
            out = cuda.device_array((T, N), np.uint16)
            launch = prepare_project_q(x, d_codes, d_scales, out, weight="fp8", version=v)
            times[v] = timer(launch)
            times[v + ".gemm"] = timer(launch.gemm)
        times["act_quant"] = timer(launch.quant)
        for v in bf16_versions:
            out = cuda.device_array((T, N), np.uint16)
            times[v] = timer(prepare_project(x, d_wbf, out, version=v))
        rec["time_us"] = {k: round(t, 2) for k, t in times.items()}
        rec["tflops"] = {k: round(rec["flops"] / t / 1e6, 1) for k, t in times.items() if k != "act_quant"}
        if "gemm_v4" in times:
            rec["speedup_vs_gemm_v4"] = {v: round(times["gemm_v4"] / times[v], 3) for v in VERSIONS}
        if "cublas_v1" in times:
            rec["speedup_vs_cublas_bf16"] = {v: round(times["cublas_v1"] / times[v], 3) for v in VERSIONS}
        records.append(rec)
        (out_dir / "fp8_dev.json").write_text(json.dumps(records, indent=1))
        print(f"T={T} times " + json.dumps(rec["time_us"]), flush=True)
    return records


def table(records) -> str:
    lines = [f"{'T':>5s} {'v1 us':>8s} {'v2 us':>8s} {'v2 gemm':>8s} {'aq us':>7s} {'gemm_v4':>8s} {'cuBLAS':>8s} "
             f"{'v2 TF/s':>8s} {'x v4':>6s}  v2 vs twin (max ulp, share) / vs exact"]
    for r in records:
        t = r["time_us"]
        c = r.get("gemm_fp8_v3_vs_cpu_twin_normal", {})
        e = r.get("gemm_fp8_v3_vs_exact_normal", {})
        lines.append(f"{r['T']:5d} {t['gemm_fp8_v2']:8.1f} {t['gemm_fp8_v3']:8.1f} {t['gemm_fp8_v3.gemm']:8.1f} "
                     f"{t['act_quant']:7.1f} {t.get('gemm_v4', float('nan')):8.1f} {t.get('cublas_v1', float('nan')):8.1f} "
                     f"{r['tflops']['gemm_fp8_v3']:8.1f} {r.get('speedup_vs_gemm_v4', {}).get('gemm_fp8_v3', float('nan')):6.2f}"
                     f"  {c.get('max_ulp')} {c.get('share_differ', 0):.2e} / {e.get('max_ulp')} {e.get('share_differ', 0):.2e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for fp8_dev.json")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default %s)" % (TOKENS,))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the simulator)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = tuple(int(t) for t in a.tokens.split(",")) if a.tokens else ((3, 17) if a.smoke else TOKENS)
    t0 = time.time()
    records = run(out, tokens, a.smoke)
    print(table(records))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
