"""The kernel registry: one record per kernel version, the one list everything iterates.

The record is the kernel: a `KernelRecord` says what a kernel version is (stage, name, a one-line
changelog), carries the kernel itself (or a factory of its specialisations), its launch geometry,
its argument form, the argument types the compile-only tier compiles it with, the shapes the
simulator tests run it at, the bytes and flops of one launch (the bench's floor), whether it sums in the reference's order (`bit_exact`) and when it is
the default (`default_when` in words, `default_rule` as a predicate over the launch's context).
Each stage has ONE generic launcher that reads these fields (`proj.cuda_common.prepare`,
`rows.cuda_common.prepare`, `gate.cuda.prepare`); the pipeline, `EngramV41`, the bench sweep, the
compile-only check (`stages.compile_check`) and the GPU tests all walk the records, so adding a
kernel version is its kernel function plus one `register(KernelRecord(...))` in the stage's
`records.py` (CONTRIBUTING.md has a worked example).

Layering (no import cycles): this module imports nothing from the stages. Each stage's
`records.py` imports its kernels and its launcher and registers the records; the stage's
`launch.py` picks records by name or by default rule; `catalog.py` imports every stage's records
for the tools that need all of them.

Names: one spelling everywhere, `<family>_v<N>` ("q2k_v3", "gemv_v3", "gate_v2"); stages are
`hash`, `rows`, `proj`, `gate`.
"""
from __future__ import annotations

from dataclasses import dataclass
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
class Spec:
    """One specialisation of a record's kernel that the compile-only tier compiles.

    tag         appended to "stage.name" in the target's name: "" (one kernel), "[TB=2]" (a
                variant), ".gather[i32]" (one role of several)
    kernel      the @cuda.jit dispatcher
    argtypes    numba types of its arguments
    spill_free / vector_io   None: the record's
    """

    tag: str
    kernel: Any
    argtypes: tuple
    spill_free: bool | None = None
    vector_io: bool | None = None


class Factory:
    """A kernel built per launch key (`fn(*key) -> dispatcher`), for records whose launcher picks
    one of several specialisations: gemv_v2's token block, gate_v3's chunks a thread."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *key):
        return self.fn(*key)

    def __repr__(self) -> str:
        return f"Factory({getattr(self.fn, '__name__', self.fn)!r})"


@dataclass(frozen=True)
class KernelRecord:
    """One kernel version of one stage: what it is, and everything needed to run, compile,
    simulate and time it. The stage's one generic launcher (`launcher`) reads the record; no
    kernel module maps names to kernels, grids or argument types.

    stage           "rows" | "proj" | "gate"
    name            unique within the stage, "<family>_v<N>"
    changelog       one line: what this version changes against the previous one (and, once
                    measured, what it bought)
    launcher        the stage's generic prepare, `launcher(record, *launch arguments)` ->
                    PreparedLaunch; `record.prepare(...)` calls it (a record that runs another
                    library's kernel, such as cuBLAS, brings its own)
    kernel          the @cuda.jit dispatcher; a dict role -> dispatcher where the stage has
                    several roles (rows: "decode", "gather"); or a `Factory` that builds the
                    specialisation a launch key picks
    geometry        the stage's shape arguments -> the launch geometry (proj: (T, N) -> (grid,
                    block) or (grid, block, dynamic shared bytes); rows: n -> (blocks, threads);
                    gate: (T, hc, dim, layout, tps) -> a dict with grid, block, tps, nch)
    args            the argument form the launcher builds (each stage's launcher documents its
                    forms: "naive" arrays as given, or the flat word views of the fast kernels)
    align           bytes of alignment the fast argument forms need of the weight / table
    specs           () -> [Spec]: every specialisation the launcher can pick, with argument
                    types, for the compile-only tier (read through `compile_targets()`)
    spill_free      the compiled kernels must not spill registers (fast paths); teaching versions may
    vector_io       written around 16-byte loads/stores: the compile tier checks they are still there
    sim_cases       shapes the simulator tier runs this version at (the stage's tests read them)
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
    cost            the stage's shape arguments -> (bytes moved, flops) of one launch, the bench's
                    floor: bytes read from and written to device memory once each (inputs,
                    weights, outputs), flops of the multiply-adds (2 a product; 0 where the stage
                    has no matrix product). rows: cost(n) for n rows gathered by int64 id;
                    proj: cost(T, K, N); gate: cost(T, hc, dim, residual_bytes=4) with the
                    [T, hc] fp32 dot and gate outputs written. Read through `launch_cost()`.
    """

    stage: str
    name: str
    changelog: str
    launcher: Callable[..., Any] | None = None
    kernel: Any = None
    geometry: Callable[..., Any] | None = None
    args: str = ""
    align: int = 0
    specs: Callable[[], list] | tuple = ()
    spill_free: bool = True
    vector_io: bool = False
    sim_cases: tuple = ()
    bit_exact: bool = False
    default_when: str = "never (pick it by name)"
    default_rule: Callable[[dict], bool] | None = None
    encoding: str = ""
    simulate: bool = True
    requires: str = ""
    sweep: tuple = ()
    cost: Callable[..., tuple] | None = None

    def launch_cost(self, *shape, **kwargs) -> tuple[int, int]:
        """(bytes, flops) of one launch at `shape` (the stage's shape arguments, see `cost`)."""
        if self.cost is None:
            raise RuntimeError(f"kernel record {self.stage}.{self.name} states no cost (bytes, flops); "
                               "give it one in the stage's records.py")
        nbytes, flops = self.cost(*shape, **kwargs)
        return int(nbytes), int(flops)

    def prepare(self, *args, **kwargs):
        """A PreparedLaunch of this version (arguments as the stage's launcher takes them)."""
        if self.launcher is None:
            raise RuntimeError(f"kernel record {self.stage}.{self.name} has no launcher")
        return self.launcher(self, *args, **kwargs)

    def kernel_for(self, *key):
        """The dispatcher a launch runs: the kernel itself, or what its Factory builds for `key`."""
        return self.kernel(*key) if isinstance(self.kernel, Factory) else self.kernel

    def compile_targets(self) -> list:
        """Every specialisation as a CompileTarget named "stage.name<tag>"."""
        specs = self.specs() if callable(self.specs) else self.specs
        return [CompileTarget(f"{self.stage}.{self.name}{s.tag}", s.kernel, tuple(s.argtypes),
                              spill_free=self.spill_free if s.spill_free is None else s.spill_free,
                              vector_io=self.vector_io if s.vector_io is None else s.vector_io)
                for s in specs]

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
