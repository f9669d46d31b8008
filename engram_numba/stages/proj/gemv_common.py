"""Weight-decoding helpers of the proj stage's GEMVs (q2k and fp8 wkv), each with a simulator
twin chosen at import, like those of `engram_numba.device.intrinsics`.

Contracts
- `load_u32x2(a, i)` reads a[2i:2i+2] of a 1-D uint32 array as one 8-byte load (a's data must
  be 8-byte aligned); the GPU version is `ld.global.v2.u32` (or its shared twin).
- `f16x2_to_f32x2(word)` widens the two IEEE halves of a uint32 (low half first) to fp32,
  exactly (subnormals, inf and NaN included): two `cvt.f32.f16` on the GPU.
- `e4m3x4_to_bf16x2x2(word)` converts the four FP8 e4m3 codes of a uint32 (byte 0 = the lowest
  index) to bf16 and returns them as two bf16x2 words (codes 0, 1 | codes 2, 3, the lower index
  in the low half). Every finite e4m3 value is exact in bf16 (docs/math.md 4.4), so nothing
  rounds; the NaN codes 0x7F / 0xFF become a bf16 NaN. On the GPU: `cvt.rn.f16x2.e4m3x2` (sm_89+),
  `cvt.f32.f16`, `cvt.rn.bf16x2.f32`.
- `e4m3x4_to_f16x2x2(word)`: the same four codes as two IEEE f16x2 words (same order), exactly:
  every finite e4m3 value is a normal f16 (2^-9 .. 448); NaN codes become an f16 NaN. On the GPU
  two `cvt.rn.f16x2.e4m3x2` and nothing else (the first step of `e4m3x4_to_bf16x2x2`).
- `cvt_pack_f16x2(lo, hi)` rounds two fp32 values to nearest-even IEEE halves (subnormals kept,
  overflow to inf) packed low-first in a uint32: one `cvt.rn.f16x2.f32` on the GPU.
- `prefetch_l2(a, i)` asks L2 for the sector holding a[i] of a 1-D uint32 array and waits for
  nothing (`prefetch.global.L2`; a no-op in the simulator): a kernel's first weight bytes come
  from DRAM while it does other work, with no register held for them.
- `stream_loader(hint)(a, i)` reads a[4i:4i+4] of a 1-D uint32 array as one 16-byte load of
  read-only data streamed once (a weight): `ld.global.nc.<hint>.v4.u32` on the GPU, where hint is
  "" or PTX cache qualifiers such as "L1::no_allocate" (keep it out of L1, where x stays) or
  "L1::no_allocate.L2::256B" (ask L2 to fetch 256 bytes around it). One device function a hint.
"""
from __future__ import annotations

import numpy as np

from ...device.intrinsics import SIMULATOR

# The simulator twins are plain functions (see `device_function`).

if SIMULATOR:
    _E4M3_BF16 = None

    def _e4m3_table():
        global _E4M3_BF16
        if _E4M3_BF16 is None:
            import ml_dtypes
            vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            _E4M3_BF16 = vals.view(np.uint32) >> np.uint32(16)    # [256] bf16 words (exact; NaN stays NaN)
        return _E4M3_BF16

    def load_u32x2(a, i):
        return a[2 * i], a[2 * i + 1]

    def f16x2_to_f32x2(word):
        w = np.array([np.uint32(word)], dtype=np.uint32).view(np.float16).astype(np.float32)
        return w[0], w[1]

    def prefetch_l2(a, i):
        pass

    def stream_loader(hint=""):
        def load_stream_u32x4(a, i):
            return a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]
        return load_stream_u32x4

    def e4m3x4_to_bf16x2x2(word):
        tab = _e4m3_table()
        w = int(np.uint32(word))
        b = [int(tab[(w >> (8 * k)) & 0xFF]) for k in range(4)]
        return np.uint32(b[0] | (b[1] << 16)), np.uint32(b[2] | (b[3] << 16))

    def e4m3x4_to_f16x2x2(word):
        import ml_dtypes
        w = np.array([np.uint32(word)], dtype=np.uint32).view(np.uint8).view(ml_dtypes.float8_e4m3fn)
        h = w.astype(np.float16).view(np.uint32)
        return np.uint32(h[0]), np.uint32(h[1])

    def cvt_pack_f16x2(lo, hi):
        return np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.uint32)[0]

