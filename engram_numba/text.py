"""Text in, text out: raw token ids from text, and token strings wherever ids are shown.

    tok = en.load_tokenizer("tokenizer.json")      # or a folder holding one, or a GGUF
    ids = en.tokenize(model, "The cat sat.")        # int64 [T] raw ids, with the model's tokenizer
    tok.token_strings(ids)                          # ['<｜begin▁of▁sentence｜>', 'The', ' cat', ...]
    cap = en.Pipeline(model, "cpu").run(text="The cat sat.")   # meta["token_strings"] rides along
    en.compressed_view(model)                       # which raw tokens fold into one compressed id

Where a tokenizer comes from (`tokenizer_for(model)`, first that applies):
  1. the one passed in (a `Tokenizer`, or a path to a tokenizer.json, a folder holding one, or a GGUF);
  2. `model.tokenizer_path` (DeepSeek's Hugging Face checkpoint carries a tokenizer.json);
  3. a GGUF whose metadata holds the whole Hugging Face tokenizer (`tokenizer.huggingface.json`);
  4. a `tokenizer.json` in the model file's folder;
  5. for the tiny fixture model, data/tiny_tokenizer.json;
  6. a GGUF's own vocabulary (`tokenizer.ggml.tokens`, with `.model` / `.merges` / `.pre`): that
     one only **decodes** ids to strings. Encoding text needs the BPE pre-tokenizer's exact split
     rules, which a GGUF names (`tokenizer.ggml.pre`) but does not contain, so `encode` says so
     and asks for a tokenizer.json instead of guessing.

Token strings: each id decoded on its own (`decode([id])`), which is what that token adds to the
text. A token that is a fragment of a multi-byte UTF-8 character decodes to U+FFFD alone; for
those the raw vocabulary string is shown instead (the same rule the compressed token map uses,
docs/math.md section 2). `token_label` makes a string printable on one line (spaces as "␣",
newlines as "\\n") for plot axes and tables.
"""
from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from .errors import EngramError

GGUF_TOKENS = "tokenizer.ggml.tokens"
GGUF_MODEL = "tokenizer.ggml.model"
GGUF_TOKEN_TYPE = "tokenizer.ggml.token_type"
GGUF_MERGES = "tokenizer.ggml.merges"
GGUF_PRE = "tokenizer.ggml.pre"
GGUF_HF_JSON = "tokenizer.huggingface.json"
GGUF_CONTROL = 3            # tokenizer.ggml.token_type of a control (special) token
REPLACEMENT = "\ufffd"


class NoTokenizerError(EngramError, ValueError):
    """The model carries no tokenizer (or none that can encode) and none was given."""


