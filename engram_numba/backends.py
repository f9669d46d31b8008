"""The stage backends a `Pipeline` runs: one object per backend name with the same four stage
methods (hash, rows, proj, gate), and the resolution of a user's backend choice per stage.

    reference  plain numpy, fixed summation order (the teaching version)
    cpu        @njit, bit-identical to the reference
    blas       cpu with the projection as a BLAS fp32 matmul (not bit-identical; docs/numerics.md)
    deepseek_fp8  cpu with DeepSeek's FP8 arithmetic for an FP8 wkv (activations quantised to e4m3)
    cuda       each stage on the GPU (or numba's simulator) through one `EngramV41`

A new backend is one class here and one entry in `BACKEND_CLASSES`.
"""
from __future__ import annotations

import sys
import warnings
from typing import Mapping

import numpy as np

from .layer_step import EngineStages, GateValues, Value
from .stages.gate import cpu as _gate_cpu
from .stages.gate import reference as _gate_ref
from .stages.hash.cpu import EngramHasher
from .stages.hash.reference import hash_reference
from .stages.proj import cpu as _proj_cpu
from .stages.proj import reference as _proj_ref
from .stages.registry import BACKENDS, STAGES
from .stages.rows import cpu as _rows_cpu
from .stages.rows import reference as _rows_ref
from .stages.rows.fp8 import assemble_rows_fp8


def _caller_stacklevel() -> int:
    """The stacklevel that makes a warning point at the first frame outside this package."""
    level, frame = 1, sys._getframe(1)
    pkg = __name__.rsplit(".", 1)[0]
    while frame is not None and frame.f_globals.get("__name__", "").startswith(pkg):
        frame = frame.f_back
        level += 1
    return level


# Backends -----------------------------------------------------------------------------------

class HostBackend:
    """A backend's stages. Host backends write `rows_array`, `proj_array` and `gate_arrays` on
    numpy arrays; the stage methods the layer step calls (`rows`, `proj`, `gate`, on
    `layer_step.Value`s) fetch their inputs to the host and hand host Values on."""

    name = "?"
    versions: dict = {}

    def hash(self, hasher: EngramHasher, token_ids, token_mask):
        return hasher.hash(token_ids, token_mask)

    def rows(self, layer, raw=None, ids=None) -> Value:   # bf16 rows [T*C, 256]; raw given, or ids to gather
        return Value(host=self.rows_array(layer, raw=raw, ids=ids))

    def proj(self, layer, rows: Value) -> Value:          # kv [T, N]
        x = rows.host()
        return Value(host=self.proj_array(layer, x.reshape(-1, layer.proj_in)))

    def gate(self, layer, highway: Value, kv: Value, token_mask, residual, eps) -> GateValues:
        res = self.gate_arrays(layer, highway.host(), kv.host(), token_mask, residual, eps)
        return GateValues(Value(host=res.highway), Value(host=res.dot), Value(host=res.gate))

    def rows_array(self, layer, raw=None, ids=None) -> np.ndarray:
        raise NotImplementedError

    def proj_array(self, layer, x_bf16) -> np.ndarray:
        raise NotImplementedError

    def gate_arrays(self, layer, highway, kv, token_mask, residual, eps) -> _gate_ref.GateResult:
        raise NotImplementedError


class ReferenceBackend(HostBackend):
    name = "reference"

    def hash(self, hasher, token_ids, token_mask):
        ids = hash_reference(hasher.tables, token_ids, token_mask, history=hasher.history)
        hasher.hash(token_ids, token_mask)  # keep the shared history moving
        return ids

    def rows_array(self, layer, raw=None, ids=None):
        if raw is None:
            raw = _rows_ref.gather_reference(layer.table, ids)
            if layer.table_scales is not None:      # fp8 codes with separate scales: 264-byte rows
                raw = assemble_rows_fp8(raw, _rows_ref.gather_reference(layer.table_scales, ids))
        return _rows_ref.rows_reference(raw, layer.encoding)

    def proj_array(self, layer, x_bf16):
        return _proj_ref.projection_reference(x_bf16, layer.wkv_bf16())

    def gate_arrays(self, layer, highway, kv, token_mask, residual, eps):
        return _gate_ref.gate_reference(highway, kv, layer.q_weight, layer.k_weight, token_mask, residual, eps)


class CpuBackend(HostBackend):
    name = "cpu"

    def rows_array(self, layer, raw=None, ids=None):
        if raw is None:
            raw = layer.reader.read(ids)
        return _rows_cpu.rows_cpu(raw, layer.encoding)

    def proj_array(self, layer, x_bf16):
        return _proj_cpu.projection_cpu(x_bf16, layer.wkv_bf16())

    def gate_arrays(self, layer, highway, kv, token_mask, residual, eps):
        return _gate_cpu.gate_cpu(highway, kv, layer.q_weight, layer.k_weight, token_mask, residual, eps)


class BlasBackend(CpuBackend):
    """The cpu backend with the projection at BLAS speed (`proj.cpu.projection_blas`): fp32
    matmul in BLAS's summation order, so kv is within a bf16 ulp or so of the reference's, not
    bit-identical (docs/numerics.md). For runs that do not ask for bit-identity (corpus statistics)."""

    name = "blas"

    def proj_array(self, layer, x_bf16):
        return _proj_cpu.projection_blas(x_bf16, wkv_f32=layer.wkv_f32())


class DeepSeekFp8Backend(CpuBackend):
    """The cpu backend with DeepSeek's own FP8 arithmetic for the projection
    (`proj.cpu.projection_deepseek_fp8_cpu`, the @njit twin of `reference.projection_deepseek_fp8`):
    x quantised to e4m3 per block of 32 with a power-of-two scale, the products of each 32-wide K
    block summed and promoted to fp32 with both scales, kv rounded to bf16 once. Only an FP8 wkv
    (e4m3 codes with e8m0 32x32 tile scales, as DeepSeek's checkpoint stores it) has this arithmetic;
    the other backends project the same weights exactly (docs/numerics.md compares the two)."""

    name = "deepseek_fp8"

    @staticmethod
    def check_model(model) -> None:
        """Refuse, before anything runs, a model with a layer whose wkv is not FP8."""
        for lid, layer in model.layers.items():
            if layer.wkv_encoding != "fp8" or layer.wkv_scales is None:
                raise ValueError(f"backend 'deepseek_fp8' computes DeepSeek's FP8 arithmetic on an FP8 wkv (e4m3 codes "
                                 f"with e8m0 tile scales); engram layer {lid}'s wkv is {layer.wkv_encoding!r}: use "
                                 "proj=cpu (the exact projection) for this model")

    def proj_array(self, layer, x_bf16):
        lf = layer._file
        return _proj_cpu.projection_deepseek_fp8_cpu(x_bf16, lf.wkv_raw, lf.wkv_scales)


class CudaBackend(HostBackend):
    """Each stage on the GPU (or numba's simulator), through one `EngramV41` whose workspaces
    grow to the longest call (`layer_step.EngineStages`). Values stay on the device; they are
    copied to the host only for a host backend's stage or a capture point that asks."""

    name = "cuda"

    def __init__(self, model, versions=None):
        from numba import cuda
        from numba.cuda import config

        from .engine import EngramV41
        from .engine_build import check_versions
        if config.ENABLE_CUDASIM:
            warnings.warn("cuda backend: no GPU in use, the @cuda.jit kernels run in numba's simulator "
                          "(slow, tiny shapes only)", stacklevel=_caller_stacklevel())
        elif not cuda.is_available():
            raise RuntimeError("cuda backend: no CUDA GPU is available and numba's simulator is off; set "
                               "NUMBA_ENABLE_CUDASIM=1 before numba is first imported to run the kernels on the CPU")
        if model.config.dim % 8:
            raise ValueError(f"cuda backend: the gate kernels need dim % 8 == 0, this model has dim "
                             f"{model.config.dim}; use the reference or cpu backend for the gate")
        self._model = model
        self._cls = EngramV41
        self.versions = check_versions(versions)
        self._engine = None
        self._stages = EngineStages(self.engine_for, model.config)

    def engine_for(self, n_tokens: int):
        """The engine, built (or rebuilt larger) to take n_tokens tokens a call."""
        if self._engine is None or self._engine.max_tokens < n_tokens:
            self._engine = self._cls(self._model, max_tokens=max(n_tokens, 16), device_tables=True,
                                     versions=self.versions)
        return self._engine

    @property
    def engine(self):
        """The engine the stages run on (None until one is built or given)."""
        return self._engine

    def use_engine(self, engine) -> None:
        """Run on `engine` (an EngramV41 of this model) instead of building one."""
        self._engine = engine

    def kernel_names(self) -> dict:
        """The record each cuda stage ran last (what `Capture.meta` reports)."""
        if self._engine is None:
            return {}
        return {stage: name for stage, name in self._engine.last_kernels().items()}

    def rows(self, layer, raw=None, ids=None) -> Value:
        return self._stages.rows(layer, raw=raw, ids=ids)

    def proj(self, layer, rows: Value) -> Value:
        return self._stages.proj(layer, rows)

    def gate(self, layer, highway: Value, kv: Value, token_mask, residual, eps) -> GateValues:
        return self._stages.gate(layer, highway, kv, token_mask, residual, eps)


