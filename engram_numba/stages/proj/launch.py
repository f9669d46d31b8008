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

from ...device.checks import check_array
from ...device.devarray import as_device_array, data_address
from ...device.intrinsics import SIMULATOR
from ...device.launch import NoLaunch
from .. import registry
from . import records  # noqa: F401  (registers the projection kernels)
from .cuda_common import check_bf16_matrix as _check_bf16_matrix




def device_cc():
    """Compute capability of the current device, None in numba's simulator. The Hopper kernels
    (wgmma, sm_90a) run only on 9.0: numba builds the arch-specific target for the device in use,
    and later architectures have no wgmma."""
    if SIMULATOR:
        return None
    return tuple(cuda.get_current_device().compute_capability)


def _output(out, T: int, N: int, stream):
    """out checked as device uint16 [T, N], or allocated on `stream` when None."""
    if out is None:
        return cuda.device_array((T, N), dtype=np.uint16, stream=stream)
    out = as_device_array(out, "out")
    _check_bf16_matrix(out, "out", "[T, N]")
    if tuple(out.shape) != (T, N):
        raise ValueError(f"out must be [T, N] = {(T, N)}, got {tuple(out.shape)}")
    return out


def context(T: int, K: int, N: int, aligned: bool, weight: str = "bf16", cc=None) -> dict:
    """What the default rules of the proj records look at (cc: the device's compute capability,
    taken from the current device when not given)."""
    return {"T": int(T), "K": int(K), "N": int(N), "aligned": bool(aligned), "simulator": SIMULATOR,
            "weight": weight, "cc": tuple(cc) if cc is not None else device_cc()}


def pick(T: int, K: int, N: int, aligned: bool = True, version: str | None = None,
         weight: str = "bf16") -> registry.KernelRecord:
    """The record that runs: `version` by name (it must read `weight`), else the default for this
    shape and weight encoding."""
    if version is not None:
        rec = registry.get("proj", version)
        if rec.encoding != weight:
            hint = ("prepare_project_q" if rec.encoding in QUANT_WEIGHTS else "prepare_project")
            raise ValueError(f"proj kernel {version!r} reads {rec.encoding} weights, not {weight} (use {hint}); "
                             f"{weight} versions are {registry.names('proj', weight)}")
        return rec
    return registry.default("proj", context(T, K, N, aligned, weight))


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
    out = _output(out, T, N, stream)
    if not (T and N):
        return NoLaunch(rec.name, out)
    return rec.prepare(x, wkv, out, stream=stream)


def project(x, wkv, out=None, *, stream=0, version=None):
    """kv = bf16(x @ wkv^T) on the device; returns kv (see the module doc)."""
    return prepare_project(x, wkv, out, stream=stream, version=version)()


# ---- weights in their file encoding ---------------------------------------------------------------

QUANT_WEIGHTS = ("q2k", "fp8", "q2k_r")
Q2K_BLOCK_VALUES, Q2K_BLOCK_BYTES, FP8_TILE = 256, 84, 32


def _check_u8_matrix(a, name: str, shape_doc: str):
    return check_array(a, name, np.uint8, 2, doc=shape_doc)


