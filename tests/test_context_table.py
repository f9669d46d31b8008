"""The n-gram context table: its in-place prune keeps exactly what a full sort would keep (the cap/2
most frequent contexts, ties by key), with the same counters, and a stream of chunks through a
pruning table ends as a table that prunes by sorting everything."""
import numpy as np
import pytest

from engram_numba.analysis.context_table import ContextTable, _kth_key, _slot_of, pack_width


class SortingTable(ContextTable):
    """The prune written as the definition: sort every record by (count descending, key), keep the
    first cap/2 (a fresh table of the same size)."""

    def _prune(self):
        rec = self._sorted()
        W = self.width
        keep_n = max(self.cap // 2, 1)
        count = rec[:, W]
        order = np.lexsort(tuple(rec[:, :W].T[::-1]) + (-count,))
        keep, drop = np.sort(order[:keep_n]), order[keep_n:]
        self.prunes += 1
        self.dropped_entries += int(drop.size)
        self.dropped_occurrences += int(count[drop].sum())
        self.undercount_bound += int(count[drop].max()) if drop.size else 0
        self._load_records(rec[keep], slots=self._slots.shape[0])


def _reachable(t):
    """Every record is found by a lookup of its key from its home slot (linear probing's invariant)."""
    for i in np.flatnonzero(t._slots[:, t.width]):
        assert _slot_of(t._slots, t.width, t._slots[i, :t.width].copy()) == i


def _same(a, b):
    np.testing.assert_array_equal(a.keys, b.keys)                # (a read: waits for a's lane)
    _reachable(a)
    np.testing.assert_array_equal(a.count, b.count)
    np.testing.assert_array_equal(a.gsum, b.gsum)
    for f in ("n", "prunes", "dropped_entries", "dropped_occurrences", "undercount_bound"):
        assert getattr(a, f) == getattr(b, f), f


@pytest.mark.parametrize("order,bits,vocab", [(2, 17, 40), (4, 17, 12), (4, 40, 6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_chunks_prune_as_a_full_sort_does(order, bits, vocab, seed):
    # few distinct ids: many equal counts at every threshold; (4, 17): two key words, and many keys
    # share word 0 (the tie path that sorts); (4, 40): four words of one id each
    rng = np.random.default_rng(seed)
    width, per_word = pack_width(order, bits)
    L, hc, cap = 2, 3, 37                               # tables of 64..256 slots: clusters wrap
    fast, ref = (cls(order, width, L, hc, cap, bits, per_word) for cls in (ContextTable, SortingTable))
    for _ in range(12):
        T = int(rng.integers(20, 90))
        windows = np.minimum(rng.zipf(1.3, (T, order)) - 1, vocab - 1).astype(np.int64)
        live = rng.random(T) < 0.9
        q = rng.integers(-2**33, 2**33, (T, L, hc))
        fast.add_tokens(windows, live, q)
        ref.add_tokens(windows, live, q)
        _same(fast, ref)
    assert fast.prunes > 3 and fast.undercount_bound > 0
    # the pruned table keeps taking tokens and merging as before
    _same(fast.merged(ref), ref.merged(fast))


def test_kth_key_is_the_lexicographic_order_statistic():
    rng = np.random.default_rng(5)
    for W in (1, 2, 3):
        keys = np.unique(rng.integers(0, 4, (300, W)), axis=0)           # distinct, many share word 0
        keys = keys[rng.permutation(keys.shape[0])]
        want = keys[np.lexsort(keys.T[::-1])]
        for r in (1, 2, keys.shape[0] // 2, keys.shape[0] - 1, keys.shape[0]):
            np.testing.assert_array_equal(_kth_key(keys, r), want[r - 1])


def test_prune_deletes_across_the_tables_end():
    # 16 slots, 7 records whose home slots are 13..15: their cluster wraps to slots 0..3, and the
    # deletions there must shift wrapped records back across the end
    from engram_numba.analysis.context_table import _ctx_add_entries, _home
    rng = np.random.default_rng(3)
    width, per_word = pack_width(2, 17)
    near_end = [k for k in range(1, 5000) if _home(np.array([k]), width, 15) >= 13]
    for trial in range(30):
        keys = rng.choice(near_end, 7, replace=False)
        count = rng.integers(1, 4, 7)
        rec = np.concatenate([keys[:, None], count[:, None], rng.integers(-9, 9, (7, 2))], axis=1).astype(np.int64)
        t, ref = (cls(2, width, 1, 2, 6, 17, per_word) for cls in (ContextTable, SortingTable))
        for x in (t, ref):
            x._alloc(16)
            x.n = int(_ctx_add_entries(x._slots, width, rec))
        assert (t._slots[:4, width] != 0).any()                   # the cluster wraps
        t._prune()
        ref._prune()
        _same(t, ref)


def test_chunks_added_on_a_lane_give_the_same_table_and_its_errors_surface_on_read():
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(9)
    width, per_word = pack_width(3, 17)
    on_lane, inline = (ContextTable(3, width, 1, 2, 50, 17, per_word) for _ in range(2))
    with ThreadPoolExecutor(1) as lane:
        for _ in range(10):
            windows = np.minimum(rng.zipf(1.3, (64, 3)) - 1, 30).astype(np.int64)
            live, q = rng.random(64) < 0.8, rng.integers(-2**33, 2**33, (64, 1, 2))
            on_lane.add_tokens_on(lane, windows, live, q, ahead=3)
            inline.add_tokens(windows, live, q)
        assert len(on_lane._pending) <= 3
        _same(on_lane, inline)                                  # reading waits for the lane
        assert on_lane.prunes > 0 and not on_lane._pending
        on_lane.add_tokens_on(lane, np.zeros((4, 3)), np.ones(4, bool), np.zeros((4, 1, 2), np.int64))  # float ids
        with pytest.raises(Exception):
            on_lane.flush()
