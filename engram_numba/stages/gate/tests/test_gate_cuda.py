"""The gate and highway update kernels (engram_numba.stages.gate) against the numpy reference.

Tiers: simulator (tiny shapes, every registered version and layout, both residuals, masks,
outputs), and `gpu` (the released shapes and odd ones on a real GPU; each test appends a summary
to GPU_RESULTS and prints it as one JSON line). Compile-only is tests/test_compile_tier.py.
Versions are the gate stage's kernel records ("gate_v1", ...), iterated from the registry, so a
new record is covered without editing this file; "bit-exact" below means `record.bit_exact`.

Tolerances, in units that mean something (u = 2^-24, the fp32 unit roundoff):
- dot: v1 (bit_exact) sums in the reference's order, so its dot is bit-identical. v2/v3 sum in another
  order; a sum's forward error bound is proportional to the sum of |terms|, so the check is
  |dot - dot_ref| <= DOT_K * u * dot_abs, where dot_abs is the dot of |h*w*k| (same
  normalisation, float64). Measured: <= 3.2 at the simulator's dims (64..320); the reference
  itself is <= 7.3 u*dot_abs from float64 at dim 5120 (2048 random (t, c)), so DOT_K = 64 is a
  wide margin that still catches a wrong sum (one lost term is ~2^24/dim u*dot_abs: 3300 at
  dim 5120).
- gate: the kernels evaluate the sigmoid in float64 and round once, like the reference, so the
  gate must be the reference formula applied to the kernel's own dot within GATE_ULPS = 1 fp32
  ulp (equal but for a ~2^-29 chance per value; measured: always equal); against the reference
  gate it must be within the dot tolerance carried through sigmoid(signed sqrt), plus 1 ulp.
  v1 (the reference's summation order): dot and gate bit-identical. Masked: exactly 0.
- highway: the update must be exactly round?(h + fl(gate*v)) from the kernel's own gate (bit
  for bit, both residuals; so v1's highway is bit-identical to the reference's); against the
  reference, fp32: |diff| <= |v| * |gate - gate_ref| + 3 ulp of max(|h|, |gate*v|) (the
  measured max in those ulps is printed); bf16: v1 <= 1 bf16 ulp, v2/v3 <= |v| * |gate -
  gate_ref| + 3 fp32 ulps of max(|h|, |gate*v|) + 2 bf16 ulps (the first H200 run found 6 bf16
  ulps at dim 5120, and the second cancelling sums at T=4096, where a reordered
  dot near 0 moves the gate through the steep signed sqrt; the measured ulps are recorded).
  Masked tokens: bit-identical to the input.
Every output is poisoned (NaN) before a run; every element is checked.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_ulp_distance, f32_to_bf16, f32_ulp_distance, round_f32_through_bf16
from engram_numba.config import GATE_CLAMP, MAX_HC, NORM_EPS
from engram_numba.device.intrinsics import SIMULATOR
from engram_numba.stages import registry
from engram_numba.stages.gate import cuda as G
from engram_numba.stages.gate import launch as L
from engram_numba.stages.gate.records import V2_MIN_T
from engram_numba.stages.gate.reference import GateResult, gate_reference

F32 = np.float32
U = 2.0 ** -24
DOT_K = 64          # in u * dot_abs; measured max is printed (see the module docstring)
GATE_ULPS = 1        # float64 sigmoid rounded once on both sides: equal but for a ~2^-29 chance
GPU_RESULTS: list[dict] = []

NAIVE = "gate_v1"    # one thread per (t, c): takes no layout, needs no alignment
# every registered version (that is cheap enough for the simulator, when running there)
VERSIONS = [r.name for r in registry.records("gate") if r.simulate or not SIMULATOR]
FAST = [v for v in VERSIONS if v != NAIVE]     # 16-byte loads: aligned data only, both block layouts


def _layouts(version):
    return (None,) if version == NAIVE else G.LAYOUTS


# (version, layout, tps): every kernel in both block layouts. tps=32 (several chunks per
# thread: the loop of v2, nch > 1 with idle tail chunks for v3) is covered at dim 320 by
# test_gate_loops_over_many_chunks.
SIM_CONFIGS = [(v, layout, None) for v in VERSIONS for layout in _layouts(v)]


def _cfg_id(cfg):
    v, layout, tps = cfg
    return f"{v or 'default'}" + (f"-{layout}" if layout else "") + (f"-tps{tps}" if tps else "")


def _bit_exact(version) -> bool:
    return registry.get("gate", version).bit_exact


def _vnum(version: str) -> int:
    """The number `cuda.launch_config` takes for a record name ("gate_v2" -> 2)."""
    return int(version.rsplit("_v", 1)[1])


def default_name(T, hc, dim, layout=None, tps=None, *, aligned=True) -> str:
    """The record the launcher runs for version=None here (gate_v1 in the simulator)."""
    return registry.default("gate", L.context(T, hc, dim, aligned, layout, tps)).name


def gpu_ctx(T, hc, dim, layout=None, tps=None, *, aligned=True, simulator=False) -> dict:
    """A launch context as on a GPU (or, with simulator=True, as in the simulator)."""
    return dict(L.context(T, hc, dim, aligned, layout, tps), simulator=simulator)


# ---- inputs and checks --------------------------------------------------------------------------

def make_inputs(rng, T, hc, dim, *, mask=False):
    """Realistic scales: highway ~N(0,1) times a per-(t, c) scale in {1, 10, 100}, keys and
    values ~N(0,1) rounded to bf16, w = q*k ~ 1 + 0.1 N(0,1)."""
    scale = rng.choice(np.array([1.0, 10.0, 100.0], dtype=F32), size=(T, hc, 1))
    highway = rng.standard_normal((T, hc, dim), dtype=F32) * scale
    kv = f32_to_bf16(rng.standard_normal((T, (hc + 1) * dim), dtype=F32))
    q = (1.0 + 0.1 * rng.standard_normal((hc, dim))).astype(F32)
    k = (1.0 + 0.1 * rng.standard_normal((hc, dim))).astype(F32)
    w = q * k                                             # fp32 product, as the reference forms it
    token_mask = None
    if mask:
        token_mask = (rng.random(T) < 0.6).astype(np.uint8)
        token_mask[0] = 1
        if T > 1:
            token_mask[-1] = 0                            # at least one of each
    return highway, kv, w, token_mask


def run_kernel(highway, kv, w, token_mask, residual, version, layout=None, tps=None, *,
               want_dot=True, want_gate=True, eps=NORM_EPS):
    T, hc, _ = highway.shape
    d_h = cuda.to_device(highway)
    d_kv = cuda.to_device(kv)
    d_w = cuda.to_device(w)
    d_mask = None if token_mask is None else cuda.to_device(token_mask)
    poison = np.full((T, hc), np.nan, dtype=F32)
    d_dot = cuda.to_device(poison) if want_dot else None
    d_gate = cuda.to_device(poison) if want_gate else None
    assert L.run_gate(d_h, d_kv, d_w, token_mask=d_mask, residual=residual, eps=eps,
                      dot_out=d_dot, gate_out=d_gate, version=version, layout=layout, tps=tps) is None
    cuda.synchronize()
    return (d_h.copy_to_host(), None if d_dot is None else d_dot.copy_to_host(),
            None if d_gate is None else d_gate.copy_to_host())


def gate_of_dot(dot):
    """The reference's dot -> gate formula: signed sqrt in fp32, sigmoid in float64 rounded once."""
    dot = np.asarray(dot, dtype=F32)
    g = np.copysign(np.sqrt(np.maximum(np.abs(dot), F32(GATE_CLAMP))), dot)
    return (1.0 / (1.0 + np.exp(-g.astype(np.float64)))).astype(F32)


