"""The projection kernels (engram_numba.stages.proj) against the numpy reference.

kv = bf16(x @ wkv^T) with fp32 accumulation. Every bf16 x bf16 product is exact in fp32, so the
kernels differ from each other and from the references only in how the sums round.

Tolerances, in bf16 ulps (units of the last place of the bf16 result):
- gemv_v1, gemm_v1 and gemm_v2 add each output's products in the reference's order k = 0..K-1
  (gemm_v2 tile by tile, one FMA chain per output): bit-identical to `projection_reference`
  (their records say `bit_exact`; every record that says so is held to it).
- fast versions (other fp32 summation orders, or the tensor core's): <= 1 bf16 ulp from
  `projection_exact` (float64 sum, rounded once) and from `projection_reference`, for every
  element that is not dominated by fp32 summation noise. The noise of any fp32 summation order
  grows like u * sqrt(K/2) * ||x_t * w_n||_2 (u = 2^-24; a random walk of rounding errors whose
  partial sums grow like sqrt(k)); NOISE_SIGMAS of those is the bound used here. Where it is
  below half a bf16 ulp of the exact value, 1 ulp is guaranteed and asserted. The rest are sums
  that cancel to far below their terms (|kv| < ~2^8 noise: none at the simulator's tiny K, ~0.5 %
  of outputs at K = 6144 with random data); any fp32 order, the sequential reference included, can
  land further than 1 ulp there, so those are held to |kv - exact| <= noise + 2^-7 (|exact| + noise)
  (1 bf16 ulp plus the noise). The measured maxima (all elements, the well-conditioned ones, and
  the rest as a fraction of their allowance) are printed and recorded.

Outputs are poisoned (0xFFFF, a NaN) before every run, so an unwritten element fails. Simulator
tier: tiny shapes, 1-4 blocks (the simulator runs each thread as a Python thread), every version,
tiles that do not divide T/N/K. GPU tier (`gpu` marker): the released shape (K = 6144,
N = 25600) at T in {1, 7, 16, 128, 4096} and odd shapes (T = 33, K = 264, N = 200 among them),
every applicable version, every element; each check appends a summary (with the kernel's median
time) to RESULTS. Versions are the proj stage's kernel records ("gemv_v3", "gemm_v4", ...,
"cublas_v1" where PyTorch is installed), iterated from the registry.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_ulp_distance, f32_to_bf16
from engram_numba.device.devarray import data_address
from engram_numba.device.intrinsics import SIMULATOR
from engram_numba.stages import registry
from engram_numba.stages.proj import cublas, cuda_wgmma
from engram_numba.stages.proj import launch as P
from engram_numba.stages.proj.cuda_gemv import GEMV_TOKEN_BLOCKS
from engram_numba.stages.proj.records import (GEMV3_MAX_TOKENS, GEMV_MAX_TOKENS, WGMMA_MID_MAX_TOKENS, WGMMA_SK_MAX_TOKENS,
                                              WGMMA_SMALL_MAX_TOKENS)
from engram_numba.stages.proj.reference import projection_exact, projection_reference

from .conftest import POISON, Yardstick, assert_within_tolerance, dev, error_stats, poisoned

VERSIONS = tuple(registry.names("proj", "bf16"))   # bf16 weights (q2k/fp8 weights: test_proj_quant.py)
NAIVE = ("gemv_v1", "gemm_v1")
# versions that sum in the reference's order: every record marked bit_exact (gemv_v1, gemm_v1 and
# gemm_v2 among them, see test_sequential_versions_are_marked_bit_exact)
SEQUENTIAL = tuple(r.name for r in registry.records("proj", "bf16") if r.bit_exact)
# records that run another library's kernels (cuBLAS through torch): no numba kernel, no simulator
EXTERNAL = tuple(r.name for r in registry.records("proj") if r.requires)
FAST = tuple(v for v in VERSIONS if v not in NAIVE and v not in EXTERNAL)
RESULTS: list[dict] = []     # GPU tier: one summary per check, for the results file


def launch_config(version, T, N):
    """(grid, block) of a numba proj record at T tokens and N outputs (its record's geometry)."""
    return registry.get("proj", version).geometry(T, N)[:2]


HOPPER, AMPERE = (9, 0), (8, 0)


def proj_ctx(T, K=6144, N=25600, *, aligned=True, simulator=False, cc=HOPPER, weight="bf16"):
    """A default-rule context as on a GPU of compute capability cc (an H200 unless told), or, with
    simulator=True, as in the simulator."""
    return {"T": T, "K": K, "N": N, "aligned": aligned, "simulator": simulator, "weight": weight,
            "cc": None if simulator else cc}


def default_name(T, **kw) -> str:
    return registry.default("proj", proj_ctx(T, **kw)).name


# ---- inputs and checks --------------------------------------------------------------------------

def make_inputs(rng, T, K, N, w_scale=0.05):
    """x [T, K] and wkv [N, K] as bf16 words from fresh normal draws (never zeros)."""
    x = f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32))
    w = f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(w_scale))
    return x, w


