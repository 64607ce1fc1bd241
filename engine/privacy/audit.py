"""One-shot empirical privacy estimation with canary clients.

After Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical Privacy
Estimation for Federated Learning" (ICLR 2024). With ``eval.audit_canaries=K``:

* 2K random unit directions u_k ∈ R^d are drawn from the run's seed. The first K
  belong to *canary clients* that join the population; the other K are *held out*
  and never inserted.
* Every round each canary participates independently with the real clients'
  sampling probability q (m/N under fixed-size sampling; canaries are not subject to
  ``max_cohort``). A participating canary sends its direction restricted to the
  round's released coordinates (not a personal head; only the public rand-k mask for
  Fed-SMP rand-k), scaled to norm C_t, the round's clip norm (C_t under adaptive
  clipping). It passes the clip unchanged and is added to the clipped sum before the
  noise. Canaries add no client-side noise and do not report a quantile bit.
* The statistic of direction u is the cosine between u and the final model delta
  x^T − x^0 (default), or, with ``eval.audit_every_round``, the maximum over rounds of
  the cosine between u and that round's model change x^{t+1} − x^t (the paper's
  all-iterates threat model).
* The **estimate**: a Gaussian shift model is fitted to the two sets of statistics —
  the mean of the inserted canaries', the mean of the held-out ones and one pooled
  standard deviation σ̂ — and the estimate is the ε at the run's δ of the Gaussian
  mechanism N(0, σ̂²) vs N(μ_in − μ_out, σ̂²) (both directions of the hockey-stick
  divergence, exact via normal CDFs; see :func:`gaussian_fit_epsilon` for why one
  variance). The paper compares against the theoretical null N(0, 1/d); held-out
  canaries give the same null empirically.
* The **lower bound**: a threshold test. For every threshold τ among the pooled
  statistics, TPR = share of inserted canaries above τ, FPR = share of held-out ones;
  (ε, δ)-DP implies TPR ≤ e^ε FPR + δ and 1 − FPR ≤ e^ε (1 − TPR) + δ. Clopper–Pearson
  bounds at confidence 1 − α (α = 0.05), Bonferroni-corrected over all thresholds and
  both bounds, turn these into ε_lower = max over τ of the implied ε. It treats the
  K canaries as independent trials (the one-run heuristic), and with K canaries it
  cannot exceed about log(K).

Correlated noise: the canaries follow the recipe's participation rule instead of rate
q, and the every-round statistic is the whitened matched filter over the trajectory;
see :mod:`engine.privacy.audit_correlated`.

Neither number is a privacy guarantee or a release: both are *diagnostics* of this
run under this threat model (an adversary who inserts canary clients and sees the
final model, or every model), hence the ``_nonprivate`` suffix of their columns.
Canaries never change the accounted ε of real clients: the accountant uses the real
population's sampling rate q, noise multiplier and rounds, none of which the canaries
change; the average still divides by the real population's public denominator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from engine.privacy import rng as rngs

AUDIT_ALPHA = 0.05  # the lower bound holds with confidence 1 − AUDIT_ALPHA


@dataclass(frozen=True)
class AuditSpec:
    """Public parameters of the canary audit of one run."""

    seed: int
    canaries: int  # K inserted; K more are held out
    dim: int
    rate: float  # a canary's per-round participation probability (the clients' q)
    num_clients: int  # the real population N
    delta: float
    every_round: bool = False
    #: None: sampled participation, the canaries at rate q; under correlated noise the
    #: every-round statistic its scheme names (engine.privacy.audit_correlated)
    correlated_statistic: str | None = None
    rounds: int = 0  # T, the run's rounds (the correlated audit keeps one row per round)

    @property
    def statistic(self) -> str:
        """The ``audit_statistic`` column: what each direction's score is."""
        if not self.every_round:
            return "final_model_cosine"
        return self.correlated_statistic or "max_round_cosine"

    def summary(self) -> dict:
        return {
            "audit_canaries": self.canaries,
            "audit_statistic": self.statistic,
            "population_real": self.num_clients,
            "population_with_canaries": self.num_clients + self.canaries,
        }


