"""The tuning ε describes the procedure that ran (issue 13 item 1), checked against
oracles written here with dp-accounting's own API, and the report's figures (issue 12
item 7)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pandas as pd
import pytest
from dp_accounting import dp_event, pld, rdp

from engine.config import ConfigError
from engine.privacy.accounting import EpsilonTracker, SamplingSpec
from engine.privacy.resolve import calibrate_noise_multiplier
from tuning import selection
from tuning.report import summary_table, write_report
from tuning.rounds import write_round

N, Q, T, DELTA = 1000, 0.1, 60, 1e-5


def oracle_event(z: float, q: float, rounds: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
    )


@pytest.fixture(scope="module")
def z4() -> float:
    return calibrate_noise_multiplier(4.0, DELTA, SamplingSpec("poisson", N, rate=Q), T)


def test_compose_of_eight_trials_matches_dp_accounting(z4: float) -> None:
    spec = SamplingSpec("poisson", N, rate=Q)
    ev = selection.TrialEvent(z4, spec, T, DELTA, "rdp")
    eps, rule = selection.composed_epsilon([ev] * 8, DELTA)
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.ComposedDpEvent([oracle_event(z4, Q, T)] * 8))
    assert eps == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    assert rule == "composition of 8 trials (RDP)"
    # and it is what the old Poisson repeat-and-select formula understated
    old = rdp.RdpAccountant()
    old.compose(dp_event.RepeatAndSelectDpEvent(oracle_event(z4, Q, T), 8.0, np.inf))
    assert eps > old.get_epsilon(DELTA) + 3.0


def test_compose_with_pld_matches_dp_accounting(z4: float) -> None:
    spec = SamplingSpec("poisson", N, rate=Q)
    ev = selection.TrialEvent(z4, spec, T, DELTA, "pld")
    eps, _ = selection.composed_epsilon([ev] * 3, DELTA)
    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(oracle_event(z4, Q, T), 3)
    assert eps == pytest.approx(acc.get_epsilon(DELTA), rel=1e-6)


@pytest.mark.parametrize(
    ("mode", "shape", "oracle_shape"),
    [("poisson", math.inf, np.inf), ("truncated_negative_binomial", 0.5, 0.5)],
)
def test_papernot_steinke_matches_dp_accounting(z4, mode, shape, oracle_shape) -> None:
    spec = SamplingSpec("poisson", N, rate=Q)
    ev = selection.TrialEvent(z4, spec, T, DELTA, "rdp")
    eps, rule = selection.papernot_steinke_epsilon([ev, ev], DELTA, 8, mode, shape)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.RepeatAndSelectDpEvent(oracle_event(z4, Q, T), 8.0, oracle_shape))
    assert eps == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    assert rule.startswith("Papernot-Steinke")
    # the worst event of the trials is taken: a noisier second trial changes nothing,
    # a less noisy one raises ε
    louder = selection.TrialEvent(z4 * 0.8, spec, T, DELTA, "rdp")
    worse, _ = selection.papernot_steinke_epsilon([ev, louder], DELTA, 8, mode, shape)
    assert worse > eps


def test_papernot_steinke_refuses_truncated_poisson(z4) -> None:
    spec = SamplingSpec("poisson", N, rate=Q, max_cohort=140)
    ev = selection.TrialEvent(z4, spec, T, DELTA, "pld")
    with pytest.raises(selection.TuningPrivacyError, match="max_cohort"):
        selection.papernot_steinke_epsilon([ev], DELTA, 8, "poisson", math.inf)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"search": "optuna"}, "adaptive"),
        ({"search": "hyperopt"}, "adaptive"),
        ({"scheduler": "asha"}, "stops trials"),
        ({"max_cohort": 150}, "max_cohort"),
        ({"space_keys": ["local.lr", "rounds"]}, "varies rounds"),
        ({"space_keys": ["sampling.rate"]}, "sampling.rate"),
        ({"space_keys": ["privacy.delta"]}, "privacy.delta"),
    ],
)
def test_papernot_steinke_refusals(kwargs, match) -> None:
    args = {
        "search": "random",
        "scheduler": "fifo",
        "max_cohort": None,
        "space_keys": ["local.lr", "privacy.clip_norm"],
        "shape": 1.0,
    }
    selection.check_mode("poisson", **args)  # the defaults are allowed
    if kwargs.get("search") is None or "space_keys" not in kwargs:
        selection.check_mode("compose", **{**args, **kwargs})  # composition holds
    with pytest.raises(selection.TuningPrivacyError, match=match):
        selection.check_mode("poisson", **{**args, **kwargs})
    with pytest.raises(selection.TuningPrivacyError, match=match):
        selection.check_mode("truncated_negative_binomial", **{**args, **kwargs})


def test_compose_refuses_adaptive_search_over_privacy_keys() -> None:
    args = {"scheduler": "asha", "max_cohort": None, "shape": 1.0}
    selection.check_mode("compose", search="random", space_keys=["rounds"], **args)
    selection.check_mode("compose", search="optuna", space_keys=["local.lr"], **args)
    with pytest.raises(selection.TuningPrivacyError, match="adaptively"):
        selection.check_mode("compose", search="optuna", space_keys=["rounds"], **args)


def test_run_tune_refuses_before_any_work(tmp_path) -> None:
    from tuning.experiment import run_tune

    out = tmp_path / "exp"
    with pytest.raises(ConfigError, match="adaptive"):
        run_tune(None, ["dp_fedavg"], [4.0], out=out, search="optuna", tuning_privacy="poisson")
    with pytest.raises(ConfigError, match="max_cohort"):
        run_tune(
            None,
            ["dp_fedavg"],
            [4.0],
            out=out,
            tuning_privacy="truncated_negative_binomial",
            overrides=["sampling.max_cohort=150"],
        )
    assert not out.exists()


@pytest.mark.parametrize(
    ("mode", "shape"),
    [
        ("poisson", math.inf),
        ("truncated_negative_binomial", 0.5),
        ("truncated_negative_binomial", 0.0),
        ("truncated_negative_binomial", 2.0),
    ],
)
def test_number_of_trials_has_the_accounted_law(mode, shape) -> None:
    rng = np.random.default_rng(0)
    draws = np.array([selection.draw_num_trials(mode, 8, shape, rng) for _ in range(20000)])
    # mean 8 within 5 standard errors
    assert abs(draws.mean() - 8) < 5 * draws.std() / math.sqrt(len(draws))
    if mode == "truncated_negative_binomial":
        assert draws.min() >= 1
        gamma = selection.tnb_gamma(shape, 8)
        # P[K=1] of the TNB with (eta, gamma): (1-g)·eta/(g^-eta - 1), or (1-g)/ln(1/g)
        p1 = (
            (1 - gamma) / math.log(1 / gamma)
            if shape == 0
            else ((1 - gamma) * shape / (gamma**-shape - 1))
        )
        assert abs((draws == 1).mean() - p1) < 5 * math.sqrt(p1 * (1 - p1) / len(draws))
    else:
        assert (draws == 0).mean() == pytest.approx(
            math.exp(-8), abs=5 * math.sqrt(math.exp(-8) / 2e4)
        )


def test_secure_draw_uses_os_entropy() -> None:
    draws = {selection.draw_num_trials("poisson", 50, math.inf, None) for _ in range(20)}
    assert len(draws) > 1


# --- the report, on a folder written the way dpfl tune writes it ---------------------


def fake_experiment(out, mode: str, z: float, spec: SamplingSpec, accountant: str, k: int = 3):
    """k trials of one (algorithm, ε) cell, two with equal hyperparameters (two seeds)."""
    tracker = EpsilonTracker(z, spec, DELTA, accountant)
    rounds = 4
    trials = []
    for i in range(k):
        tid = f"t{i}"
        lr = 0.1 if i < 2 else 0.3
        for r in range(1, rounds + 1):
            row = {
                "algorithm": "dp_fedavg",
                "epsilon_budget": 4.0,
                "trial_id": tid,
                "round": r,
                "dataset": "synthetic",
                "noise_multiplier": z,
                "delta": DELTA,
                "sampling": spec.name,
                "sampling_rate": spec.effective_rate,
                "cohort_size": spec.denominator,
                "accountant": accountant,
                "num_clients": spec.num_clients,
                "max_cohort": spec.max_cohort if spec.max_cohort else math.nan,
                "rounds_planned": rounds,
                "epsilon": tracker.epsilon(r),
                "test_accuracy": 0.1 * r + 0.01 * i,
                "lr": lr,
                "trial_seed": 100 + i,
            }
            write_round(out, row, {"lr": "float"})
        trials.append(
            {
                "trial_id": tid,
                "algorithm": "dp_fedavg",
                "epsilon_budget": 4.0,
                "status": "TERMINATED",
                "rounds_done": rounds,
                "noise_multiplier": z,
                "epsilon": tracker.epsilon(rounds),
                "final_test_accuracy": 0.1 * rounds + 0.01 * i,
                "best_test_accuracy": 0.1 * rounds + 0.01 * i,
                "lr": lr,
            }
        )
    from tuning.trials_table import mark_released

    frame = mark_released(pd.DataFrame(trials), "test_accuracy", mode, 8, 0.5)
    frame.to_parquet(out / "trials.parquet", index=False)
    return frame


@pytest.mark.parametrize(
    ("spec", "accountant"),
    [
        (SamplingSpec("poisson", 200, rate=0.1), "rdp"),
        (SamplingSpec("poisson", 200, rate=0.1, max_cohort=30), "pld"),
    ],
)
def test_composition_of_one_trial_is_the_runs_own_epsilon(tmp_path, spec, accountant) -> None:
    fake_experiment(tmp_path, "compose", 1.1, spec, accountant, k=1)
    table = summary_table(tmp_path)
    assert table["tuning_accounting"].iloc[0] == f"composition of 1 trials ({accountant.upper()})"
    assert table["epsilon_with_tuning"].iloc[0] == pytest.approx(table["epsilon"].iloc[0], rel=1e-9)


def test_report_under_compose_accounts_all_trials(tmp_path) -> None:
    spec = SamplingSpec("poisson", 200, rate=0.1)
    fake_experiment(tmp_path, "compose", 1.1, spec, "rdp", k=3)
    table = summary_table(tmp_path)
    acc = rdp.RdpAccountant()
    acc.compose(oracle_event(1.1, 0.1, 4), 3)
    assert table["epsilon_with_tuning"].iloc[0] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    assert table["trial_id"].iloc[0] == "t2"  # best by final accuracy


def test_report_under_papernot_steinke_shows_only_the_released_trial(tmp_path) -> None:
    spec = SamplingSpec("poisson", 200, rate=0.1)
    trials = fake_experiment(tmp_path, "truncated_negative_binomial", 1.1, spec, "rdp", k=3)
    assert trials["released"].tolist() == [False, False, True]
    table = summary_table(tmp_path)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.RepeatAndSelectDpEvent(oracle_event(1.1, 0.1, 4), 8.0, 0.5))
    assert table["epsilon_with_tuning"].iloc[0] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)
    assert "truncated negative binomial" in table["tuning_accounting"].iloc[0]
    text = write_report(tmp_path)
    assert "t2" in text and "| t0" not in text and "t1 |" not in text
    assert str(len(trials)) + " trials" not in text  # K is not released


def test_figures_carry_setting_integer_rounds_seed_bands_and_tuning_epsilon(tmp_path) -> None:
    from matplotlib.collections import PolyCollection
    from matplotlib.container import ErrorbarContainer

    from tuning import report

    spec = SamplingSpec("poisson", 200, rate=0.1)
    trials = fake_experiment(tmp_path, "compose", 1.1, spec, "rdp", k=3)
    # make trial t0 (two seeds with t1: lr 0.1) the best
    trials.loc[0, "final_test_accuracy"] = 0.9
    trials.to_parquet(tmp_path / "trials.parquet", index=False)
    table = report.summary_table(tmp_path)
    rounds = report.load_rounds(tmp_path)
    hp = report.hyperparameter_columns_of(table, "test_accuracy")
    assert hp == ["lr"]
    allowed = pd.Series(True, index=trials.index)
    seeds = {r["trial_id"]: report.replicates(r, trials, hp, allowed) for _, r in table.iterrows()}
    assert sorted(seeds["t0"]) == ["t0", "t1"]
    title = report.setting_title(rounds)
    assert title == "synthetic, N=200, T=4, δ=1e-05"

    fig = report.plot_accuracy_vs_round(table, rounds, seeds, "test_accuracy", title)
    ax = fig.axes[0]
    assert ax.get_title() == title
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1  # two seeds: a band (std of 0.00 and 0.01 offsets)
    (line,) = ax.get_lines()
    # mean over the two seeds t0, t1 (accuracy 0.1·r and 0.1·r + 0.01)
    assert line.get_ydata() == pytest.approx([0.1 * r + 0.005 for r in range(1, 5)])

    finals = {"t0": [0.9, 0.41]}
    fig = report.plot_accuracy_vs_epsilon(table, finals, "test_accuracy", title)
    ax = fig.axes[0]
    assert ax.get_title() == title and "epsilon_with_tuning" in ax.get_xlabel()
    (container,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    x = container.lines[0].get_xdata()
    assert list(x) == pytest.approx(list(table["epsilon_with_tuning"]))
    assert list(x) != pytest.approx(list(table["epsilon"]))
    assert container.has_yerr

    write_report(tmp_path)
    assert (tmp_path / "accuracy_vs_round.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--scheduler", "asha"], "stops trials on their results"),
        (["--set", "sampling.max_cohort=150"], "max_cohort"),
    ],
)
def test_cli_refuses_papernot_steinke_in_one_line(tmp_path, capsys, extra, match) -> None:
    from engine.cli import main

    out = tmp_path / "exp"
    code = main(["tune", "--tuning-privacy", "poisson", "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and match in err and len(err.splitlines()) == 1
    assert not out.exists()
