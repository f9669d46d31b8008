"""Text in, text out: the tiny tokenizer, tokenize, token strings, GGUF-embedded vocabularies,
the compressed-id view, and a pipeline run from text."""
import json

import numpy as np
import pytest

from engram_numba import text
from engram_numba.fixtures import (TINY_PATH, TINY_TOKENIZER_PATH, build_tiny_tokenizer, tiny_config,
                                   tiny_hash_tables)
from engram_numba.formats.schema_a import load_gguf, write_gguf
from engram_numba.pipeline import Pipeline

SENTENCE = "The cat sat on the mat, and the dog is running!"


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


@pytest.fixture(scope="module")
def tok():
    return text.load_tokenizer(TINY_TOKENIZER_PATH)


def test_tiny_tokenizer_file_is_what_the_builder_makes():
    committed = json.loads(TINY_TOKENIZER_PATH.read_text(encoding="utf-8"))
    assert committed == json.loads(build_tiny_tokenizer().to_str())
    assert TINY_TOKENIZER_PATH.stat().st_size < 8000


def test_both_tiny_tokenizers_share_the_special_tokens():
    """BOS, EOS and pad are ids 0..2 of the tiny GGUF's tokenizer and of the HF copy's (the
    committed files, not only the builders), and the pad is the tiny model's pad id."""
    from engram_numba.fixtures import REPO_DATA, tiny_tokenizer_json
    assert len(text.TINY_SPECIAL_TOKENS) == 3 and text.TINY_UNK_TOKEN not in text.TINY_SPECIAL_TOKENS
    hf_file = json.loads((REPO_DATA / "tiny_v41_hf" / "tokenizer.json").read_text(encoding="utf-8"))
    for doc in (json.loads(TINY_TOKENIZER_PATH.read_text(encoding="utf-8")), hf_file, json.loads(tiny_tokenizer_json())):
        specials = {t["content"]: t["id"] for t in doc["added_tokens"] if t["special"]}
        assert {t: specials.get(t) for t in text.TINY_SPECIAL_TOKENS} == dict(zip(text.TINY_SPECIAL_TOKENS, (0, 1, 2)))
        assert {doc["model"]["vocab"][t] for t in text.TINY_SPECIAL_TOKENS} == {0, 1, 2}
    assert text.TINY_SPECIAL_TOKENS[2] == "<｜▁pad▁｜>" and tiny_hash_tables().pad_id == 2   # identity token map
    # only the GGUF's tokenizer has an unknown token, right after them
    assert json.loads(TINY_TOKENIZER_PATH.read_text(encoding="utf-8"))["model"]["vocab"][text.TINY_UNK_TOKEN] == 3
    assert text.TINY_UNK_TOKEN not in hf_file["model"]["vocab"]


def test_byte_alphabet_is_gpt2s():
    table = text.byte_alphabet()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("a")] == "a" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"   # GPT-2's
    assert table[0] == chr(256) and table[0xAD] == "\u0143"          # past U+00FF, in byte order


def test_tiny_tokenizer_makes_the_tiny_models_identity_token_map(tok):
    """The compressed token map recipe of docs/math.md section 2 on the tiny tokenizer gives the
    tiny model's map (the identity over 64 raw ids, pad = raw 2)."""
    from tokenizers import Regex
    from tokenizers import normalizers as nz
    norm = nz.Sequence([nz.NFKC(), nz.NFD(), nz.StripAccents(), nz.Lowercase(),
                        nz.Replace(Regex(r"[ \t\r\n]+"), " "), nz.Replace(Regex(r"^ $"), "\ue000"),
                        nz.Strip(), nz.Replace("\ue000", " ")])
    hf = tok._hf
    keys: dict = {}
    token_map = np.empty(64, dtype=np.int64)
    for i in range(64):
        t = hf.decode([i], skip_special_tokens=False)
        key = hf.id_to_token(i) if "\ufffd" in t else (norm.normalize_str(t) or t)
        token_map[i] = keys.setdefault(key, len(keys))
    tables = tiny_hash_tables()
    np.testing.assert_array_equal(token_map, tables.token_map)
    assert int(token_map[2]) == tables.pad_id


