"""Pipeline: backends per stage, every declared capture point fires, hooks, captures, diff."""
import numpy as np
import pytest

from engram_numba.analysis.diff import diff
from engram_numba.fixtures import TINY_MASK, TINY_PATH, TINY_TOKENS
from engram_numba.formats.schema_a import load_gguf
from engram_numba.pipeline import POINTS, Capture, Pipeline, point_names
from engram_numba.stages.hash.cpu import EngramHasher


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
    expect = {"hash.ids": ((T, C), np.int64), "rows.raw": ((T * C, 84), np.uint8),
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
    np.testing.assert_array_equal(cap["L1.rows.raw"][0::6], np.repeat(model.layers[1].table[:1], 14, axis=0))
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
    with pytest.raises(KeyError, match="'L2.gate.dot' matches no capture point; did you mean 'L1.gate.dot', 'L4.gate.dot'"):
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
    with pytest.raises(ValueError, match="token_mask shape \\(1,\\) does not match token_ids shape \\(14,\\)"):
        pipe.run(TINY_TOKENS, token_mask=np.array([True]))


def test_versions_keyword_and_its_deprecated_name(model):
    """Pipeline takes kernel versions as versions= (EngramV41's name); cuda_versions= still works
    for now, with a DeprecationWarning, and reaches the engine the same way."""
    with pytest.warns(UserWarning, match="simulator"):
        new = Pipeline(model, {"proj": "cuda"}, versions={"proj": "gemv_v2"})
    with pytest.warns(DeprecationWarning, match="versions="), pytest.warns(UserWarning, match="simulator"):
        old = Pipeline(model, {"proj": "cuda"}, cuda_versions={"proj": "gemv_v2"})
    assert new.cuda_engine_for(2).versions == old.cuda_engine_for(2).versions == {"proj": "gemv_v2"}
    assert new.cuda_engine is new.cuda_engine_for(1)             # built once, grown only when asked for more
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="gemv_v9"):
        Pipeline(model, "cpu", cuda_versions={"proj": "gemv_v9"})
    with pytest.raises(TypeError, match="versions= only"):
        Pipeline(model, "cpu", versions={}, cuda_versions={})


def test_engine_hooks_of_a_pipeline_without_cuda_stages(model):
    pipe = Pipeline(model, "cpu")
    assert pipe.cuda_engine is None and pipe.cuda_kernels == {}
    with pytest.raises(ValueError, match="no stage of this pipeline runs on the cuda backend"):
        pipe.cuda_engine_for(4)


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
    top, bottom = report.plot()
    assert top.get_yscale() == "log"
    # the integer points are drawn too (share of elements that differ), one bar per layer and point
    labels = [t.get_text() for t in bottom.get_xticklabels()]
    assert "hash.ids" in labels and "rows.raw" in labels and bottom.get_ylim()[1] <= 1.05


@pytest.mark.slow     # the whole cuda pipeline in the simulator: make test only
def test_cuda_backend_with_chosen_kernel_versions(model, ref_capture):
    """The cuda backend on two tokens (the simulator runs every GPU thread in Python) with the fast
    kernels named through versions. (The launchers' defaults on this model and these tokens,
    bit-identical to the reference, are test_formats_fixtures.py's cuda test on "gguf".)"""
    tokens, mask = TINY_TOKENS[:2], TINY_MASK[:2]
    ref = Pipeline(model, "reference").run(tokens, token_mask=mask)
    fast = Pipeline(model, "cuda", versions={"rows": "q2k_v3", "gate": "gate_v2"}).run(tokens, token_mask=mask)
    # the tiny model's wkv is Q2_K, held as such (wkv_format=None): the naive Q2_K GEMV, k in order
    assert fast.meta["cuda_kernels"] == {"rows": "q2k_v3", "proj": "gemv_q2k_v1", "gate": "gate_v2"}
    report = diff(ref, fast)
    for lid in (1, 4):
        assert report[f"L{lid}.rows.bf16"].equal and report[f"L{lid}.proj.kv"].equal
        assert report[f"L{lid}.gate.dot"].rel_l2 < 1e-6
    with pytest.raises(ValueError, match="chosen per cuda stage"):
        Pipeline(model, "cuda", versions={"projection": "gemv_v2"})
    with pytest.raises(ValueError, match="no proj kernel version 'gemv_v9'"):
        Pipeline(model, "cuda", versions={"proj": "gemv_v9"})


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