def run(version, x, w, T, N, stream=0):
    out = poisoned(T, N)
    ret = P.project(cuda.to_device(x), cuda.to_device(w), out, version=version, stream=stream)
    assert ret is out
    return out.copy_to_host()


# ---- simulator tier: every version at tiny shapes ------------------------------------------------
# (T, K, N) per version: each record's sim_cases (records.py says what each one exercises).

SIM_CASES = {r.name: r.sim_cases for r in registry.records("proj", "bf16") if r.sim_cases}
# each version's first case runs in `make test-fast`; the others (larger, slower to simulate) are `slow`
SIM_PARAMS = [pytest.param(v, shape, id=f"{v}-{shape[0]}x{shape[1]}x{shape[2]}", marks=(pytest.mark.slow,) if i else ())
              for v, shapes in SIM_CASES.items() for i, shape in enumerate(shapes)]


def test_every_version_has_simulator_cases():
    assert set(SIM_CASES) == {r.name for r in registry.records("proj", "bf16") if r.simulate}
    assert set(SIM_CASES) | set(EXTERNAL) == set(registry.names("proj", "bf16"))


def test_sequential_versions_are_marked_bit_exact():
    assert {"gemv_v1", "gemm_v1", "gemm_v2"} <= set(SEQUENTIAL)


@pytest.mark.parametrize("version,shape", SIM_PARAMS)
def test_version_matches_reference(rng, version, shape):
    T, K, N = shape
    x, w = make_inputs(rng, T, K, N)
    ref = projection_reference(x, w)
    got = run(version, x, w, T, N)
    stats = error_stats(got, Yardstick(x, w), ref)
    print(json.dumps(dict(version=version, shape=[T, K, N], **stats)))
    if version in SEQUENTIAL:
        # the reference's summation order: bit for bit
        assert stats["bit_exact_vs_reference"], stats
    assert_within_tolerance(stats)


# The layouts and tiles the records do not use (the development script times them too): the
# unswizzled layout, and the small-T tiles with 64 and 256 outputs.
CANDIDATE_CASES = [("128x256/s4/noswz", (33, 264, 200)), ("64x64/s3/sw128", (70, 136, 70)),
                   ("64x256/s4/sw128", (5, 72, 260)), ("128x128/s3/sw128", (130, 200, 130))]


@pytest.mark.slow      # layouts no record uses: make test checks them, make test-fast does not
@pytest.mark.parametrize("name,shape", CANDIDATE_CASES, ids=[n for n, _ in CANDIDATE_CASES])
def test_wgmma_candidates_match_reference(rng, name, shape):
    T, K, N = shape
    x, w = make_inputs(rng, T, K, N)
    out = poisoned(T, N)
    cuda_wgmma.prepare_variant(name, cuda_wgmma.CANDIDATES[name], cuda.to_device(x), cuda.to_device(w), out)()
    stats = error_stats(out.copy_to_host(), Yardstick(x, w), projection_reference(x, w))
    print(json.dumps(dict(variant=name, shape=[T, K, N], **stats)))
    assert_within_tolerance(stats)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's refusal")
