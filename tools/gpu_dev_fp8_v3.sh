#!/usr/bin/env bash
# One GPU batch for gemv_fp8_v3 (about 3 minutes on an H200), each part under its own time limit,
# everything in $OUT:
#   1. the gpu tests of the FP8 GEMVs: v3 against the float64 yardstick on every output and against
#      v1 / v2 at the released shape and at an odd one (T = 1, 3, 8, 9), and v2 / v3 on every e4m3
#      code at the extreme scale bytes and on NaN codes;
#   2. the decode benchmark's FP8 projection records at T = 1, 4, 8: the default (gemv_fp8_v2) and
#      every other exact-weight FP8 GEMV (v3), each validated on sampled rows against the float64
#      yardstick before it is timed, L2 flushed between runs (`l2: "cold"`), cuBLAS and our bf16
#      GEMV on the decoded weight beside them;
#   3. Nsight Compute on one launch each of gemv_fp8_v2 and gemv_fp8_v3 at T = 1 (DRAM throughput,
#      occupancy, registers, warp stalls);
#   4. with SWEEP=1 only (about a minute more): tools/fp8_v3_variants.py --run, every (warps a block,
#      ring slots a warp) shape of v3 checked against the yardstick and v2, and timed L2 cold.
# Run from the repository root with the wheels installed and PYTHONPATH set (docs/gpu.md):
#   OUT=<folder> bash tools/gpu_dev_fp8_v3.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
ENGRAM_GPU_RESULTS="$OUT/gpu_tests_fp8_v3.json" timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -m gpu -q \
  -p no:cacheprovider -rfE engram_numba/stages/proj/tests/test_proj_quant.py -k "fp8_v3_against or fp8_edge_codes" \
  > "$OUT/gpu_tests_fp8_v3.log" 2>&1
echo "gpu tests exit status: $?"; tail -n 4 "$OUT/gpu_tests_fp8_v3.log"
timeout "${BENCH_TIMEOUT:-70}" python3 tools/decode_records.py "$OUT" fp8_v3 --parts proj --weights fp8 --print-fp8
echo "bench exit status: $?"
timeout "${NCU_TIMEOUT:-40}" ncu --clock-control none --kernel-name regex:gemv_fp8 --profile-from-start off \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section MemoryWorkloadAnalysis python3 tools/gpu_ncu_q2k.py fp8 > "$OUT/ncu_gemv_fp8_v3.txt" 2>&1
echo "ncu exit status: $?"
if [ "${SWEEP:-0}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-90}" python3 tools/fp8_v3_variants.py --run --out "$OUT/fp8_v3_variants.json" \
    > "$OUT/fp8_v3_variants.log" 2>&1
  echo "variants exit status: $?"; grep -h '"us"' "$OUT/fp8_v3_variants.log" | cut -c1-160 | tail -n 24
fi
