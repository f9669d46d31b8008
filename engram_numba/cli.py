"""The `engram-numba` command.

    engram-numba demo                          the tiny model through every backend, diffed
    engram-numba info PATH [--json]            any format: configuration, keys, tensors, the checks
    engram-numba run [FILE] --text "..." | --text-file F | --tokens 1,2,3 | --tokens-file F
                     [--tokenizer tokenizer.json] [--highway H.safetensors] [--backend cuda]
                     [--capture out.npz | out.safetensors]
    engram-numba stats CORPUS... [--model FILE] [--backend cuda] [--out DIR] [--tables parquet|csv]
    engram-numba stats --merge A/stats.npz B/stats.npz [--out DIR]     parts reduced separately
    engram-numba diff [FILE] --a reference --b cuda [--tokens ...] [--isolated] [--max-ulp N] [--rtol X]
    engram-numba diff A.npz B.npz [--max-ulp N] [--rtol X]          two saved captures
    engram-numba diff --model-a PATH --model-b PATH [--tokens ...]  two models (any formats), same tokens
    engram-numba points [FILE]                 the capture points of a model (for --capture, diff, hooks)
    engram-numba kernels [--stage proj]        the kernel registry: versions, defaults, changelogs
    engram-numba make-fixture [--out data/tiny_v41.gguf]
    engram-numba bench [--out bench/results/h200.json]     (needs a GPU; --smoke runs anywhere)

A user mistake (a missing file, a bad token list, an unknown backend, an unwritable output path)
prints one line starting with "error:" and exits with status 2; nothing runs before the
arguments are checked. ENGRAM_DEBUG=1 shows the traceback as well.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

_T_START = time.perf_counter()   # the demo reports its time from here: imports included

import numpy as np  # noqa: E402

from .errors import EngramError

STAGES = ("hash", "rows", "proj", "gate")
BACKENDS = ("reference", "cpu", "cuda")
EXIT_USAGE = 2        # bad arguments or inputs
EXIT_TOLERANCE = 1    # diff: a tolerance was exceeded; info: the file's checks failed
RELEASED = "released"  # --model released: the released V4.1 configuration without weights


class UserError(EngramError):
    """A mistake in the command's arguments or inputs: reported in one line, exit status 2."""


# argument types --------------------------------------------------------------------------------

_TOKEN_LIST = re.compile(r"^\s*[+-]?[0-9]+(\s*[,\s]\s*[+-]?[0-9]+)*\s*,?\s*$", re.ASCII)   # ASCII digits only


def parse_token_list(text: str) -> np.ndarray:
    """'1,2,3' or '1 2 3' (commas and/or whitespace between plain integers) -> int64 [T].
    Anything else ('1_0', '1.5', 'x', an empty list) is refused."""
    if text is None or not text.strip():
        raise UserError("--tokens is empty: give comma- or space-separated integers, e.g. --tokens 1,2,3")
    if not _TOKEN_LIST.match(text):
        raise UserError(f"--tokens must be comma- or space-separated integers, got {text!r}")
    values = [int(t) for t in re.split(r"[,\s]+", text.strip()) if t]
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise UserError(f"--tokens holds a value outside int64: {text!r}") from None


def backend_spec(text: str):
    """'cuda', or per stage 'rows=cpu,proj=cuda' (stages not named take 'reference'); 'blas' is a
    projection backend (proj=blas; alone it means cpu with the BLAS projection)."""
    from .pipeline import BACKEND_NAMES, resolve_backends
    if "=" not in text:
        if text not in BACKEND_NAMES:
            raise argparse.ArgumentTypeError(f"unknown backend {text!r}; backends are {', '.join(BACKEND_NAMES)}, "
                                             f"or per stage like rows=cpu,proj=cuda")
        return text
    out = {}
    for part in text.split(","):
        stage, sep, backend = (s.strip() for s in part.partition("="))
        if not sep or stage not in STAGES:
            raise argparse.ArgumentTypeError(f"{part!r}: expected STAGE=BACKEND with a stage in {', '.join(STAGES)}")
        if backend not in BACKEND_NAMES:
            raise argparse.ArgumentTypeError(f"{part!r}: unknown backend {backend!r}; backends are "
                                             f"{', '.join(BACKEND_NAMES)}")
        out[stage] = backend
    try:
        resolve_backends(out)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return out


def _existing_file(path: str | None, what: str = "model file") -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {path} does not exist")
    if p.is_dir():
        raise UserError(f"{what} {path} is a directory, not a file")
    if not p.is_file():
        raise UserError(f"{what} {path} is not a regular file")
    return p