class TokenizerMismatchError(EngramError, ValueError):
    """A tokenizer with more token ids than the model's token map: not this model's tokenizer."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as one printable character (printable Latin-1
    bytes as themselves, the others shifted past U+00FF in byte order)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_OF_CHAR = {c: b for b, c in byte_alphabet().items()}


def token_label(s: str) -> str:
    """A token string on one printable line: spaces as '␣', newline/tab/return escaped, other
    control characters as \\xNN; the empty string as '∅'."""
    if s == "":
        return "∅"
    out = []
    for ch in s:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


class Tokenizer:
    """Raw token ids <-> text for one model (a tokenizer.json through the `tokenizers` library,
    or a GGUF's embedded vocabulary, which decodes only).

    source:     where it was read from; kind: "tokenizer.json" | "gguf (decode only)" | "gguf (tokenizer.huggingface.json)"
    can_encode: False for a GGUF vocabulary alone
    vocab_size: ids it knows (added/special tokens included)
    """

    def __init__(self, *, hf=None, tokens=None, token_types=None, gguf_model: str | None = None,
                 pre: str | None = None, source: str = "", kind: str = "tokenizer.json"):
        self._hf = hf
        self._tokens = tokens               # GGUF vocabulary (StringArray or list of str)
        self._types = None if token_types is None else np.asarray(token_types)
        self.gguf_model = gguf_model
        self.pre = pre
        self.source = str(source)
        self.kind = kind
        self._strings: dict[int, str] = {}

    # what it is ----------------------------------------------------------------------------
    @property
    def can_encode(self) -> bool:
        return self._hf is not None

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return int(self._hf.get_vocab_size(with_added_tokens=True))
        return len(self._tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, {self.vocab_size} tokens, from {self.source})"

    # encode ----------------------------------------------------------------------------------
    def _need_encoder(self) -> None:
        if self._hf is None:
            raise NoTokenizerError(
                f"{self.source}: this GGUF carries its vocabulary (tokenizer.ggml.tokens) but not the "
                f"pre-tokenizer's split rules (tokenizer.ggml.pre = {self.pre!r} only names them), so it can "
                "decode ids to strings but not encode text the way the model's own tokenizer does; pass the "
                "model's tokenizer.json (tokenizer=PATH, or --tokenizer PATH on the command line)")

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Raw token ids int64 [T] of `text` (with the tokenizer's special tokens, e.g. a BOS,
        unless add_special_tokens=False)."""
        self._need_encoder()
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        enc = self._hf.encode(text, add_special_tokens=add_special_tokens)
        self._warn_dropped(text, enc.offsets)
        return np.asarray(enc.ids, dtype=np.int64)

    def _warn_dropped(self, text: str, offsets) -> None:
        """A small vocabulary without byte fallback or an unknown token drops characters it cannot
        spell: say so rather than run on a fraction of the text."""
        covered = np.zeros(len(text) + 1, dtype=bool)
        for start, end in offsets:
            covered[start:end] = True
        dropped = [c for c, ok in zip(text, covered) if not ok and not c.isspace()]
        if dropped:
            import warnings
            shown = "".join(dict.fromkeys(dropped))[:20]
            n = sum(not c.isspace() for c in text)
            warnings.warn(f"tokenizer {self.source} has no token for {len(dropped)} of the text's {n} non-space "
                          f"characters, which it dropped ({shown!r}); the ids cover the rest only",
                          UserWarning, stacklevel=3)

    def encode_batch(self, texts, add_special_tokens: bool = True) -> list[np.ndarray]:
        """`encode` of many texts at once (the tokenizers library runs them on several threads)."""
        self._need_encoder()
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
        return [np.asarray(e.ids, dtype=np.int64)
                for e in self._hf.encode_batch(texts, add_special_tokens=add_special_tokens)]

    # decode ----------------------------------------------------------------------------------
    def _check_ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        arr = arr.reshape(-1).astype(np.int64, copy=False)
        bad = (arr < 0) | (arr >= self.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"token id {int(arr[i])} at position {i} is outside this tokenizer's "
                             f"{self.vocab_size} ids ({self.source})")
        return arr

    def _gguf_bytes(self, i: int) -> bytes:
        s = self._tokens[i]
        if self.gguf_model == "gpt2":
            if all(c in _BYTE_OF_CHAR for c in s):
                return bytes(_BYTE_OF_CHAR[c] for c in s)
            return s.encode("utf-8")                           # a special token, kept as written
        if self.gguf_model == "llama":
            if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
                return bytes([int(s[3:5], 16)])                # sentencepiece byte fallback
            return s.replace("\u2581", " ").encode("utf-8")
        return s.encode("utf-8")

    def _is_control(self, i: int) -> bool:
        return self._types is not None and i < self._types.size and int(self._types[i]) == GGUF_CONTROL

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of a sequence of raw ids."""
        arr = self._check_ids(ids)
        if self._hf is not None:
            return self._hf.decode(arr.tolist(), skip_special_tokens=skip_special_tokens)
        parts = [self._gguf_bytes(int(i)) for i in arr if not (skip_special_tokens and self._is_control(int(i)))]
        return b"".join(parts).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        """The raw vocabulary string of one id (byte-level BPE shows a space as 'Ġ')."""
        i = int(self._check_ids([i])[0])
        if self._hf is not None:
            tok = self._hf.id_to_token(i)
            return "" if tok is None else tok
        return self._tokens[i]

    def token_string(self, i: int) -> str:
        """What one id adds to the text (its raw vocabulary string when it is a fragment of a
        multi-byte character)."""
        i = int(i)
        s = self._strings.get(i)
        if s is None:
            s = self.decode([i])
            if REPLACEMENT in s:
                s = self.id_to_token(i)
            self._strings[i] = s
        return s

    def token_strings(self, ids) -> list[str]:
        """`token_string` of every id of `ids` (any integer shape, flattened)."""
        arr = self._check_ids(ids)
        return [self.token_string(int(i)) for i in arr]

    def token_labels(self, ids) -> list[str]:
        """`token_label(token_string(id))` for every id: one printable line each."""
        return [token_label(s) for s in self.token_strings(ids)]


# Loading --------------------------------------------------------------------------------------

def _require_tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ImportError("reading a tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from None
    return tokenizers


def _from_json_file(path: Path) -> Tokenizer:
    tokenizers = _require_tokenizers()
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: not a tokenizer.json the tokenizers library can read ({exc})") from None
    return Tokenizer(hf=hf, source=str(path), kind="tokenizer.json")


def _from_gguf_kv(kv: Mapping, source: str) -> Tokenizer | None:
    """A GGUF's embedded tokenizer, or None when its metadata has none."""
    hf_json = kv.get(GGUF_HF_JSON)
    if isinstance(hf_json, str) and hf_json.strip():
        tokenizers = _require_tokenizers()
        try:
            hf = tokenizers.Tokenizer.from_str(hf_json)
        except Exception as exc:
            raise ValueError(f"{source}: {GGUF_HF_JSON} is not a tokenizer the tokenizers library can read ({exc})") from None
        return Tokenizer(hf=hf, source=source, kind="gguf (tokenizer.huggingface.json)")
    tokens = kv.get(GGUF_TOKENS)
    if tokens is None:
        return None
    if isinstance(tokens, str) or not hasattr(tokens, "__len__") or len(tokens) == 0:
        raise ValueError(f"{source}: {GGUF_TOKENS} must be a non-empty string array")
    model = kv.get(GGUF_MODEL)
    return Tokenizer(tokens=tokens, token_types=kv.get(GGUF_TOKEN_TYPE), gguf_model=model if isinstance(model, str) else None,
                     pre=kv.get(GGUF_PRE) if isinstance(kv.get(GGUF_PRE), str) else None, source=source,
                     kind="gguf (decode only)")


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_tokenizer(source) -> Tokenizer:
    """A Tokenizer from a tokenizer.json, a folder holding one, a GGUF file (its embedded
    tokenizer), or a Tokenizer (returned as it is)."""
    if isinstance(source, Tokenizer):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a tokenizer is a Tokenizer or a path, got {type(source).__name__}")
    path = Path(source)
    if path.is_dir():
        inner = path / "tokenizer.json"
        if not inner.is_file():
            raise NoTokenizerError(f"folder {path} holds no tokenizer.json")
        return _from_json_file(inner)
    if not path.exists():
        raise NoTokenizerError(f"tokenizer file {path} does not exist")
    if _is_gguf(path):
        from .formats.gguf import _parse_header
        buf = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
        kv = _parse_header(buf, str(path))[1]
        tok = _from_gguf_kv(kv, str(path))
        if tok is None:
            raise NoTokenizerError(f"{path}: this GGUF carries no tokenizer ({GGUF_TOKENS} is absent)")
        return tok
    return _from_json_file(path)


# The tiny fixture model's tokenizer (data/tiny_tokenizer.json; rebuilt in memory when this is
# not a source checkout). Defined here, not in fixtures.py, so that text never imports fixtures.
TINY_MODEL_NAME = "engram-numba tiny V4.1 fixture"      # general.name of data/tiny_v41.gguf
_REPO_DATA = Path(__file__).resolve().parent.parent / "data"
TINY_TOKENIZER_FILE = _REPO_DATA / "tiny_tokenizer.json"
# The tiny model's special tokens, ids 0..2 in both of its tokenizers (this one and the HF copy's,
# fixtures.tiny_tokenizer_json): BOS, EOS and the pad (raw id 2, the tiny hash's pad id). This
# tokenizer also has an unknown token, id 3; the HF copy's byte-level vocabulary has none.
TINY_SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
TINY_UNK_TOKEN = "<unk>"
# byte-level BPE merges, in priority order; every product is a token of the vocabulary
TINY_MERGES = (("t", "h"), ("th", "e"), ("i", "n"), ("in", "g"), ("a", "n"), ("an", "d"), ("e", "r"),
               ("o", "n"), ("r", "e"), ("a", "t"), ("e", "n"), ("o", "f"), ("t", "o"), ("i", "s"),
               ("e", "s"), ("o", "r"), ("a", "r"))


def build_tiny_tokenizer():
    """The tiny model's tokenizer (a `tokenizers.Tokenizer`): a 64-token byte-level BPE.

    Ids 0..3 are BOS, EOS, pad (raw 2, the tiny hash's pad) and <unk>; then a..z, 0..9, the space
    ('Ġ'), . , ' ! ? -, and 17 merges (th, the, in, ing, ...). Text is lower-cased first; any
    other character is <unk>. Every token's normal form (docs/math.md section 2) is different, so
    the compressed token map built from it is the identity, which is the tiny model's map."""
    tk = _require_tokenizers()
    base = list("abcdefghijklmnopqrstuvwxyz0123456789") + ["Ġ"] + list(".,'!?-")
    vocab_list = [*TINY_SPECIAL_TOKENS, TINY_UNK_TOKEN] + base + [a + b for a, b in TINY_MERGES]
    assert len(vocab_list) == 64 == len(set(vocab_list))
    vocab = {t: i for i, t in enumerate(vocab_list)}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=list(TINY_MERGES), unk_token=TINY_UNK_TOKEN, fuse_unk=True))
    tok.normalizer = tk.normalizers.Lowercase()
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(s, special=True, normalized=False)
                            for s in (*TINY_SPECIAL_TOKENS, TINY_UNK_TOKEN)])
    bos = TINY_SPECIAL_TOKENS[0]
    tok.post_processor = tk.processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                          special_tokens=[(bos, 0)])
    return tok


