"""Every table encoding through `Pipeline` and `EngramV41`: a tiny in-memory model per encoding
(a small class implementing the model protocol over numpy arrays, below) runs reference == cpu
== cuda (the kernels in numba's simulator here), bit for bit at every capture point.

The models share the tiny configuration and hash of data/tiny_v41.gguf. Their tables: Q2_K and
Q8_0 encoded from the tiny model's float tables, FP8 encoded from them too (once with the scales
inline as ds4 stores them, once as a separate [rows, 8] tensor as DeepSeek's checkpoint does),
Q3_K and Q4_K random valid rows (this package has no encoder for them). Their wkv: bf16, F16,
Q8_0 or FP8 with 32 x 32 tiles, decoded by stages/proj/weights.py.
"""
import numpy as np
import pytest

from engram_numba.analysis.diff import diff
from engram_numba.bf16 import bf16_to_f32
from engram_numba.fixtures import TINY_MASK, TINY_TOKENS, quantize_matrix, tiny_config, tiny_float_weights, tiny_hash_tables
from engram_numba.formats.model import EngramLayer
from engram_numba.pipeline import Pipeline
from engram_numba.stages.proj.weights import encode_wkv_fp8, wkv_to_bf16
from engram_numba.stages.rows.encodings import ENCODINGS, random_raw_rows
from engram_numba.stages.rows.fp8 import assemble_rows_fp8, encode_rows_fp8
from engram_numba.stages.rows.kquants import quantize_q8_0
from engram_numba.stages.rows.reference import gather_reference


class ArrayRowReader:
    """model.rows(layer_id): raw rows by id, in the encoding's row layout (fp8: 264 bytes, the
    codes and scales assembled when they are stored apart)."""

    def __init__(self, layer):
        self._layer = layer
        self.n_rows = layer.n_rows

    def read(self, ids) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        raw = gather_reference(self._layer.table, ids)            # checks every id first
        if self._layer.table_scales is not None:
            raw = assemble_rows_fp8(raw, gather_reference(self._layer.table_scales, ids))
        return raw


class ArrayModel:
    """The model protocol (what Pipeline, EngramV41, info and stats use) over numpy arrays."""

    tokenizer_path = None

    def __init__(self, layers: dict, encoding: str):
        self.path = "<in-memory>"
        self.format = f"in-memory ({encoding} tables)"
        self.config = tiny_config()
        self.hash_tables = tiny_hash_tables()
        self.layers = layers
        self.tensors, self.kv, self.problems = {}, {}, []

    def rows(self, layer_id):
        return ArrayRowReader(self.layers[layer_id])

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


VARIANTS = ("q2k", "q3_k", "q4_k", "q8_0", "fp8", "fp8-separate-scales")


def build_model(variant: str, wkv_encoding: str | None = None) -> ArrayModel:
    """The tiny model with `variant`'s tables; wkv in `wkv_encoding` (default: per variant)."""
    cfg = tiny_config()
    weights = tiny_float_weights(cfg, tiny_hash_tables())
    rng = np.random.default_rng(11)
    encoding = variant.split("-")[0]
    layers = {}
    for li, lid in enumerate(cfg.layer_ids):
        w = weights[lid]
        rows = w["table_rows"]                                       # [rows, 256] float32
        scales = wkv_scales = None
        if encoding == "q2k":
            table = quantize_matrix(rows)
        elif encoding == "q8_0":
            table = quantize_q8_0(rows)
        elif encoding == "fp8":
            codes, scales = encode_rows_fp8(rows)
            table = codes if variant.endswith("separate-scales") else assemble_rows_fp8(codes, scales)
            scales = scales if variant.endswith("separate-scales") else None
        else:
            table = random_raw_rows(encoding, rows.shape[0], rng)
        wkv_enc = wkv_encoding or {"q2k": "bf16", "q3_k": "f16", "q4_k": "bf16", "q8_0": "q8_0", "fp8": "fp8"}[encoding]
        if wkv_enc == "fp8":
            wkv_raw, wkv_scales = encode_wkv_fp8(w["wkv"])
        elif wkv_enc == "q8_0":
            wkv_raw = quantize_q8_0(w["wkv"])
        elif wkv_enc == "q2k":
            wkv_raw = quantize_matrix(w["wkv"])
        elif wkv_enc == "f16":
            wkv_raw = w["wkv"].astype(np.float16)
        else:
            wkv_raw = wkv_to_bf16(w["wkv"], "f32")
        layers[lid] = EngramLayer(lid, li, table=table, table_encoding=encoding, wkv_raw=wkv_raw, wkv_encoding=wkv_enc,
                                  q_weight=w["q_weight"], k_weight=w["k_weight"], table_scales=scales,
                                  wkv_scales=wkv_scales)
    return ArrayModel(layers, encoding)


