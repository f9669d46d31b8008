"""gate_v4 (many blocks a row) and its two-layer pair on the GPU: validate, then time beside gate_v3.

    PYTHONPATH=$PWD python3 tools/gate_dev.py --out "$OUT"                 # H200, < 90 s
    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=$PWD python3 tools/gate_dev.py --smoke --out /tmp/x

1. check (dim 5120, hc 4, T = 1, 2, 8, both residuals, a mask at T > 1): gate_v4 at tps 32
   (its default: 20 slices of 32 threads), 64 and 128 against the numpy reference with the
   gate tests' tolerances (`check` of test_gate_cuda.py; the measured ulps are recorded); the
   same v4 launch on the same input twice gives the same bits (reproducible); the v4 pair run
   3 times against 6 gate_v4 launches (a, b, a, b, a, b), bit for bit (highway, both layers'
   dot and gate); gate_v3 and its pair the same way as a control; and one v4 pair captured in a
   CUDA graph and replayed 3 times against 3 direct launches of another prepared pair.
2. kernels (T = 1, 2, 8, fp32; T = 1 also bf16): each launch captured alone in a CUDA graph
   (one node, as the decode graph holds it) and the graph replay timed with `DeviceTimer`,
   warm (no L2 flush: the decode graph's situation, its inputs were just written) and flushed;
   an empty kernel's graph beside them (the floor of one node). Rows: gate_v3, gate_v4[tps],
   gate_v3 pair, gate_v4 pair[tps], and two gate_v4 nodes in one graph.
3. decode (released widths, the decode bench's synthetic model, as tools/decode_fused_dev.py):
   an engine with gate_v4 by name against the default engine (gate_v3): the v4 engine's decode
   graph against its own step(graph=False) over 40 tokens (every 13th masked), bit for bit; the
   graph's node names; wall us/token of back-to-back decode calls, graph replay device time
   (warm, flushed) and each node alone, for both engines.

Every variant is caught on its own (its error is recorded and the rest runs). Writes gate_dev.json
and gate_dev.txt into --out (or $OUT). What to read: "check" all PASS; the kernels table's
us_warm for gate_v4 pair[32] against gate_v3 pair at T = 1 (targets: pair <= 5 us, one layer
<= 4 us), the empty node's time beside them; decode's graph replay and wall us/token, v4 vs v3.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda import config  # noqa: E402

from engram_numba.bench.timing import DeviceTimer, commit, device_name  # noqa: E402
from engram_numba.stages.gate import cuda as G  # noqa: E402
from engram_numba.stages.gate import launch as L  # noqa: E402
from engram_numba.stages.gate.tests.test_gate_cuda import Expected, check, make_inputs  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)
F32 = np.float32


def _err(e) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"


def _layer(rng, T, hc, dim):
    _, kv, w, _ = make_inputs(rng, T, hc, dim)
    return kv, w


class Case:
    """One input set on the device: highway (reset from h0 by `reset`), two layers, mask, outputs."""

    def __init__(self, rng, T, hc, dim, masked):
        self.T, self.hc, self.dim = T, hc, dim
        self.h0, kv, w, self.mask = make_inputs(rng, T, hc, dim, mask=masked)
        self.la, self.lb = (kv, w), _layer(rng, T, hc, dim)
        self.d_h = cuda.to_device(self.h0)
        self.d_la = [cuda.to_device(x) for x in self.la]
        self.d_lb = [cuda.to_device(x) for x in self.lb]
        self.d_mask = None if self.mask is None else cuda.to_device(self.mask)
        self.outs = [cuda.to_device(np.full((T, hc), np.nan, F32)) for _ in range(4)]

    def reset(self):
        self.d_h.copy_to_device(self.h0)
        for o in self.outs:
            o.copy_to_device(np.full((self.T, self.hc), np.nan, F32))

    def single(self, version, residual, tps=None, layer="a", stream=0):
        kv, w = self.d_la if layer == "a" else self.d_lb
        dot, gate = self.outs[:2] if layer == "a" else self.outs[2:]
        return L.prepare_gate(self.d_h, kv, w, token_mask=self.d_mask, residual=residual, dot_out=dot, gate_out=gate,
                              version=version, tps=tps, stream=stream)

    def pair(self, version, residual, tps=None, stream=0):
        return L.prepare_gate_pair(self.d_h, *self.d_la, *self.d_lb, token_mask=self.d_mask, residual=residual,
                                   dot_a=self.outs[0], gate_a=self.outs[1], dot_b=self.outs[2], gate_b=self.outs[3],
                                   tps=tps, version=version, stream=stream)

    def state(self):
        cuda.synchronize()
        return self.d_h.copy_to_host(), [o.copy_to_host() for o in self.outs]


def _timeouts(launch) -> int:
    """gate_v4's wait timeouts (0 unless broken); 0 for other versions."""
    return G.v4_timeouts(launch) if launch.name.startswith("gate_v4") else 0


