"""Development run of the prefill projection on a Hopper GPU: every wgmma variant checked, then timed.

    python tools/prefill_dev.py [--out DIR] [--ncu] [--quick]     (from the repository root)
    python tools/prefill_dev.py --v7 [--out DIR] [--ncu]            gemm_v7 and its candidates
    python tools/prefill_dev.py --v8 [--out DIR]                    gemm_v8 and its split choices
    python tools/prefill_dev.py --v9 [--out DIR]                    gemm_v9 and its k-loop variants

One command does the whole batch (docs/gpu.md): a worker process checks every variant of
`stages/proj/cuda_wgmma.py` (the records gemm_v4 / gemm_v5 and the other tiles and layouts in
`CANDIDATES`) against the float64 product at tiny odd shapes, then at the released shape
(K = 6144, N = 25600) for T in {16, 128, 4096} and at odd released-size shapes, and times each
with CUDA events and L2 flushed (`timing.DeviceTimer`) next to gemm_v3 / gemv_v4 and cuBLAS
(torch's `x @ w.T`) measured in the same process; then `apply` at T = 4096 (our projection + our
gate against cuBLAS + our gate). Results stream to DIR/prefill_dev.jsonl as they come (all of them
in DIR/prefill_dev.json at the end, the table in DIR/prefill_dev_table.txt); if a
variant kills the CUDA context (a bad descriptor can), the driver restarts the worker without it
and says so. With --ncu, one launch of the fastest T = 4096 variant runs under Nsight Compute
(SpeedOfLight, WarpStateStats, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis) and its SASS is
saved. The last lines printed are a compact table.

With --v7: gemm_v7 (`stages/proj/cuda_wgmma_ws.py`, warp-specialised, persistent, stream-K tail)
and its candidates are checked at the tiny odd shapes, then at the released shape for T in
V7_TOKENS (1, 16, 128, 256, 512, 1024, 4096), each checked and timed beside gemm_v4 / gemm_v5 /
gemm_v6, the default the records pick and cuBLAS, then at the odd released-size shapes; the
table's "x cuBLAS" column is what the records' default rules are decided on.

With --v8: gemm_v8 (`stages/proj/cuda_wgmma.py`: gemm_v4's mainloop on persistent CTAs, stream-K
tail) and its split choices (`SK_CANDIDATES`: data-parallel only, stream-K over 1 or 2 waves, gemm_v6's
128x200 tile) are checked at the tiny odd shapes and at odd released-size shapes (including ones where
many CTAs cut one tile: N = 512 puts ~24 CTAs on each tile), then at the released shape for T in
V8_TOKENS (128 .. 4096), each checked, checked for the same bits over 3 launches, and timed beside
gemm_v4, gemm_v6 and cuBLAS; a candidate whose schedule is gemm_v8's own at that T is not timed
twice. The last lines are a summary against the targets (<= 1.05x cuBLAS at T = 256..1024, <= 1.0x
at T = 4096).

With --v9: gemm_v9 (`stages/proj/cuda_wgmma.py`: gemm_v8 on the lean k loops) and its candidates
(`V9_CANDIDATES`: the one-barrier "lean1" loop on persistent CTAs, and on gemm_v4's grid "lean" and
"lean1" with its copy rows hoisted) are checked at the tiny odd shapes and at odd released-size shapes, then at the
released shape for T in V9_TOKENS (256, 512, 1024, 4096), each checked, checked for the same bits
over 3 launches (the persistent ones) and timed beside gemm_v4, gemm_v6, gemm_v8 and cuBLAS; a
worker that hangs is killed after 100 s and the rest rerun without the variant. The last lines are
a summary: per T each loop's time, its ratio to cuBLAS and to the kernel it rebuilds (gemm_v8 for
the persistent ones, gemm_v4 for the grid ones), and whether the targets are met.

With --ncu-l2 (alone, a second command): one launch each of gemm_v4, gemm_v9, their "lean" loop on
gemm_v4's grid and cuBLAS at T = 4096 under Nsight Compute (SpeedOfLight, MemoryWorkloadAnalysis,
WarpStateStats, LaunchStats, Occupancy, SchedulerStats, and the L2 and DRAM bytes moved; `--variants a,b`
profiles those instead, then cuBLAS): whether cuBLAS moves fewer bytes through L2 than
our 128 x 256 tiles (15 GB at T = 4096 without multicast), and what our warps stall on. Writes
DIR/ncu_l2.txt and prints the lines that answer it (~40 s).

Numerics: a check passes when every well-conditioned element (fp32 summation noise under half a
bf16 ulp) is within 1 bf16 ulp of the float64 product rounded once, and the rest within the noise
allowance (the yardstick of stages/proj/tests/test_proj_cuda.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:          # run as a script: the package beside tools/
    sys.path.insert(0, str(REPO))

import numpy as np

K_REL, N_REL = 6144, 25600
TOKENS = (16, 128, 4096)
ODD = [(33, 264, 200), (130, 136, 260), (5, 520, 9)]            # tiny: every variant, first
ODD_RELEASED = [(257, K_REL + 8, N_REL + 8), (33, K_REL, N_REL)]  # released-size odd shapes
SWEEP_TOKENS = (2, 8, 32, 48, 64, 80, 96, 192, 256, 512, 1024)      # where the defaults change hands
V7_TOKENS = (1, 16, 128, 256, 512, 1024, 4096)                      # --v7: the prefill-chunk sizes
V8_TOKENS = (128, 256, 384, 512, 768, 1024, 2048, 4096)             # --v8: around the wave boundaries
V8_ODD_RELEASED = [(257, K_REL + 8, N_REL + 8), (33, K_REL, N_REL),   # --v8: N % 256 == 8, a lone token tile
                   (33, K_REL, 512), (300, K_REL + 8, 1000)]        # ~24 / ~8 CTAs cut each tile
V8_TARGETS = {256: 1.05, 512: 1.05, 1024: 1.05, 4096: 1.0}          # x cuBLAS the brief asks for
V9_TOKENS = (256, 512, 1024, 4096)                                  # --v9: where the targets are set
V9_ODD_RELEASED = [(257, K_REL + 8, N_REL + 8), (33, K_REL, 512)]   # --v9: N % 256 == 8; ~24 CTAs cut each tile
NOISE_SIGMAS, U = 8.0, 2.0 ** -24


# ---- the yardstick (as in the proj tests) ----------------------------------------------------------

def _ulp_size(v):
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -126))) - 7)


class Yard:
    """float64 product of sampled token rows, and which elements fp32 summation noise leaves alone."""

    def __init__(self, x_rows, w_f64, w2_f64):
        from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
        xf = bf16_to_f32(x_rows).astype(np.float64)
        self.exact64 = xf @ w_f64.T
        self.exact = f32_to_bf16(self.exact64)
        K = x_rows.shape[1]
        noise = NOISE_SIGMAS * U * np.sqrt(K / 2) * np.sqrt((xf * xf) @ w2_f64.T)
        self.well = noise < 0.5 * _ulp_size(self.exact64)
        self.allow = noise + 2.0 ** -7 * (np.abs(self.exact64) + noise)

    def check(self, got_rows) -> dict:
        from engram_numba.bf16 import bf16_to_f32, bf16_ulp_distance
        ulps = bf16_ulp_distance(got_rows, self.exact)
        g64 = bf16_to_f32(got_rows).astype(np.float64)
        ill = ~self.well
        out = {"max_ulp_well": int(ulps[self.well].max()) if self.well.any() else 0,
               "max_ulp": int(ulps.max()), "frac_gt_1ulp": float((ulps > 1).mean()),
               "ill_over_allow": float((np.abs(g64[ill] - self.exact64[ill]) / self.allow[ill]).max())
               if ill.any() else 0.0,
               "finite": bool(np.isfinite(g64).all())}
        out["ok"] = bool(out["finite"] and out["max_ulp_well"] <= 1 and out["ill_over_allow"] <= 1.0)
        return out


# ---- the worker ------------------------------------------------------------------------------------

def _emit(fh, rec):
    fh.write(json.dumps(rec) + "\n")
    fh.flush()
    print(json.dumps(rec), flush=True)


def worker(out_dir: Path, skip: set, quick: bool, smoke: bool, only=None, tokens_arg=None, sweep_arg=None,
           v7: bool = False, v8: bool = False, v9: bool = False, tma: bool = False):
    from numba import cuda

    from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
    from engram_numba.stages.gate.launch import prepare_gate
    from engram_numba.stages.proj import cuda_wgmma as W
    from engram_numba.stages.proj import cuda_wgmma_ws as W7
    from engram_numba.stages.proj.launch import pick, prepare_project
    from engram_numba.bench.timing import DeviceTimer

    variants = {**W.VARIANTS, **W.CANDIDATES}
    ws_variants = {**W7.VARIANTS, **W7.CANDIDATES}
    sk_variants = {**W.SK_VARIANTS, **W.SK_CANDIDATES}
    if v8:         # gemm_v8 and its split choices against the records' tiles
        variants = {**W.VARIANTS, **sk_variants}
        ws_variants = {}
    if v7:         # gemm_v7 and its candidates against the records' tiles (the other candidates left out)
        variants = {**W.VARIANTS, **ws_variants}
    if v9:         # gemm_v9 and its loop variants against gemm_v4 / gemm_v6 / gemm_v8
        sk_variants = {**W.SK_VARIANTS, **W.V9_VARIANTS,
                       **{k: c for k, c in W.V9_CANDIDATES.items() if isinstance(c, W.SkVariant)}}
        variants = {"gemm_v4": W.VARIANTS["gemm_v4"], "gemm_v6": W.VARIANTS["gemm_v6"],
                    **{k: c for k, c in W.V9_CANDIDATES.items() if isinstance(c, W.Variant)}, **sk_variants}
        ws_variants = {}
    q_variants = {}  # the unit-queue candidates (--tma)
    same_bits = {}   # variant -> the kernel whose bits it must return (checked at every shape, beside the yardstick)
    if tma:        # the TMA loop on gemm_v4's grid and on persistent CTAs, against what they rebuild
        tma_sk = {k: c for k, c in W.TMA_CANDIDATES.items() if isinstance(c, W.SkVariant)}
        tma_grid = {k: c for k, c in W.TMA_CANDIDATES.items() if isinstance(c, W.Variant)}
        sk_variants = {**W.SK_VARIANTS, **W.V9_VARIANTS, **tma_sk}
        variants = {"gemm_v4": W.VARIANTS["gemm_v4"], "gemm_v6": W.VARIANTS["gemm_v6"], **tma_grid, **sk_variants}
        ws_variants = {}
        q_variants = dict(W.Q_CANDIDATES)
        same_bits = {**{k: "gemm_v4" for k in tma_grid},
                     **{k: "gemm_v4" if c.split == "dp" else "gemm_v8" for k, c in tma_sk.items()},
                     **{k: "gemm_v4" for k, c in q_variants.items() if c.pieces == 1}}
    if only:       # --variants: these (and cuBLAS) in every phase
        variants = {k: v for k, v in variants.items() if k in only}
        skip = set(skip) | {n for n in ("gemv_v3", "gemv_v4", "gemm_v3", *W.VARIANTS, *W.CANDIDATES) if n not in only}
    fh = open(out_dir / "prefill_dev.jsonl", "a")
    timer = DeviceTimer()
    k_rel, n_rel, tokens, odd, odd_rel = K_REL, N_REL, TOKENS, ODD, ODD_RELEASED
    HC, DIM = 4, 5120
    if smoke:     # the script's own wiring in numba's simulator: tiny shapes, meaningless times
        k_rel, n_rel, tokens, odd, odd_rel, HC, DIM = 136, 320, (16, 130), ODD[:1], [(33, 72, 200)], 4, 64
    if v7 and not smoke:
        tokens = V7_TOKENS
    if v8 and not smoke:
        tokens, odd_rel = V8_TOKENS, V8_ODD_RELEASED
    if (v9 or tma) and not smoke:
        tokens, odd_rel = V9_TOKENS, V9_ODD_RELEASED
    tokens = tuple(tokens_arg) if tokens_arg else tokens

    def rand_bf16(shape, scale, seed):       # host bf16 words (fresh normal draws, never zeros)
        r = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        return f32_to_bf16(r * np.float32(scale))

    def as_words(h):
        return cuda.to_device(h)

    def host_words(h):
        return h

    def launch_of(name, x, w, out):
        if name in q_variants:
            return W.prepare_queue(name, q_variants[name], x, w, out)
        if name in sk_variants:
            return W.prepare_sk(name, sk_variants[name], x, w, out)
        if name in ws_variants:
            return W7.prepare_variant(name, ws_variants[name], x, w, out)
        if name in variants:
            return W.prepare_variant(name, variants[name], x, w, out)
        return prepare_project(x, w, out, version=name)          # gemm_v3, gemv_v4, cublas_v1

    def tma_store(name):
        """Whether candidate `name` stores by TMA only (the queue kernels, the "tma" epilogue on the grid)."""
        c = variants.get(name)
        tile = c.tile if isinstance(c, W.SkVariant) else c
        return name in q_variants or (isinstance(tile, W.Variant) and tile.store == "tma")

    def run_check(name, x, w, T, N, rows, yard):
        out = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
        launch = launch_of(name, x, w, out)
        launch()
        cuda.synchronize()
        chk = yard.check(out.copy_to_host()[rows])
        if name in same_bits:               # every output, bit for bit, against the kernel it rebuilds
            ref = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
            launch_of(same_bits[name], x, w, ref)()
            cuda.synchronize()
            diff = int(np.count_nonzero(out.copy_to_host() != ref.copy_to_host()))
            chk[f"differs_from_{same_bits[name]}"] = diff
            chk["ok"] = bool(chk["ok"] and diff == 0)
        return launch, out, chk

    def start(name):
        print(f"START {name}", flush=True)

    # 1. tiny odd shapes: every variant (a broken one shows here, cheaply)
    for (T, K, N) in odd:
        x_t, w_t = rand_bf16((T, K), 1.0, 1 + T), rand_bf16((N, K), 0.05, 2 + N)
        wf = bf16_to_f32(host_words(w_t)).astype(np.float64)
        yard = Yard(host_words(x_t), wf, wf * wf)
        x, w = as_words(x_t), as_words(w_t)
        for name in list(variants) + list(q_variants) + ["cublas_v1"]:
            if name in skip or (smoke and name not in W.VARIANTS and name not in sk_variants):
                continue
            if (name in same_bits or name in q_variants) and K % 8:  # a TMA row is a multiple of 16 bytes
                continue
            if tma_store(name) and N % 8:      # a TMA epilogue needs 16-byte output rows (the records fall back)
                continue
            start(name)
            try:
                t0 = time.time()
                _, _, chk = run_check(name, x, w, T, N, slice(None), yard)
                _emit(fh, {"phase": "odd", "variant": name, "shape": [T, K, N], "first_call_s": round(time.time() - t0, 2),
                           **chk})
            except Exception as exc:           # a launch error that is not sticky: note it, carry on
                _emit(fh, {"phase": "odd", "variant": name, "shape": [T, K, N], "ok": False,
                           "error": f"{type(exc).__name__}: {exc}"[:400]})

    # 2. released shape: check sampled rows, then time
    w_t = rand_bf16((n_rel, k_rel), 0.05, 7)
    w_h = host_words(w_t)
    wf = bf16_to_f32(w_h).astype(np.float64)
    w2 = wf * wf
    w = as_words(w_t)
    rng = np.random.default_rng(3)
    per_T = {16: ["gemm_v5", "64x64/s3/sw128", "64x256/s4/sw128", "64x128/s6/sw128", "gemm_v4", "gemv_v4", "cublas_v1"],
             128: list(variants) + ["gemm_v3", "cublas_v1"],
             4096: ["gemm_v4", "gemm_v6", "128x128/s3/sw128", "128x256/s4/noswz", "gemm_v5", "gemm_v3", "cublas_v1"]}
    best4096 = None
    per_T[tokens[-1]] = per_T.pop(4096)
    for T in tokens:
        per_T.setdefault(T, list(variants) + ["cublas_v1"])
    if v7:         # every T: the records' wgmma tiles, the default the records pick, v7 and its candidates
        per_T = {T: list(dict.fromkeys(
            [pick(T, k_rel, n_rel).name] + (["gemm_v5"] if T <= 64 else [])
            + ["gemm_v4", "gemm_v6", *ws_variants, "cublas_v1"])) for T in tokens}
    if v8:         # every T: gemm_v8, its split choices, the tiles it competes with and cuBLAS
        per_T = {T: ["gemm_v8", *W.SK_CANDIDATES, "gemm_v4", "gemm_v6", "cublas_v1"] for T in tokens}
    if v9:         # every T: gemm_v9, its candidates, the kernels they rebuild and cuBLAS
        per_T = {T: ["gemm_v9", *W.V9_CANDIDATES, "gemm_v8", "gemm_v4", "gemm_v6", "cublas_v1"] for T in tokens}
    if tma:        # every T: the TMA candidates, the kernels they rebuild, gemm_v9 and cuBLAS
        per_T = {T: [*W.Q_CANDIDATES, *W.TMA_CANDIDATES, "gemm_v9", "gemm_v8", "gemm_v4"] + (["gemm_v6"] if T <= 256 else [])
                 + ["cublas_v1"] for T in tokens}
    if only and (v8 or v9 or tma):
        per_T = {T: [n for n in names if n in only or n == "cublas_v1"] for T, names in per_T.items()}
    if smoke:
        per_T = {T: [n for n in names if n in ("gemm_v4", "gemm_v5", "gemm_v3", "cublas_v1", *sk_variants)]
                 for T, names in per_T.items()}

    def sk_plan(name, T, N, K):
        """(split, CTAs, cut slots) of a gemm_v8 variant's schedule at this shape."""
        _, counts, slots, split = W.sk_schedule(T, N, K, sk_variants[name], W.WS.device_ctas())
        return split, int(counts.size), int(slots)

    def same_as_v8(name, T, N, K):
        """A split choice that would launch gemm_v8's own kernel on gemm_v8's own schedule."""
        a, b = sk_variants[name], sk_variants["gemm_v8"]
        if name == "gemm_v8" or a.tile is not b.tile or a.overlap != b.overlap or v9 or tma:
            return False
        sa, sb = (W.sk_schedule(T, N, K, v, W.WS.device_ctas()) for v in (a, b))
        return bool(np.array_equal(sa[0], sb[0]) and np.array_equal(sa[1], sb[1]))
    for T in tokens:
        x_t = rand_bf16((T, k_rel), 1.0, 100 + T)
        x_h = host_words(x_t)
        rows = np.arange(T) if T <= 256 else np.unique(np.concatenate(
            [[0, T - 1], rng.choice(T, 190, replace=False)]))
        yard = Yard(x_h[rows], wf, w2)
        x = as_words(x_t)
        for name in per_T[T]:
            if name in skip:
                continue
            extra = {}
            if name in sk_variants:
                split, ctas, slots = sk_plan(name, T, n_rel, k_rel)
                extra = {"split": split, "ctas": ctas, "cut_slots": slots}
                if same_as_v8(name, T, n_rel, k_rel):
                    _emit(fh, {"phase": "released", "variant": name, "T": T, "same_as": "gemm_v8", **extra})
                    continue
            start(name)
            try:
                launch, out, chk = run_check(name, x, w, T, n_rel, rows, yard)
                if name in q_variants:
                    queue, slots = W.cached_queue(T, n_rel, k_rel, q_variants[name], W.WS.device_ctas())
                    extra = {"units": int(len(queue)), "cut_slots": int(slots)}
                if name in sk_variants or name in q_variants:   # the same bits launch after launch
                    first = out.copy_to_host()
                    same = True
                    for _ in range(2):
                        out.copy_to_device(np.full((T, n_rel), 0xFFFF, np.uint16))
                        launch()
                        cuda.synchronize()
                        same = same and bool(np.array_equal(out.copy_to_host(), first))
                    extra["reproducible"] = same
                    chk["ok"] = bool(chk["ok"] and same)
                iters = 10 if T == tokens[-1] or quick else 30
                us = timer(launch, iters=iters)
                rec = {"phase": "released", "variant": name, "T": T, "time_us": round(us, 2),
                       "tflops": round(2.0 * T * k_rel * n_rel / us / 1e6, 1),
                       "weight_gbps": round(2.0 * n_rel * k_rel / us / 1e3, 1), **extra, **chk}
                _emit(fh, rec)
                if T == tokens[-1] and name != "cublas_v1" and chk["ok"] and (best4096 is None or us < best4096[1]):
                    best4096 = (name, us)
            except Exception as exc:
                _emit(fh, {"phase": "released", "variant": name, "T": T, "ok": False,
                           "error": f"{type(exc).__name__}: {exc}"[:400]})

    # 2b. where the defaults change hands: every candidate at the token counts between
    sweep = (2, 48) if smoke and not (v8 or v9) else tuple(sweep_arg) if sweep_arg is not None else () if v7 or v8 or v9 or tma \
        else SWEEP_TOKENS
    for T in sweep:
        x_t = rand_bf16((T, k_rel), 1.0, 200 + T)
        rows = np.arange(T) if T <= 64 else np.unique(np.concatenate([[0, T - 1], rng.choice(T, 62, replace=False)]))
        yard = Yard(x_t[rows], wf, w2)
        x = as_words(x_t)
        names = (["gemv_v3"] if T <= 8 else []) + (["gemv_v4"] if T <= 32 else []) \
            + (["gemm_v5"] if T <= 256 else []) + ["gemm_v4", "gemm_v6"] + (["128x128/s3/sw128"] if T >= 32 else []) \
            + (["gemm_v3"] if T > 32 else []) + ["cublas_v1"]
        for name in names:
            if name in skip or (smoke and name not in ("gemm_v4", "gemm_v5", "cublas_v1")):
                continue
            start(name)
            try:
                launch, out, chk = run_check(name, x, w, T, n_rel, rows, yard)
                us = timer(launch, iters=10 if quick else 20)
                _emit(fh, {"phase": "sweep", "variant": name, "T": T, "time_us": round(us, 2),
                           "tflops": round(2.0 * T * k_rel * n_rel / us / 1e6, 1), **chk})
            except Exception as exc:
                _emit(fh, {"phase": "sweep", "variant": name, "T": T, "ok": False,
                           "error": f"{type(exc).__name__}: {exc}"[:400]})

    # 3. apply at T = 4096: our best projection + our gate, against cuBLAS + our gate
    T = tokens[-1]
    if best4096 is not None:
        x = as_words(rand_bf16((T, k_rel), 1.0, 104096))
        kv = cuda.device_array((T, n_rel), dtype=np.uint16)
        h = cuda.to_device(np.random.default_rng(5).standard_normal((T, HC, DIM)).astype(np.float32))
        w_gate = cuda.to_device((1 + 0.1 * np.random.default_rng(6).standard_normal((HC, DIM))).astype(np.float32))
        dot = cuda.device_array((T, HC), dtype=np.float32)
        gate = cuda.device_array((T, HC), dtype=np.float32)
        gate_l = prepare_gate(h, kv, w_gate, dot_out=dot, gate_out=gate)
        ours = launch_of(best4096[0], x, w, kv)
        blas = None

        def apply_ours():
            ours()
            gate_l()

        def apply_blas():
            blas()
            gate_l()
        res = {"phase": "apply", "T": T, "proj": best4096[0], "gate": gate_l.name,
               "gate_us": round(timer(gate_l, iters=10), 2),
               "apply_ours_us": round(timer(apply_ours, iters=10), 2)}
        try:
            blas = launch_of("cublas_v1", x, w, kv)
            res["apply_cublas_us"] = round(timer(apply_blas, iters=10), 2)
            res["ratio"] = round(res["apply_ours_us"] / res["apply_cublas_us"], 3)
        except Exception as exc:
            res["cublas_error"] = f"{type(exc).__name__}: {exc}"[:300]
        _emit(fh, res)

    # 4. odd released-size shapes: checks only
    for (T, K, N) in odd_rel:
        x_t, w2_t = rand_bf16((T, K), 1.0, 11 + T), rand_bf16((N, K), 0.05, 12 + N)
        wfo = bf16_to_f32(host_words(w2_t)).astype(np.float64)
        yard = Yard(host_words(x_t), wfo, wfo * wfo)
        names = ["gemm_v4", "gemm_v5", "gemm_v6", "128x256/s4/noswz", "cublas_v1"]
        if v7:
            names = ["gemm_v4", *ws_variants, "cublas_v1"]
        if v8:
            names = [n for n in ["gemm_v4", *sk_variants, "cublas_v1"] if not only or n in only or n == "cublas_v1"]
        if v9:
            names = [n for n in ["gemm_v4", *W.V9_CANDIDATES, *W.V9_VARIANTS, "gemm_v8", "cublas_v1"]
                     if not only or n in only or n == "cublas_v1"]
        if tma:
            names = [n for n in [*W.Q_CANDIDATES, *W.TMA_CANDIDATES, "gemm_v8", "cublas_v1"]
                     if not only or n in only or n == "cublas_v1"]
        if smoke and (v8 or v9):
            names = [n for n in names if n != "cublas_v1"]
        for name in names:
            if name in skip or (tma_store(name) and N % 8):
                continue
            start(name)
            try:
                _, _, chk = run_check(name, as_words(x_t), as_words(w2_t), T, N, slice(None), yard)
                extra = dict(zip(("split", "ctas", "cut_slots"), sk_plan(name, T, N, K))) if name in sk_variants else {}
                _emit(fh, {"phase": "odd_released", "variant": name, "shape": [T, K, N], **extra, **chk})
            except Exception as exc:
                _emit(fh, {"phase": "odd_released", "variant": name, "shape": [T, K, N], "ok": False,
                           "error": f"{type(exc).__name__}: {exc}"[:400]})
    if best4096 is not None:
        _emit(fh, {"phase": "best4096", "variant": best4096[0], "time_us": round(best4096[1], 2)})
    print("WORKER DONE", flush=True)


