"""Hidden states from another engine: the highway file format, its checks, runs on it, captures
saved as safetensors, and the cuda backend's device-resident path."""
import json
import struct

import numpy as np
import pytest

from engram_numba.analysis.diff import diff
from engram_numba.bf16 import bf16_to_f32, f32_to_bf16
from engram_numba.capture import Capture
from engram_numba.fixtures import TINY_MASK, TINY_PATH, TINY_TOKENS
from engram_numba.formats.schema_a import load_gguf
from engram_numba.formats.safetensors import SafetensorsFile
from engram_numba.formats.safetensors import write_arrays as write_safetensors
from engram_numba.highway import HighwayFileError, highway_tensor_name, load_highway, save_highway
from engram_numba.pipeline import Pipeline


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


def _recorded(rng, T=14, hc=4, dim=64):
    """Stand-ins for another engine's hidden states: {layer: fp32 [T, hc, dim]} (bf16-exact)."""
    return {lid: bf16_to_f32(f32_to_bf16(rng.standard_normal((T, hc, dim)).astype(np.float32) * 3))
            for lid in (1, 4)}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_run_on_an_imported_highway(tmp_path, model, rng, dtype):
    hw_in = _recorded(rng)
    path = save_highway(tmp_path / "h.safetensors", hw_in, TINY_TOKENS, TINY_MASK, dtype=dtype,
                        producer="test", model="tiny")
    hw = load_highway(path, model)
    assert (hw.n_tokens, hw.hc, hw.dim, hw.dtype, hw.layer_ids) == (14, 4, 64, dtype, [1, 4])
    np.testing.assert_array_equal(hw.token_ids, TINY_TOKENS)
    np.testing.assert_array_equal(hw.token_mask, TINY_MASK)
    assert hw.producer == "test" and hw.metadata["format"] == "engram-highway"
    pipe = Pipeline(model, "cpu")
    cap = pipe.run(highway=hw)                                  # token ids and mask from the file
    want = pipe.run(TINY_TOKENS, token_mask=TINY_MASK, highway=hw_in)
    assert diff(want, cap).all_equal
    for lid in (1, 4):                                          # each layer reads its own recorded stream
        np.testing.assert_array_equal(cap[f"L{lid}.highway.in"], hw_in[lid])
    assert cap.meta["highway"].startswith("imported from") and "h.safetensors" in cap.meta["highway"]
    chunked = pipe.run(TINY_TOKENS, highway=hw, chunk_tokens=5)
    assert diff(cap, chunked).all_equal
    np.testing.assert_array_equal(hw.chunk(4, 3, 9), hw_in[4][3:9])


def test_given_token_ids_must_match_the_file(tmp_path, model, rng):
    path = save_highway(tmp_path / "h.safetensors", _recorded(rng), TINY_TOKENS)
    hw = load_highway(path, model)
    other = TINY_TOKENS.copy()
    other[6] = 5
    with pytest.raises(ValueError, match="token id 5 at position 6 differs from highway file"):
        Pipeline(model, "cpu").run(other, highway=hw)
    with pytest.raises(ValueError, match="3 token ids were given but highway file"):
        Pipeline(model, "cpu").run(TINY_TOKENS[:3], highway=hw)


def _write(path, tensors: dict, meta=None):
    return write_safetensors(path, tensors, meta or {})


