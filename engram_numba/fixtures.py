"""The tiny model in `data/`, in every format the toolkit reads, all from one set of float weights.

    data/tiny_v41.gguf          schema A, Q2_K tables and wkv (the original tiny model)
    data/tiny_v41_split/        the same tensors as a 3-shard split GGUF
    data/tiny_v41_q8_0.gguf     schema A with Q8_0 tables and wkv
    data/tiny_v41_ds4.gguf      schema B (ds4): FP8 rows, F16 wkv, F32 gate vectors
    data/tiny_v41_hf/           DeepSeek-style checkpoint: 2 safetensors shards (FP8 tables and wkv,
                                BF16 gate vectors), index, config.json and a 64-token tokenizer.json
                                whose compressed map folds tokens (so it is not the identity)

Every GGUF copy uses the identity token map of the tiny configuration, so they hash alike; the HF
copy hashes with its tokenizer's map (and so with other multipliers). All copies have the same
table rows (the primes do not depend on the token map) and come from `tiny_float_weights`.

The GGUF model uses the tiny configuration of docs/math.md (the reference's own test model: layer ids 1 and
4, n-grams up to 4, 2 heads, vocab 64, identity token map, pad 2), so its hash reproduces that
test vector (section 3.5), with head_dim 256 (one Q2_K block a row), dim 64 and hc 4. Tables and
`wkv` are Q2_K, as in the published Q2_K file; their values are drawn to look like trained
weights (heavy-tailed, per-row scales, a few outlier rows), not zeros or constants.

`engram-numba make-fixture` rebuilds every file and the golden captures; a test checks that each
rebuild is byte-identical and that the reference still reproduces the captures. The Q8_0, ds4 and
HF copies need the rows stage's Q8_0 and FP8 encoders and the wkv FP8 encoder
(`FORMAT_ENCODERS`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import EngramConfig
from .stages.hash.tables import EngramHashTables
from .stages.rows.q2k import ENGRAM_ROW_BYTES, quantize
from .text import TINY_SPECIAL_TOKENS, byte_alphabet

REPO_DATA = Path(__file__).resolve().parent.parent / "data"
TINY_PATH = REPO_DATA / "tiny_v41.gguf"
TINY_GOLDEN_PATH = REPO_DATA / "tiny_v41_golden.npz"
TINY_SEED = 20261129

# Every format of the tiny model: name -> path relative to the Q2_K file's folder ({stem} = its stem).
FIXTURE_FORMATS = {
    "gguf": "{stem}.gguf",
    "split": "{stem}_split",           # {stem}-0000k-of-00003.gguf inside
    "q8_0": "{stem}_q8_0.gguf",
    "ds4": "{stem}_ds4.gguf",
    "hf": "{stem}_hf",
}
SPLIT_SHARDS = 3
# The encoders each format's builder calls: format -> [(module, function)].
FORMAT_ENCODERS = {
    "gguf": [], "split": [],
    "q8_0": [("engram_numba.stages.rows.kquants", "quantize_q8_0")],
    "ds4": [("engram_numba.stages.rows.fp8", "encode_rows_fp8")],
    "hf": [("engram_numba.stages.rows.fp8", "encode_rows_fp8"), ("engram_numba.stages.proj.weights", "encode_wkv_fp8")],
}

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


def format_paths(path=TINY_PATH) -> dict[str, Path]:
    """Where each format of the tiny model lives, next to the Q2_K file `path`."""
    path = Path(path)
    return {fmt: path.parent / rel.format(stem=path.stem) for fmt, rel in FIXTURE_FORMATS.items()}


def missing_encoders(fmt: str) -> list[str]:
    """The encoders `fmt`'s builder needs that this checkout lacks ("module.function")."""
    import importlib
    out = []
    for module, fn in FORMAT_ENCODERS[fmt]:
        try:
            if not hasattr(importlib.import_module(module), fn):
                out.append(f"{module}.{fn}")
        except ImportError:
            out.append(f"{module}.{fn}")
    return out


def _encoder(module: str, fn: str):
    import importlib
    return getattr(importlib.import_module(module), fn)


