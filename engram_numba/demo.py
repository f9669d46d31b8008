"""`engram-numba demo`: the tiny model through the reference, cpu and cuda backends, diffed.

What it shows: the three backends agree (bit for bit where the kernels add in the reference's
order), what the fast kernels' numerics are, the gate table and heatmap, where the captures went.
Every step prints what it does and how long it took; the output names each kernel that ran and
where it ran.

Without a GPU the cuda backend runs in numba's CUDA simulator (pure Python, every thread a Python
thread): there the demo runs the cuda pipeline on the first few tokens only, with the naive
projection kernel (one thread per output column, the projection is most of the simulator's time),
and the fast GPU projections are not run at all: their kind of numerics (fp32 sums in another
order) is shown by the cpu BLAS projection instead, and the simulator runs the fast gate kernel,
which is cheap there. On a first run the cpu backend's @njit kernels are compiled (numba caches
them on disk) in a second process while the simulator runs, so the two overlap on two cores.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

SIM_TOKENS = 2                     # tokens the cuda pipeline runs in the simulator
SIM_PROJ = "gemv_v1"               # the naive projection: the cheapest to simulate, bit-exact
FAST_GATE = "gate_v3"              # the GPU's default gate kernel below 128 tokens
EXACT_VERSIONS = {"proj": "gemv_v1", "gate": "gate_v1"}   # naive, bit-exact (rows: the encoding's v1)


class _Clock:
    """Prints each step with the time since the demo started and how long the step took."""

    def __init__(self, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextlib.contextmanager
    def step(self, what: str):
        print(f"[{self.now():5.1f} s] {what} ...", flush=True)
        t, c = time.perf_counter(), time.process_time()
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # the simulator warning: the demo says it itself
            yield out
        extra = f"  {out['note']}" if out.get("note") else ""
        # CPU time beside wall time: on a busy machine the two differ, and the CPU time is what
        # the step costs on an idle one
        print(f"          done in {time.perf_counter() - t:.2f} s (CPU {time.process_time() - c:.2f} s){extra}",
              flush=True)


def _pair_line(a_label: str, b_label: str, report) -> str:
    """One line for a backend pair: all points bit-identical, or the worst point."""
    n = len(report.rows)
    same = sum(1 for r in report.rows if r.equal)
    if same == n:
        return f"  {a_label} vs {b_label}: {n}/{n} points bit-identical"
    worst = max((r for r in report.rows if not r.equal and r.kind != "int" and r.n),
                key=lambda r: r.rel_l2, default=None)
    ints = [r.name for r in report.rows if not r.equal and r.kind == "int"]
    desc = (f"worst {worst.name}: rel L2 {worst.rel_l2:.2e}, max {worst.max_ulp:.0f} {worst.kind} ulps, "
            f"{100.0 * worst.n_equal / worst.n:.1f}% elements equal" if worst is not None else "")
    if ints:
        desc += (", " if desc else "") + f"integer points differ: {ints}"
    return f"  {a_label} vs {b_label}: {same}/{n} points bit-identical; {desc}"


def _kernels_line(kernels: dict) -> str:
    return ", ".join(f"{stage}={name}" for stage, name in kernels.items()) or "none"


def _cpu_caches_present() -> bool:
    """True when numba's on-disk cache already holds the cpu backend's heavy @njit functions."""
    try:
        from .stages.gate.cpu import _gate
        from .stages.proj.cpu import _projection
        # an index whose source stamp is stale loads as empty: numba would compile again
        return all(d._cache._cache_file._load_index() for d in (_projection, _gate))
    except Exception:   # pragma: no cover - a numba without these internals: just compile
        return False


def warm_cpu(model_path: str) -> None:
    """Compile (or load from numba's cache) every @njit function the demo's cpu runs call."""
    from .fixtures import TINY_MASK, TINY_TOKENS
    from .formats.load import load_model
    from .pipeline import Pipeline
    from .stages.gate.cpu import gate_cpu
    from .stages.proj.cpu import projection_cpu
    with load_model(model_path) as model:
        cfg = model.config
        layer = model.layers[cfg.layer_ids[0]]
        # the two slowest compiles first (the main process compiles the hasher itself meanwhile),
        # with the argument types the pipeline passes; then a short run for the rest
        projection_cpu(np.zeros((2, cfg.proj_in), np.uint16), np.ascontiguousarray(layer.wkv_bf16()))
        gate_cpu(np.zeros((2, cfg.hc, cfg.dim), np.float32), np.zeros((2, cfg.proj_out), np.uint16),
                 layer.q_weight, layer.k_weight, np.ones(2, dtype=bool), "fp32", cfg.eps)
        Pipeline(model, backends="cpu").run(TINY_TOKENS[:2], token_mask=TINY_MASK[:2], progress=False)


def _start_cpu_warmer(model_path) -> subprocess.Popen | None:
    if _cpu_caches_present():
        return None
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import sys; from engram_numba.demo import warm_cpu; warm_cpu(sys.argv[1])"
    try:
        return subprocess.Popen([sys.executable, "-c", code, str(model_path)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError:     # pragma: no cover - no second process: the cpu run compiles in this one
        return None


def _run(pipe, tokens, mask, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the simulator warning: the demo says it itself
        return pipe.run(tokens, token_mask=mask, **kw)


def _naive_rows(encoding: str) -> str | None:
    from .stages import catalog  # noqa: F401  (registers every stage's records)
    from .stages import registry
    for rec in registry.records("rows", encoding=encoding):
        if rec.bit_exact and rec.name.endswith("_v1"):
            return rec.name
    return None


def run_demo(path=None, out_dir="engram_demo", residual: str = "fp32", sim_tokens: int = SIM_TOKENS,
             t_start: float | None = None) -> int:
    """The demo; `t_start` (a perf_counter value) is when the command started, so the times
    printed include the imports."""
    clock = _Clock(t_start)
    import matplotlib
    matplotlib.use("Agg")

    from . import SIMULATOR
    from .analysis.diff import diff
    from .analysis.plots import gate_heatmap
    from .analysis.stats import gate_stats
    from .fixtures import TINY_MASK, TINY_TOKENS, tiny_model_path
    from .formats.load import load_model
    from .pipeline import Pipeline

    out_dir = Path(out_dir)
    model_path = Path(path) if path is not None else tiny_model_path()
    warmer = _start_cpu_warmer(model_path) if SIMULATOR else None
    model = load_model(model_path)
    cfg = model.config
    T = TINY_TOKENS.size
    print(f"model: {model.path}  dim={cfg.dim} hc={cfg.hc} engram layers={list(cfg.layer_ids)} "
          f"n_hash_cols={cfg.n_hash_cols} K={cfg.proj_in} N={cfg.proj_out}  ({model.format})")
    print(f"tokens ({T}): {TINY_TOKENS.tolist()}  (token {int(np.argmin(TINY_MASK))} masked); highway: synthetic")
    S = max(1, min(int(sim_tokens), T))
    if SIMULATOR:
        print(f"cuda backend: no GPU in use -> numba's CUDA simulator on this CPU (pure Python, thousands of "
              f"times slower than a GPU): the cuda pipeline runs on the first {S} token(s), with the naive "
              f"projection {SIM_PROJ}")
    else:
        from numba import cuda
        name = cuda.get_current_device().name
        name = name.decode() if isinstance(name, bytes) else str(name)
        print(f"cuda backend: GPU {name}: all {T} tokens, with the default (fast) kernels and again with the "
              "naive bit-exact ones")
    if warmer is not None:
        print("first run: numba compiles the cpu backend's @njit kernels (cached on disk for the next run) "
              "in a second process while the other steps run")
    print()

    caps, lines = {}, []
    with clock.step(f"reference backend (numpy, the readable version): {T} tokens x {cfg.n_layers} layers") as st:
        caps["reference"] = _run(Pipeline(model, "reference", residual=residual), TINY_TOKENS, TINY_MASK)

    if SIMULATOR:
        with clock.step(f"cuda backend in numba's simulator: {S} token(s) x {cfg.n_layers} layers "
                        f"(the bar advances per token and layer)") as st:
            pipe = Pipeline(model, "cuda", residual=residual, versions={"proj": SIM_PROJ})
            cuda_cap = _run(pipe, TINY_TOKENS[:S], TINY_MASK[:S], progress=True, chunk_tokens=1)
            st["note"] = f"kernels ran (simulator): {_kernels_line(cuda_cap.meta['cuda_kernels'])}"
        ref_s = _run(Pipeline(model, "reference", residual=residual), TINY_TOKENS[:S], TINY_MASK[:S])
        lines.append(_pair_line("reference", f"cuda [{_kernels_line(cuda_cap.meta['cuda_kernels'])}, simulator, "
                                f"first {S} tokens]", diff(ref_s, cuda_cap)))
    else:
        with clock.step(f"cuda backend on the GPU, default kernels: {T} tokens x {cfg.n_layers} layers "
                        "(includes compiling each kernel once)") as st:
            fast_cap = _run(Pipeline(model, "cuda", residual=residual), TINY_TOKENS, TINY_MASK)
            st["note"] = f"kernels ran (GPU): {_kernels_line(fast_cap.meta['cuda_kernels'])}"
        exact = dict(EXACT_VERSIONS)
        rows_v1 = _naive_rows(caps["reference"].meta["encodings"][str(cfg.layer_ids[0])])
        if rows_v1:
            exact["rows"] = rows_v1
        with clock.step(f"cuda backend on the GPU, naive kernels: {T} tokens x {cfg.n_layers} layers") as st:
            cuda_cap = _run(Pipeline(model, "cuda", residual=residual, versions=exact), TINY_TOKENS, TINY_MASK)
            st["note"] = f"kernels ran (GPU): {_kernels_line(cuda_cap.meta['cuda_kernels'])}"
        lines.append(_pair_line("reference", f"cuda [{_kernels_line(cuda_cap.meta['cuda_kernels'])}, GPU]",
                                diff(caps["reference"], cuda_cap)))

    fast_lines = []
    if SIMULATOR:
        # the gate's inputs from the reference backend (no @njit compile needed, so this overlaps it)
        with clock.step(f"gate kernel {FAST_GATE} (the GPU default below 128 tokens) in the simulator, first {S} "
                        "token(s), on the reference's kv") as st:
            gate_cap = _run(Pipeline(model, {"hash": "reference", "rows": "reference", "proj": "reference",
                                             "gate": "cuda"}, residual=residual, versions={"gate": FAST_GATE}),
                            TINY_TOKENS[:S], TINY_MASK[:S], progress=False)
            st["note"] = f"kernel ran (simulator): gate={gate_cap.meta['cuda_kernels'].get('gate', '?')}"
        fast_lines.append(_pair_line("reference", f"cuda gate={gate_cap.meta['cuda_kernels'].get('gate', '?')} "
                                     f"(simulator, first {S} tokens)", diff(ref_s, gate_cap)))
    else:
        fast_lines.append(_pair_line("reference", f"cuda [{_kernels_line(fast_cap.meta['cuda_kernels'])}, GPU]",
                                     diff(caps["reference"], fast_cap)))

    with clock.step("gate heatmap and captures of the reference run"):
        out_dir.mkdir(parents=True, exist_ok=True)
        png = out_dir / "gate_heatmap.png"
        fig = gate_heatmap(caps["reference"], token_labels=[str(t) for t in TINY_TOKENS])
        fig.savefig(png, dpi=120, bbox_inches="tight")
        cap_path = out_dir / "reference_capture.npz"
        caps["reference"].save(cap_path)

    if warmer is not None:
        with clock.step("waiting for the cpu backend's @njit compile (second process)") as st:
            import resource
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            _, err = warmer.communicate()
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            st["note"] = (f"(that process: CPU {after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime:.2f} s"
                          ", imports included)")
            if warmer.returncode != 0:   # the cpu run below compiles in this process and reports any error
                print(f"          (the compile process failed; compiling here: "
                      f"{err.decode(errors='replace').strip().splitlines()[-1:] or ''})")
    with clock.step(f"cpu backend (@njit, reference's summation order): {T} tokens x {cfg.n_layers} layers, "
                    "then with the BLAS projection and with the bf16 residual"):
        caps["cpu"] = _run(Pipeline(model, "cpu", residual=residual), TINY_TOKENS, TINY_MASK)
        blas = _run(Pipeline(model, "blas", residual=residual), TINY_TOKENS, TINY_MASK)
        # the same inputs with DeepSeek's bf16 residual instead of the engine's fp32 highway
        other_res = "bf16" if residual == "fp32" else "fp32"
        cap_res = _run(Pipeline(model, backends="cpu", residual=other_res), TINY_TOKENS, TINY_MASK)
    lines.insert(0, _pair_line("reference", "cpu", diff(caps["reference"], caps["cpu"])))

    print("\nDo the backends agree? (bit-identical = every element has the same bits)")
    print("\n".join(lines))
    print("\nThe fast kernels' numerics (fp32 sums in another order than the reference's):")
    print("\n".join(fast_lines))
    if SIMULATOR:
        print(_pair_line("reference", "cpu with proj=blas (numpy fp32 matmul)", diff(caps["reference"], blas)))
        print("  The fast GPU projections (gemv_v3, gemv_q2k_v2, gemm_v4, ...) are not run in the simulator; they too\n"
              "  add in other orders (docs/numerics.md), as the BLAS projection above does.")
    names = [n for n in caps["reference"] if n.split(".", 1)[-1] in ("gate.dot", "gate.gate", "highway.out")]
    print()
    print(diff(caps["reference"], cap_res, names=names, label_a=f"residual {residual}",
               label_b=f"residual {other_res}"))
    print()
    print(gate_stats(caps["reference"]))
    print(f"\ngate heatmap saved to {png.resolve()}")
    print(f"reference captures saved to {cap_path.resolve()}")
    print(f"demo done in {clock.now():.1f} s (since the command started, imports included)")
    model.close()
    return 0
