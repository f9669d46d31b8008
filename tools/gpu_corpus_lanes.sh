#!/usr/bin/env bash
# The corpus_stats lanes matrix on the H200, in ONE process (tools/corpus_lanes.py): the Q2_K
# model (released tables) and the FP8 model (tables shrunk to fit beside two engines), each with
# the reducer's two lane modes (analysis.corpus.LANES "contexts" / "all"), the FP8 model also with
# both FP8 projections (decode: a scratch decode a chunk; bf16: decoded once at build), every
# variant warmed up (the context tables' prune compiled) and then run REPEATS times in alternating
# order, statistics checked bit for bit against each model's first run. Prints tokens/s a run
# and a summary table (which lane mode wins per model, and by how much against the runs' spread).
# Run from the repository root on the H200 with the wheels of .whl/ carried (docs/gpu.md):
#   bash tools/gpu_corpus_lanes.sh
# Environment: OUT (default ./gpu_out), CHUNKS (4096-token chunks a run, both models; default
# 400), REPEATS (default 2), MODELS (default q2k,fp8), FP8_PROJ (default decode,bf16), TIMEOUT
# (the whole run, default 270 s; the JSON is rewritten after every run, so a cut-short run keeps
# what finished and its table is still made).
# Writes $OUT/corpus_lanes.{json,txt,log}.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
timeout "${TIMEOUT:-270}" python3 tools/corpus_lanes.py --out "$OUT" --chunks "${CHUNKS:-400}" \
  --repeats "${REPEATS:-2}" --models "${MODELS:-q2k,fp8}" --fp8-proj "${FP8_PROJ:-decode,bf16}" \
  > "$OUT/corpus_lanes.log" 2>&1
rc=$?
echo "corpus_lanes exit status: $rc"
grep -vE "Warning|warn\(" "$OUT/corpus_lanes.log" | grep -E "^(q2k|fp8): |^  (q2k|fp8) \[|FAILED|Error|error" | head -n 40
if [ $rc -ne 0 ] && [ -f "$OUT/corpus_lanes.json" ]; then
  python3 tools/corpus_lanes.py --summarize "$OUT/corpus_lanes.json"
else
  cat "$OUT/corpus_lanes.txt" 2>/dev/null || echo "no summary table (see $OUT/corpus_lanes.log)"
fi
