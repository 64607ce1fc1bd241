"""Participation: who takes part in a round, and what the accountant may assume about it.

A participation scheme is one object, a :class:`Participation`. It draws each round's
cohort (:meth:`Participation.draw`), and its class *is* the statement of the sampling
the accountant assumes: the adjacency (:attr:`Participation.adjacency`), the accountants
that can account it, the public denominator of the noisy sum, and, where the sampling
amplifies privacy, :meth:`Participation.sampled_gaussian` (one round's event of a
Gaussian mechanism under that sampling). The accountant (:mod:`engine.privacy.accounting`)
and the noise schemes (:mod:`engine.privacy.noise`) read only that statement, never a
mode name.

Built in here: Poisson sampling (each client independently with probability q, add or
remove one client; optionally truncated to ``max_cohort`` by a uniformly random subset)
and fixed-size sampling without replacement (m of N, replace one client). Epoch passes
and b-min-separation are defined with the methods that use them (the methods' modules
in ``algorithms``). A new scheme subclasses the statement it meets and overrides
:meth:`Participation.draw`; :func:`check_draws` then samples the new draw when the run is
built and refuses it unless its cohorts follow the law of the statement (cohort sizes,
how often each client is drawn, the overlap of two rounds' cohorts), so a scheme that
states Poisson sampling but draws fixed-size cohorts never runs.

Cohort draws come from the round's own stream (:class:`engine.privacy.rng.Randomness`),
or in release mode (``privacy.secure_noise``) from the OS CSPRNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # the accountant's events: only where an event is built
    import dp_accounting

#: Participation classes by :attr:`Participation.mode`, filled as classes are defined
#: (:func:`engine.privacy.sampling.SamplingSpec`; tuning.report rebuilds a trial's
#: statement from its rows with :func:`by_name`).
_BY_MODE: dict[str, type[Participation]] = {}


def registered() -> dict[str, type[Participation]]:
    """The participation classes defined so far, by mode."""
    return dict(_BY_MODE)


def by_name(name: str) -> type[Participation]:
    """The participation class whose rows carry ``sampling=name``."""
    for cls in _BY_MODE.values():
        if name == cls.mode or name in cls.row_names:
            return cls
    raise ValueError(f"no participation records sampling={name!r}")


def tested_draw(fn: Callable) -> Callable:
    """Mark a :meth:`Participation.draw` as dpfl's own, tested against its law in the
    test suite: :func:`check_draws` does not sample it again at every run."""
    fn._dpfl_tested = True  # type: ignore[attr-defined]
    return fn


@dataclass(frozen=True)
class CohortLaw:
    """What a statement implies about the cohorts: the mean and variance of a cohort's
    size, the probability that a given client is in a round's cohort, and the mean
    size of the intersection of two consecutive rounds' cohorts (None: not implied)."""

    mean_size: float
    var_size: float
    inclusion: float
    mean_overlap: float | None
    var_overlap: float | None = None


