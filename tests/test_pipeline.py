"""Pipeline: backends per stage, every declared capture point fires, hooks, captures, diff."""
import numpy as np
import pytest

from engram_numba.compare import diff
from engram_numba.fixtures import TINY_MASK, TINY_PATH, TINY_TOKENS
from engram_numba.hash import EngramHasher
from engram_numba.model_file import load_gguf
from engram_numba.pipeline import POINTS, Capture, Pipeline, point_names


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


@pytest.fixture(scope="module")
def ref_capture(model):
    return Pipeline(model, "reference").run(TINY_TOKENS, token_mask=TINY_MASK)


@pytest.mark.parametrize("backends", ["reference", "cpu", {"rows": "cpu", "gate": "cpu"}])
def test_every_declared_point_fires_in_order(model, backends):
    pipe = Pipeline(model, backends)
    seen = []
    with pipe.hooks({name: (lambda a, n: seen.append(n)) for name in pipe.point_names}):
        cap = pipe.run(TINY_TOKENS)
    assert seen == pipe.point_names == point_names(model.config.layer_ids)
    assert pipe.fired == pipe.point_names
    assert list(cap) == pipe.point_names  # every point captured by default, in firing order


def test_cpu_backend_is_bit_identical_to_reference(model, ref_capture):
    cap = Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
    report = diff(ref_capture, cap)
    assert report.all_equal, str(report)
    assert len(report) == len(ref_capture)


def test_capture_shapes_and_dtypes(model, ref_capture):
    cfg = model.config
    T, C = TINY_TOKENS.size, cfg.n_hash_cols
    expect = {"hash.ids": ((T, C), np.int64), "rows.q2k": ((T * C, 84), np.uint8),
              "rows.bf16": ((T * C, 256), np.uint16), "proj.kv": ((T, cfg.proj_out), np.uint16),
              "gate.key": ((T, cfg.hc, cfg.dim), np.uint16), "gate.value": ((T, cfg.dim), np.uint16),
              "highway.in": ((T, cfg.hc, cfg.dim), np.float32), "gate.dot": ((T, cfg.hc), np.float32),
              "gate.gate": ((T, cfg.hc), np.float32), "highway.out": ((T, cfg.hc, cfg.dim), np.float32)}
    assert set(expect) == set(POINTS)
    for lid in cfg.layer_ids:
        for point, (shape, dtype) in expect.items():
            a = ref_capture[f"L{lid}.{point}"]
            assert a.shape == shape and a.dtype == dtype, (lid, point, a.shape, a.dtype)
    # the second engram layer reads the first one's output (blocks between are not modelled)
    np.testing.assert_array_equal(ref_capture["L4.highway.in"], ref_capture["L1.highway.out"])


def test_names_filter_forms(model):
    pipe = Pipeline(model, "cpu")
    assert list(pipe.run(TINY_TOKENS, names_filter="L1.proj.kv")) == ["L1.proj.kv"]
    assert list(pipe.run(TINY_TOKENS, names_filter=["L4.gate.gate", "L1.hash.ids"])) == ["L1.hash.ids", "L4.gate.gate"]
    cap = pipe.run(TINY_TOKENS, names_filter=lambda n: n.endswith("gate.dot"))
    assert list(cap) == ["L1.gate.dot", "L4.gate.dot"]


def test_hook_replacement_flows_downstream_and_is_removed(model, ref_capture):
    pipe = Pipeline(model, "cpu")
    calls = []

    def drop_head(ids, name):  # send hash column 0 of every token to row 0
        calls.append(name)
        out = ids.copy()
        out[:, 0] = 0
        return out

    with pipe.hooks({"L1.hash.ids": drop_head}):
        cap = pipe.run(TINY_TOKENS, token_mask=TINY_MASK)
    assert calls == ["L1.hash.ids"]
    assert (cap["L1.hash.ids"][:, 0] == 0).all()
    np.testing.assert_array_equal(cap["L1.rows.q2k"][0::6], np.repeat(model.layers[1].table[:1], 14, axis=0))
    assert not np.array_equal(cap["L1.proj.kv"], ref_capture["L1.proj.kv"])
    # untouched columns and the other layer's ids are the same as without the hook
    np.testing.assert_array_equal(cap["L1.hash.ids"][:, 1:], ref_capture["L1.hash.ids"][:, 1:])
    np.testing.assert_array_equal(cap["L4.hash.ids"], ref_capture["L4.hash.ids"])
    # after the block the hook is gone
    again = pipe.run(TINY_TOKENS, token_mask=TINY_MASK)
    np.testing.assert_array_equal(again["L1.proj.kv"], ref_capture["L1.proj.kv"])


