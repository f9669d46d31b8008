"""gemm_fp8_v8: DeepSeek's FP8 projection (`cuda_fp8_wgmma`'s arithmetic) with its operands and scales
brought in by TMA, and two partial tiles a math warpgroup.

Same arithmetic as gemm_fp8_v2 .. v7 (so the same bits as v5 .. v7 where the tensor core sums a k32
block alike): act_quant's codes and scales, each K block of 32 one `wgmma ... m64n128k32 .e4m3.e4m3`
into a fresh fp32 partial tile (scale-d = 0), promoted into the fp32 accumulators by
`fma(partial, s_x * s_w, acc)`, blocks in K order, bf16 once at the end.

Why another version. The promotion after every k32 block costs a math warp one FFMA a thread per
accumulator: as many issue cycles as the tensor core needs for the block (docs/gpu.md, "the K loop is
issue-bound"). So the tensor core is busy only while some warpgroup has an MMA in flight *and* the
warps that must promote are not waiting for it. v7 has one partial tile a warpgroup (MMA, wait,
promote: a warpgroup's own MMA never overlaps its own promotion; only the other warpgroup's does),
because its loader warpgroup leaves 168 registers a thread. v6's specialisations with a one-warp loader
and two partial tiles (192 fp32 registers of tiles) did not launch: 9 warps put 3 on one SM
sub-partition, whose 16384 registers hold 3 x 32 threads of at most 170 each. v8 drops the loader:
  roles     256 threads, the two math warpgroups only (64 token rows each, m64n128k32); lane 0 of each
            of warpgroup 0's four warps also issues one of a k tile's four TMA copies (warp 0 with the
            expect_tx; `V8Variant.split`, the record: on one thread the refill's work held its warp, and
            the other three waited for it at their next wgmma), so no loader warps and no cp.async
            arithmetic, and each math thread has up to 255 registers: the accumulators and *two*
            partial tiles. A k tile's 4 blocks: MMA 0 -> pa, MMA 1 -> pb, promote pa (MMA 1 runs),
            MMA 2 -> pa, promote pb (MMA 2 runs), MMA 3 -> pb, promote pa (MMA 3 runs), promote pb.
            The partials are drained at the end of each k tile (wait_group 0): a partial tile in flight
            across the loop edge makes ptxas serialize every wgmma of the kernel (C7514).
  operands  x's e4m3 codes [T, K] and w's [N, K]: boxes of 128 rows x 128 bytes, 128-byte swizzled
            (the layout the descriptors read: v7's cp.async layout); x's scales (stage layout
            [2 ceil(K/256), T, 4] fp32 as [rows, 4]) a box of 128 rows x 16 bytes; w's scales a box of
            4 rows (32-wide output tiles) x 16 bytes. TMA zero-fills codes past T, N and K; the scale
            rows past T or ceil(N/32) are the next k tile's or zeros, and they scale partial tiles of
            zero-filled rows that are never stored.
  the ring  S stages (6 by default: 35 KiB each), FULL[s] (one expect_tx arrival by thread 0 plus the
            copies' bytes) and EMPTY[s] (lane 0 of each of the 8 math warps, once its warpgroup's
            MMAs on the stage have retired). The ring runs on across a CTA's output tiles. Thread 0
            fills the first S k tiles at start; after k tile g the stage of k tile g-1 is refilled
            with k tile g-1+S once EMPTY says both warpgroups are done with it (one k tile of slack
            for the other warpgroup; `V8Variant.lag` 2: two). Every thread waits for that EMPTY (a wait
            loop inside a branch of one thread makes ptxas take the wgmma descriptors out of uniform
            registers) and keeps the fill stream's state. With `V8Variant.probe` (the record) both
            checks are probed early (`mbar_test_wait`: the next k tile's FULL after block 3's MMA, the
            refill's EMPTY after block 1's) and the answers read after the promotions, so a barrier
            check's latency is spent under the FFMAs.
  grid      persistent: min(tiles, SMs) CTAs, CTA c takes output tiles c, c + G, ... in token-tile-
            fastest order or in bands of `group_m` token tiles (`V8Variant.group_m`); bf16 stored from
            the registers (`acc_store_bf16`).

Kernel arguments: (tmx, tmw, tsx, tsw, out, T, K): the four tensor maps (`maps_v8`), out uint16 [T, N].

H200, T = 4096 (docs/gpu.md, "gemm_fp8_v8"): 1,793-1,804 us with act_quant, 1.01-1.04x the bf16 gemm_v4 of the
same run (the main bench: 1,804.3 against 1,883.1), v7 2,042-2,066; bit-identical to v7. A k tile's scale loads
go before its first wgmma (`V8Variant.early`: issued after two wgmma, they waited behind them).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from ...device.hopper import (WGMMA_SWIZZLE_128B, acc_store_bf16, fence_proxy_async, mbar_arrive,
                              mbar_arrive_expect_tx, mbar_init, mbar_test_wait, mbar_try_wait, shared_address,
                              tma_load_2d, warp_uniform, wgmma_commit, wgmma_descriptor, wgmma_fence, wgmma_waiter)
from ...device.intrinsics import SIMULATOR, device_function, load_u32x4, u32_as_f32
from ...device.launch import PreparedLaunch, allow_dynamic_shared
from .cuda_common import INLINE, bounds, cdiv
from .cuda_fp8_wgmma import (ALIGN_SLACK, BK, BLOCK, BM, BN, GROUP_BYTES, KERNELS, Fp8GemmLaunch, block_scales,
                             check_out_words, fp8_promote, scale_products, udiv32, wgmma_e4m3, workspaces)

V8_THREADS = 256
A_BYTES = BM * BK                        # x codes of a k tile (128 rows x 128 bytes)
B_BYTES = BN * BK                        # w codes
SXO = A_BYTES + B_BYTES                  # x scales: 128 rows x 4 blocks (fp32)
SWO = SXO + BM * 16                      # w scales: 4 w tiles x 4 blocks
STAGE_TX = SWO + (BN // BLOCK) * 16      # bytes a k tile's copies report
STAGE_BYTES = cdiv(STAGE_TX, 1024) * 1024
K_STEP16 = 32 >> 4                       # a k32 block in the descriptors' 16-byte units
# arrivals that release a stage: lane 0 of each math warp (every thread in the simulator, which has no lanes)
EMPTY_ARRIVALS = V8_THREADS if SIMULATOR else V8_THREADS // 32
SIM_CTAS = 2                             # the simulator runs CTAs one after another: a small persistent grid


class V8Variant:
    """A gemm_fp8_v8 specialisation: ring depth; tile order (group_m 0: token tiles fastest; g: bands of g
    token tiles, each band sweeping every output tile before the next); vec_scales (a k tile's scales in
    six 16-byte loads, not six word loads a block); probe (barrier checks probed early with
    mbarrier.test_wait); free (warpgroup 1 never waits for the refill's EMPTY); split (a refill's four
    copies issued by warpgroup 0's four warps, not by thread 0); lag (refill the stage of k tile g-lag);
    early (a k tile's six scale loads issued before its first MMA, not after its second: Nsight Compute
    put 8.5% of all stall samples on the first scale product waiting for those loads, issued behind the
    two wgmma); lane_alu (a warp's lane 0 found as tid & 31 == 0, not from %laneid, whose S2R ptxas
    re-read inside the K loop, another short-scoreboard wait)."""

    def __init__(self, stages: int = 6, group_m: int = 0, vec_scales: bool = False, probe: bool = False,
                 free: bool = False, split: bool = False, lag: int = 1, early: bool = False, lane_alu: bool = False):
        assert 3 <= stages and lag in (1, 2) and stages > lag + 1
        assert vec_scales or not (probe or early), "probes and early scale loads need the 16-byte-scale k tile"
        self.stages, self.group_m, self.vec_scales, self.probe, self.free = stages, group_m, vec_scales, probe, free
        self.split, self.lag, self.early, self.lane_alu = split, lag, early, lane_alu
        self.threads = V8_THREADS
        self.smem_bytes = stages * STAGE_BYTES + 16 * stages + ALIGN_SLACK
        assert self.smem_bytes <= 227 * 1024, self.smem_bytes
        self.name = (f"gemm_fp8_v8[s{stages}/g{group_m or 'T'}{'/v' if vec_scales else ''}{'/p' if probe else ''}"
                     f"{'/f' if free else ''}{'/x' if split else ''}{'/l2' if lag == 2 else ''}{'/e' if early else ''}"
                     f"{'/a' if lane_alu else ''}]")


def v8_ctas(tiles: int) -> int:
    """CTAs of a v8 launch over `tiles` output tiles: one an SM at most."""
    if SIMULATOR:
        return min(tiles, SIM_CTAS)
    return min(tiles, cuda.get_current_device().MULTIPROCESSOR_COUNT)


def tile_origin_host(tile: int, n_mt: int, n_nt: int, group_m: int) -> tuple:
    """(token tile, output tile) of output tile number `tile` in the kernel's order (a host twin, for tests)."""
    if not group_m:
        return tile % n_mt, tile // n_mt
    band = tile // (group_m * n_nt)
    r = tile - band * group_m * n_nt
    rows = min(group_m, n_mt - band * group_m)
    n = r // rows
    return band * group_m + r - n * rows, n


def make_kernel_v8(v: V8Variant = None):
    """gemm_fp8_v8's kernel for specialisation v (default: V8Variant()'s plain one; the record is
    `V8_VARIANTS["gemm_fp8_v8"]`)."""
    v = v or V8Variant()
    S, GM, PROBE, FREE, SPLIT, LAG, EARLY = v.stages, v.group_m, v.probe, v.free, v.split, v.lag, v.early
    LANE_ALU = v.lane_alu
    RING = S * STAGE_BYTES
    FULL0 = RING
    EMPTY0 = RING + 8 * S
    NACC = BN // 2
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    mma_wait0 = wgmma_waiter(0)
    mma_wait1 = wgmma_waiter(1)
    U0 = np.uint32(0)
    U1 = np.uint32(1)
    U2 = np.uint32(2)
    U3 = np.uint32(3)

    @device_function(**INLINE)
    def _origin(tile, n_mt, n_nt):
        """(first token row, first output) of output tile `tile` (uint32), in v's order."""
        if GM == 0:
            nt = udiv32(tile, n_mt)
            return np.uint32((tile - nt * n_mt) * np.uint32(BM)), np.uint32(nt * np.uint32(BN))
        per_band = np.uint32(np.uint32(GM) * n_nt)
        band = udiv32(tile, per_band)
        r = np.uint32(tile - band * per_band)
        # (at least 1: the fill stream asks for the tile after a CTA's last, whose origin it never uses)
        rows = np.uint32(max(U1, min(np.uint32(GM), np.uint32(n_mt - band * np.uint32(GM)))))
        nt = udiv32(r, rows)
        mt = np.uint32(band * np.uint32(GM) + r - nt * rows)
        return np.uint32(mt * np.uint32(BM)), np.uint32(nt * np.uint32(BN))

    @device_function(**INLINE)
    def _fill(smem, o, st, tmx, tmw, tsx, tsw, m0, n0, kt, T, NB):
        """k tile kt of the output tile at (m0, n0) into stage st: 4 TMA copies reported to FULL[st], by one
        thread (`_fill_part` below has them one a warp; written out here rather than a loop over it, which
        ptxas schedules otherwise)."""
        bar = np.uint32(o + np.uint32(FULL0) + (st << np.uint32(3)))
        stage = np.uint32(o + st * np.uint32(STAGE_BYTES))
        mbar_arrive_expect_tx(smem, bar, STAGE_TX)
        tma_load_2d(smem, stage, tmx, np.int32(kt * BK), np.int32(m0), bar)
        tma_load_2d(smem, stage + A_BYTES, tmw, np.int32(kt * BK), np.int32(n0), bar)
        tma_load_2d(smem, stage + SXO, tsx, np.int32(0), np.int32(kt * T + m0), bar)
        tma_load_2d(smem, stage + SWO, tsw, np.int32(0), np.int32(kt * NB + (n0 >> np.uint32(5))), bar)

    @device_function(**INLINE)
    def _fill_part(smem, o, st, part, tmx, tmw, tsx, tsw, m0, n0, kt, T, NB):
        """`_fill`'s copy `part` (0: x's codes with the stage's expect_tx, 1: w's codes, 2: x's scales,
        3: w's scales), for the lane 0 of warp `part` of warpgroup 0 (v.split): the four copies of a
        refill issued by four warps, so the refill's work does not fall on one warp of the warpgroup
        (its other warps wait for it at the next wgmma). A copy may land before the expect_tx that
        announces it: the phase completes once the arrival has come and the byte count is back at 0."""
        bar = np.uint32(o + np.uint32(FULL0) + (st << np.uint32(3)))
        stage = np.uint32(o + st * np.uint32(STAGE_BYTES))
        if part == 0:
            mbar_arrive_expect_tx(smem, bar, STAGE_TX)
            tma_load_2d(smem, stage, tmx, np.int32(kt * BK), np.int32(m0), bar)
        elif part == 1:
            tma_load_2d(smem, stage + A_BYTES, tmw, np.int32(kt * BK), np.int32(n0), bar)
        elif part == 2:
            tma_load_2d(smem, stage + SXO, tsx, np.int32(0), np.int32(kt * T + m0), bar)
        else:
            tma_load_2d(smem, stage + SWO, tsw, np.int32(0), np.int32(kt * NB + (n0 >> np.uint32(5))), bar)

    _scales = block_scales

    @device_function(**INLINE)
    def _prod8(a0, a1, w0, w1, w2, w3):
        """`scale_products` of one block from its scales as fp32 bits."""
        return scale_products(u32_as_f32(a0), u32_as_f32(a1), u32_as_f32(w0), u32_as_f32(w1), u32_as_f32(w2),
                              u32_as_f32(w3))

    @device_function(**INLINE)
    def _mma(smem, p, d_hi, da, db, j):
        """Issue block j's MMA of the k tile (descriptor low words da, db) into the partial tile p."""
        p = wgmma_fence(p)
        p = wgmma_e4m3(p, d_hi | np.uint64(np.uint32(da + np.uint32(j * K_STEP16))),
                       d_hi | np.uint64(np.uint32(db + np.uint32(j * K_STEP16))), smem)
        wgmma_commit()
        return p

    @device_function(**INLINE)
    def _k_tile(smem, acc, pa, pb, d_hi, da, db, xw, ww, fb, fpar, eb, epar):
        """A warpgroup's k tile: 4 blocks on two partial tiles, each promoted while the next block's MMA
        runs; every MMA retired on return. Returns (acc, pa, pb, 0, 0): no probes (`_k_tile_vec`)."""
        pa = _mma(smem, pa, d_hi, da, db, 0)
        pb = _mma(smem, pb, d_hi, da, db, 1)
        s = _scales(smem, xw, ww, 0)
        pa = mma_wait1(pa)
        acc = fp8_promote(acc, pa, s)
        pa = _mma(smem, pa, d_hi, da, db, 2)
        s = _scales(smem, xw, ww, 1)
        pb = mma_wait1(pb)
        acc = fp8_promote(acc, pb, s)
        pb = _mma(smem, pb, d_hi, da, db, 3)
        s = _scales(smem, xw, ww, 2)
        pa = mma_wait1(pa)
        acc = fp8_promote(acc, pa, s)
        s = _scales(smem, xw, ww, 3)
        pb = mma_wait0(pb)
        acc = fp8_promote(acc, pb, s)
        return acc, pa, pb, 0, 0

    @device_function(**INLINE)
    def _tile_scales(smem, xw, ww):
        """A k tile's scales as six 16-byte loads: the 4 blocks of the thread's rows r0 and r0 + 8 (words
        xw, xw + 32), then each of the 4 w tiles' 4 blocks (words ww ..)."""
        xc = xw >> np.uint32(2)
        wc = ww >> np.uint32(2)
        return (load_u32x4(smem, xc), load_u32x4(smem, xc + np.uint32(8)), load_u32x4(smem, wc),
                load_u32x4(smem, wc + np.uint32(1)), load_u32x4(smem, wc + np.uint32(2)),
                load_u32x4(smem, wc + np.uint32(3)))

    @device_function(**INLINE)
    def _k_tile_vec(smem, acc, pa, pb, d_hi, da, db, xw, ww, fb, fpar, eb, epar):
        """`_k_tile` with the k tile's scales read as six 16-byte loads up front (its rows' 4 blocks, each
        w tile's 4 blocks) instead of 6 word loads a block. With v.probe, two non-blocking probes whose
        answers are read after the k tile, so their latency hides behind the promotions: of the next
        k tile's FULL barrier (byte fb, parity fpar) after block 3's MMA is issued, and of the EMPTY
        barrier of the refill (eb, epar) after block 1's; (acc, pa, pb, full ready, empty ready)."""
        if EARLY:
            xa, xb, wa, wb, wc_, wd = _tile_scales(smem, xw, ww)
        pa = _mma(smem, pa, d_hi, da, db, 0)
        pb = _mma(smem, pb, d_hi, da, db, 1)
        e = mbar_test_wait(smem, eb, epar) if PROBE else 0
        if not EARLY:
            xa, xb, wa, wb, wc_, wd = _tile_scales(smem, xw, ww)
        s = _prod8(xa[0], xb[0], wa[0], wb[0], wc_[0], wd[0])
        pa = mma_wait1(pa)
        acc = fp8_promote(acc, pa, s)
        pa = _mma(smem, pa, d_hi, da, db, 2)
        s = _prod8(xa[1], xb[1], wa[1], wb[1], wc_[1], wd[1])
        pb = mma_wait1(pb)
        acc = fp8_promote(acc, pb, s)
        pb = _mma(smem, pb, d_hi, da, db, 3)
        r = mbar_test_wait(smem, fb, fpar) if PROBE else 0
        s = _prod8(xa[2], xb[2], wa[2], wb[2], wc_[2], wd[2])
        pa = mma_wait1(pa)
        acc = fp8_promote(acc, pa, s)
        s = _prod8(xa[3], xb[3], wa[3], wb[3], wc_[3], wd[3])
        pb = mma_wait0(pb)
        acc = fp8_promote(acc, pb, s)
        return acc, pa, pb, r, e

    k_tile = _k_tile_vec if v.vec_scales else _k_tile

    @cuda.jit(**bounds(V8_THREADS, 1))
    def gemm_fp8_v8(tmx, tmw, tsx, tsw, out, T, K):
        # grid: v8_ctas(tiles) CTAs of 256 threads, v.smem_bytes of dynamic shared memory
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        N = out.shape[1]
        NB = np.uint32((N + BLOCK - 1) // BLOCK)
        n_k = np.uint32((K + BK - 1) // BK)
        n_mt = np.uint32((T + BM - 1) // BM)
        n_nt = np.uint32((N + BN - 1) // BN)
        tiles = np.uint32(n_mt * n_nt)
        c0 = np.uint32(cuda.blockIdx.x)
        step = np.uint32(cuda.gridDim.x)
        mine = udiv32(tiles - c0 + step - np.uint32(1), step)          # output tiles of this CTA
        G = np.uint32(mine * n_k)                                       # its k tiles
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        o = pad
        padu = np.uint32(pad)
        if tid == 0:
            for s in range(S):
                mbar_init(smem, o + FULL0 + 8 * s, 1)
                mbar_init(smem, o + EMPTY0 + 8 * s, EMPTY_ARRIVALS)
        cuda.syncthreads()
        # the fill stream: k tile f (of this CTA's), its output tile and k index; every thread keeps it,
        # thread 0 issues the first S k tiles
        f = U0
        f_tile = c0
        f_kt = U0
        f_m0, f_n0 = _origin(c0, n_mt, n_nt)
        if tid == 0:
            fence_proxy_async()
        while f < G and f < np.uint32(S):
            if tid == 0:
                _fill(smem, padu, f, tmx, tmw, tsx, tsw, f_m0, f_n0, f_kt, T, NB)
            f = np.uint32(f + U1)
            f_kt = np.uint32(f_kt + U1)
            if f_kt == n_k:
                f_kt = U0
                f_tile = np.uint32(f_tile + step)
                f_m0, f_n0 = _origin(f_tile, n_mt, n_nt)
        wg = warp_uniform(tid >> 7)
        p = tid & 127
        r0 = wg * 64 + 16 * (p >> 5) + ((p & 31) >> 2)
        col = 2 * (p & 3)
        pairs = (N & 1) == 0
        lane0 = SIMULATOR or ((tid & 31) == 0 if LANE_ALU else cuda.laneid == 0)
        lane_0 = tid == 0
        part = (tid >> 5) & 3                                           # v.split: the copy this warp issues
        part_lane = wg == 0 and (tid & 31) == 0
        d_all = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        d_hi = d_all & np.uint64(0xFFFFFFFF00000000)
        d_lo = np.uint32(d_all & np.uint64(0xFFFFFFFF))
        a_wg16 = np.uint32(wg * (64 * BK // 16))                        # the warpgroup's A rows, 16-byte units
        xr = np.uint32(r0 * 4)                                          # word of its row r0 in a stage's x scales
        # stage 0's descriptor words and scale words; stage st's are these plus st stages (no carry: the
        # ring lies below 2^18 bytes of the shared window, whose low 18 bits the descriptor takes)
        da0 = np.uint32(np.uint32(d_lo | ((np.uint32(s0) & np.uint32(0x3FFFF)) >> np.uint32(4))) + a_wg16)
        db0 = np.uint32(d_lo | ((np.uint32(np.uint32(s0) + np.uint32(A_BYTES)) & np.uint32(0x3FFFF)) >> np.uint32(4)))
        xw0 = np.uint32(((padu + np.uint32(SXO)) >> np.uint32(2)) + xr)
        ww0 = np.uint32((padu + np.uint32(SWO)) >> np.uint32(2))
        st = U0
        par = U0
        p_st = U0
        p_par = U0
        pp_st = U0
        pp_par = U0
        g = U0
        pa = ZERO
        pb = ZERO
        tile = c0
        i = U0
        ready = 0                                                       # the probe of k tile g's FULL
        while i < mine:
            m0, n0 = _origin(tile, n_mt, n_nt)
            acc = ZERO
            kt = U0
            while kt < n_k:
                while ready == 0:                                       # k tile g has landed
                    ready = mbar_try_wait(smem, np.uint32(padu + np.uint32(FULL0) + (st << U3)), par)
                s16 = np.uint32(st * np.uint32(STAGE_BYTES >> 4))
                da = np.uint32(da0 + s16)
                db = np.uint32(db0 + s16)
                xw = np.uint32(xw0 + np.uint32(s16 << U2))
                ww = np.uint32(ww0 + np.uint32(s16 << U2))
                n_st = np.uint32(st + U1) if np.uint32(st + U1) < np.uint32(S) else U0
                n_par = np.uint32(par ^ U1) if n_st == U0 else par
                r_st = p_st if LAG == 1 else pp_st                      # the stage refilled after this k tile
                r_par = p_par if LAG == 1 else pp_par
                eb = np.uint32(padu + np.uint32(EMPTY0) + (r_st << U3))
                acc, pa, pb, ready, emptied = k_tile(smem, acc, pa, pb, d_hi, da, db, xw, ww,
                                                     np.uint32(padu + np.uint32(FULL0) + (n_st << U3)), n_par,
                                                     eb, r_par)
                if lane0:
                    mbar_arrive(smem, np.uint32(padu + np.uint32(EMPTY0) + (st << U3)))   # its MMAs on st retired
                # the stage of k tile g-LAG is refilled (f == g-LAG+S) once both warpgroups have released it.
                # Every thread waits for that and keeps the fill stream's state; the copies are issued by
                # lane 0 of warpgroup 0's four warps (SPLIT) or by thread 0. (A wait loop inside a branch
                # of thread 0 alone makes ptxas move the MMAs' descriptors out of uniform registers: 30
                # R2UR a k tile more.)
                refill = g >= np.uint32(LAG) and f < G and (wg == 0 or not FREE)   # FREE: warpgroup 1 never waits
                if not refill:
                    emptied = 1
                while emptied == 0:
                    emptied = mbar_try_wait(smem, eb, r_par)
                if refill:
                    if SPLIT:
                        if part_lane:
                            _fill_part(smem, padu, r_st, part, tmx, tmw, tsx, tsw, f_m0, f_n0, f_kt, T, NB)
                    elif lane_0:
                        _fill(smem, padu, r_st, tmx, tmw, tsx, tsw, f_m0, f_n0, f_kt, T, NB)
                    f = np.uint32(f + U1)
                    f_kt = np.uint32(f_kt + U1)
                    if f_kt == n_k:
                        f_kt = U0
                        f_tile = np.uint32(f_tile + step)
                        f_m0, f_n0 = _origin(f_tile, n_mt, n_nt)
                pp_st = p_st
                pp_par = p_par
                p_st = st
                p_par = par
                st = np.uint32(st + U1)
                if st == np.uint32(S):
                    st = U0
                    par = np.uint32(par ^ U1)
                g = np.uint32(g + U1)
                kt = np.uint32(kt + U1)
            acc_store_bf16(out, acc, m0 + r0, n0 + col, T, N, pairs)
            tile = np.uint32(tile + step)
            i = np.uint32(i + U1)

    return gemm_fp8_v8


V8_VARIANTS = {"gemm_fp8_v8": V8Variant(6, vec_scales=True, probe=True, split=True, early=True, lane_alu=True)}
# what tools/fp8_dev.py times beside the record (names are V8Variant.name)
V8_CANDIDATES = {v.name: v for v in (V8Variant(6, vec_scales=True, probe=True, split=True),
                                      V8Variant(6, vec_scales=True, probe=True, split=True, early=True),
                                      V8Variant(6, vec_scales=True, probe=True), V8Variant(6, vec_scales=True),
                                      V8Variant(6, vec_scales=True, probe=True, lag=2),
                                      V8Variant(6, vec_scales=True, probe=True, split=True, lag=2),
                                      V8Variant(6, vec_scales=True, free=True),
                                      V8Variant(6, vec_scales=True, probe=True, free=True), V8Variant(6),
                                      V8Variant(5, vec_scales=True), V8Variant(6, group_m=8, vec_scales=True))}
_V8_KERNELS: dict = {}


def kernel_v8(v: V8Variant):
    """One kernel object a specialisation (numba compiles once a kernel object)."""
    if v.name not in _V8_KERNELS:
        _V8_KERNELS[v.name] = make_kernel_v8(v)
    return _V8_KERNELS[v.name]


KERNELS["gemm_fp8_v8"] = kernel_v8(V8_VARIANTS["gemm_fp8_v8"])     # beside v1 .. v7 (records reads KERNELS)


def geometry_v8(T: int, N: int, v: V8Variant = None):
    v = v or V8_VARIANTS["gemm_fp8_v8"]
    return (v8_ctas(cdiv(T, BM) * cdiv(N, BN)),), v.threads, v.smem_bytes


def maps_v8(q_codes, codes, x_scales, w_scales, stream=0) -> tuple:
    """The four tensor maps gemm_fp8_v8 reads (device bytes, in argument order): x's and w's codes
    (boxes 128 x 128 bytes, 128-byte swizzle) and their scales in the stage layout seen as [rows, 4] fp32
    (boxes of 128 and 4 rows, no swizzle)."""
    from ...device.tma import SWIZZLE_128B, SWIZZLE_NONE, tensor_map_2d
    sx = x_scales.reshape(x_scales.shape[0] * x_scales.shape[1], x_scales.shape[2])
    sw = w_scales.reshape(w_scales.shape[0] * w_scales.shape[1], w_scales.shape[2])
    return (tensor_map_2d(q_codes, BM, BK, SWIZZLE_128B, stream=stream).device,
            tensor_map_2d(codes, BN, BK, SWIZZLE_128B, stream=stream).device,
            tensor_map_2d(sx, BM, 4, SWIZZLE_NONE, stream=stream).device,
            tensor_map_2d(sw, BN // BLOCK, 4, SWIZZLE_NONE, stream=stream).device)


def launcher_v8(rec, x, codes, scales, out, *, stream=0, variant: V8Variant = None) -> Fp8GemmLaunch:
    """gemm_fp8_v8's launch (the record's, or specialisation `variant`'s): act_quant, then the GEMM on the
    four tensor maps of the workspaces (`cuda_fp8_wgmma.workspaces`, shapes checked by
    `prepare_project_q`)."""
    T, K = x.shape
    N = codes.shape[0]
    check_out_words(rec, out)
    quant, q_codes, x_scales, w_scales = workspaces(rec, x, codes, scales, stream=stream)
    v = variant or V8_VARIANTS["gemm_fp8_v8"]
    kernel = kernel_v8(v)
    grid, block, smem = geometry_v8(T, N, v)
    args = (*maps_v8(q_codes, codes, x_scales, w_scales, stream=stream), out, T, K)
    allow_dynamic_shared(kernel, args, smem)
    name = rec.name if variant is None else v.name
    gemm = PreparedLaunch(name, kernel, grid, block, stream, args, out, sharedmem=smem)
    return Fp8GemmLaunch(name, quant, gemm, out, q_codes, x_scales, w_scales)
