"""GGUF read/write of the Engram weights (docs/formats.md, schema A): exact round trips, zero-copy views,
lazy loading, the row reader, and one test per way a file can be wrong."""
import dataclasses
import os
import time

import numpy as np
import pytest

from engram_numba.bf16 import f32_to_bf16
from engram_numba.config import EngramConfig
from engram_numba.formats import schema_a as mf
from engram_numba.stages.hash.tables import EngramHashTables
from engram_numba.stages.rows.q2k import ENGRAM_ROW_BYTES, dequantize

LAYER_IDS = (1, 4)
P = "deepseek41.engram."


def tiny_config(hc=4):
    return EngramConfig(dim=64, hc=hc, layer_ids=LAYER_IDS, max_ngram_size=4, n_heads=2)


def tiny_tables(token_map=None):
    # Layer 1 has 462 rows (primes 67..89), layer 4 has 630 (97..113): docs/math.md section 3.4.
    return EngramHashTables.build(LAYER_IDS, 4, 2, 64, np.arange(64) if token_map is None else token_map, 2)


def q2k_blocks(rng, n):
    """Random Q2_K blocks with finite, non-zero fp16 d and dmin (uint8 [n, 84])."""
    b = rng.integers(0, 256, size=(n, ENGRAM_ROW_BYTES), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1.0, size=(n, 2)).astype(np.float16) * rng.choice([-1, 1], size=(n, 2))
    b[:, 80:84] = scales.astype(np.float16).view(np.uint8).reshape(n, 4)
    return b


def make_layers(rng, config, tables, wkv_type="BF16"):
    N, K = config.proj_out, config.proj_in
    layers = {}
    for li, lid in enumerate(config.layer_ids):
        wkv_f32 = rng.standard_normal((N, K)).astype(np.float32)  # [N, K]
        wkv = {"BF16": f32_to_bf16(wkv_f32), "F32": wkv_f32, "F16": wkv_f32.astype(np.float16),
               "Q2_K": q2k_blocks(rng, N * K // 256).reshape(N, K // 256 * ENGRAM_ROW_BYTES)}[wkv_type]
        layers[lid] = {
            "table": q2k_blocks(rng, int(tables.table_rows[li])),             # [rows, 84]
            "wkv": wkv,
            "q_weight": rng.standard_normal((config.hc, config.dim)).astype(np.float32),  # [hc, dim]
            "k_weight": rng.standard_normal((config.hc, config.dim)).astype(np.float32),
        }
    return layers


@pytest.fixture
def tiny(rng, tmp_path):
    """(path, config, tables, layers) of a freshly written tiny model with a BF16 projection."""
    config, tables = tiny_config(), tiny_tables()
    layers = make_layers(rng, config, tables)
    path = mf.write_gguf(tmp_path / "tiny.gguf", config, tables, layers)
    return path, config, tables, layers


def write_modified(path, config, tables, layers, edit_tensors=None, **kw):
    """Write with build_gguf_entries, letting a test rewrite the tensor list first."""
    kvs, tensors = mf.build_gguf_entries(config, tables, layers, check=False, **kw)
    if edit_tensors is not None:
        tensors = edit_tensors(tensors)
    return mf.write_gguf_raw(path, kvs, tensors)


# Round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("hc", [1, 2, 3, 4])
def test_round_trip_exact(rng, tmp_path, hc):
    config, tables = tiny_config(hc), tiny_tables()
    layers = make_layers(rng, config, tables)
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers)
    with mf.load_gguf(path) as m:
        assert m.config == config
        t = m.hash_tables
        assert t.layer_ids == tables.layer_ids and t.pad_id == tables.pad_id
        for name in ("multipliers", "primes", "offsets", "token_map"):
            np.testing.assert_array_equal(getattr(t, name), getattr(tables, name))
        assert m.kv_types[P + "multipliers"] == "arr[u64]" and m.kv_types[P + "primes"] == "arr[u64]"
        assert m.kv_types[P + "offsets"] == "arr[u64]" and m.kv_types[P + "token_map"] == "arr[i32]"
        assert m.kv_types[P + "pad_id"] == "u32" and m.kv["general.architecture"] == "deepseek41"
        assert m.kv["deepseek41.embedding_length"] == 64
        for lid in config.layer_ids:
            lf, src = m.layers[lid], layers[lid]
            assert lf.n_rows == src["table"].shape[0] and lf.layer_id == lid
            assert lf.table.dtype == np.uint8 and lf.table.shape == src["table"].shape
            np.testing.assert_array_equal(lf.table, src["table"])
            assert np.shares_memory(lf.table, m._map), "the table must be a view of the map, not a copy"
            assert lf.q_weight.dtype == np.float32 and lf.q_weight.shape == (hc, 64)
            np.testing.assert_array_equal(lf.q_weight, src["q_weight"])
            np.testing.assert_array_equal(lf.k_weight, src["k_weight"])
            assert lf.wkv_type == "BF16"
            info = m.tensors[f"blk.{lid}.engram_wkv.weight"]
            assert info.ne == (config.proj_in, config.proj_out) and info.shape == (config.proj_out, config.proj_in)
            assert m.tensors[f"blk.{lid}.engram_q.weight"].ne == (64, hc)
            assert m.tensors[f"blk.{lid}.engram_embd.weight"].ne == (256, src["table"].shape[0])


@pytest.mark.parametrize("wkv_type", ["BF16", "F32", "F16", "Q2_K"])
def test_wkv_bf16(rng, tmp_path, wkv_type):
    config, tables = tiny_config(), tiny_tables()
    layers = make_layers(rng, config, tables, wkv_type)
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers)
    N, K = config.proj_out, config.proj_in
    with mf.load_gguf(path) as m:
        for lid in config.layer_ids:
            lf, src = m.layers[lid], layers[lid]["wkv"]
            assert lf.wkv_type == wkv_type
            np.testing.assert_array_equal(lf.wkv_raw, src)
            # chunk_rows=7 splits the rows unevenly, so the row-block loop is exercised.
            got = lf.wkv_bf16(chunk_rows=7)
            assert got.dtype == np.uint16 and got.shape == (N, K)
            if wkv_type == "BF16":
                want = src
                assert np.shares_memory(got, m._map)
            elif wkv_type == "Q2_K":
                # One wkv row is K/256 blocks; dequantised values in element order col*256 + d.
                want = f32_to_bf16(dequantize(src.reshape(-1, ENGRAM_ROW_BYTES)).reshape(N, K))
            else:
                want = f32_to_bf16(src.astype(np.float32))
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("gate_type", ["F16", "BF16"])
def test_gate_vectors_widen(rng, tmp_path, gate_type):
    config, tables = tiny_config(2), tiny_tables()
    layers = make_layers(rng, config, tables)
    for spec in layers.values():
        for key in ("q_weight", "k_weight"):
            spec[key] = spec[key].astype(np.float16) if gate_type == "F16" else f32_to_bf16(spec[key])
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers)
    with mf.load_gguf(path) as m:
        for lid in LAYER_IDS:
            src = layers[lid]["q_weight"]
            want = src.astype(np.float32) if gate_type == "F16" else (src.astype(np.uint32) << 16).view(np.float32)
            assert m.tensors[f"blk.{lid}.engram_q.weight"].type_name == gate_type
            np.testing.assert_array_equal(m.layers[lid].q_weight, want)
            assert m.layers[lid].k_weight.dtype == np.float32