# -- hooks on the raw rows, glob names, argument checks before any work --------------------------

@pytest.mark.parametrize("backend", ["reference", "cpu", "cuda"])
def test_raw_row_replacement_flows_into_decoding(model, backend):
    """Perturbing one Q2_K block's scale byte through a rows.raw hook changes exactly that row of
    rows.bf16 (the replacement is decoded, not gathered again from the ids)."""
    tokens, mask = TINY_TOKENS[:3], TINY_MASK[:3]
    pipe = Pipeline(model, {"rows": backend})
    base = pipe.run(tokens, token_mask=mask, names_filter=["L1.rows.raw", "L1.rows.bf16"])
    target = 4                                           # token 0, hash column 4

    def bump_scale(raw, name):
        raw = raw.copy()
        raw[target, 0] ^= 0x0F                           # sub-block 0's 4-bit scale
        return raw

    with pipe.hooks({"L1.rows.raw": bump_scale}):
        cap = pipe.run(tokens, token_mask=mask, names_filter=["L1.rows.raw", "L1.rows.bf16"])
    changed = np.flatnonzero((cap["L1.rows.bf16"] != base["L1.rows.bf16"]).any(axis=1))
    assert changed.tolist() == [target]
    from engram_numba.stages.rows.reference import rows_reference
    np.testing.assert_array_equal(cap["L1.rows.bf16"][target], rows_reference(cap["L1.rows.raw"][target:target + 1])[0])
    assert any("L1.rows.raw: " in h and "replaced" in h for h in cap.meta["hooks"])


def test_glob_patterns_in_filters_and_hooks(model):
    pipe = Pipeline(model, "cpu")
    cap = pipe.run(TINY_TOKENS, names_filter="L1.gate.*")
    assert list(cap) == ["L1.gate.key", "L1.gate.value", "L1.gate.dot", "L1.gate.gate"]
    assert list(pipe.run(TINY_TOKENS, names_filter=["L?.gate.gate", "tokens.*"])) == \
        ["tokens.ids", "tokens.mask", "L1.gate.gate", "L4.gate.gate"]
    seen = []
    with pipe.hooks({"L*.gate.dot": lambda a, n: seen.append(n)}):
        pipe.run(TINY_TOKENS, names_filter="L1.gate.dot")
    assert seen == ["L1.gate.dot", "L4.gate.dot"]
    with pytest.raises(KeyError, match="'L9.gate.\\*' matches no capture point"):
        pipe.run(TINY_TOKENS, names_filter="L9.gate.*")
    with pytest.raises(KeyError, match="matches no capture point; did you mean 'L1.gate.gate', 'L4.gate.gate'"):
        pipe.run(TINY_TOKENS, names_filter=["gate.gate"])
    with pytest.raises(TypeError, match="names_filter entries must be strings"):
        pipe.run(TINY_TOKENS, names_filter=[1])


def test_missing_capture_name_suggests_layer_prefixed_names(ref_capture):
    with pytest.raises(KeyError, match="did you mean 'L1.gate.gate', 'L4.gate.gate'"):
        ref_capture["gate.gate"]
    with pytest.raises(KeyError, match="did you mean 'L1.gate.dot'"):
        ref_capture["L1.gate.dto"]


def test_bad_ids_are_found_before_the_first_chunk(model):
    pipe = Pipeline(model, "cpu")
    hasher = EngramHasher(model.hash_tables)
    tokens = np.arange(40) % 60
    tokens[35] = 64                                      # outside the tiny token map, in chunk 5
    with pytest.raises(ValueError, match="token id 64 at position 35"):
        pipe.run(tokens, hasher=hasher, chunk_tokens=7)
    assert hasher.position == 0                          # no chunk ran
    with pytest.raises(ValueError, match="token_mask must be bool"):
        pipe.run(TINY_TOKENS, token_mask=np.ones(14, np.float32), hasher=hasher)
    assert hasher.position == 0


