"""The start-up uploader (`engram_numba.device.upload`) in numba's simulator: the chunked pipeline
(a ring of staging buffers refilled by a pool of reader threads, one copy a chunk) reassembles an
array of an odd size exactly, from a file (preadv) and from memory, with the ring wrapping many
times and a last partial chunk; its record splits the time; a file-backed array whose file was
truncated is refused by name before anything is allocated, by the uploader and by `EngramV41`;
and `resident_fraction` sees pages enter the page cache.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from numba import cuda

from engram_numba import engine as engine_mod
from engram_numba.device import upload as upload_mod
from engram_numba.device.upload import Uploader, check_file_region, file_region, resident_fraction
from engram_numba.engine import EngramV41
from engram_numba.fixtures import TINY_PATH
from engram_numba.formats.schema_a import load_gguf

CHUNK = 1 << 16                        # the smallest staging buffer: many chunks from a small array


def _blob(tmp_path, nbytes, seed=4):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    return data, path


@pytest.mark.parametrize("threads, read", [(1, "mmap"), (3, "mmap"), (1, "pread"), (3, "pread")])
def test_pipeline_reassembles_an_odd_size_through_a_wrapping_ring(tmp_path, threads, read):
    """23 chunks and a ragged 4,567-byte tail through a ring of threads + 2 buffers (it wraps 4-8
    times), from a mapped file at an odd offset (copied out of the map, or read with preadv) and
    from memory, in a 2-d shape."""
    nbytes = 23 * CHUNK + 4567 + 77
    data, path = _blob(tmp_path, nbytes)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")[77:].reshape(-1, 7)       # 23*CHUNK + 4567 = 7 * 215,...
    with Uploader(chunk_bytes=CHUNK, threads=threads, direct_below=0, read=read) as up:
        for arr, method in ((mapped, read), (data[77:].reshape(-1, 7), "memcpy")):
            dev = up.upload(arr, method)
            rec = up.stats.records[-1]
            assert (rec.method, rec.nbytes, rec.chunks, rec.threads) == (method, arr.nbytes, 24, threads)
            assert dev.shape == arr.shape and dev.dtype == arr.dtype
            np.testing.assert_array_equal(dev.copy_to_host(), np.asarray(arr))
        # a second upload reuses the ring: one pinned allocation for the uploader's life
        ring = up._ring
        up.upload(data[:3 * CHUNK + 1], "again")
        assert up._ring is ring
        np.testing.assert_array_equal(up.upload(data[5:CHUNK - 3], "less than a chunk").copy_to_host(),
                                      data[5:CHUNK - 3])
    report = up.stats.as_dict()
    assert (report["threads"], report["chunk_bytes"], report["n_buffers"], report["read_method"]) == \
        (threads, CHUNK, threads + 2, read)
    assert report["pipelined_bytes"] == up.stats.nbytes == 2 * (nbytes - 77) + 3 * CHUNK + 1 + CHUNK - 8
    assert report["read_gb_per_s"] is not None and report["read_seconds"] > 0


def test_pipeline_wider_dtype_and_exact_multiple(tmp_path):
    """A float32 array of exactly 5 chunks (no partial tail) from a file, and a non-contiguous one
    (made contiguous, then read through memory)."""
    vals = np.random.default_rng(9).standard_normal(5 * CHUNK // 4).astype(np.float32)
    path = tmp_path / "f32.bin"
    vals.tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="r").reshape(5, -1)
    with Uploader(chunk_bytes=CHUNK, threads=2, direct_below=0) as up:
        np.testing.assert_array_equal(up.upload(mapped, "f32").copy_to_host(), vals.reshape(5, -1))
        assert up.stats.records[-1].chunks == 5
        strided = vals.reshape(5, -1)[:, ::3]
        np.testing.assert_array_equal(up.upload(strided, "strided").copy_to_host(), strided)
        assert up.stats.records[-1].method == "memcpy"


@pytest.mark.parametrize("read", upload_mod.READ_METHODS)
def test_truncated_file_is_refused_before_any_allocation(tmp_path, monkeypatch, read):
    data, path = _blob(tmp_path, 3 * CHUNK + 100)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")[10:]
    check_file_region(mapped, "ok")                         # whole: passes
    os.truncate(path, 2 * CHUNK)
    allocs = []
    monkeypatch.setattr(upload_mod.cuda, "device_array", lambda *a, **k: allocs.append(a))
    monkeypatch.setattr(upload_mod.cuda, "to_device", lambda *a, **k: allocs.append(a))
    with Uploader(chunk_bytes=CHUNK, threads=2, direct_below=0, read=read) as up:
        with pytest.raises(ValueError, match=rf"layer 3 table: needs bytes 10\.\.{3 * CHUNK + 100} of .*blob\.bin, "
                                             rf"but the file holds {2 * CHUNK} bytes"):
            up.upload(mapped, "layer 3 table")
        assert allocs == [] and up._ring is None and up.stats.records == []


def test_engine_refuses_a_truncated_gguf_before_any_device_allocation(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    shutil.copyfile(TINY_PATH, path)
    model = load_gguf(path)
    os.truncate(path, os.path.getsize(path) - 1)           # the last tensor loses its last byte
    allocs = []
    monkeypatch.setattr(engine_mod, "plan_tables", _counting(engine_mod.plan_tables, allocs))
    monkeypatch.setattr(engine_mod, "pair_buffer", lambda *a, **k: allocs.append("pair"))
    monkeypatch.setattr(engine_mod.Uploader, "upload", lambda self, *a, **k: allocs.append(a))
    with pytest.raises(ValueError, match=r"layer \d+ k_weight: needs bytes \d+\.\.\d+ of "
                                         r".*tiny\.gguf, but the file holds \d+ bytes"):
        EngramV41(model, max_tokens=2, device_tables=True)
    assert allocs == ["plan"]                              # planned (shapes only), nothing allocated
    last = max(model.layers)
    _, wkv_at = file_region(model.layers[last].wkv_raw)
    os.truncate(path, wkv_at + 100)                        # now into the last layer's wkv as well
    with pytest.raises(ValueError, match=rf"layer {last} wkv: needs bytes {wkv_at}\.\."):
        EngramV41(model, max_tokens=2, device_tables=True)


def _counting(fn, calls):
    def wrapped(*a, **k):
        calls.append("plan")
        return fn(*a, **k)
    return wrapped


def test_resident_fraction_sees_a_read(tmp_path):
    data, path = _blob(tmp_path, 1 << 20)
    frac = resident_fraction(path)
    if frac is None:
        pytest.skip("mincore is not available here")
    with open(path, "rb") as f:
        assert f.read() == data.tobytes()
    assert resident_fraction(path) == 1.0                  # just read: every page is cached
    assert resident_fraction(path, 4096 * 3 + 5, 100) == 1.0
    sparse = tmp_path / "hole.bin"
    with open(sparse, "wb") as f:
        f.truncate(64 << 20)                               # a hole: nothing cached until it is read
    assert resident_fraction(sparse) < 0.01


def test_uploader_arguments(monkeypatch):
    with pytest.raises(ValueError, match="chunk_bytes must be"):
        Uploader(chunk_bytes=100)
    with pytest.raises(ValueError, match="direct_below must be"):
        Uploader(direct_below=-1)
    with pytest.raises(ValueError, match=r"read must be one of \('mmap', 'pread'\) or None, got 'mmap2'"):
        Uploader(read="mmap2")
    assert upload_mod.DEFAULT_THREADS >= 2 and Uploader().n_buffers == Uploader().threads + 2
    assert Uploader().read == "mmap"
    monkeypatch.setenv("ENGRAM_UPLOAD_READ", "pread")
    assert Uploader().read == "pread" and Uploader(read="mmap").read == "mmap"
    monkeypatch.setenv("ENGRAM_UPLOAD_READ", "fread")
    with pytest.raises(ValueError, match=r"ENGRAM_UPLOAD_READ must be one of \('mmap', 'pread'\), got 'fread'"):
        Uploader()


def test_uploads_in_the_simulator_default_to_direct():
    x = np.arange(1000, dtype=np.int64)
    with Uploader() as up:
        np.testing.assert_array_equal(up.upload(x, "x").copy_to_host(), x)
    assert up.stats.records[0].method == "direct" and cuda.is_available() is not None


def test_engine_build_bench_record_in_the_simulator():
    """The engine_build record's wiring at a tiny size: three builds (first read, page cache with
    the default read method, page cache with the other), each with its page-cache share and split."""
    from engram_numba.bench import decode
    from engram_numba.bench.timing import SMOKE
    lines = []
    rec = decode.bench_engine_build(SMOKE, lines.append, 0.0005, True)
    assert rec["stage"] == "engine_build" and rec["read_method"] == "mmap" and rec["bytes"] > rec["table_bytes"] > 0
    assert rec["page_cache_pread"]["read_method"] == "pread" and rec["first_read"]["read_method"] == "mmap"
    for build in (rec, rec["first_read"], rec["page_cache_pread"]):
        assert build["threads"] >= 2 and build["chunk_bytes"] == upload_mod.DEFAULT_CHUNK_BYTES
    if rec["page_cache_resident_before"] is not None:
        assert rec["page_cache_resident_before"] >= rec["first_read"]["page_cache_resident_before"]
    assert rec["filesystem"] and len(lines) == 4 and "from the page cache" in lines[-1]
    assert "build_report" in rec and "build_report" not in rec["first_read"]
