"""`engram-numba diff`: two backends stage by stage (or stage-isolated), two models, or two saved
captures; `--max-ulp` / `--rtol` turn it into a check (exit status 1)."""
from __future__ import annotations

import numpy as np

from .common import EXIT_TOLERANCE, UserError, backend_spec, check_ids, existing_file, float_at_least, model_path, open_model, parse_token_list


def add_parser(sub) -> None:
    s = sub.add_parser("diff", help="diff two backends stage by stage, two models, or two saved captures")
    s.add_argument("file", nargs="?", help="a model in any format (default: the tiny model), or the first of two "
                                           "saved captures (.npz or .safetensors)")
    s.add_argument("file_b", nargs="?", help="the second capture .npz (diff two saved captures)")
    s.add_argument("--model-a", help="diff two models: the first (any format load_model opens)")
    s.add_argument("--model-b", help="diff two models: the second; the same tokens go through both")
    s.add_argument("--a", type=backend_spec, default=None,
                   help="backend of the first run (default reference)")
    s.add_argument("--b", type=backend_spec, default=None,
                   help="backend of the second run (default cuda; with --model-a/--model-b: the same as --a)")
    s.add_argument("--tokens")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--max-ulp", type=float_at_least(0), default=None,
                   help="exit 1 when a float point differs by more ulps (of its own precision)")
    s.add_argument("--rtol", type=float_at_least(0), default=None,
                   help="exit 1 when a float point's relative L2 distance is larger")
    s.add_argument("--isolated", action="store_true",
                   help="feed every stage of the --b run the --a run's inputs of it (Pipeline.run(inputs_from=...)), "
                        "so each stage's own error shows, not the errors of the stages before it compounded")
    s.set_defaults(func=cmd_diff)


def _tokens(args, model, fallback):
    return check_ids(fallback if args.tokens is None else parse_token_list(args.tokens), model)


def _check_tolerances(report, max_ulp, rtol) -> list[str]:
    """The points whose float distance exceeds a tolerance (integer points must be equal)."""
    bad = []
    for r in report.rows:
        if r.n == 0:
            bad.append(f"{r.name}: shapes or dtypes differ")
        elif r.kind == "int":
            if not r.equal:
                bad.append(f"{r.name}: {r.n - r.n_equal} integer elements differ")
        else:
            if max_ulp is not None and r.max_ulp > max_ulp:
                bad.append(f"{r.name}: max {r.max_ulp:.0f} ulps > {max_ulp}")
            if rtol is not None and r.rel_l2 > rtol:
                bad.append(f"{r.name}: rel L2 {r.rel_l2:.3g} > {rtol}")
    return bad


def cmd_diff(args) -> int:
    from ..analysis.diff import diff
    from ..capture import Capture
    from ..fixtures import TINY_TOKENS
    from ..pipeline import Pipeline
    files = [a for a in (args.file, args.file_b) if a is not None]
    if args.model_a is not None or args.model_b is not None:     # one token sequence through two models
        if args.model_a is None or args.model_b is None or files:
            raise UserError("--model-a and --model-b go together (and without positional files)")
        if args.isolated:
            raise UserError("--isolated feeds one model's stages the inputs of another run of the same model; "
                            "it does not apply to --model-a/--model-b")
        return _diff_models(args)
    a = args.a if args.a is not None else "reference"
    b = args.b if args.b is not None else "cuda"
    if len(files) == 2:                                  # two saved captures
        if args.isolated:
            raise UserError("--isolated runs the model; two saved captures are compared as they are")
        paths = [existing_file(f, "capture file") for f in files]
        caps = []
        for p in paths:
            try:
                caps.append(Capture.load(p))
            except Exception as exc:
                raise UserError(f"{p} is not a capture saved by engram-numba ({type(exc).__name__}: {exc})") from None
        report = diff(*caps, label_a=str(paths[0]), label_b=str(paths[1]))
    else:
        path = existing_file(args.file)
        model = open_model(path)
        tokens = _tokens(args, model, TINY_TOKENS)
        cap_a = Pipeline(model, backends=a, residual=args.residual).run(tokens)
        pipe_b = Pipeline(model, backends=b, residual=args.residual)
        cap_b = pipe_b.run(inputs_from=cap_a) if args.isolated else pipe_b.run(tokens)
        report = diff(cap_a, cap_b, label_a=_label(a), label_b=_label(b) + (" (isolated)" if args.isolated else ""))
    print(report)
    return _tolerance_exit(args, report)


