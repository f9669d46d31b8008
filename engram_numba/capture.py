"""Captures: the arrays a pipeline run kept at its named points, plus what the run was.

    cap = pipe.run(tokens)          # a Capture: name -> numpy array, and cap.meta
    cap["L1.gate.gate"]             # [T, hc] fp32
    cap.layer(1)["gate.gate"]       # the same, without the layer prefix
    cap.save("run.npz"); Capture.load("run.npz")
    cap.save("run.safetensors")     # the same, as safetensors (bf16 points stored as BF16)

Names: `tokens.ids`, `tokens.mask`, then `L{layer_id}.{point}` for the points of
`engram_numba.pipeline.POINTS`. Names (and `names_filter`s) may be glob patterns ("L1.gate.*").

Saving picks the format by the file's suffix: `.safetensors` writes every array as a tensor of
the same name (the bf16-word points `rows.bf16`, `proj.kv`, `gate.key`, `gate.value` as BF16,
everything else in its own dtype) and the meta as JSON in the header's `__metadata__`
(key "engram_numba.meta"); anything else is a compressed `.npz`. `Capture.load` reads both
(by content, whatever the suffix). A safetensors capture that holds `L{id}.highway.in` and
`tokens.ids` is also a highway file (`engram_numba.load_highway`).
"""
from __future__ import annotations

import fnmatch
import json
import re
from typing import Callable, Mapping

import numpy as np

from .formats.errors import EngramFileError

INPUT_POINTS = ("tokens.ids", "tokens.mask")
POINTS = ("hash.ids", "rows.raw", "rows.bf16", "proj.kv", "gate.key", "gate.value",
          "highway.in", "gate.dot", "gate.gate", "highway.out")
OBSERVE_ONLY = ("tokens.ids", "tokens.mask", "gate.dot", "gate.gate", "highway.out")
# Points whose uint16 arrays are bf16 words (stored as BF16 in safetensors)
BF16_POINTS = ("rows.bf16", "proj.kv", "gate.key", "gate.value")
SAFETENSORS_META_KEY = "engram_numba.meta"


class CaptureFileError(EngramFileError, ValueError):
    """A file `Capture.load` cannot take: not a capture, or a damaged one (the message says which)."""


_POINT_NAME = re.compile(r"^(tokens\.(ids|mask)|L\d{1,9}\.[a-z_]+\.[a-z_0-9]+)$")
def _check_point_name(name: str, path) -> None:
    if not _POINT_NAME.match(name):
        raise CaptureFileError(f"{path}: array {name[:80]!r} is not a capture point name (tokens.ids, "
                               "L{layer}.{point}): not a capture")


def _meta(meta, path) -> dict:
    if not isinstance(meta, dict):
        raise CaptureFileError(f"{path}: the capture meta is a JSON {type(meta).__name__}, not an object")
    return meta


def point_names(layer_ids) -> list[str]:
    """Every capture point of a model, in firing order. `layer_ids`: the engram layer ids, or a
    model (anything `load_model` returns) or its config."""
    from ._argcheck import need_int_list
    cfg = getattr(layer_ids, "config", layer_ids)
    layer_ids = getattr(cfg, "layer_ids", layer_ids)
    if isinstance(layer_ids, (str, bytes)) or not hasattr(layer_ids, "__iter__"):
        raise TypeError(f"point_names takes a model, its config or a list of layer ids (layer_ids must be a list of "
                        f"integers), got {type(layer_ids).__name__} {str(layer_ids)[:40]!r}")
    layer_ids = need_int_list(layer_ids, "layer_ids")
    return list(INPUT_POINTS) + [f"L{lid}.{p}" for lid in layer_ids for p in POINTS]


def short_name(name: str) -> str:
    """'L1.gate.gate' -> 'gate.gate' (input points are returned as they are)."""
    return name.split(".", 1)[1] if name.startswith("L") and "." in name else name


