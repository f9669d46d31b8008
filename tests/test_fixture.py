"""The tiny model in data/: rebuilt byte-identically, hashing to the test vector of docs/math.md, and its golden
reference captures still reproduced."""
import numpy as np

from engram_numba.cli import main as cli_main
from engram_numba.fixtures import (TINY_GOLDEN_PATH, TINY_MASK, TINY_PATH, TINY_TOKENS, make_fixture,
                                   tiny_config)
from engram_numba.capture import Capture
from engram_numba.formats.schema_a import load_gguf
from engram_numba.pipeline import Pipeline
from engram_numba.stages.hash.cpu import hash_tokens


def test_rebuild_is_byte_identical(tmp_path):
    out = make_fixture(tmp_path / "tiny.gguf", golden_path=None, formats=("gguf",))
    assert out.read_bytes() == TINY_PATH.read_bytes(), \
        "data/tiny_v41.gguf differs from what `engram-numba make-fixture` builds: rebuild and commit it"


def test_small_and_well_formed():
    assert TINY_PATH.stat().st_size < 1_000_000
    model = load_gguf(TINY_PATH)
    assert model.config == tiny_config()
    assert list(model.hash_tables.table_rows) == [462, 630]
    for lid in (1, 4):
        layer = model.layers[lid]
        rows = layer.table
        assert rows.shape == (int(model.hash_tables.table_rows[model.config.layer_index(lid)]), 84)
        # realistic content: not zeros, not constant, finite after decoding
        from engram_numba.stages.rows.q2k import dequantize
        vals = dequantize(rows)
        assert np.isfinite(vals).all() and vals.std() > 1e-3 and len(np.unique(rows[:, 80:84], axis=0)) > 100


def test_spec_hash_vector_through_the_file():
    ids = hash_tokens(load_gguf(TINY_PATH).hash_tables, TINY_TOKENS)
    assert ids[13, 1].tolist() == [14, 186, 216, 375, 492, 542]


def test_reference_reproduces_golden_captures():
    golden = Capture.load(TINY_GOLDEN_PATH)
    cap = Pipeline(load_gguf(TINY_PATH), backends="reference").run(TINY_TOKENS, token_mask=TINY_MASK)
    assert set(golden) == set(cap)
    for name in golden:
        np.testing.assert_array_equal(cap[name], golden[name], err_msg=name)


def test_golden_covers_the_dead_token():
    golden = Capture.load(TINY_GOLDEN_PATH)
    dead = int(np.argmin(TINY_MASK))
    assert not golden["tokens.mask"][dead]
    for lid in (1, 4):
        assert (golden[f"L{lid}.gate.gate"][dead] == 0).all()
        np.testing.assert_array_equal(golden[f"L{lid}.highway.out"][dead], golden[f"L{lid}.highway.in"][dead])
        assert (golden[f"L{lid}.gate.gate"][~TINY_MASK] == 0).all()
        assert (golden[f"L{lid}.gate.gate"][TINY_MASK] > 0).all()


def test_info_command_prints_config_and_check(capsys):
    assert cli_main(["info", str(TINY_PATH)]) == 0
    out = capsys.readouterr().out
    for needle in ("dim 64", "hc 4", "deepseek41.engram.primes", "blk.4.engram_embd.weight", "Q2_K",
                   "layer 1: primes sum 462, table rows 462  OK"):
        assert needle in out


def test_info_command_on_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    assert cli_main(["info", str(bad)]) == 2
    assert "bad.gguf" in capsys.readouterr().err


def test_golden_meta_names_no_absolute_path():
    golden = Capture.load(TINY_GOLDEN_PATH)
    assert golden.meta["model"] == "tiny_v41.gguf"
    assert not any(str(v).startswith("/") for v in golden.meta.values() if isinstance(v, str))
