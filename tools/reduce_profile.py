"""Profile the corpus run's host side (hash + job, and every statistic) without a GPU.

    PYTHONPATH=$PWD python tools/reduce_profile.py [--chunks 400] [--threads 5] [--device-ms 4.87] [--cpu]
        [--lanes contexts,all --repeats 2]

The configuration is the one `python -m engram_numba.bench.corpus` uses: the bench model at the
released shapes (compressed vocabulary 99,092, layers 1 and 14, hc 4, 24 hash columns, the
released table row counts for the row bitmaps), its synthetic Zipf corpus packed into 4096-token
chunks by the corpus driver's producer (`_jobs`), and the full statistics (moments, histograms,
per-token sums, row bitmaps, n-gram context tables). The GPU's dot and gate are replaced by cheap
deterministic arrays of the right shapes and dtypes (a function of the token id and position).

Four passes over the same chunks:
  1. breakdown: every part of `StreamingGateStats.update` timed on its own, serially (no pool);
  2. update: `update` as the reducer thread calls it (with the pool of --threads threads);
  3. pipeline: `corpus_stats` itself, threads as in a real run, with the device work replaced by a
     sleep of --device-ms a chunk (sleeping releases the GIL, as waiting on the GPU does): the wall
     per chunk against that floor.
  4. drivers: `corpus_stats` with the producer live too, the device modelled (--device-ms of
     device work, --host-ms of the driving thread's Python a chunk), one chunk at a time (the
     synchronous driver) against chunks queued ahead (analysis/device_chunks.py); with --lanes
     contexts,all, the queued-ahead driver under each reducer lane mode (analysis.corpus.LANES),
     --repeats times in alternating order (compare the threads' CPU, all_cpu_s: on a loaded VM
     the walls are noise).
Per-chunk milliseconds are printed as averages over windows ending at chunks 32, 64, 128, 256 and
the last, so what grows with the corpus shows.
"""
from __future__ import annotations

import argparse
import inspect
import resource
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MARKS = (32, 64, 128, 256)


def fake_gates(job, layer_ids, hc):
    """{layer: (dot, gate)} [T, hc] fp32, deterministic in (token id, position, layer, stream)."""
    out = {}
    x = (job.token_ids * 2654435761 + job.positions * 40503) & 0xFFFFF
    for li, lid in enumerate(layer_ids):
        v = ((x[:, None] + 7919 * (li * hc + np.arange(hc))[None, :]) & 0xFFFFF).astype(np.float32)
        v /= np.float32(1 << 20)
        dot = (v - np.float32(0.5)) * np.float32(8.0)
        gate = (np.float32(1.0) / (np.float32(1.0) + np.exp(-dot))).astype(np.float32)
        out[lid] = (dot.astype(np.float32), gate)
    return out


class Timers:
    def __init__(self, clock=time.perf_counter):
        self.chunk = defaultdict(float)
        self.rows = []
        self.clock = clock

    def wrap(self, name, fn):
        def timed(*a, **k):
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.chunk[name] += self.clock() - t0
        return timed

    def close_chunk(self):
        self.rows.append(dict(self.chunk))
        self.chunk.clear()


def same_state(a, b, skip_meta=False) -> bool:
    """Every count, sum, histogram, bitmap and context table equal (each table's sorted view made
    on both sides first: it is a cache that `==` would otherwise compare)."""
    from engram_numba.analysis.stats import state_equal
    for st in (a, b):
        st.finish()
        for t in st.contexts.values():
            t._sorted()
    return state_equal(a, b, skip=("tokenizer", "meta")) if skip_meta else a == b


