"""Q3_K, Q4_K and Q8_0 rows (engram_numba/stages/rows/kquants.py): the numpy references and the
@njit decoders against gguf-py's `gguf.quants` (bit-exact, fp32 bits compared), random blocks with
every finite fp16 scale (zeros, subnormals, negatives, the largest), hypothesis property tests,
non-finite scales (NaN in the same places), and the Q8_0 encoder against `gguf.quants.quantize`.

Tolerance: exact. gguf-py is a test dependency only (the package never imports it)."""
import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_numba.bf16 import f32_to_bf16
from engram_numba.stages.rows import kquants as K
from engram_numba.stages.rows.cpu import rows_cpu
from engram_numba.stages.rows.encodings import ENCODINGS, random_raw_rows
from engram_numba.stages.rows.reference import decode_reference, rows_reference

from .conftest import assert_bits_equal

QT = gguf.GGMLQuantizationType
TYPES = {"q3_k": QT.Q3_K, "q4_k": QT.Q4_K, "q8_0": QT.Q8_0}
REF = {"q3_k": K.dequantize_q3_k, "q4_k": K.dequantize_q4_k, "q8_0": K.dequantize_q8_0}
CPU = {"q3_k": K.dequantize_q3_k_cpu, "q4_k": K.dequantize_q4_k_cpu, "q8_0": K.dequantize_q8_0_cpu}
# byte offsets of the fp16 scale fields in one 256-value row
F16_FIELDS = {"q3_k": (108,), "q4_k": (0, 2), "q8_0": tuple(34 * b for b in range(8))}


def gguf_rows(raw, encoding):
    return gguf.quants.dequantize(raw, TYPES[encoding]).reshape(raw.shape[0], 256)


def finite_f16_bits(rng, n):
    """Random fp16 bit patterns over every finite value: both signs, zeros, subnormals."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xFBFF)
    return bits


def random_rows(rng, encoding, n):
    """Random rows: random bytes, every fp16 field a random finite fp16 bit pattern."""
    raw = rng.integers(0, 256, (n, ENCODINGS[encoding].row_bytes), dtype=np.uint8)
    for off in F16_FIELDS[encoding]:
        raw[:, off:off + 2] = finite_f16_bits(rng, n).reshape(n, 1).view(np.uint8)
    return raw


@pytest.mark.parametrize("encoding", list(TYPES))
def test_decoders_bit_exact_with_gguf_on_random_rows(rng, encoding):
    raw = random_rows(rng, encoding, 4000)
    want = gguf_rows(raw, encoding)
    assert np.isfinite(want).all()
    assert_bits_equal(REF[encoding](raw), want)
    assert_bits_equal(CPU[encoding](raw), want)
    assert_bits_equal(decode_reference(raw, encoding), want)
    np.testing.assert_array_equal(rows_reference(raw, encoding), f32_to_bf16(want))
    np.testing.assert_array_equal(rows_cpu(raw, encoding), f32_to_bf16(want))


@pytest.mark.parametrize("encoding", list(TYPES))
def test_decoders_bit_exact_on_edge_scales(rng, encoding):
    """Signed zeros, the smallest and largest subnormals, the smallest normal, 1, the largest finite
    value and its negative, against every sub-block scale byte at its extremes (0x00, 0xFF)."""
    specials = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF], np.uint16)
    fields = F16_FIELDS[encoding]
    combos = np.array(np.meshgrid(*[specials] * min(2, len(fields)))).reshape(min(2, len(fields)), -1).T
    n = combos.shape[0] * 3
    raw = random_rows(rng, encoding, n)
    for i, off in enumerate(fields):
        raw[:, off:off + 2] = np.tile(combos[:, i % combos.shape[1]], 3).reshape(n, 1).view(np.uint8)
    if encoding == "q3_k":
        raw[: n // 3, 96:108] = 0x00
        raw[n // 3: 2 * n // 3, 96:108] = 0xFF
    elif encoding == "q4_k":
        raw[: n // 3, 4:16] = 0x00
        raw[n // 3: 2 * n // 3, 4:16] = 0xFF
    else:                                    # Q8_0: the int8 extremes -128 and 127
        codes = raw.reshape(n, 8, 34)[:, :, 2:]
        codes[: n // 3] = 0x80
        codes[n // 3: 2 * n // 3] = 0x7F
    want = gguf_rows(raw, encoding)
    assert_bits_equal(REF[encoding](raw), want)
    assert_bits_equal(CPU[encoding](raw), want)


@pytest.mark.parametrize("encoding", list(TYPES))
def test_non_finite_scales_give_nan_where_gguf_does(rng, encoding):
    raw = random_rows(rng, encoding, 60)
    for i, off in enumerate(F16_FIELDS[encoding]):
        raw[i::7, off:off + 2] = np.array([[0x7C00, 0xFC00, 0x7E00, 0x7C01][i % 4]], np.uint16).view(np.uint8)
    want = gguf_rows(raw, encoding)
    assert not np.isfinite(want).all()
    for got in (REF[encoding](raw), CPU[encoding](raw)):
        # same platform, same numpy operations: even the NaN payloads match the reference
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert_bits_equal(np.where(np.isnan(want), 0, got).astype(np.float32),
                          np.where(np.isnan(want), 0, want).astype(np.float32))


@settings(max_examples=150, deadline=None)
@given(encoding=st.sampled_from(list(TYPES)), seed=st.integers(0, 2**32 - 1), n=st.integers(1, 9),
       f16=st.lists(st.integers(0, 0xFFFF).filter(lambda b: (b & 0x7C00) != 0x7C00), min_size=8, max_size=8))
def test_property_decoders_match_gguf(encoding, seed, n, f16):
    """Any bytes with finite fp16 scales: the reference and the @njit decoder give gguf's bits."""
    raw = np.random.default_rng(seed).integers(0, 256, (n, ENCODINGS[encoding].row_bytes), dtype=np.uint8)
    for i, off in enumerate(F16_FIELDS[encoding]):
        raw[:, off:off + 2] = np.array([f16[i]], np.uint16).view(np.uint8)
    want = gguf_rows(raw, encoding)
    assert_bits_equal(REF[encoding](raw), want)
    assert_bits_equal(CPU[encoding](raw), want)


