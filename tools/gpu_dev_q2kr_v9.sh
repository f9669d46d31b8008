#!/usr/bin/env bash
# One GPU batch for gemv_q2k_v9 (at most 6 minutes on an H200), each part under its own time limit,
# everything in $OUT:
#   1. the gpu tests: v9 against v4 bit for bit on every output (released shape T = 1, 4, 8, 16 and
#      odd shapes, single and two-layer launches);
#   2. tools/q2kr_v9_variants.py --run: each v9 shape (the registered one first) checked against v4
#      bit for bit at T = 1, 4, 8, alone and as the two-layer launch, then timed with L2 flushed
#      between runs beside v4 and v8 (single and two-layer);
#   3. Nsight Compute on one launch of each GEMV at T = 1 (tools/gpu_ncu_q2k.py: v8 and v9 side by
#      side): registers, occupancy, issue stalls, DRAM throughput.
# Run from the repository root with the wheels installed and PYTHONPATH set (docs/gpu.md):
#   OUT=<folder> bash tools/gpu_dev_q2kr_v9.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
ENGRAM_GPU_RESULTS="$OUT/gpu_tests_v9.json" timeout "${TEST_TIMEOUT:-80}" python3 -m pytest -m gpu -q \
  -p no:cacheprovider -rfE engram_numba/stages/proj/tests/test_q2k_r.py -k "v9_is_v4" \
  > "$OUT/gpu_tests_v9.log" 2>&1
echo "gpu tests exit status: $?"; tail -n 4 "$OUT/gpu_tests_v9.log"
timeout "${VARIANTS_TIMEOUT:-190}" python3 tools/q2kr_v9_variants.py --run --only "${VARIANTS:-4}" \
  --out "$OUT/v9_variants.json" > "$OUT/v9_variants.log" 2>&1
echo "variants exit status: $?"; grep -h '"us"' "$OUT/v9_variants.log" | cut -c1-160 | tail -n 40
grep -h 'differing_from_v4": [1-9]' "$OUT/v9_variants.log" | cut -c1-160
# tools/gpu_ncu_q2k.py profiles only its third round (inside cuda.profiling())
timeout "${NCU_TIMEOUT:-85}" ncu --clock-control none --kernel-name regex:gemv --profile-from-start off \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 tools/gpu_ncu_q2k.py > "$OUT/ncu_gemv_v9.txt" 2>&1
echo "ncu exit status: $?"
