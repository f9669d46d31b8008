"""The fused decode graph (both layers' gathers in one launch, both gates in one launch) against
the per-layer graph and the ungraphed step, on the decode bench's model (released widths, small
Q2_K tables, random Q2_K wkv re-laid out as q2k_r: what tools/decode_profile.py runs):

    PYTHONPATH=$PWD python3 tools/decode_fused_dev.py --out "$OUT"          # H200, < 90 s
    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=$PWD python3 tools/decode_fused_dev.py --smoke --out /tmp/x

1. check: N tokens (every 37th one masked) through three paths on one engine, each with its own
   highway and hasher: the fused graph (`DecodeGraph.fuse = True`, the default), the per-layer
   graph (`fuse = False`, what decode captured before) and `step([tok], ..., graph=False)`. After
   every token the highway and both layers' dot and gate must be the same bits in all three.
2. wall: microseconds a token of back-to-back `decode` calls (one sync at the end), rounds
   alternating per-layer / fused, median of the rounds.
3. device: one graph replay's device time (CUDA events, `DeviceTimer`, warm L2 and flushed), and
   each graph node's kernel timed alone (warm L2), for both graphs.

Each part is caught on its own: a failing part records its traceback and the rest still runs.
Writes decode_fused.json and decode_fused.txt into --out (or $OUT). In the simulator (--smoke:
the tiny bench shape, 3 tokens, the pair-capable kernels picked by name) there are no graphs: the
graphs' launch lists run launch by launch, and nothing is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda import config  # noqa: E402

from engram_numba.bench.decode import SyntheticModel  # noqa: E402
from engram_numba.bench.timing import RELEASED, SMOKE, DeviceTimer, commit, device_name  # noqa: E402
from engram_numba.decode_graph import DecodeGraph  # noqa: E402
from engram_numba.device.devarray import data_address  # noqa: E402
from engram_numba.engine import EngramV41  # noqa: E402
from engram_numba.stages.hash.cpu import EngramHasher  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)


class _LaunchList:
    """The simulator's stand-in for a captured graph: the same launch list, run one by one."""

    def __init__(self, engine, h, fuse: bool, residual: str):
        cfg = engine.config
        g = DecodeGraph.__new__(DecodeGraph)
        g.engine, g.stream, g.device_tables, g.fuse = engine, 0, True, fuse
        if engine._decode_bad is None:
            engine._decode_bad = cuda.to_device(np.zeros(1, np.uint32))
        g.dev_ids = cuda.to_device(np.zeros(len(cfg.layer_ids) * cfg.n_hash_cols, np.int64))
        g.dev_mask = cuda.to_device(np.ones(1, np.uint8))
        self.g, self.launches = g, g._launches(h, residual)
        self.names = [x.name for x in self.launches]

    def decode(self, tok, hasher, live):
        ids = hasher.hash([int(tok)], None if live else np.array([False]))
        self.g.dev_ids.copy_to_device(np.ascontiguousarray(ids.reshape(-1)))
        self.g.dev_mask.copy_to_device(np.array([int(live)], np.uint8))
        for launch in self.launches:
            launch()
        for ws in self.g.engine._ws.values():
            ws.rows_tokens = ws.kv_tokens = ws.gate_tokens = 1


class Path_:
    """One way of running decode tokens on `engine` with its own highway and hasher."""

    def __init__(self, name, engine, model, h0, fuse):
        self.name, self.engine, self.fuse = name, engine, fuse
        self.h = cuda.to_device(h0)
        self.hasher = EngramHasher(model.hash_tables, capacity=1 << 16)
        self.graph = None
        self.sim = None
        if fuse is not None and SIM:
            self.sim = _LaunchList(engine, self.h, fuse, engine.residual)

    def decode(self, tok, live):
        eng = self.engine
        if self.fuse is None:
            eng.step([int(tok)], self.h, self.hasher, None if live else np.array([False]), graph=False)
        elif self.sim is not None:
            self.sim.decode(tok, self.hasher, live)
        else:
            DecodeGraph.fuse = self.fuse           # read when this highway's graph is captured (first call)
            try:
                eng.decode(int(tok), self.h, self.hasher, None if live else False)
            finally:
                DecodeGraph.fuse = True
            if self.graph is None:                 # the graph decode captured for this highway
                self.graph = next(g for key, g in eng._decode_graphs.items() if key[0] == data_address(self.h))

    @property
    def names(self):
        if self.sim is not None:
            return self.sim.names
        return self.graph.names if self.graph is not None else None

    def state(self):
        """(highway, [dot_a, gate_a, dot_b, gate_b]) as uint32 bits, after a sync."""
        cuda.synchronize()
        outs = []
        for lid in self.engine.config.layer_ids:
            dot, gate = self.engine.last_gate(lid)
            outs += [dot.copy_to_host().view(np.uint32), gate.copy_to_host().view(np.uint32)]
        return self.h.copy_to_host().view(np.uint32), outs


def _run(part, res, fn):
    t0 = time.perf_counter()
    try:
        res[part] = fn()
    except Exception as e:          # a failing part must not stop the others
        res.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    res.setdefault("seconds", {})[part] = round(time.perf_counter() - t0, 2)


