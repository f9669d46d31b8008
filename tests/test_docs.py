"""The documentation names only what the repository holds: every repository path written in
README.md, CONTRIBUTING.md, docs/*.md and notebooks/README.md exists (a glob matches something),
and docs/README.md lists every document in docs/."""
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "notebooks" / "README.md",
               *(REPO / "docs").glob("*.md")])
TOP = ("engram_numba", "tests", "docs", "notebooks", "data", "bench", "tools", ".ci")
# a path: a top-level folder, then path characters; placeholders (<name>, {stem}) are not paths
PATH = re.compile(r"(?<![\w/.\-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w.*/\-\[\]]*)")


def repo_paths(text: str) -> set[str]:
    out = set()
    for m in PATH.finditer(text):
        p = m.group(1).rstrip(".,:;")
        if p.endswith("]") and "[" not in p:           # the end of a markdown link's text
            p = p[:-1].rstrip(".,:;")
        end = m.end(1)
        if end < len(text) and text[end] in "<{":        # a placeholder follows: a pattern, not a path
            continue
        out.add(p)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_in_the_docs_exists(doc):
    text = doc.read_text(encoding="utf-8")
    missing = []
    for p in sorted(repo_paths(text)):
        if any(c in p for c in "*[") and list(REPO.glob(p)):
            continue
        if "." not in p.rsplit("/", 1)[-1] and list(REPO.glob(p + ".*")):   # a stem: notebooks/01_walk
            continue
        if not (REPO / p).exists():
            missing.append(p)
    assert not missing, f"{doc.relative_to(REPO)} names paths the repository does not hold: {missing}"


def test_the_path_finder_finds_paths():
    text = ("see `engram_numba/stages/registry.py`, tests/test_x.py: and notebooks/05_<name>.py or docs/{x}.md, "
            "[docs/math.md](docs/math.md) and `notebooks/[0-9]*.py`.")
    assert repo_paths(text) == {"engram_numba/stages/registry.py", "tests/test_x.py", "docs/math.md",
                                "notebooks/[0-9]*.py"}


def test_docs_readme_lists_every_document():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    for doc in (REPO / "docs").glob("*.md"):
        if doc.name != "README.md":
            assert doc.name in index, f"docs/README.md does not list {doc.name}"
