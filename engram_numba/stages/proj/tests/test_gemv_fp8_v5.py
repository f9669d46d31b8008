"""gemv_fp8_v5 (v2 on f16 operands, after x_f16_kernel) against gemv_fp8_v2, bit for bit, and the
yardstick, on x of large dynamic range; x_f16_kernel's shifts and copies against numpy.

v5's claim (cuda_gemv_fp8.py, "gemv_fp8_v5"): its outputs are v2's bits wherever no fp32 sum in
either kernel overflows or goes subnormal and the f16 copy of x is exact (every value over ~2^-32 of
its token's largest). The inputs here keep to that: per token one magnitude (2^-60 .. 2^90) with
values spread over 2^-24 of it, zeros, a whole-zero token, scale bytes 112..135. The simulator's mma
sums the exact products in float64 whatever the operand type; on the GPU tools/fp8_gemv_dev.py
compares v5 with v2 at the released shape.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
from engram_numba.device.intrinsics import SIMULATOR
from engram_numba.stages.proj import cuda_gemv_fp8 as C
from engram_numba.stages.proj import reference as R

from .conftest import assert_within_tolerance, error_stats
from .test_proj_quant import random_fp8, run_q, yardsticks


MODERATE = (40, -60, 0, 30, -20, 7, -50, 20, 1)      # the yardstick's float32 noise estimate squares x
EXTREME = (90, -80, 0, 85, -70, 7, 80, -75, 60)       # v2's sums still normal fp32 (scale bytes 112..135)


def wide_x(rng, T, K, mags=MODERATE):
    """bf16 x [T, K]: token t at magnitude 2^mags[t], each value spread over 2^-24 .. 2 of it, both
    signs, a tenth of them zero; token 2 (if any) all zero."""
    mags = np.array(mags)[:T]
    v = rng.standard_normal((T, K)) * 2.0 ** rng.integers(-24, 1, (T, K))
    v = v * 2.0 ** mags[:, None]
    v[rng.random((T, K)) < 0.1] = 0.0
    if T > 2:
        v[2] = 0.0
    return f32_to_bf16(v.astype(np.float32))


def moderate_and_extreme_x(rng, T, K):
    """x [2T, K]: wide_x's T moderate tokens (within the yardstick's float32 noise estimate), then T
    of its EXTREME ones (2^90 x weights up to 2^18: products ~2^108, tiles ~2^-80 x 2^-24). Each
    token's shift, f16 copy and output column are its own, so one launch holds both kinds (2T <= 8:
    one token group)."""
    assert 1 < T and 2 * T <= C.FP8_TOKENS
    return np.concatenate([wide_x(rng, T, K), wide_x(rng, T, K, EXTREME)])


def assert_within_the_yardstick(version, got, x, codes, scales):
    """A gemv_fp8_* version's kv on the moderate tokens x held to test_proj_quant's yardstick and
    tolerance (check_version's), its figures printed."""
    yard, wb, _ = yardsticks("fp8", x, codes, scales)
    stats = error_stats(got, yard, R.projection_reference(x, wb))
    print(json.dumps(dict(version=version, shape=[int(x.shape[0]), int(x.shape[1]), int(codes.shape[0])], **stats)))
    assert_within_tolerance(stats)


# T = 1: one token (every lane's columns token 0), in one launch and the EXTREME one in another;
# T = 3 + 3: a zero token of each kind, 2 columns past T;
# T = 4 + 4, K = 2080: every column of the token group; 65 tiles, 9 a warp: one whole trip of
# V5_UNROLL (unchecked) and one partial (checked); the last warp's only trip partial
@pytest.mark.parametrize("T,K,N", [(1, 160, 20), pytest.param(3, 96, 33, marks=pytest.mark.slow),
                                   pytest.param(4, 2080, 16, marks=pytest.mark.slow)],
                         ids=["T1", "T3+3", "T4+4-more-tiles-than-a-trip"])
def test_v5_is_v2_bit_for_bit(rng, T, K, N):
    """Moderate tokens (also held to the yardstick) and EXTREME ones (past the yardstick's noise
    estimate): v2's bits all the same."""
    codes, scales = random_fp8(rng, N, K)
    if T == 1:
        x, xe = wide_x(rng, T, K), wide_x(rng, T, K, EXTREME)
    else:
        x, xe = moderate_and_extreme_x(rng, T, K), None
    got = run_q("gemv_fp8_v5", "fp8", x, codes, scales)
    assert_within_the_yardstick("gemv_fp8_v5", got[:T], x[:T], codes, scales)
    want = run_q("gemv_fp8_v2", "fp8", x, codes, scales)
    print(json.dumps(dict(shape=[int(x.shape[0]), K, N], differs_from_v2=int((got != want).sum()))))
    np.testing.assert_array_equal(got, want)
    if T > 2:
        assert (got[2] & 0x7FFF == 0).all() and (got[T + 2] & 0x7FFF == 0).all()      # the zero tokens
    if xe is not None:
        np.testing.assert_array_equal(run_q("gemv_fp8_v5", "fp8", xe, codes, scales),
                                      run_q("gemv_fp8_v2", "fp8", xe, codes, scales))


@pytest.mark.parametrize("scale_byte,x_exp", [(246, -24), (8, 24)], ids=["huge-scale-small-x", "tiny-scale-big-x"])
def test_v5_is_v2_at_extreme_tile_scales(rng, scale_byte, x_exp):
    """Tile scales at the ends of e8m0 with x that puts v2's tile sums far from them: x is scaled by 2^s
    in the mma, and 2^-s goes back on each tile's sum before its scale, so v5's sums never leave v2's
    range (applied to the block sums instead, 2^119 tiles with x ~ 2^-24 overflowed)."""
    T, K, N = 3, 96, 20
    x = f32_to_bf16((rng.standard_normal((T, K)) * 2.0 ** x_exp).astype(np.float32))
    codes, _ = random_fp8(rng, N, K)
    scales = np.full((-(-N // 32), K // 32), scale_byte, np.uint8)
    want = run_q("gemv_fp8_v2", "fp8", x, codes, scales)
    got = run_q("gemv_fp8_v5", "fp8", x, codes, scales)
    assert np.isfinite(bf16_to_f32(want)).all()
    np.testing.assert_array_equal(got, want)


def x_f16_numpy(x):
    """x_f16_kernel's contract in numpy: (f16 copy [T, K] as uint16, shifts [T])."""
    xf = bf16_to_f32(x).astype(np.float64)
    mag = (x & 0x7FFF).max(axis=1).astype(np.int64)
    e = np.maximum(mag >> 7, 1) - 127
    s = np.minimum(15 - e, C.V5_S_MAX)
    with np.errstate(invalid="ignore"):
        h = (xf * 2.0 ** s[:, None]).astype(np.float32).astype(np.float16)
    return h.view(np.uint16), s.astype(np.int32)


def test_x_f16_kernel(rng):
    """Shifts and copies at extreme tokens: huge (bf16's top binade), subnormal bf16, zero, inf and
    NaN, values 2^-40 under the largest (rounded in f16), ordinary."""
    T, K = 6, 96
    x = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32))
    x[0] = f32_to_bf16((rng.standard_normal(K) * 2.0 ** 126).astype(np.float32))
    x[1] = rng.integers(0, 0x80, K).astype(np.uint16) | (rng.integers(0, 2, K).astype(np.uint16) << 15)   # subnormals
    x[2] = 0
    x[3, :3] = [0x7F80, 0xFF80, 0x7FC0]                         # inf, -inf, NaN
    x[4, 1:] = f32_to_bf16((rng.standard_normal(K - 1) * 2.0 ** -40).astype(np.float32))
    xd = cuda.to_device(x)
    h = cuda.device_array((T, K), np.uint16)
    xs = cuda.device_array(T, np.int32)
    C.x_f16_kernel[T, C.XF16_THREADS](xd.view(np.uint32).reshape(-1), h.view(np.uint32).reshape(-1), xs, K)
    want_h, want_s = x_f16_numpy(x)
    got_h, got_s = h.copy_to_host(), xs.copy_to_host()
    np.testing.assert_array_equal(got_s, want_s)
    assert got_s[2] == C.V5_S_MAX and got_s[1] == C.V5_S_MAX and got_s[3] == 15 - 128
    nan = np.isnan(want_h.view(np.float16))
    np.testing.assert_array_equal(np.isnan(got_h.view(np.float16)), nan)
    np.testing.assert_array_equal(got_h[~nan], want_h[~nan])
    # exact wherever the scaled value is at least 2^-17, and never past 2^16
    hv = got_h.view(np.float16).astype(np.float64)
    scaled = bf16_to_f32(x).astype(np.float64) * 2.0 ** got_s[:, None].astype(np.float64)
    fin = np.isfinite(scaled)
    ok = fin & (np.abs(scaled) >= 2.0 ** -17)
    np.testing.assert_array_equal(hv[ok], scaled[ok])
    assert (np.abs(hv[fin]) < 2.0 ** 16).all()
    assert (np.abs(hv[fin & ~ok]) <= 2.0 ** -17).all()


def test_x_f16_kernel_past_the_register_cache(rng):
    """K = 8448: 1056 16-byte units a token, more than the 256 x XF16_CACHE a block keeps in registers
    (the rest loaded twice); the largest magnitude placed in that rest."""
    T, K = 2, 8448
    assert K // 8 > C.XF16_THREADS * C.XF16_CACHE
    x = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32))
    x[:, -5] = f32_to_bf16(np.array([3e4, -5e-3], np.float32))
    x[1, -5] = x[1, -5] | 0x8000
    xd = cuda.to_device(x)
    h = cuda.device_array((T, K), np.uint16)
    xs = cuda.device_array(T, np.int32)
    C.x_f16_kernel[T, C.XF16_THREADS](xd.view(np.uint32).reshape(-1), h.view(np.uint32).reshape(-1), xs, K)
    want_h, want_s = x_f16_numpy(x)
    np.testing.assert_array_equal(xs.copy_to_host(), want_s)
    np.testing.assert_array_equal(h.copy_to_host(), want_h)


