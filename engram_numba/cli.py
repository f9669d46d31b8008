"""The `engram-numba` command.

    engram-numba demo                       the tiny model through every backend, diffed
    engram-numba info FILE                  configuration, keys, tensors, primes-vs-rows check
    engram-numba run FILE --tokens 1,2,3 --backend cuda [--capture out.npz]
    engram-numba diff FILE --a reference --b cuda [--tokens ...]
    engram-numba make-fixture [--out data/tiny_v41.gguf]
    engram-numba bench [--out bench/results/h200.json]     (needs a GPU)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def _parse_tokens(text: str | None, fallback: np.ndarray) -> np.ndarray:
    if not text:
        return fallback
    try:
        return np.array([int(t) for t in text.replace(" ", "").split(",") if t], dtype=np.int64)
    except ValueError:
        raise SystemExit(f"--tokens must be comma-separated integers, got {text!r}") from None


def _parse_backends(text: str):
    """'cuda' or 'rows=cpu,proj=cuda' -> what Pipeline takes."""
    if "=" not in text:
        return text
    out = {}
    for part in text.split(","):
        stage, _, backend = part.partition("=")
        out[stage.strip()] = backend.strip()
    return out


def cmd_info(args) -> int:
    from .model_file import EngramFileError, describe, load_gguf
    # validate=False so that a file whose primes and tables disagree is still described, with the
    # mismatch marked; a file that cannot be read at all is an error naming the problem.
    try:
        with load_gguf(args.file, validate=False) as model:
            print(describe(model))
            return 1 if model.problems else 0
    except EngramFileError as exc:
        print(f"error: {args.file}: {exc}", file=sys.stderr)
        return 2


def cmd_make_fixture(args) -> int:
    from .fixtures import TINY_GOLDEN_PATH, TINY_PATH, make_fixture
    out = Path(args.out) if args.out else TINY_PATH
    golden = None if args.no_golden else (Path(args.golden) if args.golden else
                                          (TINY_GOLDEN_PATH if out == TINY_PATH else out.with_name(out.stem + "_golden.npz")))
    make_fixture(out, golden)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)" + (f" and {golden}" if golden else ""))
    return 0


def _load(path):
    from .fixtures import tiny_model_path
    from .model_file import load_gguf
    return load_gguf(path if path else tiny_model_path())


def cmd_run(args) -> int:
    from .fixtures import TINY_TOKENS
    from .pipeline import Pipeline
    from .stats import gate_stats
    model = _load(args.file)
    tokens = _parse_tokens(args.tokens, TINY_TOKENS)
    pipe = Pipeline(model, backends=_parse_backends(args.backend), residual=args.residual)
    t0 = time.perf_counter()
    cap = pipe.run(tokens, progress=True)
    print(f"ran {tokens.size} tokens through {pipe.backends} in {time.perf_counter() - t0:.2f} s")
    print(gate_stats(cap))
    if args.capture:
        cap.save(args.capture)
        print(f"captures ({len(cap)} points) saved to {args.capture}")
    return 0


def cmd_diff(args) -> int:
    from .compare import diff
    from .fixtures import TINY_TOKENS
    from .pipeline import Pipeline
    model = _load(args.file)
    tokens = _parse_tokens(args.tokens, TINY_TOKENS)
    caps = [Pipeline(model, backends=_parse_backends(b), residual=args.residual).run(tokens) for b in (args.a, args.b)]
    report = diff(*caps, label_a=args.a, label_b=args.b)
    print(report)
    return 0


def cmd_demo(args) -> int:
    import matplotlib
    matplotlib.use("Agg")

    from . import SIMULATOR
    from .compare import diff
    from .fixtures import TINY_MASK, TINY_TOKENS, tiny_model_path
    from .model_file import load_gguf
    from .pipeline import Pipeline
    from .plots import gate_heatmap
    from .stats import gate_stats

    path = Path(args.file) if args.file else tiny_model_path()
    model = load_gguf(path)
    cfg = model.config
    print(f"model: {path}  dim={cfg.dim} hc={cfg.hc} engram layers={list(cfg.layer_ids)} "
          f"n_hash_cols={cfg.n_hash_cols} K={cfg.proj_in} N={cfg.proj_out}")
    print(f"tokens ({TINY_TOKENS.size}): {TINY_TOKENS.tolist()}  (token {int(np.argmin(TINY_MASK))} masked)")
    print(f"cuda backend: {'numba CUDA simulator (no GPU here)' if SIMULATOR else 'GPU'}\n")

    caps = {}
    for backend in ("reference", "cpu", "cuda"):
        t0 = time.perf_counter()
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caps[backend] = Pipeline(model, backends=backend, residual=args.residual).run(
                TINY_TOKENS, token_mask=TINY_MASK)
        print(f"  {backend:9s} pipeline: {time.perf_counter() - t0:6.2f} s")
    print()
    for other in ("cpu", "cuda"):
        print(diff(caps["reference"], caps[other], label_a="reference", label_b=other))
        print()
    if SIMULATOR:
        print("(in the simulator the cuda launchers default to the naive kernels, which add in the "
              "reference's order: hence all equal; on a GPU the fast kernels show their ulps)\n")
    # The same inputs with DeepSeek's bf16 residual instead of the engine's fp32 highway.
    other_res = "bf16" if args.residual == "fp32" else "fp32"
    cap_res = Pipeline(model, backends="cpu", residual=other_res).run(TINY_TOKENS, token_mask=TINY_MASK)
    names = [n for n in caps["reference"] if n.split(".", 1)[-1] in ("gate.dot", "gate.gate", "highway.out")]
    print(diff(caps["reference"], cap_res, names=names, label_a=f"residual {args.residual}",
               label_b=f"residual {other_res}"))
    print()
    print(gate_stats(caps["reference"]))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "gate_heatmap.png"
    fig = gate_heatmap(caps["reference"], token_labels=[str(t) for t in TINY_TOKENS])
    fig.savefig(png, dpi=120, bbox_inches="tight")
    cap_path = out_dir / "reference_capture.npz"
    caps["reference"].save(cap_path)
    print(f"\ngate heatmap saved to {png.resolve()}")
    print(f"reference captures saved to {cap_path.resolve()}")
    return 0


def cmd_bench(args) -> int:
    from .bench import main as bench_main
    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram-numba", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("demo", help="run the tiny model through the reference, cpu and cuda backends")
    s.add_argument("--file", help="a schema-A GGUF (default: the tiny model in data/)")
    s.add_argument("--out-dir", default="engram_demo", help="where the heatmap and captures go")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("info", help="describe a V4.1 engram GGUF")
    s.add_argument("file")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("run", help="run a token sequence through the pipeline")
    s.add_argument("file", nargs="?", help="GGUF (default: the tiny model)")
    s.add_argument("--tokens", help="comma-separated raw token ids (default: the tiny test sequence)")
    s.add_argument("--backend", default="reference",
                   help="reference | cpu | cuda, or per stage: rows=cpu,proj=cuda,gate=reference")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--capture", help="save every stage's arrays to this .npz")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("diff", help="run two backends and diff them stage by stage")
    s.add_argument("file", nargs="?", help="GGUF (default: the tiny model)")
    s.add_argument("--a", default="reference")
    s.add_argument("--b", default="cuda")
    s.add_argument("--tokens")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("make-fixture", help="rebuild data/tiny_v41.gguf and its golden captures")
    s.add_argument("--out")
    s.add_argument("--golden")
    s.add_argument("--no-golden", action="store_true")
    s.set_defaults(func=cmd_make_fixture)

    s = sub.add_parser("bench", help="benchmark every stage on the GPU (H200)")
    s.add_argument("--out", default="bench/results/h200.json")
    s.add_argument("--png", default=None)
    s.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    s.add_argument("--table-gb", type=float, default=2.0, help="size of the random Q2_K table on the device")
    s.add_argument("--variants-only", action="store_true", help="only time every kernel version")
    s.add_argument("--no-variants", action="store_true", help="skip the per-version sweep")
    s.add_argument("--hash-only", action="store_true",
                   help="only the hasher's 4096-token prefill at the released configuration (CPU, no GPU needed)")
    s.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
