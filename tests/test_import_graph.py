"""The import graph of ``dlrover_core`` and of every plugin package has no cycle, and
no module of theirs is over :data:`MAX_LINES` lines (one job per module).

The graph is read from the source with :mod:`ast` (nothing is imported): an edge
``a -> b`` for every ``import b`` / ``from b import x`` in module ``a``, wherever it
stands, so imports under ``if TYPE_CHECKING:`` and inside functions count too (they
are the same coupling). ``from pkg import mod`` is an edge to the submodule
``pkg.mod`` when it is one. Cycles are the strongly connected components of more
than one module (Tarjan's algorithm, iterative).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def package_roots(repo: Path = REPO) -> list[Path]:
    """``dlrover_core/`` and ``plugins/<name>/dlrover_plugin_<name>/``."""
    return [repo / "dlrover_core", *sorted((repo / "plugins").glob("*/dlrover_plugin_*"))]


def modules(roots: list[Path]) -> dict[str, tuple[Path, bool]]:
    """dotted module name -> (file, whether it is a package ``__init__``)."""
    out = {}
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            parts = list(f.relative_to(root.parent).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``mods`` it imports (itself left out)."""

    def known(name: str) -> str | None:  # the longest prefix that is one of ours
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    deps.update(filter(None, [sub if sub in mods else known(base)]))
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle_in_core_or_plugins():
    mods = modules(package_roots())
    assert "dlrover_core.master.launcher" in mods and "dlrover_plugin_fsdp.plugin" in mods
    assert cycles(import_graph(mods)) == []


def test_the_check_sees_a_type_checking_cycle(tmp_path):
    """Two modules that import each other, one only under ``TYPE_CHECKING`` and one
    through a relative import, make a cycle; a third that only imports them does not
    join it."""
    pkg = tmp_path / "dlrover_core"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from dlrover_core.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("import dlrover_core.a\nfrom dlrover_core import b\n")
    graph = import_graph(modules([pkg]))
    assert graph["dlrover_core.c"] == {"dlrover_core.a", "dlrover_core.b"}
    assert cycles(graph) == [["dlrover_core.a", "dlrover_core.b"]]


def test_no_module_over_max_lines():
    mods = modules(package_roots())
    sizes = {str(f.relative_to(REPO)): len(f.read_text().splitlines())
             for f, _ in mods.values()}
    assert len(sizes) > 100  # the core and the plugins were found
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}
