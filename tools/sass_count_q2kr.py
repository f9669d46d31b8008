"""SASS instruction counts of the q2k_r GEMVs' main loop, for sm_90a, on a machine with no GPU.

    NVDISASM=/path/to/nvdisasm python tools/sass_count_q2kr.py [gemv_q2k_v4 gemv_q2k_v7 ...]

Compiles each kernel as the compile tier does (`engram_numba.stages.compile_check`: numba's PTX,
assembled by nvJitLink for sm_90a), disassembles the cubin with nvdisasm (CUDA toolkit, or the
`nvidia-cuda-nvdisasm` wheel) and counts the opcodes of the K loop's body: one trip of a warp is
2 units (v4..v7: 4 Q2_K blocks of 16 rows = 64 mma = 16384 weights) or 1 unit (v8, v9: 32 mma),
told apart by its HMMA count (32 a unit). Prints the total, the count a unit (16 rows x 512 k =
8192 weights a warp), the integer-pipe share (LOP3, PRMT, SHF, MOV, CS2R, IADD3, LEA, ISETP, SEL:
half the FP32 pipe's rate on sm_90) and the top opcodes. The loop is found as the span between the label a backward branch jumps to
and the last branch back to it.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

INT_PIPE = ("LOP3", "PRMT", "SHF", "MOV", "CS2R", "IADD3", "LEA", "ISETP", "SEL")
MMA_A_UNIT = 32                   # 16 rows x 512 k: 32 mma.m16n8k16, 8192 weights


def sass_of_kernel(name: str, kernel, argtypes) -> str:
    """The SASS of `kernel` compiled for `argtypes` as the compile tier does (numba's PTX, linked by
    nvJitLink for sm_90a), disassembled by nvdisasm."""
    from cuda.bindings import nvjitlink as nj
    from numba import cuda

    from engram_numba.stages import compile_check as cc
    cc._patch_current_device()
    ptx, _ = cuda.compile_ptx(kernel.py_func, tuple(argtypes), cc=cc.CC,
                              launch_bounds=kernel.targetoptions.get("launch_bounds"))
    regs = kernel.targetoptions.get("max_registers")        # a register cap, as numba's linker passes it
    opts = [f"-arch={cc.ARCH}"] + ([f"-maxrregcount={regs}"] if regs else [])
    h = nj.create(len(opts), opts)
    try:
        data = ptx.encode()
        nj.add_data(h, nj.InputType.PTX, data, len(data), name)
        nj.complete(h)
        cubin = bytearray(nj.get_linked_cubin_size(h))
        nj.get_linked_cubin(h, cubin)
    finally:
        nj.destroy(h)
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool:
        raise SystemExit("error: no nvdisasm (set NVDISASM, or pip install nvidia-cuda-nvdisasm)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def sass_of(name: str) -> str:
    from engram_numba.stages.proj import cuda_gemv_q2kr as C, records
    return sass_of_kernel(name, C.KERNELS[name], records.FAST_ARGS)


def opcode_counts(lines) -> collections.Counter:
    """Opcodes of SASS lines (nvdisasm's text; a guard predicate is skipped)."""
    ops = collections.Counter()
    for ln in lines:
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if m:
            ops[m.group(1)] += 1
    return ops


def loops(sass: str) -> list:
    """Every loop (a label to a backward branch to it) as (first line, last line, opcode counts)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    out = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            out.append((labels[m.group(1)], i, opcode_counts(lines[labels[m.group(1)]:i + 1])))
    return out


def loop_counts(sass: str) -> collections.Counter:
    """Opcodes of the longest loop (a GEMV's unit loop)."""
    spans = loops(sass)
    if not spans:
        raise SystemExit("error: no backward branch (loop) found in the SASS")
    return max(spans, key=lambda lp: lp[1] - lp[0])[2]


def main(names) -> None:
    for name in names:
        ops = loop_counts(sass_of(name))
        total = sum(ops.values())
        integer = sum(v for k, v in ops.items() if k in INT_PIPE)
        units = max(ops.get("HMMA", 0), MMA_A_UNIT) / MMA_A_UNIT
        print(f"{name}: {total} instructions a trip of {units:g} unit(s): {total / units:.0f} a unit "
              f"({total / units / (MMA_A_UNIT * 256):.3f} a weight), integer pipe {integer / units:.0f} a unit, "
              f"HMMA {ops.get('HMMA', 0)}")
        print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemv_q2k_v4", "gemv_q2k_v7", "gemv_q2k_v8", "gemv_q2k_v9"])
