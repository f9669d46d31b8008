"""Every GPU-only helper the kernels use, each with a simulator twin.

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

    @cuda.jit(device=True)
    def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
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

            def unpack(words):                          # bf16x2 words [r, 8] -> float64 [r, 16]
                halves = np.stack([words << np.uint32(16), words & np.uint32(0xFFFF0000)], axis=-1)
                return halves.reshape(words.shape[0], 16).view(np.float32).astype(np.float64)

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


# ---- Weight-decoding GEMV helpers (proj stage, q2k / fp8 wkv) -------------------------------------
#
# Contracts
# - `load_u32x2(a, i)` reads a[2i:2i+2] of a 1-D uint32 array as one 8-byte load (a's data must
#   be 8-byte aligned); the GPU version is `ld.global.v2.u32` (or its shared twin).
# - `f16x2_to_f32x2(word)` widens the two IEEE halves of a uint32 (low half first) to fp32,
#   exactly (subnormals, inf and NaN included): two `cvt.f32.f16` on the GPU.
# - `e4m3x4_to_bf16x2x2(word)` converts the four FP8 e4m3 codes of a uint32 (byte 0 = the lowest
#   index) to bf16 and returns them as two bf16x2 words (codes 0, 1 | codes 2, 3, the lower index
#   in the low half). Every finite e4m3 value is exact in bf16 (docs/math.md 4.4), so nothing
#   rounds; the NaN codes 0x7F / 0xFF become a bf16 NaN. On the GPU: `cvt.rn.f16x2.e4m3x2` (sm_89+),
#   `cvt.f32.f16`, `cvt.rn.bf16x2.f32`.

if SIMULATOR:
    _E4M3_BF16 = None

    def _e4m3_table():
        global _E4M3_BF16
        if _E4M3_BF16 is None:
            import ml_dtypes
            vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            _E4M3_BF16 = vals.view(np.uint32) >> np.uint32(16)    # [256] bf16 words (exact; NaN stays NaN)
        return _E4M3_BF16

    @_sim_twin
    def load_u32x2(a, i):
        return a[2 * i], a[2 * i + 1]

    @_sim_twin
    def f16x2_to_f32x2(word):
        w = np.array([np.uint32(word)], dtype=np.uint32).view(np.float16).astype(np.float32)
        return w[0], w[1]

    @_sim_twin
    def e4m3x4_to_bf16x2x2(word):
        tab = _e4m3_table()
        w = int(np.uint32(word))
        b = [int(tab[(w >> (8 * k)) & 0xFF]) for k in range(4)]
        return np.uint32(b[0] | (b[1] << 16)), np.uint32(b[2] | (b[3] << 16))

else:
    _V2 = ir.VectorType(ir.IntType(32), 2)

    @intrinsic
    def _load_u32x2(typingctx, a, i):
        if not (isinstance(a, types.Array) and a.dtype == types.uint32 and a.ndim == 1
                and isinstance(i, types.Integer)):
            return None
        sig = types.UniTuple(types.uint32, 2)(a, i)

        def codegen(context, builder, signature, args):
            arr, idx = args
            idx = context.cast(builder, idx, signature.args[1], types.intp)
            ary = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=arr)
            ptr = builder.gep(builder.bitcast(ary.data, _V2.as_pointer()), [idx])
            vec = builder.load(ptr, align=8)
            elems = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(2)]
            return context.make_tuple(builder, signature.return_type, elems)

        return sig, codegen

    @cuda.jit(device=True)
    def load_u32x2(a, i):
        return _load_u32x2(a, i)

    @intrinsic
    def _f16x2_to_f32x2(typingctx, word):
        if word != types.uint32:
            return None
        sig = types.UniTuple(types.float32, 2)(types.uint32)

        def codegen(context, builder, signature, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32, f32]), [i32])
            asm = ir.InlineAsm(fnty, "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                     "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }", "=f,=f,r")
            res = builder.call(asm, list(args))
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(res, 0), builder.extract_value(res, 1)])

        return sig, codegen

    @cuda.jit(device=True)
    def f16x2_to_f32x2(word):
        return _f16x2_to_f32x2(np.uint32(word))

    _E4M3X4_TO_BF16 = (
        "{ .reg .b16 c01, c23, h0, h1, h2, h3; .reg .b32 p01, p23; .reg .f32 f0, f1, f2, f3; "
        "mov.b32 {c01, c23}, $2; "
        "cvt.rn.f16x2.e4m3x2 p01, c01; cvt.rn.f16x2.e4m3x2 p23, c23; "
        "mov.b32 {h0, h1}, p01; mov.b32 {h2, h3}, p23; "
        "cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; cvt.f32.f16 f2, h2; cvt.f32.f16 f3, h3; "
        # cvt.rn.bf16x2.f32 packs its first source into the upper half
        "cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }")

    @intrinsic
    def _e4m3x4_to_bf16x2x2(typingctx, word):
        if word != types.uint32:
            return None
        sig = types.UniTuple(types.uint32, 2)(types.uint32)

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32, i32]), [i32])
            res = builder.call(ir.InlineAsm(fnty, _E4M3X4_TO_BF16, "=r,=r,r"), list(args))
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(res, 0), builder.extract_value(res, 1)])

        return sig, codegen

    @cuda.jit(device=True)
    def e4m3x4_to_bf16x2x2(word):
        return _e4m3x4_to_bf16x2x2(np.uint32(word))


# =================================================================================================
# ---- Hopper (sm_90a): cp.async pipelines and warpgroup MMA ---------------------------------------
# =================================================================================================
#
# Contracts (each helper has a simulator twin with the same contract; the twins model the
# asynchrony, so a kernel that reads data before waiting for it fails in the simulator too)
# - `shared_address(a)`: the 32-bit shared-window address of a shared array's data (uint32);
#   what cp.async destinations and wgmma descriptors hold. In the simulator every shared array is
#   at address 0: a kernel keeps all wgmma operands in one shared array, the one it passes to
#   `wgmma_bf16`.
# - `cp_async_16(dst, dst_byte, src, src_chunk, nbytes)`: one `cp.async.cg.shared.global` of 16
#   bytes: 16-byte chunk `src_chunk` of the 1-D uint32 global array `src` (words 4c..4c+3) ->
#   bytes dst_byte..dst_byte+15 of the shared array `dst` (dst_byte a multiple of 16). nbytes is
#   16, or 0 to zero-fill the destination without reading (src_chunk must still lie inside src).
#   Asynchronous: the data is there only after `cp_async_commit` and a `cp_async_waiter(n)` that
#   retires its group, and other threads see it only after a barrier.
# - `cp_async_commit()` closes this thread's copies issued since the last commit into a group.
# - `cp_async_waiter(n)` returns a device function `wait()` (`cp.async.wait_group n`): returns once
#   at most the n most recent committed groups of this thread are still in flight.
# - `fence_proxy_async()`: `fence.proxy.async.shared::cta`, between a thread's writes to shared
#   memory (stores, or cp.async copies it has waited for) and wgmma reads of them (which go through
#   the async proxy); a barrier must follow before another warp's wgmma reads them.
# - `wgmma_descriptor(address, lbo, sbo, swizzle)`: the 64-bit shared-memory matrix descriptor:
#   (address & 0x3FFFF) >> 4 in bits 0-13, lbo >> 4 in bits 16-29, sbo >> 4 in bits 32-45,
#   swizzle mode in bits 62-63 (WGMMA_NO_SWIZZLE = 0, WGMMA_SWIZZLE_128B = 1); base offset 0.
#   Operands are K-major (the 16 k values of a row are 32 contiguous bytes before swizzling):
#   no swizzle: element (r, k) at address + (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 +
#   (k % 8) * 2 (8 x 8 "core matrices" of 16-byte rows, 128 contiguous bytes each);
#   128-byte swizzle: at L ^ (((L >> 7) & 7) << 4) with L = address + (r // 8) * sbo + (r % 8) *
#   128 + 2 k: rows of 128 bytes, 8-row atoms of 1024 bytes whose 16-byte chunks are permuted by
#   the row (the atoms must start at a multiple of 1024 bytes; lbo is unused, pass 16). Stepping k
#   by 16 adds 32 bytes to the address (inside the 128-byte row).
# - `wgmma_bf16(acc, desc_a, desc_b, smem)`: one warpgroup-wide (128 threads, 4 whole warps,
#   warp-aligned, no divergence) `wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16`,
#   D[64 x N] += A[64 x 16] B[16 x N] with A rows and B columns (= rows of a K-major [N, K] weight)
#   read through the descriptors; N = 2 * len(acc) (8..256). `acc` is this thread's tuple of
#   N / 2 fp32 accumulators: for thread p of the warpgroup (warp w = p // 32, g = lane >> 2,
#   t = lane & 3), acc[4j + 2h + c] = D[16w + g + 8h, 8j + 2t + c]. Asynchronous: `acc` may be
#   passed to further `wgmma_bf16` calls (they chain in order) but read only after
#   `wgmma_commit` and a `wgmma_waiter(n)` that retires the group. `smem` is the shared array the
#   descriptors point into (unused on the GPU; the simulator reads the operands from it).
# - `wgmma_fence(acc)`: `wgmma.fence.sync.aligned`, before the first wgmma of a batch (the
#   accumulators pass through it so the compiler orders their last writes before it).
# - `wgmma_commit()` closes this warpgroup's wgmmas since the last commit into a group;
#   `wgmma_waiter(n)` returns `wait(acc) -> acc` (`wgmma.wait_group n`): at most n groups remain
#   in flight; the accumulators pass through so nothing reads them earlier.
# - `wgmma_store_bf16x2(smem, base, stride, acc)`: rounds this thread's accumulators to bf16
#   (nearest even) and stores them as bf16x2 words in a uint32 shared array: the pair
#   (acc[4j + 2h], acc[4j + 2h + 1]) (one row, two adjacent columns) at word
#   base + 8 h * stride + 4 j. With base = (16 w + g) * stride + t, word (r, c) of the
#   [64, stride] tile holds D[r, 2c], D[r, 2c + 1].
# The simulator's wgmma sums each 16-term product in float64, rounds it to fp32 and adds it to the
# accumulator in fp32 (the tensor core's order is unspecified: compare in ulps, not bits).

WGMMA_NO_SWIZZLE = 0
WGMMA_SWIZZLE_128B = 1


@device_function
def wgmma_descriptor(address, lbo, sbo, swizzle):
    return (np.uint64((np.uint32(address) & np.uint32(0x3FFFF)) >> np.uint32(4))
            | (np.uint64(np.uint32(lbo) >> np.uint32(4)) << np.uint64(16))
            | (np.uint64(np.uint32(sbo) >> np.uint32(4)) << np.uint64(32))
            | (np.uint64(swizzle) << np.uint64(62)))


if SIMULATOR:
    # ---- simulator twins: copies and products happen when the wait that retires them runs -----
    import threading

    class _AsyncQueues(threading.local):
        """Per simulated thread (the simulator runs each CUDA thread as a Python thread): the
        cp.async copies and wgmma products issued but not yet retired by a wait."""

        def __init__(self):
            self.cp_open, self.cp_groups = [], []
            self.mma_open, self.mma_groups = [], []

    _QUEUES = _AsyncQueues()

    def _thread_id():
        th = threading.current_thread()
        if not hasattr(th, "thread_id"):
            raise RuntimeError("wgmma/cp.async twins run only inside a simulated kernel")
        return int(th.thread_id)

    def _bytes(a):
        return np.asarray(a).reshape(-1).view(np.uint8)

    @_sim_twin
    def shared_address(a):
        return np.uint32(0)

    @_sim_twin
    def cp_async_16(dst, dst_byte, src, src_chunk, nbytes):
        dst_byte, src_chunk, nbytes = int(dst_byte), int(src_chunk), int(nbytes)
        dst_b = _bytes(dst)
        if dst_byte % 16 or not 0 <= dst_byte <= dst_b.size - 16:
            raise IndexError(f"cp_async_16: destination byte {dst_byte} is not a 16-byte slot of "
                             f"the {dst_b.size}-byte shared array")
        if not 0 <= src_chunk < np.asarray(src).size // 4:
            raise IndexError(f"cp_async_16: source chunk {src_chunk} is outside the source "
                             f"({np.asarray(src).size // 4} chunks)")
        if nbytes not in (0, 16):
            raise ValueError(f"cp_async_16: nbytes must be 16 or 0, got {nbytes}")
        data = (np.array(src[4 * src_chunk:4 * src_chunk + 4], dtype=np.uint32) if nbytes
                else np.zeros(4, np.uint32))

        def land():
            dst_b[dst_byte:dst_byte + 16] = data.view(np.uint8)
        _QUEUES.cp_open.append(land)

    @_sim_twin
    def cp_async_commit():
        _QUEUES.cp_groups.append(_QUEUES.cp_open)
        _QUEUES.cp_open = []

    def cp_async_waiter(n):
        n = int(n)

        def cp_async_wait():
            while len(_QUEUES.cp_groups) > n:
                for land in _QUEUES.cp_groups.pop(0):
                    land()
        return cp_async_wait

    @_sim_twin
    def fence_proxy_async():
        pass

    class WgmmaAcc:
        """A thread's wgmma accumulators in the simulator: the values, how many products are
        still in flight, and whether a wgmma_fence came after the last read."""

        def __init__(self, values):
            self.values = np.array(values, dtype=np.float32)
            self.in_flight = 0
            self.fenced = False

        def read(self, what):
            if self.in_flight:
                raise RuntimeError(f"{what}: the accumulators are read while {self.in_flight} wgmma "
                                   "products are in flight (wgmma_commit and a wgmma_waiter first)")
            self.fenced = False
            return self.values

    def _element_offsets(desc, rows):
        """Byte offsets in shared memory of elements (rows[i], k), k < 16, of a K-major operand."""
        desc = int(desc)
        start = (desc & 0x3FFF) << 4
        lbo = ((desc >> 16) & 0x3FFF) << 4
        sbo = ((desc >> 32) & 0x3FFF) << 4
        mode = desc >> 62
        if (desc >> 49) & 7:
            raise NotImplementedError("wgmma twin: descriptor base offset must be 0")
        r = np.asarray(rows, dtype=np.int64)[:, None]
        k = np.arange(16, dtype=np.int64)[None, :]
        if mode == WGMMA_NO_SWIZZLE:
            return start + (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 + (k % 8) * 2
        if mode == WGMMA_SWIZZLE_128B:
            logical = start + (r // 8) * sbo + (r % 8) * 128 + 2 * k
            return logical ^ (((logical >> 7) & 7) << 4)
        raise NotImplementedError(f"wgmma twin: swizzle mode {mode} is not modelled")

    def _operand(smem_b, desc, rows):
        off = _element_offsets(desc, rows)
        if off.min() < 0 or off.max() + 2 > smem_b.size:
            raise IndexError(f"wgmma operand reaches bytes {off.min()}..{off.max() + 1} of a "
                             f"{smem_b.size}-byte shared array (descriptor {int(desc):#x})")
        words = smem_b.view(np.uint16)[off // 2].astype(np.uint32) << np.uint32(16)
        return words.view(np.float32).astype(np.float64)

    @_sim_twin
    def wgmma_fence(acc):
        if not isinstance(acc, WgmmaAcc):
            acc = WgmmaAcc(acc)
        acc.fenced = True
        return acc

    @_sim_twin
    def wgmma_bf16(acc, desc_a, desc_b, smem):
        if not isinstance(acc, WgmmaAcc) or not acc.fenced:
            raise RuntimeError("wgmma_bf16: no wgmma_fence since the accumulators were last written "
                               "or read by other instructions")
        n_cols = 2 * acc.values.size
        p = _thread_id() % 128
        w, g, t = p // 32, (p % 32) >> 2, p & 3
        rows_a = [16 * w + g, 16 * w + g + 8]
        cols = [8 * j + 2 * t + c for j in range(n_cols // 8) for c in range(2)]
        smem_b, da, db = _bytes(smem), int(desc_a), int(desc_b)

        def run():
            # [2, 16] x [N/4, 16]^T, exact products summed in float64, rounded once to fp32
            prod = (_operand(smem_b, da, rows_a) @ _operand(smem_b, db, cols).T).astype(np.float32)
            frag = prod.reshape(2, n_cols // 8, 2).transpose(1, 0, 2).reshape(-1)   # [j][h][c]
            acc.values = (acc.values + frag).astype(np.float32)
            acc.in_flight -= 1
        acc.in_flight += 1
        _QUEUES.mma_open.append(run)
        return acc

    @_sim_twin
    def wgmma_commit():
        _QUEUES.mma_groups.append(_QUEUES.mma_open)
        _QUEUES.mma_open = []

    def wgmma_waiter(n):
        n = int(n)

        def wgmma_wait(acc):
            while len(_QUEUES.mma_groups) > n:
                for run in _QUEUES.mma_groups.pop(0):
                    run()
            return acc
        return wgmma_wait

    @_sim_twin
    def wgmma_store_bf16x2(smem, base, stride, acc):
        vals = acc.read("wgmma_store_bf16x2") if isinstance(acc, WgmmaAcc) else np.array(acc, np.float32)
        base, stride = int(base), int(stride)
        for j in range(vals.size // 4):
            for h in range(2):
                smem[base + 8 * h * stride + 4 * j] = cvt_pack_bf16x2(vals[4 * j + 2 * h], vals[4 * j + 2 * h + 1])

else:
    # ---- GPU versions: inline PTX (sm_90a) ------------------------------------------------------
    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def _inline(builder, ret, arg_types, text, constraints, args, side_effect=True):
        fnty = ir.FunctionType(ret, arg_types)
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    def _shared_address_of(context, builder, arrty, arr):
        # numba keeps shared arrays behind generic pointers: cast back to the shared window
        ary = cgutils.create_struct_proxy(arrty)(context, builder, value=arr)
        p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        return builder.ptrtoint(builder.addrspacecast(p, ir.PointerType(ir.IntType(8), 3)), _I32)

    @intrinsic
    def shared_address(typingctx, a):
        if not isinstance(a, types.Array):
            return None

        def codegen(context, builder, signature, args):
            return _shared_address_of(context, builder, signature.args[0], args[0])
        return types.uint32(a), codegen

    @intrinsic
    def cp_async_16(typingctx, dst, dst_byte, src, src_chunk, nbytes):
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and src.dtype == types.uint32
                and all(isinstance(v, types.Integer) for v in (dst_byte, src_chunk, nbytes))):
            return None
        sig = types.void(dst, dst_byte, src, src_chunk, nbytes)

        def codegen(context, builder, signature, args):
            d, d_off, s, s_chunk, n = args
            sa, sb, sc, sd, se = signature.args
            addr = builder.add(_shared_address_of(context, builder, sa, d),
                               context.cast(builder, d_off, sb, types.uint32))
            chunk = context.cast(builder, s_chunk, sd, types.int64)
            src_ptr = _u32x4_pointer(context, builder, sc, s, chunk)
            _inline(builder, ir.VoidType(), [_I32, _I64, _I32],
                    "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                    [addr, builder.ptrtoint(src_ptr, _I64), context.cast(builder, n, se, types.uint32)])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    _CP_WAITERS: dict = {}

    def cp_async_waiter(n):
        n = int(n)
        if n not in _CP_WAITERS:
            @intrinsic
            def cp_async_wait(typingctx):
                def codegen(context, builder, signature, args):
                    _inline(builder, ir.VoidType(), [], f"cp.async.wait_group {n};", "~{memory}", [])
                    return context.get_dummy_value()
                return types.void(), codegen
            _CP_WAITERS[n] = cp_async_wait
        return _CP_WAITERS[n]

    @intrinsic
    def fence_proxy_async(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "fence.proxy.async.shared::cta;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    def _is_acc(acc):
        return (isinstance(acc, types.UniTuple) and acc.dtype == types.float32 and acc.count % 4 == 0
                and 4 <= acc.count <= 128)

    def _acc_asm(context, builder, acc_type, acc, text, extra_types=(), extra_args=(), extra_constraints=""):
        """Inline asm whose outputs are the accumulators, each tied to its input (in/out)."""
        n = acc_type.count
        vals = [builder.extract_value(acc, i) for i in range(n)]
        constraints = ",".join(["=f"] * n + [str(i) for i in range(n)]) + extra_constraints + ",~{memory}"
        res = _inline(builder, ir.LiteralStructType([_F32] * n), [_F32] * n + list(extra_types), text,
                      constraints, vals + list(extra_args))
        return context.make_tuple(builder, acc_type, [builder.extract_value(res, i) for i in range(n)])

    @intrinsic
    def wgmma_fence(typingctx, acc):
        if not _is_acc(acc):
            return None

        def codegen(context, builder, signature, args):
            return _acc_asm(context, builder, signature.args[0], args[0], "wgmma.fence.sync.aligned;")
        return acc(acc), codegen

    @intrinsic
    def wgmma_bf16(typingctx, acc, desc_a, desc_b, smem):
        if not (_is_acc(acc) and isinstance(desc_a, types.Integer) and isinstance(desc_b, types.Integer)):
            return None
        n = acc.count
        regs = ", ".join(f"${i}" for i in range(n))
        text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; "
                "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16 {%s}, $%d, $%d, p, 1, 1, 0, 0; }"
                % (2 * n + 2, 2 * n, regs, 2 * n, 2 * n + 1))

        def codegen(context, builder, signature, args):
            acc_t, da_t, db_t, _ = signature.args
            da = context.cast(builder, args[1], da_t, types.uint64)
            db = context.cast(builder, args[2], db_t, types.uint64)
            return _acc_asm(context, builder, acc_t, args[0], text, (_I64, _I64, _I32),
                            (da, db, ir.Constant(_I32, 1)), ",l,l,r")
        return acc(acc, desc_a, desc_b, smem), codegen

    @intrinsic
    def wgmma_commit(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "wgmma.commit_group.sync.aligned;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    _WGMMA_WAITERS: dict = {}

    def wgmma_waiter(n):
        n = int(n)
        if n not in _WGMMA_WAITERS:
            @intrinsic
            def wgmma_wait(typingctx, acc):
                if not _is_acc(acc):
                    return None

                def codegen(context, builder, signature, args):
                    return _acc_asm(context, builder, signature.args[0], args[0],
                                    f"wgmma.wait_group.sync.aligned {n};")
                return acc(acc), codegen
            _WGMMA_WAITERS[n] = wgmma_wait
        return _WGMMA_WAITERS[n]

    @intrinsic
    def wgmma_store_bf16x2(typingctx, smem, base, stride, acc):
        if not (isinstance(smem, types.Array) and smem.dtype == types.uint32 and _is_acc(acc)
                and isinstance(base, types.Integer) and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            sm_t, b_t, s_t, acc_t = signature.args
            ary = cgutils.create_struct_proxy(sm_t)(context, builder, value=args[0])
            data = builder.bitcast(ary.data, _I32.as_pointer())
            base_v = context.cast(builder, args[1], b_t, types.int64)
            stride_v = context.cast(builder, args[2], s_t, types.int64)
            row8 = builder.mul(stride_v, ir.Constant(_I64, 8))
            for j in range(acc_t.count // 4):
                for h in range(2):
                    lo = builder.extract_value(args[3], 4 * j + 2 * h)
                    hi = builder.extract_value(args[3], 4 * j + 2 * h + 1)
                    # PTX packs its first source into the upper half
                    word = _inline(builder, _I32, [_F32, _F32], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                                   [hi, lo], side_effect=False)
                    idx = builder.add(base_v, ir.Constant(_I64, 4 * j))
                    if h:
                        idx = builder.add(idx, row8)
                    builder.store(word, builder.gep(data, [idx]))
            return context.get_dummy_value()
        return types.void(smem, base, stride, acc), codegen
