"""ds4 GGUFs (schema B, docs/formats.md section 4): FP8 rows kept as stored, derived and checked
counts, the encoding checked by name."""
import numpy as np
import pytest

import engram_numba as en
from engram_numba.fixtures import TINY_PATH, TINY_TOKENS
from engram_numba.formats import errors as E
from engram_numba.formats import schema_b
from engram_numba.formats.split import write_split_gguf
from engram_numba.stages.hash.cpu import hash_tokens

from formats_helpers import schema_b_layers, tiny_config, tiny_tables, write_schema_b

P = "deepseek41.engram."


@pytest.fixture
def ds4(tmp_path, rng):
    return write_schema_b(tmp_path / "ds4.gguf", rng)


def test_round_trip(ds4):
    path, layers = ds4
    with en.load_model(path) as m:
        assert m.format == "gguf (schema B / ds4, fp8 tables)"
        assert m.config == tiny_config()
        for lid in (1, 4):
            lf = m.layers[lid]
            assert lf.table_encoding == "fp8" and lf.table_scales is None and lf.wkv_encoding == "f16"
            np.testing.assert_array_equal(lf.table, layers[lid]["rows_fp8"])          # [rows, 264]
            np.testing.assert_array_equal(lf.wkv_raw, layers[lid]["wkv"])
            np.testing.assert_array_equal(lf.q_weight, layers[lid]["q_weight"])
            np.testing.assert_array_equal(m.rows(lid).read([3, 0]), layers[lid]["rows_fp8"][[3, 0]])
        # derived: max_ngram 4 from 4 multipliers a layer, heads 2 from 6 primes a layer / 3 orders
        t = m.hash_tables
        ref = tiny_tables()
        for name in ("multipliers", "primes", "offsets", "token_map"):
            np.testing.assert_array_equal(getattr(t, name), getattr(ref, name))
        assert t.pad_id == 2
        # same token map as the GGUF tiny model, so the same ids
        np.testing.assert_array_equal(hash_tokens(t, TINY_TOKENS), hash_tokens(en.load_model(TINY_PATH).hash_tables,
                                                                                TINY_TOKENS))
        assert "schema B: max_ngram_size 4 (multipliers per layer), heads 2" in en.describe(m)


def test_split_schema_b(tmp_path, rng):
    config, tables = tiny_config(), tiny_tables()
    kvs, tensors = schema_b.build_schema_b_entries(config, tables, schema_b_layers(rng, config, tables))
    paths = write_split_gguf(tmp_path / "ds4", kvs, [tensors[:2], tensors[2:]])
    with en.load_model(paths[1]) as m:
        assert m.format == "split gguf (2 shards, schema B / ds4, fp8 tables)"


def test_lloyd4_refused_by_name(tmp_path, rng):
    path, _ = write_schema_b(tmp_path / "l.gguf", rng, encoding="lloyd4_e5m3_32_r136")
    with pytest.raises(E.UnsupportedEncodingError, match="'lloyd4_e5m3_32_r136', ds4's 4-bit variant"):
        en.load_model(path)
    path, _ = write_schema_b(tmp_path / "u.gguf", rng, encoding="e5m2_whatever")
    with pytest.raises(E.UnsupportedEncodingError, match="'e5m2_whatever', not an encoding this toolkit knows"):
        en.load_model(path)


@pytest.mark.parametrize("over,exc,msg", [
    ({P + "primes": ("arr[u32]", np.arange(67, 67 + 10))}, E.BadMetadataError,
     r"primes has 5 per layer, not a multiple of max_ngram_size - 1 = 3"),
    ({P + "multipliers": ("arr[u64]", np.full(2, 3, np.uint64))}, E.BadMetadataError,
     r"multipliers has 2 entries, not max_ngram_size \(>= 2\) per layer"),
    ({P + "rows": ("arr[u32]", np.array([462, 631]))}, E.RowCountMismatchError,
     r"layer 4: deepseek41\.engram\.rows says 631 rows but blk\.4\.engram_embd\.weight has 630"),
    ({P + "rows": ("arr[u32]", np.array([462]))}, E.BadMetadataError, r"rows has 1 entries, expected one per layer"),
    ({P + "compressed_vocab_size": ("u32", 99)}, E.TokenMapError,
     r"token_map gives 64 compressed ids .* but deepseek41\.engram\.compressed_vocab_size is 99"),
    ({P + "pad_id": ("u32", 64)}, E.HashConstantsError, r"pad_id 64 is outside the compressed vocab"),
    ({"general.architecture": ("str", "llama")}, E.WrongArchitectureError,
     r"general\.architecture is 'llama', expected 'deepseek41'"),
])
def test_bad_counts(tmp_path, rng, over, exc, msg):
    path, _ = write_schema_b(tmp_path / "b.gguf", rng, kv_overrides=over)
    with pytest.raises(exc, match=msg):
        en.load_model(path)


def test_primes_not_summing_to_rows(tmp_path, rng):
    primes = tiny_tables().primes.copy()
    primes[1, 2, 1] = 127        # still prime, but layer 4 now sums to 644
    path, _ = write_schema_b(tmp_path / "p.gguf", rng,
                             kv_overrides={P + "primes": ("arr[u32]", primes.ravel())})
    with pytest.raises(E.RowCountMismatchError, match=r"layer 4: its primes .* sum to 644 rows but "
                                                      r"blk\.4\.engram_embd\.weight has 630 rows"):
        en.load_model(path)
    with en.load_model(path, validate=False) as m:     # info describes it, marked
        from engram_numba.formats.describe import describe_dict, ok
        assert not ok(describe_dict(m))


def test_missing_key_names_third_party_spellings(tmp_path, rng):
    over = {"deepseek41.engram_layer_ids": ("arr[i32]", np.array([1, 4])),
            "deepseek41.engram_num_embeddings": ("u32", 1092)}
    path, _ = write_schema_b(tmp_path / "t.gguf", rng, omit_keys=(P + "layer_ids",), kv_overrides=over)
    with pytest.raises(E.MissingKeyError, match=r"'deepseek41\.engram\.layer_ids' is missing .* third-party "
                                                r"spellings .*deepseek41\.engram_layer_ids, "
                                                r"deepseek41\.engram_num_embeddings"):
        en.load_model(path)


def test_wrong_table_type_or_width(tmp_path, rng):
    config, tables = tiny_config(), tiny_tables()
    layers = schema_b_layers(rng, config, tables)
    kvs, tensors = schema_b.build_schema_b_entries(config, tables, layers)
    from dataclasses import replace

    from engram_numba.formats.gguf import write_gguf_raw
    bad = [replace(t, type_name="I16", ne=(132, t.ne[1])) if t.name == "blk.4.engram_embd.weight" else t
           for t in tensors]
    write_gguf_raw(tmp_path / "w.gguf", kvs, bad)
    with pytest.raises(E.UnsupportedQuantError, match=r"'blk\.4\.engram_embd\.weight' is I16; a schema-B table is I8"):
        en.load_model(tmp_path / "w.gguf")
    bad = [replace(t, ne=(256, t.ne[1]), data=t.data[:, :256].copy()) if t.name == "blk.1.engram_embd.weight" else t
           for t in tensors]
    write_gguf_raw(tmp_path / "w.gguf", kvs, bad)
    with pytest.raises(E.BadTensorError, match=r"ne \[256, 462\], expected \[264, rows\]"):
        en.load_model(tmp_path / "w.gguf")
