"""Decode-path benchmarks: GEMVs on Q2_K / FP8 weights, the graphed decode step, engine start-up.

    run(shape, quick, log, *, n_tokens=None, build_table_gib=None) -> {"records": [...], "decode": {...}}

Records (same schema as the suite's, `timing.make_record`):
  proj_q2k        T in 1, 4, 8: kv = bf16(x @ W^T) with W in Q2_K blocks [N, K/256*84], every q2k
                  version (the default's record first, the others with "variant"), each validated on
                  sampled output rows against its float64 yardstick before it is timed (L2 flushed
                  between runs: the 51.6 MB weight fits in the 60 MB L2, so every record says
                  `l2: "cold"`). On a GPU the same weight re-laid out on the device as q2k_r (what the
                  engine holds there) runs its versions too, and the engine's kernel is the record's
                  default. Baselines in the same run: cuBLAS on the bf16 weight, and our bf16 GEMV on it.
  proj_fp8        the same on FP8 codes [N, K] + e8m0 tile scales [N/32, K/32].
  decode_step     T = 1, both engram layers at the shape's dim/hc/columns with device-resident
                  random Q2_K tables (`table_gb` per layer; only 24 rows a token are read): wall time
                  per token over n_tokens consecutive tokens of one sequence, the hash included,
                  measured with the host clock around the whole loop (then a synchronize), and the
                  device time per token beside it (CUDA events, the host's launch time hidden).
                  Variants in the same run: the engine's default wkv (q2k_r on a GPU: both layers
                  projected in one launch) graphed (`EngramV41.decode`) and ungraphed, q2k weights and
                  bf16 weights graphed and ungraphed, and torch (index_select + Q2_K decode,
                  cuBLAS bf16 GEMV, torch.compile'd gate), eager and inside a torch CUDA graph. The
                  graphed and ungraphed runs of one weight format must end on the same highway bits.
  engine_build    seconds and GB/s to open a sparse GGUF (tables are holes: they read as zeros, no
                  disk) and build `EngramV41(..., device_tables=True)` with `build_table_gib` per
                  layer (the released size, 30 GiB, by default), twice: the first build reads the
                  file for the first time (`first_read`: on a disk filesystem the page cache's pages
                  are allocated and zeroed on the way), the second from the page cache (the
                  record's figure). Each says how much of the file was in the page cache before
                  (mincore), and splits its time: the readers' GB/s (all threads busy), the
                  copies' GB/s (CUDA events), the waits on either, the pinned ring's size. A third
                  build from the page cache reads the file the uploader's other way (`page_cache_pread`
                  beside the default, copying out of the file's map).
In numba's simulator (`engram-numba bench --smoke`) everything runs at tiny shapes and a few tokens:
it checks the wiring, its figures mean nothing.
"""
from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from .baselines import torch_gate, torch_or_none, torch_view
from .timing import RELEASED, BenchShape, DeviceTimer, make_record, measure_copy_gbps
from .validate import projection_agrees

QUANT_TOKENS = (1, 4, 8)
RELEASED_TABLE_GIB = 30.0


# ---- inputs -------------------------------------------------------------------------------------