class Participation:
    """Draws each round's cohort and states the sampling the accountant assumes."""

    num_clients: int
    #: the statement's kind, a label (``config.json``, messages); never dispatched on
    mode: ClassVar[str] = ""
    #: ``add_remove``, ``replace_one`` or ``replace_special``
    adjacency: ClassVar[str] = "add_remove"
    #: the accountants that can account this sampling (the first is the default)
    accountants: ClassVar[tuple[str, ...]] = ("rdp", "pld")
    #: whether release mode (``privacy.secure_noise``) can draw it
    secure_ok: ClassVar[bool] = True
    #: every ``sampling`` column value its rows may carry (besides :attr:`mode`)
    row_names: ClassVar[tuple[str, ...]] = ()
    # the statement's public parameters; a subclass declares the ones it has as fields
    rate: float | None = None
    cohort_size: int | None = None
    max_cohort: int | None = None
    bands: int | None = None
    horizon: int | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.__dict__.get("mode"):
            _BY_MODE.setdefault(cls.mode, cls)

    # ------------------------------------------------------------- statement

    @property
    def name(self) -> str:
        """The rows' ``sampling`` column."""
        return self.mode

    @property
    def denominator(self) -> float:
        """The fixed, public divisor of the noisy sum (never the realised cohort size)."""
        raise NotImplementedError

    @property
    def effective_rate(self) -> float:
        """A client's share of one round (its sampling probability where it is sampled)."""
        return self.denominator / self.num_clients

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        import dp_accounting

        relation = dp_accounting.NeighboringRelation
        return {
            "add_remove": relation.ADD_OR_REMOVE_ONE,
            "replace_one": relation.REPLACE_ONE,
            "replace_special": relation.REPLACE_SPECIAL,
        }[self.adjacency]

    def default_accountant(self) -> str:
        return self.accountants[0]

    def check_accountant(self, accountant: str) -> None:
        if accountant not in self.accountants:
            raise ValueError(
                f"privacy.accountant={accountant!r}: {self.name} participation is accounted "
                f"by {' or '.join(a.upper() for a in self.accountants)} only"
            )

    def sampled_gaussian(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        """One round of a Gaussian mechanism with multiplier z on the clipped sum under
        this sampling (independent noise per round). Raises where the scheme does not
        sample (its rounds are accounted by a noise scheme made for it)."""
        raise ValueError(
            f"{self.name} participation has no per-round event of independent noise: it "
            "is accounted with the correlated noise made for it"
        )

    def columns(self) -> dict[str, Any]:
        """Public columns every row of the run carries besides ``sampling`` and its rate."""
        return {}

    def algo_keys(self) -> dict[str, Any]:
        """``algo.*`` values the participation resolved (a built pipeline uses them)."""
        return {}

    def caution(self, planned_epsilon: float) -> str | None:
        """A warning a run of this participation gives, or None."""
        return None

    def law(self) -> CohortLaw | None:
        """What the statement implies about the cohorts (:func:`check_draws`)."""
        return None

    @classmethod
    def from_columns(cls, row: Any, num_clients: int, horizon: int) -> Participation:
        """The participation of a finished run from its rows' columns (``sampling``,
        ``sampling_rate`` and its own), for tuning.report's recomputed ε."""
        m = int(round(float(row["sampling_rate"]) * num_clients))
        return cls(num_clients=num_clients, cohort_size=m)  # type: ignore[call-arg]

    def rdp_hint(self) -> Participation:
        """A participation the RDP accountant can account whose ε is at least this
        one's at every z (a PLD search starts from its z): this one where RDP can."""
        return self

    @property
    def statement(self) -> Participation:
        """What the accountant reads: this object (a scheme is its statement's subclass)."""
        return self

    # ------------------------------------------------------------------ draw

    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        """The sorted client ids of round ``rnd``: from the round's own stream, or with
        ``secure`` from the OS CSPRNG. ``on_demand`` (an on-demand population) may draw
        the same law in O(cohort) instead of O(N)."""
        raise NotImplementedError


#: Rounds :func:`check_draws` samples; and how many standard errors a statistic may
#: stray from its law before the scheme is refused (false refusals: about 1e-8 each).
CHECK_ROUNDS = 200
CHECK_SIGMAS = 6.0


def check_draws(
    participation: Participation, seed: int, on_demand: bool = False, rounds: int = CHECK_ROUNDS
) -> None:
    """Refuse (ValueError) a participation whose cohorts do not follow the law of the
    sampling it states, by drawing ``rounds`` rounds of it (seeded simulation draws:
    each round's draw is a function of (seed, round) only, so the run's own draws are
    unchanged). Checked: every cohort is sorted distinct ids in [0, N); the cohort
    sizes' mean and variance; how often each client is drawn (a chi-square over the
    clients); and the mean overlap of consecutive rounds' cohorts (a scheme reusing one
    permutation in blocks draws disjoint consecutive cohorts: shuffling is not
    sampling, and is refused when it states sampling). A draw marked
    :func:`tested_draw` (dpfl's own) is not sampled here: the test suite checks it."""
    if getattr(type(participation).draw, "_dpfl_tested", False):
        return
    law = participation.law()
    n, stated = participation.num_clients, participation.name

    def refuse(what: str) -> None:
        raise ValueError(
            f"participation {type(participation).__name__} states {stated} sampling but "
            f"its cohorts do not follow it ({what}); its epsilon would not hold"
        )

    cohorts = [participation.draw(seed, r, False, on_demand) for r in range(rounds)]
    counts = np.zeros(n)
    for c in cohorts:
        c = np.asarray(c)
        if c.size and (c.min() < 0 or c.max() >= n or np.any(np.diff(c) <= 0)):
            refuse("a cohort is not sorted distinct client ids in [0, N)")
        counts[c] += 1
    if law is None:
        return
    sizes = np.array([len(c) for c in cohorts], dtype=float)
    k = float(rounds)
    if law.var_size == 0:
        if np.any(sizes != law.mean_size):
            spread = f"{sizes.min():g} to {sizes.max():g}"
            refuse(f"cohort sizes vary ({spread}), stated {law.mean_size:g}")
    else:
        se = math.sqrt(law.var_size / k)
        if abs(sizes.mean() - law.mean_size) > CHECK_SIGMAS * se:
            refuse(f"mean cohort size {sizes.mean():.4g}, stated {law.mean_size:.4g}")
        if law.var_size * k >= 20:  # enough spread to measure
            ratio = sizes.var(ddof=1) / law.var_size
            slack = CHECK_SIGMAS * math.sqrt(2.0 / (k - 1))
            if not 1 - slack < ratio < 1 + 2 * slack:
                refuse(f"cohort size variance {sizes.var(ddof=1):.4g}, stated {law.var_size:.4g}")
    p = law.inclusion
    if 0 < p < 1 and n > 1:  # chi-square of the clients' counts (N dof, ~normal)
        chi = float(((counts - k * p) ** 2).sum() / (k * p * (1 - p)))
        if abs(chi - n) > 2 * CHECK_SIGMAS * math.sqrt(2.0 * n):
            refuse(f"clients are not drawn alike (chi-square {chi:.4g} over {n} clients)")
    if law.mean_overlap is not None and law.var_overlap is not None:
        overlaps = [
            len(np.intersect1d(a, b, assume_unique=True)) for a, b in zip(cohorts, cohorts[1:])
        ]
        se = math.sqrt(law.var_overlap / (k - 1)) + 0.5 / k
        if abs(float(np.mean(overlaps)) - law.mean_overlap) > CHECK_SIGMAS * se:
            refuse(
                f"consecutive cohorts share {np.mean(overlaps):.3g} clients on average, stated "
                f"{law.mean_overlap:.3g} (independent draws every round)"
            )
