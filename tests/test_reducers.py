"""The corpus reducer's exact kernels (analysis/reducers.py) and `StreamingGateStats.update` on
lanes: the moments kept across chunks in split int64 bins fold to the integers the per-chunk
fold gives, the one-call chunk check counts and converts what the separate calls did, and a
chunk handed to lanes gives the statistics of a chunk added in place, bit for bit (seconds)."""
import pickle
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from numba import njit

from engram_numba.analysis.reducers import (_FIXED_POINT_SCALE, ACC_PARTS, EXP_BINS, FINE_BINS, first_bad_row,
                                            fold_acc, fold_sums, mark_live_rows, prepare_chunk, reduce_layer_acc,
                                            reduce_layer_rows)
from engram_numba.config import GATE_CLAMP


# ---- the references: the per-chunk reducers the corpus reducer ran before the one-call ones -------
# (kept here, apart, so that the one-call kernels are checked against code they do not share)

@njit(cache=True, nogil=True, inline="always")
def _add_exact(bits, s1, s2, c):
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
def reduce_layer(gate_bits, dot_bits, gate, dot, live, cids, g1, g2, d1, d2, dabs, counts, minmax,
                  fine, tok_sum, fine_bins, clamp):
    """One layer of one chunk: gate, dot [T, hc] (fp32, and their uint32 bits), live [T],
    cids [T] compressed ids. Exponent-binned integer sums into g1/g2/d1/d2/dabs [hc, 256] int64,
    counts [hc, 6] int64 (n, n_nonfinite, masked_nonzero, n_dot, n_clamped, n_dot_nonfinite),
    minmax [hc, 4] f64 (gate min, max, dot min, max), fine [hc, fine_bins], tok_sum [hc, V]."""
    T, hc = gate.shape
    scale = _FIXED_POINT_SCALE
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
def count_live(counts, ids, live):
    """counts[ids[t]] += 1 for every live t (ids checked in [0, counts.size))."""
    for t in range(ids.shape[0]):
        if live[t]:
            counts[ids[t]] += 1


@njit(cache=True, nogil=True)
def fixed_point_gates(gate, live, q, li):
    """q[t, li, c] = the gate gate[t, c] in fixed point (round(g * 2^32)), 0 for a dead token or a
    value that is not finite (gate [T, hc] fp32, q [T, L, hc] int64)."""
    scale = _FIXED_POINT_SCALE
    for t in range(gate.shape[0]):
        for c in range(gate.shape[1]):
            g = gate[t, c]
            if live[t] and np.isfinite(g):
                q[t, li, c] = np.int64(np.rint(np.float64(g) * scale))
            else:
                q[t, li, c] = 0



