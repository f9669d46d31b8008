"""The compressed token map of an HF checkpoint, built from its `tokenizer.json` by DeepSeek's
recipe (docs/math.md section 2), with the `tokenizers` library.

For each raw id in order: text = decode([id], skip_special_tokens=False); the key is the raw token
string when text holds U+FFFD (a fragment of a multi-byte character), else text through
NFKC, NFD, StripAccents, Lowercase, [ \\t\\r\\n]+ -> " ", ^ $ -> U+E000, Strip, U+E000 -> " "
(or text itself when that leaves nothing). Keys are numbered in first-seen order.

Building the map decodes every token once (about a second for 129,280 tokens), so it is cached:
in memory for the life of the process (keyed by the file's path, size and modification time),
and, when the caller names a folder, as an .npy file there keyed by the tokenizer's SHA-256.
Nothing is written anywhere the caller did not name.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from .errors import EngramFileError
from .gguf import check_regular_file

_MEMORY: dict[tuple, np.ndarray] = {}


def _normaliser():
    from tokenizers import Regex
    from tokenizers import normalizers as nz
    return nz.Sequence([nz.NFKC(), nz.NFD(), nz.StripAccents(), nz.Lowercase(),
                        nz.Replace(Regex(r"[ \t\r\n]+"), " "), nz.Replace(Regex(r"^ $"), "\ue000"),
                        nz.Strip(), nz.Replace("\ue000", " ")])


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise EngramFileError("building the compressed token map of an HF checkpoint needs the `tokenizers` "
                              "package, a dependency of engram-numba that is missing here: pip install tokenizers") from None
    return tokenizers


def build_token_map(tokenizer_path, n_ids: int | None = None) -> np.ndarray:
    """int64 [n_ids] raw id -> compressed id, by DeepSeek's recipe (no cache). n_ids defaults to
    the tokenizer's size with its added tokens; ids past the tokenizer's last decode to "" and
    share that key."""
    tk = _tokenizers()
    path = str(tokenizer_path)
    check_regular_file(path, "tokenizer")
    try:
        tok = tk.Tokenizer.from_file(path)
    except Exception as exc:
        raise EngramFileError(f"{path}: not a tokenizer.json the tokenizers library can read ({exc})") from None
    have = tok.get_vocab_size(with_added_tokens=True)
    size = os.stat(path).st_size
    if have > size:     # every token takes more than a byte of the file: an id far past the others
        raise EngramFileError(f"{path}: the tokenizer claims {have:,} token ids but the file has {size:,} bytes: "
                              "an added token's id is far past the vocabulary")
    n = have if n_ids is None else int(n_ids)
    if n < 0:
        raise ValueError(f"n_ids must be >= 0, got {n}")
    decoded = min(n, have)
    texts = tok.decode_batch([[i] for i in range(decoded)], skip_special_tokens=False)
    norm = _normaliser()
    keys: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = tok.id_to_token(i) or text
        else:
            key = norm.normalize_str(text) or text
        out[i] = keys.setdefault(key, len(keys))
    if n > decoded:     # ids past the tokenizer's last decode to "" and share that key
        out[decoded:] = keys.setdefault("", len(keys))
    return out


def _is_first_seen_map(m: np.ndarray) -> bool:
    """True when `m` numbers its keys in first-seen order (m[0] = 0, each id at most one past every
    id before it): what the recipe builds. A damaged cache file almost never passes."""
    if m.size == 0:
        return False
    run = np.maximum.accumulate(m)
    return bool(m[0] == 0 and (m >= 0).all() and (m[1:] <= run[:-1] + 1).all())


def compressed_token_map(tokenizer_path, n_ids: int | None = None, cache_dir=None) -> np.ndarray:
    """The compressed token map of `tokenizer_path` (int64 [n_ids], read-only), cached in memory
    and, when `cache_dir` is given, in that folder."""
    path = os.path.realpath(tokenizer_path)
    st = check_regular_file(path, "tokenizer")
    if cache_dir is not None and not Path(cache_dir).is_dir():
        raise EngramFileError(f"token map cache folder {cache_dir} does not exist")
    mkey = (path, st.st_size, st.st_mtime_ns, n_ids)
    if mkey in _MEMORY:
        return _MEMORY[mkey]
    out = None
    if cache_dir is not None:
        cache = Path(cache_dir)
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:20]
        file = cache / f"token_map-{digest}-{'all' if n_ids is None else int(n_ids)}.npy"
        if file.is_file():
            try:
                got = np.load(file, allow_pickle=False)
                if (got.ndim == 1 and got.dtype == np.int64 and (n_ids is None or got.size == n_ids)
                        and _is_first_seen_map(got)):
                    out = got
            except (OSError, ValueError):
                out = None   # a damaged cache file is rebuilt
        if out is None:
            out = build_token_map(path, n_ids)
            tmp = file.with_name(file.name + f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                np.save(f, out, allow_pickle=False)
            os.replace(tmp, file)
    if out is None:
        out = build_token_map(path, n_ids)
    out = np.ascontiguousarray(out, dtype=np.int64)
    out.setflags(write=False)
    _MEMORY[mkey] = out
    return out


def clear_memory_cache() -> None:
    _MEMORY.clear()
