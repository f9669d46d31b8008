"""Helpers the projection stage's tests share (imported as `from .conftest import ...`): poisoned
outputs, the exact yardstick and the tolerances of test_proj_cuda.py's module docstring."""
import numpy as np

from engram_numba.bf16 import bf16_to_f32, bf16_ulp_distance, f32_to_bf16

POISON = 0xFFFF              # a bf16 NaN: any element left unwritten fails the ulp check
NOISE_SIGMAS = 8.0
U = 2.0 ** -24


def dev(a):
    """a, C-contiguous, on the device."""
    from numba import cuda
    return cuda.to_device(np.ascontiguousarray(a))


def poisoned(T, N):
    """A device output [T, N] uint16, every word POISON."""
    from numba import cuda
    return cuda.to_device(np.full((T, N), POISON, dtype=np.uint16))


def bf16_ulp_size(v):
    """The spacing of bf16 values at |v| (float64), normal range."""
    mag = np.maximum(np.abs(v), 2.0 ** -126)
    return 2.0 ** (np.floor(np.log2(mag)) - 7)


class Yardstick:
    """The exact answer for x, w and the per-element allowances (module docstring), computed once
    per input and reused for every version."""

    def __init__(self, x, w, exact64=None):
        xf, wf = bf16_to_f32(x), bf16_to_f32(w)
        if exact64 is None:
            exact64 = xf.astype(np.float64) @ wf.astype(np.float64).T                  # [T, N]
        K = x.shape[1]
        noise = NOISE_SIGMAS * U * np.sqrt(K / 2) * np.sqrt((xf * xf) @ (wf * wf).T).astype(np.float64)
        self.exact64 = exact64
        self.exact_bf16 = f32_to_bf16(exact64)
        self.well = noise < 0.5 * bf16_ulp_size(exact64)
        self.allowance = noise + 2.0 ** -7 * (np.abs(exact64) + noise)


def error_stats(got, yard, ref=None):
    """Distances of the kernel's kv from the exact answer (and from the sequential reference, if
    given), split into well-conditioned elements and noise-dominated ones (module docstring)."""
    well, ill = yard.well, ~yard.well
    ulps = bf16_ulp_distance(got, yard.exact_bf16)
    got64 = bf16_to_f32(got).astype(np.float64)
    stats = {
        "max_ulp_vs_exact": int(ulps.max()),
        "max_ulp_well_conditioned": int(ulps[well].max()) if well.any() else 0,
        "n_noise_dominated": int(ill.sum()),
        "max_noise_dominated_err_over_allowance":
            float((np.abs(got64[ill] - yard.exact64[ill]) / yard.allowance[ill]).max()) if ill.any() else 0.0,
        "n_over_1ulp": int((ulps > 1).sum()),
        "n_elements": int(got.size),
        "all_finite": bool(np.isfinite(got64).all()),
    }
    if ref is not None:
        ulps_ref = bf16_ulp_distance(got, ref)
        stats["max_ulp_vs_reference"] = int(ulps_ref.max())
        stats["max_ulp_vs_reference_well_conditioned"] = int(ulps_ref[well].max()) if well.any() else 0
        stats["bit_exact_vs_reference"] = bool(np.array_equal(got, ref))
    return stats


def assert_within_tolerance(stats):
    assert stats["all_finite"], stats
    assert stats["max_ulp_well_conditioned"] <= 1, stats
    assert stats["max_noise_dominated_err_over_allowance"] <= 1.0, stats
    if "max_ulp_vs_reference_well_conditioned" in stats:
        assert stats["max_ulp_vs_reference_well_conditioned"] <= 1, stats
