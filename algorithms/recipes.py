"""One recipe per method: the pieces it names (docs/algorithms.md §1-§7, §9).

``build_pipeline(name, algo, clip_norm, noise_multiplier, ...)`` returns the
:class:`~algorithms.pipeline.Pipeline` and the resolved hyperparameters (recorded as
columns of ``rounds.parquet``). Defaults are the papers' (docs/algorithms.md §1-§7);
where a published recipe is not private as written, the private form is built and the
``departure`` text says what differs. Summaries, privacy flags and citations come from
:mod:`algorithms.catalog` (the papers' titles, authors, venues and arXiv ids). A method
that is more than pieces declares its recipe in its module (the methods' modules in ``algorithms``),
and :data:`RECIPES` lists it in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from algorithms import dp_bandmf, dp_fedpgn, dp_ftrl, registry
from algorithms.catalog import CATALOG
from algorithms.pipeline import Pipeline


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    paper: str
    private: bool
    hyperparameters: tuple[str, ...]
    shares: str
    departure: str
    spelling: Spelling
    method: str = ""  # "DP-FedAvg (McMahan et al., ICLR 2018)": the README's method column
    hyperparameter_doc: str = ""  # the README's "hyperparameters (default)" cell
    #: Tune ranges beyond (or instead of) those its pieces declare (algorithms.registry)
    own_space: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: values for ``algo`` keys left null where this recipe's default differs from the
    #: piece's (DP-FedSAM-top_k keeps 0.4 at either top-k site)
    defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def participation(self) -> str:
        """The participation it names (the registry's; ``sampled``: the ``sampling:``
        section's Poisson or fixed-size draws)."""
        return self.spelling(registry.defaults()).get("participation") or "sampled"

    @property
    def search_space(self) -> dict[str, dict[str, Any]]:
        """Tune's default range per config key (tuning.spaces adds the common keys): the
        ranges its pieces declare (the spelling of the default ``algo:`` section), then
        :attr:`own_space`."""
        from algorithms.compose import RecipeConfig, pieces

        spelling = RecipeConfig(private=self.private, **self.spelling(registry.defaults()))
        return {**registry.space(pieces(spelling)), **self.own_space}


#: Each built-in recipe is a spelling of :mod:`algorithms.compose`: the pieces it names
#: (the fields of a ``recipe:`` section), as a function of the ``algo`` keys that change
#: its structure. compose.build makes every piece, so a piece has one constructor and
#: one set of defaults whether a built-in recipe or a YAML one uses it.
Spelling = Callable[[Any], dict[str, Any]]


def _fixed(**fields: Any) -> Spelling:
    return lambda a: fields


def _fed_ls(a) -> dict[str, Any]:
    # algo.ls_local: "project" (the paper: w projected onto the ball ||w - x^t|| <= C after
    # every local step) or "clip_once" (no projection; the privatizer's clip of the final
    # update to C is the only bound). Both give ||update|| <= C, so the same accounting.
    return {
        "constraint": "ball" if a.ls_local == "project" else None,
        "server_transforms": ("laplacian_smoothing",),
    }


def _dp_fedsam_topk(a) -> dict[str, Any]:
    if a.topk_site == "client":  # option (a): local top-k before clipping, noise on all d
        return {"step": "sam", "client_transforms": ("topk",)}
    return {"step": "sam", "server_transforms": ("server_topk",)}


def _recipe(
    name: str,
    hyperparameters: tuple[str, ...],
    spelling: Spelling,
    *,
    method: str,
    shares: str,
    hyperparameter_doc: str,
    departure: str,
    own_space: dict[str, dict[str, Any]] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Recipe:
    """A recipe whose summary, privacy flag and citation are the catalog's; the texts
    are its row of the README's algorithms table (:func:`markdown_table`)."""
    entry = CATALOG[name]
    return Recipe(
        name,
        entry.summary,
        entry.citation(),
        entry.private,
        hyperparameters,
        shares,
        departure,
        spelling,
        method=method,
        hyperparameter_doc=hyperparameter_doc,
        own_space=own_space or {},
        defaults=defaults or {},
    )


def _declared(name: str, hyperparameters: tuple[str, ...], spelling: dict, **texts: Any) -> Recipe:
    """A recipe a method module declares (its ``RECIPE``: a fixed spelling and texts)."""
    return _recipe(name, hyperparameters, _fixed(**spelling), **texts)


_SAM_HP = ("rho", "asam")
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        _recipe(
            "fedavg",
            (),
            _fixed(),
            method="FedAvg (McMahan et al., AISTATS 2017)",
            shares="baseline",
            hyperparameter_doc="—",
            departure="divides by the realised cohort size",
        ),
        _recipe(
            "fedsam",
            _SAM_HP,
            _fixed(step="sam"),
            method="FedSAM (Qu et al., ICML 2022)",
            shares="SAM step of `dp_fedsam`",
            hyperparameter_doc="`rho` (0.5), `asam` (true)",
            departure="—",
        ),
        _recipe(
            "dp_fedavg",
            (),
            _fixed(),
            method="DP-FedAvg (McMahan et al., ICLR 2018)",
            shares="privatizer of all private recipes",
            hyperparameter_doc="—",
            departure="—",
        ),
        _recipe(
            "dp_fedavg_blur",
            ("blur_lambda",),
            _fixed(regularizer="blur"),
            method="DP-FedAvg + BLUR (Cheng et al., CVPR 2022)",
            shares="`dp_fedavg` + BLUR",
            hyperparameter_doc="`blur_lambda` (0.4)",
            departure="—",
        ),
        _recipe(
            "dp_fedavg_blur_lus",
            ("blur_lambda", "zero_fraction"),
            _fixed(regularizer="blur", client_transforms=("lus",)),
            method="DP-FedAvg + BLUR + LUS (Cheng et al., CVPR 2022)",
            shares="`dp_fedavg_blur` + LUS",
            hyperparameter_doc="`blur_lambda` (0.4), `zero_fraction` = zeroed fraction c (0.7)",
            departure=(
                "LUS runs before clipping; noise covers all d coordinates (the LUS mask is private)"
            ),
        ),
        _recipe(
            "fedsmp_randk",
            ("keep_fraction", "randk_rescale"),
            _fixed(client_transforms=("randk",), noise_support="public_mask"),
            method="Fed-SMP rand-k (Hu, Gong, Guo 2022)",
            shares="`dp_fedavg` + public rand-k",
            hyperparameter_doc="`keep_fraction` = kept fraction p (0.5), `randk_rescale` (false)",
            departure=(
                "— (the mask is public, drawn per round from the seed; noise only on its k "
                "coordinates)"
            ),
        ),
        _recipe(
            "fedsmp_topk",
            ("keep_fraction",),
            _fixed(client_transforms=("topk",)),
            method="Fed-SMP top-k (Hu, Gong, Guo 2022)",
            shares="`dp_fedavg` + top-k",
            hyperparameter_doc="`keep_fraction` = kept fraction (0.5)",
            departure="top-k support is private: noise covers all d coordinates",
        ),
        _recipe(
            "dp_fed_ls",
            ("sigma_ls", "ls_scope", "ls_local"),
            _fed_ls,
            method="DP-Fed-LS (Liang et al. 2020)",
            shares="Laplacian smoothing with `dp_fedpgn_ls`",
            hyperparameter_doc=(
                "`sigma_ls` (1.0 for `logreg`/`cnn`, 0.01 for other models), `ls_scope` "
                "(`tensor`), `ls_local` (`project`)"
            ),
            departure=(
                "— (local model projected onto the C-ball after every step; smoothing by FFT)"
            ),
            own_space={"algo.sigma_ls": {"type": "loguniform", "low": 0.01, "high": 3.0}},
        ),
        _recipe(
            "dp_fedsam",
            _SAM_HP,
            _fixed(step="sam"),
            method="DP-FedSAM (Shi et al., CVPR 2023)",
            shares="SAM step with `fedsam`, `dp2_fedsam`",
            hyperparameter_doc="`rho` (0.5), `asam` (true; with `asam=false` ρ defaults to 0.05)",
            departure=(
                "whole-update clipping; the reference code clipped per tensor with noise sized "
                "for C, which is not private at the stated σ"
            ),
        ),
        _recipe(
            "dp_fedsam_topk",
            (*_SAM_HP, "keep_fraction", "topk_site"),
            _dp_fedsam_topk,
            defaults={"keep_fraction": 0.4},
            method="DP-FedSAM-top_k (Shi et al. 2023, arXiv:2305.00873)",
            shares="`dp_fedsam` + server top-k",
            hyperparameter_doc=(
                "`rho`, `asam`, `keep_fraction` = kept fraction (0.4), `topk_site` (`server`)"
            ),
            departure=(
                "top-k of the noisy aggregate (post-processing) instead of per-client top-k "
                "after per-client noise, which is private only at each client's own noise level; "
                "`topk_site=client` = top-k before clipping with noise on all d"
            ),
        ),
        _recipe(
            "dp2_fedsam",
            (*_SAM_HP, "head_steps", "body_steps", "personal_layers"),
            _fixed(step="sam", personal=True),
            method="DP²-FedSAM (Zhang, Guo, Gong 2024)",
            shares="SAM step + personal split",
            hyperparameter_doc=(
                "`rho`, `asam`, `head_steps` (one pass), `body_steps` (`local.epochs` passes), "
                "`personal_layers` (1)"
            ),
            departure="— (heads never leave their client; metric `personal_accuracy_nonprivate`)",
        ),
        *(_declared(**r) for r in dp_fedpgn.RECIPES),
        _declared(**dp_ftrl.RECIPE),
        _declared(**dp_bandmf.RECIPE),
    )
}

