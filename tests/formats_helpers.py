"""Writers of small test models in every format, from random but well-formed bytes (no encoder
needed: the loaders are tested on bytes, the decoders elsewhere)."""
import numpy as np

from engram_numba.bf16 import f32_to_bf16
from engram_numba.config import EngramConfig
from engram_numba.fixtures import tiny_hf_config, tiny_hf_token_map, tiny_tokenizer_json
from engram_numba.formats import hf, schema_a, schema_b
from engram_numba.stages.hash.tables import EngramHashTables

LAYER_IDS = (1, 4)


def tiny_config(hc=4):
    return EngramConfig(dim=64, hc=hc, layer_ids=LAYER_IDS, max_ngram_size=4, n_heads=2)


def tiny_tables(token_map=None):
    return EngramHashTables.build(LAYER_IDS, 4, 2, 64, np.arange(64) if token_map is None else token_map, 2)


def fp8_codes(rng, shape):
    """Random e4m3 codes without the NaN codes 0x7F / 0xFF."""
    c = rng.integers(0, 256, size=shape, dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] ^= 1
    return c


def fp8_scales(rng, shape):
    """Random e8m0 scale bytes around 2^0 (finite, no overflow)."""
    return rng.integers(110, 135, size=shape, dtype=np.uint8)


def q2k_blocks(rng, n):
    b = rng.integers(0, 256, size=(n, 84), dtype=np.uint8)
    b[:, 80:84] = (rng.uniform(1e-3, 1.0, size=(n, 2)).astype(np.float16)).view(np.uint8).reshape(n, 4)
    return b


def schema_a_layers(rng, config, tables):
    N, K = config.proj_out, config.proj_in
    return {lid: {"table": q2k_blocks(rng, int(tables.table_rows[li])),
                  "wkv": f32_to_bf16(rng.standard_normal((N, K)).astype(np.float32)),
                  "q_weight": rng.standard_normal((config.hc, config.dim)).astype(np.float32),
                  "k_weight": rng.standard_normal((config.hc, config.dim)).astype(np.float32)}
            for li, lid in enumerate(config.layer_ids)}


def schema_b_layers(rng, config, tables):
    N, K = config.proj_out, config.proj_in
    out = {}
    for li, lid in enumerate(config.layer_ids):
        rows = int(tables.table_rows[li])
        out[lid] = {"rows_fp8": np.concatenate([fp8_codes(rng, (rows, 256)), fp8_scales(rng, (rows, 8))], axis=1),
                    "wkv": rng.standard_normal((N, K)).astype(np.float16),
                    "q_weight": rng.standard_normal((config.hc, config.dim)).astype(np.float32),
                    "k_weight": rng.standard_normal((config.hc, config.dim)).astype(np.float32)}
    return out


def hf_layers(rng, config, tables, rows_fp8=None):
    """HF layers; rows_fp8 (layer -> [rows, 264]) gives the tables' bytes (to compare with schema B)."""
    N, K = config.proj_out, config.proj_in
    out = {}
    for li, lid in enumerate(config.layer_ids):
        rows = int(tables.table_rows[li])
        r = rows_fp8[lid] if rows_fp8 is not None else np.concatenate(
            [fp8_codes(rng, (rows, 256)), fp8_scales(rng, (rows, 8))], axis=1)
        out[lid] = {"embed_codes": np.ascontiguousarray(r[:, :256]), "embed_scales": np.ascontiguousarray(r[:, 256:]),
                    "wkv_codes": fp8_codes(rng, (N, K)), "wkv_scales": fp8_scales(rng, (N // 32, K // 32)),
                    "q_weight": f32_to_bf16(rng.standard_normal((config.hc, config.dim)).astype(np.float32)),
                    "k_weight": f32_to_bf16(rng.standard_normal((config.hc, config.dim)).astype(np.float32))}
    return out


def write_hf(folder, rng, config_overrides=None, rows_fp8=None, n_shards=2, tokenizer=None):
    """A tiny HF checkpoint (the fixture's tokenizer and config) -> (folder, layers)."""
    config, tables = tiny_config(), tiny_tables()
    layers = hf_layers(rng, config, tables, rows_fp8)
    cfg = tiny_hf_config(int(tiny_hf_token_map().max()) + 1)
    for k, v in (config_overrides or {}).items():
        if v is None:
            cfg.pop(k, None)
            cfg["text_config"].pop(k, None)
        elif k in cfg["text_config"]:
            cfg["text_config"][k] = v
        else:
            cfg[k] = v
    hf.write_hf_checkpoint(folder, cfg, layers, tokenizer if tokenizer is not None else tiny_tokenizer_json(),
                           n_shards=n_shards)
    return folder, layers


def write_schema_b(path, rng, **kw):
    config, tables = tiny_config(), tiny_tables()
    layers = schema_b_layers(rng, config, tables)
    schema_b.write_schema_b_gguf(path, config, tables, layers, **kw)
    return path, layers


def write_schema_a(path, rng, **kw):
    config, tables = tiny_config(), tiny_tables()
    layers = schema_a_layers(rng, config, tables)
    schema_a.write_gguf(path, config, tables, layers, **kw)
    return path, layers
