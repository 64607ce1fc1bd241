"""The sampled participations of the ``sampling:`` section: Poisson (optionally
truncated) and fixed-size without replacement (:mod:`engine.privacy.participation`).

Under both, each round's cohort is drawn afresh and independently of earlier rounds,
which is what makes a round a *subsampled* Gaussian mechanism:

* Poisson: each client with probability q, add or remove one client;
  ``PoissonSampledDpEvent(q, Gaussian(z))``; with ``max_cohort``, a larger draw keeps a
  uniformly random subset of that size: ``TruncatedSubsampledGaussianDpEvent`` (PLD
  only). An on-demand population draws the same law in O(cohort)
  (:func:`poisson_by_count`).
* Fixed: m of N uniformly without replacement, replace one client. The clipped sum's
  replace-one sensitivity is 2C while dp-accounting's without-replacement RDP assumes C
  (library issue #378), so the Gaussian inside the event is given z / 2: sound, far
  looser than Poisson. RDP only.

The realised cohort size is private under Poisson sampling: it is never the
denominator (q·N is).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from engine.privacy.participation import CohortLaw, Participation, registered, tested_draw

if TYPE_CHECKING:
    import dp_accounting


@dataclass(frozen=True)
class PoissonSampling(Participation):
    """Each client independently with probability q; ``max_cohort``: truncated."""

    num_clients: int
    rate: float
    max_cohort: int | None = None
    mode: ClassVar[str] = "poisson"
    row_names: ClassVar[tuple[str, ...]] = ("truncated_poisson",)

    def __post_init__(self) -> None:
        if not (self.rate is not None and 0 < self.rate <= 1):
            raise ValueError(f"sampling.rate={self.rate!r} must be in (0, 1]")

    @property
    def name(self) -> str:
        return "truncated_poisson" if self.max_cohort is not None else "poisson"

    def default_accountant(self) -> str:
        return "pld" if self.max_cohort is not None else "rdp"

    def rdp_hint(self) -> Participation:
        return dataclasses.replace(self, max_cohort=None)  # truncation only helps

    @classmethod
    def from_columns(cls, row: Any, num_clients: int, horizon: int) -> Participation:
        cap = row["max_cohort"] if "max_cohort" in row else None
        if cap is not None and not math.isnan(float(cap)):
            return cls(num_clients, float(row["sampling_rate"]), int(cap))
        if row["sampling"] == "truncated_poisson":
            raise ValueError(
                "rows of a truncated-Poisson trial without max_cohort (written by an older "
                "dpfl): its privacy event cannot be rebuilt; re-run the experiment"
            )
        return cls(num_clients, float(row["sampling_rate"]))

    def check_accountant(self, accountant: str) -> None:
        if self.max_cohort is not None and accountant != "pld":
            raise ValueError(
                f"privacy.accountant={accountant!r}: sampling.max_cohort is accounted as "
                "truncated Poisson, which only the PLD accountant supports"
            )
        super().check_accountant(accountant)

    @property
    def denominator(self) -> float:
        return self.rate * self.num_clients

    @property
    def effective_rate(self) -> float:
        return self.rate

    def sampled_gaussian(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        import dp_accounting

        z = float(noise_multiplier)
        if self.max_cohort is not None:
            return dp_accounting.TruncatedSubsampledGaussianDpEvent(
                dataset_size=self.num_clients,
                sampling_probability=self.rate,
                truncated_batch_size=self.max_cohort,
                noise_multiplier=z,
            )
        return dp_accounting.PoissonSampledDpEvent(self.rate, dp_accounting.GaussianDpEvent(z))

    def law(self) -> CohortLaw | None:
        if self.max_cohort is not None:
            return None  # the truncated size's moments: not checked
        n, q = self.num_clients, self.rate
        return CohortLaw(n * q, n * q * (1 - q), q, n * q * q, n * q * q * (1 - q * q))

    @tested_draw
    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        from engine.privacy import rng as rngs  # torch: only where a cohort is drawn

        n, rate = self.num_clients, self.rate
        src = rngs.Randomness(seed, secure).cohort_stream(rnd)
        if isinstance(src, rngs.SecureRandom):
            if on_demand:
                cohort = poisson_by_gaps(n, rate, src.uniform)
            else:
                cohort = np.flatnonzero(src.uniform(n) < rate).astype(np.int64)
            if self.max_cohort is not None and len(cohort) > self.max_cohort:
                cohort = src.sample(cohort, self.max_cohort)
            return cohort
        g = src  # the round's seeded sampling stream
        if on_demand:
            cohort = poisson_by_count(g, n, rate)
        else:
            cohort = np.flatnonzero(g.random(n) < rate).astype(np.int64)
        if self.max_cohort is not None and len(cohort) > self.max_cohort:
            cohort = np.sort(g.choice(cohort, self.max_cohort, replace=False)).astype(np.int64)
        return cohort


@dataclass(frozen=True)
class FixedSampling(Participation):
    """m of the N clients uniformly without replacement, afresh every round."""

    num_clients: int
    cohort_size: int
    mode: ClassVar[str] = "fixed"
    row_names: ClassVar[tuple[str, ...]] = ("fixed_without_replacement",)
    adjacency: ClassVar[str] = "replace_one"
    accountants: ClassVar[tuple[str, ...]] = ("rdp",)

    def __post_init__(self) -> None:
        if not (self.cohort_size is not None and 1 <= self.cohort_size <= self.num_clients):
            raise ValueError(
                f"sampling.cohort_size={self.cohort_size!r} must be in [1, {self.num_clients}]"
            )

    @property
    def name(self) -> str:
        return "fixed_without_replacement"

    def check_accountant(self, accountant: str) -> None:
        if accountant != "rdp":
            raise ValueError(
                f"privacy.accountant={accountant!r}: fixed-size sampling is supported only "
                "by the RDP accountant"
            )

    @property
    def denominator(self) -> float:
        return float(self.cohort_size)

    def sampled_gaussian(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.SampledWithoutReplacementDpEvent(
            self.num_clients,
            self.cohort_size,
            dp_accounting.GaussianDpEvent(float(noise_multiplier) / 2.0),
        )

    def caution(self, planned_epsilon: float) -> str | None:
        return (
            "sampling.mode=fixed is accounted under replace-one adjacency with sensitivity "
            f"2C; its epsilon ({planned_epsilon:.3g}) is far looser than Poisson sampling's"
        )

    def law(self) -> CohortLaw:
        n, m = self.num_clients, self.cohort_size
        p = m / n  # hypergeometric overlap of two independent m-subsets
        var = m * p * (1 - p) * (n - m) / (n - 1) if n > 1 else 0.0
        return CohortLaw(float(m), 0.0, p, m * p, var)

    @tested_draw
    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        from engine.privacy import rng as rngs  # torch: only where a cohort is drawn

        src = rngs.Randomness(seed, secure).cohort_stream(rnd)
        if isinstance(src, rngs.SecureRandom):
            return src.sample(self.num_clients, self.cohort_size)  # O(k): no arange(n)
        chosen = src.choice(self.num_clients, self.cohort_size, replace=False)
        return np.sort(chosen).astype(np.int64)


def SamplingSpec(  # noqa: N802 - the statement's former class name, kept for callers
    mode: str,
    num_clients: int,
    rate: float | None = None,
    cohort_size: int | None = None,
    max_cohort: int | None = None,
    **fields: Any,
) -> Participation:
    """The participation of ``sampling.mode`` ``mode`` (the config's name; also a mode
    registered by a method module, such as ``epochs``), built from its public facts."""
    classes = registered()
    cls = classes.get(mode)
    if cls is None:
        raise ValueError(f"sampling.mode={mode!r} must be one of {', '.join(classes)}")
    given = {"rate": rate, "cohort_size": cohort_size, "max_cohort": max_cohort, **fields}
    names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    kwargs = {k: v for k, v in given.items() if k in names}
    return cls(num_clients=num_clients, **kwargs)  # type: ignore[call-arg]


def poisson_by_count(g: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Poisson sampling of ``range(n)`` with rate q in O(m) time and memory, m the
    cohort's size: m ~ Binomial(n, q), then a uniformly random m-subset, sorted.

    Why this is Poisson sampling, so the Poisson-subsampled Gaussian accountant applies
    unchanged: under Poisson sampling a subset S has probability q^|S| (1 − q)^(n − |S|),
    which depends on S only through |S|. So |S| ~ Binomial(n, q), and given |S| = m every
    m-subset is equally likely. ``Generator.choice(n, m, replace=False)`` is uniform over
    m-subsets and, for m ≤ n/50, runs Floyd's algorithm with O(m) memory."""
    m = int(g.binomial(n, rate))
    return np.sort(g.choice(n, m, replace=False)).astype(np.int64)