def test_one_dimensional_gate_vector_is_hc_1(rng, tmp_path):
    config, tables = tiny_config(1), tiny_tables()
    layers = make_layers(rng, config, tables)

    def flatten_gates(tensors):
        return [dataclasses.replace(t, ne=t.ne[:1], data=t.data.reshape(-1)) if t.name.endswith(("q.weight", "k.weight"))
                else t for t in tensors]
    path = write_modified(tmp_path / "m.gguf", config, tables, layers, flatten_gates)
    with mf.load_gguf(path) as m:
        assert m.config.hc == 1 and m.tensors["blk.1.engram_q.weight"].ne == (64,)
        np.testing.assert_array_equal(m.layers[1].q_weight, layers[1]["q_weight"])


def test_other_integer_array_types_accepted(tiny, tmp_path):
    _, config, tables, layers = tiny
    over = {P + "primes": ("arr[u32]", tables.primes.ravel()), P + "offsets": ("arr[i64]", tables.offsets.ravel()),
            P + "multipliers": ("arr[i64]", tables.multipliers.ravel()), P + "layer_ids": ("arr[u64]", LAYER_IDS),
            P + "token_map": ("arr[u16]", tables.token_map), P + "pad_id": ("i32", 2), P + "head_count": ("u64", 2)}
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, kv_overrides=over)
    with mf.load_gguf(path) as m:
        assert m.kv_types[P + "primes"] == "arr[u32]"
        for name in ("multipliers", "primes", "offsets", "token_map"):
            np.testing.assert_array_equal(getattr(m.hash_tables, name), getattr(tables, name))
        assert m.config == config


