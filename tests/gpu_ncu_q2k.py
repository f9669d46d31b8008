"""One launch of each weight-decoding GEMV at the released shape, for Nsight Compute (the evidence
behind the decode figures in bench/results/):

    ncu --clock-control none --kernel-name regex:gemv_ --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 tests/gpu_ncu_q2k.py
"""
import numpy as np
from numba import cuda

from engram_numba.bf16 import f32_to_bf16
from engram_numba.stages.proj.launch import prepare_project_q
from engram_numba.stages.rows.encodings import random_raw_rows

N, K = 25600, 6144
rng = np.random.default_rng(0)
wq = cuda.to_device(random_raw_rows("q2k", N * K // 256, rng).reshape(N, K // 256 * 84))
codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
codes[(codes & 0x7F) == 0x7F] = 0x38                      # no NaN codes
wf, sf = cuda.to_device(codes), cuda.to_device(rng.integers(110, 125, (N // 32, K // 32), dtype=np.uint8))
x = cuda.to_device(f32_to_bf16(rng.standard_normal((1, K)).astype(np.float32) * 0.05))
q2k = prepare_project_q(x, wq, weight="q2k")
fp8 = prepare_project_q(x, wf, sf, weight="fp8")
for _ in range(3):                                         # launches 0-2 warm up; ncu profiles from 3 on
    q2k()
    fp8()
cuda.synchronize()
q2k()
fp8()
cuda.synchronize()
print("done", q2k.name, fp8.name)
