"""Compile every kernel for sm_90a without a GPU, and read ptxas's resource report.

The simulator does no type checking, so a kernel can pass every simulator test and still fail to
compile; this module is the compile-only test tier. It sits beside the registry: every kernel
record lists what to compile (`KernelRecord.compile_targets()`: `CompileTarget(name, kernel,
argtypes, spill_free, vector_io)` entries, from the record's specs), and `compile_all`
turns each into PTX with `cuda.compile_ptx` and assembles that with nvJitLink (from the
`numba-cuda[cu13]` wheels) to get registers, stack and spills, all on a machine with no GPU.

Run `python -m engram_numba.stages.compile_check [--only PREFIX] [--json]` for the table (of the
targets whose name starts with PREFIX, e.g. `proj.gemm_fp8_v4`). It needs numba's real CUDA
target, not the simulator (numba picks one at import), so it restarts itself with
NUMBA_ENABLE_CUDASIM=0 when it finds the simulator on; the tests run it in a subprocess.

Target: sm_90a, what numba-cuda builds for on an H100/H200 (for a compute-capability-9.0 device its
code generator appends the "a"). The arch-specific target is what the warpgroup-MMA kernels
(`wgmma`, Hopper only) need; the other kernels compile the same way for it as for sm_90. The
stand-in device still reports compute capability (9, 0); the "a" is passed to `compile_ptx`.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field

CC = (9, 0, "a")        # compile_ptx's cc: compute capability and the arch-specific suffix
ARCH = "sm_90a"         # what nvJitLink assembles the PTX for


@dataclass
class CompileResult:
    name: str
    ok: bool
    registers: int = -1
    stack_bytes: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    spill_free_required: bool = True
    vector_io: bool = False
    wgmma_serialized: bool = False
    ptx_lines: int = 0
    instructions: dict = field(default_factory=dict)  # counts of a few PTX instructions worth watching
    error: str = ""


class _StandInDevice:
    """compile_ptx of a kernel that calls device functions asks the driver for the current
    device's compute capability; without a GPU there is none, so answer for it."""
    compute_capability = CC[:2]
    name = "sm_90 (compile only)"


def _patch_current_device():
    from numba.cuda import dispatcher
    dispatcher.get_current_device = lambda: _StandInDevice()