def test_cublas_needs_a_gpu(rng):
    x, w = make_inputs(rng, 2, 16, 3)
    with pytest.raises(RuntimeError, match="cublas_v1 calls cuBLAS on a GPU; numba's CUDA simulator has none"):
        P.project(cuda.to_device(x), cuda.to_device(w), version="cublas_v1")


def test_cublas_without_torch_says_what_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)      # import torch -> ImportError
    with pytest.raises(RuntimeError, match=r"PyTorch, which is not installed: pip install 'engram-numba\[cublas\]'"):
        cublas._torch()


def test_default_versions(rng):
    """version=None: on a GPU with aligned data gemv_v3 up to GEMV3_MAX_TOKENS; then on a Hopper GPU
    (cc 9.0) gemm_v5 up to WGMMA_SMALL_MAX_TOKENS, gemm_v10 (gemm_v4 on TMA) up to WGMMA_MID_MAX_TOKENS,
    gemm_v11 (gemm_v8 on TMA) up to WGMMA_SK_MAX_TOKENS and gemm_v12 (a producer warp over a tile queue) above,
    on other GPUs gemv_v4 up to GEMV_MAX_TOKENS and gemm_v3 above; in the simulator (or for
    unaligned data) gemv_v1 at T = 1, gemm_v1 above. What the launcher prepares is that default,
    and each agrees with the reference."""
    for cc in (HOPPER, AMPERE, (10, 0)):
        assert default_name(1, cc=cc) == default_name(GEMV3_MAX_TOKENS, cc=cc) == "gemv_v3"
    assert default_name(GEMV3_MAX_TOKENS + 1) == default_name(16) == default_name(WGMMA_SMALL_MAX_TOKENS) == "gemm_v5"
    assert default_name(WGMMA_SMALL_MAX_TOKENS + 1) == default_name(128) == default_name(WGMMA_MID_MAX_TOKENS) \
        == "gemm_v10"
    assert default_name(WGMMA_MID_MAX_TOKENS + 1) == default_name(512) == default_name(WGMMA_SK_MAX_TOKENS) \
        == "gemm_v11"
    assert default_name(WGMMA_SK_MAX_TOKENS + 1) == default_name(4096) == "gemm_v12"
    for cc in (AMPERE, (10, 0)):        # no wgmma: the mma.sync kernels
        assert default_name(GEMV3_MAX_TOKENS + 1, cc=cc) == default_name(GEMV_MAX_TOKENS, cc=cc) == "gemv_v4"
        assert default_name(GEMV_MAX_TOKENS + 1, cc=cc) == default_name(4096, cc=cc) == "gemm_v3"
    for kw in ({"simulator": True}, {"aligned": False}, {"simulator": True, "aligned": False},
               {"aligned": False, "cc": AMPERE}):
        assert default_name(1, **kw) == "gemv_v1" and default_name(9, **kw) == "gemm_v1", kw
        assert default_name(GEMV_MAX_TOKENS + 1, **kw) == "gemm_v1", kw
    # pick() builds the context from the environment (the simulator's rule when it runs)
    hopper = not SIMULATOR and P.device_cc() == HOPPER
    assert P.pick(1, 6144, 25600).name == ("gemv_v1" if SIMULATOR else "gemv_v3")
    assert P.pick(GEMV_MAX_TOKENS + 1, 6144, 25600).name == \
        ("gemm_v1" if SIMULATOR else "gemm_v5" if hopper else "gemm_v3")
    assert P.pick(1, 6144, 25600, aligned=False).name == "gemv_v1"
    assert P.pick(7, 6144, 25600, version="gemm_v2").name == "gemm_v2"
    for T, K, N in ((1, 32, 5), (3, 32, 5), (GEMV_MAX_TOKENS + 1, 32, 5)):
        x, w = make_inputs(rng, T, K, N)
        out = poisoned(T, N)
        launch = P.prepare_project(cuda.to_device(x), cuda.to_device(w), out)
        assert launch.name == P.pick(T, K, N).name
        assert launch() is out
        stats = error_stats(out.copy_to_host(), Yardstick(x, w), projection_reference(x, w))
        assert_within_tolerance(stats)


