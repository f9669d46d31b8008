"""The static hot-row cache on real text: hit rate against cache size, chunk by chunk (CPU only).

    python -m engram_numba.bench.cache_hits [--max-mb 8] [--budgets 0.0625,0.25,1] [--out FILE]

What it does: the Python standard library's source (`offline_corpus`, real text, no download)
tokenized with the real tokenizer and hashed with the released V4.1 constants
(`released_model()`: the real row ids of both 384M-row tables, no weights needed). Every tenth
document (by its index) is held out; the cache of each budget holds the rows the other documents
read most (`rank_rows`, the ranking `EngramV41.fill_cache` uses), and the held-out documents
are then read in 4096-token chunks, as `corpus_stats` would run them, counting per chunk the hits,
the misses, and the bytes a host-table run would move from host memory and from the cache
(`cache_hit_rates` is the host-side twin of the device counters `RowCache.report` keeps).
Budgets are GB a layer; a budget holds budget / row_bytes rows (Q2_K 84 B, FP8 264 B).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

CHUNK = 4096


def chunk_hits(ranked: np.ndarray, test_ids: np.ndarray, slots: int, row_bytes: int, chunk: int = CHUNK) -> dict:
    """A static cache of the first `slots` rows of `ranked`, read by `test_ids` [n, C] in chunks
    of `chunk` tokens: per chunk hits, misses, host and cache bytes; and the totals."""
    hot = np.sort(ranked[: int(slots)])
    per = []
    for t0 in range(0, test_ids.shape[0], chunk):
        ids = test_ids[t0:t0 + chunk].reshape(-1)
        if hot.size:
            pos = np.minimum(np.searchsorted(hot, ids), hot.size - 1)
            h = int(np.count_nonzero(hot[pos] == ids))
        else:
            h = 0
        m = int(ids.size - h)
        per.append({"tokens": int(min(chunk, test_ids.shape[0] - t0)), "hits": h, "misses": m,
                    "host_bytes": m * row_bytes, "cache_bytes": h * row_bytes})
    hits = sum(p["hits"] for p in per)
    reads = sum(p["hits"] + p["misses"] for p in per)
    rates = np.array([p["hits"] / max(1, p["hits"] + p["misses"]) for p in per])
    return {"slots": int(hot.size), "hit_rate": hits / max(1, reads), "hits": hits, "misses": reads - hits,
            "host_bytes_per_chunk": round((reads - hits) * row_bytes / max(1, len(per))),
            "cache_bytes_per_chunk": round(hits * row_bytes / max(1, len(per))),
            "chunk_hit_rate": {"min": round(float(rates.min()), 4), "median": round(float(np.median(rates)), 4),
                               "max": round(float(rates.max()), 4)} if per else {},
            "per_chunk": per}


def run(max_mb: float = 8.0, budgets=(0.0625, 0.25, 1.0), log=print, model=None, docs=None) -> dict:
    from ..analysis.offline_corpus import corpus_token_ids, offline_corpus
    from ..device.hostrows import rank_rows
    from .corpus import token_ids_by_layer
    t0 = time.perf_counter()
    meta = {}
    if model is None:
        from ..formats.released import released_model
        model = released_model()
        meta["model"] = "released_model() (the V4.1 hash constants and token map, 384M-row tables)"
    if docs is None:
        corpus = offline_corpus(int(max_mb * 1e6))
        docs = [d for d in corpus_token_ids(corpus, model) if d.size]
        meta["corpus"] = corpus.name
        meta["corpus_digest"] = corpus.digest
    held = [d for i, d in enumerate(docs) if i % 10 == 0]
    train = [d for i, d in enumerate(docs) if i % 10 != 0]
    tr, te = token_ids_by_layer(model, train), token_ids_by_layer(model, held)
    log(f"cache hits: {sum(d.size for d in train):,} training tokens, {sum(d.size for d in held):,} held out "
        f"({time.perf_counter() - t0:.1f} s to tokenize and hash)")
    out = {"stage": "cache_hit_rate", "chunk_tokens": CHUNK, "budgets_gb": list(budgets), **meta,
           "n_tokens": {"train": int(sum(d.size for d in train)), "held_out": int(sum(d.size for d in held))},
           "n_documents": {"train": len(train), "held_out": len(held)}, "layers": {}}
    for li, lid in enumerate(model.config.layer_ids):
        ranked = rank_rows(tr[li])
        lay = {"distinct_training_rows": int(ranked.size), "budgets": {}}
        for enc, rb in (("q2k", 84), ("fp8", 264)):
            for gb in budgets:
                r = chunk_hits(ranked, te[li], int(gb * 1e9) // rb, rb)
                lay["budgets"][f"{gb:g} GB {enc}"] = {"gb": gb, "encoding": enc, "row_bytes": rb, **r}
                log(f"  layer {lid}, {gb:g} GB a layer of {enc} rows ({r['slots']:,} rows): hit rate "
                    f"{r['hit_rate']:.3f} (chunks {r['chunk_hit_rate'].get('min', 0):.3f}.."
                    f"{r['chunk_hit_rate'].get('max', 0):.3f}); per chunk {r['host_bytes_per_chunk'] / 1e6:.2f} MB "
                    f"from host memory, {r['cache_bytes_per_chunk'] / 1e6:.2f} MB from the cache")
        out["layers"][str(lid)] = lay
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv=None) -> int:
    import argparse

    from .timing import commit
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-mb", type=float, default=8.0, help="MB of standard-library text (default 8)")
    p.add_argument("--budgets", default="0.0625,0.25,1", help="cache GB a layer, comma list")
    p.add_argument("--out", default=None, help="write the result JSON here")
    a = p.parse_args(argv)
    try:
        budgets = tuple(float(x) for x in a.budgets.split(",") if x.strip())
        if not budgets or any(not np.isfinite(b) or b < 0 for b in budgets) or a.max_mb <= 0:
            raise ValueError
    except ValueError:
        print(f"error: --budgets must be GB >= 0 (comma list) and --max-mb > 0, got {a.budgets!r}, {a.max_mb}",
              file=sys.stderr)
        return 2
    res = run(a.max_mb, budgets)
    res["commit"] = commit()
    res["command"] = "python -m engram_numba.bench.cache_hits " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
