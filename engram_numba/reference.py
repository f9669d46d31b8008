"""The numpy reference of every Engram stage: the teaching version and the yardstick.

Written to be read, not to be fast. Every float reduction runs in one fixed order (sequential,
left to right, in fp32, via `np.cumsum`), so the reference is deterministic and any other
backend's distance from it can be stated in ulps. Nothing here is compiled, so nothing here can
be fast-math'd.

Stages, with the shapes they take and give (T tokens, L engram layers, C = n_hash_cols):
    hash_reference   token ids [T]                -> row ids [T, L, C] int64
    rows_reference   Q2_K blocks [n, 84] uint8    -> bf16 rows [n, 256] uint16 words
    projection_reference  x [T, K] bf16, wkv [N, K] bf16 -> kv [T, N] bf16    (K = C*256, N = dim*(hc+1))
    gate_reference   highway [T, hc, dim] fp32, kv -> new highway, dot [T, hc], gate [T, hc]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bf16 import bf16_to_f32, f32_to_bf16, round_f32_through_bf16
from .config import GATE_CLAMP, NORM_EPS
from .hash import DEAD, EngramHashTables, check_token_ids
from .q2k import dequantize

RESIDUALS = ("fp32", "bf16")


# 1. Hash ------------------------------------------------------------------------------------

def hash_reference(tables: EngramHashTables, token_ids, token_mask=None, history=()) -> np.ndarray:
    """Row ids [T, L, C] of the next T tokens of a sequence, in plain Python integers.

    history: compressed ids of the positions before these tokens (DEAD for masked ones), so a
    decode step can look back into its prefill.
    """
    ids, mask = check_token_ids(token_ids, token_mask, tables.token_map.size, len(history))
    compressed = [int(tables.token_map[i]) for i in ids]
    if mask is not None:
        compressed = [c if live else DEAD for c, live in zip(compressed, mask)]
    seq = [int(c) for c in history] + compressed
    M, heads = tables.max_ngram_size, tables.n_heads
    out = np.empty((len(ids), tables.n_layers, tables.n_hash_cols), dtype=np.int64)
    for t in range(len(ids)):
        p = len(history) + t
        # The n-gram window: tok[s] is the token s places back. Blocking is sticky: once the
        # window reaches the sequence start or a dead token, every older slot takes the pad.
        tok, blocked = [], False
        for s in range(M):
            blocked = blocked or p < s or seq[p - s] == DEAD
            tok.append(tables.pad_id if blocked else seq[p - s])
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


# 2. Rows: gather and dequantise ---------------------------------------------------------------

def gather_reference(table_blocks: np.ndarray, row_ids) -> np.ndarray:
    """Raw Q2_K blocks [n, 84] of the given row ids from a [rows, 84] table (or memory map)."""
    row_ids = np.asarray(row_ids, dtype=np.int64).ravel()
    n_rows = table_blocks.shape[0]
    bad = (row_ids < 0) | (row_ids >= n_rows)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"row id {int(row_ids[i])} at index {i} is outside the table's [0, {n_rows}) rows")
    return np.asarray(table_blocks[row_ids], dtype=np.uint8)


def rows_reference(blocks: np.ndarray) -> np.ndarray:
    """Q2_K blocks [n, 84] -> the projection's input rows, bf16 words [n, 256]."""
    return f32_to_bf16(dequantize(blocks))


def flatten_rows(rows_bf16: np.ndarray, n_tokens: int) -> np.ndarray:
    """[T*C, 256] rows -> projection input x [T, C*256]; element col*256 + d of a token's x is
    value d of its column-col row."""
    return rows_bf16.reshape(n_tokens, -1)


# 3. Projection -------------------------------------------------------------------------------

