"""Tables out: the long per-token table and the aggregate tables, as pandas DataFrames, parquet or CSV.

    df = token_table(cap)                    # one row per (token, layer, stream) of a Capture
    token_table(cap, frame=False)            # the same as a dict of numpy columns (no pandas)
    tabs = corpus.tables()                   # {"streams", "histogram", "tokens", "contexts", "columns"}
    write_tables(tabs, "out/", "parquet")    # one file per table (or "csv")

The long table's columns: document, position, token_id, token (the token string when a tokenizer
is known, else empty), layer, stream, dot, gate, live, row_id_0 .. row_id_{C-1} (the layer's row
ids, repeated on each stream's row). DataFrames and parquet need the `analysis` extra (pandas and
pyarrow); without it the functions say so, and CSV and the dict-of-columns forms still work.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Mapping

import numpy as np

from .._optional import require_pandas, require_pyarrow

TABLE_FORMATS = ("parquet", "csv")


def _layers(capture: Mapping, point: str) -> list[int]:
    out = []
    for name in capture:
        if name.startswith("L") and name.endswith("." + point):
            lid = int(name[1:].split(".", 1)[0])
            if lid not in out:
                out.append(lid)
    return out


def token_columns(token_ids, live, gates: dict, row_ids: dict | None, *, document=0, position0: int = 0,
                  positions=None, token_strings=None) -> dict:
    """The long table as numpy columns from arrays: token_ids [T], live [T] bool,
    gates {layer: (dot [T, hc] or None, gate [T, hc])}, row_ids {layer: [T, C]} or None.
    document: an int, or [T] per token; positions: [T] (default position0 + arange(T))."""
    token_ids = np.asarray(token_ids, np.int64)
    T = token_ids.size
    layers = list(gates)
    hc = np.asarray(gates[layers[0]][1]).shape[1] if layers else 0
    n = T * len(layers) * hc
    doc = np.broadcast_to(np.asarray(document, np.int64), (T,))
    pos = np.arange(position0, position0 + T, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
    rep = len(layers) * hc                                         # rows per token
    cols = {"document": np.repeat(doc, rep), "position": np.repeat(pos, rep),
            "token_id": np.repeat(token_ids, rep)}
    if token_strings is not None:
        cols["token"] = np.repeat(np.asarray(token_strings, dtype=object), rep)
    else:
        cols["token"] = np.full(n, "", dtype=object)
    cols["layer"] = np.tile(np.repeat(np.asarray(layers, np.int64), hc), T)
    cols["stream"] = np.tile(np.arange(hc, dtype=np.int64), T * len(layers))
    dots = np.stack([np.full((T, hc), np.nan, np.float32) if gates[lid][0] is None
                     else np.asarray(gates[lid][0], np.float32) for lid in layers], axis=1)   # [T, L, hc]
    gs = np.stack([np.asarray(gates[lid][1], np.float32) for lid in layers], axis=1)          # [T, L, hc]
    cols["dot"] = dots.reshape(-1)
    cols["gate"] = gs.reshape(-1)
    cols["live"] = np.repeat(np.asarray(live, bool), rep)
    if row_ids:
        ids = np.stack([np.asarray(row_ids[lid], np.int64) for lid in layers], axis=1)       # [T, L, C]
        C = ids.shape[2]
        wide = np.repeat(ids, hc, axis=1).reshape(n, C)                                      # [n, C]
        for c in range(C):
            cols[f"row_id_{c}"] = wide[:, c]
    return cols


def token_table(capture: Mapping, tokenizer=None, *, document: int = 0, frame: bool = True):
    """The long per-token table of one capture (needs `tokens.ids` and `L{id}.gate.gate`; the
    dot, mask and hash ids are used when captured). Token strings from the capture's meta, or
    from `tokenizer` (a Tokenizer or a path). frame=False returns a dict of numpy columns."""
    from .._argcheck import need_capture, need_int
    need_capture(capture)
    need_int(document, "document", 0)
    if "tokens.ids" not in capture:
        raise KeyError("token_table needs `tokens.ids` in the capture")
    token_ids = np.asarray(capture["tokens.ids"], np.int64)
    layers = _layers(capture, "gate.gate")
    if not layers:
        raise KeyError("token_table needs `L{id}.gate.gate` in the capture (was it filtered out by names_filter?)")
    live = np.asarray(capture["tokens.mask"], bool) if "tokens.mask" in capture else np.ones(token_ids.size, bool)
    gates = {lid: (capture[f"L{lid}.gate.dot"] if f"L{lid}.gate.dot" in capture else None, capture[f"L{lid}.gate.gate"])
             for lid in layers}
    ids = {lid: capture[f"L{lid}.hash.ids"] for lid in layers} if all(f"L{lid}.hash.ids" in capture for lid in layers) \
        else None
    strings = None
    if tokenizer is not None:
        from ..text import load_tokenizer
        strings = load_tokenizer(tokenizer).token_strings(token_ids)
    else:
        strings = getattr(capture, "token_strings", None)
        if strings is None:
            meta = getattr(capture, "meta", {}) or {}
            strings = meta.get("token_strings")
    cols = token_columns(token_ids, live, gates, ids, document=document, token_strings=strings)
    if not frame:
        return cols
    pd = require_pandas("token_table")
    df = pd.DataFrame(cols)
    meta = getattr(capture, "meta", {}) or {}
    df.attrs["highway"] = meta.get("highway", "unknown")
    return df


# Aggregate tables ------------------------------------------------------------------------------------

def aggregate_tables(stats, frames: bool = True) -> dict:
    """{name: DataFrame or list of dicts} of a StreamingGateStats:
    streams    one row per layer and stream: n, mean, std, quantiles, min, max, clamp, dot, exact moments
    histogram  layer, stream, bin_lo, bin_hi, count (the report's `bins` over [0, 1])
    tokens     layer, stream, compressed_id, raw_id (most frequent), token, count, mean_gate (seen tokens)
    contexts   order, layer, stream, context (compressed ids, oldest first, space-separated), text, count, mean_gate
    columns    layer, col, order, head, reads, distinct_ids, distinct_contexts, ids_of_contexts, collisions, exact
    Every table carries the highway description (DataFrame.attrs["highway"] / a `highway` key per row is not added)."""
    stats.finish()
    out: dict[str, list] = {}
    rows = []
    for r in stats:
        d = {k: v for k, v in r.__dict__.items() if k != "hist_counts"}
        for what in ("gate", "dot"):
            m = stats.moments(r.layer, r.stream, what)
            d[f"{what}_M2"] = m["M2"]
            d[f"{what}_sum"] = m["sum"]
        d["highway"] = stats.highway
        rows.append(d)
    out["streams"] = rows
    hist = []
    for lid in stats.layer_ids:
        for c in range(stats.hc):
            counts, edges = stats.histogram(lid, c)
            hist += [{"layer": lid, "stream": c, "bin_lo": float(edges[b]), "bin_hi": float(edges[b + 1]),
                      "count": int(counts[b])} for b in range(counts.size)]
    out["histogram"] = hist
    rep = stats.representative_raw()
    seen = np.flatnonzero(stats.tok_count > 0)
    strings = {int(c): stats._string_of_compressed(rep, int(c)) for c in seen}
    scale = stats.fixed_point_scale
    toks = []
    for li, lid in enumerate(stats.layer_ids):
        for c in range(stats.hc):
            mean = stats.tok_gsum[li, c, seen] / np.maximum(stats.tok_count[seen], 1) / scale
            toks += [{"layer": lid, "stream": c, "compressed_id": int(k), "raw_id": int(rep[k]), "token": strings[int(k)],
                      "count": int(stats.tok_count[k]), "mean_gate": float(m)} for k, m in zip(seen, mean)]
    out["tokens"] = toks
    ctx = []
    for n in sorted(stats.contexts):
        t = stats.context_table(n)
        windows = stats.context_windows(n)[:, ::-1]                                  # oldest first
        names = [" ".join(str(int(x)) for x in w) for w in windows]
        texts = []
        for w in windows:
            parts = [stats._string_of_compressed(rep, int(x)) for x in w]
            texts.append(None if any(p is None for p in parts) else "".join(parts))
        for li, lid in enumerate(stats.layer_ids):
            for c in range(stats.hc):
                mean = t.gsum[:, li, c] / np.maximum(t.count, 1) / scale
                ctx += [{"order": n, "layer": lid, "stream": c, "context": names[j], "text": texts[j],
                         "count": int(t.count[j]), "mean_gate": float(mean[j])} for j in range(t.count.size)]
    out["contexts"] = ctx
    out["columns"] = stats.columns() if stats.track_rows else []
    if not frames:
        return out
    pd = require_pandas("the aggregate tables as DataFrames")
    frames_out = {}
    for name, recs in out.items():
        df = pd.DataFrame(recs)
        df.attrs["highway"] = stats.highway
        frames_out[name] = df
    return frames_out


def write_tables(tables: dict, folder, fmt: str = "parquet") -> list[Path]:
    """Write each table to folder/<name>.parquet (or .csv); tables as DataFrames, lists of dicts
    or dicts of columns. CSV needs nothing beyond the standard library."""
    if fmt not in TABLE_FORMATS:
        raise ValueError(f"table format must be one of {TABLE_FORMATS}, got {fmt!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if fmt == "parquet":
        require_pyarrow("write_tables")
        pd = require_pandas("write_tables")
    for name, table in tables.items():
        path = folder / f"{name}.{fmt}"
        if fmt == "parquet":
            df = table if isinstance(table, pd.DataFrame) else pd.DataFrame(table)
            df.to_parquet(path, index=False)
        else:
            _write_csv(path, table)
        written.append(path)
    return written


def _write_csv(path: Path, table) -> None:
    if hasattr(table, "to_csv"):
        table.to_csv(path, index=False)
        return
    if isinstance(table, Mapping):                          # dict of columns
        names = list(table)
        rows = zip(*(np.asarray(table[k]).tolist() for k in names))
    else:                                                   # list of dicts
        names = list(table[0]) if table else []
        for r in table:
            for k in r:
                if k not in names:
                    names.append(k)
        rows = ([r.get(k) for k in names] for r in table)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(names)
        w.writerows(rows)


class TokenTableWriter:
    """Appends the long per-token table chunk by chunk to one parquet (or CSV) file, so a corpus's
    table never has to fit in memory."""

    def __init__(self, path, fmt: str | None = None):
        self.path = Path(path)
        self.fmt = fmt or ("csv" if self.path.suffix == ".csv" else "parquet")
        if self.fmt not in TABLE_FORMATS:
            raise ValueError(f"token table format must be one of {TABLE_FORMATS}, got {self.fmt!r}")
        if self.fmt == "parquet":
            require_pyarrow("the per-token table")
        self._writer = None
        self._csv = None
        self.rows = 0

    def write(self, cols: dict) -> None:
        n = len(next(iter(cols.values())))
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            table = pa.table({k: (pa.array(v.tolist(), type=pa.string()) if v.dtype == object else v)
                              for k, v in cols.items()})
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, table.schema)
            self._writer.write_table(table)
        else:
            if self._csv is None:
                self._csv = open(self.path, "w", newline="", encoding="utf-8")
                self._w = csv.writer(self._csv)
                self._w.writerow(list(cols))
            self._w.writerows(zip(*(np.asarray(v).tolist() for v in cols.values())))
        self.rows += n

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._csv is not None:
            self._csv.close()
            self._csv = None
