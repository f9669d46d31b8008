"""gate_cost (engram_numba/analysis/quant_cost.py) on hand-made captures: sign flips counted over
live (token, stream) pairs only, relative L2 along the stages, the table, and its errors. Its use
on real models is tests/test_pipeline_encodings.py::test_what_quantisation_costs_at_the_gate."""
import numpy as np
import pytest

from engram_numba.analysis.quant_cost import CHAIN, gate_cost
from engram_numba.bf16 import f32_to_bf16


def capture(rng, T=6, hc=2, scale=1.0, dot=None):
    cap = {"tokens.mask": np.array([True, True, False, True, True, True][:T])}
    for lid in (1, 4):
        cap[f"L{lid}.rows.bf16"] = f32_to_bf16(rng.standard_normal((T * 3, 256)).astype(np.float32) * scale)
        cap[f"L{lid}.proj.kv"] = f32_to_bf16(rng.standard_normal((T, 40)).astype(np.float32) * scale)
        cap[f"L{lid}.gate.dot"] = np.array(dot if dot is not None else rng.standard_normal((T, hc)), np.float32)
        cap[f"L{lid}.gate.gate"] = (1 / (1 + np.exp(-cap[f"L{lid}.gate.dot"]))).astype(np.float32)
        cap[f"L{lid}.highway.out"] = rng.standard_normal((T, hc, 8)).astype(np.float32)
    return cap


def test_sign_flips_and_chain():
    rng = np.random.default_rng(0)
    dot_a = np.array([[1, -1], [2, 3], [4, 5], [-1, 0.5], [1, 1], [-2, -2]], np.float32)
    dot_b = dot_a.copy()
    dot_b[0, 1] = 0.25          # flips
    dot_b[2, 0] = -4            # flips, but token 2 is masked: not counted
    dot_b[3, 0] = 1             # flips
    a = capture(np.random.default_rng(1), dot=dot_a)
    b = capture(rng, dot=dot_b)
    cost = gate_cost(a, b, "fp8", "q2k")
    lc = cost[1]
    assert lc.live == 10 and lc.sign_flips == 2 and lc.flip_fraction == 0.2
    assert set(lc.rel_l2) == set(CHAIN) and lc.rel_l2["rows.bf16"] > 0.5
    assert cost[4].sign_flips == 2
    text = str(cost)
    assert "q2k instead of fp8" in text and "2/10 (20.00%)" in text
    assert "<table>" in cost._repr_html_() and cost.to_records()[0]["flip_fraction"] == 0.2
    same = gate_cost(a, a)
    assert same[1].sign_flips == 0 and all(v == 0 for v in same[1].rel_l2.values())
    with pytest.raises(KeyError, match="no engram layer 9"):
        cost[9]


def test_errors():
    rng = np.random.default_rng(2)
    a = capture(rng)
    b = dict(capture(rng))
    del b["L4.proj.kv"]
    with pytest.raises(ValueError, match=r"both captures need \['L4.proj.kv'\]"):
        gate_cost(a, b)
    with pytest.raises(ValueError, match="no L{id}.gate.dot point"):
        gate_cost({"tokens.mask": np.ones(2, bool)}, a)