def test_gguf_py_reads_our_file(tiny):
    from gguf import GGUFReader
    path, config, tables, layers = tiny
    r = GGUFReader(path)
    assert r.fields[P + "primes"].contents() == tables.primes.ravel().tolist()
    assert r.fields[P + "multipliers"].contents() == tables.multipliers.ravel().tolist()
    assert r.fields[P + "offsets"].contents() == tables.offsets.ravel().tolist()
    assert r.fields[P + "token_map"].contents() == tables.token_map.tolist()
    assert r.fields[P + "layer_ids"].contents() == list(LAYER_IDS)
    assert r.fields[P + "pad_id"].contents() == 2 and r.fields[P + "head_count"].contents() == 2
    assert r.fields[P + "key_length"].contents() == 256 and r.fields[P + "max_ngram_size"].contents() == 4
    assert r.fields["deepseek41.embedding_length"].contents() == 64
    assert r.fields["general.architecture"].contents() == "deepseek41"
    assert r.fields[P + "primes"].types[-1].name == "UINT64"
    assert r.fields[P + "token_map"].types[-1].name == "INT32"
    by_name = {t.name: t for t in r.tensors}
    assert len(by_name) == 8
    for lid in LAYER_IDS:
        rows = layers[lid]["table"].shape[0]
        t = by_name[f"blk.{lid}.engram_embd.weight"]
        assert t.tensor_type.name == "Q2_K" and t.shape.tolist() == [256, rows]
        np.testing.assert_array_equal(t.data, layers[lid]["table"])
        t = by_name[f"blk.{lid}.engram_wkv.weight"]
        assert t.tensor_type.name == "BF16" and t.shape.tolist() == [config.proj_in, config.proj_out]
        np.testing.assert_array_equal(np.asarray(t.data).view(np.uint16), layers[lid]["wkv"])
        t = by_name[f"blk.{lid}.engram_q.weight"]
        assert t.tensor_type.name == "F32" and t.shape.tolist() == [64, 4]
        np.testing.assert_array_equal(t.data, layers[lid]["q_weight"])


def test_gguf_py_reads_q2k_wkv(rng, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize as gg_dequantize
    config, tables = tiny_config(), tiny_tables()
    layers = make_layers(rng, config, tables, "Q2_K")
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers)
    t = {t.name: t for t in GGUFReader(path).tensors}["blk.4.engram_wkv.weight"]
    assert t.tensor_type.name == "Q2_K" and t.shape.tolist() == [config.proj_in, config.proj_out]
    with mf.load_gguf(path) as m:
        want = f32_to_bf16(gg_dequantize(np.asarray(t.data), t.tensor_type))
        np.testing.assert_array_equal(m.layers[4].wkv_bf16(), want)


def test_deterministic_bytes(tiny, tmp_path):
    path, config, tables, layers = tiny
    again = mf.write_gguf(tmp_path / "again.gguf", config, tables, layers)
    assert path.read_bytes() == again.read_bytes()


def test_describe(tiny):
    path, config, tables, layers = tiny
    with mf.load_gguf(path) as m:
        text = mf.describe(m)
    for needle in ("dim 64", "hc 4", "layers [1, 4]", "heads 2", "head_dim 256", "n_hash_cols 6",
                   "K 1536", "N 320", P + "primes", "arr[u64]", "12 entries [67, 71, 73, 79, ...]",
                   "blk.4.engram_embd.weight", "ne [256, 630]", "numpy [630, 256]", "51.7 KiB",
                   "layer 1: primes sum 462, table rows 462  OK", "layer 4: primes sum 630, table rows 630  OK"):
        assert needle in text, needle


def test_string_metadata(tiny, tmp_path, rng):
    _, config, tables, layers = tiny
    tokens = [f"tok{i}" + "é" * int(rng.integers(0, 4)) for i in range(1000)]
    over = {"tokenizer.ggml.tokens": ("arr[str]", tokens), "tokenizer.ggml.model": ("str", "gpt2"),
            "tokenizer.short": ("arr[str]", ["a", "bc"]), "general.f": ("f32", 0.5), "general.b": ("bool", True)}
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, kv_overrides=over)
    with mf.load_gguf(path) as m:
        toks = m.kv["tokenizer.ggml.tokens"]
        assert len(toks) == 1000 and toks[0] == tokens[0] and toks[999] == tokens[999]
        assert toks.tolist() == tokens and toks[10:13] == tokens[10:13]
        assert m.kv["tokenizer.ggml.model"] == "gpt2" and m.kv["tokenizer.short"] == ["a", "bc"]
        assert m.kv["general.f"] == 0.5 and m.kv["general.b"] is True
        assert "1000 entries ['tok0" in mf.describe(m)


