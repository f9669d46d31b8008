"""Records of parquet and Arrow corpora, and folders saved by Hugging Face `datasets`.

Read with pyarrow (the `analysis` extra), one record batch at a time (parquet by row group, Arrow
from a memory map); no `datasets` install is needed. A folder written by `Dataset.save_to_disk`
holds state.json (its Arrow files, in order, under `_data_files`), dataset_info.json and the Arrow
files (IPC streams). The text column is `field` (default "text"), as for JSONL: strings are
tokenized, lists of integers are token ids; empty strings and nulls are skipped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

HF_DATASET_FILES = ("dataset_info.json", "state.json")


def is_hf_dataset(path) -> bool:
    """A folder written by Hugging Face `datasets` `save_to_disk` (Arrow files + state.json)."""
    p = Path(path)
    return p.is_dir() and all((p / f).is_file() for f in HF_DATASET_FILES)


def hf_dataset_files(path) -> list[Path]:
    """The Arrow files of a saved dataset, in the order state.json lists them."""
    p = Path(path)
    try:
        state = json.loads((p / "state.json").read_text(encoding="utf-8"))
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{p / 'state.json'}: not a datasets state file ({type(exc).__name__}: {exc})") from None
    files = [p / n for n in names]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{p / 'state.json'} lists {f.name}, which is not in {p}")
    if not files:
        raise ValueError(f"{p / 'state.json'} lists no data files")
    return files


def expand_dataset_dirs(corpus):
    """A corpus argument with every saved-dataset folder replaced by its Arrow files (a
    DatasetDict folder is refused, naming its splits)."""
    items = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    out = []
    for item in items:
        p = Path(item) if isinstance(item, (str, os.PathLike)) else None
        if p is not None and p.is_dir() and (p / "dataset_dict.json").is_file():
            try:
                splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
            except (OSError, ValueError, AttributeError):
                splits = []
            raise ValueError(f"{p} is a dataset with several splits ({', '.join(map(str, splits)) or '?'}): "
                             f"give one split's folder, e.g. {p / (str(splits[0]) if splits else 'train')}")
        if p is not None and is_hf_dataset(p):
            out += hf_dataset_files(p)
        else:
            out.append(item)
    return out


def _require_pyarrow(path):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError(f"{path}: reading parquet and Arrow corpora needs pyarrow, which is not installed: "
                          "pip install 'engram-numba[analysis]'") from None
    return pyarrow


def _open_arrow(path):
    """A reader of an Arrow IPC file or stream (datasets writes streams), memory-mapped."""
    pa = _require_pyarrow(path)
    source = pa.memory_map(str(path), "r")
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{path}: not an Arrow IPC file or stream ({exc})") from None


def _arrow_batches(reader):
    if hasattr(reader, "num_record_batches"):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def _check_column(path, schema, field: str) -> None:
    if field not in schema.names:
        raise ValueError(f"{path}: no column {field!r} (columns: {', '.join(schema.names[:12])}); "
                         "pick one with --field")



def _record_values(path, kind: str, start: int, stop: int, field: str) -> Iterator[tuple[str, object]]:
    """(name, value) of records [start, stop) of a parquet / Arrow file, one record batch at a time."""
    path = str(path)
    if kind == "parquet":
        pa = _require_pyarrow(path)
        pf = pa.parquet.ParquetFile(path)
        _check_column(path, pf.schema_arrow, field)
        meta = pf.metadata
        groups, first, row = [], None, 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if row + n > start and row < stop:
                groups.append(g)
                first = row if first is None else first
            row += n
        batches = pf.iter_batches(batch_size=4096, row_groups=groups, columns=[field]) if groups else iter(())
        row = first or 0
    else:
        reader = _open_arrow(path)
        _check_column(path, reader.schema, field)
        batches = _arrow_batches(reader)
        row = 0
    for batch in batches:
        n = batch.num_rows
        if row + n <= start:
            row += n
            continue
        if row >= stop:
            break
        a, b = max(start - row, 0), min(stop - row, n)
        values = batch.column(batch.schema.get_field_index(field)).slice(a, b - a).to_pylist()
        for k, v in enumerate(values):
            yield f"{path}[{row + a + k}]", v
        row += n


def record_values(path, kind: str, field: str = "text", start: int = 0,
                  stop: int = 1 << 62) -> Iterator[tuple[str, object]]:
    """(name, text or token ids) of records [start, stop) of a parquet / Arrow file (empty
    strings and nulls skipped)."""
    for where, value in _record_values(path, kind, start, stop, field):
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        if isinstance(value, str):
            yield where, value
        elif isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            if value:
                yield where, np.asarray(value, dtype=np.int64)
        else:
            raise ValueError(f"{where}: column {field!r} must hold strings or lists of token ids, "
                             f"got {type(value).__name__}")
