"""Table rows that live in host memory: pinned mapped tables, a side-stream prefetch of the next
chunks' rows, and a hot-row cache in device memory (static, or dynamic: CLOCK).

A table placed in host memory (`EngramV41(..., tables={14: "host"})`) is copied once into pinned,
*mapped* host memory: a kernel reads it through its device address (UVA, zero-copy), so the
rows stage's gather kernels run on it unchanged. What it costs: a scattered row read from host
memory is bound by address translation and PCIe latency, ~43 M rows/s on an H200 against
~4 G rows/s from device memory. Three things hide that:

* `RowFetcher`: the rows of the chunks ahead are copied (raw, in the file's encoding) into device
  buffers while the current chunk computes; the compute stream then decodes from a buffer. Each
  host layer has its own side stream (created at the highest stream priority, so the fetch's few
  blocks are scheduled as soon as an SM frees, not after every block of a many-wave GEMM queued
  before it), so the layers' host reads are in flight together; N_BUFFERS (3) buffers a layer
  let `corpus_stats` fetch two chunks ahead. Events order the reuse, per layer and buffer:
      issue(k):  host waits `fetched[k]` (the previous copy out of pinned ids buffer k is done)
                 side stream waits `consumed[k]` (the decode that last read raw buffer k is done)
                 ids k -> device, fetch kernel -> raw k (+ the cache's insert), record `fetched[k]`
      take(k):   compute stream waits `fetched[k]`; decode raw k; record `consumed[k]` on it
* `RowCache`: a static cache of hot rows in device memory (a budget in bytes): the rows a corpus
  reads most often, ranked from its row ids (`rank_rows`). A dense remap (int32 a table row:
  slot, or -1) lives on the device, so the lookup is one coalesced 4-byte read inside the fetch
  kernel; hits are counted per fetch in device counters (`RowCache.report`). It costs 4 B a table
  row on the device whatever the budget (1.5 GB for a 384M-row table).
* `ClockCache`: a dynamic cache, set-associative (CLOCK_WAYS ways a set) with CLOCK replacement
  inside each set. The lookup is one probe: the row's set (a multiplicative hash of its id) holds
  CLOCK_WAYS int64 tags side by side (32 bytes, one memory sector). A hit copies the cached row
  and sets the slot's reference bit; a miss reads host memory and claims its set for the chunk
  (atomic max of a key that orders claims by chunk, then by the lowest position in the chunk).
  A second kernel, after the fetch on the same stream, inserts each set's winning miss (its row
  is already in the fetch buffer: no second host read): the hand sweeps the set, clearing
  reference bits, to the first way with a clear bit. At most one insert a set a chunk, each set
  touched by one thread, the cache read-only while the fetch reads it: the cache's contents
  depend only on the sequence of chunks (deterministic), and every row is a byte copy of the
  table's (bit-identical). `clock_cache_sim` is its exact CPU twin. No remap: 93 B a slot
  (Q2_K) and nothing a table row.

The fetch kernel moves 4-byte words when every row width is a multiple of 4 (Q2_K 84 B = 21
words, FP8 264 B = 66 words), else bytes; consecutive threads read consecutive words of a row, so
one row is one or two PCIe read bursts.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import cuda, int64, njit

from .intrinsics import SIMULATOR

FETCH_THREADS = 256
FETCH_BLOCKS = 16             # the fetch kernel's grid on a side stream (0: one thread a word); best of 16/64/256/full
N_BUFFERS = 3                 # raw buffers a host layer: the one being decoded, and two chunks ahead
CLOCK_WAYS = 4                # ways a set of the dynamic cache: 4 int64 tags = one 32-byte sector a probe
CACHE_POLICIES = ("static", "clock")
_HASH_MUL = 2654435761        # Knuth's multiplicative hash (2^32 / golden ratio): a row id -> its set
COUNTER_SLOTS = 4096          # per-fetch hit counters kept on the device (a ring)


# -- kernels ---------------------------------------------------------------------------------------
@cuda.jit
def fetch_rows_v1(part1, part2, cache, remap, ids, out, hits, hit_slot):
    """out[r, :] = the raw row ids[r]: from the cache when remap[ids[r]] >= 0, else words 0..W1-1
    from part1 and W1.. from part2 (FP8 codes and their scales held apart; part2 unused when
    W1 = W). part1/part2: [rows, W1] / [rows, W - W1] words (host-mapped or device); cache
    [slots, W]; remap int32 [rows] or [1] (no cache: [-1]); ids int64 [n]; out [n, W];
    hits int64 [COUNTER_SLOTS] += the cache hits of this launch at hit_slot."""
    counted = cuda.shared.array(1, int64)
    if cuda.threadIdx.x == 0:
        counted[0] = 0
    cuda.syncthreads()
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    W = out.shape[1]
    W1 = part1.shape[1]
    n = ids.shape[0]
    while i < n * W:                  # grid-stride: a bounded grid leaves SMs to the compute stream
        r = i // W
        w = i - r * W
        row = ids[r]
        slot = -1
        if row < remap.shape[0]:
            slot = remap[row]
        if slot >= 0:
            out[r, w] = cache[slot, w]
            if w == 0:
                cuda.atomic.add(counted, 0, 1)
        elif w < W1:
            out[r, w] = part1[row, w]
        else:
            out[r, w] = part2[row, w - W1]
        i += stride
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and counted[0] > 0:
        cuda.atomic.add(hits, hit_slot, counted[0])


@cuda.jit
def fetch_rows_pair_v1(a1, a2, a_cache, a_remap, a_ids, a_out, b1, b2, b_cache, b_remap, b_ids, b_out, bad):
    """fetch_rows_v1 for two layers in one launch, one thread a word and no loop: every host read
    of a decode token (both layers' rows) is in flight at once, one PCIe round trip in all, where
    a gather per layer waits one round trip each. Threads [0, na*Wa) copy layer a's rows, the next
    nb*Wb layer b's (b_ids may be empty). No hit counters (a decode token is not a chunk). An id
    outside its table reads nothing: its row is left as it was and counted in bad (uint32 [1])."""
    i = cuda.grid(1)
    na = a_ids.shape[0] * a_out.shape[1]
    if i < na:
        W = a_out.shape[1]
        r = i // W
        w = i - r * W
        row = a_ids[r]
        if row < 0 or row >= a1.shape[0]:
            if w == 0:
                cuda.atomic.add(bad, 0, np.uint32(1))
            return
        slot = -1
        if row < a_remap.shape[0]:
            slot = a_remap[row]
        W1 = a1.shape[1]
        if slot >= 0:
            a_out[r, w] = a_cache[slot, w]
        elif w < W1:
            a_out[r, w] = a1[row, w]
        else:
            a_out[r, w] = a2[row, w - W1]
        return
    i -= na
    if i < b_ids.shape[0] * b_out.shape[1]:
        W = b_out.shape[1]
        r = i // W
        w = i - r * W
        row = b_ids[r]
        if row < 0 or row >= b1.shape[0]:
            if w == 0:
                cuda.atomic.add(bad, 0, np.uint32(1))
            return
        slot = -1
        if row < b_remap.shape[0]:
            slot = b_remap[row]
        W1 = b1.shape[1]
        if slot >= 0:
            b_out[r, w] = b_cache[slot, w]
        elif w < W1:
            b_out[r, w] = b1[row, w]
        else:
            b_out[r, w] = b2[row, w - W1]


class FetchRowsLaunch:
    """A prepared launch (callable, capturable in a CUDA graph) that copies the raw rows of up to
    two host layers at once: `layers` is [(HostLayer, ids device int64 [n], out device [n, W] words)];
    more than two layers take one launch per pair."""

    def __init__(self, layers, stream=0, bad=None):
        self.name = "fetch_rows_pair_v1"
        self.stream = stream
        self.bad = bad if bad is not None else cuda.to_device(np.zeros(1, np.uint32))   # out-of-range ids
        self.launches = []
        for j in range(0, len(layers), 2):
            pair = list(layers[j:j + 2])
            if len(pair) == 1:
                hl, ids, out = pair[0]
                pair.append((hl, ids[:0], out[:0]))
            args = []
            total = 0
            for hl, ids, out in pair:
                if tuple(out.shape[1:]) != (hl.W,) or out.dtype != hl.words or out.shape[0] < ids.shape[0]:
                    raise ValueError(f"layer {hl.layer_id}: fetch output must be [>= {ids.shape[0]}, {hl.W}] "
                                     f"{hl.words}, got {out.dtype}{list(out.shape)}")
                out = out[: ids.shape[0]]
                args += [hl.word_parts[0], hl.word_parts[1], hl.cache.table, hl.cache.remap, ids, out]
                total += int(ids.shape[0]) * hl.W
            self.launches.append((_grid(total), tuple(args) + (self.bad,)))

    def __call__(self):
        for grid, args in self.launches:
            fetch_rows_pair_v1[grid, FETCH_THREADS, self.stream](*args)


@cuda.jit
def _fill_i32(a, value):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] = value


@cuda.jit
def _scatter_slots(remap, rows):
    i = cuda.grid(1)
    if i < rows.shape[0]:
        remap[rows[i]] = i


@cuda.jit
def _scatter_rows(table, slots, rows):
    """table[slots[r], :] = rows[r, :] (a cache fill)."""
    i = cuda.grid(1)
    W = rows.shape[1]
    if i < rows.shape[0] * W:
        r = i // W
        table[slots[r], i - r * W] = rows[r, i - r * W]


@cuda.jit
def clock_fetch_v1(part1, part2, table, tags, ref, claim, seq, ids, out, hits, hit_slot):
    """fetch_rows_v1 through the dynamic cache (module doc): out[r, :] = the raw row ids[r], from
    the cache when its set holds it (then ref[slot] = 1), else from host memory (then the row's
    set is claimed: claim[set] = max(claim[set], seq * 2^32 + 2^32 - 1 - r), so the chunk's
    lowest-positioned miss of a set wins it). tags int64 [sets, ways] (-1: empty); table
    [sets * ways, W] words; ref uint8 [sets * ways]; claim int64 [sets]; seq >= 1 this fetch's
    number; hits int64 [COUNTER_SLOTS] += this launch's hits at hit_slot."""
    counted = cuda.shared.array(1, int64)
    if cuda.threadIdx.x == 0:
        counted[0] = 0
    cuda.syncthreads()
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    W = out.shape[1]
    W1 = part1.shape[1]
    n = ids.shape[0]
    n_sets = tags.shape[0]
    ways = tags.shape[1]
    while i < n * W:
        r = i // W
        w = i - r * W
        row = ids[r]
        s = (((row * 2654435761) & 0xFFFFFFFF) * n_sets) >> 32
        slot = -1
        for j in range(ways):
            if tags[s, j] == row:
                slot = s * ways + j
        if slot >= 0:
            out[r, w] = table[slot, w]
            if w == 0:
                ref[slot] = 1
                cuda.atomic.add(counted, 0, 1)
        else:
            if w < W1:
                out[r, w] = part1[row, w]
            else:
                out[r, w] = part2[row, w - W1]
            if w == 0:
                cuda.atomic.max(claim, s, seq * 4294967296 + (4294967295 - r))
        i += stride
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and counted[0] > 0:
        cuda.atomic.add(hits, hit_slot, counted[0])


@cuda.jit
def clock_insert_v1(table, tags, ref, hand, claim, seq, ids, out, inserted, slot_k):
    """After clock_fetch_v1 of the same ids (same stream): thread r inserts row ids[r] when it won
    its set's claim for fetch `seq`: the hand sweeps the set from hand[set], clearing reference
    bits, to the first empty way or clear bit; the row (already fetched into out[r]) goes there
    with its bit clear, the hand one past it. inserted int64 [COUNTER_SLOTS] += the inserts."""
    counted = cuda.shared.array(1, int64)
    if cuda.threadIdx.x == 0:
        counted[0] = 0
    cuda.syncthreads()
    r = cuda.grid(1)
    if r < ids.shape[0]:
        row = ids[r]
        n_sets = tags.shape[0]
        ways = tags.shape[1]
        s = (((row * 2654435761) & 0xFFFFFFFF) * n_sets) >> 32
        if claim[s] == seq * 4294967296 + (4294967295 - r):
            h = int64(hand[s])
            victim = h
            for step in range(2 * ways):
                j = (h + step) % ways
                if tags[s, j] < 0 or ref[s * ways + j] == 0:
                    victim = j
                    break
                ref[s * ways + j] = 0
            q = s * ways + victim
            tags[s, victim] = row
            ref[q] = 0
            hand[s] = (victim + 1) % ways
            for w in range(out.shape[1]):
                table[q, w] = out[r, w]
            cuda.atomic.add(counted, 0, 1)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0 and counted[0] > 0:
        cuda.atomic.add(inserted, slot_k, counted[0])


def _grid(n: int) -> int:
    return max(1, (n + FETCH_THREADS - 1) // FETCH_THREADS)


def nonblocking_stream(high_priority: bool = False):
    """A stream that does not synchronise with the legacy default stream (stream 0): a prefetch
    on it overlaps kernels and copies that callers queue on stream 0. high_priority: at the
    device's greatest stream priority (its blocks are dispatched before pending blocks of
    lower-priority streams). The simulator's streams."""
    if SIMULATOR:
        return cuda.stream()
    from numba.cuda.cudadrv.driver import Stream, _stream_finalizer, binding, driver
    ctx = cuda.current_context()
    flags = binding.CUstream_flags.CU_STREAM_NON_BLOCKING.value
    if high_priority:
        _, greatest = driver.cuCtxGetStreamPriorityRange()
        handle = driver.cuStreamCreateWithPriority(flags, int(greatest))
    else:
        handle = driver.cuStreamCreate(flags)
    return Stream(handle, finalizer=_stream_finalizer(ctx.deallocations, handle))


# -- word views ------------------------------------------------------------------------------------
def word_dtype(*widths: int):
    """uint32 when every byte width is a multiple of 4, else uint8."""
    return np.uint32 if all(int(w) % 4 == 0 for w in widths) else np.uint8


def as_words(dev_u8, dtype):
    """A device uint8 [n, b] array seen as [n, b / itemsize] words (no copy)."""
    return dev_u8 if np.dtype(dtype) == np.uint8 else dev_u8.view(dtype)


# -- host tables -----------------------------------------------------------------------------------
class HostTable:
    """A table copied into pinned, mapped host memory. `dev` is its device view (what kernels
    read, through UVA); `host` the numpy view of the same bytes. In numba's simulator it is a
    device array (the simulator has no host/device split)."""

    def __init__(self, shape, what: str = "table"):
        self.shape = tuple(int(x) for x in shape)
        self.what = what
        self.nbytes = int(np.prod(self.shape))
        self._mapped = cuda.mapped_array(self.shape, dtype=np.uint8)
        if SIMULATOR:
            self.dev = self._mapped
            self.host = None
        else:
            self.dev = self._mapped.view(np.uint8)                           # DeviceNDArray over mapped memory
            self.host = np.ndarray.view(self._mapped, np.ndarray)            # [rows, width] uint8

    def fill(self, src, threads: int = 8, chunk_rows: int = 1 << 18) -> float:
        """Copy `src` ([rows, width] uint8: an array, a memmap, or anything whose row slices
        `src[r0:r1]` give arrays) in; returns the seconds it took."""
        import time
        t0 = time.perf_counter()
        rows = self.shape[0]
        if SIMULATOR:
            self.dev.copy_to_device(np.ascontiguousarray(np.asarray(src[0:rows]), dtype=np.uint8))
            return time.perf_counter() - t0

        def part(r0):
            r1 = min(rows, r0 + chunk_rows)
            np.copyto(self.host[r0:r1], np.asarray(src[r0:r1], dtype=np.uint8))

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="engram-hostfill") as pool:
            list(pool.map(part, range(0, rows, chunk_rows)))
        return time.perf_counter() - t0

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Host copy of rows `ids` (for the cache fill)."""
        if self.host is not None:
            return self.host[ids]
        return self.dev.copy_to_host()[ids]


# -- the hot-row cache -----------------------------------------------------------------------------
def rank_rows(row_ids, n_rows: int | None = None) -> np.ndarray:
    """Row ids by how often `row_ids` (any shape, e.g. [T, C] of one layer from the hasher) reads
    them, most frequent first (ties: the smaller id first)."""
    flat = np.asarray(row_ids).reshape(-1).astype(np.int64, copy=False)
    if n_rows is not None and flat.size and (flat.min() < 0 or flat.max() >= n_rows):
        raise ValueError(f"row ids must lie in [0, {n_rows}), got {int(flat.min())}..{int(flat.max())}")
    rows, counts = np.unique(flat, return_counts=True)
    order = np.lexsort((rows, -counts))
    return rows[order]


def cache_hit_rates(train_ids, test_ids, slots) -> dict:
    """Hit rate of a static cache of the `slots` most frequent rows of `train_ids`, on the reads
    of `test_ids` (held out): {slots: hit rate}. The host-side twin of the device counters."""
    ranked = rank_rows(train_ids)
    test = np.asarray(test_ids).reshape(-1)
    out = {}
    for s in slots:
        s = int(s)
        hot = np.sort(ranked[:s])
        if test.size == 0 or hot.size == 0:
            out[s] = 0.0
            continue
        pos = np.minimum(np.searchsorted(hot, test), hot.size - 1)
        out[s] = float(np.mean(hot[pos] == test))
    return out


class RowCache:
    """Hot rows of one host table in device memory (module doc). Budget -> `n_slots` rows of
    `row_bytes`; the remap costs 4 B a table row on the device as well (`device_bytes`)."""

    def __init__(self, n_rows: int, row_bytes: int, budget_bytes: int, words):
        self.n_rows, self.row_bytes = int(n_rows), int(row_bytes)
        self.words = np.dtype(words)
        self.W = self.row_bytes // self.words.itemsize
        self.n_slots = max(0, min(int(budget_bytes) // self.row_bytes, self.n_rows))
        self.rows = np.zeros(0, np.int64)               # row ids held, by slot
        if self.n_slots:
            self.table = cuda.device_array((self.n_slots, self.W), dtype=self.words)   # [slots, W] words
            self.remap = cuda.device_array(self.n_rows, dtype=np.int32)               # row -> slot, or -1
            _fill_i32[_grid(self.n_rows), FETCH_THREADS](self.remap, -1)
        else:
            self.table = cuda.device_array((1, self.W), dtype=self.words)
            self.remap = cuda.to_device(np.full(1, -1, np.int32))
        self.hits = cuda.to_device(np.zeros(COUNTER_SLOTS, np.int64))
        self.fetches: list[int] = []                    # rows read by each fetch, in order

    @staticmethod
    def device_bytes_for(n_rows: int, row_bytes: int, budget_bytes: int) -> int:
        slots = max(0, min(int(budget_bytes) // int(row_bytes), int(n_rows)))
        return slots * int(row_bytes) + (4 * int(n_rows) if slots else 4) + 8 * COUNTER_SLOTS

    @property
    def device_bytes(self) -> int:
        return int(self.table.nbytes) + int(self.remap.nbytes) + int(self.hits.nbytes)

    def fill(self, ranked_rows, read_rows) -> int:
        """Hold the first `n_slots` rows of `ranked_rows` (most wanted first; `rank_rows`);
        read_rows(ids) -> their raw bytes [k, row_bytes] uint8. Returns the rows held."""
        if not self.n_slots:
            return 0
        ranked = np.asarray(ranked_rows, dtype=np.int64).reshape(-1)
        if ranked.size and (ranked.min() < 0 or ranked.max() >= self.n_rows):
            raise ValueError(f"cache rows must lie in [0, {self.n_rows}), got {int(ranked.min())}..{int(ranked.max())}")
        _, first = np.unique(ranked, return_index=True)
        rows = ranked[np.sort(first)][: self.n_slots]         # distinct, rank order kept
        raw = np.ascontiguousarray(read_rows(rows), dtype=np.uint8)
        if raw.shape != (rows.size, self.row_bytes):
            raise ValueError(f"cache fill: read {list(raw.shape)} bytes, expected [{rows.size}, {self.row_bytes}]")
        if self.rows.size:                                    # refill: forget the old slots first
            _fill_i32[_grid(self.n_rows), FETCH_THREADS](self.remap, -1)
        if rows.size:
            self.table[: rows.size].copy_to_device(raw.view(self.words).reshape(rows.size, self.W))
            d_rows = cuda.to_device(rows)
            _scatter_slots[_grid(rows.size), FETCH_THREADS](self.remap, d_rows)
        self.rows = rows
        if not SIMULATOR:
            cuda.synchronize()
        return int(rows.size)

    def next_counter(self, n_rows_read: int) -> int:
        """The counter slot of the next fetch (which reads n_rows_read rows)."""
        k = len(self.fetches) % COUNTER_SLOTS
        self.fetches.append(int(n_rows_read))
        return k

    def report(self) -> dict:
        """Per fetch (the last COUNTER_SLOTS): hits, misses, bytes from host memory and from the
        cache; and the totals. Synchronises."""
        if not SIMULATOR:
            cuda.synchronize()
        hits = self.hits.copy_to_host()
        n = len(self.fetches)
        first = max(0, n - COUNTER_SLOTS)
        per = []
        for j in range(first, n):
            h = int(hits[j % COUNTER_SLOTS])
            m = self.fetches[j] - h
            per.append({"fetch": j, "rows": self.fetches[j], "hits": h, "misses": m,
                        "host_bytes": m * self.row_bytes, "cache_bytes": h * self.row_bytes})
        th = sum(p["hits"] for p in per)
        tr = sum(p["rows"] for p in per)
        return {"slots": self.n_slots, "rows_held": int(self.rows.size), "budget_bytes": self.n_slots * self.row_bytes,
                "device_bytes": self.device_bytes, "fetches": n, "hits": th, "misses": tr - th,
                "hit_rate": (th / tr) if tr else 0.0, "host_bytes": (tr - th) * self.row_bytes,
                "cache_bytes": th * self.row_bytes, "per_fetch": per}


def clock_sets(n_rows: int, row_bytes: int, budget_bytes: int, ways: int = CLOCK_WAYS) -> int:
    """Sets of a ClockCache with this budget (each holds `ways` rows; 0: no cache)."""
    slots = max(0, min(int(budget_bytes) // int(row_bytes), int(n_rows)))
    return slots // int(ways)


def clock_set_of(rows, n_sets: int) -> np.ndarray:
    """The set of each row id (the kernels' hash, on the host)."""
    rows = np.asarray(rows, dtype=np.int64)
    return (((rows * _HASH_MUL) & 0xFFFFFFFF) * int(n_sets)) >> 32


class ClockCache:
    """Hot rows of one host table in device memory, kept by CLOCK in a set-associative array
    (module doc). Budget -> `n_sets` sets of `ways` rows of `row_bytes`; a slot costs row_bytes +
    9 B of tags and reference bit, a set 9 B more (hand and claim): nothing a table row. Filled by
    the fetches themselves; `fill` warm-starts it from ranked rows. Same report as RowCache, plus
    the rows inserted per fetch. `remap` is a one-entry [-1] so kernels that only know the static
    lookup (the decode graph's fetch) read host memory and leave the cache alone."""

    policy = "clock"

    def __init__(self, n_rows: int, row_bytes: int, budget_bytes: int, words, ways: int = CLOCK_WAYS):
        self.n_rows, self.row_bytes = int(n_rows), int(row_bytes)
        self.words = np.dtype(words)
        self.W = self.row_bytes // self.words.itemsize
        self.ways = int(ways)
        if self.ways < 1:
            raise ValueError(f"a ClockCache needs >= 1 way a set, got {ways}")
        self.n_sets = clock_sets(n_rows, row_bytes, budget_bytes, self.ways)
        self.n_slots = self.n_sets * self.ways
        sets = max(1, self.n_sets)
        self.table = cuda.device_array((max(1, self.n_slots), self.W), dtype=self.words)   # [sets * ways, W] words
        self.tags = cuda.device_array((sets, self.ways), dtype=np.int64)                   # row held, or -1
        self.ref = cuda.device_array(max(1, self.n_slots), dtype=np.uint8)                 # CLOCK reference bits
        self.hand = cuda.device_array(sets, dtype=np.uint8)                                # next way to look at
        self.claim = cuda.device_array(sets, dtype=np.int64)                               # a chunk's insert winner
        self.remap = cuda.to_device(np.full(1, -1, np.int32))
        self.hits = cuda.to_device(np.zeros(COUNTER_SLOTS, np.int64))
        self.inserted = cuda.to_device(np.zeros(COUNTER_SLOTS, np.int64))
        self.fetches: list[int] = []
        self.seq = 0                                   # fetches so far (the claims' generation)
        self.rows = np.zeros(0, np.int64)              # rows a fill put in (warm start)
        self._reset()

    @staticmethod
    def device_bytes_for(n_rows: int, row_bytes: int, budget_bytes: int, ways: int = CLOCK_WAYS) -> int:
        sets = max(1, clock_sets(n_rows, row_bytes, budget_bytes, ways))
        slots = max(1, sets * int(ways))
        return slots * (int(row_bytes) + 9) + sets * 9 + 4 + 16 * COUNTER_SLOTS

    @property
    def device_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.table, self.tags, self.ref, self.hand, self.claim, self.remap,
                                            self.hits, self.inserted))

    def _reset(self) -> None:
        sets = self.tags.shape[0]
        self.tags.copy_to_device(np.full((sets, self.ways), -1, np.int64))
        self.ref.copy_to_device(np.zeros(self.ref.shape[0], np.uint8))
        self.hand.copy_to_device(np.zeros(sets, np.uint8))
        self.claim.copy_to_device(np.zeros(sets, np.int64))

    def fill(self, ranked_rows, read_rows) -> int:
        """Empty the cache, then warm-start it: each of `ranked_rows` (most wanted first) goes to
        the next free way of its set while the set has one. read_rows(ids) -> raw bytes [k,
        row_bytes] uint8. Returns the rows held. `fill([], ...)` only empties it."""
        ranked = np.asarray(ranked_rows, dtype=np.int64).reshape(-1)
        if ranked.size and (ranked.min() < 0 or ranked.max() >= self.n_rows):
            raise ValueError(f"cache rows must lie in [0, {self.n_rows}), got {int(ranked.min())}..{int(ranked.max())}")
        if not SIMULATOR:
            cuda.synchronize()                          # no fetch may read the cache while it changes
        self._reset()
        if not self.n_sets or not ranked.size:
            self.rows = np.zeros(0, np.int64)
            return 0
        _, first = np.unique(ranked, return_index=True)
        ranked = ranked[np.sort(first)]                 # distinct, rank order kept
        sets = clock_set_of(ranked, self.n_sets)
        order = np.argsort(sets, kind="stable")         # by set, rank order inside a set
        ss = sets[order]
        start = np.r_[0, np.flatnonzero(np.diff(ss)) + 1]
        way = np.empty(ss.size, np.int64)              # each row's way: its rank inside its set
        way[order] = np.arange(ss.size) - np.repeat(start, np.diff(np.r_[start, ss.size]))
        keep = np.flatnonzero(way < self.ways)          # rank order
        rows, rsets, rways = ranked[keep], sets[keep], way[keep]
        tags = np.full((self.n_sets, self.ways), -1, np.int64)
        tags[rsets, rways] = rows
        raw = np.ascontiguousarray(read_rows(rows), dtype=np.uint8)
        if raw.shape != (rows.size, self.row_bytes):
            raise ValueError(f"cache fill: read {list(raw.shape)} bytes, expected [{rows.size}, {self.row_bytes}]")
        self.tags.copy_to_device(tags)
        hand = np.zeros(self.n_sets, np.int64)
        np.maximum.at(hand, rsets, rways + 1)
        self.hand.copy_to_device((hand % self.ways).astype(np.uint8))
        d_rows = cuda.to_device(raw.view(self.words).reshape(rows.size, self.W))
        d_slots = cuda.to_device(rsets * self.ways + rways)
        _scatter_rows[_grid(rows.size * self.W), FETCH_THREADS](self.table, d_slots, d_rows)
        if not SIMULATOR:
            cuda.synchronize()
        self.rows = rows
        return int(rows.size)

    def next_counter(self, n_rows_read: int) -> int:
        k = len(self.fetches) % COUNTER_SLOTS
        self.fetches.append(int(n_rows_read))
        self.seq += 1
        return k

    def launch(self, hl, ids, out, stream, max_blocks: int) -> None:
        """The fetch of `ids` (device int64 [n]) into out [n, W] through the cache, then the inserts."""
        n = int(ids.shape[0])
        counter = self.next_counter(n)
        grid = _grid(n * self.W) if not max_blocks else min(_grid(n * self.W), max_blocks)
        clock_fetch_v1[grid, FETCH_THREADS, stream](hl.word_parts[0], hl.word_parts[1], self.table, self.tags, self.ref,
                                                    self.claim, self.seq, ids, out, self.hits, counter)
        clock_insert_v1[_grid(n), FETCH_THREADS, stream](self.table, self.tags, self.ref, self.hand, self.claim,
                                                         self.seq, ids, out, self.inserted, counter)

    def report(self) -> dict:
        """Per fetch (the last COUNTER_SLOTS): hits, misses, rows inserted, bytes from host memory
        and from the cache; and the totals. Synchronises."""
        if not SIMULATOR:
            cuda.synchronize()
        hits, ins = self.hits.copy_to_host(), self.inserted.copy_to_host()
        n = len(self.fetches)
        per = []
        for j in range(max(0, n - COUNTER_SLOTS), n):
            h, m = int(hits[j % COUNTER_SLOTS]), self.fetches[j] - int(hits[j % COUNTER_SLOTS])
            per.append({"fetch": j, "rows": self.fetches[j], "hits": h, "misses": m, "inserted": int(ins[j % COUNTER_SLOTS]),
                        "host_bytes": m * self.row_bytes, "cache_bytes": h * self.row_bytes})
        th, tr = sum(p["hits"] for p in per), sum(p["rows"] for p in per)
        held = int(np.count_nonzero(self.tags.copy_to_host() >= 0)) if self.n_sets else 0
        return {"policy": "clock", "ways": self.ways, "sets": self.n_sets, "slots": self.n_slots, "rows_held": held,
                "budget_bytes": self.n_slots * self.row_bytes, "device_bytes": self.device_bytes, "fetches": n,
                "hits": th, "misses": tr - th, "inserted": sum(p["inserted"] for p in per),
                "hit_rate": (th / tr) if tr else 0.0, "host_bytes": (tr - th) * self.row_bytes,
                "cache_bytes": th * self.row_bytes, "per_fetch": per}


