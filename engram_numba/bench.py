"""Benchmarks on the GPU: every stage against its floor and the PyTorch/cuBLAS baseline.

    engram-numba bench [--out bench/results/h200.json] [--quick]
    engram-numba bench --hash-only          (the hasher alone, on the CPU: no GPU needed)

At the released shapes (dim 5120, hc 4, 24 hash columns, head_dim 256) and T in {1, 16, 128, 4096}:
    gather_dequant  Q2_K rows by id from a >= 2 GB device-resident table -> bf16 rows
    projection      kv = bf16(x @ wkv^T): GEMV at T=1, GEMM above
    gate            the gate and the in-place FP32 highway update
    apply           projection + gate through `EngramV41.apply`
Each figure is the median of CUDA-event timings after warm-up, with L2 flushed before every run
and the CPU's launch latency hidden behind a spin kernel (so the events time the device, not
Python). Floors: bytes / the device-to-device copy bandwidth measured in the same run, and FLOPs
/ 790 TFLOP/s (bf16 matrix units). Baselines, measured in the same run when torch imports:
index_select + Q2_K dequant in torch, `x @ wkv.T` through cuBLAS, and the gate formula eager and
under `torch.compile`. Every timed kernel's output is checked against a baseline first.

Host side: hasher tokens/s at the released configuration, `EngramRowReader` rows/s from a GGUF
on disk, and Python microseconds per `EngramV41.apply` call at T=1.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BF16_TFLOPS = 790.0
DIM, HC, COLS, HEAD_DIM = 5120, 4, 24, 256
K, N = COLS * HEAD_DIM, DIM * (HC + 1)
TOKENS = (1, 16, 128, 4096)
L2_FLUSH_BYTES = 256 << 20
README_START, README_END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def _commit() -> str:
    if os.environ.get("ENGRAM_COMMIT"):
        return os.environ["ENGRAM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _device_name() -> str:
    from numba import cuda
    name = getattr(cuda.get_current_device(), "name", "numba CUDA simulator")
    return name.decode() if isinstance(name, bytes) else str(name)


class DeviceTimer:
    """Median device time of a callable, measured with CUDA events.

    Before every run: a spin kernel keeps the GPU busy while Python enqueues (so the events
    measure the device, not the launch latency), then a write over a buffer larger than L2
    evicts the previous run's data."""

    def __init__(self, stream=0):
        from numba import cuda

        @cuda.jit
        def spin(ns, flag):
            # one thread sleeps ~ns nanoseconds in 1 us naps
            if cuda.grid(1) == 0:
                for _ in range(ns // 1000):
                    cuda.nanosleep(1000)
                flag[0] = 1

        @cuda.jit
        def flush(buf, value):
            i = cuda.grid(1)
            stride = cuda.gridsize(1)
            while i < buf.size:
                buf[i] = value
                i += stride

        self.cuda = cuda
        self.stream = stream
        self._spin, self._flush = spin, flush
        self._flag = cuda.device_array(1, dtype=np.int32)
        self._buf = cuda.device_array(L2_FLUSH_BYTES // 4, dtype=np.uint32)
        self._k = 0

    def __call__(self, fn, iters: int = 50, warmup: int = 3, spin_us: int = 1000, flush: bool = True) -> float:
        cuda = self.cuda
        for _ in range(warmup):
            fn()
        cuda.synchronize()
        pairs = []
        for _ in range(iters):
            self._k += 1
            self._spin[1, 32, self.stream](spin_us * 1000, self._flag)
            if flush:
                self._flush[264, 512, self.stream](self._buf, np.uint32(self._k))
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
    src = cuda.device_array(nbytes // 4, dtype=np.uint32)
    dst = cuda.device_array(nbytes // 4, dtype=np.uint32)
    us = timer(lambda: dst.copy_to_device(src, stream=timer.stream), iters=10, flush=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def _record(stage, T, time_us, nbytes, flops, copy_gbps, baselines, **extra):
    floor_us = max(nbytes / (copy_gbps * 1e9), flops / (BF16_TFLOPS * 1e12)) * 1e6
    rec = {"stage": stage, "T": T, "time_us": round(time_us, 3), "floor_us": round(floor_us, 3),
           "pct_of_floor": round(100.0 * floor_us / time_us, 1), "bytes": int(nbytes), "flops": int(flops),
           "gbps": round(nbytes / (time_us * 1e-6) / 1e9, 1),
           "tflops": round(flops / (time_us * 1e-6) / 1e12, 2) if flops else None,
           "baselines": {k: round(v, 3) for k, v in baselines.items()}}
    rec.update(extra)
    return rec


# Validation of timed outputs ---------------------------------------------------------------------

def projection_agrees(got_words, ref_words) -> tuple[bool, dict]:
    """Two fp32 summation orders of the same bf16 product: equal within 1 bf16 ulp except where a
    sum cancels far below its terms, so: > 1 ulp on under 0.1% of elements and relative L2 under
    2^-8 (a wrong kernel is off by ~1). Returns (ok, figures)."""
    from .bf16 import bf16_to_f32, bf16_ulp_distance
    ulps = bf16_ulp_distance(got_words, ref_words)
    a, b = bf16_to_f32(got_words).astype(np.float64), bf16_to_f32(ref_words).astype(np.float64)
    rel_l2 = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    frac = float((ulps > 1).mean())
    return bool(frac < 1e-3 and rel_l2 < 2 ** -8), {"max_ulp": int(ulps.max()), "frac_gt_1ulp": frac,
                                                     "rel_l2": rel_l2}


def gate_agrees(h0, h_new, dot, gate, kv_words, dot_ref) -> bool:
    """The update is h + gate*v from the kernel's own gate (fp32), and its dot is the reference
    dot up to summation order (the gate itself moves steeply near dot = 0, so it is not compared)."""
    from .bf16 import bf16_to_f32
    T, hc, dim = h0.shape
    v = bf16_to_f32(kv_words[:, hc * dim:])
    want = h0 + gate[:, :, None] * v[:, None, :]
    return bool(np.allclose(h_new, want, rtol=2e-7, atol=1e-6) and
                np.allclose(dot, dot_ref, rtol=1e-4, atol=1e-4))


# Torch baselines ------------------------------------------------------------------------------

def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def _torch_view(dev_array, torch):
    """A torch tensor over a numba device array's memory (no copy)."""
    return torch.as_tensor(dev_array, device="cuda")


def torch_q2k_dequant(torch, table_u8, ids):
    """index_select + Q2_K decode in eager torch ops -> bf16 [n, 256] (the baseline)."""
    b = table_u8.index_select(0, ids)                                         # [n, 84]
    n = b.shape[0]
    scales = b[:, :16].to(torch.int32)
    qs = b[:, 16:80].to(torch.int32).view(n, 2, 1, 32)
    d = b[:, 80:82].contiguous().view(torch.float16).to(torch.float32)       # [n, 1]
    dmin = b[:, 82:84].contiguous().view(torch.float16).to(torch.float32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.int32).view(1, 1, 4, 1)
    q = ((qs >> shifts) & 3).view(n, 16, 16).to(torch.float32)
    y = (d * (scales & 15).to(torch.float32)).view(n, 16, 1) * q - (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    return y.view(n, 256).to(torch.bfloat16)


def torch_gate(torch, h, kv, w, hc, dim, eps=1e-20):
    T = h.shape[0]
    key = kv[:, : hc * dim].view(T, hc, dim).float()
    v = kv[:, hc * dim:].float()
    dot = ((h * w) * key).sum(-1) * torch.rsqrt((h * h).mean(-1) + eps) * torch.rsqrt((key * key).mean(-1) + eps) \
        / math.sqrt(dim)
    g = torch.sign(dot) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6))
    gate = torch.sigmoid(g)
    h.add_(gate.unsqueeze(-1) * v.unsqueeze(1))
    return gate


# The suite ------------------------------------------------------------------------------------

def bench_device(quick: bool = False, table_gb: float = 2.0, log=print) -> dict:
    from numba import cuda

    from .bf16 import f32_to_bf16
    from .kernels.dequant import gather_dequant_q2k
    from .kernels.gate import engram_v41_gate, prepare_gate
    from .kernels.projection import prepare_project
    from .reference import rows_reference

    torch = _torch()
    timer = DeviceTimer()
    device = _device_name()
    copy_gbps = measure_copy_gbps(timer)
    log(f"device: {device}; copy bandwidth {copy_gbps:.0f} GB/s")
    rng = np.random.default_rng(0)
    iters = 10 if quick else 50
    records = []

    # Inputs: a random Q2_K table of table_gb (finite fp16 scales), weights, gate vectors.
    n_rows = int(table_gb * 1e9) // 84
    table = cuda.device_array((n_rows, 84), dtype=np.uint8)
    chunk = 1 << 22
    for r0 in range(0, n_rows, chunk):
        blk = rng.integers(0, 256, (min(chunk, n_rows - r0), 84), dtype=np.uint8)
        blk[:, 80:84] = (rng.standard_normal((blk.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
        table[r0:r0 + blk.shape[0]].copy_to_device(blk)
    wkv = cuda.to_device(f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32) * 0.02))
    w_gate = cuda.to_device((1 + 0.1 * rng.standard_normal((HC, DIM))).astype(np.float32))
    tw = _torch_view(wkv, torch).view(torch.bfloat16) if torch else None
    compiled_gate = None
    if torch is not None:
        try:
            compiled_gate = torch.compile(lambda h, kv, w: torch_gate(torch, h, kv, w, HC, DIM))
        except Exception as exc:  # torch.compile is optional
            log(f"torch.compile unavailable: {exc}")

    for T in TOKENS:
        n = T * COLS
        # -- gather + dequant: fresh random ids every run, rotating through a pool
        pool = [cuda.to_device(rng.integers(0, n_rows, n, dtype=np.int64)) for _ in range(8)]
        rows = cuda.device_array((n, 256), dtype=np.uint16)
        gather_dequant_q2k(table, pool[0], rows, check=False)
        sample = np.sort(rng.choice(n, min(n, 512), replace=False))
        ids0 = pool[0].copy_to_host()
        host_blocks = np.stack([table[int(i)].copy_to_host() for i in ids0[sample]])
        ok = np.array_equal(rows.copy_to_host()[sample], rows_reference(host_blocks))
        it = iter(range(10**9))
        t_us = timer(lambda: gather_dequant_q2k(table, pool[next(it) % len(pool)], rows, check=False), iters=iters)
        base = {}
        if torch is not None:
            tt = _torch_view(table, torch)
            tpool = [_torch_view(p, torch) for p in pool]
            it2 = iter(range(10**9))
            base["torch_index_select_dequant"] = timer(lambda: torch_q2k_dequant(torch, tt, tpool[next(it2) % len(tpool)]),
                                                       iters=max(5, iters // 5))
        records.append(_record("gather_dequant", T, t_us, n * 84 + n * 512 + n * 8, 0, copy_gbps, base, validated=bool(ok)))
        log(f"gather_dequant T={T:5d}: {t_us:9.1f} us  valid={ok}  {base}")

        # -- projection (a prepared launch: the events time the kernel; Python cost is in "host")
        x = cuda.to_device(f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05))
        kv = cuda.device_array((T, N), dtype=np.uint16)
        proj = prepare_project(x, wkv, kv)
        proj()
        base = {}
        ok, agree = None, {}
        if torch is not None:
            tx = _torch_view(x, torch).view(torch.bfloat16)
            tkv = tx @ tw.T
            ok, agree = projection_agrees(kv.copy_to_host(), tkv.view(torch.int16).cpu().numpy().view(np.uint16))
            base["torch_cublas_matmul"] = timer(lambda: tx @ tw.T, iters=max(5, iters if T < 4096 else 10))
        p_iters = iters if T < 4096 else max(5, iters // 10)
        t_us = timer(proj, iters=p_iters)
        flops = 2 * T * K * N
        records.append(_record("projection", T, t_us, N * K * 2 + T * K * 2 + T * N * 2, flops, copy_gbps, base,
                               validated=ok, kernel=proj.name, vs_cublas=agree))
        log(f"projection     T={T:5d}: {t_us:9.1f} us  {flops / t_us / 1e6:.1f} TFLOP/s  {proj.name} "
            f"valid={ok} {agree}  {base}")

        # -- gate
        h0 = rng.standard_normal((T, HC, DIM)).astype(np.float32)
        kvg_h = f32_to_bf16(rng.standard_normal((T, N)).astype(np.float32))
        h, kvg = cuda.to_device(h0), cuda.to_device(kvg_h)
        dot = cuda.device_array((T, HC), dtype=np.float32)
        gate = cuda.device_array((T, HC), dtype=np.float32)
        gate_launch = prepare_gate(h, kvg, w_gate, dot_out=dot, gate_out=gate)
        gate_launch()
        h_ref, dot_ref = cuda.to_device(h0), cuda.device_array((T, HC), dtype=np.float32)
        engram_v41_gate(h_ref, kvg, w_gate, dot_out=dot_ref, version=1)  # the reference's order
        ok = gate_agrees(h0, h.copy_to_host(), dot.copy_to_host(), gate.copy_to_host(), kvg_h,
                         dot_ref.copy_to_host())
        base = {}
        if torch is not None:
            th = _torch_view(h, torch)
            tkvg = _torch_view(kvg, torch).view(torch.bfloat16)
            tw_gate = _torch_view(w_gate, torch)
            base["torch_eager"] = timer(lambda: torch_gate(torch, th, tkvg, tw_gate, HC, DIM), iters=iters)
            if compiled_gate is not None:
                try:
                    base["torch_compile"] = timer(lambda: compiled_gate(th, tkvg, tw_gate), iters=iters, warmup=5)
                except Exception as exc:
                    log(f"torch.compile gate failed: {exc}")
        t_us = timer(gate_launch, iters=iters)
        gbytes = 2 * T * HC * DIM * 4 + T * HC * DIM * 2 + T * DIM * 2 + HC * DIM * 4 + 2 * T * HC * 4
        records.append(_record("gate", T, t_us, gbytes, 0, copy_gbps, base, validated=ok, kernel=gate_launch.name))
        log(f"gate           T={T:5d}: {t_us:9.1f} us  {gate_launch.name} valid={ok}  {base}")

        # -- apply = projection + gate on its output, as EngramV41.apply runs them
        gate_on_kv = prepare_gate(h, kv, w_gate, dot_out=dot, gate_out=gate)

        def apply():
            proj()
            gate_on_kv()
        t_us = timer(apply, iters=p_iters)
        pb, gb = records[-2]["baselines"], records[-1]["baselines"]
        base = {f"torch_matmul+{k}": pb["torch_cublas_matmul"] + v for k, v in gb.items() if "torch_cublas_matmul" in pb}
        records.append(_record("apply", T, t_us, records[-2]["bytes"] + gbytes, flops, copy_gbps, base))
        log(f"apply          T={T:5d}: {t_us:9.1f} us  {base}")
    return {"copy_gbps": round(copy_gbps, 1), "records": records, "device": device}


def bench_variants(quick: bool = False, log=print) -> list[dict]:
    """Every kernel version of each stage at the shapes that decide the defaults, each checked
    against the default version's output before it is timed (llm.c style: the naive version
    is the baseline, the table says what each step bought)."""
    from numba import cuda

    from .bf16 import f32_to_bf16
    from .kernels import dequant as D
    from .kernels import gate as G
    from .kernels import projection as P

    timer = DeviceTimer()
    copy_gbps = measure_copy_gbps(timer)
    rng = np.random.default_rng(2)
    iters = 5 if quick else 20
    out = []

    def add(stage, T, variant, us, nbytes, flops, valid):
        rec = _record(stage, T, us, nbytes, flops, copy_gbps, {}, variant=variant, validated=valid)
        out.append(rec)
        log(f"  {stage:15s} T={T:5d} {variant:22s} {us:10.1f} us  {rec['pct_of_floor']:5.1f}% of floor"
            + (f"  {rec['tflops']} TFLOP/s" if flops else f"  {rec['gbps']} GB/s") + f"  valid={valid}")

    # gather + dequant at T=4096 from a 1 GB table
    n_rows = (1 << 30) // 84
    table = cuda.to_device(np.concatenate([
        np.concatenate([rng.integers(0, 256, (1 << 20, 80), dtype=np.uint8),
                        (rng.standard_normal((1 << 20, 2)) * 0.01).astype(np.float16).view(np.uint8)], axis=1)
        for _ in range(n_rows >> 20)]))
    n = 4096 * COLS
    ids = cuda.to_device(rng.integers(0, table.shape[0], n, dtype=np.int64))
    ref = cuda.device_array((n, 256), dtype=np.uint16)
    D.gather_dequant_q2k(table, ids, ref, check=False)
    ref_h = ref.copy_to_host()
    for v in sorted(D.VERSIONS["gather"]):
        got = cuda.device_array((n, 256), dtype=np.uint16)
        D.gather_dequant_q2k(table, ids, got, check=False, version=v)
        valid = bool(np.array_equal(got.copy_to_host(), ref_h))
        us = timer(lambda: D.gather_dequant_q2k(table, ids, got, check=False, version=v), iters=iters)
        add("gather_dequant", 4096, f"gather_v{v}", us, n * (84 + 512 + 8), 0, valid)


    # projection: every version at the T where it competes
    wkv = cuda.to_device(f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32) * 0.02))
    plan = {1: ["gemv_v1", "gemv_v2", "gemv_v3", "gemv_v4"], 16: ["gemv_v2", "gemv_v3", "gemv_v4", "gemm_v2", "gemm_v3"],
            128: ["gemm_v1", "gemm_v2", "gemm_v3", "gemv_v4"], 4096: ["gemm_v2", "gemm_v3"]}
    for T, versions in plan.items():
        x = cuda.to_device(f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32) * 0.05))
        ref = cuda.device_array((T, N), dtype=np.uint16)
        P.project(x, wkv, ref)
        ref_h = ref.copy_to_host()
        for v in versions:
            if v not in P.VERSIONS:
                continue
            got = cuda.device_array((T, N), dtype=np.uint16)
            launch = P.prepare_project(x, wkv, got, version=v)
            launch()
            ok, _ = projection_agrees(got.copy_to_host(), ref_h)
            slow = v.endswith("_v1")
            us = timer(launch, iters=3 if slow or T == 4096 else iters)
            add("projection", T, v, us, N * K * 2 + T * K * 2 + T * N * 2, 2 * T * K * N, ok)

    # gate at T=4096: versions and layouts
    T = 4096
    h0 = rng.standard_normal((T, HC, DIM)).astype(np.float32)
    kvg_h = f32_to_bf16(rng.standard_normal((T, N)).astype(np.float32))
    kvg = cuda.to_device(kvg_h)
    w_gate = cuda.to_device((1 + 0.1 * rng.standard_normal((HC, DIM))).astype(np.float32))
    dot_ref = cuda.device_array((T, HC), dtype=np.float32)
    G.engram_v41_gate(cuda.to_device(h0), kvg, w_gate, dot_out=dot_ref, version=1)
    dot_ref = dot_ref.copy_to_host()
    h = cuda.to_device(h0)
    dot, gate = cuda.device_array((T, HC), dtype=np.float32), cuda.device_array((T, HC), dtype=np.float32)
    gbytes = 2 * T * HC * DIM * 4 + T * HC * DIM * 2 + T * DIM * 2 + HC * DIM * 4
    for v, layout in ((1, None), (2, "token"), (2, "stream"), (3, "stream"), (3, "token")):
        h.copy_to_device(h0)
        try:
            launch = G.prepare_gate(h, kvg, w_gate, dot_out=dot, gate_out=gate, version=v, layout=layout)
        except ValueError as exc:  # a layout that does not apply to this shape
            log(f"  gate v{v} {layout}: {exc}")
            continue
        launch()
        valid = gate_agrees(h0, h.copy_to_host(), dot.copy_to_host(), gate.copy_to_host(), kvg_h, dot_ref)
        us = timer(launch, iters=iters)
        add("gate", T, f"v{v}" + (f"/{layout}" if layout else ""), us, gbytes, 0, valid)
    return out


def bench_hash(log=print, repeats: int = 30) -> dict:
    """The @njit hasher (one core) on a 4096-token prefill at the released configuration
    (2 layers x 24 columns, real multipliers and primes, ids over the whole compressed vocab).
    Best of `repeats` after a warm-up call (which compiles). Needs no GPU."""
    from .config import COMPRESSED_VOCAB_SIZE, ENGRAM_VOCAB_SIZE
    from .hash import EngramHasher, EngramHashTables

    rng = np.random.default_rng(1)
    tables = EngramHashTables.build((1, 14), 4, 8, ENGRAM_VOCAB_SIZE, np.arange(COMPRESSED_VOCAB_SIZE), 2)
    hasher = EngramHasher(tables, capacity=8192)
    toks = rng.integers(0, COMPRESSED_VOCAB_SIZE, 4096)
    hasher.hash(toks)
    times = []
    for _ in range(repeats):
        hasher.reset()
        t0 = time.perf_counter()
        hasher.hash(toks)
        times.append(time.perf_counter() - t0)
    out = {"hash_prefill_4096_ms": round(1e3 * min(times), 3),
           "hash_prefill_4096_median_ms": round(1e3 * statistics.median(times), 3),
           "hash_tokens_per_s": round(4096 / min(times))}
    log(f"hasher: 4096-token prefill {out['hash_prefill_4096_ms']} ms best, "
        f"{out['hash_prefill_4096_median_ms']} ms median ({out['hash_tokens_per_s']:,} tokens/s)")
    return out


def bench_host(log=print, n_calls: int = 500, reader_vocab: int = 100_000) -> dict:
    """Host-side figures: hasher, row reader, Python cost of one apply call at T=1."""
    from numba import cuda

    from .config import EngramConfig
    from .gpu import EngramV41
    from .hash import EngramHashTables
    from .model_file import load_gguf, write_gguf

    out = bench_hash(log)
    rng = np.random.default_rng(1)

    # A GGUF with a released-width engram (dim 5120, hc 4, 24 columns) but tables of the
    # configuration's real prime sums would be 30 GB: use real constants for the hash and a
    # small random table only for the row-reader figure.
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngramConfig(dim=64, hc=4, layer_ids=(1, 4), max_ngram_size=4, n_heads=8)
        small = EngramHashTables.build((1, 4), 4, 8, reader_vocab, np.arange(1000), 2)
        layers = {}
        for li, lid in enumerate(cfg.layer_ids):
            rows = int(small.table_rows[li])
            tbl = rng.integers(0, 256, (rows, 84), dtype=np.uint8)
            tbl[:, 80:84] = np.array([0.01, 0.001], dtype=np.float16).view(np.uint8)  # finite d, dmin
            layers[lid] = {"table": tbl, "wkv": rng.standard_normal((cfg.proj_out, cfg.proj_in)).astype(np.float32),
                           "q_weight": np.ones((cfg.hc, cfg.dim), np.float32),
                           "k_weight": np.ones((cfg.hc, cfg.dim), np.float32)}
        path = Path(tmp) / "reader.gguf"
        write_gguf(path, cfg, small, layers)
        model = load_gguf(path)
        reader = model.rows(1)
        ids = rng.integers(0, reader.n_rows, 4096 * 24)
        reader.read(ids)
        t = []
        for _ in range(10):
            t0 = time.perf_counter()
            reader.read(rng.integers(0, reader.n_rows, 4096 * 24))
            t.append(time.perf_counter() - t0)
        out["row_reader_rows_per_s"] = round(ids.size / statistics.median(t))
        out["row_reader_table_mb"] = round(reader.n_rows * 84 / 1e6, 1)
        log(f"row reader: {out['row_reader_rows_per_s']:,} rows/s from a {out['row_reader_table_mb']} MB table on disk")

        # Python cost per apply at T=1 (device time excluded: no sync inside the loop).
        eng = EngramV41(model, max_tokens=16)
        h = cuda.to_device(rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32))
        eng.rows_from_q2k(1, reader.read(rng.integers(0, reader.n_rows, (1, 24))))
        for _ in range(min(20, n_calls)):
            eng.apply(1, h)
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_calls):
            eng.apply(1, h)
        host = (time.perf_counter() - t0) / n_calls
        cuda.synchronize()
        out["apply_T1_host_us"] = round(host * 1e6, 1)
        log(f"EngramV41.apply at T=1: {out['apply_T1_host_us']} us of Python per call (2 kernel launches)")
        # the same two launches replayed from a CUDA graph (EngramV41.capture_apply)
        try:
            eng_g = EngramV41(model, max_tokens=16, stream=cuda.stream())
            h_g = cuda.to_device(rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32))
            eng_g.rows_from_q2k(1, reader.read(rng.integers(0, reader.n_rows, (1, 24))))
            graph = eng_g.capture_apply(1, h_g)
            for _ in range(20):
                graph.replay()
            eng_g.stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_calls):
                graph.replay()
            out["apply_T1_graph_replay_host_us"] = round((time.perf_counter() - t0) / n_calls * 1e6, 1)
            eng_g.stream.synchronize()
            log(f"captured apply (CUDA graph) at T=1: {out['apply_T1_graph_replay_host_us']} us of host time per replay")
        except Exception as exc:  # recorded, not fatal: the rest of the suite still runs
            out["apply_T1_graph_replay_host_us"] = f"failed: {type(exc).__name__}: {exc}"[:300]
            log(f"captured apply failed: {exc}")

        # where those microseconds go (printed, for the notes)
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            eng.apply(1, h)
        prof.disable()
        cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        log(buf.getvalue())

        # calibration: numba's own cost of launching a kernel with three array arguments
        @cuda.jit
        def _touch(a, b, c):
            if cuda.grid(1) == 0:
                c[0] = a[0] + b[0]
        a = cuda.to_device(np.ones(4, np.float32))
        _touch[1, 32](a, a, a)
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            _touch[1, 32](a, a, a)
        out["numba_launch_host_us"] = round((time.perf_counter() - t0) / 500 * 1e6, 1)
        cuda.synchronize()
        log(f"numba launch of a 3-array kernel: {out['numba_launch_host_us']} us of Python")

        # The unprepared launchers, which validate and build views on every call.
        from .kernels.gate import engram_v41_gate
        from .kernels.projection import project
        lw, ws = eng.layers[1], eng._ws[1]
        x = ws.rows[:24].reshape(1, cfg.proj_in)
        for name, call in (("project_launcher_host_us", lambda: project(x, lw.wkv, ws.kv[:1])),
                           ("gate_launcher_host_us", lambda: engram_v41_gate(h, ws.kv[:1], lw.w_gate))):
            for _ in range(10):
                call()
            cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                call()
            out[name] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
            cuda.synchronize()
        log(f"unprepared launchers: project() {out['project_launcher_host_us']} us, "
            f"engram_v41_gate() {out['gate_launcher_host_us']} us of Python per call")
        model.close()
    return out


