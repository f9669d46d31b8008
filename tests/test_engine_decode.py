"""EngramV41's decode path: wkv held in its file encoding, the graphed one-token decode, and the
pinned uploads of start-up.

Simulator tier (tiny model): the wkv format each construction picks (and refuses), that q2k- and
fp8-resident weights give today's bf16 projection bit for bit with the in-order kernels, the
many-token path (weight decoded to bf16, then the GEMM), decode == step (decode falls back to the
ungraphed path: there are no graphs in the simulator), refusals before any state changes, the
hasher's `out=`, and the uploader's file detection. GPU tier (`gpu`): decode through CUDA graphs
equals the ungraphed step bit for bit over a sequence (device tables and host tables, q2k, bf16 and
fp8 weights (gemv_fp8_v5, gemv_fp8_v6), a masked token), a new highway address captures a new graph, a bad token id leaves
everything untouched, and the pinned uploader's chunks reassemble the array exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from engram_numba import engine as engine_mod
from engram_numba.device.upload import Uploader, file_region
from engram_numba.engine import EngramV41
from engram_numba.fixtures import TINY_PATH, TINY_TOKENS
from engram_numba.formats.model import EngramLayer
from engram_numba.formats.schema_a import load_gguf
from engram_numba.stages.hash.cpu import EngramHasher
from engram_numba.stages.proj import reference as R

T = 3


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


def _FP8Layer(lf, rng, N, K) -> EngramLayer:
    """A tiny-model layer whose wkv is FP8 codes + 32x32 tile scales."""
    codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 0x01
    scales = rng.integers(116, 124, (-(-N // 32), K // 32), dtype=np.uint8)
    layer = EngramLayer(lf.layer_id, lf.index, table=lf.table, table_encoding=lf.table_encoding, wkv_raw=codes,
                        wkv_encoding="fp8", wkv_scales=scales, q_weight=lf.q_weight, k_weight=lf.k_weight,
                        wkv_shape=(N, K))
    assert np.array_equal(layer.wkv_bf16(), R.wkv_fp8_bf16(codes, scales))   # the layer decodes as the reference
    return layer


class _FP8Model:
    def __init__(self, base, seed=3):
        rng = np.random.default_rng(seed)
        self._base = base
        self.config, self.hash_tables = base.config, base.hash_tables
        self.layers = {lid: _FP8Layer(lf, rng, base.config.proj_out, base.config.proj_in) for lid, lf in base.layers.items()}

    def rows(self, lid):
        return self._base.rows(lid)


@pytest.fixture(scope="module")
def fp8_model(model):
    return _FP8Model(model)


# ---- wkv formats --------------------------------------------------------------------------------

def test_layers_are_the_typed_protocol(model, rng):
    """Every loader fills one layer type; its encodings come from the stages' tables and are
    checked when the layer is made, naming the layer."""
    lf = model.layers[1]
    assert isinstance(lf, EngramLayer) and (lf.table_encoding, lf.wkv_encoding, lf.wkv_type) == ("q2k", "q2k", "Q2_K")
    kw = dict(table=lf.table, wkv_raw=np.zeros((8, 8), np.uint16), q_weight=lf.q_weight, k_weight=lf.k_weight)
    with pytest.raises(ValueError, match=r"engram layer 1: unknown table encoding 'Q2_K'; encodings are \['q2k'"):
        EngramLayer(1, 0, table_encoding="Q2_K", wkv_encoding="bf16", **kw)
    with pytest.raises(ValueError, match=r"engram layer 1: unknown wkv encoding 'BF16'"):
        EngramLayer(1, 0, table_encoding="q2k", wkv_encoding="BF16", **kw)
    with pytest.raises(ValueError, match="wkv scales are for an fp8 wkv, not bf16"):
        EngramLayer(1, 0, table_encoding="q2k", wkv_encoding="bf16", wkv_scales=np.zeros((1, 1), np.uint8), **kw)
    with pytest.raises(ValueError, match="separate table scales are for fp8 tables, not q2k"):
        EngramLayer(1, 0, table_encoding="q2k", wkv_encoding="bf16", table_scales=np.zeros((1, 8), np.uint8), **kw)


def test_default_wkv_format_is_the_files_compact_one(model, fp8_model):
    cfg = model.config
    from engram_numba.device.intrinsics import SIMULATOR
    # on a GPU a Q2_K wkv is re-laid out as q2k_r at build (same bytes); the simulator keeps q2k
    assert EngramV41(model, max_tokens=2).wkv_format == ({1: "q2k", 4: "q2k"} if SIMULATOR else {1: "q2k_r", 4: "q2k_r"})
    q = EngramV41(model, max_tokens=2, wkv_format="q2k")
    assert q.wkv_format == {1: "q2k", 4: "q2k"}
    lw = q.layers[1]
    assert lw.wkv.dtype == np.uint8 and tuple(lw.wkv.shape) == (cfg.proj_out, cfg.proj_in // 256 * 84)
    b = EngramV41(model, max_tokens=2, wkv_format="bf16")
    assert b.layers[1].wkv.dtype == np.uint16 and tuple(b.layers[1].wkv.shape) == (cfg.proj_out, cfg.proj_in)
    assert q.device_bytes < b.device_bytes
    f = EngramV41(fp8_model, max_tokens=2)
    assert f.wkv_format == {1: "fp8", 4: "fp8"}
    assert tuple(f.layers[1].wkv_scales.shape) == (cfg.proj_out // 32, cfg.proj_in // 32)
    # a bf16 proj version decides the format when none is given; the build report is there
    v = EngramV41(model, max_tokens=2, versions={"proj": "gemv_v1"})
    assert v.wkv_format == {1: "bf16", 4: "bf16"}
    rep = q.build_report
    assert {"seconds", "bytes", "gb_per_s", "uploads", "wkv_format"} <= set(rep)
    assert rep["bytes"] > 0


def test_q2k_r_wkv_is_the_files_blocks_re_laid_out_in_one_buffer(model, fp8_model):
    """wkv_format="q2k_r": each layer's wkv is the device repack of the file's Q2_K blocks (the numpy
    reference's bytes), both layers in one buffer (decode projects them in one launch); the
    decoded weight is the file's bf16 weight; an FP8 wkv is refused by name before any upload."""
    from engram_numba.stages.proj.launch import prepare_wkv_to_bf16
    from engram_numba.stages.proj.q2k_r import q2k_r_shape, repack_q2k_r
    cfg = model.config
    eng = EngramV41(model, max_tokens=2, wkv_format="q2k_r")
    assert eng.wkv_format == {1: "q2k_r", 4: "q2k_r"}
    nt, width = q2k_r_shape(cfg.proj_out, cfg.proj_in)
    assert tuple(eng._wkv_pair.shape) == (2 * nt, width)
    for li, lid in enumerate(cfg.layer_ids):
        got = eng.layers[lid].wkv.copy_to_host()
        np.testing.assert_array_equal(got, repack_q2k_r(np.asarray(model.layers[lid].wkv_raw), cfg.proj_in))
        np.testing.assert_array_equal(eng._wkv_pair.copy_to_host()[li * nt:(li + 1) * nt], got)
    out = cuda.device_array((cfg.proj_out, cfg.proj_in), np.uint16)
    prepare_wkv_to_bf16(eng.layers[1].wkv, None, out, weight="q2k_r")()
    np.testing.assert_array_equal(out.copy_to_host(), model.layers[1].wkv_bf16())
    with pytest.raises(ValueError, match="wkv_format='q2k_r'.*stores its wkv as fp8"):
        EngramV41(fp8_model, max_tokens=2, wkv_format="q2k_r")


def test_wkv_format_refusals_come_before_any_upload(model, monkeypatch):
    calls = []
    monkeypatch.setattr(engine_mod.Uploader, "upload", lambda self, *a, **k: calls.append(a) or None)
    with pytest.raises(ValueError, match=r"stores its wkv as q2k \(nothing is re-quantised\)"):
        EngramV41(model, max_tokens=2, wkv_format="fp8")
    with pytest.raises(ValueError, match="wkv_format must be None or one of"):
        EngramV41(model, max_tokens=2, wkv_format="q4_k")
    with pytest.raises(ValueError, match="reads q2k weights but wkv_format='bf16'"):
        EngramV41(model, max_tokens=2, wkv_format="bf16", versions={"proj": "gemv_q2k_v1"})
    with pytest.raises(ValueError, match="proj kernel 'gemv_fp8_v1' reads fp8 weights"):
        EngramV41(model, max_tokens=2, versions={"proj": "gemv_fp8_v1"})
    assert calls == []


def _apply_kv(engine, model, tokens, layer_index=1):
    lid = model.config.layer_ids[layer_index]
    ids = EngramHasher(model.hash_tables).hash(tokens)[:, layer_index, :]
    engine.rows_from_ids(lid, ids)
    return engine.project(lid).copy_to_host(), lid, ids


@pytest.fixture(scope="module")
def bf16_kv(model):
    """kv of a bf16-resident engine on the first 2 tokens (layer index 1), shared by the tests that
    compare a q2k-resident engine with it (each simulated projection takes seconds)."""
    return _apply_kv(EngramV41(model, max_tokens=4, device_tables=True, wkv_format="bf16"), model, TINY_TOKENS[:2])[0]


@pytest.mark.slow     # whole engines in the simulator: make test only
def test_resident_weights_equal_the_bf16_projection(model, fp8_model, bf16_kv):
    """In the simulator the defaults are the in-order kernels on both sides (gemv_q2k_v1 /
    gemv_fp8_v1 against gemv_v1 / gemm_v1): the projection is the same bits, whatever format the
    weight is held in. (The fp8 model's bf16-resident engine would run the launches the q2k
    model's does, on a weight `_FP8Layer` checks against the reference decoder: its kv is checked
    against the reference projection only.)"""
    from engram_numba.stages.rows.reference import rows_reference
    for m in (model, fp8_model):
        kv_q, lid, ids = _apply_kv(EngramV41(m, max_tokens=4, device_tables=True), m, TINY_TOKENS[:2])
        if m is model:
            np.testing.assert_array_equal(kv_q, bf16_kv)
        x = rows_reference(m.rows(lid).read(ids)).reshape(2, -1)
        np.testing.assert_array_equal(kv_q, R.projection_reference(x, m.layers[lid].wkv_bf16()))


@pytest.mark.slow     # whole engines in the simulator: make test only
def test_many_tokens_decode_the_weight_then_run_the_gemm(model, monkeypatch, bf16_kv):
    """Above QUANT_GEMV_MAX_TOKENS the engine decodes a q2k wkv to bf16 (once per layer, into a
    shared scratch) and runs the bf16 GEMM: the same bits as a bf16-resident engine."""
    monkeypatch.setattr(engine_mod, "QUANT_GEMV_MAX_TOKENS", 1)
    eng = EngramV41(model, max_tokens=4, device_tables=True)
    kv_q, lid, _ = _apply_kv(eng, model, TINY_TOKENS[:2])
    assert "+" in eng.last_kernels()["proj"] and eng._scratch_layer == lid
    np.testing.assert_array_equal(kv_q, bf16_kv)
    assert eng.device_bytes > EngramV41(model, max_tokens=4, device_tables=True).device_bytes   # the scratch


# ---- decode ---------------------------------------------------------------------------------------

def _run_sequence(engine, model, tokens, masks, use_decode, seed=7):
    cfg = model.config
    rng = np.random.default_rng(seed)
    h0 = rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)
    d_h = cuda.to_device(h0)
    hasher = EngramHasher(model.hash_tables)
    outs = []
    for tok, live in zip(tokens, masks):
        if use_decode:
            engine.decode(int(tok), d_h, hasher, None if live is None else live)
        else:
            engine.step([int(tok)], d_h, hasher, None if live is None else np.array([live]), graph=False)
        cuda.synchronize()
        outs.append(d_h.copy_to_host())
    return np.stack(outs), hasher


