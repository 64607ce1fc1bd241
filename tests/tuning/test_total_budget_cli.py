"""``dpfl tune --total-epsilon`` end to end (the driver runner, in process), and
``dpfl tune --resume DIR`` taking its flags from the folder (issue 48 item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from engine.privacy.accounting import SamplingSpec, compute_epsilon
from tuning.budget import TOLERANCE
from tuning.report import load_rounds, load_trials, summary_table

FAST = ["--smoke-test", "--runner", "driver", "--set", "ray.executor=local", "-v"]


def _budget(out: Path) -> dict:
    return json.loads((out / "tune" / "budgets.json").read_text())["dp_fedavg-eps4"]


def test_total_budget_compose_report_and_resume_from_the_folder(tmp_path, capsys) -> None:
    out = tmp_path / "exp"
    argv = ["tune", *FAST, "--total-epsilon", "4", "--num-samples", "3", "--out", str(out)]
    assert main(argv) == 0
    record = _budget(out)
    (conf,) = record["configurations"]
    trials = load_trials(out)
    assert len(trials) == 3 and set(trials["status"]) == {"TERMINATED"}
    # every trial ran with the solved σ, and its own ε is the accountant's for it
    spec = SamplingSpec(**conf["spec"])
    assert set(trials["noise_multiplier"]) == {conf["noise_multiplier"]}
    own = compute_epsilon(conf["noise_multiplier"], spec, conf["rounds"], conf["delta"])
    assert trials["epsilon"].tolist() == pytest.approx([own] * 3, rel=1e-12)
    assert own <= record["per_trial_epsilon"] < 4.0
    # the report: the composition of the three trials that ran, within the budget
    table = summary_table(out)
    eps = float(table["epsilon_with_tuning"].iloc[0])
    assert 4.0 * (1 - TOLERANCE) <= eps <= 4.0
    assert eps == pytest.approx(record["total_epsilon"], rel=1e-12)
    assert float(table["epsilon_per_trial"].iloc[0]) == record["per_trial_epsilon"]
    assert float(table["epsilon_total_budget"].iloc[0]) == 4.0
    rows_before = load_rounds(out)

    # --resume DIR with no other flag: the folder's settings, nothing recomputed
    capsys.readouterr()
    assert main(["tune", "--resume", str(out), "-v"]) == 0
    assert load_rounds(out).equals(rows_before)
    assert (
        load_trials(out)["final_test_accuracy"].tolist() == trials["final_test_accuracy"].tolist()
    )
    # a flag given again that differs is refused, naming it
    capsys.readouterr()
    assert main(["tune", "--resume", str(out), "--num-samples", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--num_samples=5" in err and "3" in err
    assert main(["tune", "--resume", str(out), "--epsilons", "4"]) == 2
    assert "--total-epsilon" in capsys.readouterr().err
    # the same flag again is fine
    assert main(["tune", "--resume", str(out), "--num-samples", "3", "-v"]) == 0


def test_total_budget_papernot_steinke_over_a_rounds_grid(tmp_path) -> None:
    """Rounds from a grid under Poisson K: each configuration its own σ, the report's ε
    covers every configuration a trial could have drawn (the budget's own total)."""
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(
        "tune:\n  total_epsilon: 4\n  space:\n    all:\n"
        "      rounds: {type: choice, values: [1, 2]}\n"
    )
    out = tmp_path / "ps"
    argv = ["tune", *FAST, "--config", str(cfg), "--tuning-privacy", "poisson"]
    assert main([*argv, "--num-samples", "3", "--out", str(out)]) == 0
    record = _budget(out)
    by_rounds = {c["rounds"]: c["noise_multiplier"] for c in record["configurations"]}
    assert sorted(by_rounds) == [1, 2] and by_rounds[2] > by_rounds[1]
    rows = load_rounds(out)
    for _, g in rows.groupby("trial_id"):  # each trial's σ is its own configuration's
        assert float(g["noise_multiplier"].iloc[0]) == by_rounds[int(g["rounds_planned"].iloc[0])]
    assert set(rows["rounds_planned"]) == {1, 2}  # this seed's K trials drew both
    table = summary_table(out)
    eps = float(table["epsilon_with_tuning"].iloc[0])
    assert eps == pytest.approx(record["total_epsilon"], rel=1e-12)
    assert 4.0 * (1 - TOLERANCE) <= eps <= 4.0


def test_an_unreachable_total_is_one_line_exit_2_and_nothing_written(tmp_path, capsys) -> None:
    out = tmp_path / "never"
    argv = ["tune", *FAST, "--total-epsilon", "0.001", "--tuning-privacy", "poisson"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unreachable" in err and "0.001" in err
    assert not out.exists() or not any(p for p in out.rglob("*") if p.name != "ray.log")


def test_total_budget_under_the_process_runner_uses_the_solved_noise(tmp_path) -> None:
    """The default runner on one machine (trials in a pool of processes) runs every
    trial at the σ solved from the total, never at the total as a per-trial ε."""
    out = tmp_path / "procs"
    fast = ["--smoke-test", "--runner", "processes", "--set", "ray.executor=local", "-v"]
    argv = ["tune", *fast, "--total-epsilon", "4", "--num-samples", "2", "--out", str(out)]
    assert main(argv) == 0
    (conf,) = _budget(out)["configurations"]
    trials = load_trials(out)
    assert len(trials) == 2 and set(trials["status"]) == {"TERMINATED"}
    assert set(trials["noise_multiplier"]) == {conf["noise_multiplier"]}
    assert float(trials["epsilon"].max()) < 4.0
