"""No import cycles between dpfl's modules (lazy imports inside functions included;
imports under ``if TYPE_CHECKING:`` excluded, as they never run)."""

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
    assert "cluster.submit" in edges and "engine.cli_parser" in edges["cluster.submit"]
    assert cycles(edges) == []