@pytest.mark.slow     # every decode configuration in the simulator: make test only
def test_decode_equals_step_in_the_simulator(model, simulator):
    """Without a GPU, decode runs the same launches one by one: equal to step(graph=False). Two
    tokens (each one-token step is seconds of simulated projection): a masked one, then one that
    must not inherit its mask and continues its hasher's history."""
    if not simulator:
        pytest.skip("on a GPU the graphed decode is tested in the gpu tier")
    eng = EngramV41(model, max_tokens=2, device_tables=True)
    assert not eng.graphs_available
    tokens, masks = TINY_TOKENS[:2], [False, None]
    got, hasher = _run_sequence(eng, model, tokens, masks, True)
    want, _ = _run_sequence(EngramV41(model, max_tokens=2, device_tables=True), model, tokens, masks, False)
    np.testing.assert_array_equal(got, want)
    cfg = model.config
    h0 = np.random.default_rng(7).standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)   # _run_sequence's
    np.testing.assert_array_equal(got[0], h0)          # the masked token left the highway as it was
    assert not np.array_equal(got[1], got[0])
    assert hasher.position == 2


@pytest.mark.slow     # two tokens of simulated projection
def test_fp8_decode_equals_step_in_the_simulator(fp8_model, simulator):
    """The FP8-wkv engine (the GPU tier's fp8 cases) without a GPU: decode runs its launches one by
    one (the simulator's FP8 projection: gemv_fp8_v1) and equals step(graph=False). One live token
    (each is a minute of simulated FP8 projection; masks and the hasher's history across tokens are
    the q2k test's above, the same code whatever the wkv format)."""
    if not simulator:
        pytest.skip("on a GPU the graphed decode is tested in the gpu tier")
    kw = dict(max_tokens=2, device_tables=True, wkv_format="fp8")
    eng = EngramV41(fp8_model, **kw)
    assert not eng.graphs_available and eng.wkv_format == {1: "fp8", 4: "fp8"}
    tokens, masks = TINY_TOKENS[:1], [None]
    got, hasher = _run_sequence(eng, fp8_model, tokens, masks, True)
    want, _ = _run_sequence(EngramV41(fp8_model, **kw), fp8_model, tokens, masks, False)
    np.testing.assert_array_equal(got, want)
    cfg = fp8_model.config
    h0 = np.random.default_rng(7).standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)   # _run_sequence's
    assert not np.array_equal(got[0], h0) and hasher.position == 1                          # the token updated h


