"""Corpus statistics on Dask distributed: every GPU of a node, or several nodes, one exact result.

    st = distributed_corpus_stats("model.gguf", "corpus/", out="study", workers=8, backend="cuda")
    st = distributed_corpus_stats("model.gguf", "corpus/", out="study", client=Client("tcp://host:8786"))
    engram-numba stats corpus/ --model model.gguf --backend cuda --workers 8 --out study
    engram-numba stats corpus/ --model model.gguf --backend cuda --scheduler tcp://host:8786 --out study

How it runs:
- The corpus is cut into shards (`analysis/shards.py`: files, or byte / record ranges of large
  files, always on document boundaries). One Dask task per shard runs `corpus_stats` on it and
  returns its mergeable statistics (a `partfile.PartialStats`: context tables as sorted records,
  merged without rehashing); the shards' statistics are summed in a binary tree in shard order,
  on the workers, and only the total comes to the client. No
  per-token array ever crosses the network: a task takes a shard's description (its file, its
  byte or record range) and gives statistics back.
- Each worker opens the model once (a memory map) and builds its pipeline (for the cuda backend
  its `EngramV41` with device tables, on the one GPU its CUDA_VISIBLE_DEVICES shows it) once,
  kept in the worker process (`resident`) and reused by every task with the same model and
  settings. Tables are never pickled or sent.
- Every shard's statistics are written to OUT/parts/shard-NNNNN.npz as it finishes, on a writer
  thread while the next shard runs (`partfile.write_part`: a temporary name, fsync, rename: a file
  there is whole), with the model's identity, the settings and the shard's description inside. Running the same study again skips the shards whose files
  are there, and a file made by another model, other settings, another cut of the corpus or a
  corpus file that changed since is refused by name, as is one that cannot be read.
- A worker that dies mid-run has its tasks (and any merge that lived in its memory) recomputed by
  Dask on the others; shards are pure functions of their description, so the result is the same.
  A part file lost with a worker that died after returning the shard's statistics (the write is
  on a thread) is recomputed and written at the end (`RunSummary.rewritten`).
- The result equals `corpus_stats` on the same corpus in one process, exactly (every count,
  histogram, exact moment, token and context table, row bitmap): every document is a fresh
  sequence, so no hash history, position or n-gram window crosses a shard boundary. Two things
  depend on how the work was cut and are kept deterministic rather than equal: `n_chunks` (the
  chunks each shard was packed into) and, once a context table reaches its cap and prunes, which
  contexts survive (pruning happens where tables are full: after a chunk, a shard or a merge, as
  it already does between chunks in one process). Merging in a fixed tree over shard order makes
  both independent of which worker ran what and when. With the cuda backend the projection
  kernel is picked by the chunk's token count (GEMV for a few tokens, GEMM for many), and they
  sum in different orders: a token's kv can differ by a bf16 rounding with the chunk it lands in,
  in one process too (with another chunk_tokens). Shards end in shorter chunks than one pass
  does, so on cuda the gate statistics agree with one process to that rounding, and exactly only
  with the cpu and reference backends (token, document, context and row counts: always exactly).
- Not supported across shards (refused): `continuous=True` (one sequence over the whole corpus),
  `limit_tokens` and the per-token table.

The output folder must be visible at the same path to every worker (one host, or a shared file
system); the run checks it before any work. Dask is the optional `distributed` extra.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field as dc_field
from pathlib import Path

import numpy as np

from .partfile import PartialStats, read_part, write_part
from .shards import DEFAULT_SHARD_BYTES, Shard, plan_documents, plan_shards, shard_documents
from .streaming import DEFAULT_MAX_CONTEXTS, StreamingGateStats

DISTRIBUTED_EXTRA = "pip install 'engram-numba[distributed]'  (dask and distributed)"
PARTS = "parts"
PART_VERSION = 1                    # what a partial result means (model, settings, shard); its file format: partfile
DEFAULT_DOCS_PER_SHARD = 256        # in-memory documents per shard
WRITER_THREADS = 1                  # one part file at a time, beside the next shard (a write is ~5% of a shard)
ENGINE_RESOURCE = "engram"          # a worker's pipeline: shard tasks take it, merges run beside

# What a worker process runs beside its shards, cut down. With device tables a shard is bound by its
# host thread, and anything else holding the GIL comes off its throughput: Dask's statistical
# profiler walks the running task's stack every 10 ms on the event loop (the dashboard's profile
# page), the event loop checks its own health every 20 ms and samples the process every 100 and
# 500 ms. The clusters this module starts use these settings; on a cluster given to it the run
# stops the workers' profiler while it runs (`_quiet_workers`) and starts it again after.
QUIET_WORKER = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.gil.enabled": False,      # polls the GIL every 1 ms when gilknocker is there
    "distributed.admin.tick.interval": "200ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "500ms",
}
_PROFILER_CALLBACKS = ("profile", "profile-cycle")

# Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536 (to hand freed memory back to the
# system at once). Setting it turns off glibc's sliding mmap threshold: every allocation over
# 128 KB is then a fresh mmap, zero-filled page by page, and unmapped when freed, so each chunk's
# temporaries (ids, windows, gates, the reduction's scratch) fault their pages in again: the
# reduction of a shard took 4.5x the page faults and twice the system CPU of the same work in a
# plain process. The clusters this module starts leave it unset; a worker started with it (a
# `dask worker` of a cluster given to the run) gets glibc's own upper thresholds through mallopt
# when it builds its engine (`_malloc_as_a_process`).
MALLOC_UNSET = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
MMAP_THRESHOLD = 32 << 20           # glibc's sliding threshold's ceiling on 64-bit hosts
TRIM_THRESHOLD = 64 << 20           # where it puts the trim threshold then (twice the mmap one)


def require_distributed(what: str = "running on Dask"):
    """The `distributed` module, or an ImportError that says how to install it."""
    try:
        import distributed
    except ImportError:
        raise ImportError(f"{what} needs Dask distributed, which is not installed: {DISTRIBUTED_EXTRA}") from None
    return distributed


def _jsonable(x):
    return json.loads(json.dumps(x, sort_keys=True, default=str))


# The model, opened once per worker -------------------------------------------------------------

class PathModel:
    """A model file (any format `load_model` opens), opened on each worker from its path."""

    def __init__(self, path):
        self.path = str(Path(path).resolve())

    @property
    def key(self) -> str:
        return self.path

    def model(self):
        """The opened model (host side: what the client checks and plans with)."""
        from ..formats.load import load_model
        return load_model(self.path)

    def open(self, settings: dict):
        """On a worker: (model, engine or None: the pipeline builds its own)."""
        return self.model(), None


def model_identity(model) -> dict:
    """What a partial result was computed with: the model's path, shapes and a digest of its hash
    constants, token map and gate vectors (a digest of every table would read hundreds of GB)."""
    import hashlib
    cfg, t = model.config, model.hash_tables
    h = hashlib.sha256()
    desc = {"layer_ids": list(cfg.layer_ids), "dim": cfg.dim, "hc": cfg.hc, "n_hash_cols": cfg.n_hash_cols,
            "table_rows": [int(x) for x in t.table_rows], "pad_id": int(t.pad_id)}
    h.update(json.dumps(desc, sort_keys=True).encode())
    for a in (t.multipliers, t.primes, t.offsets, t.token_map):
        h.update(np.ascontiguousarray(a).tobytes())
    encodings = []
    for lid in cfg.layer_ids:
        layer = model.layers[lid] if hasattr(model, "layers") else None
        encodings.append(str(getattr(layer, "table_encoding", "")))
        for name in ("q_weight", "k_weight"):
            v = getattr(layer, name, None)
            if v is not None:
                h.update(np.ascontiguousarray(v).tobytes())
        table = getattr(layer, "table", None)
        try:                                  # the first and last rows: a re-quantised table differs
            if table is not None and len(table):
                h.update(np.ascontiguousarray(table[:2]).tobytes())
                h.update(np.ascontiguousarray(table[-2:]).tobytes())
        except (TypeError, ValueError, IndexError):
            pass
    h.update(json.dumps([encodings, str(getattr(model, "format", ""))]).encode())
    return {"path": str(getattr(model, "path", "")), "sha256": h.hexdigest(), "table_encodings": encodings, **desc}


@dataclass
class _Resident:
    model: object
    engine: object
    tokenizer: object
    identity: dict
    synthetic: object = None            # the device-cached synthetic highway (cuda pipelines)
    build_s: float = 0.0                # opening the model and building the engine, once
    lock: object = dc_field(default_factory=threading.Lock)     # one task at a time on an engine


_RESIDENT: dict = {}                 # in each worker process: key -> _Resident
_RESIDENT_LOCK = threading.Lock()


def _malloc_as_a_process() -> bool:
    """In a worker started with MALLOC_TRIM_THRESHOLD_ set (MALLOC_UNSET): glibc's mmap and trim
    thresholds where its sliding threshold ends up in a plain process. Returns whether it did."""
    if not os.environ.get("MALLOC_TRIM_THRESHOLD_") or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD)) and bool(libc.mallopt(-1, TRIM_THRESHOLD))   # M_MMAP_, M_TRIM_
    except (OSError, AttributeError):       # not glibc
        return False


def resident(source, settings: dict) -> _Resident:
    """This process's opened model and engine for `source` and these settings (built once)."""
    key = (source.key, json.dumps(_jsonable({k: settings.get(k) for k in
                                             ("backend", "residual", "chunk_tokens", "cuda_versions", "tokenizer")}),
                                  sort_keys=True))
    with _RESIDENT_LOCK:
        r = _RESIDENT.get(key)
        if r is not None:
            return r
        from ..pipeline import Pipeline
        from ..text import NoTokenizerError, tokenizer_for
        if not _RESIDENT:
            _malloc_as_a_process()
        t0 = time.perf_counter()
        model, engine = source.open(settings)
        pipe = Pipeline(model, settings["backend"], residual=settings["residual"],
                        versions=settings["cuda_versions"])
        if engine is None and pipe.device_resident:
            engine = pipe.cuda_engine_for(int(settings["chunk_tokens"]))
        try:
            tok = tokenizer_for(model, settings["tokenizer"])
        except NoTokenizerError:
            if settings["tokenizer"] is not None:
                raise
            tok = None
        synth = None
        if engine is not None:
            from .corpus import DeviceSyntheticBlocks
            synth = DeviceSyntheticBlocks(model.config.hc, model.config.dim, int(settings["chunk_tokens"]))
        r = _Resident(model, engine, tok, model_identity(model), synth, time.perf_counter() - t0)
        _RESIDENT[key] = r
        return r


