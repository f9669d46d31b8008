"""The @njit hasher (the hash stage's cpu backend; the hash has no GPU version, by design).

Token ids become compressed ids through `token_map`; every position's n-gram window (the
current token and up to max_ngram_size-1 tokens before it) is folded with XOR of per-shift
multiplier products, and each prefix of the fold (the 2-gram, 3-gram, ...) is reduced modulo
one prime per hash head. The result indexes that layer's table (docs/math.md, "Hash").

`EngramHasher` hashes one sequence, keeping its history so that decode steps look back into the
prefill. The loop is `@njit`; `reference.hash_reference` is the readable version it is tested
against.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .tables import EngramHashTables

DEAD = -1  # compressed id of a masked (dead) position in the history


# The n-gram window: the one place that says which tokens a position's hash folds ---------------

@njit(cache=True, nogil=True)
def ngram_window(history, p, pad, tok):  # pragma: no cover - jitted
    """tok[s] = the compressed id s places before position p of `history` (s = 0..len(tok)-1),
    or `pad` once the window is blocked: blocking is sticky, so once the window reaches the
    sequence start or a dead position (DEAD, or any negative id) every older slot is pad too
    (docs/math.md, section 3.1)."""
    blocked = False
    for s in range(tok.shape[0]):
        if not blocked:
            if p < s or history[p - s] < 0:
                blocked = True
        tok[s] = pad if blocked else history[p - s]


@njit(cache=True, nogil=True)
def ngram_windows(history, start, count, max_ngram, pad, out):  # pragma: no cover - jitted
    """out[t, :max_ngram] = the n-gram window of position start+t of `history` (`ngram_window`),
    for t = 0..count-1."""
    for t in range(count):
        ngram_window(history, start + t, pad, out[t, :max_ngram])


# The hasher ----------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def hash_positions(history, start, count, multipliers, primes, offsets, pad, out):  # pragma: no cover - jitted
    """Hash positions start..start+count-1 of `history` (compressed ids, DEAD for masked) into
    out[0:count, layers, cols]."""
    n_layers, M = multipliers.shape
    heads = primes.shape[2]
    tok = np.empty(M, dtype=np.int64)
    for t in range(count):
        ngram_window(history, start + t, pad, tok)
        for li in range(n_layers):
            rolling = tok[0] * multipliers[li, 0]
            for i in range(1, M):
                rolling = rolling ^ (tok[i] * multipliers[li, i])
                for h in range(heads):
                    col = (i - 1) * heads + h
                    out[t, li, col] = rolling % primes[li, i - 1, h] + offsets[li, col]


def check_token_ids(token_ids, token_mask, vocab_size: int, first_position: int = 0):
    """Validate one call's ids and mask; returns (ids int64 [T], mask bool [T] or None).

    Raises ValueError naming the first bad token's position and value."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D (one sequence), got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    # Range-check in the caller's dtype: casting first would wrap a huge uint64 to a negative.
    bad = (ids >= vocab_size) if ids.dtype.kind == "u" else ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"token id {int(ids[i])} at position {first_position + i} (index {i} of this call) is outside "
            f"the token map's range [0, {vocab_size})")
    ids = ids.astype(np.int64, copy=False)
    mask = None
    if token_mask is not None:
        mask = np.asarray(token_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"token_mask shape {mask.shape} does not match token_ids shape {ids.shape}")
        if mask.dtype != np.bool_:
            raise ValueError(f"token_mask must be bool (True = live token), got dtype {mask.dtype}")
    return ids, mask


class EngramHasher:
    """Hashes one sequence into row ids, keeping its history of compressed ids.

    >>> hasher = EngramHasher(tables)
    >>> ids = hasher.hash(prompt)          # [T, n_layers, n_hash_cols] int64
    >>> step = hasher.hash([next_token])   # looks back into the prompt

    Prefill in one call, in chunks, or followed by one-token decode steps gives identical ids.
    """

    def __init__(self, tables: EngramHashTables, capacity: int = 1024):
        if not isinstance(tables, EngramHashTables):
            raise TypeError(f"tables must be an EngramHashTables (model.hash_tables), got {type(tables).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an integer, got {type(capacity).__name__}")
        self.tables = tables
        self._history = np.empty(max(int(capacity), 16), dtype=np.int64)
        self._len = 0

    @property
    def position(self) -> int:
        """Tokens hashed so far in this sequence (the next token's position)."""
        return self._len

    @property
    def history(self) -> np.ndarray:
        """Compressed ids seen so far (DEAD = -1 for masked positions); a read-only view."""
        view = self._history[: self._len]
        view.setflags(write=False)
        return view

    def reset(self) -> None:
        """Start a new sequence."""
        self._len = 0

    def hash(self, token_ids, token_mask=None, *, out=None) -> np.ndarray:
        """Row ids [T, n_layers, n_hash_cols] int64 for the next T tokens of this sequence.

        token_mask: optional bool [T], False marks a dead token (its own ids are all pad-hashed
        and no later n-gram reaches across it). Bad ids raise before the history changes.
        out: optional writeable C-contiguous int64 [T, n_layers, n_hash_cols] to write the ids
        into (a pinned upload buffer, say); checked, like the ids, before anything is written.
        """
        t = self.tables
        ids, mask = check_token_ids(token_ids, token_mask, t.token_map.size, self._len)
        T = ids.size
        shape = (T, t.n_layers, t.n_hash_cols)
        if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.int64 and out.shape == shape
                                    and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError(f"out must be a writeable C-contiguous int64 array of shape {shape}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
        compressed = t.token_map[ids]
        if mask is not None:
            compressed = np.where(mask, compressed, DEAD)
        need = self._len + T
        if need > self._history.size:
            grown = np.empty(max(need, 2 * self._history.size), dtype=np.int64)
            grown[: self._len] = self._history[: self._len]
            self._history = grown
        self._history[self._len: need] = compressed
        if out is None:
            out = np.empty(shape, dtype=np.int64)
        hash_positions(self._history, self._len, T, t.multipliers, t.primes, t.offsets, t.pad_id, out)
        self._len = need
        return out


def hash_tokens(tables: EngramHashTables, token_ids, token_mask=None) -> np.ndarray:
    """Row ids of a whole sequence in one call (a fresh `EngramHasher`)."""
    if not isinstance(tables, EngramHashTables):
        raise TypeError(f"tables must be an EngramHashTables (model.hash_tables), got {type(tables).__name__}")
    return EngramHasher(tables, capacity=int(np.asarray(token_ids).size)).hash(token_ids, token_mask)