def test_q8_0_decoder_takes_any_number_of_blocks(rng):
    raw = random_rows(rng, "q8_0", 6).reshape(12, 136)       # [12, 4 blocks]
    want = gguf.quants.dequantize(raw, QT.Q8_0)
    assert want.shape == (12, 128)
    assert_bits_equal(K.dequantize_q8_0(raw), want)
    assert_bits_equal(K.dequantize_q8_0_cpu(raw), want)


@pytest.mark.parametrize("encoding", list(TYPES))
def test_random_raw_rows_are_finite_and_realistic(rng, encoding):
    raw = random_raw_rows(encoding, 500, rng)
    assert raw.shape == (500, ENCODINGS[encoding].row_bytes)
    vals = gguf_rows(raw, encoding)
    assert np.isfinite(vals).all() and 0 < np.abs(vals).max() < 1e3


@pytest.mark.parametrize("encoding", list(TYPES))
def test_decoders_refuse_wrong_shapes_and_dtypes(encoding):
    width = ENCODINGS[encoding].row_bytes
    with pytest.raises(ValueError, match="uint8"):
        REF[encoding](np.zeros((2, width), np.int16))
    for fn in (REF[encoding], CPU[encoding]):
        with pytest.raises(ValueError, match=r"\[n, "):
            fn(np.zeros((2, width + 1 if encoding != "q8_0" else width + 3), np.uint8))
    with pytest.raises(ValueError, match=rf"raw {encoding} rows must be uint8 \[n, {width}\]"):
        rows_reference(np.zeros((2, width - 2), np.uint8), encoding)
    with pytest.raises(ValueError, match=rf"raw {encoding} rows must be uint8 \[n, {width}\]"):
        rows_cpu(np.zeros((2, width - 2), np.uint8), encoding)
    with pytest.raises(ValueError, match="out must be float32"):
        CPU[encoding](np.zeros((2, width), np.uint8), out=np.zeros((1, 256), np.float32))


# Q8_0 encoder against gguf-py's (ggml's) -----------------------------------------------------------

def test_quantize_q8_0_bit_exact_with_gguf(rng):
    x = (rng.standard_t(3, (200, 512)) * rng.lognormal(0, 1, (200, 1))).astype(np.float32)
    x[0, :32] = 0.0                                          # an all-zero block: d = 0, codes 0
    x[1, :32] = 0.0
    x[1, :6] = [127.0, 63.5, -63.5, 0.5, -0.5, 1.5]          # exact halves: ggml rounds away from zero
    x[2, :32] = np.float32(1e-30)                            # d underflows fp16 to 0
    got = K.quantize_q8_0(x)
    np.testing.assert_array_equal(got, gguf.quants.quantize(x, QT.Q8_0))
    codes = got[1, 2:8].view(np.int8)
    assert list(codes) == [127, 64, -64, 1, -1, 2]
    back = K.dequantize_q8_0(got)
    rel = np.abs(back[3:] - x[3:]).max(axis=1) / np.abs(x[3:]).max(axis=1)
    # half a code step, plus the fp16 rounding of d (at most 2^-11 d, times |q| <= 127)
    assert rel.max() <= (0.5 + 127 * 2.0 ** -11) / 127


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(1e-6, 1e3), n=st.integers(1, 4))
def test_property_quantize_q8_0_matches_gguf(seed, scale, n):
    x = (np.random.default_rng(seed).standard_normal((n, 64)) * scale).astype(np.float32)
    np.testing.assert_array_equal(K.quantize_q8_0(x), gguf.quants.quantize(x, QT.Q8_0))


def test_quantize_q8_0_refuses_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        K.quantize_q8_0(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="finite"):
        K.quantize_q8_0(np.full((1, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="row 1, block 1: .* above the fp16 maximum"):
        x = np.zeros((2, 64), np.float32)
        x[1, 40] = 1e7
        K.quantize_q8_0(x)
    with pytest.raises(ValueError, match="floating-point"):
        K.quantize_q8_0(np.zeros((1, 32), np.int32))