@njit(cache=False)
def _clock_chunks(ids, starts, tags, ref, hand, hits, inserted):  # pragma: no cover - compiled
    n_sets, ways = tags.shape
    stamp = np.full(n_sets, -1, np.int64)          # the chunk that claimed the set
    winner = np.zeros(n_sets, np.int64)            # ... and its position
    for c in range(starts.size - 1):
        a, b = starts[c], starts[c + 1]
        for i in range(a, b):                      # the fetch: lookups, claims (lowest position wins)
            row = ids[i]
            s = (((row * 2654435761) & 0xFFFFFFFF) * n_sets) >> 32
            hit = False
            for j in range(ways):
                if tags[s, j] == row:
                    ref[s * ways + j] = 1
                    hit = True
            if hit:
                hits[c] += 1
            elif stamp[s] != c:
                stamp[s] = c
                winner[s] = i
        for i in range(a, b):                      # the inserts
            row = ids[i]
            s = (((row * 2654435761) & 0xFFFFFFFF) * n_sets) >> 32
            if stamp[s] == c and winner[s] == i:
                h = hand[s]
                victim = h
                for step in range(2 * ways):
                    j = (h + step) % ways
                    if tags[s, j] < 0 or ref[s * ways + j] == 0:
                        victim = j
                        break
                    ref[s * ways + j] = 0
                tags[s, victim] = row
                ref[s * ways + victim] = 0
                hand[s] = (victim + 1) % ways
                inserted[c] += 1