# Row reader ----------------------------------------------------------------------------------

def test_row_reader_gathers(tiny, rng):
    path, config, tables, layers = tiny
    with mf.load_gguf(path) as m:
        for lid in LAYER_IDS:
            reader = m.rows(lid)
            table = layers[lid]["table"]
            assert reader.n_rows == table.shape[0] and reader.layer_id == lid
            ids = rng.integers(0, reader.n_rows, size=300)
            ids[:5] = ids[0]                        # repeated ids
            ids[5], ids[6] = 0, reader.n_rows - 1   # both ends
            for dtype in (np.int64, np.int32, np.uint32, np.uint16, np.uint64):
                got = reader.read(ids.astype(dtype))
                assert got.shape == (300, 84) and got.dtype == np.uint8 and got.flags.c_contiguous
                np.testing.assert_array_equal(got, table[ids])
            ids2 = rng.integers(0, reader.n_rows, size=(7, 6))  # [T, n_hash_cols]
            np.testing.assert_array_equal(reader.read(ids2), table[ids2.ravel()])
            out = np.empty((42, 84), np.uint8)
            assert reader.read(ids2, out=out) is out
            np.testing.assert_array_equal(out, table[ids2.ravel()])
            assert reader.read(np.array([], dtype=np.int64)).shape == (0, 84)
        assert m.rows(1) is m.rows(1)


def test_row_reader_small_signed_ids(tiny, rng):
    path, *_ = tiny
    with mf.load_gguf(path) as m:
        ids = rng.integers(0, 127, size=20).astype(np.int8)
        np.testing.assert_array_equal(m.rows(1).read(ids), m.layers[1].table[ids.astype(np.int64)])
        with pytest.raises(ValueError, match=r"row id -3 at flat index 1 .*\[0, 462\)"):
            m.rows(1).read(np.array([0, -3], dtype=np.int8))


def test_row_reader_rejects_bad_ids(tiny):
    path, *_ = tiny
    with mf.load_gguf(path) as m:
        r = m.rows(4)
        with pytest.raises(ValueError, match=r"row id 630 at flat index 2 is outside layer 4's table: valid row ids are \[0, 630\)"):
            r.read([5, 629, 630, 1000])
        with pytest.raises(ValueError, match=r"row id -1 at flat index 0 .*\[0, 630\)"):
            r.read([-1, 3])
        with pytest.raises(ValueError, match=r"row id 700 at flat index 4 \(index \(np.int64\(1\), np.int64\(1\)\)\)|"
                                             r"row id 700 at flat index 4 \(index \(1, 1\)\)"):
            r.read(np.array([[1, 2, 3], [4, 700, 6]]))
        with pytest.raises(ValueError, match=r"row id 18446744073709551615 at flat index 1"):
            r.read(np.array([0, 2**64 - 1], dtype=np.uint64))
        with pytest.raises(ValueError, match="must be integers"):
            r.read(np.array([1.0, 2.0]))
        with pytest.raises(ValueError, match=r"out must be .*\(2, 84\)"):
            r.read([1, 2], out=np.empty((3, 84), np.uint8))
        out = np.full((2, 84), 7, np.uint8)
        with pytest.raises(ValueError):
            r.read([1, 630], out=out)
        assert (out == 7).all(), "a rejected read must not write anything"
        with pytest.raises(ValueError, match=r"layer id 2 is not an engram layer .*\[1, 4\]"):
            m.rows(2)


def test_close_and_context_manager(tiny):
    path, config, tables, layers = tiny
    m = mf.load_gguf(path)
    table = m.layers[1].table
    m.close()
    with pytest.raises(mf.EngramFileError, match="closed"):
        m.rows(1)
    # Views taken before close keep the mapping alive.
    np.testing.assert_array_equal(table, layers[1]["table"])


# Laziness and speed --------------------------------------------------------------------------

def _best_load_time(path, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = mf.load_gguf(path)
        best = min(best, time.perf_counter() - t0)
        m.close()
    return best


def test_full_token_map_loads_fast(rng, tmp_path):
    token_map = rng.integers(0, 64, size=129_280)
    token_map[:64] = np.arange(64)
    config, tables = tiny_config(), tiny_tables(token_map)
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, make_layers(rng, config, tables))
    seconds = _best_load_time(path)
    with mf.load_gguf(path) as m:
        np.testing.assert_array_equal(m.hash_tables.token_map, token_map)
        assert m.kv[P + "token_map"].size == 129_280
    assert seconds < 0.1, f"loading a 129,280-entry token map took {seconds * 1e3:.1f} ms"


