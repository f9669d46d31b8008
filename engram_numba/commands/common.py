"""What every command shares: the user-error class and exit codes, argument types, and the
checks of paths, token lists and models that run before any work."""
from __future__ import annotations

import time

T_START = time.perf_counter()   # the demo reports its time from here: imports included

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from ..errors import EngramError  # noqa: E402

STAGES = ("hash", "rows", "proj", "gate")
BACKENDS = ("reference", "cpu", "cuda")
EXIT_USAGE = 2        # bad arguments or inputs
EXIT_TOLERANCE = 1    # diff: a tolerance was exceeded; info: the file's checks failed
RELEASED = "released"  # --model released: the released V4.1 configuration without weights


class UserError(EngramError):
    """A mistake in the command's arguments or inputs: reported in one line, exit status 2."""


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
    from ..pipeline import BACKEND_NAMES, resolve_backends
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


def existing_file(path: str | None, what: str = "model file") -> Path | None:
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


def writable(path: str | None, what: str) -> Path | None:
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


def open_model(path: Path | None, tokenizer: str | None = None):
    """Any model file or folder load_model opens (default: the tiny model in data/); the word
    `released` opens the released V4.1 configuration (hash constants from DeepSeek-V4's
    tokenizer, no weights: hashing and row statistics only)."""
    from ..fixtures import tiny_model_path
    from ..formats.load import load_model
    if path is not None and str(path) == RELEASED:
        from ..formats.released import released_model
        return released_model(tokenizer)
    return load_model(path if path is not None else tiny_model_path())


def model_path(path: str, what: str = "model") -> Path:
    """A model path for load_model: a file, a shard, or a folder (split GGUF, HF checkpoint), or
    the word `released` (see open_model)."""
    p = Path(path)
    if path == RELEASED and not os.path.lexists(p):
        return p
    if not os.path.lexists(p):
        raise UserError(f"{what} {path} does not exist")
    return p


def check_ids(tokens: np.ndarray, model) -> np.ndarray:
    vocab = model.hash_tables.token_map.size
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise UserError(f"token id {int(tokens[i])} at position {i} is outside the model's token map [0, {vocab})")
    return tokens


def tokenizer_or_error(model, path, need_encode: bool):
    from ..text import NoTokenizerError, tokenizer_for
    try:
        return tokenizer_for(model, path, need_encode=need_encode)
    except NoTokenizerError as exc:
        raise UserError(str(exc).replace("tokenizer=PATH to a tokenizer.json (--tokenizer PATH on the command line)",
                                         "--tokenizer PATH (a tokenizer.json)")) from None


def float_at_least(lo: float):
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


def int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text}")
        return v
    return parse