# One shard ----------------------------------------------------------------------------------------

def part_path(out, index: int) -> Path:
    return Path(out) / PARTS / f"shard-{index:05d}.npz"


def _expected(identity: dict, settings: dict, shard: Shard) -> dict:
    return _jsonable({"version": PART_VERSION, "model": identity["sha256"], "settings": settings,
                      "shard": shard.spec()})


_WRITER = None                       # in each worker process: the threads that write partial files
_WRITES: list = []


def _write_later(st: StreamingGateStats, path: Path) -> None:
    """Write on the worker's writer threads while the next shard runs; `flush_writes` waits for them."""
    global _WRITER
    from concurrent.futures import ThreadPoolExecutor
    with _RESIDENT_LOCK:
        if _WRITER is None:
            _WRITER = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="engram-partials")
        _WRITES.append(_WRITER.submit(write_partial, st, path))


def flush_writes() -> int:
    """Wait for this process's pending partial files; raise the first failure. Returns how many."""
    with _RESIDENT_LOCK:
        pending = list(_WRITES)
        _WRITES.clear()
    for f in pending:
        f.result()
    return len(pending)


def write_partial(st: StreamingGateStats, path: Path) -> None:
    """The shard's part file (`partfile.write_part`: temporary name, fsync, rename): whole or absent."""
    write_part(st, path)