def clock_cache_sim(chunks, n_sets: int, ways: int = CLOCK_WAYS, state=None) -> dict:
    """The exact CPU twin of ClockCache's fetches: `chunks` a list of row-id arrays (one a fetch,
    in order). Returns per-fetch hits and inserts and the final state (tags [sets, ways], ref,
    hand); `state` (a previous result) continues from where it ended (warm runs)."""
    n_sets, ways = int(n_sets), int(ways)
    if state is None:
        tags = np.full((max(1, n_sets), ways), -1, np.int64)
        ref = np.zeros(max(1, n_sets) * ways, np.uint8)
        hand = np.zeros(max(1, n_sets), np.int64)
    else:
        tags, ref, hand = state["tags"], state["ref"], state["hand"]
    flat = [np.asarray(c, dtype=np.int64).reshape(-1) for c in chunks]
    ids = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    starts = np.r_[0, np.cumsum([f.size for f in flat])].astype(np.int64)
    hits = np.zeros(len(flat), np.int64)
    inserted = np.zeros(len(flat), np.int64)
    if n_sets and ids.size:
        _clock_chunks(ids, starts, tags, ref, hand, hits, inserted)
    return {"hits": hits, "inserted": inserted, "reads": np.diff(starts), "tags": tags, "ref": ref, "hand": hand}


