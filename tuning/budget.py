"""A total privacy budget for a tuned release: solve for the per-trial ε it leaves.

``dpfl tune --total-epsilon E`` and ``dpfl leaderboard`` fix what publishing the
selected trial costs *including* the hyperparameter search — E at δ — and solve for the
per-trial budget ε_t and each configuration's noise multiplier. The argument (also
``docs/leaderboard.md``, "Accounting"):

* **Configurations.** A trial's privacy event depends on its σ and on the keys of
  :data:`tuning.selection.PRIVACY_KEYS` (sampling, δ, rounds, ``algo.bands``). Those
  keys may vary across trials only over a finite grid (``rounds`` from e.g. 50, 100,
  200, 400; ``algo.bands`` from dp_bandmf's choices): every combination is one
  :class:`Configuration` c, with its own sampling spec, rounds T_c, δ and accountant.
* **Per-trial ε.** All configurations share one per-trial ε_t: σ_c is the smallest
  noise multiplier (to a relative :data:`SIGMA_TOLERANCE`) whose dp-accounting ε for
  c is ≤ ε_t (:func:`engine.privacy.accounting.compute_epsilon`, the run's own
  accounting), so a trial of 400 rounds gets more noise per round than one of 50 at
  the same ε_t. Trials run with σ_c set explicitly (``privacy.noise_multiplier``): the
  σ that runs is the σ accounted here, and each run reports its own ε (≤ ε_t).
* **compose** (every trial may be published): ε with tuning is the composition of
  every trial's own event, ``SelfComposed(round event(σ_{c_k}), T_{c_k})`` for the
  configuration c_k trial k draws. The draws are seeded and never depend on results,
  so they are known before any trial runs; the final figure is dp-accounting's
  accountant composing those events (:func:`tuning.selection.composed_epsilon`).
* **Papernot-Steinke** (K ~ Poisson(μ) or truncated negative binomial(η, μ) trials,
  only the best published, K secret): a trial draws its configuration at random, so
  one trial is a mixture of the configurations' mechanisms, with the same mixing
  weights on neighbouring data sets. For α > 1, exp((α−1)·D_α(P‖Q)) = ∫P^α Q^{1−α} is
  jointly convex in (P, Q), so the mixture's Rényi divergence at each order is at most
  the largest of its components': the elementwise max over *all* configurations'
  one-run RDP curves bounds one trial whatever it draws (the released configuration is
  part of the output, which changes nothing: its law does not depend on the data). The
  repeat-and-select transform (Papernot & Steinke 2022, Theorems 2 and 6; dp-accounting's
  implementation) is applied to that curve
  (:func:`tuning.selection.repeat_and_select_epsilon`); with one configuration this is
  dp-accounting's ``RepeatAndSelectDpEvent`` exactly. The grid must be finite for the max
  to be over a finite set.
* **The solve** (:mod:`tuning.budget_search`). The total decreases as σ grows. It is
  searched over the σ of a reference configuration (ε_t is that configuration's ε at
  it; the others' σ follow from ε_t) by regula falsi with the Illinois step on log σ
  between a σ whose total exceeds E and one within it, until the total lies in
  [E·(1 − :data:`TOLERANCE`), E].
  E is unreachable when even σ = 500 (``engine.privacy.resolve``'s bracket) leaves the
  total above E: the transform has a floor (log μ/(α−1) at the largest order) that no
  noise removes, and composition grows with the number of trials.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from dp_accounting.rdp import rdp_privacy_accountant

from engine.privacy.accounting import SamplingSpec, compute_epsilon
from tuning import selection

#: The solved total lies in [E·(1 − TOLERANCE), E].
TOLERANCE = 1e-4
#: σ_c of a configuration: the smallest noise multiplier, to this relative precision,
#: whose ε is within the per-trial ε.
SIGMA_TOLERANCE = 2e-5
#: Privacy keys a search may vary over a finite grid (a ``choice``) under a total budget.
GRID_KEYS = ("rounds", "algo.bands")


class BudgetError(ValueError):
    """The total budget cannot be met (one line, naming the budget)."""


@dataclass(frozen=True)
class Configuration:
    """One privacy-relevant configuration a trial may run (all public): the values of
    the grid keys (``keys``), and what its accounting reads."""

    keys: tuple[tuple[str, Any], ...]
    spec: SamplingSpec
    rounds: int
    delta: float
    accountant: str

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.keys) or f"rounds={self.rounds}"

    def event(self, noise_multiplier: float) -> selection.TrialEvent:
        return selection.TrialEvent(
            float(noise_multiplier), self.spec, self.rounds, self.delta, self.accountant
        )

    def epsilon(self, noise_multiplier: float) -> float:
        return compute_epsilon(
            noise_multiplier, self.spec, self.rounds, self.delta, self.accountant
        )


def configurations(config: Any, algorithm: str, grid: dict[str, list[Any]]) -> list[Configuration]:
    """Every configuration of ``algorithm`` on ``config`` (an ``engine.config.RunConfig``)
    that the grid keys' values can make (their product, in the grid's order; none given:
    the config's own), with the sampling spec, δ and accountant its run will use."""
    from engine.config import ConfigError, with_algorithm
    from engine.privacy.accounting import default_delta
    from engine.simulation import sampling_spec

    unknown = [k for k in grid if k not in GRID_KEYS]
    if unknown:
        raise ConfigError(f"{unknown[0]}: only {', '.join(GRID_KEYS)} may vary over a grid")
    keys = list(grid)
    out = []
    for values in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
        assignment = dict(zip(keys, values, strict=True))
        c = with_algorithm(config, algorithm, **assignment)
        spec = sampling_spec(c)
        p = c.privacy
        delta = p.delta if p.delta is not None else default_delta(c.dataset.num_clients)
        accountant = p.accountant or spec.default_accountant()
        spec.check_accountant(accountant)
        out.append(Configuration(tuple(assignment.items()), spec, c.rounds, delta, accountant))
    return out


