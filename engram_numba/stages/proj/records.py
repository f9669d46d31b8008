"""Kernel records of the projection stage (see `engram_numba.stages.registry`).

Default rules, over ctx = {"T", "K", "N", "aligned", "simulator", "weight", "cc"}. "weight" is the
encoding the weight is read in (the record's `encoding`): every rule claims only its own.
bf16 weights: numba's simulator, or x/wkv data not 16-byte aligned -> the naive kernels (gemv_v1 at T = 1,
gemm_v1 above: plain loops are the cheap ones to simulate); on a GPU gemv_v3 for T <= 2; then on
a Hopper GPU (cc 9.0: the warpgroup MMA) gemm_v5 up to 64 tokens, gemm_v10 (gemm_v4's grid, TMA) up to 128, gemm_v11 (gemm_v8's
stream-K schedule with TMA loads and stores) up to 2048, gemm_v12 (persistent CTAs with a producer warp over a
tile queue, TMA) above; on other GPUs gemv_v4 up to GEMV_MAX_TOKENS tokens and gemm_v3 above. Every boundary is
where the H200 measurements changed hands (bench/results/h200_prefill_dev_*.json, CUDA events, L2
flushed, K = 6144, N = 25600; older timings from f7da6aa, bench/results/h200.json):
  T = 2     gemv_v3 90.0 us, gemm_v5 92.7, gemv_v4 99.7, cuBLAS 93.7
  T = 8     gemm_v5 93.0, gemv_v4 100.1, gemv_v3 216.6, cuBLAS 93.1
  T = 64    gemm_v5 96.5, gemm_v4 102.9, cuBLAS 94.4;   T = 80: gemm_v4 103.8, gemm_v5 140.4
  T = 128   gemm_v6 101.2, gemm_v4 103.1, cuBLAS 93.4   (65..128 tokens are one padded 128-row tile)
  T = 256   gemm_v6 145.3, gemm_v8 146.8, gemm_v4 159.9, cuBLAS 120.8                (9c531d5)
  T = 512   gemm_v8 257.9, gemm_v6 277.1, gemm_v4 308.4, cuBLAS 219.3                (9c531d5)
  T = 1024  gemm_v8 494.0, gemm_v4 534.0, gemm_v6 540.5, cuBLAS 411.5                (9c531d5)
  T = 2048  gemm_v8 976.3, gemm_v4 992.0; T = 4096: gemm_v4 1940.0, gemm_v8 1971.0, cuBLAS 1635.2
  with TMA (b02b7e6, bac3928): T = 128 gemm_v10 84.8, gemm_v6 91.4, gemm_v11 92.5, cuBLAS 80.1;
  T = 192 gemm_v11 118.7, gemm_v6 143.5, cuBLAS 144.6; T = 256 / 512 / 1024 / 2048 gemm_v11 124.7 /
  217.1 / 416.3 / 831.6, gemm_v10 139.6 / 265.0 / 456.5 / 857.5; T = 4096 gemm_v10 1687.7, gemm_v11
  1688.2, cuBLAS 1650.4
q2k / fp8 weights (read in their file encoding, `launch.prepare_project_q`): the naive
gemv_q2k_v1 / gemv_fp8_v1 in the simulator or for unaligned data, the tensor-core gemv_q2k_v2 /
gemv_fp8_v2 on a GPU (gemv_fp8_v5, v2 on f16 operands with v2's bits, up to 8 tokens), for any T
(8 tokens a weight pass; the engine decodes the weight to bf16 and runs the bf16 GEMM above
QUANT_GEMV_MAX_TOKENS). gemv_q2k_v3 (factored, exact weights) is
picked by name.
q2k_r weights (the Q2_K blocks re-laid out on the device, q2k_r.py): gemv_q2k_v4 (register-staged),
the fastest of v4..v7 at T = 1, 4 and 8 on the H200 (bench/results/h200_decode_dev_b4a1848.json and
h200_decode_dev_b26720f.json, L2 flushed between runs): T=1 v4 45.6-45.7 us, v6 46.7-47.3, v7 46.7,
v5 47.4-47.5, against v2's 58.9 on the file layout and cuBLAS's 91-93 on the bf16 weight. All sit
at ~26% of the copy floor with the SMs ~65% busy (Nsight Compute,
bench/results/h200_ncu_gemv_q2kr_b4a1848.txt). v7 runs v4's kernel with 28% fewer instructions
(56% fewer on the integer pipe, tools/sass_count_q2kr.py) and bit-identical output at the same
speed, so the instruction count alone is not what bounds them. On a GPU at T = 1 the persistent
gemv_q2k_v8 took over first (44.4 us against v4's 45.5-46.1 at f52d7f1; both layers 71.7 against
82.4), then gemv_q2k_v9 (one item a block of 2 warps, 72 registers, the same kv bits as v4): 41.3
us, and 68.6 us for both layers with its pair shape, against v8's 44.4 / 72.2 in the same run at
754c9b8 (bench/results/h200_q2kr_v9_variants_754c9b8.json). At T = 4 and 8 v4 stays (46.5 / 46.7,
level with v8 and v9), until gemv_q2k_v10 (v9's blocks, the same kv bits): 39.9 / 40.8 us at T = 4 / 8
against v4's 46.1 / 45.7 and 38.6 at T = 1 against v9's 38.7 (efdb45b, L2 flushed by reading), so
v10 took 2..8 tokens on a GPU and v9 T = 1, until gemv_q2k_v12 (v11's table decode with one fma fewer a
table and branch-free ring copies, the same kv bits as v4): 37.6 us at T = 1 against v11's 38.4 and v9's
39.3, both layers 64.4 against v9's 66.0, T = 4 / 8 39.2 / 40.0 against v11's 40.6 / 41.6 in one run
(bench/results/h200_q2kr_v12_variants_ecbad0d.txt), so v12 takes 1..8 tokens on a GPU (and the decode
graph's two-layer launch), v4 more tokens and the simulator. `_few_default` picks it.
"""
from __future__ import annotations

from numba import types

from ..registry import Factory, KernelRecord, Spec, register
from . import cublas, cuda_fp8_tma, cuda_fp8_wgmma, cuda_gemm, cuda_gemv, cuda_gemv_fp8, cuda_gemv_q2k, cuda_gemv_q2kr, cuda_wgmma
from . import cuda_wgmma_ws
from .cuda_common import prepare

GEMV_MAX_TOKENS = 32    # 2 passes of gemv_v4 (~2 x 100 us) beat gemm_v3's latency-bound ~280 us at T <= 128
GEMV3_MAX_TOKENS = 2    # gemv_v3 at T = 2: 90.0 us against gemm_v5's 92.7 and gemv_v4's 99.7
WGMMA_SMALL_MAX_TOKENS = 64   # gemm_v5's 64-token tiles read the weight once up to here
WGMMA_MID_MAX_TOKENS = 128    # gemm_v10 (one wave of 100 tiles) up to here, gemm_v11 above (T = 256: 124.7 us
                              # against gemm_v10's 139.6, bench/results/h200_prefill_dev_tma_b02b7e6.txt, h200.json)
WGMMA_SK_MAX_TOKENS = 2048    # gemm_v11's stream-K tail up to here, gemm_v12 above (T = 2048: v11 834.7 us, v12
                              # 846.2; T = 3072: v12 1249.8, v11 1261.5; h200_prefill_dev_pw_9bc593c.txt)
# Above this many tokens the engine decodes a q2k/fp8 wkv to bf16 (once per layer and call) and
# runs the bf16 GEMM: the weight-decoding GEMVs stream the weight once per 8 tokens.
QUANT_GEMV_MAX_TOKENS = 16


def _naive(ctx) -> bool:
    return bool(ctx["simulator"] or not ctx["aligned"])


def _fast(ctx) -> bool:
    return not _naive(ctx)


def _bf16(ctx) -> bool:
    return ctx["weight"] == "bf16"


Q2KR_FEW_MAX_TOKENS = 8   # gemv_q2k_v12 measured against v4 up to here (one 8-token group)


def _few_default(ctx) -> bool:
    """The q2k_r contexts of gemv_q2k_v12: 1..Q2KR_FEW_MAX_TOKENS tokens on a GPU (module doc)."""
    return ctx["weight"] == "q2k_r" and not ctx["simulator"] and ctx["T"] <= Q2KR_FEW_MAX_TOKENS


FP8_FEW_MAX_TOKENS = 8    # gemv_fp8_v5 measured against v2 up to here (one 8-token group)


def _fp8_few(ctx) -> bool:
    """The fp8 contexts of gemv_fp8_v5: 1..FP8_FEW_MAX_TOKENS tokens on a GPU, aligned data."""
    return ctx["weight"] == "fp8" and _fast(ctx) and ctx["T"] <= FP8_FEW_MAX_TOKENS


def _hopper(ctx) -> bool:
    """A GPU whose tensor cores take wgmma (sm_90a: H100/H200)."""
    return _fast(ctx) and tuple(ctx.get("cc") or ()) == (9, 0)


# argument types of the compile-only tier
_U8_1D = types.uint8[::1]
_U8_2D = types.uint8[:, ::1]
_U16_2D = types.uint16[:, ::1]
_U32_1D = types.uint32[::1]
NAIVE_ARGS = (_U16_2D, _U16_2D, _U16_2D)                                  # x, wkv, out
FAST_ARGS = (_U32_1D, _U32_1D, _U16_2D, types.int64, types.int64)        # x32, w32, out, T, K


