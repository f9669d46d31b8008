"""What the projection kernels share: launch-bound options, simulator switches, flat views.

Every projection kernel computes kv = bf16(x @ wkv^T) with fp32 accumulation (docs/math.md):
x bf16 words uint16 [T, K] (K = n_hash_cols * 256), wkv bf16 words uint16 [N, K] row-major
(K contiguous: an "NT" product), kv uint16 [T, N] (N = dim * (hc + 1)). The fast versions read
x and wkv as flat uint32 views with 16-byte loads and take (x32, w32, out, T, K).

`prepare` is the stage's one launcher: it reads a kernel record (its kernel or factory, geometry,
argument form and alignment) and builds the launch. Argument forms:
    naive   (x, w, out), or (x, w, scales, out) for a weight with a separate scale tensor (fp8)
    fast    (x32, w32, out, T, K), or (x32, w32, scales, out, T, K): x and the weight as flat
            uint32 views; x must be 16-byte aligned and the weight `record.align`-byte aligned
"""
from __future__ import annotations

import numpy as np
from numba import types

from ...device.checks import check_array
from ...device.devarray import data_address
from ...device.intrinsics import SIMULATOR
from ...device.launch import PreparedLaunch, allow_dynamic_shared

# 16-byte vector access to shared memory needs a 16-byte aligned array; the simulator refuses any
# alignment argument (and needs none).
ALIGN = None if SIMULATOR else 16

# Device helpers whose array indices must fold to constants are force-inlined (an out-of-line call
# would pass the register arrays through local memory); the simulator's jit has no such option.
INLINE = {} if SIMULATOR else {"forceinline": True}

# warp_sum's scratch: one slot a thread in the simulator, unused (1 slot) on the GPU
WARP_SCRATCH = 256 if SIMULATOR else 1

U16_2D = types.uint16[:, ::1]
FAST_ARGS = (types.uint32[::1], types.uint32[::1], U16_2D, types.int64, types.int64)   # x32, w32, out, T, K
NAIVE_ARGS = (U16_2D, U16_2D, U16_2D)                                                  # x, wkv, out


def bounds(threads: int, blocks_per_sm: int) -> dict:
    """cuda.jit options capping registers so `blocks_per_sm` blocks fit an SM (65536 registers);
    the simulator's jit takes no launch bounds."""
    return {} if SIMULATOR else {"launch_bounds": (threads, blocks_per_sm)}


def register_cap(threads: int) -> dict:
    """cuda.jit options capping registers at what one block of `threads` threads may use (65536 / threads,
    rounded down to 8), as ptxas's -maxrregcount instead of launch bounds: from launch bounds of a
    block that is not a whole number of warpgroups (288 threads) ptxas caps at 168, the cap of 384."""
    return {} if SIMULATOR else {"max_registers": min(255, 65536 // threads) // 8 * 8}


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def flat_u32(a):
    """A C-contiguous 2-D array (uint16 bf16 words, or uint8 weight blocks) -> its bytes as a flat
    uint32 array, zero-copy (bf16 pairs: the low index in the low half)."""
    rows, k = a.shape
    return a.view(np.uint32).reshape(rows * (k * a.dtype.itemsize // 4))


def prepare(rec, x, w, *more, stream=0) -> PreparedLaunch:
    """The launch of kernel record `rec` on x [T, K] and the weight w [N, ...]: called as
    `rec.prepare(x, wkv, out)` (bf16) or `rec.prepare(x, wkv_raw, wkv_scales, out)` (weights in
    their file encoding; wkv_scales None where the encoding has none). Arguments are checked by
    `launch.prepare_project` / `launch.prepare_project_q`."""
    scales, out = (None, more[0]) if len(more) == 1 else more
    T, K = x.shape
    N = out.shape[1]           # out [T, N] (a q2k_r weight holds its rows in tiles: w.shape[0] is not N)
    grid, block, *smem = rec.geometry(T, N)
    sharedmem = smem[0] if smem else 0
    kernel = rec.kernel_for(T)
    withscales = () if scales is None else (scales,)
    if rec.args == "naive":
        args = (x, w) + withscales + (out,)
    elif rec.args == "fast":
        if data_address(x) % 16 or data_address(w) % rec.align:
            raise ValueError(f"{rec.name} reads x as 16-byte chunks and the weight as {rec.align}-byte units: x must "
                             f"be 16-byte and the weight {rec.align}-byte aligned (use a naive version or an "
                             "aligned copy)")
        args = (flat_u32(x), flat_u32(w)) + withscales + (out, T, K)
    else:
        raise ValueError(f"proj record {rec.name} has an unknown argument form {rec.args!r}")
    if sharedmem:
        allow_dynamic_shared(kernel, args, sharedmem)
    return PreparedLaunch(rec.name, kernel, grid, block, stream, args, out, sharedmem=sharedmem)


def fast_launch(name: str, kernel, grid, block, x, wkv, out, stream) -> PreparedLaunch:
    """A launch of a fast kernel on (x32, w32, out, T, K); x and wkv must be 16-byte aligned."""
    if data_address(x) % 16 or data_address(wkv) % 16:
        raise ValueError(f"{name} reads x and wkv as 16-byte chunks; their data must be 16-byte aligned "
                         "(use a naive version or an aligned copy)")
    T, K = x.shape
    return PreparedLaunch(name, kernel, grid, block, stream, (flat_u32(x), flat_u32(wkv), out, T, K), out)


def check_bf16_matrix(a, name: str, shape_doc: str):
    """A launcher's check of a bf16 matrix argument (uint16 words, 2-D, C-contiguous)."""
    return check_array(a, name, np.uint16, 2, what="bf16 words (uint16)", doc=shape_doc)
