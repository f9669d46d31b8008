"""Per n-gram context counts and fixed-point gate sums with a cap: the hash table behind
`StreamingGateStats.top_contexts` (`engram_numba.analysis.streaming` describes the cap and the
undercount bound it reports)."""
from __future__ import annotations

import numpy as np
from numba import njit


# A context table's slot is one int64 record [W key words | count | L*hc gate sums]: one cache
# miss per token instead of three. count 0 marks an empty slot.

@njit(cache=True, nogil=True, inline="always")
def _home(key, W, mask):  # pragma: no cover - jitted
    """The first slot probed for `key` in a table of mask + 1 slots."""
    h = np.uint64(0x9E3779B97F4A7C15)
    for w in range(W):
        h = (h ^ np.uint64(key[w])) * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
    return np.int64(h & np.uint64(mask))


@njit(cache=True, nogil=True)
def _slot_of(slots, W, key):  # pragma: no cover - jitted
    """The slot holding `key`, or the empty slot where it goes (linear probing; never full)."""
    mask = slots.shape[0] - 1
    i = _home(key, W, mask)
    while slots[i, W] != 0:
        same = True
        for w in range(W):
            if slots[i, w] != key[w]:
                same = False
                break
        if same:
            return i
        i = (i + 1) & mask
    return i


