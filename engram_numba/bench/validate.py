"""Checks run on every timed output before its time counts (against the numpy reference)."""
from __future__ import annotations

import numpy as np

from ..bf16 import bf16_to_f32, bf16_ulp_distance


def projection_agrees(got_words, ref_words) -> tuple[bool, dict]:
    """Two summations of the same bf16 product (a kernel against the float64 reference rounded
    once): within 1 bf16 ulp except where a sum cancels far below its terms, so > 1 ulp on under
    0.1% of elements and relative L2 under 2^-8 (a wrong kernel is off by ~1). -> (ok, figures)."""
    ulps = bf16_ulp_distance(got_words, ref_words)
    a, b = bf16_to_f32(got_words).astype(np.float64), bf16_to_f32(ref_words).astype(np.float64)
    rel_l2 = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    frac = float((ulps > 1).mean())
    return bool(frac < 1e-3 and rel_l2 < 2 ** -8), {"max_ulp": int(ulps.max()), "frac_gt_1ulp": frac,
                                                     "rel_l2": rel_l2}


def projection_reference_rows(x_words, wkv_words, token_rows) -> np.ndarray:
    """The float64 projection rounded once to bf16 (`projection_exact`) for some tokens only:
    the reference a timed kernel is checked against, cheap even at T = 4096."""
    from ..stages.proj.reference import projection_exact
    return projection_exact(np.asarray(x_words)[token_rows], np.asarray(wkv_words))


def gate_agrees(h0, h_new, dot, gate, kv_words, dot_ref) -> bool:
    """The update is h + gate*v from the kernel's own gate (fp32), and its dot is the reference
    dot up to summation order (the gate itself moves steeply near dot = 0, so it is not compared)."""
    T, hc, dim = h0.shape
    v = bf16_to_f32(kv_words[:, hc * dim:])
    want = h0 + gate[:, :, None] * v[:, None, :]
    return bool(np.allclose(h_new, want, rtol=2e-7, atol=1e-6) and
                np.allclose(dot, dot_ref, rtol=1e-4, atol=1e-4))