def suggest(name: str, known) -> str:
    """A hint naming the points that `name` probably meant (layer-prefixed forms, near names)."""
    known = list(known)
    short = short_name(name)
    same_point = [k for k in known if short_name(k) == short and k != name]
    if same_point:
        return f"; did you mean {', '.join(repr(k) for k in same_point)}?"
    import difflib
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if close:
        return f"; did you mean {', '.join(repr(k) for k in close)}?"
    return f"; points are e.g. {known[:len(POINTS) + 2]}"


def is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def match_names(spec, known, what: str = "names_filter") -> Callable[[str], bool]:
    """A predicate from a names filter: None (everything), a name or glob pattern, a list of them,
    or a predicate. A name or pattern that matches no point of `known` is an error (a typo would
    otherwise capture nothing, silently)."""
    if spec is None:
        return lambda name: True
    if callable(spec):
        return spec
    if isinstance(spec, str):
        patterns = [spec]
    else:
        try:
            patterns = list(spec)
        except TypeError:
            raise TypeError(f"{what} must be a name, a glob pattern, a list of them or a predicate, "
                            f"got {type(spec).__name__}") from None
    known = list(known)
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"{what} entries must be strings, got {type(p).__name__} {p!r}")
        if not any(fnmatch.fnmatchcase(k, p) for k in known):
            raise KeyError(f"{what} {p!r} matches no capture point{suggest(p, known)}")
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