def check(paths, seq, live):
    """Every token through the three paths in turn; the first mismatch per pair is recorded."""
    fused, per_layer, step = paths
    mismatches = {"fused_vs_step": [], "per_layer_vs_step": []}
    for i, (tok, lv) in enumerate(zip(seq, live)):
        states = {}
        for p in paths:
            p.decode(tok, lv)
            states[p.name] = p.state()
        for key, a in (("fused_vs_step", fused.name), ("per_layer_vs_step", per_layer.name)):
            (ha, oa), (hb, ob) = states[a], states[step.name]
            what = [] if np.array_equal(ha, hb) else ["highway"]
            what += [n for n, x, y in zip(("dot_a", "gate_a", "dot_b", "gate_b"), oa, ob) if not np.array_equal(x, y)]
            if what and len(mismatches[key]) < 5:
                mismatches[key].append({"token_index": i, "token": int(tok), "live": bool(lv), "differs": what})
    bad = fused.engine.decode_bad_ids() if not SIM else int(fused.engine._decode_bad.copy_to_host()[0])
    return {"tokens": len(seq), "masked": int((~np.asarray(live)).sum()),
            "fused_bit_identical": not mismatches["fused_vs_step"],
            "per_layer_bit_identical": not mismatches["per_layer_vs_step"],
            "mismatches": mismatches, "decode_bad_ids": bad,
            "graph_nodes": {"fused": fused.names, "per_layer": per_layer.names}}


def wall(paths, seq, rounds, per_round):
    out = {p.name: [] for p in paths}
    k = 0
    for _ in range(rounds):
        for p in paths:
            toks = [seq[(k + j) % len(seq)] for j in range(per_round)]
            k += per_round
            cuda.synchronize()
            t0 = time.perf_counter()
            for tok in toks:
                p.decode(tok, True)
            cuda.synchronize()
            out[p.name].append((time.perf_counter() - t0) / per_round * 1e6)
    return {name: {"median_us_per_token": round(statistics.median(v), 2), "rounds_us": [round(x, 2) for x in v]}
            for name, v in out.items()}


def device(paths, stream):
    timer = DeviceTimer(stream=stream)
    out = {}
    for p in paths:
        g = p.graph
        r = {"graph_replay_us_warm": round(timer(lambda: g.graphs[0].replay(), iters=100, flush=False), 2),
             "graph_replay_us_flushed": round(timer(lambda: g.graphs[0].replay(), iters=50), 2), "nodes": []}
        for launch in g.graphs[0]._launches:
            if not hasattr(launch, "configured"):
                continue                       # a host-to-device copy
            try:
                us = timer(launch, iters=50, flush=False)
                r["nodes"].append({"name": launch.name, "grid": str(launch.grid), "block": str(launch.block),
                                   "us_warm": round(us, 2)})
            except Exception as e:
                r["nodes"].append({"name": launch.name, "error": f"{type(e).__name__}: {e}"})
        out[p.name] = r
    return out


def table(res) -> str:
    lines = [f"decode fused graph at {res.get('commit')} on {res.get('device')} ({res.get('shape')})"]
    c = res.get("check")
    if c:
        lines.append(f"check over {c['tokens']} tokens ({c['masked']} masked): fused == step bit for bit: "
                     f"{c['fused_bit_identical']}; per-layer graph == step: {c['per_layer_bit_identical']}; "
                     f"bad ids {c['decode_bad_ids']}")
        for k, v in c["mismatches"].items():
            if v:
                lines.append(f"  {k}: first mismatches {v}")
        lines.append(f"  fused nodes:     {c['graph_nodes']['fused']}")
        lines.append(f"  per-layer nodes: {c['graph_nodes']['per_layer']}")
    w = res.get("wall")
    if w:
        lines.append("wall us/token (median of rounds): " + ", ".join(f"{k} {v['median_us_per_token']}"
                                                                      for k, v in w.items()))
    d = res.get("device_times")
    if d:
        for name, r in d.items():
            lines.append(f"{name}: graph replay {r['graph_replay_us_warm']} us warm, {r['graph_replay_us_flushed']} us "
                         "L2 flushed; nodes alone (warm):")
            for n in r["nodes"]:
                lines.append(f"    {n['name']:<28} {n.get('us_warm', n.get('error'))}")
    for part, err in res.get("errors", {}).items():
        lines.append(f"ERROR in {part}: {err.splitlines()[0]}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="the tiny shape in the simulator")
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke or SIM
    rng = np.random.default_rng(12)
    t0 = time.perf_counter()
    model = SyntheticModel(SMOKE if smoke else RELEASED, 0.0001 if smoke else 0.25, rng)
    cfg = model.config
    versions = {"rows": "q2k_v3", "gate": "gate_v3"} if SIM else None     # the simulator's defaults have no pairs
    engine = EngramV41(model, max_tokens=16, device_tables=True, wkv_format="q2k_r" if not SIM else None,
                       versions=versions)
    res = {"commit": commit(), "device": device_name(), "shape": f"dim {cfg.dim}, hc {cfg.hc}, {cfg.n_hash_cols} "
           f"columns, layers {list(cfg.layer_ids)}", "wkv_format": dict(engine.wkv_format),
           "build_seconds": round(time.perf_counter() - t0, 2)}
    n = 3 if smoke else args.tokens
    seq = rng.integers(0, model.token_vocab, n)
    live = np.ones(n, bool)
    live[5::37] = False
    if smoke:
        live[0] = False
    h0 = rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)
    paths = [Path_("fused", engine, model, h0, True), Path_("per_layer", engine, model, h0, False),
             Path_("step", engine, model, h0, None)]
    _run("check", res, lambda: check(paths, seq, live))
    if not SIM:
        _run("wall", res, lambda: wall(paths[:2], seq, rounds=7, per_round=200))
        _run("device_times", res, lambda: device(paths[:2], engine.decode_stream))
    res["total_seconds"] = round(time.perf_counter() - t0, 2)
    txt = table(res)
    (out / "decode_fused.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "decode_fused.txt").write_text(txt + "\n")
    print(txt, flush=True)
    return 0 if res.get("check", {}).get("fused_bit_identical") else 1


if __name__ == "__main__":
    sys.exit(main())
