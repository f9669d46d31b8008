"""Corpus statistics that stream: many documents through the pipeline, only statistics kept.

    st = en.corpus_stats(model, "wiki.jsonl", backend="cuda", chunk_tokens=4096)
    print(st)                                  # per layer and stream, exact moments, quantiles
    st.top_tokens(1, by="mean_gate"); st.top_contexts(3, 1); st.columns()
    st.save("part0.npz")                       # later: merge([load(p) for p in parts])

What a corpus is (`corpus` is a path, or a list of paths; a folder means its files, sorted):
    *.jsonl / *.ndjson   one JSON object per line; `field` (default "text") holds the text, or a
                         list of raw token ids
    *.npy                token ids: a 1-D array is one document, a 2-D array one per row
    *.ids                token ids as whitespace-separated integers, one document per line
    *.parquet            one document per row of the column `field` (text, or a list of token ids)
    *.arrow / a folder   Arrow IPC files, as parquet; a folder written by Hugging Face datasets'
                         `save_to_disk` (state.json + dataset_info.json) is its Arrow files in order
    *.safetensors        a highway file (engram_numba.load_highway): one document whose token
                         ids and hidden states come from another engine
    anything else        text, UTF-8: one document per line (split="line", the default), per
                         paragraph (split="paragraph": blocks separated by blank lines), or the
                         whole file (split="file"); empty documents are skipped
`fmt` forces one of FORMATS for every file. In memory:
`texts=[...]` (strings) or `documents=[...]` (int arrays, or HighwayFile objects).

Each document is a fresh sequence (its own hash history, positions from 0, its own BOS when the
tokenizer adds one) unless continuous=True, which runs the corpus as one sequence. Documents are
packed into chunks of `chunk_tokens` tokens (a long document spans chunks: the hasher keeps its
history), and each chunk goes through rows -> proj -> gate of every engram layer at once.

The highway: hidden states from highway files when the corpus is made of them (each layer its
own); otherwise the synthetic N(0, 1) highway of `Pipeline.run`, a function of the token's
position in its sequence only (the same draw `Pipeline.run` makes for that document alone, so a
one-document corpus has the statistics `gate_stats` gives of that run), with the second layer
reading the first's output. The statistics' header and meta say which ("highway: synthetic ...").

With the cuda backend (rows, proj and gate), rows are gathered from device tables, the highway
is assembled on the device (the synthetic one from cached blocks, device to device), and only
the dot and gate come back. Tokenizing and hashing run on a producer thread (the @njit hasher
releases the GIL), the statistics on a reducer thread, both overlapping the device work.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..formats.jsonsafe import load_json
from ..formats.safetensors import is_safetensors
from ..highway import HighwayFile, load_highway
from ..stages.hash.cpu import EngramHasher
from ..stages.hash.cpu import ngram_windows as ngram_windows_from_history
from .streaming import DEFAULT_MAX_CONTEXTS, Chunk, StreamingGateStats

FORMATS = ("text", "jsonl", "npy", "ids", "highway", "parquet", "arrow")
SPLITS = ("line", "paragraph", "file")
SYNTHETIC_CORPUS = ("synthetic (N(0,1) by position in the sequence, seed 0, as Pipeline.run draws it; "
                    "no transformer blocks)")
REDUCER_THREADS = 8                # > 1: a chunk's statistics on L + (max_ngram - 1) lanes (5 at the released shapes)
LANES = "all"                      # "all": each chunk's layers on lanes of their own, as the context orders;
                                   # "contexts": the context orders on lanes, the layers on the pool, waited
                                   # for. The same statistics either way. On the H200 host "all" won for both
                                   # models, every run agreeing (fec6e6c, tools/gpu_corpus_lanes.sh: Q2_K
                                   # 753,842 vs 752,043 tokens/s, FP8 736,889 vs 710,618; docs/research.md
                                   # section 5); earlier runs favoured whichever variant was timed second.
_TRIM_HISTORY = 1 << 20            # continuous mode: keep the hasher's history below this many tokens


@dataclass
class Document:
    """One document: raw token ids, an optional mask, an optional highway file."""

    name: str
    token_ids: np.ndarray                  # [n] int64
    mask: np.ndarray | None = None         # [n] bool
    highway: HighwayFile | None = None


# Reading a corpus ---------------------------------------------------------------------------------

def corpus_format(path, fmt: str | None = None) -> str:
    """The format of one corpus file (by `fmt`, else by its suffix / content)."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"corpus format must be one of {FORMATS}, got {fmt!r}")
        return fmt
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".npy":
        return "npy"
    if suffix == ".ids":
        return "ids"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".arrow":
        return "arrow"
    if suffix == ".safetensors" or is_safetensors(p):
        return "highway"
    return "text"


