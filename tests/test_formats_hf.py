"""DeepSeek's HF checkpoint (docs/formats.md section 5): safetensors read by hand, config.json with
text_config nesting, the recipe constants, the compressed token map from tokenizer.json, and one
test per way a checkpoint can be wrong."""
import json
import struct

import ml_dtypes
import numpy as np
import pytest

import engram_numba as en
from engram_numba.fixtures import TINY_TOKENS, tiny_hf_token_map, tiny_tokenizer_json
from engram_numba.formats import errors as E
from engram_numba.formats import tokenmap
from engram_numba.formats.safetensors import SafetensorsFile, write_safetensors
from engram_numba.stages.hash.cpu import hash_tokens
from engram_numba.stages.hash.tables import EngramHashTables

from formats_helpers import tiny_config, write_hf


@pytest.fixture
def ckpt(tmp_path, rng):
    return write_hf(tmp_path / "ckpt", rng)


def test_opens_folder_and_index(ckpt):
    folder, layers = ckpt
    for path in (folder, folder / "model.safetensors.index.json"):
        with en.load_model(path) as m:
            assert m.format == "hf safetensors (2 shards, fp8 tables)"
            assert m.config == tiny_config() and m.config.eps == 1e-20
            assert m.tokenizer_path == str(folder / "tokenizer.json")
            for lid in (1, 4):
                lf, want = m.layers[lid], layers[lid]
                assert lf.table_encoding == "fp8" and lf.wkv_encoding == "fp8"
                np.testing.assert_array_equal(lf.table, want["embed_codes"])          # [rows, 256] codes
                np.testing.assert_array_equal(lf.table_scales, want["embed_scales"])  # [rows, 8]
                np.testing.assert_array_equal(lf.wkv_raw, want["wkv_codes"])
                np.testing.assert_array_equal(lf.wkv_scales, want["wkv_scales"])
                np.testing.assert_array_equal(lf.q_weight.view(np.uint32) >> 16, want["q_weight"])
                assert lf.q_weight.dtype == np.float32 and lf.q_weight.shape == (4, 64)
                # zero-copy: the table is a view of the shard's map
                assert not lf.table.flags.owndata and not lf.table.flags.writeable
            # one layer per shard, as in the released checkpoint
            assert m.tensors["layers.1.engram.embed.weight"].shard != m.tensors["layers.4.engram.embed.weight"].shard


def test_rows_are_264_byte_fp8_rows(ckpt, rng):
    folder, layers = ckpt
    with en.load_model(folder) as m:
        ids = rng.integers(0, 630, size=(5, 6))
        got = m.rows(4).read(ids)
        want = np.concatenate([layers[4]["embed_codes"], layers[4]["embed_scales"]], axis=1)[ids.ravel()]
        assert got.shape == (30, 264)
        np.testing.assert_array_equal(got, want)
        with pytest.raises(ValueError, match=r"row id 630 at flat index 1 is outside layer 4's table"):
            m.rows(4).read([0, 630])


def test_hash_constants_come_from_the_recipes_and_the_tokenizer(ckpt):
    folder, _ = ckpt
    token_map = tiny_hf_token_map()
    with en.load_model(folder) as m:
        t = m.hash_tables
        np.testing.assert_array_equal(t.token_map, token_map)
        want = EngramHashTables.build((1, 4), 4, 2, 64, token_map, pad_id=int(token_map[2]))
        np.testing.assert_array_equal(t.multipliers, want.multipliers)
        np.testing.assert_array_equal(t.primes, want.primes)
        np.testing.assert_array_equal(t.offsets, want.offsets)
        # the tiny configuration's primes (docs/math.md): same rows as every GGUF copy
        assert list(t.table_rows) == [462, 630]
        np.testing.assert_array_equal(hash_tokens(t, TINY_TOKENS), hash_tokens(want, TINY_TOKENS))


