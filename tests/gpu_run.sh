#!/usr/bin/env bash
# One batch on the GPU machine (docs/gpu.md): the gpu test tier, then the benchmark suite. Run from
# the repository root with the wheels of .whl/ carried:
#   ENGRAM_COMMIT=<hash> bash tests/gpu_run.sh [pytest -k expression] [--no-bench] [--bench-only]
# Environment: TEST_TIMEOUT (seconds for the gpu tier, default 420), BENCH_ARGS (extra arguments of
# `engram-numba bench`, e.g. "--quick --sections device,variants"). Everything lands in $OUT (the
# device tool's output folder) or ./gpu_out; the test summary and the bench JSON are rewritten
# after every test / section, so a run cut short by a time limit keeps what ran.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
export ENGRAM_COMMIT=${ENGRAM_COMMIT:-unknown}
KEXPR=""; BENCH=1; TESTS=1
for a in "$@"; do
  case "$a" in
    --no-bench) BENCH=0 ;;
    --bench-only) TESTS=0 ;;
    *) KEXPR="$a" ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import numpy, numba, numba.cuda as c, gguf; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', c.implementation, 'gguf ok')"
if [ "$TESTS" = 1 ]; then
  ENGRAM_GPU_RESULTS="$OUT/gpu_tests.json" timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu tests engram_numba \
    -q -p no:cacheprovider -rfE ${KEXPR:+-k "$KEXPR"} > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tier exit status: $?"
  tail -n 30 "$OUT/gpu_tests.log"
fi
if [ "$BENCH" = 1 ]; then
  # shellcheck disable=SC2086
  python3 -m engram_numba.cli bench --out "$OUT/h200.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench exit status: $?"
  tail -n 60 "$OUT/bench.log"
fi
