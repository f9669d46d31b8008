"""Which memory real text touches: row-access statistics of the engram tables, from the hash
alone (no weights: `released_model()` answers these for the real V4.1 configuration).

    acc = AccessStats.empty(model)                   # or access_stats(model, texts=[...])
    acc.update(token_ids)                            # one document (raw ids) at a time
    total = acc_a + acc_b                            # parts reduced apart merge exactly
    rep = total.report()                             # an AccessReport: .to_json(), .table(), plots
    rep.layers[1]["zipf"], rep.layers[1]["static_cache"], rep.layers[1]["lru"]

What is counted, and how it merges
- **Every n-gram the hash folds, exactly.** A row id is a function of one n-gram (order 2..
  max_ngram_size, compressed ids, blocked slots as pad), so the corpus is reduced to the count of
  each distinct window the hash folds (the current token and the max_ngram_size - 1 before it),
  one insert per token in an @njit open-addressing table; an n-gram of a lower order is a prefix
  of its window, so its counts follow exactly by adding windows. Counts are split into a
  *training* and a *held-out* part (a document is held out when the CRC-32 of its raw ids is 0 mod `holdout_every`:
  a property of the document, not of where it sits in the corpus). Row counts per layer and hash
  column follow exactly when the report is made (each distinct n-gram hashed once). Integer
  counts only: parts merge exactly, in any split or order, and equal one pass.
- **Sequence statistics** (an online LRU cache and reuse distances) need the reads in order. They
  run on the held-out documents, in the order this part saw them, up to `sequence_tokens` tokens
  (each layer's reads, hash column 0..C-1 within a token): LRU stack distances by a Fenwick tree
  (exact LRU hit rates for every cache size at once), reuse distance in tokens between two reads
  of one row. Their histograms add when parts merge: each part is then its own stream (a
  separate cache), so they equal one pass only when the parts were one stream.

What the report holds (per engram layer; `to_json` keys are documented in docs/memory.md)
- reads, distinct rows, the rank-frequency curve (count at log-spaced ranks) and a Zipf fit
  (count ~ C * rank^-s by least squares in log-log over a rank range, with R^2), for the layer
  and for every hash column (order, head);
- the static cache: the k rows most read in the training part, evaluated on the held-out part,
  as hit rate against k (rows, and GB for Q2_K 84-byte and FP8 264-byte rows); rows tied at the
  boundary count at their mean (the expectation over the order of ties);
- the online LRU cache's hit rate against k on the held-out stream (cold misses included);
- collisions per hash column: distinct n-grams that share a row with another n-gram; per order,
  pairs of distinct n-grams that collide in *every* head of the order (the same row tuple);
- the reuse distance distribution (log2 bins, tokens).
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field

import numpy as np
from numba import njit

ROW_BYTES_Q2K = 84
ROW_BYTES_FP8 = 264
DEFAULT_HOLDOUT_EVERY = 10
DEFAULT_SEQUENCE_TOKENS = 1_000_000
STATE_VERSION = 1
_EMPTY = np.int64(-1)
_DIST_BINS = 48          # log2 bins: 0 = distance 0 (stack) / 1 token; bin b >= 1 holds [2^(b-1), 2^b)


# The n-gram table -------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _slot(k1, k2, mask):  # pragma: no cover - jitted
    h = np.uint64(k1) * np.uint64(0x9E3779B97F4A7C15) ^ (np.uint64(k2) * np.uint64(0xC2B2AE3D27D4EB4F))
    h ^= h >> np.uint64(29)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(32)
    return np.int64(h & np.uint64(mask))


@njit(cache=True, nogil=True)
def _insert(table, k1, k2, col, add):  # pragma: no cover - jitted
    """Add `add` to the count `col` (0 training, 1 held-out) of key (k1, k2) in the table
    [cap, 4] = (k1, k2, training, held-out); one cache line per key. Returns 1 for a new key."""
    mask = table.shape[0] - 1
    i = _slot(k1, k2, mask)
    while True:
        if table[i, 0] == -1:
            table[i, 0] = k1
            table[i, 1] = k2
            table[i, 2 + col] += add
            return 1
        if table[i, 0] == k1 and table[i, 1] == k2:
            table[i, 2 + col] += add
            return 0
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def _rehash(table, new_table):  # pragma: no cover - jitted
    for i in range(table.shape[0]):
        if table[i, 0] != -1:
            for c in range(2):
                if table[i, 2 + c]:
                    _insert(new_table, table[i, 0], table[i, 1], c, table[i, 2 + c])


@njit(cache=True, nogil=True)
def _merge_into(table, other, filled, limit):  # pragma: no cover - jitted
    """Insert other's entries from its start; returns (index reached, filled)."""
    for i in range(other.shape[0]):
        if filled >= limit:
            return i, filled
        if other[i, 0] != -1:
            new = _insert(table, other[i, 0], other[i, 1], 0, other[i, 2])
            _insert(table, other[i, 0], other[i, 1], 1, other[i, 3])
            filled += new
    return other.shape[0], filled