def audit_spec(config, plan, dim: int) -> AuditSpec | None:
    """The run's audit; ``None`` when ``eval.audit_canaries=0`` or for a non-private
    recipe (a canary's update is scaled to the clip norm, which such a recipe lacks), so
    ``dpfl compare`` and ``dpfl tune`` can mix private and non-private recipes. Under
    correlated noise (a scheme naming its statistic) the server builds the adapted
    audit (:func:`engine.privacy.audit_correlated.make_audit`). Otherwise the canaries
    take part at the clients' rate, which only a sampled participation's accounting
    covers: another one is refused (ValueError), the audit's verdict would be about
    neighbours the accountant does not cover."""
    k = config.eval.audit_canaries
    if k == 0 or not plan.private:
        return None
    if plan.noise.audit_statistic is None:
        try:
            plan.sampling.statement.sampled_gaussian(1.0)
        except ValueError:
            raise ValueError(
                f"eval.audit_canaries={k}: the canary audit needs sampled participation or "
                f"a noise scheme with an audit model, not {plan.sampling.name}"
            ) from None
    return AuditSpec(
        seed=config.seed,
        canaries=k,
        dim=dim,
        rate=plan.sampling.effective_rate,
        num_clients=config.dataset.num_clients,
        delta=plan.delta,
        every_round=config.eval.audit_every_round,
        correlated_statistic=plan.noise.audit_statistic,
        rounds=config.rounds,
    )


def canary_directions(seed: int, count: int, dim: int) -> torch.Tensor:
    """``count`` i.i.d. uniform unit vectors in R^dim (float32 rows), from the seed."""
    g = rngs.torch_gen(seed, rngs.AUDIT, 0)
    u = torch.randn(count, dim, generator=g, dtype=torch.float64)
    u = u / torch.linalg.vector_norm(u, dim=1, keepdim=True)
    return u.to(torch.float32)


def cosines(directions: torch.Tensor, vector: torch.Tensor) -> np.ndarray:
    """cos(u_k, v) for every row u_k (0 for v = 0)."""
    v = vector.double()
    n = float(torch.linalg.vector_norm(v))
    if n == 0.0:
        return np.zeros(directions.shape[0])
    norms = torch.linalg.vector_norm(directions.double(), dim=1)
    return ((directions.double() @ v) / (norms * n)).numpy()


