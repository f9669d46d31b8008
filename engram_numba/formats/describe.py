"""`engram-numba info`: what a model file holds and which checks it passes, for every format.

`describe_dict(model)` is plain data (`info --json`); `describe(model)` renders it for people.
Both use only the model protocol (formats/model.py) plus what a format adds (`kv`, `tensors`,
`shards`, `checks`, `problems`, and `gguf` / `container` details), so every format is described
the same way.
"""
from __future__ import annotations

import os

import numpy as np

from .gguf import StringArray, human_bytes
from .rowcheck import count_nonfinite_rows

# `info` scans a table for rows that decode to NaN/inf on its own when the table is at most this
# big (the tiny models, test files); a released table (30-95 GiB) is scanned only when asked.
AUTO_SCAN_BYTES = 1 << 30


def _short_value(value, limit: int = 4) -> str:
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (np.ndarray, list, StringArray)):
        n = len(value)
        head = [value[i] for i in range(min(n, limit))]
        head = [int(x) if isinstance(x, np.integer) else float(x) if isinstance(x, np.floating) else x
                for x in head]
        body = ", ".join(repr(x) if isinstance(x, str) else str(x) for x in head)
        return f"{n} entries [{body}{', ...' if n > limit else ''}]"
    return str(value)


def _json_value(value, limit: int = 8):
    if isinstance(value, (np.ndarray, list, StringArray)):
        n = len(value)
        head = [value[i] for i in range(min(n, limit))]
        head = [int(x) if isinstance(x, (np.integer, bool)) else float(x) if isinstance(x, np.floating) else
                (x if isinstance(x, (str, int, float)) else str(x)) for x in head]
        return {"count": n, "head": head}
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _json_value(v, limit) for k, v in value.items()}
    return value


def _exact_row_sums(model) -> list[int] | None:
    sums = getattr(model, "row_sums", "unset")
    if sums != "unset":
        return sums
    t = model.hash_tables
    return [sum(int(p) for p in t.primes[li].ravel().tolist()) for li in range(t.n_layers)]


def _table_bytes(lf) -> int:
    n = int(lf.table.nbytes)
    if lf.table_scales is not None:
        n += int(lf.table_scales.nbytes)
    return n


def describe_dict(model, scan_rows: bool | None = None) -> dict:
    """What `describe` shows, as plain data (`engram-numba info --json`).

    scan_rows: count each table's rows that decode to NaN/inf (reads every row's scale bytes);
    None scans tables up to AUTO_SCAN_BYTES and leaves bigger ones unscanned (reported as null)."""
    from .._argcheck import need_model
    need_model(model)
    c, t = model.config, model.hash_tables
    checks = []
    sums = _exact_row_sums(model)
    for li, lid in enumerate(c.layer_ids):
        have = model.layers[lid].n_rows
        want = None if sums is None else sums[li]
        checks.append({"check": f"layer {lid}: primes sum vs table rows", "primes_sum": want, "table_rows": have,
                       "ok": want == have})
    checks += [dict(x) for x in getattr(model, "checks", [])]
    checks.append({"check": "cuda gate kernels need dim % 8 == 0", "dim": c.dim, "ok": c.dim % 8 == 0})
    layers = {}
    for lid, lf in model.layers.items():
        size = _table_bytes(lf)
        scan = scan_rows if scan_rows is not None else size <= AUTO_SCAN_BYTES
        entry = {"table_encoding": lf.table_encoding, "table_rows": lf.n_rows, "row_bytes": int(lf.row_bytes),
                 "table_bytes": size, "table_scales": lf.table_scales is not None,
                 "wkv_encoding": lf.wkv_encoding, "wkv_type": lf.wkv_type, "nonfinite_rows": None}
        if scan:
            n, first = count_nonfinite_rows(lf.table, lf.table_encoding, lf.table_scales)
            entry["nonfinite_rows"] = n
            checks.append({"check": f"layer {lid}: rows that decode to NaN/inf", "count": n,
                           "first_row": first if n else None, "ok": n == 0})
        layers[str(lid)] = entry
    shards = [{"path": p, "bytes": os.stat(p).st_size if os.path.exists(p) else None}
              for p in getattr(model, "shards", [model.path])]
    out = {
        "file": model.path, "format": model.format, "shards": shards,
        "config": {"dim": c.dim, "hc": c.hc, "layer_ids": list(c.layer_ids), "max_ngram_size": c.max_ngram_size,
                   "n_heads": c.n_heads, "head_dim": c.head_dim, "n_hash_cols": c.n_hash_cols,
                   "proj_in": c.proj_in, "proj_out": c.proj_out, "eps": c.eps},
        "hash": {"raw_vocab": int(t.token_map.size), "compressed_vocab": int(t.compressed_vocab_size),
                 "pad_id": int(t.pad_id), "table_rows": [None if s is None else int(s) for s in (sums or [None] * t.n_layers)],
                 "source": getattr(model, "hash_source", "file metadata")},
        "layers": layers,
        "metadata": {k: {"type": model.kv_types.get(k, "?"), "value": _json_value(v)} for k, v in model.kv.items()},
        "tensors": [{"name": n, "type": i.type_name, "shape": list(i.shape), "ne": list(i.ne), "offset": i.offset,
                     "bytes": i.nbytes, "shard": i.shard} for n, i in model.tensors.items()],
        "checks": checks, "problems": list(model.problems),
    }
    if hasattr(model, "version"):
        out["gguf"] = {"version": model.version, "alignment": model.alignment, "data_offset": model.data_offset}
    if getattr(model, "tokenizer_path", None):
        out["tokenizer"] = model.tokenizer_path
    return out


