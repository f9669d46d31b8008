"""A corpus shard's statistics on disk (its part file), and the exact merge of two states that the
Dask driver runs: both cheap next to the shard that makes them.

    write_part(st, "OUT/parts/shard-00003.npz")      # whole or absent, data on disk before the name
    st = read_part("OUT/parts/shard-00003.npz")      # this format, or the older one (a full state)
    total = merge_states(a, b)                       # equal to a + b, contexts merged without rehashing

Why: at the released shapes a state is about 160 MB, and most of it is zeros. The row bitmaps
(48 MB a layer) hold one bit per table row; a shard of a few hundred thousand tokens sets a few
percent of them, so most of their bytes are 0. Compressing the whole state with zlib (the
statistics file format, level 1) took seconds of CPU per shard beside the shard's own reduction;
a part file instead stores each row bitmap as the gaps between its non-zero bytes (a byte varint
each) and those bytes, in one pass, and everything else uncompressed. Part file size and write
time are in docs/distributed.md.

Part file, format 2: the statistics file of `StreamingGateStats.save` (every entry but the row
bitmaps, zlib level 0: stored) plus these entries:
    __part__          JSON: {"format": 2, "rows": [{"encoding": "gaps" | "raw", "bytes": n}, ...]}
    rows{i}_gaps      uint8: the varint gaps between the bitmap's non-zero bytes (first from -1)
    rows{i}_bytes     uint8: those non-zero bytes, in order      (encoding "gaps")
    rows{i}           uint8: the bitmap itself                   (encoding "raw": a dense bitmap)
Format 1 is a plain statistics file (`StreamingGateStats.save`, zlib level 1); `read_part` reads
both. A part file is written to a temporary name in the same folder, flushed to disk (fsync),
renamed, and the folder flushed: a shard is done only when its part file is there, whole.

Merging: every statistic but the context tables is a sum (or a min, max, OR) and `a + b` computes
it. Context tables are hash tables; `ContextTable.merged` re-inserts both sides' records and, when
the merged table passes the cap, sorts it twice to prune. Both inputs' sorted records are at hand
(a state sorts its tables once, to save or read them), so `merge_states` merges them as sorted
lists in one pass and picks the same entries to keep with a partition instead of a sort: the same
keys, counts, sums and prune counters as `a + b`, bit for bit (tests/test_distributed.py).
"""
from __future__ import annotations

import copy
import json
import os
import threading
import zipfile
from pathlib import Path

import numpy as np
from numba import njit

from ..formats.npz import write_npy
from .context_table import ContextTable
from .stats_file import StatisticsFileError
from .streaming import StreamingGateStats

PART_FORMAT = 2
RAW_FRACTION = 0.4        # a bitmap whose non-zero bytes are more than this fraction of it is stored raw


# Row bitmaps as the gaps between their non-zero bytes ----------------------------------------------

@njit(cache=True, nogil=True)
def _count_nonzero(bitmap):  # pragma: no cover - jitted
    """np.count_nonzero without the GIL (a 48 MB bitmap: several ms other threads would wait)."""
    n = 0
    for i in range(bitmap.size):
        n += bitmap[i] != 0
    return n


@njit(cache=True, nogil=True)
def _encode_gaps(bitmap, gaps, values):  # pragma: no cover - jitted
    """Fill gaps (varint bytes, 7 bits each, high bit = more) and values; returns bytes of gaps used."""
    prev = -1
    g = 0
    v = 0
    for i in range(bitmap.size):
        b = bitmap[i]
        if b != 0:
            d = i - prev
            while d >= 128:
                gaps[g] = np.uint8((d & 127) | 128)
                g += 1
                d >>= 7
            gaps[g] = np.uint8(d)
            g += 1
            values[v] = b
            v += 1
            prev = i
    return g


@njit(cache=True, nogil=True)
def _decode_gaps(gaps, values, out):  # pragma: no cover - jitted
    """Inverse of _encode_gaps into a zeroed out; returns -1 if it fits, else the value index that
    does not (a corrupt file: a gap past the end, a gap of 0, a cut varint, counts that disagree)."""
    pos = -1
    g = 0
    for v in range(values.size):
        d = 0
        shift = 0
        while True:
            if g >= gaps.size or shift > 56:
                return v
            b = np.int64(gaps[g])
            g += 1
            d |= (b & 127) << shift
            shift += 7
            if b < 128:
                break
        if d < 1:
            return v
        pos += d
        if pos >= out.size or values[v] == 0:
            return v
        out[pos] = values[v]
    if g != gaps.size:
        return values.size
    return -1


