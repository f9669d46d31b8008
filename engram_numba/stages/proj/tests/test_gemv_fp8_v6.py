"""gemv_fp8_v6 (v5 in one launch, teams of 8 warps on a resident grid) against gemv_fp8_v5 and
gemv_fp8_v2, bit for bit, and the yardstick.

v6's claim (cuda_gemv_fp8.py, "gemv_fp8_v6"): v5's shifts, f16 copy of x, mma, k partition, tile
order and warp order, only made in each block's shared memory and spread differently over blocks,
so v5's bits wherever the inputs are (and v2's where v5's are). The simulator runs 768-thread
blocks as 768 Python threads, so the team and group edges are held here on builds of the same
factory with fewer teams (make_gemv_fp8_v6(1) and (2): the same code, team 0's or teams 0-1's
branches) and on grids of fewer simulated SMs (`run_v6`'s `blocks`), and one case runs the
registered build (3 teams: team 2's barrier). Which test covers which edge:
- one block with more groups than teams (a team with two groups, the others a surplus trip that
  computes and stores nothing), all 3 teams of the registered build:
  test_v6_is_v5_bit_for_bit[registered-4-groups-1-block]
- a team with no group at all, blocks with unequal group counts (2, 1), T = 1:
  test_v6_is_v5_bit_for_bit[T1-idle-team-unequal-blocks]
- more tiles than a trip (K = 2080: 9 a warp, one whole trip of 4 and one partial; the last warp's
  only trip partial; 260 16-byte units of x a token, more than the 256 threads that copy them),
  all 8 tokens of a group: test_v6_is_v5_bit_for_bit[T4+4-more-tiles-than-a-trip]
- rows past N and tokens past T within a group: every test_v6_is_v5_bit_for_bit case but T4+4's
- x far outside the yardstick's noise estimate (EXTREME magnitudes): every
  test_v6_is_v5_bit_for_bit case
- two token groups (T = 9, the second grid row's one token), huge / subnormal / zero tokens:
  test_v6_two_token_groups_and_extreme_tokens
- e8m0 tile scales at both ends: test_v6_is_v5_at_extreme_tile_scales
- another unroll and blocks an SM through the launcher's kernel= path, the grid capped at the
  groups: test_v6_variant_one_team_two_blocks
test_proj_quant.py runs the registered build through project_q against the yardstick at the
record's simulator cases (one group; 3 groups over 3 blocks; 7 groups over 3 blocks (3, 2, 2) and
two token groups; more tiles than a trip): the 7-group split's edges (several groups a block,
blocks of unequal counts) are the first two cases above, bit for bit. On the GPU
tools/fp8_gemv_dev.py and test_proj_quant.py compare v6 with v2 at the released shape.
"""
from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
from engram_numba.stages import registry
from engram_numba.stages.proj import cuda_gemv_fp8 as C
from engram_numba.stages.proj import records  # noqa: F401  (registers gemv_fp8_v6)

from .conftest import poisoned
from .test_gemv_fp8_v5 import EXTREME, assert_within_the_yardstick, moderate_and_extreme_x, wide_x
from .test_proj_quant import random_fp8, run_q

_BUILDS = {C.V6_TEAMS: C._gemv_fp8_v6}


def run_v6(x, codes, scales, teams=C.V6_TEAMS, blocks=C.SIM_V4_BLOCKS, grid=None):
    """gemv_fp8_v6 through its launcher on `blocks` simulated SMs: the registered kernel (teams =
    V6_TEAMS) or make_gemv_fp8_v6(teams), the same factory with fewer teams of 8 warps (fewer
    simulated threads). grid: the (blocks, token groups) the case expects (asserted)."""
    if teams not in _BUILDS:
        _BUILDS[teams] = C.make_gemv_fp8_v6(teams)
    T, N = x.shape[0], codes.shape[0]
    out = poisoned(T, N)
    with mock.patch.object(C, "sm_count", lambda: blocks):
        launch = C.launcher_v6(registry.get("proj", "gemv_fp8_v6"), cuda.to_device(x), cuda.to_device(codes),
                               cuda.to_device(scales), out, kernel=_BUILDS[teams], teams=teams)
    assert launch.block == 256 * teams and (grid is None or launch.grid == grid), launch
    launch()
    return out.copy_to_host()


