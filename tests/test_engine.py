"""EngramV41 (engine.py) under the simulator on the tiny model: every method against the reference,
and every refusal made before any copy or launch (device memory unchanged)."""
import types as pytypes

import numpy as np
import pytest
from numba import cuda

from engram_numba.bf16 import bf16_ulp_distance, f32_to_bf16, round_f32_through_bf16
from engram_numba.engine import EngramV41
from engram_numba.fixtures import TINY_PATH, TINY_TOKENS
from engram_numba.formats.schema_a import load_gguf
from engram_numba.stages.gate.reference import gate_reference
from engram_numba.stages.hash.cpu import EngramHasher
from engram_numba.stages.proj.reference import projection_reference
from engram_numba.stages.rows.reference import rows_reference

T = 3  # tokens per call: the simulator runs every GPU thread as a Python thread


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


@pytest.fixture(scope="module")
def engine(model):
    return EngramV41(model, max_tokens=4, device_tables=True)


def _ids(model, tokens, layer_index):
    return EngramHasher(model.hash_tables).hash(tokens)[:, layer_index, :]       # [T, C]


def _snapshot(engine):
    """Host copies of every workspace and weight, to prove a refused call changed nothing."""
    arrays = []
    for ws in engine._ws.values():
        arrays += [ws.raw, ws.ids, ws.rows, ws.kv, ws.dot, ws.gate]
    for lw in engine.layers.values():
        arrays += [lw.wkv, lw.w_gate, lw.table]
    return [a.copy_to_host() for a in arrays] + [engine._mask.copy_to_host()]


def _unchanged(before, after):
    return all(np.array_equal(a, b) for a, b in zip(before, after))


def test_rows_three_ways_match_the_reference(model, engine):
    ids = _ids(model, TINY_TOKENS[:T], 0)
    blocks = model.rows(1).read(ids)
    ref = rows_reference(blocks)
    engine.rows_from_ids(1, ids)
    np.testing.assert_array_equal(engine.rows_bf16(1).copy_to_host(), ref)
    engine.rows_from_raw(1, blocks)
    np.testing.assert_array_equal(engine.rows_bf16(1).copy_to_host(), ref)
    engine.rows_from_bf16(1, ref)
    np.testing.assert_array_equal(engine.rows_bf16(1).copy_to_host(), ref)
    engine.rows_from_raw(1, cuda.to_device(blocks))  # device blocks too
    np.testing.assert_array_equal(engine.rows_bf16(1).copy_to_host(), ref)


@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_apply_matches_the_reference(model, engine, rng, residual):
    cfg = model.config
    ids = _ids(model, TINY_TOKENS[:T], 1)
    engine.rows_from_ids(4, ids)
    x = rows_reference(model.rows(4).read(ids)).reshape(T, cfg.proj_in)
    kv_ref = projection_reference(x, model.layers[4].wkv_bf16())
    highway = (rng.standard_normal((T, cfg.hc, cfg.dim)) * 2).astype(np.float32)
    mask = np.array([True, False, True])
    ref = gate_reference(highway, kv_ref, model.layers[4].q_weight, model.layers[4].k_weight, mask, residual)
    d_h = cuda.to_device(highway)
    engine.apply(4, d_h, token_mask=mask, residual=residual)
    kv = engine.kv(4).copy_to_host()
    assert bf16_ulp_distance(kv, kv_ref).max() <= 1
    got = d_h.copy_to_host()
    dot, gate = (a.copy_to_host() for a in engine.last_gate(4))
    np.testing.assert_allclose(dot, ref.dot, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gate, ref.gate, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[~mask], highway[~mask])  # masked token untouched
    if residual == "bf16":
        live = got[mask]
        np.testing.assert_array_equal(round_f32_through_bf16(live), live)  # stays bf16-exact
        assert bf16_ulp_distance(f32_to_bf16(live), f32_to_bf16(ref.highway[mask])).max() <= 1
    else:
        np.testing.assert_allclose(got, ref.highway, rtol=1e-5, atol=1e-5)