def poisson_by_gaps(n: int, rate: float, uniform: Callable[[int], np.ndarray]) -> np.ndarray:
    """Poisson sampling of ``range(n)`` with rate q from uniforms in (0, 1) alone (what
    :class:`engine.privacy.rng.SecureRandom` offers), in O(m) expected time: the gaps
    between consecutive members of a Bernoulli(q) sequence are i.i.d. Geometric(q),
    P(G ≥ k) = (1 − q)^k, and G = ⌊log u / log(1 − q)⌋ has exactly that law. Members are
    the running sums of G + 1 that stay below n."""
    if n <= 0 or rate <= 0:
        return np.zeros(0, np.int64)
    if rate >= 1:
        return np.arange(n, dtype=np.int64)
    log_keep = math.log1p(-rate)
    mean = n * rate
    chunk = int(mean + 6 * math.sqrt(mean) + 16)  # usually one call
    parts, last = [], -1
    while True:
        gaps = np.minimum(np.floor(np.log(uniform(chunk)) / log_keep), n)  # ≥ n: past the end
        pos = last + np.cumsum(gaps.astype(np.int64) + 1)
        inside = pos[pos < n]  # pos increases, so this is a prefix
        parts.append(inside)
        if len(inside) < chunk:
            return np.concatenate(parts)
        last = int(pos[-1])
