"""Benchmarks on the GPU: every stage against its floor and the PyTorch/cuBLAS baseline.

    engram-numba bench [--out bench/results/h200.json] [--quick]
    engram-numba bench --hash-only          (the hasher alone, on the CPU: no GPU needed)
    engram-numba bench --smoke              (tiny shapes, runs in numba's simulator: checks the
                                             suite itself, its figures mean nothing)

Records (named after the stages; `results_io.load_results` reads files written with the earlier
names too), at the released shapes
(dim 5120, hc 4, 24 hash columns, head_dim 256) and T in {1, 16, 128, 4096}:
    rows_q2k        rows by id from a >= 2 GB device-resident Q2_K table, decoded to bf16 rows
    proj_bf16       kv = bf16(x @ wkv^T) on a bf16 weight: GEMV at T=1, GEMM above
    proj_fp8_deepseek  (variants) DeepSeek's FP8 arithmetic (act_quant + gemm_fp8_*) on an FP8 wkv at
                    T = 128, 1024, 4096, checked against the CPU twin, with `vs_gemm_v4` / `vs_cublas_bf16`:
                    gemm_v4 and cuBLAS bf16 on the same weights, timed in the same run
    gate            the gate and the in-place FP32 highway update
    proj+gate       the projection and the gate on its output, as `EngramV41.apply` runs them
    proj_q2k, proj_fp8, decode_step, engine_build   the decode path (bench/decode.py)
    corpus_stats    `corpus_stats` end to end in 4096-token chunks, tokens/s against the stages'
                    device-time sum (bench/corpus.py: device and host highways, peak memory; tables in
                    pinned host memory with prefetch and a hot-row cache against device tables, and
                    decode_step records of both placements)
and the version sweep ("variants"): every kernel record of the registry at the token counts it
competes at (`KernelRecord.sweep`), each checked against the numpy reference before it is timed.
Method in `timing.py`; baselines (measured in the same run when torch imports) in
`baselines.py`; checks in `validate.py`.

Host side: hasher tokens/s at the released configuration, the row reader's rows/s from a GGUF on
disk, and Python microseconds per `EngramV41.apply` call at T=1 (launched and graph-replayed).
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import decode as bench_decode
from .baselines import torch_gate, torch_or_none, torch_q2k_decode, torch_view
from .report import markdown_table, plot_results, update_readme  # noqa: F401  (re-exported for scripts)
from .results_io import load_results
from .timing import (FP8_TFLOPS, RELEASED, SMOKE, TIMING_METHOD, BenchShape, DeviceTimer, commit, device_name,
                     make_record, measure_copy_gbps)
from .validate import gate_agrees, projection_agrees, projection_reference_rows
from .corpus import run as corpus_bench


def _random_table(encoding: str, n_rows: int, rng, cuda):
    """A device table of n_rows random rows of `encoding` (finite scales), filled in chunks."""
    from ..stages.rows.encodings import get_encoding, random_raw_rows
    enc = get_encoding(encoding)
    table = cuda.device_array((n_rows, enc.row_bytes), dtype=np.uint8)
    chunk = 1 << 22
    for r0 in range(0, n_rows, chunk):
        blk = random_raw_rows(encoding, min(chunk, n_rows - r0), rng)
        table[r0:r0 + blk.shape[0]].copy_to_device(blk)
    return table


def _sample_rows_ok(table, ids_dev, rows_dev, encoding: str, rng, k: int = 512) -> bool:
    """Bit-exact check of k sampled gathered rows against the numpy reference."""
    from ..stages.rows.reference import rows_reference
    n = rows_dev.shape[0]
    sample = np.sort(rng.choice(n, min(n, k), replace=False))
    ids = ids_dev.copy_to_host()[sample]
    raw = np.stack([table[int(i)].copy_to_host() for i in ids])
    return bool(np.array_equal(rows_dev.copy_to_host()[sample], rows_reference(raw, encoding)))


# Projection versions not (yet) the default that bench_device times beside the default kernel at every
# projection token count on a Hopper GPU (in the proj_bf16 record's "challengers"), each validated first
PROJ_CHALLENGERS = ("gemm_v7",)
CHALLENGER_MIN_TOKENS = 16


def bench_device(shape: BenchShape = RELEASED, quick: bool = False, log=print) -> dict:
    """The stage records (rows_q2k, proj_bf16, gate, proj+gate) with the default kernels."""
    from numba import cuda

    from ..bf16 import f32_to_bf16
    from ..stages import registry
    from ..stages.gate.launch import prepare_gate
    from ..stages.gate.reference import gate_reference
    from ..stages.proj.launch import device_cc, prepare_project
    from ..stages.rows.launch import prepare_gather

    torch = torch_or_none()
    timer = DeviceTimer()
    device = device_name()
    hopper = tuple(device_cc() or ()) == (9, 0)
    copy_gbps = measure_copy_gbps(timer)
    log(f"device: {device}; copy bandwidth {copy_gbps:.0f} GB/s; shapes: {shape.name}")
    rng = np.random.default_rng(0)
    iters = 10 if quick else 50
    records = []
    HC, DIM, COLS, K, N = shape.hc, shape.dim, shape.cols, shape.K, shape.N

    n_rows = max(int(shape.table_gb * 1e9) // 84, 64)
    table = _random_table("q2k", n_rows, rng, cuda)
    wkv_h = f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32) * 0.02)
    wkv = cuda.to_device(wkv_h)
    w_gate_h = (1 + 0.1 * rng.standard_normal((HC, DIM))).astype(np.float32)
    w_gate = cuda.to_device(w_gate_h)
    tw = torch_view(wkv, torch).view(torch.bfloat16) if torch else None
    compiled_gate = None
    if torch is not None:
        try:
            compiled_gate = torch.compile(lambda h, kv, w: torch_gate(torch, h, kv, w, HC, DIM))
        except Exception as exc:  # torch.compile is optional
            log(f"torch.compile unavailable: {exc}")

    def project_at(T):
        """The proj_bf16 record at T (the default kernel, cuBLAS and the challengers of the same run)."""
        # a prepared launch: the events time the kernel; Python cost is in "host"
        x_h = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05)
        x = cuda.to_device(x_h)
        kv = cuda.device_array((T, N), dtype=np.uint16)
        proj = prepare_project(x, wkv, kv)
        proj()
        sample = np.sort(rng.choice(T, min(T, 32), replace=False))
        ref_rows = projection_reference_rows(x_h, wkv_h, sample)
        ok, agree = projection_agrees(kv.copy_to_host()[sample], ref_rows)
        base = {}
        p_iters = iters if T < 4096 else max(5, iters // 10)
        if torch is not None:
            tx = torch_view(x, torch).view(torch.bfloat16)
            base["torch_cublas_matmul"] = timer(lambda: tx @ tw.T, iters=max(5, iters if T < 4096 else 10))
        t_us = timer(proj, iters=p_iters)
        nbytes, flops = registry.get("proj", proj.name).launch_cost(T, K, N)
        extra = {}
        if "torch_cublas_matmul" in base:
            extra["vs_cublas"] = round(t_us / base["torch_cublas_matmul"], 3)
        # the versions that compete for the default (validated first, timed in the same run)
        challengers = {}
        for name in (PROJ_CHALLENGERS if hopper and T >= CHALLENGER_MIN_TOKENS else ()):
            if name == proj.name:
                continue
            got = cuda.device_array((T, N), dtype=np.uint16)
            try:
                ch = prepare_project(x, wkv, got, version=name)
                ch()
            except Exception as exc:
                challengers[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                continue
            ch_ok, ch_agree = projection_agrees(got.copy_to_host()[sample], ref_rows)
            ch_us = timer(ch, iters=p_iters) if ch_ok else None
            challengers[name] = {"time_us": None if ch_us is None else round(ch_us, 3), "validated": ch_ok, **ch_agree}
            if ch_ok and "torch_cublas_matmul" in base:
                challengers[name]["vs_cublas"] = round(ch_us / base["torch_cublas_matmul"], 3)
        if challengers:
            extra["challengers"] = challengers
        records.append(make_record("proj_bf16", T, t_us, nbytes, flops, copy_gbps, base,
                                   validated=ok, kernel=proj.name, vs_reference=agree, **extra))
        log(f"proj_bf16      T={T:5d}: {t_us:9.1f} us  {flops / t_us / 1e6:.1f} TFLOP/s  {proj.name} "
            f"valid={ok} {agree}  {base}" + (f"  vs cuBLAS {extra['vs_cublas']}" if "vs_cublas" in extra else "")
            + "".join(f"  {n}: {c.get('time_us')} us ({c.get('vs_cublas', '-')}x cuBLAS, valid={c.get('validated')})"
                      for n, c in challengers.items()))
        return proj, kv, flops, sample

    for T in shape.tokens:
        n = T * COLS
        # -- gather + decode: fresh random ids every run, rotating through a pool
        pool = [cuda.to_device(rng.integers(0, n_rows, n, dtype=np.int64)) for _ in range(8)]
        rows = cuda.device_array((n, 256), dtype=np.uint16)
        launches = [prepare_gather(table, p, rows) for p in pool]
        launches[0]()
        ok = _sample_rows_ok(table, pool[0], rows, "q2k", rng)
        it = iter(range(10**9))
        t_us = timer(lambda: launches[next(it) % len(launches)](), iters=iters)
        base = {}
        if torch is not None:
            tt = torch_view(table, torch)
            tpool = [torch_view(p, torch) for p in pool]
            it2 = iter(range(10**9))
            base["torch_index_select_decode"] = timer(lambda: torch_q2k_decode(torch, tt, tpool[next(it2) % len(tpool)]),
                                                       iters=max(5, iters // 5))
        nbytes, flops = registry.get("rows", launches[0].name).launch_cost(n)
        records.append(make_record("rows_q2k", T, t_us, nbytes, flops, copy_gbps, base,
                                   validated=bool(ok), kernel=launches[0].name, encoding="q2k"))
        log(f"rows_q2k       T={T:5d}: {t_us:9.1f} us  {launches[0].name} valid={ok}  {base}")

        proj, kv, flops, sample = project_at(T)  # sample: the token rows checked, reused by the gate
        p_iters = iters if T < 4096 else max(5, iters // 10)

        # -- gate
        h0 = rng.standard_normal((T, HC, DIM)).astype(np.float32)
        kvg_h = f32_to_bf16(rng.standard_normal((T, N)).astype(np.float32))
        h, kvg = cuda.to_device(h0), cuda.to_device(kvg_h)
        dot = cuda.device_array((T, HC), dtype=np.float32)
        gate = cuda.device_array((T, HC), dtype=np.float32)
        gate_launch = prepare_gate(h, kvg, w_gate, dot_out=dot, gate_out=gate)
        gate_launch()
        ref = gate_reference(h0[sample], kvg_h[sample], w_gate_h, np.ones_like(w_gate_h))
        ok = gate_agrees(h0[sample], h.copy_to_host()[sample], dot.copy_to_host()[sample],
                         gate.copy_to_host()[sample], kvg_h[sample], ref.dot)
        base = {}
        if torch is not None:
            th = torch_view(h, torch)
            tkvg = torch_view(kvg, torch).view(torch.bfloat16)
            tw_gate = torch_view(w_gate, torch)
            base["torch_eager"] = timer(lambda: torch_gate(torch, th, tkvg, tw_gate, HC, DIM), iters=iters)
            if compiled_gate is not None:
                try:
                    base["torch_compile"] = timer(lambda: compiled_gate(th, tkvg, tw_gate), iters=iters, warmup=5)
                except Exception as exc:
                    log(f"torch.compile gate failed: {exc}")
        t_us = timer(gate_launch, iters=iters)
        gbytes, gflops = registry.get("gate", gate_launch.name).launch_cost(T, HC, DIM)
        records.append(make_record("gate", T, t_us, gbytes, gflops, copy_gbps, base, validated=ok,
                                   kernel=gate_launch.name))
        log(f"gate           T={T:5d}: {t_us:9.1f} us  {gate_launch.name} valid={ok}  {base}")

        # -- proj+gate = projection + gate on its output, as EngramV41.apply runs them
        gate_on_kv = prepare_gate(h, kv, w_gate, dot_out=dot, gate_out=gate)

        def apply():
            proj()
            gate_on_kv()
        t_us = timer(apply, iters=p_iters)
        pb, gb = records[-2]["baselines"], records[-1]["baselines"]
        base = {f"torch_matmul+{k}": pb["torch_cublas_matmul"] + v for k, v in gb.items() if "torch_cublas_matmul" in pb}
        records.append(make_record("proj+gate", T, t_us, records[-2]["bytes"] + gbytes, flops + gflops, copy_gbps, base,
                                   kernel=f"{proj.name}+{gate_on_kv.name}"))
        log(f"proj+gate      T={T:5d}: {t_us:9.1f} us  {base}")
    for T in shape.proj_tokens:
        if T not in shape.tokens:
            project_at(T)
    return {"copy_gbps": round(copy_gbps, 1), "records": records, "device": device, "shape": shape.name}


def bench_variants(shape: BenchShape = RELEASED, quick: bool = False, log=print, stages=("rows", "proj", "gate")) -> list[dict]:
    """Every kernel record of the registry at the token counts it competes at (`sweep`), each
    checked against the numpy reference before it is timed (llm.c style: the naive version is the
    baseline, the table says what each step bought)."""
    from numba import cuda

    from ..bf16 import f32_to_bf16
    from ..stages import catalog
    from ..stages.gate.launch import prepare_gate
    from ..stages.gate.reference import gate_reference
    from ..stages.proj.launch import prepare_project
    from ..stages.rows.encodings import get_encoding
    from ..stages.rows.launch import prepare_gather

    timer = DeviceTimer()
    copy_gbps = measure_copy_gbps(timer)
    rng = np.random.default_rng(2)
    iters = 5 if quick else 20
    out = []
    HC, DIM, COLS, K, N = shape.hc, shape.dim, shape.cols, shape.K, shape.N
    smoke = shape.name != RELEASED.name

    def tokens(rec):
        if smoke:   # the suite's own wiring, not the kernels: the naive versions at the smallest shape
            return list(shape.tokens[:1]) if rec.name.endswith("_v1") else []
        return [t for t in rec.sweep if t in (shape.proj_tokens if rec.stage == "proj" else shape.tokens)]

    def add(stage, T, variant, us, nbytes, flops, valid, **extra):
        rec = make_record(stage, T, us, nbytes, flops, copy_gbps, {}, variant=variant, validated=valid, **extra)
        out.append(rec)
        log(f"  {stage:15s} T={T:5d} {variant:22s} {us:10.1f} us  {rec['pct_of_floor']:5.1f}% of floor"
            + (f"  {rec['tflops']} TFLOP/s" if flops else f"  {rec['gbps']} GB/s") + f"  valid={valid}")

    if "rows" in stages:
        tables = {}
        for rec in catalog.records("rows"):
            if rec.encoding not in tables:
                # 1 GiB of rows whatever the encoding (Q2_K: 12.8M rows, FP8: 4.1M)
                rows_of = max((1 << 30) // get_encoding(rec.encoding).row_bytes, 64) if not smoke else 64
                tables[rec.encoding] = _random_table(rec.encoding, rows_of, rng, cuda)
            table = tables[rec.encoding]
            n_rows = table.shape[0]
            for T in tokens(rec):
                n = T * COLS
                ids = cuda.to_device(rng.integers(0, n_rows, n, dtype=np.int64))
                got = cuda.device_array((n, 256), dtype=np.uint16)
                try:
                    launch = prepare_gather(table, ids, got, encoding=rec.encoding, version=rec.name)
                except Exception as exc:
                    log(f"  rows {rec.name}: cannot launch ({exc})")
                    continue
                launch()
                valid = _sample_rows_ok(table, ids, got, rec.encoding, rng)
                us = timer(launch, iters=iters)
                add(f"rows_{rec.encoding}", T, rec.name, us, *rec.launch_cost(n), valid, encoding=rec.encoding)

    if "proj" in stages:
        wkv_h = f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32) * 0.02)
        wkv = cuda.to_device(wkv_h)
        for T in sorted({t for rec in catalog.records("proj") for t in tokens(rec)}):
            x_h = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05)
            x = cuda.to_device(x_h)
            sample = np.sort(rng.choice(T, min(T, 32), replace=False))
            ref = projection_reference_rows(x_h, wkv_h, sample)
            for rec in catalog.records("proj"):
                if T not in tokens(rec) or rec.encoding != "bf16":
                    continue
                got = cuda.device_array((T, N), dtype=np.uint16)
                try:
                    launch = prepare_project(x, wkv, got, version=rec.name)
                except Exception as exc:   # e.g. an optional dependency (cuBLAS through torch) is missing
                    log(f"  proj {rec.name}: cannot launch ({exc})")
                    continue
                launch()
                ok, agree = projection_agrees(got.copy_to_host()[sample], ref)
                slow = rec.name.endswith("_v1")
                us = timer(launch, iters=3 if slow or T == 4096 else iters)
                add("proj_bf16", T, rec.name, us, *rec.launch_cost(T, K, N), ok, **agree)
        _bench_deepseek_fp8(timer, add, rng, K, N, iters, smoke, shape, log)

    if "gate" in stages:
        w_gate_h = (1 + 0.1 * rng.standard_normal((HC, DIM))).astype(np.float32)
        w_gate = cuda.to_device(w_gate_h)
        for T in sorted({t for rec in catalog.records("gate") for t in tokens(rec)}):
            h0 = rng.standard_normal((T, HC, DIM)).astype(np.float32)
            kvg_h = f32_to_bf16(rng.standard_normal((T, N)).astype(np.float32))
            kvg = cuda.to_device(kvg_h)
            ref = gate_reference(h0, kvg_h, w_gate_h, np.ones_like(w_gate_h))
            h = cuda.to_device(h0)
            dot, gate = cuda.device_array((T, HC), dtype=np.float32), cuda.device_array((T, HC), dtype=np.float32)
            for rec in catalog.records("gate"):
                if T not in tokens(rec):
                    continue
                for layout in ((None,) if rec.name in ("gate_v1", "gate_v4") else ("stream", "token")):   # v4: one map
                    h.copy_to_device(h0)
                    try:
                        launch = prepare_gate(h, kvg, w_gate, dot_out=dot, gate_out=gate, version=rec.name,
                                              layout=layout)
                    except ValueError as exc:  # a layout that does not apply to this shape
                        log(f"  gate {rec.name} {layout}: {exc}")
                        continue
                    launch()
                    valid = gate_agrees(h0, h.copy_to_host(), dot.copy_to_host(), gate.copy_to_host(), kvg_h, ref.dot)
                    us = timer(launch, iters=iters)
                    add("gate", T, rec.name + (f"/{layout}" if layout else ""), us, *rec.launch_cost(T, HC, DIM), valid)
    return out


FP8_SWEEP = (128, 1024, 4096)      # DeepSeek's FP8 GEMMs: where a prefill chunk sits (also off shape.tokens)


def _bench_deepseek_fp8(timer, add, rng, K, N, iters, smoke, shape, log):
    """The gemm_fp8_* records (act_quant included: what a projection costs) on an FP8 wkv, checked
    against the CPU twin of DeepSeek's arithmetic on sampled rows (the naive v1 bit for bit, the
    tensor-core versions within docs/numerics.md's bound) before they are timed, with gemm_v4 and
    cuBLAS bf16 on the same weights decoded to bf16 timed in the same run (`vs_gemm_v4`)."""
    from numba import cuda

    import ml_dtypes

    from ..bf16 import bf16_to_f32, bf16_ulp_distance, f32_to_bf16
    from ..stages import catalog
    from ..stages.proj.cpu import projection_deepseek_fp8_cpu
    from ..stages.proj.launch import prepare_project, prepare_project_q
    from ..stages.proj.records import DEEPSEEK_FP8_VERSIONS
    from ..stages.proj.reference import wkv_fp8_bf16

    recs = [r for r in catalog.records("proj") if r.name in DEEPSEEK_FP8_VERSIONS]
    sweep = {r.name: ([t for t in shape.tokens[:1]] if r.name.endswith("_v1") else []) if smoke
             else [t for t in r.sweep if t in FP8_SWEEP] for r in recs}
    Ts = sorted({t for ts in sweep.values() for t in ts})
    if not Ts:
        return
    w = np.clip(rng.standard_normal((N, K)).astype(np.float32) * np.float32(64.0), -448, 448)
    codes_h = np.ascontiguousarray(w.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))          # [N, K] e4m3
    scales_h = rng.integers(118, 122, (-(-N // 32), K // 32), dtype=np.uint8)                   # e8m0 tiles
    codes, scales = cuda.to_device(codes_h), cuda.to_device(scales_h)
    wbf = cuda.to_device(wkv_fp8_bf16(codes_h, scales_h))                                       # exact in bf16
    for T in Ts:
        x_h = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05)
        x = cuda.to_device(x_h)
        sample = np.sort(rng.choice(T, min(T, 16), replace=False))
        twin = projection_deepseek_fp8_cpu(x_h[sample], codes_h, scales_h)
        base = {}
        if not smoke:
            for name in ("gemm_v4", "cublas_v1"):
                try:
                    base[name] = timer(prepare_project(x, wbf, cuda.device_array((T, N), np.uint16), version=name),
                                       iters=iters)
                except Exception as exc:     # cuBLAS needs torch
                    log(f"  proj_fp8_deepseek {name}: cannot launch ({exc})")
        for rec in recs:
            if T not in sweep[rec.name]:
                continue
            got = cuda.device_array((T, N), np.uint16)
            launch = prepare_project_q(x, codes, scales, got, weight="fp8", version=rec.name)
            launch()
            g = got.copy_to_host()[sample]
            ulps = bf16_ulp_distance(g, twin)
            a, b = bf16_to_f32(g).astype(np.float64), bf16_to_f32(twin).astype(np.float64)
            rel_l2 = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            share = float((ulps > 0).mean())
            ok = bool(np.isfinite(a).all() and (ulps.max() == 0 if rec.bit_exact else rel_l2 <= 2e-3 and share <= 0.10))
            us = timer(launch, iters=3 if rec.name.endswith("_v1") or T == 4096 else iters)
            extra = {"max_ulp_vs_twin": int(ulps.max()), "share_differ_vs_twin": share, "rel_l2_vs_twin": rel_l2}
            extra.update({f"{n}_us": round(t, 2) for n, t in base.items()})
            if "gemm_v4" in base:
                extra["vs_gemm_v4"] = round(base["gemm_v4"] / us, 3)
            if "cublas_v1" in base:
                extra["vs_cublas_bf16"] = round(base["cublas_v1"] / us, 3)
            # the floor at the FP8 tensor-core rate (2 x bf16): these MMAs are e4m3
            add("proj_fp8_deepseek", T, rec.name, us, *rec.launch_cost(T, K, N), ok, encoding="fp8",
                peak_tflops=FP8_TFLOPS, **extra)


def bench_hash(log=print, repeats: int = 30, n_tokens: int = 4096) -> dict:
    """The @njit hasher (one core) on a 4096-token prefill at the released configuration
    (2 layers x 24 columns, real multipliers and primes, ids over the whole compressed vocab).
    Best of `repeats` after a warm-up call (which compiles). Needs no GPU."""
    from ..config import COMPRESSED_VOCAB_SIZE, ENGRAM_VOCAB_SIZE
    from ..stages.hash.cpu import EngramHasher
    from ..stages.hash.tables import EngramHashTables

    rng = np.random.default_rng(1)
    tables = EngramHashTables.build((1, 14), 4, 8, ENGRAM_VOCAB_SIZE, np.arange(COMPRESSED_VOCAB_SIZE), 2)
    hasher = EngramHasher(tables, capacity=2 * n_tokens)
    toks = rng.integers(0, COMPRESSED_VOCAB_SIZE, n_tokens)
    hasher.hash(toks)
    times = []
    for _ in range(repeats):
        hasher.reset()
        t0 = time.perf_counter()
        hasher.hash(toks)
        times.append(time.perf_counter() - t0)
    out = {"hash_prefill_4096_ms": round(1e3 * min(times), 3),
           "hash_prefill_4096_median_ms": round(1e3 * statistics.median(times), 3),
           "hash_tokens_per_s": round(n_tokens / min(times))}
    log(f"hasher: {n_tokens}-token prefill {out['hash_prefill_4096_ms']} ms best, "
        f"{out['hash_prefill_4096_median_ms']} ms median ({out['hash_tokens_per_s']:,} tokens/s)")
    return out


def bench_host(log=print, n_calls: int = 500, reader_vocab: int = 100_000, smoke: bool = False) -> dict:
    """Host-side figures: hasher, row reader, Python cost of one apply call at T=1."""
    from numba import cuda

    from ..config import EngramConfig
    from ..engine import EngramV41
    from ..formats.schema_a import load_gguf, write_gguf
    from ..stages.gate.launch import run_gate
    from ..stages.hash.tables import EngramHashTables
    from ..stages.proj.launch import project

    out = bench_hash(log, repeats=2 if smoke else 30, n_tokens=64 if smoke else 4096)
    if smoke:
        n_calls, reader_vocab = 2, 300
    rng = np.random.default_rng(1)
    # A GGUF with a released-width engram (24 columns) but tables of the configuration's real
    # prime sums would be 30 GB: real-recipe constants from a smaller prime start instead.
    with tempfile.TemporaryDirectory() as tmp:
        heads = 1 if smoke else 8
        cfg = EngramConfig(dim=16 if smoke else 64, hc=4, layer_ids=(1, 4), max_ngram_size=4, n_heads=heads)
        small = EngramHashTables.build((1, 4), 4, heads, reader_vocab, np.arange(1000), 2)
        layers = {}
        for li, lid in enumerate(cfg.layer_ids):
            rows = int(small.table_rows[li])
            tbl = rng.integers(0, 256, (rows, 84), dtype=np.uint8)
            tbl[:, 80:84] = np.array([0.01, 0.001], dtype=np.float16).view(np.uint8)  # finite d, dmin
            layers[lid] = {"table": tbl, "wkv": rng.standard_normal((cfg.proj_out, cfg.proj_in)).astype(np.float32),
                           "q_weight": np.ones((cfg.hc, cfg.dim), np.float32),
                           "k_weight": np.ones((cfg.hc, cfg.dim), np.float32)}
        path = Path(tmp) / "reader.gguf"
        write_gguf(path, cfg, small, layers)
        model = load_gguf(path)
        reader = model.rows(1)
        C = cfg.n_hash_cols
        ids = rng.integers(0, reader.n_rows, 4096 * C)
        reader.read(ids)
        t = []
        for _ in range(10):
            t0 = time.perf_counter()
            reader.read(rng.integers(0, reader.n_rows, 4096 * C))
            t.append(time.perf_counter() - t0)
        out["row_reader_rows_per_s"] = round(ids.size / statistics.median(t))
        out["row_reader_table_mb"] = round(reader.n_rows * 84 / 1e6, 1)
        log(f"row reader: {out['row_reader_rows_per_s']:,} rows/s from a {out['row_reader_table_mb']} MB table on disk")

        # Python cost per apply at T=1 (device time excluded: no sync inside the loop).
        eng = EngramV41(model, max_tokens=16)
        h = cuda.to_device(rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32))
        eng.rows_from_raw(1, reader.read(rng.integers(0, reader.n_rows, (1, C))))
        for _ in range(min(20, n_calls)):
            eng.apply(1, h)
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_calls):
            eng.apply(1, h)
        out["apply_T1_host_us"] = round((time.perf_counter() - t0) / n_calls * 1e6, 1)
        cuda.synchronize()
        log(f"EngramV41.apply at T=1: {out['apply_T1_host_us']} us of Python per call (2 kernel launches)")
        if not smoke:
            # the same two launches replayed from a CUDA graph (EngramV41.capture_apply)
            try:
                eng_g = EngramV41(model, max_tokens=16, stream=cuda.stream())
                h_g = cuda.to_device(rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32))
                eng_g.rows_from_raw(1, reader.read(rng.integers(0, reader.n_rows, (1, C))))
                graph = eng_g.capture_apply(1, h_g)
                for _ in range(20):
                    graph.replay()
                eng_g.stream.synchronize()
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    graph.replay()
                out["apply_T1_graph_replay_host_us"] = round((time.perf_counter() - t0) / n_calls * 1e6, 1)
                eng_g.stream.synchronize()
                log(f"captured apply (CUDA graph) at T=1: {out['apply_T1_graph_replay_host_us']} us of host time per replay")
            except Exception as exc:  # recorded, not fatal: the rest of the suite still runs
                out["apply_T1_graph_replay_host_us"] = f"failed: {type(exc).__name__}: {exc}"[:300]
                log(f"captured apply failed: {exc}")

            # calibration: numba's own cost of launching a kernel with three array arguments
            @cuda.jit
            def _touch(a, b, c):
                if cuda.grid(1) == 0:
                    c[0] = a[0] + b[0]
            a = cuda.to_device(np.ones(4, np.float32))
            _touch[1, 32](a, a, a)
            cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(500):
                _touch[1, 32](a, a, a)
            out["numba_launch_host_us"] = round((time.perf_counter() - t0) / 500 * 1e6, 1)
            cuda.synchronize()
            log(f"numba launch of a 3-array kernel: {out['numba_launch_host_us']} us of Python")

        # The unprepared launchers, which validate and build views on every call.
        lw, ws = eng.layers[1], eng._ws[1]
        x = ws.rows[:C].reshape(1, cfg.proj_in)
        for name, call in (("project_launcher_host_us", lambda: project(x, lw.wkv, ws.kv[:1])),
                           ("gate_launcher_host_us", lambda: run_gate(h, ws.kv[:1], lw.w_gate))):
            for _ in range(min(10, n_calls)):
                call()
            cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(min(200, n_calls)):
                call()
            out[name] = round((time.perf_counter() - t0) / min(200, n_calls) * 1e6, 1)
            cuda.synchronize()
        log(f"unprepared launchers: project() {out['project_launcher_host_us']} us, "
            f"run_gate() {out['gate_launcher_host_us']} us of Python per call")
        model.close()
    return out


SECTIONS = ("host", "device", "decode", "corpus", "variants")
CPU_SECTIONS = ("access",)      # run alone, on the CPU (bench/access.py), not part of the default set
_DECODE_STAGES = ("proj_q2k", "proj_fp8", "decode_step", "engine_build")


def _names(text, allowed: tuple, default: tuple, what: str, label: str) -> tuple:
    """A comma-separated option's names, each checked against `allowed` (the default when empty)."""
    if not text:
        return default
    names = tuple(x.strip() for x in str(text).split(",") if x.strip())
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise ValueError(f"unknown {what}(s) {bad or [text]}; {label} {list(allowed)}")
    return names


