"""Opening the real files takes well under a second: a sparse 7-shard Q2_K GGUF (two ~30 GiB tables
as holes, 60+ GiB apparent) and a sparse 2-shard DeepSeek checkpoint (two 94.56 GiB engram shards as
holes) at the released shapes, generated here with no disk used. Run with -s to see the figures."""
import os
import time

import numpy as np
import pytest

import engram_numba as en
from engram_numba.bf16 import f32_to_bf16
from engram_numba.config import EngramConfig
from engram_numba.fixtures import tiny_hf_token_map, tiny_tokenizer_json
from engram_numba.formats import schema_a as mf
from engram_numba.formats import tokenmap
from engram_numba.formats.gguf import GGUFTensorSpec
from engram_numba.formats.hf import write_hf_checkpoint
from engram_numba.formats.split import write_split_gguf
from engram_numba.stages.hash.tables import EngramHashTables

OPEN_LIMIT_S = 0.5     # "well under a second"
RELEASED_ROWS = {1: 384_006_168, 14: 384_016_682}


def _best(fn, repeats=3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = fn()
        best = min(best, time.perf_counter() - t0)
        m.close()
    return best


def _sparse_or_skip(paths, apparent_min):
    size = sum(os.stat(p).st_size for p in paths)
    used = sum(os.stat(p).st_blocks * 512 for p in paths)
    if used > 256 * 2**20:
        pytest.skip("this filesystem does not keep sparse files sparse")
    assert size > apparent_min
    return size, used


def test_released_7_shard_gguf_opens_in_well_under_a_second(tmp_path, rng):
    config = EngramConfig.released()
    token_map = rng.integers(0, 99_092, size=129_280)
    token_map[:99_092] = np.arange(99_092)
    tables = EngramHashTables.build((1, 14), 4, 8, 16_000_000, token_map, 2)
    gate = rng.standard_normal((4, 5120)).astype(np.float32)
    layers = {lid: {"table": np.zeros((1, 84), np.uint8), "wkv": np.zeros((1, 84), np.uint8),
                    "q_weight": gate, "k_weight": gate} for lid in (1, 14)}
    kvs, _ = mf.build_gguf_entries(config, tables, layers, check=False)
    hole = lambda name, t, ne: GGUFTensorSpec(name, t, ne, None)  # noqa: E731
    q = {lid: GGUFTensorSpec(f"blk.{lid}.engram_q.weight", "F32", (5120, 4), gate) for lid in (1, 14)}
    k = {lid: GGUFTensorSpec(f"blk.{lid}.engram_k.weight", "F32", (5120, 4), gate) for lid in (1, 14)}
    shards = [
        [hole("token_embd.weight", "Q2_K", (5120, 129_280)), q[1], k[1]],
        [hole("blk.1.engram_embd.weight", "Q2_K", (256, RELEASED_ROWS[1]))],
        [hole("blk.1.engram_wkv.weight", "Q2_K", (6144, 25_600))],
        [hole("blk.14.engram_embd.weight", "Q2_K", (256, RELEASED_ROWS[14]))],   # shard 4, as published
        [hole("blk.14.engram_wkv.weight", "Q2_K", (6144, 25_600)), q[14]],
        [k[14]],
        [hole("output.weight", "Q2_K", (5120, 129_280))],
    ]
    paths = write_split_gguf(tmp_path / "DeepSeek-V4.1-Flash-Q2_K", kvs, shards)
    size, used = _sparse_or_skip(paths, 60e9)

    t_shard = _best(lambda: en.load_model(paths[3]))
    t_folder = _best(lambda: en.load_model(tmp_path))
    print(f"\n7-shard Q2_K GGUF, {size / 2**30:.1f} GiB apparent ({used / 2**20:.1f} MiB on disk): "
          f"load_model(shard 4) {t_shard * 1e3:.1f} ms, load_model(folder) {t_folder * 1e3:.1f} ms (best of 3)")
    assert t_shard < OPEN_LIMIT_S and t_folder < OPEN_LIMIT_S
    with en.load_model(paths[0]) as m:
        assert m.format == "split gguf (7 shards, schema A, q2k tables)"
        assert m.layers[1].n_rows == RELEASED_ROWS[1] and m.layers[14].n_rows == RELEASED_ROWS[14]
        assert m.tensors["blk.14.engram_embd.weight"].shard == 3
        assert m.layers[14].table.nbytes / 2**30 > 30
        assert m.hash_tables.token_map.size == 129_280
        assert m.rows(14).read([0, RELEASED_ROWS[14] - 1]).shape == (2, 84)   # holes read as zeros


def test_released_2_shard_checkpoint_opens_in_well_under_a_second(tmp_path, rng):
    # the small tokenizer (building the real 129,280-token map is not what is timed here)
    V = int(tiny_hf_token_map().max()) + 1
    config = {"hidden_size": 5120, "hc_mult": 4, "rms_norm_eps": 1e-20,
              "text_config": {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8,
                              "engram_head_dim": 256, "engram_vocab_size": 16_000_000,
                              "engram_num_embeddings": 384_000_000, "engram_pad_token_id": 2,
                              "engram_compressed_vocab_size": V}}
    gate = f32_to_bf16(rng.standard_normal((4, 5120)).astype(np.float32))
    layers = {lid: {"embed_codes": (RELEASED_ROWS[lid], 256), "embed_scales": (RELEASED_ROWS[lid], 8),
                    "wkv_codes": (25_600, 6144), "wkv_scales": (800, 192), "q_weight": gate, "k_weight": gate}
              for lid in (1, 14)}
    folder = write_hf_checkpoint(tmp_path / "ckpt", config, layers, tiny_tokenizer_json(), holes=True)
    shards = sorted(folder.glob("*.safetensors"))
    size, used = _sparse_or_skip(shards, 2 * 94 * 2**30)
    tokenmap.clear_memory_cache()
    t0 = time.perf_counter()
    en.load_model(folder).close()                 # first open: builds the token map of the small tokenizer
    t_first = time.perf_counter() - t0
    t_folder = _best(lambda: en.load_model(folder))
    t_index = _best(lambda: en.load_model(folder / "model.safetensors.index.json"))
    print(f"\n2-shard FP8 checkpoint, {size / 2**30:.2f} GiB apparent ({size / 2 / 2**30:.2f} GiB a shard, "
          f"{used / 2**20:.1f} MiB on disk): first load_model {t_first * 1e3:.1f} ms, then folder "
          f"{t_folder * 1e3:.1f} ms, index {t_index * 1e3:.1f} ms (best of 3)")
    assert abs(size / 2 / 2**30 - 94.56) < 0.01
    assert t_first < OPEN_LIMIT_S and t_folder < OPEN_LIMIT_S and t_index < OPEN_LIMIT_S
    with en.load_model(folder) as m:
        assert m.format == "hf safetensors (2 shards, fp8 tables)"
        assert m.config == EngramConfig.released()
        assert [int(r) for r in m.hash_tables.table_rows] == [RELEASED_ROWS[1], RELEASED_ROWS[14]]
        assert m.layers[14].table.shape == (RELEASED_ROWS[14], 256)
        assert m.rows(14).read([RELEASED_ROWS[14] - 1]).shape == (1, 264)
        assert m.layers[1].wkv_raw.shape == (25_600, 6144) and m.layers[1].wkv_scales.shape == (800, 192)
