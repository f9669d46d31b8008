"""gemv_fp8_v6 (v5 in one launch, teams of 8 warps on a resident grid) against gemv_fp8_v5 and
gemv_fp8_v2, bit for bit, and the yardstick.

v6's claim (cuda_gemv_fp8.py, "gemv_fp8_v6"): v5's shifts, f16 copy of x, mma, k partition, tile
order and warp order, only made in each block's shared memory and spread differently over blocks,
so v5's bits wherever the inputs are (and v2's where v5's are). The simulator runs 3 blocks
(SIM_V4_BLOCKS) of 3 teams; the cases put several groups on a block and on a team, none on others,
rows past N, tokens past T and two token groups. On the GPU tools/fp8_gemv_dev.py and
test_proj_quant.py compare v6 with v2 at the released shape.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
from engram_numba.stages.proj import cuda_gemv_fp8 as C

from .test_gemv_fp8_v5 import EXTREME, wide_x
from .test_proj_quant import check_version, random_fp8, run_q


# (T, K, N): T = 1, one group (teams 1, 2 idle); T = 3 with 7 groups over 3 blocks (3, 2, 2: a team
# with two groups) and rows past N; T = 8 with more tiles than a trip (K = 2080: 9 a warp, one whole
# trip and one partial)
@pytest.mark.parametrize("T,K,N", [(1, 160, 20), pytest.param(3, 96, 100, marks=pytest.mark.slow),
                                   pytest.param(8, 2080, 16, marks=pytest.mark.slow)],
                         ids=["T1", "T3-7-groups", "T8-more-tiles-than-a-trip"])
def test_v6_is_v5_bit_for_bit(rng, T, K, N):
    x = wide_x(rng, T, K)
    codes, scales = random_fp8(rng, N, K)
    got, _ = check_version("gemv_fp8_v6", "fp8", x, codes, scales)        # the yardstick
    v5 = run_q("gemv_fp8_v5", "fp8", x, codes, scales)
    print(json.dumps(dict(shape=[T, K, N], differs_from_v5=int((got != v5).sum()))))
    np.testing.assert_array_equal(got, v5)
    np.testing.assert_array_equal(got, run_q("gemv_fp8_v2", "fp8", x, codes, scales))
    x = wide_x(rng, T, K, EXTREME)
    np.testing.assert_array_equal(run_q("gemv_fp8_v6", "fp8", x, codes, scales),
                                  run_q("gemv_fp8_v5", "fp8", x, codes, scales))


@pytest.mark.parametrize("scale_byte,x_exp", [(246, -24), pytest.param(8, 24, marks=pytest.mark.slow)],
                         ids=["huge-scale-small-x", "tiny-scale-big-x"])
def test_v6_is_v5_at_extreme_tile_scales(rng, scale_byte, x_exp):
    """The e8m0 ends with x far from them (test_gemv_fp8_v5's case): v6 applies v5's 2^-s per tile."""
    T, K, N = 3, 96, 20
    x = f32_to_bf16((rng.standard_normal((T, K)) * 2.0 ** x_exp).astype(np.float32))
    codes, _ = random_fp8(rng, N, K)
    scales = np.full((-(-N // 32), K // 32), scale_byte, np.uint8)
    want = run_q("gemv_fp8_v5", "fp8", x, codes, scales)
    assert np.isfinite(bf16_to_f32(want)).all()
    np.testing.assert_array_equal(run_q("gemv_fp8_v6", "fp8", x, codes, scales), want)


@pytest.mark.slow
def test_v6_two_token_groups_and_extreme_tokens(rng):
    """T = 9 (two grid rows: the second block row's one token), tokens of huge, subnormal and zero
    magnitude (the shifts' ends, as test_x_f16_kernel): v5's bits."""
    T, K, N = 9, 64, 40
    x = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32))
    x[0] = f32_to_bf16((rng.standard_normal(K) * 2.0 ** 100).astype(np.float32))
    x[1] = rng.integers(0, 0x80, K).astype(np.uint16) | (rng.integers(0, 2, K).astype(np.uint16) << 15)
    x[2] = 0
    codes, scales = random_fp8(rng, N, K)
    np.testing.assert_array_equal(run_q("gemv_fp8_v6", "fp8", x, codes, scales),
                                  run_q("gemv_fp8_v5", "fp8", x, codes, scales))


def test_v6_variant_one_team_two_blocks(rng):
    """A variant build (1 team, 2 blocks an SM: the simulator's 3 blocks x 2 = 6, capped at the 5
    groups) through the launcher's kernel= path, as tools/fp8_gemv_dev.py runs it: v5's bits."""
    from engram_numba.stages import registry
    from engram_numba.stages.proj import records  # noqa: F401
    T, K, N = 2, 64, 80
    x = wide_x(rng, T, K)
    codes, scales = random_fp8(rng, N, K)
    kern = C.make_gemv_fp8_v6(1, 2, 2)
    grid, block, nbytes = C.geometry_v6(T, N, K, 1, 2)
    assert grid == (5, 1) and block == 256 and nbytes == 4 * C.v6_shared_words(T, K, 1)
    out = cuda.device_array((T, N), np.uint16)
    C.launcher_v6(registry.get("proj", "gemv_fp8_v6"), cuda.to_device(x), cuda.to_device(codes),
                  cuda.to_device(scales), out, kernel=kern, teams=1, blocks_per_sm=2)()
    np.testing.assert_array_equal(out.copy_to_host(), run_q("gemv_fp8_v5", "fp8", x, codes, scales))


def test_v6_geometry_is_one_resident_wave():
    """At the released shape: one block an SM (3 teams), 1,600 groups split 12 / 13 with no block
    waiting for a slot; shared memory within a block's 227 KB at 8 tokens."""
    for T in (1, 4, 8):
        (nb, ny), block, nbytes = C.geometry_v6(T, 25600, 6144)
        assert nb == C.sm_count() and ny == 1 and block == 768
        assert nbytes <= 227 * 1024
        assert C.v6_blocks_per_sm(T, 6144, 3, 1) == 1
    assert C.v6_blocks_per_sm(1, 6144, 1, 3) == 3            # 12 KB of x: 3 one-team blocks fit
    assert C.v6_blocks_per_sm(8, 6144, 1, 3) == 2            # 96 KB of x: 2 do


def test_v6_launch_checks(rng):
    from engram_numba.stages.proj import launch as P
    T, K, N = 1, 64, 16
    x = wide_x(rng, T, K)
    codes, scales = random_fp8(rng, N, K)
    big = cuda.to_device(np.zeros((N * K + 4,), np.uint8))
    bad = big[4:].reshape(N, K)
    bad.copy_to_device(codes)
    with pytest.raises(ValueError, match="8-byte aligned"):
        P.prepare_project_q(cuda.to_device(x), bad, cuda.to_device(scales), weight="fp8", version="gemv_fp8_v6")
    # 8 tokens of K = 16384 do not fit a block's shared memory: refused before any launch
    T, K = 8, 16384
    xd = cuda.to_device(np.zeros((T, K), np.uint16))
    cd = cuda.to_device(np.zeros((N, K), np.uint8))
    sd = cuda.to_device(np.full((1, K // 32), 127, np.uint8))
    with pytest.raises(ValueError, match="shared memory"):
        P.prepare_project_q(xd, cd, sd, weight="fp8", version="gemv_fp8_v6")