def _groups(N, nb):
    """The 16-row groups each of nb blocks owns (the kernel's even share)."""
    G = -(-N // C.FP8_ROWS)
    return [G // nb + (b < G % nb) for b in range(nb)]


# (T, K, N, teams, blocks): the edges each case holds (module doc)
V6_CASES = {
    # 4 groups on one block of the registered 3 teams: team 0 groups 0 and 3, teams 1 and 2 one group
    # and then a surplus trip; N = 52: 12 rows past N; 3 + 3 tokens: 2 token columns past T
    "registered-4-groups-1-block": (3, 96, 52, 3, 1),
    # 3 groups over 2 blocks (2, 1) of 2 teams: block 1's team 1 has no group; T = 1; K = 64: warps 2-7
    # have no tile
    "T1-idle-team-unequal-blocks": (1, 64, 40, 2, 2),
    # 1 group, 1 team: 65 tiles, 9 a warp (4 + 4 + 1), the last warp's 2 tiles one partial trip;
    # 4 + 4 tokens: every column of the token group
    "T4+4-more-tiles-than-a-trip": (4, 2080, 16, 1, 3),
}


@pytest.mark.parametrize("case", [pytest.param(k, marks=(pytest.mark.slow,) if i else ())
                                  for i, k in enumerate(V6_CASES)])
def test_v6_is_v5_bit_for_bit(rng, case):
    """T tokens of wide_x's moderate magnitudes (held to the yardstick too) and T of its EXTREME ones
    (test_gemv_fp8_v5's moderate_and_extreme_x: one launch; at T = 1 the EXTREME token gets a launch
    of its own): v5's bits, and v2's."""
    T, K, N, teams, blocks = V6_CASES[case]
    nb = min(blocks, -(-N // C.FP8_ROWS))
    codes, scales = random_fp8(rng, N, K)
    if T == 1:
        x, xe = wide_x(rng, T, K), wide_x(rng, T, K, EXTREME)
    else:
        x, xe = moderate_and_extreme_x(rng, T, K), None
    got = run_v6(x, codes, scales, teams, blocks, grid=(nb, 1))
    assert_within_the_yardstick("gemv_fp8_v6", got[:T], x[:T], codes, scales)
    v5 = run_q("gemv_fp8_v5", "fp8", x, codes, scales)
    print(json.dumps(dict(case=case, shape=[int(x.shape[0]), K, N], teams=teams, groups_a_block=_groups(N, nb),
                          differs_from_v5=int((got != v5).sum()))))
    np.testing.assert_array_equal(got, v5)
    np.testing.assert_array_equal(got, run_q("gemv_fp8_v2", "fp8", x, codes, scales))
    if xe is not None:
        np.testing.assert_array_equal(run_v6(xe, codes, scales, teams, blocks),
                                      run_q("gemv_fp8_v5", "fp8", xe, codes, scales))


@pytest.mark.parametrize("scale_byte,x_exp", [(246, -24), pytest.param(8, 24, marks=pytest.mark.slow)],
                         ids=["huge-scale-small-x", "tiny-scale-big-x"])
def test_v6_is_v5_at_extreme_tile_scales(rng, scale_byte, x_exp):
    """The e8m0 ends with x far from them (test_gemv_fp8_v5's case): v6 applies v5's 2^-s per tile
    (per warp and tile, whatever the teams: the one-team build)."""
    T, K, N = 3, 96, 20
    x = f32_to_bf16((rng.standard_normal((T, K)) * 2.0 ** x_exp).astype(np.float32))
    codes, _ = random_fp8(rng, N, K)
    scales = np.full((-(-N // 32), K // 32), scale_byte, np.uint8)
    want = run_q("gemv_fp8_v5", "fp8", x, codes, scales)
    assert np.isfinite(bf16_to_f32(want)).all()
    np.testing.assert_array_equal(run_v6(x, codes, scales, teams=1), want)


@pytest.mark.slow
def test_v6_two_token_groups_and_extreme_tokens(rng):
    """T = 9 (two grid rows: the second block row's one token), tokens of huge, subnormal and zero
    magnitude (the shifts' ends, as test_x_f16_kernel): v5's bits. The one-team build, one group (a
    block a token group: the shifts and the copy are the block's, whatever its teams)."""
    T, K, N = 9, 64, 16
    x = f32_to_bf16(rng.standard_normal((T, K)).astype(np.float32))
    x[0] = f32_to_bf16((rng.standard_normal(K) * 2.0 ** 100).astype(np.float32))
    x[1] = rng.integers(0, 0x80, K).astype(np.uint16) | (rng.integers(0, 2, K).astype(np.uint16) << 15)
    x[2] = 0
    codes, scales = random_fp8(rng, N, K)
    np.testing.assert_array_equal(run_v6(x, codes, scales, teams=1, grid=(1, 2)),
                                  run_q("gemv_fp8_v5", "fp8", x, codes, scales))


def test_v6_variant_one_team_two_blocks(rng):
    """A variant build (1 team, 2 tiles a trip, 2 blocks an SM: the simulator's 3 blocks x 2 = 6,
    capped at the 4 groups; 12 rows past N) through the launcher's kernel= path, as
    tools/fp8_gemv_dev.py runs it: v5's bits."""
    T, K, N = 2, 64, 52
    x = wide_x(rng, T, K)
    codes, scales = random_fp8(rng, N, K)
    kern = C.make_gemv_fp8_v6(1, 2, 2)
    grid, block, nbytes = C.geometry_v6(T, N, K, 1, 2)
    assert grid == (4, 1) and block == 256 and nbytes == 4 * C.v6_shared_words(T, K, 1)
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
