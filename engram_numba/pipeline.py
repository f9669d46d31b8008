"""Run the Engram path stage by stage, with a backend per stage, capturing every boundary.

    pipe = Pipeline(model, backends={"rows": "cpu", "proj": "cuda", "gate": "reference"})
    cap = pipe.run(token_ids)                 # a Capture: name -> numpy array
    with pipe.hooks({"L1.rows.bf16": fn}):    # observe, or return a replacement
        cap2 = pipe.run(token_ids)
    diff(cap, cap2)                           # engram_numba.compare

Stages, in order, for each engram layer in model order:
    hash  token ids -> row ids              (CPU by design: the "cuda" choice runs the @njit hasher)
    rows  row ids -> Q2_K blocks -> bf16 rows
    proj  bf16 rows -> kv = bf16(x @ wkv^T)
    gate  highway, kv -> gate, highway + gate * value

Capture points, in the order they fire. First the inputs of the whole step:
    tokens.ids    [T] int64        raw token ids
    tokens.mask   [T] bool         True = live token (all True when no mask was given)
then, per engram layer (prefix `L{layer_id}.`):
    hash.ids      [T, C] int64     row ids of this layer's table
    rows.q2k      [T*C, 84] uint8  the raw Q2_K blocks gathered for those ids
    rows.bf16     [T*C, 256] uint16 (bf16 words) dequantised rows = projection input, row t*C + c
    proj.kv       [T, (hc+1)*dim] uint16  projection output
    gate.key      [T, hc, dim] uint16  the keys (a view of proj.kv)
    gate.value    [T, dim] uint16      the shared value (a view of proj.kv)
    highway.in    [T, hc, dim] fp32    streams before the update
    gate.dot      [T, hc] fp32         normalised dot before the signed square root
    gate.gate     [T, hc] fp32         sigmoid gate (0 for masked tokens)
    highway.out   [T, hc, dim] fp32    streams after the update
A hook on a point may return a replacement array of the same shape and dtype; what comes
after uses it (e.g. `hash.ids` to drop one hash head, `rows.bf16` to feed exact rows, `gate.key`
to perturb the key). `gate.dot`, `gate.gate` and `highway.out` are outputs: their hooks observe.

Blocks between engram layers are not modelled: by default the second layer's `highway.in` is
the first layer's `highway.out` (pass a dict {layer_id: highway} to feed each layer its own).
"""
from __future__ import annotations

import contextlib
import json
import warnings
from typing import Callable, Iterable, Mapping

import numpy as np

from . import cpu as _cpu
from . import reference as _ref
from .hash import EngramHasher

STAGES = ("hash", "rows", "proj", "gate")
BACKENDS = ("reference", "cpu", "cuda")
INPUT_POINTS = ("tokens.ids", "tokens.mask")
POINTS = ("hash.ids", "rows.q2k", "rows.bf16", "proj.kv", "gate.key", "gate.value",
          "highway.in", "gate.dot", "gate.gate", "highway.out")
OBSERVE_ONLY = ("tokens.ids", "tokens.mask", "gate.dot", "gate.gate", "highway.out")


def point_names(layer_ids: Iterable[int]) -> list[str]:
    """Every capture point of a model, in firing order."""
    return list(INPUT_POINTS) + [f"L{lid}.{p}" for lid in layer_ids for p in POINTS]


def _name_predicate(names_filter) -> Callable[[str], bool]:
    """names_filter: None (everything), a name, a list of names, or a predicate."""
    if names_filter is None:
        return lambda name: True
    if callable(names_filter):
        return names_filter
    if isinstance(names_filter, str):
        names = {names_filter}
    else:
        names = set(names_filter)
    return lambda name: name in names


# Captures -----------------------------------------------------------------------------------

