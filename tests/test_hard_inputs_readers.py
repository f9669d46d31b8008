"""Malformed files for every safetensors reader (HF shards, highway files, captures) and every
JSON reader (safetensors headers, config.json, the index, capture meta, statistics files), built
on the fly: each must end in the reader's own named error, never in a foreign exception or a
silently different result. Plus the bounded-work, capture, identity and argument checks."""
from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

import engram_numba as en
from engram_numba.capture import Capture, CaptureFileError
from engram_numba.fixtures import TINY_MASK, TINY_PATH, TINY_TOKENS
from engram_numba.formats import errors as E
from engram_numba.formats.jsonsafe import load_json, nesting_depth
from engram_numba.formats.safetensors import SafetensorsFile, write_arrays
from engram_numba.highway import HighwayFileError, load_highway, save_highway

from formats_helpers import write_hf


@pytest.fixture(scope="module")
def model():
    return en.load_gguf(TINY_PATH)


# Building safetensors files by hand --------------------------------------------------------------

def _entries(rng):
    """Three small tensors with fresh values: name -> (dtype, array)."""
    return {"a": ("F32", rng.standard_normal((3, 5)).astype(np.float32)),
            "b": ("I64", rng.integers(-9, 9, size=(4,)).astype(np.int64)),
            "c": ("U8", rng.integers(0, 255, size=(7,)).astype(np.uint8))}


def _build(entries, *, header_text=None, pad=True, length_delta=0, tail=b"", offsets=None):
    """Bytes of a safetensors file; header_text replaces the JSON (to repeat a key), offsets
    overrides data_offsets per name, length_delta shifts the stored header length."""
    header, body, pos = {}, b"", 0
    for name, (dtype, arr) in entries.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(raw)]}
        if offsets and name in offsets:
            header[name]["data_offsets"] = offsets[name]
        body += raw
        pos += len(raw)
    text = (header_text if header_text is not None else json.dumps(header)).encode()
    if pad:
        text += b" " * (8 + -len(text) % 8)      # at least 8 spaces: room to land a short length in
    return struct.pack("<Q", len(text) + length_delta) + text + body + tail, header


def _st_reader_error(path):
    """Open with the plain reader; returns the exception (or None)."""
    try:
        SafetensorsFile(path).close()
    except E.EngramFileError as exc:
        return exc
    return None


def test_a_repeated_key_is_refused(tmp_path, rng):
    entries = _entries(rng)
    data, header = _build(entries)
    # the same JSON with tensor "a" listed twice (the second entry aliasing "b")
    text = json.dumps(header)
    dup = text[:-1] + ', "a": ' + json.dumps(header["b"]) + "}"
    bad, _ = _build(entries, header_text=dup)
    p = tmp_path / "dup.safetensors"
    p.write_bytes(bad)
    with pytest.raises(E.SafetensorsHeaderError, match="'a' appears twice"):
        SafetensorsFile(p)


def test_a_header_length_that_lands_in_the_padding_is_refused(tmp_path, rng):
    entries = _entries(rng)
    good, _ = _build(entries)
    p = tmp_path / "ok.safetensors"
    p.write_bytes(good)
    st = SafetensorsFile(p)
    np.testing.assert_array_equal(st.raw("a"), entries["a"][1])
    st.close()
    for delta in (-1, -3, -7):      # the JSON still parses; every tensor would shift
        bad, _ = _build(entries, length_delta=delta)
        p.write_bytes(bad)
        with pytest.raises(E.SafetensorsHeaderError, match="header length that falls short"):
            SafetensorsFile(p)


