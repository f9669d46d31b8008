"""Two tables' gathers in one launch (`launch.prepare_gather_pair`, Q2_K v2/v3's `gather_pair`):
each table's rows bit-identical to its own `prepare_gather` launch, out-of-range ids NaN rows
and counted the same, argument refusals before any launch. Simulator tier (tiny shapes: a part
of a block, past one block of 32 rows); the decode graph's use of it is checked on the GPU
(tests/test_engine_decode.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from engram_numba.stages import registry
from engram_numba.stages.rows import launch as RL
from engram_numba.stages.rows.reference import rows_reference

from .conftest import compare, poisoned
from .test_rows_cuda import finite_blocks

PAIRED = [r.name for r in registry.records("rows") if RL.has_gather_pair(r)]


def test_the_fast_q2k_records_have_a_pair():
    assert PAIRED == ["q2k_v2", "q2k_v3"]


@pytest.mark.parametrize("version", PAIRED)
@pytest.mark.parametrize("n,id_dtype", [(1, np.int64), (5, np.int32), (33, np.int64)])
def test_pair_equals_two_gathers(rng, version, n, id_dtype):
    ta, tb = finite_blocks(rng, 19), finite_blocks(rng, 23)
    ids = np.concatenate([rng.integers(0, 19, n), rng.integers(0, 23, n)]).astype(id_dtype)
    if n > 1:
        ids[1], ids[n + n // 2], ids[-1] = 19, -3, 23     # out of range: NaN rows, counted
    d_ta, d_tb, d_ids = cuda.to_device(ta), cuda.to_device(tb), cuda.to_device(ids)
    count_pair = cuda.to_device(np.zeros(1, np.uint32))
    oa, ob = poisoned(n), poisoned(n)
    launch = RL.prepare_gather_pair(d_ta, d_tb, d_ids, oa, ob, version=version, bad_count=count_pair)
    assert launch.name == f"{version}[2 layers]"
    launch()
    count_one = cuda.to_device(np.zeros(1, np.uint32))
    wa, wb = poisoned(n), poisoned(n)
    RL.prepare_gather(d_ta, d_ids[:n], wa, version=version, bad_count=count_one)()
    RL.prepare_gather(d_tb, d_ids[n:], wb, version=version, bad_count=count_one)()
    got_a, got_b = oa.copy_to_host(), ob.copy_to_host()
    compare(got_a, wa.copy_to_host())
    compare(got_b, wb.copy_to_host())
    assert int(count_pair.copy_to_host()[0]) == int(count_one.copy_to_host()[0]) == (3 if n > 1 else 0)
    good_a = (ids[:n] >= 0) & (ids[:n] < 19)
    compare(got_a[good_a], rows_reference(ta)[ids[:n][good_a]])


def test_default_record_and_refusals(rng):
    ta = cuda.to_device(finite_blocks(rng, 7))
    tb = cuda.to_device(finite_blocks(rng, 7))
    ids = cuda.to_device(np.zeros(6, np.int64))
    oa, ob = poisoned(3), poisoned(3)
    # the default record of aligned arrays (q2k_v1 in the simulator, which has no pair)
    default = RL.pick("q2k", None, ta, oa)
    if RL.has_gather_pair(default):
        assert RL.prepare_gather_pair(ta, tb, ids, oa, ob).name == f"{default.name}[2 layers]"
    else:
        with pytest.raises(ValueError, match="no two-table gather"):
            RL.prepare_gather_pair(ta, tb, ids, oa, ob)
    with pytest.raises(ValueError, match="no two-table gather"):
        RL.prepare_gather_pair(ta, tb, ids, oa, ob, version="q2k_v4")
    with pytest.raises(ValueError, match="even count"):
        RL.prepare_gather_pair(ta, tb, cuda.to_device(np.zeros(5, np.int64)), oa, ob, version="q2k_v3")
    with pytest.raises(ValueError, match="out_b"):
        RL.prepare_gather_pair(ta, tb, ids, oa, poisoned(4), version="q2k_v3")
    with pytest.raises(ValueError, match=r"table must be uint8 \[n, 264\]"):
        RL.prepare_gather_pair(ta, tb, ids, oa, ob, version="q2k_v3", encoding="fp8")
    assert (oa.copy_to_host() == ob.copy_to_host()).all()       # nothing ran


@pytest.mark.gpu
@pytest.mark.parametrize("version", PAIRED)
@pytest.mark.parametrize("n", [1, 24, 32, 33, 1000])
def test_gpu_pair_equals_two_gathers(rng, version, n):
    test_pair_equals_two_gathers(rng, version, n, np.int64)
