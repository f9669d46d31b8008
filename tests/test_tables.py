"""Tables out: the long per-token table of a capture, the aggregate tables of corpus statistics,
parquet and CSV, and the message when the `analysis` extra is missing."""
import sys

import numpy as np
import pytest

from engram_numba.analysis.corpus import corpus_stats
from engram_numba.analysis.tables import aggregate_tables, token_table, write_tables
from engram_numba.fixtures import TINY_MASK, TINY_PATH, TINY_TOKENS
from engram_numba.formats.schema_a import load_gguf
from engram_numba.pipeline import Pipeline

TEXTS = ["the cat sat on the mat.", "and the dog ran to the park!", "the the cat"]


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


@pytest.fixture(scope="module")
def stats(model):
    return corpus_stats(model, texts=TEXTS * 4, backend="cpu")


def test_token_table_of_a_capture(model):
    cap = Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
    cols = token_table(cap, frame=False)
    T, L, hc, C = 14, 2, 4, 6
    assert len(cols["gate"]) == T * L * hc
    assert list(cols)[:9] == ["document", "position", "token_id", "token", "layer", "stream", "dot", "gate", "live"]
    assert [f"row_id_{c}" for c in range(C)] == list(cols)[9:]
    # row (t, layer index li, stream c) sits at t*L*hc + li*hc + c
    t, li, c = 5, 1, 2
    i = t * L * hc + li * hc + c
    assert (cols["position"][i], cols["token_id"][i], cols["layer"][i], cols["stream"][i]) == (5, TINY_TOKENS[5], 4, 2)
    assert cols["gate"][i] == cap["L4.gate.gate"][5, 2] and cols["dot"][i] == cap["L4.gate.dot"][5, 2]
    assert [cols[f"row_id_{k}"][i] for k in range(C)] == cap["L4.hash.ids"][5].tolist()
    assert not cols["live"][9 * L * hc] and cols["live"][0]
    assert cols["token"][i] == cap.meta["token_strings"][5]            # the tiny model's tokenizer


def test_token_table_as_dataframe_with_strings(model):
    pd = pytest.importorskip("pandas")
    cap = Pipeline(model, "cpu").run(text="the cat sat")
    df = token_table(cap)
    assert isinstance(df, pd.DataFrame) and df.attrs["highway"].startswith("synthetic")
    assert df[df.layer == 1].groupby("position").token.first().tolist() == cap.meta["token_strings"]
    only_gate = Pipeline(model, "cpu").run(text="the cat", names_filter=["tokens.ids", "L*.gate.gate"])
    df2 = token_table(only_gate, tokenizer=TINY_PATH.parent / "tiny_tokenizer.json")
    assert df2["dot"].isna().all() and "row_id_0" not in df2.columns and df2.token.iloc[0] == "<｜begin▁of▁sentence｜>"
    with pytest.raises(KeyError, match="needs `L\\{id\\}.gate.gate`"):
        token_table({"tokens.ids": np.arange(3)})


def test_aggregate_tables(stats):
    pd = pytest.importorskip("pandas")
    tabs = stats.tables()
    assert set(tabs) == {"streams", "histogram", "tokens", "contexts", "columns"}
    s = tabs["streams"]
    assert len(s) == 8 and {"layer", "stream", "n", "mean", "std", "q50", "clamp_frac", "gate_M2"} <= set(s.columns)
    assert s.highway.iloc[0].startswith("synthetic") and tabs["tokens"].attrs["highway"] == stats.highway
    h = tabs["histogram"]
    assert len(h) == 8 * 20 and h.groupby(["layer", "stream"])["count"].sum().eq(stats.n_tokens).all()
    tok = tabs["tokens"]
    the = tok[(tok.token == "the") & (tok.layer == 1) & (tok.stream == 0)]
    assert the["count"].iloc[0] == stats.tok_count[48] and isinstance(tok, pd.DataFrame)
    ctx = tabs["contexts"]
    assert set(ctx.order) == {2, 3, 4} and ctx["count"].min() >= 1
    assert len(tabs["columns"]) == 12


def test_write_tables_parquet_and_csv(tmp_path, stats):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    written = write_tables(stats.tables(), tmp_path / "pq", "parquet")
    assert sorted(p.name for p in written) == sorted(f"{n}.parquet" for n in stats.tables())
    back = pd.read_parquet(tmp_path / "pq" / "tokens.parquet")
    pd.testing.assert_frame_equal(back, stats.tables()["tokens"], check_like=True)
    # CSV from plain records needs no pandas
    written = write_tables(stats.tables(frames=False), tmp_path / "csv", "csv")
    first = (tmp_path / "csv" / "streams.csv").read_text().splitlines()[0]
    assert first.startswith("layer,stream,n,")
    with pytest.raises(ValueError, match="table format must be one of"):
        write_tables({}, tmp_path, "xlsx")


def test_missing_analysis_extra_is_named(monkeypatch, stats, model):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"needs pandas, which is not installed: pip install 'engram-numba\[analysis\]'"):
        stats.tables()
    cap = Pipeline(model, "cpu").run(TINY_TOKENS)
    with pytest.raises(ImportError, match=r"engram-numba\[analysis\]"):
        token_table(cap)
    assert len(token_table(cap, frame=False)["gate"]) == 14 * 8        # the plain form still works
    assert aggregate_tables(stats, frames=False)["streams"][0]["layer"] == 1
