"""One engram layer's step, hash ids -> rows -> proj -> gate, on a backend per stage.

Every path runs this one step: `Pipeline.run` (capture points and hooks at each boundary),
`Pipeline.gates_from_ids` (and through it corpus runs), and `EngramV41.step` (every stage on the
engine). The decode graph captures the same per-layer launches (`EngramV41`'s launch builders).

An array between two stages is a `Value`: on the host, on the device, or both. It moves only
when the next stage's backend or a capture point asks for it on the other side, so the path a
run takes is not chosen up front: with the cuda backend for rows, proj and gate and nothing kept
or hooked between them, rows, kv and the highway never leave the device; keep `L1.proj.kv` and
only that kv comes back (the gate still reads the device copy); hook `L1.rows.bf16` and the rows
come back, the hook sees them, and the rows it leaves go up again.

A backend's stage methods (`backends.HostBackend`): `rows(layer, ids=|raw=) -> Value`,
`proj(layer, rows: Value) -> Value`, `gate(layer, highway: Value, kv: Value, mask, residual, eps)
-> GateValues`. The gate may update the highway's device array in place: a highway handed to it
is consumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from .device.devarray import data_address, is_device_like
from .stages.proj.reference import split_kv


class Value:
    """One stage boundary's array: a host copy, a device copy, or both (made when first asked)."""

    __slots__ = ("_host", "_dev")

    def __init__(self, host=None, device=None):
        if (host is None) == (device is None):
            raise ValueError("a Value holds a host array or a device array")
        self._host, self._dev = host, device

    @classmethod
    def of(cls, a) -> "Value":
        """A device-like array as a device Value, anything else as a host one."""
        return cls(device=a) if is_device_like(a) else cls(host=np.asarray(a))

    @property
    def on_device(self) -> bool:
        return self._dev is not None

    @property
    def shape(self) -> tuple:
        return tuple((self._dev if self._dev is not None else self._host).shape)

    def host(self) -> np.ndarray:
        self._check_held()
        if self._host is None:
            self._host = self._dev.copy_to_host()
        return self._host

    def device(self):
        self._check_held()
        if self._dev is None:
            from numba import cuda
            self._dev = cuda.to_device(np.ascontiguousarray(self._host))
        return self._dev

    def _check_held(self) -> None:
        if self._host is None and self._dev is None:
            raise RuntimeError("this Value was consumed by a stage that updated its device array in place")

    def take_device(self):
        """The device array, for a stage that updates it in place: this Value forgets it (and its
        host copy, which the update makes stale)."""
        dev = self.device()
        self._dev = self._host = None
        return dev


def same_memory(a, b) -> bool:
    """True when device arrays a and b are the same view of the same memory."""
    return (a is b) or (tuple(a.shape) == tuple(b.shape) and np.dtype(a.dtype) == np.dtype(b.dtype)
                        and tuple(a.strides) == tuple(b.strides) and data_address(a) == data_address(b))


@dataclass
class GateValues:
    highway: Value   # [T, hc, dim] fp32 after the update
    dot: Value       # [T, hc] fp32
    gate: Value      # [T, hc] fp32


