"""Kernel records of the gate stage (see `engram_numba.stages.registry`).

Default rules, over ctx = {"T", "hc", "dim", "aligned", "simulator", "layout", "tps"}: numba's
simulator or unaligned data -> gate_v1 (its plain loops are the cheap ones to simulate); on a GPU
gate_v2 from V2_MIN_T tokens on and wherever v3's registers would not hold a thread's chunks,
gate_v3 below V2_MIN_T. gate_v4 (many blocks a row, few tokens) is slower than gate_v3 on the H200
(9.3 against 7.0 us at T = 1, its record) and never the default: pick it by name
(`versions={"gate": "gate_v4"}`). Timings quoted are from the H200 runs (dim 5120, hc 4; bench/results/h200.json).
"""
from __future__ import annotations

from ..registry import Factory, KernelRecord, Spec, register
from . import cuda

V2_MIN_T = 128      # from here on gate_v2 is the default (H200 at 2b45250, stream layout: T=128 v2 15.5 us,
                    # v3 16.9; T=4096 v2 249.2, v3 286.8; below, v3 wins: T=1 7.1 vs 8.3, T=16 7.6 vs 9.2)


def _naive(ctx) -> bool:
    return bool(ctx["simulator"] or not ctx["aligned"])


def _v3_fits(ctx) -> bool:
    return cuda._v3_applies(ctx["T"], ctx["hc"], ctx["dim"], ctx.get("layout"), ctx.get("tps"))


_RECORDS = [
    (1, True, "naive: one thread per (t, c), sequential fp32 loops in the reference's order (bit-exact; "
              "2225 us at T=4096)",
     "numba's simulator or unaligned data", _naive),
    (2, False, "one block per token or per (t, c), the three sums in one pass of 16-byte loads, warp shuffles, "
               "h re-read in the update pass (T=4096: 249.2 us, 83% of the floor, torch.compile 255.6; T=128: 15.5 us, v3 16.9)",
     f"GPU, aligned, T >= {V2_MIN_T} or dim too large for gate_v3",
     lambda c: not _naive(c) and (c["T"] >= V2_MIN_T or not _v3_fits(c))),
    (3, False, "v2 with each thread's h values held in registers between the passes, every load issued before "
               "the block reduction (wins below 128 tokens: T=1 7.1 us against v2's 8.3, T=16 7.6 against 9.2; loses at "
               "T=128, 16.9 against 15.5, and T=4096, 286.8 against 249.2; T 17..127 not measured)",
     f"GPU, aligned, T < {V2_MIN_T} and at most {cuda.V3_MAX_CHUNKS} chunks a thread",
     lambda c: not _naive(c) and c["T"] < V2_MIN_T and _v3_fits(c)),
    (4, False, "few tokens: each (t, c) row over S blocks of one chunk a thread (dim 5120: 20 blocks of 32), "
               "partials to global, the last block to arrive sums them in slice order (deterministic) and "
               "publishes the gate; updater blocks with higher indices, which loaded h and the value already, "
               "wait for it and store (the grid must be resident: T <= 13, its pair T <= 8 at hc 4, dim 5120 on "
               "132 SMs). H200, one graph node each, warm: 9.3 us at T = 1 against gate_v3's 7.0 (an empty "
               "node: 3.5), its pair 14.0 against v3's pair 8.8, decode_step 83.3 against 77.8 us a token: the "
               "hand-off's L2 round trips (fence, arrival atomic, publish and poll) cost more than v3's 4 "
               "blocks' serial loads (bench/results/h200_gate_dev_v4_ecbad0d.txt), so v3 stays",
     "never (pick it by name; the decode graph's gate pair follows the per-layer choice)", None),
]

_FAST = {2: lambda rb, nch: cuda.gate_v2(rb), 3: lambda rb, nch: cuda.gate_v3(nch, rb),
         4: lambda rb, nch: cuda.gate_v4(rb)}


def _specs(v: int):
    """Every specialisation the launcher can pick: v2 per residual, v3 per residual and chunk count."""
    if v == 1:
        return [Spec("", cuda.gate_v1, cuda.V1_ARGS)]
    if v == 4:      # one kernel per residual, and its two-layer form (launch.prepare_gate_pair)
        return ([Spec(f"[{cuda.residual_name(rb)}]", cuda.gate_v4(rb), cuda.V4_ARGS) for rb in (False, True)]
                + [Spec(f".pair[{cuda.residual_name(rb)}]", cuda.gate_v4_pair(rb), cuda.V4_PAIR_ARGS)
                   for rb in (False, True)])
    nchs = cuda.v3_target_nchs() if v == 3 else [0]
    out = [Spec(f"[{'' if v == 2 else f'nch={n},'}{cuda.residual_name(rb)}]", _FAST[v](rb, n), cuda.FAST_ARGS)
           for n in nchs for rb in (False, True)]
    if v == 3:      # the two-layer form (launch.prepare_gate_pair): the chunk counts a decode step picks
        out += [Spec(f".pair[nch={n},{cuda.residual_name(rb)}]", cuda.gate_v3_pair(n, rb), cuda.PAIR_ARGS)
                for n in PAIR_TARGET_NCHS for rb in (False, True)]
    return out


# the pair's compile targets, stream layout (its default): dim 5120 is nch 2 below 512 blocks (one
# decode token), nch 3 from there on; the tiny dims are nch 1
PAIR_TARGET_NCHS = (1, 2, 3)


def _geometry(v: int):
    if v == 3:
        return cuda.geometry_v3
    if v == 4:
        return cuda.geometry_v4

    def geometry(T, hc, dim, layout=None, tps=None):
        return cuda.launch_config(T, hc, dim, v, layout, tps)
    return geometry


# (T, hc, dim) the simulator tier runs every version at, two a (residual, mask) case in the order
# (fp32, no mask), (fp32, mask), (bf16, no mask), (bf16, mask): across the four cases every shape
# (T in {1, 3, 5}, hc in {1..4}, dim in {64, 128}) meets every kernel
SIM_CASES = ((1, 4, 64), (5, 4, 64), (3, 2, 128), (3, 3, 64), (5, 1, 128), (1, 2, 64), (3, 4, 64), (5, 2, 128))

def cost(T: int, hc: int, dim: int, residual_bytes: int = 4) -> tuple[int, int]:
    """(bytes, flops) of one gate launch: the highway [T, hc, dim] read and written back, kv's hc
    keys and one value [T, (hc+1)*dim] bf16 read, the weight [hc, dim] fp32 read, the dot and gate
    outputs [T, hc] fp32 written. The dot products are not a matrix product: 0 flops (the gate is
    bound by bytes)."""
    return 2 * T * hc * dim * residual_bytes + T * (hc + 1) * dim * 2 + hc * dim * 4 + 2 * T * hc * 4, 0


for _v, _exact, _log, _when, _rule in _RECORDS:
    register(KernelRecord(
        stage="gate", name=f"gate_v{_v}", changelog=_log, launcher=cuda.prepare,
        kernel=cuda.gate_v1 if _v == 1 else Factory(_FAST[_v]), geometry=_geometry(_v),
        args={1: "naive", 4: "v4"}.get(_v, "words"), align=0 if _v == 1 else 16, specs=(lambda v=_v: _specs(v)),
        spill_free=_v != 1, vector_io=_v != 1,
        sim_cases=SIM_CASES, bit_exact=_exact, default_when=_when, default_rule=_rule, sweep=(1, 8) if _v == 4 else (1, 16, 128, 4096),
        cost=cost))
