"""The notebook tutorial (``docs/tutorials/tune-and-analyse.ipynb``) runs as written, in
a fresh folder, and what it shows holds: every trial within its budget, the released
trial's ε with tuning above one trial's, the figures drawn.

The site renders the outputs stored in the notebook (it does not execute it while
building). After changing the notebook, store fresh outputs with
``python tests/test_tutorial_notebook.py --write`` (about a minute on 2 cores).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "tutorials" / "tune-and-analyse.ipynb"
OUT = Path("results") / "tutorial-tune"  # where the notebook writes, relative to its folder


def _images(nb) -> int:
    return sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )


def execute(folder: Path):
    """Run the notebook with this checkout's ``dpfl`` on the PATH and its packages
    importable; the kernel's working folder is ``folder``. Returns the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p),
        "RAY_USAGE_STATS_ENABLED": "0",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel, and the dpfl it starts, inherit them
    try:
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
        ).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


@pytest.mark.slow
def test_the_tutorial_notebook_runs_and_its_results_hold(tmp_path: Path) -> None:
    pytest.importorskip("nbclient")
    import pandas as pd

    from tests.engine.test_column_privacy import documented_columns
    from tuning.report import load_rounds, summary_table

    nb = execute(tmp_path)
    assert _images(nb) == 3  # learning curves, clip norm, accuracy against ε
    out = tmp_path / OUT
    trials = pd.read_parquet(out / "trials.parquet")
    assert len(trials) == 2 * 2 * 5  # algorithms × budgets × --num-samples
    assert set(trials["status"]) == {"TERMINATED"}
    assert (trials["epsilon"] <= trials["epsilon_budget"]).all()
    released = summary_table(out)
    assert len(released) == 4
    # five trials composed cost more than one, and less than five times one (RDP composition)
    assert (released["epsilon_with_tuning"] > released["epsilon"]).all()
    assert (released["epsilon_with_tuning"] < 5 * released["epsilon"]).all()
    # every column the sweep wrote is in the column reference, with its label
    documented = documented_columns()
    for frame in (load_rounds(out), trials, released):
        assert set(frame.columns) <= set(documented), set(frame.columns) - set(documented)
    printed = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "every row is a seeded simulation: {'seeded-simulation'}" in printed


def test_the_site_shows_the_notebook_with_its_outputs() -> None:
    """The committed notebook holds its outputs (the site renders them unexecuted)."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("outputs") for c in code), "store outputs: see this module's docstring"
    assert _images(nb) == 3


def _write() -> None:
    import nbformat

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        nb = execute(Path(folder))
    for cell in nb.cells:  # no run-specific metadata in the repository
        cell.metadata.pop("execution", None)
    nbformat.write(nb, NOTEBOOK)
    print(f"{NOTEBOOK.relative_to(ROOT)}: executed in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python {sys.argv[0]} --write")
    _write()
