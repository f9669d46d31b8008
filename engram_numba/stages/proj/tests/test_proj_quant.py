"""The projection with the weight read in its file encoding (Q2_K blocks, FP8 codes + 32x32 tile
scales): every gemv_q2k_* / gemv_fp8_* record against its numpy yardstick.

Yardsticks and tolerances (docs/numerics.md, "Weights read in their file encoding"):
- bf16-rounded weights (gemv_q2k_v1, gemv_q2k_v2) and FP8 (exact in bf16: gemv_fp8_v1, _v2) are
  the same math as today's projection of `wkv_bf16()`: the in-order versions (records marked
  bit_exact) are bit-identical to `projection_reference(x, wkv_*_bf16)`, the others within 1 bf16
  ulp of `projection_exact(x, wkv_*_bf16)` wherever fp32 summation noise is under half an ulp (and
  within the noise + 1 ulp elsewhere), exactly as test_proj_cuda.py holds the bf16 kernels.
- exact weights, factored (gemv_q2k_v3): within 1 bf16 ulp of its own float64 yardstick
  bf16(x . w_exact) under the same condition, where the noise is measured on the terms the
  factored form adds (|d*sc*q| + |dmin*m|, not |w|). Its distance from the bf16-weight projection
  is measured and printed (a property of the data: how far rounding the weights to bf16 moves kv).

Inputs are fresh random draws: Q2_K blocks of random bytes with finite random fp16 d and dmin (every
scale code, both signs of d), FP8 random finite codes with random scale bytes; outputs are poisoned
with NaN first. Simulator tier at tiny shapes (K a multiple of 256 / 32, T in 1..9, N not a multiple
of the 16-row tile, a multi-trip K); GPU tier (`gpu`) at the released shape K = 6144, N = 25600 and
T in 1, 4, 8 against the float64 references, every element, recorded in RESULTS.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_to_f32, bf16_ulp_distance, f32_to_bf16
from engram_numba.device.devarray import data_address
from engram_numba.device.intrinsics import SIMULATOR
from engram_numba.stages import registry
from engram_numba.stages.proj import cuda_gemv_fp8, cuda_gemv_q2k
from engram_numba.stages.proj import launch as P
from engram_numba.stages.proj import reference as R
from engram_numba.stages.proj.q2k_r import repack_q2k_r
from engram_numba.stages.proj.records import DEEPSEEK_FP8_VERSIONS

from .conftest import (NOISE_SIGMAS, POISON, U, Yardstick, assert_within_tolerance, bf16_ulp_size, dev, error_stats,
                       poisoned)

Q2K_VERSIONS = tuple(registry.names("proj", "q2k"))
Q2KR_VERSIONS = tuple(registry.names("proj", "q2k_r"))    # the same Q2_K weight, re-laid out (q2k_r.py)
# gemm_fp8_*: DeepSeek's FP8 arithmetic, not the bf16 projection of the exact weights (test_proj_fp8_wgmma.py)
FP8_VERSIONS = tuple(n for n in registry.names("proj", "fp8") if n not in DEEPSEEK_FP8_VERSIONS)
EXACT_WEIGHT = ("gemv_q2k_v3",)          # the factored, exact-weight path: its own yardstick
RESULTS: list[dict] = []


# ---- inputs -------------------------------------------------------------------------------------

def random_q2k(rng, N, K):
    """Q2_K weight [N, K/256*84]: random bytes, fp16 d and dmin drawn finite (both signs)."""
    raw = rng.integers(0, 256, (N, K // 256, 84), dtype=np.uint8)
    raw[:, :, 80:84] = (rng.standard_normal((N, K // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(N, K // 256 * 84))


def random_fp8(rng, N, K, lo=112, hi=136):
    """FP8 weight: e4m3 codes [N, K] (no NaN code) and e8m0 scales [ceil(N/32), K/32] in [lo, hi)."""
    codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 0x01                   # 0x7F / 0xFF are NaN: use 0x7E / 0xFE
    scales = rng.integers(lo, hi, (-(-N // 32), K // 32), dtype=np.uint8)
    return codes, scales


def random_x(rng, T, K):
    return f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32))


class ExactWeightYard:
    """Yardstick for the exact-weight path: exact64 = x . w_exact (float64) and the allowances of
    test_proj_cuda's Yardstick, with the noise measured on |terms| (w_abs), not on |w|."""

    def __init__(self, x, w_exact, w_abs):
        xf = bf16_to_f32(x).astype(np.float64)
        K = x.shape[1]
        self.exact64 = xf @ w_exact.T
        noise = NOISE_SIGMAS * U * np.sqrt(K / 2) * np.sqrt((xf * xf) @ (w_abs * w_abs).T)
        self.exact_bf16 = f32_to_bf16(self.exact64)
        self.well = noise < 0.5 * bf16_ulp_size(self.exact64)
        self.allowance = noise + 2.0 ** -7 * (np.abs(self.exact64) + noise)


