#!/usr/bin/env bash
# One GPU batch for gemm_fp8_v7 (about 3-4 minutes on an H200), each part under its own time limit,
# everything in $OUT:
#   1. tools/fp8_dev.py at T = 130, 1024, 4096: gemm_fp8_v6 and gemm_fp8_v7 with v7's specialisations
#      (one CTA a tile, two n64 partial tiles, a 4-stage ring), each validated against the CPU twin on
#      sampled rows and compared bit for bit with v6 (column "=ref"), then timed beside the bf16 gemm_v4
#      and cuBLAS (fp8_dev.json, fp8_dev.txt);
#   2. tools/gpu_ncu_fp8_v7.sh: Nsight Compute on one GEMM launch each of v7, v6, and two v7
#      specialisations at T = 4096 (pipes, issue, warp stalls: ncu_gemm_fp8_v7.txt).
# Run from the repository root with PYTHONPATH set:
#   OUT=<folder> bash tools/gpu_dev_fp8_v7.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
timeout "${DEV_TIMEOUT:-300}" python3 tools/fp8_dev.py --out "$OUT" --tokens 130,1024,4096 \
  --versions 'gemm_fp8_v6,gemm_fp8_v7' > "$OUT/fp8_dev.log" 2>&1
echo "fp8_dev exit status: $? (1: some check failed, see the table)"; tail -n 24 "$OUT/fp8_dev.log" | cut -c1-220
OUT="$OUT" bash tools/gpu_ncu_fp8_v7.sh
