"""Where the gate opens: gate statistics by token class, by n-gram frequency, and the size of the
update the gate lets through. These read a run's captures, so they need weights (the tiny model in
the tests; the real model's files for real answers).

    cap = en.Pipeline(model).run(text="...")
    classes = token_classes(cap["tokens.ids"], tokenizer)      # one class name per token
    gate_by_class(cap, tokenizer)                              # records: layer, stream, class, n, mean, ...
    gate_by_frequency(cap, access)                             # n-gram frequency buckets (an AccessStats)
    update_size(cap)                                           # |gate * value| / |h| per layer and stream

Token classes (one per token, first rule that applies):
    special       a special/added token of the tokenizer (BOS, EOS, pad, chat markers)
    whitespace    only whitespace (spaces, newlines, tabs)
    cjk           holds a CJK ideograph, kana or hangul
    digit         digits only (leading space allowed)
    code          holds a character typical of code and rare in prose: { } [ ] < > = ; _ \\ | & * ^ % ~ $ @ # `
    punctuation   punctuation or symbols only (leading space allowed)
    word-start    a word piece that starts a word: a leading space, or after whitespace, punctuation,
                  a special token or the sequence start
    continuation  a word piece that continues the previous token's word (a multi-token word)
"""
from __future__ import annotations

import unicodedata
from typing import Mapping

import numpy as np

CLASSES = ("word-start", "continuation", "digit", "punctuation", "cjk", "code", "whitespace", "special")
CODE_CHARS = set("{}[]<>=;_\\|&*^%~$@#`")
FREQ_BUCKETS = (1, 2, 10, 100, 1_000, 10_000, 100_000)     # lower edges of the n-gram count buckets


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return (0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x3040 <= o <= 0x30FF or 0xAC00 <= o <= 0xD7AF
            or 0x20000 <= o <= 0x2A6DF or 0xF900 <= o <= 0xFAFF)


