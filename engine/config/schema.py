"""The root of the config tree, :class:`RunConfig`, and its checks across sections.

The tree mirrors the config keys of the configuration reference
(docs/reference/config.md, generated from this tree). Cross-section checks that need the
whole tree (cohort vs. clients, exactly one of ε / σ, which sampling each accountant
handles) live in :meth:`RunConfig.__post_init__`. Checks that need the data (files
present) or the accountant (ε reachable) run in :func:`engine.simulation.prepare` before
any work starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from algorithms.catalog import CATALOG
from algorithms.compose import RecipeConfig
from engine.base.errors import check as _check
from engine.config.algo import algo_config_class
from engine.config.sections import (
    HELD_OUT_FRACTION,
    DatasetConfig,
    EvalConfig,
    LocalConfig,
    ModelConfig,
    PrivacyConfig,
    RayConfig,
    SamplingConfig,
    ServerConfig,
    default_normalize,
)

#: The built-in recipes, from the registry's torch-free catalog (algorithms.catalog).
ALGORITHMS = tuple(CATALOG)
NON_PRIVATE = tuple(name for name, entry in CATALOG.items() if not entry.private)
#: ``algorithm: custom`` runs the pieces named in the ``recipe:`` section (algorithms.compose).
CUSTOM = "custom"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    algorithm: str = "dp_fedavg"
    seed: int = 0
    rounds: int = 60
    out: str | None = None
    #: import paths of per-round callbacks (engine.simulation.round_end.load_callbacks)
    callbacks: tuple[str, ...] = ()
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    algo: Any = field(default_factory=lambda: algo_config_class()())  # engine.config.algo
    server: ServerConfig = field(default_factory=ServerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)

    def __post_init__(self) -> None:
        _check(
            self.algorithm in (*ALGORITHMS, CUSTOM),
            "algorithm",
            self.algorithm,
            f"must be one of {ALGORITHMS} or {CUSTOM!r} (with a recipe: section)",
        )
        if self.dataset.client_test_fraction is None:  # resolved here, so config.json has it
            resolved = dataclasses.replace(
                self.dataset, client_test_fraction=self.default_client_test_fraction()
            )
            object.__setattr__(self, "dataset", resolved)
        if self.dataset.normalize is None and default_normalize(self.dataset.name) is not None:
            # the source's own preprocessing, resolved here so that config.json says it
            resolved = dataclasses.replace(
                self.dataset, normalize=default_normalize(self.dataset.name)
            )
            object.__setattr__(self, "dataset", resolved)
        if self.algorithm != CUSTOM and self.recipe != RecipeConfig():
            changed = [
                f.name
                for f in dataclasses.fields(RecipeConfig)
                if getattr(self.recipe, f.name) != f.default
            ]
            _check(
                False,
                f"recipe.{changed[0]}",
                getattr(self.recipe, changed[0]),
                f"a recipe: section is read only with algorithm={CUSTOM} "
                f"(algorithm={self.algorithm} is a built-in recipe)",
            )
        _check(self.rounds >= 1, "rounds", self.rounds, "must be >= 1")
        _check(self.seed >= 0, "seed", self.seed, "must be >= 0")
        n = self.dataset.num_clients
        s = self.sampling
        if s.mode == "fixed" and s.cohort_size is not None:
            _check(
                s.cohort_size <= n,
                "sampling.cohort_size",
                s.cohort_size,
                f"exceeds dataset.num_clients={n}",
            )
        if s.max_cohort is not None:
            _check(
                s.max_cohort <= n,
                "sampling.max_cohort",
                s.max_cohort,
                f"exceeds dataset.num_clients={n}",
            )
        if self.is_private:
            p = self.privacy
            _check(
                math.isfinite(p.clip_norm) or p.noise_multiplier == 0,
                "privacy.clip_norm",
                p.clip_norm,
                "no clipping bounds no sensitivity, so the noise z·C would be infinite; give "
                "a finite clip norm (infinity only with privacy.noise_multiplier=0)",
            )
            given = (p.epsilon is not None) + (p.noise_multiplier is not None)
            _check(
                given == 1,
                "privacy.epsilon",
                p.epsilon,
                "give exactly one of privacy.epsilon and privacy.noise_multiplier "
                f"(noise_multiplier={p.noise_multiplier!r})",
            )
            if self.algo.noise_site == "client":
                _check(
                    s.mode == "fixed",
                    "algo.noise_site",
                    self.algo.noise_site,
                    "client-side noise is exact only for sampling.mode=fixed (known m)",
                )
            if s.max_cohort is not None:
                _check(
                    p.accountant != "rdp",
                    "privacy.accountant",
                    p.accountant,
                    "sampling.max_cohort (truncated Poisson) is accounted by PLD only",
                )
            if s.mode == "fixed":
                _check(
                    p.accountant != "pld",
                    "privacy.accountant",
                    p.accountant,
                    "fixed-size sampling is accounted by RDP only (replace-one)",
                )

    def default_client_test_fraction(self) -> float:
        """``dataset.client_test_fraction`` when it is null: 0 for a recipe that trains
        one global model (clients train on all their data, as in the papers), and
        :data:`HELD_OUT_FRACTION` when a metric needs each client's held-out split (a
        personalised recipe's ``personal_accuracy_nonprivate``, or
        ``eval.membership_inference``'s non-members)."""
        if self.algorithm == CUSTOM:
            personal = self.recipe.personal
        else:
            personal = CATALOG[self.algorithm].personal
        return HELD_OUT_FRACTION if personal or self.eval.membership_inference else 0.0

    @property
    def is_private(self) -> bool:
        if self.algorithm == CUSTOM:
            return self.recipe.private
        return self.algorithm not in NON_PRIVATE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)