@pytest.fixture(scope="module", params=VARIANTS)
def model(request):
    return build_model(request.param)


@pytest.mark.slow     # the whole cuda pipeline in the simulator: make test only (every encoding)
def test_reference_cpu_and_cuda_agree_on_every_encoding(model):
    enc = model.layers[1].table_encoding
    tokens, mask = TINY_TOKENS[:2], TINY_MASK[:2]
    ref = Pipeline(model, "reference").run(tokens, token_mask=mask)
    cpu = Pipeline(model, "cpu").run(tokens, token_mask=mask)
    # fp8 rows with their scales apart differ from the fp8 variant in the rows only: their FP8 wkv
    # (the same as fp8's, projected by the fp8 case) is held as bf16 and projected by gemv_v1, in the
    # simulator a fraction of the naive FP8 GEMV's time (both are the reference's bits)
    versions = {"proj": "gemv_v1"} if model.layers[1].table_scales is not None else None
    with pytest.warns(UserWarning, match="simulator"):
        cuda_pipe = Pipeline(model, "cuda", versions=versions)
    cuda = cuda_pipe.run(tokens, token_mask=mask)
    for other in (cpu, cuda):
        report = diff(ref, other)
        assert report.all_equal, str(report)
    assert cuda.meta["cuda_kernels"]["rows"].startswith(f"{enc}_v")
    assert ref.meta["encodings"] == {"1": enc, "4": enc} and ref.meta["format"] == f"in-memory ({enc} tables)"
    row_bytes = ENCODINGS[enc].row_bytes
    C = model.config.n_hash_cols
    assert ref["L1.rows.raw"].shape == (2 * C, row_bytes)              # fp8: always the 264-byte row
    assert np.isfinite(ref["L4.highway.out"]).all()


def test_raw_row_hook_is_decoded_in_the_table_encoding(model):
    """A rows.raw hook's replacement is what every backend decodes (the rows of token 0 replaced
    by those of token 1), also for fp8 codes stored apart from their scales."""
    tokens = TINY_TOKENS[:2]
    C = model.config.n_hash_cols

    def swap(raw, name):
        out = raw.copy()
        out[:C] = raw[C:2 * C]
        return out

    got = {}
    for backend in ("reference", "cpu"):
        with Pipeline(model, {"rows": backend}).hooks({"L1.rows.raw": swap}) as pipe:
            got[backend] = pipe.run(tokens, names_filter=["L1.rows.bf16"])["L1.rows.bf16"]
    np.testing.assert_array_equal(got["reference"], got["cpu"])
    np.testing.assert_array_equal(got["reference"][:C], got["reference"][C:])


def test_engine_uploads_the_scales_of_a_separate_scales_table():
    from engram_numba.engine import EngramV41
    model = build_model("fp8-separate-scales")
    eng = EngramV41(model, max_tokens=4, device_tables=True)
    lw = eng.layers[1]
    assert lw.table.shape == (model.layers[1].n_rows, 256) and lw.table_scales.shape == (model.layers[1].n_rows, 8)
    assert lw.row_bytes == 264 and lw.encoding == "fp8"
    assert eng.device_bytes >= lw.table.nbytes + lw.table_scales.nbytes
    ids = np.array([[0, 5, 9, 2, 7, 1]], np.int64)
    eng.rows_from_ids(1, ids)
    from engram_numba.stages.rows.reference import rows_reference
    want = rows_reference(model.rows(1).read(ids), "fp8")
    np.testing.assert_array_equal(eng.rows_bf16(1).copy_to_host(), want)
    eng.rows_from_raw(1, model.rows(1).read(ids))                       # 264-byte raw rows from the host
    np.testing.assert_array_equal(eng.rows_bf16(1).copy_to_host(), want)
    assert not isinstance(lw.table_scales, np.ndarray)                 # uploaded: a device array


def test_engine_refuses_inconsistent_tables():
    from engram_numba.engine import EngramV41
    model = build_model("fp8-separate-scales")
    model.layers[1].table_scales = model.layers[1].table_scales[:, :4]
    with pytest.raises(ValueError, match=r"layer 1: table_scales \[\d+, 4\] needs an fp8 table of codes"):
        EngramV41(model, max_tokens=2)
    model = build_model("q8_0")
    model.layers[4].table = model.layers[4].table[:, :270]
    with pytest.raises(ValueError, match="layer 4: its q8_0 table has 270 bytes a row, expected 272"):
        EngramV41(model, max_tokens=2)