class Capture(Mapping):
    """Arrays captured at named points of one run, plus what the run was (`meta`)."""

    def __init__(self, arrays: dict | None = None, meta: dict | None = None):
        self._arrays: dict[str, np.ndarray] = dict(arrays or {})
        self.meta: dict = dict(meta or {})

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._arrays[name]
        except KeyError:
            near = [n for n in self._arrays if n.split(".", 1)[-1] == name.split(".", 1)[-1]]
            hint = f"; did you mean one of {near}" if near else ""
            raise KeyError(f"no capture named {name!r}{hint} (captured: {len(self._arrays)} points)") from None

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        head = ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in list(self._arrays.items())[:4])
        more = f", ... ({len(self) - 4} more)" if len(self) > 4 else ""
        return f"Capture({head}{more}; meta={self.meta})"

    def save(self, path) -> None:
        """Write every array and the meta to one .npz file."""
        arrays = {k: np.ascontiguousarray(v) for k, v in self._arrays.items()}
        np.savez_compressed(path, __meta__=np.array(json.dumps(self.meta)), **arrays)

    @classmethod
    def load(cls, path) -> "Capture":
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(str(f["__meta__"])) if "__meta__" in f.files else {}
            return cls({k: f[k] for k in f.files if k != "__meta__"}, meta)

    def layer(self, layer_id: int) -> dict[str, np.ndarray]:
        """This layer's captures, keyed by point name without the layer prefix."""
        prefix = f"L{layer_id}."
        return {k[len(prefix):]: v for k, v in self._arrays.items() if k.startswith(prefix)}


# Backends -----------------------------------------------------------------------------------

class _HostBackend:
    """Stage functions with host (numpy) arrays in and out."""

    name = "?"

    def hash(self, hasher: EngramHasher, token_ids, token_mask):
        return hasher.hash(token_ids, token_mask)

    def rows(self, layer, row_ids):  # -> bf16 rows [n, 256]
        raise NotImplementedError

    def proj(self, layer, x_bf16):  # -> kv [T, N]
        raise NotImplementedError

    def gate(self, layer, highway, kv, token_mask, residual, eps) -> _ref.GateResult:
        raise NotImplementedError


class _ReferenceBackend(_HostBackend):
    name = "reference"

    def hash(self, hasher, token_ids, token_mask):
        ids = _ref.hash_reference(hasher.tables, token_ids, token_mask, history=hasher.history)
        hasher.hash(token_ids, token_mask)  # keep the shared history moving
        return ids

    def rows(self, layer, row_ids):
        return _ref.rows_reference(_ref.gather_reference(layer.table, row_ids))

    def proj(self, layer, x_bf16):
        return _ref.projection_reference(x_bf16, layer.wkv_bf16_cached())

    def gate(self, layer, highway, kv, token_mask, residual, eps):
        return _ref.gate_reference(highway, kv, layer.q_weight, layer.k_weight, token_mask, residual, eps)


class _CpuBackend(_HostBackend):
    name = "cpu"

    def rows(self, layer, row_ids):
        return _cpu.rows_cpu(layer.reader.read(row_ids))

    def proj(self, layer, x_bf16):
        return _cpu.projection_cpu(x_bf16, layer.wkv_bf16_cached())

    def gate(self, layer, highway, kv, token_mask, residual, eps):
        return _cpu.gate_cpu(highway, kv, layer.q_weight, layer.k_weight, token_mask, residual, eps)