@pytest.mark.parametrize("bad, match", [
    (np.int64(3), "must be 1-D"),
    (np.array([1, 2**63 + 5], dtype=np.uint64), "outside the token map"),
    (np.array([1, "2"], dtype=object), "must be integers"),
    ([1.0, 2.0], "must be integers"),
    ([True, False], "must be integers"),
])
def test_ids_are_refused_as_the_hasher_refuses_them(model, bad, match):
    with pytest.raises(ValueError, match=match):
        Pipeline(model, "cpu").run(bad)
    with pytest.raises(ValueError, match=match):
        EngramHasher(model.hash_tables).hash(bad)


@pytest.mark.parametrize("mask", [np.array(["y"] * 14), np.ones(14), [None] * 14])
def test_masks_are_refused_not_coerced(model, mask):
    with pytest.raises(ValueError, match="token_mask must be bool"):
        Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=mask)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_eps_is_checked_on_every_backend(model, backend, eps):
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        Pipeline(model, backend, eps=eps)
    from engram_numba.stages.gate.cpu import gate_cpu
    from engram_numba.stages.gate.reference import gate_reference
    fn = gate_reference if backend == "reference" else gate_cpu
    h = np.ones((1, 4, 64), np.float32)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        fn(h, np.zeros((1, 320), np.uint16), np.ones((4, 64), np.float32), np.ones((4, 64), np.float32), eps=eps)


def test_synthetic_highway_is_float32_per_chunk_and_said(model):
    from engram_numba.pipeline import synthetic_highway
    whole = synthetic_highway(0, 600, 4, 64)
    assert whole.dtype == np.float32
    np.testing.assert_array_equal(synthetic_highway(250, 520, 4, 64), whole[250:520])
    cap = Pipeline(model, "cpu").run(TINY_TOKENS)
    assert cap.meta["highway"].startswith("synthetic")
    given = Pipeline(model, "cpu").run(TINY_TOKENS, highway=whole[:14])
    assert given.meta["highway"] == "given"
    np.testing.assert_array_equal(given["L1.highway.in"], cap["L1.highway.in"])


def test_capture_meta_says_what_ran(model):
    cap = Pipeline(model, "cpu").run(TINY_TOKENS)
    m = cap.meta
    assert m["model"].endswith("tiny_v41.gguf") and "schema A" in m["format"]
    assert m["encodings"] == {"1": "q2k", "4": "q2k"}
    assert set(m["versions"]) >= {"engram_numba", "numba", "numba_cuda", "numpy"}
    assert m["hooks"] == [] and m["cuda_kernels"] == {}


def test_cuda_backend_warning_points_at_the_caller(model):
    from numba.cuda import config
    if not config.ENABLE_CUDASIM:
        pytest.skip("a GPU is present: no simulator warning")
    with pytest.warns(UserWarning, match="simulator") as rec:
        Pipeline(model, "cuda")
    assert rec[0].filename == __file__


def test_layer_ids_are_integers():
    from engram_numba.config import EngramConfig
    for bad in ((1.5, 4), (True, 4), ("1", 4)):
        with pytest.raises(ValueError, match="must hold integers"):
            EngramConfig(dim=64, hc=4, layer_ids=bad)
    cfg = EngramConfig(dim=64, hc=4, layer_ids=(1, 4))
    with pytest.raises(ValueError, match="layer id must be an integer"):
        cfg.layer_index(1.0)


# ---- isolated stages: every stage fed another capture's inputs (inputs_from) ---------------------

def test_isolated_run_on_its_own_capture_reproduces_it(model, ref_capture):
    cap = Pipeline(model, "reference").run(inputs_from=ref_capture)
    report = diff(ref_capture, cap)
    assert report.all_equal and len(report) == len(ref_capture), str(report)
    assert "isolated" in cap.meta and cap.meta["highway"] == ref_capture.meta["highway"]


