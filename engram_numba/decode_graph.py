"""One-token decode through CUDA graphs: every engram layer's launches for one highway buffer,
captured once and replayed per token (`EngramV41.decode`). The launches are the layer step's
own (the engine's gather / decode, projection and gate builders), in the step's order, except
that two engram layers on the device-table path are fused where the same bits allow it: their
gathers are one launch (`prepare_gather_pair`, when the rows kernel has that form), two `q2k_r`
layers' projections one launch, and their gates one launch (`prepare_gate_pair`, when each
layer's own gate would be gate_v3, or both gate_v4): a layer's kv depends on its token ids only, so both gathers
and both projections can run before the gates, which then run layer a, layer b in one block."""
from __future__ import annotations

import numpy as np
from numba import cuda

from .device.graphs import CapturedGraph, HostToDeviceCopy
from .stages.gate.launch import prepare_gate_pair
from .stages.hash.cpu import EngramHasher
from .stages.rows.launch import has_gather_pair, pick, prepare_decode, prepare_gather_pair

_LIVE, _DEAD = np.array([True]), np.array([False])


class DecodeGraph:
    """Every engram layer's one-token decode for one highway buffer, as two CUDA graphs that differ
    only in the pinned host buffer their first copy reads (double buffering: the hasher fills one
    while the graph reading the other may still run).

    Device tables: graph = [ids upload (pinned int64 [1, L, C] -> device), mask upload, then per
    layer: gather + decode, projection, gate]; with two layers, as many of those as the kernels
    allow are one launch for both (`fuse`, the module doc): at best [ids, mask, gather pair,
    projection pair, gate pair]. Host tables: the host reads the token's raw rows into pinned
    buffers, and the graph uploads them and decodes instead of gathering."""

    fuse = True     # fuse the two layers' gathers and gates where the kernels allow (device tables)

    def __init__(self, engine, highway, residual: str):
        cfg = engine.config
        self.engine = engine
        self.stream = stream = engine.decode_stream
        L, C = len(cfg.layer_ids), cfg.n_hash_cols
        self.device_tables = all(lw.table is not None for lw in engine.layers.values())
        self.ids = [cuda.pinned_array((1, L, C), dtype=np.int64) for _ in range(2)]     # the hasher writes here
        self.mask = [cuda.pinned_array(1, dtype=np.uint8) for _ in range(2)]
        for b in range(2):
            self.ids[b][:] = 0
            self.mask[b][:] = 1
        self.dev_ids = cuda.to_device(np.zeros(L * C, np.int64))                       # [L*C] int64
        self.dev_mask = cuda.to_device(np.ones(1, np.uint8))
        if self.device_tables:
            copies = [[HostToDeviceCopy(self.dev_ids, self.ids[b].reshape(L * C), stream, "ids")] for b in range(2)]
        else:
            self.readers = [engine.model.rows(lid) for lid in cfg.layer_ids]
            self.raw = [[cuda.pinned_array((C, engine.layers[lid].row_bytes), dtype=np.uint8) for lid in cfg.layer_ids]
                        for _ in range(2)]
            copies = [[HostToDeviceCopy(engine._ws[lid].raw[:C], self.raw[b][li], stream, f"rows L{lid}")
                       for li, lid in enumerate(cfg.layer_ids)] for b in range(2)]
        for b in range(2):
            copies[b].append(HostToDeviceCopy(self.dev_mask, self.mask[b], stream, "mask"))
        # Compile every kernel first (a capture must not compile), on a scratch highway: the real one
        # must not be touched until the first replay.
        scratch = cuda.to_device(np.zeros(tuple(highway.shape), np.float32), stream=stream)
        for launch in self._launches(scratch, residual):
            launch()
        stream.synchronize()
        launches = self._launches(highway, residual)
        self.names = [getattr(x, "name", "?") for x in launches]
        self.graphs = [CapturedGraph(stream, copies[b] + launches, n_tokens=1) for b in range(2)]
        self.events = [cuda.event(timing=False) for _ in range(2)]
        self.recorded = [False, False]
        self.next = 0
        self._keep = (copies, scratch)

    def _launches(self, h, residual):
        eng = self.engine
        cfg = eng.config
        s = self.stream
        pair = self._pair_projection()
        gates = self._gate_pair(h, residual)
        if pair is not None or gates is not None:
            # a layer's kv depends on its token ids only: both gathers (one launch where the rows
            # kernel has a two-table form), both projections (one launch over both q2k_r wkv),
            # then the gates in layer order, or both in one launch (the same bits as layer by layer)
            rows = self._rows_pair()
            if rows is None:
                rows = [self._rows_launch(li, lid) for li, lid in enumerate(cfg.layer_ids)]
            projections = [pair] if pair is not None else [
                eng._prepare_projection(eng.layers[lid], eng._ws[lid], 1, s) for lid in cfg.layer_ids]
            if gates is None:
                gates = [self._gate_launch(lid, h, residual) for lid in cfg.layer_ids]
            return rows + projections + gates
        out = []
        for li, lid in enumerate(cfg.layer_ids):
            out.append(self._rows_launch(li, lid))
            out.append(eng._prepare_projection(eng.layers[lid], eng._ws[lid], 1, s))
            out.append(self._gate_launch(lid, h, residual))
        return out

    def _rows_launch(self, li, lid):
        eng = self.engine
        C, s = eng.config.n_hash_cols, self.stream
        lw, ws = eng.layers[lid], eng._ws[lid]
        if self.device_tables:
            return eng._gather_launch(lw, ws, self.dev_ids[li * C:(li + 1) * C], C, s, bad_count=eng._decode_bad)
        return eng._decode_launch(lw, ws, ws.raw[:C], C, s)

    def _gate_launch(self, lid, h, residual):
        eng = self.engine
        lw, ws = eng.layers[lid], eng._ws[lid]
        return eng._gate_launch(lw, ws, h, ws.kv[:1], self.dev_mask, residual, eng.config.eps, 1, self.stream)

    def _fusable(self) -> bool:
        """Two layers, both gathering from device tables in this graph."""
        eng = self.engine
        return (self.fuse and self.device_tables and len(eng.config.layer_ids) == 2
                and all(eng.layers[lid].table is not None for lid in eng.config.layer_ids))

    def _rows_pair(self):
        """Both layers' gathers in one launch ([launch]), or None: both must take the same rows
        record, one with a two-table gather, and the same table encoding (no separate scales)."""
        if not self._fusable():
            return None
        eng = self.engine
        C = eng.config.n_hash_cols
        (a, b) = eng.config.layer_ids
        la, lb = eng.layers[a], eng.layers[b]
        if la.encoding != lb.encoding or la.table_scales is not None or lb.table_scales is not None:
            return None
        singles = [self._rows_launch(li, lid).name for li, lid in enumerate((a, b))]
        rec = pick(la.encoding, eng.versions.get("rows"), la.table, eng._ws[a].rows[:C])
        if singles != [rec.name, rec.name] or not has_gather_pair(rec):
            return None
        return [prepare_gather_pair(la.table, lb.table, self.dev_ids[:2 * C], eng._ws[a].rows[:C], eng._ws[b].rows[:C],
                                    encoding=la.encoding, stream=self.stream, version=rec.name,
                                    bad_count=eng._decode_bad)]

    def _gate_pair(self, h, residual):
        """Both layers' gates in one launch ([launch]), or None: both layers' own gate launches
        must be gate_v3 (the pair is its kernel twice in one block, same geometry) or both gate_v4
        (its pair kernel, same slices), so that the pair gives the per-layer path's bits."""
        if not self._fusable():
            return None
        eng = self.engine
        a, b = eng.config.layer_ids
        names = {self._gate_launch(lid, h, residual).name for lid in (a, b)}
        if names == {"gate_v3"}:
            from .stages.gate.cuda import geometry_v3, pair_fits
            if not pair_fits(geometry_v3(1, eng.config.hc, eng.config.dim)):
                return None
        elif names == {"gate_v4"}:
            from .stages.gate.cuda import v4_applies
            if not v4_applies(1, eng.config.hc, eng.config.dim, pair=True):
                return None
        else:
            return None
        wa, wb = eng._ws[a], eng._ws[b]
        return [prepare_gate_pair(h, wa.kv[:1], eng.layers[a].w_gate, wb.kv[:1], eng.layers[b].w_gate,
                                  token_mask=self.dev_mask, residual=residual, eps=eng.config.eps,
                                  dot_a=wa.dot[:1], gate_a=wa.gate[:1], dot_b=wb.dot[:1], gate_b=wb.gate[:1],
                                  stream=self.stream, version=names.pop())]

    def _pair_projection(self):
        """One launch projecting both layers (q2k_r wkv in one buffer), or None: it must be the
        kernel each layer's own projection at one token would run."""
        eng = self.engine
        if eng._wkv_pair is None:
            return None
        from .stages.proj.cuda_gemv_q2kr import PAIR_KERNELS, prepare_pair
        a, b = eng.config.layer_ids
        single = eng._prepare_projection(eng.layers[a], eng._ws[a], 1, self.stream)
        if single.name not in PAIR_KERNELS:
            return None
        K = eng.config.proj_in
        xa = eng._ws[a].rows[:eng.config.n_hash_cols].reshape(1, K)
        xb = eng._ws[b].rows[:eng.config.n_hash_cols].reshape(1, K)
        return prepare_pair(single.name, xa, xb, eng._wkv_pair, eng._ws[a].kv[:1], eng._ws[b].kv[:1],
                            stream=self.stream)

    def run(self, token_id, live: bool, hasher: EngramHasher) -> None:
        b = self.next
        if self.recorded[b]:
            self.events[b].synchronize()          # the replay that last read buffer b is done with it
        ids = hasher.hash([token_id], None if live else _DEAD, out=self.ids[b])   # checks the id first
        if not self.device_tables:
            for li, reader in enumerate(self.readers):
                raw = reader.read(ids[:, li, :])
                np.copyto(self.raw[b][li], raw.reshape(self.raw[b][li].shape))
        self.mask[b][0] = 1 if live else 0
        self.graphs[b].replay()
        self.events[b].record(self.stream)
        self.recorded[b] = True
        self.next = 1 - b


