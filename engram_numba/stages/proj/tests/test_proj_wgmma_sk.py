"""gemm_v8 (cuda_wgmma.py: gemm_v4's CTA tile on persistent CTAs, stream-K tail): its host-side
split choice and schedules on many shapes (no simulator needed), its split choices in the simulator,
and a prepared launch replayed.

The record's own simulator cases run with every other version's in test_proj_cuda.py (and its GPU
shapes in that file's gpu tier); the compile tier (tests/test_compile_tier.py) checks its sm_90a build."""
import itertools
import json

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import f32_to_bf16
from engram_numba.stages.proj import cuda_wgmma as W
from engram_numba.stages.proj import cuda_wgmma_ws as WS
from engram_numba.stages.proj.reference import projection_reference

from .conftest import Yardstick, assert_within_tolerance, error_stats, poisoned

V8 = W.SK_VARIANTS["gemm_v8"]
K_REL, N_REL, H200_SMS = 6144, 25600, 132
SPLITS = [V8, *W.SK_CANDIDATES.values()]


def make_inputs(rng, T, K, N):
    """x [T, K] and wkv [N, K] as bf16 words from fresh normal draws (never zeros)."""
    return (f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32)),
            f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05)))


def k_tiles_per_cta(table, counts):
    return [sum(int(u[WS.F_KE] - u[WS.F_KB]) for u in table[c, :counts[c]]) for c in range(table.shape[0])]