def test_default_rules_partition_the_contexts():
    """Exactly one record claims every context (registry.default raises otherwise), every record
    with a default rule is the default somewhere, and a default reads the context's weight."""
    claimed = set()
    for weight in ("bf16", "q2k", "fp8", "q2k_r"):
        for T in (1, 2, 3, 8, 9, 16, GEMV_MAX_TOKENS - 1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, WGMMA_SMALL_MAX_TOKENS,
                  WGMMA_SMALL_MAX_TOKENS + 1, 128, WGMMA_MID_MAX_TOKENS, WGMMA_MID_MAX_TOKENS + 1, 1000,
                  WGMMA_SK_MAX_TOKENS, WGMMA_SK_MAX_TOKENS + 1, 4096, 5000):
            for aligned in (True, False):
                for simulator in (True, False):
                    for cc in (HOPPER, AMPERE, (10, 0)):
                        for K, N in ((6144, 25600), (1536, 320), (256, 3)):
                            rec = registry.default("proj", proj_ctx(T, K=K, N=N, aligned=aligned, simulator=simulator,
                                                                    cc=cc, weight=weight))
                            assert rec.encoding == weight, (rec.name, weight)
                            claimed.add(rec.name)
    assert claimed == {r.name for r in registry.records("proj") if r.default_rule is not None}


def test_allocates_out_and_accepts_a_stream(rng):
    x, w = make_inputs(rng, 2, 16, 3)
    stream = cuda.stream()
    out = P.project(cuda.to_device(x), cuda.to_device(w), stream=stream, version="gemv_v1")
    stream.synchronize()
    assert out.shape == (2, 3) and out.dtype == np.uint16
    np.testing.assert_array_equal(out.copy_to_host(), projection_reference(x, w))


def test_exact_reference_agrees_with_sequential_reference(rng):
    """The two numpy references are themselves within 1 ulp at a tiny K (sanity of the yardstick)."""
    x, w = make_inputs(rng, 4, 256, 16)
    assert bf16_ulp_distance(projection_reference(x, w), projection_exact(x, w)).max() <= 1


def test_launch_config_released_shapes():
    assert launch_config("gemv_v3", 1, 25600) == ((6400, 1), 256)
    assert launch_config("gemv_v3", 7, 25600) == ((6400, 1), 256)
    assert launch_config("gemv_v2", 1, 25600) == ((800, 1), 256)
    assert launch_config("gemv_v4", 16, 25600) == ((800, 1), 256)
    assert launch_config("gemv_v4", 7, 25600 + 40) == ((802, 1), 256)
    assert launch_config("gemm_v2", 4096, 25600) == ((200, 32), 256)
    assert launch_config("gemm_v3", 4096, 25600) == ((200, 32), 256)
    assert launch_config("gemm_v1", 130, 320) == ((10, 17), (32, 8))
    assert launch_config("gemv_v1", 1, 25600) == (200, 128)
    assert launch_config("gemm_v4", 4096, 25600) == ((32, 100), 256)      # token tiles fastest
    assert launch_config("gemm_v4", 33, 200) == ((1, 1), 256)
    assert launch_config("gemm_v5", 16, 25600) == ((1, 200), 256)
    assert launch_config("gemm_v6", 128, 25600) == ((1, 128), 256)
    for v in FAST + NAIVE:                               # every numba record has a launch configuration
        launch_config(v, 7, 25600)