def make_fixture(path=TINY_PATH, golden_path=TINY_GOLDEN_PATH, seed: int = TINY_SEED, formats="all") -> Path:
    """Write the tiny GGUF (and, when golden_path is given, its golden reference captures), and
    the other formats of `formats` beside it (format_paths). formats="all": every format whose
    encoders this checkout has (a warning names any left out and why); a sequence of
    FIXTURE_FORMATS names: exactly those, checked first, so nothing is half-written."""
    import warnings

    from .formats.schema_a import write_gguf
    every = formats == "all"
    formats = list(FIXTURE_FORMATS) if every else list(formats)
    unknown = [f for f in formats if f not in FIXTURE_FORMATS]
    if unknown:
        raise ValueError(f"unknown fixture formats {unknown}; formats are {list(FIXTURE_FORMATS)}")
    missing = {f: missing_encoders(f) for f in formats if missing_encoders(f)}
    if missing:
        text = "; ".join(f"{f} copy: needs {', '.join(m)}" for f, m in missing.items()) + " (not in this checkout)"
        if not every:
            raise RuntimeError("cannot build the tiny model's " + text)
        warnings.warn("left out of the tiny model's formats: " + text, stacklevel=2)
        formats = [f for f in formats if f not in missing]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg, tables = tiny_config(), tiny_hash_tables()
    write_gguf(path, cfg, tables, build_tiny_layers(cfg, tables, seed), name="engram-numba tiny V4.1 fixture")
    paths = format_paths(path)
    for fmt in formats:
        if fmt != "gguf":
            make_format_fixture(fmt, paths[fmt], seed)
    if golden_path is not None:
        golden_captures(path).save(golden_path)
    return path


def make_format_fixture(fmt: str, out, seed: int = TINY_SEED) -> Path:
    """Write one format of the tiny model to `out` (a file, or a folder for split and hf)."""
    out = Path(out)
    builders = {"gguf": _write_gguf, "split": _write_split, "q8_0": _write_q8_0, "ds4": _write_ds4, "hf": _write_hf}
    return builders[fmt](out, seed)


def _write_gguf(out: Path, seed: int) -> Path:
    from .formats.schema_a import write_gguf
    cfg, tables = tiny_config(), tiny_hash_tables()
    return write_gguf(out, cfg, tables, build_tiny_layers(cfg, tables, seed), name="engram-numba tiny V4.1 fixture")


def _fresh_folder(out: Path, pattern: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(pattern):   # files of an earlier build with other names
        old.unlink()


def _write_split(out: Path, seed: int) -> Path:
    """The Q2_K model's tensors in 3 shards, metadata in the first (tables of both layers and one
    wkv in different shards, so a tensor's shard matters)."""
    from .formats.schema_a import build_gguf_entries
    from .formats.split import write_split_gguf
    cfg, tables = tiny_config(), tiny_hash_tables()
    kvs, tensors = build_gguf_entries(cfg, tables, build_tiny_layers(cfg, tables, seed),
                                      name="engram-numba tiny V4.1 fixture (split)")
    _fresh_folder(out, "*.gguf")
    # tensors: per layer table, wkv, q, k
    write_split_gguf(out / "tiny_v41", kvs, [tensors[0:3], tensors[3:5], tensors[5:8]])
    return out


def _write_q8_0(out: Path, seed: int) -> Path:
    from .formats.schema_a import write_gguf
    quantize_q8_0 = _encoder("engram_numba.stages.rows.kquants", "quantize_q8_0")
    cfg, tables = tiny_config(), tiny_hash_tables()
    layers = {}
    for lid, w in tiny_float_weights(cfg, tables, seed).items():
        rows, wkv = w["table_rows"], w["wkv"]
        layers[lid] = {"table": quantize_q8_0(rows).reshape(rows.shape[0], -1), "table_type": "Q8_0",  # [rows, 272]
                       "wkv": quantize_q8_0(wkv).reshape(wkv.shape[0], -1), "wkv_type": "Q8_0",    # [N, K/32*34]
                       "q_weight": w["q_weight"], "k_weight": w["k_weight"]}
    return write_gguf(out, cfg, tables, layers, name="engram-numba tiny V4.1 fixture (Q8_0)")


def _write_ds4(out: Path, seed: int) -> Path:
    from .formats.schema_b import write_schema_b_gguf
    encode_rows_fp8 = _encoder("engram_numba.stages.rows.fp8", "encode_rows_fp8")
    cfg, tables = tiny_config(), tiny_hash_tables()
    layers = {}
    for lid, w in tiny_float_weights(cfg, tables, seed).items():
        codes, scales = encode_rows_fp8(w["table_rows"])                  # [rows, 256], [rows, 8] uint8
        layers[lid] = {"rows_fp8": np.concatenate([codes, scales], axis=1),  # [rows, 264]: ds4's row
                       "wkv": w["wkv"].astype(np.float16), "q_weight": w["q_weight"], "k_weight": w["k_weight"]}
    return write_schema_b_gguf(out, cfg, tables, layers, name="engram-numba tiny V4.1 fixture (ds4)")


# The tiny tokenizer of the HF copy: 64 raw ids. Several fold to one compressed id under DeepSeek's
# recipe (case, a leading space, whitespace runs, accents, the NFKC ligature), two are UTF-8
# fragments that keep their raw token string as key, and one normalises to nothing.
TINY_TOKEN_TEXTS = (
    "the", " the", " The", "THE", "The",           # fold to "the"
    " ", "  ", "\n", "\t",                          # fold to the lone space
    "café", "cafe", " Café",                       # fold to "cafe"
    "\ufb01", "fi", " fi",                          # the ligature folds to "fi"
    b"\xc3", b"\xe2\x80",                          # UTF-8 fragments: decode to U+FFFD, keyed by token string
    "\u0301",                                      # a lone combining accent: normalises to nothing
    "and", " and", "of", " of", "to", " to", "in", " in", "is", " is", "it", "that", "was", "for", "on",
    "with", "as", "he", "she", "at", "by", "this", "from", "or", "an", "be", "are", "we", "you", "they",
    "0", "1", "2", "3", ".", ",", "!", "?", "ing", "ed", "s", " he", "ly",
)


def _byte_level(b: bytes) -> str:
    """GPT-2's byte-to-character mapping (what a byte-level BPE vocabulary stores)."""
    table = byte_alphabet()
    return "".join(table[x] for x in b)


def tiny_tokenizer_json() -> str:
    """The HF copy's tokenizer.json: a byte-level BPE of 64 tokens, built with `tokenizers`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(TINY_SPECIAL_TOKENS)}
    for text in TINY_TOKEN_TEXTS:
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        vocab[_byte_level(raw)] = len(vocab)
    assert len(vocab) == 64, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in TINY_SPECIAL_TOKENS])
    return tok.to_str(pretty=True)


def tiny_hf_config(compressed_vocab: int) -> dict:
    """config.json of the HF copy: the model's shapes at the top level, the engram keys under
    text_config (as in the released file, where some keys are nested)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "hidden_size": 64, "hc_mult": 4, "rms_norm_eps": 1e-20, "vocab_size": 64,
        "text_config": {"engram_layer_ids": [1, 4], "engram_max_ngram_size": 4, "engram_n_heads": 2,
                        "engram_head_dim": 256, "engram_vocab_size": 64, "engram_num_embeddings": 64 * 6,
                        "engram_pad_token_id": 2, "engram_compressed_vocab_size": int(compressed_vocab)},
    }