TABLE_HEADER = (
    "| name | method (paper) | shares pieces with | hyperparameters (default) | private "
    "| departure from the paper, and why |\n| --- | --- | --- | --- | --- | --- |"
)


def markdown_table() -> str:
    """The README's algorithms table, one row per recipe, from this registry
    (``dpfl algorithms --markdown`` prints it; a test checks the README holds it)."""
    rows = [
        f"| `{r.name}` | {r.method} | {r.shares} | {r.hyperparameter_doc} | "
        f"{'yes' if r.private else 'no'} | {r.departure} |"
        for r in RECIPES.values()
    ]
    return "\n".join([TABLE_HEADER, *rows])


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"algorithm={name!r} is not one of {', '.join(RECIPES)}")
    return RECIPES[name]


def build_pipeline(
    name: str,
    algo,
    clip_norm: float,
    noise_multiplier: float,
    model_name: str | None = None,
    recipe: Any = None,
) -> Pipeline:
    """The pipeline of ``name`` with hyperparameters from ``algo`` (None → default).

    A built-in recipe is its spelling (the pieces it names) built by
    :func:`algorithms.compose.build`, exactly as ``algorithm: custom`` with that
    ``recipe:`` section; ``name="custom"`` builds ``recipe`` (algorithms.compose.RecipeConfig).
    ``model_name`` (``model.name``) selects the defaults that depend on the model kind
    (DP-Fed-LS's σ_ls, :func:`algorithms.piece_specs.fed_ls_default_sigma`). Public config only."""
    from algorithms.compose import RecipeConfig
    from algorithms.compose import build as build_composed

    if name == "custom":
        if recipe is None:
            raise ValueError("algorithm=custom needs a recipe: section naming its pieces")
        return build_composed(recipe, algo, clip_norm, noise_multiplier, model_name)
    built_in = get_recipe(name)
    unset = {k: v for k, v in built_in.defaults.items() if getattr(algo, k) is None}
    if unset:
        algo = dataclasses.replace(algo, **unset)
    spelling = RecipeConfig(private=built_in.private, **built_in.spelling(algo))
    return build_composed(spelling, algo, clip_norm, noise_multiplier, model_name)


