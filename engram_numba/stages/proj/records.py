"""Kernel records of the projection stage (see `engram_numba.stages.registry`).

Default rules, over ctx = {"T", "K", "N", "aligned", "simulator", "weight", "cc"}. "weight" is the
encoding the weight is read in (the record's `encoding`): every rule claims only its own.
bf16 weights: numba's simulator, or x/wkv data not 16-byte aligned -> the naive kernels (gemv_v1 at T = 1,
gemm_v1 above: plain loops are the cheap ones to simulate); on a GPU gemv_v3 for T <= 2; then on
a Hopper GPU (cc 9.0: the warpgroup MMA) gemm_v5 up to 64 tokens, gemm_v6 up to 512, gemm_v4
above; on other GPUs gemv_v4 up to GEMV_MAX_TOKENS tokens and gemm_v3 above. Every boundary is
where the H200 measurements changed hands (bench/results/h200_prefill_dev_*.json, CUDA events, L2
flushed, K = 6144, N = 25600; older timings from f7da6aa, bench/results/h200.json):
  T = 2     gemv_v3 90.0 us, gemm_v5 92.7, gemv_v4 99.7, cuBLAS 93.7
  T = 8     gemm_v5 93.0, gemv_v4 100.1, gemv_v3 216.6, cuBLAS 93.1
  T = 64    gemm_v5 96.5, gemm_v4 102.9, cuBLAS 94.4;   T = 80: gemm_v4 103.8, gemm_v5 140.4
  T = 128   gemm_v6 101.2, gemm_v4 103.1, cuBLAS 93.4   (65..128 tokens are one padded 128-row tile)
  T = 512   gemm_v6 278.7, gemm_v4 309.8, cuBLAS 220.3; T = 1024: gemm_v4 529.9, gemm_v6 540.5
q2k / fp8 weights (read in their file encoding, `launch.prepare_project_q`): the naive
gemv_q2k_v1 / gemv_fp8_v1 in the simulator or for unaligned data, the tensor-core gemv_q2k_v2 /
gemv_fp8_v2 on a GPU, for any T (8 tokens a weight pass; the engine decodes the weight to bf16
and runs the bf16 GEMM above QUANT_GEMV_MAX_TOKENS). gemv_q2k_v3 (factored, exact weights) is
picked by name.
q2k_r weights (the Q2_K blocks re-laid out on the device, q2k_r.py): gemv_q2k_v4 (register-staged),
the fastest of the three at T = 1, 4 and 8 on the H200 (bench/results/h200_decode_dev_b4a1848.json,
L2 flushed between runs): T=1 v4 45.7 us, v6 47.3, v5 47.5, against v2's 58.9 on the file layout
and cuBLAS's 91.1 on the bf16 weight. All three sit at ~26% of the copy floor with the SMs ~65%
busy (Nsight Compute, bench/results/h200_ncu_gemv_q2kr_b4a1848.txt): the decode's instructions,
not the loads, bound them now.
"""
from __future__ import annotations

from ..registry import KernelRecord, register
from . import cublas, cuda_gemm, cuda_gemv, cuda_gemv_fp8, cuda_gemv_q2k, cuda_gemv_q2kr, cuda_wgmma

GEMV_MAX_TOKENS = 32    # 2 passes of gemv_v4 (~2 x 100 us) beat gemm_v3's latency-bound ~280 us at T <= 128
GEMV3_MAX_TOKENS = 2    # gemv_v3 at T = 2: 90.0 us against gemm_v5's 92.7 and gemv_v4's 99.7
WGMMA_SMALL_MAX_TOKENS = 64   # gemm_v5's 64-token tiles read the weight once up to here
WGMMA_MID_MAX_TOKENS = 512    # gemm_v6's 128 output tiles fill the waves better up to here; gemm_v4 above
# Above this many tokens the engine decodes a q2k/fp8 wkv to bf16 (once per layer and call) and
# runs the bf16 GEMM: the weight-decoding GEMVs stream the weight once per 8 tokens.
QUANT_GEMV_MAX_TOKENS = 16


def _naive(ctx) -> bool:
    return bool(ctx["simulator"] or not ctx["aligned"])


def _fast(ctx) -> bool:
    return not _naive(ctx)


def _bf16(ctx) -> bool:
    return ctx["weight"] == "bf16"


def _hopper(ctx) -> bool:
    """A GPU whose tensor cores take wgmma (sm_90a: H100/H200)."""
    return _fast(ctx) and tuple(ctx.get("cc") or ()) == (9, 0)


SWEEP = {"gemv_v1": (1,), "gemv_v2": (1, 16), "gemv_v3": (1, 16), "gemv_v4": (1, 16, 128),
         "gemm_v1": (128,), "gemm_v2": (16, 128, 4096), "gemm_v3": (16, 128, 4096),
         "gemm_v4": (16, 128, 4096), "gemm_v5": (16, 128, 4096), "gemm_v6": (128, 4096),
         "cublas_v1": (1, 16, 128, 4096)}   # where each competes