def ncu_target(name: str):
    """One launch of variant `name` at T = 4096 (what Nsight Compute profiles)."""
    from numba import cuda

    from engram_numba.bf16 import f32_to_bf16
    from engram_numba.stages.proj import cuda_wgmma as W
    from engram_numba.stages.proj import cuda_wgmma_ws as W7
    ws_variants = {**W7.VARIANTS, **W7.CANDIDATES}
    variants = {**W.VARIANTS, **W.CANDIDATES}
    sk_variants = {**W.SK_VARIANTS, **W.SK_CANDIDATES}
    rng = np.random.default_rng(0)
    xw = cuda.to_device(f32_to_bf16(rng.standard_normal((4096, K_REL), dtype=np.float32)))
    ww = cuda.to_device(f32_to_bf16(rng.standard_normal((N_REL, K_REL), dtype=np.float32) * np.float32(0.05)))
    out = cuda.device_array((4096, N_REL), dtype=np.uint16)
    if name in sk_variants:
        sv = sk_variants[name]
        launch, kernel = W.prepare_sk(name, sv, xw, ww, out), W.sk_kernel_for(sv.tile, sv.overlap)
    elif name in ws_variants:
        launch, kernel = W7.prepare_variant(name, ws_variants[name], xw, ww, out), W7.kernel_for(ws_variants[name])
    else:
        launch, kernel = W.prepare_variant(name, variants[name], xw, ww, out), W.kernel_for(variants[name])
    launch()
    cuda.synchronize()
    try:   # the SASS of what ran, for the record
        sass = kernel.inspect_sass()
        text = sass if isinstance(sass, str) else "\n\n".join(str(v) for v in sass.values())
        Path(os.environ.get("OUT", ".")).joinpath(f"sass_{name.replace('/', '_')}.txt").write_text(text)
    except Exception as exc:
        print(f"no SASS: {exc}", flush=True)