@pytest.mark.parametrize("case", ["hole", "overlap", "trailing", "cut"])
def test_the_data_section_must_be_covered_exactly(tmp_path, rng, case):
    entries = _entries(rng)
    n_a, n_b = entries["a"][1].nbytes, entries["b"][1].nbytes
    n_c = entries["c"][1].nbytes
    if case == "hole":       # c starts one byte late, and the file has that byte
        bad, _ = _build(entries, offsets={"c": [n_a + n_b + 1, n_a + n_b + 1 + n_c]}, tail=b"\0")
        err, match = E.SafetensorsHeaderError, "belong to no tensor"
    elif case == "overlap":  # b moved back over a's last bytes
        bad, _ = _build(entries, offsets={"b": [n_a - 8, n_a - 8 + n_b]})
        err, match = E.OverlappingTensorsError, "overlaps tensor"
    elif case == "trailing":
        bad, _ = _build(entries, tail=b"\0" * 5)
        err, match = E.SafetensorsHeaderError, "bytes after the last tensor"
    else:
        bad, _ = _build(entries)
        bad = bad[:-3]
        err, match = E.TruncatedFileError, "runs past the file"
    p = tmp_path / f"{case}.safetensors"
    p.write_bytes(bad)
    with pytest.raises(err, match=match):
        SafetensorsFile(p)


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["a"].update(dtype=["F32"]), "dtype \\['F32'\\] is not a safetensors dtype"),
    (lambda h: h["a"].update(shape=[1] * 100_000), "100,000 axes"),
    (lambda h: h["a"].update(shape=[10**15, 10**15]), "needs more than the file holds"),
    (lambda h: h["a"].update(data_offsets=[0, "60"]), "data_offsets"),
    (lambda h: h.update(__metadata__={"k": ["v"]}), "__metadata__ must be an object of strings"),
    (lambda h: h.update(__metadata__=[1, 2]), "__metadata__ must be an object of strings"),
])
def test_header_entries_are_checked_with_short_messages(tmp_path, rng, edit, match):
    entries = _entries(rng)
    _, header = _build(entries)
    edit(header)
    bad, _ = _build(entries, header_text=json.dumps(header))
    p = tmp_path / "e.safetensors"
    p.write_bytes(bad)
    with pytest.raises(E.EngramFileError, match=match) as info:
        SafetensorsFile(p)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("text, match", [
    ('{"a":' * 5000 + "1" + "}" * 5000, "nests 5000 levels"),
    ('{"a": {"dtype": "U8", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 1]}}', "5000 digits"),
    ('{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1e999]}}', "not finite"),
    ('{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}', "NaN is not a JSON number"),
    ('\ufeff{}', "not start with"),
])
def test_json_the_header_reader_cannot_take(tmp_path, text, match):
    p = tmp_path / "j.safetensors"
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0")
    with pytest.raises(E.SafetensorsHeaderError, match=match) as info:
        SafetensorsFile(p)
    assert len(str(info.value)) < 400


def test_load_json_rules():
    class Err(ValueError):
        pass
    assert load_json(b'{"a": [1, 2.5, "x"], "b": {"c": null}}', "s", Err) == {"a": [1, 2.5, "x"], "b": {"c": None}}
    assert nesting_depth(b'{"a": "[[[[[[", "b": [[1]]}') == 3       # brackets inside strings do not count
    for bad in (b'{"a": 1, "a": 2}', b"[Infinity]", b"[-Infinity]", b"[1e400]", b"[" + b"1" * 41 + b"]",
                b"\xff\xfe{}", b"[" * 65 + b"]" * 65, b"{", b""):
        with pytest.raises(Err, match="^s: "):
            load_json(bad, "s", Err)


# Every safetensors reader, fuzzed ------------------------------------------------------------------

def _mutants(data: bytes, rng, n: int):
    """Deterministic mutations of a file: byte flips in the header and its length, cuts, appends."""
    (hlen,) = struct.unpack("<Q", data[:8])
    out = []
    for _ in range(n):
        b = bytearray(data)
        kind = rng.integers(0, 5)
        if kind == 0:                                        # one header byte changed
            i = int(rng.integers(8, 8 + hlen))
            b[i] = int(rng.integers(0, 256))
        elif kind == 1:                                      # the length a little off
            b[:8] = struct.pack("<Q", max(0, hlen + int(rng.integers(-9, 10))))
        elif kind == 2:                                      # cut short
            b = b[:int(rng.integers(0, len(b)))]
        elif kind == 3:                                      # bytes appended
            b += bytes(rng.integers(0, 256, size=int(rng.integers(1, 9)), dtype=np.uint8))
        else:                                                # a digit in the header changed
            digits = [i for i in range(8, 8 + hlen) if chr(b[i]).isdigit()]
            i = digits[int(rng.integers(0, len(digits)))]
            b[i] = ord(str(int(rng.integers(0, 10))))
        out.append(bytes(b))
    return out


