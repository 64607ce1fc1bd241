"""Start-up costs: engine.telemetry.timeline marks only when asked; a run imports only
what it uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.telemetry import timeline


def test_marks_are_written_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    monkeypatch.delenv(timeline.ENV, raising=False)
    timeline.mark("off")
    timeline.dump()
    assert not path.exists()
    monkeypatch.setenv(timeline.ENV, str(path))
    timeline.mark("a")
    timeline.mark("b")
    timeline.dump()
    timeline.dump()  # nothing left: no duplicate lines
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r[0] for r in rows] == ["a", "b"]
    assert rows[0][1] <= rows[1][1]


def test_an_in_process_run_does_not_import_ray(tmp_path: Path) -> None:
    """``dpfl run --executor local`` imports nothing it does not use: not Ray (its
    metrics are a no-op when Ray is not initialised, which needs no import to know)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from engine.cli import main\n"
        f"rc = main(['run', '-q', '--executor', 'local', '--out', {str(tmp_path / 'r')!r},\n"
        "    '--set', 'rounds=1', '--set', 'dataset.num_clients=30',\n"
        "    '--set', 'model.name=logreg'])\n"
        "print('RC', rc, 'RAY', 'ray' in sys.modules)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert "RC 0 RAY False" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_a_client_worker_imports_no_accountant_and_no_tables() -> None:
    """A client worker (``engine.federated.client``, what every Ray worker actor loads)
    trains and clips; it imports neither the accountant (dp-accounting pulls in SciPy,
    ~1.3 s per process) nor pandas/pyarrow/Ray's Tune: each would be paid again by every
    worker process a run or trial starts."""
    import subprocess
    import sys

    heavy = ("dp_accounting", "scipy", "pandas", "pyarrow", "ray")
    code = (
        "import sys\n"
        "import engine.federated.client\n"
        f"print('LOADED', sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert "LOADED []" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def _run_in_fresh_process(code: str, env: dict | None = None):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})},
    )


@pytest.mark.ray
@pytest.mark.slow
def test_ray_starts_once_the_run_is_validated(small_overrides, tmp_path: Path) -> None:
    """``dpfl run`` on Ray prepares the run (every check, the data, the pipeline) before
    Ray starts: the workers train, the run ends with Ray shut down, and the results
    equal an in-process run's."""
    sets = [o for o in small_overrides if not o.startswith("ray.executor")]
    sets += ["rounds=2", "ray.num_workers=1", "ray.num_cpus_per_worker=0.5"]
    argv = [a for o in sets for a in ("--set", o)]
    timeline_file = tmp_path / "timeline.jsonl"
    code = (
        "import sys\n"
        "from engine.cli import main\n"
        f"rc = main(['run', '-q', '--out', {str(tmp_path / 'ray')!r}, *{argv!r}])\n"
        "import ray\n"
        "print('RC', rc, 'UP', ray.is_initialized())\n"
    )
    done = _run_in_fresh_process(code, {timeline.ENV: str(timeline_file)})
    assert "RC 0 UP False" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    marks: dict[str, float] = {}
    for line in timeline_file.read_text().splitlines():
        label, t = json.loads(line)
        marks.setdefault(label, float(t))
    assert marks["imports done"] < marks["prepared"] < marks["ray.init start"]
    assert marks["ray.init done"] < marks["workers ready"] < marks["round 1"] < marks["round 2"]
    from engine.cli import main

    local = tmp_path / "local"
    assert main(["run", "-q", "--executor", "local", "--out", str(local), *argv]) == 0
    import pandas as pd

    cols = ["round", "epsilon", "test_accuracy"]
    on_ray = pd.read_parquet(tmp_path / "ray" / "rounds.parquet")[cols]
    in_process = pd.read_parquet(local / "rounds.parquet")[cols]
    pd.testing.assert_frame_equal(on_ray, in_process)


@pytest.mark.ray
@pytest.mark.slow
def test_a_refused_plan_starts_no_ray(small_overrides, tmp_path: Path) -> None:
    """A check that fails (here: the data files are missing) exits with status 2 and
    the one-line error before Ray's start and before the engine's heavy imports:
    no Ray was started, no torch imported, no results folder created."""
    sets = [o for o in small_overrides if not o.startswith("ray.executor")]
    sets += ["ray.num_workers=1", "dataset.name=fashion_mnist"]
    sets += [f"dataset.root={tmp_path / 'no-such-root'}"]
    argv = [a for o in sets for a in ("--set", o)]
    out = tmp_path / "r"
    code = (
        "from engine.cli import main\n"
        f"rc = main(['run', '-q', '--out', {str(out)!r}, *{argv!r}])\n"
        "import sys\n"
        "print('RC', rc, 'TORCH', 'torch' in sys.modules)\n"
        "import ray\n"
        "print('UP', ray.is_initialized())\n"
    )
    timeline_file = tmp_path / "timeline.jsonl"
    done = _run_in_fresh_process(code, {timeline.ENV: str(timeline_file)})
    labels = [json.loads(line)[0] for line in timeline_file.read_text().splitlines()]
    assert "ray.init start" not in labels and "imports done" not in labels, labels
    assert "RC 2 TORCH False" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "UP False" in done.stdout
    assert "dpfl: error:" in done.stderr and "no-such-root" in done.stderr
    assert not out.exists()
