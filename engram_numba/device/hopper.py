"""Hopper-only (sm_90a) device helpers: cp.async pipelines and warpgroup MMA (wgmma), each with a
simulator twin chosen at import, like those of `engram_numba.device.intrinsics`.

Contracts (each helper has a simulator twin with the same contract; the twins model the
asynchrony, so a kernel that reads data before waiting for it fails in the simulator too)
- `shared_address(a)`: the 32-bit shared-window address of a shared array's data (uint32);
  what cp.async destinations and wgmma descriptors hold. In the simulator every shared array is
  at address 0: a kernel keeps all wgmma operands in one shared array, the one it passes to
  `wgmma_bf16`.
- `cp_async_16(dst, dst_byte, src, src_chunk, nbytes)`: one `cp.async.cg.shared.global` of 16
  bytes: 16-byte chunk `src_chunk` of the 1-D uint32 global array `src` (words 4c..4c+3) ->
  bytes dst_byte..dst_byte+15 of the shared array `dst` (dst_byte a multiple of 16). nbytes is
  16, or 0 to zero-fill the destination without reading (src_chunk must still lie inside src).
  Asynchronous: the data is there only after `cp_async_commit` and a `cp_async_waiter(n)` that
  retires its group, and other threads see it only after a barrier.
- `cp_async_commit()` closes this thread's copies issued since the last commit into a group.
- `cp_async_waiter(n)` returns a device function `wait()` (`cp.async.wait_group n`): returns once
  at most the n most recent committed groups of this thread are still in flight.
- `fence_proxy_async()`: `fence.proxy.async.shared::cta`, between a thread's writes to shared
  memory (stores, or cp.async copies it has waited for) and wgmma reads of them (which go through
  the async proxy); a barrier must follow before another warp's wgmma reads them.
- `wgmma_descriptor(address, lbo, sbo, swizzle)`: the 64-bit shared-memory matrix descriptor:
  (address & 0x3FFFF) >> 4 in bits 0-13, lbo >> 4 in bits 16-29, sbo >> 4 in bits 32-45,
  swizzle mode in bits 62-63 (WGMMA_NO_SWIZZLE = 0, WGMMA_SWIZZLE_128B = 1); base offset 0.
  Operands are K-major (the 16 k values of a row are 32 contiguous bytes before swizzling):
  no swizzle: element (r, k) at address + (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 +
  (k % 8) * 2 (8 x 8 "core matrices" of 16-byte rows, 128 contiguous bytes each);
  128-byte swizzle: at L ^ (((L >> 7) & 7) << 4) with L = address + (r // 8) * sbo + (r % 8) *
  128 + 2 k: rows of 128 bytes, 8-row atoms of 1024 bytes whose 16-byte chunks are permuted by
  the row (the atoms must start at a multiple of 1024 bytes; lbo is unused, pass 16). Stepping k
  by 16 adds 32 bytes to the address (inside the 128-byte row).
- `wgmma_bf16(acc, desc_a, desc_b, smem)`: one warpgroup-wide (128 threads, 4 whole warps,
  warp-aligned, no divergence) `wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16`,
  D[64 x N] += A[64 x 16] B[16 x N] with A rows and B columns (= rows of a K-major [N, K] weight)
  read through the descriptors; N = 2 * len(acc) (8..256). `acc` is this thread's tuple of
  N / 2 fp32 accumulators: for thread p of the warpgroup (warp w = p // 32, g = lane >> 2,
  t = lane & 3), acc[4j + 2h + c] = D[16w + g + 8h, 8j + 2t + c]. Asynchronous: `acc` may be
  passed to further `wgmma_bf16` calls (they chain in order) but read only after
  `wgmma_commit` and a `wgmma_waiter(n)` that retires the group. `smem` is the shared array the
  descriptors point into (unused on the GPU; the simulator reads the operands from it).
- `wgmma_bf16_cols(first, count)` returns `wgmma(acc, desc_a, desc_b, smem)`: `wgmma_bf16` on
  accumulators first .. first + count - 1 of `acc` only (an m64n(2 count) wgmma; first and count
  multiples of 4, count <= 128), the others passed through. A thread's tuple may hold up to
  ACC_MAX accumulators: two wgmma of n = N / 2 on the two halves of the tuple, the second with
  its B descriptor N / 2 rows on, give the accumulators of one m64nN tile with N up to 320, in
  the layout above (acc[4j + 2h + c] = D[16w + g + 8h, 8j + 2t + c] for every j).
- `wgmma_fence(acc)`: `wgmma.fence.sync.aligned`, before the first wgmma of a batch (the
  accumulators pass through it so the compiler orders their last writes before it).
- `wgmma_commit()` closes this warpgroup's wgmmas since the last commit into a group;
  `wgmma_waiter(n)` returns `wait(acc) -> acc` (`wgmma.wait_group n`): at most n groups remain
  in flight; the accumulators pass through so nothing reads them earlier.
- `wgmma_store_bf16x2(smem, base, stride, acc)`: rounds this thread's accumulators to bf16
  (nearest even) and stores them as bf16x2 words in a uint32 shared array: the pair
  (acc[4j + 2h], acc[4j + 2h + 1]) (one row, two adjacent columns) at word
  base + 8 h * stride + 4 j. With base = (16 w + g) * stride + t, word (r, c) of the
  [64, stride] tile holds D[r, 2c], D[r, 2c + 1].
- `named_barrier_sync(bar, count)` / `named_barrier_arrive(bar, count)`: `bar.sync` /
  `bar.arrive` on hardware barrier `bar` (1..15; 0 is `cuda.syncthreads`'s) for `count` threads
  (a multiple of 32, whole warps): the barrier completes when `count` threads have arrived or
  synced; `sync` waits for that, `arrive` does not (a producer signalling consumers). Memory
  accesses before either are visible to the threads that sync on the completed barrier.
- `setmaxnreg(kind, n)` returns a device function `f()` (`setmaxnreg.inc` / `.dec.sync.aligned.u32
  n`, kind "inc" or "dec"): a whole warpgroup raises or lowers its per-thread register budget
  (warp-specialised kernels: the loading warpgroup gives registers to the MMA warpgroups). A no-op
  in the simulator.
- mbarriers (8-byte shared-memory barriers, at byte `off` of the shared array `smem`, 8-aligned):
  `mbar_init(smem, off, count)` (`mbarrier.init`: one thread, then a CTA barrier before any other
  use; the bytes must not hold a valid mbarrier: `mbar_inval(smem, off)` ends one, once it is idle), `mbar_arrive(smem, off)` (one arrival), `cp_async_mbar_arrive(smem, off)`
  (`cp.async.mbarrier.arrive.noinc`: one arrival made once every cp.async this thread issued before
  it has landed; the count given to `mbar_init` includes it), and `mbar_try_wait(smem, off, parity)`
  -> 1 once the phase of that parity has completed (the barrier's current phase has the other
  parity), else 0 (`mbarrier.try_wait.parity`; callers loop on it); `mbar_test_wait(smem, off, parity)`
  the same answer without waiting at all (`mbarrier.test_wait.parity`: a probe issued early, its answer
  read later, so the check's latency hides behind other work). A phase completes when `count`
  arrivals have come; the next one starts at once. Memory written before an arrival (and copies an
  arrival tracks) is visible to a thread whose wait saw the phase complete (wgmma reads still need
  `fence_proxy_async` after the wait). In the simulator `cp_async_mbar_arrive` lands the thread's
  copies at once, then arrives.
- TMA (the tensor memory accelerator; tensor maps from `device/tma.py`):
  `mbar_arrive_expect_tx(smem, off, nbytes)` (`mbarrier.arrive.expect_tx`: one arrival that also
  announces nbytes of copies the phase must wait for) and `tma_load_2d(smem, dst_byte, tmap, c0, c1,
  mbar_off)` (`cp.async.bulk.tensor.2d ... mbarrier::complete_tx::bytes`, one thread: the box of the
  tensor map `tmap` (its uint8 [128] device array) whose first element is column c0 of row c1 ->
  bytes dst_byte.. of smem (128-byte aligned; 1024 for a 128-byte-swizzled box), zeros where the
  box lies past the tensor, its bytes reported to the mbarrier at byte mbar_off). A phase with an
  expect_tx completes when its arrivals have come and the announced bytes have landed; a thread
  that waited on it sees the box (wgmma reads it without a further fence). In the simulator the
  bytes land when a thread's wait first sees their phase complete.
  `tma_store_2d(smem, src_byte, tmap, tmap_byte, c0, c1)` (`cp.async.bulk.tensor.2d.global.shared::cta
  .bulk_group`, one thread): the box of the map at byte tmap_byte of the uint8 array tmap, read from
  bytes src_byte.. of smem (laid out as a load would land it) -> the tensor at (c0, c1), the parts past
  the tensor not written; the thread's `bulk_commit()` closes its stores into a group and
  `bulk_wait_read0()` returns once they have read shared memory (the tile may be rewritten; the CTA
  may exit). Every thread that wrote the tile must `fence_proxy_async()`, then a barrier, before
  the store is issued. `wgmma_store_bf16x2_sw128(smem, base, g, box_words, acc)`: as
  `wgmma_store_bf16x2`, into 128-byte-swizzled boxes of 64 bf16 columns (32 words a row, box b
  box_words after box b-1): pair j of row r at word base + (j >> 3) * box_words + 8 h * 32 +
  4 ((j & 7) ^ g), with base = stash + r0 * 32 + t for the thread's rows r0 = 16 w + g (+ 8 h), t = lane & 3.
  `sw128_storer(chunks, first=0)` returns the same store limited to pairs first <= j < chunks (the
  boxes of a tile whose width is not a multiple of 64; or a tile stored a few boxes at a time: pair j
  into box (j - first) >> 3 of base, first a multiple of 8); `acc_tail_storer(j0)` returns `store(out, acc, row, col, T, N)`,
  the pairs j >= j0 straight to out [T, N] (uint16, N even, 4-byte aligned) as one 32-bit word each,
  (acc[4j + 2h], acc[4j + 2h + 1]) at out[row + 8h, col + 8j ..], rows >= T and columns >= N not.
- 2-CTA thread-block clusters (a kernel launched with a cluster dimension,
  `device.launch.ClusterLaunch`): `cluster_ctarank()` (uint32, the CTA's rank in its cluster);
  `cluster_sync()` (`barrier.cluster.arrive.release` + `wait.acquire`: every thread of every CTA of
  the cluster); `fence_mbarrier_init_cluster()` (after `mbar_init`, before a cluster barrier: the
  peer may then signal the barrier); `mbar_arrive_remote(smem, off, rank)` (an arrive on the
  mbarrier at byte `off` of CTA `rank`'s shared memory, through `mapa`, with mbarrier.arrive's
  default semantics, release at CTA scope, as CUTLASS's cluster barrier arrives; the waiter uses
  `mbar_try_wait`, acquire at CTA scope: release or acquire at cluster scope makes each arrive or
  wait a cluster-wide memory fence, which stalled the 2-CTA GEMM's consumer warps for 44% of their
  stall cycles, docs/gpu.md);
  `tma_load_2d_multicast(smem, dst_byte, tmap, c0, c1, mbar_off, mask)` (`tma_load_2d` into byte
  dst_byte of every CTA of `mask` (bit r: rank r), each CTA's mbarrier at mbar_off told the bytes).
  The simulator has no clusters: its twins answer for a cluster of one (rank 0, remote arrives do
  nothing, the multicast lands in the calling CTA only) and `cluster_sync` raises; a kernel written
  for clusters takes an explicit simulator path (cuda_wgmma.py, "Clusters").
- `flag_wait(flags, i)`: spins until the int32 `flags[i]` is non-zero (read atomically, so another
  CTA's `cuda.atomic.exch(flags, i, 1)` after a `cuda.threadfence()` is seen), for waits between
  CTAs. The simulator runs blocks one after another, so a flag a CTA waits for must come from a
  CTA with a lower index (the only order that cannot deadlock on a GPU either): its twin raises if
  the flag is not set yet instead of hanging.
- Accumulators out of and into global memory (epilogues of persistent and split-K kernels), each
  unrolled over the tuple so the accumulators stay in registers:
  `acc_store_f32(ws, base, stride, acc)`: ws[base + i * stride] = acc[i] (fp32 1-D ws);
  `acc_add_f32(acc, ws, base, stride)` -> acc[i] + ws[base + i * stride], read with `ld.global.cg`
  (from L2: the values were written by another CTA of the same launch);
  `acc_store_bf16(out, acc, row, col, T, N, pairs)`: the wgmma fragment rounded to bf16 (nearest
  even) into out [T, N] uint16: acc[4j + 2h + c] -> out[row + 8h, col + 8j + c] where that lies
  inside [T, N]; `pairs` (N even and out 4-byte aligned, col even) stores each pair as one 32-bit word.
- `warp_uniform(x)`: x as lane 0 of the warp holds it (`shfl.sync` from lane 0): for a value the
  code knows to be the same across the warp (a warpgroup's role), so that the compiler knows it too
  (ptxas serialises the wgmma of a kernel whose wgmma sit on a path it cannot prove warp-uniform).
The simulator's wgmma sums each 16-term product in float64, rounds it to fp32 and adds it to the
accumulator in fp32 (the tensor core's order is unspecified: compare in ulps, not bits).
"""
from __future__ import annotations