else:
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

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

    def _word_to_pair(asm):
        """An intrinsic running `asm` on one uint32 ($2) into two ($0, $1)."""
        @intrinsic
        def word_to_pair(typingctx, word):
            if word != types.uint32:
                return None
            sig = types.UniTuple(types.uint32, 2)(types.uint32)

            def codegen(context, builder, signature, args):
                i32 = ir.IntType(32)
                fnty = ir.FunctionType(ir.LiteralStructType([i32, i32]), [i32])
                res = builder.call(ir.InlineAsm(fnty, asm, "=r,=r,r"), list(args))
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, 0), builder.extract_value(res, 1)])

            return sig, codegen
        return word_to_pair

    _e4m3x4_to_bf16x2x2 = _word_to_pair(_E4M3X4_TO_BF16)

    @cuda.jit(device=True)
    def e4m3x4_to_bf16x2x2(word):
        return _e4m3x4_to_bf16x2x2(np.uint32(word))

    _E4M3X4_TO_F16 = ("{ .reg .b16 c01, c23; mov.b32 {c01, c23}, $2; "
                      "cvt.rn.f16x2.e4m3x2 $0, c01; cvt.rn.f16x2.e4m3x2 $1, c23; }")

    _e4m3x4_to_f16x2x2 = _word_to_pair(_E4M3X4_TO_F16)

    @cuda.jit(device=True)
    def e4m3x4_to_f16x2x2(word):
        return _e4m3x4_to_f16x2x2(np.uint32(word))

    @intrinsic
    def _cvt_rn_f16x2_f32(typingctx, hi, lo):
        if not (hi == types.float32 and lo == types.float32):
            return None
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            # PTX packs its first source into the upper half
            return builder.call(ir.InlineAsm(fnty, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"), list(args))

        return sig, codegen

    @cuda.jit(device=True)
    def cvt_pack_f16x2(lo, hi):
        return _cvt_rn_f16x2_f32(np.float32(hi), np.float32(lo))

    @intrinsic
    def _prefetch_l2(typingctx, a, i):
        if not (isinstance(a, types.Array) and a.dtype == types.uint32 and a.ndim == 1
                and isinstance(i, types.Integer)):
            return None
        sig = types.void(a, i)

        def codegen(context, builder, signature, args):
            arr, idx = args
            idx = context.cast(builder, idx, signature.args[1], types.intp)
            ary = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=arr)
            ptr = builder.gep(ary.data, [idx])
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64)])
            builder.call(ir.InlineAsm(fnty, "prefetch.global.L2 [$0];", "l", side_effect=True),
                         [builder.ptrtoint(ptr, ir.IntType(64))])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, forceinline=True)
    def prefetch_l2(a, i):
        _prefetch_l2(a, i)

    _STREAM_LOADERS: dict = {}

    def stream_loader(hint=""):
        hint = str(hint).strip(".")
        if hint not in _STREAM_LOADERS:
            text = "ld.global.nc%s.v4.u32 {$0, $1, $2, $3}, [$4];" % ("." + hint if hint else "")

            @intrinsic
            def _load_stream(typingctx, a, i):
                if not (isinstance(a, types.Array) and a.dtype == types.uint32 and a.ndim == 1
                        and isinstance(i, types.Integer)):
                    return None
                sig = types.UniTuple(types.uint32, 4)(a, i)

                def codegen(context, builder, signature, args):
                    from ...device.intrinsics import u32x4_pointer
                    arr, idx = args
                    idx = context.cast(builder, idx, signature.args[1], types.intp)
                    ptr = u32x4_pointer(context, builder, signature.args[0], arr, idx)
                    i32 = ir.IntType(32)
                    fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
                    res = builder.call(ir.InlineAsm(fnty, text, "=r,=r,=r,=r,l", side_effect=False),
                                       [builder.ptrtoint(ptr, ir.IntType(64))])
                    return context.make_tuple(builder, signature.return_type,
                                              [builder.extract_value(res, k) for k in range(4)])

                return sig, codegen

            @cuda.jit(device=True, forceinline=True)
            def load_stream_u32x4(a, i):
                return _load_stream(a, i)

            _STREAM_LOADERS[hint] = load_stream_u32x4
        return _STREAM_LOADERS[hint]