class Expected:
    """The reference answer for one input set, and what the checks derive from it (computed
    once, then shared by every version checked against it)."""

    def __init__(self, highway, kv, w, token_mask, residual, eps=NORM_EPS):
        T, hc, dim = highway.shape
        self.highway_in, self.kv, self.w, self.residual = highway, kv, w, residual
        self.ref = gate_reference(highway, kv, w, np.ones_like(w), token_mask=token_mask,
                                  residual=residual, eps=eps)
        self.live = np.ones(T, bool) if token_mask is None else np.asarray(token_mask).astype(bool)
        self.h = round_f32_through_bf16(highway) if residual == "bf16" else highway
        self.v = (kv[:, hc * dim:].astype(np.uint32) << 16).view(F32)            # [T, dim]
        # dot_abs: the dot's normalisation applied to sum |h*w*k|, float64 [T, hc]
        k = (kv[:, : hc * dim].astype(np.uint32) << 16).view(F32).reshape(T, hc, dim)
        hh = np.einsum("tcd,tcd->tc", self.h, self.h, dtype=np.float64)
        kk = np.einsum("tcd,tcd->tc", k, k, dtype=np.float64)
        habs = np.abs(self.h * w[None]).astype(np.float64)
        hk_abs = np.einsum("tcd,tcd->tc", habs, np.abs(k).astype(np.float64))
        self.dot_abs = hk_abs / np.sqrt(hh / dim + eps) / np.sqrt(kk / dim + eps) / np.sqrt(dim)

    def masked(self, token_mask):
        """The expectation under a mask, from the unmasked one without re-running the reference:
        gate_reference keeps dot, zeroes the gate and returns the input streams for masked
        tokens (the simulator tier checks that by calling it with masks)."""
        out = copy.copy(self)
        out.live = np.asarray(token_mask).astype(bool)
        lv = out.live
        out.ref = GateResult(highway=np.where(lv[:, None, None], self.ref.highway, self.highway_in),
                             dot=self.ref.dot, gate=np.where(lv[:, None], self.ref.gate, F32(0.0)))
        return out


