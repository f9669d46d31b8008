"""Where a graphed decode token's time goes: the decode bench's model (released widths, small
tables, random Q2_K wkv re-laid out as q2k_r), 64 warm tokens, then the wall clock of 512 tokens and
one profiled round of 4 tokens for Nsight Compute (`--smoke`: the tiny shape in the simulator) (each graph node's kernel timed on its own):

    ncu --clock-control none --profile-from-start off --graph-profiling node \
        --metrics gpu__time_duration.sum python3 tools/decode_profile.py

Without ncu it prints the wall time per token and the node names of the captured graph.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from engram_numba.bench.decode import SyntheticModel  # noqa: E402
from engram_numba.bench.timing import RELEASED, SMOKE  # noqa: E402
from engram_numba.engine import EngramV41  # noqa: E402
from engram_numba.stages.hash.cpu import EngramHasher  # noqa: E402


def main():
    smoke = sys.argv[1:] == ["--smoke"]             # the tiny shape, for the simulator
    rng = np.random.default_rng(12)
    model = SyntheticModel(SMOKE if smoke else RELEASED, 0.0001 if smoke else 0.25, rng)
    cfg = model.config
    engine = EngramV41(model, max_tokens=16, device_tables=True, wkv_format="q2k_r")
    n_warm, n_timed = (2, 4) if smoke else (64, 512)
    seq = rng.integers(0, model.token_vocab, n_warm + n_timed + 4)
    hasher = EngramHasher(model.hash_tables, capacity=len(seq) + 16)
    h = cuda.to_device(rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32))
    for tok in seq[:n_warm]:
        engine.decode(tok, h, hasher)
    cuda.synchronize()
    t0 = time.perf_counter()
    for tok in seq[n_warm:n_warm + n_timed]:
        engine.decode(tok, h, hasher)
    cuda.synchronize()
    wall = (time.perf_counter() - t0) / n_timed * 1e6
    graphs = list(engine._decode_graphs.values())
    names = graphs[-1].names if graphs else "(no graphs in the simulator)"
    print(f"wall {wall:.1f} us/token over {n_timed} tokens; graph nodes: {names}", flush=True)
    if smoke:                                    # the simulator has no profiler hooks
        return
    with cuda.profiling():
        for tok in seq[n_warm + n_timed:]:
            engine.decode(tok, h, hasher)
        cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()