def encode_bitmap(bitmap: np.ndarray) -> dict:
    """{"encoding": "gaps", "gaps": uint8[], "bytes": uint8[]} or {"encoding": "raw", "raw": bitmap}."""
    bitmap = np.ascontiguousarray(bitmap, dtype=np.uint8)
    nnz = int(_count_nonzero(bitmap))
    if nnz > RAW_FRACTION * bitmap.size:
        return {"encoding": "raw", "raw": bitmap}
    per_gap = max(1, -(-int(bitmap.size).bit_length() // 7))     # varint bytes of the largest possible gap
    gaps = np.empty(per_gap * nnz + 8, np.uint8)
    values = np.empty(nnz, np.uint8)
    n = int(_encode_gaps(bitmap, gaps, values))
    return {"encoding": "gaps", "gaps": gaps[:n].copy(), "bytes": values}


def decode_bitmap(enc: dict, n_bytes: int, where: str = "bitmap") -> np.ndarray:
    """The bitmap of `n_bytes` bytes that `encode_bitmap` encoded; StatisticsFileError if it is not one."""
    if enc["encoding"] == "raw":
        raw = np.asarray(enc["raw"])
        if raw.dtype != np.uint8 or raw.shape != (n_bytes,):
            raise StatisticsFileError(f"{where}: a raw row bitmap must be uint8[{n_bytes}], got {raw.dtype}{list(raw.shape)}")
        return raw
    gaps, values = np.asarray(enc["gaps"]), np.asarray(enc["bytes"])
    if gaps.dtype != np.uint8 or values.dtype != np.uint8 or gaps.ndim != 1 or values.ndim != 1:
        raise StatisticsFileError(f"{where}: gaps and bytes of a row bitmap must be 1-D uint8 arrays")
    out = np.zeros(n_bytes, np.uint8)
    bad = int(_decode_gaps(gaps, values, out))
    if bad >= 0:
        raise StatisticsFileError(f"{where}: the row bitmap's gaps do not decode (at non-zero byte {bad} of "
                                  f"{values.size}: past the table's {n_bytes:,} bytes, a zero gap or a cut gap)")
    return out


# Part files ------------------------------------------------------------------------------------------

def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:                    # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_part(st: StreamingGateStats, path) -> dict:
    """Write `st` as a part file (module doc) at `path`: temporary name, fsync, rename, fsync the
    folder. Returns what was written: {"bytes": file size, "rows": [encodings]}."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp.npz")
    light = copy.copy(st)                      # the same arrays, without the row bitmaps
    light.row_bitmaps, light.track_rows = [], False
    rows = [encode_bitmap(b) for b in st.row_bitmaps] if st.track_rows else []
    head = {"format": PART_FORMAT, "rows": [{"encoding": r["encoding"], "bytes": int(b.size)}
                                             for r, b in zip(rows, st.row_bitmaps)]}
    try:
        light.save(tmp, compresslevel=0)
        with zipfile.ZipFile(tmp, "a", zipfile.ZIP_STORED) as zf:
            entries = {"__part__": np.array(json.dumps(head))}
            for li, r in enumerate(rows):
                if r["encoding"] == "raw":
                    entries[f"rows{li}"] = r["raw"]
                else:
                    entries[f"rows{li}_gaps"], entries[f"rows{li}_bytes"] = r["gaps"], r["bytes"]
            for name, a in entries.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    write_npy(f, a)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"bytes": path.stat().st_size, "rows": [r["encoding"] for r in rows]}


def read_part(path) -> StreamingGateStats:
    """A part file of either format as a StreamingGateStats; StatisticsFileError naming the file
    and the entry when it is not one."""
    from ..formats.jsonsafe import load_json
    from ..formats.npz import open_npz, read_member
    E = StatisticsFileError
    st = StreamingGateStats.load(path)         # checks the file and every entry of the statistics
    zf, members = open_npz(path, E)
    with zf:
        if "__part__" not in members:          # format 1: a whole statistics file
            return st
        raw = read_member(zf, members["__part__"], path, E)
        if raw.shape != () or raw.dtype.kind != "U":
            raise E(f"{path}: __part__ is {raw.dtype}{list(raw.shape)}, not one JSON string")
        head = load_json(str(raw), f"{path}: __part__", E, what="part header")
        if not isinstance(head, dict) or head.get("format") != PART_FORMAT:
            fmt = head.get("format") if isinstance(head, dict) else None
            raise E(f"{path}: part file format {str(fmt)[:20]}, this reader knows {PART_FORMAT} (and 1)")
        rows = head.get("rows")
        if not isinstance(rows, list) or any(not isinstance(r, dict) for r in rows):
            raise E(f"{path}: __part__ 'rows' must be a list of objects")
        if not rows:
            return st
        if len(rows) != len(st.table_rows):
            raise E(f"{path}: __part__ describes {len(rows)} row bitmaps, the statistics have {len(st.table_rows)} layers")
        bitmaps = []
        for li, (r, n_rows) in enumerate(zip(rows, st.table_rows)):
            n_bytes = -(-int(n_rows) // 8)
            if r.get("bytes") != n_bytes or r.get("encoding") not in ("gaps", "raw"):
                raise E(f"{path}: __part__ rows[{li}] must be {{'encoding': 'gaps' or 'raw', 'bytes': {n_bytes}}}, "
                        f"got {str(r)[:80]}")
            names = [f"rows{li}"] if r["encoding"] == "raw" else [f"rows{li}_gaps", f"rows{li}_bytes"]
            for name in names:
                if name not in members:
                    raise E(f"{path}: array {name!r} is missing")
            arrays = [read_member(zf, members[name], path, E) for name in names]
            enc = {"encoding": "raw", "raw": arrays[0]} if r["encoding"] == "raw" else \
                {"encoding": "gaps", "gaps": arrays[0], "bytes": arrays[1]}
            bitmaps.append(decode_bitmap(enc, n_bytes, f"{path}: rows{li}"))
    st.track_rows, st.row_bitmaps = True, bitmaps
    return st


# The merge -------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _key_less(a, i, b, j, W):  # pragma: no cover - jitted
    """-1, 0, 1: record a[i]'s key against b[j]'s (lexicographic over the W key words)."""
    for w in range(W):
        if a[i, w] < b[j, w]:
            return -1
        if a[i, w] > b[j, w]:
            return 1
    return 0


@njit(cache=True, nogil=True)
def _merge_sorted(a, b, W, out):  # pragma: no cover - jitted
    """Merge two key-sorted record lists (distinct keys each) into out; equal keys add their
    count and sums. Returns the records written."""
    i = 0
    j = 0
    n = 0
    R = a.shape[1]
    while i < a.shape[0] or j < b.shape[0]:
        if j >= b.shape[0]:
            c = -1
        elif i >= a.shape[0]:
            c = 1
        else:
            c = _key_less(a, i, b, j, W)
        if c < 0:
            for r in range(R):
                out[n, r] = a[i, r]
            i += 1
        elif c > 0:
            for r in range(R):
                out[n, r] = b[j, r]
            j += 1
        else:
            for r in range(W):
                out[n, r] = a[i, r]
            for r in range(W, R):
                out[n, r] = a[i, r] + b[j, r]
            i += 1
            j += 1
        n += 1
    return n


def _prune_sorted(rec: np.ndarray, W: int, cap: int, counters: dict) -> np.ndarray:
    """ContextTable's prune on key-sorted records: keep the cap/2 most frequent, ties by key (every
    count above the threshold, and of the counts equal to it the first in key order)."""
    keep_n = max(cap // 2, 1)
    count = rec[:, W]
    thr = np.partition(count, count.size - keep_n)[count.size - keep_n]
    keep = count > thr
    keep[np.flatnonzero(count == thr)[: keep_n - int(keep.sum())]] = True
    drop = ~keep
    counters["prunes"] += 1
    counters["dropped_entries"] += int(drop.sum())
    counters["dropped_occurrences"] += int(count[drop].sum())
    counters["undercount_bound"] += int(count[drop].max()) if drop.any() else 0
    return rec[keep]


_COUNTERS = ("prunes", "dropped_entries", "dropped_occurrences", "undercount_bound")


class SortedContexts:
    """One context table as key-sorted records [n, W + 1 + L*hc] (key words, count, gate sums) and
    its prune counters: what a merge reads and writes, with no hash table to fill."""

    def __init__(self, params: tuple, records: np.ndarray, counters: dict):
        self.params = params                  # ContextTable's (order, width, n_layers, hc, cap, bits, per_word)
        self.records = records
        self.counters = counters

    @classmethod
    def of(cls, t: ContextTable) -> "SortedContexts":
        rec = np.concatenate([t.keys, t.count.reshape(-1, 1), t.gsum.reshape(t.count.size, t.n_layers * t.hc)],
                             axis=1)
        return cls((t.order, t.width, t.n_layers, t.hc, t.cap, t.bits, t.per_word),
                   np.ascontiguousarray(rec, dtype=np.int64), {f: int(getattr(t, f)) for f in _COUNTERS})

    def __add__(self, other: "SortedContexts") -> "SortedContexts":
        """ContextTable.merged: the same entries and counters."""
        order, W, _, _, cap, _, _ = self.params
        ra, rb = self.records, other.records
        rec = np.empty((ra.shape[0] + rb.shape[0], ra.shape[1]), np.int64)
        rec = rec[: int(_merge_sorted(ra, rb, W, rec))]
        counters = {f: self.counters[f] + other.counters[f] for f in _COUNTERS}
        if rec.shape[0] > cap:
            rec = _prune_sorted(rec, W, cap, counters)
        if rec.shape[0] and int(rec[:, W].max()) >= 1 << 31:
            raise OverflowError(f"order-{order} context seen {int(rec[:, W].max())} times: the fixed-point gate "
                                "sums hold 2^31 occurrences; split the corpus and merge fewer parts")
        return SortedContexts(self.params, rec, counters)

    def table(self) -> ContextTable:
        """As a ContextTable (one pass filling its hash table)."""
        W = self.params[1]
        t = ContextTable(*self.params)
        t.load(self.records[:, :W], self.records[:, W], self.records[:, W + 1:], slots=2 * self.records.shape[0])
        for f, v in self.counters.items():
            setattr(t, f, v)
        return t


class PartialStats:
    """A shard's (or a merge's) statistics as the Dask tree carries them: every statistic but the
    context tables in `base` (a StreamingGateStats with its context tables taken out), the context
    tables as `SortedContexts`. `a + b` is `StreamingGateStats` addition; `.stats()` the full state.

    `PartialStats.of(st)` splits a full state at once; `PartialStats.later(st)` when first needed
    (a merge, a transfer), so that a shard task hands its state over without sorting its context
    tables on the GPU's critical path. Pickled (sent between workers or to the client), sparse row
    bitmaps travel as `encode_bitmap` gaps."""

    def __init__(self, base: StreamingGateStats | None, contexts: dict | None, full: StreamingGateStats | None = None):
        self._base, self._contexts, self._full = base, contexts, full
        self._lock = threading.Lock()

    @classmethod
    def of(cls, st: StreamingGateStats) -> "PartialStats":
        return cls.later(st)._split()

    @classmethod
    def later(cls, st: StreamingGateStats) -> "PartialStats":
        return cls(None, None, st)

    def _split(self) -> "PartialStats":
        with self._lock:
            if self._full is not None:
                base = copy.copy(self._full)
                base.contexts = {}
                self._contexts = {n: SortedContexts.of(t) for n, t in self._full.contexts.items()}
                self._base, self._full = base, None
        return self

    @property
    def base(self) -> StreamingGateStats:
        return self._split()._base

    @property
    def contexts(self) -> dict:
        return self._split()._contexts

    @property
    def meta(self) -> dict:
        return (self._full if self._full is not None else self._base).meta

    @property
    def n_tokens(self) -> int:
        return (self._full if self._full is not None else self._base).n_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (what Dask's memory accounting sees)."""
        st = self._full if self._full is not None else self._base
        n = sum(int(getattr(st, f).nbytes) for f in ("counts", "minmax", "fine", "tok_count", "tok_gsum", "raw_count"))
        n += sum(int(b.nbytes) for b in st.row_bitmaps)
        if self._full is not None:
            n += sum(8 * int(t.n) * (t.width + 1 + t.n_layers * t.hc) for t in self._full.contexts.values())
        else:
            n += sum(int(c.records.nbytes) for c in self._contexts.values())
        return n

    def __add__(self, other: "PartialStats") -> "PartialStats":
        if not isinstance(other, PartialStats):
            return NotImplemented
        base = self.base + other.base          # every check, and every statistic but the contexts
        return PartialStats(base, {n: c + other.contexts[n] for n, c in self.contexts.items()})

    def stats(self) -> StreamingGateStats:
        """The full StreamingGateStats (context tables filled: one pass each)."""
        if self._full is not None:
            return self._full
        st = copy.copy(self._base)
        st.contexts = {n: c.table() for n, c in self._contexts.items()}
        return st

    def __getstate__(self):
        base = copy.copy(self.base)
        base.row_bitmaps = [encode_bitmap(b) for b in self.base.row_bitmaps]
        return {"base": base, "contexts": self.contexts}

    def __setstate__(self, state):
        base = state["base"]
        base.row_bitmaps = [decode_bitmap(e, -(-int(r) // 8)) for e, r in zip(base.row_bitmaps, base.table_rows)]
        self._base, self._contexts, self._full = base, state["contexts"], None
        self._lock = threading.Lock()


def merge_states(a: StreamingGateStats, b: StreamingGateStats) -> StreamingGateStats:
    """a + b, the same state bit for bit, with the context tables merged as sorted lists."""
    if not (isinstance(a, StreamingGateStats) and isinstance(b, StreamingGateStats)):
        raise TypeError(f"merge_states takes two StreamingGateStats, got {type(a).__name__} and {type(b).__name__}")
    return (PartialStats.of(a) + PartialStats.of(b)).stats()