def _fuzz(path, data, rng, open_it, error, n=60):
    refused = 0
    for bad in _mutants(data, rng, n):
        path.write_bytes(bad)
        try:
            open_it(path)
        except error:
            refused += 1
    return refused


def test_fuzzed_capture_files_end_in_capture_errors(tmp_path, rng):
    cap = Capture({"tokens.ids": TINY_TOKENS.copy(), "L1.gate.gate": rng.random((14, 4), dtype=np.float32)},
                  {"backends": {"hash": "cpu"}, "n_tokens": 14})
    cap.save(tmp_path / "c.safetensors")
    data = (tmp_path / "c.safetensors").read_bytes()
    refused = _fuzz(tmp_path / "m.safetensors", data, rng, Capture.load, CaptureFileError)
    assert refused > 30


def test_fuzzed_highway_files_end_in_highway_errors(tmp_path, rng, model):
    cfg = model.config
    hw = {lid: rng.standard_normal((len(TINY_TOKENS), cfg.hc, cfg.dim)).astype(np.float32) for lid in cfg.layer_ids}
    save_highway(tmp_path / "h.safetensors", hw, TINY_TOKENS, TINY_MASK, dtype="bf16")
    data = (tmp_path / "h.safetensors").read_bytes()
    refused = _fuzz(tmp_path / "m.safetensors", data, rng, lambda p: load_highway(p, model), HighwayFileError)
    assert refused > 30


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder, _ = write_hf(tmp_path_factory.mktemp("hf") / "ckpt", np.random.default_rng(16))
    return folder


@pytest.fixture
def hf_copy(tmp_path, hf_folder):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_folder, dst)
    return dst


def test_fuzzed_hf_shards_end_in_file_errors(hf_copy, rng):
    shard = hf_copy / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    refused = 0
    for bad in _mutants(data, rng, 25):
        shard.write_bytes(bad)
        try:
            en.load_model(hf_copy).close()
        except E.EngramFileError:
            refused += 1
    assert refused > 10


def test_hf_shard_with_a_repeated_key_or_a_short_length(hf_copy):
    shard = hf_copy / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8:8 + n].rstrip(b" ")
    header = json.loads(text)
    name = next(k for k in header if k.endswith("q_weight"))
    other = next(k for k in header if k.endswith("k_weight"))
    dup = text[:-1] + b', "' + name.encode() + b'": ' + json.dumps(header[other]).encode() + b"}"
    dup += b" " * (-len(dup) % 8)
    shard.write_bytes(struct.pack("<Q", len(dup)) + dup + data[8 + n:])
    with pytest.raises(E.SafetensorsHeaderError, match="appears twice"):
        en.load_model(hf_copy)
    if n - len(text) >= 1:            # a header length short by what the padding allows
        shard.write_bytes(struct.pack("<Q", len(text)) + data[8:])
        with pytest.raises(E.SafetensorsHeaderError, match="falls short"):
            en.load_model(hf_copy)


# JSON readers of an HF checkpoint ------------------------------------------------------------------