def _is_tiny_model(model) -> bool:
    kv = getattr(model, "kv", None)
    if isinstance(kv, Mapping) and kv.get("general.name") == TINY_MODEL_NAME:
        return True
    try:
        return Path(str(getattr(model, "path", ""))).resolve() == (_REPO_DATA / "tiny_v41.gguf").resolve()
    except OSError:  # pragma: no cover
        return False


def _tiny_tokenizer() -> Tokenizer:
    if TINY_TOKENIZER_FILE.exists():
        return _from_json_file(TINY_TOKENIZER_FILE)
    return Tokenizer(hf=build_tiny_tokenizer(), source="the tiny model's tokenizer (built in memory)")


def tokenizer_for(model, tokenizer=None, *, need_encode: bool = False) -> Tokenizer:
    """The tokenizer of `model` (see the module doc for the order in which one is looked for),
    checked against the model's token map: a tokenizer with more ids than the map is the wrong one.

    need_encode: refuse (with what to do) a tokenizer that can only decode."""
    from ._argcheck import need_model
    need_model(model)
    tok = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        candidates = []
        tp = getattr(model, "tokenizer_path", None)
        if tp:
            candidates.append(lambda: load_tokenizer(tp))
        kv = getattr(model, "kv", None)
        kv = kv if isinstance(kv, Mapping) else {}
        path = Path(str(getattr(model, "path", "")))
        if kv.get(GGUF_HF_JSON):
            candidates.append(lambda: _from_gguf_kv(kv, str(path)))
        sibling = path.parent / "tokenizer.json" if str(path) else None
        if sibling is not None and path.is_file() and sibling.is_file():
            candidates.append(lambda: _from_json_file(sibling))
        if _is_tiny_model(model):
            candidates.append(_tiny_tokenizer)
        if kv.get(GGUF_TOKENS) is not None:
            candidates.append(lambda: _from_gguf_kv(kv, str(path)))
        for make in candidates:
            tok = make()
            if tok is not None:
                break
        if tok is None:
            raise NoTokenizerError(
                f"the model {getattr(model, 'path', '')} carries no tokenizer (no tokenizer_path, no GGUF "
                f"{GGUF_TOKENS}, no tokenizer.json beside it); pass one: tokenizer=PATH to a tokenizer.json "
                "(--tokenizer PATH on the command line)")
    if need_encode:
        tok._need_encoder()
    token_map = getattr(getattr(model, "hash_tables", None), "token_map", None)
    if token_map is not None and tok.vocab_size > token_map.size:
        raise TokenizerMismatchError(f"tokenizer {tok.source} has {tok.vocab_size} token ids but the model's token map has "
                         f"{token_map.size}: it is not this model's tokenizer")
    return tok


