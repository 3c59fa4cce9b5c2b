"""The web layer's layout: what each front-end loads, and no import cycle in webapp/ or benchmarks/.

The Ray Serve path (webapp.ray_ingress, webapp.ray_serve) runs without Flask, waitress or
werkzeug; ``import webapp`` loads no web framework until ``create_app``/``serve`` are used.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLASK_SIDE = ("flask", "werkzeug", "waitress")


def _loaded_after(code: str) -> set[str]:
    """Which of FLASK_SIDE a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {FLASK_SIDE!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return set(out.stdout.split())


def test_ray_path_loads_no_flask():
    assert _loaded_after("import webapp.ray_serve, webapp.ray_ingress, webapp.ray_router") == set()


def test_package_import_is_framework_free_until_the_app_is_asked_for():
    assert _loaded_after("import webapp, webapp.generation, webapp.protocol, webapp.sse") == set()
    assert _loaded_after("import webapp; webapp.create_app") == {"flask", "werkzeug"}
    assert _loaded_after("from webapp import serve") == {"flask", "werkzeug"}  # waitress: when serving


def test_public_names_resolve_to_their_modules():
    import webapp
    import webapp.app
    import webapp.wsgi

    assert webapp.create_app is webapp.app.create_app
    assert webapp.serve is webapp.wsgi.serve and webapp.make_server is webapp.wsgi.make_server
    assert {"create_app", "serve", "make_server"} <= set(dir(webapp))
    with pytest.raises(AttributeError, match="no_such_name"):
        webapp.no_such_name  # noqa: B018


def _module_imports(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (at top level or inside functions)."""
    modules = {}
    for name in sorted(os.listdir(os.path.join(REPO, package))):
        if name.endswith(".py"):
            modules[f"{package}.{name[:-3]}".removesuffix(".__init__")] = os.path.join(REPO, package, name)
    graph = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level else (node.module or "")
                if node.level and node.module:
                    base = f"{package}.{node.module}"
                deps.add(base)
                deps.update(f"{base}.{alias.name}" for alias in node.names)
        graph[module] = {d for d in deps if d in modules and d not in (module, package)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path, or None (depth-first, three colours)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_webapp_or_benchmarks():
    for package in ("webapp", "benchmarks"):
        graph = _module_imports(package)
        assert len(graph) > 5
        assert _cycle(graph) is None, f"{package}: import cycle {' -> '.join(_cycle(graph))}"


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