@dataclass(frozen=True)
class Budget:
    """What to solve: a total ``total`` at the configurations' δ, under ``mode``
    (:data:`tuning.selection.MODES`), with ``trials`` trials (compose) or mean number of
    trials ``trials`` and TNB shape ``shape`` (Papernot-Steinke). ``draws``: under
    compose, the configuration (an index into ``configurations``) of each trial."""

    total: float
    mode: str
    trials: float
    shape: float
    configurations: tuple[Configuration, ...]
    draws: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (self.total > 0 and math.isfinite(self.total)):
            raise BudgetError(f"--total-epsilon={self.total}: must be a finite number > 0")
        if not self.configurations:
            raise BudgetError("a total budget needs at least one configuration")
        if self.mode == selection.COMPOSE and not self.draws:
            raise BudgetError("composition of no trial: nothing to budget")
        if selection.is_papernot_steinke(self.mode) and self.trials < 1:
            raise BudgetError(f"mean number of trials {self.trials}: must be >= 1")

    @property
    def delta(self) -> float:
        return max(c.delta for c in self.configurations)

    def rule(self) -> str:
        if self.mode == selection.COMPOSE:
            return f"composition of {len(self.draws)} trials"
        return selection.label(self.mode, self.trials, self.shape)


@dataclass(frozen=True)
class BudgetSolution:
    """The solved budget: the per-trial ε, each configuration's σ and own ε, and the
    total (ε with tuning, dp-accounting's, ≤ the budget)."""

    budget: Budget
    per_trial_epsilon: float
    sigmas: tuple[float, ...]
    trial_epsilons: tuple[float, ...]
    total_epsilon: float
    rule: str

    def sigma_of(self, values: dict[str, Any]) -> float:
        """σ of the configuration whose grid keys take ``values`` (a trial's draws)."""
        return self.sigmas[index_of(self.budget.configurations, values)]

    def record(self) -> dict[str, Any]:
        """What the experiment's files keep (JSON)."""
        b = self.budget
        return {
            "total_epsilon_budget": b.total,
            "tuning_privacy": b.mode,
            "trials" if b.mode == selection.COMPOSE else "mean_trials": b.trials,
            "tnb_shape": b.shape if b.mode == selection.TNB else None,
            "delta": b.delta,
            "per_trial_epsilon": self.per_trial_epsilon,
            "total_epsilon": self.total_epsilon,
            "rule": self.rule,
            "configurations": [
                {
                    "keys": dict(c.keys),
                    "rounds": c.rounds,
                    "sampling": c.spec.name,
                    "spec": {"mode": c.spec.mode, **dataclasses.asdict(c.spec)},
                    "delta": c.delta,
                    "accountant": c.accountant,
                    "noise_multiplier": z,
                    "epsilon": e,
                }
                for c, z, e in zip(b.configurations, self.sigmas, self.trial_epsilons, strict=True)
            ],
            "draws": list(b.draws),
            "trials_distribution": k_distribution(b.mode, b.trials, b.shape),
        }