def test_tokenize_with_the_models_tokenizer(model, tok):
    ids = text.tokenize(model, SENTENCE)
    assert ids.dtype == np.int64 and ids[0] == 0                      # BOS
    assert ids.max() < model.hash_tables.token_map.size
    assert tok.decode(ids, skip_special_tokens=True) == SENTENCE.lower()
    strings = tok.token_strings(ids)
    assert strings[:4] == ["<｜begin▁of▁sentence｜>", "the", " ", "c"]
    assert "".join(strings[1:]) == SENTENCE.lower()
    np.testing.assert_array_equal(text.tokenize(TINY_TOKENIZER_PATH, SENTENCE), ids)
    np.testing.assert_array_equal(text.tokenize(model, SENTENCE, add_special_tokens=False), ids[1:])
    assert [x.tolist() for x in tok.encode_batch(["the", "cat"])] == [[0, 48], [0, 6, 56]]
    assert tok.token_labels([40, 48]) == ["␣", "the"]


def test_token_label_escapes():
    assert text.token_label(" the\n") == "␣the\\n"
    assert text.token_label("\t\x01") == "\\t\\x01"
    assert text.token_label("") == "∅"


def test_unknown_characters_are_unk_and_bad_ids_are_refused(tok):
    ids = tok.encode("é", add_special_tokens=False)
    assert ids.tolist() == [3]
    with pytest.raises(ValueError, match="token id 64 at position 1 is outside this tokenizer's 64 ids"):
        tok.decode([1, 64])
    with pytest.raises(ValueError, match="must be integers"):
        tok.token_strings([1.5])


def test_pipeline_runs_from_text_and_carries_token_strings(model, tok):
    pipe = Pipeline(model, "cpu")
    cap = pipe.run(text=SENTENCE)
    ids = tok.encode(SENTENCE)
    np.testing.assert_array_equal(cap["tokens.ids"], ids)
    assert cap.meta["token_strings"] == tok.token_strings(ids)
    assert cap.token_strings == tok.token_strings(ids)
    assert cap.meta["tokenizer"].endswith("tiny_tokenizer.json")
    same = pipe.run(ids)
    np.testing.assert_array_equal(same["L4.gate.gate"], cap["L4.gate.gate"])
    assert same.meta["token_strings"] == cap.meta["token_strings"]   # the model's tokenizer is found by itself
    with pytest.raises(ValueError, match="give token_ids or text, not both"):
        pipe.run(ids, text=SENTENCE)
    with pytest.raises(ValueError, match="no tokens"):
        pipe.run()


def _tiny_with_vocab(tmp_path, tok, *, hf_json: bool = False, name: str = "vocab.gguf", vocab: bool = True):
    """The tiny model written again (under another general.name) with the tiny tokenizer's
    vocabulary in GGUF keys (or, vocab=False, with no tokenizer at all)."""
    cfg, tables = tiny_config(), tiny_hash_tables()
    src = load_gguf(TINY_PATH)
    layers = {lid: {"table": np.array(lf.table), "wkv": np.array(lf.wkv_raw), "wkv_type": lf.wkv_type,
                    "q_weight": np.array(lf.q_weight), "k_weight": np.array(lf.k_weight)}
              for lid, lf in src.layers.items()}
    hf = tok._hf
    strings = [hf.id_to_token(i) for i in range(64)]
    types = [3 if i < 4 else 1 for i in range(64)]
    merges = [" ".join(m) for m in json.loads(hf.to_str())["model"]["merges"]]
    kv = {"tokenizer.ggml.model": ("str", "gpt2"), "tokenizer.ggml.pre": ("str", "deepseek-v3"),
          "tokenizer.ggml.tokens": ("arr[str]", strings), "tokenizer.ggml.token_type": ("arr[i32]", np.array(types)),
          "tokenizer.ggml.merges": ("arr[str]", merges)}
    if hf_json:
        kv["tokenizer.huggingface.json"] = ("str", hf.to_str())
    if not vocab:
        kv = {}
    path = tmp_path / name
    write_gguf(path, cfg, tables, layers, kv_overrides=kv)
    return path


