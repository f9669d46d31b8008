"""Helpers the rows stage's tests share (imported as `from .conftest import ...`)."""
import numpy as np

POISON = 0x7F7F     # what an output holds before a kernel writes it (a finite bf16, never a decoded value here)


def poisoned(n):
    """A device output of n rows [n, 256] uint16, every word POISON."""
    from numba import cuda
    return cuda.to_device(np.full((n, 256), POISON, dtype=np.uint16))


def compare(got, ref, allow_nan_payload=False):
    """Number of bf16 words that differ (NaN == NaN when allow_nan_payload); raises on any."""
    from engram_numba.bf16 import bf16_to_f32
    got = np.asarray(got)
    assert got.shape == ref.shape and got.dtype == np.uint16
    if allow_nan_payload:
        nan_ref, nan_got = np.isnan(bf16_to_f32(ref)), np.isnan(bf16_to_f32(got))
        bad = (nan_ref != nan_got) | (~nan_ref & (got != ref))
    else:
        bad = got != ref
    n_bad = int(bad.sum())
    if n_bad:
        r, c = np.argwhere(bad)[0]
        raise AssertionError(f"{n_bad} of {bad.size} words differ; first at [{r}, {c}]: "
                             f"got {got[r, c]:#06x}, want {ref[r, c]:#06x}")
    return n_bad


def assert_bits_equal(a, b):
    """Two float32 arrays bit for bit, or an error naming the first difference."""
    assert a.shape == b.shape and a.dtype == np.float32 and b.dtype == np.float32
    ua, ub = a.view(np.uint32), b.view(np.uint32)
    if not np.array_equal(ua, ub):
        i = tuple(np.argwhere(ua != ub)[0])
        raise AssertionError(f"bits differ at {i}: {a[i]!r} ({ua[i]:#010x}) vs {b[i]!r} ({ub[i]:#010x}); "
                             f"{int((ua != ub).sum())} values differ")