def _writable(path: str | None, what: str) -> Path | None:
    """Check before any work that `path` can be written (its folder exists and is writable)."""
    if path is None:
        return None
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file name")
    if not parent.is_dir():
        raise UserError(f"cannot write {what} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"cannot write {what} {path}: permission denied")
    # os.access says yes to root on a read-only file system: open the file once to be sure
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as exc:
        raise UserError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    if not existed:
        p.unlink()
    return p


def _load(path: Path | None, tokenizer: str | None = None):
    """Any model file or folder load_model opens (default: the tiny model in data/); the word
    `released` opens the released V4.1 configuration (hash constants from DeepSeek-V4's
    tokenizer, no weights: hashing and row statistics only)."""
    from .fixtures import tiny_model_path
    from .formats.load import load_model
    if path is not None and str(path) == RELEASED:
        from .formats.released import released_model
        return released_model(tokenizer)
    return load_model(path if path is not None else tiny_model_path())


def _tokens(args, model, fallback):
    return _check_ids(fallback if args.tokens is None else parse_token_list(args.tokens), model)


# commands ----------------------------------------------------------------------------------------

def _model_path(path: str, what: str = "model") -> Path:
    """A model path for load_model: a file, a shard, or a folder (split GGUF, HF checkpoint), or
    the word `released` (see _load)."""
    p = Path(path)
    if path == RELEASED and not os.path.lexists(p):
        return p
    if not os.path.lexists(p):
        raise UserError(f"{what} {path} does not exist")
    return p


def cmd_info(args) -> int:
    from .formats.describe import describe, describe_dict, ok
    from .formats.load import load_model
    path = _model_path(args.file)
    # validate=False so that a file whose primes and tables disagree (or whose constants overflow
    # int64) is still described, with the failed check marked (exit status 1); a file that cannot
    # be read at all is an error naming the problem (exit status 2).
    with load_model(path, validate=False) as model:
        info = describe_dict(model, scan_rows=True if args.scan_rows else None)
        from .placement import format_placement, placement_report
        info["placement"] = placement_report(model)       # what tables="auto" picks here (nothing built)
        if args.json:
            print(json.dumps(info, indent=1))
        else:
            print(describe(model, info=info) + "\n" + format_placement(info["placement"]))
        return 0 if ok(info) else EXIT_TOLERANCE


def cmd_make_fixture(args) -> int:
    from .fixtures import TINY_GOLDEN_PATH, TINY_PATH, make_fixture
    out = _writable(args.out, "fixture") if args.out else TINY_PATH
    golden = None if args.no_golden else (_writable(args.golden, "golden captures") if args.golden else
                                          (TINY_GOLDEN_PATH if out == TINY_PATH else out.with_name(out.stem + "_golden.npz")))
    make_fixture(out, golden)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)" + (f" and {golden}" if golden else ""))
    return 0


def _read_token_file(path: Path) -> np.ndarray:
    """A tokens file: .npy (1-D integers) or text of integers separated by commas/whitespace."""
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as exc:
            raise UserError(f"--tokens-file {path}: not a readable .npy ({exc})") from None
        if arr.ndim != 1 or (arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_)):
            raise UserError(f"--tokens-file {path}: expected a 1-D integer array, got {arr.dtype}{list(arr.shape)}")
        return arr.astype(np.int64)
    text = path.read_text(encoding="utf-8")
    try:
        return parse_token_list(text)
    except UserError as exc:
        raise UserError(str(exc).replace("--tokens", f"--tokens-file {path}", 1)) from None


def _check_ids(tokens: np.ndarray, model) -> np.ndarray:
    vocab = model.hash_tables.token_map.size
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise UserError(f"token id {int(tokens[i])} at position {i} is outside the model's token map [0, {vocab})")
    return tokens


def _tokenizer_or_error(model, path, need_encode: bool):
    from .text import NoTokenizerError, tokenizer_for
    try:
        return tokenizer_for(model, path, need_encode=need_encode)
    except NoTokenizerError as exc:
        raise UserError(str(exc).replace("tokenizer=PATH to a tokenizer.json (--tokenizer PATH on the command line)",
                                         "--tokenizer PATH (a tokenizer.json)")) from None


def cmd_run(args) -> int:
    from .analysis.stats import gate_stats
    from .fixtures import TINY_TOKENS
    from .highway import HighwayFileError, load_highway
    from .pipeline import Pipeline
    path = _model_path(args.file) if args.file else None
    capture = _writable(args.capture, "capture file")
    sources = [name for name, v in (("--text", args.text), ("--text-file", args.text_file), ("--tokens", args.tokens),
                                    ("--tokens-file", args.tokens_file)) if v is not None]
    if len(sources) > 1:
        raise UserError(f"give one token source, got {' and '.join(sources)}")
    text = args.text
    if args.text_file is not None:
        text = _existing_file(args.text_file, "--text-file").read_text(encoding="utf-8")
    if text is not None and not text.strip():
        raise UserError("the text is empty")
    tokens = None
    if args.tokens is not None:
        tokens = parse_token_list(args.tokens)
    elif args.tokens_file is not None:
        tokens = _read_token_file(_existing_file(args.tokens_file, "--tokens-file"))
    tokenizer_path = str(_existing_file(args.tokenizer, "--tokenizer")) if args.tokenizer else None
    highway_path = _existing_file(args.highway, "--highway") if args.highway else None
    model = _load(path)
    tok = _tokenizer_or_error(model, tokenizer_path, need_encode=text is not None) if (
        text is not None or tokenizer_path) else None
    highway = None
    if highway_path is not None:
        try:
            highway = load_highway(highway_path, model)
        except HighwayFileError as exc:
            raise UserError(str(exc)) from None
    if text is not None:
        tokens = tok.encode(text)
    if tokens is not None:
        tokens = _check_ids(tokens, model)
    elif highway is None:
        tokens = TINY_TOKENS
    if highway is not None and tokens is not None:
        if tokens.shape != highway.token_ids.shape or (tokens != highway.token_ids).any():
            diff = np.flatnonzero(tokens != highway.token_ids) if tokens.shape == highway.token_ids.shape else []
            where = f" (first difference at position {int(diff[0])})" if len(diff) else \
                f" ({tokens.size} tokens given, {highway.n_tokens} in the file)"
            raise UserError(f"the tokens differ from the ones highway file {highway_path} was recorded on{where}")
    pipe = Pipeline(model, backends=args.backend, residual=args.residual, tokenizer=tok)
    t0 = time.perf_counter()
    cap = pipe.run(tokens, highway=highway, progress=True, chunk_tokens=args.chunk_tokens)
    n = cap["tokens.ids"].size
    print(f"ran {n} tokens through {pipe.backends} in {time.perf_counter() - t0:.2f} s "
          f"(highway: {cap.meta['highway']})")
    st = gate_stats(cap)
    print(st)
    if n <= args.show_tokens:
        print()
        print(st.per_token_table())
    if capture:
        cap.save(capture)
        print(f"captures ({len(cap)} points) saved to {capture}")
    return 0


