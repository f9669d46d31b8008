"""`engram-numba kernels`: the kernel registry (versions, default rules, changelogs)."""
from __future__ import annotations




def add_parser(sub) -> None:
    s = sub.add_parser("kernels", help="list the kernel registry: versions, default rules, changelogs")
    s.add_argument("--stage", choices=["rows", "proj", "gate"])
    s.set_defaults(func=cmd_kernels)


def cmd_kernels(args) -> int:
    from ..stages import catalog
    print(catalog.table(args.stage))
    return 0
