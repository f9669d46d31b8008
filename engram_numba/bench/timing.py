"""How the benchmark measures: CUDA-event medians with L2 flushed, floors, and records.

`DeviceTimer` times a callable on the device: before every run a spin kernel keeps the GPU busy
while Python enqueues (so the events measure the device, not the launch latency), then a kernel
*reading* a buffer larger than L2 evicts the previous run's data; the median of `iters` runs after
`warmup` calls is returned in microseconds. The flush reads rather than writes so that the L2 it
leaves holds clean lines: a written flush leaves it full of dirty lines, and the timed kernel's
first ~60 MB of reads then also pay for writing them back. On the H200 (tools/cold_timing.py,
bench/results/h200_cold_timing_*.json) the written flush added 3.4 us to a 49 MB one-token GEMV and
8-9 us to the 157 / 315 MB ones; read-flushed times match one cold launch and, within 2 us, the
same GEMVs launched back to back on rotating copies of their weights (a decode step's situation).
In numba's simulator (the smoke test) there are no events and no L2: the host time of one call is
returned instead, and every figure it gives is meaningless.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BF16_TFLOPS = 790.0          # H200 dense bf16 matrix throughput (floor of FLOP-bound stages)
FP8_TFLOPS = 2 * BF16_TFLOPS  # e4m3 on the same tensor cores: twice the bf16 rate (DeepSeek's FP8 GEMMs)
L2_FLUSH_BYTES = 256 << 20
# what a results file says about its timings (bench/suite.py writes it beside the records)
TIMING_METHOD = ("CUDA events around each run, after a spin kernel (device time, not launch latency) and "
                 "a kernel reading 256 MiB (L2 flushed, its lines left clean); median of the runs")


@dataclass(frozen=True)
class BenchShape:
    """The shapes one benchmark run uses (released by default; tiny for the simulator smoke test)."""

    dim: int = 5120
    hc: int = 4
    cols: int = 24
    head_dim: int = 256
    tokens: tuple = (1, 16, 128, 4096)
    # the projection (proj_bf16, with cuBLAS beside it) also at the prefill-chunk sizes between
    proj_tokens: tuple = (1, 16, 128, 256, 512, 1024, 4096)
    table_gb: float = 2.0
    name: str = "released"

    @property
    def K(self) -> int:
        return self.cols * self.head_dim

    @property
    def N(self) -> int:
        return self.dim * (self.hc + 1)


RELEASED = BenchShape()
SMOKE = BenchShape(dim=16, hc=1, cols=1, tokens=(1, 2), proj_tokens=(1, 2, 3), table_gb=0.0001, name="smoke (simulator)")


def commit() -> str:
    if os.environ.get("ENGRAM_COMMIT"):
        return os.environ["ENGRAM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def device_name() -> str:
    from numba import cuda
    from numba.cuda import config
    if config.ENABLE_CUDASIM:
        return "numba CUDA simulator"
    name = getattr(cuda.get_current_device(), "name", "unknown")
    return name.decode() if isinstance(name, bytes) else str(name)


class DeviceTimer:
    """Median device time of a callable in microseconds (see the module doc)."""

    def __init__(self, stream=0, flush_bytes: int = L2_FLUSH_BYTES):
        from numba import cuda
        from numba.cuda import config
        self.cuda = cuda
        self.stream = stream
        self.simulated = bool(config.ENABLE_CUDASIM)
        if self.simulated:
            return

        @cuda.jit
        def spin(ns, flag):
            # one thread sleeps ~ns nanoseconds in 1 us naps
            if cuda.grid(1) == 0:
                for _ in range(ns // 1000):
                    cuda.nanosleep(1000)
                flag[0] = 1

        @cuda.jit
        def flush(buf, value):
            # read every word (clean L2 lines, see the module doc); `fill` makes every word < 2^16,
            # so a thread's xor never equals the 0xFFFFFFFF passed and the store never happens,
            # but it keeps the loads from being optimised away
            i = cuda.grid(1)
            stride = cuda.gridsize(1)
            acc = np.uint32(0)
            while i < buf.size:
                acc ^= buf[i]
                i += stride
            if acc == value:
                buf[0] = acc

        @cuda.jit
        def fill(buf):
            i = cuda.grid(1)
            while i < buf.size:
                buf[i] = np.uint32(i & 0xFFFF)
                i += cuda.gridsize(1)

        self._spin, self._flush = spin, flush
        self._flag = cuda.device_array(1, dtype=np.int32)
        self._buf = cuda.device_array(flush_bytes // 4, dtype=np.uint32)
        fill[264, 512](self._buf)

    def __call__(self, fn, iters: int = 50, warmup: int = 3, spin_us: int = 1000, flush: bool = True) -> float:
        cuda = self.cuda
        if self.simulated:
            # one call, timed on the host: the simulator has nothing to warm up (no JIT, no caches),
            # and each simulated call of a kernel is seconds of Python in the smoke run
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        for _ in range(warmup):
            fn()
        cuda.synchronize()
        pairs = []
        for _ in range(iters):
            self._spin[1, 32, self.stream](spin_us * 1000, self._flag)
            if flush:
                self._flush[264, 512, self.stream](self._buf, np.uint32(0xFFFFFFFF))
            e0, e1 = cuda.event(), cuda.event()
            e0.record(self.stream)
            fn()
            e1.record(self.stream)
            pairs.append((e0, e1))
        cuda.synchronize()
        return statistics.median(cuda.event_elapsed_time(a, b) * 1000.0 for a, b in pairs)  # us


def measure_copy_gbps(timer: DeviceTimer, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    cuda = timer.cuda
    if timer.simulated:
        nbytes = 1 << 16
    src = cuda.device_array(nbytes // 4, dtype=np.uint32)
    dst = cuda.device_array(nbytes // 4, dtype=np.uint32)
    us = timer(lambda: dst.copy_to_device(src, stream=timer.stream), iters=10, flush=False)
    return 2 * nbytes / (max(us, 1e-3) * 1e-6) / 1e9


def make_record(stage: str, T: int, time_us: float, nbytes: int, flops: int, copy_gbps: float, baselines: dict,
                peak_tflops: float = BF16_TFLOPS, **extra) -> dict:
    """One benchmark record: time against the floor max(bytes / copy bandwidth, FLOPs / peak), the peak
    790 TFLOP/s (bf16) unless the record says otherwise (`peak_tflops`, kept in the record then)."""
    time_us = max(float(time_us), 1e-3)
    floor_us = max(nbytes / (copy_gbps * 1e9), flops / (peak_tflops * 1e12)) * 1e6
    if peak_tflops != BF16_TFLOPS:
        extra = {"peak_tflops": peak_tflops} | extra
    rec = {"stage": stage, "T": T, "time_us": round(time_us, 3), "floor_us": round(floor_us, 3),
           "pct_of_floor": round(100.0 * floor_us / time_us, 1), "bytes": int(nbytes), "flops": int(flops),
           "gbps": round(nbytes / (time_us * 1e-6) / 1e9, 1),
           "tflops": round(flops / (time_us * 1e-6) / 1e12, 2) if flops else None,
           "baselines": {k: round(v, 3) for k, v in baselines.items()}}
    rec.update(extra)
    return rec
