"""A sweep whose trials failed exits non-zero, naming the trials and why; ``--resume``
continues it. An empty search space is refused before any work."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

import tuning.experiment as experiment
from engine.cli import main

FLAGS = ["tune", "--smoke-test", "--runner", "driver", "--num-samples", "2"]
FLAGS += ["--set", "rounds=2", "--set", "ray.executor=local"]


def test_failed_trial_exits_1_naming_it_and_resume_finishes(tmp_path, capsys, monkeypatch) -> None:
    """Trial 1 fails (both attempts): the table is still written, the exit status is 1
    and the last stderr line names the trial, its error and ``--resume``; the resumed
    sweep runs only what is missing and exits 0 with every trial finished."""
    out = tmp_path / "sweep"
    real = experiment.trial_body

    def failing_body(*args, **kwargs):
        body = real(*args, **kwargs)

        def run(config, trial_id, name, report):
            if config["sample"] == 1:
                raise RuntimeError("injected failure of trial 1")
            return body(config, trial_id, name, report)

        return run

    monkeypatch.setattr(experiment, "trial_body", failing_body)
    assert main([*FLAGS, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    table = pd.read_parquet(out / "trials.parquet")
    assert list(table["status"]) == ["TERMINATED"]  # trial 1 wrote no row
    assert err[-1].startswith("dpfl: error: 1 trial(s) failed ("), err
    assert "RuntimeError: injected failure of trial 1" in err[-1]
    assert f"dpfl tune --resume --out {out}" in err[-1]
    failed_id = re.search(r"failed \((\w+): ", err[-1]).group(1)
    assert failed_id not in set(table["trial_id"])
    monkeypatch.setattr(experiment, "trial_body", real)
    assert main([*FLAGS, "--out", str(out), "--resume"]) == 0
    table = pd.read_parquet(out / "trials.parquet")
    assert len(table) == 2 and (table["status"] == "TERMINATED").all()
    assert failed_id in set(table["trial_id"])


@pytest.mark.parametrize("samples", [2, 1])
def test_empty_search_space(tmp_path, capsys, samples) -> None:
    """Every key of the space null: with several trials (identical runs, each accounted)
    refused in one line before any folder; with one trial it runs and one is accounted."""
    config = tmp_path / "space.yaml"
    config.write_text(
        "tune:\n  space:\n    all:\n"
        + "".join(f"      {k}: null\n" for k in ("privacy.clip_norm", "local.lr", "local.epochs"))
    )
    out = tmp_path / "sweep"
    argv = [*FLAGS, "--num-samples", str(samples), "--config", str(config), "--out", str(out)]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    if samples > 1:
        assert rc == 2 and len(err) == 1 and err[0].startswith("dpfl: error: tune.space"), err
        assert "empty" in err[0] and "--num-samples 1" in err[0]
        assert not out.exists()
    else:
        assert rc == 0
        table = pd.read_parquet(out / "trials.parquet")
        assert len(table) == 1 and (table["status"] == "TERMINATED").all()


@pytest.mark.ray
@pytest.mark.slow
def test_failed_trials_under_tune_exit_1(ray_session, tmp_path: Path, capsys) -> None:
    """Under the Tune runner a trial that fails in its own process (here: a searched
    value the data cannot take, found when the trial prepares its run) ends ERROR, and
    the sweep exits 1 naming the trial and the error (it exited 0 before)."""
    config = tmp_path / "space.yaml"
    config.write_text(
        "tune:\n  space:\n    all:\n      model.name: {type: choice, values: [char_lstm]}\n"
    )
    out = tmp_path / "sweep"
    argv = ["tune", "--smoke-test", "--num-samples", "1", "--config", str(config)]
    argv += ["--set", "rounds=2", "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dpfl: error: 1 trial(s) failed ("), err
    assert "model.name='char_lstm'" in err[-1] and "--resume" in err[-1]
