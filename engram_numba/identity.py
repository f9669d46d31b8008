"""A model's identity: what must agree for two results to come from the same Engram model.

    ident = model_identity(model)
    # {"hash": "3f0c...", "token_map": "9a1e...", "encodings": {"1": "q2k/q2k", "14": "q2k/q2k"},
    #  "layer_ids": [1, 14]}

- `hash`: a digest of every hash constant (layer ids, max_ngram_size, heads, multipliers, primes,
  offsets, the compressed pad id);
- `token_map`: a digest of the raw -> compressed token map;
- `encodings`: per layer, the table's and the projection's encodings ("table/wkv").

Statistics carry it (merging those of two models is refused), hashers are checked by it
(`Pipeline.run(hasher=)`), and captures keep it in their meta (`diff` warns when two captures'
identities differ). `identity_mismatch` compares two identities, field by field, over the fields
both know (an identity read from an older file may lack one).
"""
from __future__ import annotations

import hashlib

import numpy as np

FIELDS = ("hash", "token_map", "encodings")
_WHAT = {"hash": "hash constants", "token_map": "token maps", "encodings": "table/wkv encodings"}


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        a = np.ascontiguousarray(np.asarray(p, dtype=np.int64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def tables_digest(tables) -> tuple[str, str]:
    """(hash-constants digest, token-map digest) of an EngramHashTables, computed once per object."""
    cached = getattr(tables, "_identity_digest", None)
    if cached is not None:
        return cached
    t = tables
    consts = _digest(list(t.layer_ids), [t.max_ngram_size, t.n_heads, t.pad_id], t.multipliers, t.primes, t.offsets)
    out = (consts, _digest(t.token_map))
    try:
        object.__setattr__(t, "_identity_digest", out)
    except (AttributeError, TypeError):
        pass
    return out


def constants_digest(layer_ids, max_ngram: int, n_heads: int, pad_id: int, multipliers, primes, offsets) -> str:
    """The `hash` field from the constants themselves (as a statistics file stores them)."""
    return _digest(list(layer_ids), [max_ngram, n_heads, pad_id], multipliers, primes, offsets)


def token_map_digest(token_map) -> str:
    return _digest(token_map)


def check_hasher(hasher, tables):
    """`hasher` when it is an EngramHasher on these tables (the same object, or equal constants and
    token map); else a TypeError / ValueError saying what differs."""
    from .stages.hash.cpu import EngramHasher
    if not isinstance(hasher, EngramHasher):
        raise TypeError(f"hasher must be an EngramHasher, got {type(hasher).__name__}")
    if hasher.tables is not tables:
        a, b = tables_digest(hasher.tables), tables_digest(tables)
        differ = [w for w, x, y in zip(("hash constants", "token map"), a, b) if x != y]
        if differ:
            raise ValueError(f"hasher was built on another model's tables (a different {' and '.join(differ)}): "
                             "use EngramHasher(model.hash_tables)")
    return hasher


def model_identity(model) -> dict:
    """The identity of an opened model (module doc)."""
    consts, tmap = tables_digest(model.hash_tables)
    enc = {}
    for lid in model.config.layer_ids:
        lf = model.layers[lid]
        enc[str(lid)] = f"{getattr(lf, 'table_encoding', '?')}/{getattr(lf, 'wkv_encoding', '?')}"
    return {"hash": consts, "token_map": tmap, "encodings": enc, "layer_ids": [int(x) for x in model.config.layer_ids]}


def identity_mismatch(a: dict | None, b: dict | None) -> list[str]:
    """What differs between two identities ("hash constants", "token maps", ...), over the fields
    both carry; [] when they agree or either is unknown."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return []
    return [_WHAT[f] for f in FIELDS if a.get(f) is not None and b.get(f) is not None and a[f] != b[f]]


def check_identity(value, source: str, error: type[Exception]) -> dict | None:
    """An identity read back from a file: None, or a dict of the known fields with string digests."""
    if value is None:
        return None
    ok = isinstance(value, dict) and all(
        (value.get(f) is None or isinstance(value.get(f), str)) for f in ("hash", "token_map")) and (
        value.get("encodings") is None or (isinstance(value["encodings"], dict)
                                           and all(isinstance(v, str) for v in value["encodings"].values())))
    lids = value.get("layer_ids") if isinstance(value, dict) else None
    if lids is not None and not (isinstance(lids, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in lids)):
        ok = False
    if not ok:
        raise error(f"{source}: the model identity is not an object of digests")
    out = {f: value.get(f) for f in FIELDS}
    if lids is not None:
        out["layer_ids"] = lids
    return out
