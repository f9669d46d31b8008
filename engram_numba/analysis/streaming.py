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

from ..config import GATE_CLAMP
from ..stages.hash.cpu import hash_positions
from ..identity import identity_mismatch, model_identity
from .context_table import ContextTable, pack_width, unpack_contexts
from .reducers import (ACC_LIMIT, ACC_PARTS, EXP_BINS, FINE_BINS, FIXED_POINT_BITS, exact_m2, exact_mean, fold_acc,
                       popcount_range, prepare_chunk, reduce_layer_rows)
from .stats import QUANTILES, StreamGateStats
from .stats_file import STATE_VERSION, load_state

DEFAULT_MAX_CONTEXTS = 200_000
_NO_BITMAP = np.zeros(0, np.uint8)      # (rows=False: no row bitmap to mark)


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
        self.key_width, self.per_word = pack_width(self.max_ngram, self.bits)
        self.contexts = {n: ContextTable(n, self.key_width, L, hc, self.max_contexts, self.bits, self.per_word)
                         for n in range(2, self.max_ngram + 1)} if self.track_contexts else {}
        self.row_bitmaps = [np.zeros(-(-r // 8), np.uint8) for r in self.table_rows] if self.track_rows else []
        self._acc = np.zeros((L, ACC_PARTS, hc, EXP_BINS), np.int64)   # moments not yet folded into g1..dabs
        self._acc_values = 0                        # live tokens in _acc (a fold before ACC_LIMIT)
        self._lane_pending: dict = {}               # {lane key: futures of chunks on that lane}

    def __eq__(self, other):
        """Equal when every count, sum, histogram, context table and row bitmap is, and the meta
        but for its timings (the attached tokenizer, which is not saved, is left out)."""
        from .stats import state_equal
        if type(other) is not type(self):
            return NotImplemented
        self.finish()
        other.finish()
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
    def lane_keys(self) -> list:
        """The parts of `update` that can each run on a lane of its own (an executor with one
        thread): "layer0", "layer1", ... (a layer's moments, histogram, per-token sums and row
        bitmap) and each context order (an int)."""
        return [f"layer{li}" for li in range(len(self.layer_ids))] + list(self.contexts)

    def update(self, chunk: Chunk, token_map: np.ndarray, pool=None, lanes: dict | None = None,
               ahead: int = 16) -> None:
        """Add one chunk (the driver's `Chunk`); token_map: raw -> compressed ids.

        The chunk's ids are checked, its tokens counted and its gates put in fixed point for the
        context tables by one @njit(nogil) call here (a live token whose id, raw, compressed or
        row, is out of range is a ValueError, raised before anything is counted); then each layer
        (moments, histogram, per-token sums, row bitmap) and each context order is added on its own.
        pool: a concurrent.futures executor to run those parts side by side (they touch disjoint
        state and release the GIL); the result is the same with or without it.
        lanes: {key: an executor with one thread} for keys of `lane_keys()`: each such part is
        handed to its lane without waiting (the lane takes its chunks in order, at most `ahead`
        behind), so this call returns as soon as the chunk is handed on, and a context table's
        prune overlaps the next chunks. The chunk's arrays must then stay unchanged until
        `finish()`, which waits for every lane (raising what a lane raised) and which must be
        called before reading the statistics' arrays directly (the methods that read call it)."""
        if lanes is None:
            self._wait_lanes()                  # nothing may run beside a chunk added here
        T = int(chunk.token_ids.size)
        L = len(self.layer_ids)
        live = np.ascontiguousarray(chunk.live, dtype=np.bool_)
        token_ids = np.ascontiguousarray(chunk.token_ids, dtype=np.int64)
        token_map = np.asarray(token_map, dtype=np.int64)
        row_ids = np.ascontiguousarray(chunk.row_ids, dtype=np.int64)               # [T, L, C]
        gates = {}
        for lid in self.layer_ids:
            dot, gate = chunk.gates[lid]
            gates[lid] = (np.ascontiguousarray(dot, dtype=np.float32), np.ascontiguousarray(gate, dtype=np.float32))
        ctx = self.track_contexts and chunk.windows is not None
        q_all = np.empty((T if ctx else 0, L, self.hc), np.int64)                    # [T, L, hc] fixed point
        cids = np.empty(T, np.int64)
        n_raw, n_comp = min(self.raw_count.size, token_map.size), self.tok_count.size
        code, bad, n_live = prepare_chunk(token_ids, live, token_map, n_raw, cids, n_comp, row_ids,
                                          np.asarray(self.table_rows, np.int64), self.track_rows,
                                          tuple(gates[lid][1] for lid in self.layer_ids), q_all,
                                          self.tok_count, self.raw_count)
        if code == 1:
            raise ValueError(f"chunk token id {int(token_ids[bad])} at token {bad} is outside [0, {n_raw})")
        if code == 2:
            raise ValueError(f"chunk compressed id {int(cids[bad])} at token {bad} is outside [0, {n_comp})")
        if code == 3:
            raise ValueError(f"chunk row ids of token {bad} are outside the tables' rows {self.table_rows} "
                             f"(layers {self.layer_ids}): {row_ids[bad].tolist()}")
        self.n_tokens += T
        self.n_masked += int(T - n_live)
        self.n_documents += int(chunk.n_documents)
        self.n_chunks += 1
        if self._acc_values + n_live >= ACC_LIMIT:          # (a corpus of ~2.7e11 tokens a fold)
            self._wait_lanes()
            self._fold()
        self._acc_values += int(n_live)
        # side by side: the layers (moments, histograms and their row bitmaps) and the context
        # orders touch disjoint state, and each is one @njit(nogil) call (a prune: a few)
        tasks = []
        for li, lid in enumerate(self.layer_ids):
            tasks.append((f"layer{li}", self._update_layer, li, gates[lid], live, cids, row_ids))
        if ctx:
            windows = np.ascontiguousarray(chunk.windows, dtype=np.int64)
            for n, table in self.contexts.items():
                if lanes is not None and n in lanes:
                    table.add_tokens_on(lanes[n], windows, live, q_all, ahead)
                else:
                    tasks.append((n, table.add_tokens, windows, live, q_all))
        inline = []
        for key, fn, *args in tasks:
            if lanes is not None and key in lanes:
                pending = self._lane_pending.setdefault(key, [])
                while len(pending) >= ahead:
                    pending.pop(0).result()
                pending.append(lanes[key].submit(fn, *args))
            else:
                inline.append((fn, args))
        if pool is None or len(inline) < 2:
            for fn, args in inline:
                fn(*args)
        else:
            for f in [pool.submit(fn, *args) for fn, args in inline]:
                f.result()
        if lanes is None:
            self._fold()                        # added here: every attribute final when this returns

    def _update_layer(self, li: int, dot_gate, live, cids, row_ids) -> None:
        dot, gate = dot_gate
        bitmap = self.row_bitmaps[li] if self.track_rows else _NO_BITMAP
        reduce_layer_rows(gate.view(np.uint32), dot.view(np.uint32), gate, dot, live, cids, self._acc[li],
                          self.counts[li], self.minmax[li], self.fine[li], self.tok_gsum[li], FINE_BINS, GATE_CLAMP,
                          bitmap, row_ids, li)

    def _fold(self) -> None:
        """Fold the layers' int64 moment bins (`_acc`) into the exact Python integers g1..dabs."""
        if not self.__dict__.get("_acc_values"):
            return
        for li in range(len(self.layer_ids)):
            for name, sums in zip(("g1", "g2", "d1", "d2", "dabs"), fold_acc(self._acc[li])):
                tot = getattr(self, name)[li]
                for c, v in enumerate(sums):
                    tot[c] += v
        self._acc[...] = 0
        self._acc_values = 0

    def _wait_lanes(self) -> None:
        """Wait for the layers' chunks handed to lanes (`update`); raises what one raised."""
        pending = self.__dict__.get("_lane_pending") or {}
        error = None
        for futures in pending.values():
            while futures:
                try:
                    futures.pop(0).result()
                except BaseException as exc:  # noqa: BLE001 - the first is raised once all are done
                    error = error or exc
        pending.clear()
        if error is not None:
            raise error

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
        self.finish()
        other.finish()
        out = StreamingGateStats.__new__(StreamingGateStats)
        out.__dict__.update({k: v for k, v in self.__dict__.items()})
        out._acc, out._acc_values, out._lane_pending = np.zeros_like(self._acc), 0, {}
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
        """Wait for the chunks still being added to the context tables on their lanes (`update`'s
        lanes; every query does this too), and fold the moments they left into g1..dabs."""
        self._wait_lanes()
        self._fold()
        for t in self.contexts.values():
            t.flush()
        return self

    def __getstate__(self):
        self.finish()
        return {k: v for k, v in self.__dict__.items() if k != "_lane_pending"} | {"_lane_pending": {}}

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
        self.finish()
        from .._argcheck import need_int
        bins = self.bins if bins is None else need_int(bins, "bins", 1)
        if bins < 1 or FINE_BINS % bins:
            raise ValueError(f"bins must divide {FINE_BINS} (the fine histogram), got {bins}")
        fine = self.fine[self._li(layer_id), _stream(stream)]
        return fine.reshape(bins, FINE_BINS // bins).sum(axis=1), np.linspace(0.0, 1.0, bins + 1)

    def quantile(self, layer_id: int, stream: int, q) -> np.ndarray:
        """Quantiles of the gate from the fine histogram (resolution 1e-5, module doc)."""
        self.finish()
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
        self.finish()
        layer_id, stream = key
        li, c = self._li(layer_id), int(stream)
        if not 0 <= c < self.hc:
            raise KeyError(f"stream {stream} is outside 0..{self.hc - 1}")
        n, n_nonfinite, masked_nonzero, n_dot, n_clamped, _ = (int(x) for x in self.counts[li, c])
        mean = exact_mean(self.g1[li][c], n)
        m2 = exact_m2(self.g1[li][c], self.g2[li][c], n)
        q = self.quantile(layer_id, c, QUANTILES)
        nan = float("nan")
        gmin, gmax = (float(self.minmax[li, c, 0]), float(self.minmax[li, c, 1])) if n else (nan, nan)
        dmin, dmax = (float(self.minmax[li, c, 2]), float(self.minmax[li, c, 3])) if n_dot else (nan, nan)
        return StreamGateStats(
            layer=int(layer_id), stream=c, n=n, n_masked=self.n_masked, masked_nonzero=masked_nonzero,
            n_nonfinite=n_nonfinite, mean=mean, std=math.sqrt(m2 / n) if n else float("nan"), min=gmin, max=gmax,
            q05=float(q[0]), q25=float(q[1]), q50=float(q[2]), q75=float(q[3]), q95=float(q[4]),
            dot_mean_abs=exact_mean(self.dabs[li][c], n_dot), dot_min=dmin, dot_max=dmax, n_clamped=n_clamped,
            clamp_frac=n_clamped / n_dot if n_dot else float("nan"), hist_counts=self.histogram(layer_id, c)[0])

    def moments(self, layer_id: int, stream: int, what: str = "gate") -> dict:
        """count, mean, M2 (sum of squared deviations), min, max of the gate or the dot, exact."""
        self.finish()
        li, c = self._li(layer_id), int(stream)
        if what == "gate":
            n, s1, s2, lo, hi = int(self.counts[li, c, 0]), self.g1[li][c], self.g2[li][c], *self.minmax[li, c, :2]
        elif what == "dot":
            n, s1, s2, lo, hi = int(self.counts[li, c, 3]), self.d1[li][c], self.d2[li][c], *self.minmax[li, c, 2:]
        else:
            raise ValueError(f"what must be 'gate' or 'dot', got {what!r}")
        return {"count": n, "mean": exact_mean(s1, n), "M2": exact_m2(s1, s2, n), "min": float(lo) if n else float("nan"),
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
        self.finish()
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
        self.finish()
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
        self.finish()
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
                distinct = int(popcount_range(self.row_bitmaps[li], lo, hi))
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

        from ..formats.npz import write_npy
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=int(compresslevel)) as zf:
            for name, a in {"__state__": np.array(json.dumps(head)), **arrays}.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    write_npy(f, a)                 # write_array's bytes, the data written without the GIL

    @classmethod
    def load(cls, path) -> "StreamingGateStats":
        """Read a file written by `save`. Anything else, or a file whose arrays do not have the
        shapes its header implies, is a `StatisticsFileError` naming the file and the entry."""
        return load_state(cls, path)


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
