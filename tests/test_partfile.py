"""Part files of corpus shards and the merge the Dask tree runs: the sorted-record merge of
context tables gives `a + b` exactly (pruned or not, prune counters included), row bitmaps
survive their gap encoding, part files of this format and of the older one read back as the
state that was written, and damaged ones are refused naming the entry."""
import pickle
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as hs

from test_corpus import assert_same_stats, make_corpus

from engram_numba.analysis import partfile as pf
from engram_numba.analysis.corpus import corpus_stats
from engram_numba.analysis.partfile import StatisticsFileError
from engram_numba.analysis.streaming import StreamingGateStats
from engram_numba.fixtures import TINY_PATH
from engram_numba.formats.schema_a import load_gguf

COUNTERS = ("prunes", "dropped_entries", "dropped_occurrences", "undercount_bound", "n")


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


@pytest.fixture(scope="module")
def thirds(model):
    """Three parts of a corpus, with context tables small enough to prune, and without a cap."""
    lines = make_corpus(90, seed=31)
    out = {}
    for cap in (12, 200_000):
        out[cap] = [corpus_stats(model, texts=lines[k::3], backend="cpu", max_contexts=cap, chunk_tokens=64)
                    for k in range(3)]
    return out


def _same(want, got):
    assert_same_stats(want, got)
    for n in want.contexts:
        for f in COUNTERS:
            assert getattr(want.contexts[n], f) == getattr(got.contexts[n], f), (n, f)


@pytest.mark.parametrize("cap", [12, 200_000])
def test_partial_stats_merge_to_what_addition_gives(thirds, cap):
    a, b, c = thirds[cap]
    want = (a + b) + c
    assert cap == 200_000 or all(t.prunes for t in want.contexts.values())      # the prune path ran
    got = (pf.PartialStats.later(a) + pf.PartialStats.of(b)) + pf.PartialStats.later(c)
    _same(want, got.stats())
    _same(want, pf.merge_states(pf.merge_states(a, b), c))
    _same(c + (b + a), (pf.PartialStats.of(c) + (pf.PartialStats.of(b) + pf.PartialStats.of(a))).stats())
    back = pickle.loads(pickle.dumps(got, protocol=5))                          # as Dask sends it
    _same(want, back.stats())
    _same(want, (back + pf.PartialStats.of(a.__class__.empty(load_gguf(TINY_PATH), max_contexts=cap))).stats())
    with pytest.raises(ValueError, match="bins"):                                # a+b's checks still apply
        pf.PartialStats.of(a) + pf.PartialStats.of(corpus_stats(load_gguf(TINY_PATH), texts=["the cat"],
                                                                   backend="cpu", bins=10, max_contexts=cap))


@settings(max_examples=40, deadline=None)
@given(hs.integers(0, 5000), hs.floats(0.0, 1.0), hs.integers(0, 2**32 - 1))
def test_row_bitmaps_round_trip_through_their_gaps(n, density, seed):
    rng = np.random.default_rng(seed)
    bm = np.where(rng.random(n) < density, rng.integers(1, 256, n), 0).astype(np.uint8)
    enc = pf.encode_bitmap(bm)
    assert enc["encoding"] == ("raw" if np.count_nonzero(bm) > pf.RAW_FRACTION * n else "gaps")
    np.testing.assert_array_equal(pf.decode_bitmap(enc, n), bm)


def test_gaps_take_varints_and_refuse_what_does_not_decode():
    bm = np.zeros(1 << 22, np.uint8)
    bm[[0, 127, 128 + 127, 1 << 14, (1 << 21) + 3, (1 << 22) - 1]] = [1, 2, 3, 4, 5, 255]    # gaps of 1..3 bytes
    enc = pf.encode_bitmap(bm)
    assert enc["encoding"] == "gaps" and enc["bytes"].tolist() == [1, 2, 3, 4, 5, 255]
    assert enc["gaps"].size == 1 + 1 + 2 + 2 + 3 + 3
    np.testing.assert_array_equal(pf.decode_bitmap(enc, bm.size), bm)
    for bad, n in (({**enc, "bytes": enc["bytes"][:-1]}, bm.size),           # counts disagree
                   ({**enc, "gaps": enc["gaps"][:-1]}, bm.size),             # a cut varint
                   (enc, bm.size - 1),                                       # past the end
                   ({**enc, "gaps": np.concatenate([[0], enc["gaps"]]).astype(np.uint8)}, bm.size)):   # a zero gap
        with pytest.raises(StatisticsFileError, match="rows7: the row bitmap's gaps do not decode"):
            pf.decode_bitmap(bad, n, "rows7")