def ncu_l2_target(names=()):
    """One launch each of gemm_v4, gemm_v9, the lean and tma loops on gemm_v4's grid and cuBLAS at T = 4096
    (what --ncu-l2 profiles), in that order; with `names` (--variants), those instead (records, `--tma`'s grid
    and queue candidates, e.g. TMA_CLUSTER_TILE's name), then cuBLAS."""
    from numba import cuda

    from engram_numba.bf16 import f32_to_bf16
    from engram_numba.stages.proj import cuda_wgmma as W
    from engram_numba.stages.proj.launch import prepare_project
    rng = np.random.default_rng(0)
    xw = cuda.to_device(f32_to_bf16(rng.standard_normal((4096, K_REL), dtype=np.float32)))
    ww = cuda.to_device(f32_to_bf16(rng.standard_normal((N_REL, K_REL), dtype=np.float32) * np.float32(0.05)))
    out = cuda.device_array((4096, N_REL), dtype=np.uint16)
    launches = [("gemm_v4", lambda: W.prepare_variant("gemm_v4", W.VARIANTS["gemm_v4"], xw, ww, out)),
                ("gemm_v9", lambda: W.prepare_sk("gemm_v9", W.V9_VARIANTS["gemm_v9"], xw, ww, out)),
                ("lean", lambda: W.prepare_variant("lean", W.V9_TILES["lean"], xw, ww, out)),
                ("tma", lambda: W.prepare_variant("tma", W.TMA_TILE, xw, ww, out)),
                ("cublas_v1", lambda: prepare_project(xw, ww, out, version="cublas_v1"))]
    if names:
        grid = {k: c for k, c in W.TMA_CANDIDATES.items() if isinstance(c, W.Variant)}

        def make(name):
            if name in W.Q_CANDIDATES:
                return lambda: W.prepare_queue(name, W.Q_CANDIDATES[name], xw, ww, out)
            if name in grid:
                return lambda: W.prepare_variant(name, grid[name], xw, ww, out)
            return lambda: prepare_project(xw, ww, out, version=name)
        launches = [(n, make(n)) for n in names if n != "cublas_v1"] + launches[-1:]
    for name, make in launches:
        try:
            launch = make()
            launch()
            cuda.synchronize()
            print(f"launched {name}", flush=True)
        except Exception as exc:
            print(f"{name} failed: {type(exc).__name__}: {exc}"[:300], flush=True)


