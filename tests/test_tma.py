"""TMA (`device/tma.py`, `hopper.tma_load_2d`): one box copied into shared memory and written back,
byte for byte against the box cut from the array in numpy, zero-filled past the tensor's edges and
laid out in the 128-byte swizzle the wgmma kernels read. In the simulator (the twin) and, in the
gpu tier, through the driver's tensor map on the H200."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, types

from engram_numba.device.hopper import (mbar_arrive_expect_tx, mbar_init, mbar_inval, mbar_try_wait, shared_address,
                                        tma_load_2d)
from engram_numba.device.tma import SWIZZLE_128B, SWIZZLE_NONE, tensor_map_2d

THREADS = 64


@cuda.jit
def _tma_probe(tmap, out, c0, c1, nbytes):
    # out: uint32 [nbytes / 4], the shared-memory bytes the copy wrote
    smem = cuda.shared.array(0, types.uint32)
    tid = cuda.threadIdx.x
    base = np.int64(shared_address(smem))
    pad = (1024 - (base & 1023)) & 1023
    bar = pad + nbytes
    if tid == 0:
        mbar_init(smem, bar, 1)
    cuda.syncthreads()
    if tid == 0:
        mbar_arrive_expect_tx(smem, bar, nbytes)
        tma_load_2d(smem, pad, tmap, c0, c1, bar)
    while mbar_try_wait(smem, bar, 0) == 0:
        pass
    for i in range(tid, nbytes >> 2, THREADS):
        out[i] = smem[(pad >> 2) + i]
    cuda.syncthreads()
    if tid == 0:
        mbar_inval(smem, bar)


def expected_box(a: np.ndarray, c0: int, c1: int, box_rows: int, box_cols: int, swizzle: int) -> np.ndarray:
    """The bytes a TMA copy of box (c0 along the row, c1 rows down) writes at a 1024-aligned address."""
    box = np.zeros((box_rows, box_cols), a.dtype)
    r1, k1 = min(a.shape[0], c1 + box_rows), min(a.shape[1], c0 + box_cols)
    box[:r1 - c1, :k1 - c0] = a[c1:r1, c0:k1]
    flat = box.reshape(-1).view(np.uint8)
    out = np.zeros_like(flat)
    L = np.arange(flat.size)
    where = L ^ (((L >> 7) & 7) << 4) if swizzle == SWIZZLE_128B else L
    out[where] = flat
    return out


def run_probe(a: np.ndarray, c0: int, c1: int, box_rows: int, box_cols: int, swizzle: int) -> np.ndarray:
    d = cuda.to_device(a)
    m = tensor_map_2d(d, box_rows, box_cols, swizzle)
    out = cuda.device_array(m.box_bytes // 4, np.uint32)
    _tma_probe[1, THREADS, 0, m.box_bytes + 2048](m.device, out, c0, c1, m.box_bytes)
    cuda.synchronize()
    return out.copy_to_host().view(np.uint8)


# (array shape, dtype, box rows, box cols, swizzle, corners (c0, c1)): the wgmma kernels' boxes, and
# boxes hanging past the last row and the last column
CASES = [
    ((300, 200), np.uint16, 128, 64, SWIZZLE_128B, [(0, 0), (64, 128), (192, 256), (136, 3)]),
    ((70, 136), np.uint16, 256, 64, SWIZZLE_128B, [(0, 0), (128, 0), (64, 64)]),
    ((90, 160), np.uint8, 64, 128, SWIZZLE_128B, [(0, 0), (128, 40)]),
    ((50, 40), np.uint16, 32, 16, SWIZZLE_NONE, [(0, 0), (24, 30)]),
]


def _cases():
    for shape, dt, br, bc, sw, corners in CASES:
        for c0, c1 in corners:
            yield pytest.param(shape, dt, br, bc, sw, c0, c1, id=f"{shape[0]}x{shape[1]}-{np.dtype(dt).name}-"
                               f"box{br}x{bc}-sw{sw}-at{c0},{c1}")


def _check(shape, dt, br, bc, sw, c0, c1):
    rng = np.random.default_rng(c0 * 1000 + c1)
    a = rng.integers(1, np.iinfo(dt).max, size=shape, dtype=dt)       # no zeros: zero-fill must show
    got = run_probe(a, c0, c1, br, bc, sw)
    want = expected_box(a, c0, c1, br, bc, sw)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} of {want.size} bytes differ, first at byte {bad[:8]}"


@pytest.mark.parametrize("shape,dt,br,bc,sw,c0,c1", list(_cases()))
def test_tma_box_in_the_simulator(shape, dt, br, bc, sw, c0, c1):
    from numba.cuda import config
    if not config.ENABLE_CUDASIM:
        pytest.skip("the gpu tier runs test_tma_box_on_the_gpu")
    _check(shape, dt, br, bc, sw, c0, c1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dt,br,bc,sw,c0,c1", list(_cases()))
def test_tma_box_on_the_gpu(shape, dt, br, bc, sw, c0, c1):
    _check(shape, dt, br, bc, sw, c0, c1)


def test_tensor_map_refuses_what_tma_cannot_copy():
    d = cuda.to_device(np.zeros((8, 100), np.uint16))          # 200-byte rows: not a multiple of 16
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        tensor_map_2d(d, 8, 64)
    d = cuda.to_device(np.zeros((8, 128), np.uint16))
    with pytest.raises(ValueError, match="at most 128 bytes"):
        tensor_map_2d(d, 8, 128, SWIZZLE_128B)
    with pytest.raises(ValueError, match="1..256"):
        tensor_map_2d(d, 512, 64)
    with pytest.raises(ValueError, match="2-D"):
        tensor_map_2d(cuda.to_device(np.zeros(64, np.uint16)), 8, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(33, 328, 264), (300, 200, 520), (1024, 6144, 2048)])
def test_cluster_multicast_gemm_returns_gemm_v10_bits_on_the_gpu(T, K, N):
    """2-CTA clusters (`cuda_wgmma.TMA_CLUSTER_TILE`, launched by `ClusterLaunch`): each CTA loads half the
    weight box by TMA multicast into both, and a stage is refilled once both CTAs' consumers released it;
    the same with a producer warp (`TMA_PW_TILE`, `TMA_PW_CLUSTER_TILE`: 288 threads, warp 8 fills).
    Every output bit for bit gemm_v10's (same boxes, same wgmma chain): an odd number of token tiles (the
    last cluster's second CTA wholly past T), rows past N in a half box, a K tail, several clusters a column."""
    from engram_numba.bf16 import f32_to_bf16
    from engram_numba.stages.proj import cuda_wgmma as W
    rng = np.random.default_rng(T + K + N)
    x = cuda.to_device(f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32)))
    w = cuda.to_device(f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05)))
    outs = []
    for v in (W.TMA_STORE_TILE, W.TMA_CLUSTER_TILE, W.TMA_PW_TILE, W.TMA_PW_CLUSTER_TILE):
        out = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
        launch = W.prepare_variant(v.name, v, x, w, out)
        assert (type(launch).__name__ == "ClusterLaunch") == (v.cluster == 2)
        launch()
        cuda.synchronize()
        outs.append(out.copy_to_host())
    assert (outs[0] != 0xFFFF).all()
    for v, got in zip(("cluster", "producer warp", "producer warp + cluster"), outs[1:]):
        np.testing.assert_array_equal(got, outs[0], err_msg=v)