def yardstick_weights(weight, raw, scales, K):
    """(bf16 weights, exact weights or None, |terms| or None): what the yardsticks are built from."""
    if weight in ("q2k", "q2k_r"):
        return R.wkv_q2k_bf16(raw, K), R.wkv_q2k_exact(raw, K), R.wkv_q2k_abs_terms(raw, K)
    return R.wkv_fp8_bf16(raw, scales), None, None


def yardsticks(weight, x, raw, scales, weights=None):
    """(yardstick for bf16-weight versions, bf16 weights, exact-weight yardstick or None)."""
    wb, w_exact, w_abs = weights if weights is not None else yardstick_weights(weight, raw, scales, x.shape[1])
    return Yardstick(x, wb), wb, (ExactWeightYard(x, w_exact, w_abs) if w_exact is not None else None)


def run_q(version, weight, x, raw, scales, stream=0):
    """`raw` is the file's encoding; a q2k_r version gets it repacked (numpy reference repack)."""
    T, N = x.shape[0], raw.shape[0]
    out = poisoned(T, N)
    if weight == "q2k_r":
        raw = repack_q2k_r(raw, x.shape[1])
    ret = P.project_q(cuda.to_device(x), cuda.to_device(raw), None if scales is None else cuda.to_device(scales),
                      out, weight=weight, version=version, stream=stream)
    assert ret is out
    return out.copy_to_host()


def check_version(version, weight, x, raw, scales, *, record=None):
    """Run one version, hold it to its claim, print (and record) its figures."""
    yard, wb, exact_yard = yardsticks(weight, x, raw, scales)
    got = run_q(version, weight, x, raw, scales)
    rec = registry.get("proj", version)
    ref = R.projection_reference(x, wb) if x.shape[0] * x.shape[1] * raw.shape[0] <= 1 << 26 else None
    if version in EXACT_WEIGHT:
        stats = error_stats(got, exact_yard)
        # the research figure: how far the exact-weight path lands from the bf16-weight projection
        stats["max_ulp_vs_bf16_weights"] = int(bf16_ulp_distance(got, yard.exact_bf16).max())
        stats["max_ulp_vs_bf16_weights_well_conditioned"] = int(
            bf16_ulp_distance(got, yard.exact_bf16)[yard.well & exact_yard.well].max())
        stats["frac_differs_from_bf16_weights"] = float((got != yard.exact_bf16).mean())
    else:
        stats = error_stats(got, yard, ref)
    entry = dict(version=version, weight=weight, shape=[int(x.shape[0]), int(x.shape[1]), int(raw.shape[0])], **stats)
    print(json.dumps(entry))
    if record is not None:
        record.append(entry)
    if rec.bit_exact and ref is not None:
        assert stats["bit_exact_vs_reference"], stats
    assert_within_tolerance(stats)
    return got, stats


# ---- simulator tier -----------------------------------------------------------------------------
# (T, K, N): tiny, each case naming what it exercises. The tensor-core versions run 256 threads
# and a simulated mma per 16 values: a few seconds a case.

SIM_CASES = {r.name: r.sim_cases for r in registry.records("proj")
             if r.encoding != "bf16" and r.name not in DEEPSEEK_FP8_VERSIONS}
# each version's first case runs in `make test-fast`; the others (larger, slower to simulate) are `slow`
SIM_PARAMS = [pytest.param(v, s, id=f"{v}-{s[0]}x{s[1]}x{s[2]}", marks=(pytest.mark.slow,) if i else ())
              for v, shapes in SIM_CASES.items() for i, s in enumerate(shapes)]