def test_token_map_folds_by_the_recipe():
    m = tiny_hf_token_map()
    assert m.size == 64 and m.max() + 1 == 47
    assert not np.array_equal(m, np.arange(64))
    # "the", " the", " The", "THE", "The" fold; " ", "  ", "\n", "\t" fold; café/cafe/ Café; the ligature and fi
    assert len(set(m[3:8])) == 1 and len(set(m[8:12])) == 1 and len(set(m[12:15])) == 1 and len(set(m[15:18])) == 1
    # UTF-8 fragments keep their raw token string as key (two different keys); the lone accent keeps its text
    assert m[18] != m[19] and len({m[18], m[19], m[20]}) == 3 and m[20] not in m[:20]
    assert m[8] != m[3]   # the lone space does not fold with letters


def test_token_map_cache_folder(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(tiny_tokenizer_json())
    cache = tmp_path / "cache"
    cache.mkdir()
    tokenmap.clear_memory_cache()
    a = tokenmap.compressed_token_map(tok, cache_dir=cache)
    files = list(cache.glob("token_map-*.npy"))
    assert len(files) == 1
    tokenmap.clear_memory_cache()
    b = tokenmap.compressed_token_map(tok, cache_dir=cache)          # read from the cache folder
    np.testing.assert_array_equal(a, b)
    assert not b.flags.writeable
    assert tokenmap.compressed_token_map(tok) is tokenmap.compressed_token_map(tok)  # in memory
    with pytest.raises(E.EngramFileError, match="cache folder .* does not exist"):
        tokenmap.compressed_token_map(tok, cache_dir=tmp_path / "nope")


def test_config_keys_at_top_level_or_nested(tmp_path, rng):
    folder, _ = write_hf(tmp_path / "a", rng)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(cfg.pop("text_config"))          # everything at the top level
    (folder / "config.json").write_text(json.dumps(cfg))
    with en.load_model(folder) as m:
        assert m.config == tiny_config()
        assert "engram_layer_ids" in m.kv
    cfg["text_config"] = {"engram_n_heads": 3}  # disagreeing copies are refused
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(E.BadMetadataError, match="engram_n_heads is 2 at the top level but 3 under text_config"):
        en.load_model(folder)


def test_safetensors_views_and_ml_dtypes(ckpt):
    folder, layers = ckpt
    f = SafetensorsFile(folder / "model-00002-of-00002.safetensors")
    codes = f.array("layers.4.engram.embed.weight")
    assert codes.dtype == ml_dtypes.float8_e4m3fn and codes.shape == (630, 256)
    np.testing.assert_array_equal(codes.view(np.uint8), layers[4]["embed_codes"])
    assert f.array("layers.4.engram.embed.scale").dtype == ml_dtypes.float8_e8m0fnu
    assert f.array("layers.4.engram.q_weight").dtype == ml_dtypes.bfloat16


def test_safetensors_library_reads_what_we_write(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy", reason="the safetensors package is an optional test dependency")
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.integers(0, 100, size=(7,), dtype=np.int64)
    write_safetensors(tmp_path / "x.safetensors", {"a": ("F32", a.shape, a), "b": ("I64", b.shape, b)}, {"k": "v"})
    got = st.load_file(str(tmp_path / "x.safetensors"))
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)


# Errors ---------------------------------------------------------------------------------------

def test_missing_shard_names_the_file(ckpt):
    folder, _ = ckpt
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(E.MissingShardError, match=r"model-00002-of-00002\.safetensors does not exist"):
        en.load_model(folder)


def test_tensor_in_index_but_absent_from_its_shard(ckpt):
    folder, _ = ckpt
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.4.engram.wkv.scale"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(E.MissingTensorError, match=r"model-00001-of-00002\.safetensors: tensor "
                                                   r"'layers\.4\.engram\.wkv\.scale' is named in .* but absent"):
        en.load_model(folder)
    del index["weight_map"]["layers.4.engram.wkv.scale"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(E.MissingTensorError, match="'layers.4.engram.wkv.scale' is not in the index"):
        en.load_model(folder)


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    body = data[8 + n:]
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def test_safetensors_header_overlap_and_past_the_end(ckpt):
    folder, _ = ckpt
    shard = folder / "model-00002-of-00002.safetensors"
    good = shard.read_bytes()

    def alias(h):   # put k_weight on q_weight's bytes
        h["layers.4.engram.k_weight"]["data_offsets"] = h["layers.4.engram.q_weight"]["data_offsets"]
    _rewrite_header(shard, alias)
    with pytest.raises(E.OverlappingTensorsError, match="overlaps tensor"):
        en.load_model(folder)

    shard.write_bytes(good)

    def past(h):
        b, e = h["layers.4.engram.k_weight"]["data_offsets"]
        h["layers.4.engram.k_weight"]["data_offsets"] = [b + 10**6, e + 10**6]
    _rewrite_header(shard, past)
    with pytest.raises(E.TruncatedFileError, match=r"'layers\.4\.engram\.k_weight' .* runs past the file"):
        en.load_model(folder)

    shard.write_bytes(good)

    def wrong_size(h):
        h["layers.4.engram.k_weight"]["shape"] = [4, 63]
    _rewrite_header(shard, wrong_size)
    with pytest.raises(E.SafetensorsHeaderError, match=r"span 512 bytes but BF16 \[4, 63\] needs 504"):
        en.load_model(folder)

    shard.write_bytes(struct.pack("<Q", 2**40) + good[8:])
    with pytest.raises(E.SafetensorsHeaderError, match="more than a safetensors header may have"):
        en.load_model(folder)
    shard.write_bytes(struct.pack("<Q", 8) + b"{nope!!}" + good[16:])
    with pytest.raises(E.SafetensorsHeaderError, match="not valid JSON"):
        en.load_model(folder)


def test_token_map_of_another_size_is_refused(tmp_path, rng):
    folder, _ = write_hf(tmp_path / "c", rng, config_overrides={"engram_compressed_vocab_size": 48})
    with pytest.raises(E.TokenMapError, match=r"has 47 ids, but .*config\.json says "
                                             r"text_config\.engram_compressed_vocab_size = 48"):
        en.load_model(folder)
    from engram_numba.cli import main
    assert main(["info", str(folder)]) == 1          # described, the check marked FAILED


def test_missing_config_key_and_files(tmp_path, rng):
    folder, _ = write_hf(tmp_path / "d", rng, config_overrides={"engram_n_heads": None})
    with pytest.raises(E.MissingKeyError, match="'engram_n_heads' is missing"):
        en.load_model(folder)
    folder, _ = write_hf(tmp_path / "e", rng)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(E.MissingFileError, match="tokenizer.json does not exist"):
        en.load_model(folder)
    (folder / "config.json").unlink()
    with pytest.raises(E.MissingFileError, match="config.json does not exist"):
        en.load_model(folder)


def test_wrong_dtype_or_shape(tmp_path, rng):
    folder, _ = write_hf(tmp_path / "f", rng, config_overrides={"engram_vocab_size": 70})
    with pytest.raises(E.RowCountMismatchError, match=r"layer 1: the primes from text_config\.engram_vocab_size = 70 "
                                                      r"sum to 492 rows but layers\.1\.engram\.embed\.weight has 462"):
        en.load_model(folder)
    folder, _ = write_hf(tmp_path / "g", rng, config_overrides={"hidden_size": 32})
    with pytest.raises(E.BadTensorError, match=r"'layers\.1\.engram\.wkv\.weight' has shape \[320, 1536\], "
                                               r"expected \[N=dim\*\(hc\+1\)=160"):
        en.load_model(folder)
    folder, _ = write_hf(tmp_path / "h", rng)
    _rewrite_header(folder / "model-00001-of-00002.safetensors",
                    lambda h: h["layers.1.engram.embed.scale"].update(dtype="U8"))
    with pytest.raises(E.UnsupportedQuantError, match=r"'layers\.1\.engram\.embed\.scale' is U8; expected F8_E8M0"):
        en.load_model(folder)


def test_index_cannot_point_outside_the_folder(ckpt):
    folder, _ = ckpt
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.1.engram.q_weight"] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(E.BadMetadataError, match="not a file name in the folder"):
        en.load_model(folder)