def test_what_quantisation_costs_at_the_gate():
    """The same 256 tokens through the tiny model stored three ways from the same float weights:
    FP8 (tables and wkv, as DeepSeek's checkpoint), Q8_0 and Q2_K (tables and wkv; the Q2_K one is
    data/tiny_v41.gguf's). The FP8 run is the reference; printed: relative L2 along the stages and
    the dots that change sign (the gate on the other side of 0.5)."""
    import engram_numba as en
    from engram_numba.analysis.quant_cost import gate_cost
    tokens = np.random.default_rng(5).integers(0, 64, 256)
    mask = np.ones(256, bool)
    mask[::17] = False
    runs = {}
    with en.load_gguf(en.tiny_model_path()) as q2k_file:
        for label, model in (("fp8", build_model("fp8")), ("q8_0", build_model("q8_0", "q8_0")),
                             ("q2k", q2k_file)):
            runs[label] = Pipeline(model, "reference").run(tokens, token_mask=mask)
    cost = {label: gate_cost(runs["fp8"], runs[label], "fp8", label) for label in ("q8_0", "q2k")}
    for c in cost.values():
        print("\n" + str(c))
    floats = tiny_float_weights(tiny_config(), tiny_hash_tables())
    for lid in (1, 4):                     # each encoding's own error: rows against the float rows
        exact = floats[lid]["table_rows"][runs["fp8"][f"L{lid}.hash.ids"].reshape(-1)].astype(np.float64)
        errs = {label: np.linalg.norm(bf16_to_f32(cap[f"L{lid}.rows.bf16"]) - exact) / np.linalg.norm(exact)
                for label, cap in runs.items()}
        print(f"layer {lid} rows against the float weights (relative L2): "
              + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()))
        assert errs["q8_0"] < errs["fp8"] < errs["q2k"]
    assert gate_cost(runs["fp8"], runs["fp8"])[1].sign_flips == 0
    for lid in (1, 4):
        q8, q2 = cost["q8_0"][lid], cost["q2k"][lid]
        assert q8.live == q2.live == 4 * int(mask.sum())
        for point in ("rows.bf16", "proj.kv", "gate.dot"):
            assert 0 < q8.rel_l2[point] < q2.rel_l2[point], (lid, point)
        assert q8.rel_l2["rows.bf16"] < 0.05 < q2.rel_l2["rows.bf16"] < 0.5
        assert q8.sign_flips <= q2.sign_flips and q8.gate_mean_abs < q2.gate_mean_abs


@pytest.mark.slow
def test_pipeline_picks_deepseeks_fp8_gemm_by_name():
    """An FP8 wkv projected with DeepSeek's arithmetic on the tensor cores (gemm_fp8_v1, picked by
    name): in the simulator, the captured kv is the CPU twin's, bit for bit, from the captured rows.

    One token (the naive kernel's simulated cost is one thread per output and token, ~20 s a layer
    and token here): what this pins is the pick by name and the wkv codes and scales reaching the
    kernel, in both layers. Several tokens through this kernel (partial token blocks, T = 3 and 17)
    are test_proj_fp8_wgmma.py's cases through the same prepare_project_q, and the [T, K] rows the
    pipeline hands any projection are test_reference_cpu_and_cuda_agree_on_every_encoding's."""
    from engram_numba.stages.proj.cpu import projection_deepseek_fp8_cpu
    model = build_model("fp8")
    tokens, mask = TINY_TOKENS[:1], TINY_MASK[:1]
    with pytest.warns(UserWarning, match="simulator"):
        pipe = Pipeline(model, {"rows": "cpu", "proj": "cuda", "gate": "cpu"}, versions={"proj": "gemm_fp8_v1"})
    cap = pipe.run(tokens, token_mask=mask)
    assert cap.meta["cuda_kernels"]["proj"] == "gemm_fp8_v1"
    for lid in model.config.layer_ids:
        layer = model.layers[lid]
        x = cap[f"L{lid}.rows.bf16"].reshape(len(tokens), -1)
        want = projection_deepseek_fp8_cpu(x, layer.wkv_raw, layer.wkv_scales)
        np.testing.assert_array_equal(cap[f"L{lid}.proj.kv"], want)