def _same_bits(a, b) -> list:
    (ha, oa), (hb, ob) = a, b
    bad = [] if np.array_equal(ha.view(np.uint32), hb.view(np.uint32)) else ["highway"]
    return bad + [n for n, x, y in zip(("dot_a", "gate_a", "dot_b", "gate_b"), oa, ob)
                  if not np.array_equal(x.view(np.uint32), y.view(np.uint32))]


def check_part(Ts, hc, dim, tpss, rng):
    rows = []

    def record(what, fn, **kw):
        t0 = time.perf_counter()
        try:
            out = fn()
            ok = out.pop("ok", True) if isinstance(out, dict) else True
            rows.append({"what": what, **kw, "passed": bool(ok), **(out if isinstance(out, dict) else {}),
                         "s": round(time.perf_counter() - t0, 2)})
        except Exception as e:
            rows.append({"what": what, **kw, "passed": False, "error": _err(e)})

    for T in Ts:
        for residual in ("fp32", "bf16"):
            c = Case(rng, T, hc, dim, masked=T > 1)
            exp = Expected(c.h0, *c.la, c.mask, residual)
            for version, tps in [("gate_v3", None)] + [("gate_v4", t) for t in tpss]:
                def vs_reference(version=version, tps=tps):
                    c.reset()
                    first = c.single(version, residual, tps)
                    first()
                    h, outs = c.state()
                    c.reset()
                    second = c.single(version, residual, tps)
                    second()                                  # a second, fresh launch: the same bits
                    again = c.state()
                    diff = _same_bits((h, outs), again)
                    waits = _timeouts(first) + _timeouts(second)
                    stats = check(exp, (h, outs[0], outs[1]), version=version)
                    return {**stats, "reproducible": not diff, "wait_timeouts": waits, "ok": not diff and not waits}
                record("vs reference", vs_reference, version=version, tps=tps, T=T, residual=residual)

            for version, tps in [("gate_v3", None)] + [("gate_v4", t) for t in tpss]:
                def pair_vs_two(version=version, tps=tps):
                    c.reset()
                    launch = c.pair(version, residual, tps)
                    for _ in range(3):
                        launch()
                    got = c.state()
                    c.reset()
                    la, lb = c.single(version, residual, tps, "a"), c.single(version, residual, tps, "b")
                    for _ in range(3):
                        la()
                        lb()
                    diff = _same_bits(got, c.state())
                    waits = _timeouts(launch) + _timeouts(la) + _timeouts(lb)
                    return {"launch": launch.name, "grid": launch.grid, "block": launch.block, "differs": diff,
                            "wait_timeouts": waits, "ok": not diff and not waits}
                record("pair x3 == two launches x3", pair_vs_two, version=version, tps=tps, T=T, residual=residual)

    if not SIM:
        from engram_numba.device.graphs import CapturedGraph

        def graph_replay():
            c = Case(rng, 1, hc, dim, masked=False)
            s = cuda.stream()
            launch = c.pair("gate_v4", "fp32", None, stream=s)
            launch()            # compiled before the capture; then back to h0
            s.synchronize()
            c.reset()
            g = CapturedGraph(s, [launch], n_tokens=1)
            for _ in range(3):
                g.replay()
            s.synchronize()
            got = c.state()
            c.reset()
            direct = c.pair("gate_v4", "fp32", None)
            for _ in range(3):
                direct()
            diff = _same_bits(got, c.state())
            waits = _timeouts(launch) + _timeouts(direct)
            return {"differs": diff, "wait_timeouts": waits, "ok": not diff and not waits}
        record("v4 pair in a CUDA graph x3 == direct x3", graph_replay, version="gate_v4", T=1, residual="fp32")
    return rows