@pytest.mark.parametrize("mutate, match", [
    (lambda t: "[" * 3000 + "]" * 3000, "nests 3000 levels"),
    (lambda t: t.replace('"hidden_size": 64', '"hidden_size": ' + "1" * 5000), "5000 digits"),
    (lambda t: t.replace('"rms_norm_eps": 1e-20', '"rms_norm_eps": Infinity'), "Infinity is not a JSON number"),
    (lambda t: t.replace('"rms_norm_eps": 1e-20', '"rms_norm_eps": 1' + "0" * 399), "400 digits"),
    (lambda t: t.replace('"rms_norm_eps": 1e-20', '"rms_norm_eps": "1e-20"'), "rms_norm_eps must be a number"),
    (lambda t: t[:-1] + ', "hidden_size": 64}', "appears twice"),
    (lambda t: t.replace('"hidden_size": 64', '"hidden_size": [64]'), "hidden_size must be an integer"),
    (lambda t: t.replace('"vocab_size": 64', '"vocab_size": 4294967296'), "far more ids than the tokenizer"),
])
def test_config_json_the_reader_cannot_take(hf_copy, mutate, match):
    cfg = hf_copy / "config.json"
    text = json.dumps(json.loads(cfg.read_text()))
    assert '"hidden_size": 64' in text and '"rms_norm_eps": 1e-20' in text and '"vocab_size": 64' in text
    cfg.write_text(mutate(text))
    t0 = time.perf_counter()
    with pytest.raises(E.EngramFileError, match=match) as info:
        en.load_model(hf_copy)
    assert time.perf_counter() - t0 < 5
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("mutate, match", [
    (lambda d: "{" + '"a":{' * 2000 + "}" * 2001, "nests"),
    (lambda d: json.dumps(d)[:-1] + ', "weight_map": {}}', "appears twice"),
    (lambda d: json.dumps({**d, "weight_map": {k: [v] for k, v in d["weight_map"].items()}}), "weight_map"),
])
def test_index_json_the_reader_cannot_take(hf_copy, mutate, match):
    idx = hf_copy / "model.safetensors.index.json"
    idx.write_text(mutate(json.loads(idx.read_text())))
    with pytest.raises(E.BadMetadataError, match=match):
        en.load_model(hf_copy)


# Bounded work --------------------------------------------------------------------------------------

def test_a_split_name_with_a_huge_count_is_refused_cheaply(tmp_path):
    p = tmp_path / "m-00001-of-99999.gguf"
    shutil.copy(TINY_PATH, p)
    t0 = time.perf_counter()
    with pytest.raises(E.MissingShardError, match="99,998 of 99,999 shards missing") as info:
        en.load_model(p)
    assert time.perf_counter() - t0 < 5.0
    assert len(str(info.value)) < 400


# Captures ------------------------------------------------------------------------------------------