def run_ncu_l2(out_dir: Path, names=()) -> None:
    cmd = ["ncu", "--clock-control", "none", "--print-details", "all",
           "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis", "--section", "WarpStateStats",
           "--section", "LaunchStats", "--section", "Occupancy", "--section", "SchedulerStats",
           "--metrics", "lts__t_bytes.sum,dram__bytes_read.sum",
           "-k", "regex:gemm|nvjet|xmma|sm90", "-c", str(len(names) + 1 if names else 5), sys.executable,
           str(Path(__file__).resolve()), "--ncu-l2-target"] + (["--variants", ",".join(names)] if names else [])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        proc = subprocess.CompletedProcess(cmd, -1, str(exc.stdout or ""), "ncu timed out")
    (out_dir / "ncu_l2.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr[-20000:])
    print(f"ncu: rc {proc.returncode} in {time.time() - t0:.0f} s", flush=True)
    keep = ("launched", "failed", "gemm", "nvjet", "xmma", "Duration", "Compute (SM) Throughput", "Memory Throughput",
            "DRAM Throughput", "L2 Cache Throughput", "L1/TEX Cache Throughput", "lts__t_bytes.sum",
            "dram__bytes_read.sum", "Mem Busy", "Max Bandwidth", "L2 Hit Rate", "Warp Cycles Per Issued",
            "Stall", "stall", "Hgmma", "Cluster", "Grid Size", "Waves", "Achieved Occupancy", "Registers",
            "Issue Slots", "No Eligible")
    print("\n".join(ln for ln in proc.stdout.splitlines() if any(k in ln for k in keep))[:8000], flush=True)


# ---- the driver --------------------------------------------------------------------------------------

def _table(records: list) -> str:
    lines = []
    rel = [r for r in records if r.get("phase") == "released"]
    blas = {r["T"]: r["time_us"] for r in rel if r["variant"] == "cublas_v1" and "time_us" in r}
    lines.append(f"{'T':>5} {'variant':20} {'us':>9} {'TFLOP/s':>8} {'x cuBLAS':>8}  ok (max ulp well / all)")
    for r in rel:
        plan = (f"  [{r['split']}, {r['ctas']} CTAs, {r['cut_slots']} cut]" if "split" in r else "") \
            + ("" if r.get("reproducible", True) else "  NOT REPRODUCIBLE")
        if "same_as" in r:
            lines.append(f"{r['T']:5d} {r['variant']:20} {'= ' + r['same_as']:>9}{plan}")
            continue
        if "time_us" not in r:
            lines.append(f"{r['T']:5d} {r['variant']:20} {'ERROR':>9}  {r.get('error', '')[:80]}")
            continue
        ratio = r["time_us"] / blas[r["T"]] if r["T"] in blas else float("nan")
        lines.append(f"{r['T']:5d} {r['variant']:20} {r['time_us']:9.1f} {r['tflops']:8.1f} {ratio:8.2f}  "
                     f"{r['ok']} ({r['max_ulp_well']}/{r['max_ulp']}){plan}")
    for r in records:
        if r.get("phase") == "apply":
            blas = (f"cuBLAS+gate {r['apply_cublas_us']:.1f} us, ratio {r['ratio']}" if "ratio" in r
                    else f"cuBLAS: {r.get('cublas_error', '?')[:80]}")
            lines.append(f"apply T={r['T']}: ours ({r['proj']}+{r['gate']}) {r['apply_ours_us']:.1f} us, {blas}; "
                         f"gate alone {r['gate_us']:.1f} us")
    sweep = [r for r in records if r.get("phase") == "sweep"]
    if sweep:
        lines.append("sweep (us; * fastest of ours; cuBLAS last):")
        for T in sorted({r["T"] for r in sweep}):
            rs = [r for r in sweep if r["T"] == T and "time_us" in r]
            ours = [r for r in rs if r["variant"] != "cublas_v1"]
            best = min(ours, key=lambda r: r["time_us"])["variant"] if ours else None
            lines.append(f"  T={T:5d} " + "  ".join(
                f"{r['variant']}{'*' if r['variant'] == best else ''} {r['time_us']:.1f}{'' if r['ok'] else ' BAD'}"
                for r in rs) + "".join(f"  {r['variant']} ERROR" for r in sweep if r["T"] == T and "time_us" not in r))
    if any(r["variant"] == "gemm_v9" for r in rel):
        lines.append(_v9_summary(rel, {r["T"]: r["time_us"] for r in rel
                                       if r["variant"] == "cublas_v1" and "time_us" in r}))
    elif any(r["variant"] == "gemm_v8" for r in rel):
        lines.append(_v8_summary(rel, {r["T"]: r["time_us"] for r in rel
                                       if r["variant"] == "cublas_v1" and "time_us" in r}))
    bad = [r for r in records if r.get("phase") in ("odd", "odd_released", "sweep") and not r.get("ok")]
    good = [r for r in records if r.get("phase") in ("odd", "odd_released", "sweep") and r.get("ok")]
    lines.append(f"odd-shape and sweep checks: {len(good)} passed, {len(bad)} failed"
                 + "".join(f"\n  FAIL {r['variant']} {r.get('shape', r.get('T'))}: {r.get('error') or r}"
                           for r in bad))
    return "\n".join(lines)


def _v8_summary(rel: list, blas: dict) -> str:
    """Per T: cuBLAS, gemm_v4, gemm_v6, gemm_v8 (auto) and the fastest valid split choice, with
    gemm_v8's ratio to cuBLAS against the target where there is one."""
    lines = ["gemm_v8 summary (us; x = time / cuBLAS; target from the brief where set):",
             f"{'T':>5} {'cuBLAS':>8} {'gemm_v4':>8} {'gemm_v6':>8} {'gemm_v8':>8} {'x':>5} {'v8/v4':>6}  "
             f"{'best split choice':28} {'x':>5}  target"]
    for T in sorted({r["T"] for r in rel}):
        rs = {r["variant"]: r for r in rel if r["T"] == T and "time_us" in r}
        us = {k: r["time_us"] for k, r in rs.items() if r.get("ok")}
        b = blas.get(T)

        def f(v):
            return f"{us[v]:8.1f}" if v in us else f"{'-' if v not in rs else 'BAD':>8}"
        sk = {k: t for k, t in us.items() if k == "gemm_v8" or k.startswith("sk/")}
        best = min(sk, key=sk.get) if sk else None
        x8 = us["gemm_v8"] / b if b and "gemm_v8" in us else float("nan")
        v8v4 = us["gemm_v8"] / us["gemm_v4"] if "gemm_v8" in us and "gemm_v4" in us else float("nan")
        xb = sk[best] / b if best and b else float("nan")
        tgt = V8_TARGETS.get(T)
        verdict = "" if tgt is None else f"<= {tgt:.2f}: " + ("MET" if x8 <= tgt else "met by best" if xb <= tgt
                                                             else "missed")
        lines.append(f"{T:5d} {b or float('nan'):8.1f} {f('gemm_v4')} {f('gemm_v6')} {f('gemm_v8')} {x8:5.2f} "
                     f"{v8v4:6.2f}  {(best or '-'):28} {xb:5.2f}  {verdict}")
    return "\n".join(lines)


def _v9_summary(rel: list, blas: dict) -> str:
    """Per T and k loop: the time, x cuBLAS, and the ratio to the kernel it rebuilds (the persistent
    ones to gemm_v8, the grid ones to gemm_v4: below 1 is the loop's gain), with the targets."""
    from engram_numba.stages.proj import cuda_wgmma as W
    rebuilt = {k: "gemm_v8" if isinstance(c, W.SkVariant) else "gemm_v4"
               for k, c in {**W.V9_VARIANTS, **W.V9_CANDIDATES}.items()}
    lines = ["gemm_v9 summary (us; x = time / cuBLAS; vs = time / the kernel it rebuilds; BAD = failed check):"]
    for T in sorted({r["T"] for r in rel}):
        rs = {r["variant"]: r for r in rel if r["T"] == T and "time_us" in r}
        us = {k: r["time_us"] for k, r in rs.items() if r.get("ok")}
        b = blas.get(T)
        base = "  ".join(f"{k} {us[k]:.1f}" if k in us else f"{k} {'BAD' if k in rs else '-'}"
                         for k in ("cublas_v1", "gemm_v4", "gemm_v6", "gemm_v8"))
        lines.append(f"T={T:5d}  {base}")
        for k, ref in rebuilt.items():
            if k not in us:
                lines.append(f"         {k:28} {'BAD' if k in rs else '-'}")
                continue
            x = us[k] / b if b else float("nan")
            vs = us[k] / us[ref] if ref in us else float("nan")
            tgt = V8_TARGETS.get(T)
            verdict = "" if tgt is None else f"target <= {tgt:.2f}: " + ("MET" if x <= tgt else "missed")
            lines.append(f"         {k:28} {us[k]:8.1f}  x {x:5.2f}  vs {ref} {vs:5.3f}  {verdict}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "prefill_dev_out"))
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in numba's simulator (the script's wiring)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--skip", default="")
    ap.add_argument("--variants", default="", help="only these variants (and cuBLAS), comma-separated")
    ap.add_argument("--tokens", default="", help="released-shape token counts (default 16,128,4096)")
    ap.add_argument("--sweep", default=None, help="sweep token counts ('' for none)")
    ap.add_argument("--ncu-target", default="")
    ap.add_argument("--v7", action="store_true", help="gemm_v7 and its candidates at T = 1 .. 4096 against v4-v6 and cuBLAS")
    ap.add_argument("--worker-timeout", type=float, default=240.0,
                    help="seconds before a worker is killed as hung (0: never); the rest rerun without the variant")
    ap.add_argument("--v8", action="store_true", help="gemm_v8 and its split choices at T = 128 .. 4096 against "
                    "gemm_v4, gemm_v6 and cuBLAS")
    ap.add_argument("--v9", action="store_true", help="gemm_v9 and its k-loop variants at T = 256 .. 4096 against "
                    "gemm_v4, gemm_v6, gemm_v8 and cuBLAS")
    ap.add_argument("--tma", action="store_true", help="the TMA k loop on gemm_v4's grid and on persistent CTAs at "
                    "T = 256 .. 4096 (or --tokens), each bit for bit against the kernel it rebuilds, against gemm_v4, gemm_v8, "
                    "gemm_v9 and cuBLAS; the TMA-loop candidates (128 x 240 tiles, 2-CTA clusters, the unit queue) beside")
    ap.add_argument("--ncu-l2", action="store_true", help="gemm_v4, gemm_v9, lean and cuBLAS at T = 4096 under "
                    "Nsight Compute: L2 / DRAM bytes and stalls (alone)")
    ap.add_argument("--ncu-l2-target", action="store_true")
    args = ap.parse_args(argv)
    if (args.v9 or args.tma) and args.worker_timeout == 240.0:
        args.worker_timeout = 100.0          # a hung persistent CTA costs 100 s, not 240 (the run is ~60 s)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    if args.ncu_target:
        ncu_target(args.ncu_target)
        return 0
    names = [s for s in args.variants.split(",") if s]
    if args.ncu_l2_target:
        ncu_l2_target(names)
        return 0
    if args.ncu_l2:
        run_ncu_l2(out_dir, names)
        return 0
    if args.worker:
        ints = lambda a: [int(t) for t in a.split(",") if t]   # noqa: E731
        worker(out_dir, skip, args.quick, args.smoke, only={s for s in args.variants.split(",") if s},
               tokens_arg=ints(args.tokens), sweep_arg=None if args.sweep is None else ints(args.sweep), v7=args.v7,
               v8=args.v8, v9=args.v9, tma=args.tma)
        return 0

    log = out_dir / "prefill_dev.jsonl"
    failed: set = set()
    for attempt in range(3):
        if log.exists():     # a restarted worker redoes everything but the variant that killed the last one
            log.unlink()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out_dir),
               "--skip", ",".join(sorted(failed))] + (["--quick"] if args.quick else []) \
            + (["--smoke"] if args.smoke else []) + (["--variants", args.variants] if args.variants else []) \
            + (["--tokens", args.tokens] if args.tokens else []) \
            + (["--sweep", args.sweep] if args.sweep is not None else []) + (["--v7"] if args.v7 else []) \
            + (["--v8"] if args.v8 else []) + (["--v9"] if args.v9 else []) + (["--tma"] if args.tma else [])
        try:        # a kernel that never returns (a persistent CTA waiting for a flag nobody raises) is a death too
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout or None)
        except subprocess.TimeoutExpired as exc:
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")   # noqa: E731
            proc = subprocess.CompletedProcess(cmd, -9, text(exc.stdout),
                                               text(exc.stderr) + f"\nworker killed after {args.worker_timeout} s")
        (out_dir / f"worker{attempt}.log").write_text(proc.stdout[-200000:] + "\n--- stderr ---\n" + proc.stderr[-50000:])
        if "WORKER DONE" in proc.stdout:
            break
        started = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("START ")]
        culprit = started[-1] if started else None
        print(f"worker {attempt} died (rc {proc.returncode}) during {culprit}: {proc.stderr.strip()[-600:]}", flush=True)
        if culprit is None:
            break
        failed.add(culprit)
    records = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    from engram_numba.bench.timing import commit
    records.insert(0, {"phase": "meta", "commit": commit(), "python": sys.version.split()[0],
                       "argv": sys.argv[1:], "unit": "time_us: CUDA-event median, L2 flushed; ulps vs float64"})
    if failed:
        records.append({"phase": "crashed", "variants": sorted(failed)})
    best = [r for r in records if r.get("phase") == "best4096"]
    if args.ncu and best:
        name = best[-1]["variant"]
        cmd = ["ncu", "--clock-control", "none", "--print-details", "all",
               "--section", "SpeedOfLight", "--section", "WarpStateStats",
               "--section", "ComputeWorkloadAnalysis", "--section", "MemoryWorkloadAnalysis",
               "-k", "regex:gemm_wgmma|gemm_ws", "-c", "1", sys.executable, str(Path(__file__).resolve()),
               "--ncu-target", name]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OUT=str(out_dir)),
                                  timeout=150)
        except subprocess.TimeoutExpired as exc:
            proc = subprocess.CompletedProcess(cmd, -1, str(exc.stdout or ""), "ncu timed out")
        (out_dir / "ncu.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr[-20000:])
        print(f"ncu on {name}: rc {proc.returncode} in {time.time() - t0:.0f} s", flush=True)
        keep = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "L1/TEX Cache",
                "L2 Cache Throughput", "Warp Cycles Per Issued", "Stall", "Issue Slots", "Executed Ipc",
                "Bank", "Tensor", "Registers", "Achieved Occupancy", "SM Busy", "Shared")
        print("\n".join(ln for ln in proc.stdout.splitlines() if any(k in ln for k in keep))[:6000], flush=True)
    (out_dir / "prefill_dev.json").write_text(json.dumps(records, indent=1))
    table = _table(records)
    (out_dir / "prefill_dev_table.txt").write_text(table + "\n")
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
