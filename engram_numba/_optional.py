"""Optional dependencies, with one message that names the extra to install."""
from __future__ import annotations

ANALYSIS_EXTRA = "pip install 'engram-numba[analysis]'  (pandas and pyarrow)"


def require_pandas(what: str):
    """pandas, or an ImportError naming the `analysis` extra."""
    try:
        import pandas
    except ImportError:
        raise ImportError(f"{what} needs pandas, which is not installed: {ANALYSIS_EXTRA}") from None
    return pandas


def require_pyarrow(what: str):
    """pyarrow (with pandas), or an ImportError naming the `analysis` extra."""
    require_pandas(what)
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError(f"{what} writes parquet, which needs pyarrow, not installed: {ANALYSIS_EXTRA}; "
                          "or write CSV instead") from None
    return pyarrow


def have(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
