"""gemm_v9 (cuda_wgmma.py: gemm_v8 on the lean k loops) and gemm_v10 / gemm_v11 (the "tma" loop): the
lean and TMA loops keep gemm_v4's k order and wgmma chain, so on gemm_v4's grid they return gemm_v4's
bits, and on persistent CTAs gemm_v8's bits on the same schedule; checked in the simulator at odd small shapes (rows past T and N, a 1-chunk K
tail, units shorter than the stage ring, a ring that wraps). Also the TMA-loop candidates: 128 x 240
tiles (a TMA epilogue with 48 columns stored from registers), 2-CTA clusters (their simulator path:
the multicast itself is checked on the GPU, tests/test_tma.py) and the unit queue.

The record's own simulator cases run with every other version's in test_proj_cuda.py; the compile
tier (tests/test_compile_tier.py) checks its sm_90a builds."""
import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import f32_to_bf16
from engram_numba.stages.proj import cuda_wgmma as W

from .conftest import poisoned


def make_inputs(rng, T, K, N):
    return (f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32)),
            f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05)))


def run_grid(v, x, w):
    out = poisoned(x.shape[0], w.shape[0])
    W.prepare_variant(v.name, v, cuda.to_device(x), cuda.to_device(w), out)()
    return out.copy_to_host()


def run_sk(sv, x, w, ctas):
    out = poisoned(x.shape[0], w.shape[0])
    W.prepare_sk(sv.name, sv, cuda.to_device(x), cuda.to_device(w), out, ctas=ctas)()
    return out.copy_to_host()


def test_mbar_smem_fits_past_both_epilogue_places():
    t = W.V9_TILES["mbar"]
    assert t.mbar_at >= t.stages * t.stage_bytes and t.mbar_at % 8 == 0
    assert t.smem_bytes == t.mbar_at + 16 * t.stages + W.ALIGN_SLACK <= 227 * 1024
    assert W.sk_smem_bytes(t, True) == t.smem_bytes


def test_lean_variants_are_named_apart():
    names = {W.VARIANTS["gemm_v4"].name, *(t.name for t in W.V9_TILES.values()), W.TMA_TILE.name}
    assert len(names) == 5 and W.VARIANTS["gemm_v4"].loop == "v4"
    assert W.TMA_VARIANTS["gemm_v11"].name not in {W.V9_VARIANTS["gemm_v9"].name, W.SK_VARIANTS["gemm_v8"].name}
    assert W.V9_VARIANTS["gemm_v9"].name != W.SK_VARIANTS["gemm_v8"].name
    with pytest.raises(AssertionError):
        W.Variant(128, 256, 4, swizzle=True, loop="lean2")


# (T, K, N): 6 k tiles (the last a 1-chunk K tail) through the 4-stage ring, rows past T and N; and 2 x 2
# tiles of 2 k tiles (fewer than the copies issued ahead)
GRID_CASES = [(33, 328, 264), (130, 72, 260)]


@pytest.fixture(scope="module")
def baseline_bits():
    """(x, w, the baseline's bits) a case, made once for the module's variants of it: a simulated
    gemm_v4 / gemm_v8 launch is seconds, and each loop is compared with the same one. Inputs seeded
    from the case, so each case's are the same whichever test asks first."""
    import zlib
    made = {}

    def get(kind, T, K, N):
        if (kind, T, K, N) not in made:
            x, w = make_inputs(np.random.default_rng(zlib.crc32(repr((kind, T, K, N)).encode())), T, K, N)
            want = (run_grid(W.VARIANTS["gemm_v4"], x, w) if kind == "grid"
                    else run_sk(W.SK_VARIANTS["gemm_v8"], x, w, 3))
            made[kind, T, K, N] = x, w, want
        return made[kind, T, K, N]
    return get


# (the producer warp with clusters adds nothing the simulator can see: it runs a cluster as single CTAs, whose
# fills are `_fill`'s, the same as without the producer warp; the GPU tier checks it, tests/test_tma.py)
@pytest.mark.parametrize("loop", ["lean", "lean1", "mbar", "tma", "tma/tmastore", "tma/tmastore/c2", "tma/tmastore/pw",
                                  "tma/tmastore/wide"])
