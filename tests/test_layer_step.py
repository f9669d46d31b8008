"""The one layer step: arrays move between host and device only where a backend or a point needs them."""
import numpy as np
import pytest

from engram_numba import layer_step
from engram_numba.fixtures import TINY_MASK, TINY_PATH, TINY_TOKENS
from engram_numba.formats.schema_a import load_gguf
from engram_numba.pipeline import Pipeline


@pytest.fixture(scope="module")
def model():
    return load_gguf(TINY_PATH)


# The projection of wkv held as bf16 on the device (gemv_v1) where the test is about values moving,
# not about the weight's encoding: in the simulator it takes less than half the time of the Q2_K one
# (the default cuda pipeline on the file's Q2_K wkv: test_pipeline.py, test_pipeline_encodings.py).
BF16_PROJ = {"proj": "gemv_v1"}


@pytest.fixture
def moves(monkeypatch):
    """Record every copy a Value makes: ("down", shape) device -> host, ("up", shape) host -> device."""
    seen = []
    real_host, real_device = layer_step.Value.host, layer_step.Value.device

    def host(self):
        if self.on_device and self._host is None:
            seen.append(("down", self.shape))
        return real_host(self)

    def device(self):
        if not self.on_device:
            seen.append(("up", self.shape))
        return real_device(self)
    monkeypatch.setattr(layer_step.Value, "host", host)
    monkeypatch.setattr(layer_step.Value, "device", device)
    return seen


@pytest.mark.slow
def test_kept_rows_and_kv_come_back_once_and_never_go_up_again(model, moves):
    """Keeping rows.bf16, proj.kv, gate.key and gate.value on the cuda backend copies each back
    once for the capture; the projection and the gate still read the device copies (the only
    uploads are each layer's highway). The bf16 projection (BF16_PROJ): which values move does not
    depend on wkv's encoding."""
    cfg = model.config
    tokens, mask = TINY_TOKENS[:3], TINY_MASK[:3]
    ref = Pipeline(model, "reference").run(tokens, token_mask=mask)
    with pytest.warns(UserWarning, match="simulator"):
        pipe = Pipeline(model, "cuda", versions=BF16_PROJ)
    keep = ["L*.rows.bf16", "L*.proj.kv", "L*.gate.key", "L*.gate.value", "L*.highway.out"]
    cap = pipe.run(tokens, token_mask=mask, names_filter=keep, highway=ref["L1.highway.in"])
    T, C = len(tokens), cfg.n_hash_cols
    rows, kv, h = ("down", (T * C, 256)), ("down", (T, cfg.proj_out)), ("down", (T, cfg.hc, cfg.dim))
    # the caller's highway goes up once, before the first gate; the second layer's is the first's output
    assert moves == [rows, kv, ("up", (T, cfg.hc, cfg.dim)), h, rows, kv, h]
    for name in cap:
        np.testing.assert_array_equal(cap[name], ref[name], err_msg=name)


@pytest.mark.slow
def test_a_hook_on_device_rows_feeds_its_rows_downstream(model):
    """A hook's replacement of device rows is what the projection reads (it goes up again); the
    bf16 projection (BF16_PROJ), as the test above."""
    tokens, mask = TINY_TOKENS[:2], TINY_MASK[:2]
    ref_pipe = Pipeline(model, "reference")
    with pytest.warns(UserWarning, match="simulator"):
        pipe = Pipeline(model, "cuda", versions=BF16_PROJ)
    swap = lambda rows, name: rows[::-1].copy()                      # noqa: E731
    with ref_pipe.hooks({"L4.rows.bf16": swap}), pipe.hooks({"L4.rows.bf16": swap}):
        ref = ref_pipe.run(tokens, token_mask=mask, names_filter="L4.proj.kv")
        cap = pipe.run(tokens, token_mask=mask, names_filter="L4.proj.kv")
    np.testing.assert_array_equal(cap["L4.proj.kv"], ref["L4.proj.kv"])
    assert not np.array_equal(ref["L4.proj.kv"], Pipeline(model, "reference").run(tokens, token_mask=mask)["L4.proj.kv"])


def test_value_holds_one_side_and_forgets_a_consumed_device_array():
    with pytest.raises(ValueError, match="host array or a device array"):
        layer_step.Value()
    v = layer_step.Value(host=np.arange(6, dtype=np.float32).reshape(2, 3))
    assert not v.on_device and v.shape == (2, 3)
    dev = v.take_device()
    np.testing.assert_array_equal(dev.copy_to_host(), np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(RuntimeError, match="consumed"):
        v.host()
