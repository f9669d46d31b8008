"""Hopper-only (sm_90a) device helpers: cp.async pipelines and warpgroup MMA (wgmma), each with a
simulator twin chosen at import, like those of `engram_numba.device.intrinsics`.

Contracts (each helper has a simulator twin with the same contract; the twins model the
asynchrony, so a kernel that reads data before waiting for it fails in the simulator too)
- `shared_address(a)`: the 32-bit shared-window address of a shared array's data (uint32);
  what cp.async destinations and wgmma descriptors hold. In the simulator every shared array is
  at address 0: a kernel keeps all wgmma operands in one shared array, the one it passes to
  `wgmma_bf16`.
- `cp_async_16(dst, dst_byte, src, src_chunk, nbytes)`: one `cp.async.cg.shared.global` of 16
  bytes: 16-byte chunk `src_chunk` of the 1-D uint32 global array `src` (words 4c..4c+3) ->
  bytes dst_byte..dst_byte+15 of the shared array `dst` (dst_byte a multiple of 16). nbytes is
  16, or 0 to zero-fill the destination without reading (src_chunk must still lie inside src).
  Asynchronous: the data is there only after `cp_async_commit` and a `cp_async_waiter(n)` that
  retires its group, and other threads see it only after a barrier.
- `cp_async_commit()` closes this thread's copies issued since the last commit into a group.
- `cp_async_waiter(n)` returns a device function `wait()` (`cp.async.wait_group n`): returns once
  at most the n most recent committed groups of this thread are still in flight.
- `fence_proxy_async()`: `fence.proxy.async.shared::cta`, between a thread's writes to shared
  memory (stores, or cp.async copies it has waited for) and wgmma reads of them (which go through
  the async proxy); a barrier must follow before another warp's wgmma reads them.
- `wgmma_descriptor(address, lbo, sbo, swizzle)`: the 64-bit shared-memory matrix descriptor:
  (address & 0x3FFFF) >> 4 in bits 0-13, lbo >> 4 in bits 16-29, sbo >> 4 in bits 32-45,
  swizzle mode in bits 62-63 (WGMMA_NO_SWIZZLE = 0, WGMMA_SWIZZLE_128B = 1); base offset 0.
  Operands are K-major (the 16 k values of a row are 32 contiguous bytes before swizzling):
  no swizzle: element (r, k) at address + (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 +
  (k % 8) * 2 (8 x 8 "core matrices" of 16-byte rows, 128 contiguous bytes each);
  128-byte swizzle: at L ^ (((L >> 7) & 7) << 4) with L = address + (r // 8) * sbo + (r % 8) *
  128 + 2 k: rows of 128 bytes, 8-row atoms of 1024 bytes whose 16-byte chunks are permuted by
  the row (the atoms must start at a multiple of 1024 bytes; lbo is unused, pass 16). Stepping k
  by 16 adds 32 bytes to the address (inside the 128-byte row).
- `wgmma_bf16(acc, desc_a, desc_b, smem)`: one warpgroup-wide (128 threads, 4 whole warps,
  warp-aligned, no divergence) `wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16`,
  D[64 x N] += A[64 x 16] B[16 x N] with A rows and B columns (= rows of a K-major [N, K] weight)
  read through the descriptors; N = 2 * len(acc) (8..256). `acc` is this thread's tuple of
  N / 2 fp32 accumulators: for thread p of the warpgroup (warp w = p // 32, g = lane >> 2,
  t = lane & 3), acc[4j + 2h + c] = D[16w + g + 8h, 8j + 2t + c]. Asynchronous: `acc` may be
  passed to further `wgmma_bf16` calls (they chain in order) but read only after
  `wgmma_commit` and a `wgmma_waiter(n)` that retires the group. `smem` is the shared array the
  descriptors point into (unused on the GPU; the simulator reads the operands from it).
- `wgmma_fence(acc)`: `wgmma.fence.sync.aligned`, before the first wgmma of a batch (the
  accumulators pass through it so the compiler orders their last writes before it).
- `wgmma_commit()` closes this warpgroup's wgmmas since the last commit into a group;
  `wgmma_waiter(n)` returns `wait(acc) -> acc` (`wgmma.wait_group n`): at most n groups remain
  in flight; the accumulators pass through so nothing reads them earlier.
- `wgmma_store_bf16x2(smem, base, stride, acc)`: rounds this thread's accumulators to bf16
  (nearest even) and stores them as bf16x2 words in a uint32 shared array: the pair
  (acc[4j + 2h], acc[4j + 2h + 1]) (one row, two adjacent columns) at word
  base + 8 h * stride + 4 j. With base = (16 w + g) * stride + t, word (r, c) of the
  [64, stride] tile holds D[r, 2c], D[r, 2c + 1].
The simulator's wgmma sums each 16-term product in float64, rounds it to fp32 and adds it to the
accumulator in fp32 (the tensor core's order is unspecified: compare in ulps, not bits).
"""
from __future__ import annotations

import numpy as np

from .intrinsics import SIMULATOR, cvt_pack_bf16x2, device_function

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

    def shared_address(a):
        return np.uint32(0)

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

    def wgmma_fence(acc):
        if not isinstance(acc, WgmmaAcc):
            acc = WgmmaAcc(acc)
        acc.fenced = True
        return acc

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

    def wgmma_store_bf16x2(smem, base, stride, acc):
        vals = acc.read("wgmma_store_bf16x2") if isinstance(acc, WgmmaAcc) else np.array(acc, np.float32)
        base, stride = int(base), int(stride)
        for j in range(vals.size // 4):
            for h in range(2):
                smem[base + 8 * h * stride + 4 * j] = cvt_pack_bf16x2(vals[4 * j + 2 * h], vals[4 * j + 2 * h + 1])

else:
    # ---- GPU versions: inline PTX (sm_90a) ------------------------------------------------------
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from .intrinsics import u32x4_pointer

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
            src_ptr = u32x4_pointer(context, builder, sc, s, chunk)
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
