"""Golden outputs: every case of ``golden.json`` rerun with the current code gives the
same final model (SHA-256 of its parameters), the same ε (final and per round) and the
same value in every column of every round, bit for bit, on the CPU.

``golden.json`` holds the outputs of commit 1f4e86f (``generate.py`` says how it was
made), so a refactor (issue 27) or a performance change (issue 26) that passes this test
computes exactly what the code before it computed. The values are not hand-written
expectations: they are what the code before the change produced. Excluded, being
nondeterministic by nature: the columns named in ``golden.json``'s
``excluded_columns`` (``wall_time_s_nonprivate``, wall-clock seconds).

A failure names the case and its first difference. Regenerate ``golden.json`` only for a
change meant to alter results, and say so in that commit (``generate.py``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
GOLDEN = json.loads((HERE / "golden.json").read_text())


def _load_cases() -> Any:
    spec = importlib.util.spec_from_file_location("golden_cases", HERE / "golden_cases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("golden_cases", module)
    spec.loader.exec_module(module)
    return module


gc = _load_cases()


def _params() -> list[Any]:
    params = []
    for name, case in GOLDEN["cases"].items():
        marks = [getattr(pytest.mark, m) for m in case["marks"]]
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def test_golden_file_lists_the_cases_of_golden_cases() -> None:
    """golden.json was generated from this case list: same names, overrides and kinds
    (a case edited or added without regenerating would otherwise pass unnoticed)."""
    listed = {c.name: (c.overrides, c.kind, c.interrupt_after, list(c.marks)) for c in gc.CASES}
    frozen = {
        name: (c["overrides"], c["kind"], c["interrupt_after"], c["marks"])
        for name, c in GOLDEN["cases"].items()
    }
    assert listed == frozen
    assert list(GOLDEN["excluded_columns"]) == list(gc.EXCLUDED_COLUMNS)
    recipes = {c["algorithm"] for n, c in GOLDEN["cases"].items() if n.startswith("recipe_")}
    from algorithms.catalog import CATALOG

    # every recipe of 1f4e86f (13) has a golden run and still exists; a recipe added
    # since has no output at 1f4e86f to compare with
    assert len(recipes) == 13 and recipes <= set(CATALOG)


@pytest.mark.filterwarnings("ignore:sampling.mode=fixed is accounted:UserWarning")
@pytest.mark.parametrize("name", _params())
def test_golden(name: str, request: pytest.FixtureRequest) -> None:
    golden = GOLDEN["cases"][name]
    if golden["kind"] == "ray":
        request.getfixturevalue("ray_session")
    case = gc.Case(
        name,
        golden["algorithm"],
        tuple(golden["pins"]),
        tuple(golden["settings"]),
        kind=golden["kind"],
        interrupt_after=golden["interrupt_after"],
        marks=tuple(golden["marks"]),
    )
    assert case.overrides == golden["overrides"]
    actual = gc.run_case(case, golden["overrides"])
    expected = {k: golden[k] for k in ("params_sha256", "num_params", "final_epsilon")}
    expected.update(epsilon=golden["epsilon"], privacy=golden["privacy"])
    expected["columns"] = golden["columns"]
    diff = gc.first_difference(expected, actual)
    assert diff is None, f"{name} differs from golden.json (commit 1f4e86f): {diff}"
