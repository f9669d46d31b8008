"""`engram-numba make-fixture`: rebuild the tiny model file and its golden captures."""
from __future__ import annotations

from .common import writable


def add_parser(sub) -> None:
    s = sub.add_parser("make-fixture", help="rebuild data/tiny_v41.gguf and its golden captures")
    s.add_argument("--out")
    s.add_argument("--golden")
    s.add_argument("--no-golden", action="store_true")
    s.set_defaults(func=cmd_make_fixture)


def cmd_make_fixture(args) -> int:
    from ..fixtures import TINY_GOLDEN_PATH, TINY_PATH, make_fixture
    out = writable(args.out, "fixture") if args.out else TINY_PATH
    golden = None if args.no_golden else (writable(args.golden, "golden captures") if args.golden else
                                          (TINY_GOLDEN_PATH if out == TINY_PATH else out.with_name(out.stem + "_golden.npz")))
    make_fixture(out, golden)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)" + (f" and {golden}" if golden else ""))
    return 0