def _npy_bytes(arr) -> bytes:
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def test_capture_load_refuses_what_is_not_a_capture(tmp_path, rng, model):
    cap = en.Pipeline(model, "cpu").run(TINY_TOKENS, names_filter="L1.gate.*")
    cap.save(tmp_path / "c.npz")
    full = (tmp_path / "c.npz").read_bytes()
    back = Capture.load(tmp_path / "c.npz")
    np.testing.assert_array_equal(back["L1.gate.gate"], cap["L1.gate.gate"])
    st = en.StreamingGateStats.empty(model, contexts=False, rows=False)
    st.save(tmp_path / "stats.npz")
    save_highway(tmp_path / "h.safetensors", {1: rng.standard_normal((2, 4, 64)).astype(np.float32)},
                 TINY_TOKENS[:2])
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:       # a member declaring 10^12 elements
        z.writestr("__meta__.npy", _npy_bytes(np.array("{}")))
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
        z.writestr("tokens.ids.npy", head.getvalue() + bytes(64))
    files = {"empty": b"", "text": b"token,gate\n1,0.5\n", "half zip": full[:len(full) // 2],
             "bare npy": _npy_bytes(rng.random(3)), "stats": (tmp_path / "stats.npz").read_bytes(),
             "highway": (tmp_path / "h.safetensors").read_bytes(),
             "huge member": (tmp_path / "huge.npz").read_bytes(),
             "bad meta": full.replace(b"__meta__", b"__meta_x")}
    expect = {"empty": "empty", "text": "neither", "half zip": "not a readable .npz", "bare npy": "bare .npy",
              "stats": "statistics file", "highway": "highway file", "huge member": "declares float64",
              "bad meta": "without a __meta__"}
    for name, data in files.items():
        p = tmp_path / "x.bin"
        p.write_bytes(data)
        with pytest.raises(CaptureFileError, match=expect[name]):
            Capture.load(p)


def test_capture_meta_goes_through_the_strict_json_reader(tmp_path):
    cap = Capture({"tokens.ids": TINY_TOKENS.copy()}, {})
    for meta in ("[" * 3000 + "]" * 3000, '{"a": 1, "a": 2}', '{"x": NaN}', "[1, 2]"):
        p = tmp_path / "m.npz"
        np.savez(p, __meta__=np.array(meta), **{"tokens.ids": TINY_TOKENS})
        with pytest.raises(CaptureFileError):
            Capture.load(p)
        p = tmp_path / "m.safetensors"
        write_arrays(p, {"tokens.ids": TINY_TOKENS}, {"engram_numba.meta": meta})
        with pytest.raises(CaptureFileError):
            Capture.load(p)
    cap.save(tmp_path / "ok.safetensors")
    assert Capture.load(tmp_path / "ok.safetensors").meta == {}


# Statistics files and the model identity -----------------------------------------------------------

def _other_token_map_model(model):
    """The tiny model with the same shapes but two raw ids' compressed ids swapped."""
    from types import SimpleNamespace

    from engram_numba.stages.hash.tables import EngramHashTables
    t = model.hash_tables
    tm = t.token_map.copy()
    tm[[5, 6]] = tm[[6, 5]]
    assert tm[5] != tm[6]
    tables = EngramHashTables(t.layer_ids, t.multipliers, t.primes, t.offsets, tm, t.pad_id)
    return SimpleNamespace(config=model.config, hash_tables=tables, layers=model.layers, rows=model.rows,
                           path="other")


def _stats(model, rng, tokens=None):
    return en.corpus_stats(model, documents=[tokens if tokens is not None else TINY_TOKENS], contexts=False,
                           rows=False, threads=False)


def test_statistics_of_different_models_do_not_merge(tmp_path, model, rng):
    a = _stats(model, rng)
    b = _stats(model, rng, TINY_TOKENS[::-1].copy())
    assert (a + b).n_tokens == 2 * len(TINY_TOKENS)
    other = _stats(_other_token_map_model(model), rng)
    with pytest.raises(ValueError, match="different models: their token maps differ"):
        a + other
    with pytest.raises(ValueError, match="token maps differ"):
        en.merge_stats([a, other])
    q8 = en.load_gguf(str(TINY_PATH).replace("tiny_v41.gguf", "tiny_v41_q8_0.gguf"))
    with pytest.raises(ValueError, match="encodings differ"):
        a + _stats(q8, rng)
    # saved and loaded, the identity comes along and is still checked
    a.save(tmp_path / "a.npz")
    other.save(tmp_path / "o.npz")
    la, lo = en.StreamingGateStats.load(tmp_path / "a.npz"), en.StreamingGateStats.load(tmp_path / "o.npz")
    assert la.identity == a.identity
    with pytest.raises(ValueError, match="token maps differ"):
        la + lo
    with pytest.raises(TypeError, match=r"parts\[1\] is NoneType"):
        en.merge_stats([a, None])


def _rewrite_npz(src, dst, edit_state=None, edit_arrays=None):
    with np.load(src) as f:
        arrays = {k: f[k] for k in f.files}
    state = json.loads(str(arrays.pop("__state__")))
    if edit_state:
        edit_state(state)
    if edit_arrays:
        edit_arrays(arrays)
    np.savez(dst, __state__=np.array(json.dumps(state)), **arrays)


def test_statistics_files_are_checked_at_load(tmp_path, model, rng):
    a = _stats(model, rng)
    a.save(tmp_path / "a.npz")
    src, dst = tmp_path / "a.npz", tmp_path / "b.npz"
    from engram_numba.analysis.stats_file import StatisticsFileError as SE
    # written before identities were kept: loads, and the identity is rebuilt from its constants
    _rewrite_npz(src, dst, lambda s: s.pop("identity"))
    old = en.StreamingGateStats.load(dst)
    assert old.identity["hash"] == a.identity["hash"] and old.identity["token_map"] == a.identity["token_map"]
    assert (old + a).n_tokens == 2 * a.n_tokens
    bad = {
        "tok_gsum shape": (None, lambda d: d.update(tok_gsum=d["tok_gsum"][:, :, :-1])),
        "fine dtype": (None, lambda d: d.update(fine=d["fine"].astype(np.float64))),
        "missing counts": (None, lambda d: d.pop("counts")),
        "compressed_vocab": (lambda s: s.update(compressed_vocab=10**12), None),
        "hc as string": (lambda s: s.update(hc="4"), None),
        "tampered identity": (lambda s: s["identity"].update(hash="0" * 16), None),
        "huge exact": (lambda s: s["exact"]["g1"][0].__setitem__(0, "9" * 5000), None),
        "older version": (lambda s: s.update(version=0), None),
        "deep meta": (lambda s: s.update(meta={"x": json.loads("[" * 100 + "]" * 100)}), None),
    }
    for name, (es, ea) in bad.items():
        _rewrite_npz(src, dst, es, ea)
        with pytest.raises(SE):
            en.StreamingGateStats.load(dst)
    cap = en.Pipeline(model, "cpu").run(TINY_TOKENS[:3], names_filter="tokens.ids")
    cap.save(tmp_path / "cap.npz")
    with pytest.raises(SE, match="a capture"):
        en.StreamingGateStats.load(tmp_path / "cap.npz")


def test_a_hasher_of_another_model_is_refused_and_diff_says_so(model):
    other = _other_token_map_model(model)
    pipe = en.Pipeline(model, "cpu")
    with pytest.raises(ValueError, match="another model's tables .*token map"):
        pipe.run(TINY_TOKENS, hasher=en.EngramHasher(other.hash_tables))
    from numba import cuda
    engine = en.EngramV41(model, 4)
    with pytest.raises(ValueError, match="another model's tables .*token map"):
        engine.step(TINY_TOKENS[:2], cuda.to_device(np.ones((2, model.config.hc, model.config.dim), np.float32)),
                    en.EngramHasher(other.hash_tables))
    h = en.EngramHasher(model.hash_tables)
    pipe.run(TINY_TOKENS[:4], hasher=h, names_filter="tokens.ids")
    assert h.position == 4
    a = pipe.run(TINY_TOKENS, names_filter="L1.gate.*")
    assert "warning" not in str(en.diff(a, pipe.run(TINY_TOKENS, names_filter="L1.gate.*")))
    q8 = en.load_gguf(str(TINY_PATH).replace("tiny_v41.gguf", "tiny_v41_q8_0.gguf"))
    b = en.Pipeline(q8, "cpu").run(TINY_TOKENS, names_filter="L1.gate.*")
    report = en.diff(a, b)
    assert "encodings differ" in report.model_warning and "warning: the two captures" in str(report)


# A tokenizer beside the model that does not fit it ---------------------------------------------

def test_a_bigger_tokenizer_beside_a_gguf_does_not_break_runs_given_ids(tmp_path, model):
    from tokenizers import Tokenizer, models
    n = model.hash_tables.token_map.size + 10
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(n)}, unk_token="t0"))
    shutil.copy(TINY_PATH, tmp_path / "m.gguf")
    tok.save(str(tmp_path / "tokenizer.json"))
    m = en.load_gguf(tmp_path / "m.gguf")
    cap = en.Pipeline(m, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
    ref = en.Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK)
    np.testing.assert_array_equal(cap["L4.gate.gate"], ref["L4.gate.gate"])
    assert cap.token_strings is None
    with pytest.raises(ValueError, match="more ids|token ids but the model's token map"):
        en.Pipeline(m, "cpu").run(text="t1 t2")