@pytest.mark.parametrize("shape", GRID_CASES, ids=[f"{t}x{k}x{n}" for t, k, n in GRID_CASES])
def test_lean_loops_return_gemm_v4_bits(baseline_bits, loop, shape):
    """gemm_v10 is the "tma" loop and epilogue on this grid (the loop alone where N % 8 != 0): its boxes
    hang past T, N and K here, and its TMA stores are clipped at T and N. "pw": the same with a producer
    warp (288 threads; 6 k tiles through 4 stages: two refills wait on EMPTY). "wide": the 128 x 320 tile
    (two n160 wgmma chains a k16 step, the weight box in two TMA loads; 3 stages, so 3 refills wait; its
    fifth box holds 8 columns below N = 264)."""
    if loop.startswith("tma/tmastore") and shape[2] % 8:
        pytest.skip("a TMA store needs N % 8 == 0 (the launcher falls back to the \"tma\" case)")
    x, w, want = baseline_bits("grid", *shape)
    tile = {"tma": W.TMA_TILE, "tma/tmastore": W.TMA_STORE_TILE,
            "tma/tmastore/c2": W.TMA_CLUSTER_TILE, "tma/tmastore/pw": W.TMA_PW_TILE,
            "tma/tmastore/wide": W.TMA_WIDE_TILE}.get(loop) or W.V9_TILES[loop]
    np.testing.assert_array_equal(run_grid(tile, x, w), want)


@pytest.mark.parametrize("shape", [(33, 200, 456), (130, 72, 264)], ids=["33x200x456", "130x72x264"])
def test_tma_epilogue_tail_columns_return_gemm_v4_bits(baseline_bits, shape):
    """128 x 240 tiles (`TMA_STORE_240`): three 64-column TMA boxes and 48 columns stored from registers
    (`_store_tail`); N = 456: the second tile's boxes clipped at N and its tail cut at N (432..455 stored,
    456..479 not); N = 264: the second tile's tail wholly past N; rows past T in both."""
    x, w, want = baseline_bits("grid", *shape)
    np.testing.assert_array_equal(run_grid(W.TMA_STORE_240, x, w), want)


@pytest.mark.parametrize("name", ["gemm_v9", "sk/128x256/auto/lean1", "sk/128x256/auto/mbar", "gemm_v11 (N % 8 != 0)"])
def test_persistent_lean_loops_return_gemm_v8_bits(baseline_bits, name):
    """One tile of 6 k tiles cut over 3 CTAs (two partials and the finisher): units of 2 k tiles,
    shorter than the ring, and the next unit's prologue in flight across the fix-up."""
    sv = {**W.V9_VARIANTS, **W.V9_CANDIDATES, "gemm_v11 (N % 8 != 0)": W.TMA_FALLBACK["gemm_v11"]}[name]
    x, w, want = baseline_bits("sk", 33, 328, 9)
    np.testing.assert_array_equal(run_sk(sv, x, w, 3), want)


@pytest.mark.parametrize("name", ["gemm_v11", "sk/128x256/dp/tma/tmastore"])
def test_persistent_tma_epilogue_returns_the_same_bits(baseline_bits, name):
    """gemm_v11 with its TMA epilogue: 2 x 2 tiles of 3 k tiles, stream-K over 3 CTAs (a whole tile then a
    partial on one CTA: the next unit's fill waits for the last tile's TMA stores to have read the
    stage they share), stores clipped at T and N; without stream-K ("dp") gemm_v4's bits."""
    sv = {**W.TMA_VARIANTS, **W.TMA_CANDIDATES}[name]
    x, w, want = baseline_bits("sk" if sv.split != "dp" else "grid", 130, 136, 264)
    np.testing.assert_array_equal(run_sk(sv, x, w, 3), want)


