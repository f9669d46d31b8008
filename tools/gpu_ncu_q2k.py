"""One launch of each weight-decoding GEMV at the released shape, for Nsight Compute (the evidence
behind the decode figures): the Q2_K file-layout default, every q2k_r version (the same weight
re-laid out on the device), the FP8 default and every other FP8 GEMV that reads the exact weights
(gemv_fp8_v3, ...), T = 1. With the argument `fp8`, the FP8 GEMVs only. Two warm-up rounds, then one round between
`cuda.profiling()`, so ncu needs no launch counts:

    ncu --clock-control none --profile-from-start off --kernel-name regex:gemv \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 tools/gpu_ncu_q2k.py [fp8]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the package beside tools/

import numpy as np  # noqa: E402
from numba import cuda

from engram_numba.bf16 import f32_to_bf16
from engram_numba.stages import registry
from engram_numba.stages.proj.cuda_gemv_q2kr import repack_on_device
from engram_numba.stages.proj.launch import pick, prepare_project_q
from engram_numba.stages.proj.records import DEEPSEEK_FP8_VERSIONS
from engram_numba.stages.rows.encodings import random_raw_rows

N, K = 25600, 6144
fp8_only = sys.argv[1:] == ["fp8"]
rng = np.random.default_rng(0)
codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
codes[(codes & 0x7F) == 0x7F] = 0x38                      # no NaN codes
wf, sf = cuda.to_device(codes), cuda.to_device(rng.integers(110, 125, (N // 32, K // 32), dtype=np.uint8))
x = cuda.to_device(f32_to_bf16(rng.standard_normal((1, K)).astype(np.float32) * 0.05))
launches = []
if not fp8_only:
    wq = cuda.to_device(random_raw_rows("q2k", N * K // 256, rng).reshape(N, K // 256 * 84))
    wr = repack_on_device(wq, N, K)
    launches += [prepare_project_q(x, wq, weight="q2k")]
    launches += [prepare_project_q(x, wr, out=cuda.device_array((1, N), np.uint16), weight="q2k_r", version=v)
                 for v in registry.names("proj", "q2k_r")]
launches.append(prepare_project_q(x, wf, sf, weight="fp8"))
# the other exact-weight FP8 GEMVs (not v1: naive; not DeepSeek's FP8 arithmetic, tools/fp8_dev.py)
launches += [prepare_project_q(x, wf, sf, out=cuda.device_array((1, N), np.uint16), weight="fp8", version=v)
             for v in registry.names("proj", "fp8")
             if v != pick(1, K, N, weight="fp8").name and not v.endswith("_v1") and v not in DEEPSEEK_FP8_VERSIONS]
for _ in range(2):                                         # warm-up rounds; then one profiled round
    for launch in launches:
        launch()
cuda.synchronize()
with cuda.profiling():                                     # ncu --profile-from-start off sees this round only
    for launch in launches:
        launch()
    cuda.synchronize()
print("done", [launch.name for launch in launches])
