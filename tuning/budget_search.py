"""The search behind :mod:`tuning.budget`: each configuration's σ at a per-trial ε
(:func:`sigma_for`), and the per-trial ε whose total meets the budget
(:func:`solve_budget`; the argument is in :mod:`tuning.budget`'s docstring).

Both are bracketing searches on log σ, where ε is smooth and decreasing: secant steps
to a bracket, then it is closed (the σ of a configuration: to a relative
:data:`tuning.budget.SIGMA_TOLERANCE`; the total: into [E·(1 − TOLERANCE), E]).
Every ε they evaluate is dp-accounting's, and the final total is recomputed by its
accountant (:func:`tuning.budget.accountant_total`).
"""

from __future__ import annotations

import math

from engine.privacy.resolve import Z_BRACKET
from tuning import selection
from tuning.budget import (
    SIGMA_TOLERANCE,
    TOLERANCE,
    Budget,
    BudgetError,
    BudgetSolution,
    Configuration,
    accountant_total,
    total_epsilon,
)

Z_MIN, Z_MAX = Z_BRACKET


def sigma_for(epsilon: float, config: Configuration, hint: float | None = None) -> float:
    """The smallest σ (to :data:`SIGMA_TOLERANCE`, relative) with ``config``'s ε ≤
    ``epsilon``: a bracket [lo, hi] with ε(lo) > ``epsilon`` ≥ ε(hi) and hi − lo ≤
    SIGMA_TOLERANCE·hi, found by secant steps on log ε against log σ from ``hint`` (ε is
    smooth and decreasing in σ) and closed by probing either side of the interpolated
    root; BudgetError when even σ = 500 exceeds it."""
    target = math.log(epsilon)
    width = math.log1p(SIGMA_TOLERANCE)
    u_min, u_max = math.log(Z_MIN), math.log(Z_MAX)

    def f(u: float) -> float:  # > 0: σ = e^u is too small (ε above the target)
        eps = config.epsilon(math.exp(u))
        return math.log(eps) - target if eps > 0 else -math.inf

    # 1. a bracket: secant steps (slope of log ε in log σ: about -1 to -2) from the hint
    u0 = min(max(math.log(hint) if hint else 0.0, u_min), u_max)
    f0 = f(u0)
    slope = -1.5
    lo = hi = None
    f_lo = f_hi = 0.0
    for _ in range(60):
        if f0 > 0:
            lo, f_lo = u0, f0
        else:
            hi, f_hi = u0, f0
        if lo is not None and hi is not None:
            break
        if hi is not None and hi <= u_min:
            return Z_MIN  # even the smallest σ meets it
        if lo is not None and lo >= u_max:
            raise BudgetError(
                f"per-trial epsilon {epsilon:.4g} is unreachable for {config.label}: even "
                f"noise multiplier {Z_MAX:g} gives {config.epsilon(Z_MAX):.4g}"
            )
        step = -f0 / slope if math.isfinite(f0) else -1.0
        step = math.copysign(min(max(abs(step) * 1.02, 2 * width), 2.0), step)
        u1 = min(max(u0 + step, u_min), u_max)
        f1 = f(u1)
        if math.isfinite(f0) and math.isfinite(f1) and f1 != f0:
            slope = min((f1 - f0) / (u1 - u0), -0.05)
        u0, f0 = u1, f1
    assert lo is not None and hi is not None
    # 2. close it: interpolate the root, probe just below and above it
    for _ in range(60):
        if hi - lo <= width:
            break
        root = hi - f_hi * (hi - lo) / (f_hi - f_lo) if math.isfinite(f_hi) else 0.5 * (lo + hi)
        probes = [root - 0.45 * width, root + 0.45 * width]
        if not (lo < probes[0] and probes[1] < hi):
            probes = [0.5 * (lo + hi)]
        for u in probes:
            fu = f(u)
            if fu > 0:
                lo, f_lo = max(lo, u), fu
            else:
                hi, f_hi = min(hi, u), fu
    return math.exp(hi)


#: Budgets solved in this process (a solve is deterministic: the same budget, the same σ's).
_SOLVED: dict[Budget, BudgetSolution] = {}


def solve_budget(budget: Budget) -> BudgetSolution:
    """The per-trial ε and σ's whose total is in [E·(1 − TOLERANCE), E] (module
    docstring); BudgetError (one line) when E cannot be met. Remembered for the
    process."""
    if budget not in _SOLVED:
        _SOLVED[budget] = _solve(budget)
    return _SOLVED[budget]


