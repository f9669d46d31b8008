#!/usr/bin/env bash
# A short batch on the GPU machine for the q2k_r work, each part under its own time limit: the gpu
# tests that pin it (released-shape repack + decode on every tile, every Q2_K / q2k_r GEMV version at
# T = 1, 4, 8 against the float64 yardstick, the decode graph with both layers in one launch against
# the ungraphed per-layer step), then the decode benchmark's projection and decode_step records
# (JSON), then Nsight Compute on one launch of each GEMV. Run from the repository root with the
# wheels installed and PYTHONPATH set (docs/gpu.md); everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
ENGRAM_GPU_RESULTS="$OUT/gpu_tests_q2kr.json" timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -m gpu -q \
  -p no:cacheprovider -rfE engram_numba/stages/proj/tests/test_q2k_r.py engram_numba/stages/proj/tests/test_proj_quant.py \
  tests/test_engine_decode.py -k "every_tile or (quant_projection_released and q2k) or decode_graph_equals" \
  > "$OUT/gpu_tests_q2kr.log" 2>&1
echo "gpu tests exit status: $?"; tail -n 8 "$OUT/gpu_tests_q2kr.log"
timeout "${BENCH_TIMEOUT:-200}" python3 - "$OUT" <<'PY'
import json, sys, time
from pathlib import Path
from engram_numba.bench import decode
from engram_numba.bench.timing import RELEASED, commit, device_name
out = Path(sys.argv[1])
t0 = time.time()
res = {"commit": commit(), "device": device_name(), "records": [], "decode": {}}
def save():
    res["seconds"] = round(time.time() - t0, 1)
    (out / "decode_dev_q2kr.json").write_text(json.dumps(res, indent=1, default=str))
for part in ("proj", "decode_step"):
    r = decode.run(RELEASED, quick=True, parts=(part,), n_tokens=512)
    res["records"] += r["records"]
    res["decode"].update(r["decode"])
    save()
PY
echo "bench exit status: $?"
timeout "${NCU_TIMEOUT:-60}" ncu --clock-control none --kernel-name regex:gemv --profile-from-start off \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 tools/gpu_ncu_q2k.py > "$OUT/ncu_gemv.txt" 2>&1
echo "ncu exit status: $?"