@pytest.mark.slow     # two tokens of simulated projection
@pytest.mark.parametrize("gate", ["gate_v3", "gate_v4"])
def test_fused_decode_launches_equal_step_in_the_simulator(model, simulator, gate):
    """The decode graph's launch list with the two layers fused (one gather launch, one gate
    launch: the kernels chosen by name, since the simulator's defaults have no pair form), run
    launch by launch without a graph (the simulator has none), equals step(graph=False) bit for
    bit, dot and gate of both layers included; a masked token, then a live one. The gate pair
    is the per-layer gate's: gate_v3's or gate_v4's. Both engines hold wkv as bf16: what is fused
    here is the gather and the gate, and a simulated bf16 projection is less than half the time of
    the Q2_K one (the launch list with the file's Q2_K wkv is
    test_decode_equals_step_in_the_simulator's)."""
    if not simulator:
        pytest.skip("on a GPU the graphed decode is tested in the gpu tier")
    from engram_numba.decode_graph import DecodeGraph
    versions = {"rows": "q2k_v3", "gate": gate}
    cfg = model.config
    eng = EngramV41(model, max_tokens=2, device_tables=True, versions=versions, wkv_format="bf16")
    ref = EngramV41(model, max_tokens=2, device_tables=True, versions=versions, wkv_format="bf16")
    g = DecodeGraph.__new__(DecodeGraph)          # its launch list only: no pinned buffers, no capture
    g.engine, g.stream, g.device_tables = eng, 0, True
    eng._decode_bad = cuda.to_device(np.zeros(1, np.uint32))
    g.dev_ids = cuda.to_device(np.zeros(len(cfg.layer_ids) * cfg.n_hash_cols, np.int64))
    g.dev_mask = cuda.to_device(np.ones(1, np.uint8))
    h0 = np.random.default_rng(7).standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)
    d_h, d_ref = cuda.to_device(h0), cuda.to_device(h0)
    launches = g._launches(d_h, "fp32")
    names = [x.name for x in launches]
    assert names.count("q2k_v3[2 layers]") == 1 and names[-1] == f"{gate}[2 layers]", names
    assert not any(n in ("q2k_v3", gate) for n in names), names
    hasher, ref_hasher = EngramHasher(model.hash_tables), EngramHasher(model.hash_tables)
    for tok, live in zip(TINY_TOKENS[:2], (False, True)):
        ids = hasher.hash([int(tok)], None if live else np.array([False]))
        g.dev_ids.copy_to_device(np.ascontiguousarray(ids.reshape(-1)))
        g.dev_mask.copy_to_device(np.array([int(live)], np.uint8))
        for launch in launches:
            launch()
        for ws in eng._ws.values():                # as decode marks them after a replay
            ws.rows_tokens = ws.kv_tokens = ws.gate_tokens = 1
        ref.step([int(tok)], d_ref, ref_hasher, np.array([live]), graph=False)
        np.testing.assert_array_equal(d_h.copy_to_host().view(np.uint32), d_ref.copy_to_host().view(np.uint32))
        for lid in cfg.layer_ids:
            np.testing.assert_array_equal(eng.rows_bf16(lid).copy_to_host()[:cfg.n_hash_cols],
                                          ref.rows_bf16(lid).copy_to_host())
            for got, want in zip(eng.last_gate(lid), ref.last_gate(lid)):
                np.testing.assert_array_equal(got.copy_to_host().view(np.uint32), want.copy_to_host().view(np.uint32))
    assert int(eng._decode_bad.copy_to_host()[0]) == 0
    assert not np.array_equal(d_h.copy_to_host(), h0)