def recipe_config(name: str, recipe: Any = None) -> Any:
    """The :class:`~algorithms.compose.RecipeConfig` of ``name`` (``custom``: ``recipe``)
    with the default ``algo:`` section: which pieces, participation, noise scheme and
    server step it names (the privacy plan reads the last two before any pipeline)."""
    from algorithms.compose import RecipeConfig

    if name == "custom":
        return recipe if recipe is not None else RecipeConfig()
    built_in = get_recipe(name)
    return RecipeConfig(private=built_in.private, **built_in.spelling(registry.defaults()))


def resolved_hyperparameters(pipeline: Pipeline) -> dict[str, Any]:
    """Hyperparameters actually used, keyed by the last part of their config key: what
    each piece reports (algorithms.registry), in engine order: the client's pieces, the
    server transforms, the personal split, the server step and the noise scheme."""
    out: dict[str, Any] = {}
    for piece in (pipeline.step, pipeline.regularizer, pipeline.constraint):
        out.update(registry.report(piece, pipeline))
    for t in (*pipeline.client_transforms, *pipeline.server_transforms):
        out.update(registry.report(t, pipeline))
    out.update(registry.report(pipeline.personal, pipeline))
    out.update(registry.report(pipeline.server_step, pipeline))
    if pipeline.privatizer is not None:
        out.update(registry.report(pipeline.privatizer.noise, pipeline))
    return out
