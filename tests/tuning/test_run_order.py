"""The order both pools take their runs in (tuning.run_order): the costliest first, with
each run's cost computed from what it will draw, before it runs."""

from __future__ import annotations

import heapq

from tuning.run_order import longest_first, work


def makespan(costs: list[float], processes: int = 2) -> float:
    """When the last run ends if each run goes to the first process that is free."""
    free = [0.0] * processes
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def test_longest_first_is_a_stable_descending_order_that_ends_sooner() -> None:
    planned = [100.0, 400.0, 50.0, 200.0, 50.0, 400.0, 400.0, 400.0]
    order = longest_first(list(range(len(planned))), lambda k: planned[k])
    assert order == [1, 5, 6, 7, 3, 0, 2, 4]  # ties (the 400s, the 50s) as planned
    assert (makespan(planned), makespan([planned[k] for k in order])) == (1200.0, 1000.0)
    assert work(10, 2, None) == 20.0 and work(10, 2, 5) == 50.0  # steps replace passes


def test_a_sweeps_trials_are_costed_by_their_own_draws() -> None:
    """The process runner's cost of trial k is the rounds × local passes that trial k
    draws (tuning.trial.sampled_params), so its order follows the searched horizons."""
    from engine.config import load_config
    from tuning.trial import sampled_params
    from tuning.trial_pool import Cell, TrialTask, trial_cost

    base = load_config().to_dict()
    space = {
        "rounds": {"type": "choice", "values": [50, 100, 200, 400]},
        "local.epochs": {"type": "choice", "values": [1, 2]},
    }
    cell = Cell("dp_fedavg", 4.0, 16, base, {}, space)
    tasks = [TrialTask("out", cell, k, f"t{k}") for k in range(16)]
    drawn = [sampled_params(space, int(base["seed"]), "dp_fedavg", 4.0, k) for k in range(16)]
    costs = [float(d["rounds"] * d["local.epochs"]) for d in drawn]
    assert [trial_cost(t) for t in tasks] == costs
    assert len(set(costs)) > 2  # the draws differ, so the order is not the given one
    ordered = [t.index for t in longest_first(tasks, trial_cost)]
    assert [costs[k] for k in ordered] == sorted(costs, reverse=True)
    assert makespan([costs[k] for k in ordered]) <= makespan(costs)
    # no space: every trial has the experiment's rounds and passes
    fixed = Cell("dp_fedavg", 4.0, 2, base, {}, None)
    assert trial_cost(TrialTask("out", fixed, 1, "t1")) == float(
        base["rounds"] * base["local"]["epochs"]
    )
