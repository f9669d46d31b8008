"""Real text that every machine with Python has: the standard library's own source.

    corpus = offline_corpus(max_bytes=2_000_000)     # deterministic: sorted files, fixed order
    corpus.name                                      # says exactly what was read
    docs = corpus_token_ids(corpus, model)           # one int64 array per file (cached on disk)

The files are the `*.py` files under `sysconfig.get_paths()["stdlib"]` (site-packages and
`__pycache__` left out), sorted by their path relative to that folder, read as UTF-8 (undecodable
bytes replaced); each file is one document. With `max_bytes`, files are taken in that order until
the budget is reached (the last one cut at a line end). Python code and its docstrings and
comments: English prose, identifiers, numbers, punctuation and some non-Latin text in tests. The
same Python version gives the same corpus, byte for byte (`corpus.digest`).
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class OfflineCorpus:
    name: str
    root: str
    files: tuple          # relative paths, in corpus order
    texts: tuple          # one string per file
    n_bytes: int
    digest: str           # SHA-256 (first 16 hex digits) of the texts, in order

    def __len__(self) -> int:
        return len(self.texts)


def offline_corpus(max_bytes: int | None = None, root=None) -> OfflineCorpus:
    """The Python standard library's *.py files as a text corpus (see the module docstring)."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"standard library folder {base} does not exist")
    files = sorted((p for p in base.rglob("*.py")
                    if "site-packages" not in p.parts and "__pycache__" not in p.parts and p.is_file()),
                   key=lambda p: p.relative_to(base).as_posix())
    texts, names, total = [], [], 0
    h = hashlib.sha256()
    for p in files:
        t = p.read_bytes().decode("utf-8", errors="replace")
        if not t.strip():
            continue
        b = len(t.encode("utf-8"))
        if max_bytes is not None and total + b > max_bytes:
            room = max_bytes - total
            cut = t.encode("utf-8")[:room].decode("utf-8", errors="ignore")
            cut = cut[: cut.rfind("\n") + 1]
            if cut.strip():
                texts.append(cut)
                names.append(p.relative_to(base).as_posix())
                total += len(cut.encode("utf-8"))
                h.update(cut.encode("utf-8"))
            break
        texts.append(t)
        names.append(p.relative_to(base).as_posix())
        total += b
        h.update(t.encode("utf-8"))
    name = (f"Python {platform.python_version()} standard library source: {len(texts)} *.py files under {base} "
            f"(sorted by path, site-packages left out), {total / 1e6:.2f} MB"
            + (f", cut at {max_bytes:,} bytes" if max_bytes is not None else ""))
    return OfflineCorpus(name=name, root=str(base), files=tuple(names), texts=tuple(texts), n_bytes=total,
                         digest=h.hexdigest()[:16])


def corpus_token_ids(corpus: OfflineCorpus, model, tokenizer=None, *, cache: bool = True) -> list[np.ndarray]:
    """Raw token ids of every document of `corpus` with the model's tokenizer (or `tokenizer`),
    one int64 array per document (BOS as the tokenizer adds it). Tokenizing is slow next to the
    hash, so the result is kept in the toolkit's cache folder (engram_numba.formats.released
    .cache_dir()), keyed by the corpus digest and the tokenizer file's digest."""
    from ..text import tokenizer_for
    tok = tokenizer_for(model, tokenizer, need_encode=True)
    file = None
    src = getattr(tok, "source", None)
    if cache and src and os.path.isfile(str(src)):
        from ..formats.released import cache_dir
        tdig = hashlib.sha256(Path(str(src)).read_bytes()).hexdigest()[:16]
        folder = cache_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            file = folder / f"corpus-{corpus.digest}-{tdig}.npz"
        except OSError:
            file = None
        if file is not None and file.is_file():
            try:
                with np.load(file, allow_pickle=False) as z:
                    flat, bounds = z["ids"], z["bounds"]
                if bounds.size == len(corpus) + 1 and bounds[-1] == flat.size:
                    return [flat[bounds[i]:bounds[i + 1]] for i in range(len(corpus))]
            except (OSError, ValueError, KeyError):
                pass
    docs = [np.asarray(d, dtype=np.int64) for d in tok.encode_batch(list(corpus.texts))]
    if file is not None:
        bounds = np.concatenate([[0], np.cumsum([d.size for d in docs])]).astype(np.int64)
        tmp = file.with_name(file.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, ids=np.concatenate(docs) if docs else np.zeros(0, np.int64), bounds=bounds)
        os.replace(tmp, file)
    return docs
