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
a label and a backward branch to it; the innermost one with a wgmma, so that a persistent kernel's
loop over output tiles is not taken for it): one trip of a warp is one k tile = 4 k32 blocks for v2, v3
and v5 (8 for v4, which loads k tiles in pairs). With two math warpgroups a scheduler issues
2 x count instructions a stage against 2 x 4 x 64 = 512 tensor-core cycles of m64n128k32 e4m3,
so 512 / (2 x count) bounds the share of the FP8 peak (docs/gpu.md, `gemm_fp8_v5`). The count
includes ptxas's never-executed `@!PT LDS` padding.
"""
from __future__ import annotations

import collections
import os
import re
import sys
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_count_q2kr import loop_counts, loops, opcode_counts, sass_of_kernel  # noqa: E402  (the same compile, nvdisasm, loop finder)


def sass_of(name: str) -> str:
    """SASS of a record (`KERNELS`) or of a v6 / v7 specialisation (`V6_CANDIDATES`, `V7_CANDIDATES`)."""
    from engram_numba.stages.proj import cuda_fp8_wgmma as F, records
    if name in F.KERNELS:
        kernel = F.KERNELS[name]
    elif name in F.V7_CANDIDATES:
        kernel = F.kernel_v7(F.V7_CANDIDATES[name])
    elif name.startswith("gemm_fp8_v8"):
        from engram_numba.stages.proj import cuda_fp8_tma as V8
        kernel = V8.kernel_v8(V8.V8_CANDIDATES.get(name) or V8.V8_VARIANTS[name])
        return sass_of_kernel(name, kernel, records._FP8_TMA_ARGS)
    else:
        kernel = F.kernel_v6(F.V6_CANDIDATES[name])
    return sass_of_kernel(name, kernel, records._FP8_GEMM_ARGS)


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


def sass_of_gemv(name: str) -> str:
    from engram_numba.stages import registry
    from engram_numba.stages.proj import records  # noqa: F401  (registers the records)
    spec = registry.get("proj", name).specs[0]
    return sass_of_kernel(name, spec.kernel, spec.argtypes)


CONVERT = ("F2FP", "HADD2", "PRMT")


def fast_path_counts(sass: str) -> collections.Counter | None:
    """The loop's opcodes along its fall-through path, where its body is `if whole trip: A else: B`
    laid out as [head, @P BRA B, A, BRA J, B, J: tail]: head + A + tail (gemv_fp8_v5's unchecked
    trips); None where the loop has no unconditional forward branch inside it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    spans = loops(sass)
    if not spans:
        return None
    # the innermost loop holding the mma (gemv_fp8_v6's trip loop sits inside its loop over groups)
    mma = [lp for lp in spans if lp[2].get("HMMA", 0)] or spans
    best = min(mma, key=lambda lp: lp[1] - lp[0])[:2]
    for i in range(best[0], best[1]):
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+BRA `\((\.L_x_\d+)\)", lines[i])     # unpredicated
        if m and best[0] < labels.get(m.group(1), -1) < best[1] and labels[m.group(1)] > i:
            return opcode_counts(lines[best[0]:i + 1] + lines[labels[m.group(1)]:best[1] + 1])
    return None


def report_gemv(label, ops) -> None:
    total = sum(ops.values())
    mma = ops.get("HMMA", 0)
    conv = sum(v for k, v in ops.items() if k in CONVERT)
    print(f"{label}: {total} instructions a warp a trip, HMMA {mma} ({mma * 256} weights): "
          f"{total / max(mma * 256, 1):.4f} a weight, {total / max(mma, 1):.1f} an mma; conversion "
          f"(F2FP/HADD2/PRMT) {conv} = {conv / max(mma, 1):.1f} an mma; LDL/STL {ops.get('LDL', 0)}/{ops.get('STL', 0)}")
    print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))


def main_gemv(name) -> None:
    sass = sass_of_gemv(name)
    fast = fast_path_counts(sass)
    if fast is not None:
        report_gemv(f"{name} (whole trips, the fall-through path)", fast)
    ops = loop_counts(sass)
    if fast is not None:
        print(f"{name} (the whole loop, both paths): {sum(ops.values())} instructions")
        return
    report_gemv(name, ops)


def main(names) -> None:
    for name in names:
        if name.startswith("gemv_"):
            main_gemv(name)
            continue
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
