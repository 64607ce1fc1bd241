"""The dpfl command line: privacy calculator, algorithms list, run, errors."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from engine import calibrate_noise, epsilon
from engine.cli import main


def test_privacy_calibrates_and_accounts(capsys) -> None:
    assert (
        main(
            [
                "privacy",
                "--epsilon",
                "4",
                "--delta",
                "0.002",
                "--sampling-rate",
                "0.1",
                "--rounds",
                "300",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["noise_multiplier"] == pytest.approx(1.6882, abs=2e-4)  # notes: RDP 1.6882
    assert out["epsilon"] <= 4
    assert out["noise_multiplier"] == pytest.approx(calibrate_noise(4, 0.002, 0.1, 300))
    assert (
        main(
            [
                "privacy",
                "--noise-multiplier",
                "0.95",
                "--delta",
                "0.002",
                "--sampling-rate",
                "0.1",
                "--rounds",
                "200",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] == pytest.approx(8.5786, abs=1e-3)
    assert out["epsilon"] == epsilon(0.95, 0.1, 200, 0.002)
    assert out["adjacency"] == "add_remove" and out["accountant"] == "rdp"


def test_privacy_errors_exit_2_with_one_line(capsys) -> None:
    assert (
        main(
            ["privacy", "--epsilon", "4", "--delta", "2", "--sampling-rate", "0.1", "--rounds", "3"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpfl: error: --delta=2") and "\n" not in err


def test_algorithms_lists_every_recipe_once(capsys) -> None:
    from algorithms import RECIPES
    from engine.config import ALGORITHMS

    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(RECIPES) == list(ALGORITHMS)
    assert all(line.rstrip().endswith("]") for line in out)  # each names its paper


def test_run_prints_accuracy_and_epsilon(capsys, small_overrides, tmp_path) -> None:
    args = ["run", "-q"]
    for o in [*small_overrides, "privacy.epsilon=3", f"out={tmp_path}/r"]:
        args += ["--set", o]
    assert main(args) == 0
    out = capsys.readouterr().out
    df = pd.read_parquet(tmp_path / "r" / "rounds.parquet")
    assert f"final test_accuracy={df['test_accuracy'].iloc[-1]:.4f}" in out
    assert f"epsilon={df['epsilon'].iloc[-1]:.4g} (budget 3)" in out
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["privacy"]["final_epsilon"] == df["epsilon"].iloc[-1] <= 3
    assert cfg["config"]["rounds"] == 3


def test_run_bad_key_exits_2(capsys) -> None:
    assert main(["run", "--set", "privacy.clip_norm=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dpfl: error: privacy.clip_norm=0.0: must be > 0"


def test_compare_prints_one_table_best_first(capsys, small_overrides, tmp_path) -> None:
    args = ["compare", "-q", "--algorithms", "fedavg,dp_fedavg", "--out", str(tmp_path / "c")]
    for o in [*small_overrides, "privacy.noise_multiplier=5", "rounds=4"]:
        args += ["--set", o]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    table = pd.read_parquet(tmp_path / "c" / "compare.parquet")
    assert set(table["algorithm"]) == {"fedavg", "dp_fedavg"}
    best = table.sort_values("final_accuracy", ascending=False)["algorithm"].iloc[0]
    assert out[1].split()[0] == best  # first data row is the best
    for name in ("fedavg", "dp_fedavg"):
        assert (tmp_path / "c" / name / "rounds.parquet").is_file()
    assert main(["compare", "--algorithms", "nope"]) == 2


# --------------------------------------------------------------- results folders (issue 12)


def _run_args(small_overrides, *extra: str) -> list[str]:
    args = ["run", "-q", *extra]
    for o in small_overrides:
        args += ["--set", o]
    return args


def test_overwrite_replaces_the_folder_and_its_stale_files(small_overrides, tmp_path) -> None:
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.md").write_text("old report naming trials that no longer exist")
    (out / "accuracy_vs_round.png").write_bytes(b"old figure")
    assert main(_run_args(small_overrides, "--out", str(out))) == 2  # kept without --overwrite
    assert (out / "report.md").is_file()
    assert main(_run_args(small_overrides, "--out", str(out), "--overwrite")) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint.pkl",
        "checkpoint.previous.pkl",
        "config.json",
        "rounds.parquet",
    ]


def test_default_folder_names_never_collide(tmp_path) -> None:
    from engine.cli.common import claim_out

    same = tmp_path / "results" / "20260101-000000-000000-dp_fedavg"  # one timestamp twice
    first = claim_out(same, overwrite=False, default=True)
    second = claim_out(same, overwrite=False, default=True)
    assert first != second and first.is_dir() and second.is_dir()
    assert list(first.iterdir()) == list(second.iterdir()) == []


def test_tune_overwrite_restores_the_old_folder_when_checks_fail(tmp_path, capsys) -> None:
    old = tmp_path / "exp"
    (old / "tune").mkdir(parents=True)
    (old / "report.md").write_text("old")
    argv = ["tune", "--out", str(old), "--overwrite", "--set", "privacy.clip_norm=0"]
    assert main(argv) == 2
    assert "privacy.clip_norm=0" in capsys.readouterr().err
    assert (old / "report.md").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # nothing set aside is left


# --------------------------------------------------------------- seeds (issue 12)


def test_run_seeds_one_folder_each_and_mean_std(capsys, small_overrides, tmp_path) -> None:
    out = tmp_path / "s"
    assert main(_run_args(small_overrides, "--out", str(out), "--seeds", "0,1,2")) == 0
    printed = capsys.readouterr().out
    finals = []
    for s in (0, 1, 2):
        cfg = json.loads((out / f"seed{s}" / "config.json").read_text())
        assert cfg["config"]["seed"] == s
        rounds = pd.read_parquet(out / f"seed{s}" / "rounds.parquet")
        finals.append(rounds["test_accuracy"].iloc[-1])
    acc = pd.Series(finals)
    assert acc.nunique() > 1  # the seeds really differ
    assert f"final test_accuracy={acc.mean():.4f} ± {acc.std(ddof=1):.2g}" in printed
    assert "over 3 seeds" in printed


def test_compare_seeds_table_shows_mean_and_std(capsys, small_overrides, tmp_path) -> None:
    out = tmp_path / "c"
    args = ["compare", "-q", "-a", "fedavg,dp_fedavg", "--out", str(out), "--seeds", "0,1"]
    for o in [*small_overrides, "privacy.noise_multiplier=5"]:
        args += ["--set", o]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = pd.read_parquet(out / "compare.parquet")
    assert sorted(zip(rows["algorithm"], rows["seed"])) == [
        ("dp_fedavg", 0),
        ("dp_fedavg", 1),
        ("fedavg", 0),
        ("fedavg", 1),
    ]
    for s in (0, 1):
        for a in ("fedavg", "dp_fedavg"):
            assert (out / f"seed{s}" / a / "rounds.parquet").is_file()
    means = rows.groupby("algorithm")["final_accuracy"].mean().sort_values(ascending=False)
    stds = rows.groupby("algorithm")["final_accuracy"].std(ddof=1)
    best = means.index[0]
    assert lines[1].split()[0] == best
    assert f"{means[best]:.4g} ± {stds[best]:.2g}" in lines[1]


# --------------------------------------------------------------- help and config (issue 12)


def test_config_prints_every_key_with_a_comment_and_loads_back(capsys) -> None:
    import yaml

    from engine.config import RunConfig, config_from_dict
    from engine.config.doc import config_keys

    assert main(["config"]) == 0
    text = capsys.readouterr().out
    assert config_from_dict(yaml.safe_load(text)) == RunConfig()
    commented: dict[str, str] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if not line.startswith(" ") and line.rstrip().endswith(":"):
            section = line.rstrip()[:-1] + "."
            continue
        body, _, comment = line.partition("  # ")
        key = body.strip().split(":", 1)[0]
        commented[(section if line.startswith(" ") else "") + key] = comment.strip()
    assert set(commented) == set(config_keys())
    assert all(len(c) > 5 for c in commented.values()), commented
    # with --set, the printed config is the resolved one
    assert main(["config", "--set", "rounds=7", "--set", "privacy.noise_multiplier=1"]) == 0
    again = config_from_dict(yaml.safe_load(capsys.readouterr().out))
    assert again.rounds == 7 and again.privacy.noise_multiplier == 1.0


def test_run_help_lists_the_config_keys(capsys) -> None:
    from engine.config.doc import config_keys

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for key in config_keys():
        assert key.rsplit(".", 1)[-1] in text, key
    assert "dpfl config" in text and "--out" in text and "--seeds" in text


def test_privacy_help_describes_every_option() -> None:
    from engine.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices)
    privacy = sub.choices["privacy"]
    for action in privacy._actions:
        assert action.help, action.option_strings


def test_privacy_delta_defaults_as_runs_do(capsys) -> None:
    from engine.privacy.accounting import default_delta
    from engine.simulation import plan_privacy

    base = ["privacy", "--epsilon", "4", "--sampling-rate", "0.1", "--rounds", "50", "--json"]
    assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    run_plan = plan_privacy(_default_config(rounds=50))
    assert out["delta"] == run_plan.delta == default_delta(1000)
    assert out["noise_multiplier"] == run_plan.noise_multiplier
    assert main([*base, "--num-clients", "40"]) == 0
    assert json.loads(capsys.readouterr().out)["delta"] == default_delta(40) == 0.01 / 40


def _default_config(**changes):
    from engine.config import RunConfig, replace

    return replace(RunConfig(), **changes)


def test_privacy_fixed_sampling_warns_like_runs(capsys) -> None:
    argv = ["privacy", "--epsilon", "4", "--num-clients", "100", "--cohort-size", "10"]
    assert main([*argv, "--rounds", "20"]) == 0
    captured = capsys.readouterr()
    warning = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(warning) == 1 and warning[0].startswith("dpfl: warning: sampling.mode=fixed")
    assert "looser" in warning[0]
    assert "noise_multiplier=" in captured.out


def test_non_private_recipe_may_not_be_given_a_budget(capsys, small_overrides, tmp_path) -> None:
    argv = _run_args(small_overrides, "--out", str(tmp_path / "f"))
    assert main([*argv, "--set", "algorithm=fedavg", "--set", "privacy.epsilon=2"]) == 2
    assert "privacy.epsilon=2" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()
    assert main([*argv, "--set", "algorithm=fedavg"]) == 0
    assert "not private (epsilon=inf)" in capsys.readouterr().out


def test_compare_of_only_non_private_recipes_may_not_be_given_a_budget(capsys, tmp_path) -> None:
    import argparse

    from engine.cli.common import check_private

    out = tmp_path / "cmp"
    argv = ["compare", "-a", "fedavg,fedsam", "--out", str(out)]
    assert main([*argv, "--set", "privacy.noise_multiplier=1.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpfl: error: privacy.noise_multiplier=1.0: algorithms fedavg,fedsam")
    assert "\n" not in err and not out.exists()
    # a private recipe beside a non-private baseline uses the budget: no error
    given = argparse.Namespace(config=None, set=["privacy.epsilon=2"])
    check_private(["fedavg", "dp_fedavg"], given)


@pytest.mark.ray
@pytest.mark.slow
def test_compare_is_quiet_too(small_overrides, tmp_path) -> None:
    """dpfl compare on Ray: only dpfl's own lines on stderr; Ray's go to OUT/ray.log."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "engine.cli", "compare", "-q", "-a", "dp_fedavg"]
    for o in [*small_overrides, "ray.executor=ray", "ray.num_workers=1", "rounds=2"]:
        cmd += ["--set", o]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [*cmd, "--out", str(tmp_path / "c")], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    foreign = [
        ln
        for ln in done.stderr.splitlines()
        if ln.strip() and not ln.startswith(("dpfl: ", "Ray dashboard: "))
    ]
    assert foreign == []
    assert (tmp_path / "c" / "ray.log").read_text().startswith("# dpfl compare")


