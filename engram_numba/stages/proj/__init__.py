"""Stage 3, proj: bf16 rows x [T, K] -> kv = bf16(x @ wkv^T) [T, N], fp32 accumulation.

    reference.py   projection_reference (fp32, k in order), projection_exact (float64), split_kv,
                   projection_deepseek_fp8 (DeepSeek's own arithmetic for an FP8 wkv)
    cpu.py         projection_cpu and projection_deepseek_fp8_cpu (@njit, bit-identical twins)
    weights.py     wkv_to_bf16: the stored wkv (bf16, f16, f32, q2k, q8_0, fp8 tiles) -> bf16 words
    cuda_common.py what the kernels share (views, launch bounds, simulator switches)
    gemv_common.py the weight-decoding helpers of the q2k / fp8 GEMVs (8-byte loads, f16x2 and e4m3 widening)
    cuda_gemv.py   GEMVs for few tokens: gemv_v1 (naive) .. gemv_v4 (tensor-core GEMV)
    cuda_gemm.py   GEMMs for many tokens: gemm_v1 (naive) .. gemm_v3 (mma.sync tensor cores)
    cuda_gemv_q2k.py  GEMVs straight on a Q2_K wkv: gemv_q2k_v1 (naive) .. gemv_q2k_v3 (factored)
    cuda_gemv_fp8.py  GEMVs straight on an FP8 wkv (e4m3 + 32x32 e8m0 tiles): gemv_fp8_v1, gemv_fp8_v2
    launch.py      project / prepare_project (bf16 wkv), project_q / prepare_project_q (q2k, fp8)
    records.py     the kernel records of this stage and their default rules
    tests/
"""
