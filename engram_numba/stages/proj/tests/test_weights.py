"""wkv in every stored encoding -> bf16 words (engram_numba/stages/proj/weights.py): against
gguf-py (Q2_K, Q8_0) and ml_dtypes (F16, F32 and FP8 rounding/values), the exactness of FP8 tiles,
the chunking (same bits for every chunk size; peak host memory near the result), and the errors.

Tolerance: exact (bit-identical bf16 words)."""
import tracemalloc

import gguf
import ml_dtypes
import numpy as np
import pytest

from engram_numba.bf16 import BF16, bf16_to_f32, f32_to_bf16
from engram_numba.fixtures import quantize_matrix, realistic_rows
from engram_numba.stages.proj.weights import WKV_ENCODINGS, encode_wkv_fp8, wkv_to_bf16
from engram_numba.stages.rows.kquants import quantize_q8_0

QT = gguf.GGMLQuantizationType


def weights(rng, N=96, K=512):
    w = rng.standard_normal((N, K)) / np.sqrt(K) * rng.lognormal(0, 0.5, (N, 1))
    return w.astype(np.float32)


def test_bf16_is_zero_copy(rng):
    w = f32_to_bf16(weights(rng))
    assert wkv_to_bf16(w, "bf16") is w
    got = wkv_to_bf16(w.view(BF16), "bf16")
    assert got.dtype == np.uint16 and np.shares_memory(got, w)


@pytest.mark.parametrize("encoding,dtype", [("f16", np.float16), ("f32", np.float32)])
def test_f16_and_f32_round_to_nearest_even(rng, encoding, dtype):
    w = weights(rng).astype(dtype)
    want = w.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    got = wkv_to_bf16(w, encoding, chunk_rows=7)
    np.testing.assert_array_equal(got, want)
    moved = bf16_to_f32(got) != w.astype(np.float32)
    assert moved.mean() > 0.8                                   # a real rounding for random values (7/8 for F16)
    assert np.abs(bf16_to_f32(got) / w.astype(np.float32) - 1).max() <= 2.0 ** -8   # half an ulp


def test_q2k_matches_gguf(rng):
    w = realistic_rows(rng, 64, width=512)
    raw = quantize_matrix(w)                                     # [64, 2*84]
    want = f32_to_bf16(gguf.quants.dequantize(raw, QT.Q2_K))
    np.testing.assert_array_equal(wkv_to_bf16(raw, "q2k", chunk_rows=5), want)


def test_q8_0_matches_gguf(rng):
    w = weights(rng, K=320)                                      # K a multiple of 32, not of 256
    raw = quantize_q8_0(w)
    np.testing.assert_array_equal(raw, gguf.quants.quantize(w, QT.Q8_0))
    want = f32_to_bf16(gguf.quants.dequantize(raw, QT.Q8_0))
    np.testing.assert_array_equal(wkv_to_bf16(raw, "q8_0", chunk_rows=9), want)


