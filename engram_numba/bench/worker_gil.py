"""What a Dask worker's side work costs a host-bound driver thread: the GIL, measured on the CPU.

    python -m engram_numba.bench.worker_gil [--seconds 4] [--chunks 16] [--dask] [--malloc] [--corpus 4]
                                             [--no-side] [--out gil.json]

`corpus_stats` with device tables is bound by its host thread (Python that launches kernels and
waits on the device: many short calls that release the GIL), so whatever else the process runs
while holding the GIL is taken off its throughput. This bench runs a stand-in for that thread
(`driver`: per iteration, `launches` short ctypes calls with a little Python between them, then
a wait of `wait_us` with the GIL released, as a device synchronisation is) for a fixed time, and
a probe thread that sleeps 1 ms in a loop and records how late it wakes (the time it waits for
the GIL). Each is measured alone, then beside each piece of work a worker runs next to a shard:

- `part_file`: writing one shard's part file (`partfile.write_part`), over and over;
- `split_merge`: splitting a state into its merge form (`PartialStats.of`) and merging two;
- `pickle`: pickling a `PartialStats` as Dask does to send it;
- with `--dask`: the driver and probe as a task on a one-worker Dask cluster as the Dask driver
  starts it (`local_cluster`), and with Dask's defaults (statistical profiler every 10 ms, event
  loop ticks, monitors), against the same in this process.

Each side load's GIL is also measured directly (`gil_held`: a spinning Python thread's schedstat).
`--malloc`: one shard's reduction in fresh processes, plain and with the malloc setting Dask's
nanny gives its workers (page faults, CPU). `--corpus N`: N shards of the tiny model on the cpu
backend, in process and as the tasks of one Dask worker (seconds, CPU seconds by thread).

The state is one shard of `chunks` 4096-token chunks reduced at the released shapes (two tables of
384M rows: 48 MB row bitmaps, the context tables), as `bench.shard_state` builds it. The figures
are ratios to `alone` on the same machine; on a machine with few cores, work that releases the
GIL still competes for the cores, which the `cpu_s` of each side load shows.
"""
from __future__ import annotations

import ctypes
import json
import os
import pickle
import sys
import tempfile
import threading
import time

import numpy as np


def driver(seconds: float, launches: int = 12, wait_us: int = 200, probe: bool = True) -> dict:
    """The stand-in host-bound driver thread (module doc) for `seconds`, with a GIL probe beside it.
    Returns {"iters_per_s", "iter_us_p50/p99", "probe_late_us_mean/p99/max"}."""
    libc = ctypes.CDLL(None)
    getpid, usleep = libc.getpid, libc.usleep
    small = np.arange(64, dtype=np.int64)
    late: list = []
    stop = threading.Event()

    def probe_loop():
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - t0 - 0.001)

    th = threading.Thread(target=probe_loop, daemon=True) if probe else None
    if th is not None:
        th.start()
    times = []
    t_end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        if t0 >= t_end:
            break
        acc = 0
        for k in range(launches):          # argument packing and a launch: Python, then a call without the GIL
            args = (small, k, {"grid": k + 1, "block": 128})
            acc += int(small[k]) + len(args[2])
            getpid()
        usleep(wait_us)                     # the synchronisation: the GIL released, no CPU
        times.append(time.perf_counter() - t0)
    stop.set()
    if th is not None:
        th.join()
    t = np.asarray(times)
    lt = np.asarray(late) * 1e6 if late else np.zeros(1)
    return {"iters_per_s": round(t.size / max(float(t.sum()), 1e-9), 1),
            "iter_us_p50": round(float(np.percentile(t, 50)) * 1e6, 1),
            "iter_us_p99": round(float(np.percentile(t, 99)) * 1e6, 1),
            "probe_late_us_mean": round(float(lt.mean()), 1), "probe_late_us_p99": round(float(np.percentile(lt, 99)), 1),
            "probe_late_us_max": round(float(lt.max()), 1)}