def random_q2k_weight(rng, N, K):
    """Q2_K blocks [N, K/256*84] of random bytes with finite random fp16 d and dmin."""
    raw = rng.integers(0, 256, (N, K // 256, 84), dtype=np.uint8)
    raw[:, :, 80:84] = (rng.standard_normal((N, K // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(N, K // 256 * 84))


def random_fp8_weight(rng, N, K):
    """e4m3 codes [N, K] (no NaN code) and e8m0 scales [ceil(N/32), K/32] near 2^-8."""
    codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 0x01
    scales = rng.integers(115, 124, (-(-N // 32), K // 32), dtype=np.uint8)
    return codes, scales


def _hash_shape(cols: int) -> tuple[int, int]:
    """(max_ngram_size, n_heads) giving `cols` hash columns."""
    return (4, cols // 3) if cols % 3 == 0 and cols >= 3 else (2, cols)


def synthetic_layer(layer_id, index, table, wkv_raw, q_weight, k_weight, K):
    """An engram layer of the model protocol held in memory: Q2_K table and wkv (the bench's decode model)."""
    from ..formats.model import EngramLayer
    return EngramLayer(layer_id, index, table=table, table_encoding="q2k", wkv_raw=wkv_raw, wkv_encoding="q2k",
                       q_weight=q_weight, k_weight=k_weight, wkv_shape=(wkv_raw.shape[0], K))


class SyntheticModel:
    """A released-width model (dim, hc, columns of `shape`) with random Q2_K tables of about
    `table_gb` per layer and random Q2_K wkv: what decode_step runs on."""

    format = "synthetic (bench decode model)"
    path = "<memory>"
    problems: list = []

    def __init__(self, shape: BenchShape, table_gb: float, rng, layer_ids=(1, 14)):
        from ..config import EngramConfig
        from ..stages.hash.tables import EngramHashTables
        from ..stages.rows.encodings import random_raw_rows
        m, heads = _hash_shape(shape.cols)
        self.config = EngramConfig(dim=shape.dim, hc=shape.hc, layer_ids=layer_ids, max_ngram_size=m, n_heads=heads)
        cols = self.config.n_hash_cols
        vocab = max(int(table_gb * 1e9 / 84 / cols), 1000)
        self.token_vocab = 4096
        self.hash_tables = EngramHashTables.build(layer_ids, m, heads, vocab, np.arange(self.token_vocab), 2)
        K, N = self.config.proj_in, self.config.proj_out
        self.layers = {}
        tile = random_raw_rows("q2k", min(1 << 19, int(self.hash_tables.table_rows.max())), rng)   # 44 MB of rows
        for li, lid in enumerate(layer_ids):
            rows = int(self.hash_tables.table_rows[li])
            table = np.empty((rows, 84), np.uint8)
            for r0 in range(0, rows, tile.shape[0]):                  # random rows, repeated (finite d, dmin)
                r1 = min(rows, r0 + tile.shape[0])
                table[r0:r1] = tile[: r1 - r0]
            self.layers[lid] = synthetic_layer(
                lid, li, table, random_q2k_weight(rng, N, K),
                (1 + 0.1 * rng.standard_normal((shape.hc, shape.dim))).astype(np.float32),
                (1 + 0.1 * rng.standard_normal((shape.hc, shape.dim))).astype(np.float32), K)

    def rows(self, layer_id):
        from ..formats.schema_a import EngramRowReader
        return EngramRowReader(layer_id, self.layers[layer_id].table)

    def close(self):
        self.layers = {}


# ---- projection on quantised weights ------------------------------------------------------------

def bench_projection_q(shape: BenchShape, quick: bool, log, timer, copy_gbps, smoke: bool,
                       encodings=("q2k", "fp8")) -> list[dict]:
    from numba import cuda

    from ..bf16 import f32_to_bf16
    from ..stages import registry
    from ..stages.proj import reference as R
    from ..stages.proj.cuda_gemv_q2kr import repack_on_device
    from ..stages.proj.launch import pick, prepare_project, prepare_project_q, prepare_wkv_to_bf16

    torch = torch_or_none()
    rng = np.random.default_rng(11)
    K, N = shape.K, shape.N
    iters = 3 if smoke else (10 if quick else 30)
    records = []
    sample = np.sort(rng.choice(N, min(N, 256), replace=False))          # output rows validated
    for weight in encodings:
        if weight == "q2k":
            raw, scales = random_q2k_weight(rng, N, K), None
            wb_rows = R.wkv_q2k_bf16(raw[sample], K)
            w_exact_rows = R.wkv_q2k_exact(raw[sample], K)
        else:
            raw, scales = random_fp8_weight(rng, N, K)
            import ml_dtypes
            v = raw[sample].view(ml_dtypes.float8_e4m3fn).astype(np.float32)            # exact
            sc = np.ldexp(np.float32(1.0), scales[sample // 32].astype(np.int32) - 127).astype(np.float32)
            wb_rows = f32_to_bf16(v * np.repeat(sc, 32, axis=1))                      # as wkv_fp8_bf16
            w_exact_rows = None
        rd = cuda.to_device(raw)
        sd = None if scales is None else cuda.to_device(scales)
        wb_dev = cuda.device_array((N, K), np.uint16)                  # the bf16 weight, for the baselines
        prepare_wkv_to_bf16(rd, sd, wb_dev, weight=weight)()
        tw = torch_view(wb_dev, torch).view(torch.bfloat16) if torch is not None else None
        # (version, the encoding it reads): on a GPU a Q2_K weight also runs re-laid out as q2k_r
        # the exact-weight GEMVs only: DeepSeek's FP8 arithmetic quantises the activations too, so it
        # has its own yardstick and bench (tools/fp8_dev.py)
        from ..stages.proj.records import DEEPSEEK_FP8_VERSIONS
        versions = [(r.name, weight) for r in registry.records("proj", weight) if r.name not in DEEPSEEK_FP8_VERSIONS]
        weights = {weight: rd}
        if weight == "q2k" and not smoke:
            weights["q2k_r"] = repack_on_device(rd, N, K)
            versions = [(r.name, "q2k_r") for r in registry.records("proj", "q2k_r")] + versions
        for T in (QUANT_TOKENS[:1] if smoke else QUANT_TOKENS):
            x_h = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05)
            x = cuda.to_device(x_h)
            default = pick(T, K, N, weight=versions[0][1]).name
            order = [(default, versions[0][1])] + [(v, enc) for v, enc in versions
                                                   if v != default and not (smoke or v.endswith("_v1"))]
            base = {}
            if torch is not None:
                tx = torch_view(x, torch).view(torch.bfloat16)
                base["torch_cublas_bf16"] = timer(lambda: tx @ tw.T, iters=iters)
            kv_b = cuda.device_array((T, N), np.uint16)
            bf16_launch = prepare_project(x, wb_dev, kv_b)
            base["ours_bf16_" + bf16_launch.name] = timer(bf16_launch, iters=iters)
            for v, enc in order:
                nbytes, flops = registry.get("proj", v).launch_cost(T, K, N)     # the same bytes for q2k and q2k_r
                kv = cuda.device_array((T, N), np.uint16)
                launch = prepare_project_q(x, weights[enc], sd, kv, weight=enc, version=v)
                launch()
                got = kv.copy_to_host()[:, sample]
                exact_weights = v == "gemv_q2k_v3"
                ref = (R.projection_exact_weights(x_h, w_exact_rows) if exact_weights
                       else R.projection_exact(x_h, wb_rows))
                ok, agree = projection_agrees(got, ref)
                if exact_weights:     # the research figure: distance from the bf16-weight projection
                    _, vs_b = projection_agrees(got, R.projection_exact(x_h, wb_rows))
                    agree["vs_bf16_weights"] = vs_b
                us = timer(launch, iters=iters)
                rec = make_record(f"proj_{weight}", T, us, nbytes, flops, copy_gbps,
                                  base if v == default else {}, validated=ok, kernel=v, encoding=enc,
                                  vs_reference=agree, l2="cold", **({} if v == default else {"variant": v}))
                records.append(rec)
                log(f"proj_{weight} T={T}: {us:8.1f} us  {rec['pct_of_floor']:5.1f}% of copy floor  "
                    f"{rec['gbps']} GB/s  {v} valid={ok} {agree}  {base if v == default else ''}")
        del rd, sd, wb_dev, weights
    return records


# ---- one decode token, both layers --------------------------------------------------------------

def _loop(step_one, tokens, sync) -> float:
    """Host seconds for step_one(token) over every token, then a synchronize."""
    t0 = time.perf_counter()
    for tok in tokens:
        step_one(tok)
    sync()
    return time.perf_counter() - t0


def _step_bytes(cfg, wkv_encoding: str) -> int:
    """Bytes one layer's decode step moves for one token: the rows, projection and gate launches'
    costs as their records state them (Q2_K tables, the wkv in `wkv_encoding`)."""
    from ..stages import registry
    rows = registry.records("rows", "q2k")[0].launch_cost(cfg.n_hash_cols)[0]
    proj = registry.records("proj", wkv_encoding)[0].launch_cost(1, cfg.proj_in, cfg.proj_out)[0]
    gate = registry.records("gate")[0].launch_cost(1, cfg.hc, cfg.dim)[0]
    return rows + proj + gate


def bench_decode_step(shape: BenchShape, quick: bool, log, timer, copy_gbps, smoke: bool, table_gb: float,
                      n_tokens: int | None = None) -> tuple:
    from numba import cuda

    from ..engine import EngramV41
    from ..stages.hash.cpu import EngramHasher

    rng = np.random.default_rng(12)
    t0 = time.perf_counter()
    model = SyntheticModel(shape, table_gb, rng)
    cfg = model.config
    if n_tokens is None:
        n_tokens = 4 if smoke else (1024 if quick else 2048)
    warm = 0 if smoke else 32          # the simulator compiles nothing and captures no graph: no warm-up there
    seq = rng.integers(0, model.token_vocab, warm + n_tokens)
    h0 = rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)
    info = {"tokens": int(n_tokens), "table_gb_per_layer": round(float(model.hash_tables.table_rows.max()) * 84 / 1e9, 3),
            "model_seconds": round(time.perf_counter() - t0, 2)}
    log(f"decode model: dim {cfg.dim}, hc {cfg.hc}, {cfg.n_hash_cols} columns, layers {cfg.layer_ids}, tables "
        f"{info['table_gb_per_layer']} GB a layer ({info['model_seconds']} s to make)")
    per_token_bytes = 0
    results = {}
    final = {}

    def sync():
        cuda.synchronize()

    def run_engine(name, engine, graphed: bool):
        hasher = EngramHasher(model.hash_tables, capacity=len(seq) + 16)
        h = cuda.to_device(h0)
        if graphed:
            def one(tok):
                engine.decode(tok, h, hasher)
        else:
            def one(tok):
                engine.step([tok], h, hasher, graph=False)
        for tok in seq[:warm]:
            one(tok)
        sync()
        secs = _loop(one, seq[warm:], sync)
        final[name] = h.copy_to_host()
        # device time of one token's work, the host's launch cost hidden behind a spin kernel
        ids = hasher.hash([int(seq[-1])])
        if graphed:
            graph = list(engine._decode_graphs.values())[-1]
            dev_us = timer(lambda: graph.graphs[0].replay(), iters=10 if smoke else 50, flush=False)
        else:
            for li, lid in enumerate(cfg.layer_ids):     # rows loaded once; then projection + gate per layer
                engine.rows_from_ids(lid, ids[:, li, :])

            def device_work():
                for li, lid in enumerate(cfg.layer_ids):
                    engine._last_launch[("rows", lid)]()
                    engine.apply(lid, h)
            dev_us = timer(device_work, iters=10 if smoke else 50, flush=False)
        results[name] = {"wall_us_per_token": secs / n_tokens * 1e6, "device_us_per_token": dev_us}
        log(f"decode_step {name:28s}: {results[name]['wall_us_per_token']:8.1f} us/token wall (host clock, "
            f"{n_tokens} tokens, hash included), {dev_us:7.1f} us/token device")

    from numba.cuda import config as _cfg
    fmts = ("q2k", "bf16") if _cfg.ENABLE_CUDASIM else ("q2k_r", "q2k", "bf16")
    for fmt in fmts:
        t_b = time.perf_counter()
        engine = EngramV41(model, max_tokens=16, device_tables=True, wkv_format=fmt)
        log(f"engine ({fmt} wkv): built in {time.perf_counter() - t_b:.2f} s; tables+wkv "
            f"{engine.build_report['gb_per_s']} GB/s through {engine.build_report['uploads'][-1]['method']} uploads")
        if fmt == fmts[0]:
            lw = next(iter(engine.layers.values()))
            per_token_bytes = len(cfg.layer_ids) * _step_bytes(cfg, lw.wkv_encoding)
        if engine.graphs_available:
            run_engine(f"{fmt} graphed", engine, True)
        run_engine(f"{fmt} ungraphed", engine, False)
        if engine.graphs_available:
            info[f"{fmt}_graph_equals_ungraphed"] = bool(np.array_equal(final[f"{fmt} graphed"], final[f"{fmt} ungraphed"]))
            info[f"{fmt}_decode_bad_ids"] = engine.decode_bad_ids()
            info[f"{fmt}_graph_launches"] = list(list(engine._decode_graphs.values())[-1].names)
        del engine
        gc.collect()

    torch = torch_or_none()
    if torch is not None and not smoke:
        try:
            errors = _bench_torch_decode(torch, model, seq, warm, n_tokens, h0, timer, results, final, log)
            if errors:
                info["torch_errors"] = errors
        except Exception as exc:        # recorded, not fatal
            info["torch_error"] = f"{type(exc).__name__}: {exc}"[:400]
            log(f"torch decode baseline failed: {exc}")
    info["results"] = {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in results.items()}
    if "bf16 ungraphed" in final and "q2k ungraphed" in final:
        a, b = final["q2k ungraphed"].astype(np.float64), final["bf16 ungraphed"].astype(np.float64)
        info["q2k_vs_bf16_highway_rel_l2"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    for tname in ("torch eager", "torch graph"):
        if tname in final and "bf16 ungraphed" in final:
            a, b = final[tname].astype(np.float64), final["bf16 ungraphed"].astype(np.float64)
            info[f"{tname.replace(' ', '_')}_vs_ours_rel_l2"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    main = f"{fmts[0]} graphed" if f"{fmts[0]} graphed" in results else f"{fmts[0]} ungraphed"
    base = {k: v["wall_us_per_token"] for k, v in results.items() if k != main}
    rec = make_record("decode_step", 1, results[main]["wall_us_per_token"], per_token_bytes, 0, copy_gbps, base,
                      kernel=(f"EngramV41.decode ({fmts[0]} wkv, one CUDA graph a token)" if main.endswith("graphed")
                              and not main.endswith("ungraphed")
                              else f"EngramV41.step ({fmts[0]} wkv, kernels launched one by one)"),
                      device_us_per_token=round(results[main]["device_us_per_token"], 2),
                      validated=all(info.get(f"{f}_graph_equals_ungraphed", True) for f in fmts),
                      variants={k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in results.items()})
    rec["tables"], rec["cache_gb"] = "device", 0.0
    torch_best = min((v["wall_us_per_token"] for k, v in results.items() if k.startswith("torch")), default=None)
    if torch_best:
        rec["speedup_vs_torch_best"] = round(torch_best / rec["time_us"], 2)
    model.close()
    gc.collect()
    return rec, info


def _bench_torch_decode(torch, model, seq, warm, n_tokens, h0, timer, results, final, log):
    """The torch baseline: per token, the same hash on the host, ids up through double-buffered
    pinned memory, then per layer index_select + Q2_K decode (eager torch ops), cuBLAS bf16 GEMV,
    and the gate (torch.compile'd eager; plain ops inside the CUDA graph)."""
    cfg = model.config
    HC, DIM, C = cfg.hc, cfg.dim, cfg.n_hash_cols
    L = len(cfg.layer_ids)
    dev = torch.device("cuda")
    tables = [torch.from_numpy(model.layers[lid].table).to(dev) for lid in cfg.layer_ids]
    wkv = [torch.from_numpy(model.layers[lid].wkv_bf16().view(np.int16)).to(dev).view(torch.bfloat16)
           for lid in cfg.layer_ids]
    wg = [torch.from_numpy(model.layers[lid].q_weight * model.layers[lid].k_weight).to(dev) for lid in cfg.layer_ids]
    try:
        compiled = torch.compile(lambda h, kv, w: torch_gate(torch, h, kv, w, HC, DIM))
    except Exception as exc:                                  # torch.compile is optional
        log(f"torch.compile unavailable ({exc}); the eager gate stands in")
        compiled = lambda h, kv, w: torch_gate(torch, h, kv, w, HC, DIM)  # noqa: E731
    pinned = [torch.empty(L * C, dtype=torch.int64, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event(), torch.cuda.Event()]
    used = [False, False]
    ids_dev = torch.empty(L * C, dtype=torch.int64, device=dev)
    shifts = torch.tensor([0, 2, 4, 6], device=dev, dtype=torch.int32).view(1, 1, 4, 1)   # made once: capturable

    def q2k_rows(table, ids):
        """index_select + Q2_K decode in torch ops (as baselines.torch_q2k_decode, graph-safe)."""
        b = table.index_select(0, ids)                                                # [n, 84]
        n = b.shape[0]
        scales = b[:, :16].to(torch.int32)
        qs = b[:, 16:80].to(torch.int32).view(n, 2, 1, 32)
        d = b[:, 80:82].contiguous().view(torch.float16).to(torch.float32)
        dmin = b[:, 82:84].contiguous().view(torch.float16).to(torch.float32)
        q = ((qs >> shifts) & 3).view(n, 16, 16).to(torch.float32)
        y = ((d * (scales & 15).to(torch.float32)).view(n, 16, 1) * q
             - (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1))
        return y.view(n, 256).to(torch.bfloat16)

    def device_token(h, gate):
        for li in range(L):
            rows = q2k_rows(tables[li], ids_dev[li * C:(li + 1) * C])                   # [C, 256] bf16
            kv = rows.view(1, C * 256) @ wkv[li].T                                     # [1, N] cuBLAS
            gate(h, kv, wg[li])

    errors = {}
    for name, graphed in (("torch eager", False), ("torch graph", True)):
        try:
            _torch_variant(torch, name, graphed, model, seq, warm, n_tokens, h0, timer, results, final, log,
                           device_token, compiled, pinned, events, used, ids_dev, HC, DIM)
        except Exception as exc:        # a capture that torch refuses: recorded, the other variant stays
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"{name} failed: {errors[name]}")
            final.pop(name, None)
            results.pop(name, None)
    return errors


def _torch_variant(torch, name, graphed, model, seq, warm, n_tokens, h0, timer, results, final, log,
                   device_token, compiled, pinned, events, used, ids_dev, HC, DIM):
    from ..stages.hash.cpu import EngramHasher
    dev = torch.device("cuda")
    hasher = EngramHasher(model.hash_tables, capacity=len(seq) + 16)
    h = torch.from_numpy(h0.copy()).to(dev)
    state = {"b": 0}
    graph = None
    if graphed:
        scratch = torch.zeros_like(h)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                device_token(scratch, lambda hh, kv, w: torch_gate(torch, hh, kv, w, HC, DIM))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            device_token(h, lambda hh, kv, w: torch_gate(torch, hh, kv, w, HC, DIM))

    def one(tok):
        b = state["b"]
        if used[b]:
            events[b].synchronize()
        pinned[b].numpy()[:] = hasher.hash([int(tok)]).reshape(-1)
        ids_dev.copy_(pinned[b], non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            device_token(h, compiled)
        events[b].record()
        used[b] = True
        state["b"] = 1 - b
    for tok in seq[:warm]:
        one(tok)
    torch.cuda.synchronize()
    secs = _loop(one, seq[warm:], torch.cuda.synchronize)
    final[name] = h.cpu().numpy()
    dev_us = timer((lambda: graph.replay()) if graph is not None else (lambda: device_token(h, compiled)),
                   iters=30, flush=False)
    results[name] = {"wall_us_per_token": secs / n_tokens * 1e6, "device_us_per_token": dev_us}
    log(f"decode_step {name:28s}: {results[name]['wall_us_per_token']:8.1f} us/token wall, {dev_us:7.1f} us/token device")


# ---- engine start-up from a sparse GGUF ---------------------------------------------------------

def write_sparse_model(path, shape: BenchShape, table_gib: float, rng, layer_ids=(1, 14)):
    """A schema-A GGUF of `shape`'s widths whose tables (about table_gib each) are holes (sparse
    file regions that read as zeros and take no disk); wkv Q2_K, random, written for real."""
    from ..config import EngramConfig
    from ..formats.gguf import GGUFTensorSpec, write_gguf_raw
    from ..formats.schema_a import build_gguf_entries, tensor_names
    from ..stages.hash.tables import EngramHashTables
    m, heads = _hash_shape(shape.cols)
    cfg = EngramConfig(dim=shape.dim, hc=shape.hc, layer_ids=layer_ids, max_ngram_size=m, n_heads=heads)
    vocab = max(int(table_gib * (1 << 30) / 84 / cfg.n_hash_cols), 1000)
    tables = EngramHashTables.build(layer_ids, m, heads, vocab, np.arange(4096), 2)
    layers = {lid: {"table": np.zeros((1, 84), np.uint8), "wkv": random_q2k_weight(rng, cfg.proj_out, cfg.proj_in),
                    "wkv_type": "Q2_K", "q_weight": np.ones((cfg.hc, cfg.dim), np.float32),
                    "k_weight": np.ones((cfg.hc, cfg.dim), np.float32)} for lid in layer_ids}
    kvs, specs = build_gguf_entries(cfg, tables, layers, check=False)
    holes = {tensor_names(lid)["table"]: int(tables.table_rows[li]) for li, lid in enumerate(layer_ids)}
    specs = [GGUFTensorSpec(s.name, "Q2_K", (256, holes[s.name]), None) if s.name in holes else s for s in specs]
    write_gguf_raw(path, kvs, specs)
    return sum(holes.values()) * 84


def measure_h2d_gbps(nbytes: int = 1 << 30) -> float:
    """Pinned host -> device copy bandwidth (the PCIe floor of any upload)."""
    from numba import cuda
    host = cuda.pinned_array(nbytes, dtype=np.uint8)
    host[:] = 1
    dev = cuda.device_array(nbytes, dtype=np.uint8)
    dev.copy_to_device(host)
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_to_device(host)
    cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def filesystem_of(path) -> str:
    """The type of the filesystem holding `path` ("ext4", "xfs", "tmpfs", "overlay", ...; "?" if unknown)."""
    real = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _free_device_memory():
    """Release the device memory of dropped arrays now (numba defers frees), so the next build's
    placement sees it free."""
    gc.collect()
    from numba import cuda
    from ..device.intrinsics import SIMULATOR
    if not SIMULATOR:
        cuda.synchronize()
        cuda.current_context().deallocations.clear()


def _timed_build(path, log, label: str, read: str | None = None) -> dict:
    """Open the GGUF at `path` and build `EngramV41(device_tables=True)` from it, timed, its uploads
    reading the file with `read` (`Uploader`'s; None: the default); the page cache's share of the
    file is measured first (mincore: nothing is read)."""
    from ..device.upload import resident_fraction
    from ..engine import EngramV41
    from ..formats.schema_a import load_gguf
    from numba import cuda

    from ..device.intrinsics import SIMULATOR
    resident = resident_fraction(path)
    free = None if SIMULATOR else cuda.current_context().get_memory_info()[0]
    before = os.environ.get("ENGRAM_UPLOAD_READ")
    if read is not None:
        os.environ["ENGRAM_UPLOAD_READ"] = read
    try:
        t0 = time.perf_counter()
        model = load_gguf(path)
        t_open = time.perf_counter() - t0
        engine = EngramV41(model, max_tokens=16, device_tables=True)
        secs = time.perf_counter() - t0
    finally:
        if before is None:
            os.environ.pop("ENGRAM_UPLOAD_READ", None)
        else:
            os.environ["ENGRAM_UPLOAD_READ"] = before
    report = engine.build_report
    del engine
    model.close()
    _free_device_memory()
    nbytes = report["bytes"]
    out = {"seconds": round(secs, 3), "gbps": round(nbytes / secs / 1e9, 2), "bytes": int(nbytes),
           "open_seconds": round(t_open, 4),
           "page_cache_resident_before": None if resident is None else round(resident, 4),
           "device_free_gb_before": None if free is None else round(free / 1e9, 1),
           **{k: report.get(k) for k in ("read_method", "read_gb_per_s", "read_gb_per_s_per_thread", "copy_gb_per_s",
                                          "copy_seconds", "read_seconds", "wait_read_seconds",
                                          "wait_copy_seconds", "threads", "chunk_bytes", "n_buffers",
                                          "pinned_alloc_seconds")},
           "build_report": report}
    log(f"engine_build ({label}, {out['read_method']}): {secs:.2f} s for {nbytes / 1e9:.1f} GB = {out['gbps']} GB/s "
        f"(file {0 if resident is None else 100 * resident:.0f}% in the page cache before; readers "
        f"{out['read_gb_per_s']} GB/s with {out['threads']} threads ({out['read_gb_per_s_per_thread']} each), "
        f"copies {out['copy_gb_per_s']} GB/s; waited {out['wait_read_seconds']} s on reads, "
        f"{out['wait_copy_seconds']} s on copies; pinned ring {out['n_buffers']} x "
        f"{(out['chunk_bytes'] or 0) >> 20} MiB allocated in {out['pinned_alloc_seconds']} s)")
    return out


def bench_engine_build(shape: BenchShape, log, table_gib: float, smoke: bool) -> dict:
    """Three timed builds from one sparse GGUF: the first reads the tables' pages for the first time
    (on a disk filesystem that allocates and zeroes the page cache's pages: a fresh machine's
    start), the second reads them from the page cache (the record's figure), both with the
    uploader's default read method; the third from the page cache with the other method. A tiny
    build first compiles what a build launches, so no compile is timed."""
    from ..device.upload import READ_METHODS
    rng = np.random.default_rng(13)
    h2d = measure_h2d_gbps(1 << 16 if smoke else 1 << 30)
    with tempfile.TemporaryDirectory(dir=os.environ.get("ENGRAM_BENCH_TMP")) as tmp:
        warm_path = Path(tmp) / "warmup.gguf"
        write_sparse_model(warm_path, shape, 0.0005, rng)
        _timed_build(warm_path, lambda *_: None, "warm-up")
        path = Path(tmp) / "sparse.gguf"
        table_bytes = write_sparse_model(path, shape, table_gib, rng)
        fs = filesystem_of(path)
        first = _timed_build(path, log, "first read of the file")
        cached = _timed_build(path, log, "from the page cache")
        other = next(m for m in READ_METHODS if m != cached["read_method"])
        try:        # a comparison only: its failure (say, device memory not yet released) is recorded
            variant = _timed_build(path, log, "from the page cache", read=other)
            variant.pop("build_report")
        except Exception as exc:   # noqa: BLE001
            variant = {"error": f"{type(exc).__name__}: {exc}", "gbps": None}
            log(f"engine_build reading with {other}: {variant['error']}")
    nbytes, secs = cached["bytes"], cached["seconds"]
    report = cached.pop("build_report")
    first.pop("build_report")
    rec = {"stage": "engine_build", "T": 0, "time_us": round(secs * 1e6, 1),
           "floor_us": round(nbytes / (h2d * 1e9) * 1e6, 1), "pct_of_floor": round(100 * nbytes / (h2d * 1e9) / secs, 1),
           "bytes": int(nbytes), "flops": 0, "gbps": round(nbytes / secs / 1e9, 2), "tflops": None,
           "baselines": {}, "kernel": "EngramV41(device_tables=True) from a sparse GGUF in the page cache",
           "seconds": round(secs, 3), "open_seconds": cached["open_seconds"], "table_bytes": int(table_bytes),
           "h2d_pinned_gbps": round(h2d, 1), "filesystem": fs,
           "page_cache_resident_before": cached["page_cache_resident_before"],
           **{k: cached[k] for k in ("read_gb_per_s", "read_gb_per_s_per_thread", "copy_gb_per_s", "threads",
                                     "chunk_bytes", "n_buffers", "pinned_alloc_seconds", "wait_read_seconds",
                                     "wait_copy_seconds", "device_free_gb_before")},
           "read_method": cached["read_method"], "first_read": first, f"page_cache_{other}": variant,
           "build_report": report}
    pct = {k: 100 * (b["page_cache_resident_before"] or 0) for k, b in (("cached", rec), ("first", first))}
    log(f"engine_build: {rec['gbps']} GB/s from the page cache ({pct['cached']:.0f}% resident, {fs}), "
        f"{first['gbps']} GB/s on the first read ({pct['first']:.0f}% resident); {variant['gbps']} GB/s from the "
        f"page cache reading with {other}; pinned H2D floor {h2d:.1f} GB/s")
    return rec


# ---- entry point --------------------------------------------------------------------------------

PARTS = ("proj", "decode_step", "engine_build")

def run(shape: BenchShape = RELEASED, quick: bool = False, log=print, *, decode_table_gb: float | None = None,
        build_table_gib: float | None = None, n_tokens: int | None = None,
        parts=PARTS, proj_weights=("q2k", "fp8")) -> dict:
    """The decode-path records (module doc). decode_table_gb: random table per layer for decode_step
    (default 1.5 GB, tiny in the simulator); build_table_gib: per layer for engine_build (default the
    released 30 GiB, or $ENGRAM_BUILD_TABLE_GIB); n_tokens: decode_step's sequence (default 1024
    with quick, else 2048); proj_weights: the wkv encodings of the projection records (q2k, fp8)."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:       # before any device work: a misspelt part would otherwise give no records, silently
        raise ValueError(f"decode bench: unknown part(s) {unknown}; the parts are {list(PARTS)}")
    unknown = sorted(set(proj_weights) - {"q2k", "fp8"})
    if unknown:
        raise ValueError(f"decode bench: unknown projection weight(s) {unknown}; they are ['q2k', 'fp8']")
    from numba.cuda import config
    smoke = bool(config.ENABLE_CUDASIM) or shape.name != RELEASED.name
    timer = DeviceTimer()
    copy_gbps = measure_copy_gbps(timer)
    out = {"records": [], "decode": {}}
    if decode_table_gb is None:
        decode_table_gb = 0.0005 if smoke else 1.5
    if build_table_gib is None:
        build_table_gib = float(os.environ.get("ENGRAM_BUILD_TABLE_GIB", 0.0005 if smoke else RELEASED_TABLE_GIB))
    if "proj" in parts:
        out["records"] += bench_projection_q(shape, quick, log, timer, copy_gbps, smoke, proj_weights)
    if "decode_step" in parts:
        rec, info = bench_decode_step(shape, quick, log, timer, copy_gbps, smoke, decode_table_gb, n_tokens)
        out["records"].append(rec)
        out["decode"]["decode_step"] = info
    if "engine_build" in parts:
        rec = bench_engine_build(shape, log, build_table_gib, smoke)
        out["records"].append(rec)
    return out


def add_to(result: dict, shape: BenchShape, quick: bool, log=print) -> dict:
    """Run the decode records and merge them into a suite result (records + result["decode"])."""
    out = run(shape, quick, log)
    result.setdefault("records", []).extend(out["records"])
    result["decode"] = out["decode"]
    return result