def _stats_out_dir(path: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    parent = out if out.exists() else out.parent if str(out.parent) else Path(".")
    if not parent.exists():
        raise UserError(f"cannot write --out {out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write --out {out}: permission denied")
    return out


def _stats_on_dask(args, model, files, tokenizer_path, out):
    """`stats --workers N` / `--scheduler ADDRESS`: the corpus in shards over Dask workers."""
    from .analysis import distributed as dist
    if args.workers is not None and args.scheduler is not None:
        raise UserError("give --workers (a cluster on this host) or --scheduler (an existing one), not both")
    if args.workers is not None and args.workers < 0:
        raise UserError(f"--workers must be >= 1 (or given alone: one per GPU / CPU core), got {args.workers}")
    if args.shard_mb <= 0:
        raise UserError(f"--shard-mb must be > 0, got {args.shard_mb}")
    for flag, bad in (("--continuous", args.continuous), ("--limit-tokens", args.limit_tokens is not None),
                      ("--token-table", args.token_table)):
        if bad:
            raise UserError(f"{flag} needs the corpus in one process: drop --workers/--scheduler for it")
    try:
        dist.require_distributed("--workers/--scheduler")
    except ImportError as exc:
        raise UserError(str(exc)) from None
    try:
        st = dist.distributed_corpus_stats(
            model.path, files, out=out, workers=args.workers or None if args.scheduler is None else None,
            scheduler=args.scheduler,
            shard_bytes=max(1, int(args.shard_mb * (1 << 20))), backend=args.backend, chunk_tokens=args.chunk_tokens,
            tokenizer=tokenizer_path, field=args.field, split=args.split, fmt=args.format,
            max_contexts=args.max_contexts, contexts=not args.no_contexts, rows=not args.no_rows,
            residual=args.residual, progress=True)
    except RuntimeError as exc:
        raise UserError(str(exc)) from None
    print(dist.RunSummary(**{k: v for k, v in st.meta["distributed"].items() if k not in ("tokens_per_s",)}))
    return st


def table_placement_spec(text: str):
    """--table-placement: device | host | mmap | auto | device<=N GB | LAYER=PLACEMENT,... ."""
    from .placement import PLACEMENTS
    text = text.strip()
    if "=" in text and "<=" not in text:
        spec = {}
        for part in text.split(","):
            lid, _, where = part.partition("=")
            try:
                spec[int(lid)] = where.strip()
            except ValueError:
                raise argparse.ArgumentTypeError(f"--table-placement: {part!r} is not LAYER=PLACEMENT") from None
            if spec[int(lid)] not in PLACEMENTS:
                raise argparse.ArgumentTypeError(f"--table-placement: {where.strip()!r} is not one of {PLACEMENTS}")
        return spec
    return text


def _placed_engine(model, args):
    """The EngramV41 of `stats --table-placement` (refused with the plan's numbers if it cannot fit)."""
    from .engine import EngramV41
    backend = args.backend if isinstance(args.backend, dict) else {s: args.backend for s in ("rows", "proj", "gate")}
    if any(backend.get(s) != "cuda" for s in ("rows", "proj", "gate")):
        raise UserError("--table-placement needs the cuda backend for rows, proj and gate (--backend cuda)")
    return EngramV41(model, max_tokens=args.chunk_tokens, tables=args.table_placement)


def cmd_stats(args) -> int:
    import matplotlib
    matplotlib.use("Agg")
    from . import _optional
    from .analysis import streaming
    from .analysis.corpus import FORMATS, corpus_files, corpus_format, corpus_stats
    from .analysis.plots import corpus_columns_plot, corpus_token_plot, gate_histogram
    from .analysis.tables import write_tables

    out = _stats_out_dir(args.out)
    if args.tables == "parquet" and not (_optional.have("pandas") and _optional.have("pyarrow")):
        raise UserError(f"--tables parquet needs pandas and pyarrow: {_optional.ANALYSIS_EXTRA}; or use --tables csv")
    if args.token_table and args.tables == "parquet" and not _optional.have("pyarrow"):
        raise UserError(f"--token-table as parquet needs pyarrow: {_optional.ANALYSIS_EXTRA}")
    if args.merge and (args.access or args.access_only):
        return _merge_access(args, out)
    if args.merge:
        parts = []
        for f in args.corpus:
            p = _existing_file(f, "statistics file")
            try:
                parts.append(streaming.StreamingGateStats.load(p))
            except Exception as exc:
                raise UserError(f"{p} is not a statistics file saved by engram-numba stats ({exc})") from None
        try:
            st = streaming.merge(parts)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        model = None
        if args.model:
            model = _load(_model_path(args.model) if args.model else None)
        tok_path = args.tokenizer or st.meta.get("tokenizer")
        if tok_path and Path(str(tok_path)).exists():
            from .text import load_tokenizer
            st.tokenizer = load_tokenizer(tok_path)
        elif model is not None:
            from .text import NoTokenizerError, tokenizer_for
            try:
                st.tokenizer = tokenizer_for(model, None)
            except NoTokenizerError:
                pass
        print(f"merged {len(parts)} part(s): {st.n_documents} documents, {st.n_tokens} tokens")
    else:
        try:
            files = corpus_files(args.corpus)
        except (FileNotFoundError, ValueError) as exc:
            raise UserError(str(exc)) from None
        if args.format is not None and args.format not in FORMATS:   # pragma: no cover - argparse choices
            raise UserError(f"--format must be one of {FORMATS}")
        if args.chunk_tokens < 1:
            raise UserError(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}")
        tokenizer_path = str(_existing_file(args.tokenizer, "--tokenizer")) if args.tokenizer else None
        model = _load(_model_path(args.model) if args.model else None,
                      tokenizer_path if args.model == RELEASED else None)
        kinds = {corpus_format(f, args.format) for f in files}
        if "text" in kinds or tokenizer_path:
            _tokenizer_or_error(model, tokenizer_path, need_encode="text" in kinds)
        if args.table_placement and (args.workers is not None or args.scheduler is not None):
            raise UserError("--table-placement applies to one process: with --workers/--scheduler each worker "
                            "places its tables itself (device when they fit)")
        engine = _placed_engine(model, args) if args.table_placement else None     # refused before any output
        from .formats.released import has_weights
        if not has_weights(model) and not args.access_only:
            raise UserError(f"--model {args.model} has no weights (hash constants only): gate statistics need a model "
                            "file with its tables, projection and gate vectors; for row-access statistics add "
                            "--access-only")
        if args.access or args.access_only:
            _access_pass(args, model, files, tokenizer_path, out)
            if args.access_only:
                return 0
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot write --out {out}: {exc.strerror or exc}") from None
        token_table = None
        if args.token_table:
            token_table = out / ("tokens_long." + args.tables)
        t0 = time.perf_counter()
        if args.workers is not None or args.scheduler is not None:
            st = _stats_on_dask(args, model, files, tokenizer_path, out)
        else:
            st = corpus_stats(model, files, backend=args.backend, chunk_tokens=args.chunk_tokens, engine=engine,
                              continuous=args.continuous, tokenizer=tokenizer_path, field=args.field, split=args.split,
                              fmt=args.format, limit_tokens=args.limit_tokens, max_contexts=args.max_contexts,
                              contexts=not args.no_contexts, rows=not args.no_rows, progress=True,
                              residual=args.residual, token_table=token_table)
        wall = time.perf_counter() - t0
        print(f"streamed {st.n_documents} documents, {st.n_tokens} tokens through {st.meta['backends']} in "
              f"{wall:.2f} s ({st.n_tokens / max(wall, 1e-9):,.0f} tokens/s)")
    out.mkdir(parents=True, exist_ok=True)
    print(st)
    (out / "summary.md").write_text(st.summary(k=args.top_k), encoding="utf-8")
    (out / "stats.json").write_text(json.dumps(st.to_json(), indent=1), encoding="utf-8")
    st.save(out / "stats.npz")
    tables = st.tables(frames=args.tables == "parquet")
    written = write_tables(tables, out / "tables", args.tables)
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    for name, fn in (("gate_histogram", lambda: gate_histogram(st)), ("tokens", lambda: corpus_token_plot(st)),
                     ("columns", lambda: corpus_columns_plot(st) if st.track_rows else None)):
        fig = fn()
        if fig is not None:
            fig.savefig(plots / f"{name}.png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close("all")
    print(f"\nwrote {out}/: summary.md, stats.json, stats.npz (merge with `engram-numba stats --merge`), "
          f"tables/ ({', '.join(p.name for p in written)}), plots/"
          + (f", {token_table.name}" if not args.merge and token_table is not None else ""))
    if st.highway_is_synthetic:
        print("note: the highway is synthetic (no hidden states were given): the gate reflects the table rows only")
    return 0


def _access_pass(args, model, files, tokenizer_path, out: Path) -> None:
    """Row-access statistics of the corpus (hash only) into OUT/access/."""
    from .analysis.access import AccessStats
    from .analysis.corpus import iter_documents
    from .text import tokenizer_for
    tok = tokenizer_for(model, tokenizer_path) if tokenizer_path or any(
        f.suffix.lower() not in (".npy", ".ids") for f in files) else None
    acc = AccessStats.empty(model, holdout_every=args.holdout_every, sequence_tokens=args.sequence_tokens)
    acc.meta.update({"corpus": [str(f) for f in files], "model": str(args.model or "tiny model")})
    seen, t0 = 0, time.perf_counter()
    for doc in iter_documents(files, tokenizer=tok, field=args.field, split=args.split, fmt=args.format,
                              model=model):
        ids = doc.token_ids
        if args.limit_tokens is not None:
            if seen >= args.limit_tokens:
                break
            ids = ids[: args.limit_tokens - seen]
        acc.update(ids)
        seen += int(ids.size)
    wall = time.perf_counter() - t0
    print(f"row access: {seen} tokens in {wall:.2f} s (tokenizing included)")
    _write_access(acc, out, args.tables)


def _write_access(acc, out: Path, tables_fmt: str) -> None:
    import matplotlib.pyplot as plt
    folder = out / "access"
    folder.mkdir(parents=True, exist_ok=True)
    rep = acc.report()
    print(rep.table())
    (folder / "access.json").write_text(json.dumps(rep.to_json(), indent=1), encoding="utf-8")
    acc.save(folder / "access.npz")
    from .analysis.tables import write_tables
    written = write_tables({"access_columns": rep.columns_records(), "access_cache": rep.cache_records()},
                           folder, tables_fmt)
    for name, fn in (("access_zipf", rep.zipf_plot), ("access_cache", rep.cache_plot),
                     ("access_reuse", rep.reuse_plot)):
        fn().savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight")
    plt.close("all")
    print(f"wrote {folder}/: access.json, access.npz (merge with `engram-numba stats --merge --access`), "
          f"{', '.join(p.name for p in written)}, access_zipf.png, access_cache.png, access_reuse.png")


def _merge_access(args, out: Path) -> int:
    from .analysis.access import AccessStats, merge_access
    parts = []
    for f in args.corpus:
        p = _existing_file(f, "access statistics file")
        try:
            parts.append(AccessStats.load(p))
        except Exception as exc:
            raise UserError(f"{p} is not an access statistics file saved by engram-numba stats --access ({exc})") from None
    try:
        acc = merge_access(parts)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(f"merged {len(parts)} access part(s): {sum(acc.n_tokens)} tokens")
    _write_access(acc, out, args.tables)
    return 0


def _check_tolerances(report, max_ulp, rtol) -> list[str]:
    """The points whose float distance exceeds a tolerance (integer points must be equal)."""
    bad = []
    for r in report.rows:
        if r.n == 0:
            bad.append(f"{r.name}: shapes or dtypes differ")
        elif r.kind == "int":
            if not r.equal:
                bad.append(f"{r.name}: {r.n - r.n_equal} integer elements differ")
        else:
            if max_ulp is not None and r.max_ulp > max_ulp:
                bad.append(f"{r.name}: max {r.max_ulp:.0f} ulps > {max_ulp}")
            if rtol is not None and r.rel_l2 > rtol:
                bad.append(f"{r.name}: rel L2 {r.rel_l2:.3g} > {rtol}")
    return bad


def cmd_diff(args) -> int:
    from .analysis.diff import diff
    from .capture import Capture
    from .fixtures import TINY_TOKENS
    from .pipeline import Pipeline
    files = [a for a in (args.file, args.file_b) if a is not None]
    if args.model_a is not None or args.model_b is not None:     # one token sequence through two models
        if args.model_a is None or args.model_b is None or files:
            raise UserError("--model-a and --model-b go together (and without positional files)")
        if args.isolated:
            raise UserError("--isolated feeds one model's stages the inputs of another run of the same model; "
                            "it does not apply to --model-a/--model-b")
        return _diff_models(args)
    a = args.a if args.a is not None else "reference"
    b = args.b if args.b is not None else "cuda"
    if len(files) == 2:                                  # two saved captures
        if args.isolated:
            raise UserError("--isolated runs the model; two saved captures are compared as they are")
        paths = [_existing_file(f, "capture file") for f in files]
        caps = []
        for p in paths:
            try:
                caps.append(Capture.load(p))
            except Exception as exc:
                raise UserError(f"{p} is not a capture saved by engram-numba ({type(exc).__name__}: {exc})") from None
        report = diff(*caps, label_a=str(paths[0]), label_b=str(paths[1]))
    else:
        path = _existing_file(args.file)
        model = _load(path)
        tokens = _tokens(args, model, TINY_TOKENS)
        cap_a = Pipeline(model, backends=a, residual=args.residual).run(tokens)
        pipe_b = Pipeline(model, backends=b, residual=args.residual)
        cap_b = pipe_b.run(inputs_from=cap_a) if args.isolated else pipe_b.run(tokens)
        report = diff(cap_a, cap_b, label_a=_label(a), label_b=_label(b) + (" (isolated)" if args.isolated else ""))
    print(report)
    return _tolerance_exit(args, report)


def _tolerance_exit(args, report) -> int:
    if args.max_ulp is None and args.rtol is None:
        return 0
    bad = _check_tolerances(report, args.max_ulp, args.rtol)
    for line in bad:
        print(f"tolerance exceeded: {line}")
    print("diff: within tolerances" if not bad else f"diff: {len(bad)} point(s) exceed the tolerances")
    return EXIT_TOLERANCE if bad else 0


def _nonfinite_lines(label: str, cap) -> list[str]:
    """One line per float point of a capture that holds NaN or inf (rows that decode to NaN reach
    the projection and the gate as NaN; they are never replaced)."""
    from .bf16 import bf16_to_f32
    out = []
    for name in cap:
        arr = cap[name]
        if arr.dtype == np.uint16 and not name.endswith(".raw"):   # bf16 words
            vals = bf16_to_f32(arr)
        elif arr.dtype.kind == "f":
            vals = arr
        else:
            continue
        n = int((~np.isfinite(vals)).sum())
        if n:
            out.append(f"  {label}: {name} holds {n} NaN/inf value(s) of {vals.size}")
    return out


def _diff_models(args) -> int:
    """The same tokens through two models (any formats), stage by stage."""
    from .analysis.diff import diff
    from .fixtures import TINY_TOKENS
    from .formats.load import load_model
    from .pipeline import Pipeline
    a_backend = args.a if args.a is not None else "reference"
    b_backend = args.b if args.b is not None else a_backend
    models = [load_model(_model_path(p, f"--model-{w}")) for p, w in ((args.model_a, "a"), (args.model_b, "b"))]
    ca, cb = (m.config for m in models)
    for field in ("dim", "hc", "layer_ids", "max_ngram_size", "n_heads", "head_dim"):
        if getattr(ca, field) != getattr(cb, field):
            raise UserError(f"the two models differ in {field} ({getattr(ca, field)} vs {getattr(cb, field)}): "
                            "their stages cannot be compared")
    vocab = min(m.hash_tables.token_map.size for m in models)
    tokens = TINY_TOKENS if args.tokens is None else parse_token_list(args.tokens)
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise UserError(f"token id {int(tokens[i])} at position {i} is outside the models' token maps [0, {vocab})")
    caps = [Pipeline(m, backends=be, residual=args.residual).run(tokens)
            for m, be in ((models[0], a_backend), (models[1], b_backend))]
    labels = [f"A {models[0].format} [{_label(a_backend)}]", f"B {models[1].format} [{_label(b_backend)}]"]
    print(f"A: {models[0].path}\n   {models[0].format}\nB: {models[1].path}\n   {models[1].format}")
    if not np.array_equal(models[0].hash_tables.token_map[:vocab], models[1].hash_tables.token_map[:vocab]):
        print("note: the two token maps differ, so the hash ids (and the rows) of the two models differ too")
    report = diff(*caps, label_a=labels[0], label_b=labels[1])
    print(report)
    nonfinite = _nonfinite_lines("A", caps[0]) + _nonfinite_lines("B", caps[1])
    if nonfinite:
        print("NaN/inf in the captures (a stored row that decodes to NaN/inf; `engram-numba info` counts them):")
        print("\n".join(nonfinite))
    for m in models:
        m.close()
    return _tolerance_exit(args, report)


def _label(spec) -> str:
    return spec if isinstance(spec, str) else ",".join(f"{k}={v}" for k, v in spec.items())


def cmd_kernels(args) -> int:
    from .stages import catalog
    print(catalog.table(args.stage))
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo
    path = _existing_file(args.file)
    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out-dir {out_dir} exists and is not a folder")
    if args.sim_tokens < 1:
        raise UserError(f"--sim-tokens must be >= 1, got {args.sim_tokens}")
    return run_demo(path, out_dir, residual=args.residual, sim_tokens=args.sim_tokens, t_start=_T_START)


def cmd_bench(args) -> int:
    from .bench.suite import main as bench_main
    if args.out:
        _writable(args.out, "--out")
    return bench_main(args)


# the parser ----------------------------------------------------------------------------------------

def _float_at_least(lo: float):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v >= lo):
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text}")
        return v
    return parse