def tiny_hf_token_map() -> np.ndarray:
    """The compressed token map of the tiny tokenizer, by DeepSeek's recipe (int64 [64])."""
    import tempfile

    from .formats.tokenmap import build_token_map
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "tokenizer.json"
        p.write_text(tiny_tokenizer_json())
        return build_token_map(p)


def _write_hf(out: Path, seed: int) -> Path:
    from .bf16 import f32_to_bf16
    from .formats.hf import write_hf_checkpoint
    encode_rows_fp8 = _encoder("engram_numba.stages.rows.fp8", "encode_rows_fp8")
    encode_wkv_fp8 = _encoder("engram_numba.stages.proj.weights", "encode_wkv_fp8")
    cfg, tables = tiny_config(), tiny_hash_tables()
    layers = {}
    for lid, w in tiny_float_weights(cfg, tables, seed).items():
        codes, scales = encode_rows_fp8(w["table_rows"])                    # [rows, 256], [rows, 8]
        wkv_codes, wkv_scales = encode_wkv_fp8(w["wkv"])                    # [N, K], [N/32, K/32]
        layers[lid] = {"embed_codes": codes, "embed_scales": scales, "wkv_codes": wkv_codes,
                       "wkv_scales": wkv_scales, "q_weight": f32_to_bf16(w["q_weight"]),
                       "k_weight": f32_to_bf16(w["k_weight"])}
    _fresh_folder(out, "*.safetensors")
    compressed = int(tiny_hf_token_map().max()) + 1
    return write_hf_checkpoint(out, tiny_hf_config(compressed), layers, tiny_tokenizer_json(), n_shards=2)


def golden_captures(path=TINY_PATH):
    """Every reference stage of the tiny model on `TINY_TOKENS` (with `TINY_MASK`), fp32 residual."""
    from .formats.schema_a import load_gguf
    from .pipeline import Pipeline
    model = load_gguf(path)
    cap = Pipeline(model, backends="reference").run(TINY_TOKENS, token_mask=TINY_MASK)
    # a committed file: paths relative to the model's folder, not the machine that wrote it
    for key in ("model", "tokenizer"):
        if cap.meta.get(key):
            p = Path(str(cap.meta[key]))
            cap.meta[key] = p.name if p.parent == Path(path).resolve().parent or p.parent == Path(path).parent else str(p)
    return cap


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