def test_gguf_vocabulary_decodes_but_does_not_encode(tmp_path, tok):
    path = _tiny_with_vocab(tmp_path, tok)
    g = text.load_tokenizer(path)
    assert g.kind == "gguf (decode only)" and not g.can_encode and g.vocab_size == 64
    ids = tok.encode(SENTENCE)
    assert g.decode(ids) == tok.decode(ids)                          # byte-level decode agrees
    assert g.token_strings(ids) == tok.token_strings(ids)
    assert g.decode(ids, skip_special_tokens=True) == SENTENCE.lower()
    with pytest.raises(text.NoTokenizerError, match="pass the model's tokenizer.json"):
        g.encode("the cat")
    # a model opened from that GGUF (not the fixture's path) uses the GGUF's own vocabulary: it
    # decodes, and text needs a tokenizer.json
    with load_gguf(path) as m:
        assert text.tokenizer_for(m).kind == "gguf (decode only)"
        with pytest.raises(text.NoTokenizerError, match="tokenizer.json"):
            Pipeline(m, "cpu").run(text="the cat")
        cap = Pipeline(m, "cpu", tokenizer=TINY_TOKENIZER_PATH).run(text="the cat")
        assert cap.meta["token_strings"] == ["<｜begin▁of▁sentence｜>", "the", " ", "c", "at"]
        assert Pipeline(m, "cpu").run(tok.encode("the cat")).meta["token_strings"][1] == "the"


def test_gguf_with_the_huggingface_json_encodes(tmp_path, tok):
    path = _tiny_with_vocab(tmp_path, tok, hf_json=True)
    g = text.load_tokenizer(path)
    assert g.can_encode and g.kind == "gguf (tokenizer.huggingface.json)"
    np.testing.assert_array_equal(g.encode(SENTENCE), tok.encode(SENTENCE))


def test_tokenizer_beside_the_model_and_errors(tmp_path, tok):
    import shutil
    copy = tmp_path / "copy" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(TINY_PATH, copy)                      # a copy of the fixture is still the tiny model
    with load_gguf(copy) as m:
        assert text.tokenizer_for(m).source.endswith("tiny_tokenizer.json")
    m_path = _tiny_with_vocab(tmp_path, tok, name="m.gguf", vocab=False)
    with load_gguf(m_path) as m:
        with pytest.raises(text.NoTokenizerError, match="carries no tokenizer"):
            text.tokenizer_for(m)
        assert Pipeline(m, "cpu").run([2, 3]).meta["token_strings"] is None
        shutil.copy(TINY_TOKENIZER_PATH, tmp_path / "tokenizer.json")
        assert text.tokenizer_for(m).source == str(tmp_path / "tokenizer.json")
        assert text.load_tokenizer(tmp_path).source == str(tmp_path / "tokenizer.json")
    with pytest.raises(text.NoTokenizerError, match="does not exist"):
        text.load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        text.load_tokenizer(bad)


def test_a_tokenizer_larger_than_the_token_map_is_refused(model):
    from tokenizers import Tokenizer, models
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    wrapped = text.Tokenizer(hf=big, source="big")
    with pytest.raises(ValueError, match="has 100 token ids but the model's token map has 64"):
        text.tokenizer_for(model, wrapped)


