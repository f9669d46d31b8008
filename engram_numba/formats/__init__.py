"""File formats: GGUF reading and writing (`gguf.py`), split GGUFs (`split.py`), the Engram
schemas on top of them (`schema_a.py`: the llama.cpp converters' layout; `schema_b.py`: ds4's FP8
rows), DeepSeek's safetensors checkpoint (`safetensors.py`, `hf.py`, `tokenmap.py`), what every
format's model shares (`model.py`, `rowcheck.py`), `describe.py` for `engram-numba info`, and
`load.py`: `load_model(path)` opens any of them. Errors in `errors.py`. Every reader works on
memory maps: opening a model reads its headers, metadata and index only.

`engram_numba.formats.load_model` is loaded on first use (this file imports nothing).
"""


def __getattr__(name: str):
    if name == "load_model":
        import importlib
        return importlib.import_module(__name__ + ".load").load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