def windows_report(rows, names, n):
    """Mean ms a chunk over (previous mark, mark] for each mark."""
    marks = [m for m in MARKS if m < n] + [n]
    lines = ["  chunks      " + "".join(f"{m:>10d}" for m in marks)]
    for name in names:
        vals, lo = [], 0
        for m in marks:
            w = [r.get(name, 0.0) for r in rows[lo:m]]
            vals.append(1e3 * sum(w) / max(len(w), 1))
            lo = m
        lines.append(f"  {name:<12s}" + "".join(f"{v:10.3f}" for v in vals))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=400)
    p.add_argument("--threads", type=int, default=5, help="the reducer's pool (corpus_stats: min(5, CPU count))")
    p.add_argument("--device-ms", type=float, default=4.87, help="the device work a chunk stands in for")
    p.add_argument("--skip", default="", help="comma list of passes to skip: breakdown,update,pipeline,drivers")
    p.add_argument("--host-ms", type=float, default=1.5,
                   help="drivers pass: the device-driving thread's own Python work a chunk, GIL held "
                        "(tools/gates_profile.py measures it)")
    p.add_argument("--save", default=None, help="save the breakdown pass's statistics here (.npz), to compare "
                   "two versions of the code: StreamingGateStats.load(a) == StreamingGateStats.load(b)")
    p.add_argument("--lanes", default="contexts",
                   help="drivers pass: comma list of analysis.corpus.LANES modes (contexts, all); with more than one "
                        "the queued-ahead driver runs each --repeats times, the order reversed each repeat")
    p.add_argument("--repeats", type=int, default=1, help="drivers pass: runs of each --lanes mode")
    p.add_argument("--cpu", action="store_true", help="breakdown pass: the thread's CPU seconds (time.thread_time) "
                   "instead of wall seconds, for a machine other work loads (the serial pass runs on one thread)")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    from engram_numba.analysis import context_table, corpus, streaming
    from engram_numba.analysis.corpus import Document, _jobs
    from engram_numba.analysis.streaming import Chunk, StreamingGateStats
    from engram_numba.bench.corpus import CHUNK, BenchModel, _documents
    from engram_numba.bench.timing import RELEASED
    from engram_numba.config import ENGRAM_VOCAB_SIZE

    t0 = time.perf_counter()
    model = BenchModel(RELEASED, ENGRAM_VOCAB_SIZE)
    cfg = model.config
    vocab = model.hash_tables.token_map.size
    docs = _documents(args.chunks * CHUNK, vocab, np.random.default_rng(11))
    token_map = model.hash_tables.token_map
    print(f"model: {model.path}; vocab {vocab}; layers {cfg.layer_ids}; hc {cfg.hc}; cols {cfg.n_hash_cols}; "
          f"{len(docs)} documents, {args.chunks} chunks of {CHUNK} (setup {time.perf_counter() - t0:.1f} s)")

    def documents():
        return (Document(f"doc{i}", d) for i, d in enumerate(docs))

    # warm-up: compile every @njit on a small corpus
    warm = StreamingGateStats.empty(model)
    for job in _jobs((Document(f"w{i}", d) for i, d in enumerate(docs[:2])), model, CHUNK, False, True, None):
        warm.update(Chunk(job.token_ids, job.live, job.row_ids, job.windows,
                          fake_gates(job, cfg.layer_ids, cfg.hc), job.n_documents), token_map)

    # producer, alone
    prod = []
    jobs = []
    it = _jobs(documents(), model, CHUNK, False, True, None)
    while True:
        s = time.perf_counter()
        job = next(it, None)
        if job is None:
            break
        prod.append({"produce": time.perf_counter() - s})
        jobs.append(job)
    chunks = [Chunk(j.token_ids, j.live, j.row_ids, j.windows, fake_gates(j, cfg.layer_ids, cfg.hc), j.n_documents)
              for j in jobs]
    n = len(chunks)
    print(f"\nproducer (hash + windows + job), ms a chunk:\n{windows_report(prod, ['produce'], n)}")

    results = {}
    if "breakdown" not in skip:
        tm = Timers(time.thread_time if args.cpu else time.perf_counter)
        clock = tm.clock
        saved = {}

        def patch(obj, name, label):                 # (what is not there in this version is skipped)
            if name not in obj.__dict__:
                return
            raw = obj.__dict__[name]
            saved[(obj, name)] = raw
            if isinstance(raw, staticmethod):
                setattr(obj, name, staticmethod(tm.wrap(label, raw.__func__)))
            else:
                setattr(obj, name, tm.wrap(label, raw))
        patch(streaming, "reduce_layer", "reduce_layer")
        patch(streaming, "reduce_layer_rows", "reduce_layer")     # (with mark_rows in the same call)
        patch(streaming, "fold_sums", "fold_sums")
        patch(StreamingGateStats, "_fold", "fold_sums")
        patch(streaming, "prepare_chunk", "prepare")
        patch(streaming, "mark_rows", "mark_rows")
        patch(streaming, "mark_live_rows", "mark_rows")
        patch(StreamingGateStats, "_add_counts", "token_counts")
        patch(StreamingGateStats, "_count_tokens", "token_counts")
        patch(context_table, "_ctx_add_tokens", "ctx_probe")
        patch(context_table.ContextTable, "_reserve", "ctx_reserve")
        patch(context_table.ContextTable, "_prune", "ctx_prune")
        orig_add = context_table.ContextTable.add_tokens

        def add_tokens(self, *a):
            t = clock()
            orig_add(self, *a)
            tm.chunk[f"ctx{self.order}_total"] += clock() - t
        context_table.ContextTable.add_tokens = add_tokens
        st = StreamingGateStats.empty(model)
        try:
            for c in chunks:
                s = clock()
                st.update(c, token_map, None)
                tm.chunk["update"] += clock() - s
                tm.close_chunk()
        finally:
            for (obj, name), fn in saved.items():
                setattr(obj, name, fn)
            context_table.ContextTable.add_tokens = orig_add
        names = ["update", "prepare", "token_counts", "reduce_layer", "fold_sums", "mark_rows"] + \
                [f"ctx{o}_total" for o in sorted(st.contexts)] + ["ctx_probe", "ctx_reserve", "ctx_prune"]
        for r in tm.rows:
            r["other"] = r["update"] - sum(r.get(k, 0.0) for k in names[1:] if not k.startswith("ctx_")
                                           and k != "update")
        print(f"\nStreamingGateStats.update, serial, {'CPU ' if args.cpu else ''}ms a chunk (ctx_* are inside ctxN_total):\n"
              f"{windows_report(tm.rows, names + ['other'], n)}")
        print("  context tables: " + ", ".join(f"order {o}: {t.n} contexts in {t._slots.shape[0]} slots, "
                                               f"{t.prunes} prunes" for o, t in st.contexts.items()))
        results["serial"] = st
        if args.save:
            st.save(args.save, compresslevel=1)
            print(f"  saved to {args.save}")

    if "update" not in skip:
        st = StreamingGateStats.empty(model)
        rows = []
        lanes = None
        if args.threads > 1 and "lanes" in inspect.signature(st.update).parameters:   # as corpus_stats runs it
            keys = st.lane_keys() if hasattr(st, "lane_keys") else list(st.contexts)
            lanes = {k: ThreadPoolExecutor(1) for k in keys}
        t_all = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            for c in chunks:
                s, cpu = time.perf_counter(), time.thread_time()
                if lanes is None:
                    st.update(c, token_map, pool if args.threads > 1 else None)
                else:
                    st.update(c, token_map, pool, lanes)
                rows.append({"update": time.perf_counter() - s, "update_cpu": time.thread_time() - cpu})
        s = time.perf_counter()
        st.finish()
        t_finish = time.perf_counter() - s
        total = time.perf_counter() - t_all
        for lane in (lanes or {}).values():
            lane.shutdown()
        print(f"\nStreamingGateStats.update with a pool of {args.threads}"
              f"{' and lanes ' + str(list(lanes)) if lanes else ''}, ms a chunk:\n"
              f"{windows_report(rows, ['update', 'update_cpu'], n)}\n  (update_cpu: the calling thread's own CPU)\n  finish (waits for the lanes) {1e3 * t_finish:.1f} ms; "
              f"all {n} chunks {total:.2f} s = {1e3 * total / n:.2f} ms a chunk")
        if "serial" in results:
            print(f"  same statistics as the serial pass: {same_state(st, results['serial'])}")

    if "pipeline" not in skip:
        from engram_numba import pipeline as pipeline_mod
        orig = pipeline_mod.Pipeline.gates_from_ids
        by_ids = {}
        for j, c in zip(jobs, chunks):
            by_ids[id(j.row_ids)] = c.gates

        def gates_from_ids(self, row_ids, highway, token_mask=None):
            time.sleep(args.device_ms / 1e3)
            return by_ids[id(row_ids)]
        pipeline_mod.Pipeline.gates_from_ids = gates_from_ids
        orig_jobs = corpus._jobs
        corpus._jobs = lambda *a, **k: iter(jobs)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        try:
            st = corpus.corpus_stats(model, documents=docs, backend="cpu", chunk_tokens=CHUNK,
                                     device_highway=lambda pos: None, reducer_threads=args.threads)
        finally:
            pipeline_mod.Pipeline.gates_from_ids = orig
            corpus._jobs = orig_jobs
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        tm_ = st.meta["timing"]
        wall = tm_["wall_s"]
        print(f"\ncorpus_stats, device work a sleep of {args.device_ms} ms, {args.threads} reducer threads, "
              f"{n} chunks (producer precomputed): {1e3 * wall / n:.2f} ms a chunk, "
              f"{st.n_tokens / wall:,.0f} tokens/s (floor {CHUNK / args.device_ms * 1e3:,.0f}); timing {tm_}")
        print(f"  the process's CPU a chunk (every thread): user {1e3 * (r1.ru_utime - r0.ru_utime) / n:.2f} ms, "
              f"system {1e3 * (r1.ru_stime - r0.ru_stime) / n:.2f} ms, {(r1.ru_minflt - r0.ru_minflt) / n:.0f} page "
              f"faults, {(r1.ru_nivcsw - r0.ru_nivcsw) / n:.0f} involuntary and "
              f"{(r1.ru_nvcsw - r0.ru_nvcsw) / n:.0f} voluntary context switches")
        if "serial" in results:
            print(f"  same statistics as the serial pass: {same_state(st, results['serial'], skip_meta=True)}")

    if "drivers" not in skip:
        drivers_pass(args, model, docs, CHUNK, results.get("serial"))