def recorded_events(record: dict[str, Any]) -> list[selection.TrialEvent]:
    """Every configuration's event at its solved σ, from a :meth:`BudgetSolution.record`
    (what a report adds under Papernot-Steinke: the configurations no trial drew)."""
    import algorithms.registry  # noqa: F401 - the methods' participations (SamplingSpec modes)

    return [
        selection.TrialEvent(
            float(c["noise_multiplier"]),
            SamplingSpec(**c["spec"]),
            int(c["rounds"]),
            float(c["delta"]),
            str(c["accountant"]),
        )
        for c in record["configurations"]
    ]


def index_of(configs: tuple[Configuration, ...] | list[Configuration], values: dict) -> int:
    """The configuration whose grid keys take the values in ``values`` (keys missing
    from ``values`` keep the configuration's own)."""
    for i, c in enumerate(configs):
        if all(values.get(k, v) == v for k, v in c.keys):
            return i
    raise KeyError(f"no configuration for {values}")


def total_epsilon(budget: Budget, sigmas: list[float] | tuple[float, ...]) -> float:
    """ε with tuning for configurations noised with ``sigmas``. Composition of RDP
    events adds their curves in the trials' order, as dp-accounting's accountant does;
    other accountants compose in one (:func:`tuning.selection.composed_epsilon`)."""
    configs = budget.configurations
    if budget.mode == selection.COMPOSE:
        events = [configs[i].event(sigmas[i]) for i in budget.draws]
        if any(e.accountant != "rdp" or e.spec.mode not in ("poisson", "fixed") for e in events):
            return selection.composed_epsilon(events, budget.delta)[0]
        if len({e.spec.adjacency for e in events}) > 1:
            return selection.composed_epsilon(events, budget.delta)[0]
        total = None
        for e in events:
            orders, curve = selection.one_run_rdp(e)
            total = curve if total is None else total + curve
        assert total is not None
        return float(rdp_privacy_accountant.compute_epsilon(orders, total, budget.delta)[0])
    curves, orders = [], None
    for c, z in zip(configs, sigmas, strict=True):
        orders, curve = selection.one_run_rdp(c.event(z))
        curves.append(curve)
    assert orders is not None
    return selection.repeat_and_select_epsilon(
        curves, orders, budget.delta, budget.trials, budget.mode, budget.shape
    )


def accountant_total(budget: Budget, sigmas: list[float] | tuple[float, ...]) -> float:
    """The final figure: dp-accounting's accountant composing every trial's event
    (compose), or the repeat-and-select transform of the configurations' max curve."""
    configs = budget.configurations
    if budget.mode == selection.COMPOSE:
        events = [configs[i].event(sigmas[i]) for i in budget.draws]
        return selection.composed_epsilon(events, budget.delta)[0]
    events = [c.event(z) for c, z in zip(configs, sigmas, strict=True)]
    return selection.papernot_steinke_epsilon(
        events, budget.delta, budget.trials, budget.mode, budget.shape
    )[0]


def k_distribution(mode: str, trials: float, shape: float) -> str:
    """The number of trials, in words (for the files and the report)."""
    if mode == selection.COMPOSE:
        return f"{int(trials)} trials (fixed), all accounted"
    if mode == selection.POISSON:
        return f"K ~ Poisson(mean {trials:g}), secret; only the best trial is released"
    gamma = selection.tnb_gamma(shape, trials)
    return (
        f"K ~ truncated negative binomial(eta {shape:g}, gamma {gamma:.4g}; mean {trials:g}), "
        "secret; only the best trial is released"
    )