def tokenize(model_or_tokenizer, text: str, tokenizer=None, add_special_tokens: bool = True) -> np.ndarray:
    """Raw token ids int64 [T] of `text`.

    model_or_tokenizer: a model (its tokenizer is found as `tokenizer_for` does), a Tokenizer, or a
    path to a tokenizer.json (or a folder holding one). tokenizer: overrides the model's."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not isinstance(model_or_tokenizer, (Tokenizer, str, os.PathLike)):
        from ._argcheck import need_model
        need_model(model_or_tokenizer, "model_or_tokenizer")
    if isinstance(model_or_tokenizer, (Tokenizer, str, os.PathLike)):
        tok = load_tokenizer(tokenizer if tokenizer is not None else model_or_tokenizer)
    else:
        tok = tokenizer_for(model_or_tokenizer, tokenizer, need_encode=True)
    return tok.encode(text, add_special_tokens=add_special_tokens)


# The compressed-id view ---------------------------------------------------------------------------

class CompressedView:
    """Which raw tokens fold into one compressed id (the hash sees only compressed ids).

    view.members(cid)      raw ids of compressed id `cid`, ascending
    view.folded(raw_id)    the raw ids that share `raw_id`'s compressed id
    view.groups(min_size)  [(cid, raw ids)] largest first
    print(view)            the largest groups with their token strings
    view.to_records() / view.to_frame()   one row per raw id: raw_id, compressed_id, group_size, token
    """

    def __init__(self, token_map: np.ndarray, pad_id: int | None = None, tokenizer: Tokenizer | None = None):
        self.token_map = np.asarray(token_map, dtype=np.int64)        # [raw vocab]
        self.pad_id = pad_id
        self.tokenizer = tokenizer
        order = np.argsort(self.token_map, kind="stable")
        self._order = order                                            # raw ids grouped by compressed id
        self._sizes = np.bincount(self.token_map)                      # [compressed vocab]
        self._starts = np.concatenate([[0], np.cumsum(self._sizes)])

    @property
    def n_raw(self) -> int:
        return int(self.token_map.size)

    @property
    def n_compressed(self) -> int:
        return int(self._sizes.size)

    def members(self, compressed_id: int) -> np.ndarray:
        c = int(compressed_id)
        if not 0 <= c < self.n_compressed:
            raise ValueError(f"compressed id {c} is outside [0, {self.n_compressed})")
        return self._order[self._starts[c]:self._starts[c + 1]]

    def folded(self, raw_id: int) -> np.ndarray:
        r = int(raw_id)
        if not 0 <= r < self.n_raw:
            raise ValueError(f"raw token id {r} is outside the token map [0, {self.n_raw})")
        return self.members(int(self.token_map[r]))

    def groups(self, min_size: int = 2) -> list[tuple[int, np.ndarray]]:
        cids = np.flatnonzero(self._sizes >= min_size)
        cids = cids[np.lexsort((cids, -self._sizes[cids]))]            # largest first, then by id
        return [(int(c), self.members(c)) for c in cids]

    def _string(self, raw_id: int) -> str | None:
        if self.tokenizer is None or raw_id >= self.tokenizer.vocab_size:
            return None
        return self.tokenizer.token_string(raw_id)

    def describe_group(self, cid: int, limit: int = 8) -> str:
        ids = self.members(cid)
        items = []
        for r in ids[:limit]:
            s = self._string(int(r))
            items.append(f"{int(r)}" if s is None else f"{int(r)} {token_label(s)!r}")
        more = f", ... ({ids.size - limit} more)" if ids.size > limit else ""
        return f"compressed {cid}: {ids.size} raw token(s): " + ", ".join(items) + more

    def to_records(self) -> list[dict]:
        out = []
        for r in range(self.n_raw):
            c = int(self.token_map[r])
            out.append({"raw_id": r, "compressed_id": c, "group_size": int(self._sizes[c]), "token": self._string(r)})
        return out

    def to_frame(self):
        from ._optional import require_pandas
        pd = require_pandas("CompressedView.to_frame")
        return pd.DataFrame(self.to_records())

    def table(self, limit: int = 20) -> str:
        folded = int((self._sizes >= 2).sum())
        lines = [f"compressed token map: {self.n_raw} raw ids -> {self.n_compressed} compressed ids; "
                 f"{folded} compressed id(s) hold more than one raw token"
                 + ("" if self.tokenizer is not None else " (no tokenizer: ids only)")]
        for c, _ in self.groups()[:limit]:
            lines.append("  " + self.describe_group(c))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{c}</td><td>{ids.size}</td><td>{html.escape(self.describe_group(c).split(': ', 2)[-1])}</td></tr>"
                       for c, ids in self.groups()[:20])
        return (f"<table><caption>{html.escape(self.table(0))}</caption><thead><tr><th>compressed id</th>"
                f"<th>raw tokens</th><th>members</th></tr></thead><tbody>{rows}</tbody></table>")


def compressed_view(model, tokenizer=None) -> CompressedView:
    """The compressed-id view of a model's token map, with token strings when a tokenizer is
    found (`tokenizer_for`; without one the view shows ids only). `model`: a loaded model or a
    path `load_model` opens."""
    if isinstance(model, (str, os.PathLike)):
        from .formats.load import load_model
        model = load_model(model)
    from ._argcheck import need_model
    tables = need_model(model).hash_tables
    tok = None
    try:
        tok = tokenizer_for(model, tokenizer)
    except NoTokenizerError:
        if tokenizer is not None:
            raise
    return CompressedView(tables.token_map, tables.pad_id, tok)


def strings_meta(tok: Tokenizer, ids) -> list[str]:
    """Token strings for a capture's meta (JSON-safe)."""
    return [str(s) for s in tok.token_strings(ids)]