def corpus_files(corpus) -> list[Path]:
    """The files of a corpus argument (a path or a list of them; a folder is its files, sorted),
    each checked to exist before any work."""
    from .records import expand_dataset_dirs
    items = expand_dataset_dirs(corpus)
    out = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"a corpus is a path or a list of paths, got {type(item).__name__} "
                            "(in-memory documents go to texts=... or documents=...)")
        p = Path(item)
        if not p.exists():
            raise FileNotFoundError(f"corpus file {p} does not exist")
        if p.is_dir():
            files = sorted(q for q in p.iterdir() if q.is_file() and not q.name.startswith("."))
            if not files:
                raise FileNotFoundError(f"corpus folder {p} holds no files")
            out += files
        else:
            out.append(p)
    if not out:
        raise ValueError("the corpus is empty: give at least one file")
    return out


def _text_documents(path: Path, split: str, stream=None, first_line: int = 1) -> Iterator[tuple[str, str]]:
    """stream, first_line: read a part of the file (an open text stream) whose first line has
    that number (a shard, analysis/shards.py)."""
    with (open(path, encoding="utf-8") if stream is None else stream) as f:
        if split == "file":
            t = f.read()
            if t.strip():
                yield f"{path}", t
            return
        if split == "line":
            for i, line in enumerate(f, first_line):
                line = line.rstrip("\n")
                if line.strip():
                    yield f"{path}:{i}", line
            return
        block, start = [], first_line
        for i, line in enumerate(f, first_line):
            if line.strip():
                if not block:
                    start = i
                block.append(line)
            elif block:
                yield f"{path}:{start}", "".join(block).rstrip("\n")
                block = []
        if block:
            yield f"{path}:{start}", "".join(block).rstrip("\n")


def _jsonl_documents(path: Path, field: str, stream=None, first_line: int = 1) -> Iterator[tuple[str, object]]:
    with (open(path, encoding="utf-8") if stream is None else stream) as f:
        for i, line in enumerate(f, first_line):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            obj = load_json(line, where, ValueError, what="JSON line")
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object with a {field!r} field, got {type(obj).__name__}")
            if field not in obj:
                raise ValueError(f"{where}: no field {field!r} (fields: {', '.join(list(obj)[:8])}); pick one with --field")
            value = obj[field]
            if isinstance(value, str):
                if value.strip():
                    yield where, value
            elif isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                if any(not -2**63 <= x < 2**63 for x in value):
                    raise ValueError(f"{where}: field {field!r} holds a token id outside int64")
                if value:
                    yield where, np.asarray(value, dtype=np.int64)
            else:
                raise ValueError(f"{where}: field {field!r} must be a string or a list of token ids, "
                                 f"got {type(value).__name__}")


def _id_documents(path: Path, fmt: str, stream=None, first_line: int = 1) -> Iterator[tuple[str, np.ndarray]]:
    if fmt == "npy":
        arr = np.load(path, allow_pickle=False, mmap_mode="r")
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise ValueError(f"{path}: token ids must be integers, got {arr.dtype}")
        if arr.ndim == 1:
            if arr.size:
                yield str(path), np.asarray(arr, dtype=np.int64)
        elif arr.ndim == 2:
            for i in range(arr.shape[0]):
                yield f"{path}[{i}]", np.asarray(arr[i], dtype=np.int64)
        else:
            raise ValueError(f"{path}: expected a 1-D (one document) or 2-D (one per row) array, got shape {arr.shape}")
        return
    with (open(path, encoding="utf-8") if stream is None else stream) as f:
        for i, line in enumerate(f, first_line):
            parts = line.split()
            if not parts:
                continue
            try:
                yield f"{path}:{i}", np.array([int(x) for x in parts], dtype=np.int64)
            except ValueError:
                bad = next(x for x in parts if not x.lstrip("+-").isdigit())
                raise ValueError(f"{path}:{i}: {bad!r} is not an integer token id") from None