# ---- argument validation ------------------------------------------------------------------------

BAD_ARGS = [
    # (description, x, wkv, out kwargs, error type, message fragment)
    ("host x", lambda x, w: (x, dev(w), None), TypeError, "x is a host numpy array"),
    ("host wkv", lambda x, w: (dev(x), w, None), TypeError, "wkv is a host numpy array"),
    ("not an array", lambda x, w: ([1, 2], dev(w), None), TypeError, "x must be a device array"),
    ("float x", lambda x, w: (dev(x.astype(np.float32)), dev(w), None), TypeError, "x must be bf16 words"),
    ("1-D wkv", lambda x, w: (dev(x), dev(w.ravel()), None), TypeError, "wkv must be 2-D"),
    ("K mismatch", lambda x, w: (dev(x), dev(w[:, :8]), None), ValueError, "K differs"),
    ("K % 8", lambda x, w: (dev(x[:, :12]), dev(w[:, :12]), None), ValueError, "multiple of 8"),
    ("out shape", lambda x, w: (dev(x), dev(w), dev(np.zeros((2, 4), np.uint16))), ValueError, "out must be"),
    ("out dtype", lambda x, w: (dev(x), dev(w), dev(np.zeros((2, 3), np.float32))), TypeError, "out must be bf16"),
    ("host out", lambda x, w: (dev(x), dev(w), np.zeros((2, 3), np.uint16)), TypeError, "out is a host"),
]


@pytest.mark.parametrize("case", BAD_ARGS, ids=[c[0] for c in BAD_ARGS])
def test_bad_arguments_raise_before_launch(rng, case):
    _, make, exc, msg = case
    x, w = make_inputs(rng, 2, 16, 3)
    xa, wa, out = make(x, w)
    with pytest.raises(exc, match=msg):
        P.project(xa, wa, out)


def test_non_contiguous_and_unknown_version(rng):
    x, w = make_inputs(rng, 4, 16, 3)
    xd, wd = dev(x), dev(w)
    # strided views (a device array's .T is a transposed copy on a GPU, a view only in the simulator)
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        P.project(dev(np.zeros((4, 32), np.uint16))[:, ::2], wd)
    with pytest.raises(ValueError, match=r"no proj kernel version 'gemm_v99'; versions are \["):
        P.project(xd, wd, version="gemm_v99")
    out = poisoned(4, 3)
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        P.project(xd, wd, dev(np.zeros((4, 6), np.uint16))[:, ::2])
    np.testing.assert_array_equal(out.copy_to_host(), POISON)   # nothing was launched


def test_zero_tokens_is_a_no_op(rng):
    _, w = make_inputs(rng, 1, 16, 3)
    out = P.project(dev(np.zeros((0, 16), np.uint16)), dev(w))
    assert out.shape == (0, 3)


def test_unaligned_inputs_need_a_naive_version(rng):
    """A view that starts 8 bytes into an allocation cannot be read with 16-byte loads: the default
    falls back to the naive kernel (still correct), an explicit fast version is refused."""
    x, w = make_inputs(rng, 3, 16, 5)
    big = np.zeros((3 * 16 + 4,), np.uint16)
    big[4:] = x.ravel()
    xd = dev(big)[4:].reshape(3, 16)           # data pointer 8 bytes past a 16-byte boundary
    assert data_address(xd) % 16 == 8
    assert FAST
    for version in FAST:
        with pytest.raises(ValueError, match="16-byte"):
            P.project(xd, dev(w), version=version)
    assert P.prepare_project(xd, dev(w)).name == "gemm_v1"
    out = poisoned(3, 5)
    P.project(xd, dev(w), out)
    np.testing.assert_array_equal(out.copy_to_host(), projection_reference(x, w))