def markdown_table(result: dict) -> str:
    lines = [f"H200 results at commit `{result['commit'][:10]}` ({result['device']}, copy bandwidth "
             f"{result['copy_gbps']:.0f} GB/s). Floor = max(bytes / copy bandwidth, FLOPs / {BF16_TFLOPS:.0f} TFLOP/s).",
             "",
             "| stage | T | time (us) | floor (us) | % of floor | GB/s | TFLOP/s | baselines (us) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["records"]:
        base = ", ".join(f"{k} {v:.1f}" for k, v in r["baselines"].items()) or "-"
        lines.append(f"| {r['stage']} | {r['T']} | {r['time_us']:.1f} | {r['floor_us']:.1f} | {r['pct_of_floor']:.1f} "
                     f"| {r['gbps']:.0f} | {r['tflops'] if r['tflops'] is not None else '-'} | {base} |")
    if result.get("variants"):
        lines += ["", "Every kernel version (llm.c style: v1 is the naive baseline), each checked against the "
                      "default before it was timed:", "",
                  "| stage | T | version | time (us) | % of floor | GB/s | TFLOP/s | valid |",
                  "|---|---:|---|---:|---:|---:|---:|---|"]
        for r in result["variants"]:
            lines.append(f"| {r['stage']} | {r['T']} | {r['variant']} | {r['time_us']:.1f} | {r['pct_of_floor']:.1f} "
                         f"| {r['gbps']:.0f} | {r['tflops'] if r['tflops'] is not None else '-'} | {r['validated']} |")
    host = result.get("host", {})
    if host:
        lines += ["", f"Host: hasher {host.get('hash_prefill_4096_ms')} ms per 4096-token prefill "
                      f"({host.get('hash_tokens_per_s', 0):,} tokens/s); row reader {host.get('row_reader_rows_per_s', 0):,} rows/s; "
                      f"`EngramV41.apply` at T=1 costs {host.get('apply_T1_host_us')} us of Python per call "
                      f"(numba's launch of a 3-array kernel: {host.get('numba_launch_host_us')} us; unprepared "
                      f"`project()` {host.get('project_launcher_host_us')} us, `engram_v41_gate()` "
                      f"{host.get('gate_launcher_host_us')} us); replayed from a CUDA graph "
                      f"(`EngramV41.capture_apply`): {host.get('apply_T1_graph_replay_host_us')} us."]
    return "\n".join(lines)


def update_readme(result: dict, readme: Path) -> bool:
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return False
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + README_START + "\n" + markdown_table(result) + "\n" + README_END + tail)
    return True


