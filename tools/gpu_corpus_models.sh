#!/usr/bin/env bash
# One GPU batch for corpus_stats with chunks queued ahead, both models: the GPU tests of the
# queued-ahead driver first (bit-identical statistics to one chunk at a time, tiny model), then
# the corpus bench's device-table runs (the reducer's layers each on a lane of its own, and, to
# compare, waited for each chunk as before: same statistics, checked) at the released shapes for
# the Q2_K model (released 32.3 GB
# tables, 400 chunks) and the FP8-encoded model (the HF checkpoint's encodings, tables shrunk to
# what the device holds, the engine's default FP8 projection). Each bench run checks its
# statistics against one chunk at a time before it is timed and prints tokens/s, the device sum
# and the threads' seconds. Everything lands in $OUT. Run from the repository root on the H200
# with the wheels of .whl/ carried (docs/gpu.md):
#   bash tools/gpu_corpus_models.sh
# Environment: CHUNKS (Q2_K chunks, default 400), FP8_CHUNKS (default 200), FP8_PROJ (decode, bf16
# or gemm_fp8_v3; default decode), TEST_TIMEOUT (default 60), BENCH_TIMEOUT (each run, default 110),
# SWITCH_INTERVAL (the benches' sys.setswitchinterval in seconds; default Python's 0.005).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
ENGRAM_GPU_RESULTS="$OUT/gpu_tests_corpus_pipelined.json" timeout "${TEST_TIMEOUT:-60}" python3 -m pytest -m gpu -q \
  -p no:cacheprovider -rfE tests/test_corpus_pipelined.py > "$OUT/gpu_tests_corpus_pipelined.log" 2>&1
echo "gpu tests exit status: $?"; tail -n 3 "$OUT/gpu_tests_corpus_pipelined.log"
timeout "${BENCH_TIMEOUT:-110}" python3 -m engram_numba.bench.corpus --quick --no-host --model q2k \
  --chunks "${CHUNKS:-400}" ${SWITCH_INTERVAL:+--switch-interval "$SWITCH_INTERVAL"} \
  --out "$OUT/corpus_q2k.json" > "$OUT/corpus_q2k.log" 2>&1
echo "q2k bench exit status: $?"; grep -E "corpus bench|stage device|queued-ahead|layers waited|corpus_stats" "$OUT/corpus_q2k.log"
timeout "${BENCH_TIMEOUT:-110}" python3 -m engram_numba.bench.corpus --quick --no-host --model fp8 \
  --fp8-proj "${FP8_PROJ:-decode}" --chunks "${FP8_CHUNKS:-200}" ${SWITCH_INTERVAL:+--switch-interval "$SWITCH_INTERVAL"} \
  --out "$OUT/corpus_fp8.json" > "$OUT/corpus_fp8.log" 2>&1
echo "fp8 bench exit status: $?"; grep -E "corpus bench|stage device|queued-ahead|layers waited|corpus_stats" "$OUT/corpus_fp8.log"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for name in ("corpus_q2k", "corpus_fp8"):
    p = pathlib.Path(sys.argv[1]) / f"{name}.json"
    if not p.exists():
        print(f"{name}: no result"); continue
    d = json.loads(p.read_text())
    print(f"{name}: commit {d.get('commit')}, switch interval {d.get('switch_interval', 0.005)} s")
    for r in d["records"]:
        if r["stage"] == "corpus_stats":
            print(f"{r['model']} [{r['variant']}]: {r['tokens_per_s']:,.0f} tokens/s, {r['time_us']:.0f} us a chunk, "
                  f"device_sum {r['device_sum_us']:.0f} us (x{r['ratio_to_device_sum']}), validated {r['validated']}, "
                  f"same as one chunk at a time {r['same_statistics_one_chunk_at_a_time']}, as the device variant "
                  f"{r.get('same_statistics_as_device_variant')}; timing_s {r['timing_s']}; "
                  f"stage_us {r['stage_us']}; kernel {r['kernel']}; tables {r['table_rows']:,} rows ({r.get('tables_fit', '')})")
PY
