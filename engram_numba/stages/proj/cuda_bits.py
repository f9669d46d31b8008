"""Bit-level device helpers of the q2k_r GEMVs (gemv_q2k_v7), each with a simulator twin.

    prmt(a, b, s)          PTX `prmt.b32`: byte n of the result is byte (s >> 4n) & 7 of the 8-byte
                           pair (a = bytes 0..3, b = bytes 4..7), replaced by its sign (0x00 /
                           0xFF) when bit 3 of that nibble is set. One instruction: libdevice's
                           byte_perm masks its selector with 0x7777 first, one more per call.
    umulhi(a, b)           the high 32 bits of the 64-bit product of two uint32 (`mul.hi.u32`),
                           an IMAD.HI: it takes a right shift of a product off the integer pipe.
    fma_rn(a, b, c)        fp32 a*b + c rounded once (`fma.rn.f32`).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...device.intrinsics import SIMULATOR

if SIMULATOR:
    def prmt(a, b, s):
        src = (int(np.uint32(b)) << 32) | int(np.uint32(a))
        sel = int(np.uint32(s))
        r = 0
        for n in range(4):
            nib = (sel >> (4 * n)) & 0xF
            byte = (src >> (8 * (nib & 7))) & 0xFF
            if nib & 8:
                byte = 0xFF if byte & 0x80 else 0
            r |= byte << (8 * n)
        return np.uint32(r)

    def umulhi(a, b):
        return np.uint32((int(np.uint32(a)) * int(np.uint32(b))) >> 32)

    def fma_rn(a, b, c):
        # exact in float64 when a*b is exact in fp32 (how v7 calls it: 0*s and 2*s), then one rounding
        return np.float32(np.float64(np.float32(a)) * np.float64(np.float32(b)) + np.float64(np.float32(c)))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _prmt(typingctx, a, b, s):
        if not (a == types.uint32 and b == types.uint32 and s == types.uint32):
            return None
        sig = types.uint32(types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(i32, [i32, i32, i32])
            asm = ir.InlineAsm(fnty, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, list(args))

        return sig, codegen

    @cuda.jit(device=True, forceinline=True)
    def prmt(a, b, s):
        return _prmt(np.uint32(a), np.uint32(b), np.uint32(s))

    @cuda.jit(device=True, forceinline=True)
    def umulhi(a, b):
        return np.uint32(libdevice.umulhi(np.int32(np.uint32(a)), np.int32(np.uint32(b))))

    @cuda.jit(device=True, forceinline=True)
    def fma_rn(a, b, c):
        return libdevice.fmaf_rn(np.float32(a), np.float32(b), np.float32(c))
