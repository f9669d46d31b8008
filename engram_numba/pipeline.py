"""Run the Engram path stage by stage, with a backend per stage, capturing every boundary.

    pipe = Pipeline(model, backends={"rows": "cpu", "proj": "cuda", "gate": "reference"})
    cap = pipe.run(token_ids)                 # a Capture: name -> numpy array
    with pipe.hooks({"L1.rows.bf16": fn}):    # observe, or return a replacement
        cap2 = pipe.run(token_ids)
    en.diff(cap, cap2)

Stages, in order, for each engram layer in model order (one spelling everywhere):
    hash  token ids -> row ids              (CPU by design: backends="cuda" hashes with the @njit
                                            hasher and records hash="cpu")
    rows  row ids -> raw rows (the table's encoding) -> bf16 rows
    proj  bf16 rows -> kv = bf16(x @ wkv^T)
    gate  highway, kv -> gate, highway + gate * value

Capture points, in the order they fire. First the inputs of the whole step:
    tokens.ids    [T] int64        raw token ids
    tokens.mask   [T] bool         True = live token (all True when no mask was given)
then, per engram layer (prefix `L{layer_id}.`):
    hash.ids      [T, C] int64     row ids of this layer's table
    rows.raw      [T*C, row_bytes] uint8  the raw rows gathered for those ids, in the table's
                                   encoding (capture meta "encodings" names it: q2k = 84 bytes)
    rows.bf16     [T*C, 256] uint16 (bf16 words) decoded rows = projection input, row t*C + c
    proj.kv       [T, (hc+1)*dim] uint16  projection output
    gate.key      [T, hc, dim] uint16  the keys (a view of proj.kv)
    gate.value    [T, dim] uint16      the shared value (a view of proj.kv)
    highway.in    [T, hc, dim] fp32    streams before the update
    gate.dot      [T, hc] fp32         normalised dot before the signed square root
    gate.gate     [T, hc] fp32         sigmoid gate (0 for masked tokens)
    highway.out   [T, hc, dim] fp32    streams after the update
A hook on a point may return a replacement array of the same shape and dtype; what comes after
uses it (`hash.ids` to redirect a hash head, `rows.raw` to perturb the stored bytes, `rows.bf16`
to feed exact rows, `gate.key` to perturb the key). `tokens.*`, `gate.dot`, `gate.gate` and
`highway.out` are outputs: their hooks observe. Hook names and `names_filter` take names, glob
patterns ("L1.gate.*"), lists of them, or (names_filter) a predicate.

Blocks between engram layers are not modelled: by default the second layer's `highway.in` is
the first layer's `highway.out` (pass a dict {layer_id: highway} to feed each layer its own, or a
`HighwayFile` from `engram_numba.load_highway`: hidden states recorded from another engine, one
per engram layer, token ids included). Without a highway the run draws a synthetic one
(`synthetic_highway`), and its meta says so: meta["highway"] starts with "synthetic".

Text: `run(text="...")` tokenizes with the model's tokenizer (`engram_numba.text.tokenizer_for`);
whenever a tokenizer is found, meta["token_strings"] holds one string per token (up to 4096
tokens), which the tables, plots and diff show beside the ids.

Every path runs one layer step (`engram_numba.layer_step`). An array between two stages moves
between host and device only where the next stage's backend or a kept or hooked point needs it:
with the cuda backend for rows, proj and gate and a names filter (and hooks) that keep none of
`rows.*`, `proj.kv`, `gate.key`, `gate.value`, `highway.out` (nor a later layer's `highway.in`),
the rows, kv and highway stay on the device (rows gathered from the device tables) and only the
kept points come back; those that are not kept still fire (in `pipe.fired`) but carry no value.
Keep `proj.kv` and only the kv is copied back: the gate still reads the device copy.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Mapping

import numpy as np

from .capture import INPUT_POINTS, OBSERVE_ONLY, POINTS, Capture, match_names, point_names, short_name
from .highway import HighwayFile
from .backends import BACKEND_NAMES, HostBackend, LayerView, make_backends, resolve_backends
from .device.devarray import is_device_like
from .engine_build import check_versions, versions_keyword
from .layer_step import LayerStep, Value, run_layers
from .stages.gate import reference as _gate_ref
from .stages.hash.cpu import EngramHasher, check_token_ids
from .stages.registry import BACKENDS, STAGES

__all__ = ["Pipeline", "Capture", "POINTS", "INPUT_POINTS", "point_names", "synthetic_highway", "STAGES",
           "BACKENDS", "BACKEND_NAMES", "resolve_backends"]

DEFAULT_CHUNK_TOKENS = 4096   # run() without chunk_tokens: longer inputs run in chunks of this many tokens
SYNTHETIC_BLOCK = 256   # tokens per independently seeded block of the synthetic highway
SYNTHETIC_HIGHWAY = "synthetic (N(0,1), seed 0, no transformer blocks)"


def synthetic_highway(t0: int, t1: int, hc: int, dim: int, seed: int = 0) -> np.ndarray:
    """Tokens t0..t1-1 of the synthetic N(0, 1) highway [t1-t0, hc, dim] fp32.

    Drawn in float32, in blocks of SYNTHETIC_BLOCK tokens each seeded by (seed, block), so any
    chunk of a sequence is drawn on its own (bounded memory) and equals the same slice of the
    whole sequence's highway."""
    out = np.empty((t1 - t0, hc, dim), dtype=np.float32)
    for b in range(t0 // SYNTHETIC_BLOCK, -(-t1 // SYNTHETIC_BLOCK)):
        b0 = b * SYNTHETIC_BLOCK
        block = np.random.default_rng([seed, b]).standard_normal((SYNTHETIC_BLOCK, hc, dim), dtype=np.float32)
        lo, hi = max(t0, b0), min(t1, b0 + SYNTHETIC_BLOCK)
        out[lo - t0:hi - t0] = block[lo - b0:hi - b0]
    return out


# The pipeline -------------------------------------------------------------------------------

class _Points:
    """A run's capture points for the layer step: a point fetches its value to the host only when
    it is kept or hooked; a hook that ran makes its (possibly replaced) host array the value."""

    def __init__(self, pipe: "Pipeline", keep, parts: dict):
        self.pipe, self.keep, self.parts = pipe, keep, parts

    def wants(self, name: str) -> bool:
        return self.keep(name) or name in self.pipe._hooks

    def fire(self, name: str) -> None:
        self.pipe.fired.append(name)

    def __call__(self, name: str, value: Value) -> Value:
        if not self.wants(name):
            self.fire(name)
            return value
        out = self.pipe._point(name, value.host(), self.keep, self.parts)
        return Value(host=out) if name in self.pipe._hooks else value


class Pipeline:
    """hash -> rows -> proj -> gate for every engram layer of `model`, one backend per stage.

    backends: "reference" | "cpu" | "cuda" | "blas" | "deepseek_fp8" for every stage, or a dict
              {stage: backend} (stages not named take "reference"). "blas" and "deepseek_fp8" are
              projection backends (numpy's fp32 matmul, not bit-identical; DeepSeek's FP8 arithmetic
              for an FP8 wkv: docs/numerics.md); as one name each means cpu with it.
    residual: "fp32" (engine: FP32 highway) or "bf16" (DeepSeek's reference: bf16 residual).
    eps:      the gate's RMS epsilon (default: the model's), finite and >= 0 on every backend.
    versions: kernel record per cuda stage, e.g. {"rows": "q2k_v4", "proj": "gemv_v2",
              "gate": "gate_v3"} (`engram_numba.stages.catalog` lists them), as `EngramV41` takes
              them; by default each stage's default rule picks (in numba's simulator, the naive
              kernels). `cuda_versions=` is its deprecated name.
    tokenizer: a `Tokenizer` or a path to a tokenizer.json for `run(text=...)` and the token
              strings in capture meta; by default the model's own (`text.tokenizer_for`).
    """

    def __init__(self, model, backends="reference", residual: str = "fp32", eps: float | None = None,
                 versions: dict | None = None, tokenizer=None, *, cuda_versions: dict | None = None):
        if isinstance(model, (str, bytes, os.PathLike)):
            raise TypeError(f"model must be an opened model, got the path {model!r}: "
                            "Pipeline(engram_numba.load_model(path))")
        if not all(hasattr(model, a) for a in ("config", "hash_tables", "layers")):
            raise TypeError(f"model must be an opened model (engram_numba.load_model), got {type(model).__name__}")
        versions, keyword = versions_keyword(versions, cuda_versions, "Pipeline")
        if versions is not None and not isinstance(versions, Mapping):
            raise TypeError(f"{keyword} must be a dict of stage -> kernel name, got {type(versions).__name__}")
        if not isinstance(residual, str) or residual not in _gate_ref.RESIDUALS:
            raise ValueError(f"residual must be one of {_gate_ref.RESIDUALS}, got {residual!r}")
        self.model = model
        self.config = model.config
        self.residual = residual
        self.eps = _gate_ref.check_eps(self.config.eps if eps is None else eps)
        self.backends = self._resolve_backends(backends)
        if versions:
            check_versions(versions)
        self._impl: dict[str, HostBackend] = make_backends(self.backends.values(), model, versions)
        self._layers = {lid: LayerView(model, lid) for lid in self.config.layer_ids}
        self._hooks: dict[str, list[Callable]] = {}
        self._hook_log: list[str] = []
        self.fired: list[str] = []  # points that fired in the last run, in order
        self._tokenizer_arg = tokenizer
        self._tokenizer = None      # resolved on first use; False = the model has none
        if tokenizer is not None:
            from .text import tokenizer_for
            self._tokenizer = tokenizer_for(model, tokenizer)

    @property
    def tokenizer(self):
        """The tokenizer used for text and token strings (None when the model has none)."""
        if self._tokenizer is None:
            from .text import tokenizer_for
            try:
                self._tokenizer = tokenizer_for(self.model)
            except (ValueError, ImportError):
                # no usable tokenizer beside the model (none, unreadable, or one with more ids than the
                # token map): runs given ids still work, without token strings
                self._tokenizer = False
        return self._tokenizer or None

    def use_cuda_engine(self, engine) -> None:
        """Run the cuda stages on `engine` (an `EngramV41` of this model: its table placement,
        cache and workspaces) instead of one the pipeline builds with device tables."""
        if "cuda" not in self._impl:
            raise ValueError("use_cuda_engine: no stage of this pipeline runs on the cuda backend")
        if engine.model is not self.model and engine.config != self.config:
            raise ValueError("use_cuda_engine: the engine was built for another model")
        self._impl["cuda"].use_engine(engine)

    @property
    def cuda_engine(self):
        """The EngramV41 the cuda stages run on (None until one is built or given)."""
        return self._impl["cuda"].engine if "cuda" in self._impl else None

    def cuda_engine_for(self, n_tokens: int):
        """The EngramV41 the cuda stages run on, built now (with device tables) if there is none
        yet or the one there takes fewer than n_tokens tokens a call."""
        if "cuda" not in self._impl:
            raise ValueError("cuda_engine_for: no stage of this pipeline runs on the cuda backend")
        return self._impl["cuda"].engine_for(int(n_tokens))

    @property
    def cuda_kernels(self) -> dict:
        """{stage: kernel record name} the cuda stages ran last ({} without a cuda stage)."""
        return self._impl["cuda"].kernel_names() if "cuda" in self._impl else {}

    @property
    def device_resident(self) -> bool:
        """True when rows, proj and gate all run on the cuda backend (see the module doc)."""
        return all(self.backends[s] == "cuda" for s in ("rows", "proj", "gate"))

    @staticmethod
    def _resolve_backends(backends) -> dict[str, str]:
        return resolve_backends(backends)

    @property
    def point_names(self) -> list[str]:
        return point_names(self.config.layer_ids)

    @contextlib.contextmanager
    def hooks(self, mapping: Mapping[str, Callable]):
        """Attach hooks {point name or glob pattern: fn(array, name)} for the `with` block; removed
        after it, also when the block raises. A hook returning an array replaces the value."""
        known = self.point_names
        added = []
        try:
            for pattern, fn in mapping.items():
                if not callable(fn):
                    raise TypeError(f"hook for {pattern!r} must be callable, got {type(fn).__name__}")
                keep = match_names(pattern, known, what="hook name")
                for name in known:
                    if keep(name):
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
                if short_name(name) in OBSERVE_ONLY:
                    raise ValueError(f"hook on {name!r} returned a value, but {short_name(name)} is an output: "
                                     "observe only")
                out = np.asarray(out)
                if out.shape != value.shape or out.dtype != value.dtype:
                    raise ValueError(f"hook on {name!r} returned {out.dtype}{list(out.shape)}, expected "
                                     f"{value.dtype}{list(value.shape)}")
                value = out
                self._hook_log.append(f"{name}: {getattr(fn, '__qualname__', repr(fn))} replaced the value")
            elif f"{name}: {getattr(fn, '__qualname__', repr(fn))} observed" not in self._hook_log:
                self._hook_log.append(f"{name}: {getattr(fn, '__qualname__', repr(fn))} observed")
        if keep(name):
            parts.setdefault(name, []).append(np.array(value, copy=True))
        return value

    def default_highway(self, n_tokens: int, seed: int = 0) -> np.ndarray:
        """The synthetic N(0, 1) highway [T, hc, dim] fp32 a run uses when given none."""
        return synthetic_highway(0, n_tokens, self.config.hc, self.config.dim, seed)

    def run(self, token_ids=None, highway=None, token_mask=None, names_filter=None,
            hasher: EngramHasher | None = None, progress: bool | None = None,
            chunk_tokens: int | None = None, *, text: str | None = None, tokenizer=None, inputs_from=None) -> Capture:
        """Run every engram layer on one sequence; returns the captures that `names_filter` keeps.

        token_ids: raw token ids [T] (any integer dtype; checked against the token map), or None
                 with `text`, or with a HighwayFile (its token ids).
        text:    a string, tokenized with `tokenizer` (a `Tokenizer` or a tokenizer.json path; it then
                 also gives the token strings), else the pipeline's (its `tokenizer` / the model's own).
        highway: [T, hc, dim] fp32 (never modified), a dict {layer_id: highway}, a `HighwayFile`
                 (`load_highway`: one highway per engram layer, read per chunk; its token ids and
                 mask are used when none are given, and must equal the ones given), or None for
                 the synthetic highway (drawn per chunk; the capture's meta says it is synthetic).
        token_mask: bool [T], False = dead token. hasher: continue an existing sequence.
        chunk_tokens: run the stages on this many tokens at a time (ids are the same: the hasher
                 keeps the sequence's history; every stage is per token). Captures are joined
                 along the token axis; hooks see one chunk at a time. progress=True shows a bar
                 with the stage and layer being run (and runs in chunks of 512 tokens when no chunk
                 size is given); None (default) shows it when the cuda backend runs in numba's
                 simulator, where a stage can take minutes.
        inputs_from: a Capture (or a mapping of its points) to isolate every stage: each stage is
                 fed that capture's input of it instead of the previous stage's output here (rows
                 gathers the capture's `hash.ids`, proj multiplies its `rows.bf16`, the gate takes
                 its `gate.key`, `gate.value` and `highway.in`), so `diff(reference, isolated)`
                 shows each stage's own error, not the errors of the stages before it compounded.
                 Tokens and mask are the capture's (given ones must equal them), and so is every
                 layer's highway (pass no highway).
                 The capture must hold every engram layer's `hash.ids`, `rows.bf16`, `gate.key`,
                 `gate.value` and `highway.in` (a run with no names_filter keeps them all).
        Every argument is checked before the first chunk runs, so a bad token late in a long
        sequence leaves the hasher and the caller's data untouched.
        """
        cfg = self.config
        keep = match_names(names_filter, self.point_names)
        if tokenizer is not None:
            from .text import tokenizer_for
            self._tokenizer_arg = tokenizer
            self._tokenizer = tokenizer_for(self.model, tokenizer, need_encode=text is not None)
        hasher = self._check_hasher(hasher) if hasher is not None else EngramHasher(self.model.hash_tables)
        given = None
        if inputs_from is not None:
            token_ids, token_mask, highway, given = self._isolated_inputs(inputs_from, token_ids, token_mask, text,
                                                                           highway)
        token_ids, token_mask = self._resolve_tokens(token_ids, token_mask, text, highway)
        token_ids, mask = check_token_ids(token_ids, token_mask, self.model.hash_tables.token_map.size,
                                          hasher.position)
        T = int(token_ids.size)
        from_file = isinstance(highway, HighwayFile)
        per_layer = isinstance(highway, Mapping) or from_file
        if from_file:
            highway.check_model(self.model)
            if highway.n_tokens != T:
                raise ValueError(f"highway file {highway.path} has {highway.n_tokens} tokens, the run {T}")
        elif per_layer:
            missing = set(cfg.layer_ids) - set(highway)
            extra = set(highway) - set(cfg.layer_ids)
            if missing or extra:
                raise ValueError(f"highway dict must have exactly the engram layers {list(cfg.layer_ids)}, got "
                                 f"{sorted(highway)}")
            for lid in cfg.layer_ids:
                self._check_highway(highway[lid], T, f"highway[{lid}]")
        elif highway is not None:
            self._check_highway(highway, T, "highway")
        if progress is None:
            from numba.cuda import config
            progress = bool(config.ENABLE_CUDASIM and "cuda" in self.backends.values())
        if chunk_tokens is None:   # long inputs run in chunks: the stages' arrays stay bounded, ids are the same
            chunk_tokens = 512 if progress and T > 512 else min(max(T, 1), DEFAULT_CHUNK_TOKENS)
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")

        parts: dict[str, list] = {}
        self.fired = []
        self._hook_log = []
        self._point("tokens.ids", token_ids, keep, parts)
        self._point("tokens.mask", np.ones(T, dtype=bool) if mask is None else mask, keep, parts)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            # one unit per token and engram layer, so the bar moves within a chunk as layers finish
            bar = tqdm(total=T * cfg.n_layers, desc=f"engram ({T} tokens x {cfg.n_layers} layers)",
                       unit="tok-layer")
        try:
            for t0 in range(0, T, chunk_tokens):
                t1 = min(T, t0 + chunk_tokens)
                chunk_mask = None if mask is None else mask[t0:t1]
                if from_file:
                    h_chunk = {lid: highway.chunk(lid, t0, t1) for lid in cfg.layer_ids}
                elif per_layer:
                    h_chunk = {lid: highway[lid][t0:t1] for lid in cfg.layer_ids}
                elif highway is None:
                    h_chunk = synthetic_highway(t0, t1, cfg.hc, cfg.dim)
                else:
                    h_chunk = highway[t0:t1]
                self._run_chunk(hasher, token_ids[t0:t1], chunk_mask, h_chunk, keep, parts, bar,
                                given=None if given is None else self._given_chunk(given, t0, t1))
        finally:
            if bar is not None:
                bar.close()
        store = {name: (chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0))
                 for name, chunks in parts.items()}
        meta = self._meta(T, token_ids, highway)
        if given is not None:
            meta["isolated"] = ("every stage fed the inputs of another capture (inputs_from), not the previous "
                                "stage's outputs of this run")
            meta["highway"] = getattr(inputs_from, "meta", {}).get("highway", meta["highway"])
        return Capture(store, meta)

    # the points a stage reads, per layer, when stages are isolated (inputs_from)
    _ISOLATED_INPUTS = ("hash.ids", "rows.bf16", "gate.key", "gate.value", "highway.in")

    def _isolated_inputs(self, cap, token_ids, token_mask, text, highway):
        """(token_ids, token_mask, highway, given) of a run isolated on the capture `cap`: every
        array checked before anything runs, an error naming the missing or mismatched point."""
        if not isinstance(cap, Mapping):
            raise TypeError(f"inputs_from must be a Capture (or a mapping of its points), got {type(cap).__name__}")
        if text is not None:
            raise ValueError("inputs_from takes the tokens of its capture: give text or inputs_from, not both")
        if highway is not None:
            raise ValueError("inputs_from takes every layer's highway.in from its capture: pass no highway")
        cfg = self.config
        need = ["tokens.ids"] + [f"L{lid}.{p}" for lid in cfg.layer_ids for p in self._ISOLATED_INPUTS]
        missing = [n for n in need if n not in cap]
        if missing:
            raise ValueError(f"inputs_from lacks {missing[:6]}{' ...' if len(missing) > 6 else ''}: isolating the "
                             "stages needs each stage's inputs; capture them all (names_filter=None)")
        ids = np.asarray(cap["tokens.ids"])
        T, C = int(ids.size), cfg.n_hash_cols
        if token_ids is not None and not np.array_equal(np.asarray(token_ids), ids):
            raise ValueError("token_ids differ from the tokens.ids of inputs_from")
        cap_mask = np.asarray(cap["tokens.mask"]) if "tokens.mask" in cap else None
        if token_mask is not None and cap_mask is not None and not np.array_equal(np.asarray(token_mask), cap_mask):
            raise ValueError("token_mask differs from the tokens.mask of inputs_from")
        mask = token_mask if token_mask is not None else cap_mask
        if mask is not None and np.asarray(mask).all():
            mask = None
        want = {"hash.ids": ((T, C), np.int64), "rows.bf16": ((T * C, cfg.head_dim), np.uint16),
                "gate.key": ((T, cfg.hc, cfg.dim), np.uint16), "gate.value": ((T, cfg.dim), np.uint16),
                "highway.in": ((T, cfg.hc, cfg.dim), np.float32)}
        given = {}
        for lid in cfg.layer_ids:
            for p in self._ISOLATED_INPUTS:
                a = np.asarray(cap[f"L{lid}.{p}"])
                shape, dtype = want[p]
                if a.shape != shape or a.dtype != dtype:
                    raise ValueError(f"inputs_from's L{lid}.{p} is {a.dtype}{list(a.shape)}, this model's run of "
                                     f"{T} tokens needs {np.dtype(dtype)}{list(shape)}")
                given[f"L{lid}.{p}"] = a
        highway = {lid: given[f"L{lid}.highway.in"] for lid in cfg.layer_ids}
        return ids, mask, highway, given

    def _given_chunk(self, given: dict, t0: int, t1: int) -> dict:
        C = self.config.n_hash_cols
        return {name: (a[t0 * C:t1 * C] if name.endswith("rows.bf16") else a[t0:t1]) for name, a in given.items()}

    def _check_hasher(self, hasher) -> EngramHasher:
        """A hasher given to `run` must hash with this model's tables (same constants, same token map)."""
        from .identity import check_hasher
        return check_hasher(hasher, self.model.hash_tables)

    def _resolve_tokens(self, token_ids, token_mask, text, highway):
        """(token ids, mask) from exactly one of token_ids / text / a HighwayFile's ids."""
        if text is not None:
            if token_ids is not None:
                raise ValueError("give token_ids or text, not both")
            from .text import tokenizer_for
            tok = tokenizer_for(self.model, self._tokenizer_arg, need_encode=True)
            self._tokenizer = tok
            token_ids = tok.encode(text)
        if isinstance(highway, HighwayFile):
            if token_ids is None:
                token_ids = highway.token_ids
            else:
                given = np.asarray(token_ids)
                if given.shape != highway.token_ids.shape:
                    raise ValueError(f"{given.size} token ids were given but highway file {highway.path} holds "
                                     f"{highway.token_ids.size}")
                diff = np.flatnonzero(given != highway.token_ids)
                if diff.size:
                    i = int(diff[0])
                    raise ValueError(f"token id {int(given[i])} at position {i} differs from highway file "
                                     f"{highway.path}'s {int(highway.token_ids[i])} (the highway was recorded on "
                                     "other tokens)")
            if token_mask is None and highway.token_mask is not None:
                token_mask = highway.token_mask
        if token_ids is None:
            raise ValueError("no tokens: give token_ids, text=..., or a HighwayFile highway (it carries its token ids)")
        return token_ids, token_mask

    @staticmethod
    def describe_highway(highway) -> str:
        """What meta["highway"] says for this highway argument."""
        if highway is None:
            return SYNTHETIC_HIGHWAY
        if isinstance(highway, HighwayFile):
            return highway.describe()
        return "given"

    def _meta(self, T: int, token_ids, highway) -> dict:
        import numba

        from . import __version__
        try:
            from importlib.metadata import version
            numba_cuda = version("numba-cuda")
        except Exception:  # pragma: no cover - depends on the install
            numba_cuda = "unknown"
        kernels = self.cuda_kernels
        return {"backends": self.backends, "residual": self.residual, "eps": self.eps, "n_tokens": T,
                "layer_ids": list(self.config.layer_ids),
                "model": str(getattr(self.model, "path", "")), "format": str(getattr(self.model, "format", "")),
                "encodings": {str(lid): v.encoding for lid, v in self._layers.items()},
                "model_identity": self._identity(),
                "highway": self.describe_highway(highway),
                "synthetic_model": bool(getattr(self.model, "synthetic", False)),
                "hooks": list(self._hook_log), "cuda_kernels": kernels,
                "versions": {"engram_numba": __version__, "numba": numba.__version__, "numba_cuda": numba_cuda,
                             "numpy": np.__version__},
                "token_ids": token_ids.tolist() if T <= 4096 else None,
                "token_strings": self._token_strings(token_ids) if T <= 4096 else None,
                "tokenizer": getattr(self.tokenizer, "source", None) if T <= 4096 else None}

    def _identity(self) -> dict | None:
        from .identity import model_identity
        try:
            return model_identity(self.model)
        except (AttributeError, KeyError, TypeError):   # a model object without layers' encodings
            return None

    def _token_strings(self, token_ids) -> list[str] | None:
        tok = self.tokenizer
        if tok is None or (token_ids.size and int(token_ids.max()) >= tok.vocab_size):
            return None
        return tok.token_strings(token_ids)

    def _layer_step(self) -> LayerStep:
        return LayerStep({s: self._impl[self.backends[s]] for s in ("rows", "proj", "gate")}, self.config,
                         self.residual, self.eps)

    def _run_chunk(self, hasher, token_ids, mask, highway, keep, parts, bar=None, given=None) -> None:
        """Every layer on one chunk of tokens (hash first: it extends the sequence's history).
        given: the isolated stages' inputs of this chunk (see `run`'s inputs_from), or None."""
        T = int(token_ids.size)
        progress = (lambda what: bar.set_postfix_str(what, refresh=True)) if bar is not None else None
        if progress is not None:
            progress("hash")
        all_ids = self._impl[self.backends["hash"]].hash(hasher, token_ids, mask)   # [T, L, C]
        if isinstance(highway, Mapping):
            h = {lid: Value(host=np.ascontiguousarray(highway[lid], dtype=np.float32)) for lid in self.config.layer_ids}
        else:
            h = Value(host=np.ascontiguousarray(highway, dtype=np.float32))
        run_layers(self._layer_step(), self._layers, all_ids, h, mask, _Points(self, keep, parts), given,
                   progress=progress, layer_done=None if bar is None else (lambda: bar.update(T)))

    def gates_from_ids(self, row_ids, highway, token_mask=None) -> dict:
        """rows -> proj -> gate of every engram layer for row ids the caller hashed, keeping only
        each layer's (dot, gate) [T, hc] fp32 (host arrays). No capture, no hooks.

        row_ids: int [T, layers, C] (`EngramHasher.hash`). highway: [T, hc, dim] fp32 host array
        (copied, not modified), a {layer_id: highway} dict, or (cuda backend for the gate) a
        device array that is updated in place. Every layer's rows and projection run before the
        first gate; with the cuda backend for rows, proj and gate only the ids go to the device
        and only the dot and gate come back."""
        cfg = self.config
        ids = np.asarray(row_ids)
        if ids.ndim != 3 or ids.shape[1:] != (cfg.n_layers, cfg.n_hash_cols):
            raise ValueError(f"row_ids must be [T, {cfg.n_layers}, {cfg.n_hash_cols}], got {list(ids.shape)}")

        def value(h):
            return Value.of(h) if is_device_like(h) else Value(host=np.asarray(h, dtype=np.float32))
        h = {lid: value(highway[lid]) for lid in cfg.layer_ids} if isinstance(highway, Mapping) else value(highway)
        res = run_layers(self._layer_step(), self._layers, ids, h, token_mask, kv_first=True)
        return {lid: (r.dot.host(), r.gate.host()) for lid, r in res.items()}

    def _check_highway(self, h, T: int, what: str) -> None:
        cfg = self.config
        shape = (T, cfg.hc, cfg.dim)
        if not isinstance(h, np.ndarray):
            raise TypeError(f"{what} must be a numpy array [T, hc, dim] fp32 (host), got {type(h).__name__}")
        if h.shape != shape:
            raise ValueError(f"{what} must have shape {shape} (T, hc, dim), got {h.shape}")
        if h.dtype != np.float32:
            raise ValueError(f"{what} must be float32, got {h.dtype}")