def _schedstat(tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of thread `tid` of this process (Linux)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        on, wait = f.read().split()[:2]
    return int(on) / 1e9, int(wait) / 1e9


def gil_held(work, reps: int = 3) -> dict:
    """How long work() holds the GIL while another thread wants it: a pure-Python thread spins
    beside it, and the time that thread spends neither on a CPU nor waiting for one (its
    /proc schedstat) is time it waited for the GIL. A busy machine delays both threads but does
    not change that difference, unlike a probe's wall-clock lateness. The minimum over `reps`:
    {"wall_s", "cpu_s" (work's thread CPU), "gil_held_s"}."""
    best = None
    for _ in range(reps):
        stop, box = threading.Event(), {}
        started = threading.Event()

        def spin():
            box["tid"] = threading.get_native_id()
            started.set()
            n = 0
            while not stop.is_set():
                n += 1

        th = threading.Thread(target=spin, daemon=True)
        th.start()
        started.wait()
        try:
            s0 = _schedstat(box["tid"])
        except OSError:                       # no schedstat here
            stop.set()
            th.join()
            return {}
        t0, c0 = time.perf_counter(), time.thread_time()
        work()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        s1 = _schedstat(box["tid"])
        stop.set()
        th.join()
        r = {"wall_s": wall, "cpu_s": cpu, "gil_held_s": max(0.0, wall - (s1[0] - s0[0]) - (s1[1] - s0[1]))}
        best = r if best is None else {k: min(best[k], r[k]) for k in r}
    return {k: round(v, 4) for k, v in best.items()}


def _side_loop(work, stop: threading.Event, log: dict) -> None:
    """Run work() until stop; record how many times, its wall and its thread CPU seconds."""
    n, wall, cpu = 0, 0.0, 0.0
    while not stop.is_set():
        c0, t0 = time.thread_time(), time.perf_counter()
        work()
        wall += time.perf_counter() - t0
        cpu += time.thread_time() - c0
        n += 1
    log.update({"runs": n, "s_per_run": round(wall / max(n, 1), 3), "cpu_s_per_run": round(cpu / max(n, 1), 3)})


def beside(work, seconds: float, **kw) -> dict:
    """driver() while work() runs in a loop on another thread."""
    stop, log = threading.Event(), {}
    th = threading.Thread(target=_side_loop, args=(work, stop, log), daemon=True)
    th.start()
    time.sleep(0.05)
    out = driver(seconds, **kw)
    stop.set()
    th.join()
    out["side"] = log
    return out


def shard_state(n_chunks: int, seed: int = 12):
    """One shard's StreamingGateStats at the released shapes (as bench.shard_state reduces it)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..analysis.corpus import Document, _jobs
    from ..analysis.streaming import Chunk, StreamingGateStats
    from .shard_state import CHUNK, _Model
    m = _Model()
    vocab = m.hash_tables.compressed_vocab_size
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < n_chunks * CHUNK:
        n = min(int(rng.integers(256, 4096)), n_chunks * CHUNK - total)
        docs.append(Document(f"d{len(docs)}", ((rng.zipf(1.1, n) - 1) % vocab).astype(np.int64)))
        total += n
    st = StreamingGateStats.empty(m)
    with ThreadPoolExecutor(min(5, os.cpu_count() or 1)) as pool:
        for j in _jobs(iter(docs), m, CHUNK, False, True, None):
            T = j.token_ids.size
            g = {lid: (rng.standard_normal((T, 4)).astype(np.float32), rng.random((T, 4)).astype(np.float32))
                 for lid in (1, 14)}
            st.update(Chunk(j.token_ids, j.live, j.row_ids, j.windows, g, j.n_documents), m.hash_tables.token_map,
                      pool)
    return st


def _dask_driver(seconds: float, kw: dict) -> dict:
    return driver(seconds, **kw)


def thread_cpu() -> dict:
    """CPU seconds each thread of this process has used so far ({name: s}, from /proc; {} elsewhere),
    and the process's: contention on a busy machine stretches wall time, not these."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "native")           # numba / OpenMP / libuv threads Python does not know
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    out["process"] = time.process_time()
    try:
        import resource
        out["minor_faults"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)   # pages faulted in
    except ImportError:                                # not on this platform
        pass
    return out


def _worker_costs(dask_worker=None) -> dict:
    """On a worker (client.run): thread_cpu() and the time its profiler has spent so far."""
    prof = float(dask_worker.digests_total.get("profile-duration", 0.0)) if dask_worker is not None else 0.0
    return {"cpu": thread_cpu(), "profile_s": prof}


def thread_kind(name: str) -> str:
    """A thread's name without its pool's numbering: "engram-stats_3" -> "engram-stats"; a Dask
    worker's task threads ("engram-0-Dask-Default-Threads-123-0") -> "Dask-Default-Threads"."""
    import re
    if "Dask-Default-Threads" in name:
        return "Dask-Default-Threads"
    return re.sub(r"([-_]\d+)+$", "", name) or name


def cpu_diff(a: dict, b: dict, per: float = 1.0) -> dict:
    """CPU seconds between two thread_cpu() readings by thread kind (`thread_kind`), divided by `per`.
    Threads that started and ended in between (a corpus_stats call's producer, reducer and
    statistics pool) are not listed by the system any more: their CPU is "ended" (the process's
    CPU less every listed thread's). "minor_faults": the process's page faults (a count, not seconds)."""
    out: dict = {}
    for name in set(a) | set(b):
        k = thread_kind(name)
        out[k] = out.get(k, 0.0) + (b.get(name, 0.0) - a.get(name, 0.0)) / per
    if "process" in out:
        out["ended"] = out["process"] - sum(v for k, v in out.items() if k not in ("process", "minor_faults"))
    return {k: round(v, 4) for k, v in sorted(out.items())}


def in_dask(seconds: float, quiet: bool, kw: dict) -> dict:
    """driver() as a task on a one-worker cluster: as `local_cluster` starts it (quiet=True), or with
    Dask's default worker settings (statistical profiler, monitors)."""
    from distributed import Client

    from ..analysis import distributed as dist
    cluster = dist.local_cluster(1, dashboard=False, quiet=quiet)
    try:
        with Client(cluster) as client:
            client.submit(_dask_driver, 0.5, kw, pure=False).result()       # imports, thread pool up
            (w, before), = client.run(_worker_costs).items()
            t0 = time.perf_counter()
            out = client.submit(_dask_driver, seconds, kw, pure=False).result()
            wall = time.perf_counter() - t0
            after = client.run(_worker_costs)[w]
    finally:
        cluster.close()
    # the worker's event loop is its MainThread; the task runs on a Dask-Default-Threads thread
    out["worker_cpu_per_s"] = cpu_diff(before["cpu"], after["cpu"], wall)
    out["profiler_s_per_s"] = round((after["profile_s"] - before["profile_s"]) / wall, 4)
    return out


def run(seconds: float = 4.0, n_chunks: int = 16, dask_runs: bool = False, side: bool = True, log=print,
        **kw) -> dict:
    """The driver alone and beside each side load (side=False: alone only), its GIL seconds, and
    with dask_runs the driver as a Dask task (quiet settings, then Dask's defaults)."""
    out = {"seconds": seconds, "chunks": n_chunks, "driver": kw, "runs": {}}
    res = out["runs"]
    if not side:
        res["alone"] = driver(seconds, **kw)
    else:
        _side_loads(out, seconds, n_chunks, log, kw)
    if dask_runs:
        res["dask_worker"] = in_dask(seconds, True, kw)
        res["dask_worker_defaults"] = in_dask(seconds, False, kw)
        res["alone_again"] = driver(seconds, **kw)
    if dask_runs:
        for name in ("dask_worker", "dask_worker_defaults"):
            log(f"  {name}: worker CPU seconds a second by thread {res[name]['worker_cpu_per_s']}; profiler "
                f"{res[name]['profiler_s_per_s']:.4f} s a second")
    base = (res["alone"]["iters_per_s"] + res.get("alone_again", res["alone"])["iters_per_s"]) / 2
    for name, r in res.items():
        r["ratio_to_alone"] = round(r["iters_per_s"] / base, 3)
        sd = r.get("side", {})
        log(f"  {name:22s} driver {r['iters_per_s']:9,.0f} it/s (x{r['ratio_to_alone']:.3f}), iteration p50 "
            f"{r['iter_us_p50']:7.0f} us p99 {r['iter_us_p99']:7.0f} us; GIL probe late mean {r['probe_late_us_mean']:6.0f} us "
            f"p99 {r['probe_late_us_p99']:6.0f} us max {r['probe_late_us_max']:7.0f} us"
            + (f"; side: {sd['s_per_run']:.3f} s a run, {sd['cpu_s_per_run']:.3f} s CPU" if sd else ""))
    return out


def _side_loads(out: dict, seconds: float, n_chunks: int, log, kw: dict) -> None:
    from ..analysis.partfile import PartialStats, write_part
    t0 = time.perf_counter()
    a = shard_state(n_chunks)
    b = shard_state(n_chunks, seed=13)
    log(f"two shards of {a.n_tokens:,} tokens reduced in {time.perf_counter() - t0:.1f} s; contexts "
        f"{[t.n for t in a.contexts.values()]}, bitmaps {[round(float(np.count_nonzero(x)) / x.size, 3) for x in a.row_bitmaps]} "
        "non-zero bytes")
    pa = PartialStats.of(a)
    out["tokens_per_shard"] = a.n_tokens
    res = out["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        loads = {
            "part_file": lambda: write_part(a, os.path.join(tmp, "shard-00000.npz")),
            "split_merge": lambda: PartialStats.of(b) + pa,
            "pickle": lambda: pickle.dumps(PartialStats.of(b), protocol=5),
        }
        for name, work in (("alone", None), *loads.items()):
            res[name] = driver(seconds, **kw) if work is None else beside(work, seconds, **kw)
        from ..analysis import partfile
        from ..formats import npz

        def numpy_writer(f, arr):
            np.lib.format.write_array(f, np.asanyarray(arr), allow_pickle=False)
        held = out["gil_held"] = {"sleep_0.2s (zero)": gil_held(lambda: time.sleep(0.2))}
        for name, work in loads.items():
            held[name] = gil_held(work)
        mine = (partfile.write_npy, npz.write_npy, partfile._count_nonzero)
        partfile.write_npy = npz.write_npy = numpy_writer       # the part file as numpy's writer writes it
        partfile._count_nonzero = np.count_nonzero
        try:
            held["part_file_numpy_writer"] = gil_held(loads["part_file"])
        finally:
            partfile.write_npy, npz.write_npy, partfile._count_nonzero = mine
        for name, r in held.items():
            log(f"  GIL held while another thread wants it: {name:24s} {r.get('gil_held_s', float('nan')):.3f} s of "
                f"{r.get('wall_s', float('nan')):.3f} s wall, {r.get('cpu_s', float('nan')):.3f} s CPU")


def corpus_run(n_shards: int = 4, shard_tokens: int = 4096, log=print, seed: int = 0) -> dict:
    """The same shards through `corpus_stats` in this process and as the tasks of a one-worker Dask
    cluster (`distributed_corpus_stats`), with the tiny model on the cpu backend: seconds a shard
    on each side, and the CPU seconds a million tokens by thread (`cpu_diff`)."""
    from distributed import Client

    from ..analysis import distributed as dist
    from ..analysis.corpus import corpus_stats
    from ..fixtures import TINY_PATH
    from ..formats.load import load_model
    model = load_model(TINY_PATH)
    rng = np.random.default_rng(seed)
    vocab = int(model.hash_tables.token_map.size)
    per = 4
    docs = [rng.integers(0, vocab, int(rng.integers(shard_tokens // per // 2, 3 * shard_tokens // per // 2)))
            for _ in range(n_shards * per)]
    shards = [docs[a:a + per] for a in range(0, len(docs), per)]
    corpus_stats(model, documents=shards[0], backend="cpu")                 # compiled before timing
    c0, seconds = thread_cpu(), []
    for d in shards:
        t0 = time.perf_counter()
        corpus_stats(model, documents=d, backend="cpu")
        seconds.append(time.perf_counter() - t0)
    n_tok = sum(int(x.size) for x in docs)
    cpu_in = cpu_diff(c0, thread_cpu(), n_tok / 1e6)
    cluster = dist.local_cluster(1, dashboard=False)
    try:
        with Client(cluster) as client, tempfile.TemporaryDirectory() as out:
            settings = dist._settings("cpu", 4096, None, "text", "line", None, True, 20, dist.DEFAULT_MAX_CONTEXTS,
                                      True, True, "fp32", None)
            client.submit(dist.warm_worker, dist.PathModel(TINY_PATH), settings, pure=False).result()
            (w, before), = client.run(thread_cpu).items()
            st = dist.distributed_corpus_stats(TINY_PATH, documents=docs, docs_per_shard=per, out=out, client=client,
                                               backend="cpu", progress=False, log=lambda *a: None)
            after = client.run(thread_cpu)[w]
    finally:
        cluster.close()
    sm = st.meta["distributed"]
    busy = sum(v["busy_s"] for v in sm["per_worker"].values())
    res = {"shards": n_shards, "tokens": n_tok, "in_process_s": [round(x, 3) for x in seconds],
           "in_process_total_s": round(sum(seconds), 3), "tasks_busy_s": round(busy, 3),
           "task_s": [d["seconds"] for d in sm.get("per_shard", [])], "wall_s": sm["wall_s"],
           "in_task_ratio_to_in_process": round(sum(seconds) / busy, 3) if busy else None,
           "cpu_s_per_million_tokens": {"in_process": cpu_in, "worker": cpu_diff(before, after, n_tok / 1e6)}}
    log(f"  {n_shards} shards, {n_tok:,} tokens (tiny model, cpu backend): in process {res['in_process_total_s']:.2f} s "
        f"{res['in_process_s']}, tasks {res['tasks_busy_s']:.2f} s {res['task_s']} (x{res['in_task_ratio_to_in_process']}), "
        f"Dask wall {sm['wall_s']:.2f} s")
    log(f"  CPU seconds a million tokens: in process {cpu_in}; worker {res['cpu_s_per_million_tokens']['worker']}")
    return res


_MALLOC_CHILD = """
import json, os, resource, sys, time
from engram_numba.analysis.distributed import _malloc_as_a_process
from engram_numba.bench.worker_gil import shard_state
if os.environ.get("ENGRAM_MALLOPT"):
    _malloc_as_a_process()
shard_state(2)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
shard_state(int(sys.argv[1]))
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"minor_faults": r1.ru_minflt - r0.ru_minflt, "user_s": round(r1.ru_utime - r0.ru_utime, 3),
                  "sys_s": round(r1.ru_stime - r0.ru_stime, 3), "wall_s": round(time.perf_counter() - t0, 3)}))
"""


def malloc_run(n_chunks: int = 16, reps: int = 2, log=print) -> dict:
    """One shard's reduction at the released shapes (`shard_state`) in fresh processes: as a plain
    process, with the MALLOC_TRIM_THRESHOLD_=65536 Dask's nanny gives its workers, and with that
    plus `_malloc_as_a_process` (what a worker does when it builds its engine). Page faults and
    CPU seconds (the minimum over `reps`): contention on the machine does not change the faults."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = {k: v for k, v in os.environ.items() if k not in ("MALLOC_TRIM_THRESHOLD_", "ENGRAM_MALLOPT")}
    base["PYTHONPATH"] = root + os.pathsep + base.get("PYTHONPATH", "")
    variants = {"plain process": {}, "MALLOC_TRIM_THRESHOLD_=65536 (Dask's nanny)": {"MALLOC_TRIM_THRESHOLD_": "65536"},
                "the same, then _malloc_as_a_process": {"MALLOC_TRIM_THRESHOLD_": "65536", "ENGRAM_MALLOPT": "1"}}
    out = {}
    for _ in range(reps):
        for name, env in variants.items():
            p = subprocess.run([sys.executable, "-c", _MALLOC_CHILD, str(n_chunks)], env={**base, **env},
                               capture_output=True, text=True, check=True)
            r = json.loads(p.stdout.strip().splitlines()[-1])
            out[name] = r if name not in out else {k: min(out[name][k], r[k]) for k in r}
    for name, r in out.items():
        log(f"  {name:45s} {r['minor_faults']:>9,} page faults, {r['user_s']:.2f} s user, {r['sys_s']:.2f} s system")
    return out


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="each measurement's length")
    p.add_argument("--chunks", type=int, default=16, help="4096-token chunks in the shard whose state is written")
    p.add_argument("--launches", type=int, default=12, help="driver: short GIL-releasing calls an iteration")
    p.add_argument("--wait-us", type=int, default=200, help="driver: the GIL-released wait an iteration")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for this run (s)")
    p.add_argument("--dask", action="store_true", help="also the driver as a task on a one-worker Dask cluster")
    p.add_argument("--no-side", action="store_true", help="skip the side loads (part file, merge, pickle)")
    p.add_argument("--malloc", action="store_true",
                   help="also: one shard's reduction in fresh processes with and without Dask's malloc setting")
    p.add_argument("--corpus", type=int, default=0, metavar="SHARDS",
                   help="also: this many shards of the tiny model (cpu backend), in process and on one Dask worker")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    from .timing import commit
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    res = run(args.seconds, args.chunks, args.dask, not args.no_side, launches=args.launches, wait_us=args.wait_us)
    if args.malloc:
        res["malloc"] = malloc_run(args.chunks)
    if args.corpus:
        res["corpus"] = corpus_run(args.corpus)
    res.update({"commit": commit(), "switch_interval": sys.getswitchinterval(), "cpus": os.cpu_count()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
