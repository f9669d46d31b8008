"""engram_numba: the Engram module of DeepSeek-V4.1-Flash as numpy, @njit and @cuda.jit stages.

    import engram_numba as en
    model = en.load_gguf(en.tiny_model_path())          # or a real DeepSeek-V4.1 GGUF
    cap = en.Pipeline(model, "reference").run(en.TINY_TOKENS, token_mask=en.TINY_MASK)
    en.diff(cap, en.Pipeline(model, "cuda").run(en.TINY_TOKENS, token_mask=en.TINY_MASK))
    en.gate_stats(cap); en.gate_heatmap(cap)

The names below are the public face; each is loaded on first use (so `import engram_numba` stays
cheap). The stages live in `engram_numba.stages.<hash|rows|proj|gate>`, one folder each with
their three backends, kernels and tests; docs/ explains the math, the formats and the numerics.
"""
from __future__ import annotations

from . import _target

_target.select()
_cuda = _target.check_numba_cuda()

from numba.cuda import config as _numba_config  # noqa: E402

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)  # True: kernels run in numba's CUDA simulator

__version__ = "0.2.0"

# public name -> (module, attribute)
_PUBLIC = {
    # configuration and the hash
    "EngramConfig": ("config", "EngramConfig"),
    "EngramHashTables": ("stages.hash.tables", "EngramHashTables"),
    "EngramHasher": ("stages.hash.cpu", "EngramHasher"),
    "hash_tokens": ("stages.hash.cpu", "hash_tokens"),
    # files
    "load_model": ("formats.load", "load_model"),
    "load_gguf": ("formats.schema_a", "load_gguf"),
    "released_model": ("formats.released", "released_model"),
    "write_gguf": ("formats.schema_a", "write_gguf"),
    "describe": ("formats.schema_a", "describe"),
    "EngramFileError": ("formats.errors", "EngramFileError"),
    # running and capturing
    "Pipeline": ("pipeline", "Pipeline"),
    "EngramError": ("errors", "EngramError"),
    "Capture": ("capture", "Capture"),
    "CaptureFileError": ("capture", "CaptureFileError"),
    "point_names": ("capture", "point_names"),
    "EngramV41": ("engine", "EngramV41"),
    # text and imported hidden states
    "tokenize": ("text", "tokenize"),
    "load_tokenizer": ("text", "load_tokenizer"),
    "tokenizer_for": ("text", "tokenizer_for"),
    "Tokenizer": ("text", "Tokenizer"),
    "compressed_view": ("text", "compressed_view"),
    "load_highway": ("highway", "load_highway"),
    "save_highway": ("highway", "save_highway"),
    "HighwayFile": ("highway", "HighwayFile"),
    # corpus statistics and tables
    "corpus_stats": ("analysis.corpus", "corpus_stats"),
    "distributed_corpus_stats": ("analysis.distributed", "distributed_corpus_stats"),
    "StreamingGateStats": ("analysis.streaming", "StreamingGateStats"),
    "merge_stats": ("analysis.streaming", "merge"),
    "token_table": ("analysis.tables", "token_table"),
    # which rows real text reads (hash only), gates by token class, row edits
    "AccessStats": ("analysis.access", "AccessStats"),
    "access_stats": ("analysis.access", "access_stats"),
    "merge_access": ("analysis.access", "merge_access"),
    "offline_corpus": ("analysis.offline_corpus", "offline_corpus"),
    "corpus_token_ids": ("analysis.offline_corpus", "corpus_token_ids"),
    "gate_by_class": ("analysis.gate_classes", "gate_by_class"),
    "gate_by_frequency": ("analysis.gate_classes", "gate_by_frequency"),
    "update_size": ("analysis.gate_classes", "update_size"),
    "row_edit": ("analysis.row_edit", "row_edit"),
    # analysis
    "diff": ("analysis.diff", "diff"),
    "DiffReport": ("analysis.diff", "DiffReport"),
    "gate_stats": ("analysis.stats", "gate_stats"),
    "gate_cost": ("analysis.quant_cost", "gate_cost"),
    "GateStats": ("analysis.stats", "GateStats"),
    "row_id_reuse": ("analysis.stats", "row_id_reuse"),
    "ngram_windows": ("analysis.stats", "ngram_windows"),
    "gate_heatmap": ("analysis.plots", "gate_heatmap"),
    "gate_histogram": ("analysis.plots", "gate_histogram"),
    "gate_vs_dot": ("analysis.plots", "gate_vs_dot"),
    "row_id_reuse_plot": ("analysis.plots", "row_id_reuse_plot"),
    # kernels
    "kernels": ("stages.catalog", None),
    # the tiny fixture model
    "tiny_model_path": ("fixtures", "tiny_model_path"),
    "TINY_TOKENS": ("fixtures", "TINY_TOKENS"),
    "TINY_MASK": ("fixtures", "TINY_MASK"),
}

__all__ = ["SIMULATOR", "__version__", *_PUBLIC]


def __getattr__(name: str):
    try:
        module, attr = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'engram_numba' has no attribute {name!r}") from None
    import importlib
    mod = importlib.import_module(f"{__name__}.{module}")
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