class EngineStages:
    """rows, proj and gate on an `EngramV41`, with device Values in and out.

    engine_for(n_tokens) -> the engine for a call of that many tokens. A Value that already is
    the engine's own buffer (the rows just gathered, the kv just projected) is used where it is:
    nothing is copied back and up again."""

    def __init__(self, engine_for: Callable[[int], object], config):
        self.engine_for = engine_for
        self.config = config

    def rows(self, layer, raw=None, ids=None) -> Value:
        lid = layer.layer_id
        if raw is not None:
            eng = self._engine(raw.shape[0], "raw rows")
            eng.rows_from_raw(lid, raw)
        else:
            ids = np.asarray(ids)
            eng = self._engine(ids.size, "row ids")
            eng.load_rows(lid, ids.reshape(-1, self.config.n_hash_cols))
        return Value(device=eng.rows_bf16(lid))

    def proj(self, layer, rows: Value) -> Value:
        lid = layer.layer_id
        eng = self._engine(rows.shape[0], "rows")
        if not (rows.on_device and same_memory(rows.device(), eng.rows_bf16(lid))):
            eng.rows_from_bf16(lid, rows.device() if rows.on_device else rows.host())
        eng.project(lid)
        return Value(device=eng.kv(lid))

    def gate(self, layer, highway: Value, kv: Value, token_mask, residual, eps) -> GateValues:
        lid = layer.layer_id
        eng = self.engine_for(highway.shape[0])
        own_kv = kv.on_device and same_memory(kv.device(), eng.kv(lid))
        h = highway.take_device()                     # updated in place: the highway is consumed
        eng.gate(lid, h, token_mask, residual=residual, eps=eps, kv=None if own_kv else kv.device())
        dot, gate = eng.last_gate(lid)
        return GateValues(Value(device=h), Value(device=dot), Value(device=gate))

    def _engine(self, n_rows: int, what: str):
        """The engine for n_rows rows of C hash columns each (T = n_rows / C tokens)."""
        C = self.config.n_hash_cols
        if n_rows % C:
            raise ValueError(f"{what}: {n_rows} rows is not a whole number of tokens ({C} hash columns each)")
        return self.engine_for(n_rows // C)


class NoPoints:
    """Capture points that keep nothing and run no hooks (gates_from_ids, EngramV41.step)."""

    def wants(self, name: str) -> bool:
        return False

    def fire(self, name: str) -> None:
        pass

    def __call__(self, name: str, value: Value) -> Value:
        return value


NO_POINTS = NoPoints()


class LayerStep:
    """hash ids -> rows -> proj -> gate of one engram layer.

    stages: {"rows": backend, "proj": backend, "gate": backend} (backend objects with the stage
    methods of the module doc), or one backend for all three. points: where each boundary's value is offered (`wants(name)`:
    it needs the host value; `fire(name)`: it fired without one; `points(name, value) -> value`,
    a hook's replacement or the value itself). given: {point name: host array} of an isolated run,
    fed to each stage instead of the previous stage's output."""

    def __init__(self, stages, config, residual: str | None, eps: float | None):
        self.stages = stages if isinstance(stages, Mapping) else {s: stages for s in ("rows", "proj", "gate")}
        self.config = config
        self.residual = residual
        self.eps = eps

    def rows(self, layer, ids: np.ndarray, points=NO_POINTS, given=None,
             progress: Callable[[str], None] | None = None) -> Value:
        """Row ids [T, C] (host) -> bf16 rows [T*C, 256]: the hash.ids, rows.raw, rows.bf16 points."""
        p = f"L{layer.layer_id}."
        ids = points(p + "hash.ids", Value(host=ids)).host()                       # [T, C]
        if given is not None:
            ids = given[p + "hash.ids"]
        if progress is not None:
            progress(f"L{layer.layer_id} rows")
        rows_b = self.stages["rows"]
        if points.wants(p + "rows.raw"):
            raw = points(p + "rows.raw", Value(host=layer.reader.read(ids)))      # [T*C, row_bytes]
            rows = rows_b.rows(layer, raw=raw.host())
        else:
            points.fire(p + "rows.raw")
            rows = rows_b.rows(layer, ids=ids)                                     # gathered by id
        rows = points(p + "rows.bf16", rows)                                       # [T*C, 256]
        if given is not None:
            rows = Value(host=given[p + "rows.bf16"])
        return rows

    def proj(self, layer, rows: Value, points=NO_POINTS, progress: Callable[[str], None] | None = None) -> Value:
        """bf16 rows -> kv [T, (hc+1)*dim] bf16 words: the proj.kv point."""
        if progress is not None:
            progress(f"L{layer.layer_id} proj")
        return points(f"L{layer.layer_id}.proj.kv", self.stages["proj"].proj(layer, rows))

    def gate(self, layer, kv: Value, highway: Value, mask, points=NO_POINTS, given=None,
             progress: Callable[[str], None] | None = None) -> GateValues:
        """The gate on this layer's kv: key and value points, highway.in, dot, gate, highway.out."""
        p = f"L{layer.layer_id}."
        kv = self._key_value(p, kv, points, given)
        if given is not None:
            highway = Value(host=given[p + "highway.in"])
        if points.wants(p + "highway.in"):
            offered = Value(host=np.ascontiguousarray(highway.host(), dtype=np.float32))
            out = points(p + "highway.in", offered)
            if out is not offered:                        # a hook's highway (or the one it looked at)
                highway = out
        else:
            points.fire(p + "highway.in")
        if progress is not None:
            progress(f"L{layer.layer_id} gate")
        res = self.stages["gate"].gate(layer, highway, kv, mask, self.residual, self.eps)
        points(p + "gate.dot", res.dot)
        points(p + "gate.gate", res.gate)
        res.highway = points(p + "highway.out", res.highway)
        return res

    def _key_value(self, p: str, kv: Value, points, given) -> Value:
        """The gate.key and gate.value points: kv is split (and joined again) only when one of them
        is kept, hooked or given."""
        names = (p + "gate.key", p + "gate.value")
        if given is None and not any(points.wants(n) for n in names):
            for n in names:
                points.fire(n)
            return kv
        host = kv.host()
        key_v, value_v = split_kv(host, self.config.hc)
        key_in, value_in = Value(host=np.ascontiguousarray(key_v)), Value(host=np.ascontiguousarray(value_v))
        key, value = points(names[0], key_in), points(names[1], value_in)
        if given is not None:
            key, value = Value(host=given[names[0]]), Value(host=given[names[1]])
        elif key is key_in and value is value_in:       # kept, not hooked: kv goes on as it is
            return kv
        T = host.shape[0]
        return Value(host=np.concatenate([key.host().reshape(T, -1), value.host()], axis=1))

    def run(self, layer, ids, highway: Value, mask, points=NO_POINTS, given=None, progress=None) -> GateValues:
        """The whole step of one layer."""
        kv = self.proj(layer, self.rows(layer, ids, points, given, progress), points, progress)
        return self.gate(layer, kv, highway, mask, points, given, progress)


def run_layers(step: LayerStep, layers: Mapping, all_ids: np.ndarray, highway, mask, points=NO_POINTS,
               given=None, *, kv_first: bool = False, progress=None, layer_done=None) -> dict:
    """Every engram layer in model order -> {layer id: GateValues}.

    all_ids: [T, layers, C] host row ids. highway: a Value for the first layer (each layer's
    output feeds the next), or {layer id: Value}. kv_first: every layer's rows, then every
    layer's projection, then the gates (a layer's kv depends on its ids only: every ids upload
    and gather is queued before the first projection, so no copy waits behind a layer's
    kernels); else layer by layer, the order the capture points fire in."""
    per_layer = isinstance(highway, Mapping)
    ids = {lid: np.ascontiguousarray(all_ids[:, li, :]) for li, lid in enumerate(layers)}
    kvs = {}
    if kv_first:
        rows = {lid: step.rows(layer, ids[lid], points, given, progress) for lid, layer in layers.items()}
        kvs = {lid: step.proj(layer, rows.pop(lid), points, progress) for lid, layer in layers.items()}
    out, current = {}, None if per_layer else highway
    for lid, layer in layers.items():
        if kv_first:
            kv = kvs.pop(lid)
        else:
            kv = step.proj(layer, step.rows(layer, ids[lid], points, given, progress), points, progress)
        res = step.gate(layer, kv, highway[lid] if per_layer else current, mask, points, given, progress)
        out[lid] = res
        current = res.highway
        if layer_done is not None:
            layer_done()
    return out
