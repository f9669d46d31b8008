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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)          # "no GPU in use"
        return corpus_stats(model, documents=_docs(), backend="cuda", chunk_tokens=2, **kw)


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