_RECORDS = [
    ("gemv_v1", cuda_gemv, True, "naive: one thread per output column, k in order (bit-exact; 922 us at T=1)",
     "numba's simulator or unaligned data, T = 1", lambda c: _bf16(c) and _naive(c) and c["T"] <= 1),
    ("gemv_v2", cuda_gemv, False, "weight rows streamed by warps with 16-byte loads, x staged in shared memory as "
     "fp32, shuffle reductions (101 us at T=1, 72% of the copy floor)", "never (pick it by name)", None),
    ("gemv_v3", cuda_gemv, False, "K split over the whole block, 4 rows a block: 6400 short blocks keep the machine "
     "full to the end (83.6 us at T=1, 88% of the copy floor; cuBLAS 94 us)",
     f"GPU, aligned, T <= {GEMV3_MAX_TOKENS}", lambda c: _bf16(c) and _fast(c) and c["T"] <= GEMV3_MAX_TOKENS),
    ("gemv_v4", cuda_gemv, False, "tensor-core GEMV: mma m16n8k16 with up to 16 tokens as M, one weight pass per "
     "16 tokens (100.7 us at T=16, cuBLAS 94.5 us)",
     f"GPU other than Hopper, aligned, {GEMV3_MAX_TOKENS} < T <= {GEMV_MAX_TOKENS}",
     lambda c: _bf16(c) and _fast(c) and not _hopper(c) and GEMV3_MAX_TOKENS < c["T"] <= GEMV_MAX_TOKENS),
    ("gemm_v1", cuda_gemm, True, "naive: one thread per output (t, n), k in order (bit-exact; 81.6 ms at T=128)",
     "numba's simulator or unaligned data, T > 1", lambda c: _bf16(c) and _naive(c) and c["T"] > 1),
    ("gemm_v2", cuda_gemm, True, "tiled SIMT GEMM, 128x128 tiles, 8x8 register micro-tiles, double-buffered "
     "shared memory, k in order (bit-exact; 42 TFLOP/s at T=4096)", "never (pick it by name)", None),
    ("gemm_v3", cuda_gemm, False, "gemm_v2's tiling on the tensor cores: inline-PTX mma.sync m16n8k16 bf16 -> fp32 "
     "(202 TFLOP/s at T=4096, a quarter of cuBLAS; 276 us at T=128 against cuBLAS's 91)",
     f"GPU other than Hopper, aligned, T > {GEMV_MAX_TOKENS}",
     lambda c: _bf16(c) and _fast(c) and not _hopper(c) and c["T"] > GEMV_MAX_TOKENS),
    # ---- Hopper (sm_90a) and the cuBLAS comparison (issue 11) ----
    ("gemm_v4", cuda_wgmma, False, "warpgroup MMA (wgmma m64n256k16, inline PTX) on 128x256 tiles, operands in "
     "128B-swizzled shared memory fed by a 4-stage cp.async pipeline, 2 warpgroups, token-tile-fastest grid "
     "(1.92-1.97 ms = 653-672 TFLOP/s at T=4096, 84% of cuBLAS's throughput; 103-106 us at T=128, cuBLAS 94)",
     f"Hopper (cc 9.0), aligned, T > {WGMMA_MID_MAX_TOKENS}",
     lambda c: _bf16(c) and _hopper(c) and c["T"] > WGMMA_MID_MAX_TOKENS),
    ("gemm_v5", cuda_wgmma, False, "gemm_v4 for few tokens: 64x128 tiles (both warpgroups on the same 64 token "
     "rows, m64n64 each), 2 CTAs an SM, so T <= 64 puts 200 CTAs on the weight stream (91.4-93.4 us at T=16, "
     "level with cuBLAS's 91.7-93.6; gemv_v4 100.7)",
     f"Hopper (cc 9.0), aligned, {GEMV3_MAX_TOKENS} < T <= {WGMMA_SMALL_MAX_TOKENS}",
     lambda c: _bf16(c) and _hopper(c) and GEMV3_MAX_TOKENS < c["T"] <= WGMMA_SMALL_MAX_TOKENS),
    ("gemm_v6", cuda_wgmma, False, "gemm_v4 with 128x200 tiles (m64n200k16): N = 25600 is 128 tiles, so T <= 128 "
     "fills 128 SMs in one wave and T <= 256 two full waves (101 us at T=128, 149 at T=192 (cuBLAS 171), 151 at "
     "T=256 (cuBLAS 125), 279 at T=512)",
     f"Hopper (cc 9.0), aligned, {WGMMA_SMALL_MAX_TOKENS} < T <= {WGMMA_MID_MAX_TOKENS}",
     lambda c: _bf16(c) and _hopper(c) and WGMMA_SMALL_MAX_TOKENS < c["T"] <= WGMMA_MID_MAX_TOKENS),
    ("cublas_v1", cublas, False, "cuBLAS through torch.matmul on the device arrays (no copies), fp32 accumulation: "
     "the comparison backend, never a default", "never (pick it by name)", None),
]