@pytest.mark.parametrize("case, match", [
    ("missing_layer", "tensor 'engram.4.highway_in' is missing; the model's engram layers are \\[1, 4\\]"),
    ("extra_layer", "tensor 'engram.7.highway_in' is for layer 7, which is not an engram layer"),
    ("wrong_dim", "tensor 'engram.1.highway_in' is \\[T=14, hc=4, dim=32\\] but the model has hc=4, dim=64"),
    ("f16", "tensor 'engram.1.highway_in' is F16; a highway is stored as BF16 or F32"),
    ("rank2", "tensor 'engram.1.highway_in' has shape \\[14, 256\\], expected \\[T, hc, dim\\]"),
    ("batch2", "one sequence per file"),
    ("no_ids", "tensor 'token_ids' \\(\\[T\\] int64 token ids\\) is missing"),
    ("float_ids", "tensor 'token_ids' is F32; token ids must be integers"),
    ("short_ids", "tensor 'token_ids' has shape \\[13\\] but the highway has T=14 tokens"),
    ("bad_token", "tensor 'token_ids': token id 64 at position 2 is outside the model's token map \\[0, 64\\)"),
    ("bad_mask", "tensor 'token_mask' holds values other than 0 and 1"),
    ("mixed", "mix dtypes"),
    ("nothing", "no tensor named engram.{layer_id}.highway_in \\(tensors found: token_ids\\)"),
])
def test_highway_file_errors_name_the_tensor(tmp_path, model, rng, case, match):
    h = rng.standard_normal((14, 4, 64)).astype(np.float32)
    t = {"engram.1.highway_in": h, "engram.4.highway_in": h, "token_ids": TINY_TOKENS}
    if case == "missing_layer":
        del t["engram.4.highway_in"]
    elif case == "extra_layer":
        t["engram.7.highway_in"] = h
    elif case == "wrong_dim":
        t = {k: (v[:, :, :32].copy() if k.startswith("engram") else v) for k, v in t.items()}
    elif case == "f16":
        t["engram.1.highway_in"] = h.astype(np.float16)
    elif case == "rank2":
        t["engram.1.highway_in"] = h.reshape(14, 256)
    elif case == "batch2":
        t["engram.1.highway_in"] = np.stack([h, h])
    elif case == "no_ids":
        del t["token_ids"]
    elif case == "float_ids":
        t["token_ids"] = TINY_TOKENS.astype(np.float32)
    elif case == "short_ids":
        t["token_ids"] = TINY_TOKENS[:13]
    elif case == "bad_token":
        t["token_ids"] = TINY_TOKENS.copy()
        t["token_ids"][2] = 64
    elif case == "bad_mask":
        t["token_mask"] = np.full(14, 2, np.uint8)
    elif case == "mixed":
        t["engram.4.highway_in"] = f32_to_bf16(h)
        path = write_safetensors(tmp_path / "x.safetensors", t, {}, bf16_names=["engram.4.highway_in"])
        with pytest.raises(HighwayFileError, match=match):
            load_highway(path, model)
        return
    elif case == "nothing":
        t = {"token_ids": TINY_TOKENS}
    path = _write(tmp_path / "x.safetensors", t)
    with pytest.raises(HighwayFileError, match=match):
        load_highway(path, model)


def test_batch_axis_of_one_is_dropped_and_files_from_the_safetensors_library_load(tmp_path, model, rng):
    st = pytest.importorskip("safetensors.numpy")
    import ml_dtypes
    h = rng.standard_normal((1, 14, 4, 64)).astype(np.float32)
    path = tmp_path / "lib.safetensors"
    st.save_file({"engram.1.highway_in": h.astype(ml_dtypes.bfloat16), "engram.4.highway_in": h.astype(ml_dtypes.bfloat16),
                  "token_ids": TINY_TOKENS[None], "token_mask": np.ones((1, 14), dtype=bool)},
                 str(path), metadata={"producer": "safetensors.numpy"})
    hw = load_highway(path, model)
    assert hw.dtype == "bf16" and hw.n_tokens == 14 and hw.producer == "safetensors.numpy"
    np.testing.assert_array_equal(hw.layer(1), h[0].astype(ml_dtypes.bfloat16).astype(np.float32))
    # and the library reads what we write
    ours = save_highway(tmp_path / "ours.safetensors", {1: hw.layer(1), 4: hw.layer(4)}, TINY_TOKENS, dtype="bf16")
    back = st.load_file(str(ours))
    assert back["engram.1.highway_in"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back["engram.1.highway_in"].astype(np.float32), hw.layer(1))
    np.testing.assert_array_equal(back["token_ids"], TINY_TOKENS)


def test_truncated_and_foreign_files(tmp_path, model, rng):
    path = save_highway(tmp_path / "h.safetensors", _recorded(rng), TINY_TOKENS)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    with pytest.raises(HighwayFileError, match="truncated or corrupt"):
        load_highway(cut, model)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(struct.pack("<Q", 5) + b"nope!")
    with pytest.raises(HighwayFileError, match="header is not JSON"):
        load_highway(junk)
    with pytest.raises(HighwayFileError, match="does not exist"):
        load_highway(tmp_path / "none.safetensors")


def test_capture_saved_as_safetensors_round_trips_and_is_a_highway_file(tmp_path, model):
    ref = Pipeline(model, "reference").run(TINY_TOKENS, token_mask=TINY_MASK)
    path = tmp_path / "cap.safetensors"
    ref.save(path)
    st = SafetensorsFile(path)
    assert st.tensors["L1.proj.kv"].type_name == "BF16" and st.tensors["L1.rows.raw"].type_name == "U8"
    assert st.tensors["tokens.mask"].type_name == "BOOL" and st.tensors["L1.highway.in"].type_name == "F32"
    assert json.loads(st.metadata["engram_numba.meta"]) == json.loads(json.dumps(ref.meta, default=str))
    back = Capture.load(path)
    assert back.meta == ref.meta and diff(ref, back).all_equal
    assert all(back[k].dtype == ref[k].dtype for k in ref)
    # the capture's highway.in per layer is a highway file: rerunning on it gives the same layer 1
    hw = load_highway(path, model)
    again = Pipeline(model, "reference").run(highway=hw)
    np.testing.assert_array_equal(again["L1.gate.gate"], ref["L1.gate.gate"])
    np.testing.assert_array_equal(again["L4.highway.in"], ref["L4.highway.in"])
    np.testing.assert_array_equal(again["tokens.mask"], TINY_MASK)
    # .npz still by default, and Capture.load tells the two apart by content
    ref.save(tmp_path / "cap.npz")
    assert diff(ref, Capture.load(tmp_path / "cap.npz")).all_equal


