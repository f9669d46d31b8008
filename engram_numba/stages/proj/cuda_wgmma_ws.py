"""A warp-specialised, persistent Hopper GEMM for the projection (gemm_v7): kv = bf16(x @ wkv^T).

Shapes and argument conventions as in `cuda_common`; the shared-memory layout and the wgmma
chain are gemm_v4's (`cuda_wgmma`): 128 x BN tiles, BK = 64, operands K-major in the
128-byte-swizzled layout, two MMA warpgroups of 64 token rows each (m64nBNk16).

What changes against gemm_v4
  roles     320 threads: warpgroups 0 and 1 (threads 0-255; a wgmma warpgroup starts at a warp
            index divisible by 4) only multiply, and 2 loader warps after them only copy (cp.async,
            48 copies a thread a stage). They hand stages over on named barriers instead of
            block-wide barriers: FULL[s] (the loader arrives once stage s has landed, the MMA
            warpgroups sync) and EMPTY[s] (the MMA warpgroups arrive once their wgmma on stage s
            have retired, the loader syncs before refilling it). The MMA warpgroups never issue a
            copy or wait for each other. A loader warpgroup that hands registers to the MMA
            warpgroups (`setmaxnreg`) is a candidate (`loader_warps=4`), but numba links every
            kernel and ptxas ignores setmaxnreg in a linked compile (C7504), so 2 warps that need
            no register shuffle are the default.
  persistent  one CTA an SM (grid = SMs, or fewer when there is less work); each CTA walks a list
            of work units (a tile and a range of its k tiles) made on the host (`schedule`), and
            the loader runs ahead into the next unit while the MMA warpgroups store the last one.
  tile order  token tiles fastest (as gemm_v4: the CTAs in flight share weight tiles in L2), or in
            groups of `group_m` token tiles (`Variant.group_m`).
  stream-K  whole waves of tiles run data-parallel; the last full wave and the partial one are
            spread evenly over all CTAs by k iterations (stream-K), so no SM idles in a ragged last
            wave (T = 512: 400 tiles on 132 SMs are 3.03 waves of work, not 4). A tile cut between
            CTAs is finished by the CTA that holds its last k tiles: the others write their fp32
            partial sums to a workspace and raise a flag; the finisher adds them to its own
            accumulators in a fixed order (its own k range, then the partials from the nearest k
            range down) and stores bf16.
  epilogue  accumulators rounded to bf16 and stored from registers (no shared-memory staging:
            the stages stay the loader's while the next unit's tiles come in).

Numerics: fp32 accumulation in the tensor core, as gemm_v4; a tile finished across CTAs sums its
k ranges' fp32 partials in the fixed order above. The schedule depends only on (T, N, K, the
variant and the number of CTAs), so results are bit-reproducible from run to run on one GPU, but a
GPU with another SM count may round a few outputs differently (within the reordered kernels'
claim, docs/numerics.md).

The pipeline (S stages, the loader LAG = S - 2 stages ahead of its FULL signal):
    loader, global step g (unit u, k tile kt):     MMA warpgroups, step g:
      g >= S: sync EMPTY[g % S]                      sync FULL[g % S]
      cp.async tile kt -> stage g % S; commit        wgmma.fence; 4 x wgmma; commit
      g >= LAG: wait_group LAG (step g-LAG landed)   not the unit's first step: wait_group 1,
        fence.proxy.async; arrive FULL[(g-LAG)%S]      arrive EMPTY[(g-1) % S]
                                                     unit's end: wait_group 0, arrive EMPTY, store
A larger LAG would deadlock: the loader's step g needs the release of step g - S, which needs the
MMAs of step g - S + 1 issued, which needs FULL[g - S + 1], raised by the loader after step
g - S + 1 + LAG; so LAG <= S - 2.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from ...device.hopper import (WGMMA_SWIZZLE_128B, acc_add_f32, acc_store_bf16, acc_store_f32, cp_async_16,
                              cp_async_commit, cp_async_waiter, fence_proxy_async, flag_wait, named_barrier_arrive,
                              named_barrier_sync, setmaxnreg, shared_address, warp_uniform, wgmma_bf16, wgmma_commit,
                              wgmma_descriptor, wgmma_fence, wgmma_waiter)
from ...device.intrinsics import SIMULATOR, device_function
from ...device.launch import PreparedLaunch, allow_dynamic_shared
from .cuda_common import INLINE, bounds, cdiv, flat_u32

CONSUMERS = 256                 # the 2 MMA warpgroups: threads 0..255 (a wgmma warpgroup starts at a warp 4k)
BM = 128
BK = 64
ROW_BYTES = 2 * BK
GROUP_BYTES = 8 * ROW_BYTES
ALIGN_SLACK = 1024
LOADER_REGS, MMA_REGS = 40, 232   # a loader warpgroup's setmaxnreg: 128 x 40 + 256 x 232 = 64512 registers
BAR_CONSUMERS = 1               # named barrier of the two MMA warpgroups (0 is __syncthreads)
BAR_FULL0 = 2                   # FULL[s] = 2 + s, EMPTY[s] = 2 + STAGES + s: 2 * STAGES + 2 <= 16
# a CTA gets at least this many k tiles of work (fewer CTAs otherwise); 1 in the simulator, whose
# cases are a few k tiles
MIN_UNIT_K_TILES = 1 if SIMULATOR else 4
SIM_CTAS = 3                    # CTAs the simulator runs (a GPU runs one an SM)

# a schedule's unit: int32 fields
F_M0, F_N0, F_KB, F_KE, F_ROLE, F_SLOT, F_LO, F_HI = range(8)
WHOLE, PARTIAL, FINISH = 0, 1, 2


class Variant:
    """A specialisation: output tile width, pipeline depth, tile order and whether the tail waves
    are stream-K."""

    def __init__(self, bn: int, stages: int, group_m: int = 0, stream_k: bool = True, loader_warps: int = 2):
        assert loader_warps in (1, 2, 4) and bn % (4 * loader_warps) == 0 and 16 <= bn <= 256
        assert 3 <= stages and 2 * stages + 2 <= 16
        self.bn, self.stages, self.group_m, self.stream_k = bn, stages, group_m, stream_k
        self.loader_warps = loader_warps
        self.threads = CONSUMERS + 32 * loader_warps
        self.stage_bytes = (BM + bn) * ROW_BYTES
        self.smem_bytes = stages * self.stage_bytes + ALIGN_SLACK
        assert self.smem_bytes <= 227 * 1024, self.smem_bytes
        self.name = f"ws{BM}x{bn}x{BK}/s{stages}/l{loader_warps}/g{group_m or 'T'}/{'sk' if stream_k else 'dp'}"


# ---- the host-side schedule ---------------------------------------------------------------------

def tile_order(mt: int, nt: int, group_m: int = 0) -> np.ndarray:
    """(token tile, output tile) pairs [mt * nt, 2] in processing order: token tiles fastest
    (group_m 0), or output tiles swept inside bands of group_m token tiles."""
    if not group_m or group_m >= mt:
        i = np.arange(mt * nt)
        return np.stack([i % mt, i // mt], axis=1)
    out = []
    for m_lo in range(0, mt, group_m):
        ms = np.arange(m_lo, min(mt, m_lo + group_m))
        for n in range(nt):
            out.extend((m, n) for m in ms)
    return np.array(out, dtype=np.int64)


def schedule(T: int, N: int, K: int, v: Variant, ctas: int, min_k_tiles: int = MIN_UNIT_K_TILES, sk_waves: int = 1):
    """The work units of every CTA: (units int32 [G, U, 8], counts int32 [G], partial slots).

    A unit is (m0, n0, first k tile, end k tile, role, slot, lo, hi): role WHOLE stores its tile,
    PARTIAL writes its fp32 sums to workspace slot `slot` and raises flag `slot`, FINISH waits for
    slots lo..hi-1 (written by lower-indexed CTAs), adds them (slot hi-1 first) and stores. The
    first (full waves - sk_waves) waves of tiles are data-parallel (CTA c takes tiles c, c + G, ...);
    the rest are cut into G equal ranges of k iterations, one a CTA (stream-K), and each CTA runs
    its range backwards by unit, so the pieces a finisher waits for are the other CTAs' first
    stream-K units and its own finishing piece is its last."""
    mt, nt, n_k = cdiv(T, BM), cdiv(N, v.bn), cdiv(K, BK)
    order = tile_order(mt, nt, v.group_m)
    n_tiles = len(order)
    G = max(1, min(ctas, (n_tiles * n_k) // min_k_tiles if v.stream_k else n_tiles))
    full, rem = divmod(n_tiles, G)
    if not v.stream_k or rem == 0:
        dp = n_tiles
    else:
        dp = max(full - sk_waves, 0) * G
    units = [[] for _ in range(G)]

    def unit(t, kb, ke, role=WHOLE, slot=0, lo=0, hi=0):
        m, n = order[t]
        return [int(m) * BM, int(n) * v.bn, kb, ke, role, slot, lo, hi]

    for t in range(dp):
        units[t % G].append(unit(t, 0, n_k))
    W = (n_tiles - dp) * n_k
    pieces = [[] for _ in range(G)]            # (tile, kb, ke) in k order
    for c in range(G):
        it, end = c * W // G, (c + 1) * W // G
        while it < end:
            t, kb = divmod(it, n_k)
            ke = min(n_k, kb + end - it)
            pieces[c].append((dp + t, kb, ke))
            it += ke - kb
    first_cta = {}                              # tile -> the CTA holding its k tile 0
    slot_of = {}
    n_slots = 0
    for c in range(G):
        for (t, kb, ke) in pieces[c]:
            if kb == 0:
                first_cta[t] = c
            if ke < n_k:
                slot_of[c] = n_slots
                n_slots += 1
    for c in range(G):
        for (t, kb, ke) in reversed(pieces[c]):
            if kb == 0 and ke == n_k:
                units[c].append(unit(t, kb, ke))
            elif ke < n_k:
                units[c].append(unit(t, kb, ke, PARTIAL, slot_of[c]))
            else:                               # the tile's last k tiles: slots of CTAs first_cta .. c-1
                lo, hi = slot_of[first_cta[t]], slot_of[c - 1] + 1
                units[c].append(unit(t, kb, ke, FINISH, 0, lo, hi))
    U = max(1, max(len(u) for u in units))
    table = np.zeros((G, U, 8), dtype=np.int32)
    counts = np.zeros(G, dtype=np.int32)
    for c, us in enumerate(units):
        counts[c] = len(us)
        if us:
            table[c, :len(us)] = us
    return table, counts, n_slots


def check_schedule(table, counts, n_slots, T, N, K, v: Variant) -> None:
    """Raise AssertionError unless the schedule computes every (tile, k tile) exactly once, every
    cut tile is finished once by the CTA holding its last k tiles, from partials of lower CTAs only
    (the order that cannot deadlock), and each slot is written once."""
    mt, nt, n_k = cdiv(T, BM), cdiv(N, v.bn), cdiv(K, BK)
    seen = np.zeros((mt, nt, n_k), dtype=np.int64)
    writer = {}
    finish = {}
    for c in range(table.shape[0]):
        for u in table[c, :counts[c]]:
            m, n = u[F_M0] // BM, u[F_N0] // v.bn
            seen[m, n, u[F_KB]:u[F_KE]] += 1
            if u[F_ROLE] == PARTIAL:
                assert u[F_SLOT] not in writer, "a slot written twice"
                writer[u[F_SLOT]] = (c, m, n, u[F_KB], u[F_KE])
            elif u[F_ROLE] == FINISH:
                assert (m, n) not in finish, "a tile finished twice"
                assert u[F_KE] == n_k, "a finisher without the tile's last k tiles"
                finish[m, n] = (c, u[F_LO], u[F_HI], u[F_KB])
    assert (seen == 1).all(), "k tiles computed other than once"
    assert len(writer) == n_slots
    used = set()
    for (m, n), (c, lo, hi, kb) in finish.items():
        ks = []
        for s in range(lo, hi):
            wc, wm, wn, wkb, wke = writer[s]
            assert (wm, wn) == (m, n) and wc < c, "a finisher waits for another tile or a higher CTA"
            ks.append((wkb, wke))
            used.add(s)
        ks.append((kb, n_k))
        ks.sort()
        assert ks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ks, ks[1:])), "a cut tile's pieces leave a gap"
    assert used == set(writer), "a partial nobody adds"


# ---- the kernel -------------------------------------------------------------------------------------

def make_kernel(v: Variant):
    BN, STAGES = v.bn, v.stages
    NACC = BN // 2
    A_BYTES = BM * ROW_BYTES
    STAGE_BYTES = v.stage_bytes
    THREADS = v.threads
    LOADERS = 32 * v.loader_warps
    ROWS_A_PASS = LOADERS // 8                 # rows the loader threads copy in one pass (8 chunks a row)
    A_CHUNKS = BM // ROWS_A_PASS               # 16-byte chunks a loader thread copies a stage
    B_CHUNKS = BN // ROWS_A_PASS
    # setmaxnreg needs whole warpgroups; numba links every kernel (nvJitLink), and ptxas ignores
    # setmaxnreg in a linked compile (C7504), so the budget is 65536 / threads for every warp anyway
    SET_REGS = v.loader_warps == 4
    LAG = STAGES - 2
    BAR_EMPTY0 = BAR_FULL0 + STAGES
    ZERO = tuple(np.float32(0.0) for _ in range(NACC))
    cp_wait_lag = cp_async_waiter(LAG)
    cp_wait0 = cp_async_waiter(0)
    mma_wait1 = wgmma_waiter(1)
    mma_wait0 = wgmma_waiter(0)
    loader_regs = setmaxnreg("dec", LOADER_REGS)
    mma_regs = setmaxnreg("inc", MMA_REGS)
    d_hi_c = (16, GROUP_BYTES, WGMMA_SWIZZLE_128B)

    @device_function(**INLINE)
    def _issue_stage(smem, stage_off, x32, w32, m0, n0, T, N, K8, kt, row0, q):
        """cp.async this loader thread's chunks of k tile kt into the stage at byte stage_off: chunk q
        of rows row0 + ROWS_A_PASS i, each at its 128-byte-swizzled place."""
        kq = kt * 8 + q
        k_ok = kq < K8
        kc = min(kq, K8 - 1)
        for i in range(A_CHUNKS):
            rr = row0 + ROWS_A_PASS * i
            r = m0 + rr
            ok = k_ok and r < T
            cp_async_16(smem, stage_off + rr * ROW_BYTES + ((q ^ (rr & 7)) << 4), x32,
                        np.int64(min(r, T - 1)) * K8 + kc, 16 if ok else 0)
        for i in range(B_CHUNKS):
            rr = row0 + ROWS_A_PASS * i
            r = n0 + rr
            ok = k_ok and r < N
            cp_async_16(smem, stage_off + A_BYTES + rr * ROW_BYTES + ((q ^ (rr & 7)) << 4), w32,
                        np.int64(min(r, N - 1)) * K8 + kc, 16 if ok else 0)

    assert BK == 64

    @cuda.jit(**bounds(THREADS, 1))
    def gemm_ws(x32, w32, out, units, counts, ws, flags, T, K, pairs):
        # x32 uint32 [T*K/2], w32 uint32 [N*K/2]; out uint16 [T, N]; units int32 [G, U, 8],
        # counts int32 [G] (`schedule`); ws fp32 [slots * 256 * NACC], flags int32 [slots]
        smem = cuda.shared.array(0, types.uint32)        # dynamic: STAGES x ([128][64] x, [BN][64] w) bf16
        tid = cuda.threadIdx.x
        wg = warp_uniform(tid >> 7)                      # 0, 1: MMA warpgroups; 2: the loader warps
        cta = cuda.blockIdx.x
        N = out.shape[1]
        K8 = K >> 3
        n_units = counts[cta]
        base = np.int64(shared_address(smem))
        pad = (1024 - (base & 1023)) & 1023
        s0 = base + pad
        if wg == 2:
            # ---- the loader warps ----
            if SET_REGS:
                loader_regs()
            lt = tid - CONSUMERS
            row0 = lt >> 3                               # rows row0 + ROWS_A_PASS i, 16-byte chunk q of each
            q = lt & 7
            g = 0
            for u in range(n_units):
                m0 = np.int64(units[cta, u, F_M0])
                n0 = np.int64(units[cta, u, F_N0])
                for kt in range(units[cta, u, F_KB], units[cta, u, F_KE]):
                    slot = g % STAGES
                    if g >= STAGES:
                        named_barrier_sync(BAR_EMPTY0 + slot, THREADS)
                    _issue_stage(smem, s0 - base + slot * STAGE_BYTES, x32, w32, m0, n0, T, N, K8, kt, row0, q)
                    cp_async_commit()
                    if g >= LAG:
                        cp_wait_lag()
                        fence_proxy_async()
                        named_barrier_arrive(BAR_FULL0 + (g - LAG) % STAGES, THREADS)
                    g += 1
            cp_wait0()
            fence_proxy_async()
            for j in range(max(g - LAG, 0), g):
                named_barrier_arrive(BAR_FULL0 + j % STAGES, THREADS)
            # every step's stage is released once; take the releases no refill waited for
            for j in range(max(g - STAGES, 0), g):
                named_barrier_sync(BAR_EMPTY0 + j % STAGES, THREADS)
        else:
            # ---- the two MMA warpgroups: 64 token rows each ----
            if SET_REGS:
                mma_regs()
            c = tid
            cw = wg
            p = c & 127
            lane = p & 31
            a_wg = cw * (64 * ROW_BYTES)
            d_hi = wgmma_descriptor(0, d_hi_c[0], d_hi_c[1], d_hi_c[2])
            row_in_tile = 64 * cw + 16 * (p >> 5) + (lane >> 2)
            col_in_tile = 2 * (lane & 3)
            g = 0
            for u in range(n_units):
                kb = units[cta, u, F_KB]
                ke = units[cta, u, F_KE]
                acc = ZERO
                for kt in range(kb, ke):
                    slot = g % STAGES
                    named_barrier_sync(BAR_FULL0 + slot, THREADS)
                    st = s0 + slot * STAGE_BYTES
                    acc = wgmma_fence(acc)
                    # the 4 k16 steps written out: a loop ptxas keeps rolled serialises the chain
                    da = d_hi | wgmma_descriptor(st + a_wg, 0, 0, 0)
                    db = d_hi | wgmma_descriptor(st + A_BYTES, 0, 0, 0)
                    acc = wgmma_bf16(acc, da, db, smem)
                    da = d_hi | wgmma_descriptor(st + a_wg + 32, 0, 0, 0)
                    db = d_hi | wgmma_descriptor(st + A_BYTES + 32, 0, 0, 0)
                    acc = wgmma_bf16(acc, da, db, smem)
                    da = d_hi | wgmma_descriptor(st + a_wg + 64, 0, 0, 0)
                    db = d_hi | wgmma_descriptor(st + A_BYTES + 64, 0, 0, 0)
                    acc = wgmma_bf16(acc, da, db, smem)
                    da = d_hi | wgmma_descriptor(st + a_wg + 96, 0, 0, 0)
                    db = d_hi | wgmma_descriptor(st + A_BYTES + 96, 0, 0, 0)
                    acc = wgmma_bf16(acc, da, db, smem)
                    wgmma_commit()
                    if kt > kb:
                        acc = mma_wait1(acc)
                        named_barrier_arrive(BAR_EMPTY0 + (g - 1) % STAGES, THREADS)
                    g += 1
                acc = mma_wait0(acc)
                named_barrier_arrive(BAR_EMPTY0 + (g - 1) % STAGES, THREADS)

                role = units[cta, u, F_ROLE]
                if role == PARTIAL:
                    slot_p = np.int64(units[cta, u, F_SLOT])
                    acc_store_f32(ws, slot_p * (CONSUMERS * NACC) + c, CONSUMERS, acc)
                    cuda.threadfence()
                    named_barrier_sync(BAR_CONSUMERS, CONSUMERS)
                    if c == 0:
                        cuda.atomic.exch(flags, slot_p, np.int32(1))
                else:
                    if role == FINISH:
                        lo = units[cta, u, F_LO]
                        hi = units[cta, u, F_HI]
                        if c == 0:
                            for s in range(lo, hi):
                                flag_wait(flags, s)
                            cuda.threadfence()
                        named_barrier_sync(BAR_CONSUMERS, CONSUMERS)
                        for s in range(hi - 1, lo - 1, -1):
                            acc = acc_add_f32(acc, ws, np.int64(s) * (CONSUMERS * NACC) + c, CONSUMERS)
                        named_barrier_sync(BAR_CONSUMERS, CONSUMERS)
                        if c == 0:                       # read by all: ready for the next launch
                            for s in range(lo, hi):
                                cuda.atomic.exch(flags, s, np.int32(0))
                    acc_store_bf16(out, acc, units[cta, u, F_M0] + row_in_tile, units[cta, u, F_N0] + col_in_tile,
                                   T, N, pairs)

    return gemm_ws


# ---- the specialisations and their launch ---------------------------------------------------------

VARIANTS = {"gemm_v7": Variant(256, 4)}
# what the development script times besides the record's own (names are Variant.name)
CANDIDATES = {v.name: v for v in (
    Variant(256, 4, stream_k=False),            # persistent, data-parallel only
    Variant(256, 4, group_m=8),                 # output tiles swept in bands of 8 token tiles
    Variant(256, 4, loader_warps=1),            # 288 threads
    Variant(256, 4, loader_warps=4),            # a loader warpgroup with setmaxnreg (ignored when linked:
                                                # 168 registers a thread, 40 bytes spilled)
    Variant(192, 5, loader_warps=1),            # 40 KiB stages: one more in flight (2 loader warps spill)
    Variant(128, 6, loader_warps=1),
)}
SETMAXNREG_CANDIDATE = Variant(256, 4, loader_warps=4).name
_KERNELS: dict = {}


def kernel_for(v: Variant):
    if v.name not in _KERNELS:
        _KERNELS[v.name] = make_kernel(v)
    return _KERNELS[v.name]


def device_ctas() -> int:
    """CTAs of a persistent launch: one an SM of the current GPU (SIM_CTAS in the simulator)."""
    if SIMULATOR:
        return SIM_CTAS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def geometry(v: Variant):
    """(T, N) -> (grid, block, dynamic shared bytes) at K = 6144 on this device (the launcher
    builds the real grid from the schedule)."""
    def geo(T: int, N: int, K: int = 6144):
        table, _, _ = schedule(T, N, K, v, device_ctas())
        return table.shape[0], v.threads, v.smem_bytes
    return geo


def prepare_variant(name: str, v: Variant, x, wkv, out, *, stream=0, ctas: int | None = None) -> PreparedLaunch:
    """A launch of specialisation `v` on x [T, K], wkv [N, K] -> out [T, N] (the record's
    launcher and the development script's). `ctas`: CTAs to schedule for (default: the SMs)."""
    from ...device.devarray import data_address
    T, K = x.shape
    N = wkv.shape[0]
    if data_address(x) % 16 or data_address(wkv) % 16:
        raise ValueError(f"{name} reads x and wkv as 16-byte chunks; their data must be 16-byte aligned "
                         "(use a naive version or an aligned copy)")
    table, counts, n_slots = schedule(T, N, K, v, ctas or device_ctas())
    d_units = cuda.to_device(table, stream=stream)
    d_counts = cuda.to_device(counts, stream=stream)
    ws = cuda.device_array(max(n_slots, 1) * CONSUMERS * (v.bn // 2), dtype=np.float32, stream=stream)
    flags = cuda.to_device(np.zeros(max(n_slots, 1), dtype=np.int32), stream=stream)
    pairs = int(N % 2 == 0 and data_address(out) % 4 == 0)
    kernel = kernel_for(v)
    args = (flat_u32(x), flat_u32(wkv), out, d_units, d_counts, ws, flags, T, K, pairs)
    allow_dynamic_shared(kernel, args, v.smem_bytes)
    return PreparedLaunch(name, kernel, table.shape[0], v.threads, stream, args, out, sharedmem=v.smem_bytes)


def launcher(rec, x, wkv, out, *, stream=0) -> PreparedLaunch:
    """The record's launcher (`prepare_project(..., version="gemm_v7")` has checked the shapes)."""
    return prepare_variant(rec.name, VARIANTS[rec.name], x, wkv, out, stream=stream)
