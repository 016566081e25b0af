"""No module of the ``jaxkv`` package imports another in a cycle.

The graph is built statically from the source (``ast``): an edge for every ``import`` /
``from ... import`` of a jaxkv module anywhere in a file, at module level or inside a function
(an import inside a function only hides a cycle until the function runs). ``from a.b import
c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``. Package ``__init__`` files
are modules like the others; the edge from a module to its own parent packages, which Python
imports first, is left out (every package's re-exports would otherwise close a loop).
``models/`` and ``pallas_kernels/`` are the subpackages ``jaxkv.models`` and
``jaxkv.pallas_kernels`` (pyproject.toml's ``package-dir``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "jaxkv": ROOT / "jaxkv",
    "jaxkv.models": ROOT / "models",
    "jaxkv.pallas_kernels": ROOT / "pallas_kernels",
}


def package_modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    modules = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(not p.isidentifier() for p in parts):  # not importable (e.g. a script folder)
                continue
            name = ".".join([prefix, *parts])
            if name.startswith("jaxkv.models.") and prefix == "jaxkv":  # jaxkv/models, if any
                continue
            modules[name] = path
    return modules


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The jaxkv modules ``module`` imports, anywhere in its file."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:  # `import jaxkv.a.b.attr` -> the module a.b
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name)
            if target is not None and target != module:
                found.add(target)
    parents = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
    return found - parents


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan's
    algorithm, iterative), each as a closed path ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest closed path through the component's first module (breadth first)."""
    first = min(component)
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == first:
                    return paths[node] + [first]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {first} in {sorted(component)}")


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "jaxkv.entrypoints.cli" in graph and "jaxkv.models.config" in graph
    assert "jaxkv.entrypoints.llm" in graph["jaxkv.entrypoints.cli_generate"]  # in a function


def test_find_cycles_reports_each_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in jaxkv:\n" + "\n".join(" -> ".join(c) for c in cycles)
