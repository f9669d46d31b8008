"""The exact reducers behind the corpus statistics (`engram_numba.analysis.streaming`).

Every fp32 value is M * 2^E with an integer M < 2^24: `reduce_layer_acc` adds the significands
(and their squares, split in two) of one chunk's gate and dot per exponent bin in int64 bins that
last a whole run, and `fold_acc` (through `fold_sums`) folds them into Python integers once, when
read, so sums and sums of squares are exact and merge bit for bit. The same pass fills the fine
gate histogram, the clamp count and the per-token fixed-point gate sums; `reduce_layer_rows` marks
the layer's row bitmap in the same call (`mark_live_rows`), and `prepare_chunk` checks a chunk's
ids (`first_bad_row` for the row ids), counts its tokens and puts its gates in fixed point in one
call. `popcount_range` counts a bitmap's rows. Every @njit one releases the GIL, so the corpus
reducer runs them side by side on threads. (The per-chunk reducers they replaced are the
references tests/test_reducers.py checks them against.)
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
from numba import njit

FINE_BINS = 100_000                 # fine histogram bins over [0, 1]: quantile resolution 1e-5
FIXED_POINT_BITS = 32               # per-key gate sums are integer multiples of 2^-32
_FIXED_POINT_SCALE = float(1 << FIXED_POINT_BITS)       # a constant to the @njit code that reads it
EXP_BINS = 256                      # fp32 biased exponents (0 and 1 share: denormals)


# The reducer's per-layer sums kept across chunks: ACC_PARTS [hc, EXP_BINS] int64 bins a layer (gate
# significands; their squares split at bit 24 into a high and a low part; the same for the dot;
# |dot|). Every bin then grows by < 2^24 a value, so ACC_LIMIT values fit an int64 and the bins are
# folded into the exact Python integers only when read (`fold_acc`), not once a chunk.
ACC_PARTS = 7                       # g1, g2 high, g2 low, d1, d2 high, d2 low, |d|
ACC_LIMIT = 1 << 38                 # values (per layer and stream) the bins hold before a fold


@njit(cache=True, nogil=True, inline="always")
def _add_split(bits, acc, k, c):  # pragma: no cover - jitted
    """Add one fp32 value (its bits) to acc[k] (its signed significand), acc[k + 1] and acc[k + 2]
    (its square's bits 24.. and 0..23) in column c; returns (exponent bin, significand)."""
    e = (bits >> 23) & 0xFF
    m = np.int64(bits & 0x7FFFFF)
    if e == 0:
        e = 1                                                 # denormals share the first bin
    else:
        m |= 0x800000
    if bits >> 31:
        acc[k, c, e] -= m
    else:
        acc[k, c, e] += m
    mm = m * m
    acc[k + 1, c, e] += mm >> 24
    acc[k + 2, c, e] += mm & 0xFFFFFF
    return e, m


@njit(cache=True, nogil=True)
def reduce_layer_acc(gate_bits, dot_bits, gate, dot, live, cids, acc, counts, minmax, fine, tok_sum, fine_bins,
                     clamp):  # pragma: no cover - jitted
    """One layer of one chunk into acc [ACC_PARTS, hc, 256] int64 kept across chunks (the sums of
    squares split at bit 24, so nothing overflows before ACC_LIMIT values), with its counts,
    extremes, fine histogram and per-token sums; once folded (`fold_acc`), the exact moments."""
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
                _add_split(gate_bits[t, c], acc, 0, c)
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
            e, m = _add_split(dot_bits[t, c], acc, 3, c)
            acc[6, c, e] += m
            dv = np.float64(d)
            if dv < minmax[c, 2]:
                minmax[c, 2] = dv
            if dv > minmax[c, 3]:
                minmax[c, 3] = dv
            if abs(dv) < clamp:
                counts[c, 4] += 1


@njit(cache=True, nogil=True)
def reduce_layer_rows(gate_bits, dot_bits, gate, dot, live, cids, acc, counts, minmax, fine, tok_sum, fine_bins,
                      clamp, bitmap, row_ids, li):  # pragma: no cover - jitted
    """`reduce_layer_acc`, then `mark_live_rows` of layer li into bitmap (none when it is empty):
    one layer of one chunk in one call (one release of the GIL, not two)."""
    reduce_layer_acc(gate_bits, dot_bits, gate, dot, live, cids, acc, counts, minmax, fine, tok_sum, fine_bins, clamp)
    if bitmap.size:
        mark_live_rows(bitmap, row_ids, live, li)


@njit(cache=True, nogil=True)
def prepare_chunk(token_ids, live, token_map, n_raw, cids, n_compressed, row_ids, n_rows, check_rows, gates, q,
                  tok_count, raw_count):  # pragma: no cover - jitted
    """One chunk's checks, compressed ids, token counts and fixed-point gates in one call.

    In order: every token id in [0, n_raw) (code 1), cids [T] = token_map[token_ids], every live
    token's compressed id in [0, n_compressed) (code 2), with check_rows every live token's row ids
    row_ids [T, L, C] below n_rows [L] (code 3, `first_bad_row`). A failed check returns (code,
    token, live tokens) before anything is written but cids. Then tok_count[cid] and
    raw_count[id] += 1 for every live token and, when q [T, L, hc] has rows, q[t, l, c] = gates[l][t, c]
    in fixed point (round(g * 2^32); 0 for a dead token or a value that is not finite; gates a tuple
    of [T, hc] fp32); returns (0, -1, live tokens)."""
    T = token_ids.shape[0]
    n_live = 0
    for t in range(T):
        if live[t]:
            n_live += 1
        if token_ids[t] < 0 or token_ids[t] >= n_raw:
            return 1, t, n_live
    for t in range(T):
        cids[t] = token_map[token_ids[t]]
    for t in range(T):
        if live[t] and (cids[t] < 0 or cids[t] >= n_compressed):
            return 2, t, n_live
    if check_rows:
        bad = first_bad_row(row_ids, live, n_rows)
        if bad >= 0:
            return 3, bad, n_live
    for t in range(T):
        if live[t]:
            tok_count[cids[t]] += 1
            raw_count[token_ids[t]] += 1
    if q.shape[0]:
        scale = _FIXED_POINT_SCALE
        for li in range(len(gates)):
            gate = gates[li]
            for t in range(T):
                for c in range(gate.shape[1]):
                    g = gate[t, c]
                    if live[t] and np.isfinite(g):
                        q[t, li, c] = np.int64(np.rint(np.float64(g) * scale))
                    else:
                        q[t, li, c] = 0
    return 0, -1, n_live


@njit(cache=True, nogil=True)
def mark_live_rows(bitmap, row_ids, live, li):  # pragma: no cover - jitted
    """Set bit r of the byte bitmap (bit r&7 of byte r>>3) for layer li's ids r = row_ids[t, li, :]
    of every live token t (row_ids [T, L, C], checked by first_bad_row)."""
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


def fold_acc(acc: np.ndarray) -> list[list[int]]:
    """acc [ACC_PARTS, hc, 256] (`reduce_layer_acc`) -> [g1, g2, d1, d2, dabs], each per stream the
    Python int `fold_sums` gives for the same values: sum * 2^149 (squares: * 2^298)."""
    g2 = [(h << 24) + lo for h, lo in zip(fold_sums(acc[1], 2), fold_sums(acc[2], 2))]
    d2 = [(h << 24) + lo for h, lo in zip(fold_sums(acc[4], 2), fold_sums(acc[5], 2))]
    return [fold_sums(acc[0], 1), g2, fold_sums(acc[3], 1), d2, fold_sums(acc[6], 1)]


def exact_mean(s1: int, n: int, power_shift: int = 149) -> float:
    return float(Fraction(s1, n << power_shift)) if n else float("nan")


def exact_m2(s1: int, s2: int, n: int) -> float:
    """Sum of squared deviations from exact sum (x 2^149) and sum of squares (x 2^298)."""
    if not n:
        return float("nan")
    return float(Fraction(n * s2 - s1 * s1, n << 298))
