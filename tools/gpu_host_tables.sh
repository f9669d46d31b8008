#!/usr/bin/env bash
# One GPU batch for tables in host memory: the host-table GPU tests first (prefetch two chunks
# ahead, static and CLOCK caches, decode graphs: bit-identical to device tables, the CLOCK
# counters equal to their CPU twin), then the corpus bench at the released table size (both
# tables pinned, 64.5 GB): device tables, host tables without / with prefetch, the static and the
# CLOCK cache at three budgets, random-row read rates, decode. Everything lands in $OUT. Run from
# the repository root on the H200 with the wheels of .whl/ carried (docs/gpu.md):
#   bash tools/gpu_host_tables.sh
# Environment: CHUNKS (4096-token chunks a corpus variant, default 32), CACHE_GB (default
# 0.0625,0.25,1), TEST_TIMEOUT (default 150), BENCH_TIMEOUT (default 400).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
ENGRAM_GPU_RESULTS="$OUT/gpu_tests_host_tables.json" timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu -q \
  -p no:cacheprovider -rfE tests/test_placement.py > "$OUT/gpu_tests_host_tables.log" 2>&1
echo "gpu tests exit status: $?"; tail -n 5 "$OUT/gpu_tests_host_tables.log"
timeout "${BENCH_TIMEOUT:-400}" python3 -m engram_numba.bench.corpus --quick --chunks "${CHUNKS:-32}" \
  --cache-gb "${CACHE_GB:-0.0625,0.25,1}" --cache-policy static,clock --out "$OUT/host_tables.json" \
  > "$OUT/host_tables.log" 2>&1
echo "bench exit status: $?"; grep -E "corpus_stats|decode \[|random rows|host tables:" "$OUT/host_tables.log"
