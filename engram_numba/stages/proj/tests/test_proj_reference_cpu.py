"""The projection's numpy reference against order-free float64 math, and its @njit backend against
the reference (moved here from tests/test_reference_cpu.py)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engram_numba.bf16 import bf16_ulp_distance, f32_to_bf16
from engram_numba.stages.proj.cpu import projection_cpu
from engram_numba.stages.proj.reference import projection_exact, projection_reference


def _bf16(rng, shape, scale=1.0):
    return f32_to_bf16(rng.standard_normal(shape) * scale)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 6), N=st.integers(1, 40), K=st.integers(1, 96), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-3, 0.02, 1.0, 30.0]))
def test_projection_reference_within_one_ulp_of_exact_and_cpu_identical(T, N, K, seed, scale):
    rng = np.random.default_rng(seed)
    x, w = _bf16(rng, (T, K)), _bf16(rng, (N, K), scale)
    ref = projection_reference(x, w)
    assert ref.shape == (T, N) and ref.dtype == np.uint16
    assert bf16_ulp_distance(ref, projection_exact(x, w)).max() <= 1
    np.testing.assert_array_equal(projection_cpu(x, w), ref)  # same order: bit-identical


def test_projection_tiny_model_shape_cpu_identical(rng):
    x, w = _bf16(rng, (14, 1536)), _bf16(rng, (320, 1536), 0.02)
    ref = projection_reference(x, w)
    np.testing.assert_array_equal(projection_cpu(x, w), ref)
    assert bf16_ulp_distance(ref, projection_exact(x, w)).max() <= 1


def test_projection_rejects_mismatched_k(rng):
    with pytest.raises(ValueError, match="x \\[T, K\\] and wkv \\[N, K\\]"):
        projection_reference(_bf16(rng, (2, 8)), _bf16(rng, (3, 9)))
    with pytest.raises(ValueError, match="x \\[T, K\\] and wkv \\[N, K\\]"):
        projection_cpu(_bf16(rng, (2, 8)), _bf16(rng, (3, 9)))


@pytest.mark.parametrize("T", [7, 8, 9, 16, 17, 35])
def test_projection_cpu_token_groups_identical_to_reference(rng, T):
    """The @njit projection sums 8 tokens side by side; partial groups and several groups stay
    bit-identical to the reference."""
    x, w = _bf16(rng, (T, 96), 0.3), _bf16(rng, (11, 96), 0.3)
    np.testing.assert_array_equal(projection_cpu(x, w), projection_reference(x, w))


@pytest.mark.parametrize("T, K, N", [(1, 1536, 320), (14, 1536, 320), (33, 512, 96)])
def test_projection_blas_distance_from_reference_in_bf16_ulps(rng, T, K, N):
    """The BLAS projection (numpy fp32 matmul, BLAS's summation order) is not bit-identical to the
    reference, but within 1 bf16 ulp of it wherever the sum does not cancel (sum |x*w| at most
    32 x |sum x*w|: any fp32 order is then off by far less than a bf16 ulp, so the two roundings can
    differ by one step at most), and bit-identical on almost every output."""
    from engram_numba.bf16 import bf16_to_f32
    from engram_numba.stages.proj.cpu import projection_blas
    x, w = _bf16(rng, (T, K)), _bf16(rng, (N, K), 0.02)
    ref, blas = projection_reference(x, w), projection_blas(x, w)
    assert blas.shape == ref.shape and blas.dtype == np.uint16
    ulps = bf16_ulp_distance(ref, blas)
    magnitude = np.abs(bf16_to_f32(x)).astype(np.float64) @ np.abs(bf16_to_f32(w)).astype(np.float64).T
    no_cancel = magnitude <= 32 * np.abs(bf16_to_f32(ref))
    assert no_cancel.mean() > 0.25                 # enough well-conditioned outputs for the check to mean something
    assert ulps[no_cancel].max() <= 1
    assert (ulps == 0).mean() >= 0.99
    assert bf16_ulp_distance(blas, projection_exact(x, w))[no_cancel].max() <= 1
    # the fp32 weight kept between calls gives the same bits
    np.testing.assert_array_equal(projection_blas(x, wkv_f32=bf16_to_f32(w)), blas)
    with pytest.raises(ValueError, match="x \\[T, K\\] and wkv \\[N, K\\]"):
        projection_blas(x[:, :-1], w)
