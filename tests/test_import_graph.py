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
