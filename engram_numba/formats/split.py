"""One GGUF model in one file or in the shards of llama.cpp's `gguf-split` (docs/formats.md, section 3).

    c = open_gguf_container("model-00001-of-00007.gguf")   # any shard, or the folder, or one file
    c.kv, c.kv_types     metadata of the first shard (the model's keys live there)
    c.tensors            every tensor of every shard, TensorInfo.shard says which file holds it
    c.tensor_bytes(info) its bytes, a zero-copy view of that shard's map

Shards are found from the `-NNNNN-of-MMMMM.gguf` name; every one must exist and is checked:
`split.no` equals its number in the name minus one, `split.count` equals M in every shard,
`split.tensors.count` is the same in every shard and equals the tensors counted over all of
them, no tensor appears in two shards, and every shard names the same `general.architecture`.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from .errors import (BadMetadataError, BadSplitNumberError, EngramFileError, MissingShardError,
                     MixedSplitError, NotARegularFileError)
from .gguf import GGUFFile, TensorInfo, check_regular_file

SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


def shard_paths(path) -> list[Path] | None:
    """The shard files of the split that `path` (a shard's name) belongs to, in order; None when
    the name is not a shard's."""
    p = Path(path)
    m = SHARD_NAME.match(p.name)
    if m is None:
        return None
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise BadSplitNumberError(f"{p}: shard number {int(m['no'])} of {count} in the file name is not valid")
    # one listing of the folder, not `count` stat() calls: a name's count is checked against the
    # shards that exist before anything is built from it
    try:
        entries = os.listdir(p.parent if str(p.parent) else ".")
    except OSError:
        entries = None
    if entries is not None:
        tail = f"-of-{count:05d}.gguf"
        present = {int(e[len(m["prefix"]) + 1:len(m["prefix"]) + 6]) for e in entries
                   if e.startswith(m["prefix"] + "-") and e.endswith(tail) and SHARD_NAME.match(e)
                   and SHARD_NAME.match(e)["prefix"] == m["prefix"]}
        if len(present) < count:
            missing = [k for k in range(1, min(count, len(present) + 4) + 1) if k not in present][:3]
            n_missing = count - len(present)
            names = ", ".join(f"{m['prefix']}-{k:05d}-of-{count:05d}.gguf" for k in missing)
            raise MissingShardError(
                f"split GGUF {p.parent / m['prefix']}-*-of-{count:05d}.gguf: {n_missing:,} of {count:,} "
                f"shards missing: {names}{', ...' if n_missing > len(missing) else ''}")
    return [p.with_name(f"{m['prefix']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]


def splits_in_folder(folder: Path) -> dict[tuple[str, int], list[Path]]:
    """(prefix, shard count) -> the shard files present, for every split in `folder`."""
    out: dict[tuple[str, int], list[Path]] = {}
    for entry in sorted(os.listdir(folder)):
        m = SHARD_NAME.match(entry)
        if m:
            out.setdefault((m["prefix"], int(m["count"])), []).append(folder / entry)
    return out


def _split_int(f: GGUFFile, key: str) -> int | None:
    v = f.kv.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadMetadataError(f"{f.path}: {key} must be an integer, got {f.kv_types[key]} {v!r}")
    return v


class GGUFContainer:
    """The tensors and metadata of one GGUF model, in one file or in N shards (every one mapped).

    path      what was opened (the file, or the first shard of a split)
    shards    the GGUFFile of each shard, in order (one for a single file)
    split     True for a split model
    """

    def __init__(self, files: list[GGUFFile], split: bool):
        self.shards = files
        self.split = split
        first = files[0]
        self.path = first.path
        self.kv, self.kv_types = first.kv, first.kv_types
        self.version, self.alignment, self.data_offset = first.version, first.alignment, first.data_offset
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in f.tensors.items():
                if name in self.tensors:
                    other = files[self.tensors[name].shard].path
                    raise MixedSplitError(
                        f"tensor {name!r} appears in two shards, {other} and {f.path}: the shards belong to "
                        "different splits")
                self.tensors[name] = info
        self.checks: list[dict] = []

    @property
    def shard_paths(self) -> list[str]:
        return [f.path for f in self.shards]

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """uint8 [nbytes], a view of the shard's map (no copy)."""
        buf = self.shards[info.shard].buf
        if buf is None:
            raise EngramFileError(f"{self.path}: the model is closed")
        return buf[info.offset:info.offset + info.nbytes]

    def close(self) -> None:
        for f in self.shards:
            f.close()


def _open_split(paths: list[Path]) -> GGUFContainer:
    missing = [p for p in paths if not p.exists()]
    if missing:
        names = ", ".join(p.name for p in missing)
        raise MissingShardError(
            f"split GGUF {paths[0].parent / SHARD_NAME.match(paths[0].name)['prefix']}-*-of-{len(paths):05d}.gguf: "
            f"{len(missing)} of {len(paths)} shards missing: {names}")
    for p in paths:
        check_regular_file(p, "shard")
    files = [GGUFFile(p, shard=i, what="shard") for i, p in enumerate(paths)]
    n = len(paths)
    first = files[0]
    count0, tensors0 = _split_int(first, SPLIT_COUNT), _split_int(first, SPLIT_TENSORS)
    arch0 = first.kv.get("general.architecture")
    total = sum(len(f.tensors) for f in files)
    for i, f in enumerate(files):
        no, count, tcount = _split_int(f, SPLIT_NO), _split_int(f, SPLIT_COUNT), _split_int(f, SPLIT_TENSORS)
        for key, v in ((SPLIT_NO, no), (SPLIT_COUNT, count), (SPLIT_TENSORS, tcount)):
            if v is None and n > 1:
                raise BadMetadataError(f"{f.path}: metadata key {key!r} is missing; every shard of a split GGUF "
                                       "carries split.no, split.count and split.tensors.count")
        if no is not None and no != i:
            raise BadSplitNumberError(
                f"{f.path}: split.no = {no}, but the file name makes it shard {i + 1} of {n} (split.no {i}, 0-based)")
        if count is not None and count != n:
            raise MixedSplitError(
                f"{f.path}: split.count = {count}, but the file name (and the first shard) say {n} shards: "
                "the shards belong to different splits")
        if count0 is not None and count != count0:
            raise MixedSplitError(f"{f.path}: split.count = {count}, the first shard says {count0}")
        if tcount is not None and tcount != tensors0:
            raise MixedSplitError(
                f"{f.path}: split.tensors.count = {tcount}, the first shard says {tensors0}: the shards belong to "
                "different splits")
        arch = f.kv.get("general.architecture")
        if i and arch is not None and arch != arch0:
            raise MixedSplitError(f"{f.path}: general.architecture = {arch!r}, the first shard says {arch0!r}")
    if tensors0 is not None and tensors0 != total:
        raise MixedSplitError(
            f"{first.path}: split.tensors.count = {tensors0}, but the {n} shards hold {total} tensors: the shards "
            "belong to different splits, or one is incomplete")
    c = GGUFContainer(files, split=True)
    c.checks.append({"check": f"split: {n} shards, split.no 0..{n - 1} as named, split.count {n}, "
                              f"split.tensors.count {total}", "ok": True})
    return c


def open_gguf_container(path) -> GGUFContainer:
    """A single GGUF, any shard of a split GGUF (all shards are opened), or a folder holding one
    split or one GGUF file."""
    p = Path(path)
    if p.is_dir():
        splits = splits_in_folder(p)
        if len(splits) > 1:
            desc = "; ".join(f"{pre}-*-of-{cnt:05d}.gguf ({len(fs)} present)" for (pre, cnt), fs in splits.items())
            raise MixedSplitError(f"folder {p} holds shards of {len(splits)} different splits: {desc}; "
                                  "open one of them by a shard's name")
        if splits:
            (prefix, count), present = next(iter(splits.items()))
            return _open_split(shard_paths(present[0]))
        ggufs = sorted(e for e in os.listdir(p) if e.endswith(".gguf"))
        if len(ggufs) == 1:
            return open_gguf_container(p / ggufs[0])
        if not ggufs:
            raise NotARegularFileError(f"{p} is a directory holding no .gguf file")
        raise NotARegularFileError(f"folder {p} holds {len(ggufs)} GGUF files ({', '.join(ggufs[:4])}"
                                   f"{', ...' if len(ggufs) > 4 else ''}); open one of them")
    shards = shard_paths(p)
    if shards is not None:
        check_regular_file(p, "shard")
        return _open_split(shards)
    f = GGUFFile(p)
    count = _split_int(f, SPLIT_COUNT)
    if count is not None and count > 1:
        raise BadSplitNumberError(
            f"{p}: split.count = {count}, so this is one shard of a split GGUF, but its name does not end in "
            "-NNNNN-of-MMMMM.gguf, so the other shards cannot be found: keep gguf-split's file names")
    return GGUFContainer([f], split=False)


def write_split_gguf(path_prefix, kvs, shard_tensors, *, alignment: int = 32) -> list[Path]:
    """Write a split GGUF the way `gguf-split` lays it out: `<prefix>-0000k-of-0000N.gguf`, the
    model's metadata `kvs` in the first shard only, split.no / split.count / split.tensors.count
    in every shard. shard_tensors: one list of GGUFTensorSpec per shard. Returns the paths."""
    from .gguf import write_gguf_raw
    n = len(shard_tensors)
    total = sum(len(ts) for ts in shard_tensors)
    prefix = Path(path_prefix)
    paths = []
    for i, tensors in enumerate(shard_tensors):
        split_kvs = [(SPLIT_NO, "u16", i), (SPLIT_COUNT, "u16", n), (SPLIT_TENSORS, "i32", total)]
        shard_kvs = (list(kvs) if i == 0 else []) + split_kvs
        if alignment != 32:
            shard_kvs.append(("general.alignment", "u32", alignment))
        p = prefix.with_name(f"{prefix.name}-{i + 1:05d}-of-{n:05d}.gguf")
        write_gguf_raw(p, shard_kvs, tensors, alignment=alignment)
        paths.append(p)
    return paths
