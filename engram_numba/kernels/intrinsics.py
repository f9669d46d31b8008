"""Every GPU-only helper the kernels use, each with a simulator twin.

numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs kernels as Python threads: it has no warp
shuffles, no `syncwarp`, and libdevice bit casts such as `int_as_float` run there but return NaN.
So each helper below is defined twice, picked once at import by `config.ENABLE_CUDASIM`: a
numpy-scalar version for the simulator and a libdevice / shuffle / LLVM version for the GPU. Both
are `@cuda.jit(device=True)` functions with the same contract, and the other kernel modules use
only these helpers, never the raw intrinsics.

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
- `load_u32x4(a, i)` reads a[4i:4i+4] of a 1-D uint32 array as one 16-byte load (a's data must be
  16-byte aligned, which every numba/CuPy/torch allocation is); `store_u32x4` writes likewise.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda import config

SIMULATOR = bool(config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF

if SIMULATOR:
    # ---- simulator twins: plain numpy scalars ------------------------------------------------

    @cuda.jit(device=True)
    def bf16_bits_to_f32(bits):
        return np.array([np.uint32(bits) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_to_bf16_bits(x):
        x = np.float32(x)
        u = np.array([x], dtype=np.float32).view(np.uint32)[0]
        if x != x:
            return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
        return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    @cuda.jit(device=True)
    def f32_as_u32(x):
        return np.array([np.float32(x)], dtype=np.float32).view(np.uint32)[0]

    @cuda.jit(device=True)
    def u32_as_f32(u):
        return np.array([np.uint32(u)], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    @cuda.jit(device=True)
    def add_rn(a, b):
        return np.float32(np.float32(a) + np.float32(b))

    @cuda.jit(device=True)
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

    @cuda.jit(device=True)
    def load_u32x4(a, i):
        return a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]

    @cuda.jit(device=True)
    def store_u32x4(a, i, v0, v1, v2, v3):
        a[4 * i] = v0
        a[4 * i + 1] = v1
        a[4 * i + 2] = v2
        a[4 * i + 3] = v3

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

    def _u32x4_pointer(context, builder, arrty, arr, idx):
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
            ptr = _u32x4_pointer(context, builder, signature.args[0], arr, idx)
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
            ptr = _u32x4_pointer(context, builder, signature.args[0], arr, idx)
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


@cuda.jit(device=True)
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


@cuda.jit(device=True)
def bf16x2_lo(word):
    """fp32 value of the low (even-index) bf16 of a packed pair."""
    return bf16_bits_to_f32(np.uint32(word) & np.uint32(0xFFFF))


@cuda.jit(device=True)
def bf16x2_hi(word):
    """fp32 value of the high (odd-index) bf16 of a packed pair."""
    return bf16_bits_to_f32(np.uint32(word) >> np.uint32(16))


@cuda.jit(device=True)
def pack_bf16x2(lo, hi):
    """Round two fp32 values to bf16 and pack them (lo in the low half)."""
    return np.uint32(f32_to_bf16_bits(lo)) | (np.uint32(f32_to_bf16_bits(hi)) << np.uint32(16))
