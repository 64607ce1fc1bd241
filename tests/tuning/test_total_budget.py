"""A total budget (tuning.budget): the per-trial ε solved so that publishing the selected
trial, search included, costs E — checked against dp-accounting's own events on the
solved σ's (composition, ``RepeatAndSelectDpEvent``), and the unreachable case."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event, rdp

from engine.privacy.accounting import SamplingSpec
from tuning import budget as B
from tuning import budget_search as S
from tuning import selection

N, Q, DELTA = 1000, 0.05, 1e-5
SPEC = SamplingSpec("poisson", N, rate=Q)


def config(rounds: int) -> B.Configuration:
    return B.Configuration((("rounds", rounds),), SPEC, rounds, DELTA, "rdp")


def oracle_run(z: float, rounds: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(z)), rounds
    )


def oracle_epsilon(event: dp_accounting.DpEvent) -> float:
    acc = rdp.RdpAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(DELTA))


RULES = [
    ("compose", 8, 1.0, None),
    ("poisson", 8, math.inf, np.inf),
    ("truncated_negative_binomial", 8, 1.0, 1.0),
]


@pytest.fixture(scope="module")
def solved() -> dict[str, B.BudgetSolution]:
    """One configuration (T = 20), E = 4, 8 trials (mean 8) under each rule."""
    out = {}
    for mode, trials, shape, _ in RULES:
        draws = (0,) * trials if mode == "compose" else ()
        out[mode] = S.solve_budget(B.Budget(4.0, mode, trials, shape, (config(20),), draws))
    return out


@pytest.mark.parametrize(("mode", "trials", "shape", "oracle_shape"), RULES)
def test_the_solved_sigma_meets_the_total_by_dp_accountings_own_event(
    solved, mode, trials, shape, oracle_shape
) -> None:
    s = solved[mode]
    (z,) = s.sigmas
    run = oracle_run(z, 20)
    if mode == "compose":
        oracle = oracle_epsilon(dp_accounting.ComposedDpEvent([run] * trials))
    else:
        oracle = oracle_epsilon(dp_event.RepeatAndSelectDpEvent(run, float(trials), oracle_shape))
    assert s.total_epsilon == oracle  # the library's number, bit for bit
    assert 4.0 * (1 - B.TOLERANCE) <= oracle <= 4.0
    assert float(f"{oracle:.4g}") == 4.0  # E to 4 significant digits
    # the per-trial ε is the run's own ε at that σ, and σ is the smallest that meets it
    assert s.per_trial_epsilon == oracle_epsilon(run) == s.trial_epsilons[0]
    assert s.per_trial_epsilon < 4.0


def test_the_rules_order_as_they_should(solved) -> None:
    """Composition of 8 trials leaves less per trial than best-of-Poisson(8)."""
    assert solved["compose"].per_trial_epsilon < solved["poisson"].per_trial_epsilon
    assert solved["compose"].sigmas[0] > solved["poisson"].sigmas[0]


def test_repeat_and_select_of_one_curve_is_dp_accountings_event_exactly() -> None:
    for z in (0.8, 1.3):
        event = selection.TrialEvent(z, SPEC, 30, DELTA, "rdp")
        orders, curve = selection.one_run_rdp(event)
        for mode, shape, oracle_shape in (("poisson", math.inf, np.inf), (selection.TNB, 0.5, 0.5)):
            ours = selection.repeat_and_select_epsilon([curve], orders, DELTA, 5.0, mode, shape)
            oracle = oracle_epsilon(
                dp_event.RepeatAndSelectDpEvent(oracle_run(z, 30), 5.0, oracle_shape)
            )
            assert ours == oracle


@pytest.fixture(scope="module")
def grid() -> tuple[B.Configuration, ...]:
    return (config(10), config(20))


@pytest.mark.parametrize("mode", ["compose", "poisson"])
def test_a_rounds_grid_gives_each_configuration_its_own_sigma_at_one_per_trial_epsilon(
    grid, mode
) -> None:
    draws = (0, 1, 1, 0, 1) if mode == "compose" else ()
    s = S.solve_budget(B.Budget(3.0, mode, 5.0, math.inf, grid, draws))
    z10, z20 = s.sigmas
    assert z20 > z10  # more rounds at the same per-trial ε: more noise per round
    for c, z in zip(grid, s.sigmas, strict=True):
        own = oracle_epsilon(oracle_run(z, c.rounds))
        assert own <= s.per_trial_epsilon * (1 + 1e-12)
        # the smallest σ that meets it (to the stated precision)
        assert oracle_epsilon(oracle_run(z * (1 - 3 * B.SIGMA_TOLERANCE), c.rounds)) > own
    assert 3.0 * (1 - B.TOLERANCE) <= s.total_epsilon <= 3.0
    if mode == "compose":  # every trial's own event, composed by dp-accounting
        events = [oracle_run(s.sigmas[i], grid[i].rounds) for i in draws]
        assert s.total_epsilon == pytest.approx(
            oracle_epsilon(dp_accounting.ComposedDpEvent(events)), rel=1e-12
        )
    else:  # the max curve bounds every configuration's own repeat-and-select ε
        for c, z in zip(grid, s.sigmas, strict=True):
            one = oracle_epsilon(
                dp_event.RepeatAndSelectDpEvent(oracle_run(z, c.rounds), 5.0, np.inf)
            )
            assert one <= s.total_epsilon
        # and is the transform of the elementwise max, not a max of transforms
        curves = [selection.one_run_rdp(c.event(z))[1] for c, z in zip(grid, s.sigmas, strict=True)]
        assert not np.array_equal(curves[0], np.maximum(*curves))
        assert not np.array_equal(curves[1], np.maximum(*curves))


def test_an_unreachable_total_is_one_error_naming_it() -> None:
    with pytest.raises(B.BudgetError, match=r"0\.005.*unreachable|unreachable.*0\.005") as err:
        S.solve_budget(B.Budget(0.005, "poisson", 8.0, math.inf, (config(20),)))
    assert "\n" not in str(err.value)


def test_the_grid_of_a_config_is_its_rounds_and_bands_choices() -> None:
    from engine.config import load_config

    base = load_config(overrides=["dataset.num_clients=100", "sampling.rate=0.1", "rounds=8"])
    configs = B.configurations(base, "dp_bandmf", {"rounds": [4, 8], "algo.bands": [1, 2]})
    assert [c.label for c in configs] == [
        "rounds=4, algo.bands=1",
        "rounds=4, algo.bands=2",
        "rounds=8, algo.bands=1",
        "rounds=8, algo.bands=2",
    ]
    assert [(c.spec.mode, c.spec.bands, c.spec.horizon) for c in configs] == [
        ("bands", 1, 4),
        ("bands", 2, 4),
        ("bands", 1, 8),
        ("bands", 2, 8),
    ]
    assert B.index_of(configs, {"rounds": 8, "algo.bands": 2, "local.lr": 0.1}) == 3