def ptxas_report(ptx: str, arch: str = ARCH, max_registers: int | None = None) -> dict:
    """Assemble PTX with nvJitLink (with the kernel's register cap, if it has one, as numba's linker
    passes it) and parse its verbose log."""
    from cuda.bindings import nvjitlink as nj
    opts = [f"-arch={arch}", "-verbose"] + ([f"-maxrregcount={max_registers}"] if max_registers else [])
    handle = nj.create(len(opts), opts)
    try:
        data = ptx.encode()
        nj.add_data(handle, nj.InputType.PTX, data, len(data), "kernel")
        nj.complete(handle)
        size = nj.get_info_log_size(handle)
        buf = bytearray(size)
        nj.get_info_log(handle, buf)
        log = buf.decode(errors="replace")
    finally:
        nj.destroy(handle)
    out = {"log": log}
    m = re.search(r"Used (\d+) registers", log)
    out["registers"] = int(m.group(1)) if m else -1
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        out["stack_bytes"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
    # ptxas serializes a kernel's wgmma (waits after each) when it cannot prove them safe to overlap,
    # e.g. when the kernel contains a call (64-bit integer division is one): correct but slow
    out["wgmma_serialized"] = "wgmma.mma_async instructions are serialized" in log
    return out


WATCHED = {
    "ld.global.v4": r"ld\.global(\.\w+)*\.v4",
    "st.global.v4": r"st\.global(\.\w+)*\.v4",
    "shfl": r"shfl\.sync",
    "fma.rn.f32": r"fma\.rn\.f32",
    "mma": r"\bmma\.sync",
    "wgmma": r"\bwgmma\.mma_async",
    "cp.async": r"\bcp\.async\.c[ag]\b",
    "tma.load": r"\bcp\.async\.bulk\.tensor\.\w+\.shared::cluster\.global",
    "tma.store": r"\bcp\.async\.bulk\.tensor\.\w+\.global\.shared::cta",
    "local": r"\.local\b",
}


def collect_targets():
    from . import catalog
    return catalog.compile_targets()


def compile_all(targets=None) -> list[CompileResult]:
    from numba import cuda
    from numba.cuda import config
    if config.ENABLE_CUDASIM:
        raise RuntimeError("compile_check needs the simulator off (NUMBA_ENABLE_CUDASIM=0)")
    _patch_current_device()
    results = []
    # a kernel several records share (e.g. gemm_fp8_v1..v5's act_quant) with the same argument types
    # and launch bounds is the same PTX: compiled and assembled once, reported under each name
    built: dict = {}
    for t in targets if targets is not None else collect_targets():
        fn = getattr(t.kernel, "py_func", t.kernel)
        # compile as the kernel is built: with its launch bounds, which change register allocation
        bounds = getattr(t.kernel, "targetoptions", {}).get("launch_bounds")
        max_regs = getattr(t.kernel, "targetoptions", {}).get("max_registers")
        key = (fn, tuple(t.argtypes), repr(bounds), max_regs)
        try:
            if key not in built:
                ptx, _ = cuda.compile_ptx(fn, tuple(t.argtypes), cc=CC, launch_bounds=bounds)
                built[key] = (ptx, ptxas_report(ptx, max_registers=max_regs))
            ptx, rep = built[key]
            res = CompileResult(
                name=t.name, ok=True, registers=rep["registers"], stack_bytes=rep.get("stack_bytes", -1),
                spill_stores=rep.get("spill_stores", -1), spill_loads=rep.get("spill_loads", -1),
                spill_free_required=t.spill_free, vector_io=t.vector_io, ptx_lines=ptx.count("\n"),
                wgmma_serialized=rep["wgmma_serialized"],
                instructions={k: len(re.findall(p, ptx)) for k, p in WATCHED.items()})
        except Exception as exc:  # report every failure, not just the first
            res = CompileResult(name=t.name, ok=False, spill_free_required=t.spill_free, vector_io=t.vector_io,
                                error=f"{type(exc).__name__}: {exc}"[:2000])
        results.append(res)
    return results


def format_table(results) -> str:
    lines = [f"{'kernel':58s} {'ok':3s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s}  v4ld v4st shfl wgmma"]
    for r in results:
        i = r.instructions
        lines.append(f"{r.name:58s} {'yes' if r.ok else 'NO':3s} {r.registers:4d} {r.stack_bytes:5d} "
                     f"{r.spill_stores:5d}/{r.spill_loads:<5d}  {i.get('ld.global.v4', 0):4d} "
                     f"{i.get('st.global.v4', 0):4d} {i.get('shfl', 0):4d} {i.get('wgmma', 0):5d}"
                     + (" serialized" if r.wgmma_serialized else "")
                     + (f"  {r.error.splitlines()[0][:80]}" if not r.ok else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from numba.cuda import config
    if config.ENABLE_CUDASIM:
        # numba picked the simulator at import (the package does so on machines without a GPU);
        # compiling for sm_90 needs the real target, so start again with it.
        import os
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        os.execve(sys.executable, [sys.executable, "-m", "engram_numba.stages.compile_check", *argv], env)
    targets = None
    if "--only" in argv:        # --only PREFIX: the targets whose name starts with PREFIX (e.g. proj.gemm_fp8_v4)
        prefix = argv[argv.index("--only") + 1]
        targets = [t for t in collect_targets() if t.name.startswith(prefix)]
        if not targets:
            print(f"error: no compile target starts with {prefix!r}")
            return 2
    results = compile_all(targets)
    if "--json" in argv:
        print(json.dumps([asdict(r) for r in results]))
    else:
        print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