def _inputs_and_gemm_v10(T, K, N, seed):
    """(x, w) on the device, bf16 draws seeded by `seed`, and gemm_v10's output on them (host, every element
    written): what the TMA kernels' GPU tests compare bit for bit against."""
    from engram_numba.bf16 import f32_to_bf16
    from engram_numba.stages.proj import cuda_wgmma as W
    rng = np.random.default_rng(seed)
    x = cuda.to_device(f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32)))
    w = cuda.to_device(f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05)))
    want = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
    W.prepare_variant("gemm_v10", W.TMA_STORE_TILE, x, w, want)()
    want = want.copy_to_host()
    assert (want != 0xFFFF).all()
    return x, w, want


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N", [(33, 328, 392), (300, 200, 520), (1024, 6144, 2560), (4096, 6144, 25600)])
def test_wide_tiles_return_gemm_v10_bits_on_the_gpu(T, K, N):
    """128 x 320 tiles (`cuda_wgmma.TMA_WIDE_TILE`: two m64n160 wgmma chains a k16 step on one tuple of 160
    accumulators, the weight box in two 160-row TMA loads, 3 stages) on gemm_v4's grid, on the unit queue and
    on the queue whose stage ring thread 0 streams across units (`make_queue_stream_kernel`; also with
    128 x 256 tiles), every SM and 3 CTAs (many units a CTA), return gemm_v10's bits: a last output tile of
    72 or 200 columns (boxes wholly and partly past N), rows past T, a K tail, the released shape; the
    queues' counters are reset, so a replay on a poisoned output returns the same."""
    from engram_numba.stages.proj import cuda_wgmma as W
    x, w, want = _inputs_and_gemm_v10(T, K, N, T * 7 + K + N)
    out = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
    W.prepare_variant("wide", W.TMA_WIDE_TILE, x, w, out)()
    np.testing.assert_array_equal(out.copy_to_host(), want, err_msg="grid")
    for qv in (W.QVariant(W.TMA_WIDE_TILE, 1), W.QVariant(W.TMA_WIDE_TILE, 1, stream=True),
               W.QVariant(W.TMA_STORE_TILE, 1, stream=True)):
        for ctas in (None, 3):
            launch = W.prepare_queue(qv.name, qv, x, w, out, ctas=ctas)
            for _ in range(2):
                out.copy_to_device(np.full((T, N), 0xFFFF, np.uint16))
                launch()
                cuda.synchronize()
                np.testing.assert_array_equal(out.copy_to_host(), want, err_msg=f"{qv.name}, ctas={ctas}")
            assert (launch.args[4].copy_to_host() == 0).all()