class HostDecodeGraph(DecodeGraph):
    """The one-token decode graphs of an engine with tables in pinned host memory (and none left in
    the memory map). The host rows of every host layer are read in one launch, every read in
    flight at once, into staged device buffers (`DecodeStaging`); each host layer then decodes
    from its buffer, device layers gather as usual. Two graphs per buffer set b: `full[b]` (ids
    and mask up, the fetch, the layers) for a token decoded straight away, `compute[b]` (the
    layers only) for a token whose fetch `prefetch_decode` ran ahead on a side stream. The
    layers' gathers and gates stay one launch per layer here."""

    fuse = False

    def __init__(self, engine, highway, residual: str):
        self.engine = engine
        self.stream = stream = engine.decode_stream
        self.st = st = engine._staging
        self.device_tables = True          # the base class's device layers gather from dev_ids
        # compile every kernel first (a capture must not compile), on a scratch highway, with the
        # buffer set a prefetch issued ahead is not filling (it re-sends that set's last ids)
        scratch = cuda.to_device(np.zeros(tuple(highway.shape), np.float32), stream=stream)
        c = st.next if st.pending is None else 1 - st.pending[0]
        for launch in st.fetch_launches(stream, c) + self._launches_b(scratch, residual, c):
            launch()
        stream.synchronize()
        self.full, self.compute, keep = [], [], []
        for b in range(2):
            fetch, layers = st.fetch_launches(stream, b), self._launches_b(highway, residual, b)
            self.full.append(CapturedGraph(stream, fetch + layers, n_tokens=1))
            self.compute.append(CapturedGraph(stream, self._launches_b(highway, residual, b), n_tokens=1))
            keep.append(fetch)
        self.names = [getattr(x, "name", "?") for x in st.fetch_launches(stream, 0)[2:] + layers]
        self._keep = (keep, scratch)

    def _launches_b(self, h, residual, b):
        self.dev_ids, self.dev_mask, self._b = self.st.dev_ids[b], self.st.dev_mask[b], b
        return self._launches(h, residual)

    def _rows_launch(self, li, lid):
        eng = self.engine
        lw, ws = eng.layers[lid], eng._ws[lid]
        if lw.placement == "host":
            return prepare_decode(self.st.raw_u8(self._b, lid), ws.rows[:eng.config.n_hash_cols], encoding=lw.encoding,
                                  stream=self.stream, version=eng.versions.get("rows"))
        return super()._rows_launch(li, lid)

    def run(self, token_id, live: bool, hasher: EngramHasher) -> None:
        st = self.st
        b = st.free_buffer()
        hasher.hash([token_id], None if live else _DEAD, out=st.ids[b])    # checks the id first
        st.next = 1 - b
        st.mask[b][0] = 1 if live else 0
        self.full[b].replay()
        st.done[b].record(self.stream)
        st.done_recorded[b] = True

    def run_prefetched(self) -> None:
        st = self.st
        b = st.pending[0]
        st.pending = None
        st.fetched[b].wait(self.stream)
        self.compute[b].replay()
        st.done[b].record(self.stream)
        st.done_recorded[b] = True