@pytest.mark.parametrize("shape", [(96, 512), (40, 70)])
def test_fp8_tiles_are_exact_in_bf16(rng, shape):
    w = weights(rng, *shape)
    w[:32, :32] *= 1e4                                           # tiles of very different scales
    w[32:, 32:64] *= 1e-5
    codes, scales = encode_wkv_fp8(w)
    tn, tk = -(-shape[0] // 32), -(-shape[1] // 32)
    assert codes.shape == shape and scales.shape == (tn, tk)
    assert len(np.unique(scales)) > 3
    # the values, by ml_dtypes: e4m3 code times its tile's e8m0 scale, in float64 (exact)
    tile_scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    exact = (codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
             * tile_scale[np.arange(shape[0]) // 32][:, np.arange(shape[1]) // 32])
    got = wkv_to_bf16(codes, "fp8", scales, chunk_rows=13)
    np.testing.assert_array_equal(bf16_to_f32(got).astype(np.float64), exact)   # no rounding at all
    # ml_dtypes views of the same bytes (how a safetensors map is seen) give the same words
    np.testing.assert_array_equal(
        wkv_to_bf16(codes.view(ml_dtypes.float8_e4m3fn), "fp8", scales.view(ml_dtypes.float8_e8m0fnu)), got)
    # the encoder: each tile's largest value fits 448 with the smallest power of two
    amax = np.zeros((tn * 32, tk * 32))
    amax[: shape[0], : shape[1]] = np.abs(w)
    amax = amax.reshape(tn, 32, tk, 32).max(axis=(1, 3))
    s = np.ldexp(1.0, scales.astype(np.int64) - 127)
    assert (amax / s <= 448).all() and (amax / s > 224).all()
    assert np.abs(exact - w).max() <= (np.maximum(np.abs(w) * 2.0 ** -4, 0)).max()


def test_fp8_nan_codes_and_scales_are_nan(rng):
    codes, scales = encode_wkv_fp8(weights(rng, 64, 64))
    codes[3, 5] = 0x7F
    scales[1, 1] = 255
    got = bf16_to_f32(wkv_to_bf16(codes, "fp8", scales))
    want = np.zeros((64, 64), bool)
    want[3, 5] = True
    want[32:, 32:] = True
    np.testing.assert_array_equal(np.isnan(got), want)


@pytest.mark.parametrize("encoding", [e for e in WKV_ENCODINGS if e != "bf16"])
def test_chunk_size_does_not_change_the_bits(rng, encoding):
    w = weights(rng, 70, 512)
    raw, scales = {"f16": (w.astype(np.float16), None), "f32": (w, None), "q2k": (quantize_matrix(w), None),
                   "q8_0": (quantize_q8_0(w), None), "fp8": encode_wkv_fp8(w)}[encoding]
    want = wkv_to_bf16(raw, encoding, scales, chunk_rows=10**6)
    for chunk in (1, 3, 32, 69):
        np.testing.assert_array_equal(wkv_to_bf16(raw, encoding, scales, chunk_rows=chunk), want)


@pytest.mark.parametrize("encoding", ["f32", "q8_0", "fp8"])
def test_peak_host_memory_stays_near_the_result(rng, encoding):
    N, K = 2048, 1024
    w = weights(rng, N, K)
    raw, scales = {"f32": (w, None), "q8_0": (quantize_q8_0(w), None), "fp8": encode_wkv_fp8(w)}[encoding]
    result_bytes = N * K * 2
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = wkv_to_bf16(raw, encoding, scales, chunk_rows=64)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert out.shape == (N, K)
    chunk_temps = 64 * K * 4 * 6                                 # a few fp32 chunk temporaries
    assert result_bytes <= peak <= result_bytes + chunk_temps, (peak, result_bytes)


def test_argument_errors(rng):
    w = weights(rng, 64, 64)
    codes, scales = encode_wkv_fp8(w)
    with pytest.raises(ValueError, match=r"unknown wkv encoding 'q5_k'; encodings are \["):
        wkv_to_bf16(w, "q5_k")
    with pytest.raises(ValueError, match=r"wkv of encoding 'f16' must be float16 \[N, K\], got float32"):
        wkv_to_bf16(w, "f16")
    with pytest.raises(ValueError, match=r"wkv of encoding 'bf16' must be uint16 bf16 words"):
        wkv_to_bf16(w, "bf16")
    with pytest.raises(ValueError, match=r"'q2k' must be uint8 \[N, K/256\*84\] Q2_K blocks"):
        wkv_to_bf16(np.zeros((4, 85), np.uint8), "q2k")
    with pytest.raises(ValueError, match=r"'q8_0' must be uint8 \[N, K/32\*34\] Q8_0 blocks"):
        wkv_to_bf16(np.zeros((4, 35), np.uint8), "q8_0")
    with pytest.raises(ValueError, match=r"an fp8 wkv needs its tile scales: uint8 e8m0 \[2, 2\]"):
        wkv_to_bf16(codes, "fp8")
    with pytest.raises(ValueError, match=r"tile scales must be .* \[2, 2\] for a \[64, 64\] wkv, got uint8 \[2, 3\]"):
        wkv_to_bf16(codes, "fp8", np.zeros((2, 3), np.uint8))
    with pytest.raises(ValueError, match="a f32 wkv has none"):
        wkv_to_bf16(w, "f32", scales)
    with pytest.raises(ValueError, match="2-D"):
        wkv_to_bf16(w.ravel(), "f32")
    with pytest.raises(ValueError, match="chunk_rows must be a positive integer"):
        wkv_to_bf16(w, "f32", chunk_rows=0)
    with pytest.raises(ValueError, match="finite"):
        encode_wkv_fp8(np.full((2, 2), np.nan, np.float32))


def test_schema_a_layers_decode_through_this_module():
    import engram_numba as en
    with en.load_gguf(en.tiny_model_path()) as model:
        lf = model.layers[1]
        assert lf.wkv_type == "Q2_K"
        want = f32_to_bf16(gguf.quants.dequantize(np.asarray(lf.wkv_raw), QT.Q2_K))
        np.testing.assert_array_equal(lf.wkv_bf16(), want)
        np.testing.assert_array_equal(lf.wkv_bf16(chunk_rows=7), want)
