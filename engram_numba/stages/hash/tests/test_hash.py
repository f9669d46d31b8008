"""The hash front end: the test vectors of docs/math.md section 3.5, the @njit hasher against the readable
reference (one call, chunks, decode steps), sticky blocking at dead tokens, bad ids, and
EngramHashTables.validate."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_numba.stages.hash.cpu import DEAD, EngramHasher, hash_tokens
from engram_numba.stages.hash.reference import hash_reference
from engram_numba.stages.hash.tables import EngramHashTables, next_prime_above

RELEASED_ROWS = (384_006_168, 384_016_682)
TINY_SEQUENCE = [2, 17, 47, 13, 32, 59, 39, 29, 42, 31, 36, 6, 27, 8]


def _released():
    return EngramHashTables.build((1, 14), 4, 8, 16_000_000, np.arange(99_092), 2)


def _tiny():
    return EngramHashTables.build((1, 4), 4, 2, 64, np.arange(64), 2)


def _remapped():
    # A raw vocab of the released size folded many-to-one onto the compressed vocab in a shuffled
    # order, with a pad other than 2: raw ids near the top map anywhere, including 99,091.
    rng = np.random.default_rng(20250101)
    token_map = rng.permutation(129_280) % 99_092
    return EngramHashTables.build((1, 14), 4, 8, 16_000_000, token_map, 77)


def _tiny_remapped():
    # Three heads, max_ngram_size 3, 300 raw ids onto 40 compressed ids, pad 39 (the top id).
    rng = np.random.default_rng(7)
    token_map = rng.integers(0, 40, size=300)
    token_map[:40] = rng.permutation(40)   # every compressed id is reachable
    return EngramHashTables.build((3, 9, 20), 3, 3, 40, token_map, 39)


TABLES = {"tiny": _tiny(), "released": _released(), "remapped": _remapped(), "tiny_remapped": _tiny_remapped()}


def window_ids(tables, tok):
    """Row ids [L, C] of one n-gram window tok[0..M-1] (tok[s] = the token s places back), from
    docs/math.md section 3.2 (the rolling XOR fold) with Python integers: a third implementation beside the two tested."""
    out = np.empty((tables.n_layers, tables.n_hash_cols), dtype=np.int64)
    for li in range(tables.n_layers):
        m = [int(x) for x in tables.multipliers[li]]
        rolling = tok[0] * m[0]
        for i in range(1, tables.max_ngram_size):
            rolling ^= tok[i] * m[i]
            for h in range(tables.n_heads):
                col = (i - 1) * tables.n_heads + h
                out[li, col] = rolling % int(tables.primes[li, i - 1, h]) + int(tables.offsets[li, col])
    return out


# The test vectors (docs/math.md 3.5) -----------------------------------------------------------

def test_released_multipliers():
    t = TABLES["released"]
    np.testing.assert_array_equal(t.multipliers, [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ])


def test_released_primes_offsets_and_table_rows():
    t = TABLES["released"]
    assert t.primes.shape == (2, 3, 8) and t.n_hash_cols == 24
    layer1, layer14 = t.primes[0].ravel(), t.primes[1].ravel()
    assert (layer1[0], layer1[-1]) == (16_000_057, 16_000_463)
    assert (layer14[0], layer14[-1]) == (16_000_477, 16_000_889)
    # One run of consecutive primes through both layers, in layer, order, head order.
    chain = [next_prime_above(16_000_000 - 1)]
    while len(chain) < 48:
        chain.append(next_prime_above(chain[-1]))
    np.testing.assert_array_equal(t.primes.ravel(), chain)
    np.testing.assert_array_equal(t.table_rows, RELEASED_ROWS)
    assert (t.offsets[:, 0] == 0).all()
    np.testing.assert_array_equal(t.offsets[:, -1] + t.primes[:, -1, -1], RELEASED_ROWS)
    t.validate(table_rows=RELEASED_ROWS)


def test_released_worked_example():
    t = TABLES["released"]
    for ids in (EngramHasher(t).hash([12345]), hash_reference(t, [12345])):
        assert ids.shape == (1, 2, 24)
        np.testing.assert_array_equal(ids[0, 0, :3], [10_313_217, 26_273_187, 45_356_107])
        np.testing.assert_array_equal(ids[0, 1, :3], [14_098_072, 30_405_269, 47_635_780])
        assert (ids[0] < np.array(RELEASED_ROWS)[:, None]).all()


def test_tiny_configuration():
    t = TABLES["tiny"]
    np.testing.assert_array_equal(t.primes.ravel(), [67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113])
    np.testing.assert_array_equal(t.table_rows, [462, 630])
    for ids in (EngramHasher(t).hash(TINY_SEQUENCE), hash_reference(t, TINY_SEQUENCE)):
        np.testing.assert_array_equal(ids[13, 1], [14, 186, 216, 375, 492, 542])
        assert ids.min() >= 0 and (ids < t.table_rows[None, :, None]).all()
        # Each column's ids stay inside that column's slice of the table.
        col_hi = t.offsets + t.primes.reshape(2, -1)
        assert (ids >= t.offsets).all() and (ids < col_hi).all()


# The @njit hasher against the reference ----------------------------------------------------------

@st.composite
def sequences(draw, tables):
    """(ids, mask or None, chunk lengths): ids over the whole token_map range, weighted towards
    the ends (0, the top raw ids and the raw ids of the largest compressed id)."""
    V = tables.token_map.size
    top_compressed = np.flatnonzero(tables.token_map == tables.token_map.max())[:4].tolist()
    pad_raw = np.flatnonzero(tables.token_map == tables.pad_id)[:2].tolist()
    token = st.one_of(st.integers(0, V - 1), st.integers(max(0, V - 8), V - 1),
                      st.sampled_from(top_compressed + pad_raw + [0]))
    ids = draw(st.lists(token, min_size=0, max_size=24))
    mask = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=len(ids), max_size=len(ids))))
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=4)))
    chunks = np.diff([0, *cuts, len(ids)]).tolist()
    return ids, mask, chunks


def _slice_mask(mask, a, b):
    return None if mask is None else np.array(mask[a:b], dtype=bool)


def check_all_splits(tables, ids, mask, chunks):
    want = hash_reference(tables, ids, None if mask is None else np.array(mask, dtype=bool))
    assert want.shape == (len(ids), tables.n_layers, tables.n_hash_cols)

    hasher = EngramHasher(tables, capacity=1)   # a tiny capacity also exercises the growth path
    np.testing.assert_array_equal(hasher.hash(np.array(ids, dtype=np.int64), _slice_mask(mask, 0, len(ids))), want)
    assert hasher.position == len(ids)

    # Any split into chunks, each continuing the same history; the reference continues from the
    # hasher's history to show the history holds what it should.
    hasher.reset()
    assert hasher.position == 0 and hasher.history.size == 0
    start, parts = 0, []
    for n in chunks:
        history = hasher.history.copy()
        got = hasher.hash(ids[start:start + n], _slice_mask(mask, start, start + n))
        np.testing.assert_array_equal(got, hash_reference(tables, ids[start:start + n],
                                                          _slice_mask(mask, start, start + n), history=history))
        parts.append(got)
        start += n
    np.testing.assert_array_equal(np.concatenate(parts) if parts else want, want)

    # Prefill then one-token decode steps.
    hasher.reset()
    k = chunks[0]
    steps = [hasher.hash(ids[:k], _slice_mask(mask, 0, k))]
    for p in range(k, len(ids)):
        steps.append(hasher.hash([ids[p]], _slice_mask(mask, p, p + 1)))
    np.testing.assert_array_equal(np.concatenate(steps), want)
    np.testing.assert_array_equal(hash_tokens(tables, ids, _slice_mask(mask, 0, len(ids))), want)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_hasher_matches_reference_hypothesis(name):
    tables = TABLES[name]

    @settings(max_examples=150, deadline=None)
    @given(sequences(tables))
    def run(case):
        check_all_splits(tables, *case)

    run()


@pytest.mark.parametrize("name", ["released", "remapped"])
def test_hasher_matches_reference_on_a_long_sequence(name, rng):
    tables = TABLES[name]
    V = tables.token_map.size
    ids = rng.integers(0, V, size=3000)
    ids[rng.integers(0, 3000, 100)] = V - 1 - rng.integers(0, 4, 100)
    mask = rng.random(3000) > 0.05
    chunks = np.diff([0, *sorted(rng.integers(0, 3000, 6)), 3000]).tolist()
    check_all_splits(tables, ids.tolist(), mask.tolist(), chunks)


def test_reset_starts_a_new_sequence(rng):
    tables = TABLES["released"]
    a = rng.integers(0, 99_092, size=12)
    b = rng.integers(0, 99_092, size=9)
    hasher = EngramHasher(tables)
    hasher.hash(a)
    continued = hasher.hash(b)
    hasher.reset()
    fresh = hasher.hash(b)
    np.testing.assert_array_equal(fresh, EngramHasher(tables).hash(b))
    np.testing.assert_array_equal(fresh, hash_reference(tables, b))
    # The continued call really looked back into `a` (otherwise this test proves nothing).
    assert not np.array_equal(continued[:3], fresh[:3])
    np.testing.assert_array_equal(continued[3:], fresh[3:])  # beyond the 4-gram window it cannot see `a`


# Sticky blocking at dead tokens ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TABLES))
def test_dead_token_blocks_every_window_through_it(name, rng):
    tables = TABLES[name]
    M, pad = tables.max_ngram_size, tables.pad_id
    V = tables.token_map.size
    ids = rng.integers(0, V, size=12)
    mask = np.ones(12, dtype=bool)
    dead = 5
    mask[dead] = False
    c = [int(tables.token_map[i]) for i in ids]
    got = EngramHasher(tables).hash(ids, mask)

    # The dead token's own ids: every slot is the pad.
    all_pad = window_ids(tables, [pad] * M)
    np.testing.assert_array_equal(got[dead], all_pad)
    # The same window as a lone first token that maps to the pad.
    pad_raw = int(np.flatnonzero(tables.token_map == pad)[0])
    np.testing.assert_array_equal(EngramHasher(tables).hash([pad_raw])[0], all_pad)

    # After it, windows stop at the dead token: slot s is the pad once s reaches back to it.
    for p in range(dead + 1, min(dead + M + 1, 12)):
        tok = [c[p - s] if p - s > dead else pad for s in range(M)]
        np.testing.assert_array_equal(got[p], window_ids(tables, tok), err_msg=f"position {p}")
    # Before it, ordinary windows (padded only at the sequence start).
    for p in range(dead):
        tok = [c[p - s] if p - s >= 0 else pad for s in range(M)]
        np.testing.assert_array_equal(got[p], window_ids(tables, tok), err_msg=f"position {p}")

    # Nothing before the dead token reaches past it: change those tokens, the rest stays.
    other = ids.copy()
    other[:dead] = rng.integers(0, V, size=dead)
    got_other = EngramHasher(tables).hash(other, mask)
    np.testing.assert_array_equal(got_other[dead:], got[dead:])

    # The same across a decode step: the dead token in the prefill, the rest one at a time.
    hasher = EngramHasher(tables)
    hasher.hash(ids[: dead + 1], mask[: dead + 1])
    assert hasher.history[dead] == DEAD
    steps = np.concatenate([hasher.hash(ids[p:p + 1]) for p in range(dead + 1, 12)])
    np.testing.assert_array_equal(steps, got[dead + 1:])


def test_blocking_is_sticky_not_per_slot(rng):
    # A live token *behind* a dead one must not reappear in the window: in [a, b, DEAD, d, e]
    # position 4 sees [e, d, pad, pad], not [e, d, pad, b].
    tables = TABLES["tiny"]
    pad = tables.pad_id
    ids = rng.integers(pad + 1, 64, size=5)  # no live token equals the pad
    got = EngramHasher(tables).hash(ids, np.array([True, True, False, True, True]))
    np.testing.assert_array_equal(got[4], window_ids(tables, [ids[4], ids[3], pad, pad]))
    assert not np.array_equal(got[4], window_ids(tables, [ids[4], ids[3], pad, ids[1]]))


def test_all_dead_sequence_is_all_pad(rng):
    tables = TABLES["remapped"]
    ids = rng.integers(0, tables.token_map.size, size=7)
    got = EngramHasher(tables).hash(ids, np.zeros(7, dtype=bool))
    np.testing.assert_array_equal(got, np.broadcast_to(window_ids(tables, [tables.pad_id] * 4), got.shape))


# Bad input ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "remapped"])
def test_bad_ids_raise_and_leave_the_hasher_unchanged(name, rng):
    tables = TABLES[name]
    V = tables.token_map.size
    prefix = rng.integers(0, V, size=6)
    tail = rng.integers(0, V, size=5)
    want = EngramHasher(tables).hash(np.concatenate([prefix, tail]))

    hasher = EngramHasher(tables)
    hasher.hash(prefix)
    before = hasher.history.copy()
    for bad_value, index in ((-1, 0), (V, 3), (V + 1000, 4), (-V, 2), (np.iinfo(np.int64).min, 1)):
        bad = tail.copy()
        bad[index] = bad_value
        with pytest.raises(ValueError, match=rf"token id {bad_value} at position {6 + index}\b"):
            hasher.hash(bad)
        assert hasher.position == 6
        np.testing.assert_array_equal(hasher.history, before)
        with pytest.raises(ValueError, match=rf"token id {bad_value} at position {6 + index}\b"):
            hash_reference(tables, bad, history=before)
    # The sequence carries on as if the bad calls never happened.
    np.testing.assert_array_equal(hasher.hash(tail), want[6:])


def test_bad_ids_from_a_fresh_hasher(rng):
    tables = TABLES["released"]
    for bad in ([-1], [5, 99_092], [3, 4, -7]):
        hasher = EngramHasher(tables)
        with pytest.raises(ValueError, match=rf"token id {bad[-1]} at position {len(bad) - 1}\b"):
            hasher.hash(bad)
        assert hasher.position == 0


def test_bad_uint64_id_is_reported_with_its_value():
    hasher = EngramHasher(TABLES["tiny"])
    with pytest.raises(ValueError, match="token id 9223372036854775808 at position 0"):
        hasher.hash(np.array([2**63], dtype=np.uint64))


def test_large_uint64_ids_are_rejected_not_wrapped():
    hasher = EngramHasher(TABLES["tiny"])
    for value in (2**63, 2**64 - 1, 2**64 - 64):  # the last would wrap to -64
        with pytest.raises(ValueError, match="at position 0"):
            hasher.hash(np.array([value], dtype=np.uint64))
        assert hasher.position == 0


@pytest.mark.parametrize("ids, mask, match", [
    ([1, 2, 3], [True, False], r"token_mask shape \(2,\) does not match token_ids shape \(3,\)"),
    ([1, 2, 3], [[True, True, True]], r"token_mask shape \(1, 3\)"),
    ([1, 2, 3], np.array([1, 0, 1], dtype=np.int64), "token_mask must be bool.*int64"),
    ([1, 2, 3], np.array([1.0, 0.0, 1.0]), "token_mask must be bool.*float64"),
    ([[1, 2, 3]], None, r"token_ids must be 1-D.*\(1, 3\)"),
    ([1.0, 2.0], None, "token_ids must be integers.*float64"),
    ([True, False], None, "token_ids must be integers.*bool"),
])
def test_bad_mask_or_ids_raise(ids, mask, match, rng):
    tables = TABLES["tiny"]
    hasher = EngramHasher(tables)
    hasher.hash(rng.integers(0, 64, size=3))
    before = hasher.history.copy()
    with pytest.raises(ValueError, match=match):
        hasher.hash(ids, mask)
    assert hasher.position == 3
    np.testing.assert_array_equal(hasher.history, before)
    with pytest.raises(ValueError, match=match):
        hash_reference(tables, ids, mask)


def test_history_is_read_only(rng):
    hasher = EngramHasher(TABLES["tiny"])
    hasher.hash(rng.integers(0, 64, size=4))
    with pytest.raises(ValueError):
        hasher.history[0] = 1


def test_empty_call_is_a_no_op(rng):
    tables = TABLES["tiny"]
    hasher = EngramHasher(tables)
    ids = rng.integers(0, 64, size=5)
    first = hasher.hash(ids)
    empty = hasher.hash(np.array([], dtype=np.int64), np.array([], dtype=bool))
    assert empty.shape == (0, 2, 6) and hasher.position == 5
    nxt = hasher.hash([7])
    np.testing.assert_array_equal(np.concatenate([first, nxt]), EngramHasher(tables).hash([*ids, 7]))


# EngramHashTables.validate ------------------------------------------------------------------------

def _with(tables, **fields):
    return dataclasses.replace(tables, **fields)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_built_tables_validate(name):
    tables = TABLES[name]
    assert tables.validate() is tables
    assert tables.validate(table_rows=tables.table_rows) is tables
    for arr in (tables.multipliers, tables.primes, tables.offsets, tables.token_map):
        assert arr.dtype == np.int64 and not arr.flags.writeable


def test_validate_rejects_even_or_non_positive_multiplier():
    t = TABLES["released"]
    for value in (t.multipliers[1, 2] + 1, 0, -3):
        m = t.multipliers.copy()
        m[1, 2] = value
        with pytest.raises(ValueError, match=rf"multiplier \[layer 14\]\[shift 2\] = {value} must be odd and positive"):
            _with(t, multipliers=m).validate()


def test_validate_rejects_overflowing_multiplier():
    t = TABLES["released"]
    m = t.multipliers.copy()
    m[0, 0] = (np.iinfo(np.int64).max // 99_091) + 2  # odd, one past the bound
    m[0, 0] += 1 - m[0, 0] % 2
    with pytest.raises(ValueError, match="multiplier .* overflows int64"):
        _with(t, multipliers=m).validate()


def test_validate_rejects_non_prime():
    t = TABLES["released"]
    p = t.primes.copy()
    p[1, 1, 3] += 2   # 16000xxx + 2: check it is composite so the test means what it says
    while next_prime_above(int(p[1, 1, 3]) - 1) == p[1, 1, 3]:
        p[1, 1, 3] += 2
    with pytest.raises(ValueError, match=rf"primes of layer 14 contain {int(p[1, 1, 3])}, which is not prime"):
        _with(t, primes=p, offsets=t.offsets).validate()
    p = t.primes.copy()
    p[0, 0, 0] = 1
    with pytest.raises(ValueError, match="primes must all be > 1"):
        _with(t, primes=p).validate()


def test_validate_rejects_wrong_offsets():
    t = TABLES["released"]
    o = t.offsets.copy()
    o[1, 5] += 1
    with pytest.raises(ValueError, match=r"offset \[layer 14\]\[col 5\] = .* exclusive prefix sum .* is "
                                         + str(int(t.offsets[1, 5]))):
        _with(t, offsets=o).validate()
    # Cumulative over both layers instead of restarting at 0 per layer.
    flat = t.primes.reshape(-1)
    o = np.concatenate([[0], np.cumsum(flat)[:-1]]).reshape(2, 24)
    with pytest.raises(ValueError, match=r"offset \[layer 14\]\[col 0\]"):
        _with(t, offsets=o).validate()


def test_validate_rejects_table_rows_mismatch():
    t = TABLES["released"]
    with pytest.raises(ValueError, match="layer 14: its primes sum to 384016682 rows but its table has 384016681 rows"):
        t.validate(table_rows=[RELEASED_ROWS[0], RELEASED_ROWS[1] - 1])
    with pytest.raises(ValueError, match="got 1 table row counts for 2 layers"):
        t.validate(table_rows=[RELEASED_ROWS[0]])


def test_validate_rejects_pad_outside_vocab():
    t = TABLES["tiny"]
    for pad in (64, 1000, -1):
        with pytest.raises(ValueError, match=rf"pad_id {pad} is outside the compressed vocab \[0, 64\)"):
            _with(t, pad_id=pad).validate()


def test_validate_rejects_negative_token_map_entry():
    t = TABLES["tiny"]
    tm = t.token_map.copy()
    tm[17] = -4
    with pytest.raises(ValueError, match=r"token_map holds a negative compressed id \(-4\) at raw id 17"):
        _with(t, token_map=tm).validate()


@pytest.mark.parametrize("field, value, match", [
    ("multipliers", np.ones((3, 4), np.int64), r"multipliers must be \[layers=2"),
    ("multipliers", np.ones((2, 1), np.int64), "max_ngram_size >= 2"),
    ("primes", np.full((2, 2, 2), 67), r"primes must be \[layers=2, orders=3"),
    ("offsets", np.zeros((2, 5), np.int64), r"offsets must be \[layers=2, n_hash_cols=6\]"),
    ("token_map", np.zeros((0,), np.int64), "token_map must be a non-empty 1-D"),
    ("token_map", np.zeros((4, 4), np.int64), "token_map must be a non-empty 1-D"),
])
def test_tables_reject_bad_shapes(field, value, match):
    with pytest.raises(ValueError, match=match):
        _with(TABLES["tiny"], **{field: value})


def test_build_needs_a_token_map():
    with pytest.raises(ValueError, match="token_map"):
        EngramHashTables.build((1,), 4, 2, 64)


def test_float_token_map_is_rejected():
    with pytest.raises(ValueError, match="token_map must be an integer array"):
        EngramHashTables.build((1, 4), 4, 2, 64, np.arange(64, dtype=np.float64), 2)
