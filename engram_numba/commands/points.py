"""`engram-numba points`: the capture points of a model (names for --capture, diff, hooks)."""
from __future__ import annotations

from .common import MODEL_HELP, model_path, open_model


def add_parser(sub) -> None:
    s = sub.add_parser("points", help="list the capture points of a model (names for --capture, diff, hooks)")
    s.add_argument("file", nargs="?", help=MODEL_HELP)
    s.set_defaults(func=cmd_points)


def cmd_points(args) -> int:
    from ..capture import OBSERVE_ONLY, point_names
    model = open_model(model_path(args.file) if args.file else None)
    for name in point_names(model):
        short = name.split(".", 1)[1] if name.startswith("L") else name
        print(f"{name:20s} {'output (hooks observe)' if short in OBSERVE_ONLY else 'hooks may replace it'}")
    return 0
