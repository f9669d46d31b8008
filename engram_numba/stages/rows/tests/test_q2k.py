"""Q2_K rows: the decoders against gguf-py (bit-exact), bf16 rounding against ml_dtypes, and this
package's encoder (valid blocks, measured round-trip error, better than a naive baseline)."""
import gguf
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
from engram_numba.stages.rows import q2k
from engram_numba.stages.rows.q2k import ENGRAM_ROW_BYTES, check_blocks, dequantize, dequantize_cpu, quantize

from .conftest import assert_bits_equal

Q2_K = gguf.GGMLQuantizationType.Q2_K


def _gguf_dequantize(blocks):
    return gguf.quants.dequantize(blocks, Q2_K).reshape(blocks.shape[0], 256)


def _finite_half_bits(rng, n):
    """Random fp16 bit patterns [n] uint16 over every finite value: both signs, zeros, subnormals."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    inf_or_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_or_nan] &= np.uint16(0xFBFF)  # clear one exponent bit: a finite value of the same sign
    return bits


def random_blocks(rng, n):
    """[n, 84] uint8: random scales and quants, finite random fp16 d and dmin."""
    blocks = rng.integers(0, 256, size=(n, ENGRAM_ROW_BYTES), dtype=np.uint8)
    blocks[:, 80:82] = _finite_half_bits(rng, n).reshape(n, 1).view(np.uint8)
    blocks[:, 82:84] = _finite_half_bits(rng, n).reshape(n, 1).view(np.uint8)
    return blocks


def rel_rms(approx, exact):
    exact = np.asarray(exact, dtype=np.float64)
    return float(np.sqrt(np.sum((np.asarray(approx, np.float64) - exact) ** 2) / np.sum(exact ** 2)))


# Decoders against gguf-py -----------------------------------------------------------------------

def test_decoders_bit_exact_with_gguf_on_many_random_blocks(rng):
    blocks = random_blocks(rng, 5000)
    want = _gguf_dequantize(blocks)
    assert np.isfinite(want).all()
    assert_bits_equal(dequantize(blocks), want)
    assert_bits_equal(dequantize_cpu(blocks), want)


def test_decoders_bit_exact_on_edge_super_scales(rng):
    # Signed zeros, smallest and largest subnormals, the smallest normal, the largest finite
    # value and its negative, against extreme scale/min nibbles (0 and 15).
    specials = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF],
                        dtype=np.uint16)
    d, dmin = np.meshgrid(specials, specials)
    n = d.size
    blocks = random_blocks(rng, n)
    blocks[:, 80:82] = d.reshape(n, 1).view(np.uint8)
    blocks[:, 82:84] = dmin.reshape(n, 1).view(np.uint8)
    blocks[: n // 2, :16] = rng.choice(np.array([0x00, 0x0F, 0xF0, 0xFF], np.uint8), size=(n // 2, 16))
    want = _gguf_dequantize(blocks)
    assert_bits_equal(dequantize(blocks), want)
    assert_bits_equal(dequantize_cpu(blocks), want)


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.binary(min_size=80, max_size=80),
            st.floats(width=16, allow_nan=False, allow_infinity=False),
            st.floats(width=16, allow_nan=False, allow_infinity=False),
        ),
        min_size=1, max_size=6,
    )
)
def test_decoders_bit_exact_with_gguf_hypothesis(data):
    blocks = np.empty((len(data), ENGRAM_ROW_BYTES), dtype=np.uint8)
    for i, (body, d, dmin) in enumerate(data):
        blocks[i, :80] = np.frombuffer(body, dtype=np.uint8)
        blocks[i, 80:82] = np.array([d], np.float16).view(np.uint8)
        blocks[i, 82:84] = np.array([dmin], np.float16).view(np.uint8)
    want = _gguf_dequantize(blocks)
    assert_bits_equal(dequantize(blocks), want)
    assert_bits_equal(dequantize_cpu(blocks), want)


def test_decoders_accept_flat_bytes_and_out(rng):
    blocks = random_blocks(rng, 7)
    want = dequantize(blocks)
    assert_bits_equal(dequantize(blocks.ravel()), want)
    out = np.full((7, 256), np.nan, dtype=np.float32)
    assert dequantize_cpu(blocks, out=out) is out
    assert_bits_equal(out, want)
    for bad in (np.empty((6, 256), np.float32), np.empty((7, 256), np.float64), np.empty((7, 128), np.float32)):
        with pytest.raises(ValueError, match=r"out must be float32 \[7, 256\]"):
            dequantize_cpu(blocks, out=bad)


def test_dequantize_to_bf16_rounds_like_ml_dtypes(rng):
    blocks = random_blocks(rng, 64)
    want = _gguf_dequantize(blocks).astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(q2k.dequantize_to_bf16(blocks), want)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((2, 84), np.int8), "uint8"),
    (np.zeros((2, 84), np.float32), "uint8"),
    (np.zeros(83, np.uint8), "whole number"),
    (np.zeros((2, 83), np.uint8), r"\[n, 84\]"),
    (np.zeros((2, 2, 84), np.uint8), r"\[n, 84\]"),
])
def test_check_blocks_rejects_bad_input(bad, match):
    for decode in (check_blocks, dequantize, dequantize_cpu):
        with pytest.raises(ValueError, match=match):
            decode(bad)


# bf16 rounding against ml_dtypes -----------------------------------------------------------------

def _ml_bf16(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def test_bf16_rounding_matches_ml_dtypes_on_random_bits(rng):
    bits = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    np.testing.assert_array_equal(f32_to_bf16(x), _ml_bf16(x))


def test_bf16_rounding_matches_ml_dtypes_on_ties_and_specials(rng):
    high = rng.integers(0, 1 << 16, size=4000, dtype=np.uint32) << np.uint32(16)
    # Exact halfway (ties to even: both parities of the kept half), and one below/above it.
    low = np.array([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], dtype=np.uint32)
    x = (high[:, None] | low[None, :]).ravel().view(np.float32)
    x = x[~np.isnan(x)]
    specials = np.array([
        0x7F800000, 0xFF800000,            # +-inf
        0x00000000, 0x80000000,            # +-0
        0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000, 0x807F8000,  # subnormals, incl. ties
        0x00800000,                        # smallest normal
        0x7F7FFFFF, 0xFF7FFFFF,            # largest finite: rounds to inf
        0x7F7F8000, 0x7F7F7FFF, 0x7F7E8000,  # just at / below the overflow tie, a tie that stays finite
        0x3F808000, 0x3F818000,            # 1 + half an ulp (to even: down) and 1 + 1.5 ulps (up)
    ], dtype=np.uint32).view(np.float32)
    for values in (x, specials):
        np.testing.assert_array_equal(f32_to_bf16(values), _ml_bf16(values))
    words = f32_to_bf16(specials)
    assert words[0] == 0x7F80 and words[1] == 0xFF80 and words[3] == 0x8000
    assert words[11] == 0x7F80 and words[12] == 0xFF80  # overflow to inf, as on the GPU


def test_bf16_keeps_nan_nan(rng):
    payload = rng.integers(1, 1 << 23, size=1000, dtype=np.uint32)
    sign = rng.integers(0, 2, size=1000, dtype=np.uint32) << np.uint32(31)
    # Include signalling NaNs whose payload lives only in the low 16 bits: plain truncation
    # would turn them into infinities.
    payload[:10] = np.arange(1, 11, dtype=np.uint32)
    nans = (sign | np.uint32(0x7F800000) | payload).view(np.float32)
    assert np.isnan(nans).all()
    assert np.isnan(bf16_to_f32(f32_to_bf16(nans))).all()


@settings(max_examples=500, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=32))
def test_bf16_rounding_matches_ml_dtypes_hypothesis(values):
    x = np.array(values, dtype=np.float32)
    np.testing.assert_array_equal(f32_to_bf16(x), _ml_bf16(x))


# The encoder -------------------------------------------------------------------------------------

def _naive_q2k(rows):
    """Baseline encoder: each sub-block's plain min/max grid (min clamped to <= 0), the same 4-bit
    and fp16 rounding of scales and mins as Q2_K needs, q rounded to the decoded grid."""
    n = rows.shape[0]
    x = rows.reshape(n, 16, 16).astype(np.float64)
    lo = np.minimum(x.min(axis=2), 0.0)
    scale, m = (x.max(axis=2) - lo) / 3.0, -lo                           # [n, 16] each
    d = (scale.max(axis=1) / 15).astype(np.float16)
    dmin = (m.max(axis=1) / 15).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.nan_to_num(np.clip(np.rint(scale / d.astype(np.float64)[:, None]), 0, 15))
        lm = np.nan_to_num(np.clip(np.rint(m / dmin.astype(np.float64)[:, None]), 0, 15))
        step = d.astype(np.float32)[:, None] * ls.astype(np.float32)     # [n, 16]
        offset = dmin.astype(np.float32)[:, None] * lm.astype(np.float32)
        q = np.nan_to_num(np.clip(np.rint((x + offset[..., None]) / step[..., None]), 0, 3))
    codes = (ls.astype(np.uint8) | (lm.astype(np.uint8) << 4))
    return q2k._pack_blocks(codes, q.reshape(n, 256).astype(np.uint8), d, dmin)


def _distribution(name, rng, n):
    if name == "normal":
        return rng.standard_normal((n, 256)) * 0.02
    if name == "student_t3":   # heavy tails: a few large values stretch each sub-block's range
        return rng.standard_t(3, size=(n, 256)) * 0.02
    if name == "laplace":
        return rng.laplace(size=(n, 256)) * 0.02
    if name == "row_scaled":   # magnitudes spread over orders of magnitude from row to row
        return rng.standard_normal((n, 256)) * np.exp(rng.normal(0.0, 2.0, size=(n, 1))) * 0.02
    raise KeyError(name)


def assert_valid_blocks(blocks, n):
    assert blocks.dtype == np.uint8 and blocks.shape == (n, ENGRAM_ROW_BYTES)
    halves = np.ascontiguousarray(blocks[:, 80:84]).view(np.float16)    # [n, 2] d, dmin
    assert np.isfinite(halves).all()
    assert not np.signbit(halves).any(), "super-scales must be non-negative (no -0 either)"
    decoded = dequantize(blocks)
    assert np.isfinite(decoded).all()
    assert_bits_equal(dequantize_cpu(blocks), decoded)
    return decoded


# Measured on 2000 rows with this file's seeds (quantize, naive baseline): normal 0.2606, 0.3281;
# student_t3 0.2864, 0.3789; laplace 0.2887, 0.3630; row_scaled 0.2573, 0.3284 (on 100k rows:
# normal 0.2609, student_t3 0.2855, laplace 0.2885). The limits leave about 0.01 for another seed;
# a regression in the encoder's search moves these by more.
ROUND_TRIP_LIMIT = {"normal": 0.27, "student_t3": 0.30, "laplace": 0.30, "row_scaled": 0.27}


@pytest.mark.parametrize("dist", sorted(ROUND_TRIP_LIMIT))
def test_quantize_round_trip_error(dist, rng):
    rows = _distribution(dist, rng, 2000).astype(np.float32)
    decoded = assert_valid_blocks(quantize(rows), 2000)
    err = rel_rms(decoded, rows)
    naive = rel_rms(dequantize(_naive_q2k(rows)), rows)
    print(f"Q2_K round trip, {dist}: relative RMS error {err:.4f} (naive min/max baseline {naive:.4f})")
    assert err < ROUND_TRIP_LIMIT[dist]
    # The search must clearly beat the plain grid (about 20 % lower error in every case measured).
    assert err < 0.88 * naive
    # And it must not lose to the baseline on many rows either.
    per_row = np.sqrt(((decoded.astype(np.float64) - rows) ** 2).sum(axis=1))
    per_row_naive = np.sqrt(((dequantize(_naive_q2k(rows)).astype(np.float64) - rows) ** 2).sum(axis=1))
    assert np.mean(per_row <= per_row_naive * (1 + 1e-6)) > 0.98


def test_quantize_error_is_scale_free(rng):
    # fp16 super-scales keep the relative error flat from 1e-4 to 1e4 (the subnormal fp16
    # range starts to cost precision only below that).
    base = rng.standard_normal((200, 256)).astype(np.float32)
    errs = {}
    for scale in (1e-4, 1e-2, 1.0, 1e2, 1e4):
        rows = (base * np.float32(scale)).astype(np.float32)
        errs[scale] = rel_rms(assert_valid_blocks(quantize(rows), 200), rows)
    print("relative RMS error by magnitude:", {k: round(v, 4) for k, v in errs.items()})
    assert max(errs.values()) - min(errs.values()) < 0.01
    assert max(errs.values()) < 0.28


@pytest.mark.parametrize("dist", ["normal", "student_t3"])
def test_quantize_is_stable_on_its_own_output(dist, rng):
    rows = _distribution(dist, rng, 2000).astype(np.float32)
    once = dequantize(quantize(rows))
    twice = dequantize(quantize(once))
    drift = rel_rms(twice, once)
    exact_rows = float(np.mean((twice == once).all(axis=1)))
    print(f"re-quantising decoded {dist} rows: relative RMS drift {drift:.4f}, "
          f"rows reproduced exactly {exact_rows:.3f}")
    # Measured: normal 0.020 / 0.79, student_t3 0.045 / 0.77 (against a first-pass error of 0.26-0.29).
    assert drift < {"normal": 0.03, "student_t3": 0.06}[dist]
    assert exact_rows > 0.7


def test_quantize_reproduces_rows_on_a_full_grid_exactly(rng):
    # Rows built from Q2_K codes where every sub-block uses all four levels and the largest scale
    # and min codes are 15: the encoder must find that grid again, value for value.
    n = 300
    codes = rng.integers(1, 16, size=(n, 16), dtype=np.uint8) | (rng.integers(0, 16, size=(n, 16), dtype=np.uint8) << 4)
    codes[np.arange(n), rng.integers(0, 16, n)] |= 0x0F
    codes[np.arange(n), rng.integers(0, 16, n)] |= 0xF0
    q = rng.integers(0, 4, size=(n, 16, 16), dtype=np.uint8)
    q[:, :, :4] = np.arange(4, dtype=np.uint8)                          # every level in every sub-block
    q = rng.permuted(q, axis=2).reshape(n, 256)
    d = (rng.uniform(0.5, 2.0, n) * 1e-3).astype(np.float16)
    dmin = (rng.uniform(0.5, 2.0, n) * 1e-3).astype(np.float16)
    rows = dequantize(q2k._pack_blocks(codes, q, d, dmin))
    again = dequantize(quantize(rows))
    assert_bits_equal(again, rows)


def test_pack_blocks_layout(rng):
    # The packer against the decoding formula of docs/math.md section 4.1, written out directly.
    n = 50
    codes = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    q = rng.integers(0, 4, size=(n, 256), dtype=np.uint8)
    d = rng.uniform(-2, 2, n).astype(np.float16)
    dmin = rng.uniform(-2, 2, n).astype(np.float16)
    blocks = q2k._pack_blocks(codes, q, d, dmin)
    sub = np.arange(256) // 16                                           # value e -> scales byte
    step = d.astype(np.float32)[:, None] * (codes[:, sub] & 15).astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * (codes[:, sub] >> 4).astype(np.float32)
    assert_bits_equal(dequantize(blocks), step * q.astype(np.float32) - offset)


@pytest.mark.parametrize("kind", ["zeros", "positive_constant", "negative_constant", "one_spike", "tiny", "mixed"])
def test_quantize_degenerate_rows(kind, rng):
    rows = np.zeros((4, 256), np.float32)
    if kind == "positive_constant":
        rows[:] = rng.uniform(0.1, 10.0, size=(4, 1))
    elif kind == "negative_constant":
        rows[:] = -rng.uniform(0.1, 10.0, size=(4, 1))
    elif kind == "one_spike":
        rows[np.arange(4), rng.integers(0, 256, 4)] = rng.standard_normal(4) * 5
    elif kind == "tiny":   # below what fp16 super-scales can resolve: decodes to (near) zero
        rows[:] = rng.standard_normal((4, 256)) * 1e-12
    elif kind == "mixed":  # constant, zero and normal sub-blocks in one row
        rows[:, 16:32] = 0.5
        rows[:, 64:128] = rng.standard_normal((4, 64))
    decoded = assert_valid_blocks(quantize(rows), 4)
    if kind == "tiny":
        assert np.abs(decoded).max() <= 1e-6
    else:
        # Constants and spikes sit on the grid up to fp16 rounding of d and dmin.
        tol = 0.3 if kind == "mixed" else 2e-3
        assert rel_rms(decoded, rows) < tol if rows.any() else not decoded.any()


def test_quantize_empty_and_other_float_dtypes(rng):
    assert quantize(np.zeros((0, 256), np.float32)).shape == (0, ENGRAM_ROW_BYTES)
    rows = (rng.standard_normal((8, 256)) * 0.02).astype(np.float32)
    want = quantize(rows)
    np.testing.assert_array_equal(quantize(rows.astype(np.float64)), want)
    halves = rows.astype(np.float16)
    np.testing.assert_array_equal(quantize(halves), quantize(halves.astype(np.float32)))
    bf = rows.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(quantize(bf), quantize(bf.astype(np.float32)))
    np.testing.assert_array_equal(quantize(rows[::-1][::-1]), want)   # any layout


@pytest.mark.parametrize("bad, match", [
    (np.zeros((2, 256), np.int32), "dtype int32"),
    (np.zeros((2, 256), np.uint16), "bf16 words"),
    (np.zeros((2, 256), np.complex64), "dtype complex64"),
    (np.zeros(256, np.float32), r"shape \(256,\)"),
    (np.zeros((2, 255), np.float32), r"\[n, 256\].*\(2, 255\)"),
    (np.zeros((2, 2, 256), np.float32), r"shape \(2, 2, 256\)"),
])
def test_quantize_rejects_bad_dtype_and_shape(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize(bad)


def test_quantize_rejects_non_finite_and_out_of_range_values(rng):
    rows = (rng.standard_normal((3, 256)) * 0.02).astype(np.float32)
    for value, match in ((np.nan, "nan at row 1, value 7"), (np.inf, "inf at row 1, value 7"),
                         (-np.inf, "-inf at row 1, value 7")):
        bad = rows.copy()
        bad[1, 7] = value
        with pytest.raises(ValueError, match=f"finite.*{match}"):
            quantize(bad)
    big = rows.astype(np.float64)
    big[2, 3] = 1e300  # finite in float64, not in float32
    with pytest.raises(ValueError, match="finite in float32.*row 2, value 3"):
        quantize(big)
    wide = rows.copy()
    wide[2] *= 1e9   # a range no fp16 d can hold
    with pytest.raises(ValueError, match="row 2.*super-scale d"):
        quantize(wide)
    low = rows.copy()
    low[1, :16] = -1e6  # a constant sub-block whose min no fp16 dmin can hold
    with pytest.raises(ValueError, match="row 1.*super-scale dmin"):
        quantize(low)