def test_isolated_stages_show_their_own_error_not_the_compounded_one(model, ref_capture, rng):
    """Perturb layer 1's rows.bf16 in the capture: an isolated run's proj.kv moves (it multiplies
    the perturbed rows) while its rows.bf16 (made from the ids) and its gate outputs (fed the
    capture's own key and value) stay the reference's; a chained run cannot tell them apart."""
    bad = dict(ref_capture)
    rows = ref_capture["L1.rows.bf16"].copy()
    rows ^= rng.integers(1, 4, rows.shape, dtype=np.uint16)           # 1-3 bf16 ulps, everywhere
    bad["L1.rows.bf16"] = rows
    cap = Pipeline(model, "reference").run(inputs_from=Capture(bad, ref_capture.meta))
    assert np.array_equal(cap["L1.rows.bf16"], ref_capture["L1.rows.bf16"])
    assert not np.array_equal(cap["L1.proj.kv"], ref_capture["L1.proj.kv"])
    for point in ("gate.dot", "gate.gate", "highway.out"):
        for lid in model.config.layer_ids:
            assert np.array_equal(cap[f"L{lid}.{point}"], ref_capture[f"L{lid}.{point}"]), (lid, point)
    assert np.array_equal(cap["L4.proj.kv"], ref_capture["L4.proj.kv"])    # layer 4 had its own inputs


def test_isolated_cpu_against_reference_is_exact_stage_by_stage(model, ref_capture):
    cap = Pipeline(model, "cpu").run(inputs_from=ref_capture)
    assert diff(ref_capture, cap).all_equal


def test_isolated_run_refuses_what_it_cannot_isolate(model, ref_capture):
    pipe = Pipeline(model, "reference")
    partial = ref_capture.select(["tokens.*", "L1.*"])
    with pytest.raises(ValueError, match=r"inputs_from lacks \['L4.hash.ids'"):
        pipe.run(inputs_from=partial)
    with pytest.raises(ValueError, match="pass no highway"):
        pipe.run(inputs_from=ref_capture, highway=pipe.default_highway(TINY_TOKENS.size))
    with pytest.raises(ValueError, match="token_ids differ"):
        pipe.run(TINY_TOKENS[::-1], inputs_from=ref_capture)
    with pytest.raises(TypeError, match="inputs_from must be a Capture"):
        pipe.run(inputs_from="run.npz")
    short = dict(ref_capture)
    short["L1.rows.bf16"] = short["L1.rows.bf16"][:-1]
    with pytest.raises(ValueError, match=r"L1.rows.bf16 is uint16\[.*needs uint16"):
        pipe.run(inputs_from=short)


def test_backend_names_blas_and_the_hash_on_the_cpu():
    """'blas' is a projection backend (alone: cpu with it); the hash has no GPU version, so
    backends='cuda' records hash=cpu and hash='cuda' is refused instead of mislabelled."""
    from engram_numba.pipeline import resolve_backends
    assert resolve_backends("cuda") == {"hash": "cpu", "rows": "cuda", "proj": "cuda", "gate": "cuda"}
    assert resolve_backends("blas") == {"hash": "cpu", "rows": "cpu", "proj": "blas", "gate": "cpu"}
    assert resolve_backends({"proj": "blas"})["proj"] == "blas"
    with pytest.raises(ValueError, match="hash has no GPU version"):
        resolve_backends({"hash": "cuda"})
    with pytest.raises(ValueError, match="'blas' is a projection backend; stage 'rows'"):
        resolve_backends({"rows": "blas"})
    with pytest.raises(ValueError, match="backend 'gpu' for stage 'hash' is not one of"):
        resolve_backends("gpu")


def test_blas_backend_runs_and_only_proj_differs_from_cpu():
    from engram_numba.bf16 import bf16_ulp_distance
    from engram_numba.fixtures import TINY_MASK, TINY_TOKENS, tiny_model_path
    from engram_numba.formats.load import load_model
    from engram_numba.pipeline import Pipeline
    with load_model(tiny_model_path()) as model:
        cpu = Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
        blas = Pipeline(model, "blas").run(TINY_TOKENS, token_mask=TINY_MASK)
    assert blas.meta["backends"]["proj"] == "blas"
    for name in ("L1.rows.bf16", "L4.hash.ids"):
        np.testing.assert_array_equal(blas[name], cpu[name])
    assert bf16_ulp_distance(blas["L1.proj.kv"], cpu["L1.proj.kv"]).max() <= 1


