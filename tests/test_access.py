"""Row-access statistics against brute force (every token hashed, every read replayed through a
real LRU), and merged parts against one pass."""
from collections import Counter, OrderedDict
from fractions import Fraction

import numpy as np
import pytest

import engram_numba as en
from engram_numba.analysis.access import AccessStats, access_stats, merge_access, zipf_fit
from engram_numba.stages.hash.tables import EngramHashTables


@pytest.fixture(scope="module")
def tables():
    # 3 heads, n-grams up to 4, a 300-id compressed vocab folded from 400 raw ids: small primes so
    # that rows really collide
    rng = np.random.default_rng(7)
    tm = np.concatenate([np.arange(300), rng.integers(0, 300, 100)])
    return EngramHashTables.build((1, 5), 4, 3, 500, tm, 2)


def _documents(rng, n_docs, zipf_a=1.3):
    docs = []
    for _ in range(n_docs):
        n = int(rng.integers(1, 120))
        docs.append(np.minimum(rng.zipf(zipf_a, n) - 1, 399).astype(np.int64))
    return docs


def _brute(tables, st, docs):
    """Per layer: Counter of rows over training docs and over held-out docs; held-out stream reads."""
    train = [Counter() for _ in tables.layer_ids]
    held = [Counter() for _ in tables.layer_ids]
    stream = [[] for _ in tables.layer_ids]
    for d in docs:
        ids = en.hash_tokens(tables, d)
        h = st.is_held_out(d)
        for li in range(len(tables.layer_ids)):
            (held if h else train)[li].update(ids[:, li, :].ravel().tolist())
            if h:
                stream[li].append((ids[:, li, :]))
    return train, held, stream


def test_counts_collisions_and_caches_match_brute_force(tables, rng):
    docs = _documents(rng, 240)
    st = access_stats(tables_model(tables), docs, holdout_every=3, sequence_tokens=10**9)
    rep = st.report(cache_rows=[1, 4, 64, 256])
    train, held, stream = _brute(tables, st, docs)
    assert sum(st.n_documents) == len(docs) and st.n_documents[1] > 20
    for li, lid in enumerate(tables.layer_ids):
        L = rep.layers[lid]
        both = train[li] + held[li]
        assert L["reads"] == sum(both.values()) == sum(d.size for d in docs) * 9
        assert L["distinct_rows"] == len(both)
        # per column: rows and n-grams that share them
        for c in L["columns"]:
            lo, hi = int(tables.offsets[li, c["col"]]), int(tables.offsets[li, c["col"]] + c["prime"])
            assert c["distinct_rows"] == sum(1 for r in both if lo <= r < hi)
        # static top-k by training reads evaluated on held-out reads; a tie at the boundary counts
        # at the group's mean held-out reads
        total_held = sum(held[li].values())
        groups = {}
        for r, c in train[li].items():
            groups.setdefault(c, []).append(held[li][r])
        for k, hits in zip(L["static_cache"]["rows"], L["static_cache"]["hits"]):
            want, left = Fraction(0), k
            for c in sorted(groups, reverse=True):
                g = groups[c]
                take = min(left, len(g))
                want += Fraction(sum(g) * take, len(g))
                left -= take
            assert hits == pytest.approx(float(want), rel=1e-12, abs=1e-9)
        assert L["static_cache"]["held_out_reads"] == total_held
        # LRU over the held-out stream, reads in token order then column order
        reads = [r for block in stream[li] for r in block.ravel().tolist()]
        assert L["lru"]["reads"] == len(reads)
        for k, hits in zip(L["lru"]["rows"], L["lru"]["hits"]):
            cache, n_hit = OrderedDict(), 0
            for r in reads:
                if r in cache:
                    n_hit += 1
                    cache.move_to_end(r)
                else:
                    cache[r] = True
                    if len(cache) > k:
                        cache.popitem(last=False)
            assert hits == n_hit, (lid, k)
        assert L["lru"]["cold_misses"] == len(set(reads))