def _unpack(k1: np.ndarray, k2: np.ndarray, M: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys -> (order [n], windows [n, M] compressed ids; slots past the order are 0)."""
    order = (k2 >> 56).astype(np.int64)
    mask = (1 << bits) - 1
    win = np.zeros((k1.size, M), dtype=np.int64)
    for s in range(M):
        shift = s * bits
        if shift + bits <= 56:
            win[:, s] = (k1 >> shift) & mask
        elif shift >= 56:
            win[:, s] = (k2 >> (shift - 56)) & mask
        else:
            low = (k1 >> shift) & ((1 << (56 - shift)) - 1)
            win[:, s] = low | ((k2 & ((1 << (shift + bits - 56)) - 1)) << (56 - shift))
    return order, win


# Rows from n-grams --------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _rolling(win, order, mult):  # pragma: no cover - jitted
    """The hash fold of each n-gram (window win[i, :order[i]]) with one layer's multipliers."""
    n = win.shape[0]
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        r = win[i, 0] * mult[0]
        for s in range(1, order[i]):
            r = r ^ (win[i, s] * mult[s])
        out[i] = r
    return out


@njit(cache=True, nogil=True)
def _column_rows(rolling, train, held, prime, index):  # pragma: no cover - jitted
    """Row counts of one hash column: per distinct row (local id = rolling % prime), the training
    and held-out reads and the number of distinct n-grams that hash there. Cache-friendly: one
    pass scatters the n-grams into buckets of 2^16 consecutive rows (sequential reads, one write
    stream per bucket), then each bucket is grouped with `index`, an int32 [2^16] buffer (all -1
    on entry and on exit) that stays in cache. Returns (local ids, train, held, ngrams) of the rows,
    ordered by bucket."""
    n = rolling.size
    n_buckets = (prime >> 16) + 1
    count = np.zeros(n_buckets + 1, dtype=np.int64)
    r = np.empty(n, dtype=np.int64)
    for i in range(n):
        x = rolling[i] % prime
        r[i] = x
        count[(x >> 16) + 1] += 1
    for b in range(n_buckets):
        count[b + 1] += count[b]
    pos = count[:n_buckets].copy()
    rs = np.empty(n, dtype=np.int64)
    ts = np.empty(n, dtype=np.int64)
    hs = np.empty(n, dtype=np.int64)
    for i in range(n):
        b = r[i] >> 16
        j = pos[b]
        rs[j] = r[i]
        ts[j] = train[i]
        hs[j] = held[i]
        pos[b] = j + 1
    ids = np.empty(n, dtype=np.int64)
    t = np.zeros(n, dtype=np.int64)
    h = np.zeros(n, dtype=np.int64)
    g = np.zeros(n, dtype=np.int64)
    k = 0
    for b in range(n_buckets):
        k0 = k
        for q in range(count[b], count[b + 1]):
            lr = rs[q] & 0xFFFF
            j = index[lr]
            if j < 0:
                j = k
                index[lr] = k
                ids[k] = rs[q]
                k += 1
            t[j] += ts[q]
            h[j] += hs[q]
            g[j] += 1
        for j in range(k0, k):
            index[ids[j] & 0xFFFF] = -1
    return ids[:k], t[:k], h[:k], g[:k]


# Sequence statistics ------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _dist_bin(d):  # pragma: no cover - jitted
    if d <= 0:
        return 0
    b = 1
    while d > 1:
        d >>= 1
        b += 1
    return b if b < 48 else 47


@njit(cache=True, nogil=True)
def _sequence_pass(rows, n_tok, cap_keys, cap_last, fenwick, t0, stack_hist, tok_hist, cold):  # pragma: no cover
    """LRU stack distances and reuse distances of one layer's reads rows [T, C] (in order).
    cap_keys/cap_last: open-addressing map row -> (last read index, last token); fenwick [n_reads+1]
    counts the reads that are the latest of their row. t0: reads before this call; n_tok: tokens
    before this call. Updates the histograms and cold [1]."""
    T, C = rows.shape
    mask = cap_keys.shape[0] - 1
    N = fenwick.size - 1
    for t in range(T):
        for c in range(C):
            now = t0 + t * C + c + 1          # 1-based read index
            r = rows[t, c]
            i = _slot(r, np.int64(0), mask)
            while cap_keys[i] != -1 and cap_keys[i] != r:
                i = (i + 1) & mask
            if cap_keys[i] == -1:
                cap_keys[i] = r
                cold[0] += 1
            else:
                last = cap_last[i, 0]
                # distinct rows read since: latest-read markers in (last, now)
                s = 0
                j = now - 1
                while j > 0:
                    s += fenwick[j]
                    j -= j & (-j)
                j = last
                while j > 0:
                    s -= fenwick[j]
                    j -= j & (-j)
                stack_hist[_dist_bin(s)] += 1
                tok_hist[_dist_bin(n_tok + t - cap_last[i, 1])] += 1
                j = last
                while j <= N:
                    fenwick[j] -= 1
                    j += j & (-j)
            j = now
            while j <= N:
                fenwick[j] += 1
                j += j & (-j)
            cap_last[i, 0] = now
            cap_last[i, 1] = n_tok + t


@njit(cache=True, nogil=True)
def _seq_rebuild(keys, last, new_keys, new_last, fenwick):  # pragma: no cover - jitted
    """Move the row map into a larger one and mark every row's latest read in a fresh Fenwick tree."""
    mask = new_keys.shape[0] - 1
    N = fenwick.size - 1
    for i in range(keys.shape[0]):
        r = keys[i]
        if r == -1:
            continue
        j = _slot(r, np.int64(0), mask)
        while new_keys[j] != -1:
            j = (j + 1) & mask
        new_keys[j] = r
        new_last[j, 0] = last[i, 0]
        new_last[j, 1] = last[i, 1]
        k = last[i, 0]
        while k <= N:
            fenwick[k] += 1
            k += k & (-k)


class _Sequence:
    """One layer's online state over the held-out stream (grown as reads come)."""

    def __init__(self):
        self.keys = np.full(1 << 12, -1, dtype=np.int64)
        self.last = np.zeros((1 << 12, 2), dtype=np.int64)
        self.fenwick = np.zeros((1 << 12) + 1, dtype=np.int32)
        self.reads = 0

    def reserve(self, n_new_reads: int) -> None:
        need = self.reads + n_new_reads
        cap = self.keys.size
        if need + 1 <= self.fenwick.size - 1 and need * 2 <= cap:
            return
        size = 1 << max(12, int(2 * need).bit_length())
        keys = np.full(size, -1, dtype=np.int64)
        last = np.zeros((size, 2), dtype=np.int64)
        fenwick = np.zeros(size + 1, dtype=np.int32)
        _seq_rebuild(self.keys, self.last, keys, last, fenwick)
        self.keys, self.last, self.fenwick = keys, last, fenwick


# The state ----------------------------------------------------------------------------------------

def _new_table(cap: int) -> np.ndarray:
    t = np.zeros((cap, 4), dtype=np.int64)
    t[:, 0] = -1
    return t


def _bits_for(vocab: int) -> int:
    return max(1, int(vocab - 1).bit_length())


@dataclass
class AccessStats:
    """Exact, mergeable row-access state of a corpus (see the module docstring)."""

    layer_ids: tuple
    max_ngram_size: int
    n_heads: int
    multipliers: np.ndarray         # [L, M] int64
    primes: np.ndarray              # [L, M-1, H] int64
    offsets: np.ndarray             # [L, C] int64
    pad_id: int
    compressed_vocab: int
    holdout_every: int = DEFAULT_HOLDOUT_EVERY
    sequence_tokens: int = DEFAULT_SEQUENCE_TOKENS
    table: np.ndarray = None        # [cap, 4] int64: n-gram key words (k1 = -1: empty), training, held-out
    filled: int = 0
    n_documents: list = field(default_factory=lambda: [0, 0])   # training, held-out
    n_tokens: list = field(default_factory=lambda: [0, 0])
    seq_tokens: int = 0
    stack_hist: np.ndarray = None   # [L, _DIST_BINS] int64 LRU stack distances (distinct rows)
    tok_hist: np.ndarray = None     # [L, _DIST_BINS] int64 reuse distances in tokens
    cold: np.ndarray = None         # [L] int64 first reads in the stream
    meta: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, model_or_tables, *, holdout_every: int = DEFAULT_HOLDOUT_EVERY,
              sequence_tokens: int = DEFAULT_SEQUENCE_TOKENS, capacity: int = 1 << 16) -> "AccessStats":
        t = getattr(model_or_tables, "hash_tables", model_or_tables)
        if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
            raise ValueError(f"holdout_every must be an integer >= 2 (one document in that many is held out), "
                             f"got {holdout_every!r}")
        if isinstance(sequence_tokens, bool) or not isinstance(sequence_tokens, int) or sequence_tokens < 0:
            raise ValueError(f"sequence_tokens must be an integer >= 0, got {sequence_tokens!r}")
        M = int(t.multipliers.shape[1])
        V = int(t.token_map.max()) + 1
        bits = _bits_for(max(V, t.pad_id + 1))
        if M * bits > 56 + 55:
            raise ValueError(f"n-grams of {M} compressed ids of {bits} bits do not fit the 111-bit n-gram key")
        cap = 1 << max(4, int(capacity - 1).bit_length())
        L = len(t.layer_ids)
        st = cls(layer_ids=tuple(t.layer_ids), max_ngram_size=M, n_heads=int(t.primes.shape[2]),
                 multipliers=np.array(t.multipliers), primes=np.array(t.primes), offsets=np.array(t.offsets),
                 pad_id=int(t.pad_id), compressed_vocab=V, holdout_every=holdout_every,
                 sequence_tokens=sequence_tokens, table=_new_table(cap),
                 stack_hist=np.zeros((L, _DIST_BINS), np.int64), tok_hist=np.zeros((L, _DIST_BINS), np.int64),
                 cold=np.zeros(L, np.int64))
        st._token_map = t.token_map
        st._tables = t
        st._seq = None
        return st

    # reducing -------------------------------------------------------------------------------
    @property
    def keys(self) -> np.ndarray:
        """[cap, 2] int64 n-gram keys (a view; k1 = -1 marks an empty slot)."""
        return self.table[:, :2]

    @property
    def counts(self) -> np.ndarray:
        """[cap, 2] int64 training and held-out occurrences (a view)."""
        return self.table[:, 2:]

    def ngram_table(self, order: int) -> np.ndarray:
        """The [cap, 4] table (k1, k2, training, held-out) of the distinct n-grams of `order`: the
        counted windows for the largest order, derived from them (and kept until the next update)
        for the others."""
        M = self.max_ngram_size
        if not 2 <= order <= M:
            raise ValueError(f"order must be in 2..{M}, got {order}")
        if order == M:
            return self.table
        derived = self.__dict__.setdefault("_derived", {})
        if order not in derived:
            out = _new_table(1 << max(4, int(2 * self.filled + 1).bit_length()))
            _derive(self.table, order, self.bits, out)
            derived[order] = out
        return derived[order]

    @property
    def bits(self) -> int:
        return _bits_for(max(self.compressed_vocab, self.pad_id + 1))

    def _grow(self) -> None:
        table = _new_table(self.table.shape[0] * 2)
        _rehash(self.table, table)
        self.table = table

    def is_held_out(self, token_ids: np.ndarray) -> bool:
        """A document is held out when the CRC-32 of its raw ids (int64, little-endian) is 0 mod
        holdout_every: decided by its content, so any split of a corpus agrees."""
        return zlib.crc32(np.ascontiguousarray(token_ids, dtype="<i8").tobytes()) % self.holdout_every == 0

    def update(self, token_ids) -> "AccessStats":
        """Count one document (raw token ids [T], a fresh sequence: positions from 0)."""
        from ..stages.hash.cpu import check_token_ids
        tm = getattr(self, "_token_map", None)
        if tm is None:
            raise ValueError("this AccessStats was loaded from a file: it merges and reports, but counting needs "
                             "AccessStats.empty(model)")
        ids, _ = check_token_ids(token_ids, None, tm.size)
        if ids.size == 0:
            return self
        held = self.is_held_out(ids)
        col = 1 if held else 0
        self.__dict__.pop("_derived", None)
        cids = tm[ids]
        limit = self.table.shape[0] // 2
        done = 0
        while done < cids.size:
            done, self.filled = _count_from(cids, done, self.max_ngram_size, self.pad_id, self.bits,
                                            self.table, col, self.filled, limit)
            if self.filled >= limit:
                self._grow()
                limit = self.table.shape[0] // 2
        self.n_documents[col] += 1
        self.n_tokens[col] += int(ids.size)
        if held and self.seq_tokens < self.sequence_tokens:
            self._sequence(ids)
        return self

    def _sequence(self, ids: np.ndarray) -> None:
        from ..stages.hash.cpu import hash_tokens
        take = min(ids.size, self.sequence_tokens - self.seq_tokens)
        rows = hash_tokens(self._tables, ids[:take])            # [T, L, C]; the document's own history
        C = rows.shape[2]
        if self._seq is None:
            self._seq = [_Sequence() for _ in self.layer_ids]
        for li, s in enumerate(self._seq):
            s.reserve(take * C)
            _sequence_pass(np.ascontiguousarray(rows[:, li, :]), self.seq_tokens, s.keys, s.last, s.fenwick,
                           s.reads, self.stack_hist[li], self.tok_hist[li], self.cold[li:li + 1])
            s.reads += take * C
        self.seq_tokens += take

    # merging --------------------------------------------------------------------------------
    def _check_same(self, other: "AccessStats") -> None:
        for name in ("layer_ids", "max_ngram_size", "n_heads", "pad_id", "compressed_vocab", "holdout_every"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(f"cannot merge access statistics with different {name}: {getattr(self, name)!r} vs "
                                 f"{getattr(other, name)!r}")
        for name in ("multipliers", "primes", "offsets"):
            if not np.array_equal(getattr(self, name), getattr(other, name)):
                raise ValueError(f"cannot merge access statistics of different hash constants ({name} differ)")

    def __add__(self, other: "AccessStats") -> "AccessStats":
        if not isinstance(other, AccessStats):
            return NotImplemented
        self._check_same(other)
        out = AccessStats(layer_ids=self.layer_ids, max_ngram_size=self.max_ngram_size, n_heads=self.n_heads,
                          multipliers=self.multipliers, primes=self.primes, offsets=self.offsets,
                          pad_id=self.pad_id, compressed_vocab=self.compressed_vocab,
                          holdout_every=self.holdout_every, sequence_tokens=self.sequence_tokens + other.sequence_tokens,
                          table=self.table.copy(), filled=self.filled,
                          n_documents=[a + b for a, b in zip(self.n_documents, other.n_documents)],
                          n_tokens=[a + b for a, b in zip(self.n_tokens, other.n_tokens)],
                          seq_tokens=self.seq_tokens + other.seq_tokens,
                          stack_hist=self.stack_hist + other.stack_hist, tok_hist=self.tok_hist + other.tok_hist,
                          cold=self.cold + other.cold, meta=dict(self.meta))
        out.meta["merged_parts"] = self.meta.get("merged_parts", 1) + other.meta.get("merged_parts", 1)
        i = 0
        while i < other.table.shape[0]:
            limit = out.table.shape[0] // 2
            j, out.filled = _merge_into(out.table, other.table[i:], out.filled, limit)
            i += j
            if out.filled >= limit:
                out._grow()
        return out

    # saving ---------------------------------------------------------------------------------
    def save(self, path) -> None:
        live = self.keys[:, 0] != -1
        np.savez_compressed(
            path, version=np.int64(STATE_VERSION), layer_ids=np.array(self.layer_ids, np.int64),
            multipliers=self.multipliers, primes=self.primes, offsets=self.offsets,
            scalars=np.array([self.pad_id, self.compressed_vocab, self.holdout_every, self.sequence_tokens,
                              self.seq_tokens, *self.n_documents, *self.n_tokens], np.int64),
            keys=self.table[live, :2], counts=self.table[live, 2:], stack_hist=self.stack_hist, tok_hist=self.tok_hist,
            cold=self.cold, meta=np.array(json.dumps(self.meta)))

    @classmethod
    def load(cls, path) -> "AccessStats":
        with np.load(path, allow_pickle=False) as z:
            if "version" not in z or int(z["version"]) != STATE_VERSION or "keys" not in z:
                raise ValueError(f"{path} is not an access statistics file (version {STATE_VERSION})")
            s = z["scalars"].tolist()
            keys, counts = z["keys"], z["counts"]
            cap = 1 << max(4, int(2 * keys.shape[0] + 1).bit_length())
            st = cls(layer_ids=tuple(z["layer_ids"].tolist()), max_ngram_size=int(z["multipliers"].shape[1]),
                     n_heads=int(z["primes"].shape[2]), multipliers=z["multipliers"], primes=z["primes"],
                     offsets=z["offsets"], pad_id=s[0], compressed_vocab=s[1], holdout_every=s[2],
                     sequence_tokens=s[3], seq_tokens=s[4], n_documents=s[5:7], n_tokens=s[7:9],
                     table=_new_table(cap),
                     stack_hist=z["stack_hist"], tok_hist=z["tok_hist"], cold=z["cold"],
                     meta=json.loads(str(z["meta"])))
        _rehash(np.ascontiguousarray(np.concatenate([keys, counts], axis=1), dtype=np.int64), st.table)
        st.filled = int(keys.shape[0])
        return st

    # the report -----------------------------------------------------------------------------
    def ngrams(self, sort: bool = True) -> dict:
        """The distinct n-grams: {"order": [n], "window": [n, M] compressed ids, "train": [n],
        "held_out": [n]}, in key order (sorted) so that two equal states give equal arrays
        (sort=False: in table order, faster)."""
        parts = [self.ngram_table(o) for o in range(2, self.max_ngram_size + 1)]
        rows = np.concatenate([t[t[:, 0] != -1] for t in parts])
        if sort:
            rows = rows[np.lexsort((rows[:, 0], rows[:, 1]))]
        order, win = _unpack(rows[:, 0], rows[:, 1], self.max_ngram_size, self.bits)
        return {"order": order, "window": win, "train": rows[:, 2].copy(), "held_out": rows[:, 3].copy()}

    def report(self, *, cache_rows=None, zipf_range=None) -> "AccessReport":
        return build_report(self, cache_rows=cache_rows, zipf_range=zipf_range)


@njit(cache=True, nogil=True)
def _count_from(cids, start, M, pad, bits, table, col, filled, limit):  # pragma: no cover - jitted
    """Count every n-gram (orders 2..M) of positions start.. of one document (compressed ids) into
    the table; stops early, to let the caller grow the table, once `filled` reaches `limit`.
    Returns (next position, filled)."""
    T = cids.size
    tok = np.empty(M, dtype=np.int64)
    for p in range(start, T):
        if filled >= limit:
            return p, filled
        blocked = False
        for s in range(M):
            if not blocked and p < s:
                blocked = True
            tok[s] = pad if blocked else cids[p - s]
        lo = tok[0]
        hi = np.int64(0)
        for s in range(1, M):
            shift = s * bits
            if shift < 56:
                lo |= tok[s] << shift
                if shift + bits > 56:
                    hi |= tok[s] >> (56 - shift)
            else:
                hi |= tok[s] << (shift - 56)
        filled += _insert(table, lo & np.int64(0xFFFFFFFFFFFFFF), hi | (np.int64(M) << 56), col, 1)
    return T, filled


@njit(cache=True, nogil=True)
def _derive(table, order, bits, out):  # pragma: no cover - jitted
    """Counts of the n-grams of `order` from the full windows in `table`: each window's first
    `order` ids (the current token and the ones before it) are its n-gram of that order. Returns
    the number of distinct n-grams placed in `out` (a fresh table)."""
    nb = order * bits
    filled = 0
    for i in range(table.shape[0]):
        if table[i, 0] == -1:
            continue
        k1 = table[i, 0]
        if nb < 56:
            p1 = k1 & ((np.int64(1) << nb) - 1)
            p2 = np.int64(0)
        else:
            p1 = k1
            p2 = (table[i, 1] & ((np.int64(1) << (nb - 56)) - 1)) if nb > 56 else np.int64(0)
        key2 = p2 | (np.int64(order) << 56)
        filled += _insert(out, p1, key2, 0, table[i, 2])
        _insert(out, p1, key2, 1, table[i, 3])
    return filled


# The report ---------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _hist_add(n, w, values, weights, weighted):  # pragma: no cover - jitted
    """n[v] += 1 and w[v] += weight for every 0 < v < n.size; returns how many values were >= n.size."""
    cap = n.size
    big = 0
    for i in range(values.size):
        v = values[i]
        if v <= 0:
            continue
        if v >= cap:
            big += 1
            continue
        n[v] += 1
        if weighted:
            w[v] += weights[i]
    return big


class CountGroups:
    """A multiset of positive integer counts (one per row), kept as a histogram (count value ->
    rows with it, and the sum of a weight over those rows), so that rank-frequency curves, Zipf
    fits and top-k sums need no sort of the rows. Values below 2^16 go to dense bincounts, larger
    ones (few) are kept as they are."""

    CAP = 1 << 16

    def __init__(self):
        self._n = np.zeros(self.CAP, np.int64)
        self._w = np.zeros(self.CAP, np.float64)
        self._big_v: list = []
        self._big_w: list = []

    def add(self, values: np.ndarray, weights: np.ndarray | None = None) -> "CountGroups":
        v = np.ascontiguousarray(values, np.int64)
        w = np.zeros(0, np.int64) if weights is None else np.ascontiguousarray(weights, np.int64)
        if _hist_add(self._n, self._w, v, w, weights is not None):
            big = v >= self.CAP
            self._big_v.append(v[big])
            self._big_w.append(w[big].astype(np.float64) if weights is not None else np.zeros(int(big.sum())))
        return self

    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values descending, rows with each value, weight sum of those rows)."""
        bv = np.concatenate(self._big_v) if self._big_v else np.zeros(0, np.int64)
        bw = np.concatenate(self._big_w) if self._big_w else np.zeros(0)
        u, inv = np.unique(bv, return_inverse=True)
        bn = np.bincount(inv, minlength=u.size).astype(np.int64)
        bws = np.bincount(inv, weights=bw, minlength=u.size)
        vals = np.flatnonzero(self._n)[::-1]
        return (np.concatenate([u[::-1], vals]).astype(np.int64), np.concatenate([bn[::-1], self._n[vals]]),
                np.concatenate([bws[::-1], self._w[vals]]))

    @classmethod
    def of(cls, counts) -> "CountGroups":
        return cls().add(np.asarray(counts))


def _at_ranks(values, n, ranks):
    """The count at each 1-based rank of the descending sequence the groups make."""
    return values[np.searchsorted(np.cumsum(n), ranks, side="left")]


def zipf_fit(counts, rank_range=None) -> dict:
    """Fit count ~ C * rank^-s to the rows' counts ranked in descending order (`counts`: an array
    in any order, or CountGroups), by least squares of log count on log rank at up to 64
    log-spaced ranks of the range (so the long tail does not outweigh the head). Default range:
    rank 10 to the last rank read at least 3 times (the tail of ones and twos is a staircase, not
    a power law); the whole curve when that leaves fewer than 100 ranks.
    -> {"exponent", "rank_lo", "rank_hi", "r2", "points"}."""
    g = counts if isinstance(counts, CountGroups) else CountGroups.of(counts)
    values, n, _ = g.groups()
    total = int(n.sum())
    if rank_range is None:
        hi = int(n[values >= 3].sum())
        lo = 10
        if hi - lo < 100:
            lo, hi = 1, total
    else:
        lo, hi = int(rank_range[0]), min(int(rank_range[1]), total)
    if hi - lo < 2:
        return {"exponent": None, "rank_lo": lo, "rank_hi": hi, "r2": None, "points": 0}
    ranks = np.unique(np.round(np.logspace(math.log10(lo), math.log10(hi), 64)).astype(np.int64))
    x, y = np.log(ranks), np.log(_at_ranks(values, n, ranks).astype(np.float64))
    slope, icpt = np.polyfit(x, y, 1)
    resid = y - (slope * x + icpt)
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss if ss > 0 else None
    return {"exponent": float(-slope), "rank_lo": lo, "rank_hi": hi, "r2": r2, "points": int(ranks.size)}


def rank_frequency(counts, points: int = 60) -> dict:
    """Counts at log-spaced ranks (1-based) of the rows' counts in descending order."""
    g = counts if isinstance(counts, CountGroups) else CountGroups.of(counts)
    values, n, _ = g.groups()
    total = int(n.sum())
    if total == 0:
        return {"rank": [], "count": []}
    ranks = np.unique(np.round(np.logspace(0, math.log10(total), points)).astype(np.int64))
    return {"rank": ranks.tolist(), "count": _at_ranks(values, n, ranks).tolist()}


