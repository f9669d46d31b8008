"""gate_v4 (many blocks a (t, c) row, for few tokens) and its two-layer pair.

Simulator tier, at odd small shapes (a slice count that does not divide the chunks, so the last
slice is partial; several slices a row; T = 1 and 3), masks, both residuals:
- v4 against the numpy reference with the tolerances of test_gate_cuda.py (`check`: the dot in
  u * dot_abs, the gate from its own dot within 1 ulp, the highway exactly h + gate*v from its own
  gate); test_gate_cuda.py also runs v4 through every generic test (it walks the registry);
- the same prepared launch run again (its counters are not reset: the second launch is a new
  epoch) equals a fresh launch on the first one's output, bit for bit;
- the pair against two gate_v4 launches (same tps), bit for bit: highway, dot and gate of both
  layers, every subset of outputs, dead tokens with and without a dot to compute;
- geometry and the launcher's refusals (grid not resident, bad tps).
The GPU tier (marker gpu): the released width at T = 1, 2, 8 against the reference and the pair
against two launches, replayed; tools/gate_dev.py times them.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from engram_numba.stages.gate import cuda as G
from engram_numba.stages.gate import launch as L
from engram_numba.stages.gate.tests.test_gate_cuda import Expected, check, make_inputs

F32 = np.float32
V4 = "gate_v4"


def _run(prepared_args, h, kv, w, mask, residual, tps, want=(True, True)):
    """One gate_v4 launch on a fresh device copy of h -> (highway, dot, gate)."""
    T, hc, _ = h.shape
    d_h = cuda.to_device(h)
    dot = cuda.to_device(np.full((T, hc), np.nan, F32)) if want[0] else None
    gate = cuda.to_device(np.full((T, hc), np.nan, F32)) if want[1] else None
    launch = L.prepare_gate(d_h, cuda.to_device(kv), cuda.to_device(w),
                            token_mask=None if mask is None else cuda.to_device(mask), residual=residual,
                            dot_out=dot, gate_out=gate, version=V4, tps=tps)
    assert launch.name == V4
    launch()
    cuda.synchronize()
    return d_h.copy_to_host(), None if dot is None else dot.copy_to_host(), None if gate is None else gate.copy_to_host()


# (T, hc, dim, tps): slices of 32 chunks with a partial last one (70 chunks: 32 + 32 + 6; 41: 32 + 9),
# one slice (8 chunks), and 64-thread blocks (two warps a slice: the warps' sums in order)
CASES = [(1, 3, 560, 32), (3, 2, 328, 32), (1, 4, 64, None), (3, 1, 1048, 64)]


@pytest.mark.parametrize("T,hc,dim,tps", CASES, ids=[f"T{c[0]}-hc{c[1]}-d{c[2]}-tps{c[3]}" for c in CASES])
@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_v4_matches_reference(rng, T, hc, dim, tps, residual):
    masked = T > 1
    h, kv, w, mask = make_inputs(rng, T, hc, dim, mask=masked)
    cfg = G.geometry_v4(T, hc, dim, None, tps)
    assert cfg["slices"] * cfg["tps"] >= dim // 8 > (cfg["slices"] - 1) * cfg["tps"]
    got = _run(None, h, kv, w, mask, residual, tps)
    stats = check(Expected(h, kv, w, mask, residual), got, version=V4)
    print(f"\ngate_v4 T{T} hc{hc} dim{dim} tps{tps} {residual}: {stats}")


def test_v4_launch_again_is_a_new_epoch(rng):
    """A prepared launch run twice (as a graph replays it): its counters keep counting, and the
    second run equals a fresh launch on the first run's output, bit for bit; dead tokens with a
    dot asked for move the counters too."""
    T, hc, dim = 3, 1, 328
    h, kv, w, mask = make_inputs(rng, T, hc, dim, mask=True)
    for residual in ("fp32", "bf16"):
        d_h = cuda.to_device(h)
        d_dot, d_gate = cuda.device_array((T, hc), F32), cuda.device_array((T, hc), F32)
        launch = L.prepare_gate(d_h, cuda.to_device(kv), cuda.to_device(w), token_mask=cuda.to_device(mask),
                                residual=residual, dot_out=d_dot, gate_out=d_gate, version=V4, tps=32)
        launch()
        first = _run(None, h, kv, w, mask, residual, 32)
        assert np.array_equal(d_h.copy_to_host().view(np.uint32), first[0].view(np.uint32))
        launch()
        second = _run(None, first[0], kv, w, mask, residual, 32)
        assert np.array_equal(d_h.copy_to_host().view(np.uint32), second[0].view(np.uint32))
        assert np.array_equal(d_dot.copy_to_host().view(np.uint32), second[1].view(np.uint32))
        assert np.array_equal(d_gate.copy_to_host().view(np.uint32), second[2].view(np.uint32))
        sync = launch.args[7].copy_to_host().reshape(T * hc, G.V4_SYNC)
        S = G.geometry_v4(T, hc, dim, None, 32)["slices"]
        assert np.all(sync[:, G.V4_ARRIVE_A] == 2 * S) and np.all(sync[:, G.V4_TICKET_U] == 2 * S)
        assert G.v4_timeouts(launch) == 0


# ---- the pair -----------------------------------------------------------------------------------

def _layer(rng, T, hc, dim):
    _, kv, w, _ = make_inputs(rng, T, hc, dim)
    return kv, w


def _poison(T, hc, want):
    return cuda.to_device(np.full((T, hc), np.nan, F32)) if want else None


def _host(outs):
    return [None if o is None else o.copy_to_host() for o in outs]


def _two_launches(h, la, lb, mask, residual, tps, want, times=1):
    """gate_v4 for layer a, then for layer b, `times` over -> (highway, [dot_a, gate_a, dot_b, gate_b])."""
    T, hc, _ = h.shape
    d_h = cuda.to_device(h)
    d_mask = None if mask is None else cuda.to_device(mask)
    outs = [_poison(T, hc, w) for w in want]
    launches = [L.prepare_gate(d_h, cuda.to_device(kv), cuda.to_device(w), token_mask=d_mask, residual=residual,
                               dot_out=dot, gate_out=gate, version=V4, tps=tps)
                for (kv, w), dot, gate in ((la, outs[0], outs[1]), (lb, outs[2], outs[3]))]
    for _ in range(times):
        for launch in launches:
            launch()
    cuda.synchronize()
    return d_h.copy_to_host(), _host(outs)


def _pair(h, la, lb, mask, residual, tps, want, times=1):
    T, hc, _ = h.shape
    d_h = cuda.to_device(h)
    outs = [_poison(T, hc, w) for w in want]
    launch = L.prepare_gate_pair(d_h, *(cuda.to_device(x) for x in (la[0], la[1], lb[0], lb[1])),
                                 token_mask=None if mask is None else cuda.to_device(mask), residual=residual,
                                 dot_a=outs[0], gate_a=outs[1], dot_b=outs[2], gate_b=outs[3], tps=tps, version=V4)
    assert launch.name == "gate_v4[2 layers]"
    assert launch.grid == 3 * T * hc * G.geometry_v4(T, hc, h.shape[2], None, tps)["slices"]
    for _ in range(times):
        launch()
    cuda.synchronize()
    return d_h.copy_to_host(), _host(outs)


def _same(got, want):
    (gh, go), (wh, wo) = got, want
    assert np.array_equal(gh.view(np.uint32), wh.view(np.uint32)), "highway differs from two gate_v4 launches"
    for name, g, w in zip(("dot_a", "gate_a", "dot_b", "gate_b"), go, wo):
        assert (g is None) == (w is None)
        if g is not None:
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"{name} differs"


PAIR_CASES = [(1, 3, 560, 32), (3, 2, 328, 32), (1, 2, 1048, 64)]


@pytest.mark.parametrize("T,hc,dim,tps", PAIR_CASES, ids=[f"T{c[0]}-hc{c[1]}-d{c[2]}-tps{c[3]}" for c in PAIR_CASES])
@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_pair_is_two_v4_launches_bit_for_bit(rng, T, hc, dim, tps, residual):
    h, _, _, mask = make_inputs(rng, T, hc, dim, mask=T > 1)
    la, lb = _layer(rng, T, hc, dim), _layer(rng, T, hc, dim)
    want = (True, True, True, True)
    _same(_pair(h, la, lb, mask, residual, tps, want), _two_launches(h, la, lb, mask, residual, tps, want))


@pytest.mark.parametrize("want", [(False, False, False, False), (False, True, False, True), (True, False, False, True),
                                  (False, False, True, False)])
def test_pair_outputs_masks_and_replay(rng, want):
    """Any subset of the outputs; dead tokens with and without a dot to compute; the same pair
    launch run twice equals four gate_v4 launches (a, b, a, b)."""
    T, hc, dim = 2, 1, 328                        # token 0 live, token 1 dead
    h, _, _, mask = make_inputs(rng, T, hc, dim, mask=True)
    la, lb = _layer(rng, T, hc, dim), _layer(rng, T, hc, dim)
    _same(_pair(h, la, lb, mask, "fp32", 32, want, times=2), _two_launches(h, la, lb, mask, "fp32", 32, want, times=2))
    dead = np.zeros(T, np.uint8)
    _same(_pair(h, la, lb, dead, "bf16", 32, want), _two_launches(h, la, lb, dead, "bf16", 32, want))


# ---- geometry and refusals ------------------------------------------------------------------------

def test_geometry_at_the_released_widths():
    for dim, slices in ((5120, 20), (4096, 16)):
        cfg = G.geometry_v4(1, 4, dim)
        assert (cfg["tps"], cfg["slices"], cfg["grid"], cfg["block"]) == (32, slices, 2 * 4 * slices, 32)
        for T in (1, 2, 8):                     # the decode shapes the GPU tool times
            assert G.v4_applies(T, 4, dim, pair=True, n_sm=132) and G.v4_applies(T, 4, dim, n_sm=132)
    assert G.geometry_v4(1, 4, 16384)["tps"] == 64 and G.geometry_v4(1, 4, 5120, None, 128)["slices"] == 5
    assert not G.v4_applies(16, 4, 5120, pair=True, n_sm=132)      # 3840 blocks: not resident at once
    assert not G.v4_applies(1, 1, 8 * 512 * 33, n_sm=132)          # more than 32 slices of 512
    with pytest.raises(ValueError, match="multiple of 32"):
        G.geometry_v4(1, 4, 5120, None, 48)


def test_refusals_before_any_launch(rng):
    h, kv, w, _ = make_inputs(rng, 16, 4, 5120)
    d_h = cuda.to_device(h)
    with pytest.raises(ValueError, match="gate_v4 at T=16.*more than the device holds at once"):
        L.prepare_gate(d_h, cuda.to_device(kv), cuda.to_device(w), version=V4, tps=32)
    d_kv, d_w = cuda.to_device(kv), cuda.to_device(w)
    with pytest.raises(ValueError, match=r"gate_v4\[2 layers\] at T=16"):
        L.prepare_gate_pair(d_h, d_kv, d_w, d_kv, d_w, version=V4)
    with pytest.raises(ValueError, match="version"):
        L.prepare_gate_pair(d_h, d_kv, d_w, d_kv, d_w, version="gate_v2")
    assert np.array_equal(d_h.copy_to_host().view(np.uint32), h.view(np.uint32))
    z = cuda.to_device(np.zeros((0, 2, 64), F32))
    kz = cuda.to_device(np.zeros((0, 3 * 64), np.uint16))
    wz = cuda.to_device(np.ones((2, 64), F32))
    assert L.prepare_gate_pair(z, kz, wz, kz, wz, version=V4)() is None


# ---- GPU tier ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_gpu_v4_and_pair_at_the_released_width(rng, gpu_record, T, residual):
    hc, dim = 4, 5120
    h, kv, w, mask = make_inputs(rng, T, hc, dim, mask=T > 1)
    stats = check(Expected(h, kv, w, mask, residual), _run(None, h, kv, w, mask, residual, None), version=V4)
    la, lb = _layer(rng, T, hc, dim), _layer(rng, T, hc, dim)
    want = (True, True, True, True)
    _same(_pair(h, la, lb, mask, residual, None, want, times=3),
          _two_launches(h, la, lb, mask, residual, None, want, times=3))
    gpu_record(test="gate_v4 vs reference; pair == two v4 launches (x3)", shape=[T, hc, dim], residual=residual,
               passed=True, **stats)
