"""A corpus run's device work, queued ahead: chunk k+1 (and k+2) go to the GPU before chunk k's
dot and gate are read back.

`corpus_stats` with the cuda backend for rows, proj and gate and every table on the device runs
each chunk's launches through a `DeviceChunks`:

    dc = DeviceChunks(engine, residual, eps)
    done = dc.submit(row_ids, highway_for, live)   # ids up, gathers, projections, gates, dot/gate down
    ...                                            # submit the next chunks while this one computes
    gates = done()                                 # {layer id: (dot, gate)} [T, hc] fp32, host

What a chunk costs the host thread that drives the device, and why (module `tools/gates_profile.py`
counts it): `Pipeline.gates_from_ids` waited for every chunk's dot and gate (a synchronous copy)
before the next chunk's launches were made, so the GPU idled while Python prepared the next chunk
and the host thread's time per chunk was its own work plus the device's. Here:
  - one stream (the engine's when it has a real one, else one of its own) carries every copy and
    launch in order, so the engine's single workspaces are reused safely across chunks in flight;
  - the row ids go up from pinned buffers (one per chunk in flight, written in place), the dot and
    gate come down into pinned buffers with asynchronous copies, and one event a chunk says when
    they have landed;
  - each layer's gather, projection and gate are prepared launches made once per (layer, token
    count, highway buffer) and reused: a chunk is 2 copies + 3 launches + 2 copies a layer;
  - with a q2k or fp8 wkv held as stored, a many-token projection decodes the weight into one
    bf16 scratch the layers share: the layer whose weight the scratch holds projects first, so a
    chunk decodes one wkv, not one a layer (the kv of a layer does not depend on the order);
  - waiting for a chunk polls its event with short sleeps, so the producer and reducer threads
    hold the GIL while the GPU works.
The same kernels read the same inputs as `Pipeline.gates_from_ids` does, so the statistics are
bit-identical (tests/test_corpus_pipelined.py compares the two).
"""
from __future__ import annotations

import time

import numpy as np

from ..device.devarray import data_address, is_device_like
from ..device.intrinsics import SIMULATOR

DEPTH = 2                   # chunks queued on the device beyond the one being read back
POLL_S = 100e-6             # sleep between event polls while waiting for a chunk


def eligible(pipe, engine) -> str | None:
    """None when `DeviceChunks` can run this pipeline's chunks, else why not (a short phrase)."""
    if not pipe.device_resident:
        return "not every stage on the cuda backend"
    if engine is None:
        return "no engine"
    for lid, lw in engine.layers.items():
        if lw.placement != "device" or lw.table is None:
            return f"layer {lid}'s table is placed {lw.placement!r}"
    return None


