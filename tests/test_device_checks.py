"""One rule for the argument checks of device-facing functions (engram_numba.device.checks): a
TypeError for the wrong kind of argument (not an array, dtype, number of dimensions, a bool or a
float for an integer), a ValueError for a wrong value (shape, layout, range, choice); every
message names the parameter, and the stage launchers follow it before any launch."""
import numpy as np
import pytest
from numba import cuda

from engram_numba import _argcheck
from engram_numba.device.checks import INTEGER, check_array, check_choice, check_int


@pytest.fixture
def arr(rng):
    return rng.integers(1, 200, (6, 8), dtype=np.uint8)


KIND = [   # (description, call) -> TypeError naming the parameter
    ("not an array", lambda a: check_array([1, 2], "table", np.uint8)),
    ("dtype", lambda a: check_array(a.astype(np.int16), "table", np.uint8)),
    ("dtype set", lambda a: check_array(a.astype(np.uint32), "table", (np.int32, np.int64))),
    ("not integer", lambda a: check_array(a.astype(np.float32), "table", INTEGER)),
    ("bool is not integer", lambda a: check_array(a > 9, "table", INTEGER)),
    ("ndim", lambda a: check_array(a.reshape(-1), "table", np.uint8, 2)),
    ("ndim from shape", lambda a: check_array(a, "table", np.uint8, shape=(None,))),
    ("bool int", lambda a: check_int(True, "table")),
    ("float int", lambda a: check_int(3.0, "table")),
]
VALUE = [  # (description, call) -> ValueError naming the parameter
    ("shape", lambda a: check_array(a, "table", np.uint8, shape=(None, 9))),
    ("fixed extent", lambda a: check_array(a, "table", np.uint8, shape=(7, 8))),
    ("not C-contiguous", lambda a: check_array(a[:, ::2], "table", np.uint8, 2)),
    ("transposed", lambda a: check_array(a.T, "table", np.uint8, 2)),
    ("below range", lambda a: check_int(-1, "table", 0)),
    ("above range", lambda a: check_int(5, "table", 0, 4)),
    ("choice", lambda a: check_choice("bf8", "table", ("fp32", "bf16"))),
]


@pytest.mark.parametrize("case", KIND, ids=[c[0] for c in KIND])
def test_the_wrong_kind_is_a_type_error_naming_the_parameter(arr, case):
    with pytest.raises(TypeError, match="^table must be"):
        case[1](arr)


@pytest.mark.parametrize("case", VALUE, ids=[c[0] for c in VALUE])
def test_a_wrong_value_is_a_value_error_naming_the_parameter(arr, case):
    with pytest.raises(ValueError, match="^table must be"):
        case[1](arr)


def test_good_arguments_pass_and_come_back(arr):
    assert check_array(arr, "table", np.uint8, shape=(6, None)) is arr
    assert check_array(arr.astype(np.int64), "ids", INTEGER, 2) is not None
    assert check_array(arr.astype(np.int32), "ids", (np.int32, np.int64), shape=(6, 8)) is not None
    assert check_int(np.int64(4), "n", 0, 4) == 4 and type(check_int(np.int64(4), "n")) is int
    assert check_choice(None, "layout", ("a",), optional=True) is None
    d = cuda.to_device(arr)                                # device arrays too
    assert check_array(d, "table", np.uint8, 2) is d
    with pytest.raises(TypeError, match="table must be 1-D"):
        check_array(d, "table", np.uint8, 1)


def test_messages_say_what_is_wanted_and_what_came(arr):
    with pytest.raises(TypeError, match=r"x must be bf16 words \(uint16\), got uint8"):
        check_array(arr, "x", np.uint16, 2, what="bf16 words (uint16)", doc="[T, K]")
    with pytest.raises(ValueError, match=r"raw must be uint8 \[n, 84\], got shape \(6, 8\)"):
        check_array(arr, "raw", np.uint8, shape=(None, 84), doc="[n, 84]")
    with pytest.raises(ValueError, match=r"mode must be one of \('a', 'b'\) or None, got 'c'"):
        check_choice("c", "mode", ("a", "b"), optional=True)


def test_the_public_face_checks_follow_the_same_rule():
    with pytest.raises(TypeError, match="k must be an integer"):
        _argcheck.need_int(2.5, "k")
    with pytest.raises(ValueError, match="k must be >= 1"):
        _argcheck.need_int(0, "k", 1)
    with pytest.raises(TypeError, match=r"ids entries must be an integer"):
        _argcheck.need_int_list([1, True], "ids")


def test_the_stage_launchers_follow_the_rule(rng):
    """Dtype and rank are TypeErrors, shapes ValueErrors, at each stage's launcher (nothing launched)."""
    from engram_numba.stages.gate.launch import prepare_gate
    from engram_numba.stages.proj.launch import prepare_project, prepare_project_q
    from engram_numba.stages.rows.launch import prepare_decode, prepare_gather
    T, hc, dim = 3, 2, 16
    h = cuda.to_device(rng.standard_normal((T, hc, dim)).astype(np.float32))
    kv = cuda.to_device(rng.integers(0, 1 << 15, (T, (hc + 1) * dim), dtype=np.uint16))
    w = cuda.to_device(rng.standard_normal((hc, dim)).astype(np.float32))
    with pytest.raises(TypeError, match="^highway must be float32"):
        prepare_gate(cuda.to_device(np.ones((T, hc, dim), np.float64)), kv, w)
    with pytest.raises(TypeError, match="^w must be 2-D"):
        prepare_gate(h, kv, cuda.to_device(np.ones(hc * dim, np.float32)))
    with pytest.raises(ValueError, match=r"^kv must be uint16 \(bf16 words\) \[T, \(hc\+1\)\*dim\], got shape"):
        prepare_gate(h, cuda.to_device(np.ones((T, dim), np.uint16)), w)
    with pytest.raises(ValueError, match="^residual must be one of"):
        prepare_gate(h, kv, w, residual="fp16")
    x = cuda.to_device(rng.integers(0, 1 << 15, (2, 16), dtype=np.uint16))
    wkv = cuda.to_device(rng.integers(0, 1 << 15, (3, 16), dtype=np.uint16))
    with pytest.raises(TypeError, match="^x must be bf16 words"):
        prepare_project(cuda.to_device(np.ones((2, 16), np.float32)), wkv)
    with pytest.raises(TypeError, match="^wkv must be 2-D"):
        prepare_project(x, cuda.to_device(np.ones(48, np.uint16)))
    with pytest.raises(TypeError, match="^wkv_raw must be uint8"):
        prepare_project_q(x, cuda.to_device(np.ones((3, 16), np.uint16)), cuda.to_device(np.ones((1, 1), np.uint8)),
                          weight="fp8")
    raw = cuda.to_device(rng.integers(0, 255, (4, 84), dtype=np.uint8))
    with pytest.raises(TypeError, match="^raw must be uint8"):
        prepare_decode(cuda.to_device(np.ones((4, 84), np.int8)))
    with pytest.raises(ValueError, match=r"^raw must be uint8 \[n, 84\], got shape \(4, 83\)"):
        prepare_decode(cuda.to_device(np.ones((4, 83), np.uint8)))
    with pytest.raises(TypeError, match="^row_ids must be int32 or int64, got uint32"):
        prepare_gather(raw, cuda.to_device(np.zeros(3, np.uint32)))
    with pytest.raises(ValueError, match=r"^bad_count must be uint32 \[1\], got shape \(2,\)"):
        prepare_gather(raw, cuda.to_device(np.zeros(3, np.int64)), bad_count=cuda.to_device(np.zeros(2, np.uint32)))