def check(exp: Expected, got, *, version, exact_dot=None):
    """Every check of the module docstring; returns the measured errors."""
    new, dot, gate = got
    ref, live, residual = exp.ref, exp.live, exp.residual
    stats = {}

    # masked tokens: streams bit-identical to the input, gate exactly 0
    assert np.array_equal(new[~live].view(np.uint32), exp.highway_in[~live].view(np.uint32)), "masked rows changed"

    if dot is not None:
        assert not np.isnan(dot).any(), "dot_out: an element was not written (NaN poison left)"
        exact_dot = _bit_exact(version) if exact_dot is None else exact_dot
        if exact_dot:
            assert np.array_equal(dot.view(np.uint32), ref.dot.view(np.uint32)), \
                f"{version} dot differs from the reference: max {np.max(np.abs(dot - ref.dot))}"
            if gate is not None:
                assert np.array_equal(gate.view(np.uint32), ref.gate.view(np.uint32)), f"{version} gate differs"
        ratio = np.abs(dot.astype(np.float64) - ref.dot) / (U * exp.dot_abs + 1e-300)
        stats["dot_err_u_dotabs"] = round(float(ratio.max()), 3)
        stats["dot_err_ulps"] = int(f32_ulp_distance(dot, ref.dot).max())
        assert ratio.max() <= DOT_K, f"dot error {ratio.max():.1f} u*dot_abs > {DOT_K}"

    if gate is not None:
        assert not np.isnan(gate).any(), "gate_out: an element was not written (NaN poison left)"
        assert np.all(gate[~live] == 0.0), "masked tokens must have gate 0"
        if dot is not None and live.any():
            d = f32_ulp_distance(gate[live], gate_of_dot(dot)[live])
            stats["gate_vs_own_dot_ulps"] = int(d.max())
            assert d.max() <= GATE_ULPS, f"gate is {d.max()} ulps from gate(dot)"
            # against the reference: the dot tolerance carried through sigmoid(signed sqrt)
            g = np.sqrt(np.maximum(np.abs(ref.dot.astype(np.float64)), GATE_CLAMP))
            sig = 1.0 / (1.0 + np.exp(-g))
            tol = sig * (1.0 - sig) / (2.0 * g) * DOT_K * U * exp.dot_abs \
                + GATE_ULPS * np.spacing(np.abs(ref.gate)).astype(np.float64)
            err = np.abs(gate.astype(np.float64) - ref.gate)
            stats["gate_err_ulps"] = int(f32_ulp_distance(gate, ref.gate)[live].max())
            assert np.all(err[live] <= tol[live]), f"gate error {err[live].max():.3g} beyond the propagated bound"

        # the update pass exactly, from the kernel's own gate
        h, v = exp.h[live], exp.v[live][:, None, :]
        gv = gate[live][:, :, None] * v                                  # fp32, rounded
        upd = h + gv
        if residual == "bf16":
            upd = round_f32_through_bf16(upd)
        assert np.array_equal(new[live].view(np.uint32), upd.view(np.uint32)), \
            "highway is not h + gate*v from the kernel's own gate"
        # against the reference
        if residual == "fp32" and live.any():
            unit = np.spacing(np.maximum(np.abs(h), np.abs(gv)))
            diff = np.abs(new[live] - ref.highway[live])               # exact in fp32 here
            dgate = np.abs(gate[live] - ref.gate[live]).astype(np.float64)[:, :, None]
            bound = np.abs(v) * dgate * (1 + 2 * U) + 3.0 * unit
            assert np.all(diff <= bound), "highway differs from the reference beyond |v| dgate + 3 ulp"
            stats["highway_err_ulps_of_max_h_gv"] = round(float((diff / unit).max()), 3)
    if residual == "bf16":
        words = f32_to_bf16(new)
        dist = bf16_ulp_distance(words, f32_to_bf16(ref.highway))
        stats["highway_err_bf16_ulps"] = int(dist.max())
        if _bit_exact(version) or gate is None:
            assert dist.max() <= 1, f"bf16 highway {dist.max()} bf16 ulps from the reference"
        elif live.any():
            # Another summation order moves the gate (the signed sqrt is steep near dot = 0), and
            # h + gate*v then rounds to bf16 on its own: |diff| <= |v| dgate + the fp32 roundings
            # (3 ulp of max(|h|, |gate*v|), which matter where the sum cancels) + 1 bf16 ulp each side.
            v = exp.v[live][:, None, :]
            dgate = np.abs(gate[live] - ref.gate[live]).astype(np.float64)[:, :, None]
            big = np.maximum(np.abs(new[live]), np.abs(ref.highway[live]))
            gv = np.abs(gate[live][:, :, None] * v)
            unit = np.spacing(np.maximum(np.abs(exp.h[live]), gv))   # fp32 roundings before the bf16 one
            bound = np.abs(v) * dgate * (1 + 2 * U) + 3.0 * unit + 2.0 * np.spacing(big) * 65536
            diff = np.abs(new[live].astype(np.float64) - ref.highway[live])
            assert np.all(diff <= bound), "bf16 highway differs from the reference beyond |v| dgate + 2 bf16 ulp"
        assert np.array_equal((words.astype(np.uint32) << 16)[live], new[live].view(np.uint32)), \
            "bf16 container not bf16-exact"
    return stats


