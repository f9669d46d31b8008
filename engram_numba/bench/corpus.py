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
highway sources: "device" (already on the device: a device-to-device refresh per chunk, as the
gate updates it in place), "device, gate statistics only" (contexts and row bitmaps off: what the
host reduction costs), "host pinned" and "host pageable" (the highway copied from host memory
every chunk: 4096 x 4 x 5120 x 4 B = 335 MB, so PCIe bounds it; `h2d_gbps` and
`h2d_bound_tokens_per_s` say where). Plus peak host memory (getrusage) and peak device memory
(the lowest free memory seen) of the run.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from .timing import RELEASED, BenchShape, DeviceTimer, commit, device_name

CHUNK = 4096


@dataclass
class _Layer:
    layer_id: int
    table: np.ndarray        # [rows, 84] zero-stride stand-in (the real table lives on the device)
    _wkv: np.ndarray
    q_weight: np.ndarray
    k_weight: np.ndarray
    table_encoding: str = "q2k"
    table_scales: None = None

    def wkv_bf16(self) -> np.ndarray:
        return self._wkv

    @property
    def n_rows(self) -> int:
        return int(self.table.shape[0])


class _NoReader:
    def __init__(self, n_rows: int):
        self.n_rows = n_rows

    def read(self, ids):  # pragma: no cover - the bench gathers on the device only
        raise RuntimeError("the bench model has no host tables: rows are gathered from the device tables")


class BenchModel:
    """The released shapes with random weights and no host tables (the protocol's fields that
    the pipeline, the engine and corpus_stats use)."""

    def __init__(self, shape: BenchShape, table_rows_per_col: int, seed: int = 0):
        from ..config import COMPRESSED_VOCAB_SIZE, EngramConfig
        from ..stages.hash.tables import EngramHashTables
        from ..bf16 import f32_to_bf16
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
        for li, lid in enumerate(cfg.layer_ids):
            rows = int(self.hash_tables.table_rows[li])
            wkv = f32_to_bf16((rng.standard_normal((cfg.proj_out, cfg.proj_in), dtype=np.float32) * 0.02))
            self.layers[lid] = _Layer(lid, np.broadcast_to(np.zeros(84, np.uint8), (rows, 84)), wkv,
                                      (1 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32),
                                      (1 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32))
        self.path = f"bench model ({shape.name} shapes, random weights, {int(self.hash_tables.table_rows[0]):,} rows a table)"
        self.format = "in memory (random q2k tables on the device)"
        self.tokenizer_path = None
        self.problems: list[str] = []

    def rows(self, layer_id):
        return _NoReader(self.layers[layer_id].n_rows)


def _fill_device_table(n_rows: int, rng, cuda, block_rows: int = 1 << 20):
    """A device table [n_rows, 84] of random finite Q2_K rows: one random block uploaded, then
    repeated by device-to-device copies (gathers read random rows all over it, as in use)."""
    from ..stages.rows.encodings import random_raw_rows
    table = cuda.device_array((n_rows, 84), dtype=np.uint8)
    block = cuda.to_device(random_raw_rows("q2k", min(block_rows, n_rows), rng))
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
        rng = np.random.default_rng(11)
        for lid in model.config.layer_ids:
            eng.layers[lid].table = _fill_device_table(model.layers[lid].n_rows, rng, cuda)
        return model, eng


