"""Kernel records of the rows stage (see `engram_numba.stages.registry`).

Versions are per encoding, "<encoding>_v<N>"; each decodes rows in order and gathers rows of a
device table by id (one record covers both forms). Every rows kernel is bit-exact: decoding is
integer unpacking plus the reference's fp32 operations in its order, then one rounding to bf16.
"""
from __future__ import annotations

from numba import types

from ..registry import KernelRecord, register
from . import cuda_fp8, cuda_kquants, cuda_q2k
from .cuda_common import U8_2D, U16_2D, U32_1D, U32_2D, geometry_fast, geometry_lanes, geometry_naive, prepare, specs
from .encodings import ROW_VALUES, get_encoding

# rows the simulator tier decodes: one, a few, past one block of 32 (Q2_K); one and a few (the others)
SIM_ROWS = {"q2k": (1, 3, 33)}


def cost(encoding: str):
    """(bytes, flops) of gathering n rows of `encoding` by int64 id: each id read, each raw row
    read, each decoded bf16 row written once; decoding has no matrix product (0 flops)."""
    row_bytes = get_encoding(encoding).row_bytes

    def rows_cost(n: int) -> tuple[int, int]:
        return n * (8 + row_bytes + 2 * ROW_VALUES), 0
    rows_cost.__name__ = f"cost_{encoding}"
    return rows_cost


def _rows(encoding, version, changelog, *, pair, args, src_t, out_t, extra=(), geometry=None, when=None, rule=None,
          gather_pair=None):
    """Register rows record <encoding>_v<version>: `pair` = (decode, gather) kernels, `args` the
    launcher's argument form (cuda_common.prepare), src_t / out_t / extra the compile-tier types;
    `gather_pair`: the kernel gathering two tables' rows in one launch (`launch.prepare_gather_pair`),
    for the records that have one."""
    naive = args.startswith("u8")
    kernel = {"decode": pair[0], "gather": pair[1]}
    if gather_pair is not None:
        kernel["gather_pair"] = gather_pair
    register(KernelRecord(
        stage="rows", name=f"{encoding}_v{version}", encoding=encoding, changelog=changelog, launcher=prepare,
        kernel=kernel, geometry=geometry or (geometry_naive if naive else geometry_fast), args=args,
        align=0 if naive else get_encoding(encoding).fast_align, specs=specs(kernel, src_t, out_t, extra),
        spill_free=not naive, vector_io=not naive, sim_cases=SIM_ROWS.get(encoding, (1, 9)), bit_exact=True,
        default_when=when or "never (pick it by name)", default_rule=rule, sweep=(4096,), cost=cost(encoding)))


def _rule(encoding: str, aligned: bool):
    def rule(ctx) -> bool:
        return ctx.get("encoding") == encoding and bool(ctx["aligned"]) == aligned
    rule.__name__ = f"_{encoding}_{'fast' if aligned else 'naive'}"
    return rule


# ---- Q2_K: four versions ------------------------------------------------------------------------

_Q2K_FAST = dict(args="u32", src_t=U32_2D, out_t=U32_1D)

_rows("q2k", 1, "naive: one thread per output value, bytes read straight from the block (the teaching baseline)",
      pair=(cuda_q2k._dequant_v1, cuda_q2k._gather_v1), args="u8", src_t=U8_2D, out_t=U16_2D,
      when="q2k rows, unaligned input or output (a slice at an odd offset)", rule=_rule("q2k", False))
_rows("q2k", 2, "8 lanes a row, 5 word loads a lane, a byte_perm lookup table of the 4 values per sub-block, "
      "16-byte stores", pair=(cuda_q2k._dequant_v2, cuda_q2k._gather_v2), gather_pair=cuda_q2k._gather_pair_v2,
      **_Q2K_FAST)
_rows("q2k", 3, "v2 with cvt.rn.bf16x2.f32 rounding (half v2's instructions); the default (H200, T=4096 gather: "
      "23.6 us, 59% of its floor, against v2's 24.1 and v4's 24.7)",
      pair=(cuda_q2k._dequant_v3, cuda_q2k._gather_v3), gather_pair=cuda_q2k._gather_pair_v3, **_Q2K_FAST,
      when="q2k rows, aligned input and output", rule=_rule("q2k", True))
_rows("q2k", 4, "v3 decoding 2 rows per 8-lane group, every load issued before any decoding",
      pair=(cuda_q2k._dequant_v4, cuda_q2k._gather_v4), **_Q2K_FAST,
      geometry=geometry_lanes(cuda_q2k.ROWS_PER_GROUP_V4))


# ---- Q3_K, Q4_K, Q8_0 and FP8: a naive v1 and one fast v2 each --------------------------------------

_ALIGN_WORDS = {"q3_k": "2-byte", "q4_k": "16-byte", "q8_0": "4-byte", "fp8": "4-byte"}


def _pair(encoding, v1_log, v2_log, v1, v2, *, v1_args="u8", v2_args, v2_src_t, v1_extra=(), v2_extra=()):
    _rows(encoding, 1, v1_log, pair=v1, args=v1_args, src_t=U8_2D, out_t=U16_2D, extra=v1_extra,
          when=f"{encoding} rows, unaligned input or output", rule=_rule(encoding, False))
    _rows(encoding, 2, v2_log, pair=v2, args=v2_args, src_t=v2_src_t, out_t=U32_1D, extra=v2_extra,
          when=f"{encoding} rows, {_ALIGN_WORDS[encoding]} aligned input (codes and scales) and 16-byte aligned output",
          rule=_rule(encoding, True))


_pair("q3_k", "naive: one thread per output value, bytes read straight from the 110-byte row",
      "8 lanes a row, 15 halfword loads a lane (rows are only 2-byte aligned), codes decoded 4 at a time from packed "
      "bytes, 16-byte stores", cuda_kquants.q3_k_v1, cuda_kquants.q3_k_v2,
      v2_args="u16,rows", v2_src_t=U16_2D, v2_extra=(types.int64,))
_pair("q4_k", "naive: one thread per output value, bytes read straight from the 144-byte row",
      "8 lanes a row, two 16-byte loads a lane (header, 16 qs bytes = 32 values), 16-byte stores",
      cuda_kquants.q4_k_v1, cuda_kquants.q4_k_v2, v2_args="u32_flat,rows", v2_src_t=U32_1D, v2_extra=(types.int64,))
_pair("q8_0", "naive: one thread per output value, bytes read straight from the 8 34-byte blocks",
      "one lane per 34-byte block: 9 word loads realigned with byte_perm, 16-byte stores",
      cuda_kquants.q8_0_v1, cuda_kquants.q8_0_v2, v2_args="u32,rows", v2_src_t=U32_2D, v2_extra=(types.int64,))
# FP8's gather takes the scales and their first column too (inline in the row, or a separate tensor)
_pair("fp8", "naive: one thread per output value, its e4m3 code and e8m0 scale bytes read directly",
      "8 lanes a row, 10 word loads a lane (8 code words, both scale words), e4m3 decoded by bit arithmetic, 128 "
      "contiguous bytes stored per row and instruction",
      (cuda_fp8._decode_v1, cuda_fp8._gather_v1), (cuda_fp8._decode_v2, cuda_fp8._gather_v2),
      v1_args="u8,scales", v1_extra=(U8_2D, types.int64),
      v2_args="u32,scales", v2_src_t=U32_2D, v2_extra=(U32_2D, types.int64))
