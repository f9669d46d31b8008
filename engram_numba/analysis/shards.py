"""A corpus cut into shards: pieces of work that together hold every document exactly once.

    plan = plan_shards(corpus_files("corpus/"), shard_bytes=32 << 20)
    for shard in plan:
        for doc in shard_documents(shard, tokenizer=tok):     # Document objects, in file order
            ...

A shard is one file, or one range of a file:
    text (split "line"), JSONL, .ids   a byte range cut just after a newline, so every line
                                       (document) lies whole in one shard
    text (split "paragraph")           a byte range cut just after a blank line
    text (split "file"), 1-D .npy,     the whole file (it is one document)
    highway .safetensors
    2-D .npy                           a range of rows (one document a row)
    .parquet                           a range of rows (records) of the text column
    .arrow (Hugging Face datasets      a range of records; a folder written by
    saved to disk, or any Arrow IPC)   `Dataset.save_to_disk` is its .arrow files, in order

Every document starts a fresh sequence (its own hash history, positions from 0), so a document
never needs anything from the shard before it: the statistics of the shards, merged, are the
statistics of the corpus in one pass. A shard is described by plain JSON (`Shard.spec()`), with
the file's size and modification time, so a partial result made from a file that changed since
is recognised as foreign.

Reading parquet and Arrow needs pyarrow (the `analysis` extra); they stream one record batch at
a time. The text column is `field` (default "text"), as for JSONL: strings are tokenized, lists
of integers are token ids; empty strings and nulls are skipped.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

DEFAULT_SHARD_BYTES = 32 << 20       # about a minute of text on one CPU worker, seconds on a GPU
_SCAN_BLOCK = 16 << 20
HF_DATASET_FILES = ("dataset_info.json", "state.json")


@dataclass(frozen=True)
class Shard:
    """One piece of a corpus (module doc). `unit` is "bytes", "rows" or "file"; [start, stop)."""

    index: int
    path: str
    kind: str                 # text | jsonl | ids | npy | highway | parquet | arrow | documents
    unit: str
    start: int
    stop: int
    first_line: int = 1       # byte ranges: the line number at `start` (names documents path:line)
    size: int = 0             # the file's size and mtime when planned (foreign partials are refused)
    mtime_ns: int = 0
    split: str = "line"
    digest: str = ""          # in-memory documents: sha256 of their token ids

    def spec(self) -> dict:
        return asdict(self)

    @property
    def name(self) -> str:
        if self.unit == "file":
            return f"{self.path}"
        what = "bytes" if self.unit == "bytes" else "rows"
        return f"{self.path}[{what} {self.start}:{self.stop}]"


# Folders and formats ----------------------------------------------------------------------------

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


# Planning ----------------------------------------------------------------------------------------

def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return int(st.st_size), int(st.st_mtime_ns)


def _line_cuts(path: Path, shard_bytes: int, paragraph: bool) -> list[tuple[int, int, int]]:
    """[(start, stop, first line)] byte ranges cut just after a newline (paragraph: just after a
    blank line), each at least shard_bytes long but the last. Reads the file once."""
    size = path.stat().st_size
    cuts = [(0, 1)]                  # (byte offset, line number there)
    line = 1
    pos = 0
    target = shard_bytes
    with open(path, "rb") as f:
        if paragraph:
            for raw in f:
                pos += len(raw)
                # lines as the text reader numbers them (\r\n, \r and \n end a line)
                line += raw.count(b"\n") + raw.count(b"\r") - raw.count(b"\r\n")
                if pos >= target and raw.endswith(b"\n") and not raw.strip() and pos < size:
                    cuts.append((pos, line))
                    target = pos + shard_bytes
        else:
            carry_cr = False
            while True:
                block = f.read(_SCAN_BLOCK)
                if not block:
                    break
                base = pos
                i = 0
                while base + len(block) > target and pos < size:
                    j = block.find(b"\n", max(target - base, i))
                    if j < 0:
                        break
                    chunk = block[i:j + 1]
                    line += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n") - \
                        (1 if carry_cr and chunk.startswith(b"\n") else 0)
                    carry_cr = False
                    i = j + 1
                    if base + i < size:
                        cuts.append((base + i, line))
                    target = base + i + shard_bytes
                rest = block[i:]
                line += rest.count(b"\n") + rest.count(b"\r") - rest.count(b"\r\n") - \
                    (1 if carry_cr and rest.startswith(b"\n") else 0)
                carry_cr = block.endswith(b"\r")
                pos = base + len(block)
    bounds = [c[0] for c in cuts] + [size]
    return [(bounds[k], bounds[k + 1], cuts[k][1]) for k in range(len(cuts)) if bounds[k + 1] > bounds[k]]


def plan_shards(files, *, fmt: str | None = None, split: str = "line", shard_bytes: int = DEFAULT_SHARD_BYTES,
                field: str = "text") -> list[Shard]:
    """The shards of a corpus (files as `corpus_files` gives them), in corpus order."""
    from .corpus import SPLITS, corpus_format
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, (int, np.integer)) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    out: list[Shard] = []

    def add(path: Path, kind: str, unit: str, start: int, stop: int, first_line: int = 1):
        size, mtime = _stamp(path)
        out.append(Shard(len(out), str(path.resolve()), kind, unit, int(start), int(stop), int(first_line), size,
                         mtime, split))

    for f in files:
        path = Path(f)
        kind = corpus_format(path, fmt)
        if kind in ("jsonl", "ids") or (kind == "text" and split != "file"):
            for a, b, line in _line_cuts(path, int(shard_bytes), kind == "text" and split == "paragraph"):
                add(path, kind, "bytes", a, b, line)
        elif kind == "npy":
            arr = np.load(path, allow_pickle=False, mmap_mode="r")
            if arr.ndim == 2 and arr.shape[0]:
                per = max(1, int(shard_bytes) // max(arr.itemsize * arr.shape[1], 1))
                for a in range(0, arr.shape[0], per):
                    add(path, kind, "rows", a, min(arr.shape[0], a + per))
            else:
                add(path, kind, "file", 0, 0)
        elif kind == "parquet":
            pa = _require_pyarrow(path)
            try:
                meta = pa.parquet.ParquetFile(str(path)).metadata
            except pa.ArrowInvalid as exc:
                raise ValueError(f"{path}: not a parquet file ({exc})") from None
            n, nbytes = meta.num_rows, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            per = max(1, int(n * int(shard_bytes) // max(nbytes, 1)))
            for a in range(0, n, per):
                add(path, kind, "rows", a, min(n, a + per))
        elif kind == "arrow":
            rows, nbytes = 0, 0
            for batch in _arrow_batches(_open_arrow(path)):
                rows += batch.num_rows
                nbytes += batch.nbytes
            per = max(1, int(rows * int(shard_bytes) // max(nbytes, 1)))
            for a in range(0, rows, per):
                add(path, kind, "rows", a, min(rows, a + per))
        else:                                   # text split "file", highway
            add(path, kind, "file", 0, 0)
    return out


def plan_documents(documents, per_shard: int) -> list[tuple[Shard, list]]:
    """In-memory token-id documents cut into shards of `per_shard` documents: [(shard, docs)]."""
    docs = [np.ascontiguousarray(np.asarray(d), dtype=np.int64) for d in documents]
    for i, d in enumerate(docs):
        if d.ndim != 1:
            raise ValueError(f"documents[{i}] must be 1-D token ids, got shape {list(d.shape)}")
    out = []
    for a in range(0, len(docs), max(1, int(per_shard))):
        part = docs[a:a + per_shard]
        h = hashlib.sha256()
        for d in part:
            h.update(np.int64(d.size).tobytes())
            h.update(d.tobytes())
        out.append((Shard(len(out), "documents", "documents", "rows", a, a + len(part), digest=h.hexdigest()), part))
    return out


# Reading one shard ------------------------------------------------------------------------------

def _range_text(shard: Shard):
    """The shard's byte range as a text stream with the file reader's newline handling."""
    with open(shard.path, "rb") as f:
        f.seek(shard.start)
        data = f.read(shard.stop - shard.start)
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


def _record_values(shard: Shard, field: str) -> Iterator[tuple[str, object]]:
    """(name, value) of every record of a parquet / Arrow shard, one record batch at a time."""
    if shard.kind == "parquet":
        pa = _require_pyarrow(shard.path)
        pf = pa.parquet.ParquetFile(shard.path)
        _check_column(shard.path, pf.schema_arrow, field)
        meta = pf.metadata
        groups, first, row = [], None, 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if row + n > shard.start and row < shard.stop:
                groups.append(g)
                first = row if first is None else first
            row += n
        batches = pf.iter_batches(batch_size=4096, row_groups=groups, columns=[field]) if groups else iter(())
        row = first or 0
    else:
        reader = _open_arrow(shard.path)
        _check_column(shard.path, reader.schema, field)
        batches = _arrow_batches(reader)
        row = 0
    for batch in batches:
        n = batch.num_rows
        if row + n <= shard.start:
            row += n
            continue
        if row >= shard.stop:
            break
        a, b = max(shard.start - row, 0), min(shard.stop - row, n)
        values = batch.column(batch.schema.get_field_index(field)).slice(a, b - a).to_pylist()
        for k, v in enumerate(values):
            yield f"{shard.path}[{row + a + k}]", v
        row += n


def _checked_values(shard: Shard, field: str) -> Iterator[tuple[str, object]]:
    for where, value in _record_values(shard, field):
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


def record_documents(path, kind: str, field: str = "text") -> Iterator[tuple[str, object]]:
    """(name, text or token ids) of every record of a whole parquet / Arrow file."""
    path = Path(path)
    yield from _checked_values(Shard(0, str(path), kind, "rows", 0, 1 << 62), field)


def shard_pairs(shard: Shard, *, field: str = "text") -> Iterator[tuple[str, object]]:
    """(name, text or token ids) of every document of a text / JSONL / .ids / parquet / Arrow
    shard, in order; names as the whole-file readers give them."""
    from .corpus import _id_documents, _jsonl_documents, _text_documents
    path = Path(shard.path)
    if shard.kind in ("parquet", "arrow"):
        yield from _checked_values(shard, field)
    elif shard.unit == "file":
        if shard.kind == "text":
            yield from _text_documents(path, "file")
        else:
            yield from _id_documents(path, shard.kind)
    elif shard.kind == "text":
        yield from _text_documents(path, shard.split, stream=_range_text(shard), first_line=shard.first_line)
    elif shard.kind == "jsonl":
        yield from _jsonl_documents(path, field, stream=_range_text(shard), first_line=shard.first_line)
    elif shard.kind == "ids":
        yield from _id_documents(path, "ids", stream=_range_text(shard), first_line=shard.first_line)
    elif shard.kind == "npy":
        arr = np.load(path, allow_pickle=False, mmap_mode="r")
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise ValueError(f"{path}: token ids must be integers, got {arr.dtype}")
        for i in range(shard.start, shard.stop):
            yield f"{path}[{i}]", np.asarray(arr[i], dtype=np.int64)
    else:
        raise ValueError(f"shard {shard.name}: no reader for kind {shard.kind!r}")


def shard_documents(shard: Shard, *, tokenizer=None, field: str = "text", add_special_tokens: bool = True,
                    model=None, documents=None, batch: int = 256):
    """The Document objects of one shard, in order (texts tokenized in batches, as the corpus
    reader does)."""
    from ..highway import load_highway
    from .corpus import Document
    if shard.kind == "documents":
        for k, d in enumerate(documents):
            yield Document(f"documents[{shard.start + k}]", d)
        return
    if shard.kind == "highway":
        hw = load_highway(shard.path, model)
        yield Document(shard.path, hw.token_ids, hw.token_mask, hw)
        return
    pending: list[tuple[str, str]] = []

    def flush():
        if tokenizer is None:
            raise ValueError(f"{pending[0][0]}: this document is text, and no tokenizer can encode it "
                             "(pass tokenizer=PATH to a tokenizer.json)")
        ids = tokenizer.encode_batch([t for _, t in pending], add_special_tokens=add_special_tokens)
        out = [Document(name, np.asarray(i, dtype=np.int64)) for (name, _), i in zip(pending, ids)]
        pending.clear()
        return out
    for name, value in shard_pairs(shard, field=field):
        if isinstance(value, str):
            pending.append((name, value))
            if len(pending) >= batch:
                yield from flush()
        else:
            if pending:
                yield from flush()
            yield Document(name, np.asarray(value, dtype=np.int64))
    if pending:
        yield from flush()
