"""The package's shape: no import cycles, the public face, and the docs' Python runs.

The import graph is read from the source (every `import` and `from ... import` statement of every
module, function-level imports included), so a cycle that only a lazy import would hide still
counts. Parent packages are not edges: importing a.b.c runs a/__init__ and a/b/__init__, but those
only document their folders (a test below checks that they import nothing of their own package
except constants).
"""
import ast
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PKG = REPO / "engram_numba"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py") if "tests" not in p.relative_to(PKG).parts}


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module)
                # `from pkg import sub` imports the submodule when there is one
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods and "." in n:
                    n = n.rsplit(".", 1)[0]
                if n in mods and n.startswith("engram_numba") and n != mod:
                    edges.add(n)
        graph[mod] = edges
    return graph


def find_cycle(graph):
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {m: WHITE for m in graph}
    stack = []

    def visit(m):
        colour[m] = GREY
        stack.append(m)
        for n in sorted(graph[m]):
            if colour[n] == GREY:
                return stack[stack.index(n):] + [n]
            if colour[n] == WHITE:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        colour[m] = BLACK
        return None

    for m in sorted(graph):
        if colour[m] == WHITE:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 30 and "engram_numba.stages.proj.launch" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kernels_never_import_tooling_and_stats_never_import_plots():
    graph = import_graph()
    tooling = ("engram_numba.pipeline", "engram_numba.engine", "engram_numba.analysis", "engram_numba.bench",
               "engram_numba.cli", "engram_numba.stages.compile_check", "engram_numba.stages.catalog")
    for mod, edges in graph.items():
        if re.match(r"engram_numba\.stages\.\w+\.(cuda\w*|reference|cpu|tables|q2k|encodings)$", mod):
            bad = [e for e in edges if e.startswith(tooling)]
            assert not bad, f"{mod} imports tooling {bad}"
    assert "engram_numba.analysis.plots" not in graph["engram_numba.analysis.stats"]


def test_package_inits_import_nothing_heavy():
    graph = import_graph()
    for mod, path in _modules().items():
        if path.name == "__init__.py" and mod != "engram_numba":
            assert graph[mod] <= {"engram_numba.stages.registry"}, (mod, graph[mod])


PUBLIC = ("load_gguf", "Pipeline", "Capture", "diff", "gate_stats", "EngramV41", "gate_heatmap", "gate_histogram",
          "gate_vs_dot", "row_id_reuse_plot", "tiny_model_path", "TINY_TOKENS", "TINY_MASK", "kernels",
          "released_model", "access_stats", "AccessStats", "offline_corpus", "gate_by_class", "row_edit")


@pytest.mark.parametrize("name", PUBLIC)
def test_public_face(name):
    import engram_numba as en
    assert name in en.__all__ and name in dir(en)
    assert getattr(en, name) is not None


def test_unknown_public_name_is_an_attribute_error():
    import engram_numba as en
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        en.nope  # noqa: B018


def _python_blocks(md: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", md.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path, monkeypatch):
    """Docs as tests: every ```python block of the README runs, in order, in one namespace (slow:
    the first block runs the 14-token CUDA pipeline in the simulator, about a minute of CPU)."""
    import matplotlib
    matplotlib.use("Agg")
    blocks = _python_blocks(REPO / "README.md")
    assert blocks, "the README has no python blocks"
    (tmp_path / "data").symlink_to(REPO / "data")     # the README's paths are relative to the repository
    monkeypatch.chdir(tmp_path)                       # what the blocks write lands in tmp_path
    ns: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), ns)


@pytest.mark.parametrize("numba_first", ["numba", "numba.cuda"])
def test_importing_numba_first_still_picks_the_simulator_or_says_why(numba_first):
    """Without a GPU: `import numba` before engram_numba still gives the simulator; importing
    numba.cuda first (its real target chosen) gives a clear message when the cuda backend is asked for."""
    from engram_numba import _target
    if _target.gpu_device_present():
        pytest.skip("this machine has a GPU")
    code = (f"import {numba_first}\nimport engram_numba as en\nprint('SIM', en.SIMULATOR)\n"
            "m = en.load_gguf(en.tiny_model_path())\n"
            "try:\n    en.Pipeline(m, 'cuda')\n    print('CUDA OK')\nexcept RuntimeError as e:\n    print('MSG', e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if numba_first == "numba":
        assert "SIM True" in out.stdout and "CUDA OK" in out.stdout
    else:
        assert "SIM False" in out.stdout and "NUMBA_ENABLE_CUDASIM=1 before numba is first imported" in out.stdout


@pytest.mark.slow      # a fresh process compiling the cpu backend: make test runs it, make test-fast does not
def test_forked_child_survives_the_cpu_backend(tmp_path):
    """After the cpu backend's parallel kernels ran, a child forked by multiprocessing (the default
    start method on Linux) runs them too: the package picks a fork-safe threading layer."""
    script = tmp_path / "fork.py"
    script.write_text(
        "import multiprocessing as mp\nimport engram_numba as en\n"
        "def child(q):\n"
        "    m = en.load_gguf(en.tiny_model_path())\n"
        "    q.put(float(en.Pipeline(m, 'cpu').run(en.TINY_TOKENS)['L1.gate.gate'].sum()))\n"
        "if __name__ == '__main__':\n"
        "    m = en.load_gguf(en.tiny_model_path())\n"
        "    want = float(en.Pipeline(m, 'cpu').run(en.TINY_TOKENS)['L1.gate.gate'].sum())\n"
        "    ctx = mp.get_context('fork'); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,))\n"
        "    p.start(); p.join(120)\n"
        "    assert p.exitcode == 0, p.exitcode\n"
        "    assert q.get(timeout=5) == want\n"
        "    print('FORK OK')\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("NUMBA_THREADING_LAYER")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert "FORK OK" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
