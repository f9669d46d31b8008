"""Profile the Python work of the corpus run's device-driving thread, per chunk, without a GPU.

    PYTHONPATH=$PWD python tools/gates_profile.py [--chunks 24] [--launch-us 25] [--cprofile]
        [--model q2k|fp8] [--fp8-proj decode|bf16]

The bench model at the released shapes (dim 5120, hc 4, layers 1 and 14, 24 hash columns, bf16
wkv [25600, 6144]; small tables, so the rows fit this machine) on numba's simulator, with every
kernel launch replaced by a counter (nothing computes) and device-to-device copies counted, not
made: what is left is the host thread's own work a chunk. Two drivers over the same chunks:
  1. `Pipeline.gates_from_ids`, one chunk at a time (what corpus_stats did): Values, the engine's
     stage methods and checks, pageable id uploads, synchronous dot/gate copies;
  2. `DeviceChunks.submit` + its result (what corpus_stats does now with every table on the
     device): pinned buffers, prepared launches, one event a chunk.
For each: launches, host->device / device->host / device->device copies (synchronous ones: those on
the default stream or from pageable memory, which wait for the device), device and pinned
allocations, and the host milliseconds a chunk; plus an estimate with numba's launch cost on the
H200 (--launch-us each, 17-41 us measured) added, which the simulator does not have.
"""
from __future__ import annotations