def read_partial_header(path: Path) -> dict:
    """The partial-result description inside a shard file; a clear error when it is not one."""
    try:
        with np.load(path, allow_pickle=False) as f:
            head = json.loads(str(f["__state__"]))
        return head["meta"]["partial"]
    except Exception as exc:  # noqa: BLE001 - any failure means the file is not a usable partial
        raise ValueError(f"partial statistics file {path} cannot be read ({type(exc).__name__}: {exc}); "
                         "delete it and run again to recompute that shard") from None


def check_partial(path: Path, want: dict) -> None:
    """Refuse, by name, a partial file made for another study."""
    have = read_partial_header(path)
    diffs = []
    for k in ("version", "model", "settings", "shard"):
        if have.get(k) != want[k]:
            if isinstance(want[k], dict) and isinstance(have.get(k), dict):
                keys = sorted(set(want[k]) | set(have[k]))
                diffs += [f"{k}.{x}: {have[k].get(x)!r} here, {want[k].get(x)!r} now" for x in keys
                          if have[k].get(x) != want[k].get(x)]
            else:
                diffs.append(f"{k}: {have.get(k)!r} here, {want[k]!r} now")
    if diffs:
        raise ValueError(f"partial statistics file {path} belongs to another study (" + "; ".join(diffs[:4]) +
                         "): delete it, or give another output folder")


