"""Corpus statistics that stream: readers, the driver, exact merges, and agreement with
`gate_stats` of single runs. Runs on the tiny model with the cpu backend (seconds)."""
import json

import numpy as np
import pytest

from engram_numba.analysis import corpus as corpus_mod
from engram_numba.analysis.corpus import corpus_stats, iter_documents
from engram_numba.analysis.stats import gate_stats
from engram_numba.analysis.streaming import FINE_BINS, StreamingGateStats, merge
from engram_numba.fixtures import TINY_PATH
from engram_numba.formats.schema_a import load_gguf
from engram_numba.highway import load_highway, save_highway
from engram_numba.pipeline import Pipeline
from engram_numba.text import load_tokenizer

WORDS = ("the cat sat on a mat and the dog ran to its park while it rained on every tree in the "
         "garden of an old house near the river where children often played their games").split()


def make_corpus(n_lines: int, seed: int = 3) -> list[str]:
    """Lines of Zipf-ish word sequences (repeated n-grams, as in text)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(WORDS) + 1)
    p /= p.sum()
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 14)), p=p)) + rng.choice([".", "!", "?", ","])
            for _ in range(n_lines)]


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


@pytest.fixture(scope="module")
def tok():
    from engram_numba.fixtures import TINY_TOKENIZER_PATH
    return load_tokenizer(TINY_TOKENIZER_PATH)


def assert_same_stats(a: StreamingGateStats, b: StreamingGateStats, contexts: bool = True):
    """Every accumulated number equal: integers exactly, the exact moments exactly, floats bitwise."""
    a.finish(), b.finish()
    for f in ("n_documents", "n_tokens", "n_masked"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("g1", "g2", "d1", "d2", "dabs"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("counts", "minmax", "fine", "tok_count", "tok_gsum", "raw_count"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    for x, y in zip(a.row_bitmaps, b.row_bitmaps):
        np.testing.assert_array_equal(x, y)
    if contexts:
        for n in a.contexts:
            ta, tb = a.context_table(n), b.context_table(n)
            np.testing.assert_array_equal(ta.keys, tb.keys)
            np.testing.assert_array_equal(ta.count, tb.count)
            np.testing.assert_array_equal(ta.gsum, tb.gsum)
    for ra, rb in zip(a, b):
        for k, v in ra.__dict__.items():
            if k == "hist_counts":
                np.testing.assert_array_equal(v, rb.hist_counts)
            else:
                assert (v == getattr(rb, k)) or (v != v and getattr(rb, k) != getattr(rb, k)), (k, v, getattr(rb, k))


@pytest.mark.slow
def test_a_streamed_corpus_of_10k_tokens_merges_to_its_one_pass_statistics(tmp_path, model, tok):
    """The CI corpus: > 10,000 tokens in three files. One pass over all of it equals the three
    files run separately (different chunk sizes, one without threads) and merged, exactly; and
    saving and loading the parts changes nothing."""
    lines = make_corpus(600)
    parts = [lines[:180], lines[180:420], lines[420:]]
    files = []
    for i, part in enumerate(parts):
        f = tmp_path / f"part{i}.txt"
        f.write_text("\n".join(part) + "\n", encoding="utf-8")
        files.append(f)
    whole = corpus_stats(model, files, backend="cpu", chunk_tokens=4096)
    assert whole.n_tokens >= 10_000 and whole.n_documents == 600
    assert whole.n_chunks >= 3 and whole.meta["highway"].startswith("synthetic")
    runs = [corpus_stats(model, files[0], backend="cpu", chunk_tokens=1000),
            corpus_stats(model, files[1], backend="cpu", chunk_tokens=4096, threads=False, reducer_threads=1),
            corpus_stats(model, files[2], backend="cpu", chunk_tokens=333)]
    assert_same_stats(whole, merge(runs))
    assert_same_stats(whole, runs[0] + runs[1] + runs[2])
    for i, r in enumerate(runs):
        r.save(tmp_path / f"s{i}.npz")
    loaded = merge([StreamingGateStats.load(tmp_path / f"s{i}.npz") for i in range(3)])
    assert_same_stats(whole, loaded)
    # the report is there, and says the highway is synthetic
    assert "SYNTHETIC" in str(whole)
    js = whole.to_json()
    assert js["n_tokens"] == whole.n_tokens and js["highway_is_synthetic"]
    json.dumps(js)
    assert whole.context_table(4).exact and whole.columns()[0]["exact"]


def test_one_document_equals_gate_stats_of_its_run(model, tok):
    text = " ".join(make_corpus(12))
    st = corpus_stats(model, texts=[text], backend="cpu", chunk_tokens=64, reducer_threads=2)
    cpu_s = {k for k in st.meta["timing"] if k.endswith("_cpu_s")}           # each thread's CPU seconds
    assert cpu_s == {"produce_cpu_s", "gates_cpu_s", "reduce_cpu_s", "lanes_cpu_s", "all_cpu_s"}
    cap = Pipeline(model, "cpu").run(tok.encode(text))
    gs = gate_stats(cap, bins=20)
    for r in gs:
        s = st[r.layer, r.stream]
        assert (s.n, s.n_clamped, s.masked_nonzero) == (r.n, r.n_clamped, r.masked_nonzero)
        assert (s.min, s.max, s.dot_min, s.dot_max) == (r.min, r.max, r.dot_min, r.dot_max)
        np.testing.assert_allclose([s.mean, s.std, s.dot_mean_abs], [r.mean, r.std, r.dot_mean_abs], rtol=1e-12)
        np.testing.assert_array_equal(s.hist_counts, r.hist_counts)
        np.testing.assert_allclose([s.q05, s.q25, s.q50, s.q75, s.q95],
                                   [r.q05, r.q25, r.q50, r.q75, r.q95], rtol=0, atol=1e-5)
    # exact moments against Python fractions
    from fractions import Fraction
    g = cap["L1.gate.gate"][:, 0]
    m = st.moments(1, 0)
    exact_mean = sum(Fraction(float(x)) for x in g) / g.size
    assert m["mean"] == float(exact_mean)
    assert m["M2"] == float(sum((Fraction(float(x)) - exact_mean) ** 2 for x in g))


@pytest.mark.slow
def test_continuous_runs_the_corpus_as_one_sequence(model, tok):
    texts = make_corpus(30)
    st = corpus_stats(model, texts=texts, backend="cpu", chunk_tokens=100, continuous=True)
    ids = np.concatenate(tok.encode_batch(texts))
    gs = gate_stats(Pipeline(model, "cpu").run(ids))
    for r in gs:
        s = st[r.layer, r.stream]
        assert s.n == r.n == ids.size
        np.testing.assert_allclose(s.mean, r.mean, rtol=1e-12)
    fresh = corpus_stats(model, texts=texts, backend="cpu", chunk_tokens=100)
    assert fresh[1, 0].mean != st[1, 0].mean          # fresh sequences hash (and draw) differently


def test_highway_file_documents_with_masks(tmp_path, model, rng, tok):
    """A corpus of highway files: each a document with its own recorded streams (and mask)."""
    files, caps = [], []
    for i in range(3):
        ids = tok.encode(make_corpus(2, seed=i)[0])
        mask = rng.random(ids.size) > 0.2
        hw = {lid: rng.standard_normal((ids.size, 4, 64)).astype(np.float32) for lid in (1, 4)}
        files.append(save_highway(tmp_path / f"h{i}.safetensors", hw, ids, mask, dtype="fp32"))
        caps.append(Pipeline(model, "cpu").run(ids, token_mask=mask, highway=hw))
    st = corpus_stats(model, files, backend="cpu", chunk_tokens=16)
    assert st.meta["highway"].startswith("imported from 3 highway file") and not st.highway_is_synthetic
    n_masked = sum(int((~c["tokens.mask"]).sum()) for c in caps)
    assert st.n_masked == n_masked > 0
    for lid in (1, 4):
        for c in range(4):
            g = np.concatenate([cap[f"L{lid}.gate.gate"][cap["tokens.mask"], c] for cap in caps])
            assert st[lid, c].n == g.size
            np.testing.assert_allclose(st[lid, c].mean, g.astype(np.float64).mean(), rtol=1e-12)
    docs = [load_highway(f, model) for f in files]
    again = corpus_stats(model, documents=docs, backend="cpu")
    assert_same_stats(st, again)
    with pytest.raises(ValueError, match="mixes documents with highway files and documents without"):
        corpus_stats(model, documents=[docs[0], tok.encode("the cat")], backend="cpu", threads=False)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl_ids", "npy", "npy2d", "ids", "paragraph", "file", "folder"])
def test_corpus_formats(tmp_path, model, tok, fmt):
    lines = make_corpus(8)
    ids = [tok.encode(t) for t in lines]
    want = corpus_stats(model, texts=lines, backend="cpu")
    split = "line"
    if fmt == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(lines)))
    elif fmt == "jsonl_ids":
        path = tmp_path / "c.jsonl"
        path.write_text("\n".join(json.dumps({"text": x.tolist()}) for x in ids))
    elif fmt == "npy":
        path = tmp_path / "d"
        path.mkdir()
        for i, x in enumerate(ids):
            np.save(path / f"{i:02d}.npy", x)
    elif fmt == "npy2d":
        n = min(x.size for x in ids)
        ids = [x[:n] for x in ids]
        want = corpus_stats(model, documents=ids, backend="cpu")
        path = tmp_path / "c.npy"
        np.save(path, np.stack(ids))
    elif fmt == "ids":
        path = tmp_path / "c.ids"
        path.write_text("\n".join(" ".join(map(str, x)) for x in ids) + "\n\n")
    elif fmt == "paragraph":
        path = tmp_path / "c.txt"
        path.write_text("\n\n".join(lines) + "\n")
        split = "paragraph"
    elif fmt == "file":
        path = tmp_path / "c"
        path.mkdir()
        for i, t in enumerate(lines):
            (path / f"{i:02d}.txt").write_text(t)
        split = "file"
    else:
        path = tmp_path / "c"
        path.mkdir()
        (path / "a.txt").write_text("\n".join(lines[:3]) + "\n")
        (path / "b.txt").write_text("\n".join(lines[3:]) + "\n")
    got = corpus_stats(model, path, backend="cpu", split=split)
    assert_same_stats(want, got)


def test_documents_are_read_in_order_and_named(tmp_path, tok):
    path = tmp_path / "c.txt"
    path.write_text("the cat\n\n  \nsat on\n")
    docs = list(iter_documents([path], tokenizer=tok))
    assert [d.name for d in docs] == [f"{path}:1", f"{path}:4"]
    assert docs[1].token_ids.tolist() == tok.encode("sat on").tolist()


@pytest.mark.parametrize("content, name, match", [
    ('{"text": "a"}\n{"body": "b"}\n', "c.jsonl", r"c.jsonl:2: no field 'text' \(fields: body\)"),
    ('{"text": 5}\n', "c.jsonl", "field 'text' must be a string or a list of token ids"),
    ("[1, 2]\n", "c.jsonl", "expected a JSON object"),
    ("1 2 x3\n", "c.ids", r"c.ids:1: 'x3' is not an integer token id"),
    ("1 2 99\n", "c.ids", r"c.ids:1: token id 99 at position 2 is outside the model's token map \[0, 64\)"),
])
def test_corpus_errors_name_the_line(tmp_path, model, content, name, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        corpus_stats(model, path, backend="cpu")


def test_argument_errors_before_any_work(tmp_path, model):
    with pytest.raises(FileNotFoundError, match="corpus file .*nope.txt does not exist"):
        corpus_stats(model, tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        corpus_stats(model, texts=["a"], chunk_tokens=0)
    with pytest.raises(ValueError, match="no corpus"):
        corpus_stats(model)
    with pytest.raises(ValueError, match="split must be one of"):
        corpus_stats(model, texts=["a"], split="sentence")
    with pytest.raises(ValueError, match="bins must divide 100000"):
        corpus_stats(model, texts=["a"], bins=7)


@pytest.mark.slow
def test_context_cap_prunes_and_says_how_far_off_counts_can_be(model):
    texts = make_corpus(60)
    st = corpus_stats(model, texts=texts, backend="cpu", chunk_tokens=64, max_contexts=20)
    t = st.context_table(4)
    assert not t.exact and t.prunes > 0 and t.count.size <= 20 and t.undercount_bound > 0
    assert "pruned" in st.summary() and "lower bound" in st.summary()
    full = corpus_stats(model, texts=texts, backend="cpu", chunk_tokens=64)
    ft = full.context_table(4)
    # every surviving context's count is within the bound of its true count
    true = {tuple(k): c for k, c in zip(ft.keys.tolist(), ft.count.tolist())}
    for k, c in zip(t.keys.tolist(), t.count.tolist()):
        assert true[tuple(k)] - t.undercount_bound <= c <= true[tuple(k)]
    assert_same_stats(st, full, contexts=False)          # nothing else depends on the cap


@pytest.mark.slow
def test_top_lists_columns_and_strings(model, tok):
    st = corpus_stats(model, texts=make_corpus(80), backend="cpu")
    top = st.top_tokens(1, k=3)
    assert [r["token"] for r in top][:1] == [" "] and top[0]["count"] >= top[1]["count"]
    by_gate = st.top_tokens(4, 2, k=5, by="mean_gate", min_count=5)
    assert all(r["count"] >= 5 for r in by_gate)
    assert [r["mean_gate"] for r in by_gate] == sorted((r["mean_gate"] for r in by_gate), reverse=True)
    ctx = st.top_contexts(3, 1, k=2)
    assert len(ctx[0]["ids"]) == 3 and ctx[0]["text"] == "".join(ctx[0]["tokens"])
    cols = st.columns()
    assert len(cols) == 2 * 6
    for c in cols:
        assert c["exact"] and c["collisions"] == c["distinct_contexts"] - c["ids_of_contexts"]
        assert c["ids_of_contexts"] == c["distinct_ids"]   # the bitmap and the rerun hash agree
    # row-id reuse of the same corpus as one capture agrees with row_id_reuse
    from engram_numba.analysis.stats import row_id_reuse
    text = " ".join(make_corpus(20))
    one = corpus_stats(model, texts=[text], backend="cpu")
    cap = Pipeline(model, "cpu").run(tok.encode(text))
    reuse = row_id_reuse(cap, tables=model.hash_tables)
    for c in one.columns():
        r = reuse[c["layer"]][c["col"]]
        assert (c["distinct_ids"], c["distinct_contexts"], c["collisions"]) == \
            (r.distinct_ids, r.distinct_contexts, r.collisions)


def test_quantiles_from_the_fine_histogram(model):
    st = StreamingGateStats.empty(model)
    rng = np.random.default_rng(5)
    g = rng.random((5000, 4)).astype(np.float32)
    from engram_numba.analysis.streaming import Chunk
    T = g.shape[0]
    st.update(Chunk(np.zeros(T, np.int64), np.ones(T, bool), np.zeros((T, 2, 6), np.int64), None,
                    {1: (g - 0.5, g), 4: (g - 0.5, g)}), model.hash_tables.token_map)
    for c in range(4):
        want = np.quantile(g[:, c].astype(np.float64), [0.05, 0.5, 0.95])
        np.testing.assert_allclose(st.quantile(1, c, [0.05, 0.5, 0.95]), want, rtol=0, atol=1e-5)
    assert st.fine.shape[-1] == FINE_BINS
    counts, edges = st.histogram(1, 0, bins=50)
    np.testing.assert_array_equal(counts, np.histogram(g[:, 0], bins=50, range=(0, 1))[0])


@pytest.mark.parametrize("what", ["negative token id", "token id past the map", "compressed id", "row id"])
def test_update_refuses_ids_out_of_range_before_counting_anything(model, what):
    from engram_numba.analysis.streaming import Chunk
    rng = np.random.default_rng(8)
    T, tables = 40, model.hash_tables
    token_map = tables.token_map.copy()
    ids = rng.integers(0, token_map.size, T)
    rows = np.stack([rng.integers(0, r, (T, model.config.n_hash_cols)) for r in tables.table_rows], axis=1)
    g = rng.random((T, model.config.hc)).astype(np.float32)
    live = np.ones(T, bool)
    live[3] = False
    bad = {"negative token id": ("token id -1 at token 7", lambda: ids.__setitem__(7, -1)),
           "token id past the map": (f"token id {token_map.size} at token 7",
                                     lambda: ids.__setitem__(7, token_map.size)),
           "compressed id": (f"compressed id {tables.compressed_vocab_size} at token 7",
                             lambda: token_map.__setitem__(ids[7], tables.compressed_vocab_size)),
           "row id": ("row ids of token 7", lambda: rows.__setitem__((7, 1, 5), tables.table_rows[1]))}
    match, spoil = bad[what]
    spoil()
    rows[3, 0, 0] = -5                                   # a dead token's rows are not read
    st = StreamingGateStats.empty(model)
    windows = rng.integers(0, tables.compressed_vocab_size, (T, model.config.max_ngram_size))
    chunk = Chunk(ids, live, rows, windows, {lid: (g - 0.5, g) for lid in model.config.layer_ids})
    with pytest.raises(ValueError, match=match):
        st.update(chunk, token_map)
    assert st == StreamingGateStats.empty(model)


def test_merging_different_settings_is_refused(model):
    a = corpus_stats(model, texts=["the cat"], backend="cpu")
    b = corpus_stats(model, texts=["the cat"], backend="cpu", max_contexts=10)
    with pytest.raises(ValueError, match="max_contexts: 200000 vs 10"):
        a + b


def test_token_table_written_while_streaming(tmp_path, model, tok):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    texts = make_corpus(5)
    out = tmp_path / "long.parquet"
    corpus_stats(model, texts=texts, backend="cpu", chunk_tokens=20, token_table=out)
    df = pd.read_parquet(out)
    n = sum(tok.encode(t).size for t in texts)
    assert len(df) == n * 2 * 4
    first = df[(df.document == 1)]
    ids = tok.encode(texts[1])
    cap = Pipeline(model, "cpu").run(ids)
    sel = first[(first.layer == 4) & (first.stream == 2)].sort_values("position")
    np.testing.assert_array_equal(sel.gate.to_numpy(), cap["L4.gate.gate"][:, 2])
    np.testing.assert_array_equal(sel.token_id.to_numpy(), ids)
    assert sel.token.tolist() == tok.token_strings(ids)
    np.testing.assert_array_equal(sel[[f"row_id_{c}" for c in range(6)]].to_numpy(), cap["L4.hash.ids"])


@pytest.mark.slow
def test_cuda_backend_corpus_equals_cpu_in_the_simulator(model):
    """The device path (device tables, synthetic highway assembled on the device, only dot and
    gate back) on a handful of tokens: the naive kernels in the simulator add in the reference's
    order, so the statistics equal the cpu backend's exactly."""
    docs = [np.array([0, 48]), np.array([17])]         # one chunk, two sequences (two highway runs)
    cpu = corpus_stats(model, documents=docs, backend="cpu", chunk_tokens=3)
    with pytest.warns(UserWarning, match="simulator"):
        gpu = corpus_stats(model, documents=docs, backend="cuda", chunk_tokens=3)
    assert_same_stats(cpu, gpu)
    assert gpu.meta["cuda_kernels"]


