"""No import cycles between dpfl's modules, nor between its rooms (lazy imports inside
functions included; imports under ``if TYPE_CHECKING:`` excluded, as they never run).

A room is a package by concept (docs/architecture.md): ``algorithms``, ``tuning``,
``cluster``, and each of ``engine``'s subpackages or top-level modules
(``engine.cli``, ``engine.config``, ``engine.privacy``, ``engine.models``, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "algorithms", "tuning", "cluster")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the dpfl modules it imports. ``from pkg import sub`` is an edge to
    ``pkg.sub`` when that is a module (the package's own code is not needed for it)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for b in node.body
            for n in ast.walk(b)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [s for s in subs if s in mods] or [node.module]
            else:
                continue
            edges[m] |= {n for n in names if n in mods and n != m}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_dpfl_has_no_import_cycles() -> None:
    edges = import_graph()
    assert "engine.cli.submit" in edges and "engine.cli.parser" in edges["engine.cli.submit"]
    assert cycles(edges) == []


def room(module: str) -> str:
    """The room of a dpfl module: ``engine.X`` for anything in engine's subpackage or
    module X, the top-level package otherwise (``engine`` itself is its own room)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" and len(parts) > 1 else parts[0]


def room_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import."""
    out: dict[str, set[str]] = {}
    for a, bs in edges.items():
        out.setdefault(room(a), set())
        out[room(a)] |= {room(b) for b in bs if room(b) != room(a)}
    return out


def test_room_graph_finds_a_room_cycle() -> None:
    edges = {"engine.cli.a": {"tuning.x"}, "tuning.x": {"engine.cli.b"}, "engine.cli.b": set()}
    assert cycles(room_graph(edges)) == [["engine.cli", "tuning"]]


def test_dpfl_rooms_have_no_cycles() -> None:
    """The rooms form a DAG: the command line on top, privacy/data/telemetry below."""
    rooms = room_graph(import_graph())
    assert {"engine.cli", "engine.config", "engine.privacy", "engine.federated"} <= set(rooms)
    assert cycles(rooms) == []


def test_every_room_says_its_role() -> None:
    """Each room's package ``__init__`` (or module) opens with a role docstring."""
    for pkg in sorted({room(m) for m in _modules()}):
        path = ROOT / Path(*pkg.split("."))
        init = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 8 and doc != "TODO", f"{init}: no role docstring"


def package(module: str) -> str:
    """The directory package a module's file lives in (a package's ``__init__`` is the
    package itself)."""
    path = ROOT / Path(*module.split("."))
    return module if (path / "__init__.py").exists() else module.rsplit(".", 1)[0]


def test_dpfl_packages_have_no_cycles() -> None:
    """Read by directory too: no package (``engine``, ``engine.privacy``,
    ``algorithms.pieces``, ...) imports another that imports it back, so the engine
    package's own ``__init__`` (the notebook API, on top of everything) holds no leaf
    that lower rooms need."""
    edges = import_graph()
    packages: dict[str, set[str]] = {}
    for a, bs in edges.items():
        packages.setdefault(package(a), set())
        packages[package(a)] |= {package(b) for b in bs if package(b) != package(a)}
    assert {"engine", "engine.privacy", "algorithms.pieces"} <= set(packages)
    assert cycles(packages) == []


def import_time_graph() -> dict[str, set[str]]:
    """Module -> the dpfl modules that run while it is imported: its top-level imports
    (not those inside functions, which run later) and, for each imported ``a.b.c``, the
    parent packages ``a`` and ``a.b``, whose ``__init__`` Python runs first, except the
    module's own parents: those began before its body did (imported first, a module's
    package runs first and imports it from there, if it does, completely). A cycle
    here is an ``ImportError`` ("partially initialized module") for a module of the
    cycle imported first."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}

    def with_parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(mods)

    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        for node in tree.body:  # top level only; if/try blocks at top level too
            nodes = [node] if not isinstance(node, (ast.If, ast.Try)) else list(ast.walk(node))
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for n in nodes:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if isinstance(n, ast.Import):
                    names = [a.name for a in n.names]
                elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                    subs = [f"{n.module}.{a.name}" for a in n.names]
                    names = [s for s in subs if s in mods] + [n.module]
                else:
                    continue
                for name in names:
                    edges[m] |= with_parents(name) - with_parents(m)
    return edges


def test_import_time_graph_sees_a_parent_package_cycle() -> None:
    """The cycle issue 43 found: ``algorithms.compose`` imported ``engine.base.errors``,
    which runs ``engine/__init__``, which imported ``engine.config``, which imports
    ``algorithms.compose``. With the parents' edges the checker sees it."""
    edges = {
        "algorithms": set(),
        "algorithms.compose": {"algorithms", "engine", "engine.base", "engine.base.errors"},
        "engine": {"engine.config"},
        "engine.base": {"engine"},
        "engine.base.errors": {"engine", "engine.base"},
        "engine.config": {"engine", "algorithms", "algorithms.compose"},
    }
    assert cycles(edges) == [
        ["algorithms.compose", "engine", "engine.base", "engine.base.errors", "engine.config"]
    ]


def test_dpfl_has_no_import_time_cycles() -> None:
    """No chain of imports that run at import time (parent packages included) leads
    back to where it started, so any module imports first in a fresh interpreter."""
    edges = import_time_graph()
    assert "engine" in edges["algorithms.compose"]  # parents of what it imports are edges
    assert cycles(edges) == []


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """``python -c "import M"`` for every dpfl module M: one interpreter imports each
    module after forgetting every dpfl module imported before (third-party packages
    such as torch stay loaded, which changes nothing about dpfl's own import order),
    so M is the first dpfl module imported, as in a fresh interpreter."""
    import json
    import subprocess
    import sys

    script = (
        "import importlib, json, sys, traceback\n"
        f"names = {sorted(_modules())!r}\n"
        f"roots = {PACKAGES!r}\n"
        "bad = {}\n"
        "for name in names:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] in roots]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as err:\n"
        "        bad[name] = f'{type(err).__name__}: {err}'\n"
        "print(json.dumps(bad))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
