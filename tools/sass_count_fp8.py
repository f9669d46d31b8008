"""SASS instruction counts of the FP8 GEMMs' K loop, for sm_90a, on a machine with no GPU.

    NVDISASM=/path/to/nvdisasm python tools/sass_count_fp8.py [gemm_fp8_v3 gemm_fp8_v5 ...]

Compiles each kernel as the compile tier does (`engram_numba.stages.compile_check`: numba's PTX,
assembled by nvJitLink for sm_90a), disassembles the cubin with nvdisasm (CUDA toolkit, or the
`nvidia-cuda-nvdisasm` wheel) and counts the opcodes of the K loop's body (the longest span between
a label and a backward branch to it): one trip of a warp is one k tile = 4 k32 blocks for v2, v3
and v5 (8 for v4, which loads k tiles in pairs). With two math warpgroups a scheduler issues
2 x count instructions a stage against 2 x 4 x 64 = 512 tensor-core cycles of m64n128k32 e4m3,
so 512 / (2 x count) bounds the share of the FP8 peak (docs/gpu.md, `gemm_fp8_v5`). The count
includes ptxas's never-executed `@!PT LDS` padding.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def sass_of(name: str) -> str:
    from cuda.bindings import nvjitlink as nj
    from numba import cuda

    from engram_numba.stages import compile_check as cc
    from engram_numba.stages.proj import cuda_fp8_wgmma as F, records
    cc._patch_current_device()
    k = F.KERNELS[name]
    ptx, _ = cuda.compile_ptx(k.py_func, tuple(records._FP8_GEMM_ARGS), cc=cc.CC,
                              launch_bounds=k.targetoptions.get("launch_bounds"))
    h = nj.create(1, [f"-arch={cc.ARCH}"])
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


def loop_counts(sass: str) -> collections.Counter:
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            span = (labels[m.group(1)], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        raise SystemExit("error: no backward branch (loop) found in the SASS")
    ops = collections.Counter()
    for ln in lines[best[0]:best[1] + 1]:
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if m:
            ops[m.group(1)] += 1
    return ops


def main(names) -> None:
    for name in names:
        ops = loop_counts(sass_of(name))
        total = sum(ops.values())
        print(f"{name}: {total} instructions a warp a trip; FFMA {ops.get('FFMA', 0)}, FMUL {ops.get('FMUL', 0)}, "
              f"LDS {ops.get('LDS', 0)}, QGMMA {ops.get('QGMMA', 0)}, BAR {ops.get('BAR', 0)}")
        print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemm_fp8_v3", "gemm_fp8_v5"])
