"""The tiny model in `data/`: a deterministic, schema-A GGUF small enough to commit.

It uses the tiny configuration of docs/math.md (the reference's own test model: layer ids 1 and
4, n-grams up to 4, 2 heads, vocab 64, identity token map, pad 2), so its hash reproduces that
test vector (section 3.5), with head_dim 256 (one Q2_K block a row), dim 64 and hc 4. Tables and
`wkv` are Q2_K, as in the published Q2_K file; their values are drawn to look like trained
weights (heavy-tailed, per-row scales, a few outlier rows), not zeros or constants.

`engram-numba make-fixture` rebuilds the file and the golden captures beside it; a test checks
that the rebuild is byte-identical and that the reference still reproduces the captures.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import EngramConfig
from .stages.hash.tables import EngramHashTables
from .stages.rows.q2k import ENGRAM_ROW_BYTES, quantize

REPO_DATA = Path(__file__).resolve().parent.parent / "data"
TINY_PATH = REPO_DATA / "tiny_v41.gguf"
TINY_GOLDEN_PATH = REPO_DATA / "tiny_v41_golden.npz"
TINY_SEED = 20261129

# The tiny test sequence of docs/math.md; position 13 hashes to layer-4 ids [14, 186, 216, 375, 492, 542].
TINY_TOKENS = np.array([2, 17, 47, 13, 32, 59, 39, 29, 42, 31, 36, 6, 27, 8], dtype=np.int64)
# The golden run masks one token (as an image position would be), to pin the dead-token path.
TINY_MASK = np.ones(TINY_TOKENS.size, dtype=bool)
TINY_MASK[9] = False


def tiny_config() -> EngramConfig:
    return EngramConfig(dim=64, hc=4, layer_ids=(1, 4), max_ngram_size=4, n_heads=2, head_dim=256)


def tiny_hash_tables() -> EngramHashTables:
    return EngramHashTables.build((1, 4), max_ngram_size=4, n_heads=2, engram_vocab_size=64,
                                  token_map=np.arange(64), pad_id=2)


def realistic_rows(rng: np.random.Generator, n: int, width: int = 256, scale: float = 0.02) -> np.ndarray:
    """float32 [n, width] that look like trained embedding rows: Student-t(4) values, a log-normal
    scale per row, a small per-row offset, and 1% of rows ten times larger."""
    values = rng.standard_t(4, size=(n, width)) / np.sqrt(2.0)
    row_scale = scale * rng.lognormal(0.0, 0.35, size=(n, 1))
    row_scale[rng.random(n) < 0.01] *= 10.0
    offset = 0.1 * row_scale * rng.standard_normal((n, 1))
    return (values * row_scale + offset).astype(np.float32)


def quantize_matrix(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> Q2_K blocks of each row, uint8 [N, K/256*84]."""
    N, K = w.shape
    return quantize(w.reshape(N * K // 256, 256)).reshape(N, K // 256 * ENGRAM_ROW_BYTES)


def tiny_float_weights(cfg: EngramConfig, tables: EngramHashTables, seed: int = TINY_SEED) -> dict:
    """The tiny model's weights before quantisation, per layer: `table_rows` float32 [rows, 256],
    `wkv` float32 [N, K], `q_weight` and `k_weight` float32 [hc, dim]. What the file stores is
    these with the table and wkv quantised to Q2_K, so these are the "exact" rows to compare a
    Q2_K pipeline against."""
    rng = np.random.default_rng(seed)
    out = {}
    for li, lid in enumerate(cfg.layer_ids):
        rows = int(tables.table_rows[li])
        table_rows = realistic_rows(rng, rows)                                       # [rows, 256]
        # wkv rows: keys and value, scaled so kv entries are O(1) for O(scale) inputs
        wkv = (rng.standard_normal((cfg.proj_out, cfg.proj_in)) / np.sqrt(cfg.proj_in) * 25.0)
        wkv *= rng.lognormal(0.0, 0.2, size=(cfg.proj_out, 1))                       # per-output scale
        q_weight = (1.0 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32)
        k_weight = (1.0 + 0.1 * rng.standard_normal((cfg.hc, cfg.dim))).astype(np.float32)
        out[lid] = {"table_rows": table_rows, "wkv": wkv.astype(np.float32), "q_weight": q_weight,
                    "k_weight": k_weight}
    return out


def build_tiny_layers(cfg: EngramConfig, tables: EngramHashTables, seed: int = TINY_SEED) -> dict:
    """Every tensor of the tiny model as the file stores it, deterministically from `seed`."""
    return {lid: {"table": quantize(w["table_rows"]), "wkv": quantize_matrix(w["wkv"]), "wkv_type": "Q2_K",
                  "q_weight": w["q_weight"], "k_weight": w["k_weight"]}
            for lid, w in tiny_float_weights(cfg, tables, seed).items()}


def make_fixture(path=TINY_PATH, golden_path=TINY_GOLDEN_PATH, seed: int = TINY_SEED) -> Path:
    """Write the tiny GGUF (and, when golden_path is given, its golden reference captures)."""
    from .formats.schema_a import write_gguf
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg, tables = tiny_config(), tiny_hash_tables()
    write_gguf(path, cfg, tables, build_tiny_layers(cfg, tables, seed), name="engram-numba tiny V4.1 fixture")
    if golden_path is not None:
        golden_captures(path).save(golden_path)
    return path


def golden_captures(path=TINY_PATH):
    """Every reference stage of the tiny model on `TINY_TOKENS` (with `TINY_MASK`), fp32 residual."""
    from .formats.schema_a import load_gguf
    from .pipeline import Pipeline
    model = load_gguf(path)
    return Pipeline(model, backends="reference").run(TINY_TOKENS, token_mask=TINY_MASK)


def tiny_model_path() -> Path:
    """The shipped tiny model; rebuilt into a temporary folder if this is not a source checkout."""
    if TINY_PATH.exists():
        return TINY_PATH
    import tempfile
    out = Path(tempfile.gettempdir()) / "engram_numba" / "tiny_v41.gguf"
    if not out.exists():
        make_fixture(out, golden_path=None)
    return out


# The tiny model's tokenizer -----------------------------------------------------------------------

TINY_TOKENIZER_PATH = REPO_DATA / "tiny_tokenizer.json"


def build_tiny_tokenizer():
    """The tiny model's tokenizer as a `tokenizers.Tokenizer` (see `text.build_tiny_tokenizer`)."""
    from .text import build_tiny_tokenizer as build
    return build()


def make_tiny_tokenizer(path=TINY_TOKENIZER_PATH) -> Path:
    """Write data/tiny_tokenizer.json (pretty-printed, a few KB)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_tiny_tokenizer().to_str(pretty=True) + "\n", encoding="utf-8")
    return path