def check_quant_weight(wkv_raw, wkv_scales, K: int, weight: str, N: int | None = None):
    """Validate a q2k / fp8 / q2k_r weight for inputs of width K -> (device wkv_raw, device scales or
    None, N, aligned-for-the-fast-kernels). A q2k_r weight pads its rows to tiles of 16, so its N
    comes from the caller (the output's width). Raises before anything is launched or allocated."""
    if weight not in QUANT_WEIGHTS:
        raise ValueError(f"weight must be one of {QUANT_WEIGHTS} (bf16 weights: prepare_project), got {weight!r}")
    wkv_raw = as_device_array(wkv_raw, "wkv_raw")
    if weight == "q2k_r":
        from .q2k_r import q2k_r_shape
        if N is None:
            raise ValueError("a q2k_r weight holds its rows in tiles of 16: pass out [T, N] to say N")
        _check_u8_matrix(wkv_raw, "wkv_raw", "[ceil(N/16), ceil(K/512)*2688] (q2k_r)")
        if K % Q2K_BLOCK_VALUES or K == 0:
            raise ValueError(f"K = {K} must be a positive multiple of {Q2K_BLOCK_VALUES} for q2k_r weights")
        want = q2k_r_shape(N, K)
        if tuple(wkv_raw.shape) != want:
            raise ValueError(f"wkv_raw must be [ceil(N/16), ceil(K/512)*2688] = {list(want)} q2k_r bytes for "
                             f"N = {N}, K = {K}, got {list(wkv_raw.shape)}")
        if wkv_scales is not None:
            raise ValueError("q2k_r weights carry their scales inside the units: wkv_scales must be None")
        return wkv_raw, None, int(N), data_address(wkv_raw) % 16 == 0
    if weight == "q2k":
        _check_u8_matrix(wkv_raw, "wkv_raw", "[N, K/256*84] (Q2_K blocks)")
        if K % Q2K_BLOCK_VALUES or K == 0:
            raise ValueError(f"K = {K} must be a positive multiple of {Q2K_BLOCK_VALUES} for Q2_K weights "
                             "(one block = 256 values of a row)")
        want = K // Q2K_BLOCK_VALUES * Q2K_BLOCK_BYTES
        if wkv_raw.shape[1] != want:
            raise ValueError(f"wkv_raw must be [N, K/256*84] = [N, {want}] Q2_K blocks for K = {K}, "
                             f"got {tuple(wkv_raw.shape)}")
        if wkv_scales is not None:
            raise ValueError("Q2_K weights carry their scales inside the blocks: wkv_scales must be None")
        return wkv_raw, None, int(wkv_raw.shape[0]), data_address(wkv_raw) % 4 == 0
    _check_u8_matrix(wkv_raw, "wkv_raw", "[N, K] (e4m3 codes)")
    if K % FP8_TILE or K == 0:
        raise ValueError(f"K = {K} must be a positive multiple of {FP8_TILE} for FP8 weights (32 x 32 scale tiles)")
    if wkv_raw.shape[1] != K:
        raise ValueError(f"wkv_raw must be [N, K] = [N, {K}] e4m3 codes, got {tuple(wkv_raw.shape)}")
    N = int(wkv_raw.shape[0])
    if wkv_scales is None:
        raise ValueError("FP8 weights need wkv_scales: uint8 [ceil(N/32), K/32] e8m0 tile scales")
    wkv_scales = as_device_array(wkv_scales, "wkv_scales")
    _check_u8_matrix(wkv_scales, "wkv_scales", "[ceil(N/32), K/32] (e8m0)")
    want = (-(-N // FP8_TILE), K // FP8_TILE)
    if tuple(wkv_scales.shape) != want:
        raise ValueError(f"wkv_scales must be [ceil(N/32), K/32] = {list(want)} for N = {N}, K = {K}, "
                         f"got {list(wkv_scales.shape)}")
    return wkv_raw, wkv_scales, N, data_address(wkv_raw) % 8 == 0


def prepare_project_q(x, wkv_raw, wkv_scales=None, out=None, *, weight: str, stream=0, version=None):
    """Validate once and return a PreparedLaunch of kv = bf16(x @ W^T) with W read in its file
    encoding `weight` ("q2k" or "fp8", see the module doc). x: device uint16 [T, K]; out: optional
    device uint16 [T, N]. version: a proj record whose encoding is `weight`; None takes the
    default (records.py)."""
    x = as_device_array(x, "x")
    _check_bf16_matrix(x, "x", "[T, K]")
    T, K = x.shape
    n_out = None
    if weight == "q2k_r" and out is not None:
        out = as_device_array(out, "out")
        _check_bf16_matrix(out, "out", "[T, N]")
        n_out = int(out.shape[1])
    wkv_raw, wkv_scales, N, w_aligned = check_quant_weight(wkv_raw, wkv_scales, K, weight, n_out)
    aligned = data_address(x) % 16 == 0 and w_aligned
    rec = pick(max(T, 1), K, N, aligned, version, weight)
    out = _output(out, T, N, stream)
    if not (T and N):
        return NoLaunch(rec.name, out)
    return rec.prepare(x, wkv_raw, wkv_scales, out, stream=stream)


def project_q(x, wkv_raw, wkv_scales=None, out=None, *, weight: str, stream=0, version=None):
    """kv = bf16(x @ W^T) with W in its file encoding; returns kv (see prepare_project_q)."""
    return prepare_project_q(x, wkv_raw, wkv_scales, out, weight=weight, stream=stream, version=version)()


def prepare_wkv_to_bf16(wkv_raw, wkv_scales, out, *, weight: str, stream=0):
    """A launch decoding the whole weight into out (device uint16 [N, K] bf16 words): Q2_K with the
    rows stage's decoder (bit-identical to `wkv_bf16()`), FP8 exactly. For many tokens, where the
    bf16 GEMM beats streaming the weight once per 8 tokens."""
    out = as_device_array(out, "out")
    _check_bf16_matrix(out, "out", "[N, K]")
    N, K = out.shape
    wkv_raw, wkv_scales, n_w, _ = check_quant_weight(wkv_raw, wkv_scales, K, weight, N)
    if n_w != N:
        raise ValueError(f"out has {N} rows, the weight {n_w}")
    if weight == "q2k_r":
        from .cuda_gemv_q2kr import prepare_decode_q2k_r
        return prepare_decode_q2k_r(wkv_raw, out, stream=stream)
    if weight == "q2k":
        from ..rows.launch import prepare_decode
        blocks = N * (K // Q2K_BLOCK_VALUES)
        return prepare_decode(wkv_raw.reshape(blocks, Q2K_BLOCK_BYTES), out.reshape(blocks, Q2K_BLOCK_VALUES),
                              encoding="q2k", stream=stream)
    from .cuda_gemv_fp8 import prepare_dequant
    return prepare_dequant(wkv_raw, wkv_scales, out, stream=stream)
