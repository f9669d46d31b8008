#!/usr/bin/env bash
# One short GPU batch for gemv_q2k_v7, each part under its own time limit, everything in $OUT:
# v7 against v4 bit for bit (released shape T = 1, 4, 8 and odd shapes, single and two-layer
# launches) and the decode graph against the ungraphed step (the engine's q2k_r kernel),
# then the decode benchmark's projection records (every version validated on sampled rows against
# the float64 yardstick before it is timed, L2 cold) and decode_step, then Nsight Compute on v7,
# FP8, the file-layout default and v4 (launch order of tools/gpu_ncu_q2k.py). Run from the
# repository root with the wheels installed and PYTHONPATH set
# (docs/gpu.md).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
ENGRAM_GPU_RESULTS="$OUT/gpu_tests_v7.json" timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -m gpu -q \
  -p no:cacheprovider -rfE engram_numba/stages/proj/tests/test_q2k_r.py tests/test_engine_decode.py \
  -k "v7_is_v4 or decode_graph_equals" > "$OUT/gpu_tests_v7.log" 2>&1
echo "gpu tests exit status: $?"; tail -n 4 "$OUT/gpu_tests_v7.log"
timeout "${BENCH_TIMEOUT:-150}" python3 tools/decode_records.py "$OUT" v7
echo "bench exit status: $?"
timeout "${NCU_TIMEOUT:-40}" ncu --clock-control none --kernel-name regex:gemv --profile-from-start off \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 tools/gpu_ncu_q2k.py > "$OUT/ncu_gemv_v7.txt" 2>&1
echo "ncu exit status: $?"