def check(T, N, K, sv, ctas, min_k_tiles):
    """The schedule of sv at (T, N, K) on `ctas` CTAs: every k tile of every tile once, cut tiles
    finished once from lower CTAs' partials (cuda_wgmma_ws.check_schedule), no idle CTA, and the
    promised balance: stream-K splits give every CTA the same k tiles to within one, data-parallel
    the same tiles to within one."""
    plan = W._Split(sv.bn, sv.split) if sv.split != "auto" else sv.plan(T, N, K, ctas)
    table, counts, slots = W.banded_schedule(T, N, K, plan, ctas, min_k_tiles, W.MAX_BAND if sv.banded else 1)
    WS.check_schedule(table, counts, slots, T, N, K, plan)
    assert table.shape[0] <= ctas and counts.min() >= 1
    per = k_tiles_per_cta(table, counts)
    n_k = -(-K // W.BK)
    assert sum(per) == -(-T // 128) * -(-N // sv.bn) * n_k
    if plan.stream_k and slots:
        assert max(per) - min(per) <= 1, (max(per), min(per))
    else:
        assert max(per) - min(per) <= n_k
    for c in range(table.shape[0]):            # at most one partial (first of the stream-K part), finisher last
        roles = list(table[c, :counts[c], WS.F_ROLE])
        assert roles.count(WS.PARTIAL) <= 1 and roles.count(WS.FINISH) <= 1
        if WS.FINISH in roles:
            assert roles[-1] == WS.FINISH
    return table, counts, slots, per


# tokens around tile and wave edges, widths around both tiles (256, 200), K tails, SM counts from 1 to H200's
_T = [1, 5, 127, 128, 129, 255, 257, 384, 700, 1024]
_N = [8, 199, 256, 257, 600, 1000, 3000]
_K = [8, 64, 72, 520, 6152]
_CTAS = [1, 2, 3, 7, 66, 132]


@pytest.mark.parametrize("sv", SPLITS, ids=lambda v: v.name)
def test_schedules_cover_every_k_tile_once(sv):
    """Every (T, N, K, CTAs) of the grid above (2100 schedules a split), with the simulator's
    unit floor (1 k tile) and the GPU's (4)."""
    for T, N, K, ctas in itertools.product(_T, _N, _K, _CTAS):
        check(T, N, K, sv, ctas, 1)
        if K >= 520:
            check(T, N, K, sv, ctas, 4)


@pytest.mark.parametrize("T", [1, 16, 128, 256, 384, 512, 768, 1024, 2048, 4096, 257, 4000])
@pytest.mark.parametrize("sv", SPLITS, ids=lambda v: v.name)
def test_schedules_released_shape(T, sv):
    check(T, N_REL, K_REL, sv, H200_SMS, 4)


def test_released_split_choice_and_balance(monkeypatch):
    """At N = 25600 on 132 SMs: stream-K wherever the last wave is ragged, data-parallel for a whole
    number of waves; T = 256 / 512 / 1024 / 4096 then take 146 / 291 / 582 / 2328 k tiles on the
    busiest CTA against gemm_v4's 192 / 384 / 672 / 2400 (2 / 4 / 7 / 25 waves of 96)."""
    for T, busiest in [(256, 146), (512, 291), (1024, 582), (4096, 2328)]:
        assert W.choose_split(T, N_REL, K_REL, 256, H200_SMS) == "sk1"
        table, counts, _, per = check(T, N_REL, K_REL, V8, H200_SMS, 4)
        assert max(per) == busiest and table.shape[0] == H200_SMS, (T, max(per))
    # 132 tiles: exactly one wave (T = 128 x 3, N = 256 x 44): nothing to balance, nothing cut
    assert W.choose_split(384, 256 * 44, K_REL, 256, H200_SMS) == "dp"
    # gemm_v6's tile at T <= 128: 128 tiles on 132 SMs is one wave already, and cutting them in two
    # saves less than the fix-up costs (with the GPU's cost guess; the simulator's is 0)
    monkeypatch.setattr(W, "SK_FIXUP_K_TILES", 3)
    assert W.choose_split(128, N_REL, K_REL, 200, H200_SMS) == "dp"
    assert W.choose_split(128, N_REL, K_REL, 256, H200_SMS) == "sk1"      # 100 tiles: 73 k tiles a CTA, not 96


@pytest.mark.parametrize("T,h", [(256, 2), (384, 3), (512, 4), (768, 6), (1024, 4), (4096, 4), (640, 1), (129, 2)])
def test_bands_walk_in_lockstep(T, h):
    """The CTAs of a band take the same output tiles and k ranges at the same steps, one token tile
    each (so each weight k tile is read by all of them at once, as gemm_v4's neighbouring CTAs do)."""
    assert W.band_height(T, H200_SMS) == h
    table, counts, _, per = check(T, N_REL, K_REL, V8, H200_SMS, 4)
    same = [WS.F_N0, WS.F_KB, WS.F_KE, WS.F_ROLE]
    for c in range(0, table.shape[0], h):
        band = table[c:c + h]
        assert (counts[c:c + h] == counts[c]).all()
        assert (band[:, :, same] == band[:1, :, same]).all()
        m = band[:, :counts[c], WS.F_M0]
        assert (np.diff(m, axis=0) == 128).all()          # token tiles j = 0 .. h-1 of the band


def test_bad_variants_are_refused():
    with pytest.raises(AssertionError):
        W.SkVariant(W.VARIANTS["gemm_v5"])          # 64 token rows: the schedule's tiles are 128 rows
    with pytest.raises(AssertionError):
        W.SkVariant(W.VARIANTS["gemm_v4"], "sk3")


def test_unaligned_inputs_are_refused_before_launch(rng):
    x, w = make_inputs(rng, 3, 72, 9)
    xd = cuda.to_device(np.zeros(3 * 72 + 1, np.uint16))[1:].reshape(3, 72)
    with pytest.raises(ValueError, match="16-byte aligned"):
        W.prepare_sk("gemm_v8", V8, xd, cuda.to_device(w), poisoned(3, 9))


def test_prepared_launch_replays_with_the_same_bits(rng):
    """One tile cut over 3 CTAs (two partials and their finisher): the finisher clears the flags it
    consumed, so a prepared launch runs again (the simulator's flag_wait twin raises on a flag left
    unset, and a flag left set would let a second launch read stale partials on a GPU)."""
    T, K, N = 33, 328, 9
    x, w = make_inputs(rng, T, K, N)
    out = poisoned(T, N)
    launch = W.prepare_sk("gemm_v8", V8, cuda.to_device(x), cuda.to_device(w), out, ctas=3)
    flags = launch.args[6]
    assert launch.grid == 3 and flags.size == 2
    launch()
    first = out.copy_to_host()
    assert (flags.copy_to_host() == 0).all()
    out.copy_to_device(np.full((T, N), 0xFFFF, np.uint16))
    launch()
    np.testing.assert_array_equal(out.copy_to_host(), first)
    assert_within_tolerance(error_stats(first, Yardstick(x, w)))


def test_bands_with_stream_k_match_reference(rng):
    """Bands of 2 token tiles on 4 CTAs (2 bands of CTAs), 3 output tiles of 2 k tiles each cut
    between the bands: the first band's CTAs run a partial then a whole tile (the next unit's stages
    in flight across the fix-up), the second's a whole tile then the finisher, and the partial
    slots are remapped per token tile of the band (slot j * S + s)."""
    T, K, N = 130, 72, 600
    x, w = make_inputs(rng, T, K, N)
    out = poisoned(T, N)
    launch = W.prepare_sk("gemm_v8", V8, cuda.to_device(x), cuda.to_device(w), out, ctas=4)
    table, counts, slots, split = W.sk_schedule(T, N, K, V8, 4)
    assert W.band_height(T, 4) == 2 and launch.grid == 4 and slots == 2 and split == "sk1"
    assert [list(table[c, :counts[c], WS.F_ROLE]) for c in range(4)] == [[WS.PARTIAL, WS.WHOLE]] * 2 \
        + [[WS.WHOLE, WS.FINISH]] * 2
    launch()
    stats = error_stats(out.copy_to_host(), Yardstick(x, w), projection_reference(x, w))
    print(json.dumps(dict(shape=[T, K, N], **stats)))
    assert_within_tolerance(stats)


# The split choices beside the record's "auto" in the simulator: (variant, (T, K, N), CTAs). ~1.5 s a
# k tile of a CTA: data-parallel over 2 CTAs (one takes 2 tiles: the ring across units), stream-K over
# 2 waves (5 tiles on 2 CTAs: sk1 would deal 2 whole tiles first), and gemm_v6's 128 x 200 tile cut over 3 CTAs.
CANDIDATE_CASES = [("sk/128x256/dp", (130, 136, 260), 3),
                   ("sk/128x256/sk2", (33, 72, 1100), 2),
                   ("sk/128x200/auto", (33, 264, 210), 3)]


@pytest.mark.slow
@pytest.mark.parametrize("name,shape,ctas", CANDIDATE_CASES, ids=[n for n, _, _ in CANDIDATE_CASES])
def test_split_choices_match_reference(rng, name, shape, ctas):
    T, K, N = shape
    x, w = make_inputs(rng, T, K, N)
    out = poisoned(T, N)
    W.prepare_sk(name, W.SK_CANDIDATES[name], cuda.to_device(x), cuda.to_device(w), out, ctas=ctas)()
    stats = error_stats(out.copy_to_host(), Yardstick(x, w), projection_reference(x, w))
    print(json.dumps(dict(variant=name, shape=[T, K, N], **stats)))
    assert_within_tolerance(stats)
