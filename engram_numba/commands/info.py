"""`engram-numba info`: describe a model in any format (configuration, keys, tensors, the checks)."""
from __future__ import annotations

import json

from .common import EXIT_TOLERANCE, model_path


def add_parser(sub) -> None:
    s = sub.add_parser("info", help="describe an Engram model (any format): configuration, keys, tensors, checks")
    s.add_argument("file", help="a GGUF, any shard of a split GGUF or its folder, a ds4 GGUF, or an HF "
                                "checkpoint folder or its model.safetensors.index.json")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--scan-rows", action="store_true",
                   help="count rows that decode to NaN/inf in every table, however big (reads every row's scales)")
    s.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    from ..formats.describe import describe, describe_dict, ok
    from ..formats.load import load_model
    from ..placement import format_placement, placement_report
    path = model_path(args.file)
    # validate=False so that a file whose primes and tables disagree (or whose constants overflow
    # int64) is still described, with the failed check marked (exit status 1); a file that cannot
    # be read at all is an error naming the problem (exit status 2).
    with load_model(path, validate=False) as model:
        info = describe_dict(model, scan_rows=True if args.scan_rows else None)
        info["placement"] = placement_report(model)       # what tables="auto" picks here (nothing built)
        if args.json:
            print(json.dumps(info, indent=1))
        else:
            print(describe(model, info=info) + "\n" + format_placement(info["placement"]))
        return 0 if ok(info) else EXIT_TOLERANCE
