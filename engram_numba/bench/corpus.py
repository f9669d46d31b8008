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

import numpy as np

from .timing import RELEASED, BenchShape, DeviceTimer, commit, device_name

CHUNK = 4096


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
        for li, lid in enumerate(cfg.layer_ids):
            rows = int(self.hash_tables.table_rows[li])
            wkv = f32_to_bf16((rng.standard_normal((cfg.proj_out, cfg.proj_in), dtype=np.float32) * 0.02))
            # the table is a zero-stride stand-in [rows, 84]: the real one lives on the device
            self.layers[lid] = EngramLayer(
                lid, li, table=np.broadcast_to(np.zeros(84, np.uint8), (rows, 84)), table_encoding="q2k",
                wkv_raw=wkv, wkv_encoding="bf16",
                q_weight=(1 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32),
                k_weight=(1 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32))
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


def _h2d_gbps(timer: DeviceTimer, cuda, nbytes: int, pinned: bool) -> float:
    host = cuda.pinned_array(nbytes, dtype=np.uint8) if pinned else np.empty(nbytes, dtype=np.uint8)
    host[:] = 1
    dev = cuda.device_array(nbytes, dtype=np.uint8)
    us = timer(lambda: dev.copy_to_device(host), iters=5, flush=False)
    return nbytes / (max(us, 1e-3) * 1e-6) / 1e9


def run(shape: BenchShape = RELEASED, quick: bool = False, log=print, table_gb: float | None = None,
        n_chunks: int | None = None) -> dict:
    """The corpus_stats records (module doc). table_gb: each layer's table size in GB (default:
    the released 32.3 GB; the smoke shape uses a tiny table)."""
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
    args = p.parse_args(argv)
    if not args.smoke and (config.ENABLE_CUDASIM or not cuda.is_available()):
        print("error: the corpus bench needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    from .timing import SMOKE
    res = run(SMOKE if args.smoke else RELEASED, quick=args.quick, table_gb=args.table_gb, n_chunks=args.chunks)
    res.update({"commit": commit(), "device": device_name()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
