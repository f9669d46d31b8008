"""Stage 3, proj: bf16 rows x [T, K] -> kv = bf16(x @ wkv^T) [T, N], fp32 accumulation.

    reference.py   projection_reference (fp32, k in order), projection_exact (float64), split_kv,
                   projection_deepseek_fp8 (DeepSeek's own arithmetic for an FP8 wkv)
    cpu.py         projection_cpu and projection_deepseek_fp8_cpu (@njit, bit-identical twins)
    weights.py     wkv_to_bf16: the stored wkv (bf16, f16, f32, q2k, q8_0, fp8 tiles) -> bf16 words
    cuda_common.py what the kernels share (views, launch bounds, simulator switches)
    cuda_gemv.py   GEMVs for few tokens: gemv_v1 (naive) .. gemv_v4 (tensor-core GEMV)
    cuda_gemm.py   GEMMs for many tokens: gemm_v1 (naive) .. gemm_v3 (mma.sync tensor cores)
    launch.py      project / prepare_project: the GPU launcher
    records.py     the kernel records of this stage and their default rules
    tests/
"""
