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
