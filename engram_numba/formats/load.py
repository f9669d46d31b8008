"""`load_model(path)`: open any Engram model file this toolkit reads, whatever its container
(docs/formats.md, "Loading").

    single GGUF, schema A or B (ds4)          a .gguf file
    split GGUF (gguf-split), schema A or B    any shard (-NNNNN-of-MMMMM.gguf) or the folder
    DeepSeek HF checkpoint                    its folder, or model.safetensors.index.json

The format is recognised from the path and the file's own metadata (schema B has the key
`deepseek41.engram.encoding`); `model.format` says what was opened, with the table encoding.
Whatever is wrong is a named EngramFileError before any large allocation.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import BadMagicError, MissingFileError, NotARegularFileError
from .gguf import check_regular_file


def load_model(path, *, validate: bool = True, key_prefix: str | None = None, token_map_cache=None):
    """Open an Engram model in any supported container, memory-mapped (see the module docstring).

    validate=False: open a model whose hash constants disagree with its tables (shapes must still
    be right), listing the problems in `model.problems` (what `engram-numba info` does).
    key_prefix: schema A's key prefix ('deepseek41.', or 'deepseek4.' for older converters).
    token_map_cache: HF checkpoints only, a folder to keep the compressed token map in."""
    from .hf import HFCheckpointModel, is_hf_checkpoint
    from .schema_a import KEY_PREFIX, EngramModel
    from .schema_b import SchemaBModel, is_schema_b
    from .split import open_gguf_container

    from .._argcheck import need_path
    p = Path(os.fspath(need_path(path)))
    if not os.path.lexists(p):
        raise MissingFileError(f"model file {p} does not exist")
    if p.is_dir():
        if is_hf_checkpoint(p):
            return HFCheckpointModel(p, validate=validate, token_map_cache=token_map_cache)
    elif p.name.endswith((".json", ".safetensors")):
        check_regular_file(p)
        if p.name.endswith(".safetensors"):
            _not_a_toolkit_file(p)
        return HFCheckpointModel(p, validate=validate, token_map_cache=token_map_cache)
    elif not p.is_dir():
        check_regular_file(p)
        try:
            with open(p, "rb") as f:
                head = f.read(4)
        except OSError:
            head = b""
        if head.startswith(b"PK"):
            raise BadMagicError(f"{p}: a .npz (zip) file, not a model (captures and statistics files are .npz: "
                                "Capture.load / StreamingGateStats.load read them)")
    if p.is_dir() and not any(e.endswith(".gguf") for e in os.listdir(p)):
        raise NotARegularFileError(f"{p} is a directory holding no GGUF file, no model.safetensors.index.json "
                                   "and no model.safetensors: not a model folder")
    container = open_gguf_container(p)
    try:
        if is_schema_b(container.kv):
            return SchemaBModel(p, validate=validate, container=container)
        return EngramModel(p, key_prefix=key_prefix or KEY_PREFIX, validate=validate, container=container)
    except BaseException:
        container.close()
        raise


def _not_a_toolkit_file(p: Path) -> None:
    """A capture or highway file given where a model belongs is named as what it is."""
    from .errors import BadMetadataError
    from .safetensors import SafetensorsFile
    st = SafetensorsFile(p)
    kind = st.metadata.get("format")
    st.close()
    if kind in ("engram-capture", "engram-highway"):
        what = "a capture (Capture.load)" if kind == "engram-capture" else "a highway file (load_highway)"
        raise BadMetadataError(f"{p} is {what}, not a model")


def describe_model(model, scan_rows: bool | None = None) -> str:
    from .describe import describe
    return describe(model, scan_rows)