# ---- simulator tier -------------------------------------------------------------------------------

# The simulator runs every thread as a Python thread, so each (residual, mask) case takes two
# tiny shapes of the record's sim_cases (records.py says which).
def sim_shapes(version, residual, masked):
    cases = registry.get("gate", version).sim_cases
    j = 2 * (2 * (residual == "bf16") + int(masked))
    return cases[j:j + 2]


@pytest.mark.parametrize("cfg", SIM_CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("residual", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])   # fast: fp32 only
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_gate_matches_reference(rng, cfg, residual, masked):
    version, layout, tps = cfg
    worst = {}
    for shape in sim_shapes(version, residual, masked):
        inputs = make_inputs(rng, *shape, mask=masked)
        got = run_kernel(*inputs, residual, version, layout, tps)
        stats = check(Expected(*inputs, residual), got, version=version)
        for k, v in stats.items():
            worst[k] = max(worst.get(k, 0), v)
    print(f"\n{_cfg_id(cfg)} {residual} mask={masked}: {worst}")


@pytest.mark.parametrize("cfg", [("gate_v1", None, None), ("gate_v2", "token", 32), ("gate_v3", "stream", 32)],
                         ids=_cfg_id)
def test_gate_loops_over_many_chunks(rng, cfg):
    """dim 320 with 32 threads a stream: 40 chunks = 2 steps, the second one 1/4 full."""
    version, layout, tps = cfg
    inputs = make_inputs(rng, 2, 2, 320, mask=False)
    for residual in ("fp32", "bf16"):
        got = run_kernel(*inputs, residual, version, layout, tps)
        stats = check(Expected(*inputs, residual), got, version=version)
        print(f"\n{_cfg_id(cfg)} dim 320 {residual}: {stats}")


@pytest.mark.parametrize("version", [None] + VERSIONS)
def test_optional_outputs(rng, version):
    """Without dot_out / gate_out (and with only one), the highway is the same; None is the
    default dispatch."""
    inputs = make_inputs(rng, 3, 1, 64, mask=True)
    full = run_kernel(*inputs, "fp32", version)
    check(Expected(*inputs, "fp32"), full, version=version or default_name(3, 1, 64))
    for want_dot, want_gate in ((False, False), (True, False), (False, True)):
        got = run_kernel(*inputs, "fp32", version, want_dot=want_dot, want_gate=want_gate)
        assert np.array_equal(got[0].view(np.uint32), full[0].view(np.uint32))
        if want_dot:
            assert np.array_equal(got[1].view(np.uint32), full[1].view(np.uint32))
        if want_gate:
            assert np.array_equal(got[2].view(np.uint32), full[2].view(np.uint32))


