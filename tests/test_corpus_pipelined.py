"""corpus_stats with chunks queued ahead on the device (analysis/device_chunks.py): the same
statistics, bit for bit, as each chunk through Pipeline.gates_from_ids; bad ids refused before
anything is queued. Tiny model, numba's simulator."""
import warnings

import numpy as np
import pytest

from engram_numba.analysis.corpus import Document, corpus_stats
from engram_numba.fixtures import TINY_PATH
from engram_numba.formats.schema_a import load_gguf


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


def _docs():
    """Two sequences over three 2-token chunks (one spans two chunks), a dead token in the last."""
    return [Document("a", np.array([0, 48, 5])), Document("b", np.array([17, 3]), np.array([True, False]))]


def _run(model, **kw):
    # the bf16 projection (the engine holds wkv as bf16): queuing does not depend on the weight's
    # encoding, and a simulated one is less than half the time of the Q2_K one (an encoded wkv queued:
    # test_an_fp8_wkv_is_decoded_once_a_queued_chunk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)          # "no GPU in use"
        return corpus_stats(model, documents=_docs(), backend="cuda", chunk_tokens=2, versions={"proj": "gemv_v1"},
                            **kw)


@pytest.mark.slow
def test_queued_chunks_give_the_statistics_of_one_chunk_at_a_time(model):
    """Three chunks: the third is queued before the first is read back (two queued ahead)."""
    from tests.test_corpus import assert_same_stats
    one = _run(model, pipelined=False)
    ahead = _run(model)
    assert one.meta["device_chunks"] == "off (pipelined=False)"
    dc = ahead.meta["device_chunks"]
    assert dc["chunks"] == 3 and dc["launches"] == 3 * 3 * len(model.config.layer_ids) and dc["queued_ahead"] == 2
    assert dc["h2d"] == 3 * len(model.config.layer_ids) + 1       # ids a layer a chunk; the chunk with a dead token: its mask
    assert ahead.n_masked == 1 and ahead.n_tokens == 5
    assert_same_stats(one, ahead)
    assert ahead.meta["cuda_kernels"] == one.meta["cuda_kernels"]


def test_bad_row_ids_are_refused_before_anything_is_queued(model):
    from engram_numba.analysis.device_chunks import DeviceChunks
    from engram_numba.engine import EngramV41
    cfg = model.config
    eng = EngramV41(model, max_tokens=4, device_tables=True)
    dc = DeviceChunks(eng, "fp32", cfg.eps, depth=1)
    L, C = len(cfg.layer_ids), cfg.n_hash_cols
    ids = np.zeros((2, L, C), np.int64)
    ids[1, 1, 2] = eng.layers[cfg.layer_ids[1]].n_rows                 # one past the end of layer 2's table
    hw = eng._ws[cfg.layer_ids[0]].kv                                 # never reached
    with pytest.raises(ValueError, match=rf"row id {ids[1, 1, 2]} \(token 1, column 2\) is outside layer "
                                         rf"{cfg.layer_ids[1]}'s table"):
        dc.submit(ids, hw, None)
    assert dc.counts["chunks"] == dc.counts["launches"] == dc.counts["h2d"] == 0
    with pytest.raises(ValueError, match="highway must be a device array"):
        dc.submit(np.zeros((2, L, C), np.int64), np.zeros((2, cfg.hc, cfg.dim), np.float32), None)
    assert dc.counts["launches"] == 0


@pytest.mark.gpu
def test_gpu_queued_chunks_give_the_statistics_of_one_chunk_at_a_time(model):
    """On a GPU: real streams, pinned buffers, events; many chunks, two queued ahead."""
    from tests.test_corpus import assert_same_stats, make_corpus
    from engram_numba.text import load_tokenizer
    from engram_numba.fixtures import TINY_TOKENIZER_PATH
    texts = make_corpus(400)
    tok = load_tokenizer(TINY_TOKENIZER_PATH)
    one = corpus_stats(model, texts=texts, tokenizer=tok, backend="cuda", chunk_tokens=64, pipelined=False)
    ahead = corpus_stats(model, texts=texts, tokenizer=tok, backend="cuda", chunk_tokens=64)
    assert ahead.meta["device_chunks"]["chunks"] > 8
    assert_same_stats(one, ahead)


@pytest.mark.slow
def test_an_fp8_wkv_is_decoded_once_a_queued_chunk():
    """FP8 table rows and an FP8 wkv (the HF checkpoint's encodings, tiny shapes) at more tokens
    than the weight-decoding GEMVs take: each layer's projection decodes its wkv into the shared
    bf16 scratch first. Queued chunks project first the layer the scratch holds, so they decode
    one wkv a chunk instead of two, with the same statistics."""
    from numba import cuda

    from engram_numba import engine as engine_mod
    from engram_numba.bench.corpus import BenchModel, _documents, _fill_device_table
    from engram_numba.bench.timing import SMOKE
    from engram_numba.engine import EngramV41
    from engram_numba.stages.proj.records import QUANT_GEMV_MAX_TOKENS
    from tests.test_corpus import assert_same_stats
    T = QUANT_GEMV_MAX_TOKENS + 1
    bm = BenchModel(SMOKE, 61, kind="fp8")
    eng = EngramV41(bm, max_tokens=T, device_tables=False)
    for lid in bm.config.layer_ids:
        lay = bm.layers[lid]
        eng.layers[lid].table = _fill_device_table(lay.n_rows, lay.table.block, cuda)
        eng.layers[lid].table_scales = _fill_device_table(lay.n_rows, lay.table_scales.block, cuda)
        eng.layers[lid].placement = "device"
    docs = _documents(3 * T, bm.hash_tables.token_map.size, np.random.default_rng(4), lo=5, hi=30)
    decodes = []
    real = engine_mod._DecodedWeightProjection.__call__

    def counted(self):
        if self.engine._scratch_layer != self.layer_id:
            decodes.append(self.layer_id)
        return real(self)
    engine_mod._DecodedWeightProjection.__call__ = counted
    try:
        runs = {}
        for pipelined in (False, True):
            decodes.clear()
            eng._scratch_layer = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                runs[pipelined] = corpus_stats(bm, documents=docs, backend="cuda", engine=eng, chunk_tokens=T,
                                               pipelined=pipelined)
            runs[pipelined, "decodes"] = len(decodes)
    finally:
        engine_mod._DecodedWeightProjection.__call__ = real
    assert runs[True].meta["device_chunks"]["chunks"] == 3 and runs[True].n_tokens == 3 * T
    assert runs[False, "decodes"] == 2 * 3                   # one a layer a chunk
    assert runs[True, "decodes"] == 2 + 1 + 1                # both in the first chunk, then one a chunk
    assert_same_stats(runs[False], runs[True])
