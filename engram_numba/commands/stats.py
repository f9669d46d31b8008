"""`engram-numba stats`: a corpus streamed through the pipeline (one process or Dask workers) into
mergeable gate statistics, row-access statistics, tables and plots; `--merge` adds saved parts."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .common import MODEL_HELP, RELEASED, UserError, backend_spec, existing_file, model_path, open_model, tokenizer_or_error


def add_parser(sub) -> None:
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
    from ..analysis import distributed as dist
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
    from ..placement import PLACEMENTS
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
    from ..engine import EngramV41
    backend = args.backend if isinstance(args.backend, dict) else {s: args.backend for s in ("rows", "proj", "gate")}
    if any(backend.get(s) != "cuda" for s in ("rows", "proj", "gate")):
        raise UserError("--table-placement needs the cuda backend for rows, proj and gate (--backend cuda)")
    return EngramV41(model, max_tokens=args.chunk_tokens, tables=args.table_placement)


def cmd_stats(args) -> int:
    import matplotlib
    matplotlib.use("Agg")
    from .. import _optional
    from ..analysis import streaming
    from ..analysis.corpus import FORMATS, corpus_files, corpus_format, corpus_stats
    from ..analysis.plots import corpus_columns_plot, corpus_token_plot, gate_histogram
    from ..analysis.tables import write_tables

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
            p = existing_file(f, "statistics file")
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
            model = open_model(model_path(args.model) if args.model else None)
        tok_path = args.tokenizer or st.meta.get("tokenizer")
        if tok_path and Path(str(tok_path)).exists():
            from ..text import load_tokenizer
            st.tokenizer = load_tokenizer(tok_path)
        elif model is not None:
            from ..text import NoTokenizerError, tokenizer_for
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
        tokenizer_path = str(existing_file(args.tokenizer, "--tokenizer")) if args.tokenizer else None
        model = open_model(model_path(args.model) if args.model else None,
                      tokenizer_path if args.model == RELEASED else None)
        kinds = {corpus_format(f, args.format) for f in files}
        if "text" in kinds or tokenizer_path:
            tokenizer_or_error(model, tokenizer_path, need_encode="text" in kinds)
        if args.table_placement and (args.workers is not None or args.scheduler is not None):
            raise UserError("--table-placement applies to one process: with --workers/--scheduler each worker "
                            "places its tables itself (device when they fit)")
        engine = _placed_engine(model, args) if args.table_placement else None     # refused before any output
        from ..formats.released import has_weights
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
    from ..analysis.access import AccessStats
    from ..analysis.corpus import iter_documents
    from ..text import tokenizer_for
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
    from ..analysis.tables import write_tables
    written = write_tables({"access_columns": rep.columns_records(), "access_cache": rep.cache_records()},
                           folder, tables_fmt)
    for name, fn in (("access_zipf", rep.zipf_plot), ("access_cache", rep.cache_plot),
                     ("access_reuse", rep.reuse_plot)):
        fn().savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight")
    plt.close("all")
    print(f"wrote {folder}/: access.json, access.npz (merge with `engram-numba stats --merge --access`), "
          f"{', '.join(p.name for p in written)}, access_zipf.png, access_cache.png, access_reuse.png")


def _merge_access(args, out: Path) -> int:
    from ..analysis.access import AccessStats, merge_access
    parts = []
    for f in args.corpus:
        p = existing_file(f, "access statistics file")
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
