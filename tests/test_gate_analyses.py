"""Gate statistics by token class and n-gram frequency, update sizes, and row edits, on the tiny
model (synthetic weights)."""
import numpy as np
import pytest

import engram_numba as en
from engram_numba.analysis.access import access_stats
from engram_numba.analysis.gate_classes import (CLASSES, classify_string, gate_by_class, gate_by_frequency,
                                                ngram_counts_for, token_classes, update_size)
from engram_numba.analysis.row_edit import ngram_rows, row_edit
from engram_numba.bf16 import bf16_to_f32

TEXT = "the thing is, 42 apples and 7 pears; x = y*2! then it's over."


@pytest.fixture(scope="module")
def model():
    return en.load_model(en.tiny_model_path())


@pytest.fixture(scope="module")
def cap(model):
    return en.Pipeline(model).run(text=TEXT)


def test_classify_string_rules():
    assert classify_string(" the", "word-start") == "word-start"
    assert classify_string("ing", "word-start") == "continuation"
    assert classify_string("ing", None) == "word-start"
    assert classify_string(" 42", "word-start") == "digit"
    assert classify_string(",", "word-start") == "punctuation"
    assert classify_string(" =", "word-start") == "code"
    assert classify_string("\n\n", "word-start") == "whitespace"
    assert classify_string("中文", None) == "cjk"
    assert classify_string("<s>", None, special=True) == "special"


def test_gate_by_class_matches_a_direct_computation(model, cap):
    tok = en.tokenizer_for(model)
    labels = token_classes(cap["tokens.ids"], tok)
    assert labels[0] == "special" and {"word-start", "continuation", "digit", "punctuation"} <= set(labels)
    recs = gate_by_class(cap)
    assert {r["class"] for r in recs} == set(CLASSES)
    g = cap["L4.gate.gate"]
    lab = np.array(labels)
    for r in recs:
        if r["layer"] == 4 and r["n"]:
            x = g[lab == r["class"], r["stream"]]
            assert r["n"] == x.size and r["mean"] == pytest.approx(float(x.astype(np.float64).mean()), rel=1e-12)


def test_gate_by_frequency_buckets_count_the_corpus(model, cap):
    corpus = ["the thing is over", "the end of the thing", "apples and pears and apples"] * 5
    acc = access_stats(model, texts=corpus, sequence_tokens=0)
    counts = ngram_counts_for(cap["tokens.ids"], acc, 2)
    # brute force: the bigram (previous, current) of each position, in compressed ids, counted in the corpus
    tm = model.hash_tables.token_map
    docs = [en.tokenize(model, t) for t in corpus]
    ids = cap["tokens.ids"]
    pad = model.hash_tables.pad_id
    def bigrams(d):
        c = tm[d]
        return [(pad if p == 0 else int(c[p - 1]), int(c[p])) for p in range(d.size)]
    from collections import Counter
    want = Counter(b for d in docs for b in bigrams(d))
    assert counts.tolist() == [want[b] for b in bigrams(ids)]
    assert counts.max() > 0 and (counts == 0).any()
    recs = gate_by_frequency(cap, acc, order=2)
    assert sum(r["n"] for r in recs if r["layer"] == 1 and r["stream"] == 0) == ids.size


def test_update_size_is_gate_times_value_over_h(cap):
    recs = update_size(cap)
    g, v, h = cap["L1.gate.gate"], bf16_to_f32(cap["L1.gate.value"]), cap["L1.highway.in"]
    r = np.abs(g[:, 2]) * np.linalg.norm(v, axis=-1) / np.linalg.norm(h[:, 2], axis=-1)
    rec = next(x for x in recs if x["layer"] == 1 and x["stream"] == 2)
    assert rec["mean"] == pytest.approx(float(r.mean()), rel=1e-6) and rec["n"] == r.size


def test_row_edit_zero_changes_exactly_the_reads_of_those_rows(model):
    ctx = en.tokenize(model, "the thing and the end")
    ngram = ctx[1:3]                                       # "the", " thing"... as raw ids
    rows = ngram_rows(model, ngram)
    ed = row_edit(model, ngram, op="zero", context=ctx)
    base, new = ed.baseline, ed.edited
    for li, lid in enumerate(model.config.layer_ids):
        ids = base[f"L{lid}.hash.ids"]                                     # [T, C]
        hit = np.isin(ids, rows[lid])
        assert np.isin(rows[lid], ids[2]).all()         # the n-gram's last token reads every edited row
        assert ed.effects[lid]["reads_edited"] == int(hit.sum())
        assert ed.effects[lid]["tokens"] == sorted(set(np.flatnonzero(hit.any(axis=1)).tolist()))
        b, n = base[f"L{lid}.rows.bf16"], new[f"L{lid}.rows.bf16"]
        flat = hit.reshape(-1)
        assert (bf16_to_f32(n[flat]) == 0).all() and np.array_equal(b[~flat], n[~flat])
    assert ed.effects[1]["key_rel_change"] > 0 and ed.effects[1]["max_abs_delta_gate"] > 0
    assert "row edit (zero)" in str(ed)


def test_row_edit_scale_one_is_a_no_op_and_collateral_finds_sharers(model):
    ngram = en.tokenize(model, "the end", add_special_tokens=False)[:2]        # a bigram: "the", " "
    ed = row_edit(model, ngram, op="scale", factor=1.0, context="the end of the thing")
    assert all(e["max_abs_delta_gate"] == 0 and e["highway_rel_change"] == 0 for e in ed.effects.values())
    texts = ["the end of the thing, and the end of it", "then the thing ends", "at the end the end",
             "the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
             "sphinx of black quartz, judge my vow!", "how vexingly quick daft zebras jump?",
             "we promptly judged antique ivory buckles for the next prize - 1234567890"] * 2
    acc = access_stats(model, texts=texts, sequence_tokens=0)
    col = ed.collateral(acc)
    # brute force: every distinct bigram of the corpus whose row in some head equals an edited row
    ng = acc.ngrams()
    from engram_numba.stages.hash.cpu import hash_positions
    t = model.hash_tables
    found = []
    for li, lid in enumerate(model.config.layer_ids):
        want = set()
        for w, o in zip(ng["window"], ng["order"]):
            if o != 2:
                continue
            out = np.empty((1, len(t.layer_ids), t.offsets.shape[1]), np.int64)
            hash_positions(np.array([w[1], w[0]], np.int64), 1, 1, t.multipliers, t.primes, t.offsets, t.pad_id, out)
            heads = out[0, li, :model.config.n_heads]
            own = tuple(t.token_map[ngram][::-1].tolist())
            if tuple(w[:2].tolist()) != own and np.isin(heads, ed.rows[lid]).any():
                want.add((int(w[1]), int(w[0])))
        got = {tuple(r["ngram"]) for r in col[lid]}
        assert got == want or (len(col[lid]) == 20 and got <= want)
        found.append(len(want))
    assert sum(found) > 0                                  # the tiny tables are small: rows are shared


def test_row_edit_refuses_bad_requests(model):
    with pytest.raises(ValueError, match="op must be one of"):
        row_edit(model, [5, 6], op="negate")
    with pytest.raises(ValueError, match=r"2..4 tokens"):
        row_edit(model, [5], op="zero")
    with pytest.raises(ValueError, match="256 finite floats"):
        row_edit(model, [5, 6], op="replace", value=[1.0, 2.0])
    rel = pytest.importorskip("engram_numba.formats.released")
    assert rel.WeightsMissingError.__mro__[1] is en.EngramFileError
