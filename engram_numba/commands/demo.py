"""`engram-numba demo`: the tiny model through the reference, cpu and cuda backends, diffed."""
from __future__ import annotations

from pathlib import Path

from .common import MODEL_HELP, T_START, UserError, existing_file


def add_parser(sub) -> None:
    s = sub.add_parser("demo", help="run the tiny model through the reference, cpu and cuda backends")
    s.add_argument("--file", help=MODEL_HELP)
    s.add_argument("--out-dir", default="engram_demo", help="where the heatmap and captures go")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--sim-tokens", type=int, default=2,
                   help="without a GPU: tokens the cuda pipeline runs in numba's simulator (default 2; ~3 s each)")
    s.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from ..demo import run_demo
    path = existing_file(args.file)
    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out-dir {out_dir} exists and is not a folder")
    if args.sim_tokens < 1:
        raise UserError(f"--sim-tokens must be >= 1, got {args.sim_tokens}")
    return run_demo(path, out_dir, residual=args.residual, sim_tokens=args.sim_tokens, t_start=T_START)
