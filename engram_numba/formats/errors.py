"""Errors of the file readers: every problem found in a model file has its own type, and every
message names the file, and the key, tensor or shard at fault."""
from __future__ import annotations

from ..errors import EngramError


class EngramFileError(EngramError):
    """Base of every problem found in an Engram model file (GGUF, split GGUF, safetensors checkpoint)."""


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


# Files and folders ----------------------------------------------------------------------------

class MissingFileError(EngramFileError):
    """A file the model needs does not exist (the message names it)."""


class NotARegularFileError(EngramFileError):
    """A path that is a directory, a FIFO, a socket or a device where a regular file is needed
    (refused before anything opens it: opening a FIFO would block)."""


class WrongArchitectureError(BadMetadataError):
    """`general.architecture` names another model (the message says which was expected)."""


class OverlappingTensorsError(BadTensorError):
    """Two tensors' data overlap or alias each other (the message names both and their byte ranges)."""


class HashOverflowError(HashConstantsError):
    """A sum of hash constants (a layer's row count, an offset plus its prime) does not fit in int64."""


class TokenMapError(HashConstantsError):
    """A token map that does not give the configured compressed vocabulary size."""


class UnsupportedEncodingError(UnsupportedQuantError):
    """A table encoding this toolkit does not decode (refused by name, never guessed at)."""


# Split GGUFs ------------------------------------------------------------------------------------

class SplitError(EngramFileError):
    """The shards of a split GGUF do not make one model."""


class MissingShardError(SplitError, MissingFileError):
    """A shard named by the -NNNNN-of-MMMMM pattern is absent (the message names the file)."""


class MixedSplitError(SplitError):
    """Shards of two different splits: their split.count, split.tensors.count or architecture
    disagree, or one tensor appears in two shards."""


class BadSplitNumberError(SplitError):
    """A shard's split.no does not match the number in its file name."""


# safetensors -------------------------------------------------------------------------------------

class SafetensorsHeaderError(EngramFileError):
    """A safetensors header that is not valid: bad length, bad JSON, unknown dtype, a tensor whose
    byte range does not match its shape."""
