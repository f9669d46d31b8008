"""gemm_v7's host-made schedule (no simulator needed) and its kernel's candidates in the simulator.

The record's own simulator cases run with every other version's in test_proj_cuda.py; the
compile tier (tests/test_compile_tier.py) checks its sm_90a build."""
import json

import numpy as np
import pytest
from numba import cuda

from engram_numba.stages.proj import cuda_wgmma_ws as W
from engram_numba.stages.proj.reference import projection_reference
from engram_numba.bf16 import f32_to_bf16

from .conftest import Yardstick, assert_within_tolerance, error_stats, poisoned

V7 = W.VARIANTS["gemm_v7"]
K_REL, N_REL, H200_SMS = 6144, 25600, 132


def make_inputs(rng, T, K, N):
    """x [T, K] and wkv [N, K] as bf16 words from fresh normal draws (never zeros)."""
    return (f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32)),
            f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05)))


@pytest.mark.parametrize("T", [1, 16, 128, 256, 512, 1024, 4096, 257, 4000])
def test_schedule_released_shapes(T):
    """Every k tile once, cut tiles finished once from lower CTAs' partials, and the work spread
    evenly: no CTA has more than one tile's k tiles above the mean (the stream-K promise)."""
    table, counts, slots = W.schedule(T, N_REL, K_REL, V7, H200_SMS, min_k_tiles=4)
    W.check_schedule(table, counts, slots, T, N_REL, K_REL, V7)
    n_k = K_REL // W.BK
    per_cta = [sum(int(u[W.F_KE] - u[W.F_KB]) for u in table[c, :counts[c]]) for c in range(table.shape[0])]
    tiles = -(-T // W.BM) * (N_REL // V7.bn)
    assert table.shape[0] == H200_SMS
    assert sum(per_cta) == tiles * n_k
    assert max(per_cta) <= -(-tiles * n_k // H200_SMS) + 1 or max(per_cta) - min(per_cta) <= 1, (max(per_cta), min(per_cta))
    # at most one partial and one finishing unit a CTA; the partial first, the finisher last
    for c in range(table.shape[0]):
        roles = list(table[c, :counts[c], W.F_ROLE])
        assert roles.count(W.PARTIAL) <= 1 and roles.count(W.FINISH) <= 1
        sk = [r for r in roles if r != W.WHOLE]
        assert sk in ([], [W.PARTIAL], [W.FINISH], [W.PARTIAL, W.FINISH])
        if W.FINISH in roles:
            assert roles[-1] == W.FINISH
    if T == 512:        # 400 tiles: 2 data-parallel waves, then 136 tiles in 132 equal ranges
        assert max(per_cta) - min(per_cta) <= 1


@pytest.mark.parametrize("T,K,N,ctas", [(1, 64, 8, 3), (33, 72, 9, 3), (130, 136, 260, 3), (300, 136, 514, 4),
                                        (4096, 6144 + 8, 25600 + 8, 132), (777, 520, 1000, 7), (5, 6144, 300, 132)])
@pytest.mark.parametrize("variant", [V7, *W.CANDIDATES.values()], ids=lambda v: v.name)
def test_schedule_odd_shapes(T, K, N, ctas, variant):
    table, counts, slots = W.schedule(T, N, K, variant, ctas, min_k_tiles=1)
    W.check_schedule(table, counts, slots, T, N, K, variant)
    assert counts.min() >= 1                         # no idle CTA is launched


def test_schedule_data_parallel_variant_cuts_nothing():
    v = next(v for v in W.CANDIDATES.values() if not v.stream_k)
    table, counts, slots = W.schedule(512, N_REL, K_REL, v, H200_SMS)
    assert slots == 0 and set(table[:, :, W.F_ROLE].ravel()) == {W.WHOLE}


def test_check_schedule_catches_a_bad_schedule():
    table, counts, slots = W.schedule(130, 260, 136, V7, 3, min_k_tiles=1)
    bad = table.copy()
    c, u = next((c, u) for c in range(bad.shape[0]) for u in range(counts[c]) if bad[c, u, W.F_ROLE] == W.FINISH)
    bad[c, u, W.F_KB] += 1                           # a k tile nobody computes
    with pytest.raises(AssertionError, match="other than once"):
        W.check_schedule(bad, counts, slots, 130, 260, 136, V7)


def test_tile_order_groups():
    assert W.tile_order(3, 2).tolist() == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
    assert W.tile_order(3, 2, group_m=2).tolist() == [[0, 0], [1, 0], [0, 1], [1, 1], [2, 0], [2, 1]]


# Simulator cases beyond the record's own (test_proj_cuda.py): (variant, (T, K, N), CTAs). ~3 s a k tile
# of a CTA, so all slow: one CTA through 9 k tiles (the 4-stage ring wraps twice: the loader's
# EMPTY waits in steady state), and the 6-stage, 1-loader-warp, 128-wide candidate over 2 CTAs.
CANDIDATE_CASES = [(W.Variant(256, 4, stream_k=False).name, (33, 520, 9), 1),
                   (W.Variant(128, 6, loader_warps=1).name, (70, 136, 136), 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name,shape,ctas", CANDIDATE_CASES, ids=[n for n, _, _ in CANDIDATE_CASES])
def test_candidates_match_reference(rng, name, shape, ctas):
    T, K, N = shape
    x, w = make_inputs(rng, T, K, N)
    out = poisoned(T, N)
    W.prepare_variant(name, W.CANDIDATES[name], cuda.to_device(x), cuda.to_device(w), out, ctas=ctas)()
    stats = error_stats(out.copy_to_host(), Yardstick(x, w), projection_reference(x, w))
    print(json.dumps(dict(variant=name, shape=[T, K, N], **stats)))
    assert_within_tolerance(stats)


@pytest.mark.skipif(not W.SIMULATOR, reason="the simulator twins")
def test_twins_named_barrier_orders_a_handoff_and_flag_wait_refuses_a_higher_cta():
    """A producer warp's stores before `named_barrier_arrive` are seen by the consumer warps after
    their `named_barrier_sync` (two phases of one barrier in a row); a CTA that waits for a flag
    no lower CTA set is refused by the twin instead of hanging."""
    from engram_numba.device.hopper import flag_wait, named_barrier_arrive, named_barrier_sync

    @cuda.jit
    def handoff(buf, seen):
        tid = cuda.threadIdx.x
        for phase in range(2):
            if tid >= 64:                            # the producer warp
                if tid == 64:
                    buf[0] = 10 + phase
                named_barrier_arrive(3, 96)
                named_barrier_sync(4, 96)            # consumers are done with this phase
            else:
                named_barrier_sync(3, 96)
                seen[phase, tid] = buf[0]
                named_barrier_arrive(4, 96)

    seen = np.zeros((2, 64), np.int32)
    handoff[1, 96](np.zeros(1, np.int32), seen)
    assert (seen[0] == 10).all() and (seen[1] == 11).all()

    @cuda.jit
    def waits_on_a_later_cta(flags):
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            flag_wait(flags, 1)
        if cuda.blockIdx.x == 1 and cuda.threadIdx.x == 0:
            cuda.atomic.exch(flags, 1, np.int32(1))

    with pytest.raises(RuntimeError, match="lower-indexed CTAs"):
        waits_on_a_later_cta[2, 32](np.zeros(2, np.int32))
