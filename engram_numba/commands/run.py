"""`engram-numba run`: text or a token sequence through the pipeline, its gate statistics, its captures."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .common import MODEL_HELP, UserError, backend_spec, check_ids, existing_file, int_at_least, model_path, open_model, parse_token_list, tokenizer_or_error, writable


def add_parser(sub) -> None:
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
    s.add_argument("--chunk-tokens", type=int_at_least(1), default=None, help="run the stages this many tokens at a time")
    s.add_argument("--show-tokens", type=int_at_least(0), default=40,
                   help="print the per-token gate table up to this many tokens (0: never)")
    s.add_argument("--capture", help="save every stage's arrays to this .npz (or .safetensors)")
    s.set_defaults(func=cmd_run)


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


def cmd_run(args) -> int:
    from ..analysis.stats import gate_stats
    from ..fixtures import TINY_TOKENS
    from ..highway import HighwayFileError, load_highway
    from ..pipeline import Pipeline
    path = model_path(args.file) if args.file else None
    capture = writable(args.capture, "capture file")
    sources = [name for name, v in (("--text", args.text), ("--text-file", args.text_file), ("--tokens", args.tokens),
                                    ("--tokens-file", args.tokens_file)) if v is not None]
    if len(sources) > 1:
        raise UserError(f"give one token source, got {' and '.join(sources)}")
    text = args.text
    if args.text_file is not None:
        text = existing_file(args.text_file, "--text-file").read_text(encoding="utf-8")
    if text is not None and not text.strip():
        raise UserError("the text is empty")
    tokens = None
    if args.tokens is not None:
        tokens = parse_token_list(args.tokens)
    elif args.tokens_file is not None:
        tokens = _read_token_file(existing_file(args.tokens_file, "--tokens-file"))
    tokenizer_path = str(existing_file(args.tokenizer, "--tokenizer")) if args.tokenizer else None
    highway_path = existing_file(args.highway, "--highway") if args.highway else None
    model = open_model(path)
    tok = tokenizer_or_error(model, tokenizer_path, need_encode=text is not None) if (
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
        tokens = check_ids(tokens, model)
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