def test_every_quant_version_has_simulator_cases():
    assert set(SIM_CASES) == set(Q2K_VERSIONS) | set(FP8_VERSIONS) | set(Q2KR_VERSIONS)
    for version, cases in SIM_CASES.items():
        assert cases, f"{version} has no simulator cases"
        for T, K, N in cases:                       # whole blocks / tiles of K, as the kernels take
            assert T >= 1 and N >= 1 and K % (256 if "q2k" in version else 32) == 0, (version, T, K, N)
    # each tensor-core version has a case with more K blocks than its warps load in one trip
    assert max(k for _, k, _ in SIM_CASES["gemv_q2k_v2"]) // 256 > 8 * 3
    assert max(k for _, k, _ in SIM_CASES["gemv_fp8_v2"]) // 32 > 8 * 8
    assert max(k for _, k, _ in SIM_CASES["gemv_q2k_v6"]) // 512 > 4 * 3
    # gemv_fp8_v3: more 64-wide steps a warp than its ring holds, and a last step of one scale tile
    steps = -(-max(k for _, k, _ in SIM_CASES["gemv_fp8_v3"]) // 64)
    assert -(-steps // cuda_gemv_fp8.V3_SPLIT) > cuda_gemv_fp8.V3_STAGES
    assert any(k % 64 == 32 for _, k, _ in SIM_CASES["gemv_fp8_v3"])


def test_quant_records():
    for v in Q2K_VERSIONS + FP8_VERSIONS + Q2KR_VERSIONS:
        rec = registry.get("proj", v)
        assert rec.sweep == (1, 4, 8), rec
        assert rec.bit_exact == v.endswith("_v1"), rec


@pytest.mark.parametrize("version,shape", SIM_PARAMS)
def test_quant_version_matches_its_yardstick(rng, version, shape):
    T, K, N = shape
    weight = registry.get("proj", version).encoding
    x = random_x(rng, T, K)
    raw, scales = (random_q2k(rng, N, K), None) if weight in ("q2k", "q2k_r") else random_fp8(rng, N, K)
    check_version(version, weight, x, raw, scales)


@pytest.mark.slow
def test_fp8_v4_factory_shape(rng):
    """gemv_fp8_v4's factory at another shape than the registered one (tools/fp8_gemv_dev.py times
    such variants): 2 warps a block (the chunk's 256 sums stored by 64 threads, 4 a thread), 3 steps
    in flight (10 steps a block: the last trip of 3 slots runs one), 5 steps a warp with a last one
    of one tile (K = 608: 10 steps, the second warp's last half past K), 3
    blocks over 9 groups of rows (N = 68: the second and third blocks' groups straddle two chunks,
    the last group 4 rows past N), two token groups (T = 9), the empty groups' mma skipped - against
    the yardstick as every registered version is."""
    from engram_numba.device.launch import PreparedLaunch
    from engram_numba.stages.proj.cuda_common import flat_u32
    T, K, N = 9, 608, 68
    x = random_x(rng, T, K)
    codes, scales = random_fp8(rng, N, K)
    kernel = cuda_gemv_fp8.make_gemv_fp8_v4(warps=2, skip_empty=True, depth=3)
    grid, block = cuda_gemv_fp8.geometry_v4(T, N, warps=2)
    assert grid == (3, 2) and block == 64
    out = poisoned(T, N)
    xd, cd = cuda.to_device(x), cuda.to_device(codes)
    PreparedLaunch("v4[2w]", kernel, grid, block, 0, (flat_u32(xd), flat_u32(cd), cuda.to_device(scales), out, T, K),
                   out)()
    yard = Yardstick(x, R.wkv_fp8_bf16(codes, scales))
    stats = error_stats(out.copy_to_host(), yard)
    print(json.dumps(dict(version="gemv_fp8_v4[warps=2,depth=3]", shape=[T, K, N], **stats)))
    assert_within_tolerance(stats)


def test_naive_versions_equal_todays_bf16_projection(rng):
    """gemv_q2k_v1 and gemv_fp8_v1 are the bf16 projection of `wkv_bf16()` in the same order: the
    same bits as gemv_v1 on the decoded weight (and as the reference)."""
    T, K, N = 2, 256, 6
    x = random_x(rng, T, K)
    raw = random_q2k(rng, N, K)
    codes, scales = random_fp8(rng, N, K)
    for version, weight, w, s, wb in (("gemv_q2k_v1", "q2k", raw, None, R.wkv_q2k_bf16(raw, K)),
                                      ("gemv_fp8_v1", "fp8", codes, scales, R.wkv_fp8_bf16(codes, scales))):
        got = run_q(version, weight, x, w, s)
        bf16_path = P.project(cuda.to_device(x), cuda.to_device(wb), version="gemv_v1").copy_to_host()
        np.testing.assert_array_equal(got, bf16_path)


def test_fp8_edge_codes_are_exact(rng):
    """Every finite e4m3 code (zeros, subnormals, 448, negatives) at the ends of the exact scale
    range (bytes 3 and 246): the naive kernel reproduces the exact bf16 projection bit for bit and
    a NaN code gives NaN in exactly the rows that hold it."""
    K, N = 256, 2
    codes = np.arange(256, dtype=np.uint8).reshape(1, 256).repeat(N, 0)
    codes[0, [0x7F, 0xFF]] = 0x00                            # row 0 finite, row 1 keeps its NaN codes
    for s in (3, 246):
        # small x at the top of the range, so the 256-term sums stay finite
        x = f32_to_bf16(bf16_to_f32(random_x(rng, 2, K)) * np.float32(2.0 ** (-24 if s == 246 else 0)))
        scales = np.full((1, K // 32), s, np.uint8)
        w64 = R.wkv_fp8_exact(codes[:1], scales)
        np.testing.assert_array_equal(bf16_to_f32(R.wkv_fp8_bf16(codes[:1], scales)).astype(np.float64), w64)
        got = run_q("gemv_fp8_v1", "fp8", x, codes, scales)
        np.testing.assert_array_equal(got[:, :1], R.projection_reference(x, R.wkv_fp8_bf16(codes[:1], scales)))
        assert np.isnan(bf16_to_f32(got[:, 1])).all()


@pytest.mark.skipif(not SIMULATOR, reason="calls device helpers from the host (the simulator's twins)")
def test_e4m3_and_e8m0_decoders_match_ml_dtypes():
    """The kernels' scalar decoders (e4m3_to_f32, e8m0_to_f32) and the intrinsic that converts 4
    codes to bf16, on every code, against ml_dtypes' float8_e4m3fn / float8_e8m0fnu."""
    import ml_dtypes
    from engram_numba.stages.proj.gemv_common import e4m3x4_to_bf16x2x2
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.array([cuda_gemv_fp8.e4m3_to_f32(c) for c in range(256)], dtype=np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    words = np.arange(256, dtype=np.uint8).view(np.uint32)
    pairs = np.array([e4m3x4_to_bf16x2x2(w) for w in words], dtype=np.uint32).reshape(-1)   # [128] bf16x2
    bf = bf16_to_f32(pairs.view(np.uint16))
    np.testing.assert_array_equal(np.isnan(bf), np.isnan(want))
    np.testing.assert_array_equal(bf[~np.isnan(want)], want[~np.isnan(want)])
    e8 = np.array([cuda_gemv_fp8.e8m0_to_f32(s) for s in range(256)], dtype=np.float32)
    want8 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(e8), np.isnan(want8))
    np.testing.assert_array_equal(e8[:255], want8[:255])


@pytest.mark.skipif(not SIMULATOR, reason="calls device helpers from the host (the simulator's twins)")
def test_small_int_and_split_helpers():
    """small_u32_to_f32 is exact; split3 splits an fp32 into three bf16 parts that sum back exactly."""
    for v in (0, 1, 15, 45, 255, (1 << 23) - 1):
        assert cuda_gemv_q2k.small_u32_to_f32(np.uint32(v)) == np.float32(v)
    rng = np.random.default_rng(5)
    for s in np.concatenate([rng.standard_normal(200).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 200),
                             np.float32([0.0, -0.0, 1.0, -3.0000002, 1e-30])]).astype(np.float32):
        parts = np.array(cuda_gemv_q2k.split3(np.float32(s)), dtype=np.uint16)
        assert bf16_to_f32(parts).astype(np.float64).sum() == np.float64(s), (s, parts)


def quant_ctx(T, weight, *, aligned=True, simulator=False):
    return {"T": T, "K": 6144, "N": 25600, "aligned": aligned, "simulator": simulator, "weight": weight}


def test_default_versions_for_quant_weights():
    for T in (1, 4, 8, 9, 16, 4096):
        assert registry.default("proj", quant_ctx(T, "q2k")).name == "gemv_q2k_v2"
        # gemv_fp8_v5 (v2's bits on f16 operands) up to 8 tokens, v2 past them
        assert registry.default("proj", quant_ctx(T, "fp8")).name == ("gemv_fp8_v5" if T <= 8 else "gemv_fp8_v2")
        for kw in ({"simulator": True}, {"aligned": False}):
            assert registry.default("proj", quant_ctx(T, "q2k", **kw)).name == "gemv_q2k_v1"
            assert registry.default("proj", quant_ctx(T, "fp8", **kw)).name == "gemv_fp8_v1"
        # the bf16 rules are untouched by the new records
        assert registry.default("proj", quant_ctx(T, "bf16")).encoding == "bf16"
    assert P.pick(1, 6144, 25600, weight="q2k").name == ("gemv_q2k_v1" if SIMULATOR else "gemv_q2k_v2")


def test_prepared_default_and_stream(rng):
    """version=None prepares the default for the environment; a stream is honoured."""
    T, K, N = 2, 256, 3
    x, raw = random_x(rng, T, K), random_q2k(rng, N, K)
    stream = cuda.stream()
    launch = P.prepare_project_q(cuda.to_device(x), cuda.to_device(raw), weight="q2k", stream=stream)
    assert launch.name == P.pick(T, K, N, weight="q2k").name
    out = launch()
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), R.projection_reference(x, R.wkv_q2k_bf16(raw, K)))


def test_wkv_to_bf16_decodes_the_whole_weight(rng):
    """The many-token path's decoder: Q2_K bit-identical to wkv_bf16 (the rows-stage decoder), FP8
    to the exact bf16 weights."""
    N, K = 3, 512
    raw = random_q2k(rng, N, K)
    out = cuda.to_device(np.full((N, K), POISON, np.uint16))
    P.prepare_wkv_to_bf16(cuda.to_device(raw), None, out, weight="q2k")()
    np.testing.assert_array_equal(out.copy_to_host(), R.wkv_q2k_bf16(raw, K))
    codes, scales = random_fp8(rng, 33, 64)
    out = cuda.to_device(np.full((33, 64), POISON, np.uint16))
    P.prepare_wkv_to_bf16(cuda.to_device(codes), cuda.to_device(scales), out, weight="fp8")()
    np.testing.assert_array_equal(out.copy_to_host(), R.wkv_fp8_bf16(codes, scales))


# ---- argument checks: refused before any launch or allocation --------------------------------------

def _bad_cases(rng):
    x = random_x(rng, 2, 256)
    raw = random_q2k(rng, 3, 256)
    codes, scales = random_fp8(rng, 3, 64)
    x64 = random_x(rng, 2, 64)
    return [
        ("unknown weight", lambda: P.prepare_project_q(dev(x), dev(raw), weight="q4_k"), ValueError, "weight must be one of"),
        ("host x", lambda: P.prepare_project_q(x, dev(raw), weight="q2k"), TypeError, "x is a host numpy array"),
        ("host wkv", lambda: P.prepare_project_q(dev(x), raw, weight="q2k"), TypeError, "wkv_raw is a host"),
        ("float x", lambda: P.prepare_project_q(dev(x.astype(np.float32)), dev(raw), weight="q2k"), TypeError,
         "x must be bf16 words"),
        ("K % 256", lambda: P.prepare_project_q(dev(x[:, :128]), dev(raw), weight="q2k"), ValueError,
         "multiple of 256"),
        ("q2k width", lambda: P.prepare_project_q(dev(random_x(rng, 2, 512)), dev(raw), weight="q2k"), ValueError,
         r"\[N, 168\] Q2_K blocks for K = 512"),
        ("q2k dtype", lambda: P.prepare_project_q(dev(x), dev(raw.view(np.int8)), weight="q2k"), TypeError,
         "wkv_raw must be uint8"),
        ("q2k scales", lambda: P.prepare_project_q(dev(x), dev(raw), dev(scales), weight="q2k"), ValueError,
         "wkv_scales must be None"),
        ("fp8 no scales", lambda: P.prepare_project_q(dev(x64), dev(codes), weight="fp8"), ValueError,
         "FP8 weights need wkv_scales"),
        ("fp8 scales shape", lambda: P.prepare_project_q(dev(x64), dev(codes), dev(scales[:, :1]), weight="fp8"),
         ValueError, r"wkv_scales must be \[ceil\(N/32\), K/32\] = \[1, 2\]"),
        ("fp8 K", lambda: P.prepare_project_q(dev(x), dev(codes), dev(scales), weight="fp8"), ValueError,
         r"wkv_raw must be \[N, K\] = \[N, 256\]"),
        ("fp8 K % 32", lambda: P.prepare_project_q(dev(x64[:, :48]), dev(codes[:, :48]), dev(scales), weight="fp8"),
         ValueError, "multiple of 32"),
        ("bf16 version for q2k", lambda: P.prepare_project_q(dev(x), dev(raw), weight="q2k", version="gemv_v3"),
         ValueError, "reads bf16 weights, not q2k"),
        ("fp8 version for q2k", lambda: P.prepare_project_q(dev(x), dev(raw), weight="q2k", version="gemv_fp8_v2"),
         ValueError, "reads fp8 weights, not q2k"),
        ("q2k version through the bf16 launcher",
         lambda: P.prepare_project(dev(x), dev(random_x(rng, 3, 256)), version="gemv_q2k_v2"), ValueError,
         "use prepare_project_q"),
        ("out shape", lambda: P.prepare_project_q(dev(x), dev(raw), out=dev(np.zeros((2, 4), np.uint16)), weight="q2k"),
         ValueError, "out must be"),
        ("host out", lambda: P.prepare_project_q(dev(x), dev(raw), out=np.zeros((2, 3), np.uint16), weight="q2k"),
         TypeError, "out is a host"),
    ]


def test_bad_arguments_raise_before_launch(rng):
    for name, call, exc, msg in _bad_cases(rng):
        with pytest.raises(exc, match=msg):
            call()


def test_unaligned_inputs_need_the_naive_versions(rng):
    """x starting 8 bytes into an allocation cannot be read with 16-byte loads: the default falls
    back to the naive kernel (still exact), a fast version named explicitly is refused."""
    T, K, N = 2, 256, 3
    x, raw = random_x(rng, T, K), random_q2k(rng, N, K)
    big = np.zeros(T * K + 4, np.uint16)
    big[4:] = x.ravel()
    xd = dev(big)[4:].reshape(T, K)
    assert data_address(xd) % 16 == 8
    for version in ("gemv_q2k_v2", "gemv_q2k_v3"):
        with pytest.raises(ValueError, match="16-byte"):
            P.prepare_project_q(xd, dev(raw), weight="q2k", version=version)
    launch = P.prepare_project_q(xd, dev(raw), weight="q2k")
    assert launch.name == "gemv_q2k_v1"
    np.testing.assert_array_equal(launch().copy_to_host(), R.projection_reference(x, R.wkv_q2k_bf16(raw, K)))


def test_zero_tokens_is_a_no_op(rng):
    raw = random_q2k(rng, 3, 256)
    out = P.project_q(dev(np.zeros((0, 256), np.uint16)), dev(raw), weight="q2k")
    assert out.shape == (0, 3)


def test_launch_configs():
    def geo(name, T, N):
        return registry.get("proj", name).geometry(T, N)
    assert geo("gemv_q2k_v2", 1, 25600) == ((1600, 1), 256)
    assert geo("gemv_q2k_v3", 9, 25600 + 5) == ((1601, 2), 256)
    assert geo("gemv_q2k_v1", 1, 25600) == (200, 128)
    assert geo("gemv_fp8_v2", 8, 25600) == ((1600, 1), 256)
    assert geo("gemv_fp8_v1", 9, 40) == (1, 128)
    assert geo("gemv_fp8_v3", 8, 25600) == ((800, 1), 64)          # 32 rows a block, K over 2 warps: one wave
    assert geo("gemv_fp8_v3", 9, 25600 + 5) == ((801, 2), 64)
    # one block an SM (the simulator's 3 stand for the SMs), never more blocks than 8-row groups
    assert geo("gemv_fp8_v4", 8, 25600) == ((cuda_gemv_fp8.sm_count(), 1), 32 * cuda_gemv_fp8.V4_WARPS)
    assert geo("gemv_fp8_v4", 9, 13) == ((2, 2), 32 * cuda_gemv_fp8.V4_WARPS)


# ---- GPU tier: released shapes ------------------------------------------------------------------

RELEASED_K, RELEASED_N = 6144, 25600
GPU_TOKENS = (1, 4, 8)


@pytest.fixture(scope="module")
def released_q_weights():
    """One random Q2_K and one FP8 weight at the released shape, with their yardstick weights."""
    rng = np.random.default_rng(20260611)
    raw = random_q2k(rng, RELEASED_N, RELEASED_K)
    codes, scales = random_fp8(rng, RELEASED_N, RELEASED_K)
    return {"q2k": (raw, None, yardstick_weights("q2k", raw, None, RELEASED_K)),
            "fp8": (codes, scales, yardstick_weights("fp8", codes, scales, RELEASED_K))}


def gpu_time_us(fn, reps=20, rounds=3):
    """Median device time of back-to-back calls between two events (no L2 flush: the bench does that)."""
    fn()
    cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = cuda.event(), cuda.event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return float(np.median(times))


@pytest.mark.gpu
@pytest.mark.parametrize("weight", ["q2k", "fp8"])
@pytest.mark.parametrize("T", GPU_TOKENS)
def test_gpu_quant_projection_released(rng, released_q_weights, weight, T):
    """Every version at K = 6144, N = 25600 against the float64 yardsticks, every element."""
    raw, scales, weights = released_q_weights[weight]
    x = random_x(rng, T, RELEASED_K)
    yard, wb, exact_yard = yardsticks(weight, x, raw, scales, weights)
    xd, rd = cuda.to_device(x), cuda.to_device(raw)
    sd = None if scales is None else cuda.to_device(scales)
    failures = []
    # DeepSeek's FP8 arithmetic (activations quantised too) has its own yardstick and gpu test
    versions = [(v, weight) for v in registry.names("proj", weight) if v not in DEEPSEEK_FP8_VERSIONS]
    if weight == "q2k":       # the same weight re-laid out on the device
        from engram_numba.stages.proj.cuda_gemv_q2kr import repack_on_device
        rd_r = repack_on_device(rd, RELEASED_N, RELEASED_K)
        versions += [(v, "q2k_r") for v in registry.names("proj", "q2k_r")]
    for version, w_enc in versions:
        out = poisoned(T, RELEASED_N)
        launch = P.prepare_project_q(xd, rd_r if w_enc == "q2k_r" else rd, sd, out, weight=w_enc, version=version)
        launch()
        got = out.copy_to_host()
        if version in EXACT_WEIGHT:
            stats = error_stats(got, exact_yard)
            d = bf16_ulp_distance(got, yard.exact_bf16)
            stats.update(max_ulp_vs_bf16_weights=int(d.max()),
                         max_ulp_vs_bf16_weights_well_conditioned=int(d[yard.well & exact_yard.well].max()),
                         frac_differs_from_bf16_weights=float((got != yard.exact_bf16).mean()),
                         p99_ulp_vs_bf16_weights=float(np.percentile(d, 99)))
        else:
            stats = error_stats(got, yard)
        t_us = gpu_time_us(launch, reps=3 if version.endswith("_v1") else 20)
        nbytes = raw.nbytes + (0 if scales is None else scales.nbytes) + x.nbytes + 2 * T * RELEASED_N
        entry = dict(test="projection-quant", weight=weight, shape=[T, RELEASED_K, RELEASED_N], version=version,
                     unit="bf16 ulp vs its float64 yardstick", time_us=round(t_us, 2),
                     gbps=round(nbytes / t_us / 1e3, 1), **stats)
        try:
            assert_within_tolerance(stats)
            entry["passed"] = True
        except AssertionError:
            entry["passed"] = False
            failures.append(version)
        RESULTS.append(entry)
        print(json.dumps(entry))
    assert not failures, failures


@pytest.mark.gpu
def test_gpu_naive_quant_versions_bit_exact(rng, released_q_weights):
    """At the released K the in-order versions still reproduce projection_reference bit for bit
    (520 outputs, 3 tokens: the reference is slow)."""
    x = random_x(rng, 3, RELEASED_K)
    failed = []
    for weight, version in (("q2k", "gemv_q2k_v1"), ("fp8", "gemv_fp8_v1")):
        raw, scales, _ = released_q_weights[weight]
        raw = np.ascontiguousarray(raw[:520])
        scales = None if scales is None else np.ascontiguousarray(scales[:-(-520 // 32)])
        wb = R.wkv_q2k_bf16(raw, RELEASED_K) if weight == "q2k" else R.wkv_fp8_bf16(raw, scales)
        got = run_q(version, weight, x, raw, scales)
        ok = bool(np.array_equal(got, R.projection_reference(x, wb)))
        RESULTS.append(dict(test="projection-quant-bitexact", version=version, shape=[3, RELEASED_K, 520], passed=ok))
        if not ok:
            failed.append(version)
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["gemv_fp8_v2", "gemv_fp8_v3", "gemv_fp8_v4", "gemv_fp8_v5", "gemv_fp8_v6"])
def test_gpu_fp8_edge_codes_tensor_core(rng, version):
    """The tensor-core FP8 kernels on every code at scale bytes 3 and 246 (exact in bf16) and on
    NaN codes: exact-weight projection within tolerance, NaN exactly where a NaN code is."""
    K, N = 256, 48
    codes = np.tile(np.arange(256, dtype=np.uint8), (N, 1))
    for r in range(N):
        codes[r] = np.roll(codes[r], r)
    finite = codes.copy()
    finite[(finite & 0x7F) == 0x7F] = 0
    for s in (3, 246):
        x = f32_to_bf16(bf16_to_f32(random_x(rng, 8, K)) * np.float32(2.0 ** (-24 if s == 246 else 0)))
        scales = np.full((2, K // 32), s, np.uint8)
        check_version(version, "fp8", x, finite, scales, record=RESULTS)
        got = run_q(version, "fp8", x, codes, scales)
        assert np.isnan(bf16_to_f32(got)).all()          # every row holds a NaN code


@pytest.fixture(scope="module")
def released_fp8_weight():
    """One random FP8 weight at the released shape and its bf16 words (without the Q2_K weight's
    costly yardsticks: the FP8 GPU batch runs these tests alone)."""
    codes, scales = random_fp8(np.random.default_rng(20261202), RELEASED_N, RELEASED_K)
    return codes, scales, R.wkv_fp8_bf16(codes, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("version", ("gemv_fp8_v3", "gemv_fp8_v4"))
@pytest.mark.parametrize("T", (1, 3, 8, 9))
@pytest.mark.parametrize("cut", [(0, 0), (7, 32)], ids=["released", "odd"])
def test_gpu_fp8_v3_against_v1_v2(rng, released_fp8_weight, T, cut, version):
    """gemv_fp8_v3 and gemv_fp8_v4 at the released shape (and with 7 rows and one scale tile of K cut
    off: a last warp with rows past N, a last step of one tile) against the float64 yardstick on
    every element, and against v1 (the reference's order) and v2 on the same launch inputs: v3 and
    v4 sum in other orders, so they may differ from them by the fp32 noise, never more than 2 ulp
    where the yardstick is well conditioned (each is within 1 ulp of it there)."""
    codes, scales, wb = released_fp8_weight
    N, K = RELEASED_N - cut[0], RELEASED_K - cut[1]
    codes = np.ascontiguousarray(codes[:N, :K])
    scales = np.ascontiguousarray(scales[:, :K // 32])
    wb = np.ascontiguousarray(wb[:N, :K])
    x = random_x(rng, T, K)
    yard = Yardstick(x, wb)
    xd, cd, sd = cuda.to_device(x), cuda.to_device(codes), cuda.to_device(scales)
    got = {}
    for v in ("gemv_fp8_v1", "gemv_fp8_v2", version):
        out = poisoned(T, N)
        P.prepare_project_q(xd, cd, sd, out, weight="fp8", version=v)()
        got[v] = out.copy_to_host()
    stats = error_stats(got[version], yard)
    for other in ("gemv_fp8_v1", "gemv_fp8_v2"):
        d = bf16_ulp_distance(got[version], got[other])
        stats[f"max_ulp_vs_{other}_well_conditioned"] = int(d[yard.well].max())
        stats[f"frac_differs_from_{other}"] = float((d > 0).mean())
    entry = dict(test="projection-fp8-" + version.split("_")[-1], version=version, shape=[T, K, N], **stats)
    print(json.dumps(entry))
    RESULTS.append(entry)
    assert_within_tolerance(stats)
    assert stats["max_ulp_vs_gemv_fp8_v1_well_conditioned"] <= 2, stats
    assert stats["max_ulp_vs_gemv_fp8_v2_well_conditioned"] <= 2, stats


@pytest.mark.gpu
@pytest.mark.parametrize("version", ("gemv_fp8_v5", "gemv_fp8_v6"))
@pytest.mark.parametrize("T", (1, 3, 8, 9))
@pytest.mark.parametrize("cut", [(0, 0), (7, 32)], ids=["released", "odd"])
def test_gpu_fp8_v5_is_v2(rng, released_fp8_weight, T, cut, version):
    """gemv_fp8_v5 sums v2's products in v2's order on operands scaled by powers of two, and
    gemv_fp8_v6 is v5's arithmetic in one launch: on the H200 their outputs must be v2's bits
    (records.py states the conditions; random x meets them)."""
    codes, scales, _ = released_fp8_weight
    N, K = RELEASED_N - cut[0], RELEASED_K - cut[1]
    codes = np.ascontiguousarray(codes[:N, :K])
    scales = np.ascontiguousarray(scales[:, :K // 32])
    x = random_x(rng, T, K)
    xd, cd, sd = cuda.to_device(x), cuda.to_device(codes), cuda.to_device(scales)
    got = {}
    for v in ("gemv_fp8_v2", version):
        out = poisoned(T, N)
        P.prepare_project_q(xd, cd, sd, out, weight="fp8", version=v)()
        got[v] = out.copy_to_host()
    differs = int((got[version] != got["gemv_fp8_v2"]).sum())
    RESULTS.append(dict(test=f"projection-fp8-{version.split('_')[-1]}-bits", version=version, shape=[T, K, N],
                        differs_from_v2=differs, passed=differs == 0))
    assert differs == 0