def test_big_table_load_is_lazy(rng, tmp_path):
    """A ~50 MB table: opening must not read it, and rows read back right."""
    # Primes near 100,000 give ~600k rows (~50 MB of blocks) per layer.
    tables = EngramHashTables.build(LAYER_IDS, 4, 2, 100_000, np.arange(64), 2)
    config = tiny_config()
    layers = make_layers(rng, config, tiny_tables())
    pattern = q2k_blocks(rng, 1024)
    for li, lid in enumerate(LAYER_IDS):
        rows = int(tables.table_rows[li])
        layers[lid]["table"] = np.tile(pattern, (-(-rows // 1024), 1))[:rows]
    path = mf.write_gguf(tmp_path / "big.gguf", config, tables, layers)
    assert os.path.getsize(path) > 90e6
    assert _best_load_time(path) < 0.05
    with mf.load_gguf(path) as m:
        ids = np.array([0, 1023, 1024, m.layers[4].n_rows - 1])
        np.testing.assert_array_equal(m.rows(4).read(ids), layers[4]["table"][ids])


def _released_sparse_file(path, rng):
    """Released shapes (docs/math.md section 1) with every big tensor left as a hole: ~60 GB apparent."""
    config = EngramConfig.released()
    token_map = rng.integers(0, 99_092, size=129_280)
    token_map[:99_092] = np.arange(99_092)
    tables = EngramHashTables.build((1, 14), 4, 8, 16_000_000, token_map, 2)
    gate = rng.standard_normal((4, 5120)).astype(np.float32)
    layers = {lid: {"table": np.zeros((1, 84), np.uint8), "wkv": np.zeros((1, 84), np.uint8),
                    "q_weight": gate, "k_weight": gate} for lid in (1, 14)}

    def holes(tensors):
        out = []
        for t in tensors:
            lid = int(t.name.split(".")[1])
            if "engram_embd" in t.name:
                t = dataclasses.replace(t, ne=(256, int(tables.table_rows[config.layer_index(lid)])), data=None)
            elif "engram_wkv" in t.name:
                t = dataclasses.replace(t, ne=(config.proj_in, config.proj_out), data=None)
            out.append(t)
        return out
    return write_modified(path, config, tables, layers, holes), tables


def test_released_size_sparse_file_opens_in_milliseconds(rng, tmp_path):
    path, tables = _released_sparse_file(tmp_path / "released.gguf", rng)
    st = os.stat(path)
    if st.st_blocks * 512 > 64 * 2**20:
        pytest.skip("this filesystem does not keep sparse files sparse")
    assert st.st_size > 60e9
    # Reading any tensor data would fault in tens of GB; the header alone is ~1 MB.
    assert _best_load_time(path, 3) < 0.1
    with mf.load_gguf(path) as m:
        assert m.config == EngramConfig.released()
        assert m.layers[1].n_rows == 384_006_168 and m.layers[14].n_rows == 384_016_682
        assert m.layers[14].wkv_type == "Q2_K" and m.layers[14].wkv_raw.shape == (25600, 24 * 84)
        np.testing.assert_array_equal(m.hash_tables.primes, tables.primes)
        got = m.rows(14).read([0, 384_016_681])
        assert got.shape == (2, 84) and not got.any()  # a hole reads as zeros


# Errors --------------------------------------------------------------------------------------

def test_bad_magic_and_version(tiny, tmp_path):
    path, *_ = tiny
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(mf.BadMagicError, match="not a GGUF file"):
        mf.load_gguf(bad)
    bad.write_bytes(b"hello")
    with pytest.raises(mf.BadMagicError):
        mf.load_gguf(bad)
    for version in (1, 99):
        bad.write_bytes(data[:4] + version.to_bytes(4, "little") + data[8:])
        with pytest.raises(mf.UnsupportedVersionError, match=f"GGUF version {version} is not supported"):
            mf.load_gguf(bad)
    bad.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(mf.UnsupportedVersionError, match="big-endian"):
        mf.load_gguf(bad)


def test_truncated_files(tiny, tmp_path):
    path, config, tables, layers = tiny
    data = path.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:10])
    with pytest.raises(mf.TruncatedFileError, match="header is cut short"):
        mf.load_gguf(bad)
    with mf.load_gguf(path) as m:
        data_offset = m.data_offset
        last = m.tensors["blk.4.engram_k.weight"]
    for cut in (40, 300, data_offset - 40):  # inside the KVs, the token map, the tensor index
        bad.write_bytes(data[:cut])
        with pytest.raises(mf.TruncatedFileError, match="cut short"):
            mf.load_gguf(bad)
    bad.write_bytes(data[:last.offset + last.nbytes - 1])
    with pytest.raises(mf.TruncatedFileError, match=r"tensor 'blk.4.engram_k.weight' .*truncated"):
        mf.load_gguf(bad)


def test_truncated_string_array(tiny, tmp_path):
    _, config, tables, layers = tiny
    over = {"tokenizer.ggml.tokens": ("arr[str]", [f"t{i}" for i in range(500)])}
    kvs, tensors = mf.build_gguf_entries(config, tables, layers, kv_overrides=over)
    path = mf.write_gguf_raw(tmp_path / "s.gguf", kvs, [])
    data = path.read_bytes()
    path.write_bytes(data[:-20])
    with pytest.raises(mf.TruncatedFileError, match="tokenizer.ggml.tokens"):
        mf.load_gguf(path)


def test_missing_key(tiny, tmp_path):
    _, config, tables, layers = tiny
    for key in (P + "head_count", "deepseek41.embedding_length", P + "layer_ids"):
        path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, omit_keys=(key,))
        with pytest.raises(mf.MissingKeyError, match=f"'{key}' is missing"):
            mf.load_gguf(path)