def kernels_part(Ts, hc, dim, tpss, rng):
    from engram_numba.device.graphs import CapturedGraph

    @cuda.jit
    def empty(x):
        if cuda.grid(1) == 1 << 30:
            x[0] = 0.0

    s = cuda.stream()
    timer = DeviceTimer(stream=s)
    dummy = cuda.device_array(1, F32)
    rows = []

    def time_launches(name, make, **kw):
        try:
            launches = make()
            for x in launches:            # compile outside the capture
                x()
            s.synchronize()
            g = CapturedGraph(s, launches, n_tokens=1)
            warm = timer(g.replay, iters=200, warmup=10, flush=False)
            flushed = timer(g.replay, iters=50, warmup=3)
            waits = sum(_timeouts(x) for x in launches if hasattr(x, "args"))
            rows.append({"name": name, **kw, "nodes": len(launches), "us_warm": round(warm, 2),
                         "us_flushed": round(flushed, 2), "wait_timeouts": waits,
                         "grid": [getattr(x, "grid", None) for x in launches],
                         "block": [getattr(x, "block", None) for x in launches]})
        except Exception as e:
            rows.append({"name": name, **kw, "error": _err(e)})

    class _Empty:
        name, grid, block = "empty kernel", 1, 32

        def __init__(self):
            self.configured = empty[1, 32, s]

        def __call__(self):
            self.configured(dummy)

    time_launches("empty kernel", lambda: [_Empty()], T=0, residual="-")
    for T in Ts:
        for residual in (("fp32", "bf16") if T == 1 else ("fp32",)):
            c = Case(rng, T, hc, dim, masked=False)
            time_launches("gate_v3", lambda: [c.single("gate_v3", residual, stream=s)], T=T, residual=residual)
            for tps in tpss:
                time_launches(f"gate_v4[{tps}]", lambda: [c.single("gate_v4", residual, tps, stream=s)], T=T,
                              residual=residual)
            time_launches("gate_v3 pair", lambda: [c.pair("gate_v3", residual, stream=s)], T=T, residual=residual)
            for tps in tpss:
                time_launches(f"gate_v4 pair[{tps}]", lambda: [c.pair("gate_v4", residual, tps, stream=s)], T=T,
                              residual=residual)
            time_launches("2 x gate_v3", lambda: [c.single("gate_v3", residual, None, "a", s),
                                                   c.single("gate_v3", residual, None, "b", s)], T=T, residual=residual)
            time_launches(f"2 x gate_v4[{tpss[0]}]", lambda: [c.single("gate_v4", residual, tpss[0], "a", s),
                                                              c.single("gate_v4", residual, tpss[0], "b", s)],
                          T=T, residual=residual)
    return rows


