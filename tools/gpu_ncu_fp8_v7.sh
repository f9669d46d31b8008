#!/usr/bin/env bash
# Nsight Compute on one GEMM launch each of gemm_fp8_v7 (and, by default, v6 and v7's one-CTA-a-tile and
# n64x2 specialisations beside it) at T = 4096, the released shape: time, instructions a cycle, the FMA /
# ALU / tensor / shared pipes' utilisation, issue-active share, and the warp stall reasons
# (WarpStateStats, SchedulerStats). About 60-90 s (each kernel replayed for its passes). Writes
# $OUT/ncu_gemm_fp8_v7.txt. Run from the repository root with PYTHONPATH set:
#   OUT=<folder> bash tools/gpu_ncu_fp8_v7.sh [versions ...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
if [ $# -eq 0 ]; then
  set -- gemm_fp8_v7 gemm_fp8_v6 'gemm_fp8_v7[s5/grid/n128]' 'gemm_fp8_v7[s5/persist/n64x2]'
fi
METRICS=gpu__time_duration.sum,sm__inst_executed.avg.per_cycle_active,\
sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active,\
sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,\
smsp__issue_active.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --profile-from-start off --kernel-name regex:gemm_fp8 \
  --metrics "$METRICS" --section WarpStateStats --section SchedulerStats --section LaunchStats \
  python3 tools/fp8_ncu.py --tokens 4096 "$@" > "$OUT/ncu_gemm_fp8_v7.txt" 2>&1
echo "ncu exit status: $?"
grep -E "gemm_fp8|duration|pipe_tensor_cycles|pipe_fma_cycles|issue_active|Stall|profiled|FAILED" \
  "$OUT/ncu_gemm_fp8_v7.txt" | cut -c1-160 | head -n 60