def run_shard(shard: Shard, documents, source, settings: dict, out, identity: dict) -> PartialStats:
    """One task: the statistics of one shard, written to its partial file (on a writer thread, while
    the next shard runs), returned for the merge tree (`PartialStats`: split for merging when the
    first merge or transfer needs it, not on the GPU's critical path)."""
    from .corpus import corpus_stats
    _register_sizeof()
    r = resident(source, settings)
    if r.identity["sha256"] != identity["sha256"]:
        raise ValueError(f"host {socket.gethostname()}: the model at {source.key} is not the one the client opened "
                         "(its hash constants, token map or gate vectors differ): give every host the same file")
    t0 = time.perf_counter()
    docs = shard_documents(shard, tokenizer=r.tokenizer, field=settings["field"],
                           add_special_tokens=settings["add_special_tokens"], model=r.model, documents=documents)
    with r.lock:
        st = corpus_stats(r.model, documents=docs, backend=settings["backend"], chunk_tokens=settings["chunk_tokens"],
                          tokenizer=r.tokenizer, bins=settings["bins"], max_contexts=settings["max_contexts"],
                          contexts=settings["contexts"], rows=settings["rows"], residual=settings["residual"],
                          versions=settings["cuda_versions"], engine=r.engine,
                          device_highway=None if r.synthetic is None else r.synthetic.device)
    st.tokenizer = None
    st.meta["corpus"] = shard.name
    st.meta["partial"] = _expected(identity, settings, shard)
    timing = st.meta.get("timing", {})
    st.meta["shard_run"] = {"shard": shard.index, "worker": _worker_name(), "seconds": time.perf_counter() - t0,
                            "tokens": st.n_tokens, "timing": {k: timing[k] for k in sorted(timing)}}
    if out is not None:
        _write_later(st, part_path(out, shard.index))
    return PartialStats.later(st)


def warm_lengths(chunk_tokens: int) -> list[int]:
    """Chunk lengths that reach every projection kernel the pipeline picks by token count."""
    return sorted({n for n in (1, 2, 8, 16, 17, 32, 64, 65, 128, 256, 1024, chunk_tokens) if n <= chunk_tokens})


def warm_run(run, model, chunk_tokens: int) -> None:
    """run(documents) once per length of `warm_lengths` (compiles every kernel a shard's chunks,
    short last ones included, can pick)."""
    vocab = int(model.hash_tables.token_map.size)
    for n in warm_lengths(int(chunk_tokens)):
        run([np.arange(n, dtype=np.int64) % vocab])


def warm_worker(source, settings: dict) -> dict:
    """Open the model and build the engine on this worker, and run one document of every chunk
    length that picks another kernel: benchmarks time what follows. Returns {"worker", "build_s"
    (model and engine), "warm_s" (the warm-up runs)}."""
    from .corpus import corpus_stats
    r = resident(source, settings)
    t0 = time.perf_counter()
    with r.lock:
        if r.synthetic is not None:
            r.synthetic.device(np.arange(int(settings["chunk_tokens"])))
        warm_run(lambda docs: corpus_stats(
            r.model, documents=docs, backend=settings["backend"], chunk_tokens=settings["chunk_tokens"],
            tokenizer=r.tokenizer, residual=settings["residual"], versions=settings["cuda_versions"],
            engine=r.engine, device_highway=None if r.synthetic is None else r.synthetic.device),
            r.model, settings["chunk_tokens"])
    return {"worker": _worker_name(), "build_s": round(r.build_s, 3), "warm_s": round(time.perf_counter() - t0, 3)}


def load_partial(path) -> PartialStats:
    """A part file of a finished shard (either format `partfile.read_part` reads)."""
    _register_sizeof()
    return PartialStats.of(read_part(path))


def _merge_two(a: PartialStats, b: PartialStats) -> PartialStats:
    return a + b


def _shard_info(st: PartialStats) -> dict:
    return dict(st.meta.get("shard_run", {}))


_SIZEOF = []


def _register_sizeof() -> None:
    """Tell Dask how large a PartialStats is (its memory accounting and transfer costs), once."""
    if _SIZEOF:
        return
    try:
        from dask.sizeof import sizeof
    except ImportError:  # pragma: no cover - dask without sizeof
        return
    sizeof.register(PartialStats)(lambda p: p.nbytes)
    _SIZEOF.append(True)


def _worker_name() -> str:
    try:
        from distributed import get_worker
        w = get_worker()
        return str(w.name if w.name is not None else w.address)
    except Exception:  # noqa: BLE001 - not on a Dask worker
        return f"{socket.gethostname()}:{os.getpid()}"


def _visible(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK)


def _quiet_workers(dask_worker=None, start: bool = False) -> bool:
    """On a worker (client.run): stop its statistical profiler (start=True: start it again).
    Returns whether it was running (start=False) or was started (start=True)."""
    pcs = [dask_worker.periodic_callbacks.get(k) for k in _PROFILER_CALLBACKS] if dask_worker is not None else []
    pcs = [pc for pc in pcs if pc is not None]
    if start:
        for pc in pcs:
            pc.start()
        return bool(pcs)
    running = any(pc.is_running() for pc in pcs)
    for pc in pcs:
        pc.stop()
    return running