def test_part_files_of_both_formats_read_back_and_damaged_ones_are_refused_by_entry(tmp_path, thirds, monkeypatch):
    dense = thirds[12][0] + thirds[12][1]           # the tiny tables' bitmaps are dense: stored raw
    sparse = thirds[12][2]
    encodings = []
    for k, st in enumerate((dense, sparse)):
        st.meta["partial"] = {"shard": {"index": k}}
        p = tmp_path / f"shard-{k:05d}.npz"
        with monkeypatch.context() as mp:
            if st is sparse:                        # as a shard of a released-size table: gaps
                mp.setattr(pf, "RAW_FRACTION", 1.0)
            info = pf.write_part(st, p)
        assert info["bytes"] == p.stat().st_size
        encodings += info["rows"]
        got = pf.read_part(p)
        _same(st, got)
        assert got.meta["partial"] == st.meta["partial"] and got.track_rows
    assert "raw" in encodings and "gaps" in encodings
    assert not list(tmp_path.glob(".*tmp*"))                                 # no temporary left behind
    st, p2 = sparse, tmp_path / "shard-00001.npz"
    p1 = tmp_path / "old.npz"                                                # format 1: a whole statistics file
    st.save(p1, compresslevel=1)
    _same(st, pf.read_part(p1))
    # damaged: an entry's bytes changed, an entry missing, a format this reader does not know
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(p2) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "rows0_gaps.npy":
                data = data[:-3] + b"\x80\x80\x80"                           # a cut varint at the end
            dst.writestr(item, data)
    with pytest.raises(StatisticsFileError, match=r"bad.npz: rows0: the row bitmap's gaps do not decode"):
        pf.read_part(bad)
    for drop, msg in (("rows1_bytes.npy", r"array 'rows1_bytes' is missing"), ("ctx3_gsum.npy", r"'ctx3_gsum' is missing")):
        with zipfile.ZipFile(p2) as src, zipfile.ZipFile(bad, "w") as dst:
            for item in src.infolist():
                if item.filename != drop:
                    dst.writestr(item, src.read(item))
        with pytest.raises(StatisticsFileError, match=msg):
            pf.read_part(bad)
    with zipfile.ZipFile(p2) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            if item.filename != "__part__.npy":
                dst.writestr(item, src.read(item))
        with dst.open("__part__.npy", "w") as f:
            np.lib.format.write_array(f, np.array('{"format": 9, "rows": []}'))
    with pytest.raises(StatisticsFileError, match="part file format 9"):
        pf.read_part(bad)
    assert isinstance(StreamingGateStats.load(p2), StreamingGateStats)       # the statistics inside stay readable


@pytest.mark.parametrize("level", [None, 1])
def test_write_npy_writes_the_bytes_numpy_writes(tmp_path, level, monkeypatch):
    """Part files and statistics files write their members with `write_npy` (the data handed to the
    zip in slices of the array's own memory, not copied into bytes under the GIL): every member is
    byte for byte what numpy's write_array gives, strided, Fortran-ordered, 0-d, empty and
    multi-slice arrays included."""
    from engram_numba.formats import npz
    monkeypatch.setattr(npz, "WRITE_SLICE", 1000)          # several slices, and one cut mid-element
    rng = np.random.default_rng(3)
    rec = rng.integers(-2**40, 2**40, (301, 11))
    arrays = {"c": rec, "cols": rec[:, 2:5], "col": rec[:, 3], "g": rec[:, 3:].reshape(-1, 2, 4),
              "f": np.asfortranarray(rng.random((7, 9))), "s": np.array('{"a": [1, 2]}'), "e": np.zeros((3, 0)),
              "u8": rng.integers(0, 255, 5003).astype(np.uint8), "b": rng.random(17) > 0.5, "x": np.float32(2.5)}
    mode = zipfile.ZIP_STORED if level is None else zipfile.ZIP_DEFLATED
    for name, a in arrays.items():
        paths = []
        for k, write in enumerate((lambda f, a: np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False),
                                   npz.write_npy)):
            p = tmp_path / f"{name}{k}.npz"
            with zipfile.ZipFile(p, "w", mode, compresslevel=level) as zf:
                with zf.open("m.npy", "w", force_zip64=True) as f:
                    write(f, a)
            paths.append(p)
        got = [zipfile.ZipFile(p).read("m.npy") for p in paths]
        assert got[0] == got[1], name
        np.testing.assert_array_equal(np.load(paths[1])["m"], a)
    with open(tmp_path / "o.npy", "wb") as f, pytest.raises(ValueError, match="object"):
        npz.write_npy(f, np.array([None, 1], dtype=object))
