"""The root of every error the toolkit raises on purpose: `except engram_numba.EngramError` catches
them all. Each class also keeps the standard base it always had (a bad highway file is still a
ValueError), so `except ValueError` goes on working.

    EngramError
      EngramFileError (formats/errors.py)   a model file: GGUF, split GGUF, safetensors checkpoint
      HighwayFileError (highway.py)         a highway file (also a ValueError)
      NoTokenizerError (text.py)            no tokenizer to encode with (also a ValueError)
      UserError (commands/common.py)        a command-line mistake, reported in one line
"""
from __future__ import annotations


class EngramError(Exception):
    """Base of every error engram_numba raises on purpose (with a message that names the problem)."""
