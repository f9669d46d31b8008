"""The exact reducers behind the corpus statistics (`engram_numba.analysis.streaming`).

Every fp32 value is M * 2^E with an integer M < 2^24: `reduce_layer` adds the significands (and
their squares) of one chunk's gate and dot per exponent bin in int64, and `fold_sums` folds the bins
into Python integers, so sums and sums of squares are exact and merge bit for bit. The same pass
fills the fine gate histogram, the clamp count and the per-token fixed-point gate sums.
`mark_rows` / `mark_live_rows` / `popcount_range` keep the bitmap of row ids a table served;
`count_live` and `fixed_point_gates` are the per-token counts and the context tables' gate values.
Every one releases the GIL, so the corpus reducer runs them side by side on a thread pool.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
from numba import njit

FINE_BINS = 100_000                 # fine histogram bins over [0, 1]: quantile resolution 1e-5
FIXED_POINT_BITS = 32               # per-key gate sums are integer multiples of 2^-32
_FIXED_POINT_SCALE = float(1 << FIXED_POINT_BITS)       # a constant to the @njit code that reads it
MAX_CALL_TOKENS = 32_768            # the reducer's int64 squares stay exact for this many values a call
EXP_BINS = 256                      # fp32 biased exponents (0 and 1 share: denormals)


@njit(cache=True, nogil=True, inline="always")
def _add_exact(bits, s1, s2, c):  # pragma: no cover - jitted
    """Add one fp32 value (its bits) to the exponent-binned integer sums s1 (of the signed
    significand) and s2 (of its square) of column c; returns (exponent bin, significand)."""
    e = (bits >> 23) & 0xFF
    m = np.int64(bits & 0x7FFFFF)
    if e == 0:
        e = 1                                                 # denormals share the first bin
    else:
        m |= 0x800000
    if bits >> 31:
        s1[c, e] -= m
    else:
        s1[c, e] += m
    s2[c, e] += m * m
    return e, m


@njit(cache=True, nogil=True)
def reduce_layer(gate_bits, dot_bits, gate, dot, live, cids, g1, g2, d1, d2, dabs, counts, minmax,
                  fine, tok_sum, fine_bins, clamp):  # pragma: no cover - jitted
    """One layer of one chunk: gate, dot [T, hc] (fp32, and their uint32 bits), live [T],
    cids [T] compressed ids. Exponent-binned integer sums into g1/g2/d1/d2/dabs [hc, 256] int64,
    counts [hc, 6] int64 (n, n_nonfinite, masked_nonzero, n_dot, n_clamped, n_dot_nonfinite),
    minmax [hc, 4] f64 (gate min, max, dot min, max), fine [hc, fine_bins], tok_sum [hc, V]."""
    T, hc = gate.shape
    scale = _FIXED_POINT_SCALE
    for t in range(T):
        for c in range(hc):
            g = gate[t, c]
            if not live[t]:
                if g != 0.0:
                    counts[c, 2] += 1
                continue
            if not np.isfinite(g):
                counts[c, 1] += 1
            else:
                counts[c, 0] += 1
                e, m = _add_exact(gate_bits[t, c], g1, g2, c)
                gv = np.float64(g)
                if gv < minmax[c, 0]:
                    minmax[c, 0] = gv
                if gv > minmax[c, 1]:
                    minmax[c, 1] = gv
                b = np.int64(gv * fine_bins)
                if b < 0:
                    b = 0
                elif b >= fine_bins:
                    b = fine_bins - 1
                fine[c, b] += 1
                tok_sum[c, cids[t]] += np.int64(np.rint(gv * scale))
            d = dot[t, c]
            if not np.isfinite(d):
                counts[c, 5] += 1
                continue
            counts[c, 3] += 1
            e, m = _add_exact(dot_bits[t, c], d1, d2, c)
            dabs[c, e] += m
            dv = np.float64(d)
            if dv < minmax[c, 2]:
                minmax[c, 2] = dv
            if dv > minmax[c, 3]:
                minmax[c, 3] = dv
            if abs(dv) < clamp:
                counts[c, 4] += 1


@njit(cache=True, nogil=True)
def mark_rows(bitmap, ids):  # pragma: no cover - jitted
    """Set bit ids[i] of the byte bitmap (bit i&7 of byte i>>3) for every id."""
    for i in range(ids.size):
        r = ids[i]
        bitmap[r >> 3] |= np.uint8(1 << (r & 7))


@njit(cache=True, nogil=True)
def mark_live_rows(bitmap, row_ids, live, li):  # pragma: no cover - jitted
    """mark_rows of layer li's ids row_ids[t, li, :] for every live token t (row_ids [T, L, C],
    checked by first_bad_row)."""
    for t in range(row_ids.shape[0]):
        if live[t]:
            for c in range(row_ids.shape[2]):
                r = row_ids[t, li, c]
                bitmap[r >> 3] |= np.uint8(1 << (r & 7))


@njit(cache=True, nogil=True)
def first_bad_row(row_ids, live, n_rows):  # pragma: no cover - jitted
    """The first live token t with an id row_ids[t, l, :] outside [0, n_rows[l]) (row_ids [T, L, C]),
    or -1."""
    for t in range(row_ids.shape[0]):
        if live[t]:
            out = False
            for li in range(row_ids.shape[1]):
                n = np.uint64(n_rows[li])
                for c in range(row_ids.shape[2]):
                    out |= np.uint64(row_ids[t, li, c]) >= n          # a negative id wraps past n
            if out:
                return t
    return -1


@njit(cache=True, nogil=True)
def count_live(counts, ids, live):  # pragma: no cover - jitted
    """counts[ids[t]] += 1 for every live t (ids checked in [0, counts.size))."""
    for t in range(ids.shape[0]):
        if live[t]:
            counts[ids[t]] += 1


@njit(cache=True, nogil=True)
def fixed_point_gates(gate, live, q, li):  # pragma: no cover - jitted
    """q[t, li, c] = the gate gate[t, c] in fixed point (round(g * 2^32)), 0 for a dead token or a
    value that is not finite (gate [T, hc] fp32, q [T, L, hc] int64)."""
    scale = _FIXED_POINT_SCALE
    for t in range(gate.shape[0]):
        for c in range(gate.shape[1]):
            g = gate[t, c]
            if live[t] and np.isfinite(g):
                q[t, li, c] = np.int64(np.rint(np.float64(g) * scale))
            else:
                q[t, li, c] = 0


@njit(cache=True, nogil=True)
def popcount_range(bitmap, lo, hi):  # pragma: no cover - jitted
    """Set bits in [lo, hi)."""
    n = 0
    for r in range(lo, hi):
        if (bitmap[r >> 3] >> (r & 7)) & 1:
            n += 1
    return n


# Exact sums -----------------------------------------------------------------------------------

def fold_sums(acc: np.ndarray, power: int) -> list[int]:
    """[hc, 256] int64 exponent-binned sums -> per stream, a Python int = sum * 2^(power*149)."""
    out = []
    for row in acc:
        e = np.flatnonzero(row)
        out.append(sum([v << s for v, s in zip(row[e].tolist(), (power * (e - 1)).tolist())]))
    return out


def exact_mean(s1: int, n: int, power_shift: int = 149) -> float:
    return float(Fraction(s1, n << power_shift)) if n else float("nan")


def exact_m2(s1: int, s2: int, n: int) -> float:
    """Sum of squared deviations from exact sum (x 2^149) and sum of squares (x 2^298)."""
    if not n:
        return float("nan")
    return float(Fraction(n * s2 - s1 * s1, n << 298))
