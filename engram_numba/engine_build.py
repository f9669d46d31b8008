"""What `EngramV41` holds on the device and how it gets there: each layer's weights (wkv in the
encoding the projection reads, the gate weight, the table where its placement puts it) and the
fixed workspaces a call's rows, kv, dot and gate live in.

Everything here is settled and checked before the first byte is uploaded (a refused build
allocates nothing); uploads go through `device.upload.Uploader` (pinned, chunked, overlapped).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from numba import cuda

from .device.intrinsics import SIMULATOR
from .device.upload import Uploader, check_file_region
from .placement import host_tables_for
from .stages import registry
from .stages.rows.encodings import ROW_VALUES, get_encoding

WKV_FORMATS = ("bf16", "q2k", "fp8", "q2k_r")   # wkv_format choices; None = the most compact the file offers
RESIDENT_WKV = ("q2k", "fp8", "q2k_r")          # encodings the projection reads without decoding to bf16 first
# q2k_r: a Q2_K wkv re-laid out on the device at build (same bytes; stages/proj/q2k_r.py)


def check_versions(versions) -> dict:
    """{stage: record name} for the cuda stages, checked against the kernel registry."""
    from .stages import catalog  # noqa: F401  (every stage's records registered)
    versions = dict(versions or {})
    for stage, name in versions.items():
        if stage not in ("rows", "proj", "gate"):
            raise ValueError(f"kernel versions are chosen per cuda stage (rows, proj, gate), got stage {stage!r}")
        if name is not None:
            registry.get(stage, name)
    return versions


def versions_keyword(versions, cuda_versions, where: str, stacklevel: int = 3):
    """The kernel versions given as `versions=` or (deprecated) `cuda_versions=` -> (the dict or
    None, the keyword used); both given is an error."""
    if cuda_versions is None:
        return versions, "versions"
    if versions is not None:
        raise TypeError(f"{where}: give versions= only (cuda_versions= is its deprecated name)")
    warnings.warn(f"{where}(cuda_versions=...) is deprecated: the keyword is versions= (as in EngramV41)",
                  DeprecationWarning, stacklevel=stacklevel)
    return cuda_versions, "cuda_versions"


@dataclass
class EngramLayerWeights:
    """One engram layer's weights on the device."""

    layer_id: int
    wkv: object          # wkv_encoding "bf16": [N, K] uint16 bf16 words (N = dim*(hc+1), K = n_hash_cols*256);
                         # "q2k": [N, K/256*84] uint8 Q2_K blocks; "fp8": [N, K] uint8 e4m3 codes;
                         # "q2k_r": [ceil(N/16), ceil(K/512)*2688] uint8, the Q2_K blocks re-laid out
    w_gate: object       # [hc, dim] fp32, q_weight * k_weight (the gate's per-stream weight)
    n_rows: int          # rows of this layer's table
    encoding: str = "q2k"  # the table's row encoding (engram_numba.stages.rows.encodings)
    row_bytes: int = 84    # bytes of one raw row in that encoding
    table: object = None  # [rows, row_bytes] uint8 raw rows, when device_tables=True
    table_scales: object = None  # fp8 with separate scales: table is codes [rows, 256], these [rows, 8]
    wkv_encoding: str = "bf16"   # how `wkv` is held on the device (the projection's weight encoding)
    wkv_scales: object = None    # fp8: [ceil(N/32), K/32] uint8 e8m0 tile scales; else None
    placement: str = "device"    # where `table` lives: "device", "host" (pinned mapped memory: `table`
                                 # is its device view, read through UVA) or "mmap" (table None)

    @property
    def nbytes(self) -> int:
        """Device bytes of this layer's weights (a host table's bytes are in host memory)."""
        tables = (self.table, self.table_scales) if self.placement == "device" else ()
        return sum(int(a.nbytes) for a in (self.wkv, self.wkv_scales, self.w_gate, *tables) if a is not None)


class LayerWorkspace:
    """One layer's fixed device buffers, sized for max_tokens once."""

    def __init__(self, max_tokens: int, cfg, row_bytes: int):
        C = cfg.n_hash_cols
        self.raw = cuda.device_array((max_tokens * C, row_bytes), dtype=np.uint8)          # staging
        self.ids = cuda.device_array(max_tokens * C, dtype=np.int64)                       # staging
        self.rows = cuda.device_array((max_tokens * C, ROW_VALUES), dtype=np.uint16)       # [T*C, 256]
        self.kv = cuda.device_array((max_tokens, cfg.proj_out), dtype=np.uint16)           # [T, N]
        self.dot = cuda.device_array((max_tokens, cfg.hc), dtype=np.float32)               # [T, hc]
        self.gate = cuda.device_array((max_tokens, cfg.hc), dtype=np.float32)              # [T, hc]
        self.rows_tokens = 0      # tokens whose rows are loaded (0 = none)
        self.kv_tokens = 0        # tokens whose kv is current
        self.gate_tokens = 0