class Capture(Mapping):
    """Arrays captured at named points of one run, plus what the run was (`meta`)."""

    def __init__(self, arrays: dict | None = None, meta: dict | None = None):
        self._arrays: dict[str, np.ndarray] = dict(arrays or {})
        self.meta: dict = dict(meta or {})

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._arrays[name]
        except KeyError:
            raise KeyError(f"no capture named {name!r}{suggest(name, self._arrays) if self._arrays else ''} "
                           f"(captured: {len(self._arrays)} points)") from None

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        head = ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in list(self._arrays.items())[:4])
        more = f", ... ({len(self) - 4} more)" if len(self) > 4 else ""
        return f"Capture({head}{more}; meta keys {sorted(self.meta)})"

    def select(self, names_filter) -> "Capture":
        """A Capture of the points matching `names_filter` (a name, glob, list or predicate)."""
        keep = match_names(names_filter, self._arrays)
        return Capture({k: v for k, v in self._arrays.items() if keep(k)}, self.meta)

    def save(self, path) -> None:
        """Write every array and the meta to one file: `.safetensors` by its suffix, else `.npz`."""
        arrays = {k: np.ascontiguousarray(v) for k, v in self._arrays.items()}
        if str(path).endswith(".safetensors"):
            from .formats.safetensors import write_arrays
            bf16 = [k for k, v in arrays.items() if v.dtype == np.uint16 and short_name(k) in BF16_POINTS]
            write_arrays(path, arrays, {SAFETENSORS_META_KEY: json.dumps(self.meta, default=str),
                                             "format": "engram-capture"}, bf16_names=bf16)
            return
        # through a file object: numpy would append ".npz" to a name with another suffix
        with open(path, "wb") as f:
            np.savez_compressed(f, __meta__=np.array(json.dumps(self.meta, default=str)), **arrays)

    @classmethod
    def load(cls, path) -> "Capture":
        """Read a capture written by `save` (.npz or .safetensors, told apart by content). Anything
        else (an empty or text file, a cut zip, a bare .npy, a statistics or highway file) is a
        `CaptureFileError` naming the file and what is wrong."""
        from ._argcheck import need_path
        from .formats.errors import EngramFileError
        from .formats.gguf import check_regular_file
        need_path(path)
        try:
            size = check_regular_file(path, "capture file").st_size
            with open(path, "rb") as f:
                head = f.read(8)
        except EngramFileError as exc:
            raise CaptureFileError(str(exc)) from None
        except OSError as exc:
            raise CaptureFileError(f"{path}: cannot be read: {exc.strerror or exc}") from None
        if size == 0:
            raise CaptureFileError(f"{path}: the file is empty, not a capture")
        if head.startswith(b"PK"):
            return cls._load_npz(path, size)
        if head.startswith(b"\x93NUMPY"):
            raise CaptureFileError(f"{path}: a bare .npy array, not a capture (Capture.save writes .npz or "
                                   ".safetensors)")
        if len(head) == 8 and int.from_bytes(head, "little") + 8 <= size:
            with open(path, "rb") as f:
                f.seek(8)
                brace = f.read(1)
            if brace == b"{":
                return cls._load_safetensors(path)
        raise CaptureFileError(f"{path}: not a capture: neither a .npz (zip) nor a safetensors file")

    @classmethod
    def _load_safetensors(cls, path) -> "Capture":
        from .formats.errors import EngramFileError
        from .formats.jsonsafe import load_json
        from .formats.safetensors import SafetensorsFile
        try:
            st = SafetensorsFile(path, what="capture file")
        except EngramFileError as exc:
            raise CaptureFileError(str(exc)) from None
        try:
            if SAFETENSORS_META_KEY not in st.metadata:
                kind = st.metadata.get("format")
                hint = " (a highway file: engram_numba.load_highway reads it)" if kind == "engram-highway" else ""
                raise CaptureFileError(f"{path}: a safetensors file without the {SAFETENSORS_META_KEY!r} metadata "
                                       f"entry: not a capture{hint}")
            meta = _meta(load_json(st.metadata[SAFETENSORS_META_KEY], f"{path}: {SAFETENSORS_META_KEY}",
                                   CaptureFileError, what="meta"), path)
            for name in st.tensors:
                _check_point_name(name, path)
            try:
                arrays = {name: np.array(st.raw(name)) for name in st.tensors}
            except EngramFileError as exc:
                raise CaptureFileError(str(exc)) from None
        finally:
            st.close()
        return cls(arrays, meta)

    @classmethod
    def _load_npz(cls, path, size: int) -> "Capture":
        from .formats.jsonsafe import load_json
        from .formats.npz import open_npz, read_member
        zf, members = open_npz(path, CaptureFileError)
        with zf:
            if "__state__" in members:
                raise CaptureFileError(f"{path}: a statistics file (StreamingGateStats.save), not a capture; "
                                       "StreamingGateStats.load reads it")
            if "__meta__" not in members:
                raise CaptureFileError(f"{path}: an .npz without a __meta__ entry: not a capture written by "
                                       "Capture.save")
            for key in members:
                if key != "__meta__":
                    _check_point_name(key, path)
            arrays = {key: read_member(zf, info, path, CaptureFileError) for key, info in members.items()}
        meta_arr = arrays.pop("__meta__")
        if meta_arr.shape != () or meta_arr.dtype.kind != "U":
            raise CaptureFileError(f"{path}: __meta__ is {meta_arr.dtype}{list(meta_arr.shape)}, not one JSON string")
        meta = _meta(load_json(str(meta_arr), f"{path}: __meta__", CaptureFileError, what="meta"), path)
        return cls(arrays, meta)

    @property
    def token_strings(self) -> list[str] | None:
        """The token strings the run carried in its meta (a run from text, or with a tokenizer), else None."""
        s = self.meta.get("token_strings")
        return list(s) if isinstance(s, list) else None

    @property
    def highway_is_synthetic(self) -> bool:
        return str(self.meta.get("highway", "")).startswith("synthetic")

    def layer(self, layer_id: int) -> dict[str, np.ndarray]:
        """This layer's captures, keyed by point name without the layer prefix."""
        from ._argcheck import need_int
        prefix = f"L{need_int(layer_id, 'layer_id')}."
        return {k[len(prefix):]: v for k, v in self._arrays.items() if k.startswith(prefix)}
