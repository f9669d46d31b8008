#!/usr/bin/env bash
# One GPU batch for gemv_q2k_v10 (about a minute on an H200), everything in $OUT:
#   tools/q2kr_v10_variants.py --run: the registered v10 and each variant shape checked against
#   gemv_q2k_v4 bit for bit (released shape at T = 1, 4, 8 and three odd small shapes, alone and as
#   the two-layer launch), then timed at T = 1 with DeviceTimer (L2 flushed) beside v9 and v4, single
#   and two-layer: $OUT/v10_variants.json, $OUT/v10_variants.txt (the table), $OUT/v10_variants.log.
#   NCU=1 adds Nsight Compute's warp-stall breakdown of v9 and v10 at T = 1 ($OUT/ncu_v10.txt, ~40 s).
# Run from the repository root with the wheels installed and PYTHONPATH set (docs/gpu.md):
#   OUT=<folder> bash tools/gpu_dev_q2kr_v10.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
timeout "${VARIANTS_TIMEOUT:-110}" python3 tools/q2kr_v10_variants.py --run --out "$OUT" > "$OUT/v10_variants.log" 2>&1
echo "variants exit status: $?"
cat "$OUT/v10_variants.txt" 2>/dev/null || tail -n 30 "$OUT/v10_variants.log"
if [ "${NCU:-0}" = 1 ]; then
  timeout "${NCU_TIMEOUT:-60}" ncu --clock-control none --kernel-name regex:gemv --launch-count 2 \
    --metrics gpu__time_duration.sum,launch__registers_per_thread,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,sm__cycles_active.avg,sm__cycles_elapsed.avg \
    python3 -c "
import numpy as np
from numba import cuda
from engram_numba.stages.proj import cuda_gemv_q2kr as C
from engram_numba.stages.proj.launch import prepare_project_q
from engram_numba.stages.proj.tests.test_proj_quant import random_q2k, random_x
rng = np.random.default_rng(1)
w = C.repack_on_device(cuda.to_device(random_q2k(rng, 25600, 6144)), 25600, 6144)
x = cuda.to_device(random_x(rng, 1, 6144))
for v in ('gemv_q2k_v9', 'gemv_q2k_v10'):
    o = cuda.device_array((1, 25600), np.uint16)
    prepare_project_q(x, w, None, o, weight='q2k_r', version=v)()
cuda.synchronize()
" > "$OUT/ncu_v10.txt" 2>&1
  echo "ncu exit status: $?"
fi