# Arguments --------------------------------------------------------------------------------------

def test_wrong_typed_and_reinterpreted_arguments_are_named(model, tmp_path, rng):
    cap = en.Pipeline(model, "cpu").run(TINY_TOKENS, names_filter=["tokens.*", "L1.gate.*"])
    cases = [
        (lambda: en.load_model(None), TypeError, "path must be a path"),
        (lambda: en.Pipeline("x.gguf"), TypeError, "got the path 'x.gguf'"),
        (lambda: en.Pipeline(model, versions="gemv_v2"), TypeError, "versions must be a dict"),
        (lambda: en.describe("x.gguf"), TypeError, "model must be an opened model"),
        (lambda: en.compressed_view(None), TypeError, "model must be an opened model"),
        (lambda: en.EngramHasher(None), TypeError, "tables must be an EngramHashTables"),
        (lambda: en.gate_stats(cap, bins=2.5), TypeError, "bins must be an integer"),
        (lambda: en.gate_stats(cap, layer_ids="1"), TypeError, "layer_ids must be a list of integers"),
        (lambda: en.gate_stats(None), TypeError, "capture must be a Capture"),
        (lambda: en.diff(cap, [1]), TypeError, "b must be a Capture"),
        (lambda: en.point_names("14"), TypeError, "layer_ids must be a list of integers"),
        (lambda: en.EngramConfig(dim=64, hc=4, layer_ids="14"), ValueError, "the string '14'"),
        (lambda: en.corpus_stats(model, texts="one text"), TypeError, "texts must be a list"),
        (lambda: en.corpus_stats(model, documents=[TINY_TOKENS], max_contexts=-1), ValueError, "max_contexts"),
        (lambda: en.corpus_stats(model, documents=[TINY_TOKENS], bins=20.0), TypeError, "bins must be"),
        (lambda: en.merge_stats("ab"), TypeError, "parts must be a list"),
        (lambda: en.Capture.load(None), TypeError, "path must be a path"),
        (lambda: en.tokenize(model, None), TypeError, "text must be a str"),
    ]
    for call, err, match in cases:
        with pytest.raises(err, match=match):
            call()


