"""Row edits: change the table rows one n-gram reads and see what moves.

    ed = row_edit(model, "of the", op="zero", context="the end of the day")
    ed.rows            # {layer id: [row ids]}: the rows the n-gram's own order reads (one per head)
    ed.effects         # per layer: tokens whose rows changed, |delta gate|, key/value/highway change
    ed.collateral(access)   # other n-grams of a corpus that read the same rows
    print(ed)

The n-gram is given as text (tokenized without special tokens) or raw token ids; its rows are the
ones its last token reads in the hash columns of its own order (order = its length; one row per
head and engram layer). The edit runs through the pipeline's `L{id}.rows.bf16` hooks on the
context (default: the n-gram alone): every read of an edited row, wherever in the context it
comes from, is replaced (`op="replace"`, `value` = 256 floats or a callable of the row), scaled
(`op="scale"`, `factor`) or zeroed (`op="zero"`), rounded to bf16 as the rows stage's output is.
The baseline and the edited run see the same highway (the synthetic one unless given).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..bf16 import bf16_to_f32, f32_to_bf16

OPS = ("zero", "scale", "replace")


def _ngram_ids(model, ngram, tokenizer) -> np.ndarray:
    if isinstance(ngram, str):
        from ..text import tokenizer_for
        tok = tokenizer_for(model, tokenizer, need_encode=True)
        ids = tok.encode(ngram, add_special_tokens=False)
    else:
        ids = np.asarray(ngram, dtype=np.int64).reshape(-1)
    n = model.config.max_ngram_size
    if not 2 <= ids.size <= n:
        raise ValueError(f"an n-gram has 2..{n} tokens (the hashed orders), got {ids.size}: {ids.tolist()}")
    return ids


def ngram_rows(model, ngram, tokenizer=None) -> dict:
    """{layer id: int64 [n_heads] row ids} the n-gram reads in the columns of its own order."""
    from ..stages.hash.cpu import check_token_ids, hash_tokens
    ids = _ngram_ids(model, ngram, tokenizer)
    check_token_ids(ids, None, model.hash_tables.token_map.size)
    cfg = model.config
    o = ids.size
    last = hash_tokens(model.hash_tables, ids)[-1]       # [L, C]: the window that ends at the last token
    cols = slice((o - 2) * cfg.n_heads, (o - 1) * cfg.n_heads)
    return {lid: last[li, cols].copy() for li, lid in enumerate(cfg.layer_ids)}


@dataclass
class RowEdit:
    ngram_ids: np.ndarray
    rows: dict                 # layer id -> int64 [heads]
    op: str
    context_ids: np.ndarray
    effects: dict              # layer id -> dict
    baseline: object = field(repr=False)
    edited: object = field(repr=False)
    model: object = field(repr=False, default=None)

    def collateral(self, access, tokenizer=None, limit: int = 20) -> dict:
        """Other n-grams of a corpus (an AccessStats) that read an edited row: {layer id: records
        {head, row, ngram (compressed ids), count, text}} sorted by corpus count, at most `limit`
        per layer (the n-gram itself left out)."""
        from .access import _rolling
        ng = access.ngrams()
        o = self.ngram_ids.size
        sel = ng["order"] == o
        win, cnt = ng["window"][sel], ng["train"][sel] + ng["held_out"][sel]
        own = access._token_map[self.ngram_ids[::-1]] if getattr(access, "_token_map", None) is not None else None
        cfg_heads = access.n_heads
        view = None
        if tokenizer is not None or self.model is not None:
            try:
                from ..text import compressed_view, tokenizer_for
                tok = tokenizer_for(self.model, tokenizer)
                view = (compressed_view(self.model, tok), tok)
            except Exception:   # no tokenizer: records without text
                view = None
        out = {}
        for li, lid in enumerate(access.layer_ids):
            if lid not in self.rows:
                continue
            rolling = _rolling(win, np.full(win.shape[0], o, np.int64), access.multipliers[li])
            recs = []
            for h in range(cfg_heads):
                col = (o - 2) * cfg_heads + h
                prime, off = int(access.primes[li, o - 2, h]), int(access.offsets[li, col])
                row = int(self.rows[lid][h])
                hit = np.flatnonzero(rolling % prime + off == row)
                for i in hit:
                    w = win[i, :o]
                    if own is not None and np.array_equal(w, own):
                        continue
                    rec = {"head": h, "row": row, "ngram": w[::-1].tolist(), "count": int(cnt[i])}
                    if view is not None:
                        cv, tok = view
                        rec["text"] = "".join(tok.token_string(int(cv.members(int(c))[0])) if
                                              cv.members(int(c)).size else "?" for c in w[::-1])
                    recs.append(rec)
            recs.sort(key=lambda r: (-r["count"], r["head"], r["ngram"]))
            out[lid] = recs[:limit]
        return out

    def table(self) -> str:
        lines = [f"row edit ({self.op}) of n-gram {self.ngram_ids.tolist()} on a {self.context_ids.size}-token context"]
        for lid, e in self.effects.items():
            lines.append(f"  layer {lid}: rows {self.rows[lid].tolist()}; {e['reads_edited']} reads edited at "
                         f"{len(e['tokens'])} token(s) {e['tokens'][:12]}")
            lines.append(f"    max |delta gate| {e['max_abs_delta_gate']:.4g}, rel. change key {e['key_rel_change']:.4g}, "
                         f"value {e['value_rel_change']:.4g}, highway.out {e['highway_rel_change']:.4g}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    d = float(np.linalg.norm((a - b).ravel()))
    n = float(np.linalg.norm(a.ravel()))
    return d / n if n > 0 else d


def row_edit(model, ngram, *, op: str = "zero", factor: float = 0.0, value=None, context=None, tokenizer=None,
             backend="reference", highway=None) -> RowEdit:
    """Edit the rows `ngram` reads and compare a run of `context` with and without the edit (see
    the module docstring). context: text or raw ids (default: the n-gram itself)."""
    from ..pipeline import Pipeline
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "scale" and not np.isfinite(factor):
        raise ValueError(f"factor must be finite, got {factor!r}")
    ids = _ngram_ids(model, ngram, tokenizer)
    rows = ngram_rows(model, ids)
    head_dim = model.config.head_dim
    repl = None
    if op == "replace":
        if value is None:
            raise ValueError("op='replace' needs value= (head_dim floats, or a callable row_f32 -> row_f32)")
        if not callable(value):
            repl = np.asarray(value, dtype=np.float32).reshape(-1)
            if repl.size != head_dim or not np.isfinite(repl).all():
                raise ValueError(f"value must be {head_dim} finite floats, got {repl.size} values")
    if context is None:
        ctx = ids
    elif isinstance(context, str):
        from ..text import tokenizer_for
        ctx = tokenizer_for(model, tokenizer, need_encode=True).encode(context)
    else:
        ctx = np.asarray(context, dtype=np.int64).reshape(-1)
    pipe = Pipeline(model, backend, tokenizer=tokenizer)
    base = pipe.run(ctx, highway=highway)
    cfg = model.config
    edited_at = {lid: [] for lid in cfg.layer_ids}
    current_ids = {}

    def grab_ids(arr, name):
        current_ids[int(name.split(".")[0][1:])] = np.asarray(arr)

    def edit(arr, name):
        lid = int(name.split(".")[0][1:])
        flat = current_ids[lid].reshape(-1)                 # [T*C] the row id of each bf16 row
        hit = np.flatnonzero(np.isin(flat, rows[lid]))
        if hit.size == 0:
            return None
        out = arr.copy()
        x = bf16_to_f32(out[hit])                            # [n, 256]
        if op == "zero":
            x = np.zeros_like(x)
        elif op == "scale":
            x = x * np.float32(factor)
        elif repl is not None:
            x = np.broadcast_to(repl, x.shape)
        else:
            x = np.stack([np.asarray(value(r), np.float32).reshape(head_dim) for r in x])
        out[hit] = f32_to_bf16(np.ascontiguousarray(x, dtype=np.float32))
        edited_at[lid] = sorted(set(edited_at[lid]) | set((hit // cfg.n_hash_cols).tolist()))
        edit.reads[lid] = edit.reads.get(lid, 0) + int(hit.size)
        return out

    edit.reads = {}
    with pipe.hooks({"L*.hash.ids": grab_ids, "L*.rows.bf16": edit}):
        new = pipe.run(ctx, highway=highway)
    effects = {}
    for lid in cfg.layer_ids:
        p = f"L{lid}."
        g0, g1 = base[p + "gate.gate"], new[p + "gate.gate"]
        effects[lid] = {
            "tokens": edited_at[lid], "reads_edited": edit.reads.get(lid, 0),
            "max_abs_delta_gate": float(np.abs(g1 - g0).max()),
            "delta_gate": (g1 - g0).tolist(),
            "key_rel_change": _rel(bf16_to_f32(base[p + "gate.key"]), bf16_to_f32(new[p + "gate.key"])),
            "value_rel_change": _rel(bf16_to_f32(base[p + "gate.value"]), bf16_to_f32(new[p + "gate.value"])),
            "highway_rel_change": _rel(base[p + "highway.out"], new[p + "highway.out"]),
        }
    return RowEdit(ngram_ids=ids, rows=rows, op=op, context_ids=ctx, effects=effects, baseline=base, edited=new,
                   model=model)