def _sequential_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis in fp32, strictly left to right."""
    if v.shape[-1] == 0:
        return np.zeros(v.shape[:-1], dtype=np.float32)
    return np.cumsum(v, axis=-1, dtype=np.float32)[..., -1]


def projection_reference(x_bf16: np.ndarray, wkv_bf16: np.ndarray, token_block: int = 8) -> np.ndarray:
    """kv = bf16(x @ wkv^T): x [T, K] and wkv [N, K] bf16 words; fp32 accumulation over k in
    order 0..K-1 (each bf16 x bf16 product is exact in fp32, so only the sums round)."""
    x = bf16_to_f32(x_bf16)      # [T, K]
    w = bf16_to_f32(wkv_bf16)    # [N, K]
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"projection needs x [T, K] and wkv [N, K], got {x.shape} and {w.shape}")
    T, N = x.shape[0], w.shape[0]
    acc = np.empty((T, N), dtype=np.float32)
    # Blocks of tokens and outputs keep the [t, n, k] product array small.
    n_block = max(1, (1 << 22) // max(1, token_block * w.shape[1]))
    for t0 in range(0, T, token_block):
        for n0 in range(0, N, n_block):
            prod = x[t0:t0 + token_block, None, :] * w[None, n0:n0 + n_block, :]
            acc[t0:t0 + token_block, n0:n0 + n_block] = _sequential_sum(prod)
    return f32_to_bf16(acc)


def projection_exact(x_bf16: np.ndarray, wkv_bf16: np.ndarray) -> np.ndarray:
    """The projection with float64 accumulation, rounded once to bf16: the order-free answer
    that every fp32 summation order is measured against."""
    return f32_to_bf16(bf16_to_f32(x_bf16).astype(np.float64) @ bf16_to_f32(wkv_bf16).astype(np.float64).T)


def split_kv(kv_bf16: np.ndarray, hc: int):
    """kv [T, (hc+1)*dim] -> key [T, hc, dim] and value [T, dim] (bf16 words, views)."""
    T, N = kv_bf16.shape
    if N % (hc + 1):
        raise ValueError(f"kv width {N} is not a multiple of hc + 1 = {hc + 1}")
    dim = N // (hc + 1)
    return kv_bf16[:, : hc * dim].reshape(T, hc, dim), kv_bf16[:, hc * dim:]


# 4. Gate and highway update ------------------------------------------------------------------

@dataclass
class GateResult:
    highway: np.ndarray  # [T, hc, dim] fp32, the updated streams
    dot: np.ndarray      # [T, hc] fp32, the normalised dot before the signed sqrt
    gate: np.ndarray     # [T, hc] fp32, sigmoid(signed sqrt(dot)); 0 for masked tokens


def gate_reference(highway: np.ndarray, kv_bf16: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray,
                   token_mask=None, residual: str = "fp32", eps: float = NORM_EPS) -> GateResult:
    """SPEC section 5, all in fp32. Returns a new highway; the input is not changed.

    residual="fp32": the engine's FP32 highway, no rounding.
    residual="bf16": DeepSeek's reference: h is a bf16 value and the update is rounded back to
    bf16 (nearest even). The streams stay in an fp32 container holding bf16-exact values.
    """
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
    highway = np.asarray(highway, dtype=np.float32)
    T, hc, dim = highway.shape
    key_bf16, value_bf16 = split_kv(kv_bf16, hc)
    h = round_f32_through_bf16(highway) if residual == "bf16" else highway.copy()
    k = bf16_to_f32(key_bf16)                               # [T, hc, dim]
    v = bf16_to_f32(value_bf16)                             # [T, dim]
    w = (np.asarray(q_weight, np.float32) * np.asarray(k_weight, np.float32))[None]  # [1, hc, dim]
    f32 = np.float32
    dim32, eps32 = f32(dim), f32(eps)

    hk = _sequential_sum((h * w) * k)                       # [T, hc]
    hh = _sequential_sum(h * h)
    kk = _sequential_sum(k * k)
    inv_h = f32(1.0) / np.sqrt(hh / dim32 + eps32)
    inv_k = f32(1.0) / np.sqrt(kk / dim32 + eps32)
    dot = hk * inv_h * inv_k / np.sqrt(dim32)               # [T, hc]
    g = np.copysign(np.sqrt(np.maximum(np.abs(dot), f32(GATE_CLAMP))), dot)
    # The sigmoid is evaluated in float64 and rounded once: that is the correctly rounded fp32
    # sigmoid (but for a ~2^-29 chance), so every backend agrees on the gate given the same dot;
    # an fp32 expf would add 1-2 ulps that depend on whose libm ran it.
    gate = (1.0 / (1.0 + np.exp(-g.astype(np.float64)))).astype(np.float32)
    if token_mask is not None:
        live = np.asarray(token_mask, dtype=bool)
        gate = np.where(live[:, None], gate, f32(0.0))
    else:
        live = np.ones(T, dtype=bool)

    new = h + gate[:, :, None] * v[:, None, :]
    if residual == "bf16":
        new = round_f32_through_bf16(new)
    new = np.where(live[:, None, None], new, highway)       # masked tokens: streams untouched
    return GateResult(highway=new.astype(np.float32), dot=dot.astype(np.float32), gate=gate.astype(np.float32))