@pytest.mark.ray
@pytest.mark.slow
def test_ray_chatter_goes_to_ray_log_unless_verbose(small_overrides, tmp_path) -> None:
    """Quiet by default: on stderr only dpfl's own lines; Ray's go to OUT/ray.log."""
    import subprocess
    import sys

    sets = [
        *small_overrides,
        "ray.executor=ray",
        "ray.num_workers=1",
        "ray.num_cpus_per_worker=0.5",
        "rounds=2",
    ]
    cmd = [sys.executable, "-m", "engine.cli", "run", "-q"]
    for o in sets:
        cmd += ["--set", o]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    runs: dict[str, list[str]] = {}
    stderr: dict[str, str] = {}
    for name, extra in (("quiet", []), ("verbose", ["--verbose"])):
        done = subprocess.run(
            [*cmd, "--out", str(tmp_path / name), *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        stderr[name] = done.stderr
        runs[name] = [
            ln
            for ln in done.stderr.splitlines()
            if ln.strip() and not ln.startswith(("dpfl: ", "Ray dashboard: "))
        ]
    assert runs["quiet"] == []
    assert "core_worker" not in stderr["quiet"] and "token" not in stderr["quiet"].lower()
    log = (tmp_path / "quiet" / "ray.log").read_text().splitlines()
    for marker in ("core_worker", "Token authentication"):  # moved, not lost
        if marker in stderr["verbose"]:
            assert any(marker in line for line in log), marker
    assert log[0].startswith("# dpfl run")
    if runs["verbose"]:  # what Ray printed in the verbose run was kept in the quiet one's log
        assert len(log) > 1
    assert not (tmp_path / "verbose" / "ray.log").exists()
    quiet = pd.read_parquet(tmp_path / "quiet" / "rounds.parquet")
    verbose = pd.read_parquet(tmp_path / "verbose" / "rounds.parquet")
    cols = ["round", "epsilon", "test_accuracy"]
    pd.testing.assert_frame_equal(quiet[cols], verbose[cols])  # quiet changes no result


def test_run_plan_checks_everything_and_writes_nothing(small_overrides, tmp_path) -> None:
    """``dpfl run`` is plan (checks, no side effects) then execute: the plan holds the
    parsed seeds, the folder and the prepared first run, and creates no folder; a bad value
    fails in the plan, before any folder exists."""
    from engine.cli.parser import build_parser
    from engine.cli.run import plan_run

    out = tmp_path / "r"
    argv = [
        "run",
        "--out",
        str(out),
        "--seeds",
        "3,4",
        *[a for k in small_overrides for a in ("--set", k)],
    ]
    plan = plan_run(build_parser().parse_args(argv))
    assert plan.seeds == [3, 4] and plan.out == out and not plan.default_out
    prepared = plan.prepared  # the first seed's run, validated and built: what executes
    assert prepared is not None and prepared.config.seed == 3
    assert prepared.dataset.num_clients == plan.config.dataset.num_clients
    assert not out.exists()
    bad = build_parser().parse_args([*argv, "--set", "sampling.rate=2"])
    with pytest.raises(Exception, match="sampling.rate"):
        plan_run(bad)
    assert not out.exists()