def _busy(ms: float) -> None:
    """Python work holding the GIL for `ms` milliseconds."""
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1


class _ModelDeviceChunks:
    """DeviceChunks with the GPU modelled: submit costs host_ms of Python (GIL held) and queues
    device_ms on one timeline; a chunk's result waits (sleeping: no GIL) until its work is done."""

    def __init__(self, model, host_ms: float, device_ms: float):
        self.cfg, self.host_ms, self.device_ms = model.config, host_ms, device_ms
        self.free_at = 0.0
        self.n_slots = 3
        self.counts = {"chunks": 0}
        self.seconds = {"launch_s": 0.0, "wait_s": 0.0}
        self._jobs = {}

    def submit(self, row_ids, highway, live):
        _busy(self.host_ms)
        now = time.perf_counter()
        self.free_at = end = max(self.free_at, now) + self.device_ms / 1e3
        self.counts["chunks"] += 1
        job = self._jobs.pop(id(row_ids))

        def done():
            t = time.perf_counter()
            if end > t:
                time.sleep(end - t)
            self.seconds["wait_s"] += time.perf_counter() - t
            return fake_gates(job, self.cfg.layer_ids, self.cfg.hc)
        return done

    def drain(self):
        pass


def drivers_pass(args, model, docs, chunk: int, serial) -> None:
    """corpus_stats end to end with a live producer (hash + windows), the reducer, and the device
    modelled, under the two drivers of the device work:
      one at a time: host_ms of Python, then device_ms waited for (sleeping: the GIL released, the
                     most the old synchronous copies could have given), before the next chunk;
      queued ahead:  host_ms of Python a chunk, the device working through its queue meanwhile
                     (analysis/device_chunks.py), results read two chunks later."""
    from engram_numba import pipeline as pipeline_mod
    from engram_numba.analysis import corpus, device_chunks
    P = pipeline_mod.Pipeline
    saved = (P.gates_from_ids, P.device_resident, P.cuda_engine_for, device_chunks.eligible,
             device_chunks.DeviceChunks, corpus._jobs)
    cfg = model.config
    runners = []
    by_ids = {}
    real_jobs = corpus._jobs

    def jobs_seen(*a, **k):              # the live producer; each job findable by its row ids
        for job in real_jobs(*a, **k):
            by_ids[id(job.row_ids)] = job
            yield job

    def one_at_a_time(self, row_ids, highway, token_mask=None):
        _busy(args.host_ms)
        time.sleep(args.device_ms / 1e3)
        return fake_gates(by_ids.pop(id(row_ids)), cfg.layer_ids, cfg.hc)

    def make_runner(*a, **k):
        r = _ModelDeviceChunks(model, args.host_ms, args.device_ms)
        r._jobs = by_ids
        runners.append(r)
        return r
    try:
        corpus._jobs = jobs_seen
        P.gates_from_ids = one_at_a_time
        P.device_resident = property(lambda self: True)
        P.cuda_engine_for = lambda self, n: None
        device_chunks.eligible = lambda pipe, eng: None
        device_chunks.DeviceChunks = make_runner
        n = None
        modes = [m for m in args.lanes.split(",") if m]
        runs = [("one chunk at a time", False, modes[0])] if len(modes) == 1 else []
        for rep in range(args.repeats):
            runs += [(f"queued ahead, LANES={m}, repeat {rep}", True, m) for m in (modes if rep % 2 == 0 else modes[::-1])]
        # warm-up: every @njit compiled or loaded, the context tables' prune too (a tiny cap prunes them all)
        corpus.corpus_stats(model, documents=docs[:2], backend="cpu", chunk_tokens=chunk,
                            device_highway=lambda pos: None, reducer_threads=args.threads, pipelined=True,
                            max_contexts=8)
        keep = corpus.LANES
        for name, pipelined, lanes in runs:
            corpus.LANES = lanes
            try:
                st = corpus.corpus_stats(model, documents=docs, backend="cpu", chunk_tokens=chunk,
                                         device_highway=lambda pos: None, reducer_threads=args.threads,
                                         pipelined=pipelined)
            finally:
                corpus.LANES = keep
            tm_ = st.meta["timing"]
            n = n or -(-st.n_tokens // chunk)
            wall = tm_["wall_s"]
            per = {k: round(1e3 * v / n, 2) for k, v in tm_.items()}
            print(f"\ncorpus_stats, drivers pass [{name}]: live producer, host {args.host_ms} ms + device "
                  f"{args.device_ms} ms a chunk (modelled), {args.threads} reducer threads, {n} chunks: "
                  f"{1e3 * wall / n:.2f} ms a chunk, {st.n_tokens / wall:,.0f} tokens/s (device floor "
                  f"{chunk / args.device_ms * 1e3:,.0f}); ms a chunk by thread {per}")
            if serial is not None:
                print(f"  same statistics as the serial pass: {same_state(st, serial, skip_meta=True)}")
    finally:
        (P.gates_from_ids, P.device_resident, P.cuda_engine_for, device_chunks.eligible,
         device_chunks.DeviceChunks, corpus._jobs) = saved


if __name__ == "__main__":
    main()
