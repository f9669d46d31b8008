"""Launchers of the gate and highway update on the GPU (docs/math.md, "Gate").

    prepare_gate(highway, kv, w, *, token_mask=None, residual="fp32", eps=1e-20, dot_out=None,
                 gate_out=None, stream=0, version=None, layout=None, tps=None) -> PreparedLaunch
    run_gate(...same...) -> None          (the highway is updated in place)

highway  [T, hc, dim] fp32 device array, C-contiguous, updated in place (hc 1..4, dim % 8 == 0)
kv       [T, (hc+1)*dim] uint16 bf16 words: hc keys, then the shared value
w        [hc, dim] fp32: q_weight * k_weight (multiplied in fp32 by the caller)
token_mask [T] uint8/bool, optional: 0 = masked token (gate 0, its streams not written)
residual "fp32" (no rounding) or "bf16" (h rounded to bf16 first, the result rounded to bf16)
eps      RMS epsilon (1e-20 in the release), finite and >= 0
dot_out, gate_out  [T, hc] fp32, optional: written for every (t, c), masked tokens included
version  a record name of the gate stage ("gate_v1" .. "gate_v4"); None: the default
layout   "token" / "stream" for v2 and v3 (see `cuda.launch_config`); tps threads per stream
         (gate_v4: threads a block = chunks a slice, `cuda.geometry_v4`; it ignores layout)

    prepare_gate_pair(highway, kv_a, w_a, kv_b, w_b, *, token_mask=None, residual="fp32", eps=1e-20,
                      dot_a=None, gate_a=None, dot_b=None, gate_b=None, stream=0, layout=None, tps=None,
                      version="gate_v3")
        -> PreparedLaunch "gate_v3[2 layers]" (or "gate_v4[2 layers]"): layer a's gate (kv_a, w_a,
        dot_a, gate_a), then layer b's on the result, in one launch; bit-identical to two launches
        of that version (same layout and tps) in sequence

Every argument is checked before anything runs: a bad one raises TypeError/ValueError naming it
and leaves the highway untouched.
"""
from __future__ import annotations

import numpy as np

from ...config import MAX_HC, NORM_EPS
from ...device.checks import check_array, check_choice
from ...device.devarray import as_device_array, data_address
from ...device.intrinsics import SIMULATOR
from .. import registry
from . import records  # noqa: F401  (registers the gate kernels)
from .cuda import LAYOUTS, launch_config, prepare_pair
from .reference import RESIDUALS, check_eps

PAIR_VERSIONS = ("gate_v3", "gate_v4")     # the records with a two-layer form


def context(T: int, hc: int, dim: int, aligned: bool, layout=None, tps=None) -> dict:
    return {"T": int(T), "hc": int(hc), "dim": int(dim), "aligned": bool(aligned), "simulator": SIMULATOR,
            "layout": layout, "tps": tps}


def _check_highway(highway):
    highway = as_device_array(highway, "highway")
    check_array(highway, "highway", np.float32, 3, doc="[T, hc, dim]")
    T, hc, dim = (int(s) for s in highway.shape)
    if not 1 <= hc <= MAX_HC:
        raise ValueError(f"highway's hc (axis 1) must be in 1..{MAX_HC}, got {hc}")
    if dim <= 0 or dim % 8:
        raise ValueError(f"highway's dim (axis 2) must be a positive multiple of 8, got {dim}")
    return highway, T, hc, dim


def _check_mask(token_mask, T):
    mask = as_device_array(token_mask, "token_mask", optional=True)
    if mask is not None:
        if mask.dtype == np.bool_:
            mask = mask.view(np.uint8)
        check_array(mask, "token_mask", np.uint8, shape=(T,), what="uint8 or bool", doc="[T]")
    return mask