def test_compressed_view(model, tok):
    view = text.compressed_view(model)
    assert view.n_raw == 64 and view.n_compressed == 64 and view.groups() == []
    assert "0 compressed id(s) hold more than one raw token" in str(view)
    # a map that folds: raw 1, 5 and 9 share compressed id 1
    token_map = np.arange(12)
    token_map[[5, 9]] = 1
    token_map[token_map > 5] -= 1
    token_map[10:] -= 1
    v = text.CompressedView(token_map, tokenizer=tok)
    assert v.folded(9).tolist() == [1, 5, 9]
    assert v.groups()[0][0] == 1
    line = v.describe_group(1)
    assert "3 raw token(s)" in line and "'<｜end▁of▁sentence｜>'" in line and "'b'" in line
    recs = v.to_records()
    assert recs[5] == {"raw_id": 5, "compressed_id": 1, "group_size": 3, "token": "b"}
    assert "<table>" in v._repr_html_()
    with pytest.raises(ValueError, match="outside the token map"):
        v.folded(99)
    pytest.importorskip("pandas")
    assert list(v.to_frame().columns) == ["raw_id", "compressed_id", "group_size", "token"]


def test_research_doc_text_example_runs():
    """docs/research.md section 1's first python block runs as written."""
    import re
    from pathlib import Path
    md = (Path(__file__).resolve().parent.parent / "docs" / "research.md").read_text()
    block = re.findall(r"```python\n(.*?)```", md, flags=re.S)[0]
    ns: dict = {}
    exec(compile(block, "docs/research.md block 0", "exec"), ns)
    assert ns["cap"].meta["token_strings"][1] == "the"


def test_token_strings_in_diff_heatmap_and_gate_tables(model):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from engram_numba.analysis.diff import diff
    from engram_numba.analysis.plots import gate_heatmap, gate_histogram
    from engram_numba.analysis.stats import gate_stats
    a = Pipeline(model, "cpu").run(text="the cat sat")
    b = Pipeline(model, "cpu", residual="bf16").run(text="the cat sat")
    report = diff(a, b)
    row = report["L1.highway.out"]
    t = report.token_of(row)
    assert t == row.first_diff[0]
    assert f"(token {t} '{text.token_label(a.meta['token_strings'][t])}')" in str(report)
    st = gate_stats(a)
    assert st.token_strings == a.meta["token_strings"] and "highway: SYNTHETIC" in str(st)
    table = st.per_token_table()
    assert "gate per token (strings, highway SYNTHETIC)" in table and " the " in table
    top = st.top_tokens(1, k=2)
    assert len(top) == 2 and top[0]["gate"] >= top[1]["gate"] and top[0]["token"] in a.meta["token_strings"]
    fig = gate_heatmap(a)
    labels = [x.get_text() for ax in fig.axes for x in ax.get_xticklabels() if x.get_text()]
    assert "the" in labels and "␣" in labels
    assert any("SYNTHETIC" in t.get_text() for t in fig.texts)
    fig2 = gate_histogram(a)
    assert any("SYNTHETIC" in t.get_text() for t in fig2.texts)
    plt.close("all")


def test_characters_a_tokenizer_drops_are_warned_about():
    from engram_numba.formats.load import load_model
    hf = load_model(TINY_PATH.parent / "tiny_v41_hf")
    tok_hf = text.tokenizer_for(hf)
    with pytest.warns(UserWarning, match=r"no token for 16 of the text's 17 non-space characters"):
        tok_hf.encode("the cat sat on the mat")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text.tokenizer_for(load_gguf(TINY_PATH)).encode("the cat sat on the mat")   # spells it all


def test_run_takes_a_tokenizer_and_compressed_view_takes_a_path(tok):
    from engram_numba.fixtures import TINY_TOKENIZER_PATH
    model = load_gguf(TINY_PATH)
    cap = Pipeline(model, "cpu").run(text="The cat sat.", tokenizer=str(TINY_TOKENIZER_PATH))
    assert cap["tokens.ids"].tolist() == tok.encode("The cat sat.").tolist()
    assert cap.meta["token_strings"] == tok.token_strings(cap["tokens.ids"])
    view = text.compressed_view(str(TINY_PATH))
    assert view.token_map.tolist() == model.hash_tables.token_map.tolist()
    with pytest.raises(TypeError, match="model must be an opened model"):
        text.compressed_view(3)
