"""The notebooks in notebooks/ are jupytext percent-format .py sources, each paired with a generated
.ipynb committed with its outputs stripped. These tests keep each pair in step; executing the
notebooks is `pytest --nbmake notebooks` (the Makefile's test target). See notebooks/README.md.
"""
import json
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
# every notebook: a numbered jupytext source NN_name.py (found by glob, so a new one is tested too)
STEMS = tuple(sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py")))
REGENERATE = "regenerate it: `jupytext --sync notebooks/[0-9]*.py` (see notebooks/README.md)"


def _source(cell) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def test_every_notebook_is_a_pair_listed_in_the_readme():
    assert len(STEMS) >= 4
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == list(STEMS), "every .py has its .ipynb and back"
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.py")) == list(STEMS), "only notebook sources in notebooks/"
    readme = (NOTEBOOKS / "README.md").read_text(encoding="utf-8")
    for stem in STEMS:
        assert f"`{stem}`" in readme, f"notebooks/README.md does not list {stem}"


def test_notebooks_are_paired():
    """jupytext.toml pairs every notebook in the folder with its percent-format .py."""
    text = (NOTEBOOKS / "jupytext.toml").read_text(encoding="utf-8")
    assert 'formats = "ipynb,py:percent"' in text


@pytest.mark.parametrize("stem", STEMS)
def test_source_is_jupytext_percent_format(stem):
    text = (NOTEBOOKS / f"{stem}.py").read_text(encoding="utf-8")
    header = text.split("\n# ---\n", 1)[0]
    assert text.startswith("# ---\n# jupyter:\n"), f"{stem}.py lacks the jupytext header block"
    for line in ("#       format_name: percent", "#     name: python3"):
        assert line in header, f"{stem}.py header lacks {line.strip('# ')!r}"
    assert "\n# %% [markdown]\n" in text and "\n# %%\n" in text


@pytest.mark.parametrize("stem", STEMS)
def test_notebook_outputs_are_stripped(stem):
    nb = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{stem}.ipynb has no code cells"
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            assert "outputs" not in cell and "execution_count" not in cell, f"{stem}.ipynb cell {i}"
            continue
        assert cell["outputs"] == [], f"{stem}.ipynb cell {i} has outputs: clear them, or {REGENERATE}"
        assert cell["execution_count"] is None, f"{stem}.ipynb cell {i} has an execution count"
    # No execution traces in the notebook's metadata either (widget state, timings, versions).
    assert set(nb["metadata"]) <= {"kernelspec", "language_info"}, f"{stem}.ipynb metadata: {sorted(nb['metadata'])}"
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("stem", STEMS)
def test_notebook_is_valid_nbformat(stem):
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4))


@pytest.mark.parametrize("stem", STEMS)
def test_notebook_is_what_jupytext_makes_of_its_source(stem):
    """Each .ipynb holds exactly the cells jupytext reads from its .py: same types, sources and
    cell metadata, in the same order (cell ids are not compared: jupytext draws new ones)."""
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    want = jupytext.read(NOTEBOOKS / f"{stem}.py")
    have = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    assert len(have.cells) == len(want.cells), (
        f"{stem}.ipynb has {len(have.cells)} cells, {stem}.py has {len(want.cells)}: {REGENERATE}")
    for i, (h, w) in enumerate(zip(have.cells, want.cells)):
        where = f"{stem}.ipynb cell {i} differs from {stem}.py"
        assert h.cell_type == w.cell_type, f"{where} (type {h.cell_type} vs {w.cell_type}): {REGENERATE}"
        assert _source(h) == _source(w), f"{where} (source): {REGENERATE}"
        assert dict(h.metadata) == dict(w.metadata), f"{where} (cell metadata): {REGENERATE}"
    assert dict(have.metadata.get("kernelspec", {})) == dict(want.metadata.get("kernelspec", {}))


@pytest.mark.parametrize("stem", STEMS)
def test_notebooks_use_the_public_api_and_stay_in_the_repository(stem):
    """The notebooks use the public API (no module that does not exist) and point at nothing outside the repo."""
    text = (NOTEBOOKS / f"{stem}.py").read_text(encoding="utf-8")
    for old in ("engram_numba.model_file", "engram_numba.kernels", "engram_numba.reference",
                "engram_numba.compare", "engram_numba.hash ", "from engram_numba import compare",
                "SPEC", "shared/"):
        assert old not in text, f"{stem}.py mentions {old!r}"
    assert not re.search(r"L(\d+|\{\w+\})\.rows\.q2k", text), "capture point rows.q2k is now rows.raw"
    assert "import engram_numba as en" in text