def test_synthetic_blocks_match_the_pipelines_highway():
    from engram_numba.pipeline import synthetic_highway
    blocks = corpus_mod.SyntheticBlocks(2, 8, cache_bytes=1)
    pos = np.array([0, 1, 2, 300, 301, 5, 255, 256])
    whole = synthetic_highway(0, 400, 2, 8)
    np.testing.assert_array_equal(blocks.host(pos), whole[pos])


# -- gpu tier (skipped without a GPU) ------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_corpus_stats_agree_with_cpu(model):
    """On a GPU the default (fast) kernels sum in other orders: every count that does not depend
    on the gate's value is equal, and the gate's moments agree to bf16 rounding of the kv."""
    texts = make_corpus(300)
    cpu = corpus_stats(model, texts=texts, backend="cpu")
    gpu = corpus_stats(model, texts=texts, backend="cuda")
    assert (gpu.n_tokens, gpu.n_documents) == (cpu.n_tokens, cpu.n_documents)
    np.testing.assert_array_equal(gpu.tok_count, cpu.tok_count)
    for a, b in zip(gpu.row_bitmaps, cpu.row_bitmaps):
        np.testing.assert_array_equal(a, b)
    for n in cpu.contexts:
        np.testing.assert_array_equal(gpu.context_table(n).count, cpu.context_table(n).count)
    for r, s in zip(cpu, gpu):
        assert r.n == s.n
        np.testing.assert_allclose([s.mean, s.std, s.q50], [r.mean, r.std, r.q50], rtol=2e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_device_path_keeps_rows_and_kv_on_the_device(model, monkeypatch):
    from engram_numba import layer_step
    from engram_numba.fixtures import TINY_MASK, TINY_TOKENS
    ref = Pipeline(model, "reference").run(TINY_TOKENS, token_mask=TINY_MASK)
    pipe = Pipeline(model, "cuda")
    fetched = []
    real_host = layer_step.Value.host

    def host(self):
        if self.on_device and self._host is None:
            fetched.append(self.shape)
        return real_host(self)
    monkeypatch.setattr(layer_step.Value, "host", host)
    cap = pipe.run(TINY_TOKENS, token_mask=TINY_MASK, names_filter=["tokens.*", "L*.gate.gate", "L*.gate.dot"])
    assert fetched == [(len(TINY_TOKENS), model.config.hc)] * 4     # only each layer's dot and gate came back
    for lid in (1, 4):
        np.testing.assert_allclose(cap[f"L{lid}.gate.gate"], ref[f"L{lid}.gate.gate"], rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
def test_gpu_corpus_bench_small_tables():
    from engram_numba.bench.corpus import run
    from engram_numba.bench.timing import RELEASED
    res = run(RELEASED, quick=True, table_gb=0.5, n_chunks=2, log=lambda *a: None, cache_gbs=(0.001,))
    corpus = [r for r in res["records"] if r["stage"] == "corpus_stats"]
    # quick: device tables (the default reducer, then the layers on lanes of their own), then host
    # tables: none, prefetch, static cache, clock x 2
    assert len(corpus) == 2 + 5
    assert [r["variant"] for r in corpus[:2]] == ["device", "device, layers on lanes"]
    assert corpus[1]["same_statistics_as_device_variant"] is True
    for r in corpus:
        assert r["validated"] and r["tokens_per_s"] > 0 and r["device_sum_us"] > 0
        assert r["tables"] in ("device", "host") and "cache_gb" in r
    assert [r["cache_policy"] for r in corpus[-3:]] == ["static", "clock", "clock"]
    assert corpus[-1]["cache_warm_started"] and corpus[-2]["inserted_per_chunk"] > 0
    decode = [r for r in res["records"] if r["stage"] == "decode_step"]
    assert [r["tables"] for r in decode] == ["device", "host", "host"] and all(r["validated"] for r in decode)
    assert [r["prefetch"] for r in decode] == [False, False, True]     # the third: prefetch_decode ahead
    assert res["memory"]["peak_device_gb"] > 1.0


@pytest.mark.gpu
def test_gpu_corpus_bench_fp8_model_small_tables():
    """The HF checkpoint's encodings (FP8 rows with separate scales, FP8 wkv) through the
    engine's default projection, queued-ahead chunks checked against one chunk at a time."""
    from engram_numba.bench.corpus import run
    from engram_numba.bench.timing import RELEASED
    res = run(RELEASED, quick=True, table_gb=0.5, n_chunks=3, log=lambda *a: None, model="fp8")
    rec, lanes = [r for r in res["records"] if r["stage"] == "corpus_stats"]
    assert (rec["variant"], lanes["variant"]) == ("device", "device, layers on lanes")
    assert rec["model"] == "fp8" and rec["wkv_on_device"] == {"1": "fp8", "14": "fp8"}
    assert rec["validated"] and rec["same_statistics_one_chunk_at_a_time"] and rec["tokens_per_s"] > 0
    assert rec["device_chunks"]["chunks"] == 3 and "fp8" in rec["kernel"]
    assert lanes["validated"] and lanes["same_statistics_as_device_variant"] is True


def test_corpus_stats_versions_keyword_and_its_deprecated_name(model):
    docs = [np.arange(1, 9), np.arange(20, 25)]
    new = corpus_stats(model, documents=docs, backend="cpu", versions={"proj": "gemv_v2"}, threads=False)
    with pytest.warns(DeprecationWarning, match="corpus_stats\\(cuda_versions=...\\) is deprecated"):
        old = corpus_stats(model, documents=docs, backend="cpu", cuda_versions={"proj": "gemv_v2"}, threads=False)
    assert old == new and new.n_tokens == 13
