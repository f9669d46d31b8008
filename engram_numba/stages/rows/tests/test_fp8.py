"""FP8 rows (engram_numba/stages/rows/fp8.py): the value tables and the decoders against
ml_dtypes' float8_e4m3fn / float8_e8m0fnu (an independent implementation of the same formats),
the @njit decoder against the reference (bit-exact, NaN words included), the range of scale
bytes in which every value is exact in bf16 and what happens outside it, and the encoder
(e4m3 round-to-nearest-even against ml_dtypes, power-of-two scales, round trips).

Tolerance: exact everywhere, except the encoder's round trip (half an e4m3 step)."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
from engram_numba.stages.rows import fp8
from engram_numba.stages.rows.cpu import rows_cpu
from engram_numba.stages.rows.encodings import random_raw_rows
from engram_numba.stages.rows.reference import rows_reference

ALL = np.arange(256, dtype=np.uint8)


def ml_e4m3(codes):
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def ml_e8m0(scales):
    return np.asarray(scales, np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def every_code_and_scale() -> np.ndarray:
    """Rows [256*256/32, 264] holding every (code, scale byte) pair once."""
    codes = np.tile(ALL, 256).reshape(-1, 256)                    # [256, 256]: row s, value c
    rows = np.empty((256 * 8, 264), np.uint8)
    rows[:, :256] = np.repeat(codes, 8, axis=0)                   # 8 rows per scale byte
    sb = np.repeat(ALL, 8)                                        # row r has scale byte r // 8 ...
    rows[:, 256:] = sb[:, None]                                   # ... in all its 8 groups
    return rows


def test_value_tables_match_ml_dtypes():
    want = ml_e4m3(ALL)
    assert np.isnan(fp8.E4M3_VALUES).tolist() == np.isnan(want).tolist()
    assert [i for i in range(256) if np.isnan(want[i])] == [0x7F, 0xFF]
    fin = ~np.isnan(want)
    np.testing.assert_array_equal(fp8.E4M3_VALUES[fin].view(np.uint32), want[fin].view(np.uint32))  # -0 too
    assert fp8.E4M3_VALUES[0x7E] == 448 and fp8.E4M3_VALUES[0x01] == 2.0 ** -9 and fp8.E4M3_VALUES[0x08] == 2.0 ** -6
    s = ml_e8m0(ALL)
    np.testing.assert_array_equal(fp8.E8M0_VALUES[:255], s[:255])
    assert np.isnan(fp8.E8M0_VALUES[255]) and fp8.E8M0_VALUES[0] == 2.0 ** -127
    # the decoders' NaN: one fp32 NaN everywhere, 0x7FFFFFFF
    assert fp8.E4M3_VALUES[[0x7F, 0xFF]].view(np.uint32).tolist() == [0x7FFFFFFF] * 2
    assert fp8.E8M0_VALUES[255:].view(np.uint32).tolist() == [0x7FFFFFFF]


def test_every_code_times_every_scale():
    """The reference and the @njit decoder on all 65,536 (code, scale) pairs: against
    ml_dtypes' values multiplied in fp32, and bit-identical to each other (NaN words included)."""
    rows = every_code_and_scale()
    with np.errstate(over="ignore"):
        want = ml_e4m3(rows[:, :256]) * ml_e8m0(rows[:, 256:])[:, np.arange(256) // 32]
    got = fp8.decode_fp8_reference(rows)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    np.testing.assert_array_equal(fp8.decode_fp8_cpu(rows).view(np.uint32), got.view(np.uint32))
    assert set(got[nan].view(np.uint32).tolist()) == {0x7FFFFFFF}
    bf = rows_reference(rows, "fp8")
    np.testing.assert_array_equal(rows_cpu(rows, "fp8"), bf)
    assert set(bf[nan].tolist()) == {0x7FFF}


def test_exact_in_bf16_for_scale_bytes_3_to_246():
    """Inside 3..246 every value survives the bf16 rounding unchanged; bytes 0..2 round the
    smallest codes (below bf16's subnormal step 2^-133), bytes 247..254 overflow the largest codes
    to +-inf, as docs/math.md section 4.5 says."""
    rows = every_code_and_scale()
    vals = fp8.decode_fp8_reference(rows)                          # [2048, 256]
    scale_byte = rows[:, 256]
    with np.errstate(over="ignore"):
        back = bf16_to_f32(f32_to_bf16(vals))
    same = (back.view(np.uint32) == vals.view(np.uint32)) | np.isnan(vals)
    inside = (scale_byte >= 3) & (scale_byte <= 246)
    assert same[inside].all()
    for e in (0, 1, 2):
        assert not same[scale_byte == e].all(), e                  # some tiny codes round
    for e in range(247, 255):
        row = vals[scale_byte == e]                                # codes 0..255, 8 identical rows
        big = np.abs(ml_e4m3(ALL).astype(np.float64)) * 2.0 ** (e - 127) >= 2.0 ** 128
        np.testing.assert_array_equal(np.isinf(row), np.broadcast_to(big, row.shape))   # exactly those overflow
        assert big.any()
    # fp32 holds every product exactly below 247 (the decode itself rounds nothing there)
    lo = (scale_byte < 247) & (scale_byte != 255)
    exact = np.array([math.ldexp(float(c), 0) for c in ml_e4m3(ALL)], np.float64)
    prod = exact[rows[lo, :256]] * np.ldexp(1.0, scale_byte[lo].astype(np.int64) - 127)[:, None]
    fin = ~np.isnan(prod)
    assert (prod[fin] == vals[lo][fin].astype(np.float64)).all()


def test_nan_codes_and_nan_scales_give_nan_exactly_there(rng):
    raw = random_raw_rows("fp8", 6, rng)
    raw[0, 5] = 0x7F
    raw[1, 200] = 0xFF
    raw[2, 256 + 3] = 255                                          # a NaN scale: values 96..127
    want_nan = np.zeros((6, 256), bool)
    want_nan[0, 5] = want_nan[1, 200] = True
    want_nan[2, 96:128] = True
    for got in (fp8.decode_fp8_reference(raw), fp8.decode_fp8_cpu(raw)):
        np.testing.assert_array_equal(np.isnan(got), want_nan)
    np.testing.assert_array_equal(rows_reference(raw, "fp8")[want_nan], 0x7FFF)


def test_random_raw_rows_fp8_are_finite_and_exact(rng):
    raw = random_raw_rows("fp8", 300, rng)
    assert raw.shape == (300, 264)
    assert not np.isin(raw[:, :256], [0x7F, 0xFF]).any() and (raw[:, 256:] <= 246).all()
    vals = fp8.decode_fp8_reference(raw)
    assert np.isfinite(vals).all()
    np.testing.assert_array_equal(bf16_to_f32(rows_reference(raw, "fp8")), vals)


def test_split_assemble_round_trip_and_fp8_views(rng):
    raw = random_raw_rows("fp8", 10, rng)
    codes, scales = fp8.split_rows_fp8(raw)
    assert codes.shape == (10, 256) and scales.shape == (10, 8)
    np.testing.assert_array_equal(fp8.assemble_rows_fp8(codes, scales), raw)
    # the HF checkpoint's dtypes, as ml_dtypes views of the same bytes
    np.testing.assert_array_equal(
        fp8.assemble_rows_fp8(codes.view(ml_dtypes.float8_e4m3fn), scales.view(ml_dtypes.float8_e8m0fnu)), raw)
    with pytest.raises(ValueError, match=r"scales must be \[n=10, 8\]"):
        fp8.assemble_rows_fp8(codes, scales[:, :7])
    with pytest.raises(ValueError, match=r"codes must be \[n, 256\]"):
        fp8.assemble_rows_fp8(raw, scales)
    with pytest.raises(ValueError, match=r"uint8 \[n, 264\] fp8 rows"):
        fp8.decode_fp8_reference(raw[:, :263])
    with pytest.raises(ValueError, match="uint8 bytes"):
        fp8.decode_fp8_reference(raw.astype(np.float32))


# Encoding ------------------------------------------------------------------------------------------

def test_e4m3_encode_is_round_to_nearest_even(rng):
    finite = fp8.E4M3_VALUES[np.isfinite(fp8.E4M3_VALUES)]
    pos = np.unique(finite[finite >= 0])
    ties = (pos[:-1] + pos[1:]) / 2                                 # exactly half-way: ties to even
    v = np.concatenate([rng.uniform(-448, 448, 100_000), rng.uniform(-0.05, 0.05, 100_000),
                        rng.uniform(-2.0 ** -6, 2.0 ** -6, 50_000), finite, ties, -ties,
                        np.nextafter(ties, 0), np.nextafter(ties, 1000)]).astype(np.float32)
    got = fp8.e4m3_encode(v)
    np.testing.assert_array_equal(got, v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    np.testing.assert_array_equal(fp8.e4m3_round(v), ml_e4m3(got))
    with pytest.raises(ValueError, match=r"\|v\| <= 448"):
        fp8.e4m3_encode(np.array([449.0], np.float32))


def test_ceil_log2_from_the_bits(rng):
    r = np.concatenate([rng.lognormal(0, 20, 10_000), [1.0, 2.0, 0.75, 2.0 ** -126, 2.0 ** -130, 3e-45,
                                                       2.0 ** 127]]).astype(np.float32)
    r = r[r > 0]
    # math.log2 is exact at powers of two, and an fp32 value that is not one is far enough from
    # them for the float64 log2 to land on the right side
    want = [math.ceil(math.log2(float(x))) for x in r]
    np.testing.assert_array_equal(fp8.ceil_log2_f32(r), want)


def test_encode_rows_fp8_scales_fit_and_round_trip(rng):
    x = (rng.standard_t(4, (300, 256)) * rng.lognormal(-4, 2, (300, 1))).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = 448.0
    x[1, 32:64] = -449.0
    codes, scales = fp8.encode_rows_fp8(x)
    assert codes.dtype == np.uint8 and scales.dtype == np.uint8 and scales.shape == (300, 8)
    assert not np.isin(codes, [0x7F, 0xFF]).any() and (scales < 255).all()
    assert (scales[0] == 127).all() and (codes[0] == 0).all()
    assert scales[1, 0] == 127 and scales[1, 1] == 128            # 448 fits 2^0; 449 needs 2^1
    vals = fp8.decode_fp8_reference(fp8.assemble_rows_fp8(codes, scales))
    groups = np.abs(x).reshape(300, 8, 32).max(axis=2)             # amax per group
    s = np.ldexp(1.0, scales.astype(np.int64) - 127)
    assert (groups / s <= 448).all() and ((groups == 0) | (groups / s > 224)).all()   # the smallest scale
    # error: at most half an e4m3 step of each value (relative 2^-4), or 2^-10 of the scale below 2^-6
    err = np.abs(vals - x).reshape(300, 8, 32)
    step = np.maximum(np.abs(x).reshape(300, 8, 32) * 2.0 ** -4, s[:, :, None] * 2.0 ** -10)
    assert (err <= step).all()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lo=st.integers(3, 120), n=st.integers(1, 5))
def test_property_encode_decode_is_idempotent_on_fp8_values(seed, lo, n):
    """Values that are already fp8 rows re-encode to rows with the same values (the encoder picks
    the smallest scale that fits, which may differ from the stored one; the values cannot)."""
    r = np.random.default_rng(seed)
    raw = random_raw_rows("fp8", n, r)
    raw[:, 256:] = r.integers(lo, lo + 127, (n, 8), dtype=np.uint8)
    vals = fp8.decode_fp8_reference(raw)
    codes, scales = fp8.encode_rows_fp8(vals)
    again = fp8.decode_fp8_reference(fp8.assemble_rows_fp8(codes, scales))
    np.testing.assert_array_equal(again.view(np.uint32), vals.view(np.uint32))


def test_encode_rows_fp8_refuses_bad_input():
    with pytest.raises(ValueError, match="finite"):
        fp8.encode_rows_fp8(np.full((1, 256), np.inf, np.float32))
    with pytest.raises(ValueError, match=r"\[n, 256\]"):
        fp8.encode_rows_fp8(np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match="floating-point"):
        fp8.encode_rows_fp8(np.zeros((1, 256), np.int64))