def ok(info: dict) -> bool:
    """True when every check passed and nothing was let through."""
    return not info["problems"] and all(ch.get("ok", True) for ch in info["checks"])


def describe(model, scan_rows: bool | None = None, info: dict | None = None) -> str:
    """Human-readable summary of an opened model, for `engram-numba info PATH`."""
    from .._argcheck import need_model
    need_model(model)
    d = info if info is not None else describe_dict(model, scan_rows)
    c, t, h = model.config, model.hash_tables, d["hash"]
    lines = [f"file      {model.path}", f"format    {model.format}"]
    if "gguf" in d:
        g = d["gguf"]
        lines.append(f"          GGUF v{g['version']}, alignment {g['alignment']}, data at byte {g['data_offset']}"
                     + (" (first shard)" if len(d["shards"]) > 1 else ""))
    if len(d["shards"]) > 1:
        lines.append(f"shards    {len(d['shards'])}")
        lines += [f"  {i + 1}  {s['path']}  {human_bytes(s['bytes'])}" for i, s in enumerate(d["shards"])]
    if d.get("tokenizer"):
        lines.append(f"tokenizer {d['tokenizer']}")
    lines += ["", "configuration",
              f"  dim {c.dim}   hc {c.hc}   layers {list(c.layer_ids)}   max_ngram_size {c.max_ngram_size} "
              f"(orders {c.n_orders})   heads {c.n_heads}   head_dim {c.head_dim}   eps {c.eps:g}",
              f"  n_hash_cols {c.n_hash_cols}   projection K {c.proj_in} -> N {c.proj_out}   "
              f"token map {t.token_map.size} raw -> {t.compressed_vocab_size} compressed, pad {t.pad_id}",
              f"  hash constants from {h['source']}", "", "layers"]
    for lid, e in d["layers"].items():
        scan = "not scanned (pass --scan-rows)" if e["nonfinite_rows"] is None else str(e["nonfinite_rows"])
        lines.append(f"  layer {lid}: {e['table_encoding']} table, {e['table_rows']} rows x {e['row_bytes']} B "
                     f"({human_bytes(e['table_bytes'])}{', scales apart' if e['table_scales'] else ''}), "
                     f"{e['wkv_encoding']} wkv; rows decoding to NaN/inf: {scan}")
    lines += ["", f"metadata ({len(model.kv)} keys)"]
    w = max((len(k) for k in model.kv), default=0)
    for key, value in model.kv.items():
        lines.append(f"  {key:<{w}}  {model.kv_types.get(key, '?'):<9} {_short_value(value)}")
    lines += ["", f"tensors ({len(model.tensors)})"]
    w = max((len(n) for n in model.tensors), default=0)
    multi = len(d["shards"]) > 1
    for name, info in model.tensors.items():
        lines.append(f"  {name:<{w}}  {info.type_name:<7} numpy {str(list(info.shape)):<14} "
                     f"ne {str(list(info.ne)):<14} {human_bytes(info.nbytes)}"
                     + (f"  shard {info.shard + 1}" if multi else ""))
    lines += ["", "primes vs table rows"]
    sums = h["table_rows"]
    for li, lid in enumerate(c.layer_ids):
        want, have = sums[li], model.layers[lid].n_rows
        if want is None:
            lines.append(f"  layer {lid}: primes sum does not fit in int64, table rows {have}  OVERFLOW")
        else:
            lines.append(f"  layer {lid}: primes sum {want}, table rows {have}  {'OK' if want == have else 'MISMATCH'}")
    others = [ch for ch in d["checks"] if not ch["check"].endswith("primes sum vs table rows")]
    if others:
        lines += ["", "checks"]
        for ch in others:
            extra = "" if "count" not in ch else f": {ch['count']}" + (
                f" (first row {ch['first_row']})" if ch.get("first_row") is not None else "")
            lines.append(f"  {ch['check']}{extra}  {'OK' if ch['ok'] else 'FAILED'}")
    if model.problems:
        lines += ["", "problems (opened with validate=False)"] + [f"  {m}" for m in model.problems]
    return "\n".join(lines)
