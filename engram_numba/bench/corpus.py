"""Benchmark `corpus_stats`: corpus statistics end to end on the GPU at the released shapes.

    python -m engram_numba.bench.corpus [--table-gb 32] [--quick] [--out corpus.json]
    engram-numba bench ...          (the suite calls `run` and adds its records)

Setup (nothing is read from disk): the released configuration (dim 5120, hc 4, layers 1 and 14,
24 hash columns, the real hash constants' recipe with the compressed vocabulary 99,092 as the
token map), random bf16 `wkv` and gate vectors, and device-resident Q2_K tables filled with
random finite rows. `table_gb` sets each layer's table size through the prime search's start:
the default, 32.3 GB a layer, is the released size (384M rows, two tables, 65 GB of the H200's
139 GiB); a smaller value keeps the run quick. The corpus is synthetic token ids (a Zipf law over
the compressed vocabulary, documents of 256..4096 tokens, each a fresh sequence), packed into
4096-token chunks.

Records (stage "corpus_stats", one per highway source), each with:
    tokens_per_s        end to end: hash (producer thread), gather + decode + projection + gate of
                        both layers (device), dot and gate back, every streaming statistic (reducer
                        thread), as `corpus_stats` runs them
    device_sum_us       the sum of the stages' device times for one 4096-token chunk, measured
                        apart with CUDA events (gather, projection, gate per layer, and the
                        highway's arrival: a device-to-device refresh or the host-to-device copy)
    time_us             wall time per 4096-token chunk (= 4096 / tokens_per_s)
    ratio_to_device_sum time_us / device_sum_us (1.0 = the host work hides entirely behind the GPU)
highway sources: "device" (already on the device: a device-to-device refresh per chunk, as the gate
updates it in place; the reducer's arrangement LANES = "contexts": each chunk's layers on the pool,
waited for), "device, layers on lanes" (the same with each layer on a lane of its own too:
analysis.corpus.LANES = "all", the default; also with --quick), "device, gate
statistics only" (contexts and row bitmaps off: what the host reduction costs), "host pinned" and
"host pageable" (the highway copied from host memory every chunk: 4096 x 4 x 5120 x 4 B = 335 MB,
so PCIe bounds it; `h2d_gbps` and `h2d_bound_tokens_per_s` say where). Plus peak host memory
(getrusage) and peak device memory (the lowest free memory seen) of the run.

Host tables (unless --no-host): the same corpus with both tables in pinned host memory (shrunk to
what `MemAvailable` holds, and said so): no prefetch, prefetch (the fetch grid swept, or only
the default with --quick), prefetch + a static cache at each --cache-gb budget (hit rate, host
and cache bytes per chunk); random rows read from pinned memory against the device table and
the copy floor; `decode_step` with device tables, host tables (both layers' rows fetched in one
launch inside the graph) and host tables with the next token fetched ahead (`prefetch_decode`).
Every corpus_stats and decode_step record has `tables` and `cache_gb`. --quick (two device-table
variants, 8 chunks, the default grid, 256 decode tokens) is meant to fit ~150 s on an H200 with
the released 32 GB tables, most of it pinning 64.5 GB (42 s measured) and compiling.
--smoke (tiny shapes in the simulator, which compiles nothing and captures no graph: the first
variant's warm-up only, one decode token and no warm-up one, the FP8 model's two device-table
variants only) checks that every variant runs end to end.
"""
from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np

from .timing import RELEASED, BenchShape, DeviceTimer, commit, device_name

CHUNK = 4096
# The warm-up's context cap: so small that its two documents prune every context table, so the
# prune's @njit functions are compiled (or loaded from numba's cache) before anything is timed.
# With the default cap the first prune comes some chunks into the first timed run, and its
# compile (1.2 s on a 2-core VM, the GIL held: every thread stalls) lands on whichever variant
# runs first in a fresh process.
WARM_MAX_CONTEXTS = 8


class TiledTable:
    """A [rows, 84] Q2_K table that repeats one block of random finite rows, made row range by
    row range on demand (what the host-table run copies into pinned memory, without holding a
    second 32 GB copy in pageable memory)."""

    def __init__(self, n_rows: int, block: np.ndarray):
        self.shape = (int(n_rows), int(block.shape[1]))
        self.dtype = np.dtype(np.uint8)
        self.block = block                                  # [B, 84]
        self.nbytes = self.shape[0] * self.shape[1]

    def __getitem__(self, sl):
        if not isinstance(sl, slice):
            rows = np.asarray(sl, dtype=np.int64)
            return self.block[rows % self.block.shape[0]]
        r0, r1, step = sl.indices(self.shape[0])
        B = self.block.shape[0]
        if step == 1 and r0 % B + (r1 - r0) <= B:
            return self.block[r0 % B: r0 % B + (r1 - r0)]
        return self.block[np.arange(r0, r1, step) % B]


class _NoReader:
    def __init__(self, n_rows: int):
        self.n_rows = n_rows

    def read(self, ids):  # pragma: no cover - the bench gathers on the device only
        raise RuntimeError("the bench model has no host tables: rows are gathered from the device tables")


MODELS = {
    "q2k": {"table": "q2k: 84-byte Q2_K rows (the GGUF's)", "wkv": "bf16 [{N}, {K}]"},
    "fp8": {"table": "fp8: e4m3 codes [rows, 256] + e8m0 scales [rows, 8] (264 B a row, DeepSeek's HF checkpoint)",
            "wkv": "fp8: e4m3 codes [{N}, {K}] + e8m0 scales [{NS}, {KS}], one per 32x32 tile (the HF checkpoint's)"},
}
FP8_PROJ = ("decode", "bf16")    # besides these, a DeepSeek-arithmetic record name (gemm_fp8_v*)


