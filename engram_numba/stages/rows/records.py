"""Kernel records of the rows stage (see `engram_numba.stages.registry`).

Versions are per encoding, "<encoding>_v<N>"; each decodes rows in order and gathers rows of a
device table by id (one record covers both forms). Every rows kernel is bit-exact: decoding is
integer unpacking plus the reference's fp32 operations in its order, then one rounding to bf16.
"""
from __future__ import annotations

from ..registry import KernelRecord, register
from . import cuda_q2k


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
