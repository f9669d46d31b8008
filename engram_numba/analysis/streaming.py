"""Gate statistics that stream and merge: a corpus is reduced chunk by chunk, and parts reduced
separately (other processes, other machines) add up to the statistics of the whole.

    st = StreamingGateStats.empty(model)          # or what `corpus_stats` returns
    st.update(chunk)                              # one chunk of tokens (the corpus driver does this)
    total = st_a + st_b                           # or merge([st_a, st_b, st_c])
    total[1, 0]                                   # a StreamGateStats (as `gate_stats` gives)
    total.top_tokens(1, k=20, by="mean_gate")     # per compressed token
    total.top_contexts(3, 1, by="count")          # per n-gram context (order 3)
    total.columns()                               # row-id usage and collisions per hash column
    total.save("part.npz"); StreamingGateStats.load("part.npz")

What is kept, per engram layer and stream, over live tokens (masked tokens are counted apart, as
`gate_stats` does):

- **Moments, exactly.** Every fp32 value is M * 2^E with an integer M < 2^24; the sums of M (and
  M^2) are kept per exponent in integers and folded into Python integers, so the count, sum, sum
  of squares, mean and M2 (sum of squared deviations) are exact rationals, rounded once when
  read. Merged statistics therefore equal one-pass statistics bit for bit, whatever the split.
  The same for the dot (and |dot|). min and max are exact.
- **A fixed fine histogram** of the gate: FINE_BINS = 100,000 bins over [0, 1] (width 1e-5; the
  last bin includes 1.0). The coarse histogram (`bins`, a divisor of FINE_BINS) is a sum of fine
  bins, and the quantiles are read from the fine histogram by linear interpolation inside the
  bin that holds them: each of the two order statistics np.quantile interpolates between is
  placed inside its fine bin, so a quantile is within 1e-5 of np.quantile's (linear) value.
  Integer counts: merges are exact.
- **The clamp rate**: live tokens with |dot| < 1e-6 (the gate's clamp, docs/math.md section 6).
- **Per compressed token** (the hash's unit): live occurrences, and the gate's sum per layer and
  stream in fixed point (integer multiples of 2^-32, so exact and mergeable; a mean gate is good
  to 1.2e-10). Raw-token occurrences are counted too, to name each compressed id by its most
  frequent raw token.
- **Per n-gram context** (the window the hash folds, orders 2..max_ngram_size, compressed ids,
  blocked slots as pad): occurrences and fixed-point gate sums, in a hash table with a cap of
  `max_contexts` distinct contexts per order. Below the cap everything is exact (and merges
  exactly). When a chunk (or a merge) leaves more than the cap, the table keeps the cap/2 most
  frequent contexts (ties by key) and drops the rest; `pruned` then says so, and `undercount_bound` is a
  bound on how much any context's count can be below its true count (the sum, over prunes, of
  the largest count dropped).
- **Row ids**: a bitmap of the rows each layer's table served (exact distinct ids per hash
  column; 48 MB a layer at the released table size), and reads per column. Collisions per
  column: distinct tracked contexts of the column's order minus the distinct row ids those
  contexts hash to (the hash is rerun on the tracked contexts). Exact while the context table
  has not been pruned; a lower bound after.

Overflow limits (documented, checked): per compressed token or context, the fixed-point sums hold
up to 2^31 occurrences.
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numba import njit

from ..config import GATE_CLAMP
from ..stages.hash.cpu import hash_positions
from ..stages.hash.cpu import ngram_windows as ngram_windows_from_history  # noqa: F401  (the corpus driver's name)
from ..formats.errors import EngramFileError
from ..identity import constants_digest, identity_mismatch, model_identity, token_map_digest
from .stats import QUANTILES, StreamGateStats

FINE_BINS = 100_000                 # fine histogram bins over [0, 1]: quantile resolution 1e-5
FIXED_POINT_BITS = 32               # per-key gate sums are integer multiples of 2^-32
MAX_CALL_TOKENS = 32_768            # the reducer's int64 squares stay exact for this many values a call
DEFAULT_MAX_CONTEXTS = 200_000
_EXP_BINS = 256                     # fp32 biased exponents (0 and 1 share: denormals)
STATE_VERSION = 1


# The per-element reducer ----------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _add_exact(bits, s1, s2, c):  # pragma: no cover - jitted
    """Add one fp32 value (its bits) to the exponent-binned integer sums s1 (of the signed
    significand) and s2 (of its square) of column c; returns (exponent bin, significand)."""
    e = (bits >> 23) & 0xFF
    m = np.int64(bits & 0x7FFFFF)
    if e == 0:
        e = 1                                                 # denormals share the first bin
    else:
        m |= 0x800000
    if bits >> 31:
        s1[c, e] -= m
    else:
        s1[c, e] += m
    s2[c, e] += m * m
    return e, m


@njit(cache=True, nogil=True)
def _reduce_layer(gate_bits, dot_bits, gate, dot, live, cids, g1, g2, d1, d2, dabs, counts, minmax,
                  fine, tok_sum, fine_bins, clamp):  # pragma: no cover - jitted
    """One layer of one chunk: gate, dot [T, hc] (fp32, and their uint32 bits), live [T],
    cids [T] compressed ids. Exponent-binned integer sums into g1/g2/d1/d2/dabs [hc, 256] int64,
    counts [hc, 6] int64 (n, n_nonfinite, masked_nonzero, n_dot, n_clamped, n_dot_nonfinite),
    minmax [hc, 4] f64 (gate min, max, dot min, max), fine [hc, fine_bins], tok_sum [hc, V]."""
    T, hc = gate.shape
    scale = 4294967296.0                                      # 2^FIXED_POINT_BITS
    for t in range(T):
        for c in range(hc):
            g = gate[t, c]
            if not live[t]:
                if g != 0.0:
                    counts[c, 2] += 1
                continue
            if not np.isfinite(g):
                counts[c, 1] += 1
            else:
                counts[c, 0] += 1
                e, m = _add_exact(gate_bits[t, c], g1, g2, c)
                gv = np.float64(g)
                if gv < minmax[c, 0]:
                    minmax[c, 0] = gv
                if gv > minmax[c, 1]:
                    minmax[c, 1] = gv
                b = np.int64(gv * fine_bins)
                if b < 0:
                    b = 0
                elif b >= fine_bins:
                    b = fine_bins - 1
                fine[c, b] += 1
                tok_sum[c, cids[t]] += np.int64(np.rint(gv * scale))
            d = dot[t, c]
            if not np.isfinite(d):
                counts[c, 5] += 1
                continue
            counts[c, 3] += 1
            e, m = _add_exact(dot_bits[t, c], d1, d2, c)
            dabs[c, e] += m
            dv = np.float64(d)
            if dv < minmax[c, 2]:
                minmax[c, 2] = dv
            if dv > minmax[c, 3]:
                minmax[c, 3] = dv
            if abs(dv) < clamp:
                counts[c, 4] += 1


@njit(cache=True, nogil=True)
def _mark_rows(bitmap, ids):  # pragma: no cover - jitted
    """Set bit ids[i] of the byte bitmap (bit i&7 of byte i>>3) for every id."""
    for i in range(ids.size):
        r = ids[i]
        bitmap[r >> 3] |= np.uint8(1 << (r & 7))


@njit(cache=True, nogil=True)
def _popcount_range(bitmap, lo, hi):  # pragma: no cover - jitted
    """Set bits in [lo, hi)."""
    n = 0
    for r in range(lo, hi):
        if (bitmap[r >> 3] >> (r & 7)) & 1:
            n += 1
    return n


# Exact sums -----------------------------------------------------------------------------------

def _fold(acc: np.ndarray, power: int) -> list[int]:
    """[hc, 256] int64 exponent-binned sums -> per stream, a Python int = sum * 2^(power*149)."""
    out = []
    for row in acc:
        total = 0
        for e in np.flatnonzero(row):
            total += int(row[e]) << (power * (int(e) - 1))
        out.append(total)
    return out


def _mean(s1: int, n: int, power_shift: int = 149) -> float:
    return float(Fraction(s1, n << power_shift)) if n else float("nan")


def _m2(s1: int, s2: int, n: int) -> float:
    """Sum of squared deviations from exact sum (x 2^149) and sum of squares (x 2^298)."""
    if not n:
        return float("nan")
    return float(Fraction(n * s2 - s1 * s1, n << 298))


# Context tables -------------------------------------------------------------------------------

# A context table's slot is one int64 record [W key words | count | L*hc gate sums]: one cache
# miss per token instead of three. count 0 marks an empty slot.

@njit(cache=True, nogil=True)
def _slot_of(slots, W, key):  # pragma: no cover - jitted
    """The slot holding `key`, or the empty slot where it goes (linear probing; never full)."""
    mask = slots.shape[0] - 1
    h = np.uint64(0x9E3779B97F4A7C15)
    for w in range(W):
        h = (h ^ np.uint64(key[w])) * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
    i = np.int64(h & np.uint64(mask))
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

    def _alloc(self, slots: int) -> None:
        self._slots = np.zeros((slots, self.width + 1 + self.n_layers * self.hc), np.int64)

    @property
    def exact(self) -> bool:
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
        """Nothing pending (kept for the callers that fold before reading)."""

    def _sorted(self) -> np.ndarray:
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
        rec = self._sorted()
        W = self.width
        keep_n = max(self.cap // 2, 1)
        count = rec[:, W]
        order = np.lexsort(tuple(rec[:, :W].T[::-1]) + (-count,))       # most frequent first, ties by key
        keep, drop = np.sort(order[:keep_n]), order[keep_n:]
        self.prunes += 1
        self.dropped_entries += int(drop.size)
        self.dropped_occurrences += int(count[drop].sum())
        self.undercount_bound += int(count[drop].max()) if drop.size else 0
        self._load_records(rec[keep], slots=self._slots.shape[0])       # same size: no regrowth

    def merged(self, other: "ContextTable") -> "ContextTable":
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


def _pack_width(max_ngram: int, bits: int) -> tuple[int, int]:
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


# The statistics ----------------------------------------------------------------------------------

@dataclass
class Chunk:
    """One chunk of tokens as the corpus driver hands it to `StreamingGateStats.update`."""

    token_ids: np.ndarray       # [T] int64 raw ids
    live: np.ndarray            # [T] bool
    row_ids: np.ndarray         # [T, L, C] int64
    windows: np.ndarray | None  # [T, M] int64 compressed n-gram windows (None: no context stats)
    gates: dict                 # {layer_id: (dot [T, hc] fp32, gate [T, hc] fp32)}
    n_documents: int = 0        # documents that start in this chunk


class StreamingGateStats:
    """Mergeable statistics of the gate over a corpus (module doc). Build with `empty(model)`;
    `corpus_stats` fills one."""

    def __init__(self, *, layer_ids, hc: int, n_hash_cols: int, n_heads: int, max_ngram: int, compressed_vocab: int,
                 raw_vocab: int, pad_id: int, table_rows, hash_constants: dict | None = None, bins: int = 20,
                 max_contexts: int = DEFAULT_MAX_CONTEXTS, contexts: bool = True, rows: bool = True,
                 meta: dict | None = None, token_map=None, identity: dict | None = None):
        for name, v in (("bins", bins), ("max_contexts", max_contexts)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be a positive integer, got {type(v).__name__} {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v}")
        if FINE_BINS % int(bins):
            raise ValueError(f"bins must divide {FINE_BINS} (the fine histogram), got {bins}")
        self.layer_ids = [int(x) for x in layer_ids]
        self.hc, self.n_hash_cols, self.n_heads, self.max_ngram = int(hc), int(n_hash_cols), int(n_heads), int(max_ngram)
        self.compressed_vocab, self.raw_vocab, self.pad_id = int(compressed_vocab), int(raw_vocab), int(pad_id)
        self.table_rows = [int(x) for x in table_rows]
        self.hash_constants = hash_constants       # multipliers, primes, offsets (lists): rerun the hash
        self.bins = int(bins)
        self.max_contexts = int(max_contexts)
        self.track_contexts, self.track_rows = bool(contexts), bool(rows)
        self.meta: dict = dict(meta or {})
        self.identity = identity                    # the model's identity (engram_numba.identity), or None
        self.tokenizer = None                       # for token strings (not saved; meta names its source)
        self.token_map = None if token_map is None else np.asarray(token_map, np.int64)   # raw -> compressed
        L, hc = len(self.layer_ids), self.hc
        self.n_documents = 0
        self.n_tokens = 0
        self.n_masked = 0
        self.n_chunks = 0
        self.g1 = [[0] * hc for _ in range(L)]      # exact sums x 2^149
        self.g2 = [[0] * hc for _ in range(L)]      # exact sums of squares x 2^298
        self.d1 = [[0] * hc for _ in range(L)]
        self.d2 = [[0] * hc for _ in range(L)]
        self.dabs = [[0] * hc for _ in range(L)]
        self.counts = np.zeros((L, hc, 6), np.int64)
        self.minmax = np.empty((L, hc, 4), np.float64)
        self.minmax[..., 0::2] = np.inf
        self.minmax[..., 1::2] = -np.inf
        self.fine = np.zeros((L, hc, FINE_BINS), np.int64)
        self.tok_count = np.zeros(self.compressed_vocab, np.int64)
        self.tok_gsum = np.zeros((L, hc, self.compressed_vocab), np.int64)
        self.raw_count = np.zeros(self.raw_vocab, np.int64)
        self.bits = max(int(self.compressed_vocab - 1).bit_length(), 1)
        self.key_width, self.per_word = _pack_width(self.max_ngram, self.bits)
        self.contexts = {n: ContextTable(n, self.key_width, L, hc, self.max_contexts, self.bits, self.per_word)
                         for n in range(2, self.max_ngram + 1)} if self.track_contexts else {}
        self.row_bitmaps = [np.zeros(-(-r // 8), np.uint8) for r in self.table_rows] if self.track_rows else []

    def __eq__(self, other):
        """Equal when every count, sum, histogram, context table and row bitmap is, and the meta
        but for its timings (the attached tokenizer, which is not saved, is left out)."""
        from .stats import state_equal
        if type(other) is not type(self):
            return NotImplemented
        untimed = [{k: v for k, v in m.items() if k not in ("timing", "tokens_per_s")} for m in (self.meta, other.meta)]
        return untimed[0] == untimed[1] and state_equal(self, other, skip=("tokenizer", "meta"))

    __hash__ = None

    # construction ----------------------------------------------------------------------------
    @classmethod
    def empty(cls, model, **kwargs) -> "StreamingGateStats":
        cfg, t = model.config, model.hash_tables
        consts = {"multipliers": t.multipliers.tolist(), "primes": t.primes.tolist(), "offsets": t.offsets.tolist()}
        return cls(layer_ids=cfg.layer_ids, hc=cfg.hc, n_hash_cols=cfg.n_hash_cols, n_heads=cfg.n_heads,
                   max_ngram=cfg.max_ngram_size, compressed_vocab=t.compressed_vocab_size, raw_vocab=t.token_map.size,
                   pad_id=t.pad_id, table_rows=[int(x) for x in t.table_rows], hash_constants=consts,
                   token_map=t.token_map, identity=model_identity(model), **kwargs)

    def _shape_key(self) -> tuple:
        return (tuple(self.layer_ids), self.hc, self.n_hash_cols, self.n_heads, self.max_ngram, self.compressed_vocab,
                self.raw_vocab, self.pad_id, tuple(self.table_rows), self.bins, self.max_contexts,
                self.track_contexts, self.track_rows)

    # streaming -------------------------------------------------------------------------------
    def update(self, chunk: Chunk, token_map: np.ndarray, pool=None) -> None:
        """Add one chunk (the driver's `Chunk`); token_map: raw -> compressed ids.

        pool: a concurrent.futures executor to run the per-layer reductions and the per-order
        context tables side by side (they touch disjoint state, and the @njit parts release the
        GIL); the result is the same with or without it."""
        T = int(chunk.token_ids.size)
        live = np.ascontiguousarray(chunk.live, dtype=np.bool_)
        cids = np.asarray(token_map, dtype=np.int64)[chunk.token_ids]               # [T]
        self.n_tokens += T
        self.n_masked += int(T - live.sum())
        self.n_documents += int(chunk.n_documents)
        self.n_chunks += 1
        self._add_counts(self.tok_count, cids[live])
        self._add_counts(self.raw_count, chunk.token_ids[live])
        gates = {}
        for lid in self.layer_ids:
            dot, gate = chunk.gates[lid]
            gates[lid] = (np.ascontiguousarray(dot, dtype=np.float32), np.ascontiguousarray(gate, dtype=np.float32))
        tasks = [(self._update_layer, li, gates[lid], live, cids, chunk.row_ids) for li, lid in enumerate(self.layer_ids)]
        if self.track_contexts and chunk.windows is not None:
            q_all = np.empty((T, len(self.layer_ids), self.hc), np.int64)          # [T, L, hc] fixed point
            for li, lid in enumerate(self.layer_ids):
                g = gates[lid][1]
                g = np.where(live[:, None] & np.isfinite(g), g, 0.0).astype(np.float64)
                q_all[:, li, :] = np.rint(g * float(1 << FIXED_POINT_BITS)).astype(np.int64)
            windows = np.ascontiguousarray(chunk.windows, dtype=np.int64)
            tasks += [(table.add_tokens, windows, live, q_all) for table in self.contexts.values()]
        if pool is None:
            for fn, *args in tasks:
                fn(*args)
        else:
            for f in [pool.submit(fn, *args) for fn, *args in tasks]:
                f.result()

    def _update_layer(self, li: int, dot_gate, live, cids, row_ids) -> None:
        dot, gate = dot_gate
        T = gate.shape[0]
        for t0 in range(0, T, MAX_CALL_TOKENS):
            t1 = min(T, t0 + MAX_CALL_TOKENS)
            acc = [np.zeros((self.hc, _EXP_BINS), np.int64) for _ in range(5)]
            _reduce_layer(gate[t0:t1].view(np.uint32), dot[t0:t1].view(np.uint32), gate[t0:t1], dot[t0:t1],
                          live[t0:t1], cids[t0:t1], *acc, self.counts[li], self.minmax[li], self.fine[li],
                          self.tok_gsum[li], FINE_BINS, GATE_CLAMP)
            for name, a, power in (("g1", acc[0], 1), ("g2", acc[1], 2), ("d1", acc[2], 1), ("d2", acc[3], 2),
                                   ("dabs", acc[4], 1)):
                tot = getattr(self, name)[li]
                for c, v in enumerate(_fold(a, power)):
                    tot[c] += v
        if self.track_rows:
            ids = np.ascontiguousarray(row_ids[live, li, :]).reshape(-1)
            _mark_rows(self.row_bitmaps[li], ids)

    @staticmethod
    def _add_counts(target: np.ndarray, ids: np.ndarray) -> None:
        if ids.size:
            target += np.bincount(ids, minlength=target.size).astype(np.int64)[: target.size]

    # merging ------------------------------------------------------------------------------------
    def __add__(self, other: "StreamingGateStats") -> "StreamingGateStats":
        if not isinstance(other, StreamingGateStats):
            return NotImplemented
        if self._shape_key() != other._shape_key():
            mine, theirs = self._shape_key(), other._shape_key()
            names = ("layer_ids", "hc", "n_hash_cols", "n_heads", "max_ngram", "compressed_vocab", "raw_vocab",
                     "pad_id", "table_rows", "bins", "max_contexts", "contexts", "rows")
            what = [f"{n}: {a} vs {b}" for n, a, b in zip(names, mine, theirs) if a != b]
            raise ValueError("cannot merge statistics of different models or settings (" + "; ".join(what) + ")")
        differ = identity_mismatch(self.identity, other.identity)
        if differ:
            raise ValueError("cannot merge statistics of different models: their " + ", ".join(differ) + " differ")
        out = StreamingGateStats.__new__(StreamingGateStats)
        out.__dict__.update({k: v for k, v in self.__dict__.items()})
        out.meta = _merge_meta(self.meta, other.meta)
        for f in ("n_documents", "n_tokens", "n_masked", "n_chunks"):
            setattr(out, f, getattr(self, f) + getattr(other, f))
        for f in ("g1", "g2", "d1", "d2", "dabs"):
            a, b = getattr(self, f), getattr(other, f)
            setattr(out, f, [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)])
        out.counts = self.counts + other.counts
        out.minmax = self.minmax.copy()
        out.minmax[..., 0::2] = np.minimum(self.minmax[..., 0::2], other.minmax[..., 0::2])
        out.minmax[..., 1::2] = np.maximum(self.minmax[..., 1::2], other.minmax[..., 1::2])
        out.fine = self.fine + other.fine
        out.tok_count = self.tok_count + other.tok_count
        out.tok_gsum = self.tok_gsum + other.tok_gsum
        out.raw_count = self.raw_count + other.raw_count
        out.contexts = {n: t.merged(other.contexts[n]) for n, t in self.contexts.items()}
        out.row_bitmaps = [a | b for a, b in zip(self.row_bitmaps, other.row_bitmaps)]
        out.tokenizer = self.tokenizer or other.tokenizer
        out.identity = self.identity if self.identity is not None else other.identity
        return out

    def finish(self) -> "StreamingGateStats":
        """Fold pending context rows in (every query does this too)."""
        for t in self.contexts.values():
            t.flush()
        return self

    # per layer and stream -------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return list(self.layer_ids)

    def streams(self, layer_id: int) -> int:
        self._li(layer_id)
        return self.hc

    def _li(self, layer_id) -> int:
        from .._argcheck import need_int
        need_int(layer_id, "layer_id")
        try:
            return self.layer_ids.index(int(layer_id))
        except ValueError:
            raise KeyError(f"layer {layer_id} is not in these statistics; layers are {self.layer_ids}") from None

    @property
    def edges(self) -> np.ndarray:
        return np.linspace(0.0, 1.0, self.bins + 1)

    def histogram(self, layer_id: int, stream: int, bins: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(counts, edges) of the gate over [0, 1], summed from the fine histogram (bins must divide
        FINE_BINS = 100,000)."""
        from .._argcheck import need_int
        bins = self.bins if bins is None else need_int(bins, "bins", 1)
        if bins < 1 or FINE_BINS % bins:
            raise ValueError(f"bins must divide {FINE_BINS} (the fine histogram), got {bins}")
        fine = self.fine[self._li(layer_id), _stream(stream)]
        return fine.reshape(bins, FINE_BINS // bins).sum(axis=1), np.linspace(0.0, 1.0, bins + 1)

    def quantile(self, layer_id: int, stream: int, q) -> np.ndarray:
        """Quantiles of the gate from the fine histogram (resolution 1e-5, module doc)."""
        fine = self.fine[self._li(layer_id), _stream(stream)]
        n = int(fine.sum())
        qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
        if n == 0:
            return np.full(qs.shape, np.nan)
        cum = np.cumsum(fine)

        def at(rank: int) -> float:
            """The value of order statistic `rank`, placed inside its fine bin (error < 1e-5)."""
            b = min(int(np.searchsorted(cum, rank, side="right")), FINE_BINS - 1)
            before = int(cum[b - 1]) if b else 0
            return (b + (rank - before + 0.5) / max(int(fine[b]), 1)) / FINE_BINS
        out = []
        for x in qs:
            r = x * (n - 1)                                 # np.quantile's (linear) interpolation
            lo = math.floor(r)
            hi = min(lo + 1, n - 1)
            out.append(at(lo) + (r - lo) * (at(hi) - at(lo)))
        li = self._li(layer_id)
        lo, hi = self.minmax[li, int(stream), 0], self.minmax[li, int(stream), 1]
        return np.clip(np.array(out), lo, hi)

    def __getitem__(self, key) -> StreamGateStats:
        """st[layer_id, stream] -> a StreamGateStats (the fields `gate_stats` gives)."""
        layer_id, stream = key
        li, c = self._li(layer_id), int(stream)
        if not 0 <= c < self.hc:
            raise KeyError(f"stream {stream} is outside 0..{self.hc - 1}")
        n, n_nonfinite, masked_nonzero, n_dot, n_clamped, _ = (int(x) for x in self.counts[li, c])
        mean = _mean(self.g1[li][c], n)
        m2 = _m2(self.g1[li][c], self.g2[li][c], n)
        q = self.quantile(layer_id, c, QUANTILES)
        nan = float("nan")
        gmin, gmax = (float(self.minmax[li, c, 0]), float(self.minmax[li, c, 1])) if n else (nan, nan)
        dmin, dmax = (float(self.minmax[li, c, 2]), float(self.minmax[li, c, 3])) if n_dot else (nan, nan)
        return StreamGateStats(
            layer=int(layer_id), stream=c, n=n, n_masked=self.n_masked, masked_nonzero=masked_nonzero,
            n_nonfinite=n_nonfinite, mean=mean, std=math.sqrt(m2 / n) if n else float("nan"), min=gmin, max=gmax,
            q05=float(q[0]), q25=float(q[1]), q50=float(q[2]), q75=float(q[3]), q95=float(q[4]),
            dot_mean_abs=_mean(self.dabs[li][c], n_dot), dot_min=dmin, dot_max=dmax, n_clamped=n_clamped,
            clamp_frac=n_clamped / n_dot if n_dot else float("nan"), hist_counts=self.histogram(layer_id, c)[0])

    def moments(self, layer_id: int, stream: int, what: str = "gate") -> dict:
        """count, mean, M2 (sum of squared deviations), min, max of the gate or the dot, exact."""
        li, c = self._li(layer_id), int(stream)
        if what == "gate":
            n, s1, s2, lo, hi = int(self.counts[li, c, 0]), self.g1[li][c], self.g2[li][c], *self.minmax[li, c, :2]
        elif what == "dot":
            n, s1, s2, lo, hi = int(self.counts[li, c, 3]), self.d1[li][c], self.d2[li][c], *self.minmax[li, c, 2:]
        else:
            raise ValueError(f"what must be 'gate' or 'dot', got {what!r}")
        return {"count": n, "mean": _mean(s1, n), "M2": _m2(s1, s2, n), "min": float(lo) if n else float("nan"),
                "max": float(hi) if n else float("nan"),
                "sum": float(Fraction(s1, 1 << 149)), "sum_sq": float(Fraction(s2, 1 << 298))}

    def __iter__(self):
        return (self[lid, c] for lid in self.layer_ids for c in range(self.hc))

    def __len__(self) -> int:
        return len(self.layer_ids) * self.hc

    @property
    def rows(self) -> list[StreamGateStats]:
        return list(self)

    # tokens and contexts -------------------------------------------------------------------------
    def representative_raw(self) -> np.ndarray:
        """[compressed vocab] the raw id that names each compressed id: its most frequent raw
        token in the corpus (ties, and ids never seen: the smallest raw id); -1 without a token map."""
        if self.token_map is None:
            return np.full(self.compressed_vocab, -1, np.int64)
        token_map = self.token_map
        order = np.lexsort((np.arange(token_map.size), -self.raw_count, token_map))
        first = np.ones(order.size, dtype=bool)
        first[1:] = token_map[order][1:] != token_map[order][:-1]
        rep = np.full(self.compressed_vocab, -1, np.int64)
        rep[token_map[order][first]] = order[first]
        return rep

    def _string_of_compressed(self, rep: np.ndarray, cid: int) -> str | None:
        r = int(rep[cid]) if 0 <= cid < rep.size else -1
        if self.tokenizer is None or r < 0 or r >= self.tokenizer.vocab_size:
            return None
        return self.tokenizer.token_string(r)

    def _mean_gate(self, gsum, count):
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, gsum / np.maximum(count, 1) / float(1 << FIXED_POINT_BITS), np.nan)

    def top_tokens(self, layer_id: int, stream: int | None = None, k: int = 20, by: str = "count",
                   min_count: int = 1, ascending: bool = False) -> list[dict]:
        """The k compressed tokens with the most occurrences (by="count") or the highest mean gate
        (by="mean_gate", among tokens seen at least min_count times; ascending=True: the lowest).
        stream None averages the streams. Each: compressed_id, raw_id (most frequent), token, count, mean_gate."""
        li = self._li(layer_id)
        gsum = self.tok_gsum[li].sum(axis=0) if stream is None else self.tok_gsum[li, int(stream)]
        denom = self.tok_count * (self.hc if stream is None else 1)
        mean = self._mean_gate(gsum, denom)
        ids = np.flatnonzero(self.tok_count >= max(min_count, 1))
        return self._top(ids, self.tok_count[ids], mean[ids], k, by, ascending,
                         lambda i, rep: {"compressed_id": int(i), "raw_id": int(rep[i]),
                                         "token": self._string_of_compressed(rep, int(i))})

    def _top(self, ids, counts, means, k, by, ascending, describe):
        if by not in ("count", "mean_gate"):
            raise ValueError(f"by must be 'count' or 'mean_gate', got {by!r}")
        primary = counts if by == "count" else means
        sign = 1 if ascending else -1
        order = np.lexsort((np.arange(ids.size), sign * primary))[:k]
        rep = self.representative_raw()
        out = []
        for j in order:
            d = describe(ids[j], rep)
            d.update({"count": int(counts[j]), "mean_gate": float(means[j])})
            out.append(d)
        return out

    def context_table(self, order: int) -> ContextTable:
        if not self.track_contexts:
            raise KeyError("these statistics were gathered without context tracking (contexts=False)")
        try:
            t = self.contexts[int(order)]
        except KeyError:
            raise KeyError(f"no context order {order}; orders are {sorted(self.contexts)}") from None
        t.flush()
        return t

    fixed_point_scale = float(1 << FIXED_POINT_BITS)   # per-key gate sums are in units of 1 / this

    def context_windows(self, order: int) -> np.ndarray:
        """The tracked contexts of `order` as compressed ids [G, order], slot 0 the current token
        (the rows of `context_table(order)`)."""
        t = self.context_table(order)
        return unpack_contexts(t.keys, t.order, self.bits, self.per_word)

    def top_contexts(self, order: int, layer_id: int, stream: int | None = None, k: int = 20, by: str = "count",
                     min_count: int = 1, ascending: bool = False) -> list[dict]:
        """The k n-gram contexts of `order` by occurrences or mean gate (see top_tokens). Each:
        ids (compressed, oldest first), tokens (their most frequent raw token strings), text, count, mean_gate."""
        t = self.context_table(order)
        li = self._li(layer_id)
        gsum = t.gsum[:, li, :].sum(axis=1) if stream is None else t.gsum[:, li, int(stream)]
        mean = self._mean_gate(gsum, t.count * (self.hc if stream is None else 1))
        ids = np.flatnonzero(t.count >= max(min_count, 1))
        windows = unpack_contexts(t.keys, t.order, self.bits, self.per_word)     # [G, order] slot 0 = current

        def describe(i, rep):
            cids = windows[i][::-1].tolist()                                    # oldest first
            strings = [self._string_of_compressed(rep, c) for c in cids]
            text = None if any(s is None for s in strings) else "".join(strings)
            return {"ids": cids, "tokens": strings, "text": text}
        return self._top(ids, t.count[ids], mean[ids], k, by, ascending, describe)

    # row ids -------------------------------------------------------------------------------------
    def columns(self) -> list[dict]:
        """Per layer and hash column: order, head, reads (live tokens), distinct row ids (exact,
        from the bitmap), tracked contexts of the column's order, the distinct ids they hash to,
        collisions (tracked contexts - their distinct ids) and whether that is exact."""
        if not self.track_rows:
            raise KeyError("these statistics were gathered without row tracking (rows=False)")
        out = []
        offsets = None if self.hash_constants is None else np.asarray(self.hash_constants["offsets"], np.int64)
        primes = None if self.hash_constants is None else np.asarray(self.hash_constants["primes"], np.int64)
        ctx_ids = self._context_row_ids() if self.track_contexts and self.hash_constants is not None else {}
        reads = self.n_tokens - self.n_masked
        for li, lid in enumerate(self.layer_ids):
            for col in range(self.n_hash_cols):
                order = col // self.n_heads + 2
                lo = int(offsets[li, col]) if offsets is not None else 0
                hi = lo + int(primes.reshape(len(self.layer_ids), -1)[li, col]) if primes is not None else self.table_rows[li]
                distinct = int(_popcount_range(self.row_bitmaps[li], lo, hi))
                rec = {"layer": lid, "col": col, "order": order, "head": col % self.n_heads, "reads": int(reads),
                       "distinct_ids": distinct, "rows_in_column": hi - lo}
                if (li, col) in ctx_ids:
                    tracked, tracked_ids = ctx_ids[(li, col)]
                    t = self.contexts[order]
                    rec.update({"distinct_contexts": tracked, "ids_of_contexts": tracked_ids,
                                "collisions": tracked - tracked_ids, "exact": t.exact})
                out.append(rec)
        return out

    def _context_row_ids(self) -> dict:
        """{(layer index, col): (tracked contexts of the column's order, distinct ids they hash to)}."""
        mult = np.asarray(self.hash_constants["multipliers"], np.int64)
        primes = np.asarray(self.hash_constants["primes"], np.int64)
        offsets = np.asarray(self.hash_constants["offsets"], np.int64)
        M, L, C = self.max_ngram, len(self.layer_ids), self.n_hash_cols
        out = {}
        for n, t in self.contexts.items():
            t.flush()
            windows = unpack_contexts(t.keys, n, self.bits, self.per_word)     # [G, n]
            G = windows.shape[0]
            ids_all = np.empty((G, L, C), np.int64)
            batch = 16384
            for b0 in range(0, G, batch):
                w = windows[b0:b0 + batch]
                g = w.shape[0]
                hist = np.full((g, M), self.pad_id, np.int64)                  # each context in its own M slots
                hist[:, M - n:] = w[:, ::-1]                                    # oldest first, current last
                out_b = np.empty((g * M, L, C), np.int64)
                hash_positions(hist.reshape(-1), 0, g * M, mult, primes, offsets, self.pad_id, out_b)
                ids_all[b0:b0 + g] = out_b[M - 1::M]
            for li in range(L):
                for col in range(C):
                    if col // self.n_heads + 2 == n:
                        out[(li, col)] = (G, int(np.unique(ids_all[:, li, col]).size))
        return out

    # reports -------------------------------------------------------------------------------------
    @property
    def highway(self) -> str:
        return str(self.meta.get("highway", "unknown"))

    @property
    def highway_is_synthetic(self) -> bool:
        return self.highway.startswith("synthetic")

    def _header(self) -> str:
        syn = " (SYNTHETIC highway: the gate reflects the table rows, not a real model's hidden states)" \
            if self.highway_is_synthetic else ""
        return (f"corpus gate statistics: {self.n_documents} documents, {self.n_tokens} tokens, {self.n_masked} "
                f"masked (excluded), layers {self.layer_ids}; highway: {self.highway}{syn}")

    def table(self) -> str:
        from .stats import GateStats
        gs = GateStats.__new__(GateStats)
        cols = GateStats._COLUMNS
        rows = [list(cols)] + [gs._cells(r) for r in self]
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = [self._header()]
        for j, row in enumerate(rows):
            lines.append("  ".join(c.rjust(w) if j and i > 1 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append(f"(quantiles from a {FINE_BINS:,}-bin histogram: resolution 1e-5)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.table())}</pre>"

    def summary(self, k: int = 10, min_count: int = 5) -> str:
        """A markdown report: the header, per-stream table, top tokens and contexts, hash columns."""
        from ..text import token_label
        lab = (lambda s: "?" if s is None else token_label(s))
        out = ["# Engram gate statistics", "", self._header(), ""]
        if self.meta.get("corpus"):
            out += [f"corpus: {self.meta['corpus']}", ""]
        out += ["## Per layer and stream", "", "```", self.table(), "```", ""]
        for lid in self.layer_ids:
            out += [f"## Layer {lid}: compressed tokens", ""]
            for by, asc, title in (("count", False, "most frequent"), ("mean_gate", False, "highest mean gate"),
                                   ("mean_gate", True, "lowest mean gate")):
                mc = 1 if by == "count" else min_count
                rows = self.top_tokens(lid, None, k=k, by=by, min_count=mc, ascending=asc)
                out += [f"{title} (mean over streams{'' if by == 'count' else f', seen >= {mc} times'}):", "",
                        "| compressed id | token | count | mean gate |", "|---:|---|---:|---:|"]
                out += [f"| {r['compressed_id']} | `{lab(r['token'])}` | {r['count']} | {r['mean_gate']:.4f} |"
                        for r in rows]
                out.append("")
        if self.track_contexts:
            for n in sorted(self.contexts):
                t = self.context_table(n)
                note = "exact" if t.exact else (f"pruned {t.prunes}x: counts may be low by up to {t.undercount_bound}")
                out += [f"## {n}-gram contexts ({t.count.size} tracked, {note})", ""]
                lid = self.layer_ids[0]
                for by in ("count", "mean_gate"):
                    mc = 1 if by == "count" else min_count
                    rows = self.top_contexts(n, lid, None, k=k, by=by, min_count=mc)
                    out += [f"top by {by} (layer {lid}, mean over streams):", "", "| context | count | mean gate |",
                            "|---|---:|---:|"]
                    out += [f"| `{' · '.join(lab(s) for s in r['tokens'])}` | {r['count']} | {r['mean_gate']:.4f} |"
                            for r in rows]
                    out.append("")
        if self.track_rows:
            out += ["## Hash columns: row-id usage and collisions", "",
                    "| layer | col | order | head | reads | distinct ids | contexts | ids of contexts | collisions |",
                    "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in self.columns():
                out.append(f"| L{r['layer']} | {r['col']} | {r['order']} | {r['head']} | {r['reads']} | "
                           f"{r['distinct_ids']} | {r.get('distinct_contexts', '-')} | {r.get('ids_of_contexts', '-')} | "
                           f"{r.get('collisions', '-')}{'' if r.get('exact', True) else ' (lower bound)'} |")
            out.append("")
        return "\n".join(out)

    def to_json(self) -> dict:
        """The summary numbers as plain JSON (per stream, per column, top-k lists)."""
        def clean(v):
            return None if isinstance(v, float) and not np.isfinite(v) else v
        streams = []
        for r in self:
            d = {k: clean(v) for k, v in r.__dict__.items() if k != "hist_counts"}
            d.update({f"{w}_{k}": clean(v) for w in ("gate", "dot") for k, v in self.moments(r.layer, r.stream, w).items()})
            streams.append(d)
        out = {"n_documents": self.n_documents, "n_tokens": self.n_tokens, "n_masked": self.n_masked,
               "n_chunks": self.n_chunks, "highway": self.highway, "highway_is_synthetic": self.highway_is_synthetic,
               "fine_bins": FINE_BINS, "quantile_resolution": 1.0 / FINE_BINS, "bins": self.bins,
               "meta": self.meta, "streams": streams,
               "top_tokens": {str(lid): {by: self.top_tokens(lid, None, 20, by, 1 if by == "count" else 5)
                                         for by in ("count", "mean_gate")} for lid in self.layer_ids}}
        if self.track_contexts:
            out["contexts"] = {str(n): {"tracked": int(t.count.size), "exact": t.exact, "prunes": t.prunes,
                                        "dropped_occurrences": t.dropped_occurrences,
                                        "undercount_bound": t.undercount_bound,
                                        "top_by_count": self.top_contexts(n, self.layer_ids[0], None, 20, "count")}
                               for n, t in ((n, self.context_table(n)) for n in sorted(self.contexts))}
        if self.track_rows:
            out["columns"] = self.columns()
        return json.loads(json.dumps(out, default=lambda o: o.item() if hasattr(o, "item") else str(o)))

    def tables(self, frames: bool = True) -> dict:
        """The aggregate tables: streams, histogram, tokens, contexts, columns; pandas DataFrames
        (the `analysis` extra) or, frames=False, lists of dicts."""
        from .tables import aggregate_tables
        return aggregate_tables(self, frames=frames)

    # saving -------------------------------------------------------------------------------------
    def save(self, path, compresslevel: int | None = None) -> None:
        """Write the whole state to one .npz (exact integers as decimal strings in its JSON), for
        merging later: StreamingGateStats.load(a) + StreamingGateStats.load(b).
        compresslevel: zlib's level (default 6; 1 writes a released-size state several times
        faster, a little larger)."""
        self.finish()
        head = {"version": STATE_VERSION, "layer_ids": self.layer_ids, "hc": self.hc, "n_hash_cols": self.n_hash_cols,
                "n_heads": self.n_heads, "max_ngram": self.max_ngram, "compressed_vocab": self.compressed_vocab,
                "raw_vocab": self.raw_vocab, "pad_id": self.pad_id, "table_rows": self.table_rows,
                "hash_constants": self.hash_constants, "bins": self.bins, "max_contexts": self.max_contexts,
                "contexts": self.track_contexts, "rows": self.track_rows,
                "meta": self.meta, "identity": self.identity,
                "n_documents": self.n_documents, "n_tokens": self.n_tokens, "n_masked": self.n_masked,
                "n_chunks": self.n_chunks,
                "exact": {f: [[str(x) for x in row] for row in getattr(self, f)] for f in ("g1", "g2", "d1", "d2", "dabs")},
                "context_counters": {str(n): [t.prunes, t.dropped_entries, t.dropped_occurrences, t.undercount_bound]
                                     for n, t in self.contexts.items()}}
        arrays = {"counts": self.counts, "minmax": self.minmax, "fine": self.fine, "tok_count": self.tok_count,
                  "tok_gsum": self.tok_gsum, "raw_count": self.raw_count}
        if self.token_map is not None:
            arrays["token_map"] = self.token_map
        for n, t in self.contexts.items():
            arrays[f"ctx{n}_keys"], arrays[f"ctx{n}_count"], arrays[f"ctx{n}_gsum"] = t.keys, t.count, t.gsum
        for li, bm in enumerate(self.row_bitmaps):
            arrays[f"rows{li}"] = bm
        if compresslevel is None:
            np.savez_compressed(path, __state__=np.array(json.dumps(head)), **arrays)
            return
        import zipfile
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=int(compresslevel)) as zf:
            for name, a in {"__state__": np.array(json.dumps(head)), **arrays}.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)

    @classmethod
    def load(cls, path) -> "StreamingGateStats":
        """Read a file written by `save`. Anything else, or a file whose arrays do not have the
        shapes its header implies, is a `StatisticsFileError` naming the file and the entry."""
        return _load_state(cls, path)


def _stream(stream) -> int:
    from .._argcheck import need_int
    return need_int(stream, "stream", 0)


def _merge_meta(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k == "corpus" and out[k] != v:
            out[k] = f"{out[k]} + {v}"
        elif k == "highway" and out[k] != v:
            out[k] = f"{out[k]} | {v}"
    return out


def merge(parts) -> StreamingGateStats:
    """The statistics of all `parts` together (same model and settings): part_1 + part_2 + ..."""
    if isinstance(parts, (str, bytes, StreamingGateStats)) or not hasattr(parts, "__iter__"):
        raise TypeError(f"merge: parts must be a list of StreamingGateStats, got {type(parts).__name__}")
    parts = list(parts)
    if not parts:
        raise ValueError("merge needs at least one StreamingGateStats")
    for i, p in enumerate(parts):
        if not isinstance(p, StreamingGateStats):
            raise TypeError(f"merge: parts[{i}] is {type(p).__name__}, not a StreamingGateStats")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total.finish()


# Reading a saved state ----------------------------------------------------------------------------

class StatisticsFileError(EngramFileError, ValueError):
    """A file `StreamingGateStats.load` cannot take: not a statistics file, an older one, or one
    whose header and arrays disagree (the message names the entry)."""


_EXACT_FIELDS = ("g1", "g2", "d1", "d2", "dabs")
_MAX_EXACT_DIGITS = 400         # exact sums x 2^298 of up to 2^63 values stay far below this


def _load_state(cls, path) -> StreamingGateStats:
    from ..formats.gguf import check_regular_file
    from ..formats.jsonsafe import field, load_json
    from ..formats.npz import member_header, open_npz, read_member
    from .._argcheck import need_path
    E = StatisticsFileError
    need_path(path)
    try:
        check_regular_file(path, "statistics file")
    except EngramFileError as exc:
        raise E(str(exc)) from None
    zf, members = open_npz(path, E)
    with zf:
        if "__state__" not in members:
            what = " (a capture: Capture.load reads it)" if "__meta__" in members else ""
            raise E(f"{path} is not a statistics file saved by StreamingGateStats.save (no __state__ entry){what}")
        state = read_member(zf, members["__state__"], path, E)
        if state.shape != () or state.dtype.kind != "U":
            raise E(f"{path}: __state__ is {state.dtype}{list(state.shape)}, not one JSON string")
        head = load_json(str(state), f"{path}: __state__", E, what="state")
        if not isinstance(head, dict):
            raise E(f"{path}: __state__ is a JSON {type(head).__name__}, not an object")
        version = head.get("version")
        if version != STATE_VERSION:
            older = isinstance(version, int) and not isinstance(version, bool) and version < STATE_VERSION
            raise E(f"{path}: statistics state version {str(version)[:20]}, this reader knows {STATE_VERSION}"
                    + (": written by an older version of engram_numba; recompute it" if older else ""))
        src = f"{path}: __state__"

        def num(key, lo=0):
            v = field(head, key, int, src, E)
            if v < lo:
                raise E(f"{src}: key {key!r} must be >= {lo}, got {v}")
            return v

        layer_ids = field(head, "layer_ids", list, src, E)
        if not layer_ids or len(layer_ids) > 4096 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in layer_ids):
            raise E(f"{src}: key 'layer_ids' must be a non-empty list of integers")
        L = len(layer_ids)
        hc, n_hash_cols, n_heads, max_ngram = num("hc", 1), num("n_hash_cols", 1), num("n_heads", 1), num("max_ngram", 2)
        V, R = num("compressed_vocab", 1), num("raw_vocab", 1)
        pad = num("pad_id")
        if pad >= V:
            raise E(f"{src}: pad_id {pad} is outside the compressed vocabulary [0, {V})")
        table_rows = field(head, "table_rows", list, src, E)
        if len(table_rows) != L or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in table_rows):
            raise E(f"{src}: key 'table_rows' must be {L} positive integers")
        bins, max_contexts = num("bins", 1), num("max_contexts", 1)
        contexts, rows = field(head, "contexts", bool, src, E), field(head, "rows", bool, src, E)
        meta = field(head, "meta", dict, src, E)
        consts = field(head, "hash_constants", dict, src, E, required=False)
        counters = {k: num(k) for k in ("n_documents", "n_tokens", "n_masked", "n_chunks")}
        exact = field(head, "exact", dict, src, E)
        sums = {}
        for k in _EXACT_FIELDS:
            rows_k = exact.get(k)
            if (not isinstance(rows_k, list) or len(rows_k) != L or
                    not all(isinstance(r, list) and len(r) == hc for r in rows_k)):
                raise E(f"{src}: exact.{k} must be {L} lists of {hc} decimal strings")
            try:
                sums[k] = [[_exact_int(x) for x in r] for r in rows_k]
            except (TypeError, ValueError):
                raise E(f"{src}: exact.{k} holds a value that is not a decimal integer of at most "
                        f"{_MAX_EXACT_DIGITS} digits") from None
        # every array's declared shape, before anything of the header's sizes is allocated
        width, _ = _pack_width(max_ngram, max(int(V - 1).bit_length(), 1))
        want = {"counts": ((L, hc, 6), np.int64), "minmax": ((L, hc, 4), np.float64),
                "fine": ((L, hc, FINE_BINS), np.int64), "tok_count": ((V,), np.int64),
                "tok_gsum": ((L, hc, V), np.int64), "raw_count": ((R,), np.int64)}
        if "token_map" in members:
            want["token_map"] = ((R,), np.int64)
        if rows:
            for li, r in enumerate(table_rows):
                want[f"rows{li}"] = ((-(-r // 8),), np.uint8)
        shapes = {}
        for name, (shape, dtype) in want.items():
            if name not in members:
                raise E(f"{path}: array {name!r} is missing")
            got_shape, got_dtype = member_header(zf, members[name], path, E)
            if got_shape != shape or got_dtype != np.dtype(dtype):
                raise E(f"{path}: array {name!r} is {got_dtype}{list(got_shape)[:6]}, but the header makes it "
                        f"{np.dtype(dtype)}{list(shape)}")
            shapes[name] = got_shape
        ctx_names = {}
        if contexts:
            for n in range(2, max_ngram + 1):
                names = (f"ctx{n}_keys", f"ctx{n}_count", f"ctx{n}_gsum")
                hs = []
                for name in names:
                    if name not in members:
                        raise E(f"{path}: array {name!r} is missing")
                    hs.append(member_header(zf, members[name], path, E))
                G = hs[1][0][0] if len(hs[1][0]) == 1 else -1
                for name, (got_shape, got_dtype), shape in zip(names, hs, ((G, width), (G,), (G, L, hc))):
                    if G < 0 or got_shape != shape or got_dtype != np.dtype(np.int64):
                        raise E(f"{path}: array {name!r} is {got_dtype}{list(got_shape)[:6]}, but the header makes "
                                f"it int64{list(shape)}")
                ctx_names[n] = names
        st = cls(layer_ids=layer_ids, hc=hc, n_hash_cols=n_hash_cols, n_heads=n_heads, max_ngram=max_ngram,
                 compressed_vocab=V, raw_vocab=R, pad_id=pad, table_rows=table_rows, hash_constants=consts,
                 bins=bins, max_contexts=max_contexts, contexts=contexts, rows=rows, meta=meta)
        for k, v in counters.items():
            setattr(st, k, v)
        for k, v in sums.items():
            setattr(st, k, v)
        arrays = {name: read_member(zf, members[name], path, E) for name in want}
        st.counts, st.minmax, st.fine = arrays["counts"], arrays["minmax"], arrays["fine"]
        st.tok_count, st.tok_gsum, st.raw_count = arrays["tok_count"], arrays["tok_gsum"], arrays["raw_count"]
        if "token_map" in arrays:
            tm = arrays["token_map"]
            if tm.size and (int(tm.min()) < 0 or int(tm.max()) >= V):
                raise E(f"{path}: array 'token_map' holds ids outside the compressed vocabulary [0, {V})")
            st.token_map = tm
        cc = head.get("context_counters", {})
        for n, names in ctx_names.items():
            c = cc.get(str(n)) if isinstance(cc, dict) else None
            if not (isinstance(c, list) and len(c) == 4 and all(isinstance(x, int) and not isinstance(x, bool)
                                                               and x >= 0 for x in c)):
                raise E(f"{src}: context_counters.{n} must be 4 non-negative integers")
            t = st.contexts[n]
            t.load(*(read_member(zf, members[name], path, E) for name in names))
            t.prunes, t.dropped_entries, t.dropped_occurrences, t.undercount_bound = c
        st.row_bitmaps = [arrays[f"rows{li}"] for li in range(len(st.row_bitmaps))]
    st.identity = _identity_of_state(head, st, src)
    return st


def _exact_int(x) -> int:
    if not isinstance(x, str) or len(x) > _MAX_EXACT_DIGITS:
        raise ValueError(x)
    return int(x)


def _identity_of_state(head: dict, st: StreamingGateStats, src: str) -> dict | None:
    """The identity a state carries; for a file written before identities were kept, rebuilt from
    its hash constants and token map (the encodings stay unknown)."""
    from ..identity import check_identity
    stored = check_identity(head.get("identity"), src, StatisticsFileError)
    rebuilt = {"hash": None, "token_map": None, "encodings": None}
    c = st.hash_constants
    if isinstance(c, dict):
        try:
            L = len(st.layer_ids)
            mult = np.asarray(c["multipliers"], dtype=np.int64).reshape(L, st.max_ngram)
            primes = np.asarray(c["primes"], dtype=np.int64).reshape(L, st.max_ngram - 1, st.n_heads)
            offsets = np.asarray(c["offsets"], dtype=np.int64).reshape(L, st.n_hash_cols)
        except (KeyError, TypeError, ValueError, OverflowError):
            raise StatisticsFileError(f"{src}: hash_constants do not have the shapes of the header's model") from None
        rebuilt["hash"] = constants_digest(st.layer_ids, st.max_ngram, st.n_heads, st.pad_id, mult, primes, offsets)
    if st.token_map is not None:
        rebuilt["token_map"] = token_map_digest(st.token_map)
    if stored is None:
        return rebuilt if (rebuilt["hash"] or rebuilt["token_map"]) else None
    differ = identity_mismatch(stored, rebuilt)
    if differ:
        raise StatisticsFileError(f"{src}: the stored model identity does not match its own {', '.join(differ)}")
    return stored
