"""corpus_stats throughput on the GPU: which reducer lanes (and, for the FP8 model, which FP8
projection), both models, repeated in alternating order, in ONE process.

    PYTHONPATH=$PWD python tools/corpus_lanes.py --out $OUT [--chunks 400] [--repeats 2]
        [--models q2k,fp8] [--fp8-proj decode,bf16] [--smoke]
    python tools/corpus_lanes.py --summarize $OUT/corpus_lanes.json     (the table of a run cut short)
    bash tools/gpu_corpus_lanes.sh                                      (the H200 batch: wheels, timeout)

Why: the reducer's two arrangements (analysis.corpus.LANES: "contexts", each chunk's layers run
on the pool and waited for; "all", each layer on a lane of its own too) were compared by
`python -m engram_numba.bench.corpus`, which times them once each, always in the same order, one
model a process. Its first timed run in a fresh process also compiled the context tables' prune
(@njit, ~1 s with the GIL held) a few chunks in, so "which lane mode wins" followed the order.
Here every variant is warmed up first (a warm-up whose context cap is so small that every table
prunes), and then each model runs its variants `--repeats` times, the order reversed every
repeat (A B C D, D C B A, ...), so drift of the host (other jobs) and order effects show as the
spread between a variant's runs rather than as a difference between variants.

Variants: per model, both lane modes; for the FP8 model, each --fp8-proj too ("decode": the
engine's default, the FP8 wkv held as stored and decoded to a bf16 scratch once a chunk; "bf16":
decoded once at build: at two layers the same device memory, 2 x 315 MB either way). The models
run one after the other (the Q2_K model's released tables, 2 x 32.3 GB, are freed first); the FP8
tables are shrunk to what the device holds beside two engines.

Every run's statistics are checked bit for bit against the model's first run (lane modes and
FP8 projections must not change a bit). Each model gets the stage device times of one chunk
(CUDA events) for each engine, so every run has its ratio to the device sum. Output in --out:
corpus_lanes.json (rewritten after every run, so a timeout keeps what finished) and
corpus_lanes.txt (the summary table). A failing variant is recorded and the rest go on.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

LANE_MODES = ("contexts", "all")


def _stage_us(eng, cfg, ids, work, pristine, timer, iters: int) -> dict:
    """The stages' device times for one chunk (bench/corpus.py's list: rows, proj and gate a layer,
    the scratch decode of a q2k/fp8 wkv when the engine has one, the highway's d2d refresh)."""
    out = {}
    for li, lid in enumerate(cfg.layer_ids):
        layer_ids = np.ascontiguousarray(ids[:, li, :])
        out[f"L{lid}.rows"] = timer(lambda: eng.rows_from_ids(lid, layer_ids), iters=iters)
        out[f"L{lid}.proj"] = timer(lambda: eng.project(lid), iters=iters)
        out[f"L{lid}.gate"] = timer(lambda: eng.gate(lid, work), iters=iters)
    decoded = eng._plans.get(("proj", cfg.layer_ids[-1], ids.shape[0]))
    if hasattr(decoded, "decode"):
        out["wkv.decode"] = timer(decoded.decode, iters=iters)
    out["highway.d2d"] = timer(lambda: work.copy_to_device(pristine), iters=iters)
    return {k: round(v, 1) for k, v in out.items()}


def _settle(st):
    """Every lane done and each context table's sorted view made (state_equal compares them)."""
    st.finish()
    for t in st.contexts.values():
        t._sorted()
    return st