class _CudaBackend(_HostBackend):
    """Each stage on the GPU (or numba's simulator), through one `EngramV41` whose workspaces
    grow to the longest call. Inputs are copied in and results copied out per stage, so any
    stage can be swapped for another backend's."""

    name = "cuda"

    def __init__(self, model, versions=None):
        from numba import cuda
        from numba.cuda import config

        from .gpu import EngramV41
        if config.ENABLE_CUDASIM:
            warnings.warn("cuda backend: no GPU in use, the @cuda.jit kernels run in numba's simulator "
                          "(slow, tiny shapes only)", stacklevel=3)
        elif not cuda.is_available():
            raise RuntimeError("cuda backend: no CUDA GPU is available and numba's simulator is off; set "
                               "NUMBA_ENABLE_CUDASIM=1 before numba is first imported to run the kernels on the CPU")
        self._model = model
        self._cls = EngramV41
        self._versions = dict(versions or {})
        self._engine = None

    def _engine_for(self, n_tokens: int):
        if self._engine is None or self._engine.max_tokens < n_tokens:
            self._engine = self._cls(self._model, max_tokens=max(n_tokens, 16), device_tables=True,
                                     versions=self._versions)
        return self._engine

    def rows(self, layer, row_ids):
        n_cols = self._model.config.n_hash_cols
        eng = self._engine_for(np.asarray(row_ids).size // n_cols)
        eng.rows_from_ids(layer.layer_id, np.asarray(row_ids).reshape(-1, n_cols))
        return eng.rows_bf16(layer.layer_id).copy_to_host()

    def proj(self, layer, x_bf16):
        T = x_bf16.shape[0]
        eng = self._engine_for(T)
        eng.rows_from_bf16(layer.layer_id, x_bf16.reshape(T * self._model.config.n_hash_cols, -1))
        return eng.project(layer.layer_id).copy_to_host()

    def gate(self, layer, highway, kv, token_mask, residual, eps):
        from numba import cuda
        T = highway.shape[0]
        eng = self._engine_for(T)
        d_highway = cuda.to_device(np.ascontiguousarray(highway, dtype=np.float32))
        eng.gate(layer.layer_id, d_highway, kv=cuda.to_device(np.ascontiguousarray(kv)),
                 token_mask=token_mask, residual=residual, eps=eps)
        dot, gate = eng.last_gate(layer.layer_id)
        return _ref.GateResult(highway=d_highway.copy_to_host(), dot=dot.copy_to_host(), gate=gate.copy_to_host())


class _LayerView:
    """What the host backends need of one engram layer (weights decoded once per pipeline)."""

    def __init__(self, model, layer_id: int):
        lf = model.layers[layer_id]
        self.layer_id = layer_id
        self.table = lf.table
        self.reader = model.rows(layer_id)
        self.q_weight = lf.q_weight
        self.k_weight = lf.k_weight
        self._file = lf
        self._wkv = None

    def wkv_bf16_cached(self) -> np.ndarray:
        if self._wkv is None:
            self._wkv = np.ascontiguousarray(self._file.wkv_bf16())
        return self._wkv


# The pipeline -------------------------------------------------------------------------------

class Pipeline:
    """hash -> rows -> proj -> gate for every engram layer of `model`, one backend per stage.

    backends: "reference" | "cpu" | "cuda" for every stage, or a dict {stage: backend}
              (stages not named take "reference").
    residual: "fp32" (engine: FP32 highway) or "bf16" (DeepSeek's reference: bf16 residual).
    cuda_versions: kernel versions for the cuda backend, e.g. {"projection": "gemv_v2", "gate": 3,
              "gather": 4} (see `EngramV41`); by default each launcher picks (in numba's simulator,
              the naive kernels, which are the fast ones to simulate).
    """

    def __init__(self, model, backends="reference", residual: str = "fp32", eps: float | None = None,
                 cuda_versions: dict | None = None):
        if residual not in _ref.RESIDUALS:
            raise ValueError(f"residual must be one of {_ref.RESIDUALS}, got {residual!r}")
        self.model = model
        self.config = model.config
        self.residual = residual
        self.eps = self.config.eps if eps is None else float(eps)
        self.backends = self._resolve_backends(backends)
        unknown = set(cuda_versions or {}) - {"dequant", "gather", "projection", "gate"}
        if unknown:
            raise ValueError(f"cuda_versions names unknown stage(s) {sorted(unknown)}; "
                             "stages are dequant, gather, projection, gate")
        factories = {"reference": _ReferenceBackend, "cpu": _CpuBackend,
                     "cuda": lambda: _CudaBackend(model, cuda_versions)}
        self._impl: dict[str, _HostBackend] = {b: factories[b]() for b in set(self.backends.values())}
        self._layers = {lid: _LayerView(model, lid) for lid in self.config.layer_ids}
        self._hooks: dict[str, list[Callable]] = {}
        self.fired: list[str] = []  # points that fired in the last run, in order

    @staticmethod
    def _resolve_backends(backends) -> dict[str, str]:
        if isinstance(backends, str):
            backends = {s: backends for s in STAGES}
        elif isinstance(backends, Mapping):
            unknown = set(backends) - set(STAGES)
            if unknown:
                raise ValueError(f"unknown stage(s) {sorted(unknown)} in backends; stages are {list(STAGES)}")
            backends = {s: backends.get(s, "reference") for s in STAGES}
        else:
            raise TypeError(f"backends must be a backend name or a dict stage -> name, got {type(backends).__name__}")
        for stage, b in backends.items():
            if b not in BACKENDS:
                raise ValueError(f"backend {b!r} for stage {stage!r} is not one of {list(BACKENDS)}")
        return backends

    @property
    def point_names(self) -> list[str]:
        return point_names(self.config.layer_ids)

    @contextlib.contextmanager
    def hooks(self, mapping: Mapping[str, Callable]):
        """Attach hooks {point name: fn(array, name)} for the `with` block; removed after it,
        also when the block raises. A hook returning an array replaces the captured value."""
        known = set(self.point_names)
        for name in mapping:
            if name not in known:
                raise KeyError(f"no hook point named {name!r}; points are e.g. {self.point_names[:len(POINTS) + 2]}")
        added = []
        try:
            for name, fn in mapping.items():
                self._hooks.setdefault(name, []).append(fn)
                added.append((name, fn))
            yield self
        finally:
            for name, fn in added:
                self._hooks[name].remove(fn)
                if not self._hooks[name]:
                    del self._hooks[name]

    def _point(self, name: str, value: np.ndarray, keep, parts: dict) -> np.ndarray:
        self.fired.append(name)
        for fn in self._hooks.get(name, ()):
            out = fn(value, name)
            if out is not None:
                short = name.split(".", 1)[1] if name.startswith("L") else name
                if short in OBSERVE_ONLY:
                    raise ValueError(f"hook on {name!r} returned a value, but {short} is an output: observe only")
                out = np.asarray(out)
                if out.shape != value.shape or out.dtype != value.dtype:
                    raise ValueError(f"hook on {name!r} returned {out.dtype}{list(out.shape)}, expected "
                                     f"{value.dtype}{list(value.shape)}")
                value = out
        if keep(name):
            parts.setdefault(name, []).append(np.array(value, copy=True))
        return value

    def default_highway(self, n_tokens: int, seed: int = 0) -> np.ndarray:
        """A fixed-seed N(0, 1) highway [T, hc, dim] fp32 (this toolkit has no transformer blocks)."""
        rng = np.random.default_rng(seed)
        return rng.standard_normal((n_tokens, self.config.hc, self.config.dim)).astype(np.float32)

    def run(self, token_ids, highway=None, token_mask=None, names_filter=None,
            hasher: EngramHasher | None = None, progress: bool = False,
            chunk_tokens: int | None = None) -> Capture:
        """Run every engram layer on one sequence; returns the captures that `names_filter` keeps.

        highway: [T, hc, dim] fp32 (never modified), a dict {layer_id: highway}, or None for
                 `default_highway(T)`. hasher: continue an existing sequence (decode steps).
        chunk_tokens: run the stages on this many tokens at a time (the hasher keeps the
                 sequence's history, so ids are the same; every stage is per token). Captures are
                 joined along the token axis; hooks see one chunk at a time. With progress=True
                 and no chunk size, long sequences go in chunks of 512 so the bar moves.
        """
        cfg = self.config
        token_ids = np.asarray(token_ids)
        T = int(token_ids.size)
        mask = None if token_mask is None else np.asarray(token_mask, dtype=bool)
        if mask is not None and mask.shape != (T,):
            raise ValueError(f"token_mask must have shape ({T},), got {mask.shape}")
        per_layer = isinstance(highway, Mapping)
        if per_layer:
            missing = set(cfg.layer_ids) - set(highway)
            if missing:
                raise ValueError(f"highway dict lacks engram layer(s) {sorted(missing)}")
            for lid in cfg.layer_ids:
                self._check_highway(highway[lid], T)
        else:
            highway = self.default_highway(T) if highway is None else highway
            self._check_highway(highway, T)
        if chunk_tokens is None:
            chunk_tokens = 512 if progress and T > 512 else max(T, 1)
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")

        keep = _name_predicate(names_filter)
        parts: dict[str, list] = {}
        self.fired = []
        self._point("tokens.ids", token_ids.astype(np.int64), keep, parts)
        self._point("tokens.mask", np.ones(T, dtype=bool) if mask is None else mask, keep, parts)
        hasher = hasher if hasher is not None else EngramHasher(self.model.hash_tables, capacity=max(T, 16))
        starts = range(0, T, chunk_tokens)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=T, desc="engram", unit="tok")
        for t0 in starts:
            t1 = min(T, t0 + chunk_tokens)
            chunk_mask = None if mask is None else mask[t0:t1]
            h_chunk = ({lid: highway[lid][t0:t1] for lid in cfg.layer_ids} if per_layer else highway[t0:t1])
            self._run_chunk(hasher, token_ids[t0:t1], chunk_mask, h_chunk, keep, parts)
            if bar is not None:
                bar.update(t1 - t0)
        if bar is not None:
            bar.close()
        store = {name: (chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0))
                 for name, chunks in parts.items()}
        meta = {"backends": self.backends, "residual": self.residual, "eps": self.eps, "n_tokens": T,
                "layer_ids": list(cfg.layer_ids), "model": str(getattr(self.model, "path", "")),
                "token_ids": token_ids.tolist() if T <= 4096 else None}
        return Capture(store, meta)

    def _run_chunk(self, hasher, token_ids, mask, highway, keep, parts) -> None:
        """Every layer on one chunk of tokens (hash first: it extends the sequence's history)."""
        cfg = self.config
        T = int(token_ids.size)
        all_ids = self._impl[self.backends["hash"]].hash(hasher, token_ids, mask)   # [T, L, C]
        per_layer = isinstance(highway, Mapping)
        current = None if per_layer else highway
        for li, lid in enumerate(cfg.layer_ids):
            layer = self._layers[lid]
            p = f"L{lid}."
            ids = self._point(p + "hash.ids", np.ascontiguousarray(all_ids[:, li, :]), keep, parts)  # [T, C]
            if keep(p + "rows.q2k") or p + "rows.q2k" in self._hooks:
                self._point(p + "rows.q2k", layer.reader.read(ids), keep, parts)
            else:
                self.fired.append(p + "rows.q2k")
            rows = self._impl[self.backends["rows"]].rows(layer, ids)                    # [T*C, 256]
            rows = self._point(p + "rows.bf16", rows, keep, parts)
            kv = self._impl[self.backends["proj"]].proj(layer, rows.reshape(T, cfg.proj_in))
            kv = self._point(p + "proj.kv", kv, keep, parts)                              # [T, N]
            key, value = _ref.split_kv(kv, cfg.hc)
            key = self._point(p + "gate.key", np.ascontiguousarray(key), keep, parts)
            value = self._point(p + "gate.value", np.ascontiguousarray(value), keep, parts)
            kv = np.concatenate([key.reshape(T, -1), value], axis=1)
            h_in = highway[lid] if per_layer else current
            h_in = self._point(p + "highway.in", np.ascontiguousarray(h_in, dtype=np.float32), keep, parts)
            res = self._impl[self.backends["gate"]].gate(layer, h_in, kv, mask, self.residual, self.eps)
            self._point(p + "gate.dot", res.dot, keep, parts)
            self._point(p + "gate.gate", res.gate, keep, parts)
            self._point(p + "highway.out", res.highway, keep, parts)
            current = res.highway

    def _check_highway(self, h, T: int) -> None:
        cfg = self.config
        shape = (T, cfg.hc, cfg.dim)
        if not isinstance(h, np.ndarray):
            raise TypeError(f"highway must be a numpy array [T, hc, dim] fp32 (host), got {type(h).__name__}")
        if h.shape != shape:
            raise ValueError(f"highway must have shape {shape} (T, hc, dim), got {h.shape}")
        if h.dtype != np.float32:
            raise ValueError(f"highway must be float32, got {h.dtype}")