def test_decode_refuses_bad_input_before_anything_changes(model):
    cfg = model.config
    eng = EngramV41(model, max_tokens=2, device_tables=True)
    hasher = EngramHasher(model.hash_tables)
    h0 = np.ones((1, cfg.hc, cfg.dim), np.float32)
    d_h = cuda.to_device(h0)
    vocab = model.hash_tables.token_map.size
    with pytest.raises(ValueError, match=f"token id {vocab} at position 0"):
        eng.decode(vocab, d_h, hasher)
    with pytest.raises(ValueError, match="token_mask must be a bool"):
        eng.decode(2, d_h, hasher, np.array([1, 0]))
    with pytest.raises(ValueError, match="graph=True replays the one-token decode graph"):
        eng.step([2, 3], d_h, hasher, graph=True)
    assert hasher.position == 0
    np.testing.assert_array_equal(d_h.copy_to_host(), h0)


def test_hasher_writes_into_out_after_checking_it(model):
    hasher = EngramHasher(model.hash_tables)
    want = EngramHasher(model.hash_tables).hash(TINY_TOKENS[:2])
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous int64 array of shape"):
        hasher.hash(TINY_TOKENS[:2], out=np.empty((2, 1, 1), np.int64))
    assert hasher.position == 0
    out = np.full(want.shape, -5, np.int64)
    assert hasher.hash(TINY_TOKENS[:2], out=out) is out
    np.testing.assert_array_equal(out, want)