def test_highway_files_two_spellings_bool_bytes_and_chunk_ranges(tmp_path, rng, model):
    cfg = model.config
    T = len(TINY_TOKENS)
    h = {lid: rng.standard_normal((T, cfg.hc, cfg.dim)).astype(np.float32) for lid in cfg.layer_ids}
    p = save_highway(tmp_path / "h.safetensors", h, TINY_TOKENS, TINY_MASK, dtype="fp32")
    hw = load_highway(p, model)
    np.testing.assert_array_equal(hw.chunk(1, 2, 5), h[1][2:5])
    for t0, t1 in ((5, 5), (6, 2), (0, T + 1), (-1, 3)):
        with pytest.raises(ValueError, match="non-empty range"):
            hw.chunk(1, t0, t1)
    with pytest.raises(TypeError, match="t1 must be an integer"):
        hw.chunk(1, 0, 2.0)
    hw.close()
    # two spellings of layer 1
    arrays = {"engram.1.highway_in": h[1], "engram.01.highway_in": h[1], "engram.4.highway_in": h[4],
              "token_ids": TINY_TOKENS.astype(np.int64)}
    write_arrays(tmp_path / "two.safetensors", arrays)
    with pytest.raises(HighwayFileError, match="both layer 1's highway"):
        load_highway(tmp_path / "two.safetensors")
    # a BOOL mask byte of 2
    data = bytearray(p.read_bytes())
    st = SafetensorsFile(p)
    off = st.tensors["token_mask"].offset
    st.close()
    data[off + 3] = 2
    (tmp_path / "b.safetensors").write_bytes(bytes(data))
    with pytest.raises(HighwayFileError, match="BOOL but element 3 is the byte 2"):
        load_highway(tmp_path / "b.safetensors", model)


def test_long_runs_are_chunked_by_default_with_the_same_result(model, monkeypatch):
    import engram_numba.pipeline as pl
    monkeypatch.setattr(pl, "DEFAULT_CHUNK_TOKENS", 4)
    pipe = en.Pipeline(model, "cpu")
    seen = []
    with pipe.hooks({"L1.hash.ids": lambda value, name: seen.append(len(value))}):
        chunked = pipe.run(TINY_TOKENS, token_mask=TINY_MASK, progress=False)
    assert seen == [4, 4, 4, 2]
    whole = en.Pipeline(model, "cpu").run(TINY_TOKENS, token_mask=TINY_MASK, chunk_tokens=len(TINY_TOKENS),
                                          progress=False)
    for name in whole:
        np.testing.assert_array_equal(chunked[name], whole[name], err_msg=name)