def test_compile_targets_cover_every_kernel():
    names = set()
    for rec in registry.records("proj"):
        mine = [t.name for t in rec.compile_targets()]
        if rec.requires:                                 # another library's kernels: nothing to compile
            assert not mine, mine
            continue
        assert mine and all(n == f"proj.{rec.name}" or n.startswith(f"proj.{rec.name}[") for n in mine), mine
        names.update(mine)
    assert {"proj.gemv_v1", "proj.gemm_v1", "proj.gemv_v4", "proj.gemm_v2", "proj.gemm_v3"} <= names
    assert {f"proj.gemm_v4[{cuda_wgmma.VARIANTS['gemm_v4'].name}]",
            f"proj.gemm_v5[{cuda_wgmma.VARIANTS['gemm_v5'].name}]",
            f"proj.gemm_v6[{cuda_wgmma.VARIANTS['gemm_v6'].name}]"} <= names
    for tb in GEMV_TOKEN_BLOCKS:
        assert f"proj.gemv_v2[TB={tb}]" in names and f"proj.gemv_v3[TB={tb}]" in names


# ---- GPU tier -----------------------------------------------------------------------------------

RELEASED_K, RELEASED_N = 6144, 25600
GPU_SHAPES = [(1, RELEASED_K, RELEASED_N), (7, RELEASED_K, RELEASED_N), (128, RELEASED_K, RELEASED_N),
              (4096, RELEASED_K, RELEASED_N),
              (3, RELEASED_K, RELEASED_N + 40),       # N not a multiple of any tile
              (130, 1536, 320),                       # the tiny model's K and N, T past one tile
              (16, RELEASED_K, RELEASED_N),           # a decode batch: two GEMV token groups
              (33, 264, 200),                         # no tile divides T, N or K (K % 64 == 8)
              (257, 6144 + 8, 25600 + 8)]             # a token past 2 wgmma tiles, a K tail, N % 256 == 8
NAIVE_MAX_T = 130         # the naive kernels are ~1000x slower; only up to here
GEMV_MAX_T = 130          # gemv at T tokens streams the weight ceil(T/8) times


def _importable(requires: str) -> bool:
    """A record's optional dependency ("torch", "torch or cupy") is installed ("" needs nothing)."""
    import importlib.util
    return not requires or any(importlib.util.find_spec(m.strip()) is not None for m in requires.split(" or "))


def applicable_versions(T):
    vs = []
    for v in registry.names("proj", "bf16"):
        if not _importable(registry.get("proj", v).requires):
            continue
        if v in NAIVE and T > NAIVE_MAX_T:
            continue
        if v.startswith("gemv") and T > GEMV_MAX_T:
            continue
        vs.append(v)
    return vs


@pytest.fixture(scope="module")
def released_weight():
    """One random wkv [N, K] per (K, N), kept on host and device for the whole module."""
    cache = {}

    def get(K, N):
        if (K, N) not in cache:
            rng = np.random.default_rng(K * 100003 + N)
            w = f32_to_bf16(rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.05))
            cache[(K, N)] = (w, cuda.to_device(w))
        return cache[(K, N)]
    return get


def median_time_us(fn, reps=10, rounds=3):
    """Device time of one call: `reps` back-to-back calls between two events (so the ~20-40 us
    Python launch cost overlaps the previous kernel instead of idling the GPU), median of
    `rounds`. No L2 flush: the released weight (315 MB) is 5x the L2."""
    fn()
    cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = cuda.event(), cuda.event()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / reps)
    return float(np.median(times))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"{t}x{k}x{n}" for t, k, n in GPU_SHAPES])