@pytest.mark.parametrize("version", VERSIONS)
def test_tiny_dot_takes_the_clamp(rng, version):
    """|dot| < 1e-6: a key with one nonzero element makes hk a single exact product, so dot =
    h[d0] * w[d0] * sign(k[d0]) * inv_h in every summation order; h[d0] ~ 3e-7 puts it under
    the clamp, with both signs. The clamp then gives every same-sign dot the same gate."""
    T, hc, dim = 2, 2, 64
    highway, kv, w, _ = make_inputs(rng, T, hc, dim)
    keys = np.zeros((T, hc, dim), np.float32)
    d0 = rng.integers(0, dim, size=(T, hc))
    for t in range(T):
        for c in range(hc):
            keys[t, c, d0[t, c]] = 1.5 if c % 2 else -0.75
            highway[t, c, d0[t, c]] = F32(3e-7 * (1 if t % 2 else -1))     # dots of both signs
    kv[:, : hc * dim] = f32_to_bf16(keys.reshape(T, hc * dim))
    for residual in ("fp32", "bf16"):
        exp = Expected(highway, kv, w, None, residual)
        assert np.all(np.abs(exp.ref.dot) < GATE_CLAMP) and np.all(exp.ref.dot != 0)
        got = run_kernel(highway, kv, w, None, residual, version)
        dot, gate = got[1], got[2]
        assert np.array_equal(np.sign(dot), np.sign(exp.ref.dot))
        assert np.unique(gate[dot > 0]).size == 1 and np.unique(gate[dot < 0]).size == 1
        check(exp, got, version=version)


@pytest.mark.parametrize("version", VERSIONS)
def test_zero_key_rows(rng, version):
    """mean(k*k) = 0: eps = 1e-20 keeps inv_k finite (1e10), hk is a sum of signed zeros
    (+0 with mixed-sign h), so dot is +0 and the gate sigmoid(+sqrt(1e-6)); no NaN, as the
    reference. Also -0.0 key words."""
    T, hc, dim = 3, 2, 64
    highway, kv, w, _ = make_inputs(rng, T, hc, dim)
    kv[1, : hc * dim] = 0
    kv[2, dim: 2 * dim] = 0x8000
    for residual in ("fp32", "bf16"):
        exp = Expected(highway, kv, w, None, residual)
        got = run_kernel(highway, kv, w, None, residual, version)
        assert not any(np.isnan(x).any() for x in got)
        zero = [(1, c) for c in range(hc)] + [(2, 1)]
        for t, c in zero:
            assert got[1][t, c].view(np.uint32) == 0 == exp.ref.dot[t, c].view(np.uint32)
        check(exp, got, version=version)


@pytest.mark.parametrize("version", VERSIONS)
def test_all_masked_and_bool_mask(rng, version):
    highway, kv, w, _ = make_inputs(rng, 3, 2, 64)
    got = run_kernel(highway, kv, w, np.zeros(3, dtype=np.bool_), "fp32", version)
    assert np.array_equal(got[0].view(np.uint32), highway.view(np.uint32))
    assert np.all(got[2] == 0) and not np.isnan(got[1]).any()
    mask = np.array([True, False, True])
    got = run_kernel(highway, kv, w, mask, "bf16", version)
    check(Expected(highway, kv, w, mask.astype(np.uint8), "bf16"), got, version=version)


def test_masked_expectation_matches_the_reference(rng):
    """The GPU tier derives masked expectations from unmasked ones; check that against
    gate_reference with the mask, bit for bit."""
    highway, kv, w, mask = make_inputs(rng, 6, 3, 64, mask=True)
    for residual in ("fp32", "bf16"):
        direct = Expected(highway, kv, w, mask, residual).ref
        derived = Expected(highway, kv, w, None, residual).masked(mask).ref
        for a, b in ((direct.highway, derived.highway), (direct.dot, derived.dot), (direct.gate, derived.gate)):
            assert np.array_equal(np.asarray(a, F32).view(np.uint32), np.asarray(b, F32).view(np.uint32))


