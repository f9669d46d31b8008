"""Hot-row caches on real text: hit rate against cache size, static vs dynamic (CLOCK) vs ideal
LRU, chunk by chunk (CPU only).

    python -m engram_numba.bench.cache_hits [--max-mb 8] [--budgets 0.0625,0.25,1] [--out FILE]

What it does: the Python standard library's source (`offline_corpus`, real text, no download)
tokenized with the real tokenizer and hashed with the released V4.1 constants
(`released_model()`: the real row ids of both 384M-row tables, no weights needed). Every tenth
document (by its index) is held out; hit rates are counted on the held-out documents' reads, in
4096-token chunks as `corpus_stats` would run them. Budgets are GB a layer; a budget holds
budget / row_bytes rows (Q2_K 84 B, FP8 264 B).

Policies:
  static   the rows the other (training) documents read most (`rank_rows`, the ranking
           `EngramV41.fill_cache` uses): per chunk hits, misses, host and cache bytes
           (`cache_hit_rates` is the host-side twin of the device counters `RowCache.report` keeps)
  clock    the device's dynamic cache (`ClockCache`, CLOCK_WAYS ways a set), through its exact CPU
           twin `clock_cache_sim`: "warm" streams the training documents through it first (a long
           corpus run's steady state), "cold" starts empty on the held-out documents; the 1- and
           8-way variants (warm) show what the associativity buys
  lru      an ideal fully associative LRU of the same rows, read by read (no chunking: a row read
           twice in a chunk hits the second time, which the chunked device cache cannot), from
           exact stack distances (`lru_stack_distances`), warm and cold as above
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


def run(max_mb: float = 8.0, budgets=(0.0625, 0.25, 1.0), log=print, model=None, docs=None,
        chunk: int = CHUNK, docs_cache=None) -> dict:
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
        meta["corpus"] = corpus.name
        meta["corpus_digest"] = corpus.digest
        cached = None
        if docs_cache is not None:                       # token ids of this very corpus, kept from a run before
            from pathlib import Path
            if Path(docs_cache).exists():
                with np.load(docs_cache) as z:
                    if str(z["digest"]) == corpus.digest:
                        cached = [z[f"d{i}"] for i in range(int(z["n"]))]
        if cached is None:
            cached = [d for d in corpus_token_ids(corpus, model) if d.size]
            if docs_cache is not None:
                np.savez(docs_cache, n=len(cached), digest=corpus.digest, **{f"d{i}": d for i, d in enumerate(cached)})
        docs = cached
    held = [d for i, d in enumerate(docs) if i % 10 == 0]
    train = [d for i, d in enumerate(docs) if i % 10 != 0]
    tr, te = token_ids_by_layer(model, train), token_ids_by_layer(model, held)
    log(f"cache hits: {sum(d.size for d in train):,} training tokens, {sum(d.size for d in held):,} held out "
        f"({time.perf_counter() - t0:.1f} s to tokenize and hash)")
    out = {"stage": "cache_hit_rate", "chunk_tokens": chunk, "budgets_gb": list(budgets), **meta,
           "n_tokens": {"train": int(sum(d.size for d in train)), "held_out": int(sum(d.size for d in held))},
           "n_documents": {"train": len(train), "held_out": len(held)}, "layers": {}}
    for li, lid in enumerate(model.config.layer_ids):
        ranked = rank_rows(tr[li])
        lay = {"distinct_training_rows": int(ranked.size), "budgets": {}}
        for enc, rb in (("q2k", 84), ("fp8", 264)):
            for gb in budgets:
                r = chunk_hits(ranked, te[li], int(gb * 1e9) // rb, rb, chunk=chunk)
                lay["budgets"][f"{gb:g} GB {enc}"] = {"gb": gb, "encoding": enc, "row_bytes": rb, **r}
                log(f"  layer {lid}, {gb:g} GB a layer of {enc} rows ({r['slots']:,} rows): hit rate "
                    f"{r['hit_rate']:.3f} (chunks {r['chunk_hit_rate'].get('min', 0):.3f}.."
                    f"{r['chunk_hit_rate'].get('max', 0):.3f}); per chunk {r['host_bytes_per_chunk'] / 1e6:.2f} MB "
                    f"from host memory, {r['cache_bytes_per_chunk'] / 1e6:.2f} MB from the cache")
        lay["dynamic"] = _dynamic(tr[li], te[li], budgets, log, lid, chunk=chunk)
        for key, dyn in lay["dynamic"].items():
            lay["budgets"][key]["clock_hit_rate"] = dyn["clock"]["warm"]["hit_rate"]
            lay["budgets"][key]["lru_hit_rate"] = dyn["lru"]["warm"]["hit_rate"]
        out["layers"][str(lid)] = lay
    out["summary"] = [{"layer": int(lid), "budget": key, "static": round(b["hit_rate"], 4),
                       "clock_warm": round(lay["dynamic"][key]["clock"]["warm"]["hit_rate"], 4),
                       "clock_cold": round(lay["dynamic"][key]["clock"]["cold"]["hit_rate"], 4),
                       "lru_warm": round(lay["dynamic"][key]["lru"]["warm"]["hit_rate"], 4),
                       "lru_cold": round(lay["dynamic"][key]["lru"]["cold"]["hit_rate"], 4)}
                      for lid, lay in out["layers"].items() for key, b in lay["budgets"].items()]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _chunks(ids: np.ndarray, chunk: int) -> list:
    return [ids[t0:t0 + chunk].reshape(-1) for t0 in range(0, ids.shape[0], chunk)]


def _rates(hits: np.ndarray, reads: np.ndarray) -> dict:
    r = hits / np.maximum(reads, 1)
    return {"hit_rate": float(hits.sum() / max(1, reads.sum())),
            "chunk_hit_rate": {"min": round(float(r.min()), 4), "median": round(float(np.median(r)), 4),
                               "max": round(float(r.max()), 4)} if r.size else {}}


def _dynamic(train_ids: np.ndarray, test_ids: np.ndarray, budgets, log, lid, chunk: int = CHUNK,
             ways_variants=(1, 8)) -> dict:
    """CLOCK (the device policy's twin) and ideal LRU on one layer's reads, warm and cold (module doc)."""
    from ..device.hostrows import CLOCK_WAYS, clock_cache_sim, clock_sets, lru_stack_distances
    train_c, test_c = _chunks(train_ids, chunk), _chunks(test_ids, chunk)
    n_test = int(test_ids.size)
    d_warm = lru_stack_distances(np.concatenate([train_ids.reshape(-1), test_ids.reshape(-1)]))[train_ids.size:]
    d_cold = lru_stack_distances(test_ids)
    n_rows = 1 << 40                                      # the budget, not the table, bounds these caches
    out = {}
    for enc, rb in (("q2k", 84), ("fp8", 264)):
        for gb in budgets:
            slots = int(gb * 1e9) // rb
            res = {"slots": slots}
            for ways in (CLOCK_WAYS,) + tuple(w for w in ways_variants if w != CLOCK_WAYS):
                sets = clock_sets(n_rows, rb, int(gb * 1e9), ways)
                warm = clock_cache_sim(test_c, sets, ways, state=clock_cache_sim(train_c, sets, ways))
                name = "clock" if ways == CLOCK_WAYS else f"clock_{ways}way"
                res[name] = {"ways": ways, "sets": sets,
                             "warm": {**_rates(warm["hits"], warm["reads"]),
                                      "inserted_per_chunk": round(float(warm["inserted"].mean()), 1) if test_c else 0.0,
                                      "host_bytes_per_chunk": round(float((warm["reads"] - warm["hits"]).mean()) * rb)
                                      if test_c else 0}}
                if ways == CLOCK_WAYS:
                    cold = clock_cache_sim(test_c, sets, ways)
                    res[name]["cold"] = _rates(cold["hits"], cold["reads"])
            res["lru"] = {"warm": {"hit_rate": float(np.count_nonzero((d_warm >= 0) & (d_warm < slots)) / max(1, n_test))},
                          "cold": {"hit_rate": float(np.count_nonzero((d_cold >= 0) & (d_cold < slots)) / max(1, n_test))}}
            key = f"{gb:g} GB {enc}"
            out[key] = res
            log(f"  layer {lid}, {key}: clock {res['clock']['warm']['hit_rate']:.3f} warm / "
                f"{res['clock']['cold']['hit_rate']:.3f} cold ("
                + ", ".join(f"{w}-way {res[f'clock_{w}way']['warm']['hit_rate']:.3f}" for w in ways_variants
                            if w != CLOCK_WAYS)
                + f"); ideal LRU {res['lru']['warm']['hit_rate']:.3f} warm / {res['lru']['cold']['hit_rate']:.3f} cold")
    return out


def main(argv=None) -> int:
    import argparse

    from .timing import commit
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-mb", type=float, default=8.0, help="MB of standard-library text (default 8)")
    p.add_argument("--budgets", default="0.0625,0.25,1", help="cache GB a layer, comma list")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--docs-cache", default=None, help="keep the tokenized corpus in this .npz (reused when its digest matches)")
    a = p.parse_args(argv)
    try:
        budgets = tuple(float(x) for x in a.budgets.split(",") if x.strip())
        if not budgets or any(not np.isfinite(b) or b < 0 for b in budgets) or a.max_mb <= 0:
            raise ValueError
    except ValueError:
        print(f"error: --budgets must be GB >= 0 (comma list) and --max-mb > 0, got {a.budgets!r}, {a.max_mb}",
              file=sys.stderr)
        return 2
    res = run(a.max_mb, budgets, docs_cache=a.docs_cache)
    res["commit"] = commit()
    res["command"] = "python -m engram_numba.bench.cache_hits " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
