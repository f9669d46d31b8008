"""Stage 3, proj: bf16 rows x [T, K] -> kv = bf16(x @ wkv^T) [T, N], fp32 accumulation.

    reference.py   projection_reference (fp32, k in order), projection_exact (float64), split_kv
    cpu.py         projection_cpu (@njit, bit-identical to the reference)
    cuda_common.py what the kernels share (views, launch bounds, simulator switches)
    cuda_gemv.py   GEMVs for few tokens: gemv_v1 (naive) .. gemv_v4 (tensor-core GEMV)
    cuda_gemm.py   GEMMs for many tokens: gemm_v1 (naive) .. gemm_v3 (mma.sync tensor cores)
    launch.py      project / prepare_project: the GPU launcher
    records.py     the kernel records of this stage and their default rules
    tests/
"""