# The CLI on any file -----------------------------------------------------------------------------

def test_info_on_any_file_is_a_description_or_one_error_line(tmp_path, rng, hf_folder):
    files = {"empty.gguf": b"", "text.txt": b"hello\n", "deep.json": b"[" * 3000,
             "random.bin": bytes(rng.integers(0, 256, size=300, dtype=np.uint8)),
             "dup.safetensors": _build(_entries(rng), header_text='{"a": {}, "a": {}}')[0]}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    cfg = tmp_path / "ckpt"
    shutil.copytree(hf_folder, cfg)
    (cfg / "config.json").write_text("{" + '"a":{' * 2000 + "}" * 2001)
    paths = [tmp_path / n for n in files] + [cfg]
    code = ("import sys\nfrom engram_numba.cli import main\nfor p in sys.argv[1:]:\n"
            "    rc = main(['info', p]); print('rc', rc, file=sys.stderr)\n")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - t0 < 60
    assert "Traceback" not in out.stderr, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == len(paths), out.stderr
    assert all(len(ln) < 400 for ln in errors)


@pytest.mark.parametrize("line, match", [
    ('{"text": ' + "[" * 3000 + "]" * 3000 + "}", "nests"),
    ('{"text": [1, 2], "text": [3]}', "appears twice"),
    ('{"text": [1, NaN]}', "NaN"),
    ('{"text": [1, ' + "9" * 30 + "]}", "outside int64"),
    ('{"text": [1, ' + "9" * 5000 + "]}", "5000 digits"),
])
def test_corpus_json_lines_go_through_the_strict_reader(tmp_path, line, match):
    from engram_numba.analysis.corpus import iter_documents
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": [5, 6]}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"c.jsonl:2: .*{match}"):
        list(iter_documents([path]))


def _text_mutants(text: str, rng, n: int):
    """Deterministic edits of a JSON text: JSON-significant characters inserted, deleted or swapped."""
    alphabet = list('{}[]",:0123456789-.eE ') + ["NaN", "Infinity", "1e999", "9" * 50, "[" * 100, '"a":1,']
    out = []
    for _ in range(n):
        t = text
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(t) + 1))
            kind = rng.integers(0, 3)
            tok = alphabet[int(rng.integers(0, len(alphabet)))]
            t = t[:i] + tok + t[i:] if kind == 0 else (t[:i] + t[i + 1:] if kind == 1 else t[:i] + tok + t[i + 1:])
        out.append(t)
    return out


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_fuzzed_checkpoint_json_ends_in_file_errors(hf_copy, rng, name):
    path = hf_copy / name
    text = path.read_text()
    refused = 0
    for bad in _text_mutants(text, rng, 30):
        path.write_text(bad)
        try:
            en.load_model(hf_copy).close()
        except E.EngramFileError as exc:
            assert len(str(exc)) < 600
            refused += 1
    assert refused > 15


def test_fuzzed_npz_captures_and_statistics_end_in_their_errors(tmp_path, rng, model):
    from engram_numba.analysis.stats_file import StatisticsFileError as SE
    cap = Capture({"tokens.ids": TINY_TOKENS.copy(), "L1.gate.gate": rng.random((14, 4), dtype=np.float32)},
                  {"n_tokens": 14})
    cap.save(tmp_path / "c.npz")
    en.StreamingGateStats.empty(model, contexts=False, rows=False).save(tmp_path / "s.npz")
    for src, load, err in ((tmp_path / "c.npz", Capture.load, CaptureFileError),
                           (tmp_path / "s.npz", en.StreamingGateStats.load, SE)):
        data = src.read_bytes()
        refused = 0
        for _ in range(40):
            b = bytearray(data)
            for _ in range(int(rng.integers(1, 4))):
                i = int(rng.integers(0, len(b)))
                b[i] = int(rng.integers(0, 256))
            if rng.integers(0, 4) == 0:
                b = b[:int(rng.integers(0, len(b)))]
            (tmp_path / "m.npz").write_bytes(bytes(b))
            try:
                load(tmp_path / "m.npz")
            except err:
                refused += 1
        assert refused > 10