# Clusters ----------------------------------------------------------------------------------------

def visible_gpus() -> list[str]:
    """The GPUs this host shows (CUDA_VISIBLE_DEVICES, else nvidia-smi), without starting CUDA here."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1"]
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def uses_gpu(backend) -> bool:
    """The backend runs a stage with @cuda.jit on a real GPU (not the simulator)."""
    from numba.cuda import config
    if config.ENABLE_CUDASIM:
        return False
    stages = backend.values() if isinstance(backend, dict) else [backend]
    return "cuda" in stages


def local_cluster(n_workers: int | None = None, *, gpu: bool = False, dashboard: bool = True, gpus=None,
                  quiet: bool = True):
    """A Dask cluster on this host: one worker process per GPU (gpu=True; n_workers > GPUs puts
    several on each, round robin; each sees only its own GPU through CUDA_VISIBLE_DEVICES), or
    n_workers CPU workers sharing the cores. Workers are spawned processes (never forked, so no
    CUDA context or OpenMP pool is inherited), each running one shard at a time with merges beside,
    with `QUIET_WORKER`'s settings and malloc as in a plain process (`MALLOC_UNSET`; quiet=False:
    Dask's defaults, to measure what they cost)."""
    distributed = require_distributed("a local cluster")
    import dask
    from distributed import Nanny, Scheduler, SpecCluster
    cores = os.cpu_count() or 1
    if gpu:
        gpus = list(gpus) if gpus is not None else visible_gpus()
        if not gpus:
            raise RuntimeError("the cuda backend needs a GPU, and this host shows none "
                               "(CUDA_VISIBLE_DEVICES, nvidia-smi)")
        n = len(gpus) if n_workers is None else int(n_workers)
    else:
        n = max(1, cores) if n_workers is None else int(n_workers)
    if n < 1:
        raise ValueError(f"workers must be at least 1, got {n}")
    threads = str(max(1, cores // n))
    # two threads: a shard task (one at a time: it holds the worker's one ENGINE_RESOURCE) beside merges
    specs = {}
    for i in range(n):
        env = {"NUMBA_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = str(gpus[i % len(gpus)])
        specs[f"engram-{i}"] = {"cls": Nanny, "options": {"nthreads": 2, "env": env, "name": f"engram-{i}",
                                                         "resources": {ENGINE_RESOURCE: 1},
                                                         "silence_logs": logging.WARNING}}
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn",
                          "distributed.scheduler.worker-ttl": None,
                          **({**QUIET_WORKER, **MALLOC_UNSET} if quiet else {})}):
        cluster = SpecCluster(workers=specs, scheduler={"cls": Scheduler, "options": {
            "dashboard_address": ":0" if dashboard else None, "dashboard": dashboard}},
            silence_logs=logging.WARNING, name="engram-numba")
    del distributed
    return cluster


# The driver ---------------------------------------------------------------------------------------

@dataclass
class RunSummary:
    workers: int = 0
    shards: int = 0
    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    dashboard: str | None = None
    per_worker: dict = dc_field(default_factory=dict)
    per_shard: list = dc_field(default_factory=list)   # computed shards: index, worker, seconds, tokens, stage times
    tail_merges_s: float = 0.0      # after the last shard's statistics arrived: the merges left and the transfer
    tail_parts_s: float = 0.0       # then waiting for the part files still being written
    tail_finalize_s: float = 0.0    # then the merged state's context tables filled on the client
    rewritten: int = 0              # part files lost with a dead worker (result sent, file not yet written), redone

    def to_json(self) -> dict:
        return {"workers": self.workers, "shards": self.shards, "computed": self.computed, "skipped": self.skipped,
                "tokens": self.tokens, "wall_s": round(self.wall_s, 3),
                "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s > 0 else None,
                "dashboard": self.dashboard, "per_worker": self.per_worker,
                "per_shard": sorted(self.per_shard, key=lambda d: d["shard"]),
                "tail_merges_s": round(self.tail_merges_s, 3), "tail_parts_s": round(self.tail_parts_s, 3),
                "tail_finalize_s": round(self.tail_finalize_s, 3), "rewritten": self.rewritten}

    def __str__(self) -> str:
        j = self.to_json()
        lines = [f"{self.workers} worker(s), {self.shards} shard(s) ({self.computed} computed, {self.skipped} from "
                 f"earlier partial files), {self.tokens:,} tokens computed in {self.wall_s:.2f} s"
                 + (f" ({j['tokens_per_s']:,.0f} tokens/s)" if j["tokens_per_s"] else "")]
        for w, d in sorted(self.per_worker.items()):
            lines.append(f"  {w}: {d['shards']} shard(s), {d['tokens']:,} tokens, {d['busy_s']:.2f} s busy, "
                         f"{d['tokens_per_s']:,.0f} tokens/s")
        lines.append(f"  after the last shard: {self.tail_merges_s:.2f} s merges and transfer, {self.tail_parts_s:.2f} s "
                     f"part files, {self.tail_finalize_s:.2f} s filling the context tables")
        if self.rewritten:
            lines.append(f"  {self.rewritten} part file(s) lost with a worker that died after sending its result: "
                         "recomputed and written again")
        return "\n".join(lines)


def _rewrite_lost_parts(client, plan, done, out, source, settings, identity, res, attempts: int = 3) -> int:
    """Part files are written on a worker's writer thread after its task has returned, so a worker
    killed in between loses the file although its statistics reached the merge (the merged result is
    still exact). Recompute those shards (pure functions of their description) and write them again,
    so that a rerun finds every shard done. Returns how many were redone."""
    redone = 0
    for _ in range(attempts):
        lost = [(s, docs) for s, docs in plan if s.index not in done and not part_path(out, s.index).exists()]
        if not lost:
            return redone
        fs = [client.submit(run_shard, s, docs, source, settings, str(out), identity, pure=False,
                            key=f"engram-rewrite-{s.index}-{os.urandom(4).hex()}", resources=res) for s, docs in lost]
        client.gather(fs)
        client.run(flush_writes)
        redone += len(lost)
    lost = [s.index for s, _ in plan if s.index not in done and not part_path(out, s.index).exists()]
    if lost:
        warnings.warn(f"the part files of shard(s) {lost[:8]} could not be written after {attempts} attempts (workers "
                      "keep dying): the statistics returned are exact, but a rerun will compute those shards again",
                      RuntimeWarning, stacklevel=3)
    return redone


def _settings(backend, chunk_tokens, tokenizer, field, split, fmt, add_special_tokens, bins, max_contexts,
              contexts, rows, residual, cuda_versions) -> dict:
    tok = tokenizer
    if tok is not None and not isinstance(tok, (str, os.PathLike)):
        tok = getattr(tok, "source", None)
        if tok is None:
            raise ValueError("tokenizer= must be a path (a tokenizer.json, a folder or a GGUF) to run on Dask, so that "
                             "every worker loads the same one")
    return _jsonable({"backend": backend, "chunk_tokens": int(chunk_tokens),
                      "tokenizer": None if tok is None else str(Path(tok).resolve()), "field": field, "split": split,
                      "fmt": fmt, "add_special_tokens": bool(add_special_tokens), "bins": int(bins),
                      "max_contexts": int(max_contexts), "contexts": bool(contexts), "rows": bool(rows),
                      "residual": residual, "cuda_versions": cuda_versions})


def distributed_corpus_stats(model, corpus=None, *, documents=None, out, client=None, workers: int | None = None,
                             scheduler: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                             docs_per_shard: int = DEFAULT_DOCS_PER_SHARD, backend="cpu", chunk_tokens: int = 4096,
                             tokenizer=None, field: str = "text", split: str = "line", fmt: str | None = None,
                             add_special_tokens: bool = True, bins: int = 20,
                             max_contexts: int = DEFAULT_MAX_CONTEXTS, contexts: bool = True, rows: bool = True,
                             residual: str = "fp32", versions: dict | None = None, progress: bool = True,
                             log=print, continuous: bool = False, limit_tokens=None,
                             token_table=None, cuda_versions: dict | None = None) -> StreamingGateStats:
    """`corpus_stats` over Dask workers (module doc): the same statistics, exactly.

    model:      a model path (every worker opens it), an opened model (its .path is used), or an
                object like `PathModel`: .key, .model() (host side) and .open(settings) -> (model,
                engine or None), built once per worker process (benchmarks use one).
    corpus:     paths as `corpus_stats` takes them; or documents=[token-id arrays] (sent with the tasks).
    out:        the output folder; shard results go to OUT/parts/ (resume: run the same call again).
    client:     a distributed.Client; or scheduler="tcp://host:8786" (an existing cluster); or
                workers=N: a local cluster of N workers (GPU backends: one per GPU by default).
    shard_bytes: the size a file is cut at (documents never split); docs_per_shard for documents=.
    The rest as `corpus_stats`. Returns the merged statistics; meta["distributed"] holds the run
    summary (workers, shards, tokens, wall time, per-worker throughput).
    """
    from ..formats.load import load_model
    from ..text import NoTokenizerError, tokenizer_for
    from .corpus import SYNTHETIC_CORPUS, _describe_corpus, corpus_files, corpus_format

    if continuous:
        raise ValueError("continuous=True runs the corpus as one sequence, which cannot be cut into shards: run it "
                         "in one process (corpus_stats)")
    if limit_tokens is not None:
        raise ValueError("limit_tokens counts tokens in corpus order, which shards do not share: cut the corpus "
                         "instead, or run it in one process")
    if token_table is not None:
        raise ValueError("the per-token table is written by one process: run corpus_stats for it")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if sum(x is not None for x in (client, workers, scheduler)) > 1:
        raise ValueError("give one of client=, scheduler= and workers=")
    if workers is not None and (isinstance(workers, bool) or int(workers) < 1):
        raise ValueError(f"workers must be at least 1, got {workers!r}")
    if corpus is None and documents is None:
        raise ValueError("no corpus: give a path (or paths), or documents=[...]")
    require_distributed("distributed_corpus_stats")
    from distributed import Client, as_completed

    # -- everything checked and planned before any cluster starts
    if isinstance(model, (str, os.PathLike)):
        source = PathModel(model)
        opened = load_model(source.path)
    elif hasattr(model, "key") and hasattr(model, "open"):
        source = model
        opened = model.model()
    else:
        if not Path(str(getattr(model, "path", ""))).exists():
            raise ValueError("an opened model must have a .path the workers can open (or pass the path itself)")
        source, opened = PathModel(model.path), model
    identity = model_identity(opened)
    from ..engine_build import versions_keyword
    versions, _ = versions_keyword(versions, cuda_versions, "distributed_corpus_stats")
    settings = _settings(backend, chunk_tokens, tokenizer, field, split, fmt, add_special_tokens, bins, max_contexts,
                         contexts, rows, residual, versions)
    StreamingGateStats.empty(opened, bins=bins, max_contexts=max_contexts, contexts=contexts, rows=False)  # checks
    files = corpus_files(corpus) if corpus is not None else []
    kinds = {corpus_format(f, fmt) for f in files}
    if "highway" in kinds and (len(kinds) > 1 or documents is not None):
        raise ValueError("the corpus mixes documents with highway files and documents without: run them separately "
                         "(a statistic over both would mix real and synthetic hidden states)")
    try:
        tok = tokenizer_for(opened, settings["tokenizer"], need_encode="text" in kinds)
    except NoTokenizerError:
        if "text" in kinds or settings["tokenizer"] is not None:
            raise
        tok = None
    plan = [(s, None) for s in plan_shards(files, fmt=fmt, split=split, shard_bytes=shard_bytes, field=field)]
    if documents is not None:
        base = len(plan)
        for s, docs in plan_documents(documents, docs_per_shard):
            plan.append((Shard(base + s.index, s.path, s.kind, s.unit, s.start, s.stop, digest=s.digest), docs))
    out = Path(out).resolve()
    parts = out / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    plan_file = parts / "plan.json"
    plan_json = _jsonable({"version": PART_VERSION, "model": identity, "settings": settings,
                           "shards": [s.spec() for s, _ in plan]})
    if plan_file.exists():
        try:
            old = json.loads(plan_file.read_text(encoding="utf-8"))
        except ValueError:
            raise ValueError(f"{plan_file} cannot be read: delete {parts} to start the study again") from None
        if old != plan_json:
            what = [k for k in ("version", "model", "settings", "shards") if old.get(k) != plan_json[k]]
            raise ValueError(f"{out} holds partial statistics of another study ({', '.join(what)} differ, see "
                             f"{plan_file}): give another output folder, or delete {parts}")
    else:
        tmp = plan_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan_json, indent=1), encoding="utf-8")
        os.replace(tmp, plan_file)
    for stale in parts.glob(".shard-*.tmp.npz"):
        stale.unlink(missing_ok=True)
    done = {}
    for s, _ in plan:
        p = part_path(out, s.index)
        if p.exists():
            check_partial(p, _expected(identity, settings, s))
            done[s.index] = p

    # -- the cluster
    own = None
    if client is None:
        if scheduler is not None:
            client = Client(scheduler)
        else:
            own = local_cluster(workers, gpu=uses_gpu(backend))
            client = Client(own)
        owned_client = True
    else:
        owned_client = False
    summary = RunSummary(shards=len(plan), skipped=len(done), computed=len(plan) - len(done))
    profiling = {}
    try:
        info = client.scheduler_info()
        summary.workers = len(info.get("workers", {}))
        if "dashboard" in info.get("services", {}):
            summary.dashboard = client.dashboard_link
            log(f"Dask dashboard: {summary.dashboard}")
        seen = client.run(_visible, str(parts))
        blind = [w for w, ok in seen.items() if not ok]
        if blind:
            raise ValueError(f"the output folder {out} is not writable at that path on worker(s) "
                             f"{', '.join(map(str, blind[:4]))}: give a folder on a file system every worker shares")
        profiling = client.run(_quiet_workers)         # the profiler takes the GIL from the shards every 10 ms
        every = [w.get("resources", {}).get(ENGINE_RESOURCE, 0) >= 1 for w in info.get("workers", {}).values()]
        res = {ENGINE_RESOURCE: 1} if every and all(every) else None
        t0 = time.perf_counter()
        leaves, infos, merges = [], [], []
        for s, docs in plan:
            if s.index in done:
                leaves.append(client.submit(load_partial, str(done[s.index]), pure=False,
                                            key=f"engram-load-{s.index}-{os.urandom(4).hex()}"))
            else:
                f = client.submit(run_shard, s, docs, source, settings, str(out), identity, pure=False,
                                  key=f"engram-shard-{s.index}-{os.urandom(4).hex()}", resources=res)
                leaves.append(f)
                infos.append(client.submit(_shard_info, f, pure=False))
        level = leaves
        while len(level) > 1:                        # the tree, in shard order
            nxt = []
            for i in range(0, len(level), 2):
                if i + 1 < len(level):
                    merges.append(client.submit(_merge_two, level[i], level[i + 1], pure=False))
                    nxt.append(merges[-1])
                else:
                    nxt.append(level[i])
            level = nxt
        total_f = level[0]
        bar = None
        if progress and infos:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(plan), initial=len(done), desc="shards", unit="shard")
        per = summary.per_worker
        try:
            for _, inf in as_completed(infos, with_results=True):
                w = per.setdefault(inf["worker"], {"shards": 0, "tokens": 0, "busy_s": 0.0, "tokens_per_s": 0.0})
                w["shards"] += 1
                w["tokens"] += int(inf["tokens"])
                w["busy_s"] += float(inf["seconds"])
                w["tokens_per_s"] = w["tokens"] / w["busy_s"] if w["busy_s"] > 0 else 0.0
                summary.per_shard.append({"shard": int(inf["shard"]), "worker": inf["worker"],
                                          "seconds": round(float(inf["seconds"]), 3), "tokens": int(inf["tokens"]),
                                          "timing": inf.get("timing", {})})
                summary.tokens += int(inf["tokens"])
                if bar is not None:
                    el = time.perf_counter() - t0
                    bar.set_postfix_str(f"{summary.tokens / max(el, 1e-9):,.0f} tok/s; " + ", ".join(
                        f"{k} {v['tokens_per_s']:,.0f}" for k, v in sorted(per.items())), refresh=False)
                    bar.update(1)
            t_end = time.perf_counter()
            total = total_f.result()
            summary.tail_merges_s = time.perf_counter() - t_end
            client.run(flush_writes)
            summary.rewritten = _rewrite_lost_parts(client, plan, done, out, source, settings, identity, res)
            summary.tail_parts_s = time.perf_counter() - t_end - summary.tail_merges_s
            t_end = time.perf_counter()
            st = total.stats()
            summary.tail_finalize_s = time.perf_counter() - t_end
        except BaseException:
            client.cancel(leaves + infos + merges)      # a shared cluster goes on with other work
            raise
        finally:
            if bar is not None:
                bar.close()
        summary.wall_s = time.perf_counter() - t0
        for w in per.values():
            w["busy_s"] = round(w["busy_s"], 3)
            w["tokens_per_s"] = round(w["tokens_per_s"], 1)
    finally:
        again = [w for w, was in profiling.items() if was]
        if again and own is None:                      # a cluster we did not start: as it was
            try:
                client.run(_quiet_workers, start=True, workers=again)
            except Exception:  # noqa: BLE001 - a worker gone since: nothing to start again
                pass
        if owned_client:
            client.close()
        if own is not None:
            own.close()
    st.tokenizer = tok
    for k in ("partial", "shard_run"):
        st.meta.pop(k, None)
    st.meta.update({"model": identity["path"], "corpus": _describe_corpus(files, None, documents),
                    "highway": (f"imported from {len(files)} highway file(s)" if kinds == {"highway"} else
                                SYNTHETIC_CORPUS),
                    "tokenizer": getattr(tok, "source", None) if tok is not None else st.meta.get("tokenizer"),
                    "tokens_per_s": summary.to_json()["tokens_per_s"], "distributed": summary.to_json(),
                    "output": str(out)})
    st.meta.pop("timing", None)
    return st
