"""Shapes of the Engram module and their validation.

`EngramConfig` is the one place that says what shape every stage works on. It validates
itself on construction, so a bad value fails here, with the field named, rather than as an
index error deep inside a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Constants of the released DeepSeek-V4.1-Flash checkpoint (docs/math.md, "Shapes").
RELEASED_DIM = 5120
RELEASED_HC = 4
RELEASED_LAYER_IDS = (1, 14)
RELEASED_MAX_NGRAM_SIZE = 4
RELEASED_N_HEADS = 8
RELEASED_HEAD_DIM = 256
ENGRAM_VOCAB_SIZE = 16_000_000  # where the prime search starts
COMPRESSED_VOCAB_SIZE = 99_092
RAW_VOCAB_SIZE = 129_280
RAW_PAD_ID = 2
NORM_EPS = 1e-20  # RMS eps inside the gate
GATE_CLAMP = 1e-6  # |dot| is clamped below by this before the signed square root

MAX_HC = 4
Q2K_BLOCK_VALUES = 256  # one Q2_K super-block decodes to exactly one table row


@dataclass(frozen=True)
class EngramConfig:
    """Shapes of one model's Engram module.

    dim            hidden size H (5120 in the release)
    hc             hyper-connection streams, 1..=4 (4 in the release)
    layer_ids      blocks that engram runs in front of, in model order ((1, 14))
    max_ngram_size largest n-gram; orders 2..max_ngram_size are hashed (4)
    n_heads        hash heads per order (8)
    head_dim       values in one table row (256; every table encoding stores 256-value rows)
    eps            RMS epsilon of the gate (1e-20)
    table_type     the tables' row encoding as the rows stage names it ("q2k", "q8_0", "fp8", ...;
                   "a/b" when layers differ), filled in by the loaders; "" for a config made by hand
    """

    dim: int
    hc: int
    layer_ids: tuple[int, ...]
    max_ngram_size: int = RELEASED_MAX_NGRAM_SIZE
    n_heads: int = RELEASED_N_HEADS
    head_dim: int = RELEASED_HEAD_DIM
    eps: float = NORM_EPS
    table_type: str = field(default="", compare=False)     # what the file stores, not a shape

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", check_layer_ids(self.layer_ids, "EngramConfig.layer_ids"))
        _positive_int("dim", self.dim)
        _positive_int("hc", self.hc)
        if not 1 <= self.hc <= MAX_HC:
            raise ValueError(f"EngramConfig.hc must be in 1..={MAX_HC}, got {self.hc}")
        if len(self.layer_ids) == 0:
            raise ValueError("EngramConfig.layer_ids must name at least one layer, got ()")
        for lid in self.layer_ids:
            if lid < 0:
                raise ValueError(f"EngramConfig.layer_ids must be non-negative, got {lid} in {self.layer_ids}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"EngramConfig.layer_ids must be unique, got {self.layer_ids}")
        _positive_int("max_ngram_size", self.max_ngram_size)
        if self.max_ngram_size < 2:
            raise ValueError(f"EngramConfig.max_ngram_size must be >= 2 (bigrams at least), got {self.max_ngram_size}")
        _positive_int("n_heads", self.n_heads)
        _positive_int("head_dim", self.head_dim)
        if not isinstance(self.table_type, str):
            raise ValueError(f"EngramConfig.table_type must be a string (a table encoding), got {self.table_type!r}")
        from .stages.rows.encodings import ENCODINGS
        row_encoded = not self.table_type or all(t in ENCODINGS for t in self.table_type.split("/"))
        if row_encoded and self.head_dim != Q2K_BLOCK_VALUES:
            what = f"{self.table_type} tables" if self.table_type else "the table encodings (q2k, q8_0, fp8, ...)"
            raise ValueError(
                f"EngramConfig.head_dim must be {Q2K_BLOCK_VALUES} for {what}: every row holds "
                f"{Q2K_BLOCK_VALUES} values, got {self.head_dim}"
            )
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0.0):
            raise ValueError(f"EngramConfig.eps must be a non-negative float, got {self.eps!r}")

    # Derived widths -------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_orders(self) -> int:
        """n-gram orders hashed: 2..max_ngram_size."""
        return self.max_ngram_size - 1

    @property
    def n_hash_cols(self) -> int:
        return self.n_orders * self.n_heads

    @property
    def proj_in(self) -> int:
        """Projection input width K = n_hash_cols * head_dim (6144 in the release)."""
        return self.n_hash_cols * self.head_dim

    @property
    def proj_out(self) -> int:
        """Projection output width N = dim * (hc + 1): hc keys, then one shared value."""
        return self.dim * (self.hc + 1)

    def layer_index(self, layer_id: int) -> int:
        """Position of `layer_id` in `layer_ids`; a clear error for an unknown id."""
        lid = check_layer_id(layer_id)
        try:
            return self.layer_ids.index(lid)
        except ValueError:
            raise ValueError(
                f"layer id {layer_id} is not an engram layer of this model (engram layers: {list(self.layer_ids)})"
            ) from None

    @classmethod
    def released(cls) -> "EngramConfig":
        """The DeepSeek-V4.1-Flash shapes."""
        return cls(dim=RELEASED_DIM, hc=RELEASED_HC, layer_ids=RELEASED_LAYER_IDS)


def check_layer_id(layer_id, what: str = "layer id") -> int:
    """An int from an integer layer id; 1.5, True or "1" are refused, not coerced."""
    if isinstance(layer_id, (bool, np.bool_)) or not isinstance(layer_id, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {layer_id!r} ({type(layer_id).__name__})")
    return int(layer_id)


def check_layer_ids(layer_ids, what: str = "layer_ids") -> tuple[int, ...]:
    """A tuple of ints from integer layer ids; 1.5, True or "1" are refused, not coerced."""
    if isinstance(layer_ids, (str, bytes)):     # would be read character by character
        raise ValueError(f"{what} must be a sequence of integers, got the string {layer_ids[:40]!r}")
    try:
        items = list(layer_ids)
    except TypeError:
        raise ValueError(f"{what} must be a sequence of integers, got {type(layer_ids).__name__}") from None
    out = []
    for x in items:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"{what} must hold integers, got {x!r} ({type(x).__name__}) in {items}")
        out.append(int(x))
    return tuple(out)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"EngramConfig.{name} must be a positive integer, got {value!r}")