def fp8_wkv(N: int, K: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A random FP8 wkv: e4m3 codes [N, K] with exponent fields 0..7 (|code| <= 1.875) and e8m0 tile
    scales [ceil(N/32), K/32] of 2^-7..2^-5, so values stay near a trained projection's (|w| <= 0.06)."""
    codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
    codes &= np.uint8(0xBF)                                  # exponent field 0..7 (bit 6 clear): never NaN
    scales = rng.integers(120, 123, (-(-N // 32), K // 32), dtype=np.uint8)
    return codes, scales


class BenchModel:
    """The released shapes with random weights and no host tables (the protocol's fields that
    the pipeline, the engine and corpus_stats use). kind: "q2k" (Q2_K tables, bf16 wkv: the GGUF
    model) or "fp8" (FP8 tables with separate scales, FP8 wkv: DeepSeek's HF checkpoint's
    encodings); MODELS says what each holds."""

    def __init__(self, shape: BenchShape, table_rows_per_col: int, seed: int = 0, block_rows: int = 1 << 20,
                 kind: str = "q2k"):
        if kind not in MODELS:
            raise ValueError(f"bench model kind must be one of {list(MODELS)}, got {kind!r}")
        self.kind = kind
        from ..config import COMPRESSED_VOCAB_SIZE, EngramConfig
        from ..stages.hash.tables import EngramHashTables
        from ..bf16 import f32_to_bf16
        from ..formats.model import EngramLayer
        cols = shape.cols
        n_heads = cols // 3 if cols % 3 == 0 else cols
        max_ngram = cols // n_heads + 1
        self.config = EngramConfig(dim=shape.dim, hc=shape.hc, layer_ids=(1, 14), max_ngram_size=max_ngram,
                                   n_heads=n_heads, head_dim=shape.head_dim)
        vocab = COMPRESSED_VOCAB_SIZE if shape.name == RELEASED.name else 64
        self.hash_tables = EngramHashTables.build((1, 14), max_ngram, n_heads, int(table_rows_per_col),
                                                  np.arange(vocab), 2)
        rng = np.random.default_rng(seed)
        cfg = self.config
        self.layers = {}
        from ..stages.rows.encodings import random_raw_rows
        block = random_raw_rows(kind, int(min(block_rows, self.hash_tables.table_rows.max())), rng)
        scales = None
        if kind == "fp8":             # codes and scales apart, as the checkpoint stores them; scales 2^-11..2^-9
            block, scales = np.ascontiguousarray(block[:, :256]), rng.integers(116, 119, (block.shape[0], 8), dtype=np.uint8)
        for li, lid in enumerate(cfg.layer_ids):
            rows = int(self.hash_tables.table_rows[li])
            if kind == "fp8":
                wkv, wkv_scales = fp8_wkv(cfg.proj_out, cfg.proj_in, rng)
            else:
                wkv = f32_to_bf16((rng.standard_normal((cfg.proj_out, cfg.proj_in), dtype=np.float32) * 0.02))
                wkv_scales = None
            # the table repeats one block of random rows (copied only by a host-table engine)
            self.layers[lid] = EngramLayer(
                lid, li, table=TiledTable(rows, block), table_encoding=kind,
                table_scales=None if scales is None else TiledTable(rows, scales),
                wkv_raw=wkv, wkv_encoding="fp8" if kind == "fp8" else "bf16", wkv_scales=wkv_scales,
                q_weight=(1 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32),
                k_weight=(1 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32))
        self.path = (f"bench model ({shape.name} shapes, {kind} encodings, random weights, "
                     f"{int(self.hash_tables.table_rows[0]):,} rows a table)")
        self.format = f"in memory (random {kind} tables on the device)"
        self.tokenizer_path = None
        self.problems: list[str] = []

    def rows(self, layer_id):
        return _NoReader(self.layers[layer_id].n_rows)


def _fill_device_table(n_rows: int, block_rows: np.ndarray, cuda):
    """A device table [n_rows, width] of random finite rows (Q2_K rows, or FP8 codes or scales):
    one random block uploaded, then repeated by device-to-device copies (gathers read random rows
    all over it, as in use); the same bytes as the model's TiledTable, so host and device tables
    give the same results."""
    table = cuda.device_array((n_rows, int(block_rows.shape[1])), dtype=np.uint8)
    block = cuda.to_device(block_rows)
    for r0 in range(0, n_rows, block.shape[0]):
        n = min(block.shape[0], n_rows - r0)
        table[r0:r0 + n].copy_to_device(block[:n])
    cuda.synchronize()
    return table


def _documents(n_tokens: int, vocab: int, rng, lo: int = 256, hi: int = 4096) -> list[np.ndarray]:
    """Synthetic documents: Zipf(1.1) token ids over the compressed vocabulary (so n-grams repeat
    as in text), lengths uniform in [lo, hi)."""
    docs, total = [], 0
    while total < n_tokens:
        n = min(int(rng.integers(lo, hi)), n_tokens - total)
        ids = (rng.zipf(1.1, n) - 1) % vocab
        docs.append(ids.astype(np.int64))
        total += n
    return docs


class _Memory:
    """Peak host memory (ru_maxrss) and the lowest free device memory seen."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.total = None
        self.min_free = None
        self.sample()

    def sample(self) -> None:
        try:
            free, total = self.cuda.current_context().get_memory_info()
        except Exception:  # pragma: no cover - no memory info
            return
        if not (np.isfinite(free) and np.isfinite(total)):   # the simulator reports infinities
            return
        self.total = int(total)
        self.min_free = int(free) if self.min_free is None else min(self.min_free, int(free))

    def report(self) -> dict:
        out = {"peak_host_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)}
        if self.total is not None:
            out["peak_device_gb"] = round((self.total - self.min_free) / 1e9, 2)
            out["device_total_gb"] = round(self.total / 1e9, 2)
        return out


class BenchSource:
    """The bench model as a Dask worker opens it (`distributed_corpus_stats`' model protocol):
    the same random weights (same seed), and device tables filled on the worker's own GPU."""

    def __init__(self, shape_name: str, rows_per_col: int, chunk: int):
        self.shape_name, self.rows_per_col, self.chunk = shape_name, int(rows_per_col), int(chunk)

    @property
    def key(self) -> str:
        return f"bench:{self.shape_name}:{self.rows_per_col}:{self.chunk}"

    def model(self) -> BenchModel:
        from .timing import RELEASED, SMOKE
        return BenchModel(RELEASED if self.shape_name == RELEASED.name else SMOKE, self.rows_per_col)

    def open(self, settings: dict):
        from numba import cuda

        from ..engine import EngramV41
        model = self.model()
        eng = EngramV41(model, max_tokens=self.chunk, device_tables=False)
        for lid in model.config.layer_ids:            # the same bytes as the in-process run's tables
            eng.layers[lid].table = _fill_device_table(model.layers[lid].n_rows, model.layers[lid].table.block, cuda)
            eng.layers[lid].placement = "device"
        return model, eng


def _shards_of(docs, shard_tokens: int) -> int:
    """Documents per shard for shards of about `shard_tokens` tokens (documents are never split)."""
    mean = sum(int(d.size) for d in docs) / max(len(docs), 1)
    return max(1, int(round(shard_tokens / max(mean, 1.0))))


def _dask_name(dask_worker=None) -> str:
    """On a worker (client.run): its name as the run summary gives it."""
    return str(dask_worker.name if dask_worker.name is not None else dask_worker.address)


def _network_bytes(dist, out, plan_docs) -> dict:
    """What crosses the network per shard, measured: a task's arguments as Dask pickles them (the
    shard's description and settings; with documents= also its token ids), and a shard's
    statistics as a merge or the client receives them (PartialStats, pickled), and its part file."""
    import pickle
    from pathlib import Path

    from ..analysis.partfile import PartialStats, read_part
    parts = sorted((Path(out) / dist.PARTS).glob("shard-*.npz"))
    if not parts:
        return {}
    st = PartialStats.of(read_part(parts[0]))
    t0 = time.perf_counter()
    state = pickle.dumps(st, protocol=5)
    pickle_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pickle.loads(state)
    unpickle_s = time.perf_counter() - t0
    return {"bytes_in_per_shard_with_documents": int(plan_docs),
            "bytes_out_per_shard": len(state), "part_file_bytes_per_shard": int(sum(p.stat().st_size for p in parts)
                                                                                  / len(parts)),
            "pickle_s": round(pickle_s, 3), "unpickle_s": round(unpickle_s, 3)}


def run_distributed(model, eng, docs, shape: BenchShape, rows_per_col: int, chunk: int, workers: int = 2,
                    log=print, docs_per_shard: int | None = None, shard_tokens: int = 1 << 21,
                    build_s: float | None = None) -> list[dict]:
    """The corpus_stats_distributed records: the same corpus and settings as corpus_stats (device
    tables, the synthetic highway cached on the device), in process, then through Dask: `workers`
    worker processes sharing this one GPU (each with its own engine and tables: the scheduler's
    overhead), then one worker alone (the in-process ratio). Shards of about `shard_tokens` tokens
    (or docs_per_shard documents). Frees `eng`'s tables first.

    Each record has the ratio to in process three ways: inside the tasks (steady state: what a
    long study converges to), end to end (the run's wall time: first task to the merged state on
    the client, every part file on disk), and end to end with start-up (cluster start, model and
    engine build, warm-up; in process: its engine build and warm-up: build_s + the warm runs)."""
    import gc
    import pickle
    import tempfile

    from numba import cuda

    from ..analysis import distributed as dist
    from ..analysis.corpus import DeviceSyntheticBlocks, corpus_stats
    cfg = model.config
    synth = DeviceSyntheticBlocks(cfg.hc, cfg.dim, chunk)
    synth.device(np.arange(chunk))                                          # the blocks, cached
    kw = dict(backend="cuda", chunk_tokens=chunk)
    t0 = time.perf_counter()
    dist.warm_run(lambda d: corpus_stats(model, documents=d, engine=eng, device_highway=synth.device, **kw),
                  model, chunk)
    warm_in = time.perf_counter() - t0
    st = corpus_stats(model, documents=docs, engine=eng, device_highway=synth.device, **kw)
    wall_in = st.meta["timing"]["wall_s"]
    tps_in = st.n_tokens / wall_in
    log(f"  in process: {st.n_tokens:,} tokens, {tps_in:,.0f} tokens/s")
    per = docs_per_shard or _shards_of(docs, shard_tokens)
    from .worker_gil import cpu_diff, thread_cpu
    same = []                       # in process again, shard by shard: the tasks' own baseline
    cpu0 = thread_cpu()
    for a in range(0, len(docs), per):
        sst = corpus_stats(model, documents=docs[a:a + per], engine=eng, device_highway=synth.device, **kw)
        same.append({"shard": len(same), "seconds": round(sst.meta["timing"]["wall_s"], 3), "tokens": sst.n_tokens,
                     "timing": sst.meta["timing"]})
    tps_same = sum(d["tokens"] for d in same) / max(sum(d["seconds"] for d in same), 1e-9)
    cpu_same = cpu_diff(cpu0, thread_cpu(), sum(d["tokens"] for d in same) / 1e6)     # CPU s a million tokens
    log(f"  in process, shard by shard: {tps_same:,.0f} tokens/s; per shard "
        + ", ".join(f"{d['seconds']:.2f} s" for d in same))
    for lid in cfg.layer_ids:
        eng.layers[lid].table = None
    del synth, eng
    gc.collect()
    try:
        cuda.current_context().deallocations.clear()
    except AttributeError:                                                  # the simulator
        pass
    source = BenchSource(shape.name, rows_per_col, chunk)
    settings = dist._settings("cuda", chunk, None, "text", "line", None, True, 20, dist.DEFAULT_MAX_CONTEXTS, True,
                              True, "fp32", None)
    task_bytes = int(np.mean([len(pickle.dumps((None, docs[a:a + per], source, settings, "/out", {"sha256": "0" * 64}),
                                               protocol=5)) for a in range(0, len(docs), per)]))
    t0 = time.perf_counter()
    cluster = dist.local_cluster(workers, gpu=True, gpus=["0"], dashboard=False)
    from distributed import Client
    client = Client(cluster)
    records = []
    network = {}
    try:
        addrs = sorted(client.scheduler_info()["workers"])
        started = time.perf_counter() - t0
        warm = [client.submit(dist.warm_worker, source, settings, workers=[a], allow_other_workers=False, pure=False)
                for a in addrs]
        builds = {w["worker"]: w for w in client.gather(warm)}
        del warm                                                             # nothing held when workers go
        startup = time.perf_counter() - t0
        log(f"  {workers} Dask workers on the one GPU started in {started:.1f} s, built and warm in {startup:.1f} s "
            "(" + ", ".join(f"{k}: build {v['build_s']:.1f} s, warm {v['warm_s']:.1f} s" for k, v in sorted(builds.items()))
            + ")")
        for n in dict.fromkeys((workers, 1)):                               # `workers`, then one (once if 1)
            if n != len(client.scheduler_info()["workers"]):
                cluster.scale(n)
                deadline = time.time() + 120
                while len(client.scheduler_info()["workers"]) != n and time.time() < deadline:
                    time.sleep(0.2)
            cpu0 = client.run(thread_cpu)
            with tempfile.TemporaryDirectory() as out:
                got = dist.distributed_corpus_stats(source, documents=docs, docs_per_shard=per, out=out,
                                                    client=client, progress=False, log=lambda *a: None, **kw)
                if not network:
                    network = _network_bytes(dist, out, task_bytes)
            sm = got.meta["distributed"]
            cpu1 = client.run(thread_cpu)
            names = client.run(_dask_name)
            cpu_workers = {names.get(a, a): cpu_diff(cpu0[a], cpu1[a], max(sm["per_worker"].get(names.get(a, a), {})
                                                                             .get("tokens", 0), 1) / 1e6)
                           for a in cpu0 if a in cpu1}
            busy = sum(w["busy_s"] for w in sm["per_worker"].values())
            in_task = sm["tokens"] / busy * len(sm["per_worker"]) if busy else 0.0
            mine = [builds[w] for w in sm["per_worker"] if w in builds]
            start_n = started + max((b["build_s"] + b["warm_s"] for b in mine), default=0.0)
            with_start = sm["tokens"] / (sm["wall_s"] + start_n)
            in_with_start = st.n_tokens / (wall_in + (build_s or 0.0) + warm_in)
            rec = {"stage": "corpus_stats_distributed", "T": chunk, "variant": f"{n} Dask worker(s) on 1 GPU",
                   "workers": n, "shards": sm["shards"], "shard_tokens": int(sm["tokens"] / max(sm["shards"], 1)),
                   "n_tokens": sm["tokens"],
                   "tokens_per_s": round(sm["tokens_per_s"], 1),
                   "in_process_tokens_per_s": round(tps_in, 1),
                   "ratio_to_in_process": round(sm["tokens_per_s"] / tps_in, 3),
                   "in_task_tokens_per_s": round(in_task, 1),
                   "in_task_ratio_to_in_process": round(in_task / tps_in, 3),
                   "in_process_same_shards_tokens_per_s": round(tps_same, 1),
                   "in_task_ratio_to_same_shards": round(in_task / tps_same, 3),
                   "per_shard": sm["per_shard"], "in_process_per_shard": same,
                   "cpu_s_per_million_tokens": {"in_process_same_shards": cpu_same, "workers": cpu_workers},
                   "with_startup_tokens_per_s": round(with_start, 1),
                   "with_startup_ratio_to_in_process": round(with_start / in_with_start, 3),
                   "startup_s": {"cluster": round(started, 2), "workers": {w: builds[w] for w in sm["per_worker"]
                                                                           if w in builds},
                                 "in_process_build": None if build_s is None else round(build_s, 2),
                                 "in_process_warm": round(warm_in, 2)},
                   "wall_s": sm["wall_s"], "per_worker": sm["per_worker"],
                   "tail_s": {k: sm.get(f"tail_{k}_s") for k in ("merges", "parts", "finalize")},
                   "fixed_overhead_s": round(sm["wall_s"] - busy / max(len(sm["per_worker"]), 1), 3),
                   "network": network,
                   "time_us": round(1e6 * chunk / max(sm["tokens_per_s"], 1e-9), 1), "floor_us": 0.0, "bytes": 0,
                   "flops": 0, "gbps": 0.0, "tflops": 0.0, "baselines": {}, "kernel": "corpus_stats via Dask",
                   "validated": bool(got.n_tokens == st.n_tokens and got.n_documents == st.n_documents and
                                     np.array_equal(got.tok_count, st.tok_count) and
                                     all(np.array_equal(a, b) for a, b in zip(got.row_bitmaps, st.row_bitmaps))),
                   "same_gate_histogram": bool(np.array_equal(got.fine, st.fine))}
            records.append(rec)
            log(f"  through Dask, {n} worker(s) on the one GPU: {rec['tokens_per_s']:,.0f} tokens/s end to end "
                f"(x{rec['ratio_to_in_process']:.3f} of in process; {sm['shards']} shards of ~{rec['shard_tokens']:,} "
                f"tokens, wall {sm['wall_s']:.2f} s, fixed cost {rec['fixed_overhead_s']:.2f} s, tail {rec['tail_s']}), "
                f"{in_task:,.0f} tokens/s inside the tasks (x{rec['in_task_ratio_to_in_process']:.3f}), "
                f"x{rec['with_startup_ratio_to_in_process']:.3f} with start-up on both sides; same statistics: "
                f"{rec['validated']}")
            log("    per shard (task s / in process s; stage seconds in the task): " + "; ".join(
                f"{d['shard']}: {d['seconds']:.2f}/{same[d['shard']]['seconds']:.2f} "
                + " ".join(f"{k[:-2]} {v:.2f}" for k, v in d["timing"].items())
                for d in sm["per_shard"] if d["shard"] < len(same)))
            log(f"    CPU seconds a million tokens by thread: in process {cpu_same}; workers {cpu_workers}")
        log(f"  per shard over the network: {network}")
    finally:
        client.close()
        cluster.close()
    return records


def _h2d_gbps(timer: DeviceTimer, cuda, nbytes: int, pinned: bool) -> float:
    host = cuda.pinned_array(nbytes, dtype=np.uint8) if pinned else np.empty(nbytes, dtype=np.uint8)
    host[:] = 1
    dev = cuda.device_array(nbytes, dtype=np.uint8)
    us = timer(lambda: dev.copy_to_device(host), iters=5, flush=False)
    return nbytes / (max(us, 1e-3) * 1e-6) / 1e9


def run(shape: BenchShape = RELEASED, quick: bool = False, log=print, table_gb: float | None = None,
        n_chunks: int | None = None, distributed: int = 0, dist_chunks: int | None = None,
        host: bool = True, cache_gbs=(0.25, 1.0, 4.0), dist_shard_tokens: int = 1 << 21,
        cache_policies=("static", "clock"), model: str = "q2k", fp8_proj: str = "decode") -> dict:
    """The corpus_stats records (module doc). table_gb: each layer's table size in GB (default:
    the released 32.3 GB; the smoke shape uses a tiny table). distributed: also the
    corpus_stats_distributed records with this many Dask workers sharing the GPU (then one), over
    dist_chunks chunks (default n_chunks); needs the distributed extra.

    model: "q2k" (the GGUF's encodings) or "fp8" (the HF checkpoint's: FP8 table rows, FP8 wkv;
    device tables only, shrunk to what the device holds beside everything else unless table_gb
    says otherwise: two released FP8 tables, 2 x 101 GB, do not fit one 141 GB H200).
    fp8_proj: how the FP8 wkv is projected: "decode" (what the pipeline and the engine do by
    default: the FP8 wkv held as it is, decoded exactly to bf16 into a scratch before each
    layer's many-token GEMM, gemm_v4), "bf16" (decoded once at build, wkv_format="bf16"), or a
    DeepSeek-arithmetic record (gemm_fp8_v3, gemm_fp8_v4: act_quant + FP8 tensor-core GEMM)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")
    if model == "fp8":
        host = False                         # host-table runs and Dask workers are the Q2_K model's
        if distributed:
            raise ValueError("--distributed runs the Q2_K model only (its workers build the q2k bench model)")
    from numba import cuda

    from ..analysis.corpus import corpus_stats
    from ..engine import EngramV41
    from ..stages.hash.cpu import EngramHasher

    smoke = shape.name != RELEASED.name
    chunk = 4 if smoke else CHUNK
    if n_chunks is None:
        n_chunks = 2 if smoke else (8 if quick else 32)
    timer = DeviceTimer()
    mem = _Memory(cuda)
    rng = np.random.default_rng(11)
    row_bytes = 264 if model == "fp8" else 84
    fit_note = None
    if smoke:
        rows_per_col = 61
        cache_gbs = tuple(cache_gbs)[:1]     # the simulator checks the cached path once; budgets differ only in size
    elif model == "fp8" and table_gb is None:
        from ..config import ENGRAM_VOCAB_SIZE
        free, _ = cuda.current_context().get_memory_info()
        # beside the tables: both wkv (0.3 GB), workspaces (0.6 GB), the bf16 scratch or wkv (0.6 GB),
        # the bench's two highways (0.7 GB), kernels, act_quant buffers and slack
        fit = int((free - (8 << 30)) / 2 / row_bytes / shape.cols)
        rows_per_col = min(ENGRAM_VOCAB_SIZE, max(fit, 1024))
        if rows_per_col < ENGRAM_VOCAB_SIZE:
            fit_note = (f"FP8 tables shrunk to {rows_per_col / ENGRAM_VOCAB_SIZE:.0%} of the released rows: two "
                        f"released tables ({2 * ENGRAM_VOCAB_SIZE * shape.cols * row_bytes / 1e9:.0f} GB) do not fit "
                        f"the {free / 1e9:.0f} GB free on the device beside the rest")
            log(f"corpus bench: {fit_note}")
    elif table_gb is None:
        from ..config import ENGRAM_VOCAB_SIZE
        rows_per_col = ENGRAM_VOCAB_SIZE                     # the released tables: 384M rows, 32.3 GB each
    else:
        rows_per_col = max(int(table_gb * 1e9 / row_bytes / shape.cols), 1024)
    if host and not smoke:                 # both tables must fit in pinnable host memory: shrink if not
        from ..placement import HOST_RESERVE, host_available_bytes
        avail = host_available_bytes()
        if avail is not None:
            fit = int((avail - HOST_RESERVE - (12 << 30)) / 2 / 84 / shape.cols)
            if fit < rows_per_col:
                log(f"corpus bench: host memory ({avail / 1e9:.0f} GB available) holds two tables of "
                    f"{fit * shape.cols * 84 / 1e9:.1f} GB at most: both runs use that size")
                rows_per_col = max(fit, 1024)
    t0 = time.perf_counter()
    kind = model
    model = BenchModel(shape, rows_per_col, kind=kind)
    cfg = model.config
    proj_kw, proj_how = {}, "bf16 wkv: the bf16 projection (gemm_v4 at 4096 tokens)"
    if kind == "fp8":
        if fp8_proj == "decode":
            proj_how = ("fp8 wkv held as stored, decoded exactly to bf16 into a scratch before each layer's GEMM "
                        "(the pipeline's and engine's default for an FP8 wkv at many tokens), then the bf16 GEMM")
        elif fp8_proj == "bf16":
            proj_kw, proj_how = {"wkv_format": "bf16"}, "fp8 wkv decoded exactly to bf16 once at build, then the bf16 GEMM"
        else:
            from ..stages.proj.records import DEEPSEEK_FP8_VERSIONS
            if fp8_proj not in DEEPSEEK_FP8_VERSIONS:
                raise ValueError(f"fp8_proj must be one of {list(FP8_PROJ) + list(DEEPSEEK_FP8_VERSIONS)}, got {fp8_proj!r}")
            proj_kw = {"versions": {"proj": fp8_proj}}
            proj_how = f"DeepSeek's FP8 arithmetic: act_quant + {fp8_proj} (e4m3 tensor cores, fp32 promotion a K block)"
    eng = EngramV41(model, max_tokens=chunk, device_tables=False, **proj_kw)
    for lid in cfg.layer_ids:
        lay = model.layers[lid]
        eng.layers[lid].table = _fill_device_table(lay.n_rows, lay.table.block, cuda)
        if lay.table_scales is not None:
            eng.layers[lid].table_scales = _fill_device_table(lay.n_rows, lay.table_scales.block, cuda)
        eng.layers[lid].placement = "device"
    mem.sample()
    build_s = time.perf_counter() - t0
    table_gb_real = model.layers[1].n_rows * row_bytes / 1e9
    N, K = cfg.proj_out, cfg.proj_in
    encodings = {"model": kind, "table_encoding": MODELS[kind]["table"],
                 "wkv_encoding": MODELS[kind]["wkv"].format(N=N, K=K, NS=-(-N // 32), KS=K // 32),
                 "wkv_on_device": dict((str(k), v) for k, v in eng.wkv_format.items()), "projection": proj_how,
                 "table_rows": int(model.layers[1].n_rows)}
    if kind == "fp8":
        from ..config import ENGRAM_VOCAB_SIZE
        encodings["rows_per_col"] = int(rows_per_col)              # the prime search's start, as the released
        encodings["released_rows_per_col"] = None if smoke else int(ENGRAM_VOCAB_SIZE)   # tables' ENGRAM_VOCAB_SIZE
        encodings["tables_fit"] = ("tiny (simulator)" if smoke else fit_note or
                                   ("as given (--table-gb)" if table_gb is not None else "released size"))
    log(f"corpus bench: {model.path}; tables {table_gb_real:.1f} GB a layer on the device; {proj_how} "
        f"(setup {time.perf_counter() - t0:.1f} s)")
    vocab = model.hash_tables.token_map.size
    docs = _documents(n_chunks * chunk, vocab, rng, lo=2 if smoke else 256, hi=6 if smoke else 4096)
    T, HC, DIM = chunk, cfg.hc, cfg.dim

    # -- the stages' device times for one chunk (hash on the CPU, timed apart)
    hasher = EngramHasher(model.hash_tables, capacity=2 * T)
    toks = np.concatenate(docs)[:T]
    ids = hasher.hash(toks)
    hasher.reset()
    t_hash = []
    for _ in range(3 if not smoke else 1):
        hasher.reset()
        s = time.perf_counter()
        hasher.hash(toks)
        t_hash.append(time.perf_counter() - s)
    hash_us = 1e6 * min(t_hash)
    pristine = cuda.to_device(rng.standard_normal((T, HC, DIM), dtype=np.float32))       # [T, hc, dim]
    work = cuda.device_array((T, HC, DIM), dtype=np.float32)
    work.copy_to_device(pristine)
    iters = 3 if smoke else (5 if quick else 20)
    stage_us = {}
    for li, lid in enumerate(cfg.layer_ids):
        layer_ids = np.ascontiguousarray(ids[:, li, :])
        stage_us[f"L{lid}.rows"] = timer(lambda: eng.rows_from_ids(lid, layer_ids), iters=iters)
        stage_us[f"L{lid}.proj"] = timer(lambda: eng.project(lid), iters=iters)   # (a scratch decode: once, below)
        stage_us[f"L{lid}.gate"] = timer(lambda: eng.gate(lid, work), iters=iters)
    decoded = eng._plans.get(("proj", cfg.layer_ids[-1], T))
    if hasattr(decoded, "decode"):       # a q2k/fp8 wkv decoded to the shared bf16 scratch for many tokens:
        stage_us["wkv.decode"] = timer(decoded.decode, iters=iters)   # once a queued chunk (DeviceChunks)
    stage_us["highway.d2d"] = timer(lambda: work.copy_to_device(pristine), iters=iters)
    base_sum = sum(v for k, v in stage_us.items() if k != "highway.d2d")
    mem.sample()
    log(f"  stage device times for {T} tokens (us): " + ", ".join(f"{k} {v:.1f}" for k, v in stage_us.items())
        + f"; hash (CPU) {hash_us:.1f}")

    host_pinned = cuda.pinned_array((T, HC, DIM), dtype=np.float32)
    host_pinned[:] = np.asarray(pristine.copy_to_host())
    host_pageable = np.array(host_pinned)
    nbytes = T * HC * DIM * 4
    h2d = {"pinned": _h2d_gbps(timer, cuda, nbytes, True), "pageable": _h2d_gbps(timer, cuda, nbytes, False)}

    def from_device(positions):
        n = positions.size
        work[:n].copy_to_device(pristine[:n])
        return work[:n]

    def from_host(host):
        def fn(positions):
            n = positions.size
            work[:n].copy_to_device(host[:n])
            return work[:n]
        return fn

    records = []
    variants = [("device", from_device, True, stage_us["highway.d2d"]),
                ("device, layers on lanes", from_device, True, stage_us["highway.d2d"])]
    # --quick: the device-table run the host-table runs compare with. The simulator's FP8-model run keeps the
    # device-table runs only: the other highway sources (pinned, pageable, gate statistics only) are the same
    # code whatever the encodings, and the smoke's Q2_K-model run has them.
    if (smoke and kind == "q2k") or not (smoke or quick):
        variants += [("device, gate statistics only", from_device, False, stage_us["highway.d2d"]),
                     ("host pinned", from_host(host_pinned), True, nbytes / (h2d["pinned"] * 1e3)),
                     ("host pageable", from_host(host_pageable), True, nbytes / (h2d["pageable"] * 1e3))]
    from ..analysis import corpus as corpus_mod
    for name, source, full, highway_us in variants:
        # "layers on lanes": each layer on a lane of its own as well as each context order (LANES =
        # "all", the default); "device" keeps the layers on the pool, waited for; the same statistics
        lanes_default = corpus_mod.LANES
        corpus_mod.LANES = "all" if name.endswith("layers on lanes") else "contexts"
        try:
            # warm-up (the simulator compiles nothing: there, the first variant's only, so that the smoke
            # run still goes through it, and each further one would be seconds of simulated kernels)
            if not smoke or name == variants[0][0]:
                corpus_stats(model, documents=docs[:2], backend="cuda", engine=eng, device_highway=source,
                             chunk_tokens=chunk, contexts=full, rows=full, max_contexts=WARM_MAX_CONTEXTS)
            mem.sample()
            st = corpus_stats(model, documents=docs, backend="cuda", engine=eng, device_highway=source,
                              chunk_tokens=chunk, contexts=full, rows=full)
        finally:
            corpus_mod.LANES = lanes_default
        mem.sample()
        same = same_as_device = None
        if name == "device":
            device_st = st
        elif name.endswith("layers on lanes"):     # the same statistics as the default, bit for bit
            from ..analysis.stats import state_equal
            for x in (st, device_st):
                x.finish()
                for t in x.contexts.values():
                    t._sorted()
            same_as_device = bool(state_equal(st, device_st, skip=("tokenizer", "meta")))
            device_st = None
            log(f"  layers on lanes vs waited for over {st.n_tokens:,} tokens: same statistics {same_as_device}")
        if name == "device":         # queued ahead vs one chunk at a time: the same statistics, bit for bit
            from ..analysis.stats import state_equal
            few = docs[: max(1, len(docs) // 8)] if not smoke else docs
            # the smoke's queued-ahead run is the one just made (the same documents, the same call)
            a = st if few is docs else corpus_stats(model, documents=few, backend="cuda", engine=eng,
                                                    device_highway=source, chunk_tokens=chunk, contexts=full,
                                                    rows=full)
            b = corpus_stats(model, documents=few, backend="cuda", engine=eng, device_highway=source,
                             chunk_tokens=chunk, contexts=full, rows=full, pipelined=False)
            for x in (a, b):
                x.finish()
                for t in x.contexts.values():
                    t._sorted()
            same = bool(state_equal(a, b, skip=("tokenizer", "meta")) and isinstance(a.meta["device_chunks"], dict))
            log(f"  queued-ahead chunks vs one chunk at a time over {a.n_tokens:,} tokens: same statistics {same}")
        wall = st.meta["timing"]["wall_s"]
        tps = st.n_tokens / wall
        dev_sum = base_sum + highway_us
        time_us = 1e6 * chunk / tps
        rec = {"stage": "corpus_stats", "T": chunk, "variant": name, "tokens_per_s": round(tps, 1),
               "time_us": round(time_us, 1), "floor_us": round(dev_sum, 1), "device_sum_us": round(dev_sum, 1),
               "pct_of_floor": round(100.0 * dev_sum / time_us, 1), "ratio_to_device_sum": round(time_us / dev_sum, 3),
               "device_sum_tokens_per_s": round(1e6 * chunk / dev_sum, 1), "n_tokens": st.n_tokens,
               "n_documents": st.n_documents, "hash_us_per_chunk": round(hash_us, 1),
               "stage_us": {k: round(v, 1) for k, v in stage_us.items()},
               "timing_s": st.meta["timing"], "statistics": "full" if full else "gate only (contexts, rows off)",
               "bytes": 0, "flops": 4 * chunk * cfg.proj_in * cfg.proj_out, "gbps": 0.0,
               "tflops": round(4 * chunk * cfg.proj_in * cfg.proj_out / (time_us * 1e-6) / 1e12, 2),
               "baselines": {}, "kernel": "+".join(f"{k}:{v}" for k, v in st.meta.get("cuda_kernels", {}).items()),
               "validated": bool(np.isfinite(st[1, 0].mean) and st.n_tokens == sum(d.size for d in docs)
                                 and same is not False and same_as_device is not False),
               "same_statistics_one_chunk_at_a_time": same, "same_statistics_as_device_variant": same_as_device,
               "tables": "device", "cache_gb": 0.0, **encodings,
               "device_chunks": st.meta.get("device_chunks")}
        if name.startswith("host"):
            kind = name.split()[1]
            rec["h2d_gbps"] = round(h2d[kind], 1)
            rec["h2d_us_per_chunk"] = round(highway_us, 1)
            rec["h2d_bound_tokens_per_s"] = round(1e6 * chunk / highway_us, 1)
            rec["bound"] = (f"PCIe host-to-device ({kind}): {h2d[kind]:.1f} GB/s moves the {nbytes / 1e6:.0f} MB "
                            f"highway of a chunk in {highway_us:.0f} us, {1e6 * chunk / highway_us:,.0f} tokens/s "
                            "at most, before any compute")
        records.append(rec)
        log(f"  corpus_stats [{name}]: {tps:,.0f} tokens/s end to end, {time_us:.0f} us a chunk vs device sum "
            f"{dev_sum:.0f} us (x{time_us / dev_sum:.2f}); producer {st.meta['timing']['produce_s']:.2f} s, "
            f"gates {st.meta['timing']['gates_s']:.2f} s (waiting for the device "
            f"{st.meta['timing'].get('gates_wait_s', float('nan')):.2f} s), reduce {st.meta['timing']['reduce_s']:.2f} s, "
            f"wall {wall:.2f} s; CPU seconds by thread: "
            + (", ".join(f"{k[:-6]} {v:.2f}" for k, v in st.meta["timing"].items() if k.endswith("_cpu_s")) or "-")
            + (f"; {rec['bound']}" if "bound" in rec else ""))
    host_info = None
    if host:
        host_info = _host_runs(model, eng, docs, chunk, timer, mem, log, cache_gbs, smoke, records[0], from_device,
                               h2d["pinned"], base_sum + stage_us["highway.d2d"], quick=quick,
                               cache_policies=cache_policies)
        records += host_info.pop("records")
    if distributed:
        ddocs = docs if dist_chunks is None else _documents(dist_chunks * chunk, vocab, np.random.default_rng(12),
                                                             lo=2 if smoke else 256, hi=6 if smoke else 4096)
        records += run_distributed(model, eng, ddocs, shape, rows_per_col, chunk, workers=int(distributed), log=log,
                                   shard_tokens=(4 if smoke else dist_shard_tokens), build_s=build_s)
    memory = mem.report()
    for r in records:
        r.update(memory)
        r["table_gb_per_layer"] = round(table_gb_real, 2)
    log(f"  memory: {memory}")
    return {"records": records, "memory": memory, "h2d_gbps": {k: round(v, 1) for k, v in h2d.items()},
            "table_gb_per_layer": round(table_gb_real, 2), "host_tables": host_info, "model": encodings}


def token_ids_by_layer(model, docs) -> list:
    """Each layer's row ids [n, C] over documents hashed one by one (as corpus_stats does)."""
    from ..stages.hash.cpu import EngramHasher
    hasher = EngramHasher(model.hash_tables, capacity=max(d.size for d in docs) + 8)
    per = [[] for _ in model.config.layer_ids]
    for d in docs:
        hasher.reset()
        ids = hasher.hash(d)
        for li in range(len(per)):
            per[li].append(ids[:, li, :])
    return [np.concatenate(p) for p in per]


def _host_runs(model, dev_eng, docs, chunk, timer, mem, log, cache_gbs, smoke, device_rec, from_device,
               h2d_pinned_gbps, device_sum_us, quick: bool = False, cache_policies=("static", "clock")) -> dict:
    """The same corpus with both tables in pinned host memory (module doc): no prefetch, prefetch,
    prefetch + a static cache at each budget, prefetch + the dynamic (CLOCK) cache at each budget
    (empty at the start, and warm-started from the ranked rows); the random-row read rate from
    pinned memory; decode tokens on host against device tables."""
    from numba import cuda

    from ..analysis.corpus import PREFETCH_DEPTH, corpus_stats
    from ..device.hostrows import FETCH_BLOCKS, FETCH_THREADS, cache_hit_rates, fetch_rows_v1, rank_rows
    from ..engine import EngramV41
    from ..placement import PlacementError
    from ..stages.hash.cpu import EngramHasher
    cfg = model.config
    out = {"records": []}
    t0 = time.perf_counter()
    try:
        static_gb = max(cache_gbs) if cache_gbs and "static" in cache_policies else None
        host = EngramV41(model, max_tokens=chunk, tables="host", cache_gb=static_gb)
    except PlacementError as exc:
        log(f"  host tables: refused ({exc})")
        out["refused"] = str(exc)
        return out
    out["build_s"] = round(time.perf_counter() - t0, 1)
    out["build_report"] = {k: v for k, v in host.build_report.items() if k != "uploads"}
    out["pinned_gb"] = round(host.host_bytes / 1e9, 2)
    mem.sample()
    log(f"  host tables: {out['pinned_gb']} GB pinned in {out['build_s']} s; placement {host.build_report['placement']}")

    # -- random rows from pinned host memory: the fetch kernel, against the same from the device table
    rng = np.random.default_rng(5)
    lid = cfg.layer_ids[0]
    hl = host._fetcher.layers[lid]
    n_rows = host.layers[lid].n_rows
    gather = {}
    for n in ((64,) if smoke else (4096, 98304) if quick else (4096, 98304, 1 << 20)):
        ids = cuda.to_device(rng.integers(0, n_rows, n, dtype=np.int64))
        outb = cuda.device_array((n, hl.W), dtype=hl.words)
        nocache = cuda.to_device(np.full(1, -1, np.int32))
        hits = cuda.to_device(np.zeros(1, np.int64))
        dev_words = dev_eng.layers[lid].table.view(hl.words)
        row = {}
        full = (n * hl.W + FETCH_THREADS - 1) // FETCH_THREADS
        for name, src, grid in (("host", hl.word_parts[0], full), ("device", dev_words, full),
                                (f"host, {FETCH_BLOCKS} blocks", hl.word_parts[0], min(full, FETCH_BLOCKS))):
            def fetch(src=src, grid=grid):
                fetch_rows_v1[grid, FETCH_THREADS](src, src, hl.cache.table, nocache, ids, outb, hits, 0)
            us = timer(fetch, iters=1 if smoke else 20, flush=False)
            row[name] = {"us": round(us, 1), "rows_per_s": round(n / (us * 1e-6)), "gbps": round(n * 84 / (us * 1e-6) / 1e9, 2)}
        row["copy_floor_rows_per_s"] = round(h2d_pinned_gbps * 1e9 / 84)
        gather[n] = row
        log(f"  random rows from pinned host memory, {n} rows: {row['host']['rows_per_s'] / 1e6:.1f} M rows/s "
            f"({row['host']['gbps']} GB/s; {row[f'host, {FETCH_BLOCKS} blocks']['rows_per_s'] / 1e6:.1f} M rows/s "
            f"with {FETCH_BLOCKS} blocks); device table {row['device']['rows_per_s'] / 1e6:.0f} M rows/s; "
            f"bulk-copy floor {row['copy_floor_rows_per_s'] / 1e6:.0f} M rows/s ({h2d_pinned_gbps:.1f} GB/s)")
    out["random_row_reads"] = gather

    # -- the static cache: ranked from a training corpus of the same law, measured on the bench corpus
    vocab = model.hash_tables.token_map.size
    n_tok = sum(d.size for d in docs)
    train_docs = _documents(n_tok, vocab, np.random.default_rng(99), lo=2 if smoke else 256, hi=6 if smoke else 4096)
    train = token_ids_by_layer(model, train_docs)
    test = token_ids_by_layer(model, docs)
    ranked = {l_: rank_rows(train[li]) for li, l_ in enumerate(cfg.layer_ids)}
    slots = {gb: int(gb * 1e9) // 84 for gb in cache_gbs}
    out["hit_rate_host_model"] = {str(gb): {str(l_): round(cache_hit_rates(train[li], test[li], [s])[s], 4)
                                            for li, l_ in enumerate(cfg.layer_ids)} for gb, s in slots.items()}
    out["distinct_train_rows"] = {str(l_): int(ranked[l_].size) for l_ in cfg.layer_ids}

    def totals():
        rep = host.cache_report()
        return ({l_: (rep[l_]["hits"], rep[l_]["misses"], rep[l_].get("inserted", 0)) for l_ in host.host_layers},
                dict(rep["prefetch"]))

    variants = [("host tables, no prefetch", False, 0.0, FETCH_BLOCKS, "static", False)]
    grids = (FETCH_BLOCKS,) if quick else sorted({0, 16, 64, FETCH_BLOCKS, 256})
    variants += [(f"host tables, prefetch, fetch grid {b or 'full'}", True, 0.0, b, "static", False) for b in grids]
    if "static" in cache_policies:
        variants += [(f"host tables, prefetch, cache {gb:g} GB a layer", True, gb, FETCH_BLOCKS, "static", True)
                     for gb in cache_gbs]
    if "clock" in cache_policies:
        for gb in (cache_gbs[-1:] if smoke else cache_gbs):              # the simulator: one budget is enough
            variants += [(f"host tables, prefetch, clock cache {gb:g} GB a layer", True, gb, FETCH_BLOCKS, "clock", False),
                         (f"host tables, prefetch, clock cache {gb:g} GB a layer, warm-started", True, gb, FETCH_BLOCKS,
                          "clock", True)]
    dev_tps = device_rec["tokens_per_s"]
    for name, pre, gb, blocks, policy, filled in variants:
        host._fetcher.max_blocks = blocks
        if policy == "clock":
            host.set_cache(gb, "clock")
            if filled:
                for l_ in cfg.layer_ids:
                    host.fill_cache(l_, ranked[l_], ranked=True)
        elif static_gb:
            for l_ in cfg.layer_ids:
                host.fill_cache(l_, ranked[l_][: slots.get(gb, 0)], ranked=True) if gb else host.fill_cache(l_, [], ranked=True)
        # warm-up (kernels compiled; not the corpus): in the simulator, which compiles nothing, the first
        # variant's only (as the device-table variants above)
        if not smoke or name == variants[0][0]:
            corpus_stats(model, documents=train_docs[:2], backend="cuda", engine=host, device_highway=from_device,
                         chunk_tokens=chunk, prefetch=pre)
        before, pf0 = totals()
        st = corpus_stats(model, documents=docs, backend="cuda", engine=host, device_highway=from_device,
                          chunk_tokens=chunk, prefetch=pre)
        after, pf1 = totals()
        mem.sample()
        wall = st.meta["timing"]["wall_s"]
        tps = st.n_tokens / wall
        hits = sum(after[l_][0] - before[l_][0] for l_ in after)
        misses = sum(after[l_][1] - before[l_][1] for l_ in after)
        inserted = sum(after[l_][2] - before[l_][2] for l_ in after)
        n_chunks = max(1, pf1["issued"] - pf0["issued"]) if pre else max(1, (hits + misses) // (chunk * cfg.n_hash_cols * len(after)))
        time_us = 1e6 * chunk / tps
        rec = {"stage": "corpus_stats", "T": chunk, "variant": name, "tables": "host", "cache_gb": gb,
               "cache_policy": policy if gb else None, "cache_warm_started": bool(filled and gb),
               "prefetch": pre, "prefetch_depth": PREFETCH_DEPTH if pre else 0, "fetch_blocks": blocks, "tokens_per_s": round(tps, 1), "time_us": round(time_us, 1),
               "pct_of_device_tables": round(100.0 * tps / dev_tps, 1), "device_tables_tokens_per_s": dev_tps,
               "floor_us": round(device_sum_us, 1), "device_sum_us": round(device_sum_us, 1),
               "pct_of_floor": round(100.0 * device_sum_us / time_us, 1), "n_tokens": st.n_tokens,
               "hit_rate": round(hits / max(1, hits + misses), 4), "host_bytes_per_chunk": int(misses * 84 / n_chunks),
               "cache_bytes_per_chunk": int(hits * 84 / n_chunks), "prefetch_counts": {k: pf1[k] - pf0[k] for k in pf1},
               "inserted_per_chunk": int(inserted / n_chunks),
               "timing_s": st.meta["timing"], "statistics": "full", "bytes": 0, "flops": 0, "gbps": 0.0, "tflops": 0.0,
               "baselines": {"device tables": device_rec["time_us"]},
               "validated": bool(st.n_tokens == device_rec["n_tokens"] and (not pre or pf1["missed"] == pf0["missed"]))}
        out["records"].append(rec)
        log(f"  corpus_stats [{name}]: {tps:,.0f} tokens/s ({rec['pct_of_device_tables']}% of device tables), "
            f"cache hit rate {rec['hit_rate']:.3f}, {rec['host_bytes_per_chunk'] / 1e6:.2f} MB from host a chunk")

    # -- decode tokens: device tables; host tables with the token's rows fetched in the graph (one
    # launch for both layers), and with them fetched ahead (prefetch_decode, issued as soon as the
    # token is known: here the host runs ahead, so the fetch overlaps the previous token's graph, as
    # in a model it overlaps the blocks ahead of the first engram layer); the same with a cache
    hs = {}
    # the simulator compiles nothing and captures no graph: there one timed token and no warm-up (decode across
    # tokens, prefetched or not, is tests/test_placement.py's and tests/test_engine_decode.py's)
    seq = np.random.default_rng(7).integers(0, vocab, (0 if smoke else 32) + (1 if smoke else 256 if quick else 512))
    warm = 0 if smoke else 32
    h0 = np.random.default_rng(8).standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)
    if cache_gbs and (static_gb or "clock" in cache_policies):   # decode without cached rows
        for l_ in cfg.layer_ids:
            host.fill_cache(l_, [], ranked=True)
    decodes = [("device tables", dev_eng, False), ("host tables", host, False),
               ("host tables, next token prefetched", host, True)]
    for name, e, ahead in decodes:
        hasher = EngramHasher(model.hash_tables, capacity=seq.size + 8)
        h = cuda.to_device(h0)

        def one(tok, e=e, h=h, hasher=hasher, ahead=ahead):
            if ahead:
                e.prefetch_decode(tok, hasher)
            e.decode(tok, h, hasher)
        for tok in seq[:warm]:
            one(int(tok))
        cuda.synchronize()
        t1 = time.perf_counter()
        for tok in seq[warm:]:
            one(int(tok))
        cuda.synchronize()
        hs[name] = {"wall_us_per_token": round((time.perf_counter() - t1) / (seq.size - warm) * 1e6, 2),
                    "final": h.copy_to_host(), "graphed": bool(e.graphs_available), "prefetch": ahead}
    dev_us = hs["device tables"]["wall_us_per_token"]
    for name, _, ahead in decodes:
        same = bool(np.array_equal(hs["device tables"]["final"], hs[name]["final"]))
        rec = {"stage": "decode_step", "T": 1, "variant": f"{name} (corpus bench model, bf16 wkv)",
               "tables": name.split()[0], "cache_gb": 0.0, "prefetch": ahead,
               "time_us": hs[name]["wall_us_per_token"], "graphed": hs[name]["graphed"], "tokens": int(seq.size - warm),
               "bytes": 0, "flops": 0, "gbps": 0.0, "tflops": 0.0, "floor_us": 0.0, "pct_of_floor": 0.0,
               "baselines": {"device tables": dev_us}, "validated": same}
        if name != "device tables":
            rec["delta_us_vs_device_tables"] = round(hs[name]["wall_us_per_token"] - dev_us, 2)
            rec["host_fetch"] = "one launch: every host row of both layers (fetch_rows_pair_v1), then decode"
        out["records"].append(rec)
        log(f"  decode [{name}]: {hs[name]['wall_us_per_token']} us/token"
            + ("" if name == "device tables" else f" ({hs[name]['wall_us_per_token'] - dev_us:+.2f} us vs device tables)")
            + f"; same highway bits as device tables: {same}")
    host._fetcher.close()
    return out


def main(argv=None) -> int:
    import argparse
    from numba import cuda
    from numba.cuda import config
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table-gb", type=float, default=None, help="GB per layer table (default: released, 32.3)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in the simulator")
    p.add_argument("--chunks", type=int, default=None, help="4096-token chunks per variant")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--distributed", type=int, default=0,
                   help="also corpus_stats_distributed: this many Dask workers sharing the GPU, then one")
    p.add_argument("--dist-chunks", type=int, default=None, help="4096-token chunks of the distributed runs")
    p.add_argument("--dist-shard-tokens", type=int, default=1 << 21,
                   help="tokens per shard of the distributed runs (default 2,097,152: about 10 s of one GPU; a study's 32 MB text shards hold about 8M)")
    p.add_argument("--no-host", action="store_true", help="skip the host-table runs")
    p.add_argument("--model", default=None, choices=("q2k", "fp8", "both"),
                   help="q2k: Q2_K tables + bf16 wkv (the GGUF's encodings; default); fp8: FP8 table rows + FP8 wkv "
                        "(the HF checkpoint's), device tables only; both: one after the other (default with --smoke)")
    p.add_argument("--fp8-proj", default="decode",
                   help="the FP8 wkv's projection: decode (the engine's default: decoded to bf16 before each GEMM), "
                        "bf16 (decoded once at build), or gemm_fp8_v3 / gemm_fp8_v4 (DeepSeek's FP8 arithmetic)")
    p.add_argument("--cache-gb", default="0.25,1,4", help="cache budgets per layer for the host runs (GB, comma list)")
    p.add_argument("--cache-policy", default="static,clock",
                   help="hot-row cache policies the host runs measure at each budget (comma list of static, clock)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run (seconds; Python's default 0.005): how long a thread "
                        "that wants the GIL waits before the holder is made to drop it")
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        if not (np.isfinite(args.switch_interval) and args.switch_interval > 0):
            print(f"error: --switch-interval must be seconds > 0, got {args.switch_interval}", file=sys.stderr)
            return 2
        sys.setswitchinterval(args.switch_interval)
    if not args.smoke and (config.ENABLE_CUDASIM or not cuda.is_available()):
        print("error: the corpus bench needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    from .timing import SMOKE
    try:
        cache_gbs = tuple(float(x) for x in args.cache_gb.split(",") if x.strip())
        if any(not np.isfinite(g) or g < 0 for g in cache_gbs):
            raise ValueError
    except ValueError:
        print(f"error: --cache-gb must be GB >= 0 (comma list), got {args.cache_gb!r}", file=sys.stderr)
        return 2
    policies = tuple(x.strip() for x in args.cache_policy.split(",") if x.strip())
    if not policies or any(x not in ("static", "clock") for x in policies):
        print(f"error: --cache-policy takes static and/or clock (comma list), got {args.cache_policy!r}", file=sys.stderr)
        return 2
    from ..stages.proj.records import DEEPSEEK_FP8_VERSIONS
    if args.fp8_proj not in FP8_PROJ + tuple(DEEPSEEK_FP8_VERSIONS):
        print(f"error: --fp8-proj must be one of {', '.join(FP8_PROJ + tuple(DEEPSEEK_FP8_VERSIONS))}, got "
              f"{args.fp8_proj!r}", file=sys.stderr)
        return 2
    which = args.model or ("both" if args.smoke else "q2k")
    kinds = ("q2k", "fp8") if which == "both" else (which,)
    if args.distributed and "fp8" in kinds:
        print("error: --distributed runs the q2k model only (--model q2k)", file=sys.stderr)
        return 2
    res = {"records": [], "models": {}}
    for kind in kinds:
        part = run(SMOKE if args.smoke else RELEASED, quick=args.quick, table_gb=args.table_gb, n_chunks=args.chunks,
                   distributed=args.distributed, dist_chunks=args.dist_chunks, host=not args.no_host,
                   cache_gbs=cache_gbs, dist_shard_tokens=args.dist_shard_tokens, cache_policies=policies,
                   model=kind, fp8_proj=args.fp8_proj)
        res["records"] += part.pop("records")
        res["models"][kind] = part
        import gc
        gc.collect()                       # the model's device tables go before the next model's are made
        try:
            cuda.current_context().deallocations.clear()
        except AttributeError:             # the simulator
            pass
    res.update({"commit": commit(), "device": device_name(), "switch_interval": sys.getswitchinterval()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