import argparse
import os
import time
from collections import Counter

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=24)
    p.add_argument("--launch-us", type=float, default=25.0, help="numba's host cost of one launch on the GPU")
    p.add_argument("--cprofile", action="store_true", help="also print the top functions of each driver")
    p.add_argument("--model", default="q2k", choices=("q2k", "fp8"),
                   help="the bench model's encodings: q2k (Q2_K tables; wkv as bf16) or fp8 (FP8 tables with their "
                        "scale tables, FP8 wkv as --fp8-proj holds it)")
    p.add_argument("--fp8-proj", default="decode", choices=("decode", "bf16"),
                   help="fp8: decode (the engine's default: the FP8 wkv decoded to a bf16 scratch a chunk) or bf16 "
                        "(decoded once at build)")
    args = p.parse_args(argv)

    from numba import cuda
    from numba.cuda.simulator.cudadrv import devicearray as sim_da

    from engram_numba.analysis.corpus import Document, _jobs
    from engram_numba.analysis.device_chunks import DeviceChunks
    from engram_numba.bench.corpus import CHUNK, BenchModel, _documents, _fill_device_table
    from engram_numba.bench.timing import RELEASED
    from engram_numba.device import launch as launch_mod
    from engram_numba.engine import EngramV41
    from engram_numba.pipeline import Pipeline

    t0 = time.perf_counter()
    model = BenchModel(RELEASED, 1031, kind=args.model)
    cfg = model.config
    fmt = "bf16" if args.model == "q2k" or args.fp8_proj == "bf16" else None
    eng = EngramV41(model, max_tokens=CHUNK, device_tables=False, wkv_format=fmt)
    for lid in cfg.layer_ids:
        lay = model.layers[lid]
        eng.layers[lid].table = _fill_device_table(lay.n_rows, lay.table.block, cuda)
        if lay.table_scales is not None:
            eng.layers[lid].table_scales = _fill_device_table(lay.n_rows, lay.table_scales.block, cuda)
        eng.layers[lid].placement = "device"
    print(f"wkv on the device: {eng.wkv_format}")
    docs = _documents(args.chunks * CHUNK, model.hash_tables.token_map.size, np.random.default_rng(11))
    jobs = list(_jobs((Document(f"d{i}", d) for i, d in enumerate(docs)), model, CHUNK, False, False, None))
    highway = cuda.device_array((CHUNK, cfg.hc, cfg.dim), dtype=np.float32)
    print(f"model: {model.path}; {len(jobs)} chunks of {CHUNK} tokens (setup {time.perf_counter() - t0:.1f} s)")

    counts: Counter = Counter()

    def launch_stub(self):
        counts["launches"] += 1
        return self.out
    launch_mod.PreparedLaunch.__call__ = launch_stub

    real_to_dev, real_to_host = sim_da.FakeCUDAArray.copy_to_device, sim_da.FakeCUDAArray.copy_to_host

    def to_device(self, ary, stream=0):
        if sim_da.is_cuda_ndarray(ary):
            counts["d2d copies"] += 1
            counts["d2d copies, default stream"] += not stream
            return None                                      # counted, not made (the highway refresh)
        counts["h2d copies"] += 1
        counts["h2d copies that wait (default stream or pageable)"] += (not stream) or not _pinned(ary)
        return real_to_dev(self, ary, stream)

    def to_host(self, ary=None, stream=0):
        counts["d2h copies"] += 1
        counts["d2h copies that wait (default stream or pageable)"] += (not stream) or ary is None or not _pinned(ary)
        return real_to_host(self, ary, stream)
    pinned_ids = set()
    real_pinned = cuda.pinned_array

    def pinned_array(*a, **k):
        counts["pinned allocations"] += 1
        arr = real_pinned(*a, **k)
        pinned_ids.add(arr.ctypes.data)
        return arr

    def _pinned(ary):
        return getattr(ary, "base", None) is not None and any(
            b in pinned_ids for b in (ary.ctypes.data, getattr(ary.base, "ctypes", ary).data))
    real_device_array = cuda.device_array

    def device_array(*a, **k):
        counts["device allocations"] += 1
        return real_device_array(*a, **k)
    real_to_device_fn = cuda.to_device

    def to_device_fn(ary, *a, **k):
        counts["device allocations"] += 1
        counts["h2d copies"] += 1
        counts["h2d copies that wait (default stream or pageable)"] += 1
        return real_to_device_fn(ary, *a, **k)
    sim_da.FakeCUDAArray.copy_to_device, sim_da.FakeCUDAArray.copy_to_host = to_device, to_host
    cuda.pinned_array, cuda.device_array, cuda.to_device = pinned_array, device_array, to_device_fn
    real_event = cuda.event

    def event(*a, **k):
        counts["events made"] += 1
        ev = real_event()
        sync = ev.synchronize

        def synchronize():
            counts["event waits"] += 1
            sync()
        ev.synchronize = synchronize
        return ev
    cuda.event = event

    pipe = Pipeline(model, "cuda")
    pipe.use_cuda_engine(eng)

    def old(job):
        return pipe.gates_from_ids(job.row_ids, highway, None if job.live.all() else job.live)

    dc = DeviceChunks(eng, pipe.residual, pipe.eps)

    def new(job):
        return dc.submit(job.row_ids, highway, None if job.live.all() else job.live)

    results = {}
    for name, run in (("gates_from_ids, one chunk at a time", old), ("DeviceChunks, queued ahead", new)):
        run(jobs[0]) if name.startswith("gates") else run(jobs[0])()           # warm: plans made
        counts.clear()
        prof = None
        if args.cprofile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        pending = []
        for job in jobs[1:]:
            out = run(job)
            if callable(out):
                pending.append(out)
                if len(pending) > 2:
                    pending.pop(0)()
        for f in pending:
            f()
        dt = (time.perf_counter() - t) / (len(jobs) - 1)
        if prof is not None:
            prof.disable()
        n = len(jobs) - 1
        per = {k: v / n for k, v in sorted(counts.items())}
        results[name] = (dt, per)
        print(f"\n{name}: {1e3 * dt:.3f} ms of host work a chunk (launches stubbed); "
              f"with {args.launch_us:g} us a launch: {1e3 * dt + per.get('launches', 0) * args.launch_us / 1e3:.2f} ms")
        for k, v in per.items():
            print(f"  {k:<52s} {v:8.2f} a chunk")
        if prof is not None:
            import pstats
            pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    return results


if __name__ == "__main__":
    main()
