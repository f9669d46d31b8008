"""Every kernel record states the bytes and flops of one launch (the bench's floor), and the
statement matches a count by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from engram_numba.bench.results_io import load_results
from engram_numba.stages import catalog, registry

H200 = Path(__file__).resolve().parents[1] / "bench" / "results" / "h200.json"
K, N, HC, DIM, COLS = 6144, 25600, 4, 5120, 24      # the released projection and gate


def _shape(rec, T=1):
    return {"rows": (T * COLS,), "proj": (T, K, N), "gate": (T, HC, DIM)}[rec.stage]


@pytest.mark.parametrize("rec", catalog.records(), ids=lambda r: f"{r.stage}.{r.name}")
def test_every_record_states_a_cost(rec):
    nbytes, flops = rec.launch_cost(*_shape(rec, 16))
    assert nbytes > 0 and flops >= 0
    # more tokens never cost less
    assert rec.launch_cost(*_shape(rec, 17))[0] > nbytes


def test_costs_by_hand():
    # rows: 24 ids (int64), 24 raw rows, 24 bf16 rows of 256 values
    assert registry.get("rows", "q2k_v3").launch_cost(24) == (24 * 8 + 24 * 84 + 24 * 512, 0)
    assert registry.get("rows", "fp8_v2").launch_cost(3) == (3 * 8 + 3 * 264 + 3 * 512, 0)
    # proj at T=1: the weight, x, kv; 2 flops a multiply-add
    assert registry.get("proj", "gemv_v3").launch_cost(1, K, N) == (25600 * 6144 * 2 + 6144 * 2 + 25600 * 2,
                                                                    2 * 6144 * 25600)
    q2k = 25600 * 24 * 84 + 6144 * 2 + 25600 * 2                   # one 84-byte block per 256 values
    assert registry.get("proj", "gemv_q2k_v2").launch_cost(1, K, N) == (q2k, 314_572_800)
    assert registry.get("proj", "gemv_q2k_v4").launch_cost(1, K, N)[0] == q2k   # q2k_r: the same bytes re-laid out
    fp8 = 25600 * 6144 + 800 * 192 + 4 * 6144 * 2 + 4 * 25600 * 2  # codes, one scale per 32x32 tile, x, kv
    assert registry.get("proj", "gemv_fp8_v2").launch_cost(4, K, N) == (fp8, 2 * 4 * 6144 * 25600)
    # gate at T=1: highway read and written (fp32), 4 keys + 1 value bf16, the weight, dot and gate out
    want = 2 * 4 * 5120 * 4 + 5 * 5120 * 2 + 4 * 5120 * 4 + 2 * 4 * 4
    for name in ("gate_v1", "gate_v2", "gate_v3"):
        assert registry.get("gate", name).launch_cost(1, HC, DIM) == (want, 0)
    assert registry.get("gate", "gate_v2").launch_cost(1, HC, DIM, residual_bytes=2) == (want - 4 * 5120 * 4, 0)


def test_committed_floors_are_the_records_costs():
    """The H200 result's stage records were measured with byte counts the records now state."""
    res = load_results(H200)
    checked = 0
    for r in res["records"]:
        stage = {"rows": "rows", "proj": "proj", "gate": "gate"}.get(r["stage"].split("_")[0])
        if stage is None or r["stage"] == "proj+gate":
            continue
        rec = registry.get(stage, r["kernel"])
        assert rec.launch_cost(*_shape(rec, r["T"])) == (r["bytes"], r["flops"]), r
        checked += 1
    assert checked >= 20


def test_a_record_without_a_cost_says_so():
    rec = registry.KernelRecord(stage="gate", name="gate_v99", changelog="test")
    with pytest.raises(RuntimeError, match=r"gate\.gate_v99 states no cost"):
        rec.launch_cost(1, HC, DIM)
