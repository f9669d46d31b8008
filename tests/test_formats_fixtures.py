"""The tiny model in every format (data/, fixtures.py): each committed file is what a rebuild
writes, every format hashes, gathers and decodes alike where its token map and encoding agree with
another's, and each backend equals the reference on each format.

The Q8_0, ds4 and HF copies are built with the rows stage's Q8_0 / FP8 encoders and the wkv FP8
encoder; in a checkout without them, the tests of those copies are skipped and say so. With the
encoders present, a missing or stale file fails."""
import filecmp
import json

import numpy as np
import pytest

import engram_numba as en
from engram_numba.cli import main as cli_main
from engram_numba.fixtures import (FIXTURE_FORMATS, TINY_MASK, TINY_TOKENS, format_paths, make_format_fixture,
                                   missing_encoders, tiny_config, tiny_float_weights, tiny_hash_tables)
from engram_numba.pipeline import Pipeline
from engram_numba.stages.hash.cpu import hash_tokens

PATHS = format_paths()
FORMATS = list(FIXTURE_FORMATS)
GGUF_FORMATS = ["gguf", "split", "q8_0", "ds4"]          # identity token map: they hash alike
ENCODING = {"gguf": "q2k", "split": "q2k", "q8_0": "q8_0", "ds4": "fp8", "hf": "fp8"}


def _need(fmt: str) -> None:
    missing = missing_encoders(fmt)
    if missing:
        pytest.skip(f"the {fmt} copy is built with {', '.join(missing)}, not in this checkout; "
                    "`engram-numba make-fixture` writes it once they are there")


def _open(fmt: str):
    _need(fmt)
    assert PATHS[fmt].exists(), f"{PATHS[fmt]} is missing: run `engram-numba make-fixture` and commit it"
    return en.load_model(PATHS[fmt])


def _files(p):
    return sorted(x.relative_to(p) for x in p.rglob("*") if x.is_file()) if p.is_dir() else [None]


@pytest.mark.parametrize("fmt", FORMATS)
def test_committed_file_is_byte_identical_to_a_rebuild(fmt, tmp_path):
    _need(fmt)
    out = make_format_fixture(fmt, tmp_path / PATHS[fmt].name)
    want = PATHS[fmt]
    assert want.exists(), f"{want} is missing: run `engram-numba make-fixture` and commit it"
    if want.is_dir():
        assert _files(out) == _files(want), f"{want}: the files differ from a rebuild's"
        for rel in _files(want):
            assert filecmp.cmp(out / rel, want / rel, shallow=False), \
                f"{want / rel} differs from what `engram-numba make-fixture` builds: rebuild and commit it"
    else:
        assert out.read_bytes() == want.read_bytes(), \
            f"{want} differs from what `engram-numba make-fixture` builds: rebuild and commit it"


def test_data_folder_stays_small():
    total = sum(f.stat().st_size for f in PATHS["gguf"].parent.rglob("*") if f.is_file())
    assert total < 8 * 2**20, f"data/ holds {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_opens_with_the_tiny_configuration(fmt):
    with _open(fmt) as m:
        assert m.config == tiny_config()
        # the config names the tables' encoding (an HF FP8 checkpoint's is "fp8", not Q2_K)
        assert m.config.table_type == ENCODING[fmt]
        assert list(m.hash_tables.table_rows) == [462, 630]
        for lid in (1, 4):
            assert m.layers[lid].table_encoding == ENCODING[fmt]
            assert m.rows(lid).read([0]).shape == (1, {"q2k": 84, "q8_0": 272, "fp8": 264}[ENCODING[fmt]])
        assert ENCODING[fmt] in m.format


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_same_hash_ids_where_the_token_maps_agree(fmt):
    want = hash_tokens(tiny_hash_tables(), TINY_TOKENS, TINY_MASK)
    with _open(fmt) as m:
        np.testing.assert_array_equal(hash_tokens(m.hash_tables, TINY_TOKENS, TINY_MASK), want)
        assert want[13, 1].tolist() == [14, 186, 216, 375, 492, 542]       # docs/math.md's test vector


def test_hf_copy_hashes_with_its_own_token_map():
    from engram_numba.fixtures import tiny_hf_token_map
    from engram_numba.stages.hash.tables import EngramHashTables
    with _open("hf") as m:
        token_map = tiny_hf_token_map()
        assert not np.array_equal(token_map, np.arange(64))       # the map folds tokens
        np.testing.assert_array_equal(m.hash_tables.token_map, token_map)
        want = EngramHashTables.build((1, 4), 4, 2, 64, token_map, pad_id=int(token_map[2]))
        np.testing.assert_array_equal(hash_tokens(m.hash_tables, TINY_TOKENS), hash_tokens(want, TINY_TOKENS))
        np.testing.assert_array_equal(m.hash_tables.primes, tiny_hash_tables().primes)