def test_highway_name_and_save_errors(rng):
    assert highway_tensor_name(14) == "engram.14.highway_in"
    with pytest.raises(ValueError, match="dtype must be"):
        save_highway("/tmp/x.safetensors", {1: np.zeros((2, 1, 8), np.float32)}, [1, 2], dtype="fp16")
    with pytest.raises(ValueError, match="expected \\[T=3, hc, dim\\]"):
        save_highway("/tmp/x.safetensors", {1: np.zeros((2, 1, 8), np.float32)}, [1, 2, 3])


# -- the cuda backend keeps rows, kv and highway on the device ------------------------------------

@pytest.mark.slow     # the whole cuda pipeline in the simulator: make test only
def test_cuda_backend_device_resident_path(model, monkeypatch):
    """With a names filter that keeps only ids, dot and gate, nothing but the dot and gate comes
    back from the device: rows, kv and the highway between layers stay there. In the simulator
    (naive kernels) the values equal the reference's. Two tokens: each simulated one is seconds of CPU.
    The projection is gemv_v1 on a bf16-resident wkv, the cheapest to simulate: what stays on the
    device does not depend on the kernel (the default Q2_K one is test_formats_fixtures.py's)."""
    from engram_numba import layer_step
    tokens, mask = TINY_TOKENS[:2], TINY_MASK[:2]
    ref = Pipeline(model, "reference").run(tokens, token_mask=mask)
    with pytest.warns(UserWarning, match="simulator"):
        pipe = Pipeline(model, "cuda", versions={"proj": "gemv_v1"})
    fetched = []
    real_host = layer_step.Value.host

    def host(self):
        if self.on_device and self._host is None:
            fetched.append(self.shape)
        return real_host(self)
    monkeypatch.setattr(layer_step.Value, "host", host)
    keep = ["tokens.*", "L*.hash.ids", "L*.gate.dot", "L*.gate.gate", "L1.highway.in"]
    cap = pipe.run(tokens, token_mask=mask, names_filter=keep)
    hc = model.config.hc
    assert fetched == [(2, hc)] * 4                              # each layer's dot and gate, nothing else
    assert pipe.fired == pipe.point_names                       # every point still fires
    assert sorted(cap) == sorted(["tokens.ids", "tokens.mask", "L1.hash.ids", "L4.hash.ids", "L1.gate.dot",
                                  "L4.gate.dot", "L1.gate.gate", "L4.gate.gate", "L1.highway.in"])
    assert diff(ref, cap).all_equal
    fetched.clear()
    out = pipe.gates_from_ids(np.stack([ref["L1.hash.ids"], ref["L4.hash.ids"]], axis=1), ref["L1.highway.in"], mask)
    assert fetched == [(2, hc)] * 4
    for lid in (1, 4):
        np.testing.assert_array_equal(out[lid][1], ref[f"L{lid}.gate.gate"])
    monkeypatch.undo()
    # asking for the kv brings that kv back, and only it
    cap2 = pipe.run(tokens, token_mask=mask, names_filter=["L1.proj.kv", "L4.gate.gate"])
    np.testing.assert_array_equal(cap2["L1.proj.kv"], ref["L1.proj.kv"])
    np.testing.assert_array_equal(cap2["L4.gate.gate"], ref["L4.gate.gate"])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gates_from_ids_on_host_backends(model, backend):
    ref = Pipeline(model, "reference").run(TINY_TOKENS, token_mask=TINY_MASK)
    ids = np.stack([ref["L1.hash.ids"], ref["L4.hash.ids"]], axis=1)          # [T, L, C]
    h = ref["L1.highway.in"].copy()
    out = Pipeline(model, backend).gates_from_ids(ids, h, TINY_MASK)
    np.testing.assert_array_equal(h, ref["L1.highway.in"])                     # not modified
    for lid in (1, 4):
        np.testing.assert_array_equal(out[lid][0], ref[f"L{lid}.gate.dot"])
        np.testing.assert_array_equal(out[lid][1], ref[f"L{lid}.gate.gate"])
    with pytest.raises(ValueError, match="row_ids must be \\[T, 2, 6\\]"):
        Pipeline(model, backend).gates_from_ids(ids[:, :1], h)
