"""`EngramV41`: the Engram path on the GPU, with device-resident weights and fixed workspaces.

    engine = EngramV41(model, max_tokens=4096, device_tables=True)
    hasher = EngramHasher(model.hash_tables)
    engine.step(prompt_ids, d_highway, hasher)      # hash -> rows -> projection -> gate, all layers
    engine.step([next_id], d_highway, hasher)       # decode: one token, same workspaces

One-token decode through a CUDA graph (all layers; captured once per highway buffer, replayed
per token while the host hashes the next one; `step` with one token does the same on a GPU):
    for token in stream_of_tokens:
        engine.decode(token, d_highway, hasher)     # asynchronous on engine.decode_stream

The projection reads `wkv` in the encoding the file stores it in when there is a kernel for it
(`wkv_format=None`: Q2_K blocks or FP8 codes + tile scales, 6x / 2x smaller than bf16);
`wkv_format="bf16"` decodes it to bf16 once at construction, as before. Device tables go up
through pinned, chunked, overlapped copies; `engine.build_report` says how long that took.

Or stage by stage, for one layer:
    engine.load_rows(1, row_ids)            # [T, C] ids -> rows, wherever the layer's table is placed
    engine.rows_from_ids(1, row_ids)        # [T, C] ids -> gather + decode from the device table
    engine.rows_from_raw(1, raw)            # or raw rows from the host (mmap'd file), decoded here
    engine.rows_from_bf16(1, rows)          # or bf16 rows you made yourself
    engine.apply(1, d_highway, token_mask)  # projection, then gate, in place on [T, hc, dim] fp32

Every method checks its arguments (layer id, dtype, shape, token counts against `max_tokens` and
against the rows loaded for that layer, host vs device arrays) before any copy or launch, so a
refused call leaves device memory exactly as it was. Device arrays from numba, CuPy, PyTorch or
JAX are taken without copies through `__cuda_array_interface__` (or DLPack, via CuPy).

`step` runs the one layer step (`layer_step`) on the engine's stage methods. What the engine
holds on the device and how it is uploaded is in `engine_build`; the decode graphs, which
capture the same per-layer launches, are in `decode_graph`.
"""
from __future__ import annotations

import time

import numpy as np
from numba import cuda

from .config import MAX_HC, check_layer_id
from .device.devarray import as_device_array, data_address, is_device_like
from .device.graphs import CapturedGraph
from .device.intrinsics import SIMULATOR
from .device.upload import Uploader
from .engine_build import (EngramLayerWeights, LayerWorkspace, check_layers, check_versions, pair_buffer,
                           resolve_wkv_format, upload_layers)
from .identity import check_hasher
from .layer_step import EngineStages, LayerStep, Value, run_layers
from .placement import DecodeStaging, fetched_rows, make_fetcher, plan_tables
from .stages.gate.launch import prepare_gate
from .stages.gate.reference import RESIDUALS
from .stages.hash.cpu import EngramHasher
from .stages.proj.launch import prepare_project, prepare_project_q, prepare_wkv_to_bf16
from .stages.proj.records import QUANT_GEMV_MAX_TOKENS
from .stages.rows.encodings import ROW_VALUES
from .stages.rows.launch import prepare_decode, prepare_gather


_DEAD = np.array([False])          # the token mask of a dead decode token