def _values(rng, T, hc):
    """[T, hc] fp32 gates and dots with every kind of value the reducer bins: normal, denormal,
    negative, zero, the largest significands, NaN and inf."""
    gate = rng.random((T, hc)).astype(np.float32)
    dot = ((rng.random((T, hc)) - 0.5) * 16).astype(np.float32)
    flat_g, flat_d = gate.reshape(-1), dot.reshape(-1)
    n = flat_g.size
    for arr in (flat_g, flat_d):
        k = rng.choice(n, size=n // 8, replace=False)
        arr[k[0::6]] = np.float32(1e-40)                                 # denormal
        arr[k[1::6]] = np.float32(0.0)
        arr[k[2::6]] = np.nextafter(np.float32(1.0), np.float32(0))     # significand 2^24 - 1
        arr[k[3::6]] = -np.float32(3.9999998)
        arr[k[4::6]] = np.float32(np.nan)
        arr[k[5::6]] = np.float32(np.inf)
    flat_d[::37] = np.float32(5e-7)                                      # clamped
    return dot, gate


def test_split_bins_across_chunks_fold_to_the_per_chunk_exact_sums():
    rng = np.random.default_rng(5)
    hc, V = 3, 50
    acc = np.zeros((ACC_PARTS, hc, EXP_BINS), np.int64)
    out_new = [np.zeros((hc, 6), np.int64), np.full((hc, 4), np.inf), np.zeros((hc, FINE_BINS), np.int64),
               np.zeros((hc, V), np.int64)]
    out_new[1][:, 1::2] = -np.inf
    out_ref = [x.copy() for x in out_new]
    ref = [[0] * hc for _ in range(5)]
    for T in (1, 97, 4096, 33):
        dot, gate = _values(rng, T, hc)
        live = rng.random(T) < 0.85
        gate[~live & (rng.random(T) < 0.5)] = 0.0                        # some masked gates are 0, some not
        cids = rng.integers(0, V, T)
        reduce_layer_acc(gate.view(np.uint32), dot.view(np.uint32), gate, dot, live, cids, acc, *out_new,
                         FINE_BINS, GATE_CLAMP)
        per = [np.zeros((hc, EXP_BINS), np.int64) for _ in range(5)]
        reduce_layer(gate.view(np.uint32), dot.view(np.uint32), gate, dot, live, cids, *per, *out_ref,
                     FINE_BINS, GATE_CLAMP)
        for f, (a, power) in enumerate(zip(per, (1, 2, 1, 2, 1))):
            for c, v in enumerate(fold_sums(a, power)):
                ref[f][c] += v
    assert fold_acc(acc) == ref
    # the one-call layer: the same sums, and layer 1's row ids marked as mark_live_rows marks them
    rows = rng.integers(0, 1000, (T, 2, 5))
    bitmap, bitmap_ref = np.zeros(125, np.uint8), np.zeros(125, np.uint8)
    mark_live_rows(bitmap_ref, rows, live, 1)
    acc2, acc3 = np.zeros_like(acc), np.zeros_like(acc)
    outs = [[x.copy() for x in out_new] for _ in range(2)]
    reduce_layer_rows(gate.view(np.uint32), dot.view(np.uint32), gate, dot, live, cids, acc2, *outs[0],
                      FINE_BINS, GATE_CLAMP, bitmap, rows, 1)
    reduce_layer_acc(gate.view(np.uint32), dot.view(np.uint32), gate, dot, live, cids, acc3, *outs[1],
                     FINE_BINS, GATE_CLAMP)
    np.testing.assert_array_equal(bitmap, bitmap_ref)
    np.testing.assert_array_equal(acc2, acc3)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(out_new, out_ref):
        np.testing.assert_array_equal(a, b)
    assert out_new[0][:, 1].sum() > 0 and out_new[0][:, 2].sum() > 0 and out_new[0][:, 4].sum() > 0


@pytest.mark.parametrize("spoil, code, at", [(None, 0, -1), ("token", 1, 6), ("dead token", 1, 2),
                                             ("compressed", 2, 6), ("dead compressed", 0, -1), ("row", 3, 6),
                                             ("dead row", 0, -1)])
def test_prepare_chunk_checks_in_order_then_counts_and_converts(spoil, code, at):
    rng = np.random.default_rng(6)
    T, L, C, hc, R, V = 20, 2, 5, 4, 30, 12
    token_map = rng.integers(0, V, R)
    ids = rng.integers(0, R - 2, T)                      # R - 2 and R - 1 only where spoiled
    live = np.ones(T, bool)
    live[2] = False
    n_rows = np.array([100, 200], np.int64)
    rows = np.stack([rng.integers(0, n, (T, C)) for n in n_rows], axis=1)
    gates = tuple(rng.random((T, hc)).astype(np.float32) for _ in range(L))
    gates[1][4, 1] = np.nan
    if spoil == "token":
        ids[6] = R
    elif spoil == "dead token":
        ids[2] = -1                                      # every token's id is checked, live or not
    elif spoil == "compressed":
        ids[6], token_map[R - 1] = R - 1, V
    elif spoil == "dead compressed":
        ids[2], token_map[R - 2] = R - 2, V              # only live tokens' compressed ids are
    elif spoil == "row":
        rows[6, 1, 3] = 200
    elif spoil == "dead row":
        rows[2, 0, 0] = -1
    cids = np.empty(T, np.int64)
    q = np.full((T, L, hc), 7, np.int64)
    tok, raw = np.zeros(V, np.int64), np.zeros(R, np.int64)
    got = prepare_chunk(ids, live, token_map, R, cids, V, rows, n_rows, True, gates, q, tok, raw)
    assert got[:2] == (code, at)
    if code:
        assert not tok.any() and not raw.any() and (q == 7).all()       # nothing counted
        return
    assert got[2] == live.sum()
    np.testing.assert_array_equal(cids, token_map[ids])
    assert first_bad_row(rows, live, n_rows) == -1
    tok_ref, raw_ref = np.zeros(V, np.int64), np.zeros(R, np.int64)
    count_live(tok_ref, cids, live)
    count_live(raw_ref, ids, live)
    np.testing.assert_array_equal(tok, tok_ref)
    np.testing.assert_array_equal(raw, raw_ref)
    q_ref = np.empty_like(q)
    for li in range(L):
        fixed_point_gates(gates[li], live, q_ref, li)
    np.testing.assert_array_equal(q, q_ref)


@pytest.fixture(scope="module")
def model():
    from engram_numba.fixtures import TINY_PATH
    from engram_numba.formats.schema_a import load_gguf
    return load_gguf(TINY_PATH)


def _chunks(model, n, T, seed=7):
    from engram_numba.analysis.streaming import Chunk
    rng = np.random.default_rng(seed)
    cfg, tables = model.config, model.hash_tables
    out = []
    for k in range(n):
        ids = rng.integers(0, tables.token_map.size, T)
        live = rng.random(T) < 0.9
        rows = np.stack([rng.integers(0, r, (T, cfg.n_hash_cols)) for r in tables.table_rows], axis=1)
        windows = np.minimum(rng.zipf(1.5, (T, cfg.max_ngram_size)) - 1, tables.compressed_vocab_size - 1)
        gates = {}
        for lid in cfg.layer_ids:
            dot, gate = _values(rng, T, cfg.hc)
            gate[~live] = 0.0
            gates[lid] = (dot, gate)
        out.append(Chunk(ids, live, rows, windows, gates, n_documents=k % 2))
    return out


def test_a_chunk_on_lanes_gives_the_statistics_of_a_chunk_added_in_place(model):
    from engram_numba.analysis.streaming import StreamingGateStats
    token_map = model.hash_tables.token_map
    chunks = _chunks(model, 9, 300)
    serial = StreamingGateStats.empty(model, max_contexts=400)            # prunes on the way
    for c in chunks:
        serial.update(c, token_map)
    assert serial.g1[0][0] != 0 and serial._acc_values == 0               # folded after every update
    on_lanes = StreamingGateStats.empty(model, max_contexts=400)
    lanes = {k: ThreadPoolExecutor(1) for k in on_lanes.lane_keys()}
    assert len(lanes) == len(model.config.layer_ids) + model.config.max_ngram_size - 1
    try:
        for c in chunks:
            on_lanes.update(c, token_map, None, lanes, ahead=2)
            assert all(len(f) <= 2 for f in on_lanes._lane_pending.values())
        lid = model.config.layer_ids[-1]
        assert on_lanes.moments(lid, 1, "dot") == serial.moments(lid, 1, "dot")   # a read waits and folds
        assert on_lanes == serial and serial.contexts[3].prunes > 0
        assert pickle.loads(pickle.dumps(on_lanes)) == serial
        on_lanes.update(chunks[0], token_map)            # in place after lanes
        serial.update(chunks[0], token_map)
        assert on_lanes == serial
    finally:
        for lane in lanes.values():
            lane.shutdown()


def test_corpus_stats_with_layer_lanes_equals_layers_waited_for(model, monkeypatch):
    """corpus_stats' two arrangements (analysis.corpus.LANES; the corpus bench times both): the
    same statistics, prunes included."""
    from engram_numba.analysis import corpus as corpus_mod
    rng = np.random.default_rng(4)
    vocab = model.hash_tables.token_map.size
    docs = [rng.integers(0, vocab, int(n)) for n in rng.integers(5, 200, 12)]
    runs = []
    for lanes in ("all", "contexts"):
        monkeypatch.setattr(corpus_mod, "LANES", lanes)
        runs.append(corpus_mod.corpus_stats(model, documents=docs, backend="cpu", chunk_tokens=96, max_contexts=60,
                                            reducer_threads=3))
    assert runs[0].context_table(4).prunes > 0
    assert runs[0] == runs[1]