@pytest.mark.skipif(not SIMULATOR, reason="calls device helpers from the host (the simulator's twins)")
def test_e4m3_to_f16_and_f16_pack_helpers():
    """e4m3x4_to_f16x2x2 on every code against ml_dtypes; cvt_pack_f16x2 rounds as numpy does."""
    import ml_dtypes
    from engram_numba.stages.proj.gemv_common import cvt_pack_f16x2, e4m3x4_to_f16x2x2
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    words = np.arange(256, dtype=np.uint8).view(np.uint32)
    got = np.array([e4m3x4_to_f16x2x2(w) for w in words], dtype=np.uint32).reshape(-1).view(np.float16)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)].astype(np.float32), want[~np.isnan(want)])
    with np.errstate(over="ignore"):                       # 70000 rounds to inf, as cvt.rn does
        for lo, hi in ((1.0, -2.5), (65504.0, 1e-8), (1.0 + 2.0 ** -11, 70000.0)):
            w = np.uint32(cvt_pack_f16x2(np.float32(lo), np.float32(hi)))
            np.testing.assert_array_equal(np.array([w], np.uint32).view(np.float16),
                                          np.array([lo, hi], np.float32).astype(np.float16))


def test_v5_launch_checks_alignment(rng):
    from engram_numba.stages.proj import launch as P
    T, K, N = 1, 64, 16
    x = wide_x(rng, T, K)
    codes, scales = random_fp8(rng, N, K)
    big = cuda.to_device(np.zeros((N * K + 4,), np.uint8))
    bad = big[4:].reshape(N, K)
    bad.copy_to_device(codes)
    with pytest.raises(ValueError, match="8-byte aligned"):
        P.prepare_project_q(cuda.to_device(x), bad, cuda.to_device(scales), weight="fp8", version="gemv_fp8_v5")
