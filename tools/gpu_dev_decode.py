"""One call on the GPU machine for the decode work: its gpu tests, the register report of
its kernels, and the decode benchmark; a compact table last, JSON in $OUT.

    # with the carried wheels installed as docs/gpu.md says (PYTHONPATH = .site:repo root):
    ENGRAM_COMMIT=<hash> OUT=<folder> python3 tools/gpu_dev_decode.py [--build-table-gib 30] [--no-tests]
                                                                     [--no-bench] [--tokens N] [--ncu]

Writes $OUT/gpu_tests_decode.json (pytest outcomes + recorded figures), $OUT/gpu_tests_decode.log,
$OUT/compile_decode.json, $OUT/decode_bench.json and $OUT/decode_bench.log (with --ncu also
$OUT/ncu_gemv.txt: Nsight Compute on one launch of each GEMV, clocks not locked). About 4-5 minutes
on an H200 (engine_build at the released 30 GiB a layer uploads 61 GiB; torch.compile's first call
is part of it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"q2k_gemv_t1_us": 24.0, "decode_step_us": 60.0, "decode_speedup_vs_torch": 5.0,
           "engine_build_gbps": 10.0}


def sh(cmd, log_path, timeout, env=None):
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env=env or os.environ.copy())
    return proc.returncode, time.time() - t0


def run_tests(out: Path) -> dict:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", ENGRAM_GPU_RESULTS=str(out / "gpu_tests_decode.json"))
    rc, secs = sh([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--maxfail=10",
                   "engram_numba/stages/proj/tests/test_proj_quant.py",
                   "engram_numba/stages/proj/tests/test_q2k_r.py", "tests/test_engine_decode.py",
                   "tests/test_engine.py"],
                  out / "gpu_tests_decode.log", timeout=420, env=env)
    summary = {"rc": rc, "seconds": round(secs, 1)}
    try:
        res = json.loads((out / "gpu_tests_decode.json").read_text())
        summary.update({k: res[k] for k in ("passed", "failed", "skipped")})
        summary["records"] = res["records"]
    except Exception as exc:
        summary["error"] = f"no results file: {exc}"
    return summary


def run_compile_report(out: Path) -> list:
    code = ("import json; from engram_numba.stages import compile_check as cc; from engram_numba.stages import catalog;"
            "ts=[t for t in catalog.compile_targets('proj') if 'q2k' in t.name or 'fp8' in t.name];"
            "print(json.dumps([r.__dict__ for r in cc.compile_all(ts)]))")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    try:
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:
        rows = [{"error": (proc.stdout + proc.stderr)[-2000:]}]
    (out / "compile_decode.json").write_text(json.dumps(rows, indent=1))
    return rows


def run_ncu(out: Path) -> int:
    """Nsight Compute on tools/gpu_ncu_q2k.py: DRAM throughput, warp stalls, registers, occupancy."""
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", "regex:gemv", "--launch-skip", "10",
           "--launch-count", "5", "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis",
           "--section", "Occupancy", "--section", "WarpStateStats", "--section", "LaunchStats",
           sys.executable, "tools/gpu_ncu_q2k.py"]
    rc, _ = sh(cmd, out / "ncu_gemv.txt", timeout=300, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    return rc


def run_bench(out: Path, build_gib: float, tokens: int | None) -> dict:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")
    sys.path.insert(0, str(REPO))
    from engram_numba.bench import decode
    from engram_numba.bench.timing import RELEASED, commit, device_name
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
    t0 = time.time()
    res = decode.run(RELEASED, quick=True, log=log, build_table_gib=build_gib, n_tokens=tokens)
    res.update({"commit": commit(), "device": device_name(), "seconds": round(time.time() - t0, 1)})
    (out / "decode_bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "decode_bench.log").write_text("\n".join(lines))
    return res


def table(tests: dict | None, compiled: list | None, bench: dict | None) -> str:
    rows = []
    if tests is not None:
        rows.append(f"gpu tests: passed {tests.get('passed')} failed {tests.get('failed')} skipped {tests.get('skipped')} "
                    f"({tests.get('seconds')} s, rc {tests.get('rc')}) {tests.get('error', '')}")
        for r in tests.get("records", []):
            if r.get("test") == "projection-quant":
                extra = (f" vs bf16 weights: max {r.get('max_ulp_vs_bf16_weights')} ulp, "
                         f"{100 * r.get('frac_differs_from_bf16_weights', 0):.2f}% differ"
                         if "max_ulp_vs_bf16_weights" in r else "")
                rows.append(f"  {r['version']:12s} T={r['shape'][0]} {r['time_us']:9.1f} us {r['gbps']:7.1f} GB/s "
                            f"well-cond max {r['max_ulp_well_conditioned']} ulp, noise-dom {r['n_noise_dominated']} "
                            f"passed={r['passed']}{extra}")
            elif not str(r.get("test", "")).startswith("projection"):
                rows.append("  " + json.dumps({k: v for k, v in r.items() if k not in ("module",)})[:200])
    if compiled:
        rows.append("registers (sm_90): " + ", ".join(f"{c.get('name')} {c.get('registers')}r "
                                                      f"spill {c.get('spill_stores')}/{c.get('spill_loads')}"
                                                      for c in compiled if "name" in c))
    if bench is not None:
        rows.append("")
        rows.append("| record | T | kernel / variant | time (us) | % copy floor | GB/s | valid | baselines (us) |")
        rows.append("|---|---:|---|---:|---:|---:|---|---|")
        for r in bench["records"]:
            base = ", ".join(f"{k} {v:.1f}" for k, v in r.get("baselines", {}).items()) or "-"
            rows.append(f"| {r['stage']} | {r['T']} | {r.get('variant', r.get('kernel'))} | {r['time_us']:.1f} | "
                        f"{r['pct_of_floor']:.1f} | {r['gbps']} | {r.get('validated', '-')} | {base} |")
        dec = bench.get("decode", {}).get("decode_step", {})
        for k, v in dec.get("results", {}).items():
            rows.append(f"decode_step {k:16s}: {v['wall_us_per_token']:8.1f} us/token wall, "
                        f"{v['device_us_per_token']:8.1f} us/token device")
        rows.append("decode checks: " + json.dumps({k: v for k, v in dec.items() if k not in ("results",)}))
        # targets
        q1 = next((r for r in bench["records"] if r["stage"] == "proj_q2k" and r["T"] == 1 and "variant" not in r), None)
        ds = next((r for r in bench["records"] if r["stage"] == "decode_step"), None)
        eb = next((r for r in bench["records"] if r["stage"] == "engine_build"), None)
        got = {"q2k_gemv_t1_us": q1 and q1["time_us"], "decode_step_us": ds and ds["time_us"],
               "decode_speedup_vs_torch": ds and ds.get("speedup_vs_torch_best"),
               "engine_build_gbps": eb and eb["gbps"]}
        for k, want in TARGETS.items():
            v = got[k]
            at_most = k.endswith("_us")
            ok = v is not None and (v <= want if at_most else v >= want)
            rows.append(f"target {k}: {v} ({'<=' if at_most else '>='} {want}) -> "
                        f"{'MET' if ok else 'MISSED'}")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-table-gib", type=float, default=30.0, help="engine_build table size per layer (GiB)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--ncu", action="store_true", help="also profile each GEMV once with Nsight Compute")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", REPO / "gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    tests = None if args.no_tests else run_tests(out)
    compiled = run_compile_report(out)
    if args.ncu:
        print("ncu exit status:", run_ncu(out), flush=True)
    bench = None
    if not args.no_bench:
        try:
            bench = run_bench(out, args.build_table_gib, args.tokens)
        except Exception:
            import traceback
            traceback.print_exc()
            (out / "decode_bench_error.txt").write_text(traceback.format_exc())
    text = table(tests, compiled, bench)
    (out / "decode_summary.txt").write_text(text)
    print("\n" + text)
    return 0 if (tests is None or tests.get("rc") == 0) and (args.no_bench or bench is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