def test_old_prefix(tiny, tmp_path):
    _, config, tables, layers = tiny
    path = mf.write_gguf(tmp_path / "old.gguf", config, tables, layers, key_prefix="deepseek4.")
    with pytest.raises(mf.MissingKeyError, match=r"'deepseek41\.embedding_length' is missing; the file uses the old "
                                                 r"prefix 'deepseek4\.'"):
        mf.load_gguf(path)
    with mf.load_gguf(path, key_prefix="deepseek4.") as m:
        np.testing.assert_array_equal(m.hash_tables.primes, tables.primes)


def test_missing_hash_constants(tiny, tmp_path):
    _, config, tables, layers = tiny
    consts = [P + k for k in ("multipliers", "primes", "offsets", "token_map", "pad_id")]
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, omit_keys=consts)
    with pytest.raises(mf.MissingKeyError, match="lacks the hash constants") as err:
        mf.load_gguf(path)
    for key in consts:
        assert key in str(err.value)
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, omit_keys=(P + "pad_id",))
    with pytest.raises(mf.MissingKeyError, match=r"'deepseek41\.engram\.pad_id' is missing.*missing: deepseek41\.engram\.pad_id\)"):
        mf.load_gguf(path)


@pytest.mark.parametrize("key,count,expect", [
    ("primes", 10, r"deepseek41\.engram\.primes has 10 entries, expected layers\*orders\*heads = 2\*3\*2 = 12"),
    ("offsets", 13, r"deepseek41\.engram\.offsets has 13 entries, expected layers\*orders\*heads = 2\*3\*2 = 12"),
    ("multipliers", 6, r"deepseek41\.engram\.multipliers has 6 entries, expected layers\*max_ngram_size = 2\*4 = 8"),
])
def test_wrong_array_length(tiny, tmp_path, key, count, expect):
    _, config, tables, layers = tiny
    values = np.resize(getattr(tables, key).ravel(), count)
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, kv_overrides={P + key: ("arr[u64]", values)})
    with pytest.raises(mf.BadMetadataError, match=expect):
        mf.load_gguf(path)


def test_bad_metadata_values(tiny, tmp_path):
    _, config, tables, layers = tiny
    cases = [
        ({P + "head_count": ("str", "two")}, mf.BadMetadataError, r"head_count must be an integer, got str"),
        ({P + "primes": ("arr[f32]", tables.primes.ravel())}, mf.BadMetadataError, r"primes must be an integer array"),
        ({P + "multipliers": ("arr[u64]", np.full(8, 2**64 - 1, np.uint64))}, mf.BadMetadataError,
         r"multipliers\[0\] = 18446744073709551615 does not fit in int64"),
        ({P + "key_length": ("u32", 128)}, mf.BadMetadataError, r"head_dim must be 256"),
        ({P + "offsets": ("arr[u64]", tables.offsets.ravel() + 1)}, mf.HashConstantsError,
         r"offset \[layer 1\]\[col 0\] = 1"),
        ({P + "pad_id": ("u32", 64)}, mf.HashConstantsError, r"pad_id 64 is outside the compressed vocab"),
        ({"general.alignment": ("u32", 24)}, mf.BadMetadataError, r"general.alignment = 24"),
    ]
    for over, exc, msg in cases:
        path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, kv_overrides=over)
        with pytest.raises(exc, match=msg):
            mf.load_gguf(path)