def run_distributed(model, eng, docs, shape: BenchShape, rows_per_col: int, chunk: int, workers: int = 2,
                    log=print, docs_per_shard: int | None = None) -> list[dict]:
    """The corpus_stats_distributed records: the same corpus and settings as corpus_stats (device
    tables, the synthetic highway cached on the device), in process, then through Dask: `workers`
    worker processes sharing this one GPU (each with its own engine and tables: the scheduler's
    overhead), then one worker alone (the in-process ratio). Frees `eng`'s tables first."""
    import gc
    import tempfile

    from numba import cuda

    from ..analysis import distributed as dist
    from ..analysis.corpus import DeviceSyntheticBlocks, corpus_stats
    cfg = model.config
    synth = DeviceSyntheticBlocks(cfg.hc, cfg.dim, chunk)
    synth.device(np.arange(chunk))                                          # the blocks, cached
    kw = dict(backend="cuda", chunk_tokens=chunk)
    dist.warm_run(lambda d: corpus_stats(model, documents=d, engine=eng, device_highway=synth.device, **kw),
                  model, chunk)
    st = corpus_stats(model, documents=docs, engine=eng, device_highway=synth.device, **kw)
    tps_in = st.n_tokens / st.meta["timing"]["wall_s"]
    log(f"  in process: {st.n_tokens:,} tokens, {tps_in:,.0f} tokens/s")
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
    per = docs_per_shard or max(1, len(docs) // (4 * workers))
    t0 = time.perf_counter()
    cluster = dist.local_cluster(workers, gpu=True, gpus=["0"], dashboard=False)
    from distributed import Client
    client = Client(cluster)
    records = []
    try:
        addrs = sorted(client.scheduler_info()["workers"])
        warm = [client.submit(dist.warm_worker, source, settings, workers=[a], allow_other_workers=False, pure=False)
                for a in addrs]
        client.gather(warm)
        del warm                                                             # nothing held when workers go
        log(f"  {workers} Dask workers on the one GPU started and warm in {time.perf_counter() - t0:.1f} s")
        for n in (workers, 1):
            if n != len(client.scheduler_info()["workers"]):
                cluster.scale(n)
                deadline = time.time() + 120
                while len(client.scheduler_info()["workers"]) != n and time.time() < deadline:
                    time.sleep(0.2)
            with tempfile.TemporaryDirectory() as out:
                got = dist.distributed_corpus_stats(source, documents=docs, docs_per_shard=per, out=out,
                                                    client=client, progress=False, log=lambda *a: None, **kw)
            sm = got.meta["distributed"]
            busy = sum(w["busy_s"] for w in sm["per_worker"].values())
            in_task = sm["tokens"] / busy * len(sm["per_worker"]) if busy else 0.0
            rec = {"stage": "corpus_stats_distributed", "T": chunk, "variant": f"{n} Dask worker(s) on 1 GPU",
                   "workers": n, "shards": sm["shards"], "n_tokens": sm["tokens"],
                   "tokens_per_s": round(sm["tokens_per_s"], 1),
                   "in_process_tokens_per_s": round(tps_in, 1),
                   "ratio_to_in_process": round(sm["tokens_per_s"] / tps_in, 3),
                   "in_task_tokens_per_s": round(in_task, 1),
                   "in_task_ratio_to_in_process": round(in_task / tps_in, 3),
                   "wall_s": sm["wall_s"], "per_worker": sm["per_worker"],
                   "fixed_overhead_s": round(sm["wall_s"] - busy / max(len(sm["per_worker"]), 1), 3),
                   "time_us": round(1e6 * chunk / max(sm["tokens_per_s"], 1e-9), 1), "floor_us": 0.0, "bytes": 0,
                   "flops": 0, "gbps": 0.0, "tflops": 0.0, "baselines": {}, "kernel": "corpus_stats via Dask",
                   "validated": bool(got.n_tokens == st.n_tokens and got.n_documents == st.n_documents and
                                     np.array_equal(got.tok_count, st.tok_count) and
                                     all(np.array_equal(a, b) for a, b in zip(got.row_bitmaps, st.row_bitmaps))),
                   "same_gate_histogram": bool(np.array_equal(got.fine, st.fine))}
            records.append(rec)
            log(f"  through Dask, {n} worker(s) on the one GPU: {rec['tokens_per_s']:,.0f} tokens/s end to end "
                f"(x{rec['ratio_to_in_process']:.3f} of in process; {sm['shards']} shards, wall {sm['wall_s']:.2f} s, "
                f"fixed cost {rec['fixed_overhead_s']:.2f} s), {in_task:,.0f} tokens/s inside the tasks "
                f"(x{rec['in_task_ratio_to_in_process']:.3f}); same statistics: {rec['validated']}")
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
        n_chunks: int | None = None, distributed: int = 0, dist_chunks: int | None = None) -> dict:
    """The corpus_stats records (module doc). table_gb: each layer's table size in GB (default:
    the released 32.3 GB; the smoke shape uses a tiny table). distributed: also the
    corpus_stats_distributed records with this many Dask workers sharing the GPU (then one), over
    dist_chunks chunks (default n_chunks); needs the distributed extra."""
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
    if smoke:
        rows_per_col = 61
    elif table_gb is None:
        from ..config import ENGRAM_VOCAB_SIZE
        rows_per_col = ENGRAM_VOCAB_SIZE                     # the released tables: 384M rows, 32.3 GB each
    else:
        rows_per_col = max(int(table_gb * 1e9 / 84 / shape.cols), 1024)
    t0 = time.perf_counter()
    model = BenchModel(shape, rows_per_col)
    cfg = model.config
    eng = EngramV41(model, max_tokens=chunk, device_tables=False)
    for lid in cfg.layer_ids:
        eng.layers[lid].table = _fill_device_table(model.layers[lid].n_rows, rng, cuda)
    mem.sample()
    table_gb_real = model.layers[1].n_rows * 84 / 1e9
    log(f"corpus bench: {model.path}; tables {table_gb_real:.1f} GB a layer on the device "
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
        stage_us[f"L{lid}.proj"] = timer(lambda: eng.project(lid), iters=iters)
        stage_us[f"L{lid}.gate"] = timer(lambda: eng.gate(lid, work), iters=iters)
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
                ("device, gate statistics only", from_device, False, stage_us["highway.d2d"]),
                ("host pinned", from_host(host_pinned), True, nbytes / (h2d["pinned"] * 1e3)),
                ("host pageable", from_host(host_pageable), True, nbytes / (h2d["pageable"] * 1e3))]
    for name, source, full, highway_us in variants:
        corpus_stats(model, documents=docs[:2], backend="cuda", engine=eng, device_highway=source, chunk_tokens=chunk,
                     contexts=full, rows=full)                                  # warm-up (compiles)
        mem.sample()
        st = corpus_stats(model, documents=docs, backend="cuda", engine=eng, device_highway=source,
                          chunk_tokens=chunk, contexts=full, rows=full)
        mem.sample()
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
               "validated": bool(np.isfinite(st[1, 0].mean) and st.n_tokens == sum(d.size for d in docs))}
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
            f"gates {st.meta['timing']['gates_s']:.2f} s, reduce {st.meta['timing']['reduce_s']:.2f} s, "
            f"wall {wall:.2f} s" + (f"; {rec['bound']}" if "bound" in rec else ""))
    if distributed:
        ddocs = docs if dist_chunks is None else _documents(dist_chunks * chunk, vocab, np.random.default_rng(12),
                                                             lo=2 if smoke else 256, hi=6 if smoke else 4096)
        records += run_distributed(model, eng, ddocs, shape, rows_per_col, chunk, workers=int(distributed), log=log)
    memory = mem.report()
    for r in records:
        r.update(memory)
        r["table_gb_per_layer"] = round(table_gb_real, 2)
    log(f"  memory: {memory}")
    return {"records": records, "memory": memory, "h2d_gbps": {k: round(v, 1) for k, v in h2d.items()},
            "table_gb_per_layer": round(table_gb_real, 2)}


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
    args = p.parse_args(argv)
    if not args.smoke and (config.ENABLE_CUDASIM or not cuda.is_available()):
        print("error: the corpus bench needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    from .timing import SMOKE
    res = run(SMOKE if args.smoke else RELEASED, quick=args.quick, table_gb=args.table_gb, n_chunks=args.chunks,
              distributed=args.distributed, dist_chunks=args.dist_chunks)
    res.update({"commit": commit(), "device": device_name()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