@pytest.mark.slow     # the whole cuda pipeline in the simulator: make test only
def test_step_runs_both_layers_like_the_pipeline(model, rng):
    from engram_numba.pipeline import Pipeline
    engine = EngramV41(model, max_tokens=4)          # host tables: rows come through rows_from_raw
    highway = rng.standard_normal((T, model.config.hc, model.config.dim)).astype(np.float32)
    d_h = cuda.to_device(highway)
    hasher = EngramHasher(model.hash_tables)
    engine.step(TINY_TOKENS[:T], d_h, hasher)
    ref = Pipeline(model, "reference").run(TINY_TOKENS[:T], highway=highway)
    np.testing.assert_allclose(d_h.copy_to_host(), ref["L4.highway.out"], rtol=1e-5, atol=1e-5)
    # decode: one more token continues the same hasher
    d_one = cuda.to_device(highway[:1])
    engine.step(TINY_TOKENS[T:T + 1], d_one, hasher)
    assert hasher.position == T + 1


def test_refuses_too_many_tokens_before_any_copy_or_launch(model, engine, rng):
    cfg = model.config
    too_many = 5
    ids = _ids(model, TINY_TOKENS[:too_many], 0)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="5 tokens exceed this engine's max_tokens = 4"):
        engine.rows_from_raw(1, model.rows(1).read(ids))
    with pytest.raises(ValueError, match="exceed this engine's max_tokens"):
        engine.rows_from_bf16(1, np.zeros((too_many * cfg.n_hash_cols, 256), np.uint16))
    with pytest.raises(ValueError, match="exceed this engine's max_tokens"):
        engine.rows_from_ids(1, ids)
    d_big = cuda.to_device(rng.standard_normal((too_many, cfg.hc, cfg.dim)).astype(np.float32))
    with pytest.raises(ValueError, match="tokens"):
        engine.apply(1, d_big)
    assert _unchanged(before, _snapshot(engine))


def test_refuses_bad_arguments_without_touching_memory(model, engine, rng):
    cfg = model.config
    ids = _ids(model, TINY_TOKENS[:2], 0)
    engine.rows_from_ids(1, ids)
    before = _snapshot(engine)
    h = rng.standard_normal((2, cfg.hc, cfg.dim)).astype(np.float32)
    with pytest.raises(TypeError, match="host numpy array"):
        engine.apply(1, h)
    with pytest.raises(ValueError, match="highway has 3 tokens but the rows loaded for this layer cover 2"):
        engine.apply(1, cuda.to_device(np.zeros((3, cfg.hc, cfg.dim), np.float32)))
    with pytest.raises(ValueError, match="float32"):
        engine.apply(1, cuda.to_device(h.astype(np.float64)))
    with pytest.raises(ValueError, match="layer id 2 is not an engram layer"):
        engine.apply(2, cuda.to_device(h))
    with pytest.raises(ValueError, match="token_mask must be bool"):
        engine.apply(1, cuda.to_device(h), token_mask=np.array([1, 0]))
    # a device mask of the wrong length is refused before the projection writes the kv workspace
    with pytest.raises(ValueError, match=r"token_mask must be uint8/bool \[2\]"):
        engine.apply(1, cuda.to_device(h), token_mask=cuda.to_device(np.ones(3, np.uint8)))
    with pytest.raises(ValueError, match="residual must be one of"):
        engine.apply(1, cuda.to_device(h), residual="fp16")
    bad = ids.copy()
    bad[1, 3] = 462
    with pytest.raises(ValueError, match=r"row id 462 \(token 1, column 3\) is outside layer 1's table of 462 rows"):
        engine.rows_from_ids(1, bad)
    with pytest.raises(ValueError, match="uint8"):
        engine.rows_from_raw(1, np.zeros((12, 84), np.int8))
    with pytest.raises(ValueError, match=r"\[T\*6, 256\]"):
        engine.rows_from_bf16(1, np.zeros((12, 128), np.uint16))
    with pytest.raises(ValueError, match="whole number of tokens"):
        engine.rows_from_bf16(1, np.zeros((7, 256), np.uint16))
    assert _unchanged(before, _snapshot(engine))


