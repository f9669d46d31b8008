"""Where each engram layer's table lives, decided (and refused) before anything is allocated.

    EngramV41(model, 4096, tables="device")                 # every table uploaded (= device_tables=True)
    EngramV41(model, 4096, tables={1: "device", 14: "host"})
    EngramV41(model, 4096, tables="device<=100GB")          # device while the tables fit in 100 GB, then host
    EngramV41(model, 4096, tables="auto")                   # device while it fits, then host, then mmap
    EngramV41(model, 4096, tables="host", cache_gb=8)       # host tables, 8 GB of hot rows on the device each

Placements:
  device  the table is uploaded; rows are gathered on the GPU (4 G rows/s from HBM).
  host    the table is copied into pinned, mapped host memory; kernels read it through UVA
          (zero-copy, ~43 M scattered rows/s on an H200), a chunk ahead on a side stream when the
          caller prefetches (`EngramV41.prefetch`, done by `corpus_stats`), through an optional
          device cache of hot rows (`cache_gb`). See engram_numba/device/hostrows.py.
  mmap    the table stays in the file's memory map: the CPU reads the rows and uploads them per
          call (nothing pinned, nothing on the device; the slowest, and the only choice when the
          table fits neither).

`plan_placement` sizes everything a choice needs (tables, caches, and the engine's weights and
workspaces, estimated) against the free device memory and the host memory the kernel reports
available (MemAvailable), and raises `PlacementError` naming the layer and the numbers when a
choice cannot fit: the engine calls it before its first allocation, so a refusal leaves nothing
allocated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

PLACEMENTS = ("device", "host", "mmap")
DEVICE_RESERVE = 512 << 20        # left free on the device (the CUDA context's own needs, kernels' stacks)
HOST_RESERVE = 4 << 30            # left to the OS and the process when pinning host tables
_UNTIL = re.compile(r"^\s*device\s*<=\s*([0-9]*\.?[0-9]+)\s*(gb|gib)?\s*$", re.IGNORECASE)


class PlacementError(ValueError):
    """A table placement that cannot be honoured (does not fit, or is not a placement)."""


def device_free_bytes():
    """Free device memory in bytes, or None where it is unknown (numba's simulator)."""
    from numba import cuda
    from numba.cuda import config
    if config.ENABLE_CUDASIM:
        return None
    free, _ = cuda.current_context().get_memory_info()
    return int(free)


def host_available_bytes():
    """Host memory the kernel says is available (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class LayerPlacement:
    layer_id: int
    placement: str
    table_bytes: int          # the table (and its separate scales), wherever it lives
    cache_bytes: int = 0      # device bytes of its hot-row cache (rows + remap), host tables only
    cache_budget_bytes: int = 0


@dataclass
class PlacementPlan:
    layers: dict = field(default_factory=dict)     # layer id -> LayerPlacement
    other_device_bytes: int = 0                    # weights, workspaces, fetch buffers (estimated)
    device_free: int | None = None
    host_available: int | None = None
    policy: str = ""
    cache_policy: str = "static"                   # the hot-row caches': "static" or "clock"

    @property
    def device_bytes(self) -> int:
        return self.other_device_bytes + sum(lp.cache_bytes + (lp.table_bytes if lp.placement == "device" else 0)
                                             for lp in self.layers.values())

    @property
    def host_pinned_bytes(self) -> int:
        return sum(lp.table_bytes for lp in self.layers.values() if lp.placement == "host")

    @property
    def kind(self) -> str:
        """"device", "host", "mmap" when every layer agrees, else "mixed" (the bench records' field)."""
        kinds = {lp.placement for lp in self.layers.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def as_dict(self) -> dict:
        gb = lambda b: round(b / 1e9, 3)  # noqa: E731
        return {"policy": self.policy, "tables": {lid: lp.placement for lid, lp in self.layers.items()},
                "kind": self.kind, "table_gb": {lid: gb(lp.table_bytes) for lid, lp in self.layers.items()},
                "cache_gb": {lid: gb(lp.cache_budget_bytes) for lid, lp in self.layers.items() if lp.cache_budget_bytes},
                "cache": self.cache_policy,
                "device_gb_planned": gb(self.device_bytes), "host_pinned_gb": gb(self.host_pinned_bytes),
                "device_free_gb": None if self.device_free is None else gb(self.device_free),
                "host_available_gb": None if self.host_available is None else gb(self.host_available)}


def _check_placement(value, where: str) -> str:
    if value not in PLACEMENTS:
        raise PlacementError(f"{where}: a table placement is one of {PLACEMENTS}, got {value!r}")
    return value


def _cache_budgets(cache_gb, layer_ids) -> dict:
    if cache_gb is None:
        return {lid: 0 for lid in layer_ids}
    if isinstance(cache_gb, dict):
        unknown = set(cache_gb) - set(layer_ids)
        if unknown:
            raise PlacementError(f"cache_gb names layer(s) {sorted(unknown)}, engram layers are {list(layer_ids)}")
        vals = {lid: cache_gb.get(lid, 0) for lid in layer_ids}
    else:
        vals = {lid: cache_gb for lid in layer_ids}
    out = {}
    for lid, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v) or v < 0:
            raise PlacementError(f"cache_gb for layer {lid} must be a number >= 0 (GB), got {v!r}")
        out[lid] = int(round(float(v) * 1e9))
    return out


def plan_placement(sizes: dict, tables=None, *, device_tables: bool = False, cache_gb=None,
                   other_device_bytes: int = 0, row_bytes: dict | None = None, n_rows: dict | None = None,
                   device_free=None, host_available=None, cache: str = "static") -> PlacementPlan:
    """Decide each layer's placement (module doc) or raise PlacementError.

    sizes: {layer id: table bytes (with separate scales)}, in model order; tables: None (then
    device_tables picks "device" or "mmap"), a placement for every layer, {layer id: placement}
    (layers not named take the device_tables default), "auto", "device<=N GB", or a callable
    (layer id, table bytes, device bytes planned so far) -> placement. cache_gb: GB of hot rows
    per host layer (a number, or {layer id: GB}); cache: their policy, "static" or "clock"
    (`engram_numba.device.hostrows`). other_device_bytes: what the engine allocates
    besides tables and caches. device_free / host_available: the limits (default: measured)."""
    from .device.hostrows import CACHE_POLICIES, ClockCache, RowCache
    if cache not in CACHE_POLICIES:
        raise PlacementError(f"cache must be one of {CACHE_POLICIES}, got {cache!r}")
    layer_ids = list(sizes)
    default = "device" if device_tables else "mmap"
    if device_free is None:
        device_free = device_free_bytes()
    if host_available is None:
        host_available = host_available_bytes()
    dev_cap = None if device_free is None else max(0, int(device_free) - DEVICE_RESERVE)
    host_cap = None if host_available is None else max(0, int(host_available) - HOST_RESERVE)
    budgets = _cache_budgets(cache_gb, layer_ids)

    def cache_dev(lid):
        if not budgets[lid]:
            return 0
        return (ClockCache if cache == "clock" else RowCache).device_bytes_for(n_rows[lid], row_bytes[lid], budgets[lid])

    policy = "device_tables=True" if tables is None and device_tables else repr(tables)
    if tables is None:
        choose = lambda lid, nb, planned: default  # noqa: E731
    elif isinstance(tables, str) and tables in PLACEMENTS:
        choose = lambda lid, nb, planned: tables  # noqa: E731
    elif isinstance(tables, str) and tables == "auto":
        def choose(lid, nb, planned):
            if dev_cap is None or planned + nb + cache_dev(lid) <= dev_cap:
                return "device"
            host_used = sum(p.table_bytes for p in plan.layers.values() if p.placement == "host")
            if host_cap is None or host_used + nb <= host_cap:
                return "host"
            return "mmap"
    elif isinstance(tables, str) and _UNTIL.match(tables):
        m = _UNTIL.match(tables)
        limit = float(m.group(1)) * (2 ** 30 if (m.group(2) or "").lower() == "gib" else 1e9)

        def choose(lid, nb, planned):
            used = sum(p.table_bytes for p in plan.layers.values() if p.placement == "device")
            return "device" if used + nb <= limit else "host"
    elif isinstance(tables, dict):
        unknown = set(tables) - set(layer_ids)
        if unknown:
            raise PlacementError(f"tables names layer(s) {sorted(unknown)}, engram layers are {layer_ids}")
        for lid, v in tables.items():
            _check_placement(v, f"tables[{lid}]")
        choose = lambda lid, nb, planned: tables.get(lid, default)  # noqa: E731
    elif callable(tables):
        choose = tables
        policy = getattr(tables, "__name__", "callable")
    else:
        raise PlacementError(f"tables must be None, one of {PLACEMENTS}, 'auto', 'device<=N GB', a dict "
                             f"{{layer id: placement}} or a callable, got {tables!r}")

    plan = PlacementPlan(other_device_bytes=int(other_device_bytes), device_free=device_free,
                         host_available=host_available, policy=policy, cache_policy=cache)
    for lid in layer_ids:
        nb = int(sizes[lid])
        p = _check_placement(choose(lid, nb, plan.device_bytes), f"layer {lid}")
        if budgets[lid] and p != "host":
            raise PlacementError(f"layer {lid}: cache_gb is for host-resident tables, but its table is placed "
                                 f"on {p!r} (give a cache budget only to host layers: cache_gb={{layer id: GB}})")
        plan.layers[lid] = LayerPlacement(lid, p, nb, cache_dev(lid) if p == "host" else 0,
                                          budgets[lid] if p == "host" else 0)
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    if dev_cap is not None and plan.device_bytes > dev_cap:
        parts = [f"layer {lid} table {gb(lp.table_bytes)}" for lid, lp in plan.layers.items() if lp.placement == "device"]
        parts += [f"layer {lid} cache {gb(lp.cache_bytes)}" for lid, lp in plan.layers.items() if lp.cache_bytes]
        parts.append(f"weights and workspaces {gb(plan.other_device_bytes)}")
        raise PlacementError(f"tables do not fit on the device: the plan needs {gb(plan.device_bytes)} "
                             f"({', '.join(parts)}), the device has {gb(device_free)} free "
                             f"({gb(DEVICE_RESERVE)} kept back); place a table in host memory "
                             f"(tables={{layer id: 'host'}}), use tables='auto', or a smaller cache_gb")
    if host_cap is not None and plan.host_pinned_bytes > host_cap:
        parts = [f"layer {lid} {gb(lp.table_bytes)}" for lid, lp in plan.layers.items() if lp.placement == "host"]
        raise PlacementError(f"host tables do not fit in pinnable host memory: {gb(plan.host_pinned_bytes)} "
                             f"({', '.join(parts)}) against {gb(host_available)} available "
                             f"({gb(HOST_RESERVE)} kept back); leave a table in the memory map (tables={{layer id: "
                             f"'mmap'}}) or on the device")
    return plan


# -- what EngramV41 calls (kept here so the engine only names the steps) ---------------------------
def _wkv_bytes(cfg, fmt: str) -> int:
    N, K = cfg.proj_out, cfg.proj_in
    if fmt in ("q2k", "q2k_r"):                # q2k_r: the same bytes re-laid out (rows padded to 16)
        return (-(-N // 16) * 16) * (K // 256) * 84
    if fmt == "fp8":
        return N * K + (-(-N // 32)) * (K // 32)
    return N * K * 2


def engine_device_estimate(cfg, max_tokens: int, wkv_formats: dict, row_bytes: dict, host_layers) -> int:
    """Device bytes an EngramV41 allocates besides its tables and caches (weights, workspaces,
    the scratch of a decoded wkv, the fetch buffers of host layers): an estimate for the plan."""
    from .stages.proj.records import QUANT_GEMV_MAX_TOKENS
    C, T, N = cfg.n_hash_cols, int(max_tokens), cfg.proj_out
    total = T
    for lid, fmt in wkv_formats.items():
        total += _wkv_bytes(cfg, fmt) + 4 * cfg.hc * cfg.dim
        total += T * C * (row_bytes[lid] + 8 + 512) + T * N * 2 + 2 * T * cfg.hc * 4
    if any(f != "bf16" for f in wkv_formats.values()) and T > QUANT_GEMV_MAX_TOKENS:
        total += N * cfg.proj_in * 2
    from .device.hostrows import N_BUFFERS
    for lid in host_layers:
        total += N_BUFFERS * T * C * (row_bytes[lid] + 8)
    return int(total)


def plan_tables(model, max_tokens: int, wkv_formats: dict, tables, device_tables: bool, cache_gb,
                cache: str = "static") -> PlacementPlan:
    """The engine's placement plan (raises PlacementError before anything is allocated)."""
    from .stages.rows.encodings import get_encoding
    cfg = model.config
    sizes, rbytes, nrows = {}, {}, {}
    for lid in cfg.layer_ids:
        lf = model.layers[lid]
        t = lf.table
        scales = getattr(lf, "table_scales", None)
        sizes[lid] = int(t.shape[0]) * int(t.shape[1]) + (0 if scales is None else int(np.prod(scales.shape)))
        rbytes[lid] = get_encoding(getattr(lf, "table_encoding", "q2k")).row_bytes
        nrows[lid] = int(t.shape[0])
    # the fetch buffers depend on which layers go to host memory: plan once to learn it, then again
    # with the full estimate (the second plan is the one checked against the limits)
    first = plan_placement(sizes, tables, device_tables=device_tables, cache_gb=cache_gb, row_bytes=rbytes,
                           n_rows=nrows, device_free=1 << 62, host_available=1 << 62, cache=cache)
    hosts = [lid for lid, lp in first.layers.items() if lp.placement == "host"]
    other = engine_device_estimate(cfg, max_tokens, wkv_formats, rbytes, hosts)
    return plan_placement(sizes, tables, device_tables=device_tables, cache_gb=cache_gb, row_bytes=rbytes,
                          n_rows=nrows, other_device_bytes=other, cache=cache)


def host_tables_for(lid: int, table, scales, stats=None) -> list:
    """Copy layer lid's table (and separate scales) into pinned mapped host memory."""
    import time

    from .device.hostrows import HostTable
    from .device.upload import UploadRecord
    held = []
    for arr, what in ((table, f"layer {lid} table (host)"), (scales, f"layer {lid} table scales (host)")):
        if arr is None:
            continue
        t0 = time.perf_counter()
        ht = HostTable(tuple(arr.shape), what)
        ht.fill(arr)
        held.append(ht)
        if stats is not None:
            stats.records.append(UploadRecord(what, ht.nbytes, time.perf_counter() - t0, "pinned host copy"))
    return held


def make_fetcher(engine, plan: PlacementPlan):
    """The engine's RowFetcher over its host layers, with their (empty) caches."""
    from .device.hostrows import ClockCache, HostLayer, RowCache, RowFetcher, word_dtype
    layers = []
    for lid, held in engine._host_tables.items():
        lw = engine.layers[lid]
        parts = [h.dev for h in held]
        budget = plan.layers[lid].cache_budget_bytes
        words = word_dtype(*[p.shape[1] for p in parts])
        kind = ClockCache if plan.cache_policy == "clock" else RowCache
        cache = kind(lw.n_rows, lw.row_bytes, budget, words) if budget else None
        layers.append(HostLayer(lid, parts, lw.row_bytes, lw.n_rows, cache))
    return RowFetcher(layers, engine.max_tokens * engine.config.n_hash_cols, engine.stream)


def replace_caches(engine, cache_gb, cache: str = "static") -> dict:
    """Give the engine's host layers new hot-row caches (`EngramV41.set_cache`): checked first
    (the policy, the budgets, and the device memory the new caches need beyond the old ones'),
    then the side streams drained, the old caches dropped and the new ones made (empty), and the
    decode graphs rebuilt at the next decode. Returns {layer id: slots}."""
    from .device.hostrows import CACHE_POLICIES, ClockCache, RowCache
    if cache not in CACHE_POLICIES:
        raise PlacementError(f"cache must be one of {CACHE_POLICIES}, got {cache!r}")
    f = engine._fetcher
    if f is None:
        raise PlacementError("set_cache: no table is in host memory (a hot-row cache is for host-resident tables: "
                             "tables={layer id: 'host'})")
    if engine._decode_pending is not None:
        raise PlacementError(f"set_cache: token {engine._decode_pending[0]} was prefetched by prefetch_decode and not "
                             f"yet decoded: decode it first")
    hosts = list(f.layers)
    if isinstance(cache_gb, dict):
        named = set(cache_gb) - set(hosts)
        if named:
            raise PlacementError(f"cache_gb names layer(s) {sorted(named)} whose tables are not in host memory "
                                 f"(host layers: {hosts})")
    budgets = _cache_budgets(cache_gb, hosts)
    kind = ClockCache if cache == "clock" else RowCache
    need = sum(kind.device_bytes_for(f.layers[lid].n_rows, f.layers[lid].row_bytes, budgets[lid])
               for lid in hosts if budgets[lid])
    old = sum(hl.cache.device_bytes for hl in f.layers.values())
    free = device_free_bytes()
    if free is not None and need - old > free - DEVICE_RESERVE:
        raise PlacementError(f"set_cache: the caches need {need / 1e9:.2f} GB on the device, {old / 1e9:.2f} GB are "
                             f"freed and {free / 1e9:.2f} GB are free ({DEVICE_RESERVE / 1e9:.2f} GB kept back): "
                             f"give a smaller cache_gb")
    if not _simulator():
        from numba import cuda
        cuda.synchronize()                 # no fetch or decode reads the old caches any more
    engine._decode_graphs.clear()          # they captured the old caches' arrays
    engine._staging = None
    out = {}
    for lid in hosts:
        hl = f.layers[lid]
        hl.cache = kind(hl.n_rows, hl.row_bytes, budgets[lid], hl.words) if budgets[lid] else \
            RowCache(hl.n_rows, hl.row_bytes, 0, hl.words)
        lp = engine.placement.layers[lid]
        lp.cache_budget_bytes = budgets[lid]
        lp.cache_bytes = kind.device_bytes_for(hl.n_rows, hl.row_bytes, budgets[lid]) if budgets[lid] else 0
        out[lid] = hl.cache.n_slots
    engine.placement.cache_policy = cache
    return out


def _simulator() -> bool:
    from numba.cuda import config
    return bool(config.ENABLE_CUDASIM)


def fetched_rows(engine, lw, ws, flat: np.ndarray, T: int, k=None) -> bool:
    """Rows of a host layer through the fetcher: a matching prefetch (buffer k, when the caller
    matched it already), or (with a cache) a fetch now; then the decode on the engine's stream.
    False: neither (the caller gathers straight from host memory)."""
    from .device.devarray import data_address
    from .stages.rows.launch import prepare_decode
    fetcher = engine._fetcher
    if k is None:
        k = fetcher.match(lw.layer_id, flat)
    if k is None:
        fetcher.missed += 1
        if not fetcher.layers[lw.layer_id].cache.n_slots:
            return False
        k = fetcher.issue({lw.layer_id: flat})
    src = fetcher.take(lw.layer_id, k)
    n = int(flat.size)
    launch = engine._plan(("decode", lw.layer_id, n, data_address(src)), lambda: prepare_decode(
        src, ws.rows[:n], encoding=lw.encoding, stream=engine.stream, version=engine.versions.get("rows")))
    engine._last_launch[("rows", lw.layer_id)] = launch
    launch()
    fetcher.release(k, lw.layer_id)
    engine._loaded(ws, T)
    return True


class DecodeStaging:
    """What one-token decode graphs of an engine with host tables share: two sets of pinned ids
    and mask buffers, their device copies, and the host layers' raw rows staged on the device
    (double buffered: the hasher fills set b while a graph may still read the other), plus the
    fetch of a token issued ahead on a side stream (`EngramV41.prefetch_decode`).

    The fetch part of a token (ids and mask up, then every host row of every host layer in one
    launch: `FetchRowsLaunch`) either opens the token's decode graph, or runs ahead on the side
    stream as its own graph; the decode graph then starts at the decode of the staged rows.
        prefetch(b): host waits done[b] (the graph that last read set b), hashes into ids[b],
                     replays fetch graph b on the side stream, records fetched[b] there
        decode:      decode stream waits fetched[b], replays compute graph b, records done[b]"""

    def __init__(self, engine):
        from .device.hostrows import nonblocking_stream
        cfg = engine.config
        L, C = len(cfg.layer_ids), cfg.n_hash_cols
        self.engine = engine
        self.host_layers = [lid for lid in cfg.layer_ids if engine.layers[lid].placement == "host"]
        self.ids = [cuda_pinned((1, L, C), np.int64) for _ in range(2)]      # the hasher writes here
        self.mask = [cuda_pinned(1, np.uint8) for _ in range(2)]
        for b in range(2):
            self.ids[b][:] = 0
            self.mask[b][:] = 1
        from numba import cuda
        self.dev_ids = [cuda.to_device(np.zeros(L * C, np.int64)) for _ in range(2)]     # [L*C] int64
        self.dev_mask = [cuda.to_device(np.ones(1, np.uint8)) for _ in range(2)]
        fl = engine._fetcher.layers
        self.raw = [{lid: cuda.device_array((C, fl[lid].W), dtype=fl[lid].words) for lid in self.host_layers}
                    for _ in range(2)]
        self.side = nonblocking_stream()
        self.fetched = [cuda.event(timing=False) for _ in range(2)]
        self.done = [cuda.event(timing=False) for _ in range(2)]
        self.done_recorded = [False, False]
        self.next = 0
        self.pending = None            # (buffer, token id, live, hasher) of a fetch issued ahead
        self._fetch_graphs = None

    def raw_u8(self, b: int, lid: int):
        """Staged rows of host layer lid in set b as uint8 [C, row_bytes] (what the decode reads)."""
        a = self.raw[b][lid]
        return a if a.dtype == np.uint8 else a.view(np.uint8)

    def fetch_launches(self, stream, b: int) -> list:
        """Set b's ids and mask up, then the host rows of every host layer (one launch a pair)."""
        from .device.graphs import HostToDeviceCopy
        from .device.hostrows import FetchRowsLaunch
        C = self.engine.config.n_hash_cols
        order = self.engine.config.layer_ids
        fl = self.engine._fetcher.layers
        L = len(order)
        out = [HostToDeviceCopy(self.dev_ids[b], self.ids[b].reshape(L * C), stream, "ids"),
               HostToDeviceCopy(self.dev_mask[b], self.mask[b], stream, "mask")]
        out.append(FetchRowsLaunch([(fl[lid], self.dev_ids[b][order.index(lid) * C:(order.index(lid) + 1) * C],
                                     self.raw[b][lid]) for lid in self.host_layers], stream,
                                   bad=self.engine._decode_bad))
        return out

    def free_buffer(self) -> int:
        """The set the next token uses, once the graph that last read it is done (the caller
        advances `next` after its hash succeeds)."""
        b = self.next
        if self.done_recorded[b]:
            self.done[b].synchronize()
        return b

    def prefetch(self, token_id, live: bool, hasher) -> None:
        from .device.graphs import CapturedGraph
        b = self.free_buffer()
        if self._fetch_graphs is None:
            for launch in self.fetch_launches(self.side, b):     # compile first (a capture must not), on the free set
                launch()
            self.side.synchronize()
            self._fetch_graphs = [CapturedGraph(self.side, self.fetch_launches(self.side, k), n_tokens=1)
                                  for k in range(2)]
        hasher.hash([token_id], None if live else np.array([False]), out=self.ids[b])   # checks the id first
        self.next = 1 - b
        self.mask[b][0] = 1 if live else 0
        self._fetch_graphs[b].replay()
        self.fetched[b].record(self.side)
        self.pending = (b, int(token_id), bool(live), hasher)


def cuda_pinned(shape, dtype):
    from numba import cuda
    return cuda.pinned_array(shape, dtype=dtype)


# -- what `engram-numba info` reports: the plan of an engine, without building one ----------------
def _file_wkv_format(lf) -> str:
    enc = str(getattr(lf, "wkv_encoding", None) or getattr(lf, "wkv_type", None) or "bf16").lower()
    if "q2" in enc:
        return "q2k_r"
    return "fp8" if "fp8" in enc or "e4m3" in enc else "bf16"


def placement_report(model, max_tokens: int = 4096, tables="auto", cache_gb=None,
                     device_free=None, host_available=None) -> dict:
    """What EngramV41(model, max_tokens, tables=tables, cache_gb=cache_gb) would place where on
    this machine, and the bytes each layer costs on the device and in pinned host memory, from the
    tables' shapes alone (nothing is read, uploaded or pinned). Where the device's free memory is
    unknown (no GPU, or numba's simulator) it says so and plans as if it were unbounded. A plan
    that cannot fit is reported with the reason instead of raising."""
    from .stages.rows.encodings import get_encoding
    cfg = model.config
    if device_free is None:
        try:
            device_free = device_free_bytes()
        except Exception:                    # no GPU or no driver: unknown
            device_free = None
    if host_available is None:
        host_available = host_available_bytes()
    sizes, rbytes, nrows = {}, {}, {}
    try:
        for lid in cfg.layer_ids:
            lf = model.layers[lid]
            t, scales = lf.table, getattr(lf, "table_scales", None)
            sizes[lid] = int(t.shape[0]) * int(t.shape[1]) + (0 if scales is None else int(np.prod(scales.shape)))
            rbytes[lid] = get_encoding(getattr(lf, "table_encoding", "q2k")).row_bytes
            nrows[lid] = int(t.shape[0])
        wkv = {lid: _file_wkv_format(model.layers[lid]) for lid in cfg.layer_ids}
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:   # a model without tables
        return {"max_tokens": int(max_tokens), "policy": repr(tables), "error": f"no placement: {exc}"}
    gb = lambda b: None if b is None else round(b / 1e9, 3)  # noqa: E731
    out = {"max_tokens": int(max_tokens), "policy": repr(tables), "device_free_gb": gb(device_free),
           "host_available_gb": gb(host_available),
           "layers": {lid: {"table_gb": gb(sizes[lid]), "table_bytes": sizes[lid], "rows": nrows[lid],
                            "row_bytes": rbytes[lid]}
                      for lid in cfg.layer_ids}}
    try:
        kw = dict(cache_gb=cache_gb, row_bytes=rbytes, n_rows=nrows)
        first = plan_placement(sizes, tables, **kw, device_free=1 << 62, host_available=1 << 62)
        hosts = [lid for lid, lp in first.layers.items() if lp.placement == "host"]
        other = engine_device_estimate(cfg, max_tokens, wkv, rbytes, hosts)
        plan = plan_placement(sizes, tables, **kw, other_device_bytes=other,
                              device_free=device_free if device_free is not None else 1 << 62,
                              host_available=host_available if host_available is not None else 1 << 62)
    except PlacementError as exc:
        out["refused"] = str(exc)
        return out
    for lid, lp in plan.layers.items():
        dev = (lp.table_bytes if lp.placement == "device" else 0) + lp.cache_bytes
        pinned = lp.table_bytes if lp.placement == "host" else 0
        out["layers"][lid].update(placement=lp.placement, device_gb=gb(dev), device_bytes=dev, pinned_gb=gb(pinned),
                                  pinned_bytes=pinned)
    out.update(kind=plan.kind, device_gb_planned=gb(plan.device_bytes), host_pinned_gb=gb(plan.host_pinned_bytes),
               device_bytes_planned=plan.device_bytes, host_pinned_bytes=plan.host_pinned_bytes,
               weights_and_workspaces_gb=gb(plan.other_device_bytes), weights_and_workspaces_bytes=plan.other_device_bytes,
               note=None if device_free is not None else "no GPU seen: device memory unknown, planned as unbounded")
    return out


def _human(b: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def format_placement(rep: dict) -> str:
    """`placement_report` as the lines `engram-numba info` prints."""
    if "error" in rep:
        return f"placement {rep['error']}"
    free = "unknown (no GPU)" if rep["device_free_gb"] is None else f"{rep['device_free_gb']:.2f} GB free"
    host = "unknown" if rep["host_available_gb"] is None else f"{rep['host_available_gb']:.2f} GB available"
    lines = [f"placement tables={rep['policy']}, max_tokens {rep['max_tokens']}: device {free}, host {host}"]
    if "refused" in rep:
        return "\n".join(lines + [f"  refused: {rep['refused']}"])
    for lid, lay in rep["layers"].items():
        lines.append(f"  layer {lid}: {lay['placement']:6s} table {_human(lay['table_bytes'])} ({lay['rows']:,} rows of "
                     f"{lay['row_bytes']} B); on the device {_human(lay['device_bytes'])}, pinned host "
                     f"{_human(lay['pinned_bytes'])}")
    lines.append(f"  planned: device {_human(rep['device_bytes_planned'])} (weights and workspaces "
                 f"{_human(rep['weights_and_workspaces_bytes'])}), pinned host {_human(rep['host_pinned_bytes'])}")
    return "\n".join(lines)