def test_cluster_launch_refuses_a_grid_of_part_clusters():
    """A grid dimension that is not a whole number of clusters is refused before anything launches."""
    from engram_numba.device.launch import ClusterLaunch

    @cuda.jit
    def fill(out):
        out[cuda.blockIdx.x] = 1

    out = cuda.to_device(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"grid \(3, 1, 1\) is not a whole number of clusters of \(2, 1, 1\)"):
        ClusterLaunch("fill", fill, (3, 1), 32, 0, (out,), out, cluster=(2, 1, 1))
    assert not out.copy_to_host().any()


@pytest.mark.gpu
@pytest.mark.parametrize("stages,wg_epilogue", [(4, False), (3, False), (4, True)], ids=["s4", "s3", "s4-wgepi"])
@pytest.mark.parametrize("T,K,N", [(33, 328, 264), (300, 200, 520), (1024, 6144, 2048)])
def test_producer_warp_queue_returns_gemm_v10_bits_on_the_gpu(T, K, N, stages, wg_epilogue):
    """The producer-warp queue kernel (`cuda_wgmma.make_queue_pw_kernel`: persistent CTAs whose producer warp
    takes units from the queue and runs the stage ring on across them, the epilogue in two rounds through its
    own buffer) returns gemm_v10's bits, on every SM and on 3 CTAs (many units a CTA, both unit slots
    reused), and leaves its counters at 0, so a second launch returns the same."""
    from engram_numba.stages.proj import cuda_wgmma as W
    x, w, want = _inputs_and_gemm_v10(T, K, N, T * K + N)
    qv = W.QVariant({4: W.TMA_PW_TILE, 3: W.TMA_PW3_TILE}[stages], 1, wg_epilogue=wg_epilogue)
    for ctas in (None, 3):
        out = cuda.to_device(np.full((T, N), 0xFFFF, np.uint16))
        launch = W.prepare_queue(qv.name, qv, x, w, out, ctas=ctas)
        for _ in range(2):                       # the replay on a poisoned output: the counters were reset
            out.copy_to_device(np.full((T, N), 0xFFFF, np.uint16))
            launch()
            cuda.synchronize()
            np.testing.assert_array_equal(out.copy_to_host(), want, err_msg=f"ctas={ctas}")
        assert (launch.args[4].copy_to_host() == 0).all()