def _check_layer(kv, w, T, hc, dim, sfx=""):
    """A layer's kv and w (names suffixed by `sfx` in errors)."""
    kv = as_device_array(kv, "kv" + sfx)
    check_array(kv, "kv" + sfx, np.uint16, shape=(T, (hc + 1) * dim), what="uint16 (bf16 words)",
                doc="[T, (hc+1)*dim]")
    w = as_device_array(w, "w" + sfx)
    check_array(w, "w" + sfx, np.float32, shape=(hc, dim), doc="[hc, dim]")
    return kv, w


def _check_outs(outs: dict, T, hc):
    """Optional dot/gate outputs [T, hc] fp32, by name."""
    checked = {}
    for name, arr in outs.items():
        arr = as_device_array(arr, name, optional=True)
        if arr is not None:
            check_array(arr, name, np.float32, shape=(T, hc), doc="[T, hc]")
        checked[name] = arr
    return checked


def prepare_gate_pair(highway, kv_a, w_a, kv_b, w_b, *, token_mask=None, residual: str = "fp32",
                      eps: float = NORM_EPS, dot_a=None, gate_a=None, dot_b=None, gate_b=None, stream=0,
                      layout: str | None = None, tps: int | None = None, version: str = "gate_v3"):
    """Two layers' gates on one highway in one launch (see the module doc): `version`'s arithmetic
    (gate_v3 or gate_v4), so the data must be 16-byte aligned and dim small enough for it
    (ValueError otherwise, before any launch). One token mask serves both layers."""
    check_choice(version, "version", PAIR_VERSIONS)
    check_choice(residual, "residual", RESIDUALS)
    check_choice(layout, "layout", LAYOUTS, optional=True)
    eps = check_eps(eps)
    highway, T, hc, dim = _check_highway(highway)
    kv_a, w_a = _check_layer(kv_a, w_a, T, hc, dim, "_a")
    kv_b, w_b = _check_layer(kv_b, w_b, T, hc, dim, "_b")
    mask = _check_mask(token_mask, T)
    oa = _check_outs({"dot_a": dot_a, "gate_a": gate_a}, T, hc)
    ob = _check_outs({"dot_b": dot_b, "gate_b": gate_b}, T, hc)
    launch_config(max(T, 1), hc, dim, 3, layout, tps)   # checks tps
    return prepare_pair(registry.get("gate", version), highway, kv_a, w_a, kv_b, w_b, mask=mask, **oa, **ob,
                        residual_bf16=residual == "bf16", eps=eps, layout=layout, tps=tps, stream=stream)


def prepare_gate(highway, kv, w, *, token_mask=None, residual: str = "fp32", eps: float = NORM_EPS,
                 dot_out=None, gate_out=None, stream=0, version: str | None = None,
                 layout: str | None = None, tps: int | None = None):
    """Validate the gate's arguments once; returns a PreparedLaunch (see the module doc)."""
    check_choice(residual, "residual", RESIDUALS)
    if version is not None:
        registry.get("gate", version)
    check_choice(layout, "layout", LAYOUTS, optional=True)
    eps = check_eps(eps)

    highway, T, hc, dim = _check_highway(highway)
    kv, w = _check_layer(kv, w, T, hc, dim)
    mask = _check_mask(token_mask, T)
    outs = _check_outs({"dot_out": dot_out, "gate_out": gate_out}, T, hc)

    launch_config(max(T, 1), hc, dim, 2, layout, tps)   # checks tps
    aligned = all(data_address(a) % 16 == 0 for a in (highway, kv, w))
    rec = (registry.get("gate", version) if version is not None
           else registry.default("gate", context(max(T, 1), hc, dim, aligned, layout, tps)))
    return rec.prepare(highway, kv, w, mask=mask, dot_out=outs["dot_out"], gate_out=outs["gate_out"],
                       residual_bf16=residual == "bf16", eps=eps, layout=layout, tps=tps, stream=stream)


def run_gate(highway, kv, w, **kwargs) -> None:
    """Apply the gate and highway update in place; returns None (arguments as `prepare_gate`)."""
    prepare_gate(highway, kv, w, **kwargs)()
    return None