@njit(cache=False)
def _stack_distances(dense, n_distinct):  # pragma: no cover - compiled
    n = dense.size
    tree = np.zeros(n + 1, np.int64)               # Fenwick tree over positions: 1 at each row's last read
    last = np.full(n_distinct, -1, np.int64)
    out = np.full(n, -1, np.int64)
    for i in range(n):
        r = dense[i]
        p = last[r]
        if p >= 0:
            # distinct rows read since p = marks in (p, i)
            tot = 0
            k = i                                  # prefix sum over positions [0, i)
            while k > 0:
                tot += tree[k]
                k -= k & (-k)
            k = p + 1                              # minus the prefix over [0, p]
            while k > 0:
                tot -= tree[k]
                k -= k & (-k)
            out[i] = tot
            k = p + 1
            while k <= n:
                tree[k] -= 1
                k += k & (-k)
        k = i + 1
        while k <= n:
            tree[k] += 1
            k += k & (-k)
        last[r] = i
    return out


def lru_stack_distances(row_ids) -> np.ndarray:
    """Per read, the number of distinct other rows read since the last read of the same row (-1:
    its first read). A fully associative LRU cache of S rows hits exactly the reads whose distance
    is < S (the ideal the dynamic policies are measured against)."""
    flat = np.asarray(row_ids, dtype=np.int64).reshape(-1)
    if not flat.size:
        return np.zeros(0, np.int64)
    uniq, dense = np.unique(flat, return_inverse=True)
    return _stack_distances(dense.astype(np.int64), uniq.size)


