"""Kernel records of the rows stage (see `engram_numba.stages.registry`).

Versions are per encoding, "<encoding>_v<N>"; each decodes rows in order and gathers rows of a
device table by id (one record covers both forms). Every rows kernel is bit-exact: decoding is
integer unpacking plus the reference's fp32 operations in its order, then one rounding to bf16.
"""
from __future__ import annotations

from ..registry import KernelRecord, register
from . import cuda_fp8, cuda_kquants, cuda_q2k


def _q2k(ctx) -> bool:
    return ctx.get("encoding") == "q2k"


def _naive(ctx) -> bool:
    return _q2k(ctx) and not ctx["aligned"]


def _fast(ctx) -> bool:
    return _q2k(ctx) and bool(ctx["aligned"])


Q2K_CHANGELOG = {
    1: "naive: one thread per output value, bytes read straight from the block (the teaching baseline)",
    2: "8 lanes a row, 5 word loads a lane, a byte_perm lookup table of the 4 values per sub-block, "
       "16-byte stores",
    3: "v2 with cvt.rn.bf16x2.f32 rounding (half v2's instructions); the default (H200, T=4096 gather: "
       "23.6 us, 59% of its floor, against v2's 24.1 and v4's 24.7)",
    4: "v3 decoding 2 rows per 8-lane group, every load issued before any decoding",
}

for _v in (1, 2, 3, 4):
    register(KernelRecord(
        stage="rows", name=f"q2k_v{_v}", encoding="q2k", changelog=Q2K_CHANGELOG[_v],
        prepare=cuda_q2k.make_prepare(_v),
        compile_targets=(lambda v=_v: cuda_q2k.compile_targets(v)),
        bit_exact=True,
        default_when={1: "q2k rows, unaligned input or output (a slice at an odd offset)",
                      3: "q2k rows, aligned input and output"}.get(_v, "never (pick it by name)"),
        default_rule={1: _naive, 3: _fast}.get(_v),
        sweep=(4096,),
    ))


# Q3_K, Q4_K, Q8_0 and FP8: a naive v1 and one fast v2 each --------------------------------------

def _rule(encoding: str, aligned: bool):
    def rule(ctx) -> bool:
        return ctx.get("encoding") == encoding and bool(ctx["aligned"]) == aligned
    rule.__name__ = f"_{encoding}_{'fast' if aligned else 'naive'}"
    return rule


OTHER_CHANGELOG = {
    ("q3_k", 1): "naive: one thread per output value, bytes read straight from the 110-byte row",
    ("q3_k", 2): "8 lanes a row, 15 halfword loads a lane (rows are only 2-byte aligned), codes decoded "
                 "4 at a time from packed bytes, 16-byte stores",
    ("q4_k", 1): "naive: one thread per output value, bytes read straight from the 144-byte row",
    ("q4_k", 2): "8 lanes a row, two 16-byte loads a lane (header, 16 qs bytes = 32 values), 16-byte stores",
    ("q8_0", 1): "naive: one thread per output value, bytes read straight from the 8 34-byte blocks",
    ("q8_0", 2): "one lane per 34-byte block: 9 word loads realigned with byte_perm, 16-byte stores",
    ("fp8", 1): "naive: one thread per output value, its e4m3 code and e8m0 scale bytes read directly",
    ("fp8", 2): "8 lanes a row, 10 word loads a lane (8 code words, both scale words), e4m3 decoded by bit "
                "arithmetic, 128 contiguous bytes stored per row and instruction",
}

_ALIGN_WORDS = {"q3_k": "2-byte", "q4_k": "16-byte", "q8_0": "4-byte", "fp8": "4-byte"}

for (_enc, _v), _log in OTHER_CHANGELOG.items():
    if _enc == "fp8":
        _prepare, _targets = cuda_fp8.make_prepare(_v), (lambda v=_v: cuda_fp8.compile_targets(v))
    else:
        _prepare = cuda_kquants.make_prepare(_enc, _v)
        _targets = (lambda e=_enc, v=_v: cuda_kquants.compile_targets(e, v))
    register(KernelRecord(
        stage="rows", name=f"{_enc}_v{_v}", encoding=_enc, changelog=_log,
        prepare=_prepare, compile_targets=_targets, bit_exact=True,
        default_when=(f"{_enc} rows, unaligned input or output" if _v == 1 else
                      f"{_enc} rows, {_ALIGN_WORDS[_enc]} aligned input (codes and scales) and 16-byte aligned output"),
        default_rule=_rule(_enc, _v != 1),
        sweep=(4096,),
    ))
