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

Parquet and Arrow records are read by `records.py` (pyarrow, one record batch at a time).
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..highway import load_highway
from .corpus import (SPLITS, Document, _id_documents, _jsonl_documents, _text_documents, corpus_format,
                     encode_documents)
from .records import _arrow_batches, _open_arrow, _require_pyarrow, record_values

DEFAULT_SHARD_BYTES = 32 << 20       # about a minute of text on one CPU worker, seconds on a GPU
_SCAN_BLOCK = 16 << 20


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


def shard_pairs(shard: Shard, *, field: str = "text") -> Iterator[tuple[str, object]]:
    """(name, text or token ids) of every document of a text / JSONL / .ids / parquet / Arrow
    shard, in order; names as the whole-file readers give them."""
    path = Path(shard.path)
    if shard.kind in ("parquet", "arrow"):
        yield from record_values(shard.path, shard.kind, field, shard.start, shard.stop)
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
    if shard.kind == "documents":
        for k, d in enumerate(documents):
            yield Document(f"documents[{shard.start + k}]", d)
        return
    if shard.kind == "highway":
        hw = load_highway(shard.path, model)
        yield Document(shard.path, hw.token_ids, hw.token_mask, hw)
        return
    yield from encode_documents(shard_pairs(shard, field=field), tokenizer, add_special_tokens=add_special_tokens,
                                batch=batch)