def _tolerance_exit(args, report) -> int:
    if args.max_ulp is None and args.rtol is None:
        return 0
    bad = _check_tolerances(report, args.max_ulp, args.rtol)
    for line in bad:
        print(f"tolerance exceeded: {line}")
    print("diff: within tolerances" if not bad else f"diff: {len(bad)} point(s) exceed the tolerances")
    return EXIT_TOLERANCE if bad else 0


def _nonfinite_lines(label: str, cap) -> list[str]:
    """One line per float point of a capture that holds NaN or inf (rows that decode to NaN reach
    the projection and the gate as NaN; they are never replaced)."""
    from ..bf16 import bf16_to_f32
    out = []
    for name in cap:
        arr = cap[name]
        if arr.dtype == np.uint16 and not name.endswith(".raw"):   # bf16 words
            vals = bf16_to_f32(arr)
        elif arr.dtype.kind == "f":
            vals = arr
        else:
            continue
        n = int((~np.isfinite(vals)).sum())
        if n:
            out.append(f"  {label}: {name} holds {n} NaN/inf value(s) of {vals.size}")
    return out


def _diff_models(args) -> int:
    """The same tokens through two models (any formats), stage by stage."""
    from ..analysis.diff import diff
    from ..fixtures import TINY_TOKENS
    from ..formats.load import load_model
    from ..pipeline import Pipeline
    a_backend = args.a if args.a is not None else "reference"
    b_backend = args.b if args.b is not None else a_backend
    models = [load_model(model_path(p, f"--model-{w}")) for p, w in ((args.model_a, "a"), (args.model_b, "b"))]
    ca, cb = (m.config for m in models)
    for field in ("dim", "hc", "layer_ids", "max_ngram_size", "n_heads", "head_dim"):
        if getattr(ca, field) != getattr(cb, field):
            raise UserError(f"the two models differ in {field} ({getattr(ca, field)} vs {getattr(cb, field)}): "
                            "their stages cannot be compared")
    vocab = min(m.hash_tables.token_map.size for m in models)
    tokens = TINY_TOKENS if args.tokens is None else parse_token_list(args.tokens)
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise UserError(f"token id {int(tokens[i])} at position {i} is outside the models' token maps [0, {vocab})")
    caps = [Pipeline(m, backends=be, residual=args.residual).run(tokens)
            for m, be in ((models[0], a_backend), (models[1], b_backend))]
    labels = [f"A {models[0].format} [{_label(a_backend)}]", f"B {models[1].format} [{_label(b_backend)}]"]
    print(f"A: {models[0].path}\n   {models[0].format}\nB: {models[1].path}\n   {models[1].format}")
    if not np.array_equal(models[0].hash_tables.token_map[:vocab], models[1].hash_tables.token_map[:vocab]):
        print("note: the two token maps differ, so the hash ids (and the rows) of the two models differ too")
    report = diff(*caps, label_a=labels[0], label_b=labels[1])
    print(report)
    nonfinite = _nonfinite_lines("A", caps[0]) + _nonfinite_lines("B", caps[1])
    if nonfinite:
        print("NaN/inf in the captures (a stored row that decodes to NaN/inf; `engram-numba info` counts them):")
        print("\n".join(nonfinite))
    for m in models:
        m.close()
    return _tolerance_exit(args, report)


def _label(spec) -> str:
    return spec if isinstance(spec, str) else ",".join(f"{k}={v}" for k, v in spec.items())
