"""What one corpus shard's statistics cost on the host, at the released shapes (CPU only, no model
weights): the numbers behind the Dask driver's per-shard costs and what crosses the network.

    python -m engram_numba.bench.shard_state [--chunks 64] [--out shard_state.json]

Two shards of `chunks` chunks of 4096 tokens each (Zipf(1.1) token ids over the 99,092-token
compressed vocabulary, documents of 256..4096 tokens) are hashed with the released hash
configuration (two tables of 384M rows) and reduced into `StreamingGateStats` with random gates
(the reduction does not depend on their values). Then, for one shard: its `PartialStats` pickled
as Dask sends it, the full state pickled, its part file (format 2) and the older format (zlib
level 1), the merge of the two shards both ways, and the client's filling of the merged context
tables. Times are wall seconds on this machine; the reduction's own time is printed to scale them.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import time

import numpy as np

CHUNK = 4096


class _Model:
    """The fields `StreamingGateStats.empty` and the corpus packer read, at the released shapes."""

    def __init__(self):
        from ..config import COMPRESSED_VOCAB_SIZE, ENGRAM_VOCAB_SIZE, EngramConfig
        from ..stages.hash.tables import EngramHashTables

        class _Layer:
            table_encoding, wkv_encoding = "q2k", "bf16"
        self.config = EngramConfig(dim=5120, hc=4, layer_ids=(1, 14), max_ngram_size=4, n_heads=8, head_dim=256)
        self.hash_tables = EngramHashTables.build((1, 14), 4, 8, ENGRAM_VOCAB_SIZE, np.arange(COMPRESSED_VOCAB_SIZE), 2)
        self.layers = {1: _Layer(), 14: _Layer()}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(n_chunks: int = 64, log=print, seed: int = 12) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from ..analysis.corpus import Document, _jobs
    from ..analysis.partfile import PartialStats, write_part
    from ..analysis.shards import plan_shards
    from ..analysis import distributed as dist
    from ..analysis.streaming import Chunk, StreamingGateStats
    m = _Model()
    vocab = m.hash_tables.compressed_vocab_size
    rng = np.random.default_rng(seed)

    def shard():
        docs, total = [], 0
        while total < n_chunks * CHUNK:
            n = min(int(rng.integers(256, 4096)), n_chunks * CHUNK - total)
            docs.append(Document(f"d{len(docs)}", ((rng.zipf(1.1, n) - 1) % vocab).astype(np.int64)))
            total += n
        chunks = []
        for j in _jobs(iter(docs), m, CHUNK, False, True, None):
            T = j.token_ids.size
            g = {lid: (rng.standard_normal((T, 4)).astype(np.float32), rng.random((T, 4)).astype(np.float32))
                 for lid in (1, 14)}
            chunks.append(Chunk(j.token_ids, j.live, j.row_ids, j.windows, g, j.n_documents))
        return chunks

    pool = ThreadPoolExecutor(min(5, os.cpu_count() or 1))
    warm = StreamingGateStats.empty(m)
    warm.update(shard()[0], m.hash_tables.token_map, pool)                # compiles the reducer

    def reduce(chunks):
        st = StreamingGateStats.empty(m)
        for c in chunks:
            st.update(c, m.hash_tables.token_map, pool)
        return st
    a, reduce_s = _timed(lambda: reduce(shard()))
    b = reduce(shard())
    out = {"tokens_per_shard": a.n_tokens, "reduce_s": round(reduce_s, 2),
           "contexts": [t.n for t in a.contexts.values()], "prunes": [t.prunes for t in a.contexts.values()],
           "bitmap_nonzero_bytes": [round(float(np.count_nonzero(x)) / x.size, 4) for x in a.row_bitmaps]}
    state, out["partial_pickle_s"] = _timed(lambda: pickle.dumps(PartialStats.later(a), protocol=5))
    back, out["partial_unpickle_s"] = _timed(lambda: pickle.loads(state))
    out["partial_pickled_bytes"] = len(state)
    out["full_state_pickled_bytes"] = len(pickle.dumps(a, protocol=5))
    with tempfile.TemporaryDirectory() as tmp:
        info, out["part_file_s"] = _timed(lambda: write_part(a, os.path.join(tmp, "p2.npz")))
        out["part_file_bytes"], out["part_file_rows"] = info["bytes"], info["rows"]
        _, out["format1_zlib1_s"] = _timed(lambda: a.save(os.path.join(tmp, "p1.npz"), compresslevel=1))
        out["format1_zlib1_bytes"] = os.path.getsize(os.path.join(tmp, "p1.npz"))
        pb = PartialStats.of(b)
        merged, out["merge_partial_s"] = _timed(lambda: back + pb)
        _, out["merge_stats_s"] = _timed(lambda: a + b)
        _, out["finalize_s"] = _timed(merged.stats)
        text = os.path.join(tmp, "c.txt")
        with open(text, "w") as f:
            f.write("the cat sat on the mat\n" * 1000)
        sh = plan_shards([text], shard_bytes=4096)[1]
    settings = dist._settings("cuda", CHUNK, None, "text", "line", None, True, 20, dist.DEFAULT_MAX_CONTEXTS, True,
                              True, "fp32", None)
    ident = dist.model_identity(m)
    out["task_bytes_file_shard"] = len(pickle.dumps((sh, None, dist.PathModel(text), settings, "/study", ident),
                                                    protocol=5))
    for k, v in list(out.items()):
        if k.endswith("_s"):
            out[k] = round(v, 3)
    log(f"shard of {a.n_tokens:,} tokens (reduced in {reduce_s:.1f} s here): contexts {out['contexts']}, "
        f"bitmaps {out['bitmap_nonzero_bytes']} non-zero bytes")
    log(f"  out: PartialStats pickled {len(state) / 1e6:.1f} MB ({out['partial_pickle_s']:.2f} s + "
        f"{out['partial_unpickle_s']:.2f} s), the full state {out['full_state_pickled_bytes'] / 1e6:.1f} MB; "
        f"in: a file shard's task {out['task_bytes_file_shard']} bytes")
    log(f"  part file {out['part_file_bytes'] / 1e6:.1f} MB in {out['part_file_s']:.2f} s ({info['rows']}); "
        f"format 1 at zlib 1 {out['format1_zlib1_bytes'] / 1e6:.1f} MB in {out['format1_zlib1_s']:.2f} s")
    log(f"  merge of two shards: {out['merge_partial_s']:.2f} s as PartialStats, {out['merge_stats_s']:.2f} s as "
        f"StreamingGateStats; the client fills the merged context tables in {out['finalize_s']:.2f} s")
    return out


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=64, help="4096-token chunks per shard")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    from .timing import commit
    res = run(args.chunks)
    res["commit"] = commit()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
