"""The hash in plain Python integers: the readable version the @njit hasher is tested against."""
from __future__ import annotations

import numpy as np

from .cpu import DEAD, check_token_ids, ngram_windows
from .tables import EngramHashTables


def hash_reference(tables: EngramHashTables, token_ids, token_mask=None, history=()) -> np.ndarray:
    """Row ids [T, L, C] of the next T tokens of a sequence, in plain Python integers.

    history: compressed ids of the positions before these tokens (DEAD for masked ones), so a
    decode step can look back into its prefill.
    """
    ids, mask = check_token_ids(token_ids, token_mask, tables.token_map.size, len(history))
    compressed = [int(tables.token_map[i]) for i in ids]
    if mask is not None:
        compressed = [c if live else DEAD for c, live in zip(compressed, mask)]
    seq = np.array([int(c) for c in history] + compressed, dtype=np.int64)
    M, heads = tables.max_ngram_size, tables.n_heads
    # The n-gram windows: window[t, s] is the token s places back from this call's token t.
    # Blocking is sticky: once a window reaches the sequence start or a dead token, every older
    # slot takes the pad (the hash stage's one definition, `cpu.ngram_window`).
    windows = np.empty((len(ids), M), dtype=np.int64)
    ngram_windows(seq, len(history), len(ids), M, int(tables.pad_id), windows)
    out = np.empty((len(ids), tables.n_layers, tables.n_hash_cols), dtype=np.int64)
    for t in range(len(ids)):
        tok = [int(x) for x in windows[t]]
        for li in range(tables.n_layers):
            m = [int(x) for x in tables.multipliers[li]]
            rolling = tok[0] * m[0]
            for i in range(1, M):  # after step i the fold covers the (i+1)-gram
                rolling ^= tok[i] * m[i]
                for h in range(heads):
                    col = (i - 1) * heads + h
                    prime = int(tables.primes[li, i - 1, h])
                    out[t, li, col] = rolling % prime + int(tables.offsets[li, col])
    return out
