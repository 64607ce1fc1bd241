"""Every error path of every ``dpfl`` subcommand: exit status 2, exactly one line on
stderr (``dpfl: error: ...`` naming the bad value), no traceback, and nothing written —
no results folder, no change to an existing one. None of these starts Ray."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from engine.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "dataset.num_clients=40", "--set", "rounds=2", "--set", "ray.executor=local"]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"")
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A current directory holding inputs the cases need; results would land here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("rounds: 3\nlocal: lr: 0.1\n")
    (tmp_path / "unknown.yaml").write_text("rounds: 3\nlocal:\n  lrr: 0.1\n")
    (tmp_path / "badtune.yaml").write_text("tune:\n  spaces: {}\n")
    old = tmp_path / "old"
    old.mkdir()
    (old / "rounds.parquet").write_bytes(b"precious")
    cmp_dir = tmp_path / "cmp"
    cmp_dir.mkdir()
    pd.DataFrame({"algorithm": ["dp_fedavg"]}).to_parquet(cmp_dir / "compare.parquet")
    exp = tmp_path / "exp"
    (exp / "rounds").mkdir(parents=True)
    (exp / "tune").mkdir()
    pd.DataFrame(
        {"trial_id": ["a"], "final_test_accuracy": [0.5], "best_test_accuracy": [0.5]}
    ).to_parquet(exp / "trials.parquet")
    bad = tmp_path / "badexp"
    (bad / "rounds").mkdir(parents=True)
    (bad / "trials.parquet").write_bytes(b"PAR1 truncated")
    return tmp_path


CASES = {
    # run
    "run yaml syntax": (["run", "--config", "bad.yaml"], ["bad.yaml", "invalid YAML", "line 2"]),
    "run unknown key in file": (["run", "--config", "unknown.yaml"], ["local.lrr"]),
    "run unknown key": (["run", "--set", "privacy.epsilonn=2"], ["privacy.epsilonn"]),
    "run bad value": (["run", "--set", "privacy.clip_norm=0"], ["privacy.clip_norm=0"]),
    "run bad type": (["run", "--set", "rounds=many"], ["rounds='many'"]),
    "run missing config file": (["run", "--config", "nope.yaml"], ["nope.yaml"]),
    "run missing dataset files": (
        ["run", *SMALL, "--set", "dataset.name=mnist", "--set", "dataset.root=data"],
        ["data"],
    ),
    "run out exists": (["run", *SMALL, "--out", "old"], ["old", "--resume", "--overwrite"]),
    "run set out exists": (["run", *SMALL, "--set", "out=old"], ["old", "--overwrite"]),
    "run non-private epsilon": (
        ["run", "--set", "algorithm=fedavg", "--set", "privacy.epsilon=2"],
        ["privacy.epsilon=2", "fedavg", "not private"],
    ),
    "run bad seeds": (["run", *SMALL, "--seeds", "0,a"], ["--seeds='0,a'"]),
    "run repeated seeds": (["run", *SMALL, "--seeds", "1,1"], ["--seeds='1,1'"]),
    "run unknown flag": (["run", "--bogus"], ["--bogus"]),
    "run resume with out": (["run", "--resume", "old", "--out", "x"], ["--out"]),
    "run resume not a run": (["run", "--resume", "cmp"], ["cmp", "config.json"]),
    "run overwrite without out": (["run", *SMALL, "--overwrite"], ["--overwrite", "--out"]),
    "run unreachable budget": (["run", "--set", "privacy.epsilon=1e-9"], ["epsilon"]),
    # an infinite or NaN budget is no private run: a non-private recipe is
    "run infinite budget": (
        ["run", "--set", "privacy.epsilon=inf"],
        ["privacy.epsilon=inf", "non-private recipe", "algorithm=fedavg"],
    ),
    "run NaN budget": (["run", "--set", "privacy.epsilon=nan"], ["privacy.epsilon=nan", "fedavg"]),
    # a local Ray is never asked for more worker processes than the cores hold
    "run too many workers": (
        ["run", "--set", "ray.num_workers=1000"],
        ["ray.num_workers=1000", "needs 1000 CPUs", "at most"],
    ),
    "run tiny workers, too many processes": (
        ["run", "--set", "ray.num_workers=1000", "--set", "ray.num_cpus_per_worker=0.001"],
        ["ray.num_workers=1000", "at most"],
    ),
    # compare
    "compare unknown algorithm": (["compare", "--algorithms", "nope"], ["nope"]),
    "compare yaml syntax": (["compare", "--config", "bad.yaml"], ["bad.yaml", "line 2"]),
    "compare out exists": (["compare", *SMALL, "--out", "old"], ["old", "--overwrite"]),
    "compare missing dataset files": (
        ["compare", "-a", "dp_fedavg", *SMALL, "--set", "dataset.name=cifar10"],
        ["dataset"],
    ),
    "compare bad seeds": (["compare", *SMALL, "--seeds", "-1"], ["--seeds='-1'"]),
    "compare too many workers": (
        ["compare", "-a", "dp_fedavg", "--set", "ray.num_workers=1000", "--out", "c2"],
        ["ray.num_workers=1000", "at most"],
    ),
    "compare infinite budget": (["compare", "--epsilons", "inf"], ["privacy.epsilon=inf"]),
    # tune
    "tune out exists": (["tune", "--out", "old"], ["old", "--resume", "--overwrite"]),
    "tune resume nothing": (["tune", "--resume", "--out", "nothere"], ["nothere"]),
    "tune resume needs out": (["tune", "--resume"], ["--resume", "--out"]),
    "tune resume and overwrite": (["tune", "--resume", "--overwrite", "--out", "old"], ["one"]),
    "tune bad epsilons": (["tune", "--epsilons", "1,x"], ["--epsilons='1,x'"]),
    "tune unknown algorithm": (["tune", "--algorithms", "nope"], ["nope"]),
    "tune metric": (["tune", "--metric", "foo"], ["'foo'"]),
    "tune nonprivate metric": (
        ["tune", "--metric", "personal_accuracy_nonprivate", "--out", "t"],
        ["personal_accuracy_nonprivate", "--allow-nonprivate-metric"],
    ),
    "tune yaml syntax": (["tune", "--config", "bad.yaml", "--out", "t"], ["bad.yaml", "line 2"]),
    "tune unknown tune key": (["tune", "--config", "badtune.yaml", "--out", "t"], ["spaces"]),
    "tune unknown config key": (["tune", "--set", "foo=1", "--out", "t"], ["foo"]),
    "tune infinite budget": (["tune", "--epsilons", "inf", "--out", "t"], ["epsilon", "inf"]),
    # under Ray Tune a trial's workers are actors that must fit (the process runner's
    # trials run their workers in process, where any count fits)
    "tune too many workers": (
        ["tune", "--runner", "tune", "--set", "ray.num_workers=1000", "--out", "t"],
        ["ray.num_workers=1000"],
    ),
    # a default folder is claimed before the experiment's own checks, and removed again
    "tune unknown key, default folder": (["tune", "--set", "foo=1"], ["foo"]),
    "tune unknown tune key, default folder": (["tune", "--config", "badtune.yaml"], ["spaces"]),
    # report
    "report no folder": (["report", "nothere"], ["nothere"]),
    "report on a compare folder": (["report", "cmp"], ["cmp", "trials.parquet", "compare"]),
    "report metric": (["report", "exp", "--metric", "foo"], ["--metric='foo'", "test_accuracy"]),
    "report damaged trials table": (
        ["report", "badexp"],
        ["badexp/trials.parquet", "damaged", "dpfl tune --resume"],
    ),
    # privacy
    "privacy bad delta": (
        ["privacy", "--epsilon", "4", "--delta", "2", "--sampling-rate", "0.1", "--rounds", "3"],
        ["--delta=2"],
    ),
    "privacy no sampling": (["privacy", "--epsilon", "4", "--rounds", "3"], ["--sampling-rate"]),
    "privacy both": (
        ["privacy", "--epsilon", "4", "--noise-multiplier", "1", "--sampling-rate", "0.1"]
        + ["--rounds", "3"],
        ["--epsilon", "--noise-multiplier"],
    ),
    "privacy bad rounds": (["privacy", "--rounds", "x"], ["--rounds", "'x'"]),
    "privacy unreachable": (
        ["privacy", "--epsilon", "1e-9", "--sampling-rate", "0.1", "--rounds", "100"],
        ["epsilon"],
    ),
    "privacy cohort without N": (
        ["privacy", "--epsilon", "4", "--cohort-size", "10", "--rounds", "3"],
        ["--num-clients"],
    ),
    # submit, algorithms, config
    "submit no entrypoint": (["submit"], ["entrypoint"]),
    "submit bad entrypoint": (["submit", "--", "dpfl", "run", "--set", "x=1"], ["x"]),
    "algorithms extra": (["algorithms", "--bogus"], ["--bogus"]),
    "config unknown key": (["config", "--set", "foo=1"], ["foo"]),
    "config yaml syntax": (["config", "--config", "bad.yaml"], ["bad.yaml"]),
    "no command": ([], ["command"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_error_is_one_line_exit_2_and_writes_nothing(name, workdir, capsys, monkeypatch) -> None:
    argv, needles = CASES[name]
    before = _tree(workdir)
    try:
        status = main(argv)
    except SystemExit as e:  # argparse refuses a flag or its value this way
        status = e.code
    assert status == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("dpfl: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert _tree(workdir) == before  # no folder created, nothing changed or removed


def test_optuna_missing_fails_before_ray_and_folders(workdir, capsys, monkeypatch) -> None:
    import engine.cli.tune as cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "optuna" else real(name, *a),
    )
    import engine.runtime.executors

    def no_ray(*a, **k):  # the check must come before Ray is started or attached
        raise AssertionError("ensure_ray called before the --search check")

    import tuning.experiment

    monkeypatch.setattr(engine.runtime.executors, "ensure_ray", no_ray)
    monkeypatch.setattr(tuning.experiment, "ensure_ray", no_ray)
    was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    before = _tree(workdir)
    assert main(["tune", "--search", "optuna", "--out", "exp2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpfl: error: --search=optuna") and "\n" not in err
    assert "pip install optuna" in err
    assert _tree(workdir) == before
    assert ("ray" in sys.modules and sys.modules["ray"].is_initialized()) == was_up


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--config", "bad.yaml"],
        ["report", "cmp"],
        ["report", "exp", "--metric", "foo"],
        ["tune", "--out", "old"],
    ],
)
def test_real_entry_point_prints_no_traceback(workdir, argv) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", *argv],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr
