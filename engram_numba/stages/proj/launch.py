"""Launchers of the projection on the GPU: kv = bf16(x @ wkv^T), fp32 accumulation.

    prepare_project(x, wkv, out=None, *, stream=0, version=None) -> PreparedLaunch (.out is kv)
    project(x, wkv, out=None, *, stream=0, version=None)         -> kv

x: device uint16 [T, K] bf16 words; wkv: device uint16 [N, K]; both C-contiguous, K % 8 == 0.
out: optional device uint16 [T, N] (allocated on `stream` when None). `version` names a record of
the proj stage ("gemv_v3", "gemm_v3", ...); None takes the record whose default rule holds for
this T (records.py). The fast versions read x and wkv with 16-byte loads: for data that is not
16-byte aligned (an odd slice) the default falls back to a naive kernel and a fast version asked
for by name is refused. To launch the same shapes repeatedly (decode), keep the prepared launch.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ...device.devarray import as_device_array, data_address
from ...device.intrinsics import SIMULATOR
from ...device.launch import NoLaunch
from .. import registry
from . import records  # noqa: F401  (registers the projection kernels)


def _check_bf16_matrix(a, name: str, shape_doc: str):
    if a.dtype != np.dtype(np.uint16):
        raise ValueError(f"{name} must be bf16 words (uint16) {shape_doc}, got dtype {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D {shape_doc}, got shape {tuple(a.shape)}")
    if not a.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")


def device_cc():
    """Compute capability of the current device, None in numba's simulator. The Hopper kernels
    (wgmma, sm_90a) run only on 9.0: numba builds the arch-specific target for the device in use,
    and later architectures have no wgmma."""
    if SIMULATOR:
        return None
    return tuple(cuda.get_current_device().compute_capability)


def context(T: int, K: int, N: int, aligned: bool, weight: str = "bf16", cc=None) -> dict:
    """What the default rules of the proj records look at (cc: the device's compute capability,
    taken from the current device when not given)."""
    return {"T": int(T), "K": int(K), "N": int(N), "aligned": bool(aligned), "simulator": SIMULATOR,
            "weight": weight, "cc": tuple(cc) if cc is not None else device_cc()}


def pick(T: int, K: int, N: int, aligned: bool = True, version: str | None = None) -> registry.KernelRecord:
    """The record that runs: `version` by name, else the default for this shape."""
    if version is not None:
        return registry.get("proj", version)
    return registry.default("proj", context(T, K, N, aligned))


def prepare_project(x, wkv, out=None, *, stream=0, version=None):
    """Validate once and return a PreparedLaunch of kv = bf16(x @ wkv^T) (see the module doc)."""
    x = as_device_array(x, "x")
    wkv = as_device_array(wkv, "wkv")
    _check_bf16_matrix(x, "x", "[T, K]")
    _check_bf16_matrix(wkv, "wkv", "[N, K]")
    T, K = x.shape
    N = wkv.shape[0]
    if wkv.shape[1] != K:
        raise ValueError(f"x is [T, K] = {tuple(x.shape)} but wkv is [N, K] = {tuple(wkv.shape)}: K differs")
    if K % 8 or K == 0:
        raise ValueError(f"K = {K} must be a positive multiple of 8 (rows are read as 16-byte chunks)")
    aligned = data_address(x) % 16 == 0 and data_address(wkv) % 16 == 0
    rec = pick(max(T, 1), K, N, aligned, version)
    if out is None:
        out = cuda.device_array((T, N), dtype=np.uint16, stream=stream)
    else:
        out = as_device_array(out, "out")
        _check_bf16_matrix(out, "out", "[T, N]")
        if tuple(out.shape) != (T, N):
            raise ValueError(f"out must be [T, N] = {(T, N)}, got {tuple(out.shape)}")
    if not (T and N):
        return NoLaunch(rec.name, out)
    return rec.prepare(x, wkv, out, stream=stream)


def project(x, wkv, out=None, *, stream=0, version=None):
    """kv = bf16(x @ wkv^T) on the device; returns kv (see the module doc)."""
    return prepare_project(x, wkv, out, stream=stream, version=version)()
