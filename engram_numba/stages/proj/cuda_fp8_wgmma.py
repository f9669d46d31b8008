"""DeepSeek's FP8 projection on Hopper's FP8 tensor cores (sm_90a): act_quant, then an e4m3 GEMM
whose partial sums are promoted to fp32 at every K block.

The arithmetic is `reference.projection_deepseek_fp8` (docs/math.md section 5.4), on an FP8 wkv as
DeepSeek's checkpoint stores it: codes uint8 [N, K] (e4m3) and scales uint8 [ceil(N/32), K/32]
(e8m0, one per 32 x 32 tile).
  1. `act_quant` (kernel `act_quant_kernel`): per token and group of 32 values, amax floored at
     1e-4, s = 2^ceil(log2(amax / 448)), q = e4m3 round-to-nearest-even of clamp(x / s, +-448),
     written as e4m3 codes uint8 [T, K] and s as fp32 [T, K/32]. Every step is exact or one
     correctly rounded fp32 operation, so the codes and scales are bit-identical to
     `act_quant_reference` / `act_quant_cpu` on the GPU and in the simulator.
  2. The GEMM: for each K block of 32 (the scale block, one k32 wgmma), the tensor core computes
     the block's 32-term sum into a fresh fp32 register tile (scale-d = 0), and the threads add
     `partial * (s_x[t, kb] * s_w[n // 32, kb])` into the fp32 accumulators, blocks in K order;
     bf16 once at the end. This is DeepGEMM's promotion with V4.1's block of 32: Hopper's FP8 MMA
     accumulates with reduced precision, so nothing is carried in the tensor core across blocks.
     Both scales are powers of two: their product, and the product with the partial, are exact
     whenever they stay in fp32's normal range (every scale byte a checkpoint uses), so
     `fma(partial, s_x * s_w, acc)` equals the reference's `acc + (partial * s_x) * s_w`.

Numerics (docs/numerics.md, "DeepSeek's FP8 arithmetic on the tensor cores"): the only freedom
left is the order and precision of the 32-term sum inside the tensor core, which PTX does not
specify. The simulator's wgmma sums the 32 exact products sequentially in fp32 (k in order), the
CPU twin's order, so in the simulator the whole projection is bit-identical to
`projection_deepseek_fp8_cpu`; on the GPU the distance is measured (numerics.md states it).

Kernel versions (after act_quant; v2 and v3 from one factory, `make_kernel(double_buffer)`)
  gemm_fp8_v1  naive: one thread per output (t, n), the twin's loops (k in order inside a block,
               blocks in K order) on act_quant's codes and scales: bit-identical to the twin in the
               simulator and, by construction, on the GPU (every product and every scaling is
               exact, so contraction into fma changes nothing).
  gemm_fp8_v2  CTA tile 128 x 128 (2 warpgroups, m64n128k32 each on its 64 token rows), BK = 128
               (4 scale blocks a stage), 5 cp.async stages of 128-byte-swizzled K-major operands
               (gemm_v4's pipeline on bytes) with the stage's scales alongside; each block: wgmma
               into the partial tile, wait for it, promote. One warpgroup's promotion overlaps the
               other's MMA. H200, T = 4096: 3.44 ms (gemm_v4 1.83 ms).
  gemm_fp8_v3  v2 with two partial tiles: the MMA of block kb+1 is in flight while block kb is
               promoted (wgmma.wait_group 1). H200, T = 4096: 3.02 ms = 426 TFLOP/s, 0.60x
               gemm_v4: the wait and the 64 FMAs a thread after every k32 block are not hidden
               by two warpgroups (docs/gpu.md).
  gemm_fp8_v4  the 128 x 128 tile over 4 math warpgroups of m64n64 (4 warps a scheduler), each
               with two partial tiles, on a deeper stream (`make_kernel_v4`): k tiles in pairs, 8
               blocks a barrier and a drain (v3: 4 blocks, two barriers), 6 tile slots; 128
               registers, no spills, wgmma not serialized. H200, T = 4096: 3.74 ms, slower than v3.
  gemm_fp8_v5  v3's schedule and arithmetic on a third fewer instructions (`make_kernel_v5`): the K
               loop is issue-bound (the promotion's 64 FFMA a warp a block take as many issue
               cycles as the tensor core takes for the block), so every other instruction counts;
               467 instructions a warp per 4 blocks (v3: 703), one barrier a stage (v3: two), 232
               registers, no spills, wgmma not serialized. Not yet timed on a GPU.
  gemm_fp8_v6  v5's tile, ring, MMAs and promotion (so its outputs are v5's, bit for bit),
               warp-specialised (`make_kernel_v6`, gemm_v7's roles, DeepGEMM's structure): a loader
               warpgroup copies (cp.async), the two MMA warpgroups only multiply and promote, and
               stages are handed over on named barriers (a FULL barrier a warpgroup, EMPTY shared)
               instead of a block barrier: v5's barrier ties both warpgroups to every stage, so they
               wait and promote together and the tensor pipe idles (28% active at T = 4096); free
               running, one's promotion issues while the other's MMA runs. One partial tile a
               warpgroup (MMA, wait, promote each block), so the accumulator and partial fit the 168
               registers of a 384-thread block: 156, no spills, wgmma not serialized; 384 SASS
               instructions a consumer warp a k tile (v5: 467, loads included), ~110 a loader warp.
               Registers are capped by -maxrregcount (`register_cap`): ptxas caps launch bounds of 288
               threads at 168, the cap of 384. Specialisations (`V6Variant`, `V6_CANDIDATES`, timed by
               tools/fp8_dev.py): one loader warp and two partial tiles a warpgroup (288 threads, 219
               registers), the chain running on from one k tile into the next and drained every two
               ("pair") or every tile; a chain left in flight across the loop edge makes ptxas
               serialize every wgmma (C7514). Not yet timed on a GPU.
  gemm_fp8_v7  v6's roles, MMAs and promotion (outputs v6's, bit for bit) with the scale products made
               once a k tile by the loader warpgroup and staged beside the operands (an MMA thread
               reads a block's 8 products as two 16-byte loads; v6: 6 loads and 8 multiplies) and a
               persistent grid (min(tiles, SMs) CTAs, token tile fastest) whose k-tile stream runs on
               across output tiles, so the ring never drains (`make_kernel_v7`, `V7Variant`); 160
               registers, no spills, wgmma not serialized; 335 SASS instructions a consumer warp a k
               tile (v6: 384). Specialisations (`V7_CANDIDATES`, timed by tools/fp8_dev.py): one CTA a
               tile; two n64 partial tiles a warpgroup (one half promoted while the other's MMA runs,
               154 registers); a 4-stage ring. H200, T = 4096: 2.03 ms = 634 TFLOP/s, 0.89x gemm_v4.
  gemm_fp8_v8  in `cuda_fp8_tma.py`: v7's arithmetic on 256 math threads with TMA operands and scales
               (warpgroup 0's four warps issue the copies), two partial tiles a warpgroup, a 6-stage ring
               running on across a persistent CTA's tiles. H200, T = 4096: 1.83 ms, 1.015x gemm_v4.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from ...device.hopper import (WGMMA_SWIZZLE_128B, acc_store_bf16, cp_async_16, cp_async_commit, cp_async_waiter,
                              fence_proxy_async, named_barrier_arrive, named_barrier_sync, shared_address,
                              warp_uniform, wgmma_commit, wgmma_descriptor, wgmma_fence, wgmma_store_bf16x2,
                              wgmma_waiter)
from ...device.intrinsics import (SIMULATOR, bf16_bits_to_f32, device_function, f32_as_u32, f32_to_bf16_bits,
                                  load_u32x4, store_u32x4, u32_as_f32)
from ...device.launch import PreparedLaunch, allow_dynamic_shared
from .cuda_common import INLINE, bounds, cdiv, register_cap
from .cuda_gemv_fp8 import e4m3_to_f32, e8m0_to_f32

BLOCK = 32                      # act_quant group = K block of the promotion = one k32 wgmma
THREADS = 256                   # 2 warpgroups
BM, BN = 128, 128               # CTA tile: tokens x outputs
WG_N = 128                      # each warpgroup: 64 token rows x 128 outputs (m64n128k32)
NACC = WG_N // 2                # fp32 accumulators a thread
NG = WG_N // BLOCK              # scale tiles of w a warpgroup's outputs span
BK = 128                        # k values (bytes) a stage: one 128-byte row per operand row
STAGES = 5
ROW_BYTES = BK
GROUP_BYTES = 8 * ROW_BYTES     # one 1024-byte swizzle atom
ALIGN_SLACK = 1024
A_BYTES = BM * ROW_BYTES
B_BYTES = BN * ROW_BYTES
SX_BYTES = BM * 16               # a stage's scales of x: 4 k blocks x 128 token rows (one 16-byte chunk a row)
SW_BYTES = (BN // BLOCK) * 16    # ... and of w: 4 k blocks x 4 tiles of 32 outputs
STAGE_BYTES = -(-(A_BYTES + B_BYTES + SX_BYTES + SW_BYTES) // 1024) * 1024   # atoms stay 1024-aligned
SCALE_K = BK // BLOCK           # k blocks a stage (4): the scale arrays' innermost axis
STASH_STRIDE = BN // 2 + (4 - BN // 2) % 8      # words a row of the bf16x2 output tile (bank-conflict free)
SMEM_BYTES = max(STAGES * STAGE_BYTES, BM * STASH_STRIDE * 4) + ALIGN_SLACK


# ---- the FP8 wgmma and the promotion, with their simulator twins -----------------------------------
#
# - `wgmma_e4m3(part, desc_a, desc_b, smem)`: one warpgroup-wide
#   `wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3` with scale-d = 0: part = A[64 x 32] B[32 x N]
#   (the accumulator's previous values are ignored), A rows and B columns read K-major through the
#   descriptors (32 bytes of a row per k32 step: the same bytes a bf16 k16 step reads, so the
#   descriptors are the bf16 ones). N = 2 * len(part); the fragment layout is wgmma_bf16's. The same
#   asynchronous rules as wgmma_bf16: wgmma_fence before, read only after commit and a waiter.
#   Simulator twin: the 32 products (exact in fp32) summed sequentially in fp32, k = 0..31.
# - `fp8_promote(acc, part, scales)` -> acc: acc[i] = fma(part[i], scales[g(i)], acc[i]) with
#   g(i) = G h + j // 4 for i = 4 j + 2 h + c (row half h, output column 8 j + 2 t + c, so j // 4 is
#   the 32-wide scale tile of the column within the warpgroup's N = 32 G outputs): `scales` is the
#   tuple (s_row0 * s_w[0..G-1], s_row8 * s_w[0..G-1]). `part` must be retired (a waiter) before.
# - `opaque_copy(v)`: v (a 32-bit integer) through a volatile mov the compiler cannot hoist out of a
#   loop: what is computed from it inside the loop is recomputed there instead of held in registers
#   across the loop (the twin returns v).
# - `after_retired(index, part)`: index, made to depend on a retired partial tile, so the shared-memory
#   loads of the scales it addresses are not scheduled before the wait that retires it (they would
#   hold registers across the MMA); part[0] is NaN only when the partial is, and then every fma that
#   uses the scale is NaN whatever it reads (the twin returns index).
# - `udiv32(a, b)`: a // b as one PTX div.u32 on the low 32 bits of a and b (both < 2^32): numba types
#   a division of 32-bit integers as a 64-bit one, which ptxas makes a call, and a call anywhere in a
#   kernel makes ptxas serialize its wgmma.

if SIMULATOR:
    from ...device.hopper import WgmmaAcc, _QUEUES, _bytes, _element_offsets, _thread_id
    from ..rows.fp8 import E4M3_VALUES

    def _fp8_operand(smem_b, desc, rows):
        """fp32 values [len(rows), 32] of a K-major e4m3 operand: byte j of a row is byte j % 2 of
        its bf16-sized element j // 2."""
        off = _element_offsets(desc, rows)                                  # [r, 16] bytes of bf16 pairs
        off = (off[:, :, None] + np.arange(2)[None, None, :]).reshape(off.shape[0], 32)
        if off.min() < 0 or off.max() + 1 > smem_b.size:
            raise IndexError(f"wgmma_e4m3 operand reaches bytes {off.min()}..{off.max()} of a "
                             f"{smem_b.size}-byte shared array (descriptor {int(desc):#x})")
        return E4M3_VALUES[smem_b[off]]

    def wgmma_e4m3(part, desc_a, desc_b, smem):
        if not isinstance(part, WgmmaAcc) or not part.fenced:
            raise RuntimeError("wgmma_e4m3: no wgmma_fence since the accumulators were last written "
                               "or read by other instructions")
        n_cols = 2 * part.values.size
        p = _thread_id() % 128
        w, g, t = p // 32, (p % 32) >> 2, p & 3
        rows_a = [16 * w + g, 16 * w + g + 8]
        cols = [8 * j + 2 * t + c for j in range(n_cols // 8) for c in range(2)]
        smem_b, da, db = _bytes(smem), int(desc_a), int(desc_b)

        def run():
            a = _fp8_operand(smem_b, da, rows_a)                             # [2, 32] fp32
            b = _fp8_operand(smem_b, db, cols)                               # [N/4, 32]
            prod = a[:, None, :] * b[None, :, :]                             # exact in fp32
            s = np.cumsum(prod, axis=-1, dtype=np.float32)[..., -1]          # k in order, fp32
            part.values = s.reshape(2, n_cols // 8, 2).transpose(1, 0, 2).reshape(-1).astype(np.float32)
            part.in_flight -= 1
        part.in_flight += 1
        _QUEUES.mma_open.append(run)
        return part

    def fp8_promote(acc, part, scales):
        p = part.read("fp8_promote") if isinstance(part, WgmmaAcc) else np.array(part, np.float32)
        a = np.array(acc, dtype=np.float32)
        s = np.array(scales, dtype=np.float32)
        i = np.arange(a.size)
        g = (a.size // 16) * ((i >> 1) & 1) + (i >> 2) // 4
        # partial * scale is exact (powers of two), so the fp32 add is the fma's one rounding
        out = (a + p * s[g]).astype(np.float32)
        return tuple(np.float32(v) for v in out)

    def opaque_copy(v):
        return v

    def after_retired(index, part):
        return index

    def udiv32(a, b):
        return np.uint32(int(a) // int(b))

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def _is_tile(acc):
        return isinstance(acc, types.UniTuple) and acc.dtype == types.float32 and acc.count % 4 == 0 \
            and 4 <= acc.count <= 128

    @intrinsic
    def wgmma_e4m3(typingctx, part, desc_a, desc_b, smem):
        if not (_is_tile(part) and isinstance(desc_a, types.Integer) and isinstance(desc_b, types.Integer)):
            return None
        n = part.count
        regs = ", ".join(f"${i}" for i in range(n))
        # scale-d = 0 (a fresh sum); e4m3 operands take no transpose immediates (K-major only)
        text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; "
                "wgmma.mma_async.sync.aligned.m64n%dk32.f32.e4m3.e4m3 {%s}, $%d, $%d, p, 1, 1; }"
                % (2 * n + 2, 2 * n, regs, 2 * n, 2 * n + 1))

        def codegen(context, builder, signature, args):
            acc_t, da_t, db_t, _ = signature.args
            da = context.cast(builder, args[1], da_t, types.uint64)
            db = context.cast(builder, args[2], db_t, types.uint64)
            vals = [builder.extract_value(args[0], i) for i in range(n)]
            constraints = ",".join(["=f"] * n + [str(i) for i in range(n)]) + ",l,l,r,~{memory}"
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * n), [_F32] * n + [_I64, _I64, _I32])
            res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True),
                               vals + [da, db, ir.Constant(_I32, 0)])
            return context.make_tuple(builder, acc_t, [builder.extract_value(res, i) for i in range(n)])
        return part(part, desc_a, desc_b, smem), codegen

    @intrinsic
    def fp8_promote(typingctx, acc, part, scales):
        if not (_is_tile(acc) and acc == part and isinstance(scales, types.UniTuple)
                and scales.dtype == types.float32 and scales.count == 2 * (acc.count // 16)):
            return None
        n = acc.count

        def codegen(context, builder, signature, args):
            # one fma.rn each, spelled out: the sum must not be left to the compiler's contraction choices
            fma = ir.InlineAsm(ir.FunctionType(_F32, [_F32, _F32, _F32]), "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f",
                               side_effect=False)
            out = []
            for i in range(n):
                g = (n // 16) * ((i >> 1) & 1) + (i >> 2) // 4
                out.append(builder.call(fma, [builder.extract_value(args[1], i), builder.extract_value(args[2], g),
                                              builder.extract_value(args[0], i)]))
            return context.make_tuple(builder, signature.return_type, out)
        return acc(acc, part, scales), codegen

    @intrinsic
    def opaque_copy(typingctx, v):
        if not isinstance(v, types.Integer) or v.bitwidth != 32:
            return None

        def codegen(context, builder, signature, args):
            return builder.call(ir.InlineAsm(ir.FunctionType(_I32, [_I32]), "mov.b32 $0, $1;", "=r,r", side_effect=True),
                                [args[0]])
        return v(v), codegen

    @intrinsic
    def udiv32(typingctx, a, b):
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            x = builder.trunc(context.cast(builder, args[0], signature.args[0], types.uint64), _I32)
            y = builder.trunc(context.cast(builder, args[1], signature.args[1], types.uint64), _I32)
            return builder.call(ir.InlineAsm(ir.FunctionType(_I32, [_I32, _I32]), "div.u32 $0, $1, $2;", "=r,r,r",
                                             side_effect=False), [x, y])
        return types.uint32(a, b), codegen

    @device_function(**INLINE)
    def after_retired(index, part):
        # part[0] is NaN only if the partial is (then so is every fma that uses the scale read here)
        return index + np.int64(part[0] != part[0])


# ---- act_quant ---------------------------------------------------------------------------------------

AQ_THREADS = 128
F32_TWO23 = np.float32(8388608.0)


@device_function(**INLINE)
def e4m3_code(v):
    """e4m3 code (uint32, 0..255) of the nearest e4m3 value to fp32 v, |v| <= 448, ties to even;
    the sign bit is v's (so -0 -> 0x80). The step of v's binade is 2^(E-3) (3 mantissa bits),
    never finer than the subnormal step 2^-9; v / step is exact, and adding and subtracting 2^23
    rounds it to an integer (nearest even) in one fp32 rounding."""
    u = f32_as_u32(v)
    sign = (u >> np.uint32(24)) & np.uint32(0x80)
    a = abs(v)
    ea = np.int32((f32_as_u32(a) >> np.uint32(23)) & np.uint32(0xFF))      # biased fp32 exponent
    se = max(ea - np.int32(130), np.int32(-9))                              # step = 2^se
    y = a * u32_as_f32(np.uint32(np.int32(127) - se) << np.uint32(23))      # exact, < 16
    r = (y + F32_TWO23) - F32_TWO23                                         # nearest integer, ties even
    qv = r * u32_as_f32(np.uint32(np.int32(127) + se) << np.uint32(23))      # exact e4m3 value
    bq = f32_as_u32(qv)
    eq = (bq >> np.uint32(23)) & np.uint32(0xFF)
    if eq >= np.uint32(121):                                                # >= 2^-6: normal e4m3
        code = ((eq - np.uint32(120)) << np.uint32(3)) | ((bq >> np.uint32(20)) & np.uint32(7))
    else:                                                                   # subnormal: r * 2^-9
        code = np.uint32(r)
    return code | sign


@device_function(**INLINE)
def act_scale(amax):
    """2^ceil(log2(max(amax, 1e-4) / 448)) in fp32, the ceil-log2 read off the fp32 bits."""
    r = max(amax, np.float32(1e-4)) / np.float32(448.0)
    b = f32_as_u32(r)
    e = np.int32((b >> np.uint32(23)) & np.uint32(0xFF))
    if b & np.uint32(0x7FFFFF):
        e += np.int32(1)
    return u32_as_f32(np.uint32(e) << np.uint32(23))


@device_function(**INLINE)
def _pair_codes(u, scale):
    """Two bf16 values (one bf16x2 word) -> their e4m3 codes in the low 16 bits."""
    lo = min(max(bf16_bits_to_f32(u & np.uint32(0xFFFF)) / scale, np.float32(-448.0)), np.float32(448.0))
    hi = min(max(bf16_bits_to_f32(u >> np.uint32(16)) / scale, np.float32(-448.0)), np.float32(448.0))
    return e4m3_code(lo) | (e4m3_code(hi) << np.uint32(8))


@device_function(**INLINE)
def _word_amax(amax, u):
    return max(amax, abs(bf16_bits_to_f32(u & np.uint32(0xFFFF))), abs(bf16_bits_to_f32(u >> np.uint32(16))))


@cuda.jit(**bounds(AQ_THREADS, 8))
def act_quant_kernel(x32, q32, s, T, K):
    # x32: uint32 [T*K/2] bf16 pairs; q32: uint32 [T*K/4] e4m3 codes; s: float32 stage_scales_shape(T, K)
    # (the scale of group b of token t at [b // 4, t, b % 4]: one 16-byte chunk per token and GEMM stage).
    # One thread a group of 32 values: 4 16-byte loads for the amax, the same 4 (L1 hits) again to
    # quantise, 2 16-byte stores of codes.
    i = cuda.grid(1)
    KB = K // BLOCK
    if i >= T * KB:
        return
    t = i // KB
    b = i - t * KB
    e0 = np.int64(t) * K + b * BLOCK                 # first value of the group
    v0 = e0 >> 3                                     # its 16-byte chunk of x
    amax = np.float32(0.0)
    for c in range(4):
        u0, u1, u2, u3 = load_u32x4(x32, v0 + c)
        amax = _word_amax(_word_amax(_word_amax(_word_amax(amax, u0), u1), u2), u3)
    scale = act_scale(amax)
    s[b >> 2, t, b & 3] = scale
    for c in range(2):                               # 16 values -> one 16-byte chunk of codes
        u0, u1, u2, u3 = load_u32x4(x32, v0 + 2 * c)
        u4, u5, u6, u7 = load_u32x4(x32, v0 + 2 * c + 1)
        store_u32x4(q32, (e0 >> 4) + c,
                    _pair_codes(u0, scale) | (_pair_codes(u1, scale) << np.uint32(16)),
                    _pair_codes(u2, scale) | (_pair_codes(u3, scale) << np.uint32(16)),
                    _pair_codes(u4, scale) | (_pair_codes(u5, scale) << np.uint32(16)),
                    _pair_codes(u6, scale) | (_pair_codes(u7, scale) << np.uint32(16)))


@cuda.jit
def e8m0_table_kernel(scales, out):
    # scales: uint8 [NB, KB] e8m0 bytes -> out: float32 [ceil(KB/4), NB, 4] (the stage layout of act_quant's s)
    i = cuda.grid(1)
    NB, KB = scales.shape
    if i < NB * KB:
        nb = i // KB
        kb = i - nb * KB
        out[kb >> 2, nb, kb & 3] = e8m0_to_f32(scales[nb, kb])


# ---- the GEMM --------------------------------------------------------------------------------------

def _stage_issuer(threads: int):
    """`_issue_stage` for a CTA of `threads` threads: each loads threads / 8 operand rows a pass."""
    A_CHUNKS = BM * 8 // threads
    B_CHUNKS = BN * 8 // threads
    ROWS = threads // 8
    PASS_BYTES = ROWS * ROW_BYTES

    @device_function(**INLINE)
    def _issue_stage(smem, stage_off, x32, w32, sx32, sw32, m0, n0, T, N, NB, K16, kt, row0, q, off0, tid):
        """cp.async this thread's 16-byte chunks of k tile kt into the stage at byte stage_off: the
        operands, and (threads 0..131) the tile's scales: x's for 128 token rows, w's for 4 tiles."""
        if tid < BM:
            r = m0 + tid
            cp_async_16(smem, stage_off + A_BYTES + B_BYTES + 16 * tid, sx32, np.int64(kt) * T + min(r, T - 1),
                        16 if r < T else 0)
        elif tid < BM + BN // BLOCK:
            c = tid - BM
            cp_async_16(smem, stage_off + A_BYTES + B_BYTES + SX_BYTES + 16 * c, sw32,
                        np.int64(kt) * NB + min(n0 // BLOCK + c, NB - 1), 16)
        kq = kt * 8 + q
        k_ok = kq < K16
        kc = min(kq, K16 - 1)
        for i in range(A_CHUNKS):
            r = m0 + row0 + ROWS * i
            ok = k_ok and r < T
            cp_async_16(smem, stage_off + off0 + PASS_BYTES * i, x32, np.int64(min(r, T - 1)) * K16 + kc, 16 if ok else 0)
        for i in range(B_CHUNKS):
            r = n0 + row0 + ROWS * i
            ok = k_ok and r < N
            cp_async_16(smem, stage_off + A_BYTES + off0 + PASS_BYTES * i, w32, np.int64(min(r, N - 1)) * K16 + kc,
                        16 if ok else 0)
    return _issue_stage


def make_kernel(double_buffer: bool):
    K_STEP = 32                              # a k32 step: 32 bytes along the swizzled 128-byte row
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    cp_wait = cp_async_waiter(STAGES - 2)
    cp_wait0 = cp_async_waiter(0)
    mma_wait0 = wgmma_waiter(0)
    mma_wait1 = wgmma_waiter(1)

    _issue_stage = _stage_issuer(THREADS)

    @device_function(**INLINE)
    def _scales(smem, sc, r0, j):
        """(s_x[row r0] * s_w[tiles 0..3], s_x[row r0 + 8] * s_w[tiles 0..3]) of k block j of the stage
        whose scales start at word sc of smem (zeros past K: the zero-filled tail's partial stays 0)."""
        a0 = u32_as_f32(smem[sc + 4 * r0 + j])
        a1 = u32_as_f32(smem[sc + 4 * r0 + 32 + j])
        w = sc + SX_BYTES // 4 + j
        w0 = u32_as_f32(smem[w])
        w1 = u32_as_f32(smem[w + 4])
        w2 = u32_as_f32(smem[w + 8])
        w3 = u32_as_f32(smem[w + 12])
        return (a0 * w0, a0 * w1, a0 * w2, a0 * w3, a1 * w0, a1 * w1, a1 * w2, a1 * w3)

    @cuda.jit(**bounds(THREADS, 1))
    def gemm_fp8(x32, w32, sx32, sw32, out, T, K):
        # x32: uint32 [T*K/4] e4m3 codes of x; w32: uint32 [N*K/4] of wkv; sx32: float32 bits
        # stage_scales_shape(T, K) flat (act_quant's stage layout); sw32: stage_scales_shape(ceil(N/32), K) flat;
        # out: uint16 [T, N]
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        wg = tid >> 7
        N = out.shape[1]
        K16 = K >> 4
        NB = (N + BLOCK - 1) // BLOCK
        n_k = (K16 + 7) >> 3
        m0 = cuda.blockIdx.x * BM
        n0 = cuda.blockIdx.y * BN
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        row0 = tid >> 3
        q = tid & 7
        off0 = row0 * ROW_BYTES + ((q ^ (row0 & 7)) << 4)
        d_hi = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        a_wg = wg * (64 * ROW_BYTES)

        # this thread's first accumulator row within the CTA tile (the second is 8 below)
        p = tid & 127
        r0 = wg * 64 + 16 * (p >> 5) + ((p & 31) >> 2)

        for s in range(STAGES - 1):
            if s < n_k:
                _issue_stage(smem, s0 - base + s * STAGE_BYTES, x32, w32, sx32, sw32, m0, n0, T, N, NB, K16, s, row0, q,
                             off0, tid)
            cp_async_commit()

        acc = ZERO
        pa = ZERO
        pb = ZERO
        for kt in range(n_k):
            st = s0 + (kt % STAGES) * STAGE_BYTES
            cp_wait()
            fence_proxy_async()
            cuda.syncthreads()
            sc = (st - base + A_BYTES + B_BYTES) >> 2      # word of this stage's scales in smem
            if double_buffer:
                # blocks kb (pa) and kb+1 (pb) in flight; each promotion waits only for its own block,
                # the next block's MMA runs meanwhile; the stage ends with nothing in flight
                pa = wgmma_fence(pa)
                pa = wgmma_e4m3(pa, d_hi | wgmma_descriptor(st + a_wg, 0, 0, 0),
                                d_hi | wgmma_descriptor(st + A_BYTES, 0, 0, 0), smem)
                wgmma_commit()
                pb = wgmma_fence(pb)
                pb = wgmma_e4m3(pb, d_hi | wgmma_descriptor(st + a_wg + K_STEP, 0, 0, 0),
                                d_hi | wgmma_descriptor(st + A_BYTES + K_STEP, 0, 0, 0), smem)
                wgmma_commit()
                pa = mma_wait1(pa)
                acc = fp8_promote(acc, pa, _scales(smem, sc, r0, 0))
                pa = wgmma_fence(pa)
                pa = wgmma_e4m3(pa, d_hi | wgmma_descriptor(st + a_wg + 2 * K_STEP, 0, 0, 0),
                                d_hi | wgmma_descriptor(st + A_BYTES + 2 * K_STEP, 0, 0, 0), smem)
                wgmma_commit()
                pb = mma_wait1(pb)
                acc = fp8_promote(acc, pb, _scales(smem, sc, r0, 1))
                pb = wgmma_fence(pb)
                pb = wgmma_e4m3(pb, d_hi | wgmma_descriptor(st + a_wg + 3 * K_STEP, 0, 0, 0),
                                d_hi | wgmma_descriptor(st + A_BYTES + 3 * K_STEP, 0, 0, 0), smem)
                wgmma_commit()
                pa = mma_wait1(pa)
                acc = fp8_promote(acc, pa, _scales(smem, sc, r0, 2))
                pb = mma_wait0(pb)
                acc = fp8_promote(acc, pb, _scales(smem, sc, r0, 3))
            else:
                for ks in range(4):
                    pa = wgmma_fence(pa)
                    pa = wgmma_e4m3(pa, d_hi | wgmma_descriptor(st + a_wg + ks * K_STEP, 0, 0, 0),
                                    d_hi | wgmma_descriptor(st + A_BYTES + ks * K_STEP, 0, 0, 0), smem)
                    wgmma_commit()
                    pa = mma_wait0(pa)
                    acc = fp8_promote(acc, pa, _scales(smem, sc, r0, ks))
            cuda.syncthreads()                       # both warpgroups are done with stage kt
            nk = kt + STAGES - 1
            if nk < n_k:
                _issue_stage(smem, s0 - base + (nk % STAGES) * STAGE_BYTES, x32, w32, sx32, sw32, m0, n0, T, N, NB,
                             K16, nk, row0, q, off0, tid)
            cp_async_commit()
        cp_wait0()
        cuda.syncthreads()

        # epilogue (gemm_v4's): bf16 pairs into a [BM][STASH_STRIDE] word tile, then row-contiguous stores
        w4 = p >> 5
        lane = p & 31
        wbase = (pad >> 2) + (16 * w4 + (lane >> 2)) * STASH_STRIDE + (lane & 3) + wg * 64 * STASH_STRIDE
        wgmma_store_bf16x2(smem, wbase, STASH_STRIDE, acc)
        cuda.syncthreads()
        words = BN // 2
        for i in range(tid, BM * words, THREADS):
            r = i // words
            c = i - r * words
            t = m0 + r
            n = n0 + 2 * c
            if t < T and n < N:
                word = smem[(pad >> 2) + r * STASH_STRIDE + c]
                out[t, n] = np.uint16(word & np.uint32(0xFFFF))
                if n + 1 < N:
                    out[t, n + 1] = np.uint16(word >> np.uint32(16))

    return gemm_fp8


# ---- gemm_fp8_v4: four math warpgroups on a deeper MMA stream ---------------------------------------
#
# The promotion after every k32 block costs a thread one fp32 FMA per accumulator: as much FP32-pipe
# time as the tensor core spends on the block. v3 has two warpgroups (2 warps a scheduler) to hide
# the waits in, and drains its MMA stream (wait_group 0) and passes two barriers every 4 blocks.
# v4 splits the same 128 x 128 CTA tile over four math warpgroups of m64n64k32 (warpgroup w: token
# rows 64 (w & 1), outputs 64 (w >> 1); 4 warps a scheduler, so one warp's FMAs issue while
# another's MMA runs), each with the accumulator and two partial tiles (96 of the 128 registers 512
# threads leave a thread). The k tiles are loaded in pairs into a ring of 3 pair slots (6 tiles, 4
# ahead of the MMA), and the 8 blocks of a pair run as one unrolled ping-pong (block b + 1 issued
# before block b is promoted, wait_group 1 throughout, wait_group 0 at the pair's end): one barrier
# and one drain every 8 blocks. The barrier that publishes pair kp is also the one after which pair
# kp - 1's slot is refilled. A last odd k tile pairs with a tile past K: its operands are
# zero-filled and its scales are the zero padding of the stage layout, so its blocks add nothing
# (fma(0, 0, acc) = acc). The same arithmetic as v1..v3: the same partial sums, promoted in K order
# with the same fma.
#
# Fitting 128 registers (compile tier, sm_90a): written plainly the kernel needs 176 and spills
# 108/128 bytes. Two things held registers across the MMA: the loader's indices (hoisted out of the
# tile loop: now recomputed from `opaque_copy(tid)` at each refill) and the scale loads of later
# blocks (scheduled early: `after_retired` makes each depend on the partial it scales). With both:
# 128 registers, no spills. `make_kernel_v4(128)` is the same schedule on v3's two warpgroups of
# m64n128 (225 registers), which tools/fp8_dev.py times beside it.
# What did not work: a producer warpgroup handing its registers to the math warpgroups with
# setmaxnreg: numba links every kernel through nvJitLink as relocatable code, and there ptxas ignores
# setmaxnreg (info C7504, "'setmaxnreg' ignored to maintain compatibility across compilation
# units"; the same PTX assembled whole-program by ptxas honours it). And a partial tile kept in
# flight across a loop edge makes ptxas serialize every wgmma (C7514: the phi copies read it),
# hence the hand-unrolled pair.

V4_WG_N = 64
V4_PAIRS = 3                     # ring slots, each a pair of k tiles (2 x 4 k32 blocks)
V4_SMEM_BYTES = max(2 * V4_PAIRS * STAGE_BYTES, BM * STASH_STRIDE * 4) + ALIGN_SLACK



def make_kernel_v4(wg_n: int = V4_WG_N):
    """gemm_fp8_v4's kernel with math warpgroups of m64n{wg_n} (64: 4 warpgroups, the record; 128: 2)."""
    threads = 128 * 2 * (BN // wg_n)
    K_STEP = 32
    ZERO = tuple(np.float32(0.0) for _ in range(wg_n // 2))
    issue = _stage_issuer(threads)
    cp_wait = cp_async_waiter(V4_PAIRS - 2)      # pair kp landed, kp + 1 may still be in flight
    cp_wait0 = cp_async_waiter(0)
    mma_wait0 = wgmma_waiter(0)
    mma_wait1 = wgmma_waiter(1)

    if wg_n == 64:
        @device_function(**INLINE)
        def _scales2(smem, sc, r0, wt, j):
            """(s_x[r0] * s_w[wt], s_x[r0] * s_w[wt + 1], s_x[r0 + 8] * s_w[wt], s_x[r0 + 8] * s_w[wt + 1]) of
            k block j of the stage whose scales start at word sc (wt: the warpgroup's first 32-output tile)."""
            a0 = u32_as_f32(smem[sc + 4 * r0 + j])
            a1 = u32_as_f32(smem[sc + 4 * r0 + 32 + j])
            w = sc + SX_BYTES // 4 + 4 * wt + j
            w0 = u32_as_f32(smem[w])
            w1 = u32_as_f32(smem[w + 4])
            return (a0 * w0, a0 * w1, a1 * w0, a1 * w1)
    else:
        @device_function(**INLINE)
        def _scales2(smem, sc, r0, wt, j):
            """The same for 4 tiles of 32 outputs (wt = 0)."""
            a0 = u32_as_f32(smem[sc + 4 * r0 + j])
            a1 = u32_as_f32(smem[sc + 4 * r0 + 32 + j])
            w = sc + SX_BYTES // 4 + j
            w0 = u32_as_f32(smem[w])
            w1 = u32_as_f32(smem[w + 4])
            w2 = u32_as_f32(smem[w + 8])
            w3 = u32_as_f32(smem[w + 12])
            return (a0 * w0, a0 * w1, a0 * w2, a0 * w3, a1 * w0, a1 * w1, a1 * w2, a1 * w3)

    @cuda.jit(**bounds(threads, 1))
    def gemm_fp8_v4(x32, w32, sx32, sw32, out, T, K):
        # the arguments of v2/v3's kernel
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        wg = tid >> 7
        N = out.shape[1]
        K16 = K >> 4
        NB = (N + BLOCK - 1) // BLOCK
        n_k = (K16 + 7) >> 3
        m0 = cuda.blockIdx.x * BM
        n0 = cuda.blockIdx.y * BN
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        row0 = tid >> 3
        q = tid & 7
        off0 = row0 * ROW_BYTES + ((q ^ (row0 & 7)) << 4)
        d_hi = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        m_wg = (wg & 1) * 64
        n_wg = (wg >> 1) * wg_n
        a_wg = m_wg * ROW_BYTES
        b_wg = A_BYTES + n_wg * ROW_BYTES
        wt = n_wg // BLOCK
        p = tid & 127
        r0 = m_wg + 16 * (p >> 5) + ((p & 31) >> 2)     # this thread's first accumulator row (second: + 8)

        n_p = (n_k + 1) >> 1                          # pairs of k tiles (a last odd tile pairs with zeros)
        for s in range(V4_PAIRS - 1):
            if s < n_p:
                for h in range(2):
                    issue(smem, s0 - base + (2 * s + h) * STAGE_BYTES, x32, w32, sx32, sw32, m0, n0, T, N, NB, K16,
                          2 * s + h, row0, q, off0, tid)
            cp_async_commit()

        acc = ZERO
        pa = ZERO
        pb = ZERO
        for kp in range(n_p):
            st = s0 + 2 * (kp % V4_PAIRS) * STAGE_BYTES
            cp_wait()
            fence_proxy_async()
            # publishes pair kp, and every warpgroup is done with pair kp - 1: its slot is refilled now
            cuda.syncthreads()
            nk = kp + V4_PAIRS - 1
            if nk < n_p:
                # the loader's indices recomputed from an opaque copy of tid, not held across the MMA
                tv = np.int32(opaque_copy(np.uint32(tid)))
                rv = tv >> 3
                qv = tv & 7
                ov = rv * ROW_BYTES + ((qv ^ (rv & 7)) << 4)
                for h in range(2):
                    issue(smem, s0 - base + (2 * (nk % V4_PAIRS) + h) * STAGE_BYTES, x32, w32, sx32, sw32,
                          cuda.blockIdx.x * BM, cuda.blockIdx.y * BN, T,
                          N, (N + BLOCK - 1) // BLOCK, K >> 4, 2 * nk + h, rv, qv, ov, tv)
            cp_async_commit()
            sc0 = (st - base + A_BYTES + B_BYTES) >> 2
            sc1 = sc0 + STAGE_BYTES // 4
            # the pair's descriptors: the start address (bits 0-13, in 16-byte units) moves by a
            # constant a block (st + 2 stages < 2^18: no carry out of the field)
            da = d_hi | wgmma_descriptor(st + a_wg, 0, 0, 0)
            db = d_hi | wgmma_descriptor(st + b_wg, 0, 0, 0)
            # 8 k32 blocks, even ones in pa, odd ones in pb: block b + 1 is issued before block b is
            # promoted (unrolled: a partial tile in flight across a loop edge would serialize the MMAs)
            pa = wgmma_fence(pa)
            pa = wgmma_e4m3(pa, da,
                            db, smem)
            wgmma_commit()
            pb = wgmma_fence(pb)
            pb = wgmma_e4m3(pb, da + np.uint64((K_STEP) >> 4),
                            db + np.uint64((K_STEP) >> 4), smem)
            wgmma_commit()
            pa = mma_wait1(pa)
            acc = fp8_promote(acc, pa, _scales2(smem, after_retired(sc0, pa), r0, wt, 0))
            pa = wgmma_fence(pa)
            pa = wgmma_e4m3(pa, da + np.uint64((2 * K_STEP) >> 4),
                            db + np.uint64((2 * K_STEP) >> 4), smem)
            wgmma_commit()
            pb = mma_wait1(pb)
            acc = fp8_promote(acc, pb, _scales2(smem, after_retired(sc0, pb), r0, wt, 1))
            pb = wgmma_fence(pb)
            pb = wgmma_e4m3(pb, da + np.uint64((3 * K_STEP) >> 4),
                            db + np.uint64((3 * K_STEP) >> 4), smem)
            wgmma_commit()
            pa = mma_wait1(pa)
            acc = fp8_promote(acc, pa, _scales2(smem, after_retired(sc0, pa), r0, wt, 2))
            pa = wgmma_fence(pa)
            pa = wgmma_e4m3(pa, da + np.uint64((STAGE_BYTES) >> 4),
                            db + np.uint64((STAGE_BYTES) >> 4), smem)
            wgmma_commit()
            pb = mma_wait1(pb)
            acc = fp8_promote(acc, pb, _scales2(smem, after_retired(sc0, pb), r0, wt, 3))
            pb = wgmma_fence(pb)
            pb = wgmma_e4m3(pb, da + np.uint64((STAGE_BYTES + K_STEP) >> 4),
                            db + np.uint64((STAGE_BYTES + K_STEP) >> 4), smem)
            wgmma_commit()
            pa = mma_wait1(pa)
            acc = fp8_promote(acc, pa, _scales2(smem, after_retired(sc1, pa), r0, wt, 0))
            pa = wgmma_fence(pa)
            pa = wgmma_e4m3(pa, da + np.uint64((STAGE_BYTES + 2 * K_STEP) >> 4),
                            db + np.uint64((STAGE_BYTES + 2 * K_STEP) >> 4), smem)
            wgmma_commit()
            pb = mma_wait1(pb)
            acc = fp8_promote(acc, pb, _scales2(smem, after_retired(sc1, pb), r0, wt, 1))
            pb = wgmma_fence(pb)
            pb = wgmma_e4m3(pb, da + np.uint64((STAGE_BYTES + 3 * K_STEP) >> 4),
                            db + np.uint64((STAGE_BYTES + 3 * K_STEP) >> 4), smem)
            wgmma_commit()
            pa = mma_wait1(pa)
            acc = fp8_promote(acc, pa, _scales2(smem, after_retired(sc1, pa), r0, wt, 2))
            pb = mma_wait0(pb)
            acc = fp8_promote(acc, pb, _scales2(smem, after_retired(sc1, pb), r0, wt, 3))
        cp_wait0()
        cuda.syncthreads()

        # epilogue: bf16 pairs into the [BM][STASH_STRIDE] word tile, then row-contiguous stores
        lane = p & 31
        wbase = (pad >> 2) + (m_wg + 16 * (p >> 5) + (lane >> 2)) * STASH_STRIDE + (lane & 3) + (n_wg >> 1)
        wgmma_store_bf16x2(smem, wbase, STASH_STRIDE, acc)
        cuda.syncthreads()
        words = BN // 2
        for i in range(tid, BM * words, threads):
            r = i // words
            c = i - r * words
            t = m0 + r
            n = n0 + 2 * c
            if t < T and n < N:
                word = smem[(pad >> 2) + r * STASH_STRIDE + c]
                out[t, n] = np.uint16(word & np.uint32(0xFFFF))
                if n + 1 < N:
                    out[t, n + 1] = np.uint16(word >> np.uint32(16))

    return gemm_fp8_v4


# ---- gemm_fp8_v5: v3's schedule on fewer instructions ----------------------------------------------
#
# The promotion is one fp32 FMA a thread per accumulator after every k32 block: 64 FFMA a warp a
# block. A scheduler issues one warp instruction a cycle and its FP32 pipe takes one FFMA a cycle,
# while the SM's tensor cores take 64 cycles for a warpgroup's m64n128k32 e4m3 block (4096 FP8 MACs
# a cycle): the FFMAs alone need as many issue cycles as the MMAs need tensor-core cycles. With two
# math warpgroups (two warps a scheduler), a stage of 4 blocks costs each scheduler
# 2 x (instructions a warp a stage) issue cycles against 2 x 4 x 64 = 512 tensor-core cycles, so
# the instruction count bounds the kernel at 512 / (2 x count) of the FP8 peak. v3's K loop (SASS,
# compile tier, sm_90a) is 703 instructions a warp a stage, 256 of them the FFMAs: at most 36 % of
# the peak, and it measured ~22 %. The other 447 were the loader's 64-bit signed index arithmetic
# (clamps, zero-fill predicates), the ring slot `kt % STAGES` (a 64-bit division by a constant),
# descriptors rebuilt a block in 64-bit arithmetic and the scales' shared-memory indices, each
# wrapped for negative values. v5 keeps v3's schedule and arithmetic (2 warpgroups of m64n128k32 on
# a 128 x 128 tile, 5 cp.async stages, two partial tiles with block kb + 1's MMA in flight while
# block kb is promoted) and strips the rest:
# - the ring slots are running byte offsets, advanced and wrapped by a compare;
# - the descriptors' low words (the start address field never carries inside a stage) advance by
#   32-bit adds; the constant high word is or-ed in; the warpgroup's offset into the A tile comes
#   from `warp_uniform`, so ptxas keeps the descriptors in uniform registers (no R2UR a block);
# - the scales are read at one unsigned per-thread word index a stage, constant offsets a block;
# - the loader's per-thread chunk offsets (row x K/16) are computed once before the loop, 32-bit:
#   a refill is an add, a wide multiply-add and an LDGSTS a chunk. Rows past T or N are clamped to
#   the last row instead of zero-filled: they feed only accumulators that are never stored;
# - one barrier a stage (v3: two): the slot of stage kt - 1 is refilled right after the barrier that
#   publishes stage kt, which every thread reaches only when done with kt - 1 (v4's order);
# - a block's scales are read before the wait for its MMA (in v3 the wait's memory clobber put
#   them after it, so each promotion began with a shared-memory load's latency).
# Result (compile tier): 467 instructions a warp a stage (bound 55 % of the peak), 232 registers,
# no spills, wgmma not serialized. The same partial sums promoted in the same order by the same fma.

def make_kernel_v5(refill_under_mma: bool = False):
    """gemm_fp8_v5's kernel; refill_under_mma: the refill issued after the stage's first two MMAs
    instead of before them (its instructions fill the wait for the first block, but under the
    in-flight partial tiles ptxas recomputes more: 490 instructions a warp a stage against 467;
    an experiment tools/fp8_dev.py times, not a record)."""
    K_STEP = 32
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    cp_wait = cp_async_waiter(STAGES - 2)
    cp_wait0 = cp_async_waiter(0)
    mma_wait0 = wgmma_waiter(0)
    mma_wait1 = wgmma_waiter(1)
    assert BM * 8 // THREADS == 4 and BN * 8 // THREADS == 4       # the loader's 4 + 4 chunks a thread a stage
    ROWS = THREADS // 8                      # operand rows a pass (32)
    PASS = ROWS * ROW_BYTES
    SCW = (A_BYTES + B_BYTES) // 4           # word of a stage's x scales within the stage
    SWW = (A_BYTES + B_BYTES + SX_BYTES) // 4
    RING = STAGES * STAGE_BYTES
    U0 = np.uint32(0)
    U16 = np.uint32(16)

    @device_function(**INLINE)
    def _scales5(smem, xw, ww, j):
        """(s_x[r0] * s_w[tiles 0..3], s_x[r0 + 8] * s_w[tiles 0..3]) of block j: xw is the word of
        this thread's row r0 in the stage's x scales, ww the stage's first w scale word."""
        a0 = u32_as_f32(smem[xw + np.uint32(j)])
        a1 = u32_as_f32(smem[xw + np.uint32(32 + j)])
        w0 = u32_as_f32(smem[ww + np.uint32(j)])
        w1 = u32_as_f32(smem[ww + np.uint32(4 + j)])
        w2 = u32_as_f32(smem[ww + np.uint32(8 + j)])
        w3 = u32_as_f32(smem[ww + np.uint32(12 + j)])
        return (a0 * w0, a0 * w1, a0 * w2, a0 * w3, a1 * w0, a1 * w1, a1 * w2, a1 * w3)

    @device_function(**INLINE)
    def _load(smem, so, x32, w32, sx32, sw32, kt, K16, xo, wo, off0, tid, sxo, swo, T, NB):
        """cp.async k tile kt into the stage at ring byte so: x's rows from chunk offsets xo (row x
        K/16, one a pass), w's from wo, and (threads 0..131) the tile's scales from rows sxo / swo.
        Rows past T or N are clamped to the last row, not zero-filled: they only feed output rows or
        columns that are never stored. The k chunks past K are zero-filled (their scales are 0)."""
        kq = np.uint32(kt * np.uint32(8) + (np.uint32(tid) & np.uint32(7)))
        ks = U16 if kq < K16 else U0
        kc = np.uint32(min(kq, np.uint32(K16 - np.uint32(1))))
        if tid < BM:
            cp_async_16(smem, so + np.uint32(A_BYTES + B_BYTES + 16 * tid), sx32, np.uint32(kt * T + sxo), U16)
        elif tid < BM + BN // BLOCK:
            cp_async_16(smem, so + np.uint32(A_BYTES + B_BYTES + SX_BYTES + 16 * (tid - BM)), sw32, np.uint32(kt * NB + swo), U16)
        xa, xb, xc, xd = xo
        wa, wb, wc, wd = wo
        sa = np.uint32(so + off0)
        sb = np.uint32(sa + np.uint32(A_BYTES))
        cp_async_16(smem, sa, x32, np.uint32(xa + kc), ks)
        cp_async_16(smem, sa + np.uint32(PASS), x32, np.uint32(xb + kc), ks)
        cp_async_16(smem, sa + np.uint32(2 * PASS), x32, np.uint32(xc + kc), ks)
        cp_async_16(smem, sa + np.uint32(3 * PASS), x32, np.uint32(xd + kc), ks)
        cp_async_16(smem, sb, w32, np.uint32(wa + kc), ks)
        cp_async_16(smem, sb + np.uint32(PASS), w32, np.uint32(wb + kc), ks)
        cp_async_16(smem, sb + np.uint32(2 * PASS), w32, np.uint32(wc + kc), ks)
        cp_async_16(smem, sb + np.uint32(3 * PASS), w32, np.uint32(wd + kc), ks)

    @cuda.jit(**bounds(THREADS, 1))
    def gemm_fp8_v5(x32, w32, sx32, sw32, out, T, K):
        # the arguments of v2/v3's kernel
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        wg = tid >> 7
        N = out.shape[1]
        K16 = np.uint32(K >> 4)
        NB = np.uint32((N + BLOCK - 1) // BLOCK)
        n_k = (K16 + np.uint32(7)) >> np.uint32(3)
        m0 = cuda.blockIdx.x * BM
        n0 = cuda.blockIdx.y * BN
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        padu = np.uint32(pad)
        row0 = tid >> 3
        q = tid & 7
        off0 = np.uint32(row0 * ROW_BYTES + ((q ^ (row0 & 7)) << 4))
        d_all = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        d_hi = d_all & np.uint64(0xFFFFFFFF00000000)
        d_lo = np.uint32(d_all & np.uint64(0xFFFFFFFF))
        a_wg16 = np.uint32(warp_uniform(wg) * (64 * ROW_BYTES // 16))     # the warpgroup's A rows, 16-byte units
        p = tid & 127
        r0 = wg * 64 + 16 * (p >> 5) + ((p & 31) >> 2)
        # the loader's per-thread chunk offsets (rows clamped to the last) and the scale rows it copies
        Tu = np.uint32(T)
        xr = m0 + row0
        wr = n0 + row0
        xo = (np.uint32(min(xr, T - 1)) * K16, np.uint32(min(xr + ROWS, T - 1)) * K16,
              np.uint32(min(xr + 2 * ROWS, T - 1)) * K16, np.uint32(min(xr + 3 * ROWS, T - 1)) * K16)
        wo = (np.uint32(min(wr, N - 1)) * K16, np.uint32(min(wr + ROWS, N - 1)) * K16,
              np.uint32(min(wr + 2 * ROWS, N - 1)) * K16, np.uint32(min(wr + 3 * ROWS, N - 1)) * K16)
        sxo = np.uint32(min(m0 + tid, T - 1))
        swo = np.uint32(max(0, min(n0 // BLOCK + tid - BM, (N + BLOCK - 1) // BLOCK - 1)))
        for s in range(STAGES - 1):
            if s < n_k:
                _load(smem, padu + np.uint32(s * STAGE_BYTES), x32, w32, sx32, sw32, np.uint32(s), K16, xo, wo, off0,
                      tid, sxo, swo, Tu, NB)
            cp_async_commit()

        xw0 = np.uint32(4 * r0)
        acc = ZERO
        pa = ZERO
        pb = ZERO
        so = np.uint32(0)                              # ring offset of stage kt
        lo = np.uint32((STAGES - 1) * STAGE_BYTES)     # ring offset of stage kt + STAGES - 1
        for kt in range(n_k):
            cp_wait()
            fence_proxy_async()
            cuda.syncthreads()
            # refill the slot of stage kt - 1 with tile kt + STAGES - 1 (every thread is past this
            # stage's barrier, so done with kt - 1: one barrier a stage)
            if not refill_under_mma:
                nk = np.uint32(kt) + np.uint32(STAGES - 1)
                if nk < n_k:
                    _load(smem, padu + lo, x32, w32, sx32, sw32, nk, K16, xo, wo, off0, tid, sxo, swo, Tu, NB)
                cp_async_commit()
            st = s0 + so
            xw = ((padu + so) >> np.uint32(2)) + np.uint32(SCW) + xw0
            ww = ((padu + so) >> np.uint32(2)) + np.uint32(SWW)
            # the descriptors' low words (start address, in 16-byte units, and the constant LBO; the
            # address field never carries: st + a stage < 2^18) advance by 32-bit adds a block
            da = np.uint32(np.uint32(d_lo | ((np.uint32(st) & np.uint32(0x3FFFF)) >> np.uint32(4))) + a_wg16)
            db = np.uint32(d_lo | ((np.uint32(st + A_BYTES) & np.uint32(0x3FFFF)) >> np.uint32(4)))
            pa = wgmma_fence(pa)
            pa = wgmma_e4m3(pa, d_hi | np.uint64(da), d_hi | np.uint64(db), smem)
            wgmma_commit()
            pb = wgmma_fence(pb)
            pb = wgmma_e4m3(pb, d_hi | np.uint64(np.uint32(da + np.uint32(K_STEP >> 4))),
                            d_hi | np.uint64(np.uint32(db + np.uint32(K_STEP >> 4))), smem)
            wgmma_commit()
            if refill_under_mma:
                nk = np.uint32(kt) + np.uint32(STAGES - 1)
                if nk < n_k:
                    _load(smem, padu + lo, x32, w32, sx32, sw32, nk, K16, xo, wo, off0, tid, sxo, swo, Tu, NB)
                cp_async_commit()
            sj = _scales5(smem, xw, ww, 0)
            pa = mma_wait1(pa)
            acc = fp8_promote(acc, pa, sj)
            pa = wgmma_fence(pa)
            pa = wgmma_e4m3(pa, d_hi | np.uint64(np.uint32(da + np.uint32(2 * K_STEP >> 4))),
                            d_hi | np.uint64(np.uint32(db + np.uint32(2 * K_STEP >> 4))), smem)
            wgmma_commit()
            sj = _scales5(smem, xw, ww, 1)
            pb = mma_wait1(pb)
            acc = fp8_promote(acc, pb, sj)
            pb = wgmma_fence(pb)
            pb = wgmma_e4m3(pb, d_hi | np.uint64(np.uint32(da + np.uint32(3 * K_STEP >> 4))),
                            d_hi | np.uint64(np.uint32(db + np.uint32(3 * K_STEP >> 4))), smem)
            wgmma_commit()
            sj = _scales5(smem, xw, ww, 2)
            pa = mma_wait1(pa)
            acc = fp8_promote(acc, pa, sj)
            sj = _scales5(smem, xw, ww, 3)
            pb = mma_wait0(pb)
            acc = fp8_promote(acc, pb, sj)
            so = so + np.uint32(STAGE_BYTES)
            if so == np.uint32(RING):
                so = np.uint32(0)
            lo = lo + np.uint32(STAGE_BYTES)
            if lo == np.uint32(RING):
                lo = np.uint32(0)
        cp_wait0()
        cuda.syncthreads()

        # epilogue (v3's)
        w4 = p >> 5
        lane = p & 31
        wbase = (pad >> 2) + (16 * w4 + (lane >> 2)) * STASH_STRIDE + (lane & 3) + wg * 64 * STASH_STRIDE
        wgmma_store_bf16x2(smem, wbase, STASH_STRIDE, acc)
        cuda.syncthreads()
        words = BN // 2
        for i in range(tid, BM * words, THREADS):
            r = i // words
            c = i - r * words
            t = m0 + r
            n = n0 + 2 * c
            if t < T and n < N:
                word = smem[(pad >> 2) + r * STASH_STRIDE + c]
                out[t, n] = np.uint16(word & np.uint32(0xFFFF))
                if n + 1 < N:
                    out[t, n + 1] = np.uint16(word >> np.uint32(16))

    return gemm_fp8_v5


# ---- gemm_fp8_v6: warp-specialised (a loader, two free-running MMA warpgroups) ----------------------
#
# v5's arithmetic, tile, ring layout and promotion, with the roles and hand-offs of gemm_v7
# (cuda_wgmma_ws.py): warpgroups 0 and 1 (threads 0..255) only multiply and promote, each on its own
# 64 token rows of the 128 x 128 tile; the loader warp(s) after them only copy (cp.async). Stages are
# handed over on named barriers instead of a block barrier: FULL_w[s] (one a warpgroup: the loader
# arrives once stage s has landed, warpgroup w syncs) and EMPTY[s] (both warpgroups arrive once their
# last read of stage s is done, the loader syncs before refilling it). So the two warpgroups never
# wait for each other and drift apart: one's promotion FFMAs issue while the other's MMA runs. bf16
# stored straight from the registers (no shared-memory staging: the other warpgroup may still be
# reading the ring).
# A warpgroup's k tile (`V6Variant`):
#   partials=1 (the record): per block: MMA into the partial tile, its scales read, wait_group 0,
#     promote. A loader warpgroup (4 warps, one a scheduler: its ~110 instructions a k tile spread).
#   partials=2: two partial tiles, block j+1's MMA in flight while block j is promoted (v5's chain),
#     one loader warp (288 threads: two partials need ~219 registers); pair: the chain runs on from
#     an even k tile into the next and drains after it (every tile otherwise). It cannot run on
#     across the loop edge: a wgmma in flight there makes ptxas serialize every wgmma (C7514).
# Pipeline (S stages, LAG = S - 2, as gemm_v7: a larger LAG deadlocks, since with pair a warpgroup
# releases tile kt only after FULL[kt + 1]):
#     loader, k tile g:                             MMA warpgroup w, k tile kt:
#       g >= S: sync EMPTY[g % S]                     sync FULL_w[kt % S]
#       cp.async tile g -> slot g % S; commit         its 4 blocks: MMA, wait, promote (as above)
#       g >= LAG: wait_group LAG; fence.proxy.async   arrive EMPTY[kt % S] once its last MMA retired
#         arrive FULL_0, FULL_1 [(g - LAG) % S]         and its scales are read
V6_CONSUMERS = 256                  # the two MMA warpgroups (a wgmma warpgroup starts at a warp index 4k)
V6_BAR_FULL0 = 1                    # FULL_w[s] = 1 + w * S + s, EMPTY[s] = 1 + 2 S + s: 3 S <= 15 barriers


@device_function(**INLINE)
def scale_products(a0, a1, w0, w1, w2, w3):
    """A thread's 8 scale products of one k block (fp32 values): (s_x[r0] * s_w[tiles 0..3], s_x[r0 + 8] *
    s_w[tiles 0..3]), the `scales` of `fp8_promote` on an m64n128 tile."""
    return (a0 * w0, a0 * w1, a0 * w2, a0 * w3, a1 * w0, a1 * w1, a1 * w2, a1 * w3)


@device_function(**INLINE)
def block_scales(smem, xw, ww, j):
    """v5's `_scales5` (v6 and v8): block j's `scale_products` read as words from a stage's scales, x's from
    word xw (the thread's row r0; row r0 + 8 eight rows on) and w's from word ww (4 tiles x 4 blocks)."""
    return scale_products(u32_as_f32(smem[xw + np.uint32(j)]), u32_as_f32(smem[xw + np.uint32(32 + j)]),
                          u32_as_f32(smem[ww + np.uint32(j)]), u32_as_f32(smem[ww + np.uint32(4 + j)]),
                          u32_as_f32(smem[ww + np.uint32(8 + j)]), u32_as_f32(smem[ww + np.uint32(12 + j)]))


class V6Variant:
    """A gemm_fp8_v6 specialisation: ring depth and loader warps."""

    def __init__(self, stages: int = 5, loader_warps: int = 1, pair: bool = True, partials: int = 2):
        assert 3 <= stages and 3 * stages <= 15 and loader_warps in (1, 2, 4) and partials in (1, 2)
        self.pair, self.partials = pair and partials == 2, partials
        assert stages * STAGE_BYTES + ALIGN_SLACK <= 227 * 1024
        self.stages, self.loader_warps = stages, loader_warps
        self.threads = V6_CONSUMERS + 32 * loader_warps
        self.smem_bytes = stages * STAGE_BYTES + ALIGN_SLACK
        self.name = (f"gemm_fp8_v6[s{stages}/l{loader_warps}/{'pair' if self.pair else 'tile'}"
                     + ("/p1]" if partials == 1 else "]"))


def make_kernel_v6(v: V6Variant = None):
    """gemm_fp8_v6's kernel for specialisation v (default: 5 stages, 1 loader warp)."""
    v = v or V6Variant()
    S, LOADERS, THREADS_6, PAIR, ONE_PARTIAL = v.stages, 32 * v.loader_warps, v.threads, v.pair, v.partials == 1
    LAG = S - 2
    K_STEP = 32
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    BAR_EMPTY0 = V6_BAR_FULL0 + 2 * S
    FULL_COUNT = 128 + LOADERS
    EMPTY_COUNT = V6_CONSUMERS + LOADERS
    cp_wait_lag = cp_async_waiter(LAG)
    cp_wait0 = cp_async_waiter(0)
    mma_wait0 = wgmma_waiter(0)
    mma_wait1 = wgmma_waiter(1)
    ROWS = LOADERS // 8                      # operand rows a loader pass (4 or 8)
    PASSES = BM // ROWS                      # passes an operand a stage (BM == BN)
    SX_CHUNKS = BM // LOADERS                # x scale chunks a loader thread a stage
    SCW = (A_BYTES + B_BYTES) // 4           # word of a stage's x scales within the stage
    SWW = (A_BYTES + B_BYTES + SX_BYTES) // 4
    RING = S * STAGE_BYTES
    assert BM == BN and BM % LOADERS == 0 and BN // BLOCK <= LOADERS
    U0 = np.uint32(0)
    U16 = np.uint32(16)

    _scales6 = block_scales

    @device_function(**INLINE)
    def _load6(smem, so, x32, w32, sx32, sw32, kt, K16, m0, n0, T, N, NB, lt):
        """The loader thread lt's cp.async of k tile kt into the stage at ring byte so: chunk q = lt % 8
        of operand rows lt // 8 + ROWS i (rows past T or N clamped to the last: they only feed
        outputs never stored; k chunks past K zero-filled), and the tile's scales (rows clamped)."""
        q = np.uint32(lt) & np.uint32(7)
        row0 = np.uint32(lt) >> np.uint32(3)
        kq = np.uint32(kt * np.uint32(8) + q)
        ks = U16 if kq < K16 else U0
        kc = np.uint32(min(kq, np.uint32(K16 - np.uint32(1))))
        for i in range(SX_CHUNKS):
            r = np.uint32(LOADERS * i) + np.uint32(lt)
            cp_async_16(smem, so + np.uint32(A_BYTES + B_BYTES) + r * U16, sx32,
                        np.uint32(kt * np.uint32(T) + np.uint32(min(np.uint32(m0) + r, np.uint32(T - 1)))), U16)
        if lt < BN // BLOCK:
            cp_async_16(smem, so + np.uint32(A_BYTES + B_BYTES + SX_BYTES) + np.uint32(lt) * U16, sw32,
                        np.uint32(kt * NB + np.uint32(min(np.uint32(n0 // BLOCK + lt), NB - np.uint32(1)))), U16)
        sw0 = (q ^ (row0 & np.uint32(7))) << np.uint32(4)
        sw1 = (q ^ ((row0 + np.uint32(4)) & np.uint32(7))) << np.uint32(4)
        d0 = so + row0 * np.uint32(ROW_BYTES)
        if np.uint32(m0 + BM) <= np.uint32(T) and np.uint32(n0 + BN) <= np.uint32(N):
            # a whole tile (every CTA at T = 4096): rows in steps of ROWS, running source offsets
            K16s = np.uint32(ROWS) * K16
            xs = (np.uint32(m0) + row0) * K16 + kc
            ws = (np.uint32(n0) + row0) * K16 + kc
            for i in range(PASSES):
                dst = d0 + np.uint32(ROWS * ROW_BYTES * i) + (sw1 if (ROWS * i) & 4 else sw0)
                cp_async_16(smem, dst, x32, xs, ks)
                cp_async_16(smem, dst + np.uint32(A_BYTES), w32, ws, ks)
                xs += K16s
                ws += K16s
        else:                           # rows past T or N clamped to the last
            Tl = np.uint32(T - 1)
            Nl = np.uint32(N - 1)
            for i in range(PASSES):
                rr = row0 + np.uint32(ROWS * i)
                dst = d0 + np.uint32(ROWS * ROW_BYTES * i) + (sw1 if (ROWS * i) & 4 else sw0)
                cp_async_16(smem, dst, x32, np.uint32(min(np.uint32(m0) + rr, Tl) * K16 + kc), ks)
                cp_async_16(smem, dst + np.uint32(A_BYTES), w32, np.uint32(min(np.uint32(n0) + rr, Nl) * K16 + kc), ks)

    @device_function(**INLINE)
    def _open6(smem, pa, bar, s0, so, d_hi, d_lo, a_wg16):
        """Wait for the k tile at ring offset so (its FULL barrier bar) and issue its block 0 into pa;
        returns pa and the tile's descriptor low words."""
        named_barrier_sync(bar, FULL_COUNT)
        st = np.uint32(s0) + so
        da = np.uint32(np.uint32(d_lo | ((st & np.uint32(0x3FFFF)) >> np.uint32(4))) + a_wg16)
        db = np.uint32(d_lo | (((st + np.uint32(A_BYTES)) & np.uint32(0x3FFFF)) >> np.uint32(4)))
        pa = wgmma_fence(pa)
        pa = wgmma_e4m3(pa, d_hi | np.uint64(da), d_hi | np.uint64(db), smem)
        wgmma_commit()
        return pa, da, db

    @device_function(**INLINE)
    def _next6(so, slot):
        """The ring offset and slot of the next k tile."""
        so = so + np.uint32(STAGE_BYTES)
        if so == np.uint32(RING):
            so = np.uint32(0)
        slot = slot + 1
        if slot == S:
            slot = 0
        return so, slot

    @device_function(**INLINE)
    def _block6(smem, acc, pa, d_hi, da, db, xw, ww, j):
        """One partial tile: block j's MMA, its scales read under it, the wait, the promotion."""
        pa = wgmma_fence(pa)
        pa = wgmma_e4m3(pa, d_hi | np.uint64(np.uint32(da + np.uint32(j * (K_STEP >> 4)))),
                        d_hi | np.uint64(np.uint32(db + np.uint32(j * (K_STEP >> 4)))), smem)
        wgmma_commit()
        sj = _scales6(smem, xw, ww, j)
        pa = mma_wait0(pa)
        return fp8_promote(acc, pa, sj), pa

    @device_function(**INLINE)
    def _stage6(smem, acc, pa, pb, d_hi, da, db, so, padu, xw0):
        """A warpgroup's k tile at ring offset so whose block 0 is in flight in pa (descriptor words da,
        db): issue blocks 1..3, promote blocks 0..2 each after the next block's MMA is issued, and
        return block 3's scales (block 3 is in flight in pb)."""
        xw = ((padu + so) >> np.uint32(2)) + np.uint32(SCW) + xw0
        ww = ((padu + so) >> np.uint32(2)) + np.uint32(SWW)
        pb = wgmma_fence(pb)
        pb = wgmma_e4m3(pb, d_hi | np.uint64(np.uint32(da + np.uint32(K_STEP >> 4))),
                        d_hi | np.uint64(np.uint32(db + np.uint32(K_STEP >> 4))), smem)
        wgmma_commit()
        sj = _scales6(smem, xw, ww, 0)
        pa = mma_wait1(pa)
        acc = fp8_promote(acc, pa, sj)
        pa = wgmma_fence(pa)
        pa = wgmma_e4m3(pa, d_hi | np.uint64(np.uint32(da + np.uint32(2 * K_STEP >> 4))),
                        d_hi | np.uint64(np.uint32(db + np.uint32(2 * K_STEP >> 4))), smem)
        wgmma_commit()
        sj = _scales6(smem, xw, ww, 1)
        pb = mma_wait1(pb)
        acc = fp8_promote(acc, pb, sj)
        pb = wgmma_fence(pb)
        pb = wgmma_e4m3(pb, d_hi | np.uint64(np.uint32(da + np.uint32(3 * K_STEP >> 4))),
                        d_hi | np.uint64(np.uint32(db + np.uint32(3 * K_STEP >> 4))), smem)
        wgmma_commit()
        sj = _scales6(smem, xw, ww, 2)
        pa = mma_wait1(pa)
        acc = fp8_promote(acc, pa, sj)
        return acc, pa, pb, _scales6(smem, xw, ww, 3)

    @cuda.jit(**register_cap(THREADS_6))
    def gemm_fp8_v6(x32, w32, sx32, sw32, out, T, K):
        # the arguments of v2..v5's kernel
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        wg = warp_uniform(tid >> 7)                  # 0, 1: MMA warpgroups; 2: the loader warp(s)
        N = out.shape[1]
        K16 = np.uint32(K >> 4)
        NB = np.uint32((N + BLOCK - 1) // BLOCK)
        n_k = (K16 + np.uint32(7)) >> np.uint32(3)
        m0 = cuda.blockIdx.x * BM
        n0 = cuda.blockIdx.y * BN
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        padu = np.uint32(pad)
        if wg == 2:
            # ---- the loader ----
            lt = tid - V6_CONSUMERS
            so = padu
            for g in range(n_k):
                slot = g % S
                if g >= S:
                    named_barrier_sync(BAR_EMPTY0 + slot, EMPTY_COUNT)
                _load6(smem, so, x32, w32, sx32, sw32, np.uint32(g), K16, m0, n0, T, N, NB, lt)
                cp_async_commit()
                if g >= LAG:
                    cp_wait_lag()
                    fence_proxy_async()
                    f = (g - LAG) % S
                    named_barrier_arrive(V6_BAR_FULL0 + f, FULL_COUNT)
                    named_barrier_arrive(V6_BAR_FULL0 + S + f, FULL_COUNT)
                so = so + np.uint32(STAGE_BYTES)
                if so == padu + np.uint32(RING):
                    so = padu
            cp_wait0()
            fence_proxy_async()
            nk = np.int32(n_k)                           # signed: n_k - LAG may be negative
            for j in range(max(nk - LAG, 0), nk):
                named_barrier_arrive(V6_BAR_FULL0 + j % S, FULL_COUNT)
                named_barrier_arrive(V6_BAR_FULL0 + S + j % S, FULL_COUNT)
            # every stage is released once: take the releases no refill waited for
            for j in range(max(nk - S, 0), nk):
                named_barrier_sync(BAR_EMPTY0 + j % S, EMPTY_COUNT)
        else:
            # ---- the two MMA warpgroups: 64 token rows each ----
            full0 = V6_BAR_FULL0 + wg * S
            d_all = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
            d_hi = d_all & np.uint64(0xFFFFFFFF00000000)
            d_lo = np.uint32(d_all & np.uint64(0xFFFFFFFF))
            a_wg16 = np.uint32(wg * (64 * ROW_BYTES // 16))     # the warpgroup's A rows, 16-byte units
            p = tid & 127
            r0 = wg * 64 + 16 * (p >> 5) + ((p & 31) >> 2)
            xw0 = np.uint32(4 * r0)
            acc = ZERO
            pa = ZERO
            pb = ZERO
            so = np.uint32(0)                                    # ring offset of k tile kt
            slot = 0
            if ONE_PARTIAL:
                # one partial tile: each block's MMA, wait, promote; the other warpgroup's MMAs
                # fill the wait (DeepGEMM's two math warpgroups), and the accumulator and one
                # partial fit the 168 registers of a 384-thread block (a loader warpgroup)
                for kt in range(n_k):
                    named_barrier_sync(full0 + slot, FULL_COUNT)
                    st = np.uint32(s0) + so
                    da = np.uint32(np.uint32(d_lo | ((st & np.uint32(0x3FFFF)) >> np.uint32(4))) + a_wg16)
                    db = np.uint32(d_lo | (((st + np.uint32(A_BYTES)) & np.uint32(0x3FFFF)) >> np.uint32(4)))
                    xw = ((padu + so) >> np.uint32(2)) + np.uint32(SCW) + xw0
                    ww = ((padu + so) >> np.uint32(2)) + np.uint32(SWW)
                    # the 4 blocks written out (a loop ptxas keeps rolled costs ~10 instructions a block)
                    acc, pa = _block6(smem, acc, pa, d_hi, da, db, xw, ww, 0)
                    acc, pa = _block6(smem, acc, pa, d_hi, da, db, xw, ww, 1)
                    acc, pa = _block6(smem, acc, pa, d_hi, da, db, xw, ww, 2)
                    acc, pa = _block6(smem, acc, pa, d_hi, da, db, xw, ww, 3)
                    named_barrier_arrive(BAR_EMPTY0 + slot, EMPTY_COUNT)
                    so, slot = _next6(so, slot)
                lane = p & 31
                acc_store_bf16(out, acc, m0 + r0, n0 + 2 * (lane & 3), T, N, (N & 1) == 0)
                return
            # k tiles in pairs (PAIR): the chain runs on from a pair's first tile into its second;
            # it is drained at the end of every loop iteration, since a wgmma in flight across a loop
            # edge leaves ptxas serializing every wgmma (C7514)
            for it in range(n_k >> np.uint32(1) if PAIR else n_k):
                pa, da, db = _open6(smem, pa, full0 + slot, s0, so, d_hi, d_lo, a_wg16)
                acc, pa, pb, sj = _stage6(smem, acc, pa, pb, d_hi, da, db, so, padu, xw0)
                so, nslot = _next6(so, slot)
                if PAIR:
                    pa, da, db = _open6(smem, pa, full0 + nslot, s0, so, d_hi, d_lo, a_wg16)
                    pb = mma_wait1(pb)
                    acc = fp8_promote(acc, pb, sj)
                    named_barrier_arrive(BAR_EMPTY0 + slot, EMPTY_COUNT)
                    slot = nslot
                    acc, pa, pb, sj = _stage6(smem, acc, pa, pb, d_hi, da, db, so, padu, xw0)
                    so, nslot = _next6(so, slot)
                pb = mma_wait0(pb)
                acc = fp8_promote(acc, pb, sj)
                named_barrier_arrive(BAR_EMPTY0 + slot, EMPTY_COUNT)
                slot = nslot
            if PAIR and (n_k & np.uint32(1)):                   # an odd last k tile
                pa, da, db = _open6(smem, pa, full0 + slot, s0, so, d_hi, d_lo, a_wg16)
                acc, pa, pb, sj = _stage6(smem, acc, pa, pb, d_hi, da, db, so, padu, xw0)
                pb = mma_wait0(pb)
                acc = fp8_promote(acc, pb, sj)
                named_barrier_arrive(BAR_EMPTY0 + slot, EMPTY_COUNT)
            lane = p & 31
            acc_store_bf16(out, acc, m0 + r0, n0 + 2 * (lane & 3), T, N, (N & 1) == 0)

    return gemm_fp8_v6


# ---- gemm_fp8_v7: v6's roles, the scale products made by the loader, a persistent grid ---------------
#
# v6's loader warpgroup and two free-running MMA warpgroups on named barriers, and the same MMAs and
# promotion (so the same outputs, bit for bit), with two changes where v6 spends issue slots or idles,
# and a third as a specialisation:
# - the scale products: per block v6's MMA warps read 6 scales (LDS) and multiply 8 products (FMUL)
#   for the 64 FFMA of the promotion. In v7 the loader makes them once a k tile: each loader thread
#   (one token row of the tile) reads its row's 4 x scales and the tile's 4 x 4 w scales from global
#   memory (plain loads, issued one k tile ahead, so their latency is hidden by the next tile's
#   copies), multiplies the 16 products s_x * s_w (the same fp32 products v5 forms) and stores them
#   into the stage, laid out [block j][token row][w tile]: an MMA thread reads a block's 8 products
#   as two 16-byte loads (rows r0 and r0 + 8). The stores follow the EMPTY sync that frees the slot
#   and precede the FULL arrive that publishes it (a barrier orders the arriving thread's earlier
#   shared-memory stores for the threads that sync on it). The raw scales are no longer staged.
# - a persistent grid (`V7Variant.persistent`): min(tiles, SMs) CTAs, CTA c takes output tiles
#   c, c + grid, ... (token tile fastest, so the CTAs in flight share a few weight tiles: each weight
#   tile comes from HBM about once, x stays in L2). The loader's k-tile stream runs on from one tile
#   into the next, so the ring never drains: while the MMA warpgroups store a tile's bf16 outputs from
#   registers, the next tile's first stages are already landing; the prologue is paid once per CTA.
#   (persistent=False: the same kernel on one CTA a tile.)
# - `V7Variant.split` (a candidate, not the record): two partial tiles a warpgroup within the 168
#   registers of 384 threads, by splitting each block's m64n128k32 into two m64n64k32 (the 64 output
#   columns of each half): half 1's MMA runs while half 0 is promoted, and half 0 of the next block
#   runs while half 1 is promoted (wait_group 1), drained at the end of a k tile (a chain across the
#   loop edge serializes every wgmma: C7514). Each output's 32-term sum is the same MMA column; the
#   simulator's sums are identical; on the GPU the n64 and n128 MMAs are expected to sum a column alike
#   (tools/fp8_dev.py compares the outputs with v6's bit for bit). Twice the A-operand reads from
#   shared memory.
# What was not done: setmaxnreg to give the loader's registers to the MMA warpgroups (ptxas ignores it
# under numba's relocatable nvJitLink link: C7504, see gemm_fp8_v4's notes). The one-loader-warp shapes
# of v6 (288 threads) cannot launch with more than 168 registers a thread: the register file is split
# over the 4 schedulers (16384 registers each) and one of them holds 3 of the 9 warps (3 x 32 x 168 <=
# 16384 < 3 x 32 x 176), whatever 65536 / 288 suggests.
V7_LOADERS = 128
V7_THREADS = V6_CONSUMERS + V7_LOADERS
V7_PROD_BYTES = SCALE_K * BM * (BN // BLOCK) * 4        # products [4 blocks][128 rows][4 w tiles] fp32
V7_STAGE_BYTES = A_BYTES + B_BYTES + V7_PROD_BYTES      # 40 KiB (atoms stay 1024-aligned)
assert V7_STAGE_BYTES % 1024 == 0


class V7Variant:
    """A gemm_fp8_v7 specialisation: ring depth, persistent grid, split MMAs (two n64 partial tiles)."""

    def __init__(self, stages: int = 5, persistent: bool = True, split: bool = False):
        assert 3 <= stages and 3 * stages <= 15
        assert stages * V7_STAGE_BYTES + ALIGN_SLACK <= 227 * 1024
        self.stages, self.persistent, self.split = stages, persistent, split
        self.threads = V7_THREADS
        self.smem_bytes = stages * V7_STAGE_BYTES + ALIGN_SLACK
        self.name = f"gemm_fp8_v7[s{stages}/{'persist' if persistent else 'grid'}/{'n64x2' if split else 'n128'}]"


# the simulator runs CTAs one after another: a small persistent grid there, so that CTAs take several tiles
V7_SIM_CTAS = 2


def v7_ctas(tiles: int, v: V7Variant) -> int:
    """CTAs of a v7 launch over `tiles` output tiles: one a tile, or (persistent) one an SM at most."""
    if not v.persistent:
        return tiles
    if SIMULATOR:
        return min(tiles, V7_SIM_CTAS)
    return min(tiles, cuda.get_current_device().MULTIPROCESSOR_COUNT)


def make_kernel_v7(v: V7Variant = None):
    """gemm_fp8_v7's kernel for specialisation v (default: the record, 5 stages, persistent, n128)."""
    v = v or V7Variant()
    S, SPLIT = v.stages, v.split
    LAG = S - 2
    K_STEP16 = 32 >> 4                       # a k32 step in the descriptor's 16-byte units
    HALF_B16 = (64 * ROW_BYTES) >> 4         # B rows 64..127 (the second n64 half), 16-byte units
    NA = NACC // 2 if SPLIT else NACC
    ZERO = tuple(np.float32(0.0) for _ in range(NA))
    BAR_EMPTY0 = V6_BAR_FULL0 + 2 * S
    FULL_COUNT = 128 + V7_LOADERS
    EMPTY_COUNT = V6_CONSUMERS + V7_LOADERS
    cp_wait_lag = cp_async_waiter(LAG)
    cp_wait0 = cp_async_waiter(0)
    mma_wait0 = wgmma_waiter(0)
    mma_wait1 = wgmma_waiter(1)
    ROWS = V7_LOADERS // 8                   # operand rows a loader pass (16)
    PASSES = BM // ROWS                      # passes an operand a stage (8)
    PCH = (A_BYTES + B_BYTES) // 16          # 16-byte chunk of a stage's products within the stage
    RING = S * V7_STAGE_BYTES
    assert BM == BN == V7_LOADERS and BN // BLOCK == 4
    U0 = np.uint32(0)
    U16 = np.uint32(16)

    @device_function(**INLINE)
    def _origin7(tile, n_mt):
        """(first token row, first output) of output tile `tile`, token tiles fastest (uint32)."""
        nt = udiv32(tile, n_mt)
        return np.uint32((tile - nt * n_mt) * np.uint32(BM)), np.uint32(nt * np.uint32(BN))

    @device_function(**INLINE)
    def _copy7(smem, so, x32, w32, kt, K16, m0, n0, T, N, lt):
        """v6's `_load6` without the scales: loader thread lt's cp.async of k tile kt's operands into
        the stage at ring byte so (rows past T or N clamped to the last, k chunks past K zero-filled)."""
        q = np.uint32(lt) & np.uint32(7)
        row0 = np.uint32(lt) >> np.uint32(3)
        kq = np.uint32(kt * np.uint32(8) + q)
        ks = U16 if kq < K16 else U0
        kc = np.uint32(min(kq, np.uint32(K16 - np.uint32(1))))
        sw = (q ^ (row0 & np.uint32(7))) << np.uint32(4)       # ROWS = 16: every pass has row0's phase
        d0 = so + row0 * np.uint32(ROW_BYTES) + sw
        if np.uint32(m0 + BM) <= np.uint32(T) and np.uint32(n0 + BN) <= np.uint32(N):
            K16s = np.uint32(ROWS) * K16
            xs = (np.uint32(m0) + row0) * K16 + kc
            ws = (np.uint32(n0) + row0) * K16 + kc
            for i in range(PASSES):
                dst = d0 + np.uint32(ROWS * ROW_BYTES * i)
                cp_async_16(smem, dst, x32, xs, ks)
                cp_async_16(smem, dst + np.uint32(A_BYTES), w32, ws, ks)
                xs += K16s
                ws += K16s
        else:
            Tl = np.uint32(T - 1)
            Nl = np.uint32(N - 1)
            for i in range(PASSES):
                rr = row0 + np.uint32(ROWS * i)
                dst = d0 + np.uint32(ROWS * ROW_BYTES * i)
                cp_async_16(smem, dst, x32, np.uint32(min(np.uint32(m0) + rr, Tl) * K16 + kc), ks)
                cp_async_16(smem, dst + np.uint32(A_BYTES), w32, np.uint32(min(np.uint32(n0) + rr, Nl) * K16 + kc), ks)

    @device_function(**INLINE)
    def _rows7(m0, n0, T, NB, lt):
        """Loader thread lt's scale rows in an output tile: its token row (past T clamped to the last)
        and the tile's 4 w tiles (past N clamped), uint32, computed once a tile."""
        Nl = NB - np.uint32(1)
        nb = np.uint32(n0 >> np.uint32(5))
        return (np.uint32(min(np.uint32(m0 + np.uint32(lt)), np.uint32(T - 1))),
                np.uint32(min(nb, Nl)), np.uint32(min(np.uint32(nb + np.uint32(1)), Nl)),
                np.uint32(min(np.uint32(nb + np.uint32(2)), Nl)), np.uint32(min(np.uint32(nb + np.uint32(3)), Nl)))

    @device_function(**INLINE)
    def _scales7(sx32, sw32, kt, T, NB, rows):
        """k tile kt's scales for a loader thread whose scale rows are `rows` (`_rows7`): its token row's
        4 and the 4 w tiles' 4 each, as fp32 bits (plain global loads: not waited for here)."""
        xr, r0, r1, r2, r3 = rows
        xo = np.uint32(kt * np.uint32(T))
        wo = np.uint32(kt * NB)
        xs = load_u32x4(sx32, np.uint32(xo + xr))
        w0 = load_u32x4(sw32, np.uint32(wo + r0))
        w1 = load_u32x4(sw32, np.uint32(wo + r1))
        w2 = load_u32x4(sw32, np.uint32(wo + r2))
        w3 = load_u32x4(sw32, np.uint32(wo + r3))
        return xs, (w0, w1, w2, w3)

    @device_function(**INLINE)
    def _product_chunk(smem, ch, x, w0, w1, w2, w3):
        a = u32_as_f32(x)
        store_u32x4(smem, ch, f32_as_u32(a * u32_as_f32(w0)), f32_as_u32(a * u32_as_f32(w1)),
                    f32_as_u32(a * u32_as_f32(w2)), f32_as_u32(a * u32_as_f32(w3)))

    @device_function(**INLINE)
    def _products7(smem, so, padu, xs, ws, lt):
        """The stage's products for token row lt: chunk [j][lt] = s_x[lt, j] * s_w[tiles 0..3, j]."""
        ch = ((padu + so) >> np.uint32(4)) + np.uint32(PCH) + np.uint32(lt)
        wa, wb, wc, wd = ws
        _product_chunk(smem, ch, xs[0], wa[0], wb[0], wc[0], wd[0])
        _product_chunk(smem, ch + np.uint32(BM), xs[1], wa[1], wb[1], wc[1], wd[1])
        _product_chunk(smem, ch + np.uint32(2 * BM), xs[2], wa[2], wb[2], wc[2], wd[2])
        _product_chunk(smem, ch + np.uint32(3 * BM), xs[3], wa[3], wb[3], wc[3], wd[3])

    @device_function(**INLINE)
    def _prods(smem, pch, j):
        """Block j's 8 products of this thread: (s_x[r0] * s_w[0..3], s_x[r0 + 8] * s_w[0..3]); pch is
        the chunk of row r0, block 0."""
        a0, a1, a2, a3 = load_u32x4(smem, pch + np.uint32(BM * j))
        b0, b1, b2, b3 = load_u32x4(smem, pch + np.uint32(BM * j + 8))
        return (u32_as_f32(a0), u32_as_f32(a1), u32_as_f32(a2), u32_as_f32(a3),
                u32_as_f32(b0), u32_as_f32(b1), u32_as_f32(b2), u32_as_f32(b3))

    @device_function(**INLINE)
    def _block7(smem, acc, pa, d_hi, da, db, pch, j):
        """v6's `_block6` on the staged products: block j's MMA, its products read under it, the wait,
        the promotion."""
        pa = wgmma_fence(pa)
        pa = wgmma_e4m3(pa, d_hi | np.uint64(np.uint32(da + np.uint32(j * K_STEP16))),
                        d_hi | np.uint64(np.uint32(db + np.uint32(j * K_STEP16))), smem)
        wgmma_commit()
        sj = _prods(smem, pch, j)
        pa = mma_wait0(pa)
        return fp8_promote(acc, pa, sj), pa

    @device_function(**INLINE)
    def _mma_half(smem, p, d_hi, da, db, j, h):
        """Issue block j's MMA of output half h (B rows 64 h .. 64 h + 63) into the n64 partial p."""
        p = wgmma_fence(p)
        p = wgmma_e4m3(p, d_hi | np.uint64(np.uint32(da + np.uint32(j * K_STEP16))),
                       d_hi | np.uint64(np.uint32(db + np.uint32(j * K_STEP16 + h * HALF_B16))), smem)
        wgmma_commit()
        return p

    @device_function(**INLINE)
    def _tile_split(smem, acc0, acc1, pa, pb, d_hi, da, db, pch):
        """A k tile on two n64 partials: pa holds half 0, pb half 1; each half is promoted while the
        other's MMA runs; drained at the end (nothing in flight across the loop edge)."""
        pa = _mma_half(smem, pa, d_hi, da, db, 0, 0)
        pb = _mma_half(smem, pb, d_hi, da, db, 0, 1)
        s = _prods(smem, pch, 0)
        pa = mma_wait1(pa)
        acc0 = fp8_promote(acc0, pa, (s[0], s[1], s[4], s[5]))
        pa = _mma_half(smem, pa, d_hi, da, db, 1, 0)
        pb = mma_wait1(pb)
        acc1 = fp8_promote(acc1, pb, (s[2], s[3], s[6], s[7]))
        pb = _mma_half(smem, pb, d_hi, da, db, 1, 1)
        s = _prods(smem, pch, 1)
        pa = mma_wait1(pa)
        acc0 = fp8_promote(acc0, pa, (s[0], s[1], s[4], s[5]))
        pa = _mma_half(smem, pa, d_hi, da, db, 2, 0)
        pb = mma_wait1(pb)
        acc1 = fp8_promote(acc1, pb, (s[2], s[3], s[6], s[7]))
        pb = _mma_half(smem, pb, d_hi, da, db, 2, 1)
        s = _prods(smem, pch, 2)
        pa = mma_wait1(pa)
        acc0 = fp8_promote(acc0, pa, (s[0], s[1], s[4], s[5]))
        pa = _mma_half(smem, pa, d_hi, da, db, 3, 0)
        pb = mma_wait1(pb)
        acc1 = fp8_promote(acc1, pb, (s[2], s[3], s[6], s[7]))
        pb = _mma_half(smem, pb, d_hi, da, db, 3, 1)
        s = _prods(smem, pch, 3)
        pa = mma_wait1(pa)
        acc0 = fp8_promote(acc0, pa, (s[0], s[1], s[4], s[5]))
        pb = mma_wait0(pb)
        acc1 = fp8_promote(acc1, pb, (s[2], s[3], s[6], s[7]))
        return acc0, acc1, pa, pb

    @cuda.jit(**register_cap(V7_THREADS))
    def gemm_fp8_v7(x32, w32, sx32, sw32, out, T, K):
        # the arguments of v2..v6's kernel; grid: any number of CTAs <= the output tiles (v7_ctas)
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        wg = warp_uniform(tid >> 7)                  # 0, 1: MMA warpgroups; 2: the loader warpgroup
        N = out.shape[1]
        K16 = np.uint32(K >> 4)
        NB = np.uint32((N + BLOCK - 1) // BLOCK)
        n_k = (K16 + np.uint32(7)) >> np.uint32(3)
        n_mt = np.uint32((T + BM - 1) // BM)
        tiles = np.uint32(n_mt * np.uint32((N + BN - 1) // BN))
        c0 = np.uint32(cuda.blockIdx.x)
        step = np.uint32(cuda.gridDim.x)
        mine = udiv32(tiles - c0 + step - np.uint32(1), step)             # output tiles of this CTA
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        padu = np.uint32(pad)
        if wg == 2:
            # ---- the loader: one k-tile stream over all of this CTA's output tiles ----
            lt = tid - V6_CONSUMERS
            G = np.int32(mine * n_k)                                          # k tiles of this CTA
            tile = c0
            kt = np.uint32(0)
            m0, n0 = _origin7(tile, n_mt)
            rows = _rows7(m0, n0, T, NB, lt)
            xs, ws = _scales7(sx32, sw32, kt, T, NB, rows)
            so = np.uint32(0)                                                 # ring offset of k tile g
            slot = 0                                                          # its slot
            fs = 0                                                            # slot of k tile g - LAG
            for g in range(G):
                if g >= S:
                    named_barrier_sync(BAR_EMPTY0 + slot, EMPTY_COUNT)
                _copy7(smem, padu + so, x32, w32, kt, K16, m0, n0, T, N, lt)
                cp_async_commit()
                _products7(smem, so, padu, xs, ws, lt)
                kt = kt + np.uint32(1)                                        # the next k tile (of this
                if kt == n_k:                                                 # output tile or the next)
                    kt = np.uint32(0)
                    tile = np.uint32(tile + step)
                    m0, n0 = _origin7(tile, n_mt)
                    rows = _rows7(m0, n0, T, NB, lt)
                xs, ws = _scales7(sx32, sw32, kt, T, NB, rows)                 # clamped: in bounds past the last
                if g >= LAG:
                    cp_wait_lag()
                    fence_proxy_async()
                    named_barrier_arrive(V6_BAR_FULL0 + fs, FULL_COUNT)
                    named_barrier_arrive(V6_BAR_FULL0 + S + fs, FULL_COUNT)
                    fs = fs + 1
                    if fs == S:
                        fs = 0
                so = so + np.uint32(V7_STAGE_BYTES)
                if so == np.uint32(RING):
                    so = np.uint32(0)
                slot = slot + 1
                if slot == S:
                    slot = 0
            cp_wait0()
            fence_proxy_async()
            for j in range(max(G - LAG, 0), G):
                named_barrier_arrive(V6_BAR_FULL0 + j % S, FULL_COUNT)
                named_barrier_arrive(V6_BAR_FULL0 + S + j % S, FULL_COUNT)
            # every stage is released once: take the releases no refill waited for
            for j in range(max(G - S, 0), G):
                named_barrier_sync(BAR_EMPTY0 + j % S, EMPTY_COUNT)
        else:
            # ---- the two MMA warpgroups: 64 token rows each ----
            full0 = V6_BAR_FULL0 + wg * S
            d_all = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
            d_hi = d_all & np.uint64(0xFFFFFFFF00000000)
            d_lo = np.uint32(d_all & np.uint64(0xFFFFFFFF))
            a_wg16 = np.uint32(wg * (64 * ROW_BYTES // 16))     # the warpgroup's A rows, 16-byte units
            p = tid & 127
            r0 = wg * 64 + 16 * (p >> 5) + ((p & 31) >> 2)
            col = 2 * (p & 3)
            pairs = (N & 1) == 0
            pa = ZERO
            pb = ZERO
            so = np.uint32(0)
            slot = 0
            for i in range(mine):
                m0, n0 = _origin7(np.uint32(c0 + np.uint32(i) * step), n_mt)
                acc = ZERO
                acc1 = ZERO
                for kt in range(n_k):
                    named_barrier_sync(full0 + slot, FULL_COUNT)
                    st = np.uint32(s0) + so
                    da = np.uint32(np.uint32(d_lo | ((st & np.uint32(0x3FFFF)) >> np.uint32(4))) + a_wg16)
                    db = np.uint32(d_lo | (((st + np.uint32(A_BYTES)) & np.uint32(0x3FFFF)) >> np.uint32(4)))
                    pch = ((padu + so) >> np.uint32(4)) + np.uint32(PCH) + np.uint32(r0)
                    if SPLIT:
                        acc, acc1, pa, pb = _tile_split(smem, acc, acc1, pa, pb, d_hi, da, db, pch)
                    else:
                        acc, pa = _block7(smem, acc, pa, d_hi, da, db, pch, 0)
                        acc, pa = _block7(smem, acc, pa, d_hi, da, db, pch, 1)
                        acc, pa = _block7(smem, acc, pa, d_hi, da, db, pch, 2)
                        acc, pa = _block7(smem, acc, pa, d_hi, da, db, pch, 3)
                    named_barrier_arrive(BAR_EMPTY0 + slot, EMPTY_COUNT)
                    so = so + np.uint32(V7_STAGE_BYTES)
                    if so == np.uint32(RING):
                        so = np.uint32(0)
                    slot = slot + 1
                    if slot == S:
                        slot = 0
                acc_store_bf16(out, acc, m0 + r0, n0 + col, T, N, pairs)
                if SPLIT:
                    acc_store_bf16(out, acc1, m0 + r0, n0 + 64 + col, T, N, pairs)

    return gemm_fp8_v7


@cuda.jit
def gemm_fp8_naive(xq, codes, sx, sw, out):
    # xq: uint8 [T, K] e4m3 codes of x; codes: uint8 [N, K]; sx: float32 stage_scales_shape(T, K);
    # sw: float32 stage_scales_shape(ceil(N/32), K); out: uint16 [T, N]
    n, t = cuda.grid(2)
    T, K = xq.shape
    N = codes.shape[0]
    if n >= N or t >= T:
        return
    acc = np.float32(0.0)
    for b in range(K // BLOCK):
        partial = np.float32(0.0)
        for k in range(BLOCK * b, BLOCK * b + BLOCK):          # k in order inside the block
            partial += e4m3_to_f32(xq[t, k]) * e4m3_to_f32(codes[n, k])
        acc += (partial * sx[b >> 2, t, b & 3]) * sw[b >> 2, n // BLOCK, b & 3]   # blocks in K order
    out[t, n] = f32_to_bf16_bits(acc)


NAIVE_BLOCK = (32, 4)


def geometry_naive(T: int, N: int):
    return (cdiv(N, NAIVE_BLOCK[0]), cdiv(T, NAIVE_BLOCK[1])), NAIVE_BLOCK


KERNELS = {"gemm_fp8_v1": gemm_fp8_naive, "gemm_fp8_v2": make_kernel(False), "gemm_fp8_v3": make_kernel(True),
           "gemm_fp8_v4": make_kernel_v4(), "gemm_fp8_v5": make_kernel_v5()}
V6_VARIANTS = {"gemm_fp8_v6": V6Variant(5, 4, partials=1)}
# what tools/fp8_dev.py times beside the record (names are V6Variant.name)
V6_CANDIDATES = {v.name: v for v in (V6Variant(4, 4, partials=1), V6Variant(5, 1, True), V6Variant(5, 1, False),
                                      V6Variant(4, 1, True))}
_V6_KERNELS: dict = {}


def kernel_v6(v: V6Variant):
    """One kernel object a specialisation (numba compiles once a kernel object)."""
    if v.name not in _V6_KERNELS:
        _V6_KERNELS[v.name] = make_kernel_v6(v)
    return _V6_KERNELS[v.name]


KERNELS["gemm_fp8_v6"] = kernel_v6(V6_VARIANTS["gemm_fp8_v6"])

V7_VARIANTS = {"gemm_fp8_v7": V7Variant(5, persistent=True, split=False)}
# what tools/fp8_dev.py times beside the record (names are V7Variant.name): each lever alone
V7_CANDIDATES = {v.name: v for v in (V7Variant(5, persistent=False, split=False), V7Variant(5, True, split=True),
                                      V7Variant(5, False, split=True), V7Variant(4, True, split=False))}
_V7_KERNELS: dict = {}


def kernel_v7(v: V7Variant):
    """One kernel object a specialisation."""
    if v.name not in _V7_KERNELS:
        _V7_KERNELS[v.name] = make_kernel_v7(v)
    return _V7_KERNELS[v.name]


KERNELS["gemm_fp8_v7"] = kernel_v7(V7_VARIANTS["gemm_fp8_v7"])


def geometry(T: int, N: int):
    return (cdiv(T, BM), cdiv(N, BN)), THREADS, SMEM_BYTES


def geometry_v6(T: int, N: int, v: V6Variant = None):
    v = v or V6_VARIANTS["gemm_fp8_v6"]
    return (cdiv(T, BM), cdiv(N, BN)), v.threads, v.smem_bytes


def geometry_v7(T: int, N: int, v: V7Variant = None):
    v = v or V7_VARIANTS["gemm_fp8_v7"]
    return (v7_ctas(cdiv(T, BM) * cdiv(N, BN), v),), v.threads, v.smem_bytes


def geometry_v4(T: int, N: int):
    return (cdiv(T, BM), cdiv(N, BN)), 128 * 2 * (BN // V4_WG_N), V4_SMEM_BYTES


def act_quant_geometry(T: int, K: int):
    return cdiv(T * (K // BLOCK), AQ_THREADS), AQ_THREADS


# ---- launch ----------------------------------------------------------------------------------------

class Fp8GemmLaunch:
    """act_quant of x, then the FP8 GEMM, with their workspaces (x's codes and scales, the weight's
    scales as fp32) allocated at prepare; calling it launches both kernels and returns `out`."""

    __slots__ = ("name", "quant", "gemm", "out", "grid", "block", "x_codes", "x_scales", "w_scales")

    def __init__(self, name, quant, gemm, out, x_codes, x_scales, w_scales):
        self.name, self.quant, self.gemm, self.out = name, quant, gemm, out
        self.grid, self.block = gemm.grid, gemm.block
        self.x_codes, self.x_scales, self.w_scales = x_codes, x_scales, w_scales

    def __call__(self):
        self.quant()
        self.gemm()
        return self.out

    def __repr__(self) -> str:
        return f"Fp8GemmLaunch({self.name}: act_quant {self.quant.grid} + gemm {self.grid})"


def stage_scales_shape(rows: int, K: int) -> tuple:
    """Shape of a scale array in the GEMM's stage layout: [2 * ceil(K/256), rows, 4] float32, the scale
    of k block b of row r at [b // 4, r, b % 4] (zeros past K; an even number of 128-wide k tiles, so
    gemm_fp8_v4, which loads k tiles in pairs, reads zero scales for a last odd tile's partner)."""
    return (2 * cdiv(K, 2 * BK), rows, SCALE_K)


def scales_by_row(s3, K: int) -> np.ndarray:
    """A host scale array in the stage layout -> [rows, K/32] (row-major blocks, as act_quant_cpu's s)."""
    s3 = np.asarray(s3)
    rows = s3.shape[1]
    return np.ascontiguousarray(s3.transpose(1, 0, 2).reshape(rows, -1)[:, : K // BLOCK])


def _zeros(shape, stream):
    return cuda.to_device(np.zeros(shape, dtype=np.float32), stream=stream)


def prepare_act_quant(x, q_codes, x_scales, *, stream=0) -> PreparedLaunch:
    """act_quant of x (device uint16 [T, K] bf16 words, K % 32 == 0, 16-byte aligned) into q_codes
    (uint8 [T, K]) and x_scales (float32 `stage_scales_shape(T, K)`, zero-filled once by the caller:
    the padding past K is never written; `scales_by_row` turns it into [T, K/32])."""
    T, K = x.shape
    grid, block = act_quant_geometry(T, K)
    args = (x.view(np.uint32).reshape(T * K // 2), q_codes.view(np.uint32).reshape(T * K // 4), x_scales, T, K)
    return PreparedLaunch("act_quant", act_quant_kernel, grid, block, stream, args, (q_codes, x_scales))


def workspaces(rec, x, codes, scales, *, stream=0) -> tuple:
    """What every FP8 GEMM launch needs before its kernel: x, codes and scales checked for the alignment
    the kernels read them with, the workspaces (x's codes and scales, w's scales as fp32 in the stage
    layout: the e8m0 table kernel launched here) and act_quant's prepared launch:
    (quant, q_codes, x_scales, w_scales)."""
    from ...device.devarray import data_address
    T, K = x.shape
    if data_address(x) % 16:
        raise ValueError(f"{rec.name}: act_quant reads x as 16-byte chunks: x must be 16-byte aligned "
                         "(pass an aligned copy)")
    if rec.args != "naive" and data_address(codes) % 16:
        raise ValueError(f"{rec.name} reads the e4m3 codes as 16-byte chunks: they must be 16-byte aligned")
    q_codes = cuda.device_array((T, K), dtype=np.uint8, stream=stream)
    x_scales = _zeros(stage_scales_shape(T, K), stream)
    NB, KB = scales.shape
    w_scales = _zeros(stage_scales_shape(NB, K), stream)
    e8m0_table_kernel[cdiv(NB * KB, 256), 256, stream](scales, w_scales)
    return prepare_act_quant(x, q_codes, x_scales, stream=stream), q_codes, x_scales, w_scales


def check_out_words(rec, out) -> None:
    """The kernels that store bf16 pairs as 32-bit words need out 4-byte aligned."""
    from ...device.devarray import data_address
    if data_address(out) % 4:
        raise ValueError(f"{rec.name} stores bf16 pairs as 32-bit words: out must be 4-byte aligned")


def launcher(rec, x, codes, scales, out, *, stream=0) -> Fp8GemmLaunch:
    """The records' launcher of gemm_fp8_v1 .. v7 (`prepare_project_q(..., weight="fp8", version=...)` has
    checked the shapes: x [T, K] bf16, codes [N, K] uint8, scales [ceil(N/32), K/32] uint8, out [T, N]).
    The workspaces (`workspaces`) are allocated here, once per prepared launch."""
    T, K = x.shape
    N = codes.shape[0]
    if rec.name in ("gemm_fp8_v6", "gemm_fp8_v7"):
        check_out_words(rec, out)
    quant, q_codes, x_scales, w_scales = workspaces(rec, x, codes, scales, stream=stream)
    kernel = rec.kernel_for(T)
    if rec.args == "naive":
        grid, block = geometry_naive(T, N)
        gemm = PreparedLaunch(rec.name, kernel, grid, block, stream, (q_codes, codes, x_scales, w_scales, out), out)
        return Fp8GemmLaunch(rec.name, quant, gemm, out, q_codes, x_scales, w_scales)
    grid, block, smem = (geometry_v4 if rec.name == "gemm_fp8_v4" else geometry_v6 if rec.name == "gemm_fp8_v6"
                         else geometry_v7 if rec.name == "gemm_fp8_v7" else geometry)(T, N)
    args = (q_codes.view(np.uint32).reshape(T * K // 4), codes.view(np.uint32).reshape(N * K // 4),
            x_scales.view(np.uint32).reshape(x_scales.size), w_scales.view(np.uint32).reshape(w_scales.size),
            out, T, K)
    allow_dynamic_shared(kernel, args, smem)
    gemm = PreparedLaunch(rec.name, kernel, grid, block, stream, args, out, sharedmem=smem)
    return Fp8GemmLaunch(rec.name, quant, gemm, out, q_codes, x_scales, w_scales)