def test_split_and_single_store_the_same_rows():
    a, b = _open("gguf"), _open("split")
    for lid, n in ((1, 462), (4, 630)):
        ids = np.arange(n)
        np.testing.assert_array_equal(a.rows(lid).read(ids), b.rows(lid).read(ids))
        np.testing.assert_array_equal(a.layers[lid].wkv_bf16(), b.layers[lid].wkv_bf16())


def test_ds4_and_hf_store_the_same_fp8_rows():
    """Both keep the encoder's FP8 bytes: inline (ds4) and in two tensors (HF) give the same
    264-byte rows, hence the same decoded rows."""
    from engram_numba.stages.rows.reference import rows_reference
    a, b = _open("ds4"), _open("hf")
    for lid, n in ((1, 462), (4, 630)):
        ids = np.arange(n)
        raw_a, raw_b = a.rows(lid).read(ids), b.rows(lid).read(ids)
        np.testing.assert_array_equal(raw_a, raw_b)
        np.testing.assert_array_equal(rows_reference(raw_a, "fp8"), rows_reference(raw_b, "fp8"))


@pytest.mark.parametrize("fmt,bound", [("gguf", 0.35), ("q8_0", 0.015), ("ds4", 0.05), ("hf", 0.05)])
def test_tables_decode_close_to_the_float_weights(fmt, bound):
    """Every copy is the same float tables, encoded: relative RMS error within the encoding's."""
    from engram_numba.stages.rows.reference import decode_reference
    weights = tiny_float_weights(tiny_config(), tiny_hash_tables())
    with _open(fmt) as m:
        for lid in (1, 4):
            want = weights[lid]["table_rows"]
            got = decode_reference(m.rows(lid).read(np.arange(want.shape[0])), ENCODING[fmt])
            err = np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean())
            assert err < bound, f"{fmt} layer {lid}: relative RMS error {err:.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_equals_reference_on_every_format(fmt):
    from engram_numba.analysis.diff import diff
    with _open(fmt) as m:
        ref = Pipeline(m, "reference").run(TINY_TOKENS, token_mask=TINY_MASK)
        report = diff(ref, Pipeline(m, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK))
        assert report.all_equal, str(report)
        assert ref.meta["format"] == m.format


# one format (gguf) in `make test-fast`, every format in `make test`: each is the whole cuda pipeline
# in the simulator (the readers are checked on every format by the cpu test above)
CUDA_FORMATS = [f if f == "gguf" else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS]


@pytest.mark.parametrize("fmt", CUDA_FORMATS)
def test_cuda_equals_reference_on_every_format(fmt):
    """Two tokens (the simulator runs every thread in Python); the default kernels there add in
    the reference's order, so every point is bit-identical."""
    import warnings

    from engram_numba.analysis.diff import diff
    tokens, mask = TINY_TOKENS[:2], TINY_MASK[:2]
    with _open(fmt) as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = Pipeline(m, "reference").run(tokens, token_mask=mask)
        report = diff(ref, Pipeline(m, "cuda").run(tokens, token_mask=mask))
        assert report.all_equal, str(report)


@pytest.mark.parametrize("fmt", FORMATS)
def test_info_json_on_every_format(fmt, capsys):
    _need(fmt)
    assert cli_main(["info", str(PATHS[fmt]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["layer_ids"] == [1, 4] and all(c["ok"] for c in info["checks"])
    assert info["layers"]["4"]["table_encoding"] == ENCODING[fmt] and info["layers"]["4"]["nonfinite_rows"] == 0
    assert info["format"].endswith(f"{ENCODING[fmt]} tables)")


def test_diff_two_models(capsys):
    """`engram-numba diff --model-a --model-b`: the same tokens through two models, stage by stage."""
    assert cli_main(["diff", "--model-a", str(PATHS["gguf"]), "--model-b", str(PATHS["split"]),
                     "--tokens", "3,4,5", "--max-ulp", "0"]) == 0
    out = capsys.readouterr().out
    assert "split gguf (3 shards, schema A, q2k tables)" in out and "diff: within tolerances" in out
    assert cli_main(["diff", "--model-a", str(PATHS["gguf"]), "--tokens", "3"]) == 2
    assert "go together" in capsys.readouterr().err


def test_diff_q2k_against_fp8(capsys):
    _need("hf")
    assert cli_main(["diff", "--model-a", str(PATHS["hf"]), "--model-b", str(PATHS["gguf"]), "--tokens", "3,4,5"]) == 0
    out = capsys.readouterr().out
    assert "the two token maps differ" in out and "L4.gate.gate" in out