def encode_documents(pairs: Iterable[tuple[str, object]], tokenizer, *, add_special_tokens: bool = True,
                     batch: int = 256) -> Iterator[Document]:
    """(name, text or token ids) pairs -> Documents in order, texts tokenized `batch` at a time
    (a run of texts is flushed before the next id document, so the order holds)."""
    pending: list[tuple[str, str]] = []

    def flush():
        if tokenizer is None:
            raise ValueError(f"{pending[0][0]}: this document is text, and no tokenizer can encode it "
                             "(pass tokenizer=PATH to a tokenizer.json)")
        ids = tokenizer.encode_batch([t for _, t in pending], add_special_tokens=add_special_tokens)
        out = [Document(name, np.asarray(i, dtype=np.int64)) for (name, _), i in zip(pending, ids)]
        pending.clear()
        return out

    for name, value in pairs:
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


def iter_documents(files=None, *, texts=None, documents=None, tokenizer=None, field: str = "text",
                   split: str = "line", fmt: str | None = None, add_special_tokens: bool = True,
                   model=None, batch: int = 256) -> Iterator[Document]:
    """Every document of a corpus, in order, as raw token ids (texts tokenized in batches)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")

    def encoded(pairs: Iterable[tuple[str, object]]) -> Iterator[Document]:
        return encode_documents(pairs, tokenizer, add_special_tokens=add_special_tokens, batch=batch)

    if texts is not None:
        yield from encoded((f"texts[{i}]", t) for i, t in enumerate(texts))
    if documents is not None:
        for i, d in enumerate(documents):
            if isinstance(d, Document):
                yield d
            elif isinstance(d, HighwayFile):
                yield Document(f"documents[{i}] ({d.path})", d.token_ids, d.token_mask, d)
            else:
                a = np.asarray(d)
                if a.ndim != 1 or (a.size and (not np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_)):
                    raise ValueError(f"documents[{i}] must be 1-D integer token ids, got {a.dtype}{list(a.shape)}")
                yield Document(f"documents[{i}]", a.astype(np.int64))
    for path in files or ():
        kind = corpus_format(path, fmt)
        if kind == "text":
            yield from encoded(_text_documents(path, split))
        elif kind == "jsonl":
            yield from encoded(_jsonl_documents(path, field))
        elif kind in ("npy", "ids"):
            for name, ids in _id_documents(path, kind):
                yield Document(name, ids)
        elif kind in ("parquet", "arrow"):
            from .records import record_values
            yield from encoded(record_values(path, kind, field))
        else:
            hw = load_highway(path, model)
            yield Document(str(path), hw.token_ids, hw.token_mask, hw)


# Chunks ----------------------------------------------------------------------------------------------

@dataclass
class _Job:
    token_ids: np.ndarray          # [T] int64
    live: np.ndarray               # [T] bool
    row_ids: np.ndarray            # [T, L, C] int64
    windows: np.ndarray | None     # [T, M] int64
    positions: np.ndarray          # [T] int64, position in its sequence
    documents: np.ndarray          # [T] int64, document index
    pieces: list                   # [(HighwayFile | None, t0, t1)] in token order
    n_documents: int               # documents that start here
    seconds: float = 0.0           # producer time (tokenize + hash)


def _trim_history(hasher: EngramHasher, keep: int) -> None:
    """Drop all but the last `keep` entries of a continuous sequence's hash history (only the
    last max_ngram_size - 1 reach a later window)."""
    tail = np.array(hasher.history[-keep:])
    hasher.reset()
    hasher._history[: tail.size] = tail
    hasher._len = tail.size


def _jobs(docs: Iterator[Document], model, chunk_tokens: int, continuous: bool, windows: bool,
          limit_tokens: int | None, first_doc: int = 0) -> Iterator[_Job]:
    """Pack documents into chunks; hash each piece with its sequence's hasher."""
    cfg, tables = model.config, model.hash_tables
    M, pad, vocab = cfg.max_ngram_size, tables.pad_id, tables.token_map.size
    hasher = EngramHasher(tables, capacity=max(chunk_tokens, 1024))
    seq_pos = 0
    buf: dict[str, list] = {}
    n_docs_here = 0
    fill = 0
    total = 0
    t_start = time.perf_counter()
    doc_index = first_doc - 1

    def reset_buf():
        for k in ("ids", "live", "rows", "win", "pos", "doc", "pieces"):
            buf[k] = []

    def emit():
        nonlocal fill, n_docs_here, t_start
        job = _Job(np.concatenate(buf["ids"]), np.concatenate(buf["live"]), np.concatenate(buf["rows"]),
                   np.concatenate(buf["win"]) if windows else None, np.concatenate(buf["pos"]),
                   np.concatenate(buf["doc"]), list(buf["pieces"]), n_docs_here, time.perf_counter() - t_start)
        reset_buf()
        fill, n_docs_here = 0, 0
        t_start = time.perf_counter()
        return job

    reset_buf()
    for doc in docs:
        doc_index += 1
        ids = doc.token_ids
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{doc.name}: token id {int(ids[i])} at position {i} is outside the model's token "
                             f"map [0, {vocab})")
        if doc.mask is not None and doc.mask.shape != ids.shape:
            raise ValueError(f"{doc.name}: its mask has shape {doc.mask.shape}, its token ids {ids.shape}")
        if limit_tokens is not None:
            ids = ids[: max(limit_tokens - total, 0)]
            if ids.size == 0:
                break
        if not continuous:
            hasher.reset()
            seq_pos = 0
        elif hasher.position > _TRIM_HISTORY:
            _trim_history(hasher, M)
        n_docs_here += 1
        a = 0
        while a < ids.size:
            b = min(ids.size, a + chunk_tokens - fill)
            piece = ids[a:b]
            mask = None if doc.mask is None else np.ascontiguousarray(doc.mask[a:b], dtype=np.bool_)
            start = hasher.position
            row_ids = hasher.hash(piece, mask)                                        # [n, L, C]
            buf["ids"].append(piece)
            buf["live"].append(np.ones(piece.size, bool) if mask is None else mask)
            buf["rows"].append(row_ids)
            if windows:
                w = np.empty((piece.size, M), np.int64)
                ngram_windows_from_history(hasher.history, start, piece.size, M, pad, w)
                buf["win"].append(w)
            buf["pos"].append(np.arange(seq_pos, seq_pos + piece.size, dtype=np.int64))
            buf["doc"].append(np.full(piece.size, doc_index, np.int64))
            buf["pieces"].append((doc.highway, a, b))
            seq_pos += piece.size
            fill += piece.size
            total += piece.size
            a = b
            if fill == chunk_tokens:
                yield emit()
                t_start = time.perf_counter()     # a job's seconds leave out the wait for the consumer
        if limit_tokens is not None and total >= limit_tokens:
            break
    if fill:
        yield emit()


