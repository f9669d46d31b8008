"""The two-layer gate (`launch.prepare_gate_pair`, gate_v3's pair kernel) against two gate_v3
launches in sequence: the highway, and each layer's dot and gate, must be the same bits (the
pair is v3's arithmetic twice in one block; gate_v3 itself is checked against the reference in
test_gate_cuda.py). Simulator tier: tiny and odd shapes (a partial last chunk, 1..8 chunks a
thread through `tps`), both layouts and residuals, masks, every subset of outputs, bad
arguments. The decode graph's use of it is checked on the GPU (tests/test_engine_decode.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import f32_to_bf16
from engram_numba.stages.gate import cuda as G
from engram_numba.stages.gate import launch as L

F32 = np.float32


def _layer(rng, T, hc, dim):
    kv = f32_to_bf16(rng.standard_normal((T, (hc + 1) * dim), dtype=F32))
    w = ((1.0 + 0.1 * rng.standard_normal((hc, dim))) * (1.0 + 0.1 * rng.standard_normal((hc, dim)))).astype(F32)
    return kv, w


def _inputs(rng, T, hc, dim, masked):
    scale = rng.choice(np.array([1.0, 10.0, 100.0], dtype=F32), size=(T, hc, 1))
    h = rng.standard_normal((T, hc, dim), dtype=F32) * scale
    mask = None
    if masked:
        mask = (rng.random(T) < 0.5).astype(np.uint8)
        mask[0] = 0
        if T > 1:
            mask[-1] = 1
    return h, _layer(rng, T, hc, dim), _layer(rng, T, hc, dim), mask


def _poison(T, hc):
    return cuda.to_device(np.full((T, hc), np.nan, F32))


def _sequence(h, la, lb, mask, residual, layout, tps, want):
    """Two gate_v3 launches, layer a then layer b -> (highway, [dot_a, gate_a, dot_b, gate_b])."""
    T, hc, _ = h.shape
    d_h = cuda.to_device(h)
    d_mask = None if mask is None else cuda.to_device(mask)
    outs = [_poison(T, hc) if w else None for w in want]
    for (kv, w), dot, gate in ((la, outs[0], outs[1]), (lb, outs[2], outs[3])):
        L.run_gate(d_h, cuda.to_device(kv), cuda.to_device(w), token_mask=d_mask, residual=residual, dot_out=dot,
                   gate_out=gate, version="gate_v3", layout=layout, tps=tps)
    cuda.synchronize()
    return d_h.copy_to_host(), [None if o is None else o.copy_to_host() for o in outs]


def _pair(h, la, lb, mask, residual, layout, tps, want):
    T, hc, _ = h.shape
    d_h = cuda.to_device(h)
    d_mask = None if mask is None else cuda.to_device(mask)
    outs = [_poison(T, hc) if w else None for w in want]
    launch = L.prepare_gate_pair(d_h, cuda.to_device(la[0]), cuda.to_device(la[1]), cuda.to_device(lb[0]),
                                 cuda.to_device(lb[1]), token_mask=d_mask, residual=residual, dot_a=outs[0],
                                 gate_a=outs[1], dot_b=outs[2], gate_b=outs[3], layout=layout, tps=tps)
    assert launch.name == "gate_v3[2 layers]"
    launch()
    cuda.synchronize()
    return d_h.copy_to_host(), [None if o is None else o.copy_to_host() for o in outs]


def _same(got, want):
    (gh, go), (wh, wo) = got, want
    assert np.array_equal(gh.view(np.uint32), wh.view(np.uint32)), "highway differs from two gate_v3 launches"
    for name, g, w in zip(("dot_a", "gate_a", "dot_b", "gate_b"), go, wo):
        assert (g is None) == (w is None)
        if g is not None:
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"{name} differs"


# (T, hc, dim, layout, tps): dim 5*8 and 9*8 (odd chunk counts), tps 32 with 40/72/104 chunks (2, 3,
# 4 chunks a thread, a partial last one); 264 chunks at tps 32 is 8.25 -> too many for v3; 256: 8
CASES = [
    (1, 4, 64, None, None), (3, 3, 40, None, None), (2, 2, 72, "token", None), (3, 1, 320, None, 32),
    (1, 4, 576, None, 32), (2, 3, 832, "token", 32), (1, 1, 2048, None, 32), (1, 2, 1256, None, 32),
]


@pytest.mark.parametrize("T,hc,dim,layout,tps", CASES, ids=[f"T{c[0]}-hc{c[1]}-d{c[2]}-{c[3]}-{c[4]}" for c in CASES])
@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_pair_is_two_v3_launches_bit_for_bit(rng, T, hc, dim, layout, tps, residual):
    masked = (dim // 8) % 2 == 1 or T == 2
    h, la, lb, mask = _inputs(rng, T, hc, dim, masked)
    nch = G.geometry_v3(T, hc, dim, layout, tps)["nch"]
    assert 1 <= nch <= 8
    want = (True, True, True, True)
    _same(_pair(h, la, lb, mask, residual, layout, tps, want), _sequence(h, la, lb, mask, residual, layout, tps, want))


@pytest.mark.parametrize("want", [(False, False, False, False), (False, True, False, True), (True, False, False, True),
                                  (False, False, True, False)])
def test_optional_outputs_and_masks(rng, want):
    """Any subset of the four outputs; masked tokens with and without a dot to compute."""
    h, la, lb, mask = _inputs(rng, 3, 2, 64, True)
    _same(_pair(h, la, lb, mask, "fp32", None, None, want), _sequence(h, la, lb, mask, "fp32", None, None, want))
    all_dead = np.zeros(3, np.uint8)
    _same(_pair(h, la, lb, all_dead, "bf16", None, None, want),
          _sequence(h, la, lb, all_dead, "bf16", None, None, want))


def test_every_chunk_count_has_its_kernel():
    assert G.gate_v3_pair(2, False) is G.gate_v3_pair(2, False)
    assert G.gate_v3_pair(2, False) is not G.gate_v3_pair(2, True)
    with pytest.raises(ValueError, match="1..8 chunks"):
        G.gate_v3_pair(9)


def _args(rng, T=2, hc=2, dim=64):
    h, la, lb, _ = _inputs(rng, T, hc, dim, False)
    return [cuda.to_device(x) for x in (h, la[0], la[1], lb[0], lb[1])]


@pytest.mark.parametrize("which,bad,match", [
    (2, np.zeros((2, 64), F32), "w_a"),
    (3, np.zeros((2, 3 * 64 + 8), np.uint16), "kv_b"),
    (4, np.zeros((3, 64), F32), "w_b"),
])
def test_bad_arguments_name_the_layer(rng, which, bad, match):
    args = _args(rng)
    before = args[0].copy_to_host()
    args[which] = cuda.to_device(bad) if which != 2 else cuda.to_device(np.zeros((3, 64), F32))
    with pytest.raises((ValueError, TypeError), match=match):
        L.prepare_gate_pair(*args)()
    assert np.array_equal(args[0].copy_to_host(), before)


def test_bad_outputs_mask_and_options(rng):
    args = _args(rng)
    with pytest.raises(ValueError, match="gate_b"):
        L.prepare_gate_pair(*args, gate_b=cuda.device_array((2, 3), F32))
    with pytest.raises(ValueError, match="token_mask"):
        L.prepare_gate_pair(*args, token_mask=cuda.device_array(3, np.uint8))
    with pytest.raises(ValueError, match="residual"):
        L.prepare_gate_pair(*args, residual="fp16")
    with pytest.raises(ValueError, match="gate_v3 keeps at most"):
        L.prepare_gate_pair(*_args(rng, 1, 1, 8 * 32 * 9), tps=32)


def test_unaligned_views_are_refused(rng):
    h, la, lb, _ = _inputs(rng, 2, 2, 64, False)
    big = cuda.to_device(np.concatenate([np.zeros(2, np.uint16), lb[0].ravel()]))
    kv_b = big[2:].reshape(2, 3 * 64)     # starts 4 bytes into its allocation: no 16-byte loads
    with pytest.raises(ValueError, match="kv_b.*16-byte"):
        L.prepare_gate_pair(cuda.to_device(h), cuda.to_device(la[0]), cuda.to_device(la[1]), kv_b,
                            cuda.to_device(lb[1]))


def test_blocks_past_the_register_file_are_refused(rng):
    # the token layout at the released width puts 5 chunks a thread on 512 threads: the pair's
    # registers for that do not fit a block (it failed to launch on the H200), so it is refused
    h, la, lb, mask = _inputs(rng, 5, 4, 5120, False)
    cfg = G.geometry_v3(5, 4, 5120, "token")
    assert (cfg["nch"], cfg["block"]) == (5, 512) and not G.pair_fits(cfg)
    with pytest.raises(ValueError, match="5 chunks a thread on 512-thread blocks.*layout='stream'"):
        L.prepare_gate_pair(cuda.to_device(h), cuda.to_device(la[0]), cuda.to_device(la[1]), cuda.to_device(lb[0]),
                            cuda.to_device(lb[1]), layout="token")
    assert G.pair_fits(G.geometry_v3(1, 4, 5120)) and G.pair_fits(G.geometry_v3(5, 4, 2048, "token"))


def test_zero_tokens_is_a_no_op():
    z = cuda.to_device(np.zeros((0, 2, 64), F32))
    kv = cuda.to_device(np.zeros((0, 3 * 64), np.uint16))
    w = cuda.to_device(np.zeros((2, 64), F32))
    launch = L.prepare_gate_pair(z, kv, w, kv, w)
    assert launch.name == "gate_v3[2 layers]" and launch() is None


# ---- GPU tier: the released width, the decode shape and a few others -------------------------------

GPU_CASES = [(1, 4, 5120, None), (1, 3, 5120, None), (16, 4, 5120, None), (5, 4, 2048, "token"), (600, 4, 5120, None),
             (3, 2, 136, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("T,hc,dim,layout", GPU_CASES, ids=[f"T{c[0]}-hc{c[1]}-d{c[2]}-{c[3]}" for c in GPU_CASES])
@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_gpu_pair_is_two_v3_launches_bit_for_bit(rng, gpu_record, T, hc, dim, layout, residual):
    h, la, lb, mask = _inputs(rng, T, hc, dim, T > 1)
    want = (True, True, True, True)
    _same(_pair(h, la, lb, mask, residual, layout, None, want), _sequence(h, la, lb, mask, residual, layout, None, want))
    gpu_record(test="gate pair == two gate_v3", shape=[T, hc, dim], layout=str(layout), residual=residual,
               nch=G.geometry_v3(T, hc, dim, layout)["nch"], passed=True)
