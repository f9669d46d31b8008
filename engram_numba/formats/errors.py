"""Errors of the file readers: every problem found in a model file has its own type, and every
message names the file, and the key, tensor or shard at fault."""
from __future__ import annotations


class EngramFileError(Exception):
    """Base of every problem found in an Engram GGUF file."""


class BadMagicError(EngramFileError):
    """The file does not start with b'GGUF'."""


class UnsupportedVersionError(EngramFileError):
    """A GGUF version (or byte order) this reader does not handle."""


class TruncatedFileError(EngramFileError):
    """The header, metadata or a tensor's data runs past the end of the file."""


class MissingKeyError(EngramFileError):
    """A required metadata key is absent (the message says whether the old prefix is used)."""


class BadMetadataError(EngramFileError):
    """A metadata value of the wrong type, length or range."""


class HashConstantsError(EngramFileError):
    """The hash constants are inconsistent (EngramHashTables.validate failed)."""


class RowCountMismatchError(HashConstantsError):
    """A layer's primes do not sum to its table's row count."""


class MissingTensorError(EngramFileError):
    """A required tensor is absent."""


class BadTensorError(EngramFileError):
    """A tensor of the wrong shape, an unaligned offset or a malformed tensor record."""


class UnsupportedQuantError(EngramFileError):
    """A tensor stored in a type this toolkit cannot use (yet)."""