def resolve_wkv_format(versions: dict, lid, lf, wkv_format) -> str:
    """The encoding layer `lid`'s wkv is held in (see `EngramV41`'s wkv_format); raises before any upload."""
    stored = lf.wkv_encoding
    proj = versions.get("proj")
    by_version = registry.get("proj", proj).encoding if proj else None
    if wkv_format is not None and wkv_format not in WKV_FORMATS:
        raise ValueError(f"wkv_format must be None or one of {WKV_FORMATS}, got {wkv_format!r}")
    if by_version is not None:
        if wkv_format is not None and wkv_format != by_version:
            raise ValueError(f"proj kernel {proj!r} reads {by_version} weights but wkv_format={wkv_format!r}")
        wkv_format = by_version
    if wkv_format is None:
        if stored == "q2k" and not SIMULATOR:
            return "q2k_r"      # on a GPU the re-laid-out Q2_K streams 16 bytes a load
        return stored if stored in RESIDENT_WKV else "bf16"
    if wkv_format == "q2k_r" and stored == "q2k":
        return wkv_format
    if wkv_format != "bf16" and wkv_format != stored:
        why = f"proj kernel {proj!r} reads {wkv_format} weights" if by_version else f"wkv_format={wkv_format!r}"
        raise ValueError(f"{why}, but layer {lid} stores its wkv as {stored} (nothing is re-quantised): "
                         f"use wkv_format='bf16' or None")
    return wkv_format