def test_construction_checks(model):
    fake = pytypes.SimpleNamespace(config=pytypes.SimpleNamespace(hc=5), layers={})
    with pytest.raises(ValueError, match="hc in 1..=4"):
        EngramV41(fake, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        EngramV41(model, max_tokens=0)
    engine = EngramV41(model, max_tokens=2)
    with pytest.raises(ValueError, match="device_tables=True"):
        engine.rows_from_ids(1, _ids(model, TINY_TOKENS[:1], 0))
    with pytest.raises(ValueError, match="no rows loaded"):
        engine.apply(1, cuda.to_device(np.zeros((1, 4, 64), np.float32)))


class _Foreign:
    """Stands in for a CuPy/PyTorch tensor: only __cuda_array_interface__."""

    def __init__(self, dev):
        self._dev = dev
        self.__cuda_array_interface__ = dev.__cuda_array_interface__


@pytest.mark.gpu  # the simulator's arrays have no __cuda_array_interface__
def test_accepts_cuda_array_interface_objects_without_copy(model, engine, rng):
    cfg = model.config
    ids = _ids(model, TINY_TOKENS[:2], 0)
    engine.rows_from_ids(1, ids)
    h = rng.standard_normal((2, cfg.hc, cfg.dim)).astype(np.float32)
    d_h = cuda.to_device(h)
    engine.apply(1, _Foreign(d_h))
    assert not np.array_equal(d_h.copy_to_host(), h)  # updated in place through the interface


@pytest.mark.gpu
def test_accepts_torch_and_cupy_tensors(model, rng):
    engine = EngramV41(model, max_tokens=4, device_tables=True)
    ids = _ids(model, TINY_TOKENS[:2], 0)
    h = rng.standard_normal((2, model.config.hc, model.config.dim)).astype(np.float32)
    ran = []
    for lib in ("torch", "cupy"):
        try:
            mod = __import__(lib)
        except ImportError:
            continue
        t = mod.as_tensor(h, device="cuda") if lib == "torch" else mod.asarray(h)
        engine.rows_from_ids(1, ids)
        engine.apply(1, t)
        got = t.cpu().numpy() if lib == "torch" else mod.asnumpy(t)
        d_ref = cuda.to_device(h)
        engine.rows_from_ids(1, ids)
        engine.apply(1, d_ref)
        np.testing.assert_array_equal(got, d_ref.copy_to_host())
        ran.append(lib)
    if not ran:
        pytest.skip("neither torch nor cupy is installed")


@pytest.mark.gpu
def test_captured_apply_replays_like_apply(model, rng, gpu_record):
    """One-token decode through a CUDA graph: the replay computes what apply computes, reading
    the rows loaded for the next token, and costs one graph launch of host time."""
    import time
    stream = cuda.stream()
    engine = EngramV41(model, max_tokens=4, device_tables=True, stream=stream)
    plain = EngramV41(model, max_tokens=4, device_tables=True)
    all_ids = _ids(model, TINY_TOKENS[:3], 0)                       # [3, C]
    h0 = rng.standard_normal((1, model.config.hc, model.config.dim)).astype(np.float32)
    d_h, d_ref = cuda.to_device(h0), cuda.to_device(h0)
    engine.rows_from_ids(1, all_ids[:1])
    graph = engine.capture_apply(1, d_h)                             # applies once, then captures
    plain.rows_from_ids(1, all_ids[:1])
    plain.apply(1, d_ref)
    for t in (1, 2):                                                 # the next tokens, by replay
        engine.rows_from_ids(1, all_ids[t:t + 1])
        graph.replay()
        plain.rows_from_ids(1, all_ids[t:t + 1])
        plain.apply(1, d_ref)
        stream.synchronize()
        cuda.synchronize()
        np.testing.assert_array_equal(d_h.copy_to_host(), d_ref.copy_to_host())
    t0 = time.perf_counter()
    for _ in range(200):
        graph.replay()
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    stream.synchronize()
    gpu_record(test="captured apply (T=1, tiny model)", replay_host_us=round(host_us, 1), passed=True)
    with pytest.raises(ValueError, match="non-default stream"):
        plain.capture_apply(1, d_ref)


def test_capture_apply_needs_a_gpu(model, engine, simulator):
    if not simulator:
        pytest.skip("a GPU is present (the gpu tier tests the capture)")
    with pytest.raises(RuntimeError, match="need a real GPU"):
        engine.capture_apply(1, cuda.to_device(np.zeros((1, 4, 64), np.float32)))