def test_deepseek_fp8_backend_is_the_twin_on_captured_rows_and_refuses_a_non_fp8_wkv():
    """'deepseek_fp8' (a projection backend; alone: cpu with it) projects with DeepSeek's FP8
    arithmetic: kv is the @njit twin's on the captured rows, bit for bit, and a model whose wkv is
    not FP8 is refused by layer when the Pipeline is built; stage-isolated on rows that are not FP8
    values, act_quant's rounding shows at proj.kv."""
    from engram_numba.fixtures import tiny_model_path
    from engram_numba.formats.load import load_model
    from engram_numba.pipeline import resolve_backends
    from engram_numba.stages.proj.cpu import projection_deepseek_fp8_cpu
    assert resolve_backends("deepseek_fp8") == {"hash": "cpu", "rows": "cpu", "proj": "deepseek_fp8", "gate": "cpu"}
    with pytest.raises(ValueError, match="'deepseek_fp8' is a projection backend; stage 'gate'"):
        resolve_backends({"gate": "deepseek_fp8"})
    hf = load_model(tiny_model_path().parent / "tiny_v41_hf")
    T = len(TINY_TOKENS)
    run = Pipeline(hf, "deepseek_fp8").run(TINY_TOKENS, token_mask=TINY_MASK)
    assert run.meta["backends"]["proj"] == "deepseek_fp8"
    for lid in hf.config.layer_ids:
        lf = hf.layers[lid]
        want = projection_deepseek_fp8_cpu(run[f"L{lid}.rows.bf16"].reshape(T, -1), lf.wkv_raw, lf.wkv_scales)
        np.testing.assert_array_equal(run[f"L{lid}.proj.kv"], want)
    with load_model(tiny_model_path()) as q2k:
        with pytest.raises(ValueError, match="engram layer 1's wkv is 'q2k'"):
            Pipeline(q2k, {"proj": "deepseek_fp8"})
        rows_q2k = Pipeline(q2k, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
    exact = Pipeline(hf, "cpu").run(inputs_from=rows_q2k)
    fp8 = Pipeline(hf, "deepseek_fp8").run(inputs_from=rows_q2k)
    rep = diff(exact, fp8, names=["L1.rows.bf16", "L1.proj.kv"])
    assert rep["L1.rows.bf16"].equal and not rep["L1.proj.kv"].equal
    assert 1e-3 < rep["L1.proj.kv"].rel_l2 < 0.1          # act_quant's rounding of Q2_K rows: ~2.8 %


def test_diff_names_take_globs_and_point_names_take_a_model(model):
    cap = Pipeline(model, "reference").run(TINY_TOKENS[:4])
    rep = diff(cap, cap, names="L*.gate.*")
    assert [r.name for r in rep.rows] == [n for n in cap if n.split(".", 1)[1].startswith("gate.")]
    assert [r.name for r in diff(cap, cap, names=["L1.proj.kv", "tokens.ids"]).rows] == ["tokens.ids", "L1.proj.kv"]
    with pytest.raises(KeyError, match="matches no capture point"):
        diff(cap, cap, names="L9.*")
    assert point_names(model) == point_names(model.config) == point_names([1, 4]) == Pipeline(model).point_names
    with pytest.raises(TypeError, match="point_names takes a model"):
        point_names(3.5)


def test_statistics_objects_compare_by_value(model):
    from engram_numba.analysis import streaming
    from engram_numba.analysis.stats import gate_stats
    cap = Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
    other = Pipeline(model, "cpu").run(TINY_TOKENS[:-1], token_mask=TINY_MASK[:-1])
    assert gate_stats(cap) == gate_stats(Capture(dict(cap), cap.meta))
    assert gate_stats(cap) != gate_stats(other)
    a, b = streaming.StreamingGateStats.empty(model), streaming.StreamingGateStats.empty(model)
    assert a == b
    assert a != gate_stats(cap)
    from engram_numba.analysis.corpus import corpus_stats
    one = corpus_stats(model, documents=[TINY_TOKENS, TINY_TOKENS[3:]], backend="cpu")
    again = corpus_stats(model, documents=[TINY_TOKENS, TINY_TOKENS[3:]], backend="cpu")
    fewer = corpus_stats(model, documents=[TINY_TOKENS], backend="cpu")
    assert one == again and one != fewer
