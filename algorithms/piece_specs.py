"""The built-in pieces' declarations (:class:`~algorithms.registry.PieceSpec`) and the
``algo.*`` keys they read; :mod:`algorithms.registry` lists them, one line per piece
(a method's own pieces are declared in its module, the methods' modules in ``algorithms``).

Torch-free: a builder imports :mod:`algorithms.pipeline` only when it runs. The defaults a
builder picks for a null key are the papers' (docs/algorithms.md §1-§7).
"""

from __future__ import annotations

from typing import Any

from algorithms.spec import BuildContext, Key, PieceSpec

PIPELINE = "algorithms.pipeline"


def _at_least(low: float) -> Any:
    return lambda v: v >= low


def _one_of(*values: str) -> Any:
    return lambda v: v in values


# ------------------------------------------------------------------ the algo.* keys

RHO = Key(
    "rho",
    float | None,
    None,
    "SAM radius (null: the recipe's default)",
    _at_least(0),
    "must be >= 0",
)
ASAM = Key("asam", bool | None, None, "adaptive SAM (null: the recipe's default)")
SIGMA_LS = Key(
    "sigma_ls",
    float | None,
    None,
    "Laplacian smoothing strength (null: recipe default; dp_fed_ls: "
    "1.0 for logreg/cnn, 0.01 for other models)",
    _at_least(0),
    "must be >= 0",
)
LS_SCOPE = Key(
    "ls_scope",
    str,
    "tensor",
    "Laplacian smoothing per tensor, over the whole model, or weights "
    "(each weight tensor of >= 2 dims; biases unsmoothed)",
    _one_of("tensor", "model", "weights"),
    "must be tensor, model or weights",
)
LS_LOCAL = Key(
    "ls_local",
    str,
    "project",
    "DP-Fed-LS local bounding: project (ball after every step, the paper) "
    "or clip_once (clip the final update only)",
    _one_of("project", "clip_once"),
    "must be project (per-step ball projection) or clip_once",
)
KEEP_FRACTION = Key(
    "keep_fraction",
    float | None,
    None,
    "kept fraction p of top-k, rand-k and server top-k",
    lambda v: 0 < v <= 1,
    "(kept fraction) must be in (0, 1]",
)
ZERO_FRACTION = Key(
    "zero_fraction",
    float | None,
    None,
    "zeroed fraction c of LUS",
    lambda v: 0 <= v < 1,
    "(zeroed fraction) must be in [0, 1)",
)
TOPK_SITE = Key(
    "topk_site",
    str,
    "server",
    "top-k of the noisy aggregate (server) or before clipping (client)",
    _one_of("server", "client"),
    "must be server (top-k of the noisy aggregate) or client (before clipping)",
)
RANDK_RESCALE = Key("randk_rescale", bool, False, "rand-k: scale kept coordinates by d/k")
BLUR_LAMBDA = Key(
    "blur_lambda",
    float | None,
    None,
    "BLUR weight lambda (null: recipe default)",
    _at_least(0),
    "must be >= 0",
)
HEAD_STEPS = Key(
    "head_steps",
    int | None,
    None,
    "DP2-FedSAM: local steps on the personal head",
    _at_least(1),
    "must be >= 1",
)
BODY_STEPS = Key(
    "body_steps",
    int | None,
    None,
    "DP2-FedSAM: local steps on the shared body",
    _at_least(1),
    "must be >= 1",
)
PERSONAL_LAYERS = Key(
    "personal_layers",
    int,
    1,
    "DP2-FedSAM: number of last Linear layers kept personal",
    _at_least(1),
    "must be >= 1",
)
NOISE_SITE = Key(
    "noise_site",
    str,
    "server",
    "add noise at the server, or at clients (fixed-size sampling only)",
    _one_of("server", "client"),
    "must be server or client",
)
CLIENT_STATE = Key(
    "client_state",
    str,
    "memory",
    "per-client state in memory or on disk under out/client_state/",
    _one_of("memory", "disk"),
    "must be memory or disk",
)

#: Every built-in key, in the ``algo:`` section's order (``dpfl config``, config.json);
#: the registry lists them first, so a new piece's keys follow them.
ALGO_KEYS = (
    RHO,
    ASAM,
    SIGMA_LS,
    LS_SCOPE,
    LS_LOCAL,
    KEEP_FRACTION,
    ZERO_FRACTION,
    TOPK_SITE,
    RANDK_RESCALE,
    BLUR_LAMBDA,
    HEAD_STEPS,
    BODY_STEPS,
    PERSONAL_LAYERS,
    NOISE_SITE,
    CLIENT_STATE,
)


#: DP-Fed-LS's σ_ls when ``algo.sigma_ls`` is null, by ``model.name``. The paper smooths
#: logistic-regression and CNN weights, whose storage order runs over image pixels, so
#: that neighbouring coordinates are related, with σ_ls = 1. It gives no value for other
#: models; an MLP on tabular features (the default synthetic data) has coordinates in no
#: meaningful order, and σ_ls = 1 there removes as much signal as noise. For every model
#: the paper does not cover dpfl uses FED_LS_SIGMA_OTHER, measured on the default data
#: (docs/algorithms.md §4, "σ_ls by model kind").
FED_LS_SIGMA_BY_MODEL: dict[str, float] = {"logreg": 1.0, "cnn": 1.0}
FED_LS_SIGMA_OTHER = 0.01


def fed_ls_default_sigma(model_name: str | None) -> float:
    """DP-Fed-LS's default σ_ls for ``model_name`` (None: the paper's 1.0)."""
    if model_name is None:
        return 1.0
    return FED_LS_SIGMA_BY_MODEL.get(model_name, FED_LS_SIGMA_OTHER)


