"""Hard inputs from real files: each gets a named error before any large
allocation, or (NaN rows) is flagged and never used silently."""
import json
import os
import signal
import struct
import tracemalloc

import numpy as np
import pytest

import engram_numba as en
from engram_numba.cli import main as cli_main
from engram_numba.fixtures import TINY_PATH
from engram_numba.formats import errors as E
from engram_numba.formats import schema_a as mf
from engram_numba.formats.gguf import GGUF_MAGIC, MAX_ARRAY_DEPTH
from engram_numba.formats.rowcheck import nonfinite_rows

from formats_helpers import schema_a_layers, tiny_config, tiny_tables, write_schema_a, write_schema_b

P = "deepseek41.engram."


def _tensor_record(data: bytes, name: str) -> tuple[int, int]:
    """(position of the u64 relative offset, n_dims) of tensor `name`'s record in a GGUF's bytes."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    return pos + 4 + 8 * n_dims + 4, n_dims


def test_overlapping_tensor_data_refused(tmp_path, rng):
    path, _ = write_schema_a(tmp_path / "m.gguf", rng)
    data = bytearray(path.read_bytes())
    q_at, _ = _tensor_record(data, "blk.1.engram_q.weight")
    k_at, _ = _tensor_record(data, "blk.1.engram_k.weight")
    data[q_at:q_at + 8] = data[k_at:k_at + 8]          # one 8-byte change: engram_q on engram_k's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(E.OverlappingTensorsError, match=r"'blk\.1\.engram_(q|k)\.weight' .* overlaps tensor "
                                                        r"'blk\.1\.engram_(q|k)\.weight'"):
        en.load_model(path)
    with pytest.raises(E.OverlappingTensorsError):
        mf.load_gguf(path)
    assert cli_main(["info", str(path)]) == 2


def test_partial_overlap_refused(tmp_path, rng):
    path, _ = write_schema_a(tmp_path / "m.gguf", rng)
    data = bytearray(path.read_bytes())
    at, _ = _tensor_record(data, "blk.4.engram_embd.weight")
    (rel,) = struct.unpack_from("<Q", data, at)
    data[at:at + 8] = struct.pack("<Q", rel - 32)       # one alignment step back: into the tensor before
    path.write_bytes(bytes(data))
    with pytest.raises(E.OverlappingTensorsError, match="overlapping or aliased tensor data is refused"):
        en.load_model(path)


def test_hash_constant_sums_beyond_int64(tmp_path, rng, capsys):
    big = 2**63 - 25                                      # the largest prime below 2^63
    tables = tiny_tables()
    primes = tables.primes.copy()
    primes[1, 2, 1] = big                                 # layer 4's last column
    offsets = tables.offsets.copy()                       # exclusive prefix sums: all still small
    path, _ = write_schema_a(tmp_path / "o.gguf", rng, check=False,
                             kv_overrides={P + "primes": ("arr[u64]", primes.ravel()),
                                           P + "offsets": ("arr[u64]", offsets.ravel())})
    with pytest.raises(E.HashOverflowError, match=r"layer 4 summed up to column 5 give 9223372036854776300, more "
                                                  r"than int64 holds"):
        en.load_model(path)
    # info describes it and does not say OK
    assert cli_main(["info", str(path)]) == 1
    out = capsys.readouterr().out
    assert "OVERFLOW" in out and "layer 4: primes sum does not fit in int64" in out
    assert "layer 4: primes sum 630" not in out
    assert cli_main(["info", str(path), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["problems"] and info["hash"]["table_rows"] == [None, None]


def test_offset_plus_prime_beyond_int64(tmp_path, rng):
    tables = tiny_tables()
    offsets = tables.offsets.copy()
    offsets[0, 5] = 2**63 - 50                            # + prime 89 passes int64
    path, _ = write_schema_a(tmp_path / "o.gguf", rng, check=False,
                             kv_overrides={P + "offsets": ("arr[u64]", offsets.ravel())})
    with pytest.raises(E.HashOverflowError, match=r"offset 9223372036854775758 \+ prime 89 of layer 1 column 5"):
        en.load_model(path)


def _gguf_with_kv(key: bytes, type_code: int, payload: bytes) -> bytes:
    head = GGUF_MAGIC + struct.pack("<IQQ", 3, 0, 1)
    return head + struct.pack("<Q", len(key)) + key + struct.pack("<I", type_code) + payload


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_string_length_capped_before_copying(tmp_path):
    """A 900 MiB string claim in a 1 GiB (sparse) file: refused without copying anything."""
    path = tmp_path / "s.gguf"
    with open(path, "wb") as f:
        f.write(_gguf_with_kv(b"general.name", 8, struct.pack("<Q", 900 * 2**20)))
        f.truncate(2**30)

    def load():
        with pytest.raises(E.BadMetadataError, match=r"holds a string of 943,718,400 bytes, more than the"):
            mf.load_gguf(path)
    assert _peak_bytes(load) < 8 * 2**20
    # a claim past the end of the file says truncated, before reading anything
    path.write_bytes(_gguf_with_kv(b"general.name", 8, struct.pack("<Q", 10**6)) + b"x" * 100)
    with pytest.raises(E.TruncatedFileError, match="cut short"):
        mf.load_gguf(path)


def test_header_budget(tmp_path):
    """An array whose claimed size is inside the file but past the header budget is refused."""
    path = tmp_path / "a.gguf"
    with open(path, "wb") as f:
        f.write(_gguf_with_kv(b"x.big", 9, struct.pack("<IQ", 0, 600 * 2**20)))   # 600 MiB of u8
        f.truncate(2**30)
    with pytest.raises(E.BadMetadataError, match=r"past the 536,870,912 bytes a GGUF header may take"):
        mf.load_gguf(path)


def test_array_nesting_capped(tmp_path):
    depth = 300
    payload = struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    path = tmp_path / "n.gguf"
    path.write_bytes(_gguf_with_kv(b"x.nested", 9, payload))
    with pytest.raises(E.BadMetadataError, match=f"nests arrays more than {MAX_ARRAY_DEPTH} deep"):
        mf.load_gguf(path)


@pytest.mark.parametrize("tname,value", [("bool", True), ("i32", 32), ("u8", 32), ("str", "32")])
def test_alignment_of_another_type_refused(tmp_path, rng, tname, value):
    path, _ = write_schema_a(tmp_path / "a.gguf", rng, kv_overrides={"general.alignment": (tname, value)})
    with pytest.raises(E.BadMetadataError, match=rf"general\.alignment is stored as {tname} .*it must be a u32 or u64"):
        en.load_model(path)


def test_alignment_u64_accepted(tmp_path, rng):
    path, _ = write_schema_a(tmp_path / "a.gguf", rng, kv_overrides={"general.alignment": ("u64", 32)})
    with en.load_model(path) as m:
        assert m.alignment == 32


@pytest.fixture
def alarm():
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def handler(*_):
        raise TimeoutError("hung")
    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_fifo_directory_missing(tmp_path, alarm, capsys):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for opener in (en.load_model, mf.load_gguf):
        with pytest.raises(E.NotARegularFileError, match=r"pipe\.gguf is a FIFO \(named pipe\); only regular files"):
            opener(fifo)
    assert cli_main(["info", str(fifo)]) == 2
    assert "FIFO" in capsys.readouterr().err
    d = tmp_path / "folder.gguf"
    d.mkdir()
    with pytest.raises(E.NotARegularFileError, match="is a directory"):
        mf.load_gguf(d)
    with pytest.raises(E.NotARegularFileError, match="is a directory holding no GGUF file"):
        en.load_model(d)
    for opener in (en.load_model, mf.load_gguf):
        with pytest.raises(E.MissingFileError, match=r"nope\.gguf does not exist"):
            opener(tmp_path / "nope.gguf")
    assert cli_main(["info", str(tmp_path / "nope.gguf")]) == 2
    # a FIFO named as a shard of a split
    os.mkfifo(tmp_path / "s-00002-of-00002.gguf")
    mf.write_gguf(tmp_path / "s-00001-of-00002.gguf", tiny_config(), tiny_tables(),
                  schema_a_layers(np.random.default_rng(0), tiny_config(), tiny_tables()))
    with pytest.raises(E.NotARegularFileError, match=r"s-00002-of-00002\.gguf is a FIFO"):
        en.load_model(tmp_path / "s-00001-of-00002.gguf")


def test_architecture_checked(tmp_path, rng):
    path, _ = write_schema_a(tmp_path / "l.gguf", rng, kv_overrides={"general.architecture": ("str", "llama")})
    with pytest.raises(E.WrongArchitectureError, match=r"general\.architecture is 'llama', expected 'deepseek41'"):
        en.load_model(path)
    path, _ = write_schema_a(tmp_path / "n.gguf", rng, omit_keys=("general.architecture",))
    with pytest.raises(E.MissingKeyError, match=r"'general\.architecture' is missing \(expected 'deepseek41'\)"):
        en.load_model(path)


def test_uint64_row_ids_beyond_int64_reported_as_such():
    with en.load_model(TINY_PATH) as m:
        ids = np.array([3, 2**63 + 5], dtype=np.uint64)
        with pytest.raises(ValueError, match=r"row id 9223372036854775813 at flat index 1 is outside layer 1's table"):
            m.rows(1).read(ids)
        with pytest.raises(ValueError, match=r"row id 18446744073709551615 at flat index 0"):
            m.rows(1).check(np.array([2**64 - 1], dtype=np.uint64))


def test_third_party_spellings_named(tmp_path, rng):
    over = {"deepseek41.engram_layer_ids": ("arr[i32]", np.array([1, 4])),
            "deepseek41.engram_pad_token_id": ("u32", 2),
            "deepseek41.engram_num_embeddings": ("u32", 384)}
    nine = [P + k for k in ("layer_ids", "head_count", "key_length", "max_ngram_size", "multipliers", "primes",
                            "offsets", "token_map", "pad_id")]
    path, _ = write_schema_a(tmp_path / "t.gguf", rng, omit_keys=nine, kv_overrides=over)
    with pytest.raises(E.MissingKeyError, match=r"none of schema A's nine deepseek41\.engram\.\* keys .* third-party "
                                                r"spellings .*deepseek41\.engram_layer_ids, "
                                                r"deepseek41\.engram_pad_token_id, deepseek41\.engram_num_embeddings"):
        en.load_model(path)


# Rows that decode to NaN -------------------------------------------------------------------------

def test_fp8_nan_rows_flagged(tmp_path, rng, capsys):
    path, layers = write_schema_b(tmp_path / "nan.gguf", rng)
    rows = layers[4]["rows_fp8"]
    data = bytearray(path.read_bytes())
    with en.load_model(path) as m:
        base = m.tensors["blk.4.engram_embd.weight"].offset
    # row 5: an e4m3 NaN code; row 9: an e8m0 scale byte 255; row 11: 448 * 2^(250-127) overflows fp32
    data[base + 5 * 264 + 17] = 0x7F
    data[base + 9 * 264 + 256 + 3] = 255
    data[base + 11 * 264 + 64] = 0x7E        # 448
    data[base + 11 * 264 + 256 + 2] = 250
    path.write_bytes(bytes(data))
    with en.load_model(path) as m:
        flags = m.rows(4).check(np.arange(630))
        assert np.flatnonzero(flags).tolist() == [5, 9, 11]
        assert not m.rows(1).check(np.arange(462)).any()
        # the raw bytes are still what was stored: nothing is replaced
        assert m.rows(4).read([5])[0, 17] == 0x7F
    assert cli_main(["info", str(path), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["layers"]["4"]["nonfinite_rows"] == 3 and info["layers"]["1"]["nonfinite_rows"] == 0
    check = next(c for c in info["checks"] if c["check"] == "layer 4: rows that decode to NaN/inf")
    assert check["count"] == 3 and check["first_row"] == 5 and not check["ok"]
    assert rows.shape == (630, 264)


def test_fp8_checkpoint_nan_rows_flagged(tmp_path, rng):
    from formats_helpers import write_hf
    folder, layers = write_hf(tmp_path / "hf", rng)
    shard = folder / "model-00001-of-00002.safetensors"
    with en.load_model(folder) as m:
        info = m.tensors["layers.1.engram.embed.scale"]
    data = bytearray(shard.read_bytes())
    data[info.offset + 7 * 8 + 1] = 255                   # row 7, scale 1
    shard.write_bytes(bytes(data))
    with en.load_model(folder) as m:
        assert np.flatnonzero(m.rows(1).check(np.arange(462))).tolist() == [7]


def test_kquant_rows_with_nonfinite_scales_flagged(rng):
    rows = rng.integers(0, 256, size=(4, 84), dtype=np.uint8)
    rows[:, 80:84] = np.array([[0.5, 0.25]], np.float16).view(np.uint8)
    rows[2, 80:82] = np.array([np.inf], np.float16).view(np.uint8)
    rows[3, 82:84] = np.array([np.nan], np.float16).view(np.uint8)
    assert nonfinite_rows(rows, "q2k").tolist() == [False, False, True, True]
    q8 = np.zeros((2, 272), np.uint8)
    q8[1, 34 * 7:34 * 7 + 2] = np.array([np.inf], np.float16).view(np.uint8)
    assert nonfinite_rows(q8, "q8_0").tolist() == [False, True]


def test_nan_rows_decode_to_nan_in_the_rows_stage():
    """What the toolkit does with such a row: the rows stage decodes it as stored (NaN), so the
    projection and the gate of that token are NaN and `gate_stats` counts them; nothing is replaced.
    Needs the rows stage's fp8 decoder."""
    from engram_numba.fixtures import missing_encoders
    if missing_encoders("ds4"):
        pytest.skip("the rows stage's fp8 decoder (engram_numba.stages.rows.fp8) is not in this checkout")
    from engram_numba.stages.rows.reference import decode_reference
    row = np.zeros((1, 264), np.uint8)
    row[0, 256:] = 127
    row[0, 3] = 0x7F
    vals = decode_reference(row, "fp8")
    assert np.isnan(vals[0, 3]) and np.isfinite(np.delete(vals[0], 3)).all()
