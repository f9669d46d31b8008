#!/usr/bin/env bash
# One GPU batch for a q2k_r GEMV family (VERSION = v10, v11 or v12; default v12), about a minute on an
# H200, everything in $OUT (3 files):
#   tools/q2kr_v10_variants.py --version $VERSION --run: the registered gemv_q2k_$VERSION and its variant
#   shapes checked against gemv_q2k_v4 bit for bit on every output (released shape K x N = 6144 x 25600 at
#   T = 1, 4, 8 and three odd small shapes, alone and as the two-layer launch), then timed with DeviceTimer
#   (L2 flushed): T = 1 single and two-layer beside the family's baselines (v12: v11, v9, v4), T = 4 and 8
#   single. $OUT/<VERSION>_variants.json, $OUT/<VERSION>_variants.txt (the table), $OUT/<VERSION>_variants.log.
#   A variant that differs from v4 or fails is listed with its error and not timed; the rest go on.
# Run from the repository root with the wheels installed and PYTHONPATH set (docs/gpu.md):
#   OUT=<folder> bash tools/gpu_dev_q2kr_variants.sh            # VERSION=v12
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
VERSION=${VERSION:-v12}
mkdir -p "$OUT"
timeout "${VARIANTS_TIMEOUT:-100}" python3 tools/q2kr_v10_variants.py --version "$VERSION" --run --out "$OUT" \
  > "$OUT/${VERSION}_variants.log" 2>&1
echo "variants exit status: $? (124: the timeout; the JSON holds what finished)"
cat "$OUT/${VERSION}_variants.txt" 2>/dev/null || tail -n 30 "$OUT/${VERSION}_variants.log"