def default_cache_rows(n_rows_max: int) -> list[int]:
    """Cache sizes 2^10, 2^11, ... up to the first power of two that holds every row touched."""
    out, k = [], 1 << 10
    while True:
        out.append(k)
        if k >= n_rows_max:
            return out
        k <<= 1


def _bins_json(hist: np.ndarray) -> list[dict]:
    out = []
    for b in np.flatnonzero(hist):
        lo, hi = (0, 1) if b == 0 else (1 << (int(b) - 1), 1 << int(b))
        out.append({"lo": lo, "hi": hi, "reads": int(hist[b])})
    return out


def _median_bin(hist: np.ndarray) -> int | None:
    total = int(hist.sum())
    if not total:
        return None
    b = int(np.searchsorted(np.cumsum(hist), (total + 1) // 2))
    return 0 if b == 0 else 1 << (b - 1)


def static_cache_hits(train_groups: CountGroups, sizes) -> list[float]:
    """Held-out reads caught by a cache of the k rows with the most training reads, for each k of
    `sizes` (train_groups: the rows' training reads, weighted by their held-out reads; rows never
    read in training are never cached). Rows tied on training reads at the boundary are taken at
    their mean held-out reads (the expectation over any order of the ties), so no sort of the rows
    is needed and the result depends on the counts only."""
    _, g_n, g_h = train_groups.groups()
    if g_n.size == 0:
        return [0.0 for _ in sizes]
    cum_n, cum_h = np.cumsum(g_n), np.cumsum(g_h)
    out = []
    for k in sizes:
        g = int(np.searchsorted(cum_n, k, side="left"))
        if g >= g_n.size:
            out.append(float(cum_h[-1]))
            continue
        before_n = int(cum_n[g - 1]) if g else 0
        before_h = float(cum_h[g - 1]) if g else 0.0
        out.append(before_h + (k - before_n) * float(g_h[g]) / float(g_n[g]))
    return out


def build_report(st: AccessStats, *, cache_rows=None, zipf_range=None) -> "AccessReport":
    ng = st.ngrams(sort=False)
    H, M = st.n_heads, st.max_ngram_size
    index = np.full(1 << 16, -1, dtype=np.int32)
    layers = {}
    for li, lid in enumerate(st.layer_ids):
        cols, orders = [], {}
        layer_total, layer_train = CountGroups(), CountGroups()
        n_rows = reads = held_reads = trained_rows = 0
        for i in range(M - 1):
            o = i + 2
            sel = ng["order"] == o
            win, tr, hd = ng["window"][sel], ng["train"][sel], ng["held_out"][sel]
            rolling = _rolling(win, np.full(win.shape[0], o, np.int64), st.multipliers[li])
            _, groups = np.unique(rolling, return_counts=True)
            dup = groups[groups >= 2]
            orders[o] = {"ngrams": int(win.shape[0]), "all_heads_pairs": int((dup * (dup - 1) // 2).sum()),
                         "all_heads_ngrams": int(dup.sum())}
            for h in range(H):
                col = i * H + h
                prime = int(st.primes[li, i, h])
                ids, t, hh, g = _column_rows(rolling, tr, hd, prime, index)
                total = t + hh
                col_groups = CountGroups.of(total)
                layer_total.add(total)
                layer_train.add(t, hh)
                shared = g >= 2
                c_reads = int(total.sum())
                cols.append({"col": col, "order": o, "head": h, "prime": prime, "reads": c_reads,
                             "distinct_rows": int(ids.size), "ngrams": int(win.shape[0]),
                             "rows_shared": int(shared.sum()), "ngrams_in_shared_rows": int(g[shared].sum()),
                             "max_ngrams_per_row": int(g.max()) if g.size else 0,
                             "zipf": zipf_fit(col_groups, zipf_range)})
                n_rows += int(ids.size)
                reads += c_reads
                held_reads += int(hh.sum())
                trained_rows += int((t > 0).sum())
        # static cache: the k rows most read in training, hits on the held-out reads
        sizes = list(cache_rows) if cache_rows is not None else default_cache_rows(max(n_rows, 1))
        static = static_cache_hits(layer_train, sizes)
        # online LRU on the held-out stream: a read hits a cache of k rows when its stack distance < k
        sh = st.stack_hist[li]
        seq_reads = int(sh.sum() + st.cold[li])
        csum = np.cumsum(sh)
        lru = []
        for k in sizes:
            j = int(math.floor(math.log2(k))) if k >= 1 else -1
            exact = k >= 1 and (1 << j) == k
            lru.append(int(csum[min(j, _DIST_BINS - 1)]) if (j >= 0 and exact) else None)
        layers[lid] = {
            "reads": reads, "distinct_rows": n_rows, "table_rows": int(st.primes[li].sum()),
            "zipf": zipf_fit(layer_total, zipf_range), "rank_frequency": rank_frequency(layer_total),
            "static_cache": {"rows": sizes, "gb_q2k": [k * ROW_BYTES_Q2K / 1e9 for k in sizes],
                             "gb_fp8": [k * ROW_BYTES_FP8 / 1e9 for k in sizes], "held_out_reads": held_reads,
                             "hits": static, "hit_rate": [h / held_reads if held_reads else None for h in static],
                             "ties": "rows tied on training reads at the cache boundary count at their mean held-out reads "
                                     "(the expectation over the order of ties)",
                             "rows_with_training_reads": trained_rows},
            "lru": {"rows": sizes, "reads": seq_reads, "cold_misses": int(st.cold[li]),
                    "hits": lru, "hit_rate": [h / seq_reads if (seq_reads and h is not None) else None for h in lru],
                    "tokens": int(st.seq_tokens)},
            "reuse_distance_tokens": {"bins": _bins_json(st.tok_hist[li]), "first_reads": int(st.cold[li]),
                                      "median_bin_lo": _median_bin(st.tok_hist[li])},
            "stack_distance_rows": {"bins": _bins_json(sh)},
            "collisions": {"orders": {str(o): v for o, v in orders.items()}},
            "columns": cols,
        }
    return AccessReport(st, layers)


class AccessReport:
    """What `AccessStats.report()` gives: `layers[layer_id]` (a dict, the JSON's), `to_json()`,
    `table()` (text), `columns_frame()` (pandas), `zipf_plot()`, `cache_plot()`, `reuse_plot()`."""

    def __init__(self, st: AccessStats, layers: dict):
        self.layers = layers
        self.meta = dict(st.meta)
        self.n_documents = {"train": int(st.n_documents[0]), "held_out": int(st.n_documents[1])}
        self.n_tokens = {"train": int(st.n_tokens[0]), "held_out": int(st.n_tokens[1])}
        self.holdout_every = st.holdout_every
        self.sequence_tokens = int(st.seq_tokens)

    def to_json(self) -> dict:
        return {"version": STATE_VERSION, "meta": self.meta, "n_documents": self.n_documents,
                "n_tokens": self.n_tokens, "holdout_every": self.holdout_every,
                "sequence_tokens": self.sequence_tokens, "row_bytes": {"q2k": ROW_BYTES_Q2K, "fp8": ROW_BYTES_FP8},
                "layers": {str(k): v for k, v in self.layers.items()}}

    def columns_records(self) -> list[dict]:
        out = []
        for lid, L in self.layers.items():
            for c in L["columns"]:
                out.append({"layer": lid, "col": c["col"], "order": c["order"], "head": c["head"],
                            "reads": c["reads"], "distinct_rows": c["distinct_rows"], "ngrams": c["ngrams"],
                            "rows_shared": c["rows_shared"], "ngrams_in_shared_rows": c["ngrams_in_shared_rows"],
                            "max_ngrams_per_row": c["max_ngrams_per_row"], "zipf_exponent": c["zipf"]["exponent"],
                            "zipf_r2": c["zipf"]["r2"]})
        return out

    def cache_records(self) -> list[dict]:
        out = []
        for lid, L in self.layers.items():
            s, u = L["static_cache"], L["lru"]
            for i, k in enumerate(s["rows"]):
                out.append({"layer": lid, "rows": k, "gb_q2k": s["gb_q2k"][i], "gb_fp8": s["gb_fp8"][i],
                            "static_hit_rate": s["hit_rate"][i], "lru_hit_rate": u["hit_rate"][i]})
        return out

    def table(self) -> str:
        lines = [f"row access: {self.n_tokens['train']:,} training + {self.n_tokens['held_out']:,} held-out tokens "
                 f"({self.n_documents['train']} + {self.n_documents['held_out']} documents; LRU on "
                 f"{self.sequence_tokens:,} held-out tokens)"]
        for lid, L in self.layers.items():
            z = L["zipf"]
            zs = "no Zipf fit (too few rows)" if z["exponent"] is None else (
                f"Zipf exponent {z['exponent']:.3f} over ranks {z['rank_lo']}..{z['rank_hi']} (R^2 {z['r2']:.3f})")
            lines.append(f"layer {lid}: {L['reads']:,} reads, {L['distinct_rows']:,} distinct rows of "
                         f"{L['table_rows']:,}; {zs}")
            lines.append("  cache rows   Q2_K GB   FP8 GB   static hit   LRU hit")
            s, u = L["static_cache"], L["lru"]
            for i, k in enumerate(s["rows"]):
                lr = u["hit_rate"][i]
                sr = s["hit_rate"][i]
                lines.append(f"  {k:>10,}  {s['gb_q2k'][i]:8.3f}  {s['gb_fp8'][i]:7.3f}   "
                             + ("        -" if sr is None else f"{sr:9.4f}") + "   "
                             + ("      -" if lr is None else f"{lr:7.4f}"))
            for o, c in L["collisions"]["orders"].items():
                cols = [c2 for c2 in L["columns"] if c2["order"] == int(o)]
                shared = sum(c2["ngrams_in_shared_rows"] for c2 in cols) / max(1, len(cols))
                lines.append(f"  order {o}: {c['ngrams']:,} distinct n-grams; {shared:,.0f} share a row per head "
                             f"(mean); {c['all_heads_pairs']} pairs collide in every head")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def columns_frame(self):
        from .._optional import require_pandas
        return require_pandas("AccessReport.columns_frame").DataFrame(self.columns_records())

    def zipf_plot(self, ax=None):
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        for lid, L in self.layers.items():
            rf, z = L["rank_frequency"], L["zipf"]
            ax.loglog(rf["rank"], rf["count"], label=f"layer {lid} (s = {z['exponent']:.2f})")
        ax.set_xlabel("rank of row")
        ax.set_ylabel("reads")
        ax.set_title("row-access rank-frequency")
        ax.legend()
        return ax.figure

    def cache_plot(self, ax=None, unit: str = "rows"):
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        key = {"rows": "rows", "q2k": "gb_q2k", "fp8": "gb_fp8"}[unit]
        for lid, L in self.layers.items():
            s, u = L["static_cache"], L["lru"]
            ax.semilogx(s[key], s["hit_rate"], "-o", ms=3, label=f"layer {lid} static top-k")
            pts = [(x, y) for x, y in zip(s[key], u["hit_rate"]) if y is not None]
            if pts:
                ax.semilogx(*zip(*pts), "--s", ms=3, label=f"layer {lid} LRU")
        ax.set_xlabel({"rows": "cache size (rows)", "q2k": "cache size (GB, Q2_K rows)",
                       "fp8": "cache size (GB, FP8 rows)"}[unit])
        ax.set_ylabel("hit rate on held-out reads")
        ax.legend()
        return ax.figure

    def reuse_plot(self, ax=None):
        import matplotlib.pyplot as plt
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        for lid, L in self.layers.items():
            bins = L["reuse_distance_tokens"]["bins"]
            ax.step([b["lo"] for b in bins], [b["reads"] for b in bins], where="post", label=f"layer {lid}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("reuse distance (tokens, log2 bins)")
        ax.set_ylabel("reads")
        ax.legend()
        return ax.figure


def access_stats(model, documents=None, *, texts=None, tokenizer=None, holdout_every: int = DEFAULT_HOLDOUT_EVERY,
                 sequence_tokens: int = DEFAULT_SEQUENCE_TOKENS, limit_tokens: int | None = None,
                 progress: bool = False) -> AccessStats:
    """Row-access statistics of documents (raw token id arrays) or texts (tokenized with the model's
    tokenizer, or `tokenizer`), each a fresh sequence. Works on any model with hash tables,
    `released_model()` included."""
    st = AccessStats.empty(model, holdout_every=holdout_every, sequence_tokens=sequence_tokens)
    if texts is not None:
        from ..text import tokenizer_for
        tok = tokenizer_for(model, tokenizer, need_encode=True)
        documents = (tok.encode(t) for t in texts)
    if documents is None:
        raise ValueError("give documents (token id arrays) or texts")
    seen = 0
    for d in documents:
        if limit_tokens is not None and seen >= limit_tokens:
            break
        d = np.asarray(d)
        if limit_tokens is not None:
            d = d[: limit_tokens - seen]
        st.update(d)
        seen += int(d.size)
    return st


def merge_access(parts) -> AccessStats:
    parts = list(parts)
    if not parts:
        raise ValueError("nothing to merge")
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out
