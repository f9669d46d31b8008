#!/usr/bin/env bash
# One GPU batch for gemv_q2k_v8 (at most 9.2 minutes on an H200), each part under its own time limit,
# everything in $OUT:
#   1. the gpu tests: v8 against v4 bit for bit on every output (released shape T = 1, 4, 8, 16 and
#      odd shapes, single and two-layer launches) and v7 the same, the released-shape repack;
#   2. tools/q2kr_v8_variants.py --run: v4's every output against the float64 yardstick (max ulp),
#      then each v8 shape (the registered one first) checked against v4 bit for bit at T = 1, 4, 8,
#      alone and as the two-layer pool, and timed with L2 flushed between runs beside v4 and v7;
#   3. the decode benchmark's projection records (every q2k_r version, v8 included, validated on
#      sampled rows against the float64 yardstick before it is timed, L2 cold) and decode_step;
#   4. Nsight Compute on one launch of each GEMV (tools/gpu_ncu_q2k.py: the file-layout default,
#      every q2k_r version, the FP8 GEMVs), v8's registers, occupancy and DRAM throughput.
# Run from the repository root with the wheels installed and PYTHONPATH set (docs/gpu.md):
#   OUT=<folder> bash tools/gpu_dev_q2kr_v8.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
ENGRAM_GPU_RESULTS="$OUT/gpu_tests_v8.json" timeout "${TEST_TIMEOUT:-110}" python3 -m pytest -m gpu -q \
  -p no:cacheprovider -rfE engram_numba/stages/proj/tests/test_q2k_r.py -k "v8_is_v4 or v7_is_v4" \
  > "$OUT/gpu_tests_v8.log" 2>&1
echo "gpu tests exit status: $?"; tail -n 4 "$OUT/gpu_tests_v8.log"
timeout "${VARIANTS_TIMEOUT:-230}" python3 tools/q2kr_v8_variants.py --run --only "${VARIANTS:-5}" \
  --out "$OUT/v8_variants.json" > "$OUT/v8_variants.log" 2>&1
echo "variants exit status: $?"; grep -h '"us"' "$OUT/v8_variants.log" | cut -c1-160 | tail -n 40
timeout "${BENCH_TIMEOUT:-150}" python3 tools/decode_records.py "$OUT" v8 --print-q2k
echo "bench exit status: $?"
timeout "${NCU_TIMEOUT:-60}" ncu --clock-control none --kernel-name regex:gemv --profile-from-start off \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 tools/gpu_ncu_q2k.py > "$OUT/ncu_gemv_v8.txt" 2>&1
echo "ncu exit status: $?"
