"""DeepSeek's own projection arithmetic for an FP8 wkv (reference.projection_deepseek_fp8 and its
@njit twin cpu.projection_deepseek_fp8_cpu; docs/math.md section 5.4).

- act_quant: the reference and the @njit twin are bit-identical; q is what ml_dtypes' e4m3 RNE
  gives for x / s; it is lossless on FP8 rows and rounds below the 1e-4 amax floor.
- the projection: reference == @njit bit for bit, and both == a scalar loop of the formula.
- how far it lands from the bf16-dequantised GEMM (the projection of this toolkit, with the FP8
  wkv decoded exactly to bf16) on the tiny FP8 model, in bf16 ulps: printed, and held to the
  figures docs/numerics.md states (max 1 ulp, no output more than 1 ulp away). On rows that are
  not FP8 values (the tiny model's Q2_K rows) act_quant rounds them, and the distance is real.
"""
import ml_dtypes
import numpy as np
import pytest

from engram_numba.bf16 import bf16_to_f32, bf16_ulp_distance, f32_to_bf16
from engram_numba.fixtures import realistic_rows, tiny_config, tiny_float_weights, tiny_hash_tables
from engram_numba.stages.proj import cpu as C
from engram_numba.stages.proj import reference as R
from engram_numba.stages.proj.weights import encode_wkv_fp8, wkv_to_bf16
from engram_numba.stages.rows.fp8 import E4M3_VALUES, E8M0_VALUES, assemble_rows_fp8, encode_rows_fp8
from engram_numba.stages.rows.reference import rows_reference


def fp8_rows(rng, n):
    """bf16 words [n, 256] of realistic rows stored as FP8 (exact in bf16)."""
    codes, scales = encode_rows_fp8(realistic_rows(rng, n))
    return rows_reference(assemble_rows_fp8(codes, scales), "fp8")


def random_case(rng, T, K, N):
    x = f32_to_bf16(rng.standard_t(4, (T, K)).astype(np.float32) * rng.lognormal(-3, 2, (T, 1)).astype(np.float32))
    w = (rng.standard_normal((N, K)) / np.sqrt(K) * rng.lognormal(0, 1, (N, 1))).astype(np.float32)
    return (x, *encode_wkv_fp8(w))