class DeviceChunks:
    """Every layer's rows -> proj -> gate for chunks of row ids, queued on one stream (module doc).

    engine: an `EngramV41` with every table on the device. residual, eps: the gate's (the
    pipeline's). depth: chunks in flight beyond the one read back (pinned buffers: depth + 1)."""

    def __init__(self, engine, residual: str, eps: float, depth: int = DEPTH):
        from numba import cuda
        self._cuda = cuda
        self.engine = engine
        cfg = engine.config
        self.config = cfg
        self.residual, self.eps = residual, eps
        self.layer_ids = tuple(cfg.layer_ids)
        own = engine.stream if engine.stream and int(getattr(engine.stream, "handle", 0) or 0) else None
        self.stream = own if own is not None else cuda.stream()
        L, C, T, hc = len(self.layer_ids), cfg.n_hash_cols, engine.max_tokens, cfg.hc
        self.n_slots = int(depth) + 1
        self._ids = [cuda.pinned_array((L, T * C), dtype=np.int64) for _ in range(self.n_slots)]
        self._mask = [cuda.pinned_array(T, dtype=np.uint8) for _ in range(self.n_slots)]
        self._out = [cuda.pinned_array((L, 2, T, hc), dtype=np.float32) for _ in range(self.n_slots)]
        self._events = [None] * self.n_slots       # the event of the chunk that last used each slot
        self._unread = [False] * self.n_slots      # a slot whose chunk's results were not read yet
        self._mask_dev = cuda.device_array(T, dtype=np.uint8)
        self._next = 0
        self._plans: dict = {}
        self.counts = {"chunks": 0, "launches": 0, "h2d": 0, "d2h": 0, "waits": 0, "polls": 0}
        self.seconds = {"launch_s": 0.0, "wait_s": 0.0}

    # -- prepared launches ----------------------------------------------------------------------
    def _layer_plan(self, lid, T: int):
        key = ("layer", lid, T)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.engine.layer_launches(lid, T, self.stream)
        return plan

    def _gate_plan(self, lid, T: int, h, masked: bool):
        key = ("gate", lid, T, data_address(h), tuple(h.strides), masked)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 256:                 # many highway buffers: forget the oldest
                self._plans.pop(next(iter(self._plans)))
            mask = self._mask_dev[:T] if masked else None
            plan = self._plans[key] = self.engine.gate_launch(lid, h, T, mask, self.residual, self.eps, self.stream)
        return plan

    # -- a chunk ----------------------------------------------------------------------------------
    def submit(self, row_ids: np.ndarray, highway, live: np.ndarray | None):
        """Queue one chunk: row_ids [T, layers, C] (host), highway a device array [T, hc, dim] fp32
        (updated in place, as the gate does) or a callable (stream) -> that array (its copies on
        that stream); live [T] bool or None (all live). Returns a callable that waits for
        the chunk and returns {layer id: (dot, gate)}, each [T, hc] fp32 (fresh host arrays)."""
        t0 = time.perf_counter()
        cfg, eng, s = self.config, self.engine, self.stream
        ids = np.asarray(row_ids)
        L, C = len(self.layer_ids), cfg.n_hash_cols
        if ids.ndim != 3 or ids.shape[1:] != (L, C) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"row_ids must be integers [T, {L}, {C}], got {ids.dtype}{list(ids.shape)}")
        T = int(ids.shape[0])
        eng.check_tokens(T, "corpus chunk")
        for li, lid in enumerate(self.layer_ids):            # every id checked before anything is queued
            lay = ids[:, li, :]
            n_rows = eng.layers[lid].n_rows
            if lay.size and (lay.min() < 0 or lay.max() >= n_rows):
                flat = lay.reshape(-1)
                i = int(np.argmax((flat < 0) | (flat >= n_rows)))
                raise ValueError(f"row id {int(flat[i])} (token {i // C}, column {i % C}) is outside layer "
                                 f"{lid}'s table of {n_rows} rows")
        h = highway(s) if callable(highway) else highway
        if not is_device_like(h) or tuple(h.shape) != (T, cfg.hc, cfg.dim) or np.dtype(h.dtype) != np.float32:
            raise ValueError(f"the chunk's highway must be a device array [{T}, {cfg.hc}, {cfg.dim}] fp32, got "
                             f"{type(h).__name__} {list(getattr(h, 'shape', ()))}")
        slot = self._next
        if self._unread[slot]:
            raise RuntimeError(f"DeviceChunks: {self.n_slots} chunks in flight already (read the oldest first)")
        self._next = (slot + 1) % self.n_slots
        ev = self._events[slot]
        if ev is None:
            ev = self._events[slot] = self._cuda.event() if SIMULATOR else self._cuda.event(timing=False)
        else:                                                # the chunk that last used this slot's buffers
            self._wait(ev)
        n = T * C
        hid = self._ids[slot]
        for li in range(L):                                  # [T, C] -> the pinned [T*C] of each layer
            np.copyto(hid[li, :n].reshape(T, C), ids[:, li, :], casting="unsafe")
        masked = live is not None and not bool(np.all(live))
        if masked:
            self._mask[slot][:T] = live
            self._mask_dev[:T].copy_to_device(self._mask[slot][:T], stream=s)
            self.counts["h2d"] += 1
        for li, lid in enumerate(self.layer_ids):            # every ids upload and gather first
            eng.workspace(lid).ids[:n].copy_to_device(hid[li, :n], stream=s)
            self._layer_plan(lid, T)[0]()
        order = list(self.layer_ids)                         # then the projections, the layer whose
        held = eng.scratch_layer                             # wkv the shared bf16 scratch holds first
        if held in order and order[0] != held:               # (a q2k/fp8 wkv decoded for many tokens:
            order.remove(held)                               # one decode a chunk instead of one a layer;
            order.insert(0, held)                            # each kv depends on its own layer only)
        for lid in order:
            self._layer_plan(lid, T)[1]()
        out = self._out[slot]
        for li, lid in enumerate(self.layer_ids):            # the gates in model order, on the one highway
            ws = eng.workspace(lid)
            self._gate_plan(lid, T, h, masked)()
            ws.dot[:T].copy_to_host(out[li, 0, :T], stream=s)
            ws.gate[:T].copy_to_host(out[li, 1, :T], stream=s)
        ev.record(s)
        self._unread[slot] = True
        for lid in self.layer_ids:                           # what the engine's own calls would leave
            eng.note_queued(lid, T, *self._layer_plan(lid, T), self._gate_plan(lid, T, h, masked))
        self.counts["chunks"] += 1
        self.counts["h2d"] += L
        self.counts["launches"] += 3 * L
        self.counts["d2h"] += 2 * L
        self.seconds["launch_s"] += time.perf_counter() - t0

        def done():
            self._wait(ev)
            t1 = time.perf_counter()
            res = {lid: (np.array(out[li, 0, :T]), np.array(out[li, 1, :T])) for li, lid in enumerate(self.layer_ids)}
            self._unread[slot] = False
            self.seconds["launch_s"] += time.perf_counter() - t1
            return res
        return done

    def _wait(self, ev) -> None:
        """Wait for event `ev`, sleeping between polls (the other threads keep the GIL meanwhile)."""
        t0 = time.perf_counter()
        query = getattr(ev, "query", None)
        if query is None:                                    # numba's simulator: everything already ran
            ev.synchronize()
        else:
            while not query():
                self.counts["polls"] += 1
                time.sleep(POLL_S)
        self.counts["waits"] += 1
        self.seconds["wait_s"] += time.perf_counter() - t0

    def drain(self) -> None:
        """Wait for every chunk queued (results not read are dropped)."""
        for i, ev in enumerate(self._events):
            if ev is not None:
                self._wait(ev)
            self._unread[i] = False