def run_model(kind: str, args, res: dict, save, log=print) -> None:
    from numba import cuda

    from engram_numba.analysis import corpus as corpus_mod
    from engram_numba.analysis.corpus import corpus_stats
    from engram_numba.analysis.stats import state_equal
    from engram_numba.bench.corpus import WARM_MAX_CONTEXTS, BenchModel, _documents, _fill_device_table
    from engram_numba.bench.timing import RELEASED, SMOKE, DeviceTimer
    from engram_numba.config import ENGRAM_VOCAB_SIZE
    from engram_numba.engine import EngramV41
    from engram_numba.stages.hash.cpu import EngramHasher

    smoke = args.smoke
    shape = SMOKE if smoke else RELEASED
    chunk = 4 if smoke else 4096
    row_bytes = 264 if kind == "fp8" else 84
    projs = list(args.fp8_proj) if kind == "fp8" else ["bf16 wkv"]
    t0 = time.perf_counter()
    note = "released size"
    if smoke:
        rows_per_col, note = 61, "tiny (simulator)"
    elif kind == "fp8":
        free, _ = cuda.current_context().get_memory_info()
        # beside the tables: per engine its wkv, workspaces and scratch (~1.6 GB), the two highways
        # (0.7 GB), kernels and slack: 10 GiB for two engines
        fit = int((free - (10 << 30)) / 2 / row_bytes / shape.cols)
        rows_per_col = min(ENGRAM_VOCAB_SIZE, max(fit, 1024))
        if rows_per_col < ENGRAM_VOCAB_SIZE:
            note = f"shrunk to {rows_per_col / ENGRAM_VOCAB_SIZE:.0%} of the released rows (device memory)"
    else:
        rows_per_col = ENGRAM_VOCAB_SIZE
    model = BenchModel(shape, rows_per_col, kind=kind)
    cfg = model.config
    tables, scales = {}, {}
    for lid in cfg.layer_ids:
        lay = model.layers[lid]
        tables[lid] = _fill_device_table(lay.n_rows, lay.table.block, cuda)
        if lay.table_scales is not None:
            scales[lid] = _fill_device_table(lay.n_rows, lay.table_scales.block, cuda)
    engines = {}
    for proj in projs:
        kw = {"wkv_format": "bf16"} if proj == "bf16" else {}
        eng = EngramV41(model, max_tokens=chunk, device_tables=False, **kw)
        for lid in cfg.layer_ids:
            eng.layers[lid].table = tables[lid]
            if lid in scales:
                eng.layers[lid].table_scales = scales[lid]
            eng.layers[lid].placement = "device"
        engines[proj] = eng
    mrec = {"model": kind, "table_rows": int(model.layers[cfg.layer_ids[0]].n_rows), "tables": note,
            "table_gb_a_layer": round(model.layers[cfg.layer_ids[0]].n_rows * row_bytes / 1e9, 1),
            "chunks": args.chunks, "chunk_tokens": chunk,
            "wkv_on_device": {p: {str(k): v for k, v in e.wkv_format.items()} for p, e in engines.items()},
            "wkv_device_bytes": {}, "stage_us": {}, "device_sum_us": {}, "runs": [], "errors": []}
    res["models"][kind] = mrec
    vocab = model.hash_tables.token_map.size
    docs = _documents(args.chunks * chunk, vocab, np.random.default_rng(11), lo=2 if smoke else 256,
                      hi=6 if smoke else 4096)
    T, HC, DIM = chunk, cfg.hc, cfg.dim
    rng = np.random.default_rng(5)
    pristine = cuda.to_device(rng.standard_normal((T, HC, DIM), dtype=np.float32))
    work = cuda.device_array((T, HC, DIM), dtype=np.float32)
    work.copy_to_device(pristine)
    ids = EngramHasher(model.hash_tables, capacity=2 * T).hash(np.concatenate(docs)[:T])
    timer = DeviceTimer()
    for p, e in engines.items():
        try:
            su = _stage_us(e, cfg, ids, work, pristine, timer, 2 if smoke else 10)
            mrec["stage_us"][p] = su
            mrec["device_sum_us"][p] = round(sum(su.values()), 1)
            # the projection's weights on the device: both layers' wkv (+ scales) and the bf16 scratch
            # a q2k/fp8 wkv is decoded into (allocated by the first many-token projection, above)
            wkv = sum(int(lw.wkv.nbytes) + int(getattr(lw.wkv_scales, "nbytes", 0) or 0) for lw in e.layers.values())
            scratch = e._wkv_scratch
            mrec["wkv_device_bytes"][p] = {"wkv": wkv, "scratch": 0 if scratch is None else int(scratch.nbytes)}
        except Exception as exc:  # noqa: BLE001
            mrec["errors"].append({"what": f"stage times [{p}]", "error": repr(exc), "trace": traceback.format_exc()})
    log(f"{kind}: {model.path}; tables {note}; setup {time.perf_counter() - t0:.1f} s; device sum a chunk (us) "
        f"{mrec['device_sum_us']}; stage us {mrec['stage_us']}")
    save()

    def source(positions):
        n = positions.size
        work[:n].copy_to_device(pristine[:n])
        return work[:n]

    def stats_run(eng, lanes, documents, **kw):
        keep = corpus_mod.LANES
        corpus_mod.LANES = lanes
        try:
            return corpus_stats(model, documents=documents, backend="cuda", engine=eng, device_highway=source,
                                chunk_tokens=chunk, **kw)
        finally:
            corpus_mod.LANES = keep

    variants = [(p, lanes) for p in projs for lanes in args.lanes]
    for p, lanes in variants:                   # warm: kernels compiled, every @njit (the prune's too) loaded
        try:
            stats_run(engines[p], lanes, docs[:2], max_contexts=WARM_MAX_CONTEXTS)
        except Exception as exc:  # noqa: BLE001
            mrec["errors"].append({"what": f"warm-up [{p}, {lanes}]", "error": repr(exc),
                                   "trace": traceback.format_exc()})
    ref = None
    for rep in range(args.repeats):
        for p, lanes in (variants if rep % 2 == 0 else variants[::-1]):
            rec = {"model": kind, "proj": p, "lanes": lanes, "repeat": rep}
            try:
                gc.collect()
                st = stats_run(engines[p], lanes, docs)
                wall = st.meta["timing"]["wall_s"]
                tps = st.n_tokens / wall
                dsum = mrec["device_sum_us"].get(p)
                rec.update({"tokens_per_s": round(tps, 1), "us_a_chunk": round(1e6 * chunk / tps, 1),
                            "ratio_to_device_sum": round(1e6 * chunk / tps / dsum, 3) if dsum else None,
                            "n_tokens": st.n_tokens, "timing_s": st.meta["timing"],
                            "device_chunks": st.meta.get("device_chunks")})
                _settle(st)
                if ref is None:
                    ref, rec["same_statistics_as_first_run"] = st, True
                else:
                    rec["same_statistics_as_first_run"] = bool(state_equal(st, ref, skip=("tokenizer", "meta")))
                del st
                tm = rec["timing_s"]
                log(f"  {kind} [{p}, lanes={lanes}] repeat {rep}: {tps:,.0f} tokens/s, {rec['us_a_chunk']:.0f} us a "
                    f"chunk (x{rec['ratio_to_device_sum']} of the device sum); CPU s: "
                    + ", ".join(f"{k[:-6]} {v:.2f}" for k, v in tm.items() if k.endswith("_cpu_s"))
                    + f"; same statistics as the first run: {rec['same_statistics_as_first_run']}")
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants go on
                rec["error"] = repr(exc)
                rec["trace"] = traceback.format_exc()
                log(f"  {kind} [{p}, lanes={lanes}] repeat {rep}: FAILED {exc!r}")
            mrec["runs"].append(rec)
            save()
    del engines, tables, scales, ref
    gc.collect()
    try:
        cuda.current_context().deallocations.clear()
    except AttributeError:                      # the simulator
        pass