class LayerView:
    """What the host backends need of one engram layer (wkv decoded once per pipeline)."""

    def __init__(self, model, layer_id: int):
        lf = model.layers[layer_id]
        self.layer_id = layer_id
        self.table = lf.table
        self.encoding = lf.table_encoding
        self.table_scales = lf.table_scales
        self.proj_in = model.config.proj_in
        self.reader = model.rows(layer_id)
        self.q_weight = lf.q_weight
        self.k_weight = lf.k_weight
        self._file = lf
        self._wkv = None
        self._wkv_f32 = None

    def wkv_bf16(self) -> np.ndarray:
        if self._wkv is None:
            self._wkv = np.ascontiguousarray(self._file.wkv_bf16())
        return self._wkv

    def wkv_f32(self) -> np.ndarray:
        """wkv [N, K] widened to fp32 once (the BLAS projection's operand)."""
        if self._wkv_f32 is None:
            from .bf16 import bf16_to_f32
            self._wkv_f32 = np.ascontiguousarray(bf16_to_f32(self.wkv_bf16()))
        return self._wkv_f32


# Backend names ------------------------------------------------------------------------------

# "blas" (BLAS fp32 matmul) and "deepseek_fp8" (DeepSeek's FP8 arithmetic) are projection
# backends; as one name for every stage each means the cpu backend with that projection. The hash
# has no GPU version: "cuda" for every stage hashes with the @njit hasher and says so ("cpu"), and
# hash="cuda" is refused rather than mislabelled.
PROJ_ONLY_BACKENDS = ("blas", "deepseek_fp8")
BACKEND_NAMES = tuple(BACKENDS) + PROJ_ONLY_BACKENDS


def resolve_backends(backends) -> dict[str, str]:
    """{stage: backend} for every stage from a backend name or a partial dict (stages not named
    take "reference"); raises ValueError naming the stage or backend that cannot be."""
    if isinstance(backends, str):
        one = backends
        backends = {s: ("cpu" if (s == "hash" and one == "cuda") or (s != "proj" and one in PROJ_ONLY_BACKENDS)
                        else one)
                    for s in STAGES}
    elif not isinstance(backends, Mapping):
        raise TypeError(f"backends must be a backend name or a dict stage -> name, got {type(backends).__name__}")
    unknown = set(backends) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)} in backends; stages are {list(STAGES)}")
    out = {s: backends.get(s, "reference") for s in STAGES}
    for stage, b in out.items():
        if b not in BACKEND_NAMES:
            raise ValueError(f"backend {b!r} for stage {stage!r} is not one of {list(BACKEND_NAMES)}")
        if b in PROJ_ONLY_BACKENDS and stage != "proj":
            raise ValueError(f"backend {b!r} is a projection backend; stage {stage!r} takes one of {list(BACKENDS)}")
        if stage == "hash" and b == "cuda":
            raise ValueError("the hash has no GPU version (it runs on the CPU by design): use hash=cpu")
    return out


BACKEND_CLASSES = {"reference": ReferenceBackend, "cpu": CpuBackend, "blas": BlasBackend,
                   "deepseek_fp8": DeepSeekFp8Backend, "cuda": CudaBackend}


def make_backends(names, model, versions=None) -> dict[str, HostBackend]:
    """{backend name: backend object} for the names in `names` (each built once); a backend that
    cannot run this model says so here, before anything is built or run."""
    for b in set(names):
        check = getattr(BACKEND_CLASSES[b], "check_model", None)
        if check is not None:
            check(model)
    return {b: (CudaBackend(model, versions) if b == "cuda" else BACKEND_CLASSES[b]())
            for b in sorted(set(names))}