# The highway of a chunk ----------------------------------------------------------------------------

class SyntheticBlocks:
    """The synthetic highway by position, from cached blocks of SYNTHETIC_BLOCK tokens (host)."""

    def __init__(self, hc: int, dim: int, cache_bytes: int = 256 << 20):
        from ..pipeline import SYNTHETIC_BLOCK
        self.hc, self.dim, self.block = hc, dim, SYNTHETIC_BLOCK
        self.max_blocks = max(1, cache_bytes // (SYNTHETIC_BLOCK * hc * dim * 4))
        self._cache: OrderedDict = OrderedDict()

    def block_rows(self, b: int) -> np.ndarray:
        from ..pipeline import synthetic_highway
        blk = self._cache.get(b)
        if blk is None:
            blk = synthetic_highway(b * self.block, (b + 1) * self.block, self.hc, self.dim)
            self._cache[b] = blk
            if len(self._cache) > self.max_blocks:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(b)
        return blk

    def runs(self, positions: np.ndarray):
        """[(t0, t1, block, p0)]: maximal runs of consecutive positions inside one block."""
        T = positions.size
        if T == 0:
            return []
        blocks = positions // self.block
        brk = np.flatnonzero((np.diff(positions) != 1) | (np.diff(blocks) != 0)) + 1
        starts = np.concatenate([[0], brk])
        ends = np.concatenate([brk, [T]])
        return [(int(s), int(e), int(blocks[s]), int(positions[s] % self.block)) for s, e in zip(starts, ends)]

    def host(self, positions: np.ndarray) -> np.ndarray:
        out = np.empty((positions.size, self.hc, self.dim), np.float32)      # [T, hc, dim]
        for t0, t1, b, p0 in self.runs(positions):
            out[t0:t1] = self.block_rows(b)[p0:p0 + t1 - t0]
        return out


class DeviceSyntheticBlocks(SyntheticBlocks):
    """The same blocks cached on the device; a chunk is assembled by device-to-device copies."""

    def __init__(self, hc: int, dim: int, max_tokens: int, cache_bytes: int = 2 << 30):
        super().__init__(hc, dim, cache_bytes)
        from numba import cuda
        self._cuda = cuda
        self._dev: OrderedDict = OrderedDict()
        self.buffer = cuda.device_array((max_tokens, hc, dim), dtype=np.float32)     # [T, hc, dim]

    def device(self, positions: np.ndarray, stream=0):
        """The chunk's highway [T, hc, dim] in the device buffer; the copies go on `stream`."""
        out = self.buffer[: positions.size]
        for t0, t1, b, p0 in self.runs(positions):
            blk = self._dev.get(b)
            if blk is None:
                blk = self._cuda.to_device(self.block_rows(b))
                self._dev[b] = blk
                if len(self._dev) > self.max_blocks:
                    self._dev.popitem(last=False)
            else:
                self._dev.move_to_end(b)
            out[t0:t1].copy_to_device(blk[p0:p0 + t1 - t0], stream=stream)
        return out


def _file_highway(job: _Job, layer_ids) -> dict:
    """{layer_id: fp32 [T, hc, dim]} from the chunk's highway-file pieces."""
    return {lid: np.concatenate([hw.chunk(lid, a, b) for hw, a, b in job.pieces]) for lid in layer_ids}


# The driver ------------------------------------------------------------------------------------------

def _describe_corpus(files, texts, documents) -> str:
    parts = [str(f) for f in (files or [])[:3]]
    if files and len(files) > 3:
        parts.append(f"... ({len(files)} files)")
    if texts is not None:
        parts.append("texts")
    if documents is not None:
        parts.append("documents")
    return ", ".join(parts)


def corpus_stats(model, corpus=None, *, texts=None, documents=None, backend="cpu", chunk_tokens: int = 4096,
                 continuous: bool = False, tokenizer=None, field: str = "text", split: str = "line",
                 fmt: str | None = None, add_special_tokens: bool = True, bins: int = 20,
                 max_contexts: int = DEFAULT_MAX_CONTEXTS, contexts: bool = True, rows: bool = True,
                 limit_tokens: int | None = None, progress: bool = False, residual: str = "fp32",
                 versions: dict | None = None, token_table=None, threads: bool = True,
                 reducer_threads: int | None = None, engine=None, device_highway=None,
                 prefetch: bool = True, cuda_versions: dict | None = None,
                 pipelined: bool = True) -> StreamingGateStats:
    """Stream a corpus through the pipeline and keep only statistics (module doc).

    model:        an opened model (load_gguf / load_model).
    corpus:       a path or list of paths (module doc for the formats); or texts=[str], documents=[ids].
    backend:      "reference" | "cpu" | "cuda" or a dict per stage, as Pipeline takes.
    chunk_tokens: tokens per chunk through rows -> proj -> gate (4096: the GPU's sweet spot).
    continuous:   the whole corpus as one sequence (default: each document a fresh one).
    tokenizer:    for text (default: the model's own, `text.tokenizer_for`).
    bins, max_contexts, contexts, rows: see `StreamingGateStats`.
    limit_tokens: stop after this many tokens.
    versions:     kernel record per cuda stage, as Pipeline takes it (`cuda_versions=`: deprecated).
    token_table:  also write the long per-token table to this .parquet (or .csv) file.
    threads:      tokenize+hash and the statistics on their own threads (False: all in order on one).
    reducer_threads: 1 = the statistics of a chunk all on the reducer thread; more (default when the
                  machine has 2 CPUs or more) = each layer (moments, histograms, row bitmap) and each
                  context order on a thread of its own, a few chunks behind at most, the reducer
                  thread only checking each chunk and handing it on. Results are the same either way.
    engine:       an `EngramV41` (max_tokens >= chunk_tokens) for the cuda backend to use. When some of
                  its tables live in host memory (`tables={..: "host"}`), each chunk's rows are
                  prefetched on side streams while the two chunks before it compute
                  (PREFETCH_DEPTH; bit-identical to the unprefetched run;
                  `engine.cache_report()` has the fetch counts).
    prefetch:     False: no prefetch (host-table rows are read when their chunk computes).
    device_highway: for benchmarks, a callable (job positions [T]) -> device highway [T, hc, dim]
                  used instead of the synthetic one.
    pipelined:    with every stage and table on the device, queue each chunk's copies and launches
                  on one stream and read its dot and gate back only after the next chunks are
                  queued (analysis/device_chunks.py; the same statistics bit for bit). False: each
                  chunk through `Pipeline.gates_from_ids`, waited for before the next one.
                  meta["device_chunks"] says which ran (its counts, or why not).
    Returns a StreamingGateStats; its meta holds the settings and timing (seconds per stage).
    """
    from ..pipeline import Pipeline
    from ..text import NoTokenizerError, TokenizerMismatchError, tokenizer_for
    from .tables import TokenTableWriter, token_columns

    from .._argcheck import need_model
    need_model(model)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    for name, v in (("texts", texts), ("documents", documents)):
        if isinstance(v, (str, bytes)):    # would be iterated character by character
            raise TypeError(f"{name} must be a list of {'strings' if name == 'texts' else 'documents'}, got one "
                            f"{type(v).__name__}: {name}=[...]")
    if limit_tokens is not None and (isinstance(limit_tokens, bool) or int(limit_tokens) < 1):
        raise ValueError(f"limit_tokens must be a positive integer, got {limit_tokens!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"corpus format must be one of {FORMATS}, got {fmt!r}")
    if corpus is None and texts is None and documents is None:
        raise ValueError("no corpus: give a path (or paths), texts=[...] or documents=[...]")
    files = corpus_files(corpus) if corpus is not None else []
    kinds = {corpus_format(f, fmt) for f in files}
    needs_text = texts is not None or "text" in kinds
    tok = None
    try:
        tok = tokenizer_for(model, tokenizer, need_encode=needs_text)
    except (NoTokenizerError, TokenizerMismatchError):
        if needs_text or tokenizer is not None:
            raise
    from ..engine_build import versions_keyword
    versions, _ = versions_keyword(versions, cuda_versions, "corpus_stats")
    pipe = Pipeline(model, backend, residual=residual, versions=versions)
    if engine is not None:
        if not pipe.device_resident:
            raise ValueError("engine= is for the cuda backend (rows, proj and gate on cuda)")
        if engine.max_tokens < chunk_tokens:
            raise ValueError(f"engine has max_tokens {engine.max_tokens} < chunk_tokens {chunk_tokens}")
        pipe.use_cuda_engine(engine)
    prefetch_job = None
    if engine is not None and engine.host_layers and prefetch:
        prefetch_job = lambda job: engine.prefetch(job.row_ids)  # noqa: E731
    writer = TokenTableWriter(token_table) if token_table is not None else None
    cfg = model.config
    stats = StreamingGateStats.empty(model, bins=bins, max_contexts=max_contexts, contexts=contexts, rows=rows)
    stats.tokenizer = tok
    docs = iter_documents(files, texts=texts, documents=documents, tokenizer=tok, field=field, split=split, fmt=fmt,
                          add_special_tokens=add_special_tokens, model=model)
    jobs = _jobs(docs, model, int(chunk_tokens), continuous, contexts, limit_tokens)
    synthetic = SyntheticBlocks(cfg.hc, cfg.dim)
    dev_synth = None
    if pipe.device_resident and device_highway is None:
        dev_synth = DeviceSyntheticBlocks(cfg.hc, cfg.dim, int(chunk_tokens))
    token_map = model.hash_tables.token_map
    kinds_seen: set[str] = set()
    timing = {"produce_s": 0.0, "gates_s": 0.0, "reduce_s": 0.0}

    def note_kinds(kinds) -> None:
        kinds_seen.update(kinds)
        if len(kinds_seen) > 1:
            raise ValueError("the corpus mixes documents with highway files and documents without: run them "
                             "separately (a statistic over both would mix real and synthetic hidden states)")

    def highway_for(job: _Job):
        from_file = [p[0] is not None for p in job.pieces]
        note_kinds("file" if f else "synthetic" for f in from_file)
        if all(from_file):
            return _file_highway(job, cfg.layer_ids)
        if device_highway is not None:
            return device_highway(job.positions)
        if dev_synth is not None:
            return dev_synth.device(job.positions)
        return synthetic.host(job.positions)

    def gates(job: _Job) -> Chunk:
        t0 = time.perf_counter()
        out = pipe.gates_from_ids(job.row_ids, highway_for(job), None if job.live.all() else job.live)
        timing["gates_s"] += time.perf_counter() - t0
        return Chunk(job.token_ids, job.live, job.row_ids, job.windows, out, job.n_documents)

    # Every table on the device and the highway made there: chunks are queued ahead on one stream
    # (analysis/device_chunks.py), the same kernels on the same inputs as gates_from_ids.
    chunks_dev = {"runner": None, "why": None if pipe.device_resident and pipelined else
                  ("off (pipelined=False)" if pipe.device_resident else "not every stage on the cuda backend")}

    def runner():
        if chunks_dev["runner"] is None and chunks_dev["why"] is None:
            from .device_chunks import DeviceChunks, eligible
            eng = pipe.cuda_engine_for(int(chunk_tokens))
            chunks_dev["why"] = eligible(pipe, eng)
            if chunks_dev["why"] is None:
                chunks_dev["runner"] = DeviceChunks(eng, pipe.residual, pipe.eps)
        return chunks_dev["runner"]

    def gates_async(job: _Job):
        """Queue job's device work; returns a callable that waits for it and returns its Chunk."""
        dc = runner() if all(p[0] is None for p in job.pieces) else None
        if dc is None:
            return _Ready(gates(job))
        t0 = time.perf_counter()
        pos = job.positions
        if device_highway is not None:
            hw = lambda stream: device_highway(pos)  # noqa: E731
        else:
            hw = lambda stream: dev_synth.device(pos, stream)  # noqa: E731
        note_kinds(("synthetic",))
        done = dc.submit(job.row_ids, hw, None if job.live.all() else job.live)
        timing["gates_s"] += time.perf_counter() - t0

        def result() -> Chunk:
            t1 = time.perf_counter()
            out = done()
            timing["gates_s"] += time.perf_counter() - t1
            return Chunk(job.token_ids, job.live, job.row_ids, job.windows, out, job.n_documents)
        return result

    n_red = min(REDUCER_THREADS, os.cpu_count() or 1) if reducer_threads is None else int(reducer_threads)
    pool = None
    lanes = None
    if n_red > 1:
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(n_red, thread_name_prefix="engram-stats")
        # each layer and each context order on its own thread, a few chunks behind at most: the
        # reducer thread only checks a chunk and hands it on
        keys = stats.lane_keys() if LANES == "all" else list(stats.contexts)
        lanes = {k: ThreadPoolExecutor(1, thread_name_prefix=f"engram-stats-{k}") for k in keys}

    def reduce(job: _Job, chunk: Chunk) -> None:
        t0 = time.perf_counter()
        stats.update(chunk, token_map, pool, lanes)
        if writer is not None:
            strings = tok.token_strings(job.token_ids) if tok is not None else None
            writer.write(token_columns(job.token_ids, job.live, chunk.gates,
                                       {lid: job.row_ids[:, li, :] for li, lid in enumerate(cfg.layer_ids)},
                                       document=job.documents, positions=job.positions, token_strings=strings))
        timing["reduce_s"] += time.perf_counter() - t0

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=limit_tokens, desc="corpus", unit="tok")
    t_wall = time.perf_counter()
    cpu_all = time.process_time()
    try:
        if threads:
            _run_threaded(jobs, gates_async, reduce, bar, timing, prefetch_job)
        else:
            for job in _ahead(jobs, prefetch_job):
                timing["produce_s"] += job.seconds
                reduce(job, gates_async(job)())
                if bar is not None:
                    bar.update(job.token_ids.size)
    finally:
        if chunks_dev["runner"] is not None:
            chunks_dev["runner"].drain()   # nothing left in flight (also after an error)
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
        if pool is not None:
            pool.shutdown()
        if lanes:                          # each lane's CPU seconds, once it has done its chunks
            timing["lanes_cpu_s"] = sum(lane.submit(time.thread_time).result() for lane in lanes.values())
        for lane in (lanes or {}).values():
            lane.shutdown()                # after the chunks it still holds
    wall = time.perf_counter() - t_wall
    stats.finish()                         # raises what a context lane raised
    timing["all_cpu_s"] = time.process_time() - cpu_all     # every thread's, the pool's too (no *_cpu_s of its own)
    timing["wall_s"] = wall
    dc = chunks_dev["runner"]
    if dc is not None:
        timing["gates_wait_s"] = dc.seconds["wait_s"]    # of gates_s: waiting for the device
    stats.meta.update({
        "model": str(getattr(model, "path", "")), "format": str(getattr(model, "format", "")),
        "backends": pipe.backends, "residual": residual, "chunk_tokens": int(chunk_tokens), "continuous": continuous,
        "corpus": _describe_corpus(files, texts, documents),
        "highway": (f"imported from {len(files) or 'in-memory'} highway file(s)" if kinds_seen == {"file"} else
                    "given on the device (benchmark)" if device_highway is not None else SYNTHETIC_CORPUS),
        "tokenizer": getattr(tok, "source", None), "timing": {k: round(v, 4) for k, v in timing.items()},
        "tokens_per_s": round(stats.n_tokens / wall, 1) if wall > 0 else None,
        "token_table": str(token_table) if token_table is not None else None,
        "cuda_kernels": pipe.cuda_kernels,
        "device_chunks": ({"queued_ahead": dc.n_slots - 1, **dc.counts} if dc is not None else chunks_dev["why"])})
    return stats


class _Ready:
    """A chunk computed already (one chunk at a time), as a callable like a queued chunk's result."""

    __slots__ = ("chunk",)

    def __init__(self, chunk):
        self.chunk = chunk

    def __call__(self):
        return self.chunk


PREFETCH_DEPTH = 2      # chunks fetched ahead of the one computing (the fetcher holds depth + 1 buffers)


def _ahead(jobs: Iterator, prefetch, depth: int = PREFETCH_DEPTH) -> Iterator:
    """The jobs in order; with `prefetch`, jobs k+1..k+depth are handed to it before job k is
    yielded (so their rows are fetched while job k computes: a fetch has `depth` chunks' time)."""
    if prefetch is None:
        yield from jobs
        return
    from collections import deque
    pending: deque = deque()
    for job in jobs:
        prefetch(job)
        pending.append(job)
        if len(pending) > depth:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


def _run_threaded(jobs: Iterator[_Job], gates, reduce, bar, timing: dict, prefetch=None,
                  depth: int | None = None) -> None:
    """producer (tokenize + hash) -> this thread (device work) -> reducer (statistics), in order.
    gates(job) queues job's device work and returns a callable that waits for it (-> its Chunk);
    up to `depth` (default: the device-chunk queue's) jobs are queued before the oldest is read
    back. prefetch(job), if given, is called on this thread for jobs k+1..k+PREFETCH_DEPTH before
    job k's device work."""
    from collections import deque

    from .device_chunks import DEPTH
    depth = DEPTH if depth is None else int(depth)
    to_main: queue.Queue = queue.Queue(maxsize=2)
    to_reduce: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    errors: list[BaseException] = []
    DONE = object()

    def put(q, item):
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        cpu = time.thread_time()
        try:
            for job in jobs:
                timing["produce_s"] += job.seconds
                if not put(to_main, job):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)
            stop.set()
        finally:
            timing["produce_cpu_s"] = time.thread_time() - cpu
            put(to_main, DONE)

    def consume():
        cpu = time.thread_time()
        try:
            while True:
                item = to_reduce.get()
                if item is DONE:
                    return
                reduce(*item)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            stop.set()
        finally:
            timing["reduce_cpu_s"] = time.thread_time() - cpu

    producer = threading.Thread(target=produce, name="engram-corpus-producer", daemon=True)
    reducer = threading.Thread(target=consume, name="engram-corpus-reducer", daemon=True)
    def received():
        while not stop.is_set():
            try:
                job = to_main.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is DONE:
                return
            yield job

    producer.start()
    reducer.start()
    in_flight: deque = deque()
    cpu = time.thread_time()

    def hand_on() -> bool:
        job, result = in_flight.popleft()
        if not put(to_reduce, (job, result())):
            return False
        if bar is not None:
            bar.update(job.token_ids.size)
        return True

    try:
        for job in _ahead(received(), prefetch):
            if stop.is_set():
                break
            in_flight.append((job, gates(job)))
            stopped = False
            while in_flight and (len(in_flight) > depth or isinstance(in_flight[0][1], _Ready)):
                if not hand_on():          # a chunk already computed goes on at once
                    stopped = True
                    break
            if stopped:
                break
        while in_flight and not stop.is_set():
            if not hand_on():
                break
    except BaseException:
        stop.set()
        raise
    finally:
        timing["gates_cpu_s"] = time.thread_time() - cpu
        while reducer.is_alive():          # let the reducer finish what it has, then stop
            try:
                to_reduce.put(DONE, timeout=0.1)
                break
            except queue.Full:
                continue
        reducer.join()
        stop.set()
        producer.join(timeout=10)
    if errors:
        raise errors[0]