def _is_punct(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "PS"


def _special_ids(tokenizer) -> set:
    hf = getattr(tokenizer, "_hf", None)
    if hf is None:
        return set()
    try:
        return {int(i) for i, t in hf.get_added_tokens_decoder().items() if getattr(t, "special", False)}
    except AttributeError:   # pragma: no cover - older tokenizers
        return set()


def classify_string(s: str, previous: str | None, special: bool = False) -> str:
    """The class of one token whose text is `s`, after a token of class `previous` (None at the
    sequence start)."""
    if special:
        return "special"
    if s == "" or s.isspace():
        return "whitespace"
    if any(_is_cjk(c) for c in s):
        return "cjk"
    body = s.lstrip()
    if body.isdigit():
        return "digit"
    if any(c in CODE_CHARS for c in body):
        return "code"
    if all(_is_punct(c) for c in body):
        return "punctuation"
    if s[0].isspace() or previous in (None, "whitespace", "punctuation", "special", "code", "cjk"):
        return "word-start"
    return "continuation"


def token_classes(token_ids, tokenizer) -> list[str]:
    """One class name (CLASSES) per token of one sequence (see the module docstring)."""
    from ..text import load_tokenizer
    tok = load_tokenizer(tokenizer)
    ids = np.asarray(token_ids).reshape(-1)
    special = _special_ids(tok)
    out, prev = [], None
    for i in ids.tolist():
        s = tok.token_string(i)
        c = classify_string(s, prev, i in special)
        if c == "word-start" and prev == "digit" and not s[0].isspace():
            c = "continuation"
        out.append(c)
        prev = c
    return out


def _layers(capture: Mapping) -> list[int]:
    return sorted({int(k.split(".")[0][1:]) for k in capture if k.endswith(".gate.gate")})


def _live(capture: Mapping) -> np.ndarray:
    ids = capture["tokens.ids"]
    return np.asarray(capture["tokens.mask"], bool) if "tokens.mask" in capture else np.ones(ids.size, bool)


def _group_records(capture, labels: np.ndarray, names, key: str) -> list[dict]:
    live = _live(capture)
    out = []
    for lid in _layers(capture):
        g = np.asarray(capture[f"L{lid}.gate.gate"], np.float64)      # [T, hc]
        for c in range(g.shape[1]):
            for name in names:
                sel = live & (labels == name)
                x = g[sel, c]
                rec = {"layer": lid, "stream": c, key: name, "n": int(x.size)}
                if x.size:
                    rec.update(mean=float(x.mean()), std=float(x.std()), median=float(np.median(x)),
                               q10=float(np.quantile(x, 0.1)), q90=float(np.quantile(x, 0.9)))
                else:
                    rec.update(mean=None, std=None, median=None, q10=None, q90=None)
                out.append(rec)
    return out


def gate_by_class(capture: Mapping, tokenizer=None) -> list[dict]:
    """Gate statistics per engram layer, stream and token class (live tokens only): records
    {layer, stream, class, n, mean, std, median, q10, q90}. tokenizer: default the one named in
    the capture's meta, else pass one."""
    if tokenizer is None:
        tokenizer = capture.meta.get("tokenizer") if hasattr(capture, "meta") else None
        if tokenizer is None:
            raise ValueError("gate_by_class needs the tokenizer that made the tokens (tokenizer=PATH or a Tokenizer)")
    labels = np.array(token_classes(capture["tokens.ids"], tokenizer))
    return _group_records(capture, labels, CLASSES, "class")


def ngram_counts_for(token_ids, access, order: int) -> np.ndarray:
    """For each position of one sequence, the corpus count (training + held-out) in `access` (an
    AccessStats) of the n-gram of `order` ending there (as the hash folds it: pad before the start)."""
    from .access import _bits_for, _slot
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    tm = getattr(access, "_token_map", None)
    if tm is None:
        raise ValueError("ngram_counts_for needs an AccessStats built in this process (it maps raw ids)")
    if not 2 <= order <= access.max_ngram_size:
        raise ValueError(f"order must be in 2..{access.max_ngram_size}, got {order}")
    cids = tm[ids]
    bits = _bits_for(max(access.compressed_vocab, access.pad_id + 1))
    table = access.ngram_table(order)
    mask = table.shape[0] - 1
    out = np.zeros(ids.size, np.int64)
    for p in range(ids.size):
        big = 0
        for s in range(order):
            v = access.pad_id if p < s else int(cids[p - s])
            big |= v << (s * bits)
        k1 = big & ((1 << 56) - 1)
        k2 = (big >> 56) | (order << 56)
        i = int(_slot(np.int64(k1), np.int64(k2), mask))
        while table[i, 0] != -1:
            if table[i, 0] == k1 and table[i, 1] == k2:
                out[p] = int(table[i, 2] + table[i, 3])
                break
            i = (i + 1) & mask
    return out


def gate_by_frequency(capture: Mapping, access, order: int = 2, buckets=FREQ_BUCKETS) -> list[dict]:
    """Gate statistics per layer, stream and corpus-frequency bucket of each token's n-gram of
    `order` (counts from `access`, an AccessStats of a corpus; bucket "a-b" holds counts in [a, b),
    "unseen" the n-grams the corpus never had)."""
    counts = ngram_counts_for(capture["tokens.ids"], access, order)
    edges = list(buckets)
    names = ["unseen"] + [f"{a}-{b}" for a, b in zip(edges, edges[1:])] + [f">={edges[-1]}"]
    idx = np.searchsorted(np.asarray(edges), counts, side="right")      # 0 = below the first edge = unseen
    labels = np.array(names, dtype=object)[idx]
    return _group_records(capture, labels, names, f"order{order}_count")


def update_size(capture: Mapping) -> list[dict]:
    """|gate * value| / |h| per layer and stream over live tokens (L2 norms over dim; value is the
    shared bf16 value, h the stream's highway before the update): records {layer, stream, n, mean,
    median, q90, max}. Needs the captures gate.gate, gate.value and highway.in."""
    from ..bf16 import bf16_to_f32
    live = _live(capture)
    out = []
    for lid in _layers(capture):
        need = [f"L{lid}.gate.value", f"L{lid}.highway.in"]
        missing = [n for n in need if n not in capture]
        if missing:
            raise KeyError(f"update_size needs the captures {missing} (run without a names_filter that drops them)")
        gate = np.asarray(capture[f"L{lid}.gate.gate"], np.float64)                # [T, hc]
        vnorm = np.linalg.norm(bf16_to_f32(capture[f"L{lid}.gate.value"]).astype(np.float64), axis=-1)   # [T]
        hnorm = np.linalg.norm(np.asarray(capture[f"L{lid}.highway.in"], np.float64), axis=-1)            # [T, hc]
        ratio = np.abs(gate) * vnorm[:, None] / np.maximum(hnorm, 1e-30)
        for c in range(gate.shape[1]):
            x = ratio[live, c]
            out.append({"layer": lid, "stream": c, "n": int(x.size),
                        "mean": float(x.mean()) if x.size else None,
                        "median": float(np.median(x)) if x.size else None,
                        "q90": float(np.quantile(x, 0.9)) if x.size else None,
                        "max": float(x.max()) if x.size else None})
    return out