# -- the fetcher: raw rows of host layers, chunks ahead -------------------------------------------
class HostLayer:
    """What the fetcher needs of one host-resident layer."""

    def __init__(self, layer_id: int, parts: list, row_bytes: int, n_rows: int, cache: RowCache | None):
        self.layer_id = int(layer_id)
        self.parts = parts            # [device uint8 views]: the whole row, or (codes, scales)
        self.row_bytes = int(row_bytes)
        self.n_rows = int(n_rows)
        widths = [int(p.shape[1]) for p in parts]
        if sum(widths) != self.row_bytes:
            raise ValueError(f"layer {layer_id}: host table parts are {widths} bytes wide, a row is {row_bytes}")
        self.words = np.dtype(word_dtype(*widths))
        self.word_parts = [as_words(p, self.words) for p in parts]
        if len(self.word_parts) == 1:
            self.word_parts.append(self.word_parts[0])        # part2 unused (W1 = W)
        self.W = self.row_bytes // self.words.itemsize
        self.cache = cache if cache is not None else RowCache(n_rows, row_bytes, 0, self.words)


class RowFetcher:
    """Raw rows of the host layers, fetched on side streams into N_BUFFERS buffers a layer (module
    doc).

    layers: [HostLayer]; max_rows: rows a layer a chunk (max_tokens * n_hash_cols);
    compute_stream: the stream that decodes (the engine's). `side_stream` (one stream for every
    layer) and `event_factory` are for tests (the simulator's events are no-ops, so the ordering
    is checked on recorded calls); by default each layer gets its own high-priority stream."""

    def __init__(self, layers, max_rows: int, compute_stream=0, *, side_stream=None, event_factory=None):
        self.layers = {hl.layer_id: hl for hl in layers}
        self.order = [hl.layer_id for hl in layers]
        self.max_rows = int(max_rows)
        self.compute = compute_stream
        if side_stream is not None:
            self.sides = {lid: side_stream for lid in self.order}
        else:
            self.sides = {lid: nonblocking_stream(high_priority=True) for lid in self.order}
        self.side = self.sides[self.order[0]] if self.order else side_stream
        ev = event_factory or (lambda name: cuda.event() if SIMULATOR else cuda.event(timing=False))
        L = len(self.order)
        one = L == 1
        self.ids_host = [cuda.pinned_array((L, self.max_rows), dtype=np.int64) for _ in range(N_BUFFERS)]
        self.ids_dev = [cuda.device_array((L, self.max_rows), dtype=np.int64) for _ in range(N_BUFFERS)]
        self.raw = [{lid: cuda.device_array((self.max_rows, self.layers[lid].W), dtype=self.layers[lid].words)
                     for lid in self.order} for _ in range(N_BUFFERS)]
        # events per buffer and layer ("fetched0" alone when one layer)
        self.fetched = [{lid: ev(f"fetched{k}" if one else f"fetched{k}.{lid}") for lid in self.order}
                        for k in range(N_BUFFERS)]
        self.consumed = [{lid: ev(f"consumed{k}" if one else f"consumed{k}.{lid}") for lid in self.order}
                         for k in range(N_BUFFERS)]
        self.fetch_pending = [set() for _ in range(N_BUFFERS)]      # layers whose fetched[k] the host has not waited
        self.consume_recorded = [set() for _ in range(N_BUFFERS)]
        self.slot_rows = [dict() for _ in range(N_BUFFERS)]   # lid -> rows fetched into buffer k (untaken)
        self.queue: list[int] = []                   # buffers holding fetched, untaken rows, oldest first
        self.next = 0
        self.issued = 0
        self.taken = 0
        self.missed = 0                              # takes that found no matching prefetch
        self._taken_lid = None
        # A host read waits ~1 us on PCIe and address translation: a full grid of such blocks holds
        # every SM and stalls the compute stream's kernels, so the side streams get a bounded grid.
        self.max_blocks = FETCH_BLOCKS

    @property
    def device_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.ids_dev) + sum(int(a.nbytes) for r in self.raw for a in r.values())

    def raw_bytes_view(self, k: int, lid: int, n: int):
        """Buffer k of layer lid as uint8 [n, row_bytes] (what the decode kernel reads)."""
        hl = self.layers[lid]
        return self.raw[k][lid][:n].view(np.uint8) if hl.words != np.uint8 else self.raw[k][lid][:n]

    def issue(self, ids_by_layer: dict) -> int:
        """Start fetching {layer id: row ids (any shape, flattened in C order; int64, checked in
        range)} on the layers' side streams; returns the buffer index."""
        k = self.next
        self.next = (k + 1) % N_BUFFERS
        for lid in self.order:
            if lid in self.fetch_pending[k]:
                self.fetched[k][lid].synchronize()   # the copy out of ids_host[k] is done
        self.fetch_pending[k] = set()
        if k in self.queue:                          # never taken: dropped
            self.queue.remove(k)
        self.slot_rows[k] = {}
        host, dev = self.ids_host[k], self.ids_dev[k]
        for li, lid in enumerate(self.order):
            ids = ids_by_layer.get(lid)
            if ids is None:
                continue
            ids = np.asarray(ids)
            n = int(ids.size)
            if n > self.max_rows:
                raise ValueError(f"prefetch: {n} rows for layer {lid} exceed the fetcher's {self.max_rows}")
            host[li, :n].reshape(ids.shape)[...] = ids        # one copy, straight into pinned memory
            self.slot_rows[k][lid] = n
        for li, lid in enumerate(self.order):
            n = self.slot_rows[k].get(lid)
            if not n:
                continue
            side = self.sides[lid]
            if lid in self.consume_recorded[k]:
                self.consumed[k][lid].wait(side)     # the decode that last read raw[k] is done
            dev[li, :n].copy_to_device(host[li, :n], stream=side)
            hl = self.layers[lid]
            out = self.raw[k][lid][:n]
            if getattr(hl.cache, "policy", "static") == "clock":
                hl.cache.launch(hl, dev[li, :n], out, side, self.max_blocks)
            else:
                counter = hl.cache.next_counter(n)
                grid = _grid(n * hl.W) if not self.max_blocks else min(_grid(n * hl.W), self.max_blocks)
                fetch_rows_v1[grid, FETCH_THREADS, side](
                    hl.word_parts[0], hl.word_parts[1], hl.cache.table, hl.cache.remap, dev[li, :n], out,
                    hl.cache.hits, counter)
            self.fetched[k][lid].record(side)
            self.fetch_pending[k].add(lid)
        self.consume_recorded[k] -= set(self.slot_rows[k])
        self.queue.append(k)
        self.issued += 1
        return k

    def match(self, lid: int, ids: np.ndarray):
        """The buffer holding prefetched rows `ids` of layer lid (oldest first), or None."""
        n = int(ids.size)
        li = self.order.index(lid)
        for k in self.queue:
            if self.slot_rows[k].get(lid) == n and np.array_equal(self.ids_host[k][li, :n], ids.reshape(-1)):
                return k
        return None

    def take(self, lid: int, k: int):
        """Let the compute stream wait for buffer k's fetch of layer lid; returns its uint8 view."""
        n = self.slot_rows[k].pop(lid)
        if not self.slot_rows[k]:
            self.queue.remove(k)
        self.fetched[k][lid].wait(self.compute)
        self.taken += 1
        self._taken_lid = lid
        return self.raw_bytes_view(k, lid, n)

    def release(self, k: int, lid: int | None = None) -> None:
        """The compute stream's reads of buffer k (of layer lid; default: the layer last taken)
        are queued: record that point."""
        lid = self._taken_lid if lid is None else lid
        self.consumed[k][lid].record(self.compute)
        self.consume_recorded[k].add(lid)

    def close(self) -> None:
        if not SIMULATOR:
            for side in {id(x): x for x in self.sides.values()}.values():
                side.synchronize()
