"""The basic GPU-only helpers the kernels use, each with a simulator twin (the Hopper-only ones,
cp.async and wgmma, are in `engram_numba.device.hopper`; the proj stage's weight-decoding GEMV
helpers in `engram_numba.stages.proj.gemv_common`).

numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs kernels as Python threads: it has no warp
shuffles, no `syncwarp`, and libdevice bit casts such as `int_as_float` run there but return NaN.
So each helper below is defined twice, picked once at import by `config.ENABLE_CUDASIM`: a
numpy-scalar version for the simulator and a libdevice / shuffle / LLVM version for the GPU, with
the same contract; the other kernel modules use only these helpers, never the raw intrinsics. On
the GPU they are `@cuda.jit(device=True)` functions. In the simulator they are plain Python
functions (the simulator's device-function call costs 15-40 us, see `device_function`), except
`warp_sum` and `mma_bf16_16816`, which need the simulator's per-thread `cuda` module.

Contracts
- bf16 words are uint16 bit patterns; `bf16x2` words pack two of them in a uint32, the lower
  index in the low half (the little-endian layout of a uint16 array viewed as uint32).
- `f32_to_bf16_bits` rounds to nearest even (NaN -> quiet NaN), like torch and `cvt.rn.bf16.f32`.
- `mul_rn`/`add_rn`/`sub_rn` are fp32 operations that the compiler may not fuse into an FMA:
  the Q2_K decoder uses them to stay bit-exact with the numpy reference.
- `warp_sum(x, scratch)` sums x over the 32 lanes of each warp and returns the total to every
  lane. Every thread of the block must call it together (no divergence around the call).
  `scratch` is a float32 shared array with one slot per thread of the block; the GPU version does
  not touch it (shuffles), the simulator version reduces through it.
- `f16_bits_to_f32(bits)` widens an IEEE half (uint16 bits) exactly.
- `round_to_bf16(x)` is `bf16_bits_to_f32(f32_to_bf16_bits(x))` without a branch (for straight-line
  loops): fp32 -> the nearest-even bf16 value, still fp32; NaN stays NaN, quieted the same way.
- `load_u32x4(a, i)` reads a[4i:4i+4] of a 1-D uint32 array as one 16-byte load (a's data must be
  16-byte aligned, which every numba/CuPy/torch allocation is); `store_u32x4` writes likewise.
- `load_f32x4(a, i)` / `store_f32x4(a, i, v0, v1, v2, v3)`: the same 16-byte access for a 1-D
  float32 array, global or shared (a shared array's 16-byte vectors must start at a multiple of
  4 elements; ptxas turns them into LDS.128/STS.128). The index is not wrapped for negative values.
- `mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch)` is one warp-wide
  `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: D[16x8] = A[16x16] B[16x8] + C, fp32
  accumulation, returning this lane's (d0, d1, d2, d3). Fragments (lane g = lane >> 2, t = lane & 3;
  a/b are bf16x2 words, the lower k in the low half): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2],
  a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]; b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g] (so
  with B^T stored row-major [n, k], as a weight [N, K] is, b words are row g, word t and t+4, just
  like a's); c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1]. Every thread of the
  block must call it together (all 32 lanes of every warp, no divergence). `scratch` is a uint32
  shared array with 6 slots per thread of the block: the GPU ignores it (any size will do there),
  the simulator exchanges the fragments through it, sums the 16 exact products in float64, rounds
  that to fp32 and adds c in fp32 (the tensor core's summation order is unspecified: compare in
  ulps, not bits).
- `mma_f16_16816(...)` is the same mma on IEEE half operands
  (`mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`): a/b words are f16x2 (subnormals are
  operands like any other), the fragments, c/d and the simulator's float64 sum as above.
- `byte_perm(x, y, s)` is CUDA's `__byte_perm` (one PRMT): byte n of the uint32 result is byte
  `(s >> 4n) & 7` of the 8-byte value `y:x` (x = bytes 0-3); the upper 16 bits of s are ignored.
  The Q2_K decoder uses it as a 4-entry bf16 lookup table.
- `cvt_pack_bf16x2(lo, hi)` is `pack_bf16x2` in one instruction (`cvt.rn.bf16x2.f32`): the same
  round-to-nearest-even bits for every non-NaN input (subnormals kept, overflow to inf); a NaN
  becomes the canonical 0x7FFF (pack_bf16x2 keeps the payload, which on the GPU is canonical anyway).
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import config

SIMULATOR = bool(config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF


def device_function(fn=None, **options):
    """`@cuda.jit(device=True)` on the GPU; in the simulator, the plain Python function.

    The simulator wraps every call of a device function in a swap of its module's globals (a
    lock and a scan of the module dict), which costs 15-40 us a call: a kernel that calls small
    helpers in its inner loop then runs 10x slower than the same code called plainly. A plain
    function called from a simulated kernel of the same module sees the swapped `cuda` module
    too, so `cuda.threadIdx`, `cuda.shared.array` and `cuda.syncthreads` work in it. Use it for
    every helper defined next to the kernels that call it."""
    def wrap(f):
        return f if SIMULATOR else cuda.jit(device=True, **options)(f)
    return wrap(fn) if fn is not None else wrap


def _sim_twin(fn):
    # Simulator twins that touch no `cuda.*` API are plain functions (see device_function).
    return fn

if SIMULATOR:
    # ---- simulator twins: plain numpy scalars ------------------------------------------------

    _BF16_VALUES = (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)

    @_sim_twin
    def bf16_bits_to_f32(bits):
        return _BF16_VALUES[int(bits) & 0xFFFF]

    @_sim_twin
    def f32_to_bf16_bits(x):
        x = np.float32(x)
        u = np.array([x], dtype=np.float32).view(np.uint32)[0]
        if x != x:
            return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
        return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @_sim_twin
    def f32_as_u32(x):
        return np.array([np.float32(x)], dtype=np.float32).view(np.uint32)[0]

    @_sim_twin
    def u32_as_f32(u):
        return np.array([np.uint32(u)], dtype=np.uint32).view(np.float32)[0]

    @_sim_twin
    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    @_sim_twin
    def add_rn(a, b):
        return np.float32(np.float32(a) + np.float32(b))

    @_sim_twin
    def sub_rn(a, b):
        return np.float32(np.float32(a) - np.float32(b))

    @cuda.jit(device=True)
    def warp_sum(x, scratch):
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        scratch[tid] = np.float32(x)
        cuda.syncthreads()
        base = tid - tid % 32
        total = np.float32(0.0)
        for lane in range(32):
            total = np.float32(total + scratch[base + lane])
        cuda.syncthreads()
        return total

    @_sim_twin
    def load_u32x4(a, i):
        return a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]

    @_sim_twin
    def store_u32x4(a, i, v0, v1, v2, v3):
        a[4 * i] = v0
        a[4 * i + 1] = v1
        a[4 * i + 2] = v2
        a[4 * i + 3] = v3

    @_sim_twin
    def load_f32x4(a, i):
        return (np.float32(a[4 * i]), np.float32(a[4 * i + 1]), np.float32(a[4 * i + 2]),
                np.float32(a[4 * i + 3]))

    @_sim_twin
    def store_f32x4(a, i, v0, v1, v2, v3):
        a[4 * i] = v0
        a[4 * i + 1] = v1
        a[4 * i + 2] = v2
        a[4 * i + 3] = v3

    def _unpack_bf16(words):                            # bf16x2 words [r, 8] -> float64 [r, 16]
        halves = np.stack([words << np.uint32(16), words & np.uint32(0xFFFF0000)], axis=-1)
        return halves.reshape(words.shape[0], 16).view(np.float32).astype(np.float64)

    def _unpack_f16(words):                             # f16x2 words [r, 8] -> float64 [r, 16]
        return np.ascontiguousarray(words).view(np.float16).reshape(words.shape[0], 16).astype(np.float64)

    @cuda.jit(device=True)
    def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return _sim_mma_16816(_unpack_bf16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch)

    @cuda.jit(device=True)
    def mma_f16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return _sim_mma_16816(_unpack_f16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch)

    def _sim_mma_16816(unpack, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        lane = tid % 32
        base = 6 * (tid - lane)                         # the warp's 32 x 6 slots
        for q, v in enumerate((a0, a1, a2, a3, b0, b1)):
            scratch[6 * tid + q] = np.uint32(v)
        cuda.syncthreads()
        if lane == 0:
            # lane 0 rebuilds the warp's A [16, 16] and B^T [8, 16] from the fragments, multiplies
            # in float64 (the products are exact, the 16-term sums nearly so), and hands each lane
            # its four fp32 sums back through its own slots
            w = np.array(scratch[base:base + 192], dtype=np.uint32).reshape(8, 4, 6)   # [g, t, word]
            a_words = np.empty((16, 8), np.uint32)
            a_words[:8, :4], a_words[8:, :4] = w[:, :, 0], w[:, :, 1]
            a_words[:8, 4:], a_words[8:, 4:] = w[:, :, 2], w[:, :, 3]
            b_words = np.concatenate([w[:, :, 4], w[:, :, 5]], axis=1)                # [n, 8]
            prod = (unpack(a_words) @ unpack(b_words).T).astype(np.float32)           # [16, 8]
            frag = np.stack([prod[:8, 0::2], prod[:8, 1::2], prod[8:, 0::2], prod[8:, 1::2]], axis=-1)
            scratch[base:base + 192] = np.pad(frag.reshape(32, 4).view(np.uint32), ((0, 0), (0, 2))).ravel()
        cuda.syncthreads()
        out = []
        for q, c in enumerate((c0, c1, c2, c3)):
            p = np.array([scratch[6 * tid + q]], dtype=np.uint32).view(np.float32)[0]
            out.append(np.float32(np.float32(c) + p))
        return out[0], out[1], out[2], out[3]

    @_sim_twin
    def byte_perm(x, y, s):
        src = (int(np.uint32(y)) << 32) | int(np.uint32(x))
        sel = int(np.uint32(s))
        r = 0
        for n in range(4):
            r |= ((src >> (8 * ((sel >> (4 * n)) & 7))) & 0xFF) << (8 * n)
        return np.uint32(r)

    @_sim_twin
    def cvt_pack_bf16x2(lo, hi):
        lo_bits = np.uint32(0x7FFF) if lo != lo else np.uint32(f32_to_bf16_bits(lo))
        hi_bits = np.uint32(0x7FFF) if hi != hi else np.uint32(f32_to_bf16_bits(hi))
        return np.uint32(lo_bits | (hi_bits << np.uint32(16)))

else:
    # ---- GPU versions: libdevice, shuffles, and 16-byte vector memory ops --------------------
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    @cuda.jit(device=True)
    def f32_as_u32(x):
        return np.uint32(libdevice.float_as_int(np.float32(x)))

    @cuda.jit(device=True)
    def u32_as_f32(u):
        return libdevice.int_as_float(np.int32(u))

    @cuda.jit(device=True)
    def bf16_bits_to_f32(bits):
        return libdevice.int_as_float(np.int32(np.uint32(bits) << np.uint32(16)))

    @cuda.jit(device=True)
    def f32_to_bf16_bits(x):
        u = np.uint32(libdevice.float_as_int(np.float32(x)))
        if x != x:
            return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
        return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @cuda.jit(device=True)
    def mul_rn(a, b):
        return libdevice.fmul_rn(np.float32(a), np.float32(b))

    @cuda.jit(device=True)
    def add_rn(a, b):
        return libdevice.fadd_rn(np.float32(a), np.float32(b))

    @cuda.jit(device=True)
    def sub_rn(a, b):
        return libdevice.fsub_rn(np.float32(a), np.float32(b))

    @cuda.jit(device=True)
    def warp_sum(x, scratch):
        v = np.float32(x)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
        v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
        return v

    _V4 = ir.VectorType(ir.IntType(32), 4)

    def u32x4_pointer(context, builder, arrty, arr, idx):
        ary = cgutils.create_struct_proxy(arrty)(context, builder, value=arr)
        base = builder.bitcast(ary.data, _V4.as_pointer())
        return builder.gep(base, [idx])

    @intrinsic
    def _load_u32x4(typingctx, a, i):
        if not (isinstance(a, types.Array) and a.dtype == types.uint32 and a.ndim == 1
                and isinstance(i, types.Integer)):
            return None
        sig = types.UniTuple(types.uint32, 4)(a, i)

        def codegen(context, builder, signature, args):
            arr, idx = args
            idx = context.cast(builder, idx, signature.args[1], types.intp)
            ptr = u32x4_pointer(context, builder, signature.args[0], arr, idx)
            vec = builder.load(ptr, align=16)
            elems = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, elems)

        return sig, codegen

    @intrinsic
    def _store_u32x4(typingctx, a, i, v0, v1, v2, v3):
        if not (isinstance(a, types.Array) and a.dtype == types.uint32 and a.ndim == 1
                and isinstance(i, types.Integer)):
            return None
        sig = types.void(a, i, types.uint32, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            arr, idx = args[0], args[1]
            idx = context.cast(builder, idx, signature.args[1], types.intp)
            ptr = u32x4_pointer(context, builder, signature.args[0], arr, idx)
            vec = ir.Constant(_V4, ir.Undefined)
            for k in range(4):
                val = context.cast(builder, args[2 + k], signature.args[2 + k], types.uint32)
                vec = builder.insert_element(vec, val, ir.Constant(ir.IntType(32), k))
            builder.store(vec, ptr, align=16)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True)
    def load_u32x4(a, i):
        return _load_u32x4(a, i)

    @cuda.jit(device=True)
    def store_u32x4(a, i, v0, v1, v2, v3):
        _store_u32x4(a, i, np.uint32(v0), np.uint32(v1), np.uint32(v2), np.uint32(v3))

    _F4 = ir.VectorType(ir.FloatType(), 4)

    def _f32x4_pointer(context, builder, arrty, arr, idx):
        ary = cgutils.create_struct_proxy(arrty)(context, builder, value=arr)
        return builder.gep(builder.bitcast(ary.data, _F4.as_pointer()), [idx])

    @intrinsic
    def _load_f32x4(typingctx, a, i):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1
                and isinstance(i, types.Integer)):
            return None
        sig = types.UniTuple(types.float32, 4)(a, i)

        def codegen(context, builder, signature, args):
            arr, idx = args
            idx = context.cast(builder, idx, signature.args[1], types.intp)
            vec = builder.load(_f32x4_pointer(context, builder, signature.args[0], arr, idx), align=16)
            elems = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, elems)

        return sig, codegen

    @intrinsic
    def _store_f32x4(typingctx, a, i, v0, v1, v2, v3):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1
                and isinstance(i, types.Integer)):
            return None
        sig = types.void(a, i, types.float32, types.float32, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            arr, idx = args[0], args[1]
            idx = context.cast(builder, idx, signature.args[1], types.intp)
            vec = ir.Constant(_F4, ir.Undefined)
            for k in range(4):
                val = context.cast(builder, args[2 + k], signature.args[2 + k], types.float32)
                vec = builder.insert_element(vec, val, ir.Constant(ir.IntType(32), k))
            builder.store(vec, _f32x4_pointer(context, builder, signature.args[0], arr, idx), align=16)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True)
    def load_f32x4(a, i):
        return _load_f32x4(a, i)

    @cuda.jit(device=True)
    def store_f32x4(a, i, v0, v1, v2, v3):
        _store_f32x4(a, i, np.float32(v0), np.float32(v1), np.float32(v2), np.float32(v3))

    _MMA_16816 = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                  "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    @intrinsic
    def _mma_bf16_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if not (all(v == types.uint32 for v in (a0, a1, a2, a3, b0, b1))
                and all(v == types.float32 for v in (c0, c1, c2, c3))):
            return None
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, signature, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty, _MMA_16816, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, list(args))
            elems = [builder.extract_value(res, k) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, elems)

        return sig, codegen

    @cuda.jit(device=True)
    def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return _mma_bf16_16816(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3),
                               np.uint32(b0), np.uint32(b1), np.float32(c0), np.float32(c1),
                               np.float32(c2), np.float32(c3))

    @intrinsic
    def _mma_f16_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if not (all(v == types.uint32 for v in (a0, a1, a2, a3, b0, b1))
                and all(v == types.float32 for v in (c0, c1, c2, c3))):
            return None
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, signature, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty, _MMA_16816.replace(".bf16.bf16.", ".f16.f16."), "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, list(args))
            elems = [builder.extract_value(res, k) for k in range(4)]
            return context.make_tuple(builder, signature.return_type, elems)

        return sig, codegen

    @cuda.jit(device=True)
    def mma_f16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return _mma_f16_16816(np.uint32(a0), np.uint32(a1), np.uint32(a2), np.uint32(a3),
                              np.uint32(b0), np.uint32(b1), np.float32(c0), np.float32(c1),
                              np.float32(c2), np.float32(c3))

    @cuda.jit(device=True)
    def byte_perm(x, y, s):
        return np.uint32(libdevice.byte_perm(np.int32(np.uint32(x)), np.int32(np.uint32(y)),
                                             np.int32(np.uint32(s))))

    @intrinsic
    def _cvt_rn_bf16x2_f32(typingctx, hi, lo):
        if not (hi == types.float32 and lo == types.float32):
            return None
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            # PTX packs its first source into the upper half
            asm = ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, list(args))

        return sig, codegen

    @cuda.jit(device=True)
    def cvt_pack_bf16x2(lo, hi):
        return _cvt_rn_bf16x2_f32(np.float32(hi), np.float32(lo))


@device_function
def f16_bits_to_f32(bits):
    """IEEE fp16 bit pattern (uint16) -> fp32, exact, including subnormals, inf and NaN.

    Integer arithmetic plus one bit cast, so it needs no fp16 hardware path and matches
    numpy's float16 -> float32 conversion bit for bit."""
    b = np.uint32(bits)
    sign = (b >> np.uint32(15)) & np.uint32(1)
    exp = (b >> np.uint32(10)) & np.uint32(0x1F)
    man = b & np.uint32(0x3FF)
    if exp == 0:
        val = np.float32(man) * np.float32(5.960464477539063e-08)  # man * 2^-24, exact
    elif exp == 31:
        val = u32_as_f32(np.uint32(0x7F800000) | (man << np.uint32(13)))
    else:
        val = u32_as_f32(((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13)))
    if sign:
        val = -val
    return val


@device_function
def bf16x2_lo(word):
    """fp32 value of the low (even-index) bf16 of a packed pair."""
    return bf16_bits_to_f32(np.uint32(word) & np.uint32(0xFFFF))


@device_function
def bf16x2_hi(word):
    """fp32 value of the high (odd-index) bf16 of a packed pair."""
    return bf16_bits_to_f32(np.uint32(word) >> np.uint32(16))


@device_function
def round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, as fp32, branch-free. Rounds the magnitude (which cannot
    carry out of 32 bits, even for a NaN) and puts the sign back; overflow rounds to inf."""
    u = f32_as_u32(x)
    mag = u & np.uint32(0x7FFFFFFF)
    mag_r = np.uint32((mag + np.uint32(0x7FFF) + ((mag >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    r = np.uint32((u & np.uint32(0x80000000)) | mag_r)
    q = np.uint32((u & np.uint32(0xFFFF0000)) | np.uint32(0x00400000))
    return u32_as_f32(q if x != x else r)


@device_function
def pack_bf16x2(lo, hi):
    """Round two fp32 values to bf16 and pack them (lo in the low half)."""
    return np.uint32(f32_to_bf16_bits(lo)) | (np.uint32(f32_to_bf16_bits(hi)) << np.uint32(16))
