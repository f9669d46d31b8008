"""q2k_r, the Q2_K wkv re-laid out for the GEMV: the numpy repack is a byte permutation with an exact
inverse, the device repack writes the same bytes, the device decode (the GEMV's own decode path)
gives the file's bf16 weights bit for bit, and the two-layer launch equals two single launches.

Inputs are fresh random Q2_K blocks (random bytes, finite random fp16 d and dmin of both signs) at
odd shapes: N not a multiple of the 16-row tile, K/256 odd (a zero pad block in the last unit).
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from engram_numba.stages.proj import cuda_gemv_q2kr as C
from engram_numba.stages.proj import launch as P
from engram_numba.stages.proj import reference as R
from engram_numba.stages.proj.q2k_r import (UNIT_BYTES, q2k_r_shape, repack_q2k_r, unpack_q2k_r,
                                            wkv_q2k_r_bf16)
from engram_numba.stages.proj.tests.test_proj_quant import POISON, random_q2k, random_x

SHAPES = [(1, 256), (5, 768), (16, 512), (37, 1280), (33, 6144)]


@pytest.mark.parametrize("N,K", SHAPES)
def test_numpy_repack_round_trip(rng, N, K):
    raw = random_q2k(rng, N, K)
    packed = repack_q2k_r(raw, K)
    assert packed.shape == q2k_r_shape(N, K) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_q2k_r(packed, N, K), raw)
    np.testing.assert_array_equal(wkv_q2k_r_bf16(packed, N, K), R.wkv_q2k_bf16(raw, K))
    # a permutation: the padded bytes are zeros, every byte of raw is somewhere once
    if N % 16 == 0 and K % 512 == 0:
        assert packed.nbytes == raw.nbytes
    assert np.array_equal(np.bincount(packed.ravel(), minlength=256) - np.bincount(raw.ravel(), minlength=256),
                          np.eye(256, dtype=np.int64)[0] * (packed.size - raw.size))


def test_layout_puts_each_lane_where_the_doc_says(rng):
    """Spot the three planes of unit 0 of tile 0 against the file's bytes (lane 6: g = 1, t = 2)."""
    N, K = 16, 512
    raw = random_q2k(rng, N, K)
    u = repack_q2k_r(raw, K)[0, :UNIT_BYTES]
    lane, g, n, h = 6, 1, 1, 0
    for b in range(2):
        for p in range(2):
            row, k = g + 8 * p, b * 2 + p
            blk = raw[row, b * 84:(b + 1) * 84]
            chunk = (b * 2 + p) * 32 + lane
            np.testing.assert_array_equal(u[16 * chunk:16 * chunk + 16], blk[16 + 32 * n + 16 * h:][:16])
            sc = u[2048 + 16 * lane + 4 * k:][:4]
            np.testing.assert_array_equal(sc, blk[[8 * n + h, 8 * n + h + 2, 8 * n + h + 4, 8 * n + h + 6]])
            np.testing.assert_array_equal(u[2560 + 16 * g + 4 * k:][:4], blk[80:84])