# ---- uploads ------------------------------------------------------------------------------------

def test_file_region_finds_the_map(tmp_path):
    path = tmp_path / "blob.bin"
    data = np.arange(4096, dtype=np.uint8)
    data.tofile(path)
    m = np.memmap(path, dtype=np.uint8, mode="r")
    view = m.view(np.ndarray)[1000:3000].reshape(100, 20)
    import os
    assert file_region(view) == (os.path.abspath(str(path)), 1000)
    assert file_region(np.memmap(path, dtype=np.uint8, mode="r")[77:]) == (os.path.abspath(str(path)), 77)
    assert file_region(np.zeros(4)) is None
    assert file_region(view[:, ::2]) is None
    with Uploader() as up:
        dev = up.upload(view, "test")
        np.testing.assert_array_equal(dev.copy_to_host(), view)
        assert up.stats.records[0].nbytes == 2000


def test_uploader_arguments():
    with pytest.raises(ValueError, match="chunk_bytes must be"):
        Uploader(chunk_bytes=100)


# ---- GPU tier -----------------------------------------------------------------------------------

DECODE_TOKENS = np.array([2, 17, 47, 13, 32, 59, 39, 29, 42, 31, 36, 6, 27, 8, 5, 9, 60, 61, 3, 44], dtype=np.int64)
DECODE_MASKS = [None] * 9 + [False] + [None] * 10