def check_layers(model, cfg, wkv_formats: dict) -> None:
    """Every layer's table, table scales and wkv checked for what the upload will need (shapes, dtypes,
    and a file-backed array's bytes still in its file) -> ValueError naming the layer and tensor,
    raised before anything is allocated on the device."""
    N, K = cfg.proj_out, cfg.proj_in
    for lid in cfg.layer_ids:
        lf = model.layers[lid]
        table, scales = lf.table, lf.table_scales
        enc = get_encoding(lf.table_encoding)
        if scales is not None and (enc.name != "fp8" or tuple(scales.shape) != (table.shape[0], 8)):
            raise ValueError(f"layer {lid}: table_scales {list(scales.shape)} needs an fp8 table of codes "
                             f"[rows, 256] and scales [rows, 8] (encoding {enc.name}, table {list(table.shape)})")
        width = enc.row_bytes if scales is None else 256
        if table.shape[1] != width:
            raise ValueError(f"layer {lid}: its {enc.name} table has {table.shape[1]} bytes a row, "
                             f"expected {width}")
        fmt = wkv_formats[lid]
        raw = getattr(lf, "wkv_raw", None)
        if fmt != "bf16":
            raw = np.asarray(raw)
            want = (N, K) if fmt == "fp8" else (N, K // 256 * 84)
            if raw.dtype != np.uint8 or raw.shape != want:
                raise ValueError(f"layer {lid}: a {'q2k' if fmt == 'q2k_r' else fmt} wkv must be uint8 "
                                 f"{list(want)}, got {raw.dtype} {list(raw.shape)}")
        if fmt == "fp8":
            sc = lf.wkv_scales
            want_s = (-(-N // 32), K // 32)
            if sc is None or np.asarray(sc).dtype != np.uint8 or np.asarray(sc).shape != want_s:
                raise ValueError(f"layer {lid}: an fp8 wkv needs wkv_scales uint8 {list(want_s)} (e8m0 per 32x32 "
                                 f"tile), got {None if sc is None else (np.asarray(sc).dtype, list(np.asarray(sc).shape))}")
        for arr, what in ((table, "table"), (scales, "table scales"), (raw, "wkv"),
                          (getattr(lf, "q_weight", None), "q_weight"), (getattr(lf, "k_weight", None), "k_weight")):
            check_file_region(arr, f"layer {lid} {what}")


def upload_wkv(cfg, lid, lf, fmt: str, uploader: Uploader, dest=None):
    """Upload layer `lid`'s projection in encoding `fmt` -> (device wkv, device scales or None).
    q2k_r: the Q2_K blocks go up as they are and are re-laid out on the device (into `dest`
    when given)."""
    N, K = cfg.proj_out, cfg.proj_in
    if fmt == "bf16":
        return uploader.upload(np.ascontiguousarray(lf.wkv_bf16(), dtype=np.uint16), f"layer {lid} wkv (bf16)"), None
    raw = np.asarray(lf.wkv_raw)
    if fmt == "q2k_r":
        from .stages.proj.cuda_gemv_q2kr import prepare_repack
        from .stages.proj.q2k_r import q2k_r_shape
        want = (N, K // 256 * 84)
        if raw.dtype != np.uint8 or raw.shape != want:
            raise ValueError(f"layer {lid}: a q2k wkv must be uint8 {list(want)}, got {raw.dtype} {list(raw.shape)}")
        blocks = uploader.upload(raw, f"layer {lid} wkv (q2k, re-laid out as q2k_r on the device)")
        packed = dest if dest is not None else cuda.device_array(q2k_r_shape(N, K), dtype=np.uint8)
        prepare_repack(blocks, packed, N, K)()
        cuda.synchronize()
        del blocks
        return packed, None
    want = (N, K // 256 * 84) if fmt == "q2k" else (N, K)
    if raw.dtype != np.uint8 or raw.shape != want:
        raise ValueError(f"layer {lid}: a {fmt} wkv must be uint8 {list(want)}, got {raw.dtype} {list(raw.shape)}")
    scales = None
    if fmt == "fp8":
        sc = lf.wkv_scales
        want_s = (-(-N // 32), K // 32)
        if sc is None or np.asarray(sc).dtype != np.uint8 or np.asarray(sc).shape != want_s:
            raise ValueError(f"layer {lid}: an fp8 wkv needs wkv_scales uint8 {list(want_s)} (e8m0 per 32x32 "
                             f"tile), got {None if sc is None else (np.asarray(sc).dtype, list(np.asarray(sc).shape))}")
        scales = uploader.upload(np.ascontiguousarray(sc), f"layer {lid} wkv scales")
    return uploader.upload(raw, f"layer {lid} wkv ({fmt})"), scales


def pair_buffer(cfg, wkv_formats: dict):
    """One device buffer for both layers' q2k_r wkv (decode projects both in one launch), or None."""
    if len(cfg.layer_ids) == 2 and all(f == "q2k_r" for f in wkv_formats.values()):
        from .stages.proj.q2k_r import q2k_r_shape
        nt, width = q2k_r_shape(cfg.proj_out, cfg.proj_in)
        return cuda.device_array((2 * nt, width), dtype=np.uint8)
    return None


def upload_layers(model, cfg, placement, wkv_formats: dict, wkv_pair, uploader: Uploader):
    """Every layer's weights where `placement` puts its table -> ({layer id: EngramLayerWeights},
    {layer id: [HostTable]} of the host-resident tables). Call `check_layers` first: it refuses
    bad shapes and short files before anything is allocated."""
    layers: dict[int, EngramLayerWeights] = {}
    host_tables: dict = {}
    for lid in cfg.layer_ids:
        lf = model.layers[lid]
        where = placement.layers[lid].placement
        w_gate = (np.asarray(lf.q_weight, np.float32) * np.asarray(lf.k_weight, np.float32)).astype(np.float32)
        table = lf.table
        enc = get_encoding(lf.table_encoding)
        scales = lf.table_scales                  # shapes checked by check_layers before any allocation
        dest = None
        if wkv_pair is not None:
            half = wkv_pair.shape[0] // 2
            li = cfg.layer_ids.index(lid)
            dest = wkv_pair[li * half:(li + 1) * half]
        wkv, wkv_scales = upload_wkv(cfg, lid, lf, wkv_formats[lid], uploader, dest)
        d_table = d_scales = None
        if where == "device":
            d_table = uploader.upload(table, f"layer {lid} table")
            d_scales = uploader.upload(scales, f"layer {lid} table scales") if scales is not None else None
        elif where == "host":
            held = host_tables[lid] = host_tables_for(lid, table, scales, uploader.stats)
            d_table = held[0].dev
            d_scales = held[1].dev if len(held) > 1 else None
        layers[lid] = EngramLayerWeights(
            layer_id=lid, wkv=wkv,
            w_gate=cuda.to_device(np.ascontiguousarray(w_gate)),
            n_rows=int(table.shape[0]), encoding=enc.name, row_bytes=enc.row_bytes,
            table=d_table, table_scales=d_scales,
            wkv_encoding=wkv_formats[lid], wkv_scales=wkv_scales, placement=where,
        )
    return layers, host_tables