def test_hooks_removed_when_the_block_raises(model):
    pipe = Pipeline(model, "cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with pipe.hooks({"L1.gate.dot": lambda a, n: None}):
            raise RuntimeError("boom")
    assert pipe._hooks == {}


def test_perturbing_the_key_changes_only_the_gate_path(model, ref_capture):
    pipe = Pipeline(model, "reference")
    with pipe.hooks({"L1.gate.key": lambda k, n: np.zeros_like(k)}):  # bf16 zeros
        cap = pipe.run(TINY_TOKENS, token_mask=TINY_MASK)
    np.testing.assert_array_equal(cap["L1.proj.kv"], ref_capture["L1.proj.kv"])
    assert (cap["L1.gate.dot"] == 0).all()
    live_gate = cap["L1.gate.gate"][TINY_MASK]
    np.testing.assert_allclose(live_gate, 1 / (1 + np.exp(-np.sqrt(1e-6))), rtol=1e-6)


def test_hook_errors(model):
    pipe = Pipeline(model, "cpu")
    with pytest.raises(KeyError, match="no hook point named 'L2.gate.dot'"):
        with pipe.hooks({"L2.gate.dot": print}):
            pass
    with pipe.hooks({"L1.gate.gate": lambda a, n: a * 0}):
        with pytest.raises(ValueError, match="observe only"):
            pipe.run(TINY_TOKENS)
    with pipe.hooks({"L1.rows.bf16": lambda a, n: a[:3]}):
        with pytest.raises(ValueError, match="returned uint16"):
            pipe.run(TINY_TOKENS)


def test_backend_arguments_are_checked(model):
    with pytest.raises(ValueError, match="unknown stage"):
        Pipeline(model, {"projection": "cpu"})
    with pytest.raises(ValueError, match="backend 'gpu' for stage 'hash'"):
        Pipeline(model, "gpu")
    with pytest.raises(ValueError, match="residual must be one of"):
        Pipeline(model, "cpu", residual="fp16")
    pipe = Pipeline(model, "cpu")
    with pytest.raises(ValueError, match="highway must have shape"):
        pipe.run(TINY_TOKENS, highway=np.zeros((3, 4, 64), np.float32))
    with pytest.raises(ValueError, match="token_mask must have shape"):
        pipe.run(TINY_TOKENS, token_mask=[True])


def test_capture_save_load_round_trip(tmp_path, ref_capture):
    path = tmp_path / "cap.npz"
    ref_capture.save(path)
    back = Capture.load(path)
    assert back.meta == ref_capture.meta
    assert diff(ref_capture, back).all_equal


def test_decode_continues_the_prefill_history(model, ref_capture):
    pipe = Pipeline(model, "cpu")
    hasher = EngramHasher(model.hash_tables)
    pipe.run(TINY_TOKENS[:-1], token_mask=TINY_MASK[:-1], hasher=hasher)
    last = pipe.run(TINY_TOKENS[-1:], token_mask=TINY_MASK[-1:], hasher=hasher,
                    highway=ref_capture["L1.highway.in"][-1:])
    for lid in (1, 4):
        np.testing.assert_array_equal(last[f"L{lid}.hash.ids"], ref_capture[f"L{lid}.hash.ids"][-1:])
    np.testing.assert_array_equal(last["L1.highway.out"], ref_capture["L1.highway.out"][-1:])


def test_bf16_residual_runs_and_stays_bf16(model):
    from engram_numba.bf16 import round_f32_through_bf16
    cap = Pipeline(model, "cpu", residual="bf16").run(TINY_TOKENS)
    out = cap["L4.highway.out"]
    np.testing.assert_array_equal(round_f32_through_bf16(out), out)


def test_diff_report_renders(model, ref_capture):
    other = Pipeline(model, "cpu", residual="bf16").run(TINY_TOKENS, token_mask=TINY_MASK)
    report = diff(ref_capture, other, label_a="fp32", label_b="bf16")
    text = str(report)
    assert "fp32 vs bf16" in text and "L1.highway.out" in text
    assert report["L1.hash.ids"].equal and not report["L1.highway.out"].equal
    assert report["L1.highway.out"].first_diff is not None
    assert "<table>" in report._repr_html_()
    import matplotlib
    matplotlib.use("Agg")
    ax = report.plot()
    assert ax.get_yscale() == "log"


def test_cuda_backend_with_chosen_kernel_versions(model, ref_capture):
    """The cuda backend on two tokens (the simulator runs every GPU thread in Python), once with
    the launchers' defaults and once with the fast kernels named through cuda_versions."""
    tokens, mask = TINY_TOKENS[:2], TINY_MASK[:2]
    ref = Pipeline(model, "reference").run(tokens, token_mask=mask)
    default = Pipeline(model, "cuda").run(tokens, token_mask=mask)
    assert diff(ref, default).all_equal  # naive kernels in the simulator: the reference's order
    fast = Pipeline(model, "cuda", cuda_versions={"gather": 3, "gate": 2}).run(tokens, token_mask=mask)
    report = diff(ref, fast)
    for lid in (1, 4):
        assert report[f"L{lid}.rows.bf16"].equal and report[f"L{lid}.proj.kv"].equal
        assert report[f"L{lid}.gate.dot"].rel_l2 < 1e-6
    with pytest.raises(ValueError, match="cuda_versions names unknown stage"):
        Pipeline(model, "cuda", cuda_versions={"proj": "gemv_v2"})


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_chunked_run_equals_one_call(model, backend):
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 64, 50)
    mask = rng.random(50) > 0.1
    pipe = Pipeline(model, backend)
    whole = pipe.run(tokens, token_mask=mask)
    chunked = pipe.run(tokens, token_mask=mask, chunk_tokens=7, progress=True)
    assert diff(whole, chunked).all_equal
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        pipe.run(tokens, chunk_tokens=0)