def test_primes_do_not_sum_to_table_rows(tiny, tmp_path):
    _, config, tables, layers = tiny
    layers = dict(layers)
    layers[4] = dict(layers[4], table=layers[4]["table"][:600])
    path = mf.write_gguf(tmp_path / "m.gguf", config, tables, layers, check=False)
    with pytest.raises(mf.RowCountMismatchError,
                       match=r"layer 4: its primes \(deepseek41\.engram\.primes\) sum to 630 rows but "
                             r"blk\.4\.engram_embd\.weight has 600 rows"):
        mf.load_gguf(path)
    with mf.load_gguf(path, validate=False) as m:
        text = mf.describe(m)
    assert "layer 4: primes sum 630, table rows 600  MISMATCH" in text and "layer 1: primes sum 462" in text
    # `engram-numba info` describes such a file, marks the mismatch, and exits non-zero
    from engram_numba.cli import main
    assert main(["info", str(path)]) == 1


def _edit(name, **changes):
    def edit(tensors):
        return [dataclasses.replace(t, **changes) if t.name == name else t for t in tensors]
    return edit


def test_tensor_wrong_shape(tiny, tmp_path):
    _, config, tables, layers = tiny
    bad = tmp_path / "m.gguf"
    wkv = layers[1]["wkv"]
    write_modified(bad, config, tables, layers, _edit("blk.1.engram_wkv.weight", ne=(1536, 256), data=wkv[:256]))
    with pytest.raises(mf.BadTensorError, match=r"'blk\.1\.engram_wkv\.weight' has ggml ne \[1536, 256\], expected "
                                                r"\[K=n_hash_cols\*head_dim=1536, N=dim\*\(hc\+1\)=320\]"):
        mf.load_gguf(bad)
    q = layers[4]["q_weight"]
    write_modified(bad, config, tables, layers, _edit("blk.4.engram_q.weight", ne=(32, 8), data=q))
    with pytest.raises(mf.BadTensorError, match=r"'blk\.4\.engram_q\.weight' has ggml ne \[32, 8\], expected \[dim=64, hc\]"):
        mf.load_gguf(bad)
    k = layers[4]["k_weight"]
    write_modified(bad, config, tables, layers, _edit("blk.4.engram_k.weight", ne=(64, 2), data=k[:2]))
    with pytest.raises(mf.BadTensorError, match=r"'blk\.4\.engram_k\.weight' has ggml ne \[64, 2\], expected \[64, 4\]"):
        mf.load_gguf(bad)
    table = layers[1]["table"]
    write_modified(bad, config, tables, layers,
                   _edit("blk.1.engram_embd.weight", ne=(512, 231), data=table[:462]))
    with pytest.raises(mf.BadTensorError, match=r"'blk\.1\.engram_embd\.weight' has ggml ne \[512, 231\], expected \[256, rows\]"):
        mf.load_gguf(bad)