class CanaryAudit:
    """Canary insertion and the end-of-run estimate (lives in the server)."""

    def __init__(self, spec: AuditSpec, initial_weights: torch.Tensor) -> None:
        self.spec = spec
        self.w0 = initial_weights.detach().clone()
        self.directions = canary_directions(spec.seed, 2 * spec.canaries, spec.dim)
        self.participations = np.zeros(spec.canaries, dtype=np.int64)
        self.max_cos = np.full(2 * spec.canaries, -np.inf)

    def state_dict(self) -> dict:
        return {"participations": self.participations.copy(), "max_cos": self.max_cos.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.participations = np.array(state["participations"], dtype=np.int64)
        self.max_cos = np.array(state["max_cos"], dtype=np.float64)

    def sampled(self, rnd: int) -> np.ndarray:
        """Indices of the canaries that take part in round ``rnd`` (Poisson, rate q)."""
        g = rngs.numpy_rng(self.spec.seed, rngs.AUDIT, 1, rnd)
        return np.flatnonzero(g.random(self.spec.canaries) < self.spec.rate)

    def canary_sum(self, rnd: int, clip_norm: float, support: torch.Tensor | None) -> torch.Tensor:
        """Σ over the round's canaries of C_t·(u_k on the released support)/‖·‖ (float64)."""
        total = torch.zeros(self.spec.dim, dtype=torch.float64)
        for k in self.sampled(rnd):
            v = self.directions[k].double()
            if support is not None:
                v = v * support.double()
            n = float(torch.linalg.vector_norm(v))
            if n > 0:
                total += v * (clip_norm / n)
            self.participations[k] += 1
        return total

    def observe_round(
        self, rnd: int, before: torch.Tensor, after: torch.Tensor, rounds: int
    ) -> dict:
        """Track the per-round statistic; on the last round return the audit columns
        (NaN on every other round)."""
        if self.spec.every_round:
            self.max_cos = np.maximum(self.max_cos, cosines(self.directions, after - before))
        if rnd + 1 != rounds:
            return empty_columns()
        if self.spec.every_round:
            scores = self.max_cos
        else:
            scores = cosines(self.directions, after - self.w0)
        return audit_columns(scores, self.spec, self.participations)


def empty_columns() -> dict:
    """The audit's columns on a round that is not the last (NaN)."""
    return {
        "audit_epsilon_estimate_nonprivate": math.nan,
        "audit_epsilon_lower_nonprivate": math.nan,
        "audit_canaries_participated_nonprivate": math.nan,
    }


def audit_columns(scores: np.ndarray, spec: AuditSpec, participations: np.ndarray) -> dict:
    """The last round's columns from the 2K scores (inserted first, then held out)."""
    inserted, held_out = scores[: spec.canaries], scores[spec.canaries :]
    return {
        "audit_epsilon_estimate_nonprivate": gaussian_fit_epsilon(inserted, held_out, spec.delta),
        "audit_epsilon_lower_nonprivate": threshold_lower_bound(inserted, held_out, spec.delta),
        "audit_canaries_participated_nonprivate": int((participations > 0).sum()),
    }


# ------------------------------------------------------------------- estimation


def _mass(lo: float, hi: float, mu: float, sd: float) -> float:
    """P(lo < X < hi) for X ~ N(mu, sd²), accurate in both tails."""
    a, b = (lo - mu) / sd, (hi - mu) / sd
    if a > 0:  # both in the upper tail: difference of survival functions
        return float(stats.norm.sf(a) - stats.norm.sf(b))
    return float(stats.norm.cdf(b) - stats.norm.cdf(a))


def hockey_stick(mu_p: float, sd_p: float, mu_q: float, sd_q: float, eps: float) -> float:
    """sup_S P(S) − e^ε Q(S) for P = N(mu_p, sd_p²), Q = N(mu_q, sd_q²), exactly: S is
    where log p − log q > ε, a quadratic inequality in x."""
    a = 0.5 / sd_q**2 - 0.5 / sd_p**2
    b = mu_p / sd_p**2 - mu_q / sd_q**2
    c = mu_q**2 / (2 * sd_q**2) - mu_p**2 / (2 * sd_p**2) + math.log(sd_q / sd_p) - eps
    inf = math.inf
    if abs(a) < 1e-12 * max(abs(b), 1e-300) or a == 0.0:
        if b == 0.0:
            intervals = [(-inf, inf)] if c > 0 else []
        elif b > 0:
            intervals = [(-c / b, inf)]
        else:
            intervals = [(-inf, -c / b)]
    else:
        disc = b * b - 4 * a * c
        if disc <= 0:
            intervals = [(-inf, inf)] if a > 0 else []
        else:
            r = math.sqrt(disc)
            x1, x2 = sorted(((-b - r) / (2 * a), (-b + r) / (2 * a)))
            intervals = [(-inf, x1), (x2, inf)] if a > 0 else [(x1, x2)]
    p = sum(_mass(lo, hi, mu_p, sd_p) for lo, hi in intervals)
    q = sum(_mass(lo, hi, mu_q, sd_q) for lo, hi in intervals)
    return max(0.0, p - math.exp(eps) * q) if eps < 700 else max(0.0, p)


def gaussian_pair_epsilon(
    mu1: float, sd1: float, mu0: float, sd0: float, delta: float, eps_max: float = 500.0
) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` in both directions for the pair
    N(mu1, sd1²), N(mu0, sd0²) (bisection; ``eps_max`` if even that is not enough)."""

    def excess(eps: float) -> float:
        return max(hockey_stick(mu1, sd1, mu0, sd0, eps), hockey_stick(mu0, sd0, mu1, sd1, eps))

    if excess(0.0) <= delta:
        return 0.0
    if excess(eps_max) > delta:
        return eps_max
    lo, hi = 0.0, eps_max
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if excess(mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-6:
            break
    return hi


def gaussian_fit_epsilon(inserted: np.ndarray, held_out: np.ndarray, delta: float) -> float:
    """ε estimate: the Gaussian *shift* model fitted to the two sets of statistics — the
    means of each set and one pooled standard deviation — then the ε at ``delta`` of the
    Gaussian mechanism N(0, σ²) vs N(Δ, σ²) with Δ = mean(inserted) − mean(held out).

    One shared variance, because the Gaussian mechanism moves the mean only. Fitting a
    variance per set lets the sampling noise of the two standard deviations (about
    1/√(2K) relative with K canaries, 7 % at K = 100) read as privacy loss: a variance
    ratio of 1.1 with equal means alone is ε ≈ 1.6 at δ = 1e-5, and in dpfl runs at an
    accounted ε = 1 that estimator reported 1.2–3.7. NaN with fewer than two finite
    statistics in a set."""
    ins = np.asarray(inserted, dtype=np.float64)
    out = np.asarray(held_out, dtype=np.float64)
    ins, out = ins[np.isfinite(ins)], out[np.isfinite(out)]
    if len(ins) < 2 or len(out) < 2:
        return math.nan
    shift = float(ins.mean()) - float(out.mean())
    pooled = float(
        np.sqrt(
            ((len(ins) - 1) * ins.var(ddof=1) + (len(out) - 1) * out.var(ddof=1))
            / (len(ins) + len(out) - 2)
        )
    )
    if pooled <= 1e-12 * max(abs(shift), 1e-300):
        return math.inf if shift != 0 else 0.0
    return gaussian_pair_epsilon(abs(shift) / pooled, 1.0, 0.0, 1.0, delta)


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """Two one-sided (1 − alpha) Clopper–Pearson bounds (lower, upper) of a proportion."""
    lo = 0.0 if successes == 0 else float(stats.beta.ppf(alpha, successes, trials - successes + 1))
    hi = (
        1.0
        if successes == trials
        else float(stats.beta.ppf(1 - alpha, successes + 1, trials - successes))
    )
    return lo, hi


def clopper_pearson_arrays(
    successes: np.ndarray, trials: int, alpha: float
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`clopper_pearson` for an array of success counts (one vectorised call)."""
    k = np.asarray(successes, dtype=np.int64)
    lo = np.zeros(len(k))
    hi = np.ones(len(k))
    some, short = k > 0, k < trials
    lo[some] = stats.beta.ppf(alpha, k[some], trials - k[some] + 1)
    hi[short] = stats.beta.ppf(1 - alpha, k[short] + 1, trials - k[short])
    return lo, hi


def threshold_lower_bound(
    inserted: np.ndarray, held_out: np.ndarray, delta: float, alpha: float = AUDIT_ALPHA
) -> float:
    """ε lower bound (confidence 1 − alpha) from the best threshold test (see module doc)."""
    ins = np.sort(np.asarray(inserted, dtype=np.float64))
    out = np.sort(np.asarray(held_out, dtype=np.float64))
    n_in, n_out = len(ins), len(out)
    if n_in == 0 or n_out == 0:
        return math.nan
    thresholds = np.unique(np.concatenate([ins, out]))
    a = alpha / (2 * len(thresholds))  # Bonferroni over thresholds and both bounds
    tp = n_in - np.searchsorted(ins, thresholds, side="left")  # inserted ≥ τ
    fp = n_out - np.searchsorted(out, thresholds, side="left")  # held out ≥ τ
    tpr_lo, _ = clopper_pearson_arrays(tp, n_in, a)
    _, fpr_hi = clopper_pearson_arrays(fp, n_out, a)
    best = 0.0
    for t_lo, f_hi in zip(tpr_lo.tolist(), fpr_hi.tolist(), strict=True):
        if t_lo - delta > 0 and f_hi > 0:
            best = max(best, math.log((t_lo - delta) / f_hi))
        tnr_lo, fnr_hi = 1.0 - f_hi, 1.0 - t_lo
        if tnr_lo - delta > 0 and fnr_hi > 0:
            best = max(best, math.log((tnr_lo - delta) / fnr_hi))
    return best