def plot_results(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    stages = ["gather_dequant", "projection", "gate", "apply"]
    fig, axes = plt.subplots(1, len(stages), figsize=(15, 3.8), sharey=False)
    for ax, stage in zip(axes, stages):
        recs = [r for r in result["records"] if r["stage"] == stage]
        xs = np.arange(len(recs))
        ax.bar(xs - 0.2, [r["time_us"] for r in recs], 0.4, label="engram_numba")
        ax.bar(xs + 0.2, [r["floor_us"] for r in recs], 0.4, label="floor", color="grey", alpha=0.6)
        names = sorted({k for r in recs for k in r["baselines"]})
        colours = {k: f"C{i + 2}" for i, k in enumerate(names)}
        for r, x in zip(recs, xs):
            for name, v in r["baselines"].items():
                ax.plot([x - 0.4, x + 0.4], [v, v], lw=2, color=colours[name], label=name if x == 0 else None)
            ax.text(x - 0.2, r["time_us"], f"{r['pct_of_floor']:.0f}%", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [f"T={r['T']}" for r in recs])
        ax.set_yscale("log")
        ax.set_title(stage)
        ax.set_ylabel("us (log)")
        ax.legend(fontsize=7)
    fig.suptitle(f"engram_numba on {result['device']} at {result['commit'][:10]}: time vs floor (% of floor above bars)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(args=None) -> int:
    from numba import cuda
    from numba.cuda import config
    if getattr(args, "hash_only", False):
        bench_hash()
        return 0
    if config.ENABLE_CUDASIM or not cuda.is_available():
        print("engram-numba bench needs a CUDA GPU (none found, or numba's simulator is on); "
              "run it on the H200 machine: see tests/gpu_run.sh", file=sys.stderr)
        return 2
    out = Path(getattr(args, "out", None) or "bench/results/h200.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"commit": _commit()}
    quick = getattr(args, "quick", False)
    if getattr(args, "variants_only", False):
        result.update({"device": _device_name(), "variants": bench_variants(quick)})
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        return 0
    # Host figures first: torch.compile (in bench_device) leaves worker threads that would
    # compete with the Python being timed.
    host = bench_host()
    result.update(bench_device(quick=quick, table_gb=getattr(args, "table_gb", 2.0)))
    if not getattr(args, "no_variants", False):
        result["variants"] = bench_variants(quick)
    result["host"] = host
    out.write_text(json.dumps(result, indent=1))
    png = Path(getattr(args, "png", None) or out.with_suffix(".png"))
    plot_results(result, png)
    print(markdown_table(result))
    print(f"\nwrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
