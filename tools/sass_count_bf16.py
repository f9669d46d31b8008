"""SASS instruction counts of the bf16 wgmma GEMMs' k loop (gemm_v4, gemm_v8, gemm_v9 and its
loops), for sm_90a, on a machine with no GPU.

    NVDISASM=/path/to/nvdisasm python tools/sass_count_bf16.py [NAME ...]

NAME is a tile on gemm_v4's grid ("gemm_v4", or a key of `cuda_wgmma.V9_TILES`: "lean", "lean1", "mbar")
or a persistent kernel ("gemm_v8", "gemm_v9" (= lean), "sk/lean1", "sk/mbar"). Compiles each kernel as the
compile tier does (`sass_count_q2kr.sass_of_kernel`), disassembles it and counts the opcodes of the
k loop's body (the shortest span between a label and a backward branch to it that holds an HGMMA:
the persistent kernels' unit loop holds the k loop): one trip of a warp is one k tile (4 HGMMA). Prints the total, the CTA-wide barriers (BAR), the copies (LDGSTS), the
wgmma fences/waits (WARPGROUP) and the top opcodes.
"""
from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_count_q2kr import loops, sass_of_kernel  # noqa: E402  (the same compile, nvdisasm and loop finder)

NAMES = ("gemm_v4", "lean", "lean1", "mbar", "gemm_v8", "gemm_v9", "sk/lean1", "sk/mbar")


def kernel_of(name: str):
    from engram_numba.stages.proj import cuda_wgmma as W, records
    if name == "gemm_v4" or name in W.V9_TILES:
        v = W.VARIANTS[name] if name == "gemm_v4" else W.V9_TILES[name]
        return W.kernel_for(v), records.FAST_ARGS
    tile = {"gemm_v8": W.VARIANTS["gemm_v4"], "gemm_v9": W.V9_VARIANTS["gemm_v9"].tile,
            **{"sk/" + k: t for k, t in W.V9_TILES.items()}}[name]
    return W.sk_kernel_for(tile, True), records._SK_ARGS


def loop_counts(sass: str) -> collections.Counter:
    """Opcodes of the k loop: the innermost (shortest) loop that issues wgmma (HGMMA)."""
    spans = [lp for lp in loops(sass) if lp[2].get("HGMMA", 0)]
    if not spans:
        raise SystemExit("error: no loop with an HGMMA found in the SASS")
    return min(spans, key=lambda lp: lp[1] - lp[0])[2]


def main(names) -> None:
    for name in names:
        kernel, args = kernel_of(name)
        ops = loop_counts(sass_of_kernel(name, kernel, args))
        total = sum(ops.values())
        print(f"{name}: {total} instructions a warp a k tile; HGMMA {ops.get('HGMMA', 0)}, BAR {ops.get('BAR', 0)}, "
              f"LDGSTS {ops.get('LDGSTS', 0)}, WARPGROUP {ops.get('WARPGROUP', 0)}, DEPBAR {ops.get('DEPBAR', 0)}")
        print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))


if __name__ == "__main__":
    main(sys.argv[1:] or NAMES)
