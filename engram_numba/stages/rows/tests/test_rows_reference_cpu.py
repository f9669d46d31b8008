"""The rows stage's @njit backend against its numpy reference, and the reference's gather by id
(moved here from tests/test_reference_cpu.py)."""
import numpy as np
import pytest

from engram_numba.stages.rows.cpu import rows_cpu
from engram_numba.stages.rows.reference import gather_reference, rows_reference


def test_rows_cpu_matches_reference_and_gather_checks_ids(rng):
    blocks = rng.integers(0, 256, (50, 84), dtype=np.uint8)
    blocks[:, 80:84] = (rng.standard_normal((50, 2)) * 0.01).astype(np.float16).view(np.uint8)
    np.testing.assert_array_equal(rows_cpu(blocks), rows_reference(blocks))
    got = gather_reference(blocks, [3, 3, 49, 0])
    np.testing.assert_array_equal(got, blocks[[3, 3, 49, 0]])
    with pytest.raises(ValueError, match="row id 50 at index 1 is outside"):
        gather_reference(blocks, [0, 50])
    with pytest.raises(ValueError, match="row id -1"):
        gather_reference(blocks, [-1])
