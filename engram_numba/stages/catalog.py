"""Every stage's kernel records, loaded: what the compile-only tier, the bench sweep, the GPU
tests and `engram-numba kernels` iterate.

    from engram_numba.stages import catalog
    for rec in catalog.records("proj"):
        print(rec.name, rec.default_when, rec.changelog)
"""
from __future__ import annotations

from . import registry
from .registry import KernelRecord, default, get, names, records
# registration order is stage order: rows, proj, gate
from .rows import records as _rows_records  # noqa: F401,I001
from .proj import records as _proj_records  # noqa: F401,I001
from .gate import records as _gate_records  # noqa: F401,I001

__all__ = ["KernelRecord", "records", "get", "names", "default", "compile_targets", "table"]


def compile_targets(stage: str | None = None) -> list:
    """The CompileTargets of every record (of one stage), in registry order."""
    out = []
    for rec in registry.records(stage):
        out.extend(rec.compile_targets())
    return out


def table(stage: str | None = None) -> str:
    """A text table of the records: stage, name, bit-exact, default rule, changelog."""
    rows = [("stage", "name", "exact", "default when", "changelog")]
    for r in registry.records(stage):
        rows.append((r.stage, r.name, "yes" if r.bit_exact else "", r.default_when, r.changelog))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
        if j == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 9)
    return "\n".join(lines)