_REQUIRES = {"cublas_v1": "torch"}

for _name, _mod, _exact, _log, _when, _rule in _RECORDS:
    register(KernelRecord(
        stage="proj", name=_name, encoding="bf16", changelog=_log, prepare=_mod.make_prepare(_name),
        compile_targets=(lambda m=_mod, n=_name: m.compile_targets(n)), bit_exact=_exact,
        default_when=_when, default_rule=_rule, sweep=SWEEP[_name], requires=_REQUIRES.get(_name, ""),
        # the fast kernels' barriers, shuffles and mma twins cost 10-100x more in the simulator;
        # the tests run them on the smallest shapes only (cuBLAS does not run there at all)
        simulate=_name != "cublas_v1",
    ))


# ---- weights read in their file encoding (q2k, fp8): one weight pass per 8 tokens ----------------

QUANT_SWEEP = (1, 4, 8)

_QUANT_RECORDS = [
    ("gemv_q2k_v1", "q2k", cuda_gemv_q2k, True,
     "naive: one thread per output column, each weight decoded as the reference decodes it and rounded to "
     "bf16, k in order (bit-exact with the bf16-weight projection)",
     "q2k weights, numba's simulator or unaligned data", lambda c: c["weight"] == "q2k" and _naive(c)),
    ("gemv_q2k_v2", "q2k", cuda_gemv_q2k, False,
     "tensor cores on weights decoded in registers: a byte_perm table of each sub-block's 4 bf16-rounded values "
     "feeds mma.m16n8k16 with x's 8 tokens as N, 16 rows a block, K split over 8 warps (51.6 MB a pass)",
     "q2k weights, GPU, aligned", lambda c: c["weight"] == "q2k" and _fast(c)),
    ("gemv_q2k_v3", "q2k", cuda_gemv_q2k, False,
     "v2 factored on exact weights: A = sc*q (exact in bf16), d scales a block's mma chain, the min term "
     "dmin*m*sum(x) as 3 more mma on exact bf16 parts of the sub-block sums of x",
     "never (pick it by name)", None),
    ("gemv_q2k_v4", "q2k_r", cuda_gemv_q2kr, False,
     "v2's math on q2k_r, the Q2_K weight re-laid out at load (same bytes): six 16-byte loads a lane per "
     "16 rows x 512 k, each warp's loads for its whole K share issued into registers before any decode, "
     "6 warps a block (160 registers: 2 blocks an SM); 45.7 / 46.2 / 46.2 us at T = 1 / 4 / 8, L2 cold (v2: 58.9)",
     "q2k_r weights (on a GPU the engine holds a Q2_K wkv as q2k_r)", lambda c: c["weight"] == "q2k_r"),
    ("gemv_q2k_v5", "q2k_r", cuda_gemv_q2kr, False,
     "v4 with 12 warps a block, each loading one unit (24 words a lane): 79 registers, 24 warps an SM "
     "(47.5 / 47.8 / 48.7 us at T = 1 / 4 / 8)",
     "never (pick it by name)", None),
    ("gemv_q2k_v6", "q2k_r", cuda_gemv_q2kr, False,
     "v4 with the loads landing in shared memory by cp.async (each lane copies what it reads, one commit "
     "group a unit, waits only for the unit it decodes): 4 warps x 3 units in flight, 80 registers, 5 blocks "
     "an SM (47.3 / 46.6 / 48.0 us at T = 1 / 4 / 8)",
     "never (pick it by name)", None),
    ("gemv_fp8_v1", "fp8", cuda_gemv_fp8, True,
     "naive: one thread per output column, e4m3 x e8m0 weights decoded exactly in fp32, k in order "
     "(bit-exact with the bf16-weight projection)",
     "fp8 weights, numba's simulator or unaligned data", lambda c: c["weight"] == "fp8" and _naive(c)),
    ("gemv_fp8_v2", "fp8", cuda_gemv_fp8, False,
     "tensor cores: cvt.rn.f16x2.e4m3x2 codes (exact) as A, x's 8 tokens as N, each 32x32 tile's sum scaled "
     "once by its power-of-two scale (157 MB a pass)",
     "fp8 weights, GPU, aligned", lambda c: c["weight"] == "fp8" and _fast(c)),
]

for _name, _enc, _mod, _exact, _log, _when, _rule in _QUANT_RECORDS:
    register(KernelRecord(
        stage="proj", name=_name, encoding=_enc, changelog=_log, prepare=_mod.make_prepare(_name),
        compile_targets=(lambda m=_mod, n=_name: m.compile_targets(n)), bit_exact=_exact,
        default_when=_when, default_rule=_rule, sweep=QUANT_SWEEP, simulate=True,
    ))
