"""The kernel registry: one record per kernel version, the one list everything iterates.

A `KernelRecord` says what a kernel version is (stage, name, a one-line changelog), how to
launch it (`prepare`, the stage's prepare function for that version), how to compile it without
a GPU (`compile_targets`: kernels, argument types, launch bounds), whether it sums in the
reference's order (`bit_exact`), and when it is the default (`default_when` in words,
`default_rule` as a predicate over the launch's context). The pipeline, `EngramV41`, the bench
sweep, the compile-only check and the GPU tests all walk these records, so adding a kernel
version is one new function and one `register(KernelRecord(...))` line in the stage's
`records.py`.

Layering (no import cycles): this module imports nothing from the stages. Kernel modules import
`CompileTarget` from here; each stage's `records.py` imports its kernels and registers them; the
stage's `launch.py` picks records by name or by default rule; `catalog.py` imports every stage's
records for the tools that need all of them.

Names: one spelling everywhere, `<family>_v<N>` ("q2k_v3", "gemv_v3", "gate_v2"); stages are
`hash`, `rows`, `proj`, `gate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

STAGES = ("hash", "rows", "proj", "gate")
BACKENDS = ("reference", "cpu", "cuda")
CC_SM90 = (9, 0)


@dataclass(frozen=True)
class CompileTarget:
    """One kernel specialisation for the compile-only tier (sm_90, no GPU needed).

    name        "stage.record[variant]"
    kernel      a @cuda.jit dispatcher (its launch bounds are read from it)
    argtypes    numba types of the arguments
    spill_free  the compiled kernel must not spill registers (fast paths); teaching versions may
    vector_io   written around 16-byte loads/stores: the tier checks that they are still there
    """

    name: str
    kernel: Any
    argtypes: tuple
    spill_free: bool = True
    vector_io: bool = False


@dataclass(frozen=True)
class KernelRecord:
    """One kernel version of one stage.

    stage           "rows" | "proj" | "gate"
    name            unique within the stage, "<family>_v<N>"
    changelog       one line: what this version changes against the previous one (and, once
                    measured, what it bought)
    prepare         the stage's prepare function for this version: the same arguments as the
                    stage's launcher (`version` excluded), returns a PreparedLaunch
    compile_targets () -> list[CompileTarget]; every specialisation the launcher can pick
    bit_exact       True when the result is bit-identical to the numpy reference (integer
                    stages, or float sums in the reference's order)
    default_when    the default rule in words (shown by `engram-numba kernels` and the docs)
    default_rule    ctx -> bool: True where this record is the stage's default; ctx is a dict
                    the stage's launcher builds (tokens, shape, alignment, simulator, encoding)
    encoding        rows: the table encoding decoded ("q2k", "q8_0", "fp8", ...); proj: the
                    weight encoding read ("bf16", "q2k", "fp8", "q2k_r"); "" where it does not apply
    simulate        cheap enough to run in numba's simulator at the tests' tiny shapes
    requires        an optional dependency the version needs ("torch or cupy"), "" for none
    sweep           token counts at which the bench's version sweep times it (where it competes)
    """

    stage: str
    name: str
    changelog: str
    prepare: Callable[..., Any]
    compile_targets: Callable[[], list] = field(default=lambda: [])
    bit_exact: bool = False
    default_when: str = "never (pick it by name)"
    default_rule: Callable[[dict], bool] | None = None
    encoding: str = ""
    simulate: bool = True
    requires: str = ""
    sweep: tuple = ()

    def is_default(self, ctx: dict) -> bool:
        return bool(self.default_rule is not None and self.default_rule(ctx))

    def __repr__(self) -> str:
        exact = ", bit-exact" if self.bit_exact else ""
        return f"KernelRecord({self.stage}.{self.name}{exact}: {self.changelog})"


_RECORDS: dict[tuple[str, str], KernelRecord] = {}


def register(record: KernelRecord) -> KernelRecord:
    """Add a record; a second record with the same stage and name is an error."""
    if record.stage not in STAGES:
        raise ValueError(f"KernelRecord.stage must be one of {STAGES}, got {record.stage!r}")
    key = (record.stage, record.name)
    old = _RECORDS.get(key)
    if old is not None and old is not record:
        raise ValueError(f"kernel {record.stage}.{record.name} is registered twice")
    _RECORDS[key] = record
    return record


def records(stage: str | None = None, encoding: str | None = None) -> list[KernelRecord]:
    """Registered records, in registration order (the version order of each stage)."""
    if stage is not None and stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {list(STAGES)}")
    return [r for r in _RECORDS.values()
            if (stage is None or r.stage == stage) and (encoding is None or r.encoding == encoding)]


def names(stage: str, encoding: str | None = None) -> list[str]:
    return [r.name for r in records(stage, encoding)]


def get(stage: str, name: str) -> KernelRecord:
    """The record `stage`.`name`, or a ValueError listing the stage's versions."""
    rec = _RECORDS.get((stage, name))
    if rec is None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {list(STAGES)}")
        raise ValueError(f"no {stage} kernel version {name!r}; versions are {names(stage)}")
    return rec


def default(stage: str, ctx: dict) -> KernelRecord:
    """The one record of `stage` whose default rule holds for `ctx` (an error names the context
    when none or several claim it: the rules of a stage must partition its contexts)."""
    hits = [r for r in records(stage) if r.is_default(ctx)]
    if len(hits) != 1:
        what = "no" if not hits else f"{len(hits)} ({', '.join(r.name for r in hits)})"
        raise RuntimeError(f"{what} {stage} kernel versions claim to be the default for {ctx}; "
                           "fix the default rules in the stage's records.py")
    return hits[0]
