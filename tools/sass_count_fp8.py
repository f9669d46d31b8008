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

import os
import sys
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_count_q2kr import loop_counts, sass_of_kernel  # noqa: E402  (the same compile, nvdisasm and loop finder)


def sass_of(name: str) -> str:
    from engram_numba.stages.proj import cuda_fp8_wgmma as F, records
    return sass_of_kernel(name, F.KERNELS[name], records._FP8_GEMM_ARGS)


def main(names) -> None:
    for name in names:
        ops = loop_counts(sass_of(name))
        total = sum(ops.values())
        print(f"{name}: {total} instructions a warp a trip; FFMA {ops.get('FFMA', 0)}, FMUL {ops.get('FMUL', 0)}, "
              f"LDS {ops.get('LDS', 0)}, QGMMA {ops.get('QGMMA', 0)}, BAR {ops.get('BAR', 0)}")
        print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemm_fp8_v3", "gemm_fp8_v5"])