# bytes of a wkv [N, K] stored in each weight encoding: bf16; q2k and its device layout q2k_r, one
# 84-byte block per 256 values; fp8, one e4m3 byte a value and one e8m0 scale per 32x32 tile
WEIGHT_BYTES = {
    "bf16": lambda N, K: N * K * 2,
    "q2k": lambda N, K: N * (K // 256) * 84,
    "q2k_r": lambda N, K: N * (K // 256) * 84,
    "fp8": lambda N, K: N * K + -(-N // 32) * (K // 32),
}


def weight_bytes(encoding: str, N: int, K: int) -> int:
    """Bytes of a wkv [N, K] stored in `encoding`."""
    if encoding not in WEIGHT_BYTES:
        raise ValueError(f"no weight size for wkv encoding {encoding!r}; known: {sorted(WEIGHT_BYTES)}")
    return WEIGHT_BYTES[encoding](N, K)


def cost(encoding: str):
    """(bytes, flops) of kv = bf16(x @ W^T) with W in `encoding`: the weight read once, x [T, K]
    bf16 read, kv [T, N] bf16 written; 2*T*K*N flops whatever the weight's encoding."""
    def proj_cost(T: int, K: int, N: int) -> tuple[int, int]:
        return weight_bytes(encoding, N, K) + T * K * 2 + T * N * 2, 2 * T * K * N
    proj_cost.__name__ = f"cost_{encoding}"
    return proj_cost


def _proj(name, changelog, *, kernel, geometry, args, specs, when="never (pick it by name)", rule=None,
          exact=False, encoding="bf16", sim=(), sweep=(), align=16, vector_io=None, **kw):
    """Register one projection record (the stage's launcher: `cuda_common.prepare`); its cost is
    its weight encoding's (WEIGHT_BYTES) unless `cost=` says otherwise."""
    naive = args == "naive"
    if encoding in WEIGHT_BYTES:
        kw.setdefault("cost", cost(encoding))
    register(KernelRecord(
        stage="proj", name=name, changelog=changelog, launcher=kw.pop("launcher", prepare), kernel=kernel,
        geometry=geometry, args=args, align=0 if naive else align, specs=specs, spill_free=not naive,
        vector_io=not naive if vector_io is None else vector_io,
        sim_cases=tuple(sim), bit_exact=exact, default_when=when, default_rule=rule, encoding=encoding,
        sweep=tuple(sweep), **kw))


# Simulator cases are (T, K, N): small enough for the simulator (1-4 blocks), chosen so that tiles
# and blocks do not divide the shape; the comments say what each one exercises.

# ---- bf16 weights ----------------------------------------------------------------------------------

_proj("gemv_v1", "naive: one thread per output column, k in order (bit-exact; 922 us at T=1)",
      kernel=cuda_gemv._gemv_v1, geometry=cuda_gemv.geometry_v1, args="naive",
      specs=(Spec("", cuda_gemv._gemv_v1, NAIVE_ARGS),), exact=True,
      when="numba's simulator or unaligned data, T = 1", rule=lambda c: _bf16(c) and _naive(c) and c["T"] <= 1,
      sim=[(1, 64, 33), (5, 72, 19)], sweep=(1,))
_proj("gemv_v2", "weight rows streamed by warps with 16-byte loads, x staged in shared memory as fp32, shuffle "
      "reductions (101 us at T=1, 72% of the copy floor)",
      kernel=Factory(lambda T: cuda_gemv._gemv_v2[cuda_gemv.token_block(T)]), geometry=cuda_gemv.geometry_v2,
      args="fast", specs=tuple(Spec(f"[TB={tb}]", cuda_gemv._gemv_v2[tb], FAST_ARGS)
                               for tb in cuda_gemv.GEMV_TOKEN_BLOCKS),
      sim=[(1, 64, 33),             # TB=1, 2 blocks of 32 rows, the second with 1 row
           (2, 72, 8),              # TB=2, rows past N clamped
           (5, 64, 6),              # TB=8 (3 tokens past T)
           (1, 8256, 6)],           # x staged in 2 passes (8192 + 64 values)
      sweep=(1, 16))
_proj("gemv_v3", "K split over the whole block, 4 rows a block: 6400 short blocks keep the machine full to the end "
      "(83.6 us at T=1, 88% of the copy floor; cuBLAS 94 us)",
      kernel=Factory(lambda T: cuda_gemv._gemv_v3[cuda_gemv.token_block(T)]), geometry=cuda_gemv.geometry_v3,
      args="fast", specs=tuple(Spec(f"[TB={tb}]", cuda_gemv._gemv_v3[tb], FAST_ARGS)
                               for tb in cuda_gemv.GEMV_TOKEN_BLOCKS),
      when=f"GPU, aligned, T <= {GEMV3_MAX_TOKENS}",
      rule=lambda c: _bf16(c) and _fast(c) and c["T"] <= GEMV3_MAX_TOKENS,
      sim=[(1, 64, 6),              # TB=1, 2 blocks of 4 rows, most threads past K
           (5, 64, 3),              # TB=8 with 3 tokens past T, 1 partial block
           (3, 6208, 5)],           # TB=4, 776 chunks: a second trip over K (j0 loop)
      sweep=(1, 16))
_proj("gemv_v4", "tensor-core GEMV: mma m16n8k16 with up to 16 tokens as M, one weight pass per 16 tokens (100.7 us "
      "at T=16, cuBLAS 94.5 us)",
      kernel=cuda_gemv._gemv_v4, geometry=cuda_gemv.geometry_v4, args="fast",
      specs=(Spec("", cuda_gemv._gemv_v4, FAST_ARGS),),
      when=f"GPU other than Hopper, aligned, {GEMV3_MAX_TOKENS} < T <= {GEMV_MAX_TOKENS}",
      rule=lambda c: _bf16(c) and _fast(c) and not _hopper(c) and GEMV3_MAX_TOKENS < c["T"] <= GEMV_MAX_TOKENS,
      sim=[(1, 64, 6),              # 15 padding tokens, rows past N
           (16, 72, 33),            # a full m16 token group, 2 blocks, K8 = 9 (tail chunk)
           (19, 1040, 5)],          # 2 token groups, 3 trips over K with a partial one
      sweep=(1, 16, 128))
_proj("gemm_v1", "naive: one thread per output (t, n), k in order (bit-exact; 81.6 ms at T=128)",
      kernel=cuda_gemm._gemm_v1, geometry=cuda_gemm.geometry_v1, args="naive",
      specs=(Spec("", cuda_gemm._gemm_v1, NAIVE_ARGS),), exact=True,
      when="numba's simulator or unaligned data, T > 1", rule=lambda c: _bf16(c) and _naive(c) and c["T"] > 1,
      sim=[(2, 64, 33), (5, 72, 40)], sweep=(128,))
_proj("gemm_v2", "tiled SIMT GEMM, 128x128 tiles, 8x8 register micro-tiles, double-buffered shared memory, k in order "
      "(bit-exact; 42 TFLOP/s at T=4096)",
      kernel=cuda_gemm._gemm_v2, geometry=cuda_gemm.geometry_v2, args="fast",
      specs=(Spec("", cuda_gemm._gemm_v2, FAST_ARGS),), exact=True,
      sim=[(5, 72, 33),             # one 128x128 tile, K % 16 == 8 (zero-filled tail)
           (130, 16, 7),            # 2 tiles in T, 2 rows in the second
           (3, 32, 130)],           # 2 tiles in N
      sweep=(16, 128, 4096))
_proj("gemm_v3", "gemm_v2's tiling on the tensor cores: inline-PTX mma.sync m16n8k16 bf16 -> fp32 (202 TFLOP/s at "
      "T=4096, a quarter of cuBLAS; 276 us at T=128 against cuBLAS's 91)",
      kernel=cuda_gemm._gemm_v3, geometry=cuda_gemm.geometry_v3, args="fast",
      specs=(Spec("", cuda_gemm._gemm_v3, FAST_ARGS),),
      when=f"GPU other than Hopper, aligned, T > {GEMV_MAX_TOKENS}",
      rule=lambda c: _bf16(c) and _fast(c) and not _hopper(c) and c["T"] > GEMV_MAX_TOKENS,
      sim=[(5, 40, 33),             # one tile, K % 32 == 8 (zero-filled tail), 2 k tiles
           (130, 32, 9)],           # 2 tiles in T, N % 8 == 1 (odd n + 1 guard)
      sweep=(16, 128, 4096))


# ---- Hopper (sm_90a): warpgroup MMA, one kernel factory, a Variant (tile, stages, layout) each ------

def _wgmma(name, changelog, *, when, rule=None, sim, sweep):
    v = cuda_wgmma.VARIANTS[name]
    _proj(name, changelog, kernel=Factory(lambda T: cuda_wgmma.kernel_for(v)), geometry=cuda_wgmma.geometry(v),
          args="fast", specs=lambda: [Spec(f"[{v.name}]", cuda_wgmma.kernel_for(v), FAST_ARGS)],
          when=when, rule=rule, sim=sim, sweep=sweep, vector_io=False)


_wgmma("gemm_v4", "warpgroup MMA (wgmma m64n256k16, inline PTX) on 128x256 tiles, operands in 128B-swizzled shared "
       "memory fed by a 4-stage cp.async pipeline, 2 warpgroups, token-tile-fastest grid (1.92-1.97 ms = 653-672 "
       "TFLOP/s at T=4096, 84% of cuBLAS's throughput; 103-106 us at T=128, cuBLAS 94)",
       when="never since gemm_v10 (its mainloop on TMA): pick it by name",
       sim=[(33, 264, 200),         # one 128x256 tile: rows past T and N, K % 64 == 8 (a 1-chunk
                                    # last k tile), 5 k tiles through a 4-stage pipeline
            (130, 72, 260)],        # 2 x 2 tiles: 2 rows in the second token tile, 4 outputs in
                                    # the second output tile, 2 k tiles (pipeline deeper than K)
       sweep=(16, 128, 4096))
_wgmma("gemm_v5", "gemm_v4 for few tokens: 64x128 tiles (both warpgroups on the same 64 token rows, m64n64 each), "
       "2 CTAs an SM, so T <= 64 puts 200 CTAs on the weight stream (91.4-93.4 us at T=16, level with cuBLAS's "
       "91.7-93.6; gemv_v4 100.7)",
       when=f"Hopper (cc 9.0), aligned, {GEMV3_MAX_TOKENS} < T <= {WGMMA_SMALL_MAX_TOKENS}",
       rule=lambda c: _bf16(c) and _hopper(c) and GEMV3_MAX_TOKENS < c["T"] <= WGMMA_SMALL_MAX_TOKENS,
       sim=[(5, 136, 130),          # 64x128 tiles: 2 output tiles, the second with 2 outputs
            (70, 520, 9)],          # 2 token tiles, 9 k tiles (the ring of 4 stages wraps twice)
       sweep=(16, 128, 4096))
_wgmma("gemm_v6", "gemm_v4 with 128x200 tiles (m64n200k16): N = 25600 is 128 tiles, so T <= 128 fills 128 SMs in one "
       "wave and T <= 256 two full waves (101 us at T=128, 149 at T=192 (cuBLAS 171), 151 at T=256 (cuBLAS 125), "
       "279 at T=512)",
       when="never since gemm_v10 took 64 < T <= 128 (83.5-84.8 us against 89.0-91.4 at T = 80..128, "
            "bench/results/h200_prefill_dev_tma_t80_4096_5ad1c6a.txt): pick it by name",
       sim=[(130, 136, 330)],       # 128x200 tiles (the last 8 of 32 copy rows idle): 2 x 2 tiles,
                                    # 130 outputs in the second output tile
       sweep=(128, 4096))

# ---- gemm_v7: warp-specialised, persistent, stream-K tail (cuda_wgmma_ws.py) ----------------------
# Arguments: the fast form plus its schedule and fix-up workspace (its own launcher builds them).
_WS_ARGS = (_U32_1D, _U32_1D, _U16_2D, types.int32[:, :, ::1], types.int32[::1], types.float32[::1],
            types.int32[::1], types.int64, types.int64, types.int64)   # x32, w32, out, units, counts, ws, flags, T, K, pairs
_V7 = cuda_wgmma_ws.VARIANTS["gemm_v7"]
_proj("gemm_v7", "gemm_v4's tiles and wgmma chain, warp-specialised: 2 loader warps (cp.async) and two MMA "
      "warpgroups hand 4 stages over on named barriers; persistent CTAs (one an SM) over a host-made schedule, the "
      "last full wave and the ragged one stream-K with an fp32 fix-up in a fixed order; bf16 stores from registers "
      "(166 registers, no spills; 2.4-2.5x cuBLAS on the H200, slower than gemm_v4: bench/results/"
      "h200_prefill_dev_v7_f52d7f1.*)",
      kernel=Factory(lambda T: cuda_wgmma_ws.kernel_for(_V7)), geometry=cuda_wgmma_ws.geometry(_V7), args="fast",
      specs=lambda: [Spec(f"[{_V7.name}]", cuda_wgmma_ws.kernel_for(_V7), _WS_ARGS)]
      + [Spec(f"[{v.name}]", cuda_wgmma_ws.kernel_for(v), _WS_ARGS,
              spill_free=v.name != cuda_wgmma_ws.SETMAXNREG_CANDIDATE) for v in cuda_wgmma_ws.CANDIDATES.values()],
      launcher=cuda_wgmma_ws.launcher, vector_io=False,
      # 3 simulated CTAs (cuda_wgmma_ws.SIM_CTAS)
      # 3 simulated CTAs (cuda_wgmma_ws.SIM_CTAS), ~2 s a k tile of a CTA: `schedule` itself is tested on
      # released and odd shapes without the simulator
      sim=[(33, 72, 9),             # one tile, 2 k tiles (the second a 1-chunk K tail) cut over 2 CTAs:
                                    # a partial and its finisher; rows past T, odd N (16-bit stores)
           (130, 72, 260)],         # 2 x 2 tiles, 2 k tiles, stream-K over 3 CTAs: one runs a partial, then
                                    # a whole tile (the stage ring carries on across units), the next a
                                    # whole tile, then the finisher; outputs past N, 32-bit pair stores
      sweep=(128, 256, 512, 1024, 4096))

# ---- gemm_v8: gemm_v4's CTA tile on persistent CTAs, stream-K tail (cuda_wgmma.py, "gemm_v8") --------
# Arguments as gemm_v7's less `pairs` (its epilogue is gemm_v4's, staged in shared memory).
_SK_ARGS = (_U32_1D, _U32_1D, _U16_2D, types.int32[:, :, ::1], types.int32[::1], types.float32[::1],
            types.int32[::1], types.int64, types.int64)   # x32, w32, out, units, counts, ws, flags, T, K
_V8 = cuda_wgmma.SK_VARIANTS["gemm_v8"]
_proj("gemm_v8", "gemm_v4's CTA tile, mainloop and epilogue (the same device functions) on persistent CTAs, one an "
      "SM, over a host-made unit list: whole waves of tiles data-parallel, the last full wave and the ragged one "
      "cut into equal k ranges (stream-K) with an fp32 fix-up through a workspace and per-slot flags, added in a "
      "fixed order (reproducible bits); the split chosen per shape from T, N, K and the SM count (choose_split), "
      "so T = 256 / 512 / 1024 run 1.52 / 3.03 / 6.06 waves of work in as much time instead of 2 / 4 / 7 waves; "
      "bands of CTAs (up to 8, one token tile each) walk the same units, so a weight tile is read by all at once; "
      "the next unit's first 3 stages issued before a unit's fix-up and epilogue (211 KiB of shared memory); "
      "253 registers, no spills, wgmma asynchronous, k loop 246 SASS instructions (gemm_v4 212). H200 (L2 "
      "flushed, bench/results/h200_prefill_dev_v8_9c531d5.txt): 146.8 / 205.8 / 257.9 / 373.5 / 494.0 / 976.3 / "
      "1971.0 us at T = 256 / 384 / 512 / 768 / 1024 / 2048 / 4096 against gemm_v4's 159.9 / 236.7 / 308.4 / "
      "386.7 / 534.0 / 992.0 / 1940.0 and cuBLAS's 120.8 / 168.4 / 219.3 / 327.8 / 411.5 / 820.2 / 1635.2 "
      "(1.14-1.22x cuBLAS: the tail is fixed, gemm_v4's per-tile mainloop is what is left)",
      when="never since gemm_v11 (its mainloop on TMA): pick it by name",
      kernel=Factory(lambda T: cuda_wgmma.sk_kernel_for(_V8.tile, _V8.overlap)), geometry=cuda_wgmma.sk_geometry(_V8),
      args="fast",
      specs=lambda: [Spec(f"[sk/{t.name}{'' if ov else '/nolap'}]", cuda_wgmma.sk_kernel_for(t, ov), _SK_ARGS)
                     for t, ov in ((_V8.tile, True), (_V8.tile, False), (cuda_wgmma.VARIANTS["gemm_v6"], True))],
      launcher=cuda_wgmma.sk_launcher, vector_io=False,
      # 3 simulated CTAs (cuda_wgmma_ws.SIM_CTAS); the schedules themselves are tested on many shapes
      # without the simulator (test_proj_wgmma_sk.py)
      sim=[(33, 328, 9),            # one tile, 6 k tiles (the last a 1-chunk K tail) cut over 3 CTAs: two
                                    # partials, the finisher adds both; rows past T, odd N
           (130, 136, 260)],        # 2 x 2 tiles, 3 k tiles each, stream-K over 3 CTAs: a whole tile then a
                                    # partial on one CTA (the ring carries on across units), a finisher then
                                    # a partial, a finisher then a whole tile; outputs past N
      sweep=(128, 256, 512, 1024, 4096))

# ---- gemm_v9: gemm_v8 on a leaner k loop (cuda_wgmma.py, "gemm_v9") ---------------------------------
# Arguments as gemm_v8's; picked by name only until the H200 says where it wins.
_V9 = cuda_wgmma.V9_VARIANTS["gemm_v9"]
_proj("gemm_v9", "gemm_v8 (persistent CTAs, stream-K tail, fix-up and epilogue unchanged) on a leaner k loop "
      "(`Variant.loop` \"lean\"): the wgmma descriptors made once a unit and stepped by constants, the stage ring "
      "as running offsets, gemm_v4's copies and two barriers a k tile (228 SASS instructions a warp a k tile, "
      "gemm_v8 246, gemm_v4 212 on its grid; 253 registers, no spills); gemm_v4's k order and wgmma chain, so "
      "gemm_v8's bits on the same schedule. Candidates (tools/prefill_dev.py --v9): \"lean1\" (one barrier a "
      "k tile, 2 tiles of copies in flight instead of 3) and \"mbar\" (no CTA barrier in the k loop: per-stage "
      "full/empty mbarriers, cp.async.mbarrier.arrive.noinc) on persistent CTAs, and the three loops on gemm_v4's "
      "grid (189 / 186 / 221 instructions, gemm_v4's bits)",
      kernel=Factory(lambda T: cuda_wgmma.sk_kernel_for(_V9.tile, _V9.overlap)), geometry=cuda_wgmma.sk_geometry(_V9),
      args="fast",
      specs=lambda: [Spec(f"[sk/{t.name}]", cuda_wgmma.sk_kernel_for(t, True), _SK_ARGS)
                     for t in cuda_wgmma.V9_TILES.values()]
      + [Spec(f"[{t.name}]", cuda_wgmma.kernel_for(t), FAST_ARGS) for t in cuda_wgmma.V9_TILES.values()],
      launcher=cuda_wgmma.sk_launcher, vector_io=False,
      # 3 simulated CTAs: one tile of 6 k tiles (the last a 1-chunk K tail) cut over 3 CTAs (two partials
      # and the finisher, each unit shorter than the ring); 2 x 2 tiles of 3 k tiles, stream-K (a CTA runs
      # a whole tile then a partial: the next unit's prologue during the epilogue)
      sim=[(33, 328, 9),
           (130, 136, 260)],
      sweep=(256, 512, 1024, 4096))

# ---- gemm_v10 / gemm_v11: the stages filled and the tile stored by TMA (cuda_wgmma.py, "TMA") ----------
# Arguments: x32 and w32 are the tensor maps of x and wkv (uint8 [128] device arrays, `tma_maps`);
# their launchers make them. Same k order and wgmma chain as gemm_v4 on the same bytes.
_TMA_ARGS = (_U8_1D, _U8_1D, _U16_2D, types.int64, types.int64)                    # map x, map w, out, T, K
_TMA_SK_ARGS = (_U8_1D, _U8_1D) + _SK_ARGS[2:]
_V10, _V10F = cuda_wgmma.TMA_VARIANTS["gemm_v10"], cuda_wgmma.TMA_FALLBACK["gemm_v10"]
_V11, _V11F = cuda_wgmma.TMA_VARIANTS["gemm_v11"], cuda_wgmma.TMA_FALLBACK["gemm_v11"]
_TMA_H200 = ("H200 (L2 flushed, bench/results/h200_prefill_dev_tma_b02b7e6.txt): gemm_v10 1687.7 us at T = 4096 "
             "(gemm_v4 1965.9, cuBLAS 1650.4: 1.02x; its TMA loop with gemm_v4's epilogue 1835.9), 83.5 / 84.7 / 84.8 us at "
             "T = 96 / 112 / 128 (gemm_v6 89.7 / 90.7 / 91.4, cuBLAS 81.9 / 82.7 / 80.1; "
             "h200_prefill_dev_tma_t80_4096_5ad1c6a.txt, h200_prefill_dev_tma_t128_192_bac3928.txt); gemm_v11 124.7 / "
             "217.1 / 416.3 / 831.6 us at T = 256 / 512 / 1024 / 2048 (gemm_v8 149.3 / 258.4 / 500.9 / 989.2, cuBLAS "
             "123.2 / 221.9 / 417.1 / 830.5: 1.01x / 0.98x / 1.00x / 1.00x; with gemm_v4's epilogue 142.3 / 241.0 / "
             "465.4 / 917.9)")
_TMA_EPILOGUE = ("the bf16 tile written by each thread into 128-byte-swizzled boxes of 64 columns, stored by 4 TMA "
                 "stores of thread 0 (gemm_v4's epilogue, 128 16-bit stores a thread, where N % 8 != 0 or the output "
                 "is not 16-byte aligned)")
_proj("gemm_v10", "gemm_v4's grid, tile, stages and wgmma chain with the stages filled by TMA: thread 0 issues one "
      "mbarrier.arrive.expect_tx and two box copies (x 128 x 64, w 256 x 64, 128-byte swizzled; rows past T and N "
      "and k past K read as zeros) a k tile, and the stages are handed over on full / empty mbarriers (no CTA "
      "barrier, no cp.async, no address arithmetic in the k loop); " + _TMA_EPILOGUE + "; tensor maps made by the "
      "driver on the host per launch; gemm_v4's bits. " + _TMA_H200,
      when=f"Hopper (cc 9.0), aligned, {WGMMA_SMALL_MAX_TOKENS} < T <= {WGMMA_MID_MAX_TOKENS}",
      rule=lambda c: _bf16(c) and _hopper(c) and WGMMA_SMALL_MAX_TOKENS < c["T"] <= WGMMA_MID_MAX_TOKENS,
      kernel=Factory(lambda T: cuda_wgmma.kernel_for(_V10)), geometry=cuda_wgmma.geometry(_V10), args="fast",
      specs=lambda: [Spec(f"[{v.name}]", cuda_wgmma.kernel_for(v), _TMA_ARGS) for v in (_V10, _V10F)],
      launcher=cuda_wgmma.grid_launcher, vector_io=False,
      sim=[(33, 264, 200),          # one tile: box rows past T and N zero-filled, K % 64 == 8 (the last box
                                    # 8 k wide), 5 k tiles through the 4-stage ring; TMA stores clipped
                                    # at T and N
           (130, 72, 260)],         # 2 x 2 tiles, 2 k tiles (fewer than the stages filled ahead); N % 8
                                    # == 4: gemm_v4's epilogue
      sweep=(128, 256, 512, 1024, 4096))
_proj("gemm_v11", "gemm_v8 (persistent CTAs, stream-K tail, bands, fix-up and epilogue unchanged) on gemm_v10's TMA "
      "k loop: each unit's prologue re-initialises the barriers and fills STAGES-1 stages by TMA before the last "
      "unit's epilogue, the k loop starts with a CTA barrier and a proxy fence (the stage the epilogue's tile shares is "
      "refilled after it, once thread 0's TMA stores of the last tile have read it); " + _TMA_EPILOGUE + "; gemm_v8's "
      "bits on the same schedule. " + _TMA_H200,
      when=f"Hopper (cc 9.0), aligned, {WGMMA_MID_MAX_TOKENS} < T <= {WGMMA_SK_MAX_TOKENS}",
      rule=lambda c: _bf16(c) and _hopper(c) and WGMMA_MID_MAX_TOKENS < c["T"] <= WGMMA_SK_MAX_TOKENS,
      kernel=Factory(lambda T: cuda_wgmma.sk_kernel_for(_V11.tile, _V11.overlap)),
      geometry=cuda_wgmma.sk_geometry(_V11), args="fast",
      specs=lambda: [Spec(f"[sk/{v.tile.name}]", cuda_wgmma.sk_kernel_for(v.tile, True), _TMA_SK_ARGS)
                     for v in (_V11, _V11F)],
      launcher=cuda_wgmma.sk_launcher, vector_io=False,
      # as gemm_v9's: one tile of 6 k tiles cut over 3 CTAs (two partials and the finisher); 2 x 2 tiles
      # of 3 k tiles, stream-K (a whole tile then a partial: the next unit's prologue during the epilogue)
      sim=[(33, 328, 9),            # N % 8 != 0: gemm_v4's epilogue
           (130, 136, 264)],        # the TMA epilogue, clipped at T and N
      sweep=(256, 512, 1024, 4096))

# ---- gemm_v12: the unit queue with a producer warp (cuda_wgmma.py, "The unit queue with a producer warp") ----
_TMA_Q_ARGS = (_U8_1D, _U8_1D, _U16_2D, types.int32[:, ::1], types.int32[::1], types.float32[::1], types.int32[::1],
               types.int64, types.int64)      # maps of x and out, map of wkv, out, queue, counters, ws, flags, T, K
_V12 = cuda_wgmma.QUEUE_VARIANTS["gemm_v12"]
_proj("gemm_v12", "gemm_v4's tile and wgmma chain on persistent CTAs of 288 threads: a producer warp (warp 8) takes "
      "whole tiles from a queue with an atomic counter, hands each to the two math warpgroups through a two-slot "
      "mbarrier ring and fills its k tiles by TMA into one 4-stage ring that runs on from tile to tile, so the next "
      "tile's stages land during an epilogue; the math warpgroups wait only on full barriers; the epilogue through "
      "its own 32 KiB buffer, two rounds of two 64-column TMA boxes (gemm_v10's fallback, gemm_v4's epilogue on the "
      "grid, where N % 8 != 0 or the output is not 16-byte aligned); gemm_v4's bits. H200 (L2 flushed, "
      "bench/results/h200_prefill_dev_pw_d1063c4.txt, h200_prefill_dev_pw_9bc593c.txt): T = 4096 1623.3 / 1666.7 us "
      "against gemm_v10's 1639.4 / 1683.9 and cuBLAS's 1607.3 / 1657.3 (1.01x); T = 3072 1249.8 against 1257.5 and "
      "1243.7; T = 2048 846.2 against gemm_v11's 834.7. From fc96f9d the queue deals the tiles in bands of 12 token "
      "tiles, each band sweeping every output tile (same bits): T = 4096 1614.9 / 1612.5 against cuBLAS's 1615.4 / "
      "1616.9 and the first order's 1633.2 / 1632.5 (bench/results/h200_prefill_dev_bands_2b31e6e.txt)",
      when=f"Hopper (cc 9.0), aligned, T > {WGMMA_SK_MAX_TOKENS}",
      rule=lambda c: _bf16(c) and _hopper(c) and c["T"] > WGMMA_SK_MAX_TOKENS,
      kernel=Factory(lambda T: cuda_wgmma.queue_kernel_for(_V12.tile)), geometry=cuda_wgmma.queue_geometry(_V12),
      args="fast",
      specs=lambda: [Spec(f"[{_V12.name}]", cuda_wgmma.queue_kernel_for(_V12.tile), _TMA_Q_ARGS),
                     Spec(f"[{_V10F.name}]", cuda_wgmma.kernel_for(_V10F), _TMA_ARGS)],
      launcher=cuda_wgmma.queue_launcher, vector_io=False,
      sim=[(130, 328, 264),         # 2 x 2 tiles of 6 k tiles through the 4-stage ring on one CTA (the
                                    # simulator runs CTAs in turn): the ring and both unit slots wrap;
                                    # stores clipped at T and N
           (33, 72, 260)],          # N % 8 == 4: gemm_v10's fallback
      sweep=(3072, 4096))

# cuBLAS: the comparison backend; nothing of ours to compile, no simulator (it needs a GPU)
_proj("cublas_v1", "cuBLAS through torch.matmul on the device arrays (no copies), fp32 accumulation: the comparison "
      "backend, never a default", kernel=None, geometry=None, args="external", specs=(), launcher=cublas.launcher,
      requires="torch", simulate=False, sweep=(1, 16, 128, 4096))


# ---- weights read in their file encoding (q2k, fp8): one weight pass per 8 tokens ----------------

QUANT_SWEEP = (1, 4, 8)
_Q2K_FAST_ARGS = FAST_ARGS                                                          # x32, w32 (the blocks), out, T, K
_FP8_NAIVE_ARGS = (_U16_2D, _U8_2D, _U8_2D, _U16_2D)                                # x, codes, scales, out
_FP8_FAST_ARGS = (_U32_1D, _U32_1D, _U8_2D, _U16_2D, types.int64, types.int64)      # x32, w32, scales, out, T, K

_proj("gemv_q2k_v1", "naive: one thread per output column, each weight decoded as the reference decodes it and rounded "
      "to bf16, k in order (bit-exact with the bf16-weight projection)",
      kernel=cuda_gemv_q2k._gemv_q2k_v1, geometry=cuda_gemv_q2k.geometry_naive, args="naive",
      specs=(Spec("", cuda_gemv_q2k._gemv_q2k_v1, (_U16_2D, _U8_2D, _U16_2D)),), exact=True, encoding="q2k",
      when="q2k weights, numba's simulator or unaligned data", rule=lambda c: c["weight"] == "q2k" and _naive(c),
      sim=[(1, 256, 5), (3, 512, 33), (9, 256, 4)],       # T past one group of 8 tokens
      sweep=QUANT_SWEEP)
# the tensor-core versions run 256 threads and a simulated mma per 16 values: a few seconds a case;
# (1, 6400, 16): K/256 = 25 blocks, more than 8 warps x 3 load in one trip
_proj("gemv_q2k_v2", "tensor cores on weights decoded in registers: a byte_perm table of each sub-block's 4 "
      "bf16-rounded values feeds mma.m16n8k16 with x's 8 tokens as N, 16 rows a block, K split over 8 warps (51.6 MB "
      "a pass)",
      kernel=cuda_gemv_q2k._gemv_q2k_v2, geometry=cuda_gemv_q2k.geometry_tc, args="fast", align=4,
      specs=(Spec("", cuda_gemv_q2k._gemv_q2k_v2, _Q2K_FAST_ARGS),), encoding="q2k",
      when="q2k weights, GPU, aligned", rule=lambda c: c["weight"] == "q2k" and _fast(c),
      sim=[(1, 256, 16),            # one block, 7 warps with no blocks
           (3, 512, 20),            # 2 row tiles, rows past N clamped
           (9, 256, 5),             # 2 token groups, N < one tile
           (1, 6400, 16)],          # more K blocks than one trip of the warps
      sweep=QUANT_SWEEP)
_proj("gemv_q2k_v3", "v2 factored on exact weights: A = sc*q (exact in bf16), d scales a block's mma chain, the min "
      "term dmin*m*sum(x) as 3 more mma on exact bf16 parts of the sub-block sums of x",
      kernel=cuda_gemv_q2k._gemv_q2k_v3, geometry=cuda_gemv_q2k.geometry_tc, args="fast", align=4,
      specs=(Spec("", cuda_gemv_q2k._gemv_q2k_v3, _Q2K_FAST_ARGS),), encoding="q2k",
      sim=[(1, 256, 16), (5, 512, 20)], sweep=QUANT_SWEEP)
_proj("gemv_fp8_v1", "naive: one thread per output column, e4m3 x e8m0 weights decoded exactly in fp32, k in order "
      "(bit-exact with the bf16-weight projection)",
      kernel=cuda_gemv_fp8._gemv_fp8_v1, geometry=cuda_gemv_fp8.geometry_naive, args="naive",
      specs=(Spec("", cuda_gemv_fp8._gemv_fp8_v1, _FP8_NAIVE_ARGS),
             # the engine's many-token path decodes the whole wkv to bf16 with this kernel
             Spec("[wkv_dequant]", cuda_gemv_fp8.dequant_kernel, (_U32_1D, _U8_2D, _U32_1D, types.int64),
                  spill_free=True)),
      exact=True, encoding="fp8",
      when="fp8 weights, numba's simulator or unaligned data", rule=lambda c: c["weight"] == "fp8" and _naive(c),
      sim=[(1, 32, 5), (3, 96, 40), (9, 64, 3)],          # N % 32: a partial scale-tile row
      sweep=QUANT_SWEEP)
# (2, 2080, 16): K/32 = 65 tiles, more than 8 warps x 8 load in one trip
_proj("gemv_fp8_v2", "tensor cores: cvt.rn.f16x2.e4m3x2 codes (exact) as A, x's 8 tokens as N, each 32x32 tile's sum "
      "scaled once by its power-of-two scale (157 MB a pass)",
      kernel=cuda_gemv_fp8._gemv_fp8_v2, geometry=cuda_gemv_fp8.geometry_tc, args="fast", align=8,
      specs=(Spec("", cuda_gemv_fp8._gemv_fp8_v2, _FP8_FAST_ARGS),), encoding="fp8",
      when=f"fp8 weights, GPU, aligned, T > {FP8_FEW_MAX_TOKENS}",
      rule=lambda c: c["weight"] == "fp8" and _fast(c) and not _fp8_few(c),
      sim=[(1, 64, 16), (5, 96, 33), (9, 32, 8), (2, 2080, 16)], sweep=QUANT_SWEEP)
# v3's cases: K % 64 = 32 (a last step of one scale tile), N past a block's 32 rows (rows past N), two
# token groups, and more steps a warp than its ring holds (K = 544: 9 steps, runs of 5 and 4 > 4 slots:
# the second warp's run one step short)
_proj("gemv_fp8_v3", "v2's numerics (exact e4m3 x e8m0 weights, each 32x32 tile's fp32 mma sum scaled once by its "
      "power of two) with x as the mma's A and the codes as B: a lane's codes for 4 mma are one 16-byte chunk of "
      "its row (lanes 0-1 one scale tile, 2-3 the next, kept apart by A's two row halves), streamed through 4 "
      "cp.async slots a warp (3 in flight, 6 KB); a block owns 32 rows x 8 tokens, its 2 warps halves of K added "
      "in order at the end: one wave at the released shape (800 blocks); 102 registers, no spills, 313 SASS "
      "instructions a 64-wide step of 32 rows (0.153 a weight; v2 0.150). H200: 74.8 us at T = 1 against v2's "
      "65.5 (12 warps an SM, 50% of DRAM throughput against v2's 23 and 61%: too few bytes in flight), so "
      "picked by name only",
      kernel=cuda_gemv_fp8._gemv_fp8_v3, geometry=cuda_gemv_fp8.geometry_v3, args="fast", align=16,
      specs=(Spec("", cuda_gemv_fp8._gemv_fp8_v3, _FP8_FAST_ARGS),), encoding="fp8",
      sim=[(1, 96, 20), (3, 192, 40), (8, 64, 16), (9, 128, 20), (1, 544, 33)], sweep=QUANT_SWEEP)
# v4's cases (3 simulated blocks): N = 20 (3 groups: a block each, the last group 4 rows past N),
# N = 72 (9 groups: a block's 3 groups straddle two scale-tile rows: partial first and last chunks),
# K % 64 = 32 (a last step of one tile), two token groups, and more steps a warp than one (K = 1056:
# 17 steps over 16 warps, 2 a warp, the last warp's second step past K)
_proj("gemv_fp8_v4", "v3's fragments and numerics (x as A, a lane's 16 contiguous codes as B for 4 mma, each 32x32 "
      "tile's fp32 mma sum scaled once by its power of two) in a persistent grid: one block of 16 warps an SM, "
      "each block an equal run of 8-row groups (24 or 25 at the released shape: no partial wave), walked a "
      "scale-tile row at a time, every warp a 1/16 of K of it; the codes by 16-byte ld.global.nc.L1::no_allocate "
      "straight into registers two steps ahead (4 KB a warp, 64 KB an SM in flight), x from L1; the warps' sums "
      "added in warp order through shared memory once a chunk. Compile tier: 119 registers, no spills, 309 SASS "
      "instructions a 64-wide step of 32 rows (0.151 a weight; v3 0.153). H200 (L2 flushed, "
      "bench/results/h200_fp8_gemv_dev_9c531d5.txt): 73.5 / 73.8 / 73.7 us at T = 1 / 4 / 8 against v2's 56.8 / "
      "57.8 / 60.2 and v3's 66.2: slower; no variant (3 steps ahead, L2 prefetch hint, 8 or 12 warps, empty groups "
      "skipped) under 73.6. As many instructions a weight as v2 and half its warps' issue: bound by issue, not by "
      "bytes in flight. Picked by name",
      kernel=cuda_gemv_fp8._gemv_fp8_v4, geometry=cuda_gemv_fp8.geometry_v4, args="fast", align=16,
      specs=(Spec("", cuda_gemv_fp8._gemv_fp8_v4, _FP8_FAST_ARGS),), encoding="fp8",
      sim=[(1, 96, 20), (3, 192, 72), (8, 64, 16), (9, 128, 20), (1, 1056, 33)], sweep=QUANT_SWEEP)
# v5 is v2 on f16 operands, after x_f16_kernel: v2's cases plus K = 32 (one tile, 7 warps idle) and
# T = 8 (one full token group); test_proj_quant.py also holds it bit-identical to v2
_FP8_V5_ARGS = (_U32_1D, _U32_1D, _U8_2D, types.int32[::1], _U16_2D, types.int64, types.int64)   # h32, w64, scales, xs, out, T, K
_proj("gemv_fp8_v5", "v2's grid, loads, k partition, tile sums and warp order on fp16 operands: the codes need one "
      "cvt.rn.f16x2.e4m3x2 a pair (exact, normal f16; v2 also widens to fp32 and packs to bf16: 8 instructions a "
      "code word against 2), x a power-of-two-scaled f16 copy made once a call by x_f16_kernel (one block a token: "
      "2^15 <= max|x| 2^s < 2^16, exact for all values over ~2^-32 of the token's largest), 2^-s applied to the "
      "block sums before rounding: bit-identical to v2 where no fp32 sum overflows or goes subnormal and the "
      "tensor core sums f16 products as it sums bf16 ones (two launches a call). A trip wholly inside K runs "
      "unchecked (at 6 tiles a trip: 179 SASS instructions a warp (0.058 a weight; v2 0.150, of which 256 of 616 convert), 80 "
      "registers, no spills, tools/sass_count_fp8.py); registered with 4 tiles a trip (V5_UNROLL), the fastest "
      "of the H200's variants: T = 1 / 4 / 8 52.7 / 53.0 / 57.5 us against v2's 56.7 / 57.6 / 60.1 in the same "
      "run (70.3% of the copy floor at T = 1; 6 tiles: 57.6 / 59.4 / 63.2), every output v2's bits "
      "(bench/results/h200_fp8_gemv_dev_fec6e6c.json); main bench at cb93a1b: 52.8 / 54.4 / 56.3 us against v2's "
      "58.1 / 58.9 / 60.8. Each tile's sum gets its token's 2^-s before the tile scale (applied to the block sums "
      "at first, the scaled tile sums overflowed at 2^119 tiles with x ~ 2^-24); so fixed, on the H200: 52.9 / "
      "55.1 / 60.1 us against v2's 56.9 / 58.2 / 60.5 (70.1% of the floor at T = 1), v2's bits at the released and "
      "odd shapes, wide-range x and the edge codes (bench/results/h200_fp8_gemv_dev_v5fix.txt). The default for "
      "1..8 tokens on a GPU",
      kernel=cuda_gemv_fp8._gemv_fp8_v5, geometry=cuda_gemv_fp8.geometry_tc, args="fast", align=8,
      specs=(Spec("", cuda_gemv_fp8._gemv_fp8_v5, _FP8_V5_ARGS),
             Spec("[x_f16]", cuda_gemv_fp8.x_f16_kernel, (_U32_1D, _U32_1D, types.int32[::1], types.int64),
                  spill_free=True)),
      encoding="fp8", launcher=cuda_gemv_fp8.launcher_v5,
      when=f"fp8 weights, GPU, aligned, T <= {FP8_FEW_MAX_TOKENS}", rule=_fp8_few,
      sim=[(1, 64, 16), (3, 96, 33), (8, 32, 8), (9, 32, 8), (2, 2080, 16)], sweep=QUANT_SWEEP)
# v6 is v5 in one launch on a grid of resident blocks (3 simulated: SIM_V4_BLOCKS); its cases: one group
# (one block, teams 1 and 2 idle), 3 groups over 3 blocks with rows past N and tokens past T, 7 groups
# over 3 blocks (3, 2, 2) and two token groups, more tiles than a trip (K = 2080); test_gemv_fp8_v6.py
# holds it to v5 bit for bit
_FP8_V6_ARGS = _FP8_FAST_ARGS                                                        # x32, w64, scales, out, T, K
_proj("gemv_fp8_v6", "v5's arithmetic (shifts, f16 operands, v2's k partition, tile order and warp order: v5's bits, "
      "hence v2's) in one launch: each block copies its token group's x to f16 x 2^s in shared memory (two "
      "passes over x, maxima reduced in shared memory) while its first trip of codes loads, then its teams of 8 "
      "warps (each one v5 block, a named barrier a team) work an even share of the 16-row groups; the grid is "
      "at most the blocks the SMs hold at once (registered: 3 teams, one 768-thread block an SM, 12 or 13 "
      "groups a block at the released shape), so no partial wave and one x copy a block. Compile tier: 80 "
      "registers, no spills, 169 SASS instructions a 4-tile trip (v5 130: 12 R2UR re-stage the global-memory "
      "descriptor before the code loads, which ptxas does only once the copy of x has global loads; "
      "tools/sass_count_fp8.py). Variants (teams, unroll, blocks an SM, L2 prefetch) timed by "
      "tools/fp8_gemv_dev.py. H200, L2 flushed: 59.5 / 63.5 / 67.5 us at T = 1 / 4 / 8 against v5's 53.0 / 55.4 / "
      "60.6 (v5's x_f16 launch 5.0 us of that, its GEMV 50.5), every variant 59-83 us, every output v2's bits "
      "(bench/results/h200_fp8_gemv_dev_v6_ecbad0d.txt): one 768-thread block an SM issues too few code loads "
      "ahead and its trips cost 169 instructions, so v5 stays the default",
      kernel=cuda_gemv_fp8._gemv_fp8_v6, geometry=cuda_gemv_fp8.geometry_v6, args="fast", align=8,
      specs=(Spec("", cuda_gemv_fp8._gemv_fp8_v6, _FP8_V6_ARGS),), encoding="fp8",
      launcher=cuda_gemv_fp8.launcher_v6,
      sim=[(1, 64, 16), (3, 96, 40), (9, 32, 100), (2, 2080, 16)], sweep=QUANT_SWEEP)

# q2k_r: the same Q2_K weight re-laid out on the device at build (q2k_r.py). Every simulated block
# runs a whole unit trip of simulated mma (~12 s a block): K = 768 is an odd block count (a zero pad
# block), N = 13 rows past N in the tile.
_Q2KR_PAIR_ARGS = (_U32_1D, _U32_1D, _U32_1D, _U16_2D, _U16_2D, types.int64, types.int64)   # xa, xb, w, outa, outb, T, K


def _q2kr_specs(name, kernel, pair_kernel, build=False):
    specs = [Spec("", kernel, _Q2K_FAST_ARGS), Spec("[pair]", pair_kernel, _Q2KR_PAIR_ARGS)]
    if build:      # the repack and decode kernels of the engine's build (one record owns them)
        specs += [Spec("[repack]", cuda_gemv_q2kr.repack_kernel, (_U32_1D, _U32_1D, types.int64, types.int64, types.int64)),
                  Spec("[decode]", cuda_gemv_q2kr.decode_kernel, (_U32_1D, _U32_1D, types.int64, types.int64, types.int64))]
    return tuple(specs)


for _name, _log, _when, _rule, _sim in (
    ("gemv_q2k_v4",
     "v2's math on q2k_r, the Q2_K weight re-laid out at load (same bytes): six 16-byte loads a lane per "
     "16 rows x 512 k, each warp's loads for its whole K share issued into registers before any decode, "
     "6 warps a block (160 registers: 2 blocks an SM); 45.7 / 46.2 / 46.2 us at T = 1 / 4 / 8, L2 cold (v2: 58.9)",
     "q2k_r weights (on a GPU the engine holds a Q2_K wkv as q2k_r), but gemv_q2k_v12 at 1..8 tokens on a GPU",
     lambda c: c["weight"] == "q2k_r" and not _few_default(c),
     [(1, 768, 13)]),
    ("gemv_q2k_v5",
     "v4 with 12 warps a block, each loading one unit (24 words a lane): 79 registers, 24 warps an SM "
     "(47.5 / 47.8 / 48.7 us at T = 1 / 4 / 8)", "never (pick it by name)", None,
     [(2, 512, 5)]),
    ("gemv_q2k_v6",
     "v4 with the loads landing in shared memory by cp.async (each lane copies what it reads, one commit "
     "group a unit, waits only for the unit it decodes): 4 warps x 3 units in flight, 80 registers, 5 blocks "
     "an SM (47.3 / 46.6 / 48.0 us at T = 1 / 4 / 8)", "never (pick it by name)", None,
     [(3, 768, 13),
      (1, 6656, 13)]),          # 13 units > 4 warps x 3: two trips, warps with no units
    ("gemv_q2k_v7",
     "v4 (same stream, same values, same summation order: bit-identical kv) with a third of its integer "
     "instructions: table kept as cvt.rn.bf16x2's pair words, raw prmt, the second selector by mul.hi, "
     "y0/y2 as fma, warp-uniform skips instead of zero-filled loads (1382 SASS instructions a 4-block "
     "trip against v4's 1916, integer-pipe ones 521 against 1178; 143 registers), and no faster: "
     "46.7 / 47.3 / 48.9 us at T = 1 / 4 / 8 against v4's 45.6 / 46.4 / 45.7 in the same run, L2 cold "
     "(bench/results/h200_decode_dev_b26720f.json): v4 is not bound by its instruction count",
     "never (pick it by name)", None,
     [(1, 768, 13),
      (9, 1536, 5)]),           # 2 token groups, 3 units over 6 warps: warps with no unit
):
    _proj(_name, _log, kernel=cuda_gemv_q2kr.KERNELS[_name], geometry=cuda_gemv_q2kr.geometry(_name), args="fast",
          specs=_q2kr_specs(_name, cuda_gemv_q2kr.KERNELS[_name], cuda_gemv_q2kr.PAIR_KERNELS[_name],
                            build=_name == "gemv_q2k_v4"),
          encoding="q2k_r", when=_when, rule=_rule, sim=_sim, sweep=QUANT_SWEEP, vector_io=True)


# gemv_q2k_v8: persistent blocks and a cp.async ring a warp (cuda_gemv_q2kr.py, "gemv_q2k_v8"). Its
# simulator cases run a persistent grid of 2 blocks, so a block takes several items.
_proj("gemv_q2k_v8",
      "v4's K shares and summation order (bit-identical kv) on a persistent grid (up to SMs x 16 one-warp "
      "blocks, each summing an item's 6 shares in registers; the two-layer launch one pool of both layers' "
      "items), each warp streaming its units through 3 shared-memory slots by cp.async (2 in flight while it "
      "decodes one, across item boundaries), v7's decode from shared memory: 123 registers, no spills, ~765 "
      "SASS instructions a unit (v7: 691); the two-layer launch its own shape (2 slots, 25 blocks an SM, 72 "
      "registers). H200, L2 cold: 44.4 / 46.2 / 47.2 us at T = 1 / 4 / 8 (v4 45.5 / 45.8 / 46.4), both "
      "layers at T = 1 71.7 us (v4 82.4); issue-bound, not memory-bound: 27% of DRAM throughput, 11.6 warps "
      "an SM, an instruction every 5.9 cycles a warp (bench/results/h200_ncu_gemv_q2kr_v8_f52d7f1.txt)",
      kernel=cuda_gemv_q2kr.KERNELS["gemv_q2k_v8"], geometry=cuda_gemv_q2kr.geometry("gemv_q2k_v8"), args="fast",
      specs=_q2kr_specs("gemv_q2k_v8", cuda_gemv_q2kr.KERNELS["gemv_q2k_v8"],
                        cuda_gemv_q2kr.PAIR_KERNELS["gemv_q2k_v8"]),
      encoding="q2k_r", sim=[(1, 768, 13),      # one item: a pad block, rows past N, shares with no unit
                             (9, 256, 20)],     # 2 tiles x 2 token groups over 2 blocks: the ring across items
      sweep=QUANT_SWEEP, vector_io=True)


# gemv_q2k_v9: one item a block of 2 warps, a static cp.async ring a warp (cuda_gemv_q2kr.py,
# "gemv_q2k_v9"). The default at T = 1 on a GPU until gemv_q2k_v12 (module doc); picked by name now.
_proj("gemv_q2k_v9",
      "v4's K shares and summation order (bit-identical kv) on blocks of 2 warps, one item (16-row tile, "
      "8-token group, layer) a block, 3 shares a warp streamed through 2 shared-memory slots by cp.async "
      "(a fixed unit list: no cursor across items), warp 1's fragments added by warp 0 after one barrier, "
      "v7's decode with y3 as one fma; launch bounds for 14 blocks (28 warps) an SM: 72 registers, no spills; "
      "the two-layer launch its own shape (3 slots, 10 blocks an SM). H200, L2 cold: 41.3 / 46.1 / 47.2 us "
      "at T = 1 / 4 / 8 (v8 44.4 / 46.4 / 46.9), both layers at T = 1 68.6 us (v8 72.2); 21.8 warps an SM but "
      "~2 instructions a cycle an SM as v8, ALU pipe 42%, FMA pipe 31%, issue slots 52% busy: dependency-bound, "
      "not occupancy- or pipe-bound (bench/results/h200_ncu_gemv_pipes_dca93e4.txt)",
      when="never (pick it by name; the T = 1 default before gemv_q2k_v12)", rule=None,
      kernel=cuda_gemv_q2kr.KERNELS["gemv_q2k_v9"], geometry=cuda_gemv_q2kr.geometry("gemv_q2k_v9"), args="fast",
      specs=_q2kr_specs("gemv_q2k_v9", cuda_gemv_q2kr.KERNELS["gemv_q2k_v9"],
                        cuda_gemv_q2kr.PAIR_KERNELS["gemv_q2k_v9"]),
      encoding="q2k_r", sim=[(1, 512, 5),      # one unit: warp 1 has none, rows past N
                             (9, 768, 20)],    # a pad block, 2 tiles x 2 token groups, tokens past T
      sweep=QUANT_SWEEP, vector_io=True)

# gemv_q2k_v10: v9 with the two mma chains interleaved mma by mma (cuda_gemv_q2kr.py, "gemv_q2k_v10").
# The default for 2..8 tokens on a GPU until gemv_q2k_v12 (module doc); picked by name now.
_proj("gemv_q2k_v10",
      "v9's blocks, K shares and summation order (bit-identical kv to v4) with sub-blocks decoded in pairs "
      "(the four tables and both x rows of sub-blocks j, j+1 first, then their mma alternating between the c "
      "and e chains), the cp.async ring's next copy issued before the decode into the slot the previous unit "
      "freed (the same units in flight, half the one-round grid's start burst) and split in two commit groups "
      "(a warp decodes its first block once its 2 KB have landed), the share fragments as one 16-byte shared "
      "access a lane (v9: 4-way bank conflicts); 72 registers, no spills, 14 blocks (28 warps) an SM, 764 SASS "
      "instructions a unit (v9: 764); the two-layer launch its own shape (3 slots, 10 blocks an SM, 95 "
      "registers). H200, L2 flushed (read): 38.9 us at T = 1 against v9's 39.2 and v4's 45.5, both layers 65.7 against "
      "66.1; T = 4 / 8 40.2 / 41.2 (v4 45.8 / 45.9); no switch alone or combined moves it by more than 1 us "
      "(38.3-39.1, tools/q2kr_v10_variants.py): the chains' interleaving is not what holds v9 back. The main "
      "bench at efdb45b: 38.6 / 39.9 / 40.8 us at T = 1 / 4 / 8 against v9's 38.7 / 41.9 / 43.7 and v4's 45.6 / "
      "46.1 / 45.7",
      when="never (pick it by name; the 2..8-token default before gemv_q2k_v12)", rule=None,
      kernel=cuda_gemv_q2kr.KERNELS["gemv_q2k_v10"], geometry=cuda_gemv_q2kr.geometry("gemv_q2k_v10"),
      args="fast",
      specs=_q2kr_specs("gemv_q2k_v10", cuda_gemv_q2kr.KERNELS["gemv_q2k_v10"],
                        cuda_gemv_q2kr.PAIR_KERNELS["gemv_q2k_v10"]),
      encoding="q2k_r", sim=[(1, 512, 5),      # one unit: warp 1 has none, rows past N
                             (9, 768, 20)],    # a pad block, 2 tiles x 2 token groups, tokens past T
      sweep=QUANT_SWEEP, vector_io=True)

# gemv_q2k_v11: v10 with v11's table decode and shared d/dmin copy (cuda_gemv_q2kr.py, "gemv_q2k_v11"). Picked by name until
# the H200 has timed it (tools/gpu_dev_q2kr_v11.sh).
_proj("gemv_q2k_v11",
      "v10's blocks, ring, K shares and summation order (bit-identical kv to v4) with each sub-block table "
      "built in 10 instructions instead of 12 (a scale nibble's float 2^23 + sc times d minus d*2^23 in one fma "
      "is d*sc exactly, likewise -dmin*m: the FADDs that took 2^23 away and the FMULs go) and each unit's "
      "d/dmin plane copied once by lanes 0..7, read by each g's 4 lanes after a warp barrier (v10: every lane "
      "copies its g's chunk, most of its excess shared wavefronts); 72 registers, no spills, 746 SASS "
      "instructions a unit (v10: 764); the two-layer launch v10's pair shape (3 slots, 10 blocks an SM, 96 "
      "registers). Not yet timed on the H200 (tools/gpu_dev_q2kr_v11.sh)",
      when="never (pick it by name)", rule=None,
      kernel=cuda_gemv_q2kr.KERNELS["gemv_q2k_v11"], geometry=cuda_gemv_q2kr.geometry("gemv_q2k_v11"),
      args="fast",
      specs=_q2kr_specs("gemv_q2k_v11", cuda_gemv_q2kr.KERNELS["gemv_q2k_v11"],
                        cuda_gemv_q2kr.PAIR_KERNELS["gemv_q2k_v11"]),
      encoding="q2k_r", sim=[(1, 512, 5),      # one unit: warp 1 has none, rows past N
                             (9, 768, 20)],    # a pad block, 2 tiles x 2 token groups, tokens past T
      sweep=QUANT_SWEEP, vector_io=True)

# gemv_q2k_v12: v11 with one fma fewer a table and branch-free ring copies (cuda_gemv_q2kr.py,
# "gemv_q2k_v12"). The default for 1..8 tokens on a GPU (module doc; VERSION=v12 tools/gpu_dev_q2kr_variants.sh).
_proj("gemv_q2k_v12",
      "v11's blocks, ring, K shares and summation order (bit-identical kv to v4) with table entry 0 taken as "
      "-dmin*m itself (v11's fma(0, d*sc, -dmin*m) is always that value: the sum is never -0) and the ring's "
      "copies without a branch (a copy past the warp's units, or of the d/dmin plane by a lane past 7, is a "
      "zero-filling cp.async into the lane's own slot): 714 SASS instructions a unit (v11: 746), 72 registers, "
      "no spills; the two-layer launch v11's pair shape. The prmt selectors stay v11's: no re-layout of the "
      "quant plane makes them cheaper in this instruction set (the section's comment). H200, L2 flushed: 37.6 us "
      "at T = 1 (v11 38.4, v9 39.3, v4 45.6), both layers 64.4 (v9 66.0), T = 4 / 8 39.2 / 40.0 (v11 40.6 / "
      "41.6), every output v4's bits at the released and three odd shapes "
      "(bench/results/h200_q2kr_v12_variants_ecbad0d.txt)",
      when=f"q2k_r weights, 1 <= T <= {Q2KR_FEW_MAX_TOKENS}, on a GPU", rule=_few_default,
      kernel=cuda_gemv_q2kr.KERNELS["gemv_q2k_v12"], geometry=cuda_gemv_q2kr.geometry("gemv_q2k_v12"),
      args="fast",
      specs=_q2kr_specs("gemv_q2k_v12", cuda_gemv_q2kr.KERNELS["gemv_q2k_v12"],
                        cuda_gemv_q2kr.PAIR_KERNELS["gemv_q2k_v12"]),
      encoding="q2k_r", sim=[(1, 512, 5),      # one unit: warp 1 has none, rows past N
                             (9, 768, 20)],    # a pad block, 2 tiles x 2 token groups, tokens past T
      sweep=QUANT_SWEEP, vector_io=True)

# ---- DeepSeek's FP8 arithmetic on Hopper's FP8 tensor cores (cuda_fp8_wgmma.py) ---------------------
# An FP8 wkv read as it is stored, with DeepSeek's arithmetic (`reference.projection_deepseek_fp8`),
# not the bf16 projection of the exact weights the other fp8 records compute: picked by name
# (`prepare_project_q(..., weight="fp8", version="gemm_fp8_v3")`, `EngramV41(versions={"proj": ...})`).
# In the simulator bit-identical to `cpu.projection_deepseek_fp8_cpu`; on the GPU within the bound
# docs/numerics.md states (the tensor core's order inside a k32 step is unspecified).

DEEPSEEK_FP8_VERSIONS = ("gemm_fp8_v1", "gemm_fp8_v2", "gemm_fp8_v3", "gemm_fp8_v4", "gemm_fp8_v5", "gemm_fp8_v6",
                         "gemm_fp8_v7", "gemm_fp8_v8")
_F32_3D = types.float32[:, :, ::1]
_FP8_GEMM_ARGS = (_U32_1D, _U32_1D, _U32_1D, _U32_1D, _U16_2D, types.int64, types.int64)   # xq32, w32, sx32, sw32, out, T, K
_FP8_GEMM_NAIVE_ARGS = (_U8_2D, _U8_2D, _F32_3D, _F32_3D, _U16_2D)                           # xq, codes, sx, sw, out
_FP8_TMA_ARGS = (_U8_1D, _U8_1D, _U8_1D, _U8_1D, _U16_2D, types.int64, types.int64)   # maps x, w, sx, sw; out, T, K


def _fp8_gemm_specs(name):
    main = (_FP8_GEMM_NAIVE_ARGS if name == "gemm_fp8_v1" else _FP8_TMA_ARGS if name == "gemm_fp8_v8"
            else _FP8_GEMM_ARGS)
    return (Spec("", cuda_fp8_wgmma.KERNELS[name], main),
            Spec("[act_quant]", cuda_fp8_wgmma.act_quant_kernel, (_U32_1D, _U32_1D, _F32_3D, types.int64, types.int64),
                 spill_free=True, vector_io=True),
            Spec("[e8m0_table]", cuda_fp8_wgmma.e8m0_table_kernel, (_U8_2D, _F32_3D), spill_free=True))


for _name, _log, _sim in (
    ("gemm_fp8_v1",
     "naive: act_quant kernel (e4m3 codes + power-of-two scales per 32 values, bit-identical to the CPU twin), then "
     "one thread per output (t, n) summing each K block of 32 in k order and promoting it: bit-identical to "
     "projection_deepseek_fp8_cpu (in the simulator; by construction on the GPU)",
     [(3, 160, 40),             # a partial scale tile (N % 32), K % 128 == 32
      (17, 288, 70)]),
    ("gemm_fp8_v2",
     "DeepSeek's FP8 arithmetic on the FP8 tensor cores: wgmma m64n128k32 e4m3 on 128x128 tiles (5 cp.async stages of "
     "128B-swizzled operands, the stage's scales alongside), each K block of 32 summed in a fresh fp32 tile and "
     "promoted: acc += partial * s_x * s_w (3.44 ms at T=4096 on the H200, 0.53x gemm_v4)",
     [(3, 160, 40),             # one tile: rows past T and N, a partial scale tile (N % 32), 2 k tiles, the
                                # second with one k block (K % 128 == 32: zero-filled tail, scales 0)
      (17, 288, 136)]),         # 2 output tiles (the second 8 wide), 3 k tiles
    ("gemm_fp8_v3",
     "gemm_fp8_v2 with two partial tiles: block kb+1's MMA runs while block kb is promoted (wait_group 1; 3.02 ms "
     "= 426 TFLOP/s at T=4096, 0.60x gemm_v4; 136 us at T=128)",
     [(3, 160, 40),
      (130, 736, 72)]),         # 2 token tiles (2 rows in the second), 6 k tiles: the 5-stage ring wraps
    ("gemm_fp8_v4",
     "the 128x128 tile over 4 math warpgroups (m64n64k32 e4m3, two partial tiles each: 4 warps a scheduler to hide "
     "the per-block promotion), k tiles loaded in pairs (8 blocks between one barrier and one drain, v3: 4 and two), "
     "6 tile slots; 128 registers, no spills; same arithmetic as v1..v3 (3.74 ms at T=4096 on the H200: slower than v3)",
     [(3, 160, 40),             # one tile: rows past T and N (warpgroups on zero-filled rows or past N),
                                # one pair whose second k tile has one k block
      (70, 800, 136)]),         # 2 output tiles (the second 8 wide), 7 k tiles: 4 pairs through the 3-pair
                                # ring (it wraps), the last pair's second tile past K (zero scales)
    ("gemm_fp8_v5",
     "gemm_fp8_v3's schedule and arithmetic on a third fewer instructions: the K loop is issue-bound (the "
     "promotion's FFMA take as many issue cycles as the MMAs take tensor-core cycles), 467 instructions a warp per 4 "
     "k32 blocks (v3: 703): ring slots as running offsets, 32-bit descriptor words, unsigned scale indices, 32-bit "
     "loader offsets computed before the loop (rows past T/N clamped, not zero-filled), one barrier a stage (v3: "
     "two), each block's scales read before the wait for its MMA; 232 registers, no spills; 2.42 ms = 532 TFLOP/s at "
     "T=4096 on the H200 (v3 3.03, gemm_v4 1.86: 0.77x)",
     [(3, 160, 40),             # one tile: rows past T and N (clamped rows), a partial scale tile, K % 128 == 32
      (5, 672, 40)]),           # 6 k tiles: the 5-stage ring wraps, the last tile one k block (zero-filled tail)
    ("gemm_fp8_v6",
     "gemm_fp8_v5's tile, ring, MMAs and promotion (outputs bit-identical to v5's), warp-specialised as DeepGEMM: a "
     "loader warpgroup (cp.async) and two MMA warpgroups that hand stages over on named barriers (a FULL barrier a "
     "warpgroup, EMPTY shared) instead of v5's block barrier, so they run free and one's promotion issues while the "
     "other's MMA runs; one partial tile a warpgroup (MMA, wait, promote a block), 384 threads, 156 registers (capped "
     "at 168 by -maxrregcount), no spills, wgmma not serialized; bf16 stored from registers. Specialisations "
     "(V6_CANDIDATES) timed beside it by tools/fp8_dev.py. H200 (bench/results/h200_fp8_dev_2a6d9a6.txt, act_quant "
     "included, outputs equal to v5's): 2117 us = 608 TFLOP/s at T=4096 (v5 2407, bf16 gemm_v4 1801: 0.85x; "
     "cuBLAS bf16 1496), 566 us at T=1024 (v5 649), 187 at T=130 (v5 208); the one-loader-warp specialisations "
     "(219 registers x 288 threads) do not launch (out of resources)",
     [(3, 160, 40),             # one tile: rows past T and N (clamped rows), a partial scale tile, K % 128 == 32
      (130, 864, 72)]),         # 2 token tiles (2 rows in the second, clamped), 7 k tiles: the 5-stage ring wraps,
                                # an odd number of k blocks (27), N % 32 == 8
    ("gemm_fp8_v7",
     "gemm_fp8_v6's roles, MMAs and promotion (outputs bit-identical to v6's), with the scale products s_x * s_w "
     "made once a k tile by the loader warpgroup (from plain global loads issued a k tile ahead) and staged "
     "[block][row][w tile] beside the operands, so an MMA thread reads a block's 8 products as two 16-byte loads "
     "(v6: 6 loads and 8 multiplies a block), and a persistent grid (min(tiles, SMs) CTAs, token tile fastest): "
     "the loader's k-tile stream runs on across output tiles, so the ring never drains and the bf16 stores of one "
     "tile overlap the next tile's loads. Specialisations (V7_CANDIDATES: one CTA a tile; two n64 partial tiles a "
     "warpgroup, one half promoted while the other's MMA runs) timed beside it by tools/fp8_dev.py. Not yet timed "
     "on a GPU",
     [(3, 160, 40),             # one tile: rows past T and N (clamped rows), a partial scale tile, K % 128 == 32
      (130, 160, 264)]),        # 6 output tiles on the simulator's 2 persistent CTAs (3 each): the k-tile stream
                                # runs across tiles (6 k tiles through the 5-stage ring), the last tile 8 wide
    ("gemm_fp8_v8",
     "gemm_fp8_v7's arithmetic (the same k32 MMAs and fma: v7's bits) on 256 threads that only multiply: the four "
     "warps of warpgroup 0 also issue a k tile's four TMA copies (x's and w's codes in 128-byte-swizzled boxes, both "
     "scale boxes), so a math thread has up to 255 registers and each warpgroup keeps two partial tiles (block "
     "kb+1's MMA runs while block kb is promoted, which v6/v7's 168-register budget could not hold); a 6-stage "
     "ring running on across a persistent CTA's output tiles, mbarrier hand-over (FULL by TMA bytes, EMPTY by the "
     "8 math warps) with both barrier checks probed early (mbarrier.test_wait) and read after the promotions; the "
     "scales of a k tile in six 16-byte loads; 236 registers, no spills. Specialisations (V8_CANDIDATES) timed "
     "beside it by tools/fp8_dev.py. H200 (bench/results/h200_fp8_dev_v8_6eda8b1.txt, bit-identical to v7): "
     "1,833 us = 703 TFLOP/s at T=4096 (bf16 gemm_v4 1,861: 1.015x; v7 2,039), 496 at T=1024 (1.03x), 162 at "
     "T=130 (v7 231)",
     [(3, 160, 40),             # one tile: rows past T and N (zero-filled boxes), a partial scale tile, K % 128 == 32
      (130, 288, 264)]),        # 6 output tiles on the simulator's 2 persistent CTAs (3 each), 3 k tiles each (the
                                # last one k block): 9 k tiles through the 6-stage ring, the last output tile 8 wide
):
    naive = _name == "gemm_fp8_v1"
    _proj(_name, _log, kernel=cuda_fp8_wgmma.KERNELS[_name],
          geometry=(cuda_fp8_wgmma.geometry_naive if naive else cuda_fp8_wgmma.geometry_v4 if _name == "gemm_fp8_v4"
                    else cuda_fp8_wgmma.geometry_v6 if _name == "gemm_fp8_v6"
                    else cuda_fp8_wgmma.geometry_v7 if _name == "gemm_fp8_v7"
                    else cuda_fp8_tma.geometry_v8 if _name == "gemm_fp8_v8" else cuda_fp8_wgmma.geometry),
          args="naive" if naive else "fast",
          specs=_fp8_gemm_specs(_name), encoding="fp8", sim=_sim, exact=naive,
          launcher=cuda_fp8_tma.launcher_v8 if _name == "gemm_fp8_v8" else cuda_fp8_wgmma.launcher,
          sweep=(128, 256, 512, 1024, 4096), vector_io=False)