def _solve(budget: Budget) -> BudgetSolution:
    configs = budget.configurations
    ref = budget.draws[0] if budget.mode == selection.COMPOSE else 0
    hints: dict[int, float] = {}

    def at(z: float) -> tuple[float, float, list[float]]:
        eps_t = configs[ref].epsilon(z)
        zs = []
        for i, c in enumerate(configs):
            zs.append(z if i == ref else sigma_for(eps_t, c, hints.get(i, z)))
        hints.update(enumerate(zs))
        return total_epsilon(budget, zs), eps_t, zs

    target = budget.total
    accept = math.log1p(-TOLERANCE)  # f(u) in [accept, 0]: the total is in [E(1-TOL), E]
    top: tuple[float, float, list[float]] | None = None

    def top_point() -> tuple[float, tuple[float, float, list[float]]]:
        """The most noise every configuration can take (σ = 500 for the one that needs
        most); BudgetError when the total there is still above E."""
        nonlocal top
        floor_t = max(c.epsilon(Z_MAX) for c in configs) * (1 + 10 * SIGMA_TOLERANCE)
        z_top = sigma_for(floor_t, configs[ref], Z_MAX)
        top = at(z_top)
        if top[0] > target:
            raise BudgetError(
                f"--total-epsilon={target:g} is unreachable under {budget.rule()} (delta="
                f"{budget.delta:.3g}): even noise multiplier {Z_MAX:g} gives epsilon with "
                f"tuning {top[0]:.4g}"
            )
        return z_top, top

    def f_of(t: tuple[float, float, list[float]]) -> float:
        return math.log(t[0] / target) if t[0] > 0 else -math.inf

    # 1. a bracket in u = log σ_ref: secant steps (log total falls about 1-2 per unit of
    # log σ) from the σ whose per-trial ε is E itself (the total is at least that)
    u = math.log(sigma_for(target, configs[ref]))
    t = at(math.exp(u))
    slope = -1.5
    lo = hi = None
    for _ in range(80):
        f = f_of(t)
        if f > 0:
            lo = (u, f, t)
        else:
            hi = (u, f, t)
        if hi is not None and accept <= f <= 0:
            return _solution(budget, hi[2])
        if lo is not None and hi is not None:
            break
        if hi is not None and math.exp(u) <= Z_MIN:  # the budget does not bind
            return _solution(budget, hi[2])
        step = -f / slope if math.isfinite(f) else -1.0
        step = math.copysign(min(max(abs(step) * 1.02, 1e-4), 2.0), step)
        nxt = u + step
        if math.exp(nxt) > 50.0 and top is None:
            z_top, _ = top_point()  # refuses an unreachable total
        if top is not None and nxt >= math.log(z_top):
            nxt, t_next = math.log(z_top), top
        else:
            nxt = max(nxt, math.log(Z_MIN))
            t_next = at(math.exp(nxt))
        f_next = f_of(t_next)
        if math.isfinite(f) and math.isfinite(f_next) and nxt != u:
            slope = min((f_next - f) / (nxt - u), -0.05)
        u, t = nxt, t_next
    assert lo is not None and hi is not None
    # 2. regula falsi (Illinois) aiming just inside the budget, until the total is in
    # [E(1 - TOLERANCE), E]
    aim = 0.5 * accept
    side = 0
    for _ in range(80):
        if accept <= hi[1] <= 0 or hi[0] - lo[0] < 1e-12:
            break
        (u_lo, f_lo, _), (u_hi, f_hi, _) = lo, hi
        u = u_hi - (f_hi - aim) * (u_hi - u_lo) / (f_hi - f_lo)
        if not u_lo < u < u_hi:
            u = 0.5 * (u_lo + u_hi)
        t = at(math.exp(u))
        f = f_of(t)
        if f > 0:
            lo = (u, f, t)
            if side == -1:
                hi = (hi[0], 0.5 * (hi[1] + aim), hi[2])
            side = -1
        else:
            hi = (u, f, t)
            if side == 1:
                lo = (lo[0], 0.5 * (lo[1] + aim), lo[2])
            side = 1
    return _solution(budget, hi[2])


def _solution(budget: Budget, found: tuple[float, float, list[float]]) -> BudgetSolution:
    """The solution at a point of the search (its total, per-trial ε and σ's), its total
    recomputed by dp-accounting (:func:`accountant_total`) and checked against the
    budget."""
    _, eps_t, zs = found
    total = accountant_total(budget, zs)
    if total > budget.total:  # pragma: no cover - the fast path is the same arithmetic
        raise BudgetError(
            f"--total-epsilon={budget.total:g}: the accountant gives {total:.6g} for the "
            "solved noise; please report this"
        )
    trial_eps = tuple(c.epsilon(z) for c, z in zip(budget.configurations, zs, strict=True))
    return BudgetSolution(
        budget, float(eps_t), tuple(float(z) for z in zs), trial_eps, float(total), budget.rule()
    )