def test_round_to_bf16_matches_numpy():
    """The branch-free rounding helper against bf16.round_f32_through_bf16, bit for bit, on
    ties, the largest finite values (-> inf), infinities, NaNs, subnormals and random words."""
    from engram_numba.device.intrinsics import round_to_bf16

    @cuda.jit
    def k(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = round_to_bf16(x[i])

    rng = np.random.default_rng(7)
    special = np.array([0x00000000, 0x80000000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF,
                        0x7F7F8000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00000001,
                        0x00008000, 0x80018000, 0x7FBFFFFF], dtype=np.uint32)
    words = np.concatenate([special, rng.integers(0, 2 ** 32, size=47, dtype=np.uint64).astype(np.uint32)])
    x = words.view(F32)
    out = np.zeros_like(x)
    k[1, 64](x, out)
    want = round_f32_through_bf16(x)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


# ---- launcher: configuration and argument validation ---------------------------------------------

def test_launch_config_released_shapes():
    cfg = G.launch_config(4096, 4, 5120, 2, "token")
    assert cfg == {"version": 2, "layout": "token", "grid": 4096, "block": 512, "tps": 128, "nch": 5}
    cfg = G.launch_config(4096, 4, 5120, 2)              # the default layout (H200: fastest)
    assert cfg["layout"] == "stream" and cfg["grid"] == 4096 * 4
    cfg = G.launch_config(4096, 4, 5120, 3)
    assert cfg["layout"] == "stream" and cfg["grid"] == 4096 * 4 and cfg["tps"] * cfg["nch"] >= 640
    assert G.launch_config(1, 4, 5120, 3)["grid"] == 4
    for T in (1, 7, 128, 4096):
        for hc in range(1, 5):
            for v in (2, 3):
                c = G.launch_config(T, hc, 5120, v)
                assert c["block"] <= G.MAX_THREADS and c["tps"] % 32 == 0
                assert (c["nch"] - 1) * c["tps"] < 640 <= c["nch"] * c["tps"]
                if v == 3:
                    assert c["nch"] in G.v3_target_nchs()      # compiled by the compile-only tier


def test_default_rules_on_a_gpu_and_in_the_simulator():
    """The defaults of records.py (what `default_version` was): on a GPU with aligned data
    gate_v3 below V2_MIN_T tokens where a thread's chunks fit its registers, else gate_v2; in the
    simulator, or for unaligned data, gate_v1."""
    for T in (1, 7, 16, V2_MIN_T - 1):
        for hc in range(1, MAX_HC + 1):
            for dim in (8, 64, 5120):
                assert G._v3_applies(T, hc, dim, None)
                assert registry.default("gate", gpu_ctx(T, hc, dim)).name == "gate_v3", (T, hc, dim)
    for T in (V2_MIN_T, 4096):
        assert registry.default("gate", gpu_ctx(T, 4, 5120)).name == "gate_v2"
    # v3 would need more than V3_MAX_CHUNKS chunks a thread: gate_v2 at any T
    assert not G._v3_applies(7, 4, 5120, None, 32)
    assert registry.default("gate", gpu_ctx(7, 4, 5120, tps=32)).name == "gate_v2"
    assert not G._v3_applies(7, 4, 16384, "token")
    assert registry.default("gate", gpu_ctx(7, 4, 16384, "token")).name == "gate_v2"
    for T in (1, 7, 4096):
        assert registry.default("gate", gpu_ctx(T, 4, 5120, aligned=False)).name == "gate_v1"
        assert registry.default("gate", gpu_ctx(T, 4, 5120, simulator=True)).name == "gate_v1"
    # here: the context the launcher builds (the simulator's rule when the simulator runs)
    assert default_name(3, 1, 64) == ("gate_v1" if SIMULATOR else "gate_v3")
    assert default_name(4096, 4, 5120) == ("gate_v1" if SIMULATOR else "gate_v2")


def test_default_rules_partition_the_contexts():
    """Exactly one record claims every context (registry.default raises otherwise), and every
    record with a default rule is the default somewhere."""
    claimed = set()
    for T in (1, 2, 31, 32, 33, 127, 255, 256, 257, 1000, 4096, 5000):
        for hc in range(1, MAX_HC + 1):
            for dim in (8, 64, 320, 5120, 16384):
                for layout in (None,) + G.LAYOUTS:
                    for tps in (None, 32, 128):
                        try:
                            G.launch_config(T, hc, dim, 2, layout, tps)     # the launcher refuses these first
                        except ValueError:
                            continue
                        for aligned in (True, False):
                            for simulator in (True, False):
                                ctx = gpu_ctx(T, hc, dim, layout, tps, aligned=aligned, simulator=simulator)
                                claimed.add(registry.default("gate", ctx).name)
    assert claimed == {r.name for r in registry.records("gate") if r.default_rule is not None}


def test_the_launcher_runs_the_default_record(rng):
    """version=None prepares the record registry.default names for the launch's context."""
    for T, hc, dim in ((3, 1, 64), (1, 4, 64), (5, 2, 128)):
        highway, kv, w, _ = make_inputs(rng, T, hc, dim)
        launch = L.prepare_gate(cuda.to_device(highway), cuda.to_device(kv), cuda.to_device(w))
        assert launch.name == default_name(T, hc, dim)
        for version in VERSIONS:
            launch = L.prepare_gate(cuda.to_device(highway), cuda.to_device(kv), cuda.to_device(w), version=version)
            assert launch.name == version


def _valid_device_args(rng, T=3, hc=2, dim=64):
    highway, kv, w, mask = make_inputs(rng, T, hc, dim, mask=True)
    return highway, {"highway": cuda.to_device(highway), "kv": cuda.to_device(kv), "w": cuda.to_device(w),
                     "token_mask": cuda.to_device(mask)}


BAD_ARGS = [
    # (what to change, value maker, exception, text the message must contain)
    ("highway", lambda a, r: a["highway"].copy_to_host(), TypeError, "highway"),
    ("highway", lambda a, r: cuda.to_device(a["highway"].copy_to_host().astype(np.float64)), TypeError, "highway"),
    ("highway", lambda a, r: cuda.to_device(np.zeros((3, 5, 64), F32)), ValueError, "hc"),
    ("highway", lambda a, r: cuda.to_device(np.zeros((3, 2, 60), F32)), ValueError, "dim"),
    ("highway", lambda a, r: cuda.to_device(np.zeros((6, 64), F32)), TypeError, "highway must be 3-D"),
    ("kv", lambda a, r: cuda.to_device(np.zeros((3, 2 * 64), np.uint16)), ValueError, "kv"),
    ("kv", lambda a, r: cuda.to_device(np.zeros((3, 3 * 64), np.float32)), TypeError, "kv"),
    ("kv", lambda a, r: cuda.to_device(np.zeros((4, 3 * 64), np.uint16)), ValueError, "kv"),
    ("kv", lambda a, r: cuda.to_device(np.zeros((3, 6 * 64), np.uint16))[:, ::2], ValueError, "kv"),
    ("w", lambda a, r: cuda.to_device(np.ones((2, 32), F32)), ValueError, "w"),
    ("w", lambda a, r: cuda.to_device(np.ones((2, 64), np.float64)), TypeError, "w"),
    ("w", lambda a, r: [[1.0] * 64] * 2, TypeError, "w"),
    ("token_mask", lambda a, r: cuda.to_device(np.ones(4, np.uint8)), ValueError, "token_mask"),
    ("token_mask", lambda a, r: cuda.to_device(np.ones(3, np.int32)), TypeError, "token_mask"),
    ("token_mask", lambda a, r: np.ones(3, np.uint8), TypeError, "token_mask"),
    ("residual", lambda a, r: "bf32", ValueError, "residual"),
    ("eps", lambda a, r: -1e-20, ValueError, "eps"),
    ("eps", lambda a, r: float("nan"), ValueError, "eps"),
    ("eps", lambda a, r: "1e-20", TypeError, "eps"),
    ("dot_out", lambda a, r: cuda.to_device(np.zeros((3, 3), F32)), ValueError, "dot_out"),
    ("gate_out", lambda a, r: cuda.to_device(np.zeros((3, 2), np.float64)), TypeError, "gate_out"),
    ("gate_out", lambda a, r: np.zeros((3, 2), F32), TypeError, "gate_out"),
    ("version", lambda a, r: "gate_v9", ValueError, r"no gate kernel version 'gate_v9'; versions are \["),
    ("version", lambda a, r: 2, ValueError, r"no gate kernel version 2; versions are \["),   # the old int spelling
    ("layout", lambda a, r: "tokens", ValueError, "layout"),
    ("tps", lambda a, r: 48, ValueError, "tps"),
    ("tps", lambda a, r: 1024, ValueError, "tps"),
]


@pytest.mark.parametrize("i", range(len(BAD_ARGS)), ids=[f"{b[0]}-{b[3]}-{n}" for n, b in enumerate(BAD_ARGS)])
def test_bad_arguments_raise_and_leave_the_highway_alone(rng, i):
    name, make, exc, text = BAD_ARGS[i]
    host, args = _valid_device_args(rng)
    kwargs = {k: args[k] for k in ("token_mask",)}
    pos = [args["highway"], args["kv"], args["w"]]
    value = make(args, rng)
    if name in ("highway", "kv", "w"):
        pos[("highway", "kv", "w").index(name)] = value
    else:
        kwargs[name] = value
    with pytest.raises(exc, match=text):
        L.run_gate(*pos, **kwargs)
    assert np.array_equal(args["highway"].copy_to_host().view(np.uint32), host.view(np.uint32))


def test_unaligned_views_need_gate_v1(rng):
    """A view that starts 4 bytes into an allocation cannot take 16-byte loads: the fast versions
    refuse it by name (before any launch); the default falls back to gate_v1 (on a GPU too),
    which runs on it."""
    T, hc, dim = 2, 2, 64
    highway, kv, w, _ = make_inputs(rng, T, hc, dim)
    big = cuda.to_device(np.concatenate([np.zeros(1, F32), highway.ravel()]))
    view = big[1:].reshape(T, hc, dim)
    d_kv, d_w = cuda.to_device(kv), cuda.to_device(w)
    assert FAST
    for version in FAST:
        with pytest.raises(ValueError, match="highway.*16-byte"):
            L.run_gate(view, d_kv, d_w, version=version)
    assert np.array_equal(view.copy_to_host().view(np.uint32), highway.view(np.uint32))
    # the default for unaligned data is the naive kernel, in the simulator and on a GPU alike
    assert default_name(T, hc, dim, aligned=False) == NAIVE
    assert registry.default("gate", gpu_ctx(T, hc, dim, aligned=False)).name == NAIVE
    assert L.prepare_gate(view, d_kv, d_w).name == NAIVE
    for version in (NAIVE, None):
        d_h = cuda.to_device(np.concatenate([np.zeros(1, F32), highway.ravel()]))[1:].reshape(T, hc, dim)
        d_dot, d_gate = cuda.device_array((T, hc), F32), cuda.device_array((T, hc), F32)
        L.run_gate(d_h, d_kv, d_w, version=version, dot_out=d_dot, gate_out=d_gate)
        check(Expected(highway, kv, w, None, "fp32"), (d_h.copy_to_host(), d_dot.copy_to_host(),
                                                         d_gate.copy_to_host()), version=NAIVE)


def test_zero_tokens_is_a_no_op(rng):
    hc, dim = 2, 64
    for version in [None] + VERSIONS:
        assert L.run_gate(cuda.to_device(np.zeros((0, hc, dim), F32)),
                          cuda.to_device(np.zeros((0, (hc + 1) * dim), np.uint16)),
                          cuda.to_device(np.ones((hc, dim), F32)), version=version) is None


def test_v3_is_plain_code_specialised_per_chunk_count():
    """gate_v3 is written out in the module (no generated source): one closure per chunk count,
    each chunk's loads one call, so its values stay in registers (the compile tier checks that
    no v3 specialisation spills or uses local memory)."""
    import inspect
    src = inspect.getsource(G._make_v3)
    assert "exec(" not in inspect.getsource(G) and "if NCH > 7:" in src
    k3 = G.gate_v3(3, residual_bf16=True)
    assert G.gate_v3(3, residual_bf16=True) is k3                 # built once, then cached
    assert "nch3_bf16" in getattr(k3, "__name__", "") or "nch3_bf16" in k3.py_func.__name__
    with pytest.raises(ValueError):
        G.gate_v3(G.V3_MAX_CHUNKS + 1)


# ---- GPU tier --------------------------------------------------------------------------------------

def _record(**kw):
    GPU_RESULTS.append(kw)
    print(json.dumps(kw))


GPU_SHAPES = [(1, 4, 5120), (7, 4, 5120), (128, 4, 5120), (4096, 4, 5120),
              (33, 1, 64), (33, 2, 64), (33, 3, 64), (33, 3, 5120), (5, 2, 8)]
# every registered version in each of its layouts, then the default (version None)
GPU_CONFIGS = [(r.name, layout, None) for r in registry.records("gate") for layout in _layouts(r.name)] \
    + [(None, None, None)]
# T=4096 costs seconds of host checking per run: every version in its default layout there
# (both layouts of the fast versions are covered at T=128 and T=33)
GPU_CONFIGS_LARGE = [(r.name, None, None) for r in registry.records("gate")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_gpu_gate_matches_reference(rng, shape, residual):
    """Every version (and layout) without and with a mask; outputs poisoned, every element
    checked, one summary line per run."""
    highway, kv, w, token_mask = make_inputs(rng, *shape, mask=True)
    unmasked = Expected(highway, kv, w, None, residual)
    failures = []
    for mask in (None, token_mask):
        exp = unmasked if mask is None else unmasked.masked(mask)
        for cfg in (GPU_CONFIGS_LARGE if shape[0] >= 1024 else GPU_CONFIGS):
            version, layout, tps = cfg
            if version == "gate_v3" and not G._v3_applies(shape[0], shape[1], shape[2], layout):
                continue
            if version == "gate_v4" and not G.v4_applies(*shape):      # few tokens only: the grid must be resident
                continue
            got = run_kernel(highway, kv, w, mask, residual, version, layout, tps)
            ran = version or default_name(*shape, layout)
            try:
                stats, ok = check(exp, got, version=ran), True
            except AssertionError as exc:
                stats, ok = {"error": str(exc)[:300]}, False
                failures.append((cfg, mask is not None, str(exc)[:300]))
            launch = G.launch_config(*shape, _vnum(ran), layout)
            _record(test="gate_vs_reference", shape=list(shape), residual=residual, masked=mask is not None,
                    version=version, ran=ran, layout=launch.get("layout"), tps=launch.get("tps"), nch=launch.get("nch"),
                    passed=ok, **stats)
    assert not failures, failures