# the FP8-wkv engine's cases: its one-token projection is the default (gemv_fp8_v5: two launches, x_f16
# then the GEMV, both captured) or gemv_fp8_v6 by name (one launch)
FP8_DECODE_VERSIONS = {"fp8-default": None, "fp8-v6": "gemv_fp8_v6"}


@pytest.mark.gpu
@pytest.mark.parametrize("device_tables", [True, False], ids=["device-tables", "host-tables"])
@pytest.mark.parametrize("wkv_format", [None, "q2k", "bf16", *FP8_DECODE_VERSIONS])
def test_gpu_decode_graph_equals_ungraphed_step(model, fp8_model, device_tables, wkv_format, gpu_record):
    """A 20-token sequence (one dead token) through decode's CUDA graphs and through step(graph=False)
    on a second engine: the highway after every token is the same bits; step(T=1) uses the graph.
    The fp8 cases run the FP8-wkv model (the tiny model's tables, random FP8 wkv)."""
    import time
    fp8 = wkv_format in FP8_DECODE_VERSIONS
    m = fp8_model if fp8 else model
    kw = dict(max_tokens=4, device_tables=device_tables, wkv_format="fp8" if fp8 else wkv_format)
    if fp8 and FP8_DECODE_VERSIONS[wkv_format]:
        kw["versions"] = {"proj": FP8_DECODE_VERSIONS[wkv_format]}
    eng = EngramV41(m, **kw)
    assert eng.graphs_available
    got, hasher = _run_sequence(eng, m, DECODE_TOKENS, DECODE_MASKS, True)
    want, _ = _run_sequence(EngramV41(m, **kw), m, DECODE_TOKENS, DECODE_MASKS, False)
    np.testing.assert_array_equal(got, want)
    assert len(eng._decode_graphs) == 1 and hasher.position == len(DECODE_TOKENS)
    names = next(iter(eng._decode_graphs.values())).names
    if fp8:                    # the graph holds the FP8 GEMV of each layer
        want_proj = FP8_DECODE_VERSIONS[wkv_format] or "gemv_fp8_v5"
        assert names.count(want_proj) == len(model.config.layer_ids), names
    if wkv_format is None:     # q2k_r: both layers' projections are one launch between the gathers and the gates
        assert sum(n.startswith(("gemv_", "proj")) and "[2 layers]" in n for n in names) == 1, names
    if device_tables:          # both layers' gathers and both gates fused into one launch each
        assert "q2k_v3[2 layers]" in names and names[-1] == "gate_v3[2 layers]", names
        assert "gate_v3" not in names and "q2k_v3" not in names, names
    else:                      # the host-table graph keeps a launch per layer
        assert not any("[2 layers]" in n for n in names if not n.startswith("gemv_")), names
    if device_tables:
        assert eng.decode_bad_ids() == 0
    # step with one token replays the graph too
    d_h = cuda.to_device(np.ones((1, model.config.hc, model.config.dim), np.float32))
    eng.step([5], d_h, EngramHasher(m.hash_tables))
    assert len(eng._decode_graphs) == 2
    # host time of a decode call (the replay is asynchronous)
    h = cuda.to_device(np.ones((1, model.config.hc, model.config.dim), np.float32))
    hs = EngramHasher(m.hash_tables, capacity=1024)
    eng.decode(3, h, hs)
    cuda.synchronize()
    t0 = time.perf_counter()
    for tok in np.resize(DECODE_TOKENS, 200):
        eng.decode(int(tok), h, hs)
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    cuda.synchronize()
    gpu_record(test="decode graph == ungraphed step", device_tables=device_tables, wkv_format=str(wkv_format),
               tokens=len(DECODE_TOKENS), decode_host_us_per_token_tiny=round(host_us, 1), passed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_gpu_decode_graph_with_gate_v4_equals_ungraphed_step(model, residual, gpu_record):
    """gate_v4 picked by name: the graph fuses both layers' gates into gate_v4's pair, and the
    highway after every token is the bits of step(graph=False) running gate_v4 layer by layer
    (the graph replays the pair's counters as captured: nothing is reset between tokens)."""
    kw = dict(max_tokens=4, device_tables=True, versions={"gate": "gate_v4"}, residual=residual)
    eng = EngramV41(model, **kw)
    got, _ = _run_sequence(eng, model, DECODE_TOKENS, DECODE_MASKS, True)
    want, _ = _run_sequence(EngramV41(model, **kw), model, DECODE_TOKENS, DECODE_MASKS, False)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    names = next(iter(eng._decode_graphs.values())).names
    assert names[-1] == "gate_v4[2 layers]" and "gate_v4" not in names, names
    gpu_record(test="decode graph with gate_v4 pair == ungraphed step", residual=residual,
               tokens=len(DECODE_TOKENS), passed=True)


@pytest.mark.gpu
def test_gpu_new_highway_address_captures_a_new_graph(model):
    eng = EngramV41(model, max_tokens=2, device_tables=True)
    plain = EngramV41(model, max_tokens=2, device_tables=True)
    cfg = model.config
    rng = np.random.default_rng(1)
    for k in range(6):                                       # more highways than graphs kept (4)
        h0 = rng.standard_normal((1, cfg.hc, cfg.dim)).astype(np.float32)
        a, b = cuda.to_device(h0), cuda.to_device(h0)
        eng.decode(int(TINY_TOKENS[k]), a, EngramHasher(model.hash_tables))
        plain.step([int(TINY_TOKENS[k])], b, EngramHasher(model.hash_tables), graph=False)
        cuda.synchronize()
        np.testing.assert_array_equal(a.copy_to_host(), b.copy_to_host())
    assert len(eng._decode_graphs) == 4


@pytest.mark.gpu
def test_gpu_bad_token_changes_nothing(model):
    eng = EngramV41(model, max_tokens=2, device_tables=True)
    cfg = model.config
    hasher = EngramHasher(model.hash_tables)
    h = cuda.to_device(np.ones((1, cfg.hc, cfg.dim), np.float32))
    eng.decode(2, h, hasher)
    cuda.synchronize()
    before = h.copy_to_host()
    graph = next(iter(eng._decode_graphs.values()))
    pinned = [b.copy() for b in graph.ids]
    with pytest.raises(ValueError, match="token id -1"):
        eng.decode(-1, h, hasher)
    cuda.synchronize()
    np.testing.assert_array_equal(h.copy_to_host(), before)
    assert hasher.position == 1
    for b, p in zip(graph.ids, pinned):
        np.testing.assert_array_equal(b, p)


@pytest.mark.gpu
def test_gpu_pinned_uploader_reassembles_exactly(tmp_path, gpu_record):
    """Every read path (a mapped file copied out of its map or read with pread, memory) through a ring of small
    chunks (many wraps, a ragged last chunk) give the array back exactly."""
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, (37 << 20) + 12345, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")[77:].reshape(-1)
    rates = {}
    for read in ("mmap", "pread"):
        with Uploader(chunk_bytes=1 << 20, threads=3, read=read) as up:
            for arr, method in ((mapped, read), (data[77:], "memcpy")):
                dev = up.upload(arr, method)
                assert up.stats.records[-1].method == method
                np.testing.assert_array_equal(dev.copy_to_host(), np.asarray(arr))
            rates.update({r.method + "_gbps": round(r.gbps, 2) for r in up.stats.records})
    gpu_record(test="pinned uploader", **rates)
