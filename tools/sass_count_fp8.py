"""SASS instruction counts of the FP8 GEMMs' K loop, for sm_90a, on a machine with no GPU.

    NVDISASM=/path/to/nvdisasm python tools/sass_count_fp8.py [gemm_fp8_v3 gemm_fp8_v5 ...]

Compiles each kernel as the compile tier does (`engram_numba.stages.compile_check`: numba's PTX,
assembled by nvJitLink for sm_90a), disassembles the cubin with nvdisasm (CUDA toolkit, or the
`nvidia-cuda-nvdisasm` wheel) and counts the opcodes of the K loop's body (the longest span between
a label and a backward branch to it; the innermost one with a wgmma, so that a persistent kernel's
loop over output tiles is not taken for it): one trip of a warp is one k tile = 4 k32 blocks for v2, v3
and v5 (8 for v4, which loads k tiles in pairs). With two math warpgroups a scheduler issues
2 x count instructions a stage against 2 x 4 x 64 = 512 tensor-core cycles of m64n128k32 e4m3,
so 512 / (2 x count) bounds the share of the FP8 peak (docs/gpu.md, `gemm_fp8_v5`). The count
includes ptxas's never-executed `@!PT LDS` padding.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import collections  # noqa: E402
import re  # noqa: E402

from sass_count_q2kr import sass_of_kernel  # noqa: E402  (the same compile and nvdisasm)


def sass_of(name: str) -> str:
    """SASS of a record (`KERNELS`) or of a v6 / v7 specialisation (`V6_CANDIDATES`, `V7_CANDIDATES`)."""
    from engram_numba.stages.proj import cuda_fp8_wgmma as F, records
    if name in F.KERNELS:
        kernel = F.KERNELS[name]
    elif name in F.V7_CANDIDATES:
        kernel = F.kernel_v7(F.V7_CANDIDATES[name])
    else:
        kernel = F.kernel_v6(F.V6_CANDIDATES[name])
    return sass_of_kernel(name, kernel, records._FP8_GEMM_ARGS)


def _ops(lines) -> collections.Counter:
    ops = collections.Counter()
    for ln in lines:
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if m:
            ops[m.group(1)] += 1
    return ops


def loops(sass: str) -> list:
    """Every loop (span from a label to a backward branch to it) as (first line, last line, opcode counts)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    out = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            out.append((labels[m.group(1)], i, _ops(lines[labels[m.group(1)]:i + 1])))
    return out


def k_loop(sass: str) -> collections.Counter:
    """The K loop: the innermost (shortest) loop that issues wgmma (QGMMA); for a persistent kernel the
    loop over output tiles around it is longer."""
    spans = [lp for lp in loops(sass) if lp[2].get("QGMMA", 0)]
    if not spans:
        raise SystemExit("error: no loop with a QGMMA in the SASS")
    return min(spans, key=lambda lp: lp[1] - lp[0])[2]


def load_loop(sass: str):
    """The warp-specialised loader's loop: the shortest loop with cp.async (LDGSTS) and no QGMMA."""
    spans = [lp for lp in loops(sass) if lp[2].get("LDGSTS", 0) and not lp[2].get("QGMMA", 0)]
    return min(spans, key=lambda lp: lp[1] - lp[0])[2] if spans else None


def main(names) -> None:
    for name in names:
        sass = sass_of(name)
        ops = k_loop(sass)
        total = sum(ops.values())
        print(f"{name}: {total} instructions a warp a trip; FFMA {ops.get('FFMA', 0)}, FMUL {ops.get('FMUL', 0)}, "
              f"LDS {ops.get('LDS', 0)}, QGMMA {ops.get('QGMMA', 0)}, BAR {ops.get('BAR', 0)}")
        print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))
        ld = load_loop(sass)
        if ld is not None:
            print(f"   loader loop: {sum(ld.values())} instructions a warp a k tile: "
                  + ", ".join(f"{k} {v}" for k, v in ld.most_common(10)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemm_fp8_v3", "gemm_fp8_v5"])