def test_act_quant_reference_and_cpu_agree_and_match_ml_dtypes(rng):
    x, _, _ = random_case(rng, 9, 256, 32)
    x[0, :32] = f32_to_bf16(np.full(32, 3e-6, np.float32))              # amax below the 1e-4 floor
    x[1, 32:64] = 0                                                    # an all-zero group
    q, s = R.act_quant_reference(x)
    q2, s2 = C.act_quant_cpu(x)
    np.testing.assert_array_equal(q.view(np.uint32), q2.view(np.uint32))
    np.testing.assert_array_equal(s.view(np.uint32), s2.view(np.uint32))
    xf = bf16_to_f32(x).reshape(9, 8, 32)
    want = (xf / s[:, :, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(9, 256)
    np.testing.assert_array_equal(q, want)
    assert np.isin(s, np.ldexp(1.0, np.arange(-40, 40))).all()         # powers of two
    amax = np.maximum(np.abs(xf).max(axis=2), np.float32(1e-4))
    assert (amax / s <= 448).all() and (amax / s > 224).all()          # the smallest that fits
    assert s[0, 0] == 2.0 ** -22                                       # ceil(log2(1e-4 / 448)) = -22


def test_act_quant_is_lossless_on_fp8_rows_except_below_the_floor(rng):
    x = fp8_rows(rng, 40).reshape(10, 1024)
    q, s = R.act_quant_reference(x)
    np.testing.assert_array_equal(q * np.repeat(s, 32, axis=1), bf16_to_f32(x))
    tiny = x.copy()
    tiny[0, :32] = f32_to_bf16(bf16_to_f32(x[0, :32]) * np.float32(2.0 ** -20))   # amax now << 1e-4
    q, s = R.act_quant_reference(tiny)
    assert np.abs(bf16_to_f32(tiny[0, :32])).max() < 1e-4
    assert not np.array_equal(q[0, :32] * s[0, 0], bf16_to_f32(tiny[0, :32]))   # the floor costs bits


@pytest.mark.parametrize("T,K,N", [(1, 256, 32), (5, 512, 40), (17, 1024, 96)])
def test_reference_and_cpu_are_bit_identical(rng, T, K, N):
    x, codes, scales = random_case(rng, T, K, N)
    want = R.projection_deepseek_fp8(x, codes, scales, token_block=3)
    np.testing.assert_array_equal(C.projection_deepseek_fp8_cpu(x, codes, scales), want)
    np.testing.assert_array_equal(R.projection_deepseek_fp8(x, codes.view(ml_dtypes.float8_e4m3fn),
                                                            scales.view(ml_dtypes.float8_e8m0fnu)), want)


def test_the_formula_as_a_scalar_loop(rng):
    """A few outputs recomputed with numpy fp32 scalars, one operation at a time."""
    x, codes, scales = random_case(rng, 3, 128, 64)
    got = R.projection_deepseek_fp8(x, codes, scales)
    q, s = R.act_quant_reference(x)
    for t, n in [(0, 0), (2, 63), (1, 33)]:
        acc = np.float32(0)
        for b in range(4):
            partial = np.float32(0)
            for k in range(32 * b, 32 * b + 32):
                partial = np.float32(partial + np.float32(q[t, k] * E4M3_VALUES[codes[n, k]]))
            acc = np.float32(acc + np.float32(np.float32(partial * s[t, b]) * E8M0_VALUES[scales[n // 32, b]]))
        assert got[t, n] == f32_to_bf16(np.array([acc]))[0]


def test_argument_errors(rng):
    x, codes, scales = random_case(rng, 2, 64, 32)
    for fn in (R.projection_deepseek_fp8, C.projection_deepseek_fp8_cpu):
        with pytest.raises(ValueError, match=r"x must be bf16 words uint16 \[T, K\]"):
            fn(bf16_to_f32(x), codes, scales)
        with pytest.raises(ValueError, match=r"K = 48 .* K % 32 == 0"):
            fn(x[:, :48], codes[:, :48], scales)
        with pytest.raises(ValueError, match=r"wkv_codes must be uint8 e4m3 codes \[N, K=64\]"):
            fn(x, codes[:, :32], scales)
        with pytest.raises(ValueError, match=r"wkv_scales must be uint8 e8m0 \[1, 2\]"):
            fn(x, codes, scales[:, :1])


def _tiny_fp8_model(rng, T=64):
    """The tiny model's layer-1 weights as FP8 (tables and wkv encoded from the same float
    weights the Q2_K file was made from), and T tokens' worth of gathered rows."""
    cfg = tiny_config()
    weights = tiny_float_weights(cfg, tiny_hash_tables())[1]
    codes, scales = encode_rows_fp8(weights["table_rows"])
    rows = rows_reference(assemble_rows_fp8(codes, scales), "fp8")             # [rows, 256], exact
    x = rows[rng.integers(0, rows.shape[0], T * cfg.n_hash_cols)].reshape(T, cfg.proj_in)
    wkv_codes, wkv_scales = encode_wkv_fp8(weights["wkv"])
    return cfg, weights, x, wkv_codes, wkv_scales


def test_distance_from_the_bf16_gemm_on_the_tiny_fp8_model(rng):
    cfg, _, x, wkv_codes, wkv_scales = _tiny_fp8_model(rng)
    wkv_bf16 = wkv_to_bf16(wkv_codes, "fp8", wkv_scales)                       # exact
    deepseek = R.projection_deepseek_fp8(x, wkv_codes, wkv_scales)
    np.testing.assert_array_equal(C.projection_deepseek_fp8_cpu(x, wkv_codes, wkv_scales), deepseek)
    gemm = R.projection_reference(x, wkv_bf16)
    exact = R.projection_exact(x, wkv_bf16)
    d = bf16_ulp_distance(deepseek, gemm)
    d_exact = bf16_ulp_distance(deepseek, exact)
    d_gemm_exact = bf16_ulp_distance(gemm, exact)
    print(f"\ntiny FP8 model, layer 1, T = {x.shape[0]}, [{x.shape[0]}, {cfg.proj_in}] x [{cfg.proj_out}, "
          f"{cfg.proj_in}]^T ({d.size} outputs):\n"
          f"  DeepSeek FP8 arithmetic vs bf16 GEMM: max {d.max()} ulp, {100 * (d > 1).mean():.4f}% > 1 ulp, "
          f"{100 * (d > 0).mean():.4f}% differ\n"
          f"  vs the float64 product rounded once: DeepSeek max {d_exact.max()} ulp "
          f"({100 * (d_exact > 0).mean():.4f}% differ), bf16 GEMM max {d_gemm_exact.max()} ulp "
          f"({100 * (d_gemm_exact > 0).mean():.4f}% differ)")
    assert d.max() <= 1 and (d > 1).sum() == 0
    assert d_exact.max() <= 1 and d_gemm_exact.max() <= 1


def test_distance_on_rows_that_are_not_fp8_values(rng):
    """The tiny model's Q2_K rows through DeepSeek's arithmetic: act_quant rounds them to e4m3
    (4 significant bits), so the result moves by a few percent, not by summation noise."""
    import engram_numba as en
    cfg, _, _, wkv_codes, wkv_scales = _tiny_fp8_model(rng)
    with en.load_gguf(en.tiny_model_path()) as model:
        raw = model.rows(1).read(rng.integers(0, model.layers[1].n_rows, 64 * cfg.n_hash_cols))
    x = rows_reference(raw, "q2k").reshape(64, cfg.proj_in)
    deepseek = R.projection_deepseek_fp8(x, wkv_codes, wkv_scales)
    gemm = R.projection_reference(x, wkv_to_bf16(wkv_codes, "fp8", wkv_scales))
    d = bf16_ulp_distance(deepseek, gemm)
    a, b = bf16_to_f32(deepseek).astype(np.float64), bf16_to_f32(gemm).astype(np.float64)
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"\nQ2_K rows through DeepSeek's FP8 arithmetic vs the bf16 GEMM: relative L2 {rel:.4f}, "
          f"{100 * (d > 1).mean():.1f}% of outputs > 1 ulp")
    assert 0.005 < rel < 0.1 and (d > 1).mean() > 0.5


def test_distance_at_the_released_k(rng):
    """The same comparison at the released K = 6144 (24 FP8 rows a token) for 1024 of the 25600
    outputs, with the @njit twin (bit-identical to the reference, tested above)."""
    T, K, N = 32, 6144, 1024
    rows = fp8_rows(rng, 4096)
    x = rows[rng.integers(0, 4096, T * 24)].reshape(T, K)
    w = (rng.standard_normal((N, K)) / np.sqrt(K) * 25 * rng.lognormal(0, 0.2, (N, 1))).astype(np.float32)
    wkv_codes, wkv_scales = encode_wkv_fp8(w)
    wkv_bf16 = wkv_to_bf16(wkv_codes, "fp8", wkv_scales)
    deepseek = C.projection_deepseek_fp8_cpu(x, wkv_codes, wkv_scales)
    gemm = C.projection_cpu(x, wkv_bf16)
    exact = R.projection_exact(x, wkv_bf16)
    d, d_exact = bf16_ulp_distance(deepseek, gemm), bf16_ulp_distance(deepseek, exact)
    print(f"\nK = {K}, T = {T}, N = {N}: DeepSeek vs bf16 GEMM max {d.max()} ulp, {100 * (d > 1).mean():.4f}% > 1 ulp, "
          f"{100 * (d > 0).mean():.4f}% differ; DeepSeek vs float64 max {d_exact.max()} ulp, "
          f"{100 * (d_exact > 0).mean():.4f}% differ; bf16 GEMM vs float64 "
          f"{100 * (bf16_ulp_distance(gemm, exact) > 0).mean():.4f}% differ")
    assert d.max() <= 1 and d_exact.max() <= 1 and (d > 0).mean() < 1e-3