@njit(cache=True, nogil=True)
def _ctx_add_tokens(slots, W, windows, live, q, order, bits, per_word):  # pragma: no cover - jitted
    """Count every live token's context of `order` (slots 0..order-1 of windows [T, M]) and add its
    fixed-point gates q [T, L*hc]; returns (new contexts, the largest count touched)."""
    key = np.zeros(W, np.int64)
    G = q.shape[1]
    new = 0
    top = 0
    for t in range(windows.shape[0]):
        if not live[t]:
            continue
        for w in range(W):
            key[w] = 0
        for s in range(order):
            key[s // per_word] |= windows[t, s] << (bits * (s % per_word))
        i = _slot_of(slots, W, key)
        if slots[i, W] == 0:
            for w in range(W):
                slots[i, w] = key[w]
            new += 1
        slots[i, W] += 1
        if slots[i, W] > top:
            top = slots[i, W]
        for g in range(G):
            slots[i, W + 1 + g] += q[t, g]
    return new, top


@njit(cache=True, nogil=True)
def _ctx_add_entries(slots, W, entries):  # pragma: no cover - jitted
    """Add records entries [n, W + 1 + L*hc] (key, count, sums); returns the number of new contexts."""
    new = 0
    R = entries.shape[1]
    for j in range(entries.shape[0]):
        i = _slot_of(slots, W, entries[j, :W])
        if slots[i, W] == 0:
            for w in range(W):
                slots[i, w] = entries[j, w]
            new += 1
        for r in range(W, R):
            slots[i, r] += entries[j, r]
    return new


class ContextTable:
    """Occurrences and fixed-point gate sums per n-gram context of one order, with a cap (module doc).

    An open-addressing hash table (one int64 record a slot, @njit inserts, no sorting per chunk),
    kept under half full. Read it through `keys` [G, W] int64 (packed contexts), `count` [G] int64
    and `gsum` [G, L, hc] int64, sorted by key. 8 (W + 1 + L hc) bytes a slot.
    """

    def __init__(self, order: int, width: int, n_layers: int, hc: int, cap: int, bits: int = 21, per_word: int = 3):
        self.order, self.width, self.n_layers, self.hc, self.cap = order, width, n_layers, hc, int(cap)
        self.bits, self.per_word = bits, per_word
        self.n = 0
        self._alloc(1024)
        self.prunes = 0
        self.dropped_entries = 0
        self.dropped_occurrences = 0
        self.undercount_bound = 0
        self._compact = None
        self._pending: list = []             # futures of chunks handed to a lane (add_tokens_on)

    def _alloc(self, slots: int) -> None:
        self._slots = np.zeros((slots, self.width + 1 + self.n_layers * self.hc), np.int64)

    @property
    def exact(self) -> bool:
        self.flush()
        return self.prunes == 0

    def _records(self) -> np.ndarray:
        return self._slots[np.flatnonzero(self._slots[:, self.width])]

    def _reserve(self, more: int) -> None:
        """Keep the load under 1/2 with `more` new contexts."""
        need = self.n + more
        slots = self._slots.shape[0]
        if 2 * need <= slots:
            return
        while 2 * need > slots:
            slots *= 2
        records = self._records()
        self._alloc(slots)
        self.n = int(_ctx_add_entries(self._slots, self.width, records))

    def add_tokens(self, windows: np.ndarray, live: np.ndarray, q: np.ndarray) -> None:
        """One chunk: windows [T, M] compressed ids, live [T] bool, q [T, L, hc] fixed-point gates."""
        self.flush()
        self._add_tokens(windows, live, q)

    def add_tokens_on(self, lane, windows: np.ndarray, live: np.ndarray, q: np.ndarray, ahead: int = 16) -> None:
        """add_tokens on `lane`, an executor with one thread that only this table uses (so chunks
        are added in order), without waiting: at most `ahead` chunks are left pending, and every
        read of the table (and `flush`) waits for them first, raising what they raised."""
        self.__dict__.setdefault("_pending", [])
        while len(self._pending) >= ahead:
            self._pending.pop(0).result()
        self._pending.append(lane.submit(self._add_tokens, windows, live, q))

    def _add_tokens(self, windows, live, q) -> None:
        self._reserve(int(live.sum()))
        new, top = _ctx_add_tokens(self._slots, self.width, windows, live, q.reshape(q.shape[0], -1), self.order,
                                   self.bits, self.per_word)
        self.n += int(new)
        self._compact = None
        self._check_overflow(int(top))
        if self.n > self.cap:
            self._prune()

    def _check_overflow(self, top: int | None = None) -> None:
        if top is None:
            top = int(self._slots[:, self.width].max()) if self.n else 0
        if top >= 1 << 31:
            raise OverflowError(f"order-{self.order} context seen {top} times: the fixed-point gate sums hold 2^31 "
                                "occurrences; split the corpus and merge fewer parts")

    def flush(self) -> None:
        """Wait for the chunks handed to a lane (add_tokens_on); raises what they raised. Every
        public read calls it; nothing that runs on the lane may."""
        pending = self.__dict__.get("_pending")            # (absent in a table pickled without lanes)
        while pending:
            pending.pop(0).result()

    def __getstate__(self):
        self.flush()
        return self.__dict__

    def _sorted(self) -> np.ndarray:
        self.flush()
        if self._compact is None:
            rec = self._records()
            W = self.width
            order = np.lexsort(rec[:, :W].T[::-1]) if rec.shape[0] else np.zeros(0, np.int64)
            self._compact = rec[order]
        return self._compact

    @property
    def keys(self) -> np.ndarray:
        return self._sorted()[:, :self.width]

    @property
    def count(self) -> np.ndarray:
        return self._sorted()[:, self.width]

    @property
    def gsum(self) -> np.ndarray:
        return self._sorted()[:, self.width + 1:].reshape(-1, self.n_layers, self.hc)

    def load(self, keys, count, gsum, slots: int = 1024) -> None:
        """Replace the contents with these entries (distinct keys), in at least `slots` slots."""
        self.flush()
        records = np.concatenate([np.asarray(keys, np.int64).reshape(-1, self.width),
                                  np.asarray(count, np.int64).reshape(-1, 1),
                                  np.asarray(gsum, np.int64).reshape(-1, self.n_layers * self.hc)], axis=1)
        self._load_records(records, slots)

    def _load_records(self, records: np.ndarray, slots: int = 1024) -> None:
        self.n = 0
        self._alloc(max(1024, 1 << (int(slots) - 1).bit_length()))
        self._reserve(int(records.shape[0]))
        self.n = int(_ctx_add_entries(self._slots, self.width, np.ascontiguousarray(records)))
        self._compact = None

    def _prune(self) -> None:
        """Keep the cap/2 most frequent contexts (of the counts equal to the threshold, the first in
        key order), in place: no sort of the whole table and no fresh allocation (this runs every
        few chunks once a corpus has more contexts than the cap)."""
        W, slots = self.width, self._slots
        count, n = _ctx_counts(slots, W, self.n)
        if n != self.n:                                                  # cannot happen
            raise AssertionError(f"order-{self.order} context table holds {n} records, not {self.n}")
        keep_n = max(self.cap // 2, 1)
        if n <= keep_n:
            return
        thr = np.partition(count, n - keep_n)[n - keep_n]               # the keep_n-th largest count
        ties = _ctx_keys_counted(slots, W, thr, int(np.count_nonzero(count == thr)))
        last = _kth_key(ties, keep_n - int(np.count_nonzero(count > thr)))
        deleted, dropped_sum, dropped_max = _ctx_prune(slots, W, thr, last)
        if deleted != n - keep_n:                                        # cannot happen: keys are distinct
            raise AssertionError(f"order-{self.order} context table prune dropped {deleted} records, not "
                                 f"{n - keep_n}")
        self.prunes += 1
        self.dropped_entries += n - keep_n
        self.dropped_occurrences += int(dropped_sum)
        self.undercount_bound += int(dropped_max)
        self.n = keep_n
        self._compact = None

    def merged(self, other: "ContextTable") -> "ContextTable":
        self.flush()
        other.flush()
        out = ContextTable(self.order, self.width, self.n_layers, self.hc, self.cap, self.bits, self.per_word)
        out._load_records(self._records())
        records = other._records()
        out._reserve(int(records.shape[0]))
        out.n += int(_ctx_add_entries(out._slots, out.width, records))
        for f in ("prunes", "dropped_entries", "dropped_occurrences", "undercount_bound"):
            setattr(out, f, getattr(self, f) + getattr(other, f))
        if out.n > out.cap:
            out._prune()
        out._check_overflow()
        return out


def _kth_key(keys: np.ndarray, r: int) -> np.ndarray:
    """The r-th smallest (1-based) of distinct keys [m, W], word 0 first (as np.lexsort of the
    words reversed orders them): a partition on word 0, a sort only of the keys that share it."""
    w0 = keys[:, 0]
    v = np.partition(w0, r - 1)[r - 1]
    same = keys[w0 == v]
    same = same[np.lexsort(same.T[::-1])]
    return np.ascontiguousarray(same[r - 1 - int(np.count_nonzero(w0 < v))])


@njit(cache=True, nogil=True)
def _ctx_counts(slots, W, n):  # pragma: no cover - jitted
    """(the counts [n] of the first n occupied slots, in slot order; how many slots are occupied)."""
    count = np.empty(n, np.int64)
    j = 0
    for i in range(slots.shape[0]):
        if slots[i, W] != 0:
            if j < n:
                count[j] = slots[i, W]
            j += 1
    return count, j


@njit(cache=True, nogil=True)
def _ctx_keys_counted(slots, W, c, m):  # pragma: no cover - jitted
    """The keys [m, W] of the m records whose count is c."""
    keys = np.empty((m, W), np.int64)
    j = 0
    for i in range(slots.shape[0]):
        if slots[i, W] == c:
            for w in range(W):
                keys[j, w] = slots[i, w]
            j += 1
    return keys


@njit(cache=True, nogil=True)
def _ctx_prune(slots, W, thr, last):  # pragma: no cover - jitted
    """Delete, in place, every record but those with count > thr or count == thr and key <= last
    (word 0 first); returns (deleted records, sum and max of their counts).

    Linear probing's deletion by backward shift: each deleted slot's hole is filled by the next
    record of its cluster that may move back to it, and so on to the cluster's end, so every
    kept record stays reachable from its home slot and nothing is reinserted. A slot is looked
    at again after a record moves into it; records move only into holes at or after the slot
    being looked at (or, across the table's end, among records already kept)."""
    S, R = slots.shape
    mask = S - 1
    deleted = 0
    dropped_sum = 0
    dropped_max = 0
    i = 0
    while i < S:
        c = slots[i, W]
        if c == 0:
            i += 1
            continue
        keep = c > thr
        if c == thr:
            keep = True                                   # key <= last?
            for w in range(W):
                if slots[i, w] != last[w]:
                    keep = slots[i, w] < last[w]
                    break
        if keep:
            i += 1
            continue
        deleted += 1
        dropped_sum += c
        if c > dropped_max:
            dropped_max = c
        hole = i
        j = i
        while True:
            j = (j + 1) & mask
            if slots[j, W] == 0:
                break
            k = _home(slots[j], W, mask)
            if (j > hole and (k <= hole or k > j)) or (j < hole and k <= hole and k > j):
                for r in range(R):
                    slots[hole, r] = slots[j, r]
                hole = j
        for r in range(R):
            slots[hole, r] = 0
    return deleted, dropped_sum, dropped_max


def pack_width(max_ngram: int, bits: int) -> tuple[int, int]:
    """(int64 words per key, slots per word) for contexts of up to max_ngram ids of `bits` bits."""
    per_word = max(63 // bits, 1)
    return -(-max_ngram // per_word), per_word


def unpack_contexts(keys: np.ndarray, order: int, bits: int, per_word: int) -> np.ndarray:
    """keys [n, width] -> windows [n, order] (slot 0 = the current token)."""
    out = np.empty((keys.shape[0], order), np.int64)
    mask = (1 << bits) - 1
    for s in range(order):
        out[:, s] = (keys[:, s // per_word] >> np.int64(bits * (s % per_word))) & mask
    return out
