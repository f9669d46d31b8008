"""Hopper GEMM kernels of the projection: kv = bf16(x @ wkv^T) on the warpgroup MMA (sm_90a).

Shapes and argument conventions in `cuda_common`; numerics as gemm_v3 (the tensor core sums each
16-term product internally; within 1 bf16 ulp of the float64 answer where fp32 summation noise is
small, docs/numerics.md). The helpers (`cp_async_16`, `wgmma_bf16`, descriptors, fences) and their
simulator twins are in `device/hopper.py`; docs/design.md says how the pieces fit.

Kernel versions
  gemm_v4  CTA tile 128 x 256 (tokens x outputs), BK = 64, 4 shared-memory stages filled with
           cp.async (zero-fill for rows past T or N and the K tail); 2 warpgroups, each one
           m64n256k16 wgmma chain (128 fp32 accumulators a thread) on 64 token rows; operands
           K-major in the 128-byte-swizzled layout; tiles in token-fastest order so the CTAs in
           flight share weight tiles in L2. Epilogue: accumulators -> bf16 pairs in shared
           memory -> coalesced stores.
  gemm_v5  small T: CTA tile 64 x 128 (both warpgroups share the 64 token rows, each takes 64 of
           the 128 outputs: m64n64k16), 4 stages, 2 CTAs an SM, so T <= 64 runs 200 CTAs that
           keep the weight stream of every SM busy.
  gemm_v6  gemm_v4 with 128 x 200 tiles (m64n200k16): the released N = 25600 is 128 tiles, so
           T <= 128 runs one wave on 128 of the 132 SMs (gemm_v4: 100) and T <= 256 two full waves
           (gemm_v4: 200 tiles, the second wave half empty). records.py says where each wins.
  gemm_v8  gemm_v4's tile, pipeline and epilogue (the same device functions) on persistent CTAs, one
           an SM, over a host-made list of (tile, k range) units: whole waves data-parallel, the
           last full wave and the ragged one stream-K (equal k ranges a CTA, cut tiles fixed up
           through a global workspace in a fixed order), the next unit's first stages in flight
           during a unit's epilogue. Section "gemm_v8" below.
  gemm_v9  gemm_v8 on a leaner k loop (`Variant.loop`): the wgmma descriptors made once a unit and
           stepped by constants, the stage ring as running offsets; candidates drop one CTA-wide
           barrier ("lean1") or both for per-stage mbarriers ("mbar"). Section "gemm_v9" below.
  gemm_v10 gemm_v4's grid with the stages filled by TMA ("tma" loop: one thread, two box copies a
           k tile, full / empty mbarriers, no CTA barrier in the loop) and the tile stored by TMA
           (`_store_tile_tma`: swizzled boxes, 4 stores; gemm_v4's epilogue where N % 8 != 0).
  gemm_v11 gemm_v8's persistent CTAs and schedule on gemm_v10's loop and epilogue. Section "TMA".
  gemm_v12 persistent CTAs of 288 threads over a tile queue: a producer warp takes the tiles and fills
           one stage ring that runs on from tile to tile, the math warpgroups only multiply and store
           (through their own epilogue buffer). Section "The unit queue with a producer warp".

gemm_v4..v6 come from one kernel factory (`make_kernel(Variant)`), gemm_v8 and gemm_v9 from another
(`make_persistent_kernel`), both built on one set of device functions per tile (`parts_for(Variant)`:
copy assignment, prologue, pipelined k loop (gemm_v4's, or `_lean_loop` / `_mbar_loop` / `_tma_loop`),
epilogue (or `_store_tile_tma`)); `VARIANTS` / `SK_VARIANTS` name the specialisations the records use,
`CANDIDATES` / `SK_CANDIDATES` what the development script times besides them (gemm_v9: `V9_VARIANTS` /
`V9_CANDIDATES`; gemm_v10 / gemm_v11: `TMA_VARIANTS` / `TMA_FALLBACK` / `TMA_CANDIDATES`). gemm_v12's kernel
is `make_queue_pw_kernel` (its own k loop and epilogue on the "tma" loop's fill, `_tma_filler`);
`QUEUE_VARIANTS` names it, `Q_CANDIDATES` holds the queue candidates.

The pipeline, per k tile kt (buffer kt % STAGES):
    cp.async.wait_group STAGES-2    this thread's copies of tile kt have landed
    fence.proxy.async               ... are visible to the async proxy (wgmma reads through it)
    barrier                         ... and so are everyone else's
    wgmma.fence; 4 x wgmma (k16 steps); wgmma.commit_group
    wgmma.wait_group 1              this warpgroup's MMAs of tile kt-1 are done
    barrier                         ... and the other warpgroup's: buffer (kt-1) % STAGES is free
    cp.async tile kt+STAGES-1 into it; commit (an empty group past the end keeps the count)
so the tensor cores always have the MMAs of tile kt queued while the threads wait and issue
copies, and STAGES-1 tiles of copies are in flight.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from ...device.devarray import data_address
from ...device.intrinsics import device_function
from ...device.hopper import (WGMMA_NO_SWIZZLE, WGMMA_SWIZZLE_128B, acc_add_f32, acc_store_f32, cp_async_16,
                              cp_async_commit, cp_async_mbar_arrive, cp_async_waiter, fence_proxy_async, flag_wait,
                              mbar_arrive, mbar_arrive_expect_tx, mbar_init, mbar_inval, mbar_try_wait, shared_address,
                              bulk_commit, bulk_wait_read0, tma_load_2d, tma_store_2d, wgmma_bf16, wgmma_commit,
                              wgmma_descriptor, wgmma_fence, wgmma_store_bf16x2, wgmma_store_bf16x2_sw128, wgmma_waiter,
                              acc_tail_storer, sw128_storer, cluster_ctarank, cluster_sync,
                              fence_mbarrier_init_cluster, mbar_arrive_remote,
                              tma_load_2d_multicast, named_barrier_sync, wgmma_bf16_cols, ACC_MAX)
from ...device.launch import ClusterLaunch, PreparedLaunch, allow_dynamic_shared
from . import cuda_wgmma_ws as WS
from .cuda_common import INLINE, bounds, cdiv, fast_launch, flat_u32
from .cuda_wgmma_ws import F_HI, F_KB, F_KE, F_LO, F_M0, F_N0, F_ROLE, F_SLOT, FINISH, PARTIAL

THREADS = 256                   # 2 warpgroups
BK = 64                         # k values a stage: one 128-byte row per operand row
ROW_BYTES = 2 * BK
GROUP_BYTES = 8 * ROW_BYTES     # 8 rows: one 1024-byte atom (swizzled) or 8 core matrices (not)
ALIGN_SLACK = 1024              # the 128-byte swizzle needs its atoms 1024-byte aligned
SM_SHARED_BYTES = 228 * 1024    # shared memory of an H100/H200 SM
LOOPS = ("v4", "lean", "lean1", "mbar", "tma")  # the k loop's forms (`Variant.loop`)


class Variant:
    """One specialisation of the kernel: tile, pipeline depth and shared-memory layout."""

    def __init__(self, bm: int, bn: int, stages: int, swizzle: bool, loop: str = "v4", store: str = "v4",
                 cluster: int = 1, producer: bool = False):
        # loop: the k loop's form (`_make_parts`): "v4" (gemm_v4's), "lean" (gemm_v4's schedule, the
        # descriptors and ring offsets carried from k tile to k tile) or "lean1" (lean, one barrier a
        # k tile, STAGES-2 tiles of copies in flight) or "mbar" (lean, the stages handed over on
        # per-stage mbarriers instead of CTA-wide barriers); gemm_v9's section says why; "tma" (the
        # stages filled by TMA copies of one thread, handed over on mbarriers: section "TMA" below)
        assert loop in LOOPS, loop
        self.loop = loop
        # 2 warpgroups: split the 128 token rows (m64 each), or share 64 rows and split the outputs;
        # a warpgroup's wgmma takes n = wg_n, a multiple of 8 (accumulator quads) up to 256; past 256
        # ("tma" tiles without a producer warp, section "Wide tiles" below) each k16 step is two wgmma
        # chains of wg_n / 2 columns on the two halves of one accumulator tuple
        self.wg_n = bn if bm == 128 else bn // 2
        self.chains = 2 if self.wg_n > 256 else 1
        assert bm in (64, 128) and self.wg_n % (8 * self.chains) == 0 and 8 <= self.wg_n <= 2 * ACC_MAX \
            and stages >= 3, (bm, bn, stages)
        assert swizzle or bn % 32 == 0
        self.bm, self.bn, self.stages, self.swizzle = bm, bn, stages, swizzle
        self.stage_bytes = (bm + bn) * ROW_BYTES
        # words a row of the bf16x2 output tile, padded to 4 mod 8: lanes (g, t) store word g*stride + t
        # (+4j), 32 distinct banks
        self.stash_stride = bn // 2 + (4 - bn // 2) % 8
        # store: the epilogue's form: "v4" (the bf16 tile staged in padded rows, then 16-bit global
        # stores by every thread) or "tma" (staged in 128-byte-swizzled boxes of 64 columns, then one
        # TMA store a box: `_store_tile_tma`; "tma" loop only, 128 token rows; the last bn % 64
        # columns, if any, stored from registers as bf16 pairs: `store_tail`)
        assert store in ("v4", "tma") and (store == "v4" or (loop == "tma" and bm == 128 and bn >= 64))
        self.store = store
        self.tail = bn % 64 if store == "tma" else 0
        self.stash_bytes = bm * (bn - self.tail) * 2 if store == "tma" else bm * self.stash_stride * 4
        self.smem_bytes = max(stages * self.stage_bytes, self.stash_bytes) + ALIGN_SLACK
        # "mbar": 2 x STAGES mbarriers past the stages and either place of the epilogue's tile
        self.mbar_at = max(stages * self.stage_bytes, (stages - 1) * self.stage_bytes + self.stash_bytes)
        if loop in ("mbar", "tma"):
            self.smem_bytes = self.mbar_at + 16 * stages + ALIGN_SLACK
        assert self.smem_bytes <= 227 * 1024, self.smem_bytes
        # CTAs an SM holds: 228 KiB of shared memory, 1 KiB of it reserved per CTA
        self.blocks_per_sm = min(4, SM_SHARED_BYTES // (self.smem_bytes + 1024))
        # cluster: 2 puts the CTAs of token tiles 2c and 2c+1 (same output tile) in a cluster that shares
        # each stage's weight box: each CTA loads half of it by TMA multicast into both ("tma" loop only,
        # gemm_v4's grid: section "Clusters" below)
        assert cluster in (1, 2) and (cluster == 1 or (loop == "tma" and bm == 128 and bn % 16 == 0)), cluster
        self.cluster = cluster
        # producer: a 9th warp (threads 256..287) whose lane 0 fills every stage and waits on EMPTY, so the
        # math warpgroups only wait for data ("tma" loop, gemm_v4's grid: section "A producer warp" below)
        assert not producer or loop == "tma", "a producer warp fills stages by TMA"
        self.producer = producer
        # wide tiles: the "tma" loop and epilogue, whole 64-column boxes, no cluster; no producer warp either,
        # whose 9 warps put 3 on one SM sub-partition and leave 168 registers a thread (ptxas' cap), too
        # few beside 160 accumulators (section "Wide tiles")
        assert self.chains == 1 or (loop == "tma" and store == "tma" and cluster == 1 and not producer
                                    and bn % 64 == 0), "a wide tile: the tma loop and epilogue, whole boxes"
        # a TMA box has at most 256 rows: a weight box past that is loaded as two halves
        self.w_loads = 2 if bn // cluster > 256 else 1
        self.threads = THREADS + 32 if producer else THREADS
        self.name = f"{bm}x{bn}x{BK}/s{stages}/{'sw128' if swizzle else 'noswz'}" + ("" if loop == "v4" else f"/{loop}") \
            + ("" if store == "v4" else "/tmastore") + ("" if cluster == 1 else f"/c{cluster}") \
            + ("/pw" if producer else "")
        assert loop == "v4" or swizzle, "the lean loops step descriptors in the swizzled layout only"


class Parts:
    """The device functions of one specialisation's CTA tile, shared by gemm_v4..v6's kernel
    (`make_kernel`: one tile a CTA) and gemm_v8's (`cuda_wgmma_sk`: persistent CTAs walking a list
    of (tile, k range) units): the copy assignment, the pipelined k loop and the epilogue."""

    def __init__(self, v: Variant):
        self.variant = v
        (self.copy_slot, self.operand_offsets, self.prologue, self.k_loop, self.k_tiles,
         self.store_tile) = _make_parts(v)
        self.store_tail = None
        if v.store == "tma":
            self.store_tile = _store_tile_tma(v)
            if v.tail:
                self.store_tail = _store_tail(v)


def _make_parts(v: Variant):
    BM, BN, STAGES = v.bm, v.bn, v.stages
    WG_N = v.wg_n
    NACC = WG_N // 2
    A_BYTES = BM * ROW_BYTES
    STAGE_BYTES = v.stage_bytes
    A_CHUNKS = BM * 8 // THREADS               # 16-byte chunks a thread copies a stage
    B_CHUNKS = (BN * 8 + THREADS - 1) // THREADS  # rounded up: with BN % 32 != 0 the last pass is partial
    B_PARTIAL = BN % 32 != 0
    SPLIT_M = BM == 128
    SW = v.swizzle
    # a k16 step moves the descriptor 32 bytes along a swizzled 128-byte row, or 2 core matrices
    K_STEP = 32 if SW else 256
    LBO = 16 if SW else 128
    MODE = WGMMA_SWIZZLE_128B if SW else WGMMA_NO_SWIZZLE
    STRIDE = v.stash_stride
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    cp_wait = cp_async_waiter(STAGES - 2)
    mma_wait1 = wgmma_waiter(1)
    mma_wait0 = wgmma_waiter(0)
    cp_wait0 = cp_async_waiter(0)

    @device_function(**INLINE)
    def _issue_stage(smem, stage_off, x32, w32, m0, n0, T, N, K8, kt, row0, q, off0):
        """cp.async this thread's chunks of k tile kt into the stage at byte stage_off of smem."""
        kq = kt * 8 + q                                  # this thread's 16-byte chunk along K
        k_ok = kq < K8
        kc = min(kq, K8 - 1)
        for i in range(A_CHUNKS):
            r = m0 + row0 + 32 * i
            ok = k_ok and r < T
            cp_async_16(smem, stage_off + off0 + 4096 * i, x32, np.int64(min(r, T - 1)) * K8 + kc,
                        16 if ok else 0)
        for i in range(B_CHUNKS):
            if B_PARTIAL and row0 + 32 * i >= BN:      # past the tile (BN = 200: 8 of 32 rows)
                continue
            r = n0 + row0 + 32 * i
            ok = k_ok and r < N
            cp_async_16(smem, stage_off + A_BYTES + off0 + 4096 * i, w32, np.int64(min(r, N - 1)) * K8 + kc,
                        16 if ok else 0)

    @device_function(**INLINE)
    def _copy_slot(tid):
        """(row0, q, off0): this thread copies rows row0 + 32 i, 16-byte chunk q of each row, to byte
        off0 + 4096 i of the operand's tile.

        Unswizzled, a warp copies 8 rows x 4 chunks (64 contiguous bytes of each row) and stores
        512 contiguous bytes (core matrices are 8 rows x 16 bytes); swizzled, 4 whole rows, each
        quarter-warp's 8 chunks on 8 distinct bank groups. Rows past T (N) and chunks past K are
        zero-filled from a clamped address."""
        if SW:
            row0 = tid >> 3
            q = tid & 7
            off0 = row0 * ROW_BYTES + ((q ^ (row0 & 7)) << 4)
        else:
            row0 = ((tid >> 6) << 3) + (tid & 7)
            q = (tid >> 3) & 7
            off0 = tid << 4
        return row0, q, off0

    @device_function(**INLINE)
    def _operand_offsets(wg):
        """(a_wg, b_wg): bytes from a stage's x (w) tile to warpgroup wg's operand rows."""
        if SPLIT_M:
            return wg * (64 * ROW_BYTES), 0              # this warpgroup's 64 token rows
        return 0, wg * (WG_N * ROW_BYTES)                # this warpgroup's WG_N outputs

    @device_function(**INLINE)
    def _prologue(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0):
        """The pipeline's first STAGES-1 commit groups: k tiles kb .. kb+STAGES-2 (those before ke)
        into stages 0 .. STAGES-2."""
        n = ke - kb
        for s in range(STAGES - 1):
            if s < n:
                _issue_stage(smem, s0 - base + s * STAGE_BYTES, x32, w32, m0, n0, T, N, K8, kb + s, row0, q, off0)
            cp_async_commit()

    @device_function(**INLINE)
    def _k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        """After `_prologue` of the same unit: this warpgroup's accumulators of the tile at (m0, n0)
        over k tiles kb .. ke-1 (module docstring's pipeline); returns once every copy and MMA has
        retired and all threads have passed a barrier, so shared memory is free again."""
        n = ke - kb
        d_hi = wgmma_descriptor(0, LBO, GROUP_BYTES, MODE)   # descriptor constants; addresses per k step
        acc = ZERO
        for j in range(n):
            st = s0 + (j % STAGES) * STAGE_BYTES
            cp_wait()
            fence_proxy_async()
            cuda.syncthreads()
            acc = wgmma_fence(acc)
            for ks in range(BK // 16):
                da = d_hi | wgmma_descriptor(st + a_wg + ks * K_STEP, 0, 0, 0)
                db = d_hi | wgmma_descriptor(st + A_BYTES + b_wg + ks * K_STEP, 0, 0, 0)
                acc = wgmma_bf16(acc, da, db, smem)
            wgmma_commit()
            acc = mma_wait1(acc)
            cuda.syncthreads()
            nj = j + STAGES - 1
            if nj < n:
                _issue_stage(smem, s0 - base + (nj % STAGES) * STAGE_BYTES, x32, w32, m0, n0, T, N, K8, kb + nj,
                             row0, q, off0)
            cp_async_commit()
        acc = mma_wait0(acc)
        cp_wait0()
        cuda.syncthreads()                               # every MMA has read its last stage
        return acc

    @device_function(**INLINE)
    def _k_tiles(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        """`_prologue` then `_k_loop`: the tile's accumulators over k tiles kb .. ke-1."""
        _prologue(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0)
        return _k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg)

    @device_function(**INLINE)
    def _store_tile(smem, word0, out, acc, m0, n0, T, N, tid, wg):
        """Epilogue: bf16 pairs into a [BM][STRIDE] word tile at word word0 of smem (the start of the
        free stages in gemm_v4), then row-contiguous global stores; ends before the tile is read
        again (callers that reuse its shared memory put a barrier after it)."""
        p = tid & 127
        w4 = p >> 5
        lane = p & 31
        wbase = word0 + (16 * w4 + (lane >> 2)) * STRIDE + (lane & 3)
        if SPLIT_M:
            wbase += wg * 64 * STRIDE
        else:
            wbase += wg * (WG_N // 2)
        wgmma_store_bf16x2(smem, wbase, STRIDE, acc)
        cuda.syncthreads()
        words = BN // 2
        for i in range(tid, BM * words, THREADS):
            r = i // words
            c = i - r * words
            t = m0 + r
            n = n0 + 2 * c
            if t < T and n < N:
                word = smem[word0 + r * STRIDE + c]
                out[t, n] = np.uint16(word & np.uint32(0xFFFF))
                if n + 1 < N:
                    out[t, n + 1] = np.uint16(word >> np.uint32(16))

    if v.loop == "mbar":
        _prologue, _k_loop, _k_tiles = _mbar_loop(v, _issue_stage)
    elif v.loop == "tma":
        _prologue, _k_loop, _k_tiles = _tma_loop(v)
    elif v.loop != "v4":
        _prologue, _k_loop, _k_tiles = _lean_loop(v, _issue_stage)
    return _copy_slot, _operand_offsets, _prologue, _k_loop, _k_tiles, _store_tile


def _lean_loop(v: Variant, _issue_stage):
    """gemm_v9's k loops on tile v (`Variant.loop` "lean" or "lean1"): (prologue, k_loop, k_tiles)
    with the contracts of `_make_parts`' own, the same copies (`_issue_stage`) and the same wgmma
    chain in the same k order, so the accumulators are gemm_v4's bits. Section "gemm_v9" below."""
    assert v.swizzle, v.name
    STAGES = v.stages
    STAGE_BYTES = v.stage_bytes
    A_BYTES = v.bm * ROW_BYTES
    ONE_BARRIER = v.loop == "lean1"
    AHEAD = STAGES - 2 if ONE_BARRIER else STAGES - 1     # k tiles of copies issued before the first MMA
    RING = STAGES * STAGE_BYTES
    NACC = v.wg_n // 2
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    # descriptor steps: the address field is (address & 0x3FFFF) >> 4 in the low 14 bits; shared
    # memory ends below 2^18 bytes, so adding a byte offset >> 4 to it never carries out of the field
    D_KSTEP = np.uint64(32 >> 4)                          # a k16 step: 32 bytes along a swizzled row
    D_STAGE = np.uint64(STAGE_BYTES >> 4)
    D_RING = np.uint64(RING >> 4)
    D_A = np.uint64(A_BYTES >> 4)
    cp_wait = cp_async_waiter(AHEAD - 1)
    mma_wait1 = wgmma_waiter(1)
    mma_wait0 = wgmma_waiter(0)
    cp_wait0 = cp_async_waiter(0)

    @device_function(**INLINE)
    def _prologue(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0):
        """The pipeline's first AHEAD commit groups: k tiles kb .. kb+AHEAD-1 (those before ke) into
        stages 0 .. AHEAD-1."""
        n = ke - kb
        for s in range(AHEAD):
            if s < n:
                _issue_stage(smem, s0 - base + s * STAGE_BYTES, x32, w32, m0, n0, T, N, K8, kb + s, row0, q, off0)
            cp_async_commit()

    @device_function(**INLINE)
    def _k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        """After `_prologue` of the same unit: this warpgroup's accumulators of the tile at (m0, n0)
        over k tiles kb .. ke-1; returns once every copy and MMA has retired and all threads have
        passed a barrier, so shared memory is free again."""
        n = ke - kb
        d_hi = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        da = d_hi | wgmma_descriptor(s0 + a_wg, 0, 0, 0)        # stage 0's descriptors, then carried
        db = d_hi | wgmma_descriptor(s0 + b_wg, 0, 0, 0) + D_A
        da_end = da + D_RING
        w_off = s0 - base + AHEAD * STAGE_BYTES                 # byte offset of the stage the next copies fill
        w_end = s0 - base + RING
        kn = kb + AHEAD                                         # the k tile they bring
        acc = ZERO
        for j in range(n):
            cp_wait()                                           # this thread's copies of tile j have landed
            fence_proxy_async()
            cuda.syncthreads()                                  # ... everyone's; lean1: and every MMA of j-2
            if ONE_BARRIER:
                if kn < ke:
                    _issue_stage(smem, w_off, x32, w32, m0, n0, T, N, K8, kn, row0, q, off0)
                cp_async_commit()
                kn += 1
                w_off += STAGE_BYTES
                if w_off == w_end:
                    w_off -= RING
            acc = wgmma_fence(acc)
            for ks in range(BK // 16):
                acc = wgmma_bf16(acc, da + np.uint64(ks) * D_KSTEP, db + np.uint64(ks) * D_KSTEP, smem)
            wgmma_commit()
            da += D_STAGE
            db += D_STAGE
            if da == da_end:
                da -= D_RING
                db -= D_RING
            acc = mma_wait1(acc)                                # this warpgroup's MMAs of tile j-1 are done
            if not ONE_BARRIER:
                cuda.syncthreads()                              # ... and the other's: their stage is free
                if kn < ke:
                    _issue_stage(smem, w_off, x32, w32, m0, n0, T, N, K8, kn, row0, q, off0)
                cp_async_commit()
                kn += 1
                w_off += STAGE_BYTES
                if w_off == w_end:
                    w_off -= RING
        acc = mma_wait0(acc)
        cp_wait0()
        cuda.syncthreads()                                      # every MMA has read its last stage
        return acc

    @device_function(**INLINE)
    def _k_tiles(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        """`_prologue` then `_k_loop`: the tile's accumulators over k tiles kb .. ke-1."""
        _prologue(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0)
        return _k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg)

    return _prologue, _k_loop, _k_tiles


def _mbar_loop(v: Variant, _issue_stage):
    """gemm_v9's "mbar" k loop on tile v: (prologue, k_loop, k_tiles) as `_lean_loop`'s, the stages
    handed over on mbarriers: FULL[s] (count THREADS: each thread's `cp_async_mbar_arrive` once its
    copies of the stage have landed) and EMPTY[s] (count 8: lane 0 of each warp once its warpgroup's
    wgmma.wait_group 1 has retired the stage's MMAs; every thread in the simulator). Iteration j waits FULL[j % S] (phase parity
    (j // S) & 1) instead of cp.async.wait_group + a CTA barrier, and the copies of tile j+S-1 into
    tile j-1's stage wait EMPTY of that stage instead of a CTA barrier. The prologue initialises
    the barriers (thread 0, then a CTA barrier), the k loop's end invalidates them (thread 0, after
    its final CTA barrier: all idle), so each unit starts from phase 0. The same copies, wgmma chain
    and k order as gemm_v4: gemm_v4's bits."""
    assert v.swizzle, v.name
    STAGES = v.stages
    STAGE_BYTES = v.stage_bytes
    A_BYTES = v.bm * ROW_BYTES
    RING = STAGES * STAGE_BYTES
    FULL0 = v.mbar_at                                      # bytes from stage 0: FULL[s] at +8 s, EMPTY[s] after
    EMPTY0 = v.mbar_at + 8 * STAGES
    NACC = v.wg_n // 2
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    D_KSTEP = np.uint64(32 >> 4)
    D_STAGE = np.uint64(STAGE_BYTES >> 4)
    D_RING = np.uint64(RING >> 4)
    D_A = np.uint64(A_BYTES >> 4)
    mma_wait1 = wgmma_waiter(1)
    mma_wait0 = wgmma_waiter(0)
    # EMPTY arrivals: lane 0 of each warp (wgmma.wait_group is warp-synchronous on a GPU); the
    # simulator's threads are not in lockstep, and its wgmma twin reads shared memory at the wait, so
    # there every thread arrives
    EMPTY_COUNT = THREADS if WS.SIMULATOR else THREADS // 32

    @device_function(**INLINE)
    def _prologue(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0):
        """Barriers (re)initialised, then k tiles kb .. kb+STAGES-2 (those before ke) into stages
        0 .. STAGES-2, each tracked by its FULL barrier."""
        n = ke - kb
        o = s0 - base
        if cuda.threadIdx.x == 0:
            for s in range(STAGES):
                mbar_init(smem, o + FULL0 + 8 * s, THREADS)
                mbar_init(smem, o + EMPTY0 + 8 * s, EMPTY_COUNT)
        cuda.syncthreads()
        for s in range(STAGES - 1):
            if s < n:
                _issue_stage(smem, o + s * STAGE_BYTES, x32, w32, m0, n0, T, N, K8, kb + s, row0, q, off0)
                cp_async_mbar_arrive(smem, o + FULL0 + 8 * s)

    @device_function(**INLINE)
    def _k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        """After `_prologue` of the same unit: this warpgroup's accumulators over k tiles kb .. ke-1;
        returns once every MMA has retired and all threads have passed a barrier."""
        n = ke - kb
        o = s0 - base
        lane0 = WS.SIMULATOR or cuda.laneid == 0
        d_hi = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        da = d_hi | wgmma_descriptor(s0 + a_wg, 0, 0, 0)
        db = d_hi | wgmma_descriptor(s0 + b_wg, 0, 0, 0) + D_A
        da_end = da + D_RING
        r_st = 0                                            # stage of tile j, and its fill's parity
        r_par = 0
        p_st = STAGES - 1                                   # stage of tile j-1 (= of tile j+S-1)
        p_par = 1                                           # parity of tile j-1's fill of it (j = 0: none)
        acc = ZERO
        for j in range(n):
            while mbar_try_wait(smem, o + FULL0 + 8 * r_st, r_par) == 0:
                pass                                        # every thread's copies of tile j have landed
            fence_proxy_async()
            acc = wgmma_fence(acc)
            for ks in range(BK // 16):
                acc = wgmma_bf16(acc, da + np.uint64(ks) * D_KSTEP, db + np.uint64(ks) * D_KSTEP, smem)
            wgmma_commit()
            da += D_STAGE
            db += D_STAGE
            if da == da_end:
                da -= D_RING
                db -= D_RING
            acc = mma_wait1(acc)                            # this warpgroup's MMAs of tile j-1 are done
            if j > 0 and lane0:
                mbar_arrive(smem, o + EMPTY0 + 8 * p_st)
            nj = j + STAGES - 1
            if nj < n:
                if j > 0:                                   # both warpgroups are done with tile j-1's stage
                    while mbar_try_wait(smem, o + EMPTY0 + 8 * p_st, p_par) == 0:
                        pass
                _issue_stage(smem, o + p_st * STAGE_BYTES, x32, w32, m0, n0, T, N, K8, kb + nj, row0, q, off0)
                cp_async_mbar_arrive(smem, o + FULL0 + 8 * p_st)
            p_st = r_st
            p_par = r_par
            r_st += 1
            if r_st == STAGES:
                r_st = 0
                r_par ^= 1
        acc = mma_wait0(acc)
        cuda.syncthreads()                                  # every MMA has read its last stage
        if cuda.threadIdx.x == 0:                           # every barrier is idle: the next prologue inits
            for s in range(STAGES):
                mbar_inval(smem, o + FULL0 + 8 * s)
                mbar_inval(smem, o + EMPTY0 + 8 * s)
        return acc

    @device_function(**INLINE)
    def _k_tiles(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        _prologue(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0)
        return _k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg)

    return _prologue, _k_loop, _k_tiles


def _store_tile_tma(v: Variant):
    """The "tma" epilogue of tile v: store_tile(smem, word0, tmaps, acc, m0, n0, T, N, tid, wg), in
    place of `_make_parts`' own (the same arguments, `tmaps` where that one takes `out`). Each
    thread rounds its accumulators to bf16 pairs into BN / 64 boxes of [128 rows][128 bytes],
    128-byte swizzled, at word word0 (1024-byte aligned), fences them for the async proxy; after a
    CTA barrier thread 0 stores each box with one TMA store (the output tensor map at byte 128 of
    `tmaps`, x's at byte 0; rows past T and outputs past N are not written) and commits them.
    Returns at once: the stores read the boxes after it, so thread 0 must `bulk_wait_read0` before
    the boxes' shared memory is written again or the CTA exits (the "tma" k loop's start does).
    With BN % 64 != 0 the boxes hold the first BN // 64 * 64 columns; `_store_tail` the rest."""
    BOX_WORDS = v.bm * 32
    N_BOXES = v.bn // 64
    to_boxes = sw128_storer(8 * N_BOXES) if v.tail else wgmma_store_bf16x2_sw128
    PW = v.producer                                          # threads >= 256: the producer warp, no tile

    @device_function(**INLINE)
    def store_tile(smem, word0, tmaps, acc, m0, n0, T, N, tid, wg):
        p = tid & 127
        lane = p & 31
        g = lane >> 2
        if not PW or tid < THREADS:
            to_boxes(smem, word0 + (16 * (p >> 5) + g + 64 * wg) * 32 + (lane & 3), g, BOX_WORDS, acc)
        fence_proxy_async()
        cuda.syncthreads()
        if tid == 0:
            for b in range(N_BOXES):
                tma_store_2d(smem, word0 * 4 + b * BOX_WORDS * 4, tmaps, 128, np.int32(n0 + 64 * b), np.int32(m0))
            bulk_commit()
    return store_tile


def _store_tail(v: Variant):
    """The "tma" epilogue's last BN % 64 columns (a tile of BN = 240 ends on 48 columns no TMA box
    of the 64-column map may store: it would write the next tile's): store_tail(out, acc, m0, n0,
    T, N, tid, wg) stores this thread's pairs of them from registers, one 32-bit word a pair (the
    output passed `tma_store_ok`: N % 8 == 0, 16-byte aligned), rows past T and columns past N not."""
    tail_store = acc_tail_storer(v.bn // 64 * 8)

    @device_function(**INLINE)
    def store_tail(out, acc, m0, n0, T, N, tid, wg):
        p = tid & 127
        lane = p & 31
        tail_store(out, acc, m0 + 64 * wg + 16 * (p >> 5) + (lane >> 2), n0 + 2 * (lane & 3), T, N)
    return store_tail


def _tma_filler(v: Variant, FULL0: int):
    """The "tma" loop's fill of tile v with its FULL barriers at byte FULL0 of the stage ring's start:
    fill(smem, o, st, tmx, tmw, m0, n0, kt), for the one thread that fills."""
    STAGE_BYTES = v.stage_bytes
    A_BYTES = v.bm * ROW_BYTES
    C2 = v.cluster == 2
    MC = C2 and not WS.SIMULATOR
    HALF = v.bn // 2
    HALF_BYTES = HALF * ROW_BYTES
    W2 = v.w_loads == 2                                     # a wide tile's weight box in two loads

    @device_function(**INLINE)
    def _fill(smem, o, st, tmx, tmw, m0, n0, kt):
        """k tile kt of the tile at (m0, n0) into stage st by TMA, reported to FULL[st]."""
        bar = o + FULL0 + 8 * st
        stage = o + st * STAGE_BYTES
        mbar_arrive_expect_tx(smem, bar, STAGE_BYTES)
        tma_load_2d(smem, stage, tmx, np.int32(kt * BK), np.int32(m0), bar)
        if MC:                                              # this CTA's half of the weight box, into both
            rank = cluster_ctarank()
            tma_load_2d_multicast(smem, stage + A_BYTES + rank * HALF_BYTES, tmw, np.int32(kt * BK),
                                  np.int32(n0 + rank * HALF), bar, 3)
        elif C2 or W2:                                      # both halves (clusters: the simulator's, both CTAs')
            tma_load_2d(smem, stage + A_BYTES, tmw, np.int32(kt * BK), np.int32(n0), bar)
            tma_load_2d(smem, stage + A_BYTES + HALF_BYTES, tmw, np.int32(kt * BK), np.int32(n0 + HALF), bar)
        else:
            tma_load_2d(smem, stage + A_BYTES, tmw, np.int32(kt * BK), np.int32(n0), bar)
    return _fill


def _tma_loop(v: Variant):
    """The "tma" k loop on tile v: (prologue, k_loop, k_tiles) with `_make_parts`' contracts, except
    that the kernel's x32 and w32 arguments are the tensor maps of x [T, K] (box BM x 64) and wkv
    [N, K] (box BN x 64), 128-byte swizzled (`device/tma.py`; `prepare_variant` and `prepare_sk`
    make them). Thread 0 is the producer: a k tile is one `mbarrier.arrive.expect_tx` of the
    stage's bytes on FULL[s] and two TMA copies (the x box and the w box) reporting to it; TMA
    zero-fills rows past T and N and k past K, so there are no clamps or predicates. The rest is
    the "mbar" loop's hand-over: every thread waits FULL[j % S] (parity (j // S) & 1) before tile
    j's MMAs, lane 0 of each warp arrives on EMPTY[s] once its warpgroup's wgmma.wait_group 1 has
    retired tile j-1's MMAs, and thread 0 waits EMPTY of that stage before refilling it with tile
    j+S-1. The same wgmma chain and k order as gemm_v4 on the same bytes: gemm_v4's bits."""
    assert v.swizzle, v.name
    if v.producer:                                          # section "A producer warp"
        return _producer_warp_loop(v, _tma_filler(v, v.mbar_at))
    STAGES = v.stages
    STAGE_BYTES = v.stage_bytes
    A_BYTES = v.bm * ROW_BYTES
    RING = STAGES * STAGE_BYTES
    FULL0 = v.mbar_at
    EMPTY0 = v.mbar_at + 8 * STAGES
    NACC = v.wg_n // 2
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    D_STAGE = np.uint64(STAGE_BYTES >> 4)
    D_RING = np.uint64(RING >> 4)
    D_A = np.uint64(A_BYTES >> 4)
    mma_wait1 = wgmma_waiter(1)
    mma_wait0 = wgmma_waiter(0)
    mma_k_tile = _mma_k_tile(v)
    STORE_TMA = v.store == "tma"
    # clusters of 2 ("Clusters" below): on the GPU each CTA loads half the weight box into both CTAs,
    # and a stage is refilled once the consumers of both have released it; the simulator has no
    # peer, so there a CTA loads both halves itself and waits for its own consumers only
    MC = v.cluster == 2 and not WS.SIMULATOR
    EMPTY_COUNT = THREADS if WS.SIMULATOR else (THREADS // 32) * v.cluster     # as the "mbar" loop's

    _fill = _tma_filler(v, FULL0)

    @device_function(**INLINE)
    def _prologue(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0):
        """Barriers (re)initialised, then k tiles kb .. kb+STAGES-2 (those before ke) into stages
        0 .. STAGES-2. The stages it fills hold nothing a thread still reads: in gemm_v4's grid
        nothing came before; on persistent CTAs the last unit's k loop ended on a CTA barrier and
        its epilogue's tile lies past stage STAGES-2."""
        n = ke - kb
        o = s0 - base
        if cuda.threadIdx.x == 0:
            if STORE_TMA:                                   # the last unit's boxes may share stage 0
                bulk_wait_read0()
            for s in range(STAGES):
                mbar_init(smem, o + FULL0 + 8 * s, 1)
                mbar_init(smem, o + EMPTY0 + 8 * s, EMPTY_COUNT)
            if MC:
                fence_mbarrier_init_cluster()
        if MC:                                              # the peer's barriers exist before it fills ours
            cluster_sync()
        else:
            cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            fence_proxy_async()                             # generic accesses before, TMA writes after
            for s in range(STAGES - 1):
                if s < n:
                    _fill(smem, o, s, tmx, tmw, m0, n0, kb + s)

    @device_function(**INLINE)
    def _k_loop(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        """After `_prologue` of the same unit: this warpgroup's accumulators over k tiles kb .. ke-1;
        returns once every MMA has retired and all threads have passed a barrier."""
        n = ke - kb
        o = s0 - base
        producer = cuda.threadIdx.x == 0
        lane0 = WS.SIMULATOR or cuda.laneid == 0
        # stage STAGES-1 may still hold a persistent CTA's previous epilogue tile, read by every thread
        # (or, with the "tma" epilogue, by thread 0's TMA stores: it waits for them to have read it)
        if STORE_TMA and producer:
            bulk_wait_read0()
        cuda.syncthreads()
        if producer:
            fence_proxy_async()
        d_hi = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        da = d_hi | wgmma_descriptor(s0 + a_wg, 0, 0, 0)
        db = d_hi | wgmma_descriptor(s0 + b_wg, 0, 0, 0) + D_A
        da_end = da + D_RING
        r_st = 0
        r_par = 0
        p_st = STAGES - 1
        p_par = 1
        acc = ZERO
        for j in range(n):
            while mbar_try_wait(smem, o + FULL0 + 8 * r_st, r_par) == 0:
                pass                                        # tile j's bytes have landed
            acc = mma_k_tile(wgmma_fence(acc), da, db, smem)
            wgmma_commit()
            da += D_STAGE
            db += D_STAGE
            if da == da_end:
                da -= D_RING
                db -= D_RING
            acc = mma_wait1(acc)                            # this warpgroup's MMAs of tile j-1 are done
            if j > 0 and lane0:
                mbar_arrive(smem, o + EMPTY0 + 8 * p_st)
                if MC:                                      # and the peer's: its next fill writes here too
                    mbar_arrive_remote(smem, o + EMPTY0 + 8 * p_st, cluster_ctarank() ^ np.uint32(1))
            nj = j + STAGES - 1
            if producer and nj < n:
                if j > 0:                                   # both warpgroups (of both CTAs) are done
                    while mbar_try_wait(smem, o + EMPTY0 + 8 * p_st, p_par) == 0:     # with tile j-1's stage
                        pass
                _fill(smem, o, p_st, tmx, tmw, m0, n0, kb + nj)
            p_st = r_st
            p_par = r_par
            r_st += 1
            if r_st == STAGES:
                r_st = 0
                r_par ^= 1
        acc = mma_wait0(acc)
        if MC:                                              # the peer's arrivals on our barriers are in too
            cluster_sync()
        else:
            cuda.syncthreads()                              # every MMA has read its last stage
        if producer:                                        # every barrier is idle: the next prologue inits
            for s in range(STAGES):
                mbar_inval(smem, o + FULL0 + 8 * s)
                mbar_inval(smem, o + EMPTY0 + 8 * s)
        return acc

    @device_function(**INLINE)
    def _k_tiles(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        _prologue(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0)
        return _k_loop(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg)

    return _prologue, _k_loop, _k_tiles


def _mma_k_tile(v: Variant):
    """mma(acc, da, db, smem) -> acc: a warpgroup's wgmma of one swizzled k tile (BK // 16 k16 steps, the
    descriptors of its A and B tiles in the stage); on a wide tile (`Variant.chains` 2: section "Wide
    tiles" below) each k16 step is two wgmma of wg_n / 2 columns on the halves of the accumulators."""
    D_KSTEP = np.uint64(32 >> 4)
    HALF_ACC = v.wg_n // 4
    WIDE = v.chains == 2
    mma_lo = wgmma_bf16_cols(0, HALF_ACC) if WIDE else wgmma_bf16
    mma_hi = wgmma_bf16_cols(HALF_ACC, HALF_ACC) if WIDE else wgmma_bf16
    D_B_HALF = np.uint64((v.wg_n // 2) * ROW_BYTES >> 4)   # the second chain's weight rows

    @device_function(**INLINE)
    def mma(acc, da, db, smem):
        for ks in range(BK // 16):
            if WIDE:
                acc = mma_lo(acc, da + np.uint64(ks) * D_KSTEP, db + np.uint64(ks) * D_KSTEP, smem)
                acc = mma_hi(acc, da + np.uint64(ks) * D_KSTEP, db + D_B_HALF + np.uint64(ks) * D_KSTEP, smem)
            else:
                acc = wgmma_bf16(acc, da + np.uint64(ks) * D_KSTEP, db + np.uint64(ks) * D_KSTEP, smem)
        return acc
    return mma


def _consumer_parts(v: Variant, FULL0: int):
    """The math warpgroups' side of a producer-warp k loop on tile v (FULL barriers at byte FULL0):
    (descriptors(s0, a_wg, b_wg) -> (da, db, da_end): the wgmma descriptors of stage 0 and the ring's
    end; step(smem, o, r_st, r_par, acc, da, db, da_end) -> (acc, da, db): wait FULL[r_st] (parity
    r_par), the k tile's 4 MMAs, commit, the descriptors moved to the next stage, and wgmma.wait_group 1,
    so this warpgroup's MMAs of the k tile before have retired)."""
    D_STAGE = np.uint64(v.stage_bytes >> 4)
    D_RING = np.uint64(v.stages * v.stage_bytes >> 4)
    D_A = np.uint64(v.bm * ROW_BYTES >> 4)
    mma_wait1 = wgmma_waiter(1)
    mma_k_tile = _mma_k_tile(v)

    @device_function(**INLINE)
    def descriptors(s0, a_wg, b_wg):
        d_hi = wgmma_descriptor(0, 16, GROUP_BYTES, WGMMA_SWIZZLE_128B)
        da = d_hi | wgmma_descriptor(s0 + a_wg, 0, 0, 0)
        db = d_hi | wgmma_descriptor(s0 + b_wg, 0, 0, 0) + D_A
        return da, db, da + D_RING

    @device_function(**INLINE)
    def step(smem, o, r_st, r_par, acc, da, db, da_end):
        while mbar_try_wait(smem, o + FULL0 + 8 * r_st, r_par) == 0:
            pass                                            # the k tile's bytes have landed
        acc = mma_k_tile(wgmma_fence(acc), da, db, smem)
        wgmma_commit()
        da += D_STAGE
        db += D_STAGE
        if da == da_end:
            da -= D_RING
            db -= D_RING
        return mma_wait1(acc), da, db
    return descriptors, step


def _producer_warp_loop(v: Variant, _fill):
    """The "tma" loop with a producer warp (`Variant.producer`; section "A producer warp" below):
    (prologue, k_loop, k_tiles) with `_tma_loop`'s contracts and `_fill`, for one unit a CTA (gemm_v4's grid).
    Thread 256 (lane 0 of warp 8) fills every stage: the first STAGES at once, then k tile kt once
    EMPTY[kt % S] has completed the phase of tile kt - S; threads 0..255 run the "tma" loop's consumer
    side unchanged (wait FULL, MMAs, release the previous stage). The producer warp returns zeros."""
    STAGES = v.stages
    FULL0 = v.mbar_at
    EMPTY0 = v.mbar_at + 8 * STAGES
    NACC = v.wg_n // 2
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    descriptors, step = _consumer_parts(v, FULL0)
    mma_wait0 = wgmma_waiter(0)
    MC = v.cluster == 2 and not WS.SIMULATOR
    EMPTY_COUNT = THREADS if WS.SIMULATOR else (THREADS // 32) * v.cluster     # the consumer warps (of both CTAs)
    PRODUCER = THREADS

    @device_function(**INLINE)
    def _prologue(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0):
        """The barriers initialised by the producer before anyone waits on them; no fills here."""
        o = s0 - base
        if cuda.threadIdx.x == PRODUCER:
            for s in range(STAGES):
                mbar_init(smem, o + FULL0 + 8 * s, 1)
                mbar_init(smem, o + EMPTY0 + 8 * s, EMPTY_COUNT)
            if MC:
                fence_mbarrier_init_cluster()
        if MC:
            cluster_sync()
        else:
            cuda.syncthreads()

    @device_function(**INLINE)
    def _k_loop(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        n = ke - kb
        o = s0 - base
        tid = cuda.threadIdx.x
        acc = ZERO
        if tid >= THREADS:
            if tid == PRODUCER:
                fence_proxy_async()
                st = 0
                par = 1                                     # the parity of tile kt - S's release
                for kt in range(n):
                    if kt >= STAGES:
                        while mbar_try_wait(smem, o + EMPTY0 + 8 * st, par) == 0:
                            pass
                    _fill(smem, o, st, tmx, tmw, m0, n0, kb + kt)
                    st += 1
                    if st == STAGES:
                        st = 0
                        par ^= 1
        else:
            lane0 = WS.SIMULATOR or cuda.laneid == 0
            da, db, da_end = descriptors(s0, a_wg, b_wg)
            r_st = 0
            r_par = 0
            p_st = 0
            for j in range(n):
                acc, da, db = step(smem, o, r_st, r_par, acc, da, db, da_end)   # tile j-1's MMAs retired
                if j > 0 and lane0:
                    mbar_arrive(smem, o + EMPTY0 + 8 * p_st)
                    if MC:                                  # and the peer's: its producer's next fill writes here
                        mbar_arrive_remote(smem, o + EMPTY0 + 8 * p_st, cluster_ctarank() ^ np.uint32(1))
                p_st = r_st
                r_st += 1
                if r_st == STAGES:
                    r_st = 0
                    r_par ^= 1
            acc = mma_wait0(acc)
        if MC:                                              # the peer's arrivals on our barriers are in too
            cluster_sync()
        else:
            cuda.syncthreads()                              # every MMA has read its last stage
        if tid == PRODUCER:
            for s in range(STAGES):
                mbar_inval(smem, o + FULL0 + 8 * s)
                mbar_inval(smem, o + EMPTY0 + 8 * s)
        return acc

    @device_function(**INLINE)
    def _k_tiles(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg):
        _prologue(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0)
        return _k_loop(smem, base, s0, tmx, tmw, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg)

    return _prologue, _k_loop, _k_tiles


_PARTS: dict = {}


def parts_for(v: Variant) -> Parts:
    """The device functions of specialisation v (made once per Variant name)."""
    if v.name not in _PARTS:
        _PARTS[v.name] = Parts(v)
    return _PARTS[v.name]


def make_kernel(v: Variant):
    """gemm_v4..v6's kernel: one CTA a (token tile, output tile), all of K."""
    BM, BN = v.bm, v.bn
    parts = parts_for(v)
    copy_slot, operand_offsets, k_tiles, store_tile = parts.copy_slot, parts.operand_offsets, parts.k_tiles, \
        parts.store_tile
    STORE_TMA = v.store == "tma"
    TAIL = v.tail > 0
    store_tail = parts.store_tail
    PW = v.producer
    assert not PW or STORE_TMA, "the producer-warp kernel stores by TMA"

    @cuda.jit(**bounds(v.threads, v.blocks_per_sm))
    def gemm_wgmma(x32, w32, out, T, K):
        # x32: uint32 [T*K/2] flat view of x; w32: uint32 [N*K/2] of wkv; out: uint16 [T, N]
        smem = cuda.shared.array(0, types.uint32)        # dynamic: STAGES x ([BM][64] x, [BN][64] w) bf16
        tid = cuda.threadIdx.x
        wg = tid >> 7
        N = out.shape[1]
        K8 = K >> 3
        n_k = (K8 + 7) >> 3
        # grid (token tiles, output tiles): CTAs start in token-tile-fastest order, so those in flight
        # share weight tiles in L2 (a 2-D grid also keeps 64-bit divisions out: ptxas makes them
        # calls, and any call in the kernel serializes its wgmma)
        m0 = cuda.blockIdx.x * BM
        n0 = cuda.blockIdx.y * BN
        # shared addresses as int64 (numba types uint64 op int64 as float64)
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad                                  # shared address of stage 0, 1024-aligned
        row0, q, off0 = copy_slot(tid)
        a_wg, b_wg = operand_offsets(wg)
        acc = k_tiles(smem, base, s0, x32, w32, m0, n0, T, N, K8, 0, n_k, row0, q, off0, a_wg, b_wg)
        if STORE_TMA:                                    # x32: the maps of x and the output (`tma_maps`)
            store_tile(smem, pad >> 2, x32, acc, m0, n0, T, N, tid, wg)
            if TAIL and (not PW or tid < THREADS):
                store_tail(out, acc, m0, n0, T, N, tid, wg)
            if tid == 0:
                bulk_wait_read0()                        # the boxes are read before the CTA's memory goes
        else:
            store_tile(smem, pad >> 2, out, acc, m0, n0, T, N, tid, wg)

    return gemm_wgmma


# ---- the specialisations and their launch ---------------------------------------------------------

VARIANTS = {
    "gemm_v4": Variant(128, 256, 4, swizzle=True),
    "gemm_v5": Variant(64, 128, 4, swizzle=True),
    # N = 25600 = 128 x 200: one wave of 128 CTAs at T <= 128, 2 (not 1.5) at T <= 256
    "gemm_v6": Variant(128, 200, 4, swizzle=True),
}
# what the development script times besides the records' own (tile, stages, layout)
CANDIDATES = {
    "128x256/s4/noswz": Variant(128, 256, 4, swizzle=False),
    "64x256/s4/sw128": Variant(64, 256, 4, swizzle=True),
    "64x64/s3/sw128": Variant(64, 64, 3, swizzle=True),
    "64x128/s6/sw128": Variant(64, 128, 6, swizzle=True),
    "128x128/s3/sw128": Variant(128, 128, 3, swizzle=True),
}
_KERNELS: dict = {}


def kernel_for(v: Variant):
    """The compiled-on-first-use kernel of a specialisation (one per Variant name)."""
    if v.name not in _KERNELS:
        _KERNELS[v.name] = make_kernel(v)
    return _KERNELS[v.name]


def grid_for(v: Variant, T: int, N: int) -> tuple:
    """(token tiles, output tiles); with clusters the token tiles rounded up to whole clusters (a CTA
    past T reads zeros, stores nothing, and loads its half of the weight box for its peer)."""
    return cdiv(cdiv(T, v.bm), v.cluster) * v.cluster, cdiv(N, v.bn)


def geometry(v: Variant):
    """(T, N) -> (grid, block, dynamic shared bytes) of specialisation v."""
    def geo(T: int, N: int):
        return grid_for(v, T, N), v.threads, v.smem_bytes
    return geo


def prepare_variant(name: str, v: Variant, x, wkv, out, *, stream=0) -> PreparedLaunch:
    """A launch of specialisation `v` (named `name`) on x [T, K], wkv [N, K] -> out [T, N]: for
    the development script's candidates, which have no record."""
    T, N = x.shape[0], wkv.shape[0]
    kernel = kernel_for(v)
    launch = fast_launch(name, kernel, grid_for(v, T, N), v.threads, x, wkv, out, stream)
    args = launch.args
    if v.loop == "tma":
        args = tma_maps(v, x, wkv, out, stream) + args[2:]
    allow_dynamic_shared(kernel, args, v.smem_bytes)
    if v.cluster > 1:
        return ClusterLaunch(name, kernel, launch.grid, launch.block, stream, args, out, sharedmem=v.smem_bytes,
                             cluster=(v.cluster, 1, 1))
    return PreparedLaunch(name, kernel, launch.grid, launch.block, stream, args, out, sharedmem=v.smem_bytes)


def tma_maps(v: Variant, x, wkv, out, stream=0, out_rows: int | None = None) -> tuple:
    """The "tma" loop's two kernel arguments in place of x32 and w32: the device tensor maps of x
    [T, K] (boxes of BM rows x 64 k) and wkv [N, K] (BN x 64), 128-byte swizzled. Each map holds
    its array's address, so a launch made with them keeps the maps (and through them the arrays)
    alive: `PreparedLaunch.args` holds the maps' device arrays, each of which holds its map."""
    from ...device.tma import SWIZZLE_128B, pack_maps, tensor_map_2d
    mx = tensor_map_2d(x, v.bm, BK, SWIZZLE_128B, stream)
    mw = tensor_map_2d(wkv, v.bn // v.cluster // v.w_loads, BK, SWIZZLE_128B, stream)   # a cluster's CTA loads
    # 1 / cluster of the weight box; a wide tile's box is two loads
    if v.store == "tma":       # the output's map (boxes of out_rows or BM rows x 64 columns) at byte 128 of x's
        return pack_maps(mx, tensor_map_2d(out, out_rows or v.bm, 64, SWIZZLE_128B, stream), stream=stream), mw.device
    return mx.device, mw.device


# ---- gemm_v8: gemm_v4's CTA tile on persistent CTAs, the ragged tail stream-K -------------------
#
# What changes against gemm_v4: the grid. gemm_v4 launches one CTA a tile, so N = 25600 (100 output
# tiles) runs T = 256 as 200 tiles on 132 SMs (1.52 waves of work in 2 waves of time), T = 512 as
# 3.03 waves in 4 and T = 1024 as 6.06 in 7. gemm_v8 launches one CTA an SM; each walks a host-made
# list of units (a tile and a range of its k tiles, `cuda_wgmma_ws.schedule`, shared with gemm_v7):
# whole waves of tiles data-parallel, and the last `sk_waves` full waves with the ragged one cut into
# equal ranges of k tiles, one a CTA (stream-K), so every SM gets the same number of k tiles to
# within one. CTAs walk in bands (`banded_schedule`): h CTAs run one unit list, each on its own token
# tile, so the CTAs reading a weight k tile read it together, as gemm_v4's neighbouring CTAs do.
# Each unit runs gemm_v4's device functions unchanged (`parts_for`: prologue, pipelined
# k loop over the unit's k range, drain); a tile cut between CTAs is finished by the CTA that holds
# its last k tiles: the others store their fp32 accumulators to a workspace slot (coalesced: thread
# c's accumulator i at slot * 256 * NACC + 256 i + c), `threadfence`, barrier, and raise the slot's
# flag; the finisher's thread 0 waits for the flags (lower CTAs only: the schedule's order, which
# cannot deadlock), fences, and after a barrier every thread adds the partials to its own
# accumulators in a fixed order (the nearest k range first), then the usual bf16 epilogue. The
# finisher clears the flags it consumed, so a prepared launch can be replayed. The one change inside
# a CTA (`overlap`, on in the record): the next unit's prologue is issued as soon as a unit's MMAs
# have retired, before its fix-up and epilogue, whose bf16 tile moves past the first STAGES-1
# stages to make room (211 KiB of shared memory with gemm_v4's tile); gemm_v4 pays the pipeline
# fill on every tile, gemm_v8 only on a CTA's first unit.
# Numerics: inside a k range as gemm_v4; a cut tile adds its ranges' fp32 sums in the fixed order,
# so results are the same bits run to run for one (T, N, K, CTA count), not bit-identical to
# gemm_v4 (docs/numerics.md).
# The split is chosen per launch on the host (`choose_split`) from T, N, K and the SM count.

# cost guess of moving one 128 x 256 fp32 partial through L2, in k tiles (~0.8 us each on an H200
# SM); 0 in the simulator, whose cases have a few k tiles and should be cut wherever it balances
SK_FIXUP_K_TILES = 0 if WS.SIMULATOR else 3


class SkVariant:
    """gemm_v8's specialisation: a CTA tile (a `Variant` with 128 token rows), its split over
    persistent CTAs: "auto" (`choose_split` per shape), "dp" (data-parallel only: tiles dealt
    round-robin, nothing cut) or "sk1" / "sk2" (the last 1 / 2 full waves and the ragged one
    stream-K), whether the next unit's copies start before a unit's epilogue (`overlap`) and
    whether CTAs walk in bands (`banded_schedule`; `banded=False`: bands of one token tile)."""

    def __init__(self, tile: Variant, split: str = "auto", overlap: bool = True, banded: bool = True):
        assert tile.bm == 128 and split in ("auto", "dp", "sk1", "sk2") and tile.cluster == 1 and not tile.producer, \
            (tile.name, split)
        self.tile, self.split, self.overlap, self.banded = tile, split, overlap, banded
        self.bn = tile.bn
        self.group_m = 0              # token tiles fastest (the schedule's tile order)
        self.smem_bytes = sk_smem_bytes(tile, overlap)
        self.name = f"sk/{tile.bm}x{tile.bn}/{split}" + ("" if overlap else "/nolap") + ("" if banded else "/noband") \
            + ("" if tile.loop == "v4" else f"/{tile.loop}") + ("" if tile.store == "v4" else "/tmastore")

    def plan(self, T: int, N: int, K: int, ctas: int) -> "_Split":
        split = choose_split(T, N, K, self.bn, ctas) if self.split == "auto" else self.split
        return _Split(self.bn, split)


class _Split:
    """What `cuda_wgmma_ws.schedule` reads of a variant: bn, group_m, stream_k (and sk_waves)."""

    def __init__(self, bn: int, split: str):
        self.bn, self.group_m, self.split = bn, 0, split
        self.stream_k = split != "dp"
        self.sk_waves = {"dp": 0, "sk1": 1, "sk2": 2}[split]


def choose_split(T: int, N: int, K: int, bn: int, ctas: int) -> str:
    """"dp" or "sk1" for a launch of cdiv(T, 128) x cdiv(N, bn) tiles of cdiv(K, 64) k tiles on `ctas`
    persistent CTAs, from a cost model in k tiles a CTA: data-parallel takes ceil(tiles / ctas)
    tiles; stream-K takes the mean plus SK_FIXUP_K_TILES for each partial a finisher adds and its
    own store (a tile is cut into about n_k / (k tiles a CTA) pieces). A whole number of waves is
    never cut."""
    n_tiles, n_k = cdiv(T, 128) * cdiv(N, bn), cdiv(K, BK)
    full, rem = divmod(n_tiles, ctas)
    if rem == 0:
        return "dp"
    dp_cost = (full + 1) * n_k
    sk_tiles = rem + min(full, 1) * ctas
    per_cta = sk_tiles * n_k / ctas
    pieces = cdiv(n_k, max(1, int(per_cta)))
    sk_cost = max(full - 1, 0) * n_k + per_cta + SK_FIXUP_K_TILES * (pieces if per_cta < n_k else 2)
    return "sk1" if sk_cost < dp_cost else "dp"


def sk_smem_bytes(v: Variant, overlap: bool) -> int:
    """Dynamic shared memory of gemm_v8's kernel on tile v: gemm_v4's, or with `overlap` the
    epilogue's bf16 tile placed after the first STAGES-1 stages (where the next unit's prologue
    lands meanwhile)."""
    if not overlap:
        return v.smem_bytes
    b = max(v.stages * v.stage_bytes, (v.stages - 1) * v.stage_bytes + v.stash_bytes) + ALIGN_SLACK
    b = max(b, v.smem_bytes)                         # "mbar": its mbarriers past both
    assert b <= 227 * 1024, b
    return b


def make_persistent_kernel(v: Variant, overlap: bool):
    """gemm_v8's kernel on CTA tile v: persistent CTAs over a unit list (see above). With `overlap`,
    the next unit's first STAGES-1 k tiles are issued (cp.async) as soon as a unit's MMAs are done,
    before its fix-up and epilogue, so their latency hides behind them; the epilogue's bf16 tile
    then sits after stage STAGES-2 (`sk_smem_bytes`)."""
    assert v.bm == 128 and not v.producer, v.name
    NACC = v.wg_n // 2
    SLOT_WORDS = THREADS * NACC
    OVERLAP = overlap
    STASH_WORD = (v.stages - 1) * v.stage_bytes // 4 if overlap else 0
    parts = parts_for(v)
    copy_slot, operand_offsets, store_tile = parts.copy_slot, parts.operand_offsets, parts.store_tile
    prologue, k_loop, k_tiles = parts.prologue, parts.k_loop, parts.k_tiles
    STORE_TMA = v.store == "tma"
    TAIL = v.tail > 0
    store_tail = parts.store_tail

    @cuda.jit(**bounds(THREADS, 1))
    def gemm_wgmma_sk(x32, w32, out, units, counts, ws, flags, T, K):
        # x32 uint32 [T*K/2], w32 uint32 [N*K/2], out uint16 [T, N]; units int32 [G, U, 8] and
        # counts int32 [G] (`cuda_wgmma_ws.schedule`); ws fp32 [slots * 256 * NACC], flags int32 [slots]
        smem = cuda.shared.array(0, types.uint32)        # dynamic: STAGES x ([128][64] x, [BN][64] w) bf16
        tid = cuda.threadIdx.x
        wg = tid >> 7
        cta = cuda.blockIdx.x
        N = out.shape[1]
        K8 = K >> 3
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        row0, q, off0 = copy_slot(tid)
        a_wg, b_wg = operand_offsets(wg)
        n_units = counts[cta]
        if OVERLAP and n_units > 0:
            prologue(smem, base, s0, x32, w32, np.int64(units[cta, 0, F_M0]), np.int64(units[cta, 0, F_N0]), T, N,
                     K8, np.int64(units[cta, 0, F_KB]), np.int64(units[cta, 0, F_KE]), row0, q, off0)
        for u in range(n_units):
            m0 = np.int64(units[cta, u, F_M0])
            n0 = np.int64(units[cta, u, F_N0])
            kb = np.int64(units[cta, u, F_KB])
            ke = np.int64(units[cta, u, F_KE])
            if OVERLAP:
                acc = k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg)
                if u + 1 < n_units:                      # the next unit's first stages, in flight from now
                    prologue(smem, base, s0, x32, w32, np.int64(units[cta, u + 1, F_M0]),
                             np.int64(units[cta, u + 1, F_N0]), T, N, K8, np.int64(units[cta, u + 1, F_KB]),
                             np.int64(units[cta, u + 1, F_KE]), row0, q, off0)
            else:
                acc = k_tiles(smem, base, s0, x32, w32, m0, n0, T, N, K8, kb, ke, row0, q, off0, a_wg, b_wg)
            role = units[cta, u, F_ROLE]
            if role == PARTIAL:
                slot = np.int64(units[cta, u, F_SLOT])
                acc_store_f32(ws, slot * SLOT_WORDS + tid, THREADS, acc)
                cuda.threadfence()
                cuda.syncthreads()                       # every thread's partial is out
                if tid == 0:
                    cuda.atomic.exch(flags, slot, np.int32(1))
            else:
                if role == FINISH:
                    lo = units[cta, u, F_LO]
                    hi = units[cta, u, F_HI]
                    if tid == 0:
                        for s in range(lo, hi):
                            flag_wait(flags, s)
                        cuda.threadfence()
                    cuda.syncthreads()
                    for s in range(hi - 1, lo - 1, -1):  # the nearest k range first: a fixed order
                        acc = acc_add_f32(acc, ws, np.int64(s) * SLOT_WORDS + tid, THREADS)
                    cuda.syncthreads()
                    if tid == 0:                         # every partial is read: ready for the next launch
                        for s in range(lo, hi):
                            cuda.atomic.exch(flags, s, np.int32(0))
                if STORE_TMA:                            # x32: the maps of x and the output (`tma_maps`)
                    store_tile(smem, (pad >> 2) + STASH_WORD, x32, acc, m0, n0, T, N, tid, wg)
                    if TAIL:
                        store_tail(out, acc, m0, n0, T, N, tid, wg)
                else:
                    store_tile(smem, (pad >> 2) + STASH_WORD, out, acc, m0, n0, T, N, tid, wg)
                if not OVERLAP:
                    cuda.syncthreads()                   # the stash is read before the next unit's copies
                # (overlapped: the next unit's copies into the stash's stage come after its first barrier)
        if STORE_TMA and tid == 0:
            bulk_wait_read0()                            # the last boxes are read before the CTA's memory goes

    return gemm_wgmma_sk


SK_VARIANTS = {"gemm_v8": SkVariant(VARIANTS["gemm_v4"])}   # gemm_v4's tile, split chosen per shape
# the development script's split and tile choices beside the record's "auto"
SK_CANDIDATES = {v.name: v for v in (
    SkVariant(VARIANTS["gemm_v4"], "auto", overlap=False),     # each unit's prologue after the last epilogue
    SkVariant(VARIANTS["gemm_v4"], "auto", banded=False),      # plain stream-K ranges, no bands
    SkVariant(VARIANTS["gemm_v4"], "dp"),
    SkVariant(VARIANTS["gemm_v4"], "sk1"),
    SkVariant(VARIANTS["gemm_v4"], "sk2"),
    SkVariant(VARIANTS["gemm_v6"], "auto"),     # gemm_v6's 128 x 200 tile: 128 output tiles at N = 25600
)}

# ---- gemm_v9: gemm_v8 on a leaner k loop ------------------------------------------------------------
#
# What changes against gemm_v8: the k loop only (`_lean_loop`, picked by `Variant.loop`); the
# persistent CTAs, schedule, fix-up and epilogue are gemm_v8's. gemm_v4's loop (212 SASS instructions
# a warp a k tile: `tools/sass_count_bf16.py`) rebuilds the 4 x 2 wgmma descriptors from the stage's
# shared address before each wgmma (mask, shift, or, moves into uniform registers: ~45 instructions),
# keeps the stage ring as j % STAGES on a signed 64-bit j, and meets two CTA-wide barriers:
#   "lean"   gemm_v4's schedule (copies of tile j+STAGES-1 after the second barrier), with each
#            operand's descriptor made once a unit and stepped by constants (the stage's bytes >> 4,
#            32 >> 4 a k16 step: the 14-bit address field never carries, shared memory ends below
#            2^18 bytes), and the stage ring kept as running offsets (a compare, no division):
#            189 instructions on gemm_v4's grid, 228 on persistent CTAs (gemm_v8: 246);
#   "lean1"  lean with one barrier a k tile: the barrier before tile j's MMAs also proves that both
#            warpgroups have passed their wgmma.wait_group 1 of iteration j-1 (tile j-2's MMAs are
#            retired), so the copies issued right after it go into tile j-2's stage: tile
#            j+STAGES-2, so STAGES-2 tiles of copies are in flight (gemm_v4: STAGES-1) in exchange
#            for the second barrier; 186 instructions on gemm_v4's grid, 299 on persistent CTAs
#            (ptxas, at 253 registers there, recomputes the copies' row clamps every k tile);
#   "mbar"   lean with no CTA-wide barrier in the k loop: per-stage mbarriers (`_mbar_loop`), FULL
#            (each thread's cp.async.mbarrier.arrive.noinc) in place of cp.async.wait_group and the
#            first barrier, EMPTY (lane 0 of each warp after its wgmma.wait_group 1) in place of the
#            second, so a warpgroup waits only for the copies of the stage it reads and a producer only
#            for the MMAs of the stage it refills; STAGES-1 tiles in flight as gemm_v4; 221
#            instructions on gemm_v4's grid (the spin loops included), 341 on persistent CTAs.
# Both keep gemm_v4's k order and wgmma chain, so within a unit the accumulators are gemm_v4's bits:
# gemm_v9 returns gemm_v8's bits on the same schedule, and gemm_v4's where nothing is cut.
# (A fifth stage, which would give lean1 gemm_v4's depth, does not fit: 5 x 48 KiB > 227 KiB.)

V9_TILES = {loop: Variant(128, 256, 4, swizzle=True, loop=loop) for loop in ("lean", "lean1", "mbar")}
V9_VARIANTS = {"gemm_v9": SkVariant(V9_TILES["lean"])}
# what the development script times beside the record: lean1 and mbar on persistent CTAs, and the three
# loops on gemm_v4's grid (one tile a CTA: gemm_v4's bits everywhere, where T = 4096 is decided)
V9_CANDIDATES = {**{sv.name: sv for sv in (SkVariant(V9_TILES["lean1"]), SkVariant(V9_TILES["mbar"]))},
                 **{t.name: t for t in V9_TILES.values()}}

# ---- TMA: the stages filled by the tensor memory accelerator ----------------------------------------
#
# "tma" (`_tma_loop`): gemm_v4's tile, stages, layout and wgmma chain; what changes is who fills a
# stage. gemm_v4's k tile costs each of its 256 threads 12 cp.async with their 64-bit addresses,
# row clamps and zero-fill predicates (~100 of its 212 SASS instructions a warp a k tile); here thread
# 0 issues one `mbarrier.arrive.expect_tx` and two TMA box copies (x: 128 rows x 64 k, w: 256 x 64,
# both written in the 128-byte swizzle the descriptors read; rows past T and N and k past K arrive as
# zeros), and the stages are handed over on the "mbar" loop's FULL / EMPTY mbarriers, so there is no
# CTA-wide barrier in the k loop either. The tensor maps are made on the host per launch
# (`tma_maps`, `device/tma.py`). Same k order and chain on the same bytes: gemm_v4's bits on its
# grid, gemm_v8's on a persistent schedule.
#
# The "tma" epilogue (`_store_tile_tma`) stores the bf16 tile by TMA too: each thread writes its pairs
# into 128-byte-swizzled boxes of 64 columns (conflict-free: a quarter-warp's 8 rows land on 8
# different 16-byte chunks), and thread 0 stores the 4 boxes with 4 instructions, rows past T and
# columns past N clipped by the tensor map. gemm_v4's epilogue is 128 16-bit stores a thread with
# their index arithmetic and bounds, in series with the next tile's fill. A TMA store needs output
# rows of a multiple of 16 bytes (N % 8 == 0) and a 16-byte-aligned output: otherwise the launchers
# fall back to gemm_v4's epilogue (`TMA_FALLBACK`). Same accumulators, same rounding: the same bits.
TMA_TILE = Variant(128, 256, 4, swizzle=True, loop="tma")
TMA_STORE_TILE = Variant(128, 256, 4, swizzle=True, loop="tma", store="tma")
TMA_VARIANTS = {"gemm_v10": TMA_STORE_TILE,                  # gemm_v4's grid
                "gemm_v11": SkVariant(TMA_STORE_TILE)}       # gemm_v8's persistent CTAs and schedule
TMA_FALLBACK = {"gemm_v10": TMA_TILE, "gemm_v11": SkVariant(TMA_TILE)}   # their epilogue where N % 8 != 0
# what `tools/prefill_dev.py --tma` times beside gemm_v4 / gemm_v8 / gemm_v9 and cuBLAS: the records, their
# fallbacks, and persistent CTAs without stream-K ("dp": gemm_v4's bits)
# 128 x 240 tiles: N = 25600 in 107 output tiles, so T = 4096 is 3424 tiles, 25.9 waves of 132 CTAs, where 128 x 256
# tiles are 3200 = 24.2 waves in 25 (`_store_tail` stores the 48 columns past the three 64-column boxes)
TMA_STORE_240 = Variant(128, 240, 4, swizzle=True, loop="tma", store="tma")
# ---- Clusters: two CTAs share each stage's weight box -----------------------------------------------
#
# On gemm_v10's grid the CTAs of token tiles 2c and 2c+1 (the same output tile, next to each other in the
# grid) run as one thread-block cluster (`Variant(cluster=2)`, launched by `device.launch.ClusterLaunch`:
# numba-cuda's own launch has no cluster dimension). Each stage's weight box (256 rows x 64 k) is loaded
# once for both: CTA r loads rows 128 r .. 128 r + 127 with one TMA multicast into the same stage of both
# CTAs (`hopper.tma_load_2d_multicast`, mask 0b11), besides its own x box, so L2 serves 16 + 16 KiB a CTA
# and k tile instead of 16 + 32. The hand-over is the "tma" loop's with three changes: a CTA's FULL[s]
# expects the whole stage (its x box, its half, the peer's half, whose bytes the peer's copy reports
# here); EMPTY[s] counts the consumer warps of both CTAs (each warp's lane 0 arrives on its own EMPTY and,
# through `mapa`, on the peer's), because a refill writes into both CTAs; arrive and wait keep mbarrier's
# default semantics (release / acquire at CTA scope, as CUTLASS's cluster barriers do): at cluster scope
# each became a cluster-wide memory fence, and the MEMBAR stalls made the pair 1.44x slower than
# gemm_v10 (Nsight Compute: "Stall Membar" 44% of the stall cycles; docs/gpu.md). The barriers are made visible to the peer
# (`fence.mbarrier_init`) and both CTAs pass a cluster barrier before the first fill, and again after the
# last MMA (the peer's last arrivals on our barriers are in before they are invalidated). A token-tile
# count that is odd gets one more CTA, wholly past T: it reads zeros, stores nothing, and loads its half
# of the weight box for its peer. Same boxes, same wgmma chain: gemm_v10's bits. The simulator has no
# clusters: there each CTA loads both halves itself and waits for its own consumers only, so it checks
# the k loop and the bits, and the gpu tier (tests/test_tma.py) checks the multicast against gemm_v10.
TMA_CLUSTER_TILE = Variant(128, 256, 4, swizzle=True, loop="tma", store="tma", cluster=2)
# ---- A producer warp ------------------------------------------------------------------------------
#
# In the "tma" loop the thread that refills a stage is thread 0 of math warpgroup 0: it waits on EMPTY
# (both warpgroups, and with clusters both CTAs, done with the stage) between its warpgroup's MMAs, so a
# late warpgroup holds up the other, and in a cluster the pair runs in lockstep. `Variant(producer=True)`
# adds a ninth warp (288 threads; a wgmma warpgroup must start at a warp index divisible by 4, so the
# math warpgroups stay threads 0..255) whose lane 0 does all the filling (`_producer_warp_loop`): the
# first STAGES k tiles at once (one more in flight than thread 0 could issue ahead), then each refill
# as soon as EMPTY says the stage is free. The math warpgroups only wait on FULL and arrive on EMPTY.
# 288 threads leave 224 registers a thread (the math threads use ~161); numba's linked compile ignores
# setmaxnreg (`cuda_wgmma_ws`), so the producer warp gets as many as the rest. Same boxes, same wgmma
# chain: gemm_v10's bits. gemm_v4's grid only (one tile a CTA); with `cluster=2` on top, the waits
# for the peer's consumers are the producer warp's alone.
TMA_PW_TILE = Variant(128, 256, 4, swizzle=True, loop="tma", store="tma", producer=True)
TMA_PW_CLUSTER_TILE = Variant(128, 256, 4, swizzle=True, loop="tma", store="tma", cluster=2, producer=True)
TMA_PW3_TILE = Variant(128, 256, 3, swizzle=True, loop="tma", store="tma", producer=True)   # the queue's: 4 boxes a round

# ---- Wide tiles: 128 x 320 -------------------------------------------------------------------------
#
# L2 traffic is what the T = 4096 GEMM has left to cut (cuBLAS moves 9.6 GB through L2 to gemm_v10's
# 13.2; docs/gpu.md). A CTA tile of 128 token rows x bn outputs reads (128 + bn) rows of 128 bytes
# a k tile for 128 bn outputs: 3 / 256 of a row an output at bn = 256, 2.8 / 256 at bn = 320 (6.7%
# less), and a 128 x 320 tile divides the released N = 25600 exactly (80 output tiles; 2560 tiles at
# T = 4096 instead of 3200, so a fifth fewer epilogues and pipeline fills). Each math warpgroup then
# holds 64 x 320 fp32 accumulators, 160 a thread, which no single wgmma takes (n is at most 256): each
# k16 step issues two wgmma of m64n160k16 on the two halves of one 160-accumulator tuple
# (`hopper.wgmma_bf16_cols`, `_mma_k_tile`), the second with its weight descriptor 160 rows on; in the
# accumulator layout the halves are columns 0..159 and 160..319 of one m64n320 tile, so the epilogue's
# storers need no change. A TMA box has at most 256 rows: the weight box is two loads of 160 rows
# (`Variant.w_loads`). A stage is 56 KiB, so the ring has 3 stages (168 KiB); the "tma" epilogue stages
# the 80 KiB bf16 tile past 2 of them. 256 threads (the "tma" loop's thread 0 fills): a producer warp
# would put 3 warps on one SM sub-partition, whose 16384 registers leave 168 a thread, and ptxas then
# spills (2.2 KB a thread) and serialises the wgmma. Same k order, same 16-term products into each
# accumulator: gemm_v4's bits. On gemm_v4's grid and on the unit queue (`QVariant(TMA_WIDE_TILE, 1)`, and
# with the ring streamed by thread 0, below). Measured (docs/gpu.md): its k loop is the fastest of ours
# (the step from K = 3072 to 6144 at T = 4096: 800 us against cuBLAS's 803), but each tile pays more
# outside it, and it ends 1-3% behind gemm_v12 at T = 3072 and 4096, level with gemm_v11 at 1024-2048.
TMA_WIDE_TILE = Variant(128, 320, 3, swizzle=True, loop="tma", store="tma")
TMA_CANDIDATES = {v.name: v for v in (TMA_STORE_TILE, TMA_VARIANTS["gemm_v11"], TMA_TILE, TMA_FALLBACK["gemm_v11"],
                                      SkVariant(TMA_STORE_TILE, "dp"), TMA_STORE_240, TMA_CLUSTER_TILE,
                                      TMA_PW_TILE, TMA_PW_CLUSTER_TILE, TMA_WIDE_TILE)}


def tma_store_ok(out) -> bool:
    """Whether the "tma" epilogue can write `out` [T, N]: rows of a multiple of 16 bytes, 16-byte aligned."""
    return out.shape[1] % 8 == 0 and data_address(out) % 16 == 0
_SK_KERNELS: dict = {}
_SCHEDULES: dict = {}


def sk_kernel_for(v: Variant, overlap: bool = True):
    """The persistent kernel of CTA tile v (one per tile and overlap: the split is host-side data)."""
    if (v.name, overlap) not in _SK_KERNELS:
        _SK_KERNELS[v.name, overlap] = make_persistent_kernel(v, overlap)
    return _SK_KERNELS[v.name, overlap]


MAX_BAND = 8              # token tiles a band of CTAs walks in lockstep (gemm_v8's schedule)


def band_height(T: int, ctas: int, max_band: int = MAX_BAND) -> int:
    """Token tiles in a band: the largest h <= max_band dividing both the token tiles and the CTAs."""
    mt = cdiv(T, 128)
    return max(h for h in range(1, max_band + 1) if mt % h == 0 and ctas % h == 0)


def banded_schedule(T: int, N: int, K: int, plan, ctas: int, min_k_tiles: int, max_band: int = MAX_BAND):
    """`cuda_wgmma_ws.schedule` over bands of h = band_height(T, ctas) token tiles: (units, counts,
    slots) as that function's.

    The schedule is made for a problem of cdiv(T, 128) / h token tiles on ctas / h CTAs, then each
    CTA's unit list is given to h CTAs, the j-th taking token tile j of the band: they read the same
    weight k tiles at the same time, as gemm_v4's neighbouring CTAs do, so a weight tile comes from
    DRAM once however the stream-K ranges fall (ranges of CTAs on different token tiles of one
    output tile drift apart by tens of k tiles, and the weight read between is several times the
    L2). Slot s of the band schedule is slot j * S + s for its j-th CTA (S its slot count), so a
    finisher's slots stay a contiguous range, and CTA c of it is CTAs c * h + j: a finisher still
    waits only for lower CTAs."""
    h = band_height(T, ctas, max_band)
    bands = cdiv(T, 128) // h
    table, counts, slots = WS.schedule(bands * 128, N, K, plan, ctas // h, min_k_tiles=min_k_tiles,
                                       sk_waves=max(plan.sk_waves, 1))
    if h == 1:
        return table, counts, slots
    G, U, F = table.shape
    out = np.zeros((G * h, U, F), dtype=np.int32)
    for j in range(h):
        t = table.copy()
        t[:, :, F_M0] = t[:, :, F_M0] * h + 128 * j
        t[:, :, F_SLOT] = np.where(t[:, :, F_ROLE] == PARTIAL, t[:, :, F_SLOT] + j * slots, 0)
        cut = t[:, :, F_ROLE] == FINISH
        t[:, :, F_LO] = np.where(cut, t[:, :, F_LO] + j * slots, t[:, :, F_LO])
        t[:, :, F_HI] = np.where(cut, t[:, :, F_HI] + j * slots, t[:, :, F_HI])
        out[j::h] = t
    return out, np.repeat(counts, h), slots * h


def sk_schedule(T: int, N: int, K: int, sv: SkVariant, ctas: int):
    """(units, counts, slots, split) of gemm_v8 variant sv on `ctas` CTAs (cached: pure host data)."""
    key = (T, N, K, sv.name, ctas)
    if key not in _SCHEDULES:
        plan = sv.plan(T, N, K, ctas)
        table, counts, slots = banded_schedule(T, N, K, plan, ctas, WS.MIN_UNIT_K_TILES,
                                               MAX_BAND if sv.banded else 1)
        if len(_SCHEDULES) > 256:
            _SCHEDULES.clear()
        _SCHEDULES[key] = (table, counts, slots, plan.split)
    return _SCHEDULES[key]


def sk_geometry(sv: SkVariant):
    """(T, N) -> (grid, block, dynamic shared bytes) at K = 6144 on this device (the launcher builds
    the real grid from the schedule)."""
    def geo(T: int, N: int, K: int = 6144):
        table = sk_schedule(T, N, K, sv, WS.device_ctas())[0]
        return table.shape[0], THREADS, sv.smem_bytes
    return geo


def prepare_sk(name: str, sv: SkVariant, x, wkv, out, *, stream=0, ctas: int | None = None) -> PreparedLaunch:
    """A launch of gemm_v8 variant sv on x [T, K], wkv [N, K] -> out [T, N] (the record's launcher
    and the development script's). `ctas`: persistent CTAs to schedule for (default: the SMs; in
    the simulator cuda_wgmma_ws.SIM_CTAS)."""
    T, K = x.shape
    N = wkv.shape[0]
    if data_address(x) % 16 or data_address(wkv) % 16:
        raise ValueError(f"{name} reads x and wkv as 16-byte chunks; their data must be 16-byte aligned "
                         "(use a naive version or an aligned copy)")
    table, counts, n_slots, _ = sk_schedule(T, N, K, sv, ctas or WS.device_ctas())
    d_units = cuda.to_device(table, stream=stream)
    d_counts = cuda.to_device(counts, stream=stream)
    ws = cuda.device_array(max(n_slots, 1) * THREADS * (sv.tile.wg_n // 2), dtype=np.float32, stream=stream)
    flags = cuda.to_device(np.zeros(max(n_slots, 1), dtype=np.int32), stream=stream)
    kernel = sk_kernel_for(sv.tile, sv.overlap)
    xa, wa = tma_maps(sv.tile, x, wkv, out, stream) if sv.tile.loop == "tma" else (flat_u32(x), flat_u32(wkv))
    args = (xa, wa, out, d_units, d_counts, ws, flags, T, K)
    allow_dynamic_shared(kernel, args, sv.smem_bytes)
    return PreparedLaunch(name, kernel, table.shape[0], THREADS, stream, args, out, sharedmem=sv.smem_bytes)


def sk_launcher(rec, x, wkv, out, *, stream=0) -> PreparedLaunch:
    """gemm_v8's, gemm_v9's and gemm_v11's record launcher (`prepare_project(..., version=...)` has checked the
    shapes); gemm_v11 takes gemm_v4's epilogue where the TMA one cannot write `out` (`tma_store_ok`)."""
    if rec.name in TMA_VARIANTS and not tma_store_ok(out):
        return prepare_sk(rec.name, TMA_FALLBACK[rec.name], x, wkv, out, stream=stream)
    return prepare_sk(rec.name, {**SK_VARIANTS, **V9_VARIANTS, **TMA_VARIANTS}[rec.name], x, wkv, out, stream=stream)


def grid_launcher(rec, x, wkv, out, *, stream=0) -> PreparedLaunch:
    """gemm_v10's record launcher: gemm_v4's grid on the TMA loop and epilogue (its tensor maps made here),
    gemm_v4's epilogue where the TMA one cannot write `out` (`tma_store_ok`)."""
    v = TMA_VARIANTS[rec.name] if tma_store_ok(out) else TMA_FALLBACK[rec.name]
    return prepare_variant(rec.name, v, x, wkv, out, stream=stream)


# ---- A unit queue: persistent CTAs that take their units at run time (candidates, no record) -------
#
# gemm_v11's static unit lists leave T = 4096 slower than gemm_v10's grid when nothing is cut (persistent
# "dp" 1671.8 us against the grid's 1638.3, bench/results/h200_prefill_dev_tma_t80_4096_5ad1c6a.txt): a
# grid's CTAs go to whichever SM frees first, so SMs that run slower take fewer tiles, while a static
# list gives every CTA the same count and the launch ends with the slowest. The queue kernel keeps the
# persistent CTAs (the next unit's prologue in flight during a unit's fix-up and epilogue) and deals
# the units at run time: one list in queue order, each CTA's thread 0 takes the next index with an
# atomic add when it starts a unit (one unit ahead, so that unit's stages can be filled early). The
# list is the tiles whole, token tiles fastest (the grid's order), except the last `tail` tiles, each
# cut into `pieces` equal k ranges: their PARTIAL units, then their FINISH units (each a tile's last
# range), so the launch ends on units of 1 / pieces of a tile instead of whole tiles. A finisher waits
# only for units earlier in the queue, which CTAs already hold: no deadlock whatever the order CTAs take
# them in (the lowest-indexed unit not done always runs). The last CTA to leave resets the counters, so a
# prepared launch can be replayed. Numerics: a cut tile adds its pieces in a fixed order (the nearest k
# range first) whichever CTAs ran them: the same bits run to run for one (T, N, K, pieces, tail);
# whole tiles are gemm_v4's bits.

class QVariant:
    """The queue kernel's specialisation: a CTA tile (a "tma"-loop `Variant` of 128 token rows), the pieces
    a tail tile is cut into (1: nothing cut) and how many tail tiles (None: one a CTA)."""

    def __init__(self, tile: Variant, pieces: int = 4, tail: int | None = None, wg_epilogue: bool = False,
                 stream: bool = False, group_m: int = 0):
        assert tile.bm == 128 and tile.loop == "tma" and pieces >= 1 and tile.cluster == 1, tile.name
        # wg_epilogue (producer-warp tiles): each math warpgroup stores its own 64 rows, on its own barrier
        assert not wg_epilogue or tile.producer, tile.name
        self.wg_epilogue = wg_epilogue
        # stream: thread 0 streams the stage ring across units (`make_queue_stream_kernel`; whole tiles, TMA
        # epilogue, no producer warp)
        assert not stream or (not tile.producer and pieces == 1 and tile.store == "tma" and tile.bn % 64 == 0), \
            tile.name
        self.stream = stream
        # group_m: the queue's tile order (`cuda_wgmma_ws.tile_order`): 0, token tiles fastest (the grid's
        # order: a wave of CTAs reads all of x and a few weight panels); g > 0, bands of g token tiles, each
        # band sweeping every output tile (a wave reads g token tiles of x and ~132 / g weight panels)
        self.group_m = int(group_m)
        # a producer-warp tile: whole tiles only, stored by TMA 128 columns at a time (`make_queue_pw_kernel`)
        assert not tile.producer or (pieces == 1 and tile.store == "tma" and tile.bn % 64 == 0), tile.name
        self.tile, self.pieces, self.tail = tile, int(pieces), tail
        self.bn = tile.bn
        self.smem_bytes = pw_queue_layout(tile)["smem_bytes"] if tile.producer or stream else sk_smem_bytes(tile, True)
        self.name = f"q/{tile.bm}x{tile.bn}/p{pieces}" + ("" if tail is None else f"t{tail}") \
            + ("" if tile.store == "v4" else "/tmastore") + ("/pw" if tile.producer else "") \
            + ("" if tile.stages == 4 else f"/s{tile.stages}") + ("/wgepi" if wg_epilogue else "") \
            + ("/stream" if stream else "") + (f"/g{group_m}" if group_m else "")


def queue_schedule(T: int, N: int, K: int, qv: QVariant, ctas: int):
    """(queue int32 [U, 8], partial slots) of queue variant qv: units with cuda_wgmma_ws.schedule's
    fields (m0, n0, kb, ke, role, slot, lo, hi), in the order CTAs take them. A tile is cut only if
    each piece keeps at least MIN_UNIT_K_TILES k tiles (the simulator: 1)."""
    mt, nt, n_k = cdiv(T, 128), cdiv(N, qv.bn), cdiv(K, BK)
    order = WS.tile_order(mt, nt, qv.group_m)
    n_tiles = len(order)
    pieces = max(1, min(qv.pieces, n_k // WS.MIN_UNIT_K_TILES))
    tail = 0 if pieces == 1 else min(n_tiles, ctas if qv.tail is None else qv.tail)
    units, finishers, n_slots = [], [], 0
    cut = [n_k * i // pieces for i in range(pieces + 1)]
    for t in range(n_tiles):
        m0, n0 = int(order[t][0]) * 128, int(order[t][1]) * qv.bn
        if t < n_tiles - tail:
            units.append([m0, n0, 0, n_k, WS.WHOLE, 0, 0, 0])
            continue
        lo = n_slots
        for i in range(pieces - 1):
            units.append([m0, n0, cut[i], cut[i + 1], PARTIAL, n_slots, 0, 0])
            n_slots += 1
        finishers.append([m0, n0, cut[-2], n_k, FINISH, 0, lo, n_slots])
    # every finisher after every partial: a CTA takes a finisher about pieces - 1 rounds of pieces after
    # that tile's partials were taken, so it seldom waits for them (next to them, it could wait up to a
    # unit for a partial whose CTA was still busy)
    return np.array(units + finishers, dtype=np.int32).reshape(-1, 8), n_slots


def check_queue(queue, n_slots, T: int, N: int, K: int, bn: int) -> None:
    """Raise AssertionError unless the queue computes every (tile, k tile) once, each slot is written
    once by a PARTIAL of the tile that adds it, and every finisher comes after the partials it adds."""
    mt, nt, n_k = cdiv(T, 128), cdiv(N, bn), cdiv(K, BK)
    seen = np.zeros((mt, nt, n_k), dtype=np.int64)
    writer = {}
    for i, u in enumerate(queue):
        m, n = u[F_M0] // 128, u[F_N0] // bn
        seen[m, n, u[F_KB]:u[F_KE]] += 1
        if u[F_ROLE] == PARTIAL:
            assert u[F_SLOT] not in writer, "a slot written twice"
            writer[int(u[F_SLOT])] = (i, m, n)
        elif u[F_ROLE] == FINISH:
            assert u[F_KE] == n_k and u[F_HI] > u[F_LO], "a finisher without the tile's last k tiles"
            for s in range(u[F_LO], u[F_HI]):
                wi, wm, wn = writer[s]
                assert wi < i and (wm, wn) == (m, n), "a finisher before its partials, or of another tile"
    assert (seen == 1).all(), "k tiles computed other than once"
    assert len(writer) == n_slots


@device_function(**INLINE)
def _count_out(ctrs):
    """A queue kernel's CTA, done (one thread): every CTA has taken its last unit index once all have
    counted themselves out on ctrs[1], so the last to count resets both counters, and a prepared launch
    can be replayed."""
    if cuda.atomic.add(ctrs, 1, 1) == cuda.gridDim.x - 1:
        cuda.atomic.exch(ctrs, 0, np.int32(0))
        cuda.atomic.exch(ctrs, 1, np.int32(0))


def make_queue_kernel(v: Variant):
    """The queue kernel on CTA tile v (a "tma"-loop tile): persistent CTAs over a unit queue (above)."""
    assert v.bm == 128 and v.loop == "tma" and not v.producer, v.name
    NACC = v.wg_n // 2
    SLOT_WORDS = THREADS * NACC
    STASH_WORD = (v.stages - 1) * v.stage_bytes // 4
    parts = parts_for(v)
    copy_slot, operand_offsets, store_tile = parts.copy_slot, parts.operand_offsets, parts.store_tile
    prologue, k_loop = parts.prologue, parts.k_loop
    STORE_TMA = v.store == "tma"
    TAIL = v.tail > 0
    store_tail = parts.store_tail

    @cuda.jit(**bounds(THREADS, 1))
    def gemm_wgmma_q(x32, w32, out, queue, ctrs, ws, flags, T, K):
        # x32 / w32: the tensor maps (`tma_maps`), out uint16 [T, N]; queue int32 [U, 8] (`queue_schedule`);
        # ctrs int32 [2]: the next unit, the CTAs done (both 0 between launches); ws fp32
        # [slots * 256 * NACC], flags int32 [slots]
        smem = cuda.shared.array(0, types.uint32)        # dynamic: STAGES x ([128][64] x, [BN][64] w) bf16
        took = cuda.shared.array(2, types.int32)         # the unit thread 0 took, by parity
        tid = cuda.threadIdx.x
        wg = tid >> 7
        N = out.shape[1]
        K8 = K >> 3
        n_units = queue.shape[0]
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        row0, q, off0 = copy_slot(tid)
        a_wg, b_wg = operand_offsets(wg)
        if tid == 0:
            took[0] = cuda.atomic.add(ctrs, 0, 1)
        cuda.syncthreads()
        u = took[0]
        par = 0
        if u < n_units:
            prologue(smem, base, s0, x32, w32, np.int64(queue[u, F_M0]), np.int64(queue[u, F_N0]), T, N, K8,
                     np.int64(queue[u, F_KB]), np.int64(queue[u, F_KE]), row0, q, off0)
        while u < n_units:
            par ^= 1
            if tid == 0:                                 # the next unit, read by all after the k loop's barriers
                took[par] = cuda.atomic.add(ctrs, 0, 1)
            m0 = np.int64(queue[u, F_M0])
            n0 = np.int64(queue[u, F_N0])
            acc = k_loop(smem, base, s0, x32, w32, m0, n0, T, N, K8, np.int64(queue[u, F_KB]),
                         np.int64(queue[u, F_KE]), row0, q, off0, a_wg, b_wg)
            nu = took[par]
            if nu < n_units:                             # its first stages in flight during this epilogue
                prologue(smem, base, s0, x32, w32, np.int64(queue[nu, F_M0]), np.int64(queue[nu, F_N0]), T, N,
                         K8, np.int64(queue[nu, F_KB]), np.int64(queue[nu, F_KE]), row0, q, off0)
            role = queue[u, F_ROLE]
            if role == PARTIAL:
                slot = np.int64(queue[u, F_SLOT])
                acc_store_f32(ws, slot * SLOT_WORDS + tid, THREADS, acc)
                cuda.threadfence()
                cuda.syncthreads()                       # every thread's partial is out
                if tid == 0:
                    cuda.atomic.exch(flags, slot, np.int32(1))
            else:
                if role == FINISH:
                    lo = queue[u, F_LO]
                    hi = queue[u, F_HI]
                    if tid == 0:
                        for s in range(lo, hi):
                            flag_wait(flags, s)
                        cuda.threadfence()
                    cuda.syncthreads()
                    for s in range(hi - 1, lo - 1, -1):  # the nearest k range first: a fixed order
                        acc = acc_add_f32(acc, ws, np.int64(s) * SLOT_WORDS + tid, THREADS)
                    cuda.syncthreads()
                    if tid == 0:                         # every partial is read: ready for the next launch
                        for s in range(lo, hi):
                            cuda.atomic.exch(flags, s, np.int32(0))
                if STORE_TMA:                            # x32: the maps of x and the output (`tma_maps`)
                    store_tile(smem, (pad >> 2) + STASH_WORD, x32, acc, m0, n0, T, N, tid, wg)
                    if TAIL:
                        store_tail(out, acc, m0, n0, T, N, tid, wg)
                else:
                    store_tile(smem, (pad >> 2) + STASH_WORD, out, acc, m0, n0, T, N, tid, wg)
            u = nu
        if tid == 0:
            if STORE_TMA:
                bulk_wait_read0()                        # the last boxes are read before the CTA's memory goes
            _count_out(ctrs)                        # the last CTA out resets the counters

    return gemm_wgmma_q


_Q_KERNELS: dict = {}
_QUEUES: dict = {}


def queue_kernel_for(v: Variant, wg_epilogue: bool = False, stream: bool = False):
    key = (v.name, wg_epilogue, stream)
    if key not in _Q_KERNELS:
        _Q_KERNELS[key] = make_queue_pw_kernel(v, wg_epilogue) if v.producer else \
            make_queue_stream_kernel(v) if stream else make_queue_kernel(v)
    return _Q_KERNELS[key]


def cached_queue(T: int, N: int, K: int, qv: QVariant, ctas: int):
    key = (T, N, K, qv.name, ctas)
    if key not in _QUEUES:
        if len(_QUEUES) > 256:
            _QUEUES.clear()
        _QUEUES[key] = queue_schedule(T, N, K, qv, ctas)
    return _QUEUES[key]


def prepare_queue(name: str, qv: QVariant, x, wkv, out, *, stream=0, ctas: int | None = None) -> PreparedLaunch:
    """A launch of queue variant qv on x [T, K], wkv [N, K] -> out [T, N] on `ctas` persistent CTAs
    (default: the SMs; in the simulator cuda_wgmma_ws.SIM_CTAS)."""
    T, K = x.shape
    N = wkv.shape[0]
    if data_address(x) % 16 or data_address(wkv) % 16:
        raise ValueError(f"{name} reads x and wkv by TMA; their data must be 16-byte aligned "
                         "(use a naive version or an aligned copy)")
    ctas = ctas or WS.device_ctas()
    queue, n_slots = cached_queue(T, N, K, qv, ctas)
    d_queue = cuda.to_device(queue, stream=stream)
    ctrs = cuda.to_device(np.zeros(2, dtype=np.int32), stream=stream)
    ws = cuda.device_array(n_slots * THREADS * (qv.tile.wg_n // 2) if n_slots else 1, dtype=np.float32,
                           stream=stream)                # the partials' workspace (nothing cut: unused)
    flags = cuda.to_device(np.zeros(max(n_slots, 1), dtype=np.int32), stream=stream)
    kernel = queue_kernel_for(qv.tile, qv.wg_epilogue, qv.stream)
    xa, wa = tma_maps(qv.tile, x, wkv, out, stream, out_rows=64 if qv.wg_epilogue else None)
    args = (xa, wa, out, d_queue, ctrs, ws, flags, T, K)
    allow_dynamic_shared(kernel, args, qv.smem_bytes)
    return PreparedLaunch(name, kernel, min(ctas, len(queue)), qv.tile.threads, stream, args, out,
                          sharedmem=qv.smem_bytes)


# ---- The unit queue with a producer warp (a candidate, no record) --------------------------------------
#
# The queue kernel's CTAs still stop their tensor cores between units: thread 0 of a math warpgroup
# fills the next unit's first stages, then the fix-up and epilogue run, then the barriers are made
# anew and the next unit's MMAs start. `make_queue_pw_kernel` (`QVariant` of a `producer=True` tile,
# whole tiles only) makes the stage ring one stream across a CTA's units: the producer warp's lane 0
# takes the next unit from the queue, hands its index to the math warpgroups through a two-slot ring
# in shared memory (UNIT_FULL / UNIT_EMPTY mbarriers), and fills that unit's k tiles into the ring as
# stages free up, so the next unit's first stages land while the math warpgroups store the last one.
# FULL / EMPTY are made once a launch; the ring position (stage, parity) carries from unit to unit.
# The epilogue cannot use ring stages the producer is filling, so it has its own buffer past the ring,
# of as many of the tile's 64-column TMA boxes as fit: with 4 stages (192 KiB) two of the four, stored
# in two rounds (thread 0 waits for the first round's stores to have read the buffer before anyone
# writes the second), 225.1 KiB of the 227 a CTA may have; with 3 stages all four in one round. The
# math warpgroups meet on a named barrier, not the CTA barrier, which the producer warp does not reach.
# Same boxes and wgmma chain on whole tiles: gemm_v4's bits.


def pw_queue_layout(v: Variant) -> dict:
    """Byte offsets from the ring's start of the producer-warp queue kernel on tile v, and the boxes its
    epilogue buffer holds (`epi_boxes`: the most of the tile's that fit; the epilogue stores the tile in
    rounds of that many, the last round the rest)."""
    ring = v.stages * v.stage_bytes
    epi = ring                                   # 1024-aligned: stages are multiples of 1 KiB
    n_boxes = v.bn // 64
    box_bytes = v.bm * 128
    fixed = 32 * v.stages + 8 * 4 + 8 + ALIGN_SLACK        # FULL, EMPTY, UNIT_FULL, UNIT_EMPTY, the slots
    epi_boxes = max(b for b in range(1, n_boxes + 1) if ring + b * box_bytes + fixed <= 227 * 1024)
    full0 = epi + epi_boxes * box_bytes
    empty0 = full0 + 8 * v.stages
    ufull0 = empty0 + 8 * v.stages
    uempty0 = ufull0 + 16
    units0 = uempty0 + 16
    smem = units0 + 8 + ALIGN_SLACK
    assert smem <= 227 * 1024, (v.name, smem)
    return {"epi": epi, "full0": full0, "empty0": empty0, "ufull0": ufull0, "uempty0": uempty0, "units0": units0,
            "smem_bytes": smem, "epi_boxes": epi_boxes}


def _epilogue_rounds(v: Variant, EPI_BOXES: int, BOX_WORDS: int, BAR_THREADS: int):
    """The queue kernels' epilogue through a buffer of EPI_BOXES 64-column boxes (of BOX_WORDS words each):
    store(smem, word, epi_byte, tmaps, acc, m0, n0, tid, g, bar, issuer) stores the tile's v.bn // 64 boxes
    in rounds of EPI_BOXES (the last round the rest), each round: thread `issuer` waits until the last
    stores have read the buffer, the threads meet on named barrier `bar` (BAR_THREADS of them), write their
    pairs of the round's boxes (from word `word`), fence them for the async proxy, meet again, and
    `issuer` stores the boxes by TMA (rows from m0, columns from n0) and commits them."""
    N_BOXES = v.bn // 64
    ROUNDS = -(-N_BOXES // EPI_BOXES)
    CHUNKS = 8 * EPI_BOXES                       # accumulator pairs j (8 columns each) a round stores

    def round_storer(r):
        storer = sw128_storer(CHUNKS * (r + 1), CHUNKS * r)
        COL0 = 64 * EPI_BOXES * r
        BOXES = min(EPI_BOXES, N_BOXES - EPI_BOXES * r)     # the last round: the boxes left

        @device_function(**INLINE)
        def store_round(smem, word, epi_byte, tmaps, acc, m0, n0, tid, g, bar, issuer):
            """Round r of the epilogue: pairs CHUNKS r .. CHUNKS (r+1) - 1 into the buffer (from byte
            epi_byte), then TMA stores of the rows from m0 by thread `issuer`, barrier `bar` between."""
            if tid == issuer:
                bulk_wait_read0()                # the last stores from the buffer have read it
            named_barrier_sync(bar, BAR_THREADS)
            storer(smem, word, g, BOX_WORDS, acc)
            fence_proxy_async()
            named_barrier_sync(bar, BAR_THREADS)
            if tid == issuer:
                for b in range(BOXES):
                    tma_store_2d(smem, epi_byte + b * BOX_WORDS * 4, tmaps, 128, np.int32(n0 + COL0 + 64 * b),
                                 np.int32(m0))
                bulk_commit()
        return store_round

    def rounds_storer(r):
        """Rounds r .. ROUNDS - 1 of the epilogue, one after the other."""
        this = round_storer(r)
        if r == ROUNDS - 1:
            return this
        rest = rounds_storer(r + 1)

        @device_function(**INLINE)
        def store_rounds(smem, word, epi_byte, tmaps, acc, m0, n0, tid, g, bar, issuer):
            this(smem, word, epi_byte, tmaps, acc, m0, n0, tid, g, bar, issuer)
            rest(smem, word, epi_byte, tmaps, acc, m0, n0, tid, g, bar, issuer)
        return store_rounds
    return rounds_storer(0)


def make_queue_pw_kernel(v: Variant, wg_epilogue: bool = False):
    """The unit queue on a producer-warp tile (above): persistent CTAs of 288 threads over whole tiles.
    wg_epilogue: each math warpgroup stores its own 64 rows (boxes of 64 rows x 64 columns, half the
    buffer each, its thread 0 issuing the stores, named barrier 1 + wg of its 128 threads), so the
    warpgroup that finishes first starts the next unit's MMAs while the other still stores; the output
    map then has 64-row boxes (`prepare_queue`)."""
    assert v.bm == 128 and v.loop == "tma" and v.producer and v.store == "tma" and v.bn % 64 == 0, v.name
    L = pw_queue_layout(v)
    EPI_BOXES = L["epi_boxes"]
    EPI, FULL0, EMPTY0, UFULL0, UEMPTY0, UNITS0 = (L[k] for k in ("epi", "full0", "empty0", "ufull0", "uempty0",
                                                                  "units0"))
    STAGES = v.stages
    NACC = v.wg_n // 2
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    descriptors, step = _consumer_parts(v, FULL0)
    mma_wait0 = wgmma_waiter(0)
    WARP_COUNT = THREADS if WS.SIMULATOR else THREADS // 32     # arrivals that release a stage or a slot
    PRODUCER = THREADS
    WGE = wg_epilogue
    BOX_WORDS = (v.bm // 2 if WGE else v.bm) * 32
    BAR_THREADS = 128 if WGE else THREADS       # the threads that meet on an epilogue barrier
    fill = _tma_filler(v, FULL0)
    parts = parts_for(v)
    operand_offsets = parts.operand_offsets

    store_tile = _epilogue_rounds(v, EPI_BOXES, BOX_WORDS, BAR_THREADS)

    @cuda.jit(**bounds(v.threads, 1))
    def gemm_wgmma_qpw(x32, w32, out, queue, ctrs, ws, flags, T, K):
        # the queue kernel's arguments (ws and flags unused: nothing is cut)
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        n_units = queue.shape[0]
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        o = pad
        if tid == PRODUCER:
            for s in range(STAGES):
                mbar_init(smem, o + FULL0 + 8 * s, 1)
                mbar_init(smem, o + EMPTY0 + 8 * s, WARP_COUNT)
            for s in range(2):
                mbar_init(smem, o + UFULL0 + 8 * s, 1)
                mbar_init(smem, o + UEMPTY0 + 8 * s, WARP_COUNT)
        cuda.syncthreads()
        if tid >= THREADS:
            if tid == PRODUCER:
                fence_proxy_async()
                st = 0
                par = 1                          # the parity of the release of the fill STAGES before
                filled = 0
                i = 0
                while True:
                    u = cuda.atomic.add(ctrs, 0, 1)
                    slot = i & 1
                    if i >= 2:                   # the math warpgroups have read unit i-2's index
                        while mbar_try_wait(smem, o + UEMPTY0 + 8 * slot, ((i >> 1) - 1) & 1) == 0:
                            pass
                    smem[(o + UNITS0) // 4 + slot] = np.uint32(u)
                    mbar_arrive(smem, o + UFULL0 + 8 * slot)
                    if u >= n_units:
                        break
                    m0 = np.int64(queue[u, F_M0])
                    n0 = np.int64(queue[u, F_N0])
                    for kt in range(queue[u, F_KB], queue[u, F_KE]):
                        if filled >= STAGES:
                            while mbar_try_wait(smem, o + EMPTY0 + 8 * st, par) == 0:
                                pass
                        fill(smem, o, st, x32, w32, m0, n0, kt)
                        filled += 1
                        st += 1
                        if st == STAGES:
                            st = 0
                            par ^= 1
                    i += 1
                _count_out(ctrs)                        # the last CTA out resets the counters
        else:
            wg = tid >> 7
            p = tid & 127
            lane = p & 31
            g = lane >> 2
            lane0 = WS.SIMULATOR or cuda.laneid == 0
            if WGE:                              # this warpgroup's half of the buffer, its rows, its barrier
                epi_byte = o + EPI + wg * (EPI_BOXES * BOX_WORDS * 4)
                word = epi_byte // 4 + (16 * (p >> 5) + g) * 32 + (lane & 3)
                bar = 1 + wg
                issuer = wg * 128
                row0 = 64 * wg
            else:
                epi_byte = o + EPI
                word = epi_byte // 4 + (16 * (p >> 5) + g + 64 * wg) * 32 + (lane & 3)
                bar = 1
                issuer = 0
                row0 = 0
            a_wg, b_wg = operand_offsets(wg)
            da, db, da_end = descriptors(s0, a_wg, b_wg)
            r_st = 0
            r_par = 0
            p_st = 0
            i = 0
            while True:
                slot = i & 1
                while mbar_try_wait(smem, o + UFULL0 + 8 * slot, (i >> 1) & 1) == 0:
                    pass
                u = np.int32(smem[(o + UNITS0) // 4 + slot])
                if lane0:
                    mbar_arrive(smem, o + UEMPTY0 + 8 * slot)
                if u >= n_units:
                    break
                m0 = np.int64(queue[u, F_M0])
                n0 = np.int64(queue[u, F_N0])
                acc = ZERO
                for j in range(queue[u, F_KE] - queue[u, F_KB]):
                    acc, da, db = step(smem, o, r_st, r_par, acc, da, db, da_end)   # tile j-1's MMAs retired
                    if j > 0 and lane0:
                        mbar_arrive(smem, o + EMPTY0 + 8 * p_st)
                    p_st = r_st
                    r_st += 1
                    if r_st == STAGES:
                        r_st = 0
                        r_par ^= 1
                acc = mma_wait0(acc)
                if lane0:                        # the unit's last stage: the producer runs on into the next
                    mbar_arrive(smem, o + EMPTY0 + 8 * p_st)
                store_tile(smem, word, epi_byte, x32, acc, m0 + row0, n0, tid, g, bar, issuer)
                i += 1
            if tid == issuer:
                bulk_wait_read0()                # the last boxes are read before the CTA's memory goes

    return gemm_wgmma_qpw


# ---- The unit queue streamed by thread 0 (a candidate, no record) ----------------------------------------
#
# `make_queue_pw_kernel`'s continuous stage ring without the producer warp, for tiles whose accumulators
# leave no registers for a ninth warp (the 128 x 320 tile: section "Wide tiles"). Thread 0 fills, as in the
# "tma" loop, between its warpgroup's MMAs: after k tile j's MMAs (and the wait that retires tile j-1's)
# it waits EMPTY for the stage of tile j-1 and refills it with the next k tile of the stream, which runs on
# from unit to unit: when the unit being filled has no k tile left, thread 0 takes the next unit from the
# queue (never more than one unit ahead of the one computed) and writes its index to a two-slot ring in
# shared memory (slot i & 1 for the CTA's i-th unit), which the other threads read after the epilogue's
# barriers. After a unit's last MMAs thread 0 fills the stage they released, so all STAGES stages of the
# next unit are in flight while the epilogue stores this one through its own buffer (`pw_queue_layout`:
# for 128 x 320, 3 stages and 3 of the 5 boxes, two rounds). FULL / EMPTY are made once a launch. Same
# boxes and wgmma chain on whole tiles: gemm_v4's bits.


def make_queue_stream_kernel(v: Variant):
    """The unit queue on tile v with the stage ring streamed across units by thread 0 (above): persistent
    CTAs of 256 threads over whole tiles; the queue kernel's arguments (ws and flags unused)."""
    assert v.bm == 128 and v.loop == "tma" and not v.producer and v.store == "tma" and v.bn % 64 == 0, v.name
    L = pw_queue_layout(v)
    EPI_BOXES = L["epi_boxes"]
    EPI, FULL0, EMPTY0, UNITS0 = (L[k] for k in ("epi", "full0", "empty0", "units0"))
    STAGES = v.stages
    NACC = v.wg_n // 2
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    descriptors, step = _consumer_parts(v, FULL0)
    mma_wait0 = wgmma_waiter(0)
    WARP_COUNT = THREADS if WS.SIMULATOR else THREADS // 32     # arrivals that release a stage
    BOX_WORDS = v.bm * 32
    fill = _tma_filler(v, FULL0)
    operand_offsets = parts_for(v).operand_offsets
    store_tile = _epilogue_rounds(v, EPI_BOXES, BOX_WORDS, THREADS)

    @device_function(**INLINE)
    def feed(smem, o, x32, w32, queue, ctrs, n_units, cu_i, fu, fi, fk, fke, f_st, f_par, filled):
        """Thread 0: the stream's next k tile into the next stage of the ring (once EMPTY says the tile
        STAGES before has been read), taking the next unit from the queue when the one being filled (fu,
        the CTA's fi-th) has none left, at most one unit ahead of the one computed (the cu_i-th). Returns
        the stream's state (fu, fi, fk, fke, f_st, f_par, filled)."""
        if fk >= fke and fi <= cu_i and fu < n_units:
            fu = cuda.atomic.add(ctrs, 0, 1)
            fi += 1
            smem[(o + UNITS0) // 4 + (fi & 1)] = np.uint32(fu)
            if fu < n_units:
                fk = np.int64(queue[fu, F_KB])
                fke = np.int64(queue[fu, F_KE])
        if fk < fke:
            if filled >= STAGES:
                while mbar_try_wait(smem, o + EMPTY0 + 8 * f_st, f_par) == 0:
                    pass
            fill(smem, o, f_st, x32, w32, np.int64(queue[fu, F_M0]), np.int64(queue[fu, F_N0]), fk)
            fk += 1
            filled += 1
            f_st += 1
            if f_st == STAGES:
                f_st = 0
                f_par ^= 1
        return fu, fi, fk, fke, f_st, f_par, filled

    @cuda.jit(**bounds(THREADS, 1))
    def gemm_wgmma_qs(x32, w32, out, queue, ctrs, ws, flags, T, K):
        smem = cuda.shared.array(0, types.uint32)
        tid = cuda.threadIdx.x
        n_units = queue.shape[0]
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        o = pad
        wg = tid >> 7
        p = tid & 127
        lane = p & 31
        g = lane >> 2
        lane0 = WS.SIMULATOR or cuda.laneid == 0
        # the fill stream (thread 0's): the unit being filled, its index in the CTA, its next and end k tile,
        # the next stage, its parity, the fills so far
        fu = np.int32(0)
        fi = -1
        fk = np.int64(0)
        fke = np.int64(0)
        f_st = 0
        f_par = 1
        filled = 0
        if tid == 0:
            for s in range(STAGES):
                mbar_init(smem, o + FULL0 + 8 * s, 1)
                mbar_init(smem, o + EMPTY0 + 8 * s, WARP_COUNT)
        cuda.syncthreads()
        if tid == 0:
            fence_proxy_async()
            for _ in range(STAGES):              # the first STAGES k tiles of the stream
                fu, fi, fk, fke, f_st, f_par, filled = feed(smem, o, x32, w32, queue, ctrs, n_units, 0, fu, fi,
                                                            fk, fke, f_st, f_par, filled)
        cuda.syncthreads()                       # unit 0's index is in slot 0
        epi_byte = o + EPI
        word = epi_byte // 4 + (16 * (p >> 5) + g + 64 * wg) * 32 + (lane & 3)
        a_wg, b_wg = operand_offsets(wg)
        da, db, da_end = descriptors(s0, a_wg, b_wg)
        r_st = 0
        r_par = 0
        p_st = 0
        i = 0
        while True:
            u = np.int32(smem[(o + UNITS0) // 4 + (i & 1)])
            if u >= n_units:
                break
            m0 = np.int64(queue[u, F_M0])
            n0 = np.int64(queue[u, F_N0])
            acc = ZERO
            for j in range(queue[u, F_KE] - queue[u, F_KB]):
                acc, da, db = step(smem, o, r_st, r_par, acc, da, db, da_end)   # tile j-1's MMAs retired
                if j > 0:
                    if lane0:
                        mbar_arrive(smem, o + EMPTY0 + 8 * p_st)
                    if tid == 0:                 # tile j-1's stage, refilled once both warpgroups are done
                        fu, fi, fk, fke, f_st, f_par, filled = feed(smem, o, x32, w32, queue, ctrs, n_units, i, fu,
                                                                    fi, fk, fke, f_st, f_par, filled)
                p_st = r_st
                r_st += 1
                if r_st == STAGES:
                    r_st = 0
                    r_par ^= 1
            acc = mma_wait0(acc)
            if lane0:                            # the unit's last stage
                mbar_arrive(smem, o + EMPTY0 + 8 * p_st)
            if tid == 0:                         # refilled with the next unit's: all its stages in flight now
                # (this feed takes the next unit if no earlier one did: its index is in its slot before the
                # epilogue's barriers, and its first k tile filled, so no thread waits for a tile never filled)
                fu, fi, fk, fke, f_st, f_par, filled = feed(smem, o, x32, w32, queue, ctrs, n_units, i, fu, fi,
                                                            fk, fke, f_st, f_par, filled)
            store_tile(smem, word, epi_byte, x32, acc, m0, n0, tid, g, 1, 0)
            i += 1
        if tid == 0:
            bulk_wait_read0()                    # the last boxes are read before the CTA's memory goes
            _count_out(ctrs)                        # the last CTA out resets the counters

    return gemm_wgmma_qs


# what `tools/prefill_dev.py --tma` times: the queue with nothing cut (the grid's balance on persistent
# CTAs), the last wave's worth of tiles cut in 2, 4 or 8, and two waves' worth cut in 4
Q_CANDIDATES = {v.name: v for v in (QVariant(TMA_STORE_TILE, 1), QVariant(TMA_STORE_TILE, 2),
                                      QVariant(TMA_STORE_TILE, 4), QVariant(TMA_STORE_TILE, 8),
                                      QVariant(TMA_STORE_TILE, 4, 264), QVariant(TMA_PW_TILE, 1),
                                      QVariant(TMA_PW3_TILE, 1), QVariant(TMA_PW_TILE, 1, wg_epilogue=True),
                                      QVariant(TMA_WIDE_TILE, 1), QVariant(TMA_WIDE_TILE, 1, stream=True),
                                      QVariant(TMA_STORE_TILE, 1, stream=True), QVariant(TMA_PW_TILE, 1, group_m=8),
                                      QVariant(TMA_PW_TILE, 1, group_m=12), QVariant(TMA_PW_TILE, 1, group_m=16),
                                      QVariant(TMA_PW_TILE, 1, group_m=24))}
# gemm_v12: the producer-warp queue on gemm_v4's tile, whole tiles, the epilogue in two rounds; from 2b31e6e
# its tiles in bands of 12 token tiles (`QVariant.group_m`; 1612.5-1614.9 us against 1632.5-1633.2 token
# tiles fastest and cuBLAS's 1615.4-1616.9 at T = 4096, bench/results/h200_prefill_dev_bands_2b31e6e.txt;
# the same bits: whole tiles, only their order changes)
QUEUE_VARIANTS = {"gemm_v12": QVariant(TMA_PW_TILE, 1, group_m=12)}


def queue_launcher(rec, x, wkv, out, *, stream=0) -> PreparedLaunch:
    """gemm_v12's record launcher (`prepare_project(..., version=...)` has checked the shapes): the
    producer-warp queue; where its TMA epilogue cannot write `out` (`tma_store_ok`), gemm_v10's fallback
    (the "tma" loop on gemm_v4's grid with gemm_v4's epilogue)."""
    if not tma_store_ok(out):
        return prepare_variant(rec.name, TMA_FALLBACK["gemm_v10"], x, wkv, out, stream=stream)
    return prepare_queue(rec.name, QUEUE_VARIANTS[rec.name], x, wkv, out, stream=stream)


def queue_geometry(qv: QVariant):
    """(T, N) -> (grid, block, dynamic shared bytes) of queue variant qv on this device."""
    def geo(T: int, N: int, K: int = 6144):
        return min(WS.device_ctas(), cdiv(T, 128) * cdiv(N, qv.bn)), qv.tile.threads, qv.smem_bytes
    return geo