def summary(res: dict) -> str:
    """The table: per model, projection and lane mode, each run's tokens/s and their median; then
    which lane mode won per model and projection (by the median, and whether every run agrees)."""
    lines = [f"corpus_stats lanes matrix, commit {res.get('commit')}, {res.get('device')}, chunks "
             f"{res.get('chunks')} a run, order reversed each repeat", "",
             "| model | fp8 proj | lanes | tokens/s (each run, in run order) | median | us a chunk | x device sum "
             "| all-thread CPU s (median) | same stats |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    verdicts = []
    winners = []                                # (model, proj, winning mode, every run agrees)
    for kind, m in res["models"].items():
        groups: dict = {}
        for r in m["runs"]:
            groups.setdefault((r["proj"], r["lanes"]), []).append(r)
        med = {}
        for (p, lanes), rs in groups.items():
            ok = [r for r in rs if "tokens_per_s" in r]
            tps = [r["tokens_per_s"] for r in ok]
            med[(p, lanes)] = statistics.median(tps) if tps else None
            cpu = [r["timing_s"].get("all_cpu_s") for r in ok if r["timing_s"].get("all_cpu_s") is not None]
            dsum = m["device_sum_us"].get(p)
            each = ", ".join(f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "FAILED" for r in rs)
            mt = med[(p, lanes)]
            us = None if mt is None else m["chunk_tokens"] * 1e6 / mt
            cells = ["-" if mt is None else f"{mt:,.0f}", "-" if us is None else f"{us:,.0f}",
                     "-" if us is None or not dsum else f"{us / dsum:.3f}",
                     "-" if not cpu else f"{statistics.median(cpu):.2f}"]
            lines.append(f"| {kind} | {p if kind == 'fp8' else '-'} | {lanes} | {each} | " + " | ".join(cells) + " | "
                         f"{all(r.get('same_statistics_as_first_run') for r in rs)} |")
        for p in dict.fromkeys(p for p, _ in groups):
            a, b = med.get((p, "contexts")), med.get((p, "all"))
            if a and b:
                ra = [r["tokens_per_s"] for r in groups[(p, "contexts")] if "tokens_per_s" in r]
                rb = [r["tokens_per_s"] for r in groups[(p, "all")] if "tokens_per_s" in r]
                clear = min(rb) > max(ra) or min(ra) > max(rb)
                win = "all (layers on lanes)" if b > a else "contexts"
                winners.append((kind, p, "all" if b > a else "contexts", clear))
                verdicts.append(f"{kind}{' ' + p if kind == 'fp8' else ''}: {win} by {abs(b / a - 1):.1%} (median "
                                f"{b:,.0f} vs {a:,.0f}); {'every run agrees' if clear else 'runs overlap: within noise'}")
        best = {p: max((v for (q, _), v in med.items() if q == p and v), default=None) for p, _ in groups}
        if best.get("decode") and best.get("bf16"):
            verdicts.append(f"{kind}: fp8 proj bf16 (wkv decoded once) vs decode (a scratch decode a chunk), best lane "
                            f"mode each: {best['bf16']:,.0f} vs {best['decode']:,.0f} tokens/s "
                            f"(x{best['bf16'] / best['decode']:.3f}); wkv bytes on the device {m.get('wkv_device_bytes')}")
        for e in m.get("errors", []):
            verdicts.append(f"{kind}: error in {e['what']}: {e['error']}")
        if m["device_sum_us"]:
            verdicts.append(f"{kind}: device sum a chunk (us) {m['device_sum_us']} -> cap "
                            + ", ".join(f"{p} {m['chunk_tokens'] * 1e6 / v:,.0f} tokens/s" for p, v in
                                        m["device_sum_us"].items()) + f"; tables {m['tables']}")
    modes = {w[2] for w in winners}
    if winners and len(modes) == 1 and all(w[3] for w in winners):
        verdicts.append(f"LANES: every model and projection favours {modes.pop()!r}, every run agreeing: make it "
                        "the default (analysis.corpus.LANES)")
    elif winners:
        verdicts.append("LANES: no single verdict (" + "; ".join(f"{k} {p}: {w}{'' if c else ', within noise'}"
                                                                for k, p, w, c in winners)
                        + "): where every run agrees the mode matters for that model; within noise it does not")
    return "\n".join(lines + [""] + verdicts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "corpus_lanes_out"), help="output folder (default $OUT)")
    p.add_argument("--chunks", type=int, default=400, help="4096-token chunks a run (both models)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant, the order reversed each time")
    p.add_argument("--models", default="q2k,fp8", help="comma list of q2k, fp8")
    p.add_argument("--fp8-proj", default="decode,bf16", help="comma list of decode, bf16 (the FP8 model's wkv)")
    p.add_argument("--lanes", default=",".join(LANE_MODES), help="comma list of contexts, all")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in the simulator (NUMBA_ENABLE_CUDASIM=1)")
    p.add_argument("--summarize", default=None, metavar="JSON",
                   help="only print (and write beside it) the summary table of a corpus_lanes.json (a run cut short)")
    args = p.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            res = json.load(f)
        table = summary(res) + ("" if "total_s" in res else "\n(the run did not finish: the runs above are those done)\n")
        with open(os.path.join(os.path.dirname(os.path.abspath(args.summarize)), "corpus_lanes.txt"), "w") as f:
            f.write(table)
        print(table)
        return 0
    args.models = [x for x in args.models.split(",") if x]
    args.fp8_proj = [x for x in args.fp8_proj.split(",") if x]
    args.lanes = [x for x in args.lanes.split(",") if x]
    bad = ([m for m in args.models if m not in ("q2k", "fp8")] + [x for x in args.fp8_proj if x not in ("decode", "bf16")]
           + [x for x in args.lanes if x not in LANE_MODES])
    if bad or args.chunks < 1 or args.repeats < 1 or not args.models or not args.lanes or not args.fp8_proj:
        print(f"error: bad arguments {bad or ''} (models q2k,fp8; --fp8-proj decode,bf16; --lanes contexts,all; "
              "--chunks and --repeats >= 1)", file=sys.stderr)
        return 2
    from numba import cuda
    from numba.cuda import config
    if not args.smoke and (config.ENABLE_CUDASIM or not cuda.is_available()):
        print("error: needs a CUDA GPU (or --smoke in the simulator)", file=sys.stderr)
        return 2
    from engram_numba.bench.timing import commit, device_name
    os.makedirs(args.out, exist_ok=True)
    res = {"commit": commit(), "device": device_name(), "chunks": args.chunks, "repeats": args.repeats,
           "switch_interval": sys.getswitchinterval(), "cpus": os.cpu_count(), "models": {}}
    path = os.path.join(args.out, "corpus_lanes.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    t0 = time.perf_counter()
    for kind in args.models:
        try:
            run_model(kind, args, res, save)
        except Exception as exc:  # noqa: BLE001 - the other model still runs
            res["models"].setdefault(kind, {"runs": [], "device_sum_us": {}, "chunk_tokens": 4096, "errors": []})
            res["models"][kind]["errors"].append({"what": "model", "error": repr(exc), "trace": traceback.format_exc()})
            print(f"{kind}: FAILED {exc!r}")
        gc.collect()                            # the model's device tables freed before the next model's
        try:                                    # free memory is read (the FP8 tables' fit)
            cuda.current_context().deallocations.clear()
        except AttributeError:                  # the simulator
            pass
    res["total_s"] = round(time.perf_counter() - t0, 1)
    save()
    table = summary(res) + f"\ntotal {res['total_s']} s\n"
    with open(os.path.join(args.out, "corpus_lanes.txt"), "w") as f:
        f.write(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
