"""SASS instruction counts of the FP8 GEMMs' and GEMVs' K loop, for sm_90a, on a machine with no GPU.

    NVDISASM=/path/to/nvdisasm python tools/sass_count_fp8.py [gemm_fp8_v3 gemm_fp8_v5 gemv_fp8_v2 ...]

GEMVs (gemv_fp8_*, any proj record of the fp8 encoding compiled with its first Spec's argument
types): the loop's body is counted per weight a warp streams, from its HMMA count (m16n8k16: 16
rows x 16 k = 256 weights each; v2 and v5 run a trip of 8 tiles = 16 mma = 4096 weights, v3 and v4
a 64-wide step of 32 rows = 16 mma), with the conversion's share (F2FP, HADD2 and PRMT, the
opcodes cvt.rn.f16x2.e4m3x2 / cvt.f32.f16 / cvt.rn.bf16x2.f32 / mov.b32 become). For the GEMMs:

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


def sass_of_gemv(name: str) -> str:
    from engram_numba.stages import registry
    from engram_numba.stages.proj import records  # noqa: F401  (registers the records)
    spec = registry.get("proj", name).specs[0]
    return sass_of_kernel(name, spec.kernel, spec.argtypes)


CONVERT = ("F2FP", "HADD2", "PRMT")


def main_gemv(name) -> None:
    ops = loop_counts(sass_of_gemv(name))
    total = sum(ops.values())
    mma = ops.get("HMMA", 0)
    conv = sum(v for k, v in ops.items() if k in CONVERT)
    print(f"{name}: {total} instructions a warp a trip, HMMA {mma} ({mma * 256} weights): "
          f"{total / max(mma * 256, 1):.4f} a weight, {total / max(mma, 1):.1f} an mma; conversion "
          f"(F2FP/HADD2/PRMT) {conv} = {conv / max(mma, 1):.1f} an mma; LDL/STL {ops.get('LDL', 0)}/{ops.get('STL', 0)}")
    print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))


def main(names) -> None:
    for name in names:
        if name.startswith("gemv_"):
            main_gemv(name)
            continue
        ops = loop_counts(sass_of(name))
        total = sum(ops.values())
        print(f"{name}: {total} instructions a warp a trip; FFMA {ops.get('FFMA', 0)}, FMUL {ops.get('FMUL', 0)}, "
              f"LDS {ops.get('LDS', 0)}, QGMMA {ops.get('QGMMA', 0)}, BAR {ops.get('BAR', 0)}")
        print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemm_fp8_v3", "gemm_fp8_v5"])