def pick(value: Any, default: Any) -> Any:
    return default if value is None else value


# ----------------------------------------------------------------- Tune's ranges

_FRACTION = {"type": "uniform", "low": 0.1, "high": 1.0}


# ------------------------------------------------------------------ the pieces


def _sam(cls: type, a: Any, ctx: BuildContext) -> Any:
    asam = True if a.asam is None else a.asam
    return cls(rho=a.rho if a.rho is not None else (0.5 if asam else 0.05), asam=asam)


def _smoothing(cls: type, a: Any, ctx: BuildContext) -> Any:
    default = 0.01 if ctx.recipe.step == "pgn" else fed_ls_default_sigma(ctx.model_name)
    return cls(pick(a.sigma_ls, default), a.ls_scope)


def _keep(obj: Any, pipeline: Any) -> dict[str, Any]:
    return {"keep_fraction": obj.fraction}


SGD = PieceSpec("sgd", "step", f"{PIPELINE}:SGDStep", lambda cls, a, ctx: cls())
SAM = PieceSpec(
    "sam",
    "step",
    f"{PIPELINE}:SAMStep",
    _sam,
    keys=(RHO, ASAM),
    space={"algo.rho": {"type": "uniform", "low": 0.01, "high": 1.0}},
    report=lambda s, p: {"rho": s.rho, "asam": s.asam},
)
BLUR = PieceSpec(
    "blur",
    "regularizer",
    f"{PIPELINE}:BLUR",
    lambda cls, a, ctx: cls(pick(a.blur_lambda, 0.4), ctx.clip_norm),
    keys=(BLUR_LAMBDA,),
    space={"algo.blur_lambda": {"type": "choice", "values": [0.05, 0.1, 0.2, 0.4, 0.8]}},
    report=lambda r, p: {"blur_lambda": r.lam},
)
BALL = PieceSpec("ball", "constraint", f"{PIPELINE}:BallProjection", lambda c, a, x: c(x.clip_norm))
TOPK = PieceSpec(
    "topk",
    "client_transform",
    f"{PIPELINE}:TopK",
    lambda cls, a, ctx: cls(pick(a.keep_fraction, 0.5)),
    keys=(KEEP_FRACTION,),
    space={"algo.keep_fraction": _FRACTION},
    report=_keep,
)
RANDK = PieceSpec(
    "randk",
    "client_transform",
    f"{PIPELINE}:RandK",
    lambda cls, a, ctx: cls(pick(a.keep_fraction, 0.5), rescale=a.randk_rescale),
    keys=(KEEP_FRACTION, RANDK_RESCALE),
    space={"algo.keep_fraction": _FRACTION},
    report=lambda t, p: {"keep_fraction": t.fraction, "randk_rescale": t.rescale},
)
LUS = PieceSpec(
    "lus",
    "client_transform",
    f"{PIPELINE}:LUS",
    lambda cls, a, ctx: cls(pick(a.zero_fraction, 0.7)),
    keys=(ZERO_FRACTION,),
    space={"algo.zero_fraction": {"type": "choice", "values": [0.1, 0.3, 0.5, 0.7, 0.9]}},
    report=lambda t, p: {"zero_fraction": t.zero_fraction},
)
LAPLACIAN_SMOOTHING = PieceSpec(
    "laplacian_smoothing",
    "server_transform",
    f"{PIPELINE}:LaplacianSmoothing",
    _smoothing,
    keys=(SIGMA_LS, LS_SCOPE),
    space={"algo.sigma_ls": {"type": "loguniform", "low": 0.001, "high": 3.0}},
    report=lambda t, p: {
        "sigma_ls": t.sigma_ls,
        "ls_scope": t.scope,
        "ls_local": "project" if p.constraint is not None else "clip_once",
    },
)
SERVER_TOPK = PieceSpec(
    "server_topk",
    "server_transform",
    f"{PIPELINE}:ServerTopK",
    lambda cls, a, ctx: cls(pick(a.keep_fraction, 0.4)),
    keys=(KEEP_FRACTION,),
    space={"algo.keep_fraction": _FRACTION},
    report=_keep,
)
PERSONAL = PieceSpec(
    "personal",
    "personal",
    f"{PIPELINE}:PersonalSplit",
    lambda cls, a, ctx: cls(a.personal_layers, a.head_steps, a.body_steps),
    keys=(HEAD_STEPS, BODY_STEPS, PERSONAL_LAYERS),
    report=lambda s, p: {
        "personal_layers": s.layers,
        "head_steps": s.head_steps,
        "body_steps": s.body_steps,
    },
)


# ------------------------------------------- a round's extension points (built-ins)

SERVER_STEP = "algorithms.server_step"


def _sampled(cls: type, a: Any, ctx: BuildContext) -> Any:
    """The ``sampling:`` section's participation: Poisson (``max_cohort``: truncated)
    or fixed-size without replacement."""
    from engine.privacy.sampling import FixedSampling, PoissonSampling

    s, n = ctx.sampling, ctx.num_clients
    if s.mode == "fixed":
        return FixedSampling(n, s.cohort_size)
    return PoissonSampling(n, s.rate, s.max_cohort)


FEDAVG = PieceSpec("fedavg", "server_step", f"{SERVER_STEP}:FedAvgStep", lambda c, a, x: c())
GAUSSIAN = PieceSpec("gaussian", "noise", "engine.privacy.noise:GaussianNoise", lambda c, a, x: c())
SAMPLED = PieceSpec("sampled", "participation", "engine.privacy.sampling:PoissonSampling", _sampled)