def test_mbar_twins_phase_parity():
    """The simulator's mbarrier twins: a phase completes at its count-th arrival, try_wait answers
    for the phase of the given parity, inval/init guard reuse."""
    from engram_numba.device.hopper import mbar_arrive, mbar_init, mbar_inval, mbar_try_wait

    @cuda.jit
    def k(smem_out, res):
        sm = cuda.shared.array(4, np.uint32)
        t = cuda.threadIdx.x
        if t == 0:
            mbar_init(sm, 8, 2)
        cuda.syncthreads()
        res[t, 0] = mbar_try_wait(sm, 8, 0)          # phase 0 not complete
        cuda.syncthreads()
        mbar_arrive(sm, 8)                             # 2 threads: phase 0 completes
        while mbar_try_wait(sm, 8, 0) == 0:
            pass
        res[t, 1] = mbar_try_wait(sm, 8, 1)          # phase 1 not complete
        cuda.syncthreads()
        if t == 0:
            mbar_inval(sm, 8)

    res = np.full((2, 2), 7, np.int32)
    k[1, 2](np.zeros(1), res)
    assert (res == 0).all()


def emulate_pieces(x, w, cuts):
    """The simulator's wgmma arithmetic on k ranges `cuts` (k tile bounds) of one tile, each range summed
    in its own fp32 accumulator (each k16 product in float64, rounded to fp32, added in fp32), the last
    range's plus the others nearest first: the bf16 bits the queue kernel stores for a tile cut so."""
    from engram_numba.bf16 import bf16_to_f32
    xf, wf = bf16_to_f32(x).astype(np.float64), bf16_to_f32(w).astype(np.float64)
    K = x.shape[1]
    sums = []
    for kb, ke in zip(cuts, cuts[1:]):
        acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
        for k in range(kb * 64, min(ke * 64, K), 16):
            acc = (acc + (xf[:, k:k + 16] @ wf[:, k:k + 16].T).astype(np.float32)).astype(np.float32)
        sums.append(acc)
    acc = sums[-1]
    for p in reversed(sums[:-1]):
        acc = (acc + p).astype(np.float32)
    return f32_to_bf16(acc)


