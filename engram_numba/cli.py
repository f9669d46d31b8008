"""The `engram-numba` command.

    engram-numba demo                          the tiny model through every backend, diffed
    engram-numba info PATH [--json]            any format: configuration, keys, tensors, the checks
    engram-numba run [FILE] --text "..." | --text-file F | --tokens 1,2,3 | --tokens-file F
                     [--tokenizer tokenizer.json] [--highway H.safetensors] [--backend cuda]
                     [--capture out.npz | out.safetensors]
    engram-numba stats CORPUS... [--model FILE] [--backend cuda] [--out DIR] [--tables parquet|csv]
    engram-numba stats --merge A/stats.npz B/stats.npz [--out DIR]     parts reduced separately
    engram-numba diff [FILE] --a reference --b cuda [--tokens ...] [--isolated] [--max-ulp N] [--rtol X]
    engram-numba diff A.npz B.npz [--max-ulp N] [--rtol X]          two saved captures
    engram-numba diff --model-a PATH --model-b PATH [--tokens ...]  two models (any formats), same tokens
    engram-numba points [FILE]                 the capture points of a model (for --capture, diff, hooks)
    engram-numba kernels [--stage proj]        the kernel registry: versions, defaults, changelogs
    engram-numba make-fixture [--out data/tiny_v41.gguf]
    engram-numba bench [--out bench/results/h200.json]     (needs a GPU; --smoke runs anywhere)

A user mistake (a missing file, a bad token list, an unknown backend, an unwritable output path)
prints one line starting with "error:" and exits with status 2; nothing runs before the
arguments are checked. ENGRAM_DEBUG=1 shows the traceback as well.
"""
from __future__ import annotations

from .commands.common import EXIT_USAGE, UserError  # first: the demo's clock starts with the command's imports

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from .commands import bench, demo, diff, info, kernels, make_fixture, points, run, stats  # noqa: E402

COMMANDS = (demo, info, run, stats, diff, points, kernels, make_fixture, bench)   # in the order --help lists them


# options whose value may start with "-" (a token list such as -1,2): argparse would take the value
# for an option and answer "expected one argument"; main() glues them as --tokens=-1,2
_VALUE_MAY_START_WITH_DASH = ("--tokens",)


def _glue_dash_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _VALUE_MAY_START_WITH_DASH and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="engram-numba", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"engram-numba {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(_glue_dash_values(list(sys.argv[1:] if argv is None else argv)))
    from .formats.errors import EngramFileError
    try:
        return args.func(args)
    except (UserError, EngramFileError) as exc:
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, KeyError, TypeError, OSError) as exc:
        # Checks inside the library name the problem (token, tensor, range); say it in one line.
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {msg} ({type(exc).__name__}; ENGRAM_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