def test_collisions_against_brute_force(tables, rng):
    docs = _documents(rng, 200)
    st = access_stats(tables_model(tables), docs, holdout_every=5, sequence_tokens=0)
    rep = st.report()
    ng = st.ngrams()
    for li, lid in enumerate(tables.layer_ids):
        cols = {c["col"]: c for c in rep.layers[lid]["columns"]}
        for o in (2, 3, 4):
            wins = [tuple(w[:o]) for w, oo in zip(ng["window"], ng["order"]) if oo == o]
            assert len(wins) == len(set(wins)) == rep.layers[lid]["collisions"]["orders"][str(o)]["ngrams"]
            # the row of each distinct n-gram in each head: hash a sequence that ends with it
            rows = {}
            for w in wins:
                hist = np.array(w[::-1], np.int64)
                out = np.empty((1, 2, 9), np.int64)
                from engram_numba.stages.hash.cpu import hash_positions
                hash_positions(hist, o - 1, 1, tables.multipliers, tables.primes, tables.offsets, 10**6, out)
                rows[w] = out[0, li, (o - 2) * 3:(o - 1) * 3]
            for h in range(3):
                per_row = Counter(int(r[h]) for r in rows.values())
                c = cols[(o - 2) * 3 + h]
                assert c["rows_shared"] == sum(1 for v in per_row.values() if v >= 2)
                assert c["ngrams_in_shared_rows"] == sum(v for v in per_row.values() if v >= 2)
            tuples = Counter(tuple(r.tolist()) for r in rows.values())
            pairs = sum(v * (v - 1) // 2 for v in tuples.values())
            assert rep.layers[lid]["collisions"]["orders"][str(o)]["all_heads_pairs"] == pairs


def tables_model(tables):
    class M:
        hash_tables = tables
    return M()


def test_merged_parts_equal_one_pass(tables, rng, tmp_path):
    docs = _documents(rng, 300)
    whole = access_stats(tables_model(tables), docs, holdout_every=4, sequence_tokens=0)
    cut = [0, 37, 150, 300]
    parts = [access_stats(tables_model(tables), docs[a:b], holdout_every=4, sequence_tokens=0)
             for a, b in zip(cut, cut[1:])]
    parts[1].save(tmp_path / "p1.npz")
    parts[1] = AccessStats.load(tmp_path / "p1.npz")
    merged = merge_access([parts[2], parts[0], parts[1]])
    a, b = whole.ngrams(), merged.ngrams()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    ja, jb = whole.report().to_json(), merged.report().to_json()
    ja.pop("meta"), jb.pop("meta")
    assert ja == jb


def test_bad_inputs_are_named(tables):
    with pytest.raises(ValueError, match="holdout_every"):
        AccessStats.empty(tables, holdout_every=1)
    st = AccessStats.empty(tables)
    with pytest.raises(ValueError, match="token id 400 at position 2"):
        st.update([1, 2, 400])
    assert sum(st.n_tokens) == 0 and st.filled == 0
    other = AccessStats.empty(EngramHashTables.build((1, 6), 4, 3, 500, tables.token_map, 2))
    with pytest.raises(ValueError, match="different layer_ids"):
        st + other


def test_zipf_fit_recovers_the_exponent():
    ranks = np.arange(1, 200_001)
    counts = np.floor(1e7 * ranks ** -1.2)
    z = zipf_fit(counts)
    assert abs(z["exponent"] - 1.2) < 0.01 and z["r2"] > 0.999 and z["rank_lo"] == 10


def test_column_rows_groups_across_row_buckets(rng):
    """Columns of the released size span many 2^16-row buckets: grouping must agree with numpy."""
    from engram_numba.analysis.access import _column_rows
    prime = 16_000_057
    rolling = rng.integers(0, 2**62, 50_000)
    rolling[25_000:] = rolling[:25_000] + prime * rng.integers(1, 1000, 25_000)    # forced shared rows
    tr, hd = rng.integers(0, 5, rolling.size), rng.integers(0, 3, rolling.size)
    ids, t, h, g = _column_rows(rolling, tr, hd, prime, np.full(1 << 16, -1, np.int32))
    local = rolling % prime
    u, inv = np.unique(local, return_inverse=True)
    o = np.argsort(ids)
    assert np.array_equal(ids[o], u) and (ids >> 16).tolist() == sorted((ids >> 16).tolist())
    assert np.array_equal(t[o], np.bincount(inv, tr)) and np.array_equal(h[o], np.bincount(inv, hd))
    assert np.array_equal(g[o], np.bincount(inv)) and g.max() >= 2


def test_bench_access_section_runs_alone():
    from engram_numba.bench.suite import SECTIONS, _sections
    assert _sections("access") == ("access",) and "access" not in SECTIONS     # not in the default GPU run
    with pytest.raises(ValueError, match="run on their own"):
        _sections("access,host")
    with pytest.raises(ValueError, match="unknown bench section"):
        _sections("acess")
