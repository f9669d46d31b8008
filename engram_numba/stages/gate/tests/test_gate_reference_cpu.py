"""The gate's numpy reference against order-free float64 math, and its @njit backend against the
reference (moved here from tests/test_reference_cpu.py)."""
import numpy as np
import pytest

from engram_numba.bf16 import bf16_to_f32, f32_to_bf16, round_f32_through_bf16
from engram_numba.config import GATE_CLAMP
from engram_numba.stages.gate.cpu import gate_cpu
from engram_numba.stages.gate.reference import gate_reference
from engram_numba.stages.proj.reference import split_kv


def _bf16(rng, shape, scale=1.0):
    return f32_to_bf16(rng.standard_normal(shape) * scale)


def _gate_f64(highway, kv, q, k, mask=None, eps=1e-20):
    """docs/math.md section 6 in float64: what the fp32 reference approximates."""
    T, hc, dim = highway.shape
    key, value = split_kv(kv, hc)
    h = highway.astype(np.float64)
    kk = bf16_to_f32(key).astype(np.float64)
    v = bf16_to_f32(value).astype(np.float64)
    w = (q.astype(np.float32) * k.astype(np.float32)).astype(np.float64)[None]
    dot = ((h * w * kk).sum(-1) / np.sqrt((h * h).mean(-1) + eps) / np.sqrt((kk * kk).mean(-1) + eps)
           / np.sqrt(dim))
    g = np.copysign(np.sqrt(np.maximum(np.abs(dot), GATE_CLAMP)), dot)
    gate = 1 / (1 + np.exp(-g))
    if mask is not None:
        gate = np.where(np.asarray(mask)[:, None], gate, 0.0)
    return dot, gate, h + gate[..., None] * v[:, None, :]


def _gate_inputs(rng, T, hc, dim, h_scale=1.0):
    highway = (rng.standard_normal((T, hc, dim)) * h_scale).astype(np.float32)
    kv = _bf16(rng, (T, (hc + 1) * dim))
    q = (1 + 0.1 * rng.standard_normal((hc, dim))).astype(np.float32)
    k = (1 + 0.1 * rng.standard_normal((hc, dim))).astype(np.float32)
    return highway, kv, q, k


@pytest.mark.parametrize("hc", [1, 2, 3, 4])
@pytest.mark.parametrize("h_scale", [0.05, 1.0, 40.0])
def test_gate_reference_close_to_float64(rng, hc, h_scale):
    highway, kv, q, k = _gate_inputs(rng, 6, hc, 256, h_scale)
    mask = np.array([True, True, False, True, True, False])
    before = highway.copy()
    out = gate_reference(highway, kv, q, k, token_mask=mask)
    np.testing.assert_array_equal(highway, before)  # the reference never changes its input
    dot64, gate64, new64 = _gate_f64(highway, kv, q, k, mask)
    # fp32 reductions over 256 terms: relative error of the dot well under 1e-5
    assert np.abs(out.dot - dot64).max() <= 1e-5 * max(1.0, np.abs(dot64).max())
    assert np.abs(out.gate - gate64).max() <= 1e-6
    assert np.abs(out.highway - new64).max() <= 4e-6 * np.abs(new64).max()
    np.testing.assert_array_equal(out.highway[~mask], highway[~mask])
    assert (out.gate[~mask] == 0).all()


def test_gate_bf16_residual_rounds_input_and_output(rng):
    highway, kv, q, k = _gate_inputs(rng, 4, 4, 128, 3.0)
    out = gate_reference(highway, kv, q, k, residual="bf16")
    np.testing.assert_array_equal(round_f32_through_bf16(out.highway), out.highway)
    # the same math on the pre-rounded highway in fp32, then rounded, is the bf16 result
    fp32 = gate_reference(round_f32_through_bf16(highway), kv, q, k, residual="fp32")
    np.testing.assert_array_equal(round_f32_through_bf16(fp32.highway), out.highway)


def test_gate_clamp_and_zero_key(rng):
    highway, kv, q, k = _gate_inputs(rng, 3, 2, 64)
    key, _ = split_kv(kv, 2)
    key[0, 0, :] = 0  # mean(k*k) = 0: eps keeps it finite, dot = 0, gate = sigmoid(sqrt(1e-6))
    out = gate_reference(highway, kv, q, k)
    assert np.isfinite(out.highway).all() and np.isfinite(out.gate).all()
    assert out.dot[0, 0] == 0
    assert out.gate[0, 0] == np.float32(1 / (1 + np.exp(-np.float64(np.sqrt(np.float32(1e-6))))))


@pytest.mark.parametrize("residual", ["fp32", "bf16"])
@pytest.mark.parametrize("hc", [1, 4])
def test_gate_cpu_matches_reference(rng, residual, hc):
    highway, kv, q, k = _gate_inputs(rng, 7, hc, 320, 5.0)
    mask = rng.random(7) > 0.3
    ref = gate_reference(highway, kv, q, k, token_mask=mask, residual=residual)
    got = gate_cpu(highway, kv, q, k, token_mask=mask, residual=residual)
    # Same summation order and a float64 sigmoid in both: bit-identical.
    np.testing.assert_array_equal(got.dot, ref.dot)
    np.testing.assert_array_equal(got.gate, ref.gate)
    np.testing.assert_array_equal(got.highway, ref.highway)
    np.testing.assert_array_equal(got.highway[~mask], highway[~mask])


def test_gate_rejects_unknown_residual(rng):
    highway, kv, q, k = _gate_inputs(rng, 1, 1, 8)
    with pytest.raises(ValueError, match="residual must be one of"):
        gate_reference(highway, kv, q, k, residual="fp16")
    with pytest.raises(ValueError, match="residual must be one of"):
        gate_cpu(highway, kv, q, k, residual="fp16")