import numpy as np

from .intrinsics import SIMULATOR, cvt_pack_bf16x2, device_function

WGMMA_NO_SWIZZLE = 0
WGMMA_SWIZZLE_128B = 1
ACC_MAX = 160       # accumulators a tuple may hold (wgmma_bf16_cols: two n160 wgmma on one m64n320 tile)


@device_function
def wgmma_descriptor(address, lbo, sbo, swizzle):
    return (np.uint64((np.uint32(address) & np.uint32(0x3FFFF)) >> np.uint32(4))
            | (np.uint64(np.uint32(lbo) >> np.uint32(4)) << np.uint64(16))
            | (np.uint64(np.uint32(sbo) >> np.uint32(4)) << np.uint64(32))
            | (np.uint64(swizzle) << np.uint64(62)))


if SIMULATOR:
    # ---- simulator twins: copies and products happen when the wait that retires them runs -----
    import itertools
    import threading

    class _AsyncQueues(threading.local):
        """Per simulated thread (the simulator runs each CUDA thread as a Python thread): the
        cp.async copies and wgmma products issued but not yet retired by a wait."""

        def __init__(self):
            self.cp_open, self.cp_groups = [], []
            self.mma_open, self.mma_groups = [], []

    _QUEUES = _AsyncQueues()

    def _thread_id():
        th = threading.current_thread()
        if not hasattr(th, "thread_id"):
            raise RuntimeError("wgmma/cp.async twins run only inside a simulated kernel")
        return int(th.thread_id)

    def _bytes(a):
        return np.asarray(a).reshape(-1).view(np.uint8)

    def shared_address(a):
        return np.uint32(0)

    def cp_async_16(dst, dst_byte, src, src_chunk, nbytes):
        dst_byte, src_chunk, nbytes = int(dst_byte), int(src_chunk), int(nbytes)
        dst_b = _bytes(dst)
        if dst_byte % 16 or not 0 <= dst_byte <= dst_b.size - 16:
            raise IndexError(f"cp_async_16: destination byte {dst_byte} is not a 16-byte slot of "
                             f"the {dst_b.size}-byte shared array")
        if not 0 <= src_chunk < np.asarray(src).size // 4:
            raise IndexError(f"cp_async_16: source chunk {src_chunk} is outside the source "
                             f"({np.asarray(src).size // 4} chunks)")
        if nbytes not in (0, 16):
            raise ValueError(f"cp_async_16: nbytes must be 16 or 0, got {nbytes}")
        data = (np.array(src[4 * src_chunk:4 * src_chunk + 4], dtype=np.uint32) if nbytes
                else np.zeros(4, np.uint32))

        def land():
            dst_b[dst_byte:dst_byte + 16] = data.view(np.uint8)
        _QUEUES.cp_open.append(land)

    def cp_async_commit():
        _QUEUES.cp_groups.append(_QUEUES.cp_open)
        _QUEUES.cp_open = []

    def cp_async_waiter(n):
        n = int(n)

        def cp_async_wait():
            while len(_QUEUES.cp_groups) > n:
                for land in _QUEUES.cp_groups.pop(0):
                    land()
        return cp_async_wait

    def fence_proxy_async():
        pass

    class WgmmaAcc:
        """A thread's wgmma accumulators in the simulator: the values, how many products are
        still in flight, and whether a wgmma_fence came after the last read."""

        def __init__(self, values):
            self.values = np.array(values, dtype=np.float32)
            self.in_flight = 0
            self.fenced = False

        def read(self, what):
            if self.in_flight:
                raise RuntimeError(f"{what}: the accumulators are read while {self.in_flight} wgmma "
                                   "products are in flight (wgmma_commit and a wgmma_waiter first)")
            self.fenced = False
            return self.values

    def _element_offsets(desc, rows):
        """Byte offsets in shared memory of elements (rows[i], k), k < 16, of a K-major operand."""
        desc = int(desc)
        start = (desc & 0x3FFF) << 4
        lbo = ((desc >> 16) & 0x3FFF) << 4
        sbo = ((desc >> 32) & 0x3FFF) << 4
        mode = desc >> 62
        if (desc >> 49) & 7:
            raise NotImplementedError("wgmma twin: descriptor base offset must be 0")
        r = np.asarray(rows, dtype=np.int64)[:, None]
        k = np.arange(16, dtype=np.int64)[None, :]
        if mode == WGMMA_NO_SWIZZLE:
            return start + (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 + (k % 8) * 2
        if mode == WGMMA_SWIZZLE_128B:
            logical = start + (r // 8) * sbo + (r % 8) * 128 + 2 * k
            return logical ^ (((logical >> 7) & 7) << 4)
        raise NotImplementedError(f"wgmma twin: swizzle mode {mode} is not modelled")

    def _operand(smem_b, desc, rows):
        off = _element_offsets(desc, rows)
        if off.min() < 0 or off.max() + 2 > smem_b.size:
            raise IndexError(f"wgmma operand reaches bytes {off.min()}..{off.max() + 1} of a "
                             f"{smem_b.size}-byte shared array (descriptor {int(desc):#x})")
        words = smem_b.view(np.uint16)[off // 2].astype(np.uint32) << np.uint32(16)
        return words.view(np.float32).astype(np.float64)

    def wgmma_fence(acc):
        if not isinstance(acc, WgmmaAcc):
            acc = WgmmaAcc(acc)
        acc.fenced = True
        return acc

    def _wgmma_bf16_cols(acc, desc_a, desc_b, smem, first, count):
        if not isinstance(acc, WgmmaAcc) or not acc.fenced:
            raise RuntimeError("wgmma_bf16: no wgmma_fence since the accumulators were last written "
                               "or read by other instructions")
        n_cols = 2 * count
        if not (count % 4 == 0 and 4 <= count <= 128 and first % 4 == 0 and first + count <= acc.values.size):
            raise ValueError(f"wgmma_bf16: accumulators {first}..{first + count} of {acc.values.size}: "
                             "a wgmma takes 4..128 of them, a multiple of 4, from a multiple of 4")
        p = _thread_id() % 128
        w, g, t = p // 32, (p % 32) >> 2, p & 3
        rows_a = [16 * w + g, 16 * w + g + 8]
        cols = [8 * j + 2 * t + c for j in range(n_cols // 8) for c in range(2)]
        smem_b, da, db = _bytes(smem), int(desc_a), int(desc_b)

        def run():
            # [2, 16] x [N/4, 16]^T, exact products summed in float64, rounded once to fp32
            prod = (_operand(smem_b, da, rows_a) @ _operand(smem_b, db, cols).T).astype(np.float32)
            frag = prod.reshape(2, n_cols // 8, 2).transpose(1, 0, 2).reshape(-1)   # [j][h][c]
            vals = acc.values.copy()
            vals[first:first + count] = (vals[first:first + count] + frag).astype(np.float32)
            acc.values = vals
            acc.in_flight -= 1
        acc.in_flight += 1
        _QUEUES.mma_open.append(run)
        return acc

    def wgmma_bf16(acc, desc_a, desc_b, smem):
        size = acc.values.size if isinstance(acc, WgmmaAcc) else len(acc)
        return _wgmma_bf16_cols(acc, desc_a, desc_b, smem, 0, size)

    def wgmma_bf16_cols(first, count):
        first, count = int(first), int(count)

        def wgmma_bf16_part(acc, desc_a, desc_b, smem):
            return _wgmma_bf16_cols(acc, desc_a, desc_b, smem, first, count)
        return wgmma_bf16_part

    def wgmma_commit():
        _QUEUES.mma_groups.append(_QUEUES.mma_open)
        _QUEUES.mma_open = []

    def wgmma_waiter(n):
        n = int(n)

        def wgmma_wait(acc):
            while len(_QUEUES.mma_groups) > n:
                for run in _QUEUES.mma_groups.pop(0):
                    run()
            return acc
        return wgmma_wait

    def _named_barrier(bar, count, wait):
        # Lock-free under the GIL (a lock held by a thread the interpreter switched away from stalls
        # hundreds of simulated threads): arrival k of barrier `bar` belongs to phase k // count, and
        # the phase's last arrival sets that phase's Event (dict.setdefault and next() are atomic).
        bar, count = int(bar), int(count)
        if not 1 <= bar <= 15 or count <= 0 or count % 32:
            raise ValueError(f"named barrier {bar} for {count} threads: ids are 1..15 and counts whole warps")
        th = threading.current_thread()
        mgr = getattr(th, "_manager", None)
        if mgr is None:
            raise RuntimeError("named barriers run only inside a simulated kernel")
        if not hasattr(mgr, "named_barriers"):
            mgr.__dict__.setdefault("named_barriers", {})
        state = mgr.named_barriers.setdefault(bar, (count, itertools.count(), {}))
        if state[0] != count:
            raise RuntimeError(f"named barrier {bar}: {count} threads expected here, {state[0]} elsewhere")
        k = next(state[1])
        event = state[2].setdefault(k // count, threading.Event())
        if k % count == count - 1:
            event.set()
            return
        while wait and not event.wait(0.05):
            if th.abort:
                raise RuntimeError("abort flag set while waiting on a named barrier")

    def named_barrier_sync(bar, count):
        _named_barrier(bar, count, True)

    def named_barrier_arrive(bar, count):
        _named_barrier(bar, count, False)

    def setmaxnreg(kind, n):
        if kind not in ("inc", "dec") or not 24 <= int(n) <= 256 or int(n) % 8:
            raise ValueError(f"setmaxnreg.{kind} {n}: kind inc or dec, 24..256 registers in steps of 8")

        def set_max_registers():
            pass
        return set_max_registers

    def _mbar_state(off):
        th = threading.current_thread()
        mgr = getattr(th, "_manager", None)
        if mgr is None:
            raise RuntimeError("mbarriers run only inside a simulated kernel")
        if not hasattr(mgr, "mbarriers"):
            mgr.__dict__.setdefault("mbarriers", {})
        return th, mgr.mbarriers, int(off)

    class _Mbar:
        """An mbarrier of the simulator: arrival k belongs to phase k // count, and that phase's last
        arrival sets its Event. `expect_tx` holds its arrival back until the bytes it announced have
        been reported by `complete_tx` (a TMA copy's), as the hardware's transaction count does; a
        TMA copy's bytes land only when a thread's wait sees the phase they belong to complete, so
        a kernel that reads a stage before waiting on its barrier reads stale bytes here too."""

        def __init__(self, count):
            self.count, self.n, self.done = count, 0, {}
            self.lock = threading.Lock()
            self.tx, self.held, self.landing, self.lands = 0, 0, [], {}

        def _arrive(self):
            k = self.n
            self.n += 1
            phase = k // self.count
            if self.landing:
                self.lands.setdefault(phase, []).extend(self.landing)
                self.landing = []
            event = self.done.setdefault(phase, threading.Event())
            if k % self.count == self.count - 1:
                event.set()

        def arrive(self):
            with self.lock:
                self._arrive()

        def _release(self):
            if self.tx == 0 and self.held:
                for _ in range(self.held):
                    self._arrive()
                self.held = 0

        def expect_tx(self, nbytes):
            with self.lock:
                self.tx += nbytes
                self.held += 1
                self._release()

        def complete_tx(self, nbytes, land):
            with self.lock:
                self.tx -= nbytes
                self.landing.append(land)
                self._release()

        def land(self, upto):
            """Run the copies of every phase before `upto` (a waiter saw them complete)."""
            with self.lock:
                for phase in [p for p in self.lands if p < upto]:
                    for f in self.lands.pop(phase):
                        f()

        def completed(self):
            c = 0
            while c in self.done and self.done[c].is_set():
                c += 1
            return c

    def mbar_init(smem, off, count):
        _, bars, off = _mbar_state(off)
        if off in bars:
            raise RuntimeError(f"mbar_init: byte {off} holds a valid mbarrier (mbar_inval it first)")
        if off % 8 or not 0 <= off <= _bytes(smem).size - 8 or int(count) <= 0:
            raise ValueError(f"mbar_init: byte {off} (8-aligned, inside the shared array), count {count} > 0")
        bars[off] = _Mbar(int(count))

    def _mbar(off):
        th, bars, off = _mbar_state(off)
        if off not in bars:
            raise RuntimeError(f"mbarrier at byte {off} used before mbar_init")
        return th, bars[off]

    def mbar_arrive(smem, off):
        _mbar(off)[1].arrive()

    def mbar_inval(smem, off):
        _, bars, off = _mbar_state(off)
        if bars.pop(off, None) is None:
            raise RuntimeError(f"mbar_inval: no mbarrier at byte {off}")

    def cp_async_mbar_arrive(smem, off):
        q = _QUEUES
        for group in q.cp_groups + [q.cp_open]:
            for land in group:
                land()
        q.cp_groups, q.cp_open = [], []
        _mbar(off)[1].arrive()

    def mbar_test_wait(smem, off, parity):
        th, bar = _mbar(off)
        c = bar.completed()
        if c % 2 != int(parity) & 1:
            bar.land(c)
            return 1
        if th.abort:
            raise RuntimeError("abort flag set while waiting on an mbarrier")
        return 0

    def mbar_try_wait(smem, off, parity):
        if mbar_test_wait(smem, off, parity):
            return 1
        th, bar = _mbar(off)
        bar.done.setdefault(bar.completed(), threading.Event()).wait(0.001)
        if th.abort:
            raise RuntimeError("abort flag set while waiting on an mbarrier")
        return 0

    def mbar_arrive_expect_tx(smem, off, nbytes):
        _mbar(off)[1].expect_tx(int(nbytes))

    def tma_load_2d(smem, dst_byte, tmap, c0, c1, mbar_off):
        from .tma import SWIZZLE_128B, sim_map
        m = sim_map(tmap)
        dst_byte, c0, c1 = int(dst_byte), int(c0), int(c1)
        dst_b = _bytes(smem)
        if dst_byte % 128 or not 0 <= dst_byte <= dst_b.size - m.box_bytes:
            raise IndexError(f"tma_load_2d: destination byte {dst_byte} (128-byte aligned) and the "
                             f"{m.box_bytes}-byte box must lie inside the {dst_b.size}-byte shared array")
        if m.swizzle == SWIZZLE_128B and dst_byte % 1024:
            raise IndexError(f"tma_load_2d: a 128-byte-swizzled box lands 1024-byte aligned, not at {dst_byte}")
        rows, cols = m.shape
        src = np.asarray(m.array)
        box = np.zeros((m.box_rows, m.box_cols), src.dtype)     # past the tensor's edges: zeros
        r1, k1 = min(rows, c1 + m.box_rows), min(cols, c0 + m.box_cols)
        if c1 < r1 and c0 < k1 and c1 >= 0 and c0 >= 0:
            box[:r1 - c1, :k1 - c0] = src[c1:r1, c0:k1]
        flat = box.reshape(-1).view(np.uint8)
        row_bytes = m.box_cols * m.esize
        if m.swizzle == SWIZZLE_128B:
            # byte b of the box at L ^ (((L >> 7) & 7) << 4), L = dst + b (128-byte rows)
            L = dst_byte + np.arange(flat.size)
            where = L ^ (((L >> 7) & 7) << 4)
        else:
            where = dst_byte + np.arange(flat.size)
        assert row_bytes <= 128 or m.swizzle != SWIZZLE_128B

        def land():
            dst_b[where] = flat
        _mbar(mbar_off)[1].complete_tx(m.box_bytes, land)

    class _BulkQueue(threading.local):
        """Per simulated thread: TMA stores issued and not yet waited for (their bytes are read from
        shared memory and written at the wait, so a kernel that reuses the tile too early or never
        waits shows it)."""

        def __init__(self):
            self.pending = []

    _BULK = _BulkQueue()

    def tma_store_2d(smem, src_byte, tmap, tmap_byte, c0, c1):
        from .tma import SWIZZLE_128B, sim_map
        m = sim_map(np.asarray(tmap).reshape(-1).view(np.uint8)[int(tmap_byte):])
        src_byte, c0, c1 = int(src_byte), int(c0), int(c1)
        src_b = _bytes(smem)
        if src_byte % 128 or not 0 <= src_byte <= src_b.size - m.box_bytes:
            raise IndexError(f"tma_store_2d: source byte {src_byte} (128-byte aligned) and the "
                             f"{m.box_bytes}-byte box must lie inside the {src_b.size}-byte shared array")
        if m.swizzle == SWIZZLE_128B and src_byte % 1024:
            raise IndexError(f"tma_store_2d: a 128-byte-swizzled box is read 1024-byte aligned, not at {src_byte}")

        def land():
            L = src_byte + np.arange(m.box_bytes)
            where = L ^ (((L >> 7) & 7) << 4) if m.swizzle == SWIZZLE_128B else L
            dst = np.asarray(m.array)
            box = src_b[where].copy().view(dst.dtype).reshape(m.box_rows, m.box_cols)
            rows, cols = m.shape
            r1, k1 = min(rows, c1 + m.box_rows), min(cols, c0 + m.box_cols)
            if c1 < r1 and c0 < k1:                             # what lies past the tensor is not written
                dst[c1:r1, c0:k1] = box[:r1 - c1, :k1 - c0]
        _BULK.pending.append(land)

    def bulk_commit():
        pass

    def bulk_wait_read0():
        for land in _BULK.pending:
            land()
        _BULK.pending = []

    # ---- 2-CTA clusters: the simulator runs one CTA at a time, so it has no peer. A kernel written
    # for clusters takes its simulator path explicitly (the union of what both CTAs would load, CTA
    # barriers for cluster barriers); these twins answer for a cluster of one.
    def cluster_ctarank():
        return np.uint32(0)

    def cluster_sync():
        raise RuntimeError("cluster_sync: the simulator has no clusters (use cuda.syncthreads on its path)")

    def fence_mbarrier_init_cluster():
        pass

    def mbar_arrive_remote(smem, off, rank):
        pass                                            # the peer's barrier: no peer here

    def tma_load_2d_multicast(smem, dst_byte, tmap, c0, c1, mbar_off, mask):
        tma_load_2d(smem, dst_byte, tmap, c0, c1, mbar_off)

    def _sw128_store(smem, base, g, box_words, acc, chunks, first=0):
        vals = acc.read("wgmma_store_bf16x2_sw128") if isinstance(acc, WgmmaAcc) else np.array(acc, np.float32)
        base, g, box_words = int(base), int(g), int(box_words)
        for j in range(first, min(vals.size // 4, chunks)):
            for h in range(2):
                smem[base + ((j - first) >> 3) * box_words + 8 * h * 32 + 4 * ((j & 7) ^ g)] = \
                    cvt_pack_bf16x2(vals[4 * j + 2 * h], vals[4 * j + 2 * h + 1])

    def wgmma_store_bf16x2_sw128(smem, base, g, box_words, acc):
        _sw128_store(smem, base, g, box_words, acc, 1 << 30)

    def sw128_storer(chunks, first=0):
        chunks, first = int(chunks), int(first)
        assert first % 8 == 0 and first < chunks, (first, chunks)

        def sw128_store(smem, base, g, box_words, acc):
            _sw128_store(smem, base, g, box_words, acc, chunks, first)
        return sw128_store

    def acc_tail_storer(j0):
        j0 = int(j0)

        def acc_store_tail(out, acc, row, col, T, N):
            vals = _acc_values(acc, "acc_store_tail")
            row, col, T, N = int(row), int(col), int(T), int(N)
            for j in range(j0, vals.size // 4):
                for h in range(2):
                    r, n = row + 8 * h, col + 8 * j
                    if r < T and n < N:
                        word = int(cvt_pack_bf16x2(vals[4 * j + 2 * h], vals[4 * j + 2 * h + 1]))
                        out[r, n] = np.uint16(word & 0xFFFF)
                        out[r, n + 1] = np.uint16(word >> 16)
        return acc_store_tail

    def flag_wait(flags, i):
        if int(flags[i]) == 0:
            raise RuntimeError(f"flag_wait: flag {int(i)} is not set; the simulator runs blocks in index order, "
                               "so a CTA may only wait for flags set by lower-indexed CTAs")

    def warp_uniform(x):
        return x

    def _acc_values(acc, what):
        return acc.read(what) if isinstance(acc, WgmmaAcc) else np.array(acc, np.float32)

    def acc_store_f32(ws, base, stride, acc):
        vals = _acc_values(acc, "acc_store_f32")
        base, stride = int(base), int(stride)
        for i in range(vals.size):
            ws[base + i * stride] = vals[i]

    def acc_add_f32(acc, ws, base, stride):
        vals = _acc_values(acc, "acc_add_f32").copy()
        base, stride = int(base), int(stride)
        for i in range(vals.size):
            vals[i] = np.float32(vals[i] + np.float32(ws[base + i * stride]))
        return WgmmaAcc(vals)

    def acc_store_bf16(out, acc, row, col, T, N, pairs):
        vals = _acc_values(acc, "acc_store_bf16")
        row, col, T, N = int(row), int(col), int(T), int(N)
        for j in range(vals.size // 4):
            for h in range(2):
                r = row + 8 * h
                word = int(cvt_pack_bf16x2(vals[4 * j + 2 * h], vals[4 * j + 2 * h + 1]))
                for c in range(2):
                    n = col + 8 * j + c
                    if r < T and n < N:
                        out[r, n] = np.uint16((word >> (16 * c)) & 0xFFFF)

    def wgmma_store_bf16x2(smem, base, stride, acc):
        vals = acc.read("wgmma_store_bf16x2") if isinstance(acc, WgmmaAcc) else np.array(acc, np.float32)
        base, stride = int(base), int(stride)
        for j in range(vals.size // 4):
            for h in range(2):
                smem[base + 8 * h * stride + 4 * j] = cvt_pack_bf16x2(vals[4 * j + 2 * h], vals[4 * j + 2 * h + 1])

else:
    # ---- GPU versions: inline PTX (sm_90a) ------------------------------------------------------
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from .intrinsics import u32x4_pointer

    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def _inline(builder, ret, arg_types, text, constraints, args, side_effect=True):
        fnty = ir.FunctionType(ret, arg_types)
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    def _shared_address_of(context, builder, arrty, arr):
        # numba keeps shared arrays behind generic pointers: cast back to the shared window
        ary = cgutils.create_struct_proxy(arrty)(context, builder, value=arr)
        p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        return builder.ptrtoint(builder.addrspacecast(p, ir.PointerType(ir.IntType(8), 3)), _I32)

    @intrinsic
    def shared_address(typingctx, a):
        if not isinstance(a, types.Array):
            return None

        def codegen(context, builder, signature, args):
            return _shared_address_of(context, builder, signature.args[0], args[0])
        return types.uint32(a), codegen

    @intrinsic
    def cp_async_16(typingctx, dst, dst_byte, src, src_chunk, nbytes):
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and src.dtype == types.uint32
                and all(isinstance(v, types.Integer) for v in (dst_byte, src_chunk, nbytes))):
            return None
        sig = types.void(dst, dst_byte, src, src_chunk, nbytes)

        def codegen(context, builder, signature, args):
            d, d_off, s, s_chunk, n = args
            sa, sb, sc, sd, se = signature.args
            addr = builder.add(_shared_address_of(context, builder, sa, d),
                               context.cast(builder, d_off, sb, types.uint32))
            chunk = context.cast(builder, s_chunk, sd, types.int64)
            src_ptr = u32x4_pointer(context, builder, sc, s, chunk)
            _inline(builder, ir.VoidType(), [_I32, _I64, _I32],
                    "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                    [addr, builder.ptrtoint(src_ptr, _I64), context.cast(builder, n, se, types.uint32)])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    _CP_WAITERS: dict = {}

    def cp_async_waiter(n):
        n = int(n)
        if n not in _CP_WAITERS:
            @intrinsic
            def cp_async_wait(typingctx):
                def codegen(context, builder, signature, args):
                    _inline(builder, ir.VoidType(), [], f"cp.async.wait_group {n};", "~{memory}", [])
                    return context.get_dummy_value()
                return types.void(), codegen
            _CP_WAITERS[n] = cp_async_wait
        return _CP_WAITERS[n]

    @intrinsic
    def fence_proxy_async(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "fence.proxy.async.shared::cta;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    def _is_acc(acc):
        return (isinstance(acc, types.UniTuple) and acc.dtype == types.float32 and acc.count % 4 == 0
                and 4 <= acc.count <= ACC_MAX)

    def _acc_asm(context, builder, acc_type, acc, text, extra_types=(), extra_args=(), extra_constraints=""):
        """Inline asm whose outputs are the accumulators, each tied to its input (in/out)."""
        n = acc_type.count
        vals = [builder.extract_value(acc, i) for i in range(n)]
        constraints = ",".join(["=f"] * n + [str(i) for i in range(n)]) + extra_constraints + ",~{memory}"
        res = _inline(builder, ir.LiteralStructType([_F32] * n), [_F32] * n + list(extra_types), text,
                      constraints, vals + list(extra_args))
        return context.make_tuple(builder, acc_type, [builder.extract_value(res, i) for i in range(n)])

    @intrinsic
    def wgmma_fence(typingctx, acc):
        if not _is_acc(acc):
            return None

        def codegen(context, builder, signature, args):
            return _acc_asm(context, builder, signature.args[0], args[0], "wgmma.fence.sync.aligned;")
        return acc(acc), codegen

    def _wgmma_text(n):
        regs = ", ".join(f"${i}" for i in range(n))
        return ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; "
                "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16 {%s}, $%d, $%d, p, 1, 1, 0, 0; }"
                % (2 * n + 2, 2 * n, regs, 2 * n, 2 * n + 1))

    @intrinsic
    def wgmma_bf16(typingctx, acc, desc_a, desc_b, smem):
        if not (_is_acc(acc) and acc.count <= 128 and isinstance(desc_a, types.Integer)
                and isinstance(desc_b, types.Integer)):
            return None
        text = _wgmma_text(acc.count)

        def codegen(context, builder, signature, args):
            acc_t, da_t, db_t, _ = signature.args
            da = context.cast(builder, args[1], da_t, types.uint64)
            db = context.cast(builder, args[2], db_t, types.uint64)
            return _acc_asm(context, builder, acc_t, args[0], text, (_I64, _I64, _I32),
                            (da, db, ir.Constant(_I32, 1)), ",l,l,r")
        return acc(acc, desc_a, desc_b, smem), codegen

    _WGMMA_COLS: dict = {}

    def wgmma_bf16_cols(first, count):
        first, count = int(first), int(count)
        assert count % 4 == 0 and 4 <= count <= 128 and first % 4 == 0 and first >= 0, (first, count)
        if (first, count) in _WGMMA_COLS:
            return _WGMMA_COLS[first, count]
        text = _wgmma_text(count)

        @intrinsic
        def wgmma_bf16_part(typingctx, acc, desc_a, desc_b, smem):
            if not (_is_acc(acc) and first + count <= acc.count and isinstance(desc_a, types.Integer)
                    and isinstance(desc_b, types.Integer)):
                return None

            def codegen(context, builder, signature, args):
                acc_t, da_t, db_t, _ = signature.args
                da = context.cast(builder, args[1], da_t, types.uint64)
                db = context.cast(builder, args[2], db_t, types.uint64)
                vals = [builder.extract_value(args[0], i) for i in range(acc_t.count)]
                part = vals[first:first + count]
                constraints = ",".join(["=f"] * count + [str(i) for i in range(count)]) + ",l,l,r,~{memory}"
                res = _inline(builder, ir.LiteralStructType([_F32] * count), [_F32] * count + [_I64, _I64, _I32],
                              text, constraints, part + [da, db, ir.Constant(_I32, 1)])
                for i in range(count):
                    vals[first + i] = builder.extract_value(res, i)
                return context.make_tuple(builder, acc_t, vals)
            return acc(acc, desc_a, desc_b, smem), codegen
        _WGMMA_COLS[first, count] = wgmma_bf16_part
        return wgmma_bf16_part

    @intrinsic
    def wgmma_commit(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "wgmma.commit_group.sync.aligned;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    _WGMMA_WAITERS: dict = {}

    def wgmma_waiter(n):
        n = int(n)
        if n not in _WGMMA_WAITERS:
            @intrinsic
            def wgmma_wait(typingctx, acc):
                if not _is_acc(acc):
                    return None

                def codegen(context, builder, signature, args):
                    return _acc_asm(context, builder, signature.args[0], args[0],
                                    f"wgmma.wait_group.sync.aligned {n};")
                return acc(acc), codegen
            _WGMMA_WAITERS[n] = wgmma_wait
        return _WGMMA_WAITERS[n]

    @intrinsic
    def wgmma_store_bf16x2(typingctx, smem, base, stride, acc):
        if not (isinstance(smem, types.Array) and smem.dtype == types.uint32 and _is_acc(acc)
                and isinstance(base, types.Integer) and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            sm_t, b_t, s_t, acc_t = signature.args
            ary = cgutils.create_struct_proxy(sm_t)(context, builder, value=args[0])
            data = builder.bitcast(ary.data, _I32.as_pointer())
            base_v = context.cast(builder, args[1], b_t, types.int64)
            stride_v = context.cast(builder, args[2], s_t, types.int64)
            row8 = builder.mul(stride_v, ir.Constant(_I64, 8))
            for j in range(acc_t.count // 4):
                for h in range(2):
                    lo = builder.extract_value(args[3], 4 * j + 2 * h)
                    hi = builder.extract_value(args[3], 4 * j + 2 * h + 1)
                    # PTX packs its first source into the upper half
                    word = _inline(builder, _I32, [_F32, _F32], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                                   [hi, lo], side_effect=False)
                    idx = builder.add(base_v, ir.Constant(_I64, 4 * j))
                    if h:
                        idx = builder.add(idx, row8)
                    builder.store(word, builder.gep(data, [idx]))
            return context.get_dummy_value()
        return types.void(smem, base, stride, acc), codegen

    def _bar_op(op):
        @intrinsic
        def bar(typingctx, bar_id, count):
            if not (isinstance(bar_id, types.Integer) and isinstance(count, types.Integer)):
                return None

            def codegen(context, builder, signature, args):
                b = context.cast(builder, args[0], signature.args[0], types.uint32)
                c = context.cast(builder, args[1], signature.args[1], types.uint32)
                _inline(builder, ir.VoidType(), [_I32, _I32], f"{op} $0, $1;", "r,r,~{memory}", [b, c])
                return context.get_dummy_value()
            return types.void(bar_id, count), codegen
        return bar

    named_barrier_sync = _bar_op("bar.sync")
    named_barrier_arrive = _bar_op("bar.arrive")

    _SETMAXNREG: dict = {}

    def setmaxnreg(kind, n):
        n = int(n)
        if kind not in ("inc", "dec") or not 24 <= n <= 256 or n % 8:
            raise ValueError(f"setmaxnreg.{kind} {n}: kind inc or dec, 24..256 registers in steps of 8")
        if (kind, n) not in _SETMAXNREG:
            @intrinsic
            def set_max_registers(typingctx):
                def codegen(context, builder, signature, args):
                    _inline(builder, ir.VoidType(), [], f"setmaxnreg.{kind}.sync.aligned.u32 {n};", "~{memory}", [])
                    return context.get_dummy_value()
                return types.void(), codegen
            _SETMAXNREG[kind, n] = set_max_registers
        return _SETMAXNREG[kind, n]

    def _mbar_address(context, builder, signature, args):
        arr_t, off_t = signature.args[0], signature.args[1]
        return builder.add(_shared_address_of(context, builder, arr_t, args[0]),
                           context.cast(builder, args[1], off_t, types.uint32))

    @intrinsic
    def mbar_init(typingctx, smem, off, count):
        if not (isinstance(smem, types.Array) and isinstance(off, types.Integer) and isinstance(count, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            addr = _mbar_address(context, builder, signature, args)
            c = context.cast(builder, args[2], signature.args[2], types.uint32)
            _inline(builder, ir.VoidType(), [_I32, _I32], "mbarrier.init.shared::cta.b64 [$0], $1;",
                    "r,r,~{memory}", [addr, c])
            return context.get_dummy_value()
        return types.void(smem, off, count), codegen

    def _mbar_op(text):
        @intrinsic
        def op(typingctx, smem, off):
            if not (isinstance(smem, types.Array) and isinstance(off, types.Integer)):
                return None

            def codegen(context, builder, signature, args):
                _inline(builder, ir.VoidType(), [_I32], text, "r,~{memory}",
                        [_mbar_address(context, builder, signature, args)])
                return context.get_dummy_value()
            return types.void(smem, off), codegen
        return op

    mbar_arrive = _mbar_op("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }")
    mbar_inval = _mbar_op("mbarrier.inval.shared::cta.b64 [$0];")
    cp_async_mbar_arrive = _mbar_op("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];")

    def _parity_wait(op):
        """mbarrier.<op>.parity (acquire at CTA scope): 1 once the phase of that parity has completed, else
        0; op "try_wait" may wait a while first, "test_wait" answers at once."""
        @intrinsic
        def parity_wait(typingctx, smem, off, parity):
            if not (isinstance(smem, types.Array) and isinstance(off, types.Integer)
                    and isinstance(parity, types.Integer)):
                return None

            def codegen(context, builder, signature, args):
                addr = _mbar_address(context, builder, signature, args)
                par = context.cast(builder, args[2], signature.args[2], types.uint32)
                return _inline(builder, _I32, [_I32, _I32],
                               "{ .reg .pred p; mbarrier.%s.parity.shared::cta.b64 p, [$1], $2; "
                               "selp.u32 $0, 1, 0, p; }" % op, "=r,r,r,~{memory}", [addr, par])
            return types.int32(smem, off, parity), codegen
        return parity_wait

    mbar_try_wait = _parity_wait("try_wait")
    mbar_test_wait = _parity_wait("test_wait")

    @intrinsic
    def mbar_arrive_expect_tx(typingctx, smem, off, nbytes):
        if not (isinstance(smem, types.Array) and isinstance(off, types.Integer) and isinstance(nbytes, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            addr = _mbar_address(context, builder, signature, args)
            n = context.cast(builder, args[2], signature.args[2], types.uint32)
            _inline(builder, ir.VoidType(), [_I32, _I32],
                    "{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }",
                    "r,r,~{memory}", [addr, n])
            return context.get_dummy_value()
        return types.void(smem, off, nbytes), codegen

    def _tma_load_operands(context, builder, signature, args):
        """(dst, tensor map pointer, c0, c1, mbarrier) of a tma_load_2d call's first six arguments."""
        sm, d_off, tm, x0, x1, b_off = args[:6]
        st, dt, tt, t0, t1, bt = signature.args[:6]
        base = _shared_address_of(context, builder, st, sm)
        return [builder.add(base, context.cast(builder, d_off, dt, types.uint32)),
                builder.ptrtoint(_flat_pointer(context, builder, tt, tm, ir.IntType(8)), _I64),
                context.cast(builder, x0, t0, types.int32), context.cast(builder, x1, t1, types.int32),
                builder.add(base, context.cast(builder, b_off, bt, types.uint32))]

    @intrinsic
    def tma_load_2d(typingctx, smem, dst_byte, tmap, c0, c1, mbar_off):
        if not (isinstance(smem, types.Array) and isinstance(tmap, types.Array)
                and all(isinstance(v, types.Integer) for v in (dst_byte, c0, c1, mbar_off))):
            return None
        sig = types.void(smem, dst_byte, tmap, c0, c1, mbar_off)

        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [_I32, _I64, _I32, _I32, _I32],
                    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                    "[$0], [$1, {$2, $3}], [$4];", "r,l,r,r,r,~{memory}",
                    _tma_load_operands(context, builder, signature, args))
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def tma_store_2d(typingctx, smem, src_byte, tmap, tmap_byte, c0, c1):
        if not (isinstance(smem, types.Array) and isinstance(tmap, types.Array)
                and all(isinstance(v, types.Integer) for v in (src_byte, tmap_byte, c0, c1))):
            return None
        sig = types.void(smem, src_byte, tmap, tmap_byte, c0, c1)

        def codegen(context, builder, signature, args):
            sm, s_off, tm, t_off, x0, x1 = args
            st, so_t, tt, to_t, t0, t1 = signature.args
            src = builder.add(_shared_address_of(context, builder, st, sm), context.cast(builder, s_off, so_t, types.uint32))
            tptr = builder.add(builder.ptrtoint(_flat_pointer(context, builder, tt, tm, ir.IntType(8)), _I64),
                               context.cast(builder, t_off, to_t, types.int64))
            _inline(builder, ir.VoidType(), [_I64, _I32, _I32, _I32],
                    "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [$0, {$1, $2}], [$3];",
                    "l,r,r,r,~{memory}",
                    [tptr, context.cast(builder, x0, t0, types.int32), context.cast(builder, x1, t1, types.int32), src])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def cluster_ctarank(typingctx):
        def codegen(context, builder, signature, args):
            return _inline(builder, _I32, [], "mov.u32 $0, %cluster_ctarank;", "=r", [], side_effect=False)
        return types.uint32(), codegen

    @intrinsic
    def cluster_sync(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [],
                    "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def fence_mbarrier_init_cluster(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "fence.mbarrier_init.release.cluster;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def mbar_arrive_remote(typingctx, smem, off, rank):
        if not (isinstance(smem, types.Array) and isinstance(off, types.Integer) and isinstance(rank, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            addr = _mbar_address(context, builder, signature, args)
            r = context.cast(builder, args[2], signature.args[2], types.uint32)
            _inline(builder, ir.VoidType(), [_I32, _I32],
                    "{ .reg .b32 ra; mapa.shared::cluster.u32 ra, $0, $1; "
                    "mbarrier.arrive.shared::cluster.b64 _, [ra]; }", "r,r,~{memory}", [addr, r])
            return context.get_dummy_value()
        return types.void(smem, off, rank), codegen

    @intrinsic
    def tma_load_2d_multicast(typingctx, smem, dst_byte, tmap, c0, c1, mbar_off, mask):
        if not (isinstance(smem, types.Array) and isinstance(tmap, types.Array)
                and all(isinstance(v, types.Integer) for v in (dst_byte, c0, c1, mbar_off, mask))):
            return None
        sig = types.void(smem, dst_byte, tmap, c0, c1, mbar_off, mask)

        def codegen(context, builder, signature, args):
            m16 = builder.trunc(context.cast(builder, args[6], signature.args[6], types.uint32), ir.IntType(16))
            _inline(builder, ir.VoidType(), [_I32, _I64, _I32, _I32, _I32, ir.IntType(16)],
                    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                    ".multicast::cluster [$0], [$1, {$2, $3}], [$4], $5;", "r,l,r,r,r,h,~{memory}",
                    _tma_load_operands(context, builder, signature, args) + [m16])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def bulk_commit(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "cp.async.bulk.commit_group;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def bulk_wait_read0(typingctx):
        def codegen(context, builder, signature, args):
            _inline(builder, ir.VoidType(), [], "cp.async.bulk.wait_group.read 0;", "~{memory}", [])
            return context.get_dummy_value()
        return types.void(), codegen

    def _sw128_intrinsic(chunks, first=0):
        @intrinsic
        def wgmma_store_bf16x2_sw128(typingctx, smem, base, g, box_words, acc):
            if not (isinstance(smem, types.Array) and smem.dtype == types.uint32 and _is_acc(acc)
                    and all(isinstance(v, types.Integer) for v in (base, g, box_words))):
                return None

            def codegen(context, builder, signature, args):
                sm_t, b_t, g_t, bw_t, acc_t = signature.args
                ary = cgutils.create_struct_proxy(sm_t)(context, builder, value=args[0])
                data = builder.bitcast(ary.data, _I32.as_pointer())
                base_v = context.cast(builder, args[1], b_t, types.int64)
                g_v = context.cast(builder, args[2], g_t, types.int64)
                bw_v = context.cast(builder, args[3], bw_t, types.int64)
                for j in range(first, min(acc_t.count // 4, chunks)):
                    col = builder.shl(builder.xor(g_v, ir.Constant(_I64, j & 7)), ir.Constant(_I64, 2))
                    box = builder.mul(bw_v, ir.Constant(_I64, (j - first) >> 3))
                    for h in range(2):
                        lo = builder.extract_value(args[4], 4 * j + 2 * h)
                        hi = builder.extract_value(args[4], 4 * j + 2 * h + 1)
                        word = _inline(builder, _I32, [_F32, _F32], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                                       [hi, lo], side_effect=False)
                        idx = builder.add(builder.add(base_v, box), builder.add(col, ir.Constant(_I64, 8 * h * 32)))
                        builder.store(word, builder.gep(data, [idx]))
                return context.get_dummy_value()
            return types.void(smem, base, g, box_words, acc), codegen
        return wgmma_store_bf16x2_sw128

    wgmma_store_bf16x2_sw128 = _sw128_intrinsic(1 << 30)
    _SW128_STORERS: dict = {}

    def sw128_storer(chunks, first=0):
        chunks, first = int(chunks), int(first)
        assert first % 8 == 0 and first < chunks, (first, chunks)
        if (chunks, first) not in _SW128_STORERS:
            _SW128_STORERS[chunks, first] = _sw128_intrinsic(chunks, first)
        return _SW128_STORERS[chunks, first]

    _TAIL_STORERS: dict = {}

    def acc_tail_storer(j0):
        j0 = int(j0)
        if j0 in _TAIL_STORERS:
            return _TAIL_STORERS[j0]

        @intrinsic
        def acc_store_tail(typingctx, out, acc, row, col, T, N):
            if not (isinstance(out, types.Array) and out.dtype == types.uint16 and out.ndim == 2
                    and out.layout == "C" and _is_acc(acc)
                    and all(isinstance(v, types.Integer) for v in (row, col, T, N))):
                return None

            def codegen(context, builder, signature, args):
                out_t, acc_t, *rest_t = signature.args
                data16 = _flat_pointer(context, builder, out_t, args[0], ir.IntType(16))
                row_v, col_v, T_v, N_v = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:6], rest_t))
                for h in range(2):
                    r = builder.add(row_v, ir.Constant(_I64, 8 * h))
                    with cgutils.if_likely(builder, builder.icmp_signed("<", r, T_v)):
                        rbase = builder.mul(r, N_v)
                        for j in range(j0, acc_t.count // 4):
                            lo = builder.extract_value(args[1], 4 * j + 2 * h)
                            hi = builder.extract_value(args[1], 4 * j + 2 * h + 1)
                            word = _inline(builder, _I32, [_F32, _F32], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                                           [hi, lo], side_effect=False)
                            n = builder.add(col_v, ir.Constant(_I64, 8 * j))
                            with cgutils.if_likely(builder, builder.icmp_signed("<", n, N_v)):
                                p32 = builder.bitcast(builder.gep(data16, [builder.add(rbase, n)]), _I32.as_pointer())
                                builder.store(word, p32)
                return context.get_dummy_value()
            return types.void(out, acc, row, col, T, N), codegen
        _TAIL_STORERS[j0] = acc_store_tail
        return acc_store_tail

    @device_function(forceinline=True)
    def flag_wait(flags, i):
        while cuda.atomic.add(flags, i, 0) == 0:
            cuda.nanosleep(64)

    def _flat_pointer(context, builder, arrty, arr, elem):
        ary = cgutils.create_struct_proxy(arrty)(context, builder, value=arr)
        return builder.bitcast(ary.data, elem.as_pointer())

    @intrinsic
    def acc_store_f32(typingctx, ws, base, stride, acc):
        if not (isinstance(ws, types.Array) and ws.dtype == types.float32 and _is_acc(acc)
                and isinstance(base, types.Integer) and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ws_t, b_t, s_t, acc_t = signature.args
            data = _flat_pointer(context, builder, ws_t, args[0], _F32)
            b = context.cast(builder, args[1], b_t, types.int64)
            st = context.cast(builder, args[2], s_t, types.int64)
            for i in range(acc_t.count):
                idx = builder.add(b, builder.mul(st, ir.Constant(_I64, i)))
                builder.store(builder.extract_value(args[3], i), builder.gep(data, [idx]))
            return context.get_dummy_value()
        return types.void(ws, base, stride, acc), codegen

    @intrinsic
    def acc_add_f32(typingctx, acc, ws, base, stride):
        if not (isinstance(ws, types.Array) and ws.dtype == types.float32 and _is_acc(acc)
                and isinstance(base, types.Integer) and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            acc_t, ws_t, b_t, s_t = signature.args
            data = _flat_pointer(context, builder, ws_t, args[1], _F32)
            b = context.cast(builder, args[2], b_t, types.int64)
            st = context.cast(builder, args[3], s_t, types.int64)
            vals = []
            for i in range(acc_t.count):
                idx = builder.add(b, builder.mul(st, ir.Constant(_I64, i)))
                ptr = builder.ptrtoint(builder.gep(data, [idx]), _I64)
                v = _inline(builder, _F32, [_I64], "ld.global.cg.f32 $0, [$1];", "=f,l,~{memory}", [ptr])
                vals.append(builder.fadd(builder.extract_value(args[0], i), v))
            return context.make_tuple(builder, acc_t, vals)
        return acc(acc, ws, base, stride), codegen

    @intrinsic
    def acc_store_bf16(typingctx, out, acc, row, col, T, N, pairs):
        if not (isinstance(out, types.Array) and out.dtype == types.uint16 and out.ndim == 2 and out.layout == "C"
                and _is_acc(acc) and all(isinstance(v, (types.Integer, types.Boolean)) for v in (row, col, T, N, pairs))):
            return None

        def codegen(context, builder, signature, args):
            out_t, acc_t, *rest_t = signature.args
            data16 = _flat_pointer(context, builder, out_t, args[0], ir.IntType(16))
            row_v, col_v, T_v, N_v = (context.cast(builder, a, t, types.int64) for a, t in zip(args[2:6], rest_t[:4]))
            pairs_v = builder.icmp_unsigned("!=", context.cast(builder, args[6], rest_t[4], types.int64),
                                            ir.Constant(_I64, 0))
            words = {}
            for j in range(acc_t.count // 4):
                for h in range(2):
                    lo = builder.extract_value(args[1], 4 * j + 2 * h)
                    hi = builder.extract_value(args[1], 4 * j + 2 * h + 1)
                    words[j, h] = _inline(builder, _I32, [_F32, _F32], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                                          [hi, lo], side_effect=False)
            with builder.if_else(pairs_v) as (then, otherwise):
                for as_pairs in (True, False):
                    with (then if as_pairs else otherwise):
                        for h in range(2):
                            r = builder.add(row_v, ir.Constant(_I64, 8 * h))
                            with cgutils.if_likely(builder, builder.icmp_signed("<", r, T_v)):
                                rbase = builder.mul(r, N_v)
                                for j in range(acc_t.count // 4):
                                    n = builder.add(col_v, ir.Constant(_I64, 8 * j))
                                    idx = builder.add(rbase, n)
                                    word = words[j, h]
                                    if as_pairs:
                                        with cgutils.if_likely(builder, builder.icmp_signed("<", n, N_v)):
                                            p32 = builder.bitcast(builder.gep(data16, [idx]), _I32.as_pointer())
                                            builder.store(word, p32)
                                        continue
                                    for c in range(2):
                                        nc = builder.add(n, ir.Constant(_I64, c))
                                        with cgutils.if_likely(builder, builder.icmp_signed("<", nc, N_v)):
                                            half = builder.trunc(builder.lshr(word, ir.Constant(_I32, 16 * c)),
                                                                 ir.IntType(16))
                                            builder.store(half, builder.gep(data16, [builder.add(idx, ir.Constant(_I64, c))]))
            return context.get_dummy_value()
        return types.void(out, acc, row, col, T, N, pairs), codegen

    @device_function(forceinline=True)
    def warp_uniform(x):
        return cuda.shfl_sync(0xFFFFFFFF, x, 0)