def _sections(text) -> tuple:
    names = _names(text, SECTIONS + CPU_SECTIONS, SECTIONS, "bench section", "sections are")
    if set(names) & set(CPU_SECTIONS) and len(names) > 1:
        raise ValueError(f"the CPU section(s) {list(CPU_SECTIONS)} run on their own: --sections access")
    return names


VARIANT_STAGES = ("rows", "proj", "gate")     # bench_variants' stage families (--variant-stages)


def _variant_stages(text) -> tuple:
    return _names(text, VARIANT_STAGES, VARIANT_STAGES, "variant stage", "they are")


def _family(record: dict) -> str:
    """A variants record's stage family: rows_q2k -> rows, proj_bf16 / proj_fp8_deepseek -> proj, gate."""
    return str(record["stage"]).split("_", 1)[0]


def merge_variants(previous: list, new: list, stages: tuple) -> list:
    """The variants of an earlier run with the families in `stages` replaced by the new run's records."""
    return [r for r in previous if _family(r) not in stages] + list(new)


def _section_of(record: dict) -> str:
    if record["stage"] in _DECODE_STAGES:
        return "decode"
    if record["stage"] == "corpus_stats":
        return "corpus"
    return "device"


def main(args=None) -> int:
    from numba import cuda
    from numba.cuda import config
    if getattr(args, "hash_only", False):
        bench_hash()
        return 0
    if getattr(args, "sections", None) and _sections(args.sections) == ("access",):
        from .access import main as access_main        # CPU only: no GPU needed
        return access_main(args)
    sections = _sections(getattr(args, "sections", None))          # bad names refused before any device work
    vstages = _variant_stages(getattr(args, "variant_stages", None))
    if vstages != VARIANT_STAGES and ("variants" not in sections or getattr(args, "no_variants", False)):
        raise ValueError("--variant-stages needs the variants section (--sections variants)")
    smoke = getattr(args, "smoke", False)
    if not smoke and (config.ENABLE_CUDASIM or not cuda.is_available()):
        print("error: engram-numba bench needs a CUDA GPU (none found, or numba's simulator is on); run it on the "
              "GPU machine (tests/gpu_run.sh), or use --smoke to check the suite in the simulator", file=sys.stderr)
        return 2
    shape = SMOKE if smoke else RELEASED
    if getattr(args, "table_gb", None) and not smoke:
        shape = BenchShape(table_gb=args.table_gb)
    default_out = "bench/results/smoke.json" if smoke else "bench/results/h200.json"
    out = Path(getattr(args, "out", None) or default_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"commit": commit(), "timing": TIMING_METHOD}
    quick = getattr(args, "quick", False) or smoke
    if getattr(args, "variants_only", False):
        result.update({"device": device_name(), "copy_gbps": 0.0, "records": [],
                       "variants": bench_variants(shape, quick)})
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        return 0
    previous = {}
    if getattr(args, "merge", False) and out.exists():
        previous = load_results(out)                      # add these sections to an earlier run's file
        result = {k: v for k, v in previous.items() if k not in ("records", "variants", "host")} | result
        result["records"] = [r for r in previous.get("records", []) if _section_of(r) not in sections]
        if "variants" not in sections and "variants" in previous:
            result["variants"] = previous["variants"]
        if "host" not in sections and "host" in previous:
            result["host"] = previous["host"]

    def save():                                           # after every section: a timeout keeps what ran
        out.write_text(json.dumps(result, indent=1, default=str))

    result.setdefault("records", [])
    # Host figures first: torch.compile (in bench_device) leaves worker threads that would
    # compete with the Python being timed.
    if "host" in sections:
        result["host"] = bench_host(smoke=smoke)
        save()
    if "device" in sections:
        dev = bench_device(shape, quick=quick)
        result["records"] = dev.pop("records") + result["records"]
        result.update(dev)
        save()
    if "copy_gbps" not in result:
        result["copy_gbps"] = round(measure_copy_gbps(DeviceTimer()), 1)
        result["device"] = device_name()
    if "decode" in sections:
        bench_decode.add_to(result, shape, quick)      # proj_q2k/_fp8, decode_step, engine_build
        save()
    if "corpus" in sections:
        result["records"] += corpus_bench(shape, quick=quick, table_gb=getattr(args, "corpus_table_gb", None))["records"]
        if shape.name == SMOKE.name:          # the FP8-encoded model's corpus run too (alone: bench.corpus --model fp8)
            result["records"] += corpus_bench(shape, quick=quick, model="fp8")["records"]
        save()
    if "variants" in sections and not getattr(args, "no_variants", False):
        new = bench_variants(shape, quick, stages=vstages)
        result["variants"] = merge_variants(previous.get("variants", []), new, vstages) if previous else new
        save()
    if previous:                                          # which commit each merged part was measured at
        ran = [x for x in sections if x != "variants" or vstages == VARIANT_STAGES]
        ran += [f"variants:{x}" for x in vstages] if "variants" in sections and vstages != VARIANT_STAGES else []
        kept = {_section_of(r) for r in previous.get("records", [])} | {x for x in ("host", "variants") if x in previous}
        # a part kept from the earlier file without a commit of its own was measured at that file's commit
        commits = {x: previous.get("commit", "?") for x in kept} | dict(result.get("section_commits") or {})
        if vstages == VARIANT_STAGES:
            commits = {k: v for k, v in commits.items() if not k.startswith("variants:")}
        result["section_commits"] = commits | {x: result["commit"] for x in ran}
        save()
    save()
    png = Path(getattr(args, "png", None) or out.with_suffix(".png"))
    plot_results(result, png)
    print(markdown_table(result))
    print(f"\nwrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