def test_gpu_projection(rng, released_weight, shape):
    T, K, N = shape
    w, wd = released_weight(K, N)
    x = f32_to_bf16(rng.standard_normal((T, K), dtype=np.float32))
    xd = cuda.to_device(x)
    yard = Yardstick(x, w)
    failures = []
    for version in applicable_versions(T):
        out = poisoned(T, N)
        P.project(xd, wd, out, version=version)
        got = out.copy_to_host()
        stats = error_stats(got, yard)
        t_us = None
        if version not in NAIVE:
            t_us = median_time_us(lambda: P.project(xd, wd, out, version=version))
        entry = dict(test="projection", shape=[T, K, N], version=version, unit="bf16 ulp vs float64 exact",
                     time_us=t_us, tflops=(2.0 * T * K * N / t_us / 1e6) if t_us else None,
                     weight_gbps=(2.0 * N * K / t_us / 1e3) if t_us else None,
                     launch=str(launch_config(version, T, N)) if version not in EXTERNAL else "cuBLAS", **stats)
        try:
            assert_within_tolerance(stats)
            entry["passed"] = True
        except AssertionError:
            entry["passed"] = False
            failures.append(version)
        RESULTS.append(entry)
        print(json.dumps(entry))
    # the default choice for this T, too
    out = poisoned(T, N)
    P.project(xd, wd, out)
    stats = error_stats(out.copy_to_host(), yard)
    RESULTS.append(dict(test="projection-default", shape=[T, K, N], version=P.pick(T, K, N).name,
                        unit="bf16 ulp vs float64 exact", passed=True, **stats))
    assert_within_tolerance(stats)
    assert not failures, failures


@pytest.mark.gpu
def test_gpu_sequential_versions_match_reference_bit_for_bit(rng, released_weight):
    """At the released K, gemv_v1, gemm_v1 and gemm_v2 still add in the reference's order:
    bit-identical to projection_reference (on 3 tokens x 520 outputs: the reference is slow)."""
    w, _ = released_weight(RELEASED_K, RELEASED_N)
    w = np.ascontiguousarray(w[:520])
    x = f32_to_bf16(rng.standard_normal((3, RELEASED_K), dtype=np.float32))
    ref = projection_reference(x, w)
    failed = []
    for version in SEQUENTIAL:
        got = run(version, x, w, 3, 520)
        ok = bool(np.array_equal(got, ref))
        entry = dict(test="projection-sequential-bitexact", shape=[3, RELEASED_K, 520], version=version,
                     unit="exact", passed=ok, max_ulp_vs_reference=int(bf16_ulp_distance(got, ref).max()))
        RESULTS.append(entry)
        print(json.dumps(entry))
        if not ok:
            failed.append(version)
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.skipif(not _importable("torch"), reason="cublas_v1 needs PyTorch")
def test_gpu_pipeline_diffs_our_projection_against_cublas():
    """The comparison the cuBLAS record exists for: the same run through the pipeline with the
    projection on gemm_v4 and on cuBLAS, both within 1 bf16 ulp of the float64 product of the
    captured rows (well-conditioned elements), so within 2 of each other."""
    from engram_numba.fixtures import TINY_MASK, TINY_PATH, TINY_TOKENS
    from engram_numba.formats.schema_a import load_gguf
    from engram_numba.pipeline import Pipeline
    model = load_gguf(TINY_PATH)
    runs = {v: Pipeline(model, {"proj": "cuda"}, versions={"proj": v}).run(TINY_TOKENS, token_mask=TINY_MASK)
            for v in ("gemm_v4", "cublas_v1")}
    for v, cap in runs.items():
        assert cap.meta["cuda_kernels"]["proj"] == v
    for lid in model.config.layer_ids:
        x = runs["gemm_v4"][f"L{lid}.rows.bf16"].reshape(TINY_TOKENS.size, -1)
        yard = Yardstick(x, np.ascontiguousarray(model.layers[lid].wkv_bf16()))
        for v, cap in runs.items():
            stats = error_stats(cap[f"L{lid}.proj.kv"], yard)
            RESULTS.append(dict(test="pipeline-vs-cublas", layer=lid, version=v, passed=True, **stats))
            assert_within_tolerance(stats)
        assert bf16_ulp_distance(runs["gemm_v4"][f"L{lid}.proj.kv"], runs["cublas_v1"][f"L{lid}.proj.kv"]).max() <= 2
