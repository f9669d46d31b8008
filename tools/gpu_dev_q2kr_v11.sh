#!/usr/bin/env bash
# One GPU batch for gemv_q2k_v11 (about a minute on an H200), everything in $OUT:
#   tools/q2kr_v10_variants.py --version v11 --run: the registered v11 and its variant shapes checked
#   against gemv_q2k_v4 bit for bit (released shape at T = 1, 4, 8 and three odd small shapes, alone and
#   as the two-layer launch), then timed with DeviceTimer (L2 flushed) beside v10, v9 and v4: T = 1
#   single and two-layer, T = 4 and 8 single. $OUT/v11_variants.json, $OUT/v11_variants.txt (the table),
#   $OUT/v11_variants.log.
# Run from the repository root with the wheels installed and PYTHONPATH set (docs/gpu.md):
#   OUT=<folder> bash tools/gpu_dev_q2kr_v11.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
timeout "${VARIANTS_TIMEOUT:-110}" python3 tools/q2kr_v10_variants.py --version v11 --run --out "$OUT" \
  > "$OUT/v11_variants.log" 2>&1
echo "variants exit status: $?"
cat "$OUT/v11_variants.txt" 2>/dev/null || tail -n 30 "$OUT/v11_variants.log"