MODEL_HELP = ("a model in any format: a GGUF (single, or any shard or the folder of a split one), a ds4 GGUF, or "
              "an HF checkpoint folder (default: the tiny model in data/); or 'released': the released V4.1 hash "
              "configuration without weights (hashing and row-access statistics only)")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text}")
        return v
    return parse


# options whose value may start with "-" (a token list such as -1,2): argparse would take the value
# for an option and answer "expected one argument"; main() glues them as --tokens=-1,2
_VALUE_MAY_START_WITH_DASH = ("--tokens",)


def _glue_dash_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _VALUE_MAY_START_WITH_DASH and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def cmd_points(args) -> int:
    from .capture import OBSERVE_ONLY, point_names
    model = _load(_model_path(args.file) if args.file else None)
    for name in point_names(model):
        short = name.split(".", 1)[1] if name.startswith("L") else name
        print(f"{name:20s} {'output (hooks observe)' if short in OBSERVE_ONLY else 'hooks may replace it'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="engram-numba", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"engram-numba {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("demo", help="run the tiny model through the reference, cpu and cuda backends")
    s.add_argument("--file", help=MODEL_HELP)
    s.add_argument("--out-dir", default="engram_demo", help="where the heatmap and captures go")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--sim-tokens", type=int, default=2,
                   help="without a GPU: tokens the cuda pipeline runs in numba's simulator (default 2; ~3 s each)")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("info", help="describe an Engram model (any format): configuration, keys, tensors, checks")
    s.add_argument("file", help="a GGUF, any shard of a split GGUF or its folder, a ds4 GGUF, or an HF "
                                "checkpoint folder or its model.safetensors.index.json")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--scan-rows", action="store_true",
                   help="count rows that decode to NaN/inf in every table, however big (reads every row's scales)")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("run", help="run text or a token sequence through the pipeline")
    s.add_argument("file", nargs="?", help=MODEL_HELP)
    src = s.add_argument_group("the tokens (one source; default: the tiny test sequence, or the highway file's)")
    src.add_argument("--text", help="text, tokenized with the model's tokenizer (or --tokenizer)")
    src.add_argument("--text-file", help="a UTF-8 text file, tokenized as one sequence")
    src.add_argument("--tokens", help="raw token ids, comma- or space-separated")
    src.add_argument("--tokens-file", help="raw token ids: a 1-D .npy, or integers separated by commas/whitespace")
    s.add_argument("--tokenizer", help="a tokenizer.json (or a folder holding one) for --text and token strings")
    s.add_argument("--highway", help="hidden states from another engine: a highway .safetensors "
                                     "(docs/research.md); its token ids are used when no tokens are given")
    s.add_argument("--backend", type=backend_spec, default="reference",
                   help="reference | cpu | cuda | blas (cpu with the BLAS projection), or per stage: "
                        "rows=cpu,proj=cuda,gate=reference")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--chunk-tokens", type=_int_at_least(1), default=None, help="run the stages this many tokens at a time")
    s.add_argument("--show-tokens", type=_int_at_least(0), default=40,
                   help="print the per-token gate table up to this many tokens (0: never)")
    s.add_argument("--capture", help="save every stage's arrays to this .npz (or .safetensors)")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("stats", help="stream a corpus through the pipeline and write its gate statistics")
    s.add_argument("corpus", nargs="+", help="text / .jsonl / .npy / .ids / highway .safetensors files or folders "
                                            "(with --merge: stats.npz files to merge)")
    s.add_argument("--model", help=MODEL_HELP)
    s.add_argument("--backend", type=backend_spec, default="cpu",
                   help="reference | cpu | cuda | blas, or per stage (default cpu, bit-identical to the reference, so "
                        "merged parts equal one run; blas: cpu with the BLAS projection, about 4x less CPU time, "
                        "within a bf16 ulp of the reference, docs/numerics.md)")
    s.add_argument("--out", default="engram_stats", help="output folder (default engram_stats)")
    s.add_argument("--format", choices=["text", "jsonl", "npy", "ids", "highway", "parquet", "arrow"], default=None,
                   help="corpus format of every file (default: by suffix; other suffixes are text)")
    s.add_argument("--field", default="text", help="JSONL field holding the text or token ids (default text)")
    s.add_argument("--split", choices=["line", "paragraph", "file"], default="line",
                   help="text files: one document per line (default), per blank-line paragraph, or per file")
    s.add_argument("--tokenizer", help="a tokenizer.json (default: the model's)")
    s.add_argument("--chunk-tokens", type=int, default=4096)
    s.add_argument("--continuous", action="store_true", help="run the whole corpus as one sequence")
    s.add_argument("--limit-tokens", type=int, default=None)
    s.add_argument("--max-contexts", type=int, default=200_000, help="n-gram contexts tracked per order (cap)")
    s.add_argument("--no-contexts", action="store_true", help="skip per-context statistics")
    s.add_argument("--no-rows", action="store_true", help="skip row-id usage (its bitmap is 48 MB a layer at the "
                                                          "released size)")
    s.add_argument("--top-k", type=int, default=10, help="rows in the summary's top-k lists")
    s.add_argument("--tables", choices=["parquet", "csv"], default="parquet",
                   help="aggregate tables as parquet (needs the analysis extra) or CSV")
    s.add_argument("--token-table", action="store_true", help="also write the long per-token table")
    s.add_argument("--table-placement", type=table_placement_spec, default=None,
                   help="cuda backend: where the engram tables live: device | host (pinned, read by the GPU, the "
                        "next chunk prefetched) | mmap | auto | 'device<=N GB' | LAYER=PLACEMENT,... "
                        "(default: device); docs/placement.md")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--merge", action="store_true", help="merge saved statistics (CORPUS = stats.npz files; with "
                                                         "--access: access.npz files)")
    s.add_argument("--access", action="store_true",
                   help="also write row-access statistics (OUT/access/: Zipf fits, cache hit rates, collisions, reuse "
                        "distances; docs/memory.md). Hash only: works with --model released")
    s.add_argument("--access-only", action="store_true", help="only the row-access statistics (no gate statistics)")
    s.add_argument("--holdout-every", type=int, default=10,
                   help="row access: one document in this many is held out to evaluate the static cache (default 10)")
    s.add_argument("--sequence-tokens", type=int, default=1_000_000,
                   help="row access: held-out tokens replayed for the LRU cache and reuse distances (default 1,000,000)")
    s.add_argument("--workers", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="run on a Dask cluster of N workers on this host (alone: one per GPU with a GPU backend, one "
                        "per CPU core otherwise); shard results go to OUT/parts/ and a rerun skips finished shards "
                        "(needs the distributed extra)")
    s.add_argument("--scheduler", default=None,
                   help="run on an existing Dask cluster (`dask scheduler` + `dask worker` on each host), e.g. "
                        "tcp://head:8786; --out must be on a file system every worker shares")
    s.add_argument("--shard-mb", type=float, default=32.0,
                   help="with --workers/--scheduler: cut corpus files into shards of about this many MB "
                        "(on document boundaries; default 32)")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("diff", help="diff two backends stage by stage, two models, or two saved captures")
    s.add_argument("file", nargs="?", help="a model in any format (default: the tiny model), or the first of two "
                                           "saved captures (.npz or .safetensors)")
    s.add_argument("file_b", nargs="?", help="the second capture .npz (diff two saved captures)")
    s.add_argument("--model-a", help="diff two models: the first (any format load_model opens)")
    s.add_argument("--model-b", help="diff two models: the second; the same tokens go through both")
    s.add_argument("--a", type=backend_spec, default=None,
                   help="backend of the first run (default reference)")
    s.add_argument("--b", type=backend_spec, default=None,
                   help="backend of the second run (default cuda; with --model-a/--model-b: the same as --a)")
    s.add_argument("--tokens")
    s.add_argument("--residual", choices=["fp32", "bf16"], default="fp32")
    s.add_argument("--max-ulp", type=_float_at_least(0), default=None,
                   help="exit 1 when a float point differs by more ulps (of its own precision)")
    s.add_argument("--rtol", type=_float_at_least(0), default=None,
                   help="exit 1 when a float point's relative L2 distance is larger")
    s.add_argument("--isolated", action="store_true",
                   help="feed every stage of the --b run the --a run's inputs of it (Pipeline.run(inputs_from=...)), "
                        "so each stage's own error shows, not the errors of the stages before it compounded")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("points", help="list the capture points of a model (names for --capture, diff, hooks)")
    s.add_argument("file", nargs="?", help=MODEL_HELP)
    s.set_defaults(func=cmd_points)

    s = sub.add_parser("kernels", help="list the kernel registry: versions, default rules, changelogs")
    s.add_argument("--stage", choices=["rows", "proj", "gate"])
    s.set_defaults(func=cmd_kernels)

    s = sub.add_parser("make-fixture", help="rebuild data/tiny_v41.gguf and its golden captures")
    s.add_argument("--out")
    s.add_argument("--golden")
    s.add_argument("--no-golden", action="store_true")
    s.set_defaults(func=cmd_make_fixture)

    s = sub.add_parser("bench", help="benchmark every stage on the GPU (H200)")
    s.add_argument("--out", default=None, help="result JSON (default bench/results/h200.json)")
    s.add_argument("--png", default=None)
    s.add_argument("--quick", action="store_true", help="fewer repeats")
    s.add_argument("--smoke", action="store_true", help="tiny shapes, runs in the simulator: checks the suite itself")
    s.add_argument("--table-gb", type=_float_at_least(0.001), default=2.0,
                   help="size of the random table on the device")
    s.add_argument("--variants-only", action="store_true", help="only time every kernel version")
    s.add_argument("--sections", help="comma-separated parts to run: host, device, decode, corpus, variants "
                                      "(default all); the JSON is rewritten after each part. 'access' alone: "
                                      "the CPU benchmark of row-access statistics on real text (no GPU; "
                                      "default --out bench/results/cpu_access.json)")
    s.add_argument("--access-tokens", type=int, default=20_000_000,
                   help="--sections access: tokens of real text to count (the corpus is repeated to reach it)")
    s.add_argument("--merge", action="store_true", help="add the sections run to the --out file of an earlier run")
    s.add_argument("--corpus-table-gb", type=_float_at_least(0.001), default=None,
                   help="corpus_stats: each layer's device table in GB (default the released 32.3 GB)")
    s.add_argument("--no-variants", action="store_true", help="skip the per-version sweep")
    s.add_argument("--hash-only", action="store_true",
                   help="only the hasher's 4096-token prefill at the released configuration (CPU, no GPU needed)")
    s.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(_glue_dash_values(list(sys.argv[1:] if argv is None else argv)))
    from .formats.errors import EngramFileError
    try:
        return args.func(args)
    except (UserError, EngramFileError) as exc:
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, KeyError, TypeError, OSError) as exc:
        # Checks inside the library name the problem (token, tensor, range); say it in one line.
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {msg} ({type(exc).__name__}; ENGRAM_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