def test_unsupported_quant(tiny, tmp_path, rng):
    _, config, tables, layers = tiny
    bad = tmp_path / "m.gguf"
    for qtype, block_bytes in (("Q5_K", 176), ("Q6_K", 210), ("IQ4_XS", 136)):
        rows = layers[4]["table"].shape[0]
        data = rng.integers(0, 256, size=(rows, block_bytes), dtype=np.uint8)
        write_modified(bad, config, tables, layers, _edit("blk.4.engram_embd.weight", type_name=qtype, data=data))
        with pytest.raises(mf.UnsupportedQuantError,
                           match=rf"'blk\.4\.engram_embd\.weight' is {qtype}; supported table types: "
                                 r"Q2_K, Q3_K, Q4_K, Q8_0"):
            mf.load_gguf(bad)
    N = config.proj_out
    data = rng.integers(0, 256, size=(N, 1536 // 256 * 144), dtype=np.uint8)
    write_modified(bad, config, tables, layers, _edit("blk.1.engram_wkv.weight", type_name="Q4_K", data=data))
    with pytest.raises(mf.UnsupportedQuantError, match=r"'blk\.1\.engram_wkv\.weight' is Q4_K"):
        mf.load_gguf(bad)
    data = rng.integers(-5, 5, size=(4, 64)).astype(np.int32)
    write_modified(bad, config, tables, layers, _edit("blk.1.engram_q.weight", type_name="I32", data=data))
    with pytest.raises(mf.UnsupportedQuantError, match=r"'blk\.1\.engram_q\.weight' is I32"):
        mf.load_gguf(bad)


@pytest.mark.parametrize("qtype,encoding,row_bytes", [("Q3_K", "q3_k", 110), ("Q4_K", "q4_k", 144),
                                                       ("Q8_0", "q8_0", 272)])
def test_other_table_types_open(tiny, tmp_path, rng, qtype, encoding, row_bytes):
    """Published quant mixes: Q3_K, Q4_K and Q8_0 tables open as their rows-stage encodings."""
    _, config, tables, layers = tiny
    bad = tmp_path / "m.gguf"
    data = {}
    for lid in (1, 4):
        data[lid] = rng.integers(0, 256, size=(layers[lid]["table"].shape[0], row_bytes), dtype=np.uint8)
    edit = lambda ts: [dataclasses.replace(t, type_name=qtype, data=data[int(t.name.split(".")[1])])  # noqa: E731
                       if "engram_embd" in t.name else t for t in ts]
    write_modified(bad, config, tables, layers, edit)
    with mf.load_gguf(bad) as m:
        assert m.format == f"gguf (schema A, {encoding} tables)"
        lf = m.layers[4]
        assert lf.table_encoding == encoding and lf.table.shape == (630, row_bytes)
        np.testing.assert_array_equal(m.rows(4).read([0, 629]), data[4][[0, 629]])


def test_missing_tensor(tiny, tmp_path):
    _, config, tables, layers = tiny
    for name in ("blk.4.engram_embd.weight", "blk.1.engram_k.weight"):
        path = write_modified(tmp_path / "m.gguf", config, tables, layers,
                              lambda ts: [t for t in ts if t.name != name])
        with pytest.raises(mf.MissingTensorError, match=rf"tensor '{name}' of engram layer \d is missing"):
            mf.load_gguf(path)


def test_unaligned_or_duplicate_tensor_record(tiny, tmp_path):
    _, config, tables, layers = tiny
    kvs, tensors = mf.build_gguf_entries(config, tables, layers)
    path = mf.write_gguf_raw(tmp_path / "m.gguf", kvs, tensors + [tensors[0]])
    with pytest.raises(mf.BadTensorError, match="'blk.1.engram_embd.weight' appears twice"):
        mf.load_gguf(path)
    # Written with 32-byte padding but declaring 64: some tensor offset is not a multiple of 64.
    path = mf.write_gguf_raw(tmp_path / "m.gguf", kvs + [("general.alignment", "u32", 64)], tensors)
    with pytest.raises(mf.BadTensorError, match=r"data offset \d+ is not a multiple of the alignment 64"):
        mf.load_gguf(path)


def test_alignment_key_respected(tiny, tmp_path):
    _, config, tables, layers = tiny
    kvs, tensors = mf.build_gguf_entries(config, tables, layers)
    path = mf.write_gguf_raw(tmp_path / "m.gguf", kvs + [("general.alignment", "u32", 256)], tensors, alignment=256)
    with mf.load_gguf(path) as m:
        assert m.alignment == 256 and m.data_offset % 256 == 0
        assert all(t.offset % 256 == 0 for t in m.tensors.values())
        np.testing.assert_array_equal(m.layers[4].table, layers[4]["table"])


def test_writer_checks_shapes(tiny, tmp_path):
    _, config, tables, layers = tiny
    bad = dict(layers)
    bad[1] = dict(layers[1], table=layers[1]["table"][:10])
    with pytest.raises(ValueError, match=r"layer 1 table must be uint8 \[462, 84\]"):
        mf.write_gguf(tmp_path / "m.gguf", config, tables, bad)
    bad[1] = dict(layers[1], q_weight=layers[1]["q_weight"][:2])
    with pytest.raises(ValueError, match=r"layer 1 q_weight must be \[hc, dim\] = \[4, 64\]"):
        mf.write_gguf(tmp_path / "m.gguf", config, tables, bad)
    bad[1] = dict(layers[1], wkv=layers[1]["wkv"][:, :256])
    with pytest.raises(ValueError, match=r"layer 1 wkv has ggml ne \[256, 320\], expected \[1536, 320\]"):
        mf.write_gguf(tmp_path / "m.gguf", config, tables, bad)
    with pytest.raises(ValueError, match="cannot infer"):
        mf.write_gguf(tmp_path / "m.gguf", config, tables, {1: dict(layers[1], wkv=layers[1]["wkv"].astype(np.int64)),
                                                           4: layers[4]})