def test_queue_schedule_covers_and_orders():
    """Every (tile, k tile) once, finishers after their partials, at the released shape and odd ones."""
    for T, N, K, pieces, ctas in [(4096, 25600, 6144, 4, 132), (4096, 25600, 6144, 1, 132), (130, 264, 200, 4, 3),
                                  (300, 520, 136, 3, 5), (129, 8, 64, 2, 132)]:
        qv = W.QVariant(W.TMA_STORE_TILE, pieces)
        queue, n_slots = W.queue_schedule(T, N, K, qv, ctas)
        W.check_queue(queue, n_slots, T, N, K, qv.bn)
    queue, n_slots = W.queue_schedule(4096, 25600, 6144, W.QVariant(W.TMA_STORE_TILE, 4), 132)
    assert len(queue) == 3200 - 132 + 4 * 132 and n_slots == 3 * 132
    assert (queue[:3068, 4] == 0).all() and (queue[3068:3072, 3] - queue[3068:3072, 2] == 24).all()
    assert (queue[3068:3068 + 396, 4] == 1).all() and (queue[-132:, 4] == 2).all()   # partials, then finishers

    # bands of token tiles (`QVariant(group_m=...)`): each band sweeps every output tile, whole tiles
    for T, N, K, g in [(4096, 25600, 6144, 8), (300, 520, 136, 2), (130, 264, 64, 16)]:
        qv = W.QVariant(W.TMA_PW_TILE, 1, group_m=g)
        queue, n_slots = W.queue_schedule(T, N, K, qv, 5)
        W.check_queue(queue, n_slots, T, N, K, qv.bn)
        band = min(g, -(-T // 128))              # a band's token tiles, then the band's next output tile
        assert [tuple(u) for u in queue[:band + 1, :2]] == [(128 * m, 0) for m in range(band)] + [(0, 256)]


def test_queue_returns_whole_tiles_and_its_pieces_sums():
    """The queue kernel on 2 x 2 tiles of 4 k tiles (a 1-chunk K tail) and 3 persistent CTAs, the last 3 tiles cut
    in 4: the first tile (whole) the simulator's gemm_v4 arithmetic (`emulate_pieces` on one range), each cut
    one the fixed-order sum of its pieces' accumulators. The inputs make k tiles 0 and 1 large and cancelling,
    so a cut tile's bits differ from an uncut one's (the test fails if nothing is cut, or cut elsewhere).
    Rows past T and N, TMA stores clipped. The simulator runs CTAs one after another (CTA 0 takes every
    unit); the counters and flags are left at 0, ready for a replay."""
    T, K, N = 130, 200, 264
    rng = np.random.default_rng(5)
    xf = rng.standard_normal((T, K), dtype=np.float32)
    wf = rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05)
    xf[:, :64] *= 256                                  # exact in bf16: k tile 1 cancels k tile 0 exactly
    xf[:, 64:128] = -xf[:, :64]
    wf[:, 64:128] = wf[:, :64]
    x, w = f32_to_bf16(xf), f32_to_bf16(wf)
    qv = W.QVariant(W.TMA_STORE_TILE, 4)
    queue, _ = W.queue_schedule(T, N, K, qv, 3)
    assert (queue[:, 4] == 2).sum() == 3
    want = emulate_pieces(x, w, [0, 4])
    cut = want.copy()
    for u in queue[queue[:, 4] == 2]:                  # FINISH units: their tiles were cut at k tiles 1, 2, 3
        m0, n0 = int(u[0]), int(u[1])
        cut[m0:m0 + 128, n0:n0 + 256] = emulate_pieces(x[m0:m0 + 128], w[n0:n0 + 256], [0, 1, 2, 3, 4])
    assert (cut != want).any()                         # cutting shows in the bits (9 outputs here)
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    out = poisoned(T, N)
    launch = W.prepare_queue(qv.name, qv, dx, dw, out, ctas=3)
    launch()
    np.testing.assert_array_equal(out.copy_to_host(), cut)
    ctrs, flags = launch.args[4].copy_to_host(), launch.args[6].copy_to_host()
    assert (ctrs == 0).all() and (flags == 0).all()


@pytest.mark.parametrize("stages,wg_epilogue", [(4, False), (3, False), (4, True)], ids=["s4", "s3", "s4-wgepi"])
def test_queue_with_a_producer_warp_returns_gemm_v4_bits(stages, wg_epilogue):
    """The producer-warp queue kernel (`make_queue_pw_kernel`): 2 x 2 whole tiles of 6 k tiles (a 1-chunk K
    tail) through one ring that runs on from unit to unit, the unit index handed over through both slots
    of its ring and back (the simulator runs CTAs one after another: CTA 0 takes all 4 units), the
    epilogue in two rounds of two boxes (4 stages) or one of four (3), or each warpgroup its own 64 rows
    ("wgepi": the second token tile's second warpgroup wholly past T), the second output tile's boxes
    clipped at N = 264 (three wholly past it), rows past T. Every output the simulator's gemm_v4
    arithmetic; the counters left at 0."""
    T, K, N = 130, 328, 264
    rng = np.random.default_rng(7)
    x, w = make_inputs(rng, T, K, N)
    qv = W.QVariant({4: W.TMA_PW_TILE, 3: W.TMA_PW3_TILE}[stages], 1, wg_epilogue=wg_epilogue)
    assert W.pw_queue_layout(qv.tile)["epi_boxes"] == {4: 2, 3: 4}[stages]
    assert qv.smem_bytes <= 227 * 1024 and qv.tile.threads == 288
    out = poisoned(T, N)
    launch = W.prepare_queue(qv.name, qv, cuda.to_device(x), cuda.to_device(w), out, ctas=3)
    assert launch.block == 288
    launch()
    np.testing.assert_array_equal(out.copy_to_host(), emulate_pieces(x, w, [0, 6]))
    assert (launch.args[4].copy_to_host() == 0).all()
    with pytest.raises(AssertionError):
        W.QVariant(W.TMA_PW_TILE, 2)                   # whole tiles only


def test_queue_of_wide_tiles_returns_gemm_v4_bits():
    """The unit queue (thread 0 fills) on 128 x 320 tiles: 2 x 2 whole tiles of 6 k tiles (a 1-chunk K tail)
    through 3 stages, the next unit's first 2 stages in flight during each epilogue (its 80 KiB bf16 tile
    past them); N = 392 leaves the second output tile 72 columns (one box and 8 columns of the next, three
    boxes wholly past N), rows past T. Every output the simulator's gemm_v4 arithmetic; counters left at 0."""
    T, K, N = 130, 328, 392
    x, w = make_inputs(np.random.default_rng(11), T, K, N)
    qv = W.QVariant(W.TMA_WIDE_TILE, 1)
    assert qv.smem_bytes <= 227 * 1024 and qv.tile.threads == 256
    out = poisoned(T, N)
    launch = W.prepare_queue(qv.name, qv, cuda.to_device(x), cuda.to_device(w), out, ctas=3)
    launch()
    np.testing.assert_array_equal(out.copy_to_host(), emulate_pieces(x, w, [0, 6]))
    assert (launch.args[4].copy_to_host() == 0).all()


@pytest.mark.parametrize("bn,K", [(320, 328), (320, 64), (256, 136)], ids=["wide-6kt", "wide-1kt", "256-3kt"])
def test_queue_streamed_by_thread_0_returns_gemm_v4_bits(bn, K):
    """The unit queue whose stage ring thread 0 streams across units (`make_queue_stream_kernel`): 2 x 2 whole
    tiles (CTA 0 takes all 4 in the simulator), their k tiles one stream through the ring, the next unit taken
    while the last is computed; units of 6 k tiles (the ring wraps inside a unit), of 1 k tile (the stream
    held one unit ahead: each unit's index and first tile come from the fill after the last unit's MMAs) and
    of exactly the ring's 3 (4 stages, 128 x 256). The epilogue through its own buffer, stores clipped at T and
    N. Every output the simulator's gemm_v4 arithmetic; the counters left at 0."""
    T, N = 130, {320: 392, 256: 264}[bn]
    x, w = make_inputs(np.random.default_rng(K + bn), T, K, N)
    qv = W.QVariant({320: W.TMA_WIDE_TILE, 256: W.TMA_STORE_TILE}[bn], 1, stream=True)
    assert qv.smem_bytes <= 227 * 1024 and qv.tile.threads == 256 and qv.name.endswith("/stream")
    out = poisoned(T, N)
    launch = W.prepare_queue(qv.name, qv, cuda.to_device(x), cuda.to_device(w), out, ctas=3)
    launch()
    np.testing.assert_array_equal(out.copy_to_host(), emulate_pieces(x, w, [0, -(-K // 64)]))
    assert (launch.args[4].copy_to_host() == 0).all()


def test_wide_tiles_are_built_only_where_the_code_splits_them():
    """Past 256 outputs a tile is two wgmma chains: built only for the "tma" loop and epilogue, whole 64-column
    boxes, at most 320 columns (160 accumulators a thread), no cluster and no producer warp (which would leave
    168 registers a thread)."""
    assert W.TMA_WIDE_TILE.chains == 2 and W.TMA_WIDE_TILE.w_loads == 2 and W.TMA_STORE_TILE.chains == 1
    for kw in ({"loop": "tma"}, {"loop": "mbar"}, {"loop": "tma", "store": "tma", "producer": True},
               {"loop": "tma", "store": "tma", "cluster": 2}):
        with pytest.raises(AssertionError):
            W.Variant(128, 320, 3, swizzle=True, **kw)
    with pytest.raises(AssertionError):
        W.Variant(128, 296, 3, swizzle=True, loop="tma", store="tma")    # 296 % 64 != 0
    with pytest.raises(AssertionError):
        W.Variant(128, 384, 3, swizzle=True, loop="tma", store="tma")    # 192 accumulators


def test_wgmma_on_halves_of_the_accumulators_is_one_wide_wgmma():
    """`hopper.wgmma_bf16_cols`: two m64n64k16 wgmma on accumulators 0..31 and 32..63 of one tuple, the second
    with its B descriptor 64 rows on, leave the same accumulators as one m64n128k16 wgmma on the whole tuple,
    and both are A @ B^T (exact bf16 products, one fp32 rounding: the simulator's arithmetic); a range that is
    not whole quads, or runs past the tuple, is refused."""
    from engram_numba.bf16 import bf16_to_f32
    from engram_numba.device.hopper import (WGMMA_NO_SWIZZLE, acc_store_f32, fence_proxy_async, wgmma_bf16,
                                            wgmma_bf16_cols, wgmma_commit, wgmma_descriptor, wgmma_fence,
                                            wgmma_waiter)
    from numba import types
    rng = np.random.default_rng(3)
    a, b = make_inputs(rng, 64, 16, 128)                 # A [64, 16], B [128, 16] bf16 words
    img = np.zeros(6144 // 2, np.uint16)                 # no-swizzle core matrices: A at byte 0, B at 2048
    for base, mat in ((0, a), (2048, b)):
        for r in range(mat.shape[0]):
            for k in range(16):
                img[(base + (r // 8) * 256 + (k // 8) * 128 + (r % 8) * 16 + (k % 8) * 2) // 2] = mat[r, k]
    words = img.view(np.uint32)
    ZERO = tuple(np.float32(0.0) for _ in range(64))
    lo, hi, wait0 = wgmma_bf16_cols(0, 32), wgmma_bf16_cols(32, 32), wgmma_waiter(0)

    @cuda.jit
    def kernel(src, whole, halves):
        smem = cuda.shared.array(1536, types.uint32)
        tid = cuda.threadIdx.x
        for i in range(tid, 1536, 128):
            smem[i] = src[i]
        fence_proxy_async()
        cuda.syncthreads()
        da = wgmma_descriptor(0, 128, 256, WGMMA_NO_SWIZZLE)
        db = wgmma_descriptor(2048, 128, 256, WGMMA_NO_SWIZZLE)
        acc = wgmma_bf16(wgmma_fence(ZERO), da, db, smem)
        wgmma_commit()
        acc_store_f32(whole, tid * 64, 1, wait0(acc))
        acc = lo(wgmma_fence(ZERO), da, db, smem)
        acc = hi(acc, da, db + np.uint64(2048 >> 4), smem)   # 64 rows on: 8 core-matrix rows of 256 bytes
        wgmma_commit()
        acc_store_f32(halves, tid * 64, 1, wait0(acc))

    whole, halves = cuda.to_device(np.zeros(128 * 64, np.float32)), cuda.to_device(np.zeros(128 * 64, np.float32))
    kernel[1, 128](cuda.to_device(words), whole, halves)
    whole, halves = whole.copy_to_host().reshape(128, 64), halves.copy_to_host().reshape(128, 64)
    np.testing.assert_array_equal(halves, whole)
    d = (bf16_to_f32(a).astype(np.float64) @ bf16_to_f32(b).astype(np.float64).T).astype(np.float32)
    for p in (0, 37, 127):                               # acc[4j + 2h + c] = D[16w + g + 8h, 8j + 2t + c]
        w, g, t = p // 32, (p % 32) >> 2, p & 3
        want = [d[16 * w + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * t + i % 2] for i in range(64)]
        np.testing.assert_array_equal(whole[p], np.array(want, np.float32))

    @cuda.jit
    def bad(out):
        acc = wgmma_bf16_cols(48, 32)(wgmma_fence(ZERO), np.uint64(0), np.uint64(0), out)
        wgmma_commit()
        acc_store_f32(out, 0, 1, wait0(acc))

    with pytest.raises(Exception, match="accumulators 48..80 of 64"):
        bad[1, 128](cuda.to_device(np.zeros(64, np.float32)))
