"""The hash constants (multipliers, primes, offsets, token map, pad) and their public recipes.

`EngramHashTables` holds every constant the hash needs, read from a file or built with the
recipes below (docs/math.md, "How the constants are made"); `validate` checks that they agree
with each other and with the tables they index.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...config import ENGRAM_VOCAB_SIZE, check_layer_id, check_layer_ids

INT64_MAX = np.iinfo(np.int64).max


# Constant recipes ----------------------------------------------------------------------------

def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin: these 12 bases decide every n < 3.3e24, far past int64."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime_above(n: int) -> int:
    """Smallest prime strictly greater than n."""
    c = n + 1
    while not _is_prime(c):
        c += 1
    return c


def build_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd multipliers [layers, max_ngram_size] int64, seeded by the layer *id* (docs/math.md, section 3)."""
    bound = max(1, (INT64_MAX // int(compressed_vocab_size)) // 2)
    out = np.empty((len(layer_ids), max_ngram_size), dtype=np.int64)
    for i, lid in enumerate(layer_ids):
        rng = np.random.default_rng(10007 * int(lid))
        out[i] = rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
    return out


def build_primes(n_layers: int, max_ngram_size: int, n_heads: int, engram_vocab_size: int) -> np.ndarray:
    """Primes [layers, orders, heads] int64: layers, then orders, then heads; each the smallest
    prime above the previous search point that no earlier column took, with the search point
    reset to engram_vocab_size - 1 at each order. The net effect is one run of consecutive primes.
    """
    taken: set[int] = set()
    out = np.empty((n_layers, max_ngram_size - 1, n_heads), dtype=np.int64)
    for li in range(n_layers):
        for order in range(max_ngram_size - 1):
            point = int(engram_vocab_size) - 1
            for h in range(n_heads):
                point = next_prime_above(point)
                while point in taken:
                    point = next_prime_above(point)
                taken.add(point)
                out[li, order, h] = point
    return out


def offsets_from_primes(primes: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums of each layer's primes in column order -> [layers, n_hash_cols]."""
    flat = np.asarray(primes, dtype=np.int64).reshape(primes.shape[0], -1)
    out = np.zeros_like(flat)
    out[:, 1:] = np.cumsum(flat, axis=1)[:, :-1]
    return out


# The tables ----------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class EngramHashTables:
    """Every constant the hash needs.

    layer_ids    engram layer ids, in model order
    multipliers  [layers, max_ngram_size] int64, odd
    primes       [layers, max_ngram_size-1, n_heads] int64 (one per hash column)
    offsets      [layers, n_hash_cols] int64, exclusive prefix sums of the layer's primes
    token_map    [raw_vocab] int64, raw token id -> compressed id
    pad_id       compressed pad id
    """

    layer_ids: tuple[int, ...]
    multipliers: np.ndarray
    primes: np.ndarray
    offsets: np.ndarray
    token_map: np.ndarray
    pad_id: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", check_layer_ids(self.layer_ids))
        for name in ("multipliers", "primes", "offsets", "token_map"):
            raw = np.asarray(getattr(self, name))
            if raw.size and not np.issubdtype(raw.dtype, np.integer):
                raise ValueError(f"{name} must be an integer array, got dtype {raw.dtype}")
            arr = np.ascontiguousarray(raw, dtype=np.int64)
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "pad_id", int(self.pad_id))
        self._check_shapes()

    # shapes
    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def max_ngram_size(self) -> int:
        return self.multipliers.shape[1]

    @property
    def n_heads(self) -> int:
        return self.primes.shape[2]

    @property
    def n_hash_cols(self) -> int:
        return self.primes.shape[1] * self.primes.shape[2]

    @property
    def compressed_vocab_size(self) -> int:
        return int(self.token_map.max()) + 1

    @property
    def table_rows(self) -> np.ndarray:
        """Rows each layer's table must have: the sum of its primes. [layers] int64."""
        return self.primes.reshape(self.n_layers, -1).sum(axis=1)

    def _check_shapes(self) -> None:
        L = len(self.layer_ids)
        if self.multipliers.ndim != 2 or self.multipliers.shape[0] != L:
            raise ValueError(f"multipliers must be [layers={L}, max_ngram_size], got shape {self.multipliers.shape}")
        M = self.multipliers.shape[1]
        if M < 2:
            raise ValueError(f"multipliers must have max_ngram_size >= 2 columns, got {M}")
        if self.primes.ndim != 3 or self.primes.shape[:2] != (L, M - 1):
            raise ValueError(
                f"primes must be [layers={L}, orders={M - 1}, heads], got shape {self.primes.shape}")
        cols = self.primes.shape[1] * self.primes.shape[2]
        if self.offsets.shape != (L, cols):
            raise ValueError(f"offsets must be [layers={L}, n_hash_cols={cols}], got shape {self.offsets.shape}")
        if self.token_map.ndim != 1 or self.token_map.size == 0:
            raise ValueError(f"token_map must be a non-empty 1-D array, got shape {self.token_map.shape}")

    def validate(self, table_rows=None) -> "EngramHashTables":
        """Check the constants are self-consistent; raise ValueError naming what is wrong.

        table_rows: optional per-layer row counts of the tables these ids will index.
        """
        if (self.multipliers <= 0).any() or (self.multipliers % 2 == 0).any():
            bad = np.argwhere((self.multipliers <= 0) | (self.multipliers % 2 == 0))[0]
            raise ValueError(
                f"multiplier [layer {self.layer_ids[bad[0]]}][shift {bad[1]}] = "
                f"{self.multipliers[tuple(bad)]} must be odd and positive")
        if (self.primes <= 1).any():
            raise ValueError(f"primes must all be > 1, got min {self.primes.min()}")
        for li, lid in enumerate(self.layer_ids):
            for p in self.primes[li].ravel():
                if not _is_prime(int(p)):
                    raise ValueError(f"primes of layer {lid} contain {int(p)}, which is not prime")
        expect = offsets_from_primes(self.primes)
        if not np.array_equal(expect, self.offsets):
            li, col = np.argwhere(expect != self.offsets)[0]
            raise ValueError(
                f"offset [layer {self.layer_ids[li]}][col {col}] = {self.offsets[li, col]} but the exclusive "
                f"prefix sum of that layer's primes is {expect[li, col]}")
        tmin = int(self.token_map.min())
        if tmin < 0:
            raise ValueError(f"token_map holds a negative compressed id ({tmin}) at raw id {int(np.argmin(self.token_map))}")
        V = self.compressed_vocab_size
        if not 0 <= self.pad_id < V:
            raise ValueError(f"pad_id {self.pad_id} is outside the compressed vocab [0, {V})")
        # Every product tok * multiplier must stay below 2^63 for int64 and uint64 to agree.
        if int(self.multipliers.max()) > INT64_MAX // max(V - 1, 1):
            raise ValueError(
                f"largest multiplier {int(self.multipliers.max())} times largest compressed id {V - 1} "
                f"overflows int64")
        if table_rows is not None:
            table_rows = [int(r) for r in table_rows]
            if len(table_rows) != self.n_layers:
                raise ValueError(f"got {len(table_rows)} table row counts for {self.n_layers} layers")
            for lid, want, have in zip(self.layer_ids, self.table_rows, table_rows):
                if int(want) != have:
                    raise ValueError(
                        f"layer {lid}: its primes sum to {int(want)} rows but its table has {have} rows")
        return self

    @classmethod
    def build(cls, layer_ids, max_ngram_size: int, n_heads: int, engram_vocab_size: int = ENGRAM_VOCAB_SIZE,
              token_map=None, pad_id: int = 2) -> "EngramHashTables":
        """Constants from the public recipe (docs/math.md, section 3). The compressed vocab size, which
        bounds the multipliers, is token_map.max() + 1."""
        if token_map is None:
            raise ValueError("build() needs a token_map (raw id -> compressed id)")
        token_map = np.asarray(token_map)
        if not np.issubdtype(token_map.dtype, np.integer):
            raise ValueError(f"token_map must be an integer array, got dtype {token_map.dtype}")
        layer_ids = check_layer_ids(layer_ids)
        primes = build_primes(len(layer_ids), max_ngram_size, n_heads, engram_vocab_size)
        tables = cls(
            layer_ids=layer_ids,
            multipliers=build_multipliers(layer_ids, max_ngram_size, int(token_map.max()) + 1),
            primes=primes,
            offsets=offsets_from_primes(primes),
            token_map=token_map,
            pad_id=pad_id,
        )
        return tables.validate()

    def layer_index(self, layer_id: int) -> int:
        try:
            return self.layer_ids.index(check_layer_id(layer_id))
        except ValueError:
            raise ValueError(f"layer id {layer_id} is not one of the hash tables' layers {list(self.layer_ids)}") from None
