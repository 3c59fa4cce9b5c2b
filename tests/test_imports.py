"""The repo's import graph: no cycles, and no import from a lower layer into a higher one.

Every .py file of the repo is parsed with ``ast`` (nothing is imported) and every import
statement counts, those inside functions and under ``TYPE_CHECKING`` too: a lazy import
hides a cycle from the interpreter, not from the reader. ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module of the repo, else to ``pkg``. Cython sources
(cext/*.pyx, *.pxd) are read line by line for their Python imports. The layers are drawn in
docs/architecture.md.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"build", "node_modules", "__pycache__"}

# Cycles tolerated, each with its reason (the web layout removed the last two: ray_ingress <->
# ray_serve, benchmarks' seed_validation <-> vs_llamacpp).
ALLOWED_CYCLES: set[frozenset[str]] = set()

# The public surface of the engine: what callers import first (README, "Python API").
PUBLIC_SURFACE = ("engine.api", "engine.async_stream", "engine.request_stream", "engine.chat",
                  "engine.__main__", "engine.cli", "engine.chat_repl")

# (importer, imported, why): no module under the first may import one under the second.
FORBIDDEN = [
    ("engine.core", PUBLIC_SURFACE, "the engine thread is below the public surface"),
    ("engine.models", ("engine.core",), "models implement ForwardBatch (engine/batch.py), not the core"),
    ("engine.text", ("engine.core", "engine.sampling", "engine.tools") + PUBLIC_SURFACE,
     "text is a leaf of the core"),
    ("engine.sampling", ("engine.core", "engine.text", "engine.tools") + PUBLIC_SURFACE,
     "sampling is a leaf of the core"),
    ("engine.outputs", ("engine.core", "engine.tools", "engine.text", "engine.sampling") + PUBLIC_SURFACE,
     "the base output types depend on nothing above them"),
    ("engine.display", ("engine",), "a leaf: the outputs' repr imports it"),
    ("engine.params", ("engine.core", "engine.tools", "engine.sampling") + PUBLIC_SURFACE,
     "SamplingParams is a base type"),
    ("engine.batch", ("engine.core", "engine.models") + PUBLIC_SURFACE,
     "the model interface sits below both"),
    ("cext", ("engine", "webapp"), "the kernels know no Python package of the engine"),
    ("engine", ("webapp", "benchmarks", "tests"), "the engine does not know its front-ends"),
    ("webapp", ("benchmarks", "tests"), "the server does not know its benchmarks or tests"),
]


# Edges the rules above would refuse, each with its reason.
ALLOWED_EDGES = {
    ("engine.cli", "webapp.__main__"): "the llm-engine console script dispatches to both front-ends "
                                       "(`serve` loads the server only when asked)",
}


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def repo_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (path, is_package) for every .py file of the repo."""
    modules = {}
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            continue
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        if parts:
            modules[".".join(parts)] = (path, is_package)
    return modules


def _resolve(target: str, modules) -> str | None:
    """The repo module ``target`` names (or its nearest enclosing package); None outside the repo."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported repo module: line of the first such import} (read once per run)."""
    modules = repo_modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    edges.setdefault(resolved, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_graph_sees_the_repo():
    graph = import_graph()
    # A few edges that exist: the walk resolves absolute, relative and from-package imports.
    assert "engine.core.runtime" in graph["engine.api"]
    assert "engine.core.sequence" in graph["engine.core.scheduler"]
    assert "engine.batch" in graph["engine.models.llama"]
    assert "engine.text.detokenizer" in graph["engine.text.text_stream"]
    assert len(graph) > 150


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_cycles():
    found = set(cycles(import_graph()))
    unexpected = found - ALLOWED_CYCLES
    assert not unexpected, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in unexpected)


def test_no_upward_imports():
    graph = import_graph()
    violations = []
    for module, edges in sorted(graph.items()):
        for importer, forbidden, why in FORBIDDEN:
            if not _is_under(module, importer):
                continue
            for target, line in edges.items():
                if any(_is_under(target, f) for f in forbidden) and (module, target) not in ALLOWED_EDGES:
                    violations.append(f"{module}:{line} imports {target} ({why})")
    assert not violations, "\n".join(violations)


def test_cython_sources_import_no_engine_module():
    pattern = re.compile(r"^\s*(?:from|c?import)\s+(engine|webapp)\b", re.MULTILINE)
    sources = sorted((REPO / "cext").glob("*.py[xd]"))
    assert sources
    offenders = [f"{path.name}: {m.group(0).strip()}" for path in sources
                 for m in pattern.finditer(path.read_text(encoding="utf-8"))]
    assert not offenders, offenders