def decode_part(n_tokens, rng, smoke=False):
    """The v4 engine's decode graph against its step(graph=False); wall and device times of both
    engines. smoke: the tiny bench shape in the simulator (the graphs' launch lists run one by one)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_fused_dev import Path_, device, wall  # the fused-decode tool's paths and timers

    from engram_numba.bench.decode import SyntheticModel
    from engram_numba.bench.timing import RELEASED, SMOKE
    from engram_numba.engine import EngramV41

    res = {}
    t0 = time.perf_counter()
    model = SyntheticModel(SMOKE if smoke else RELEASED, 0.0001 if smoke else 0.25, rng)
    cfg = model.config
    kw = dict(max_tokens=16, device_tables=True, wkv_format=None if SIM else "q2k_r")
    rows = {"rows": "q2k_v3"} if SIM else {}            # the simulator's defaults have no pair forms
    engines = {"v3": EngramV41(model, **kw, versions={**rows, "gate": "gate_v3"} if SIM else None),   # the default
               "v4": EngramV41(model, **kw, versions={**rows, "gate": "gate_v4"})}
    res["build_seconds"] = round(time.perf_counter() - t0, 2)
    h0 = rng.standard_normal((1, cfg.hc, cfg.dim)).astype(F32)
    seq = rng.integers(0, model.token_vocab, n_tokens)
    live = np.ones(n_tokens, bool)
    live[3::13] = False
    graphed = {k: Path_(f"graph {k}", e, model, h0, True) for k, e in engines.items()}
    step4 = Path_("step v4", engines["v4"], model, h0, None)
    mism = []
    for i, (tok, lv) in enumerate(zip(seq, live)):
        graphed["v4"].decode(tok, lv)
        ha, oa = graphed["v4"].state()          # uint32 bits; read before the step overwrites the engine's dot/gate
        step4.decode(tok, lv)
        hb, ob = step4.state()
        diff = ([] if np.array_equal(ha, hb) else ["highway"]) + [
            n for n, x, y in zip(("dot_a", "gate_a", "dot_b", "gate_b"), oa, ob) if not np.array_equal(x, y)]
        if diff and len(mism) < 5:
            mism.append({"token_index": i, "live": bool(lv), "differs": diff})
    for tok, lv in zip(seq, live):
        graphed["v3"].decode(tok, lv)
    res["check"] = {"tokens": n_tokens, "masked": int((~live).sum()), "v4_graph_equals_v4_step": not mism,
                    "mismatches": mism, "nodes": {k: p.names for k, p in graphed.items()}}
    if SIM:
        return res
    paths = [graphed["v3"], graphed["v4"]]
    try:
        res["wall"] = wall(paths, seq, rounds=7, per_round=200)
    except Exception as e:
        res["wall_error"] = _err(e)
    res["device"] = {}
    for k, p in graphed.items():
        try:
            res["device"][p.name] = device([p], p.engine.decode_stream)[p.name]
        except Exception as e:
            res["device"][p.name] = {"error": _err(e)}
    return res


def table(res) -> str:
    lines = [f"gate_v4 dev at {res.get('commit')} on {res.get('device')} (dim {res['dim']}, hc {res['hc']})"]
    rows = res.get("check") or []
    n_ok = sum(r["passed"] for r in rows)
    lines.append(f"check: {n_ok}/{len(rows)} PASS")
    for r in rows:
        if not r["passed"] or r["what"] == "vs reference":
            keys = ("dot_err_ulps", "gate_err_ulps", "highway_err_ulps_of_max_h_gv", "highway_err_bf16_ulps",
                    "reproducible", "wait_timeouts")
            extra = ", ".join(f"{k}={r[k]}" for k in keys if k in r)
            lines.append(f"  {'PASS' if r['passed'] else 'FAIL'} {r['what']:<40} {r.get('version')}"
                         f"[{r.get('tps')}] T={r.get('T')} {r.get('residual')}: {extra}"
                         + (f" differs={r.get('differs')}" if r.get("differs") else "")
                         + (f" ERROR {r['error'].splitlines()[0]}" if "error" in r else ""))
    fails = [r for r in rows if not r["passed"]]
    lines.append("  pair / graph checks: " + ("all bit-identical" if not [r for r in fails if r["what"] != "vs reference"]
                                              else "SEE FAILURES ABOVE"))
    k = res.get("kernels")
    if k:
        lines.append("kernels, one CUDA graph each, us (warm = no L2 flush; flushed = 256 MiB read before each run):")
        lines.append(f"  {'name':<22} {'T':>2} {'resid':<5} {'warm':>8} {'flushed':>8}  grid x block")
        for r in k:
            if "error" in r:
                lines.append(f"  {r['name']:<22} {r.get('T'):>2} {r.get('residual'):<5} ERROR {r['error'].splitlines()[0]}")
            else:
                lines.append(f"  {r['name']:<22} {r['T']:>2} {r['residual']:<5} {r['us_warm']:>8} {r['us_flushed']:>8}  "
                             f"{r['grid']} x {r['block']}" + (f"  WAIT TIMEOUTS {r['wait_timeouts']}"
                                                              if r.get("wait_timeouts") else ""))
    d = res.get("decode")
    if isinstance(d, dict):
        c = d.get("check", {})
        lines.append(f"decode (released widths): v4 graph == v4 step over {c.get('tokens')} tokens "
                     f"({c.get('masked')} masked): {c.get('v4_graph_equals_v4_step')} {c.get('mismatches') or ''}")
        for name, nodes in (c.get("nodes") or {}).items():
            lines.append(f"  nodes {name}: {nodes}")
        if "wall" in d:
            lines.append("  wall us/token: " + ", ".join(f"{n} {v['median_us_per_token']}" for n, v in d["wall"].items()))
        for name, r in (d.get("device") or {}).items():
            if "error" in r:
                lines.append(f"  {name}: ERROR {r['error'].splitlines()[0]}")
                continue
            lines.append(f"  {name}: graph replay {r['graph_replay_us_warm']} us warm, {r['graph_replay_us_flushed']} "
                         "flushed; nodes alone (warm): " + ", ".join(f"{n['name']} {n.get('us_warm', n.get('error'))}"
                                                                      for n in r["nodes"]))
    for part, err in res.get("errors", {}).items():
        lines.append(f"ERROR in {part}: {err.splitlines()[0]}")
    return "\n".join(lines)


def _run(part, res, fn):
    t0 = time.perf_counter()
    try:
        res[part] = fn()
    except Exception as e:
        res.setdefault("errors", {})[part] = _err(e)
    res.setdefault("seconds", {})[part] = round(time.perf_counter() - t0, 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in the simulator: the wiring only")
    ap.add_argument("--no-decode", action="store_true", help="skip part 3 (the engines at released widths)")
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke or SIM
    rng = np.random.default_rng(41)
    hc, dim = (2, 328) if smoke else (4, 5120)
    Ts = (1,) if smoke else (1, 2, 8)
    tpss = (32,) if smoke else (32, 64, 128)
    t0 = time.perf_counter()
    res = {"commit": commit(), "device": device_name(), "dim": dim, "hc": hc, "T": list(Ts), "tps": list(tpss)}
    _run("check", res, lambda: check_part(Ts, hc, dim, tpss, rng))
    if not SIM:
        _run("kernels", res, lambda: kernels_part(Ts, hc, dim, tpss, rng))
    if not args.no_decode:
        _run("decode", res, lambda: decode_part(2 if smoke else args.tokens, rng, smoke))
    res["total_seconds"] = round(time.perf_counter() - t0, 2)
    txt = table(res)
    (out / "gate_dev.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "gate_dev.txt").write_text(txt + "\n")
    print(txt, flush=True)
    return 0 if all(r["passed"] for r in res.get("check") or [{"passed": False}]) else 1


if __name__ == "__main__":
    sys.exit(main())