class EngramV41:
    """Device weights, max_tokens workspaces, and the stage methods of the Engram path.

    model: a model from `engram_numba.load_gguf` / `load_model`, or anything with `.config`,
        `.layers` {layer_id: layer} where a layer has `wkv_bf16()`, `q_weight`, `k_weight`,
        `table` (raw rows [rows, row_bytes] uint8) and `table_encoding` (and `table_scales`
        [rows, 8] for fp8 codes [rows, 256] stored apart from their scales), and `.rows(layer_id)`
        for host row reads; for wkv held in its file encoding also `wkv_encoding` (or schema A's
        `wkv_type`), `wkv_raw` (Q2_K: uint8 [N, K/256*84]; FP8: e4m3 codes uint8 [N, K]) and
        `wkv_scales` (FP8: e8m0 uint8 [N/32, K/32]; else None).
    max_tokens: the most tokens one call may carry; workspaces are sized for it once.
    device_tables: upload each layer's table (30 GiB a layer in Q2_K at the released size), so
        rows are gathered on the GPU and never cross PCIe (the same as tables="device").
    tables: where each layer's table lives (engram_numba.placement): "device", "host" (pinned
        mapped host memory, read by the GPU through UVA), "mmap" (CPU reads + upload per call),
        {layer id: placement}, "auto" or "device<=N GB". Checked against free device memory and
        available host memory before anything is allocated (PlacementError). None: device_tables.
    cache_gb: GB of device memory per host-resident table for its hottest rows (a number, or
        {layer id: GB}); fill it with `fill_cache`. Rows of host layers go through the fetcher
        (`prefetch`) when a cache is set or a prefetch was issued, else they are gathered straight
        from host memory.
    cache: the hot-row cache's policy: "static" (the rows `fill_cache` ranks, fixed) or "clock"
        (dynamic: every fetch looks its rows up in a set-associative array and inserts its misses,
        CLOCK replacement; `fill_cache` warm-starts it). Both give the same rows, bit for bit.
    residual: default residual precision, "fp32" (engine) or "bf16" (DeepSeek's reference).
    versions: kernel version per stage by record name, {"rows": "q2k_v4", "proj": "gemm_v2",
        "gate": "gate_v2"} (see `engram_numba.stages.catalog`); a stage not named takes its default.
        A proj version also fixes the weight encoding it reads (wkv_format follows it).
    wkv_format: how `wkv` is held on the device. None: in the file's encoding when the projection
        has kernels for it ("q2k", "fp8"), else bf16; "bf16": decoded to bf16 once, here (the
        bf16-rounded Q2_K weights, exact FP8 ones); "q2k" / "fp8": the file's encoding, or an error
        if the file stores another (nothing is re-quantised).
    graphs: one-token `decode` (and `step` with one token) through a CUDA graph on a GPU.
    """

    def __init__(self, model, max_tokens: int, *, device_tables: bool = False, residual: str = "fp32",
                 stream=0, versions: dict | None = None, wkv_format: str | None = None, graphs: bool = True,
                 tables=None, cache_gb=None, cache: str = "static"):
        from ._argcheck import need_model
        cfg = need_model(model, needs=("config", "layers")).config
        if not 1 <= cfg.hc <= MAX_HC:
            raise ValueError(f"EngramV41 supports hc in 1..={MAX_HC}, the model has hc = {cfg.hc}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
        self.model = model
        self.config = cfg
        self.max_tokens = int(max_tokens)
        self.residual = residual
        self.stream = stream
        self.versions = check_versions(versions)  # stage -> kernel record name
        self.graphs = bool(graphs)
        t_build = time.perf_counter()
        # every layer's wkv format is settled (and refused, if it must be) before anything is uploaded
        wkv_formats = {lid: resolve_wkv_format(self.versions, lid, model.layers[lid], wkv_format) for lid in cfg.layer_ids}
        # ... and so is every table's placement (refused when it cannot fit: nothing allocated yet)
        self.placement = plan_tables(model, self.max_tokens, wkv_formats, tables, device_tables, cache_gb, cache)
        self._fetcher = None
        check_layers(model, cfg, wkv_formats)    # shapes and files: refused before any device allocation
        # two q2k_r layers share one buffer: decode projects both in one launch
        self._wkv_pair = pair_buffer(cfg, wkv_formats)
        uploader = Uploader()
        try:
            self.layers, self._host_tables = upload_layers(model, cfg, self.placement, wkv_formats, self._wkv_pair,
                                                           uploader)
        finally:
            uploader.close()
        self.wkv_format = {lid: lw.wkv_encoding for lid, lw in self.layers.items()}
        self._ws = {lid: LayerWorkspace(self.max_tokens, cfg, self.layers[lid].row_bytes) for lid in cfg.layer_ids}
        if self._host_tables:
            self._fetcher = make_fetcher(self, self.placement)
        self._mask = cuda.device_array(self.max_tokens, dtype=np.uint8)
        # Prepared launches (validated arguments, views, kernel and grid), reused by calls with
        # the same layer, token count and arrays: Python work per decode step stays small.
        self._plans: dict = {}
        self._last_launch: dict = {}   # (stage, layer id) -> the launch last made
        self._wkv_scratch = None       # [N, K] bf16: a q2k/fp8 wkv decoded for many-token calls
        self._scratch_layer = None     # whose wkv the scratch holds
        self._decode_graphs: dict = {}  # highway identity -> DecodeGraph
        self._graph_stream = None
        self._decode_bad = None        # device uint32 [1]: out-of-range row ids the decode graphs met
        self._staging = None           # DecodeStaging: decode graphs' buffers when tables are in host memory
        self._decode_pending = None    # (token id, live, hasher, ids) hashed by prefetch_decode, not yet decoded
        if not SIMULATOR:
            cuda.synchronize()
        self.build_report = {"seconds": round(time.perf_counter() - t_build, 4),
                             "device_tables": all(lw.placement == "device" for lw in self.layers.values()),
                             "tables": {lid: lw.placement for lid, lw in self.layers.items()},
                             "placement": self.placement.as_dict(),
                             "wkv_format": dict(self.wkv_format), **uploader.stats.as_dict()}

    # -- the projection's launch -----------------------------------------------------------------
    def _prepare_projection(self, lw, ws, T: int, stream):
        """The launch of this layer's projection at T tokens on `stream` (what project() runs and
        what the decode graph captures)."""
        x = ws.rows[: T * self.config.n_hash_cols].reshape(T, self.config.proj_in)
        version = self.versions.get("proj")
        if lw.wkv_encoding == "bf16":
            return prepare_project(x, lw.wkv, ws.kv[:T], stream=stream, version=version)
        if T <= QUANT_GEMV_MAX_TOKENS or version is not None:
            return prepare_project_q(x, lw.wkv, lw.wkv_scales, ws.kv[:T], weight=lw.wkv_encoding, stream=stream,
                                     version=version)
        # many tokens: decode the weight to bf16 once (a scratch shared by the layers), then the GEMM
        if self._wkv_scratch is None:
            self._wkv_scratch = cuda.device_array((self.config.proj_out, self.config.proj_in), dtype=np.uint16)
        decode = prepare_wkv_to_bf16(lw.wkv, lw.wkv_scales, self._wkv_scratch, weight=lw.wkv_encoding, stream=stream)
        gemm = prepare_project(x, self._wkv_scratch, ws.kv[:T], stream=stream)
        return _DecodedWeightProjection(self, lw.layer_id, decode, gemm)

    # -- the launches of one layer's step: what the stage methods run and the decode graph captures
    def _gather_launch(self, lw, ws, ids, n: int, stream, bad_count=None):
        """Gather + decode rows `ids` (device int64 [n]) of this layer's table into its workspace."""
        return prepare_gather(lw.table, ids, ws.rows[:n], encoding=lw.encoding, stream=stream,
                              version=self.versions.get("rows"), bad_count=bad_count, scales=lw.table_scales)

    def _decode_launch(self, lw, ws, src, n: int, stream):
        """Decode raw rows `src` (device [n, row_bytes]) into this layer's workspace."""
        return prepare_decode(src, ws.rows[:n], encoding=lw.encoding, stream=stream, version=self.versions.get("rows"))

    def _gate_launch(self, lw, ws, h, kv, mask, residual: str, eps: float, T: int, stream):
        """The gate of T tokens on highway `h` with kv `kv`, dot and gate into this layer's workspace."""
        return prepare_gate(h, kv, lw.w_gate, token_mask=mask, residual=residual, eps=eps, dot_out=ws.dot[:T],
                            gate_out=ws.gate[:T], stream=stream, version=self.versions.get("gate"))

    # -- a queued chunk: the public hooks of a driver that queues chunks ahead of their results
    #    (analysis.device_chunks), so it never reaches into the engine's private state
    def workspace(self, layer_id) -> LayerWorkspace:
        """This layer's device workspace (ids, rows, kv, dot, gate buffers of max_tokens)."""
        return self._layer(layer_id)[1]

    def layer_launches(self, layer_id, n_tokens: int, stream):
        """(gather, projection) launches of this layer for `n_tokens` tokens on `stream`: the gather
        reads the ids in `workspace(layer_id).ids[:n_tokens * n_hash_cols]`; reusable while the
        workspace and the stream stay the same."""
        lw, ws = self._layer(layer_id)
        self._check_tokens(int(n_tokens), "layer_launches")
        n = int(n_tokens) * self.config.n_hash_cols
        return self._gather_launch(lw, ws, ws.ids[:n], n, stream), self._prepare_projection(lw, ws, int(n_tokens), stream)

    def gate_launch(self, layer_id, highway, n_tokens: int, token_mask, residual: str, eps: float, stream):
        """The gate launch of this layer for `n_tokens` tokens of device `highway` (updated in place),
        reading the layer's kv and writing its dot and gate buffers."""
        lw, ws = self._layer(layer_id)
        T = int(n_tokens)
        self._check_tokens(T, "gate_launch")
        return self._gate_launch(lw, ws, highway, ws.kv[:T], token_mask, residual, eps, T, stream)

    @property
    def scratch_layer(self):
        """The layer whose wkv the shared bf16 scratch holds (a q2k/fp8 wkv decoded for many tokens),
        or None: projecting that layer first saves one decode."""
        return self._scratch_layer

    def check_tokens(self, n_tokens: int, what: str) -> None:
        """ValueError unless 1 <= n_tokens <= max_tokens (`what` names the caller in the message)."""
        self._check_tokens(int(n_tokens), what)

    def note_queued(self, layer_id, n_tokens: int, gather, proj, gate) -> None:
        """Record launches a driver queued itself as this layer's last ones (what `last_kernels`,
        `rows_bf16`, `kv` and `last_gate` then describe), as the engine's own calls would."""
        lw, ws = self._layer(layer_id)
        ws.rows_tokens = ws.kv_tokens = ws.gate_tokens = int(n_tokens)
        self._last_launch[("rows", lw.layer_id)] = gather
        self._last_launch[("proj", lw.layer_id)] = proj
        self._last_launch[("gate", lw.layer_id)] = gate

    # -- checks ---------------------------------------------------------------------------------
    def _layer(self, layer_id) -> tuple[EngramLayerWeights, LayerWorkspace]:
        lid = check_layer_id(layer_id, "layer_id")
        if lid not in self.layers:
            raise ValueError(f"layer id {layer_id} is not an engram layer of this model "
                             f"(engram layers: {list(self.config.layer_ids)})")
        return self.layers[lid], self._ws[lid]

    def _check_tokens(self, n_tokens: int, what: str) -> None:
        if n_tokens > self.max_tokens:
            raise ValueError(f"{what}: {n_tokens} tokens exceed this engine's max_tokens = {self.max_tokens} "
                             f"workspace (build EngramV41 with a larger max_tokens)")
        if n_tokens < 1:
            raise ValueError(f"{what}: needs at least one token, got {n_tokens}")

    def _check_rows_shape(self, arr, width: int, dtype, what: str) -> int:
        """[T*C, width] or [T, C, width] -> T (tokens)."""
        C = self.config.n_hash_cols
        shape = tuple(arr.shape)
        if np.dtype(arr.dtype) != np.dtype(dtype):
            raise ValueError(f"{what} must be {np.dtype(dtype)}, got {arr.dtype}")
        if len(shape) == 3 and shape[1:] == (C, width):
            n = shape[0] * C
        elif len(shape) == 2 and shape[1] == width:
            n = shape[0]
        else:
            raise ValueError(f"{what} must be [T*{C}, {width}] or [T, {C}, {width}], got {list(shape)}")
        if n % C:
            raise ValueError(f"{what}: {n} rows is not a whole number of tokens ({C} hash columns each)")
        T = n // C
        self._check_tokens(T, what)
        return T

    # -- rows -------------------------------------------------------------------------------------
    def rows_from_raw(self, layer_id, raw) -> None:
        """Raw rows [T*C, row_bytes] in this layer's table encoding (host, e.g. from the model's
        row reader, or device) -> decoded bf16 rows in this layer's workspace."""
        lw, ws = self._layer(layer_id)
        dev = is_device_like(raw)
        arr = as_device_array(raw, "raw") if dev else np.asarray(raw)
        width = lw.row_bytes
        T = self._check_rows_shape(arr, width, np.uint8, f"rows_from_raw raw ({lw.encoding} rows)")
        n = T * self.config.n_hash_cols
        if dev:
            src = arr.reshape(n, width) if arr.ndim == 3 else arr
        else:
            src = ws.raw[:n]
            src.copy_to_device(np.ascontiguousarray(arr.reshape(n, width)), stream=self.stream)
        launch = self._plan(("decode", lw.layer_id, n, data_address(src)),
                            lambda: self._decode_launch(lw, ws, src, n, self.stream))
        self._last_launch[("rows", lw.layer_id)] = launch
        launch()
        self._loaded(ws, T)

    def rows_from_bf16(self, layer_id, rows) -> None:
        """bf16 rows [T*C, 256] (uint16 words; host or device) -> this layer's workspace."""
        lw, ws = self._layer(layer_id)
        dev = is_device_like(rows)
        arr = as_device_array(rows, "rows") if dev else np.asarray(rows)
        if not dev and arr.dtype.name == "bfloat16":
            arr = arr.view(np.uint16)
        T = self._check_rows_shape(arr, ROW_VALUES, np.uint16, "rows_from_bf16 rows")
        n = T * self.config.n_hash_cols
        if dev:
            src = arr.reshape(n, ROW_VALUES) if arr.ndim == 3 else arr
            ws.rows[:n].copy_to_device(src, stream=self.stream)
        else:
            ws.rows[:n].copy_to_device(np.ascontiguousarray(arr.reshape(n, ROW_VALUES)), stream=self.stream)
        self._loaded(ws, T)

    def rows_from_ids(self, layer_id, row_ids) -> None:
        """Row ids [T, C] (host ints, as `EngramHasher.hash(...)[:, layer_index]` gives) ->
        gather + dequant from the device-resident table. Ids are range-checked on the host first."""
        lw, ws = self._layer(layer_id)
        if lw.table is None:
            raise ValueError(f"rows_from_ids needs layer {lw.layer_id}'s table on the device or in host memory (its "
                             f"placement is {lw.placement!r}): build EngramV41(..., device_tables=True) or tables='host', "
                             f"or read its rows with model.rows(layer_id) and call rows_from_raw")
        if is_device_like(row_ids):
            raise TypeError("rows_from_ids takes host row ids (they are range-checked before upload)")
        ids = np.asarray(row_ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"row_ids must be integers, got {ids.dtype}")
        C = self.config.n_hash_cols
        if ids.ndim != 2 or ids.shape[1] != C:
            raise ValueError(f"row_ids must be [T, {C}], got {list(ids.shape)}")
        T = ids.shape[0]
        self._check_tokens(T, "rows_from_ids")
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        prefetched = None
        if lw.placement == "host" and self._fetcher is not None:
            prefetched = self._fetcher.match(lw.layer_id, flat)    # equal to ids prefetch checked
        if prefetched is None and flat.size and (flat.min() < 0 or flat.max() >= lw.n_rows):
            bad = (flat < 0) | (flat >= lw.n_rows)
            i = int(np.argmax(bad))
            raise ValueError(f"row id {int(flat[i])} (token {i // C}, column {i % C}) is outside layer "
                             f"{lw.layer_id}'s table of {lw.n_rows} rows")
        n = T * C
        if lw.placement == "host" and self._fetcher is not None:
            if fetched_rows(self, lw, ws, flat, T, prefetched):
                return
        ws.ids[:n].copy_to_device(np.ascontiguousarray(flat), stream=self.stream)
        launch = self._plan(("gather", lw.layer_id, n), lambda: self._gather_launch(lw, ws, ws.ids[:n], n, self.stream))
        self._last_launch[("rows", lw.layer_id)] = launch
        launch()
        self._loaded(ws, T)

    def load_rows(self, layer_id, row_ids) -> None:
        """Row ids [T, C] -> this layer's rows, wherever its table lives: gathered on the device
        from a device or host-resident table (`rows_from_ids`), or read from the memory-mapped file
        on the host and decoded here (`rows_from_raw`)."""
        lw, _ = self._layer(layer_id)
        if lw.table is not None:
            self.rows_from_ids(lw.layer_id, row_ids)
        else:
            self.rows_from_raw(lw.layer_id, self.model.rows(lw.layer_id).read(np.asarray(row_ids)))

    # -- host-resident tables: prefetch and the hot-row cache -------------------------------------
    @property
    def host_layers(self) -> list:
        """Layer ids whose tables live in pinned host memory."""
        return [lid for lid, lw in self.layers.items() if lw.placement == "host"]

    def prefetch(self, row_ids) -> bool:
        """Start fetching the host layers' rows for `row_ids` [T, layers, C] (`EngramHasher.hash`)
        on side streams (one a layer), into the next of three device buffers; a later
        `rows_from_ids` (or `step`, or `Pipeline.gates_from_ids`) with the same ids decodes from
        that buffer instead of reading host memory then. Call it for chunks k+1 and k+2 before
        computing chunk k. Ids are range-checked first. Returns False when no layer's table is in host memory (nothing to do)."""
        if self._fetcher is None:
            return False
        if is_device_like(row_ids):
            raise TypeError("prefetch takes host row ids [T, layers, C]")
        ids = np.asarray(row_ids)
        cfg = self.config
        L, C = len(cfg.layer_ids), cfg.n_hash_cols
        if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 3 or ids.shape[1:] != (L, C):
            raise ValueError(f"prefetch: row_ids must be integers [T, {L}, {C}], got {ids.dtype}{list(ids.shape)}")
        self._check_tokens(ids.shape[0], "prefetch")
        by_layer = {}
        for li, lid in enumerate(cfg.layer_ids):
            if self.layers[lid].placement != "host":
                continue
            lay = ids[:, li, :]                        # [T, C]: copied once, into the fetcher's pinned buffer
            if lay.size and (lay.min() < 0 or lay.max() >= self.layers[lid].n_rows):
                flat = lay.reshape(-1)
                i = int(np.argmax((flat < 0) | (flat >= self.layers[lid].n_rows)))
                raise ValueError(f"prefetch: row id {int(flat[i])} (token {i // C}, column {i % C}) is outside "
                                 f"layer {lid}'s table of {self.layers[lid].n_rows} rows")
            by_layer[lid] = lay
        self._fetcher.issue(by_layer)
        return True

    def fill_cache(self, layer_id, row_ids, *, ranked: bool = False) -> int:
        """Fill host layer `layer_id`'s hot-row cache with the rows `row_ids` reads most often (any
        shape, e.g. a sample corpus's ids of this layer; ranked=True: already most-wanted first).
        Returns the rows held (at most the cache's slots)."""
        from .device.hostrows import rank_rows
        lw, _ = self._layer(layer_id)
        cache = self._cache_of(lw)
        order = np.asarray(row_ids, dtype=np.int64).reshape(-1) if ranked else rank_rows(row_ids, lw.n_rows)
        held = self._host_tables[lw.layer_id]

        def read(rows):
            parts = [h.rows(rows) for h in held]
            return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return cache.fill(order, read)

    def set_cache(self, cache_gb, cache: str = "static") -> dict:
        """New (empty) hot-row caches for the host layers: cache_gb GB each (or {layer id: GB}; 0:
        none), policy `cache` ("static" or "clock"), e.g. to sweep budgets and policies without
        pinning the tables again. Checked against free device memory first. Returns {layer id:
        slots}."""
        from .placement import replace_caches
        return replace_caches(self, cache_gb, cache)

    def cache_report(self, layer_id=None) -> dict:
        """Hits, misses and bytes moved per fetch of each host layer's cache ({layer id: report}),
        and the fetcher's prefetch counts. Synchronises."""
        if self._fetcher is None:
            return {}
        f = self._fetcher
        lids = self.host_layers if layer_id is None else [self._layer(layer_id)[0].layer_id]
        out = {lid: f.layers[lid].cache.report() for lid in lids}
        out["prefetch"] = {"issued": f.issued, "taken": f.taken, "missed": f.missed}
        return out

    def _cache_of(self, lw):
        if lw.placement != "host" or self._fetcher is None:
            raise ValueError(f"layer {lw.layer_id}'s table is placed {lw.placement!r}: a hot-row cache is for "
                             f"host-resident tables (tables={{{lw.layer_id}: 'host'}})")
        cache = self._fetcher.layers[lw.layer_id].cache
        if not cache.n_slots:
            raise ValueError(f"layer {lw.layer_id} has no cache: build EngramV41(..., cache_gb=...) with a budget")
        return cache

    def _plan(self, key, make):
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 256:          # many distinct highways: forget the oldest
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = make()
        return plan

    @staticmethod
    def _loaded(ws: LayerWorkspace, T: int) -> None:
        ws.rows_tokens, ws.kv_tokens, ws.gate_tokens = T, 0, 0

    # -- projection and gate --------------------------------------------------------------------
    def project(self, layer_id):
        """kv = bf16(rows @ wkv^T) for the loaded rows -> device view [T, (hc+1)*dim] uint16."""
        lw, ws = self._layer(layer_id)
        T = ws.rows_tokens
        if T == 0:
            raise ValueError(f"layer {lw.layer_id}: no rows loaded (call rows_from_ids / rows_from_raw / rows_from_bf16 first)")
        plan = self._plan(("proj", lw.layer_id, T), lambda: self._prepare_projection(lw, ws, T, self.stream))
        ws.kv_tokens = T
        self._last_launch[("proj", lw.layer_id)] = plan
        return plan()

    def gate(self, layer_id, highway, token_mask=None, *, residual: str | None = None, eps: float | None = None,
             kv=None):
        """The gate and highway update in place on `highway` [T, hc, dim] fp32 (device), using
        this layer's projected kv (or `kv` [T, (hc+1)*dim] bf16 words, device, if given)."""
        lw, ws = self._layer(layer_id)
        cfg = self.config
        residual = self.residual if residual is None else residual
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
        h = as_device_array(highway, "highway")
        if h.dtype != np.float32:
            raise ValueError(f"highway must be float32, got {h.dtype}")
        if h.ndim != 3 or tuple(h.shape[1:]) != (cfg.hc, cfg.dim):
            raise ValueError(f"highway must be [T, hc={cfg.hc}, dim={cfg.dim}], got {list(h.shape)}")
        T = int(h.shape[0])
        self._check_tokens(T, "gate highway")
        if kv is None:
            if ws.kv_tokens != T:
                have = ws.kv_tokens or ws.rows_tokens
                raise ValueError(f"layer {lw.layer_id}: highway has {T} tokens but the rows loaded for this "
                                 f"layer cover {have} tokens")
            kv_dev = ws.kv[:T]
        else:
            kv_dev = as_device_array(kv, "kv")
            if kv_dev.dtype != np.uint16 or tuple(kv_dev.shape) != (T, cfg.proj_out):
                raise ValueError(f"kv must be uint16 [T={T}, {cfg.proj_out}], got {kv_dev.dtype}{list(kv_dev.shape)}")
        mask_dev = None
        if token_mask is not None:
            if is_device_like(token_mask):
                mask_dev = as_device_array(token_mask, "token_mask")
                if tuple(mask_dev.shape) != (T,) or mask_dev.dtype not in (np.uint8, np.bool_):
                    raise ValueError(f"token_mask must be uint8/bool [{T}], got {mask_dev.dtype}{list(mask_dev.shape)}")
            else:
                m = np.asarray(token_mask)
                if m.shape != (T,):
                    raise ValueError(f"token_mask must have shape ({T},), got {m.shape}")
                if m.dtype != np.bool_:
                    raise ValueError(f"token_mask must be bool (True = live token), got {m.dtype}")
                mask_dev = self._mask[:T]
                mask_dev.copy_to_device(m.astype(np.uint8), stream=self.stream)
        eps = cfg.eps if eps is None else float(eps)
        key = ("gate", lw.layer_id, T, data_address(h), tuple(h.strides),
               None if kv is None else (data_address(kv_dev), tuple(kv_dev.strides)),
               None if mask_dev is None else (data_address(mask_dev), tuple(mask_dev.strides), str(mask_dev.dtype)),
               residual, eps)
        plan = self._plan(key, lambda: self._gate_launch(lw, ws, h, kv_dev, mask_dev, residual, eps, T, self.stream))
        self._last_launch[("gate", lw.layer_id)] = plan
        plan()
        ws.gate_tokens = T
        return highway

    def apply(self, layer_id, highway, token_mask=None, *, residual: str | None = None):
        """Projection, then gate, in place on the device highway [T, hc, dim] fp32."""
        lw, ws = self._layer(layer_id)
        h = as_device_array(highway, "highway")
        T = int(h.shape[0]) if h.ndim >= 1 else -1
        if ws.rows_tokens == 0:
            raise ValueError(f"layer {lw.layer_id}: no rows loaded (call rows_from_ids / rows_from_raw / rows_from_bf16 first)")
        if T != ws.rows_tokens:
            raise ValueError(f"layer {lw.layer_id}: highway has {T} tokens but the rows loaded for this layer "
                             f"cover {ws.rows_tokens} tokens")
        self._check_tokens(T, "apply highway")
        self._check_gate_args(h, T, token_mask, residual)
        self.project(layer_id)
        return self.gate(layer_id, h, token_mask, residual=residual)

    def _check_gate_args(self, h, T: int, token_mask, residual) -> None:
        """The gate's arguments, checked before the rows or projection write anything."""
        if h.dtype != np.float32 or h.ndim != 3 or tuple(h.shape[1:]) != (self.config.hc, self.config.dim):
            raise ValueError(f"highway must be float32 [T, hc={self.config.hc}, dim={self.config.dim}], "
                             f"got {h.dtype}{list(h.shape)}")
        if token_mask is not None:
            if is_device_like(token_mask):
                m = as_device_array(token_mask, "token_mask")
                if tuple(m.shape) != (T,) or m.dtype not in (np.uint8, np.bool_):
                    raise ValueError(f"token_mask must be uint8/bool [{T}], got {m.dtype}{list(m.shape)}")
            else:
                m = np.asarray(token_mask)
                if m.shape != (T,) or m.dtype != np.bool_:
                    raise ValueError(f"token_mask must be bool of shape ({T},), got {m.dtype}{list(m.shape)}")
        residual = self.residual if residual is None else residual
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")

    def capture_apply(self, layer_id, highway, token_mask=None, *, residual: str | None = None) -> CapturedGraph:
        """Record this layer's projection + gate on `highway` into a CUDA graph (one-token decode).

        Runs `apply` once (which also warms the kernels), then captures the same two launches on
        the engine's stream; `replay()` relaunches them for ~one graph launch of host time instead
        of two numba launches. The graph reads whatever rows are loaded in this layer's
        workspace when it replays (load the next token's rows with rows_from_* first, same token
        count) and updates the same `highway` memory. A host token_mask cannot be captured (its
        upload is a copy): pass None or a device mask whose contents you update.
        Needs a real GPU and a non-default stream: EngramV41(..., stream=numba.cuda.stream()).
        """
        from numba.cuda import config
        if config.ENABLE_CUDASIM:
            raise RuntimeError("CUDA graphs need a real GPU (numba's simulator has none)")
        if not self.stream or not int(getattr(self.stream, "handle", 0) or 0):
            raise ValueError("capture_apply needs a non-default stream: EngramV41(..., stream=numba.cuda.stream())")
        if token_mask is not None and not is_device_like(token_mask):
            raise ValueError("capture_apply takes token_mask=None or a device mask (a host mask's upload "
                             "cannot be replayed)")
        lw, _ = self._layer(layer_id)
        self.apply(layer_id, highway, token_mask, residual=residual)
        self.stream.synchronize()
        launches = (self._last_launch[("proj", lw.layer_id)], self._last_launch[("gate", lw.layer_id)])
        return CapturedGraph(self.stream, launches, n_tokens=self._ws[lw.layer_id].rows_tokens)

    def step(self, token_ids, highway, hasher: EngramHasher, token_mask=None, *, residual: str | None = None,
             graph: bool | None = None):
        """hash -> rows -> projection -> gate for every engram layer, in model order, in place.

        graph: None (default) replays the one-token decode graph (`decode`) when there is one token
        and graphs are available (a GPU; EngramV41(graphs=True)); False always launches the
        kernels one by one; True insists on the graph."""
        check_hasher(hasher, self.model.hash_tables)
        if graph is None:
            graph = self.graphs_available and len(token_ids) == 1
        if graph:
            if len(token_ids) != 1:
                raise ValueError(f"graph=True replays the one-token decode graph: pass one token, got {len(token_ids)}")
            live = None
            if token_mask is not None:
                m = np.asarray(token_mask)
                if m.shape != (1,) or m.dtype != np.bool_:
                    raise ValueError(f"token_mask must be bool of shape (1,), got {m.dtype}{list(m.shape)}")
                live = bool(m[0])
            return self.decode(token_ids[0], highway, hasher, live, residual=residual)
        h = as_device_array(highway, "highway")
        T = len(token_ids)
        self._check_tokens(T, "step")
        if h.ndim != 3 or int(h.shape[0]) != T:
            raise ValueError(f"highway must be [T={T}, hc, dim], got {list(h.shape)}")
        self._check_gate_args(h, T, token_mask, residual)
        if self._decode_pending is not None:
            raise ValueError(f"step: token {self._decode_pending[0]} was hashed by prefetch_decode and not yet "
                             f"decoded: call decode with it first")
        ids = hasher.hash(token_ids, token_mask)             # [T, L, C] (checks the token ids)
        return self._step_ids(ids, highway, h, token_mask, residual)

    def _step_ids(self, ids, highway, h, token_mask, residual):
        step = LayerStep(EngineStages(lambda n: self, self.config), self.config, residual, None)
        run_layers(step, self.layers, ids, Value(device=h), token_mask)
        return highway

    # -- one-token decode through a CUDA graph ------------------------------------------------
    @property
    def graphs_available(self) -> bool:
        """True where `decode` replays a CUDA graph (a real GPU and graphs=True)."""
        return self.graphs and not SIMULATOR

    @property
    def decode_stream(self):
        """The stream decode graphs replay on: the engine's stream when it is a real one, else one
        of its own (a blocking stream, so work on the legacy default stream stays ordered with it).
        Synchronise it (or the device) before reading a highway that decode wrote."""
        if self._graph_stream is None:
            own = self.stream if self.stream and int(getattr(self.stream, "handle", 0) or 0) else None
            self._graph_stream = own if own is not None else cuda.stream()
        return self._graph_stream

    def decode(self, token_id, highway, hasher: EngramHasher, token_mask=None, *, residual: str | None = None):
        """One decode token: hash -> rows -> projection -> gate of every engram layer, in place on
        `highway` [1, hc, dim] fp32 (device), equal bit for bit to `step([token_id], ...,
        graph=False)`.

        On a GPU the layers' launches and the row-id upload are one CUDA graph, captured the first
        time a highway buffer is seen and replayed per token on `decode_stream`: decode returns as
        soon as the replay is queued, so the host hashes the next token while this one runs. The
        ids go up from one of two pinned buffers (the hasher writes straight into it; decode waits
        for the replay that last read a buffer before writing it again). A bad token id is refused
        by the hasher before anything is written. What invalidates a graph: another highway buffer
        (a new device address: a new graph is captured automatically, the last 4 are kept), another
        residual; a new max_tokens or layer set is a new engine. In numba's simulator there are no
        graphs: decode runs the kernels one by one.

        token_mask: None or a bool (False: a dead token, as in `step`)."""
        live = True
        if token_mask is not None:
            m = np.asarray(token_mask)
            if m.dtype != np.bool_ or m.size != 1:
                raise ValueError(f"token_mask must be a bool (or bool array of one element), got {m.dtype}{list(m.shape)}")
            live = bool(m.reshape(-1)[0])
        check_hasher(hasher, self.model.hash_tables)
        pending = self._decode_pending
        if pending is not None and (pending[0] != int(token_id) or pending[1] != live or pending[2] is not hasher):
            raise ValueError(f"decode(token {token_id}{'' if live else ', dead'}) after prefetch_decode(token "
                             f"{pending[0]}{'' if pending[1] else ', dead'}{'' if pending[2] is hasher else ', another hasher'}): "
                             f"that hasher already holds token {pending[0]}; decode it next")
        if not self.graphs_available:
            if pending is None:
                return self.step([token_id], highway, hasher, None if token_mask is None else np.array([live]),
                                 residual=residual, graph=False)
            h = as_device_array(highway, "highway")
            if h.ndim != 3 or int(h.shape[0]) != 1:
                raise ValueError(f"highway must be [T=1, hc, dim], got {list(h.shape)}")
            self._decode_pending = None
            return self._step_ids(pending[3], highway, h, None if live else _DEAD, residual)
        residual = self.residual if residual is None else residual
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
        h = as_device_array(highway, "highway")
        cfg = self.config
        if h.dtype != np.float32 or tuple(h.shape) != (1, cfg.hc, cfg.dim):
            raise ValueError(f"decode's highway must be float32 [1, hc={cfg.hc}, dim={cfg.dim}], got {h.dtype}{list(h.shape)}")
        key = (data_address(h), tuple(h.strides), residual)
        graph = self._decode_graphs.get(key)
        if graph is None:
            graph = self._new_decode_graph(key, h, residual)
        self._decode_pending = None
        if pending is not None:
            graph.run_prefetched()
        else:
            graph.run(token_id, live, hasher)
        for ws in self._ws.values():
            ws.rows_tokens = ws.kv_tokens = ws.gate_tokens = 1
        return highway

    def prefetch_decode(self, token_id, hasher: EngramHasher, token_mask=None) -> bool:
        """Hash the next decode token now and start fetching its host-table rows on a side stream,
        so the `decode` of that token (which must come next, with the same hasher) reads them from
        device memory: call it as soon as the token is sampled, before the model's layers that
        come ahead of the first engram layer run. Returns False (and hashes nothing) when no table
        is in host memory, or one is left in the memory map: decode then works as before.
        token_mask: None or a bool (False: a dead token)."""
        live = True
        if token_mask is not None:
            m = np.asarray(token_mask)
            if m.dtype != np.bool_ or m.size != 1:
                raise ValueError(f"token_mask must be a bool (or bool array of one element), got {m.dtype}{list(m.shape)}")
            live = bool(m.reshape(-1)[0])
        check_hasher(hasher, self.model.hash_tables)
        if not self.host_layers or any(lw.placement == "mmap" for lw in self.layers.values()):
            return False
        if self._decode_pending is not None:
            raise ValueError(f"prefetch_decode: token {self._decode_pending[0]} was prefetched and not yet decoded")
        if self.graphs_available:
            if self._decode_bad is None:
                self._decode_bad = cuda.to_device(np.zeros(1, np.uint32))
            if self._staging is None:
                self._staging = DecodeStaging(self)
            self._staging.prefetch(token_id, live, hasher)
            self._decode_pending = (int(token_id), live, hasher, None)
            return True
        ids = hasher.hash([token_id], None if live else _DEAD)        # checks the id first
        self.prefetch(ids)
        self._decode_pending = (int(token_id), live, hasher, ids)
        return True

    def _new_decode_graph(self, key, h, residual):
        from .decode_graph import DecodeGraph, HostDecodeGraph
        if len(self._decode_graphs) >= 4:             # keep the last few highways' graphs
            self.decode_stream.synchronize()          # nothing of the dropped graph may be in flight
            self._decode_graphs.pop(next(iter(self._decode_graphs)))
        if self._decode_bad is None:
            self._decode_bad = cuda.to_device(np.zeros(1, np.uint32))
        if self.host_layers and not any(lw.placement == "mmap" for lw in self.layers.values()):
            if self._staging is None:
                self._staging = DecodeStaging(self)
            graph = self._decode_graphs[key] = HostDecodeGraph(self, h, residual)
        else:
            graph = self._decode_graphs[key] = DecodeGraph(self, h, residual)
        return graph

    def decode_bad_ids(self) -> int:
        """Row ids outside their table that decode graphs have met so far (0 unless the hash tables
        and the tables disagree); synchronises."""
        if self._decode_bad is None:
            return 0
        self.decode_stream.synchronize()
        return int(self._decode_bad.copy_to_host()[0])

    # -- what the last calls produced -----------------------------------------------------------
    def last_kernels(self) -> dict:
        """{stage: kernel record name} of the launches last made (any layer)."""
        out = {}
        for (stage, _), launch in self._last_launch.items():
            out[stage] = launch.name
        return out

    def rows_bf16(self, layer_id):
        """Device view of the loaded rows [T*C, 256] uint16."""
        lw, ws = self._layer(layer_id)
        return ws.rows[: ws.rows_tokens * self.config.n_hash_cols]

    def kv(self, layer_id):
        """Device view of the last projection [T, N] uint16."""
        lw, ws = self._layer(layer_id)
        return ws.kv[: ws.kv_tokens]

    def last_gate(self, layer_id):
        """Device views (dot [T, hc], gate [T, hc]) fp32 of the last gate call."""
        lw, ws = self._layer(layer_id)
        return ws.dot[: ws.gate_tokens], ws.gate[: ws.gate_tokens]

    @property
    def device_bytes(self) -> int:
        ws = sum(sum(int(a.nbytes) for a in (w.raw, w.ids, w.rows, w.kv, w.dot, w.gate)) for w in self._ws.values())
        scratch = int(self._wkv_scratch.nbytes) if self._wkv_scratch is not None else 0
        fetch = 0
        if self._fetcher is not None:
            fetch = self._fetcher.device_bytes + sum(h.cache.device_bytes for h in self._fetcher.layers.values())
        return ws + sum(lw.nbytes for lw in self.layers.values()) + int(self._mask.nbytes) + scratch + fetch

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes of the host-resident tables."""
        return sum(h.nbytes for held in self._host_tables.values() for h in held)


class _DecodedWeightProjection:
    """The projection of many tokens on a q2k/fp8 wkv: decode the weight to bf16 into the engine's
    scratch (skipped when the scratch already holds this layer's), then the bf16 GEMM."""

    __slots__ = ("name", "engine", "layer_id", "decode", "gemm", "out")

    def __init__(self, engine, layer_id, decode, gemm):
        self.engine, self.layer_id, self.decode, self.gemm = engine, layer_id, decode, gemm
        self.name = f"{decode.name}+{gemm.name}"
        self.out = gemm.out

    def __call__(self):
        if self.engine._scratch_layer != self.layer_id:
            self.decode()
            self.engine._scratch_layer = self.layer_id
        return self.gemm()