def test_unpack_refuses_wrong_shapes():
    with pytest.raises(ValueError, match="q2k_r weight of N = 17"):
        unpack_q2k_r(np.zeros((1, 2688), np.uint8), 17, 512)
    with pytest.raises(ValueError, match="uint8 \\[N, 84\\]"):
        repack_q2k_r(np.zeros((3, 85), np.uint8), 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        repack_q2k_r(np.zeros((3, 84), np.uint8), 100)


def test_device_repack_and_decode_every_tile(rng):
    """Device repack == numpy repack byte for byte; the device decode of it == the file's decode."""
    N, K = 21, 768
    raw = random_q2k(rng, N, K)
    packed = C.repack_on_device(cuda.to_device(raw), N, K)
    np.testing.assert_array_equal(packed.copy_to_host(), repack_q2k_r(raw, K))
    out = cuda.to_device(np.full((N, K), POISON, np.uint16))
    P.prepare_wkv_to_bf16(packed, None, out, weight="q2k_r")()
    np.testing.assert_array_equal(out.copy_to_host(), R.wkv_q2k_bf16(raw, K))


def test_device_repack_refuses_bad_arguments(rng):
    raw = cuda.to_device(random_q2k(rng, 5, 256))
    ok = cuda.device_array(q2k_r_shape(5, 256), np.uint8)
    before = ok.copy_to_host()
    with pytest.raises(ValueError, match="raw must be"):
        C.prepare_repack(raw, ok, 6, 256)
    with pytest.raises(ValueError, match="packed must be"):
        C.prepare_repack(raw, cuda.device_array((1, 2000), np.uint8), 5, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        C.prepare_repack(raw, ok, 5, 200)
    np.testing.assert_array_equal(ok.copy_to_host(), before)


def test_project_q_refuses_bad_q2k_r(rng):
    x = cuda.to_device(random_x(rng, 1, 512))
    w = cuda.to_device(repack_q2k_r(random_q2k(rng, 20, 512), 512))
    with pytest.raises(ValueError, match="pass out"):
        P.prepare_project_q(x, w, weight="q2k_r")
    with pytest.raises(ValueError, match="q2k_r bytes for N = 40"):
        P.prepare_project_q(x, w, out=cuda.device_array((1, 40), np.uint16), weight="q2k_r")
    with pytest.raises(ValueError, match="wkv_raw must be \\[N, K/256\\*84\\]"):
        P.prepare_project_q(x, w, out=cuda.device_array((1, 20), np.uint16), weight="q2k", version="gemv_q2k_v4")
    assert P.pick(1, 512, 20, weight="q2k_r").name == "gemv_q2k_v4"


@pytest.mark.slow
def test_two_layer_launch_equals_the_single_launches(rng):
    """One launch over both layers' weights: layer b (found at an offset into the pair buffer) gets
    the bits its own launch gives, layer a (offset 0, the single launch's code) its yardstick."""
    from engram_numba.bf16 import bf16_ulp_distance
    N, K, T = 13, 768, 2
    raws = [random_q2k(rng, N, K) for _ in range(2)]
    xh = [random_x(rng, T, K) for _ in range(2)]
    xs = [cuda.to_device(x) for x in xh]
    pair = cuda.to_device(np.concatenate([repack_q2k_r(r, K) for r in raws]))
    outs = [cuda.to_device(np.full((T, N), POISON, np.uint16)) for _ in range(2)]
    C.prepare_pair("gemv_q2k_v4", xs[0], xs[1], pair, outs[0], outs[1])()
    single = cuda.to_device(np.full((T, N), POISON, np.uint16))
    P.project_q(xs[1], cuda.to_device(repack_q2k_r(raws[1], K)), None, single, weight="q2k_r", version="gemv_q2k_v4")
    np.testing.assert_array_equal(outs[1].copy_to_host(), single.copy_to_host())
    ref = R.projection_exact(xh[0], R.wkv_q2k_bf16(raws[0], K))
    assert bf16_ulp_distance(outs[0].copy_to_host(), ref).max() <= 1
    with pytest.raises(ValueError, match="wkv_pair must be"):
        C.prepare_pair("gemv_q2k_v4", xs[0], xs[1], cuda.to_device(repack_q2k_r(raws[0], K)), outs[0], outs[1])


# ---- GPU tier: the released shape, every tile ------------------------------------------------------

@pytest.mark.gpu
def test_gpu_repack_and_decode_released_every_tile(gpu_record):
    """At N = 25600, K = 6144: the device repack writes the numpy reference's bytes, and the q2k_r
    decode (the GEMV's decode path) equals the file-layout Q2_K decode (the rows stage's decoder)
    on every weight of every tile."""
    import time
    rng = np.random.default_rng(20260612)
    N, K = 25600, 6144
    raw = random_q2k(rng, N, K)
    d_raw = cuda.to_device(raw)
    t0 = time.perf_counter()
    packed = C.repack_on_device(d_raw, N, K)
    cuda.synchronize()
    repack_s = time.perf_counter() - t0
    same_bytes = bool(np.array_equal(packed.copy_to_host(), repack_q2k_r(raw, K)))
    a = cuda.to_device(np.full((N, K), POISON, np.uint16))
    b = cuda.to_device(np.full((N, K), POISON, np.uint16))
    P.prepare_wkv_to_bf16(packed, None, a, weight="q2k_r")()
    P.prepare_wkv_to_bf16(d_raw, None, b, weight="q2k")()
    got, want = a.copy_to_host(), b.copy_to_host()
    differ = int((got != want).sum())
    gpu_record(test="q2k_r repack + decode, released shape", shape=[N, K], repack_bytes_equal=same_bytes,
               weights_differing=differ, weights=N * K, repack_ms=round(repack_s * 1e3, 2),
               passed=same_bytes and differ == 0)
    assert same_bytes
    assert differ == 0
