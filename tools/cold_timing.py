"""How much of a one-token GEMV's measured time is the measurement: the same launches timed four ways.

    OUT=DIR python3 tools/cold_timing.py        (H200, from the repository root; ~40 s)

A decode GEMV reads 49-157 MB once; a single launch is 35-85 us, so how it is timed matters:
  dirty_flush   the bench's DeviceTimer before a345b97: a spin kernel, then a kernel *writing* 120 MB
                (2x the L2) so the weights are not cached, then the launch between two events. The
                L2 is left full of dirty lines that the GEMV's reads must evict and write back.
  clean_flush   the same, but the flush kernel *reads* 120 MB (DeviceTimer's way since): the L2
                holds clean lines, evicting them costs nothing, as with Nsight Compute's cache control.
  rotate        no flush: R launches back to back between two events, each on the next of C
                copies of the weight (C x weight > 2 x L2, so each launch finds its copy evicted);
                per launch = total / R. This is how a decode graph runs them (and what the issue's
                "rotate at least three copies" means); it includes the gap between launches.
  rotate_single no flush: one launch between events after a spin, on the next copy (cold, with the
                launch's own ramp inside the events, as dirty/clean_flush have).
For each: the GEMVs on the released wkv (N = 25600, K = 6144) at T = 1: gemv_q2k_v9 and v4 (q2k_r),
gemv_fp8_v2 (fp8 codes + scales), gemv_v3 (bf16), and a device-to-device copy of the q2k_r bytes.
Prints a table and writes cold_timing.json into $OUT.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from engram_numba.bench.timing import DeviceTimer  # noqa: E402
from engram_numba.bf16 import f32_to_bf16  # noqa: E402
from engram_numba.stages.proj.cuda_gemv_q2kr import repack_on_device  # noqa: E402
from engram_numba.stages.proj.launch import prepare_project, prepare_project_q  # noqa: E402
from engram_numba.stages.rows.encodings import random_raw_rows  # noqa: E402

N, K = 25600, 6144
FLUSH_WORDS = (120 << 20) // 4
rng = np.random.default_rng(0)


@cuda.jit
def spin(ns, flag):
    if cuda.grid(1) == 0:
        for _ in range(ns // 1000):
            cuda.nanosleep(1000)
        flag[0] = 1


@cuda.jit
def flush_write(buf, value):
    i = cuda.grid(1)
    while i < buf.size:
        buf[i] = value
        i += cuda.gridsize(1)


@cuda.jit
def flush_read(buf, value, sink):
    i = cuda.grid(1)
    acc = np.uint32(0)
    while i < buf.size:
        acc ^= buf[i]
        i += cuda.gridsize(1)
    if acc == value:                       # never true for the values used: keeps the loads live
        sink[0] = acc


def copies_of(make, n):
    return [make() for _ in range(n)]


def main():
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    x = cuda.to_device(f32_to_bf16(rng.standard_normal((1, K)).astype(np.float32) * 0.05))
    raw = cuda.to_device(random_raw_rows("q2k", N * K // 256, rng).reshape(N, K // 256 * 84))
    wr = [repack_on_device(raw, N, K) for _ in range(4)]                     # 4 x 49 MiB
    del raw
    codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38
    wf = [cuda.to_device(codes) for _ in range(3)]                            # 3 x 150 MiB
    sf = cuda.to_device(rng.integers(110, 125, (N // 32, K // 32), dtype=np.uint8))
    wb = [cuda.to_device(f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32) * 0.02)) for _ in range(2)]
    del codes

    def q2k(version):
        o = cuda.device_array((1, N), np.uint16)
        return [prepare_project_q(x, w, out=o, weight="q2k_r", version=version) for w in wr]

    def fp8(version):
        o = cuda.device_array((1, N), np.uint16)
        return [prepare_project_q(x, w, sf, out=o, weight="fp8", version=version) for w in wf]

    def bf16(version):
        o = cuda.device_array((1, N), np.uint16)
        return [prepare_project(x, w, out=o, version=version) for w in wb]

    def dcopy():
        dst = cuda.device_array_like(wr[0])
        return [(lambda w=w: dst.copy_to_device(w)) for w in wr]

    cases = {"gemv_q2k_v9": (q2k("gemv_q2k_v9"), 49.2e6), "gemv_q2k_v4": (q2k("gemv_q2k_v4"), 49.2e6),
             "gemv_fp8_v2": (fp8("gemv_fp8_v2"), N * K), "gemv_v3 (bf16)": (bf16("gemv_v3"), 2 * N * K),
             "d2d copy of q2k_r": (dcopy(), 2 * wr[0].nbytes)}
    flag = cuda.device_array(1, np.int32)
    sink = cuda.device_array(1, np.uint32)
    buf = cuda.device_array(FLUSH_WORDS, np.uint32)
    flush_write[264, 512](buf, np.uint32(1))
    cuda.synchronize()

    def evented(pre, fn, iters=40):
        pairs = []
        for k in range(iters):
            spin[1, 32](1_000_000, flag)
            pre(k)
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            fn(k)
            e1.record()
            pairs.append((e0, e1))
        cuda.synchronize()
        return statistics.median(cuda.event_elapsed_time(a, b) * 1e3 for a, b in pairs)

    rows, table = [], []
    timer = DeviceTimer()
    for name, (launches, nbytes) in cases.items():
        for fn in launches:
            fn()
        cuda.synchronize()
        C = len(launches)
        r = {"kernel": name, "bytes": nbytes, "copies": C}
        r["bench_timer_us"] = timer(launches[0])
        r["dirty_flush_us"] = evented(lambda k: flush_write[264, 512](buf, np.uint32(k + 7)), lambda k: launches[0]())
        r["clean_flush_us"] = evented(lambda k: flush_read[264, 512](buf, np.uint32(0xFFFFFFFF), sink),
                                      lambda k: launches[0]())
        r["rotate_single_us"] = evented(lambda k: None, lambda k: launches[k % C]())
        R = 8 * C

        def burst(k, R=R, C=C, launches=launches):
            for i in range(R):
                launches[i % C]()
        r["rotate_us"] = evented(lambda k: None, burst, iters=15) / R
        r["warm_same_copy_us"] = evented(lambda k: None, lambda k: launches[0]())
        for key in ("dirty_flush_us", "clean_flush_us", "rotate_single_us", "rotate_us", "warm_same_copy_us"):
            r[key.replace("_us", "_gbps")] = round(nbytes / r[key] / 1e3, 1)
        rows.append(r)
        table.append(f"{name:20s} bench {r['bench_timer_us']:7.1f}  dirty {r['dirty_flush_us']:7.1f}  "
                     f"clean {r['clean_flush_us']:7.1f}  rotate {r['rotate_us']:7.1f}  "
                     f"rot1 {r['rotate_single_us']:7.1f}  warm {r['warm_same_copy_us']:7.1f} us   "
                     f"(rotate {r['rotate_gbps']} GB/s)")
        print(table[-1], flush=True)
    meta = {"commit": os.environ.get("ENGRAM_COMMIT", "?"), "device": str(cuda.get_current_device().name),
            "N": N, "K": K, "T": 1, "flush_bytes": FLUSH_WORDS * 4, "rows": rows}
    (out_dir / "cold_timing.json").write_text(json.dumps(meta, indent=1))
    (out_dir / "cold_timing.txt").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
