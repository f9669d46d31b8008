"""One error root: every error class the toolkit raises on purpose derives from EngramError and
keeps the standard base it had, so `except EngramError` catches them all and `except ValueError`
still catches the ones that were ValueErrors."""
import inspect

import pytest

import engram_numba as en
from engram_numba import highway, text
from engram_numba.commands import common as cli_common
from engram_numba.errors import EngramError
from engram_numba.formats import errors as file_errors


def _error_classes():
    out = []
    for mod in (file_errors, highway, text, cli_common):
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, Exception) and obj.__module__ == mod.__name__:
                out.append(obj)
    return out


def test_public_root():
    assert en.EngramError is EngramError and issubclass(EngramError, Exception)


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_derives_from_the_root(cls):
    assert issubclass(cls, EngramError), f"{cls.__module__}.{cls.__name__} is not an EngramError"


def test_the_old_bases_stay():
    assert issubclass(highway.HighwayFileError, ValueError)
    assert issubclass(text.NoTokenizerError, ValueError)
    assert issubclass(file_errors.MissingShardError, file_errors.MissingFileError)
    assert issubclass(file_errors.WrongArchitectureError, file_errors.BadMetadataError)


def test_a_file_error_is_caught_by_the_root(tmp_path):
    bad = tmp_path / "not_a_model.gguf"
    bad.write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(EngramError, match="not_a_model.gguf"):
        en.load_model(bad)
