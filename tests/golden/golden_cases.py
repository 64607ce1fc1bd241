"""The golden cases: small runs whose exact outputs ``golden.json`` freezes.

Shared by ``generate.py`` (writes ``golden.json``) and ``test_golden.py`` (reruns every
case with the current code and asserts equality). Uses only
``engine.config.load_config`` and ``engine.simulation.simulate`` with its keyword
arguments (``write``, ``resume``, ``on_checkpoint``, ``on_round``), the entry points the
existing tests use, so code can move inside the packages with few changes here.

Each case is a list of ``--set`` overrides in two parts:

* ``pins``: every key whose default shapes a run's mathematics, written out with its
  default *as of commit 1f4e86f* (``engine/config/`` then; δ = min(N^-1.1, 0.01/N) and
  the accountant as resolved for the case; each recipe's ``algo.*`` defaults as
  ``resolved_hyperparameters`` gave them). A later change of a default (issue 28:
  ``dataset.client_test_fraction``, ``dataset.normalize``, δ, initialisation) therefore
  leaves the golden values valid; only a change of behaviour fails the test.
  ``generate.py --check-pins`` proves at generation time that every pinned run equals the
  same run without its pins, bit for bit.
* ``settings``: what makes the case small and what it is about (applied after the pins).

What a record holds (:func:`record`): the SHA-256 of the final global model's parameters
(``SimulationResult.weights`` flattened, as little-endian float64 bytes, which is exact
for float32 weights), its length, the final ε, the per-round ε column, every column of
the run's rows (floats as ``repr``, which round-trips exactly; NaN as ``"nan"``) with its
pandas dtype, and the run's privacy summary. Excluded, being nondeterministic by nature:
the columns in :data:`EXCLUDED_COLUMNS` (wall-clock time).
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Columns whose values are wall-clock measurements, never equal between two runs.
EXCLUDED_COLUMNS = ("wall_time_s_nonprivate",)

#: The sizes of most cases and how they are executed (applied after the pins).
SIZES = [
    "seed=0",
    "rounds=4",
    "dataset.num_clients=30",
    "dataset.synthetic_mean_samples=16",
    "dataset.synthetic_dim=10",
    "sampling.rate=0.3",
    "eval.every=2",  # rounds 1 and 3 carry NaN accuracy, rounds 2 and 4 an evaluation
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.clip_norm=0.5",
    # execution: in-process, clients one by one, on the CPU (settings, not defaults:
    # the default executor is Ray, and the group size and device change float rounding)
    "ray.executor=local",
    "ray.clients_per_worker_batch=1",
    "ray.worker_device=cpu",
]

#: δ = default_delta(30) at 1f4e86f: min(30^-1.1, 0.01/30).
DELTA_30 = "0.0003333333333333333"

#: δ = default_delta(20) at 1f4e86f: min(20^-1.1, 0.01/20).
DELTA_20 = "0.0005"

#: Today's defaults (commit 1f4e86f) of every key that shapes the computation.
COMMON_PINS = [
    "dataset.name=synthetic",
    "dataset.partition=iid",
    "dataset.alpha=0.5",
    "dataset.client_test_fraction=0.2",
    "dataset.synthetic_model=shared",
    "dataset.synthetic_alpha=1.0",
    "dataset.synthetic_beta=1.0",
    "dataset.synthetic_classes=10",
    "dataset.public_eval_clients=3",  # null: ceil(N/10) at 1f4e86f
    "dataset.materialize=true",
    "dataset.normalize=null",
    "model.name=mlp",
    "model.memory_format=contiguous",  # auto: contiguous for a model without conv
    "model.init=default",
    "sampling.mode=poisson",
    "sampling.cohort_size=null",
    "sampling.max_cohort=null",
    "eval.membership_inference=false",
    "eval.audit_canaries=0",
    "eval.audit_every_round=false",
    "local.steps=null",
    "local.lr=0.3",
    "local.lr_decay=1.0",
    "local.momentum=0.0",
    "local.weight_decay=0.0",
    "server.lr=1.0",
    "algo.noise_site=server",
    "algo.client_state=memory",
    # two workers of one torch thread each (the worker count changes float rounding)
    "ray.num_workers=2",
    "ray.num_cpus_per_worker=1.0",
    "ray.num_gpus_per_worker=0.0",
    "ray.gpu_packing=fixed",
]

#: A private recipe runs at z = 1 (a setting: by default σ is calibrated to ε = 4).
PRIVATE_SETTINGS = ["privacy.epsilon=null", "privacy.noise_multiplier=1.0"]

#: Privacy keys of a private recipe (today's defaults).
PRIVATE_PINS = [
    f"privacy.delta={DELTA_30}",
    "privacy.accountant=rdp",
    "privacy.secure_noise=false",
    "privacy.clip_mode=fixed",
    "privacy.target_quantile=0.5",
    "privacy.clip_lr=0.2",
    "privacy.clip_count_stddev=null",
]

#: Each recipe's ``algo.*`` hyperparameters as resolved at 1f4e86f for model.name=mlp.
SAM = ["algo.rho=0.5", "algo.asam=true"]
RECIPE_PINS: dict[str, list[str]] = {
    "fedavg": [],
    "fedsam": SAM,
    "dp_fedavg": [],
    "dp_fedavg_blur": ["algo.blur_lambda=0.4"],
    "dp_fedavg_blur_lus": ["algo.blur_lambda=0.4", "algo.zero_fraction=0.7"],
    "fedsmp_randk": ["algo.keep_fraction=0.5", "algo.randk_rescale=false"],
    "fedsmp_topk": ["algo.keep_fraction=0.5"],
    "dp_fed_ls": ["algo.sigma_ls=0.01", "algo.ls_scope=tensor", "algo.ls_local=project"],
    "dp_fedsam": SAM,
    "dp_fedsam_topk": [*SAM, "algo.keep_fraction=0.4", "algo.topk_site=server"],
    "dp2_fedsam": [*SAM, "algo.head_steps=null", "algo.body_steps=null", "algo.personal_layers=1"],
    "dp_fedpgn": ["algo.beta=0.3", "algo.rho=0.2"],
    "dp_fedpgn_ls": ["algo.beta=0.3", "algo.rho=0.2", "algo.sigma_ls=0.01", "algo.ls_scope=tensor"],
}
NON_PRIVATE = ("fedavg", "fedsam")


@dataclass(frozen=True)
class Case:
    """One golden run. ``kind``: ``plain`` (one :func:`engine.simulation`), ``resume``
    (interrupted after ``interrupt_after`` rounds, resumed from the checkpoint the run
    handed to ``on_checkpoint``; also run uninterrupted, which must give the same
    record) or ``ray`` (``ray.executor=ray``; needs a running Ray)."""

    name: str
    algorithm: str
    pins: tuple[str, ...]
    settings: tuple[str, ...]
    kind: str = "plain"
    interrupt_after: int = 0
    marks: tuple[str, ...] = ()

    @property
    def overrides(self) -> list[str]:
        return [f"algorithm={self.algorithm}", *self.pins, *self.settings]


def _pins(algorithm: str, *, replace: dict[str, str] | None = None) -> tuple[str, ...]:
    pins = [*COMMON_PINS, *RECIPE_PINS[algorithm]]
    if algorithm not in NON_PRIVATE:
        pins += PRIVATE_PINS
    for key, value in (replace or {}).items():
        pins = [p for p in pins if p.split("=", 1)[0] != key] + [f"{key}={value}"]
    return tuple(pins)


def _key(override: str) -> str:
    return override.split("=", 1)[0]


def _case(name: str, algorithm: str, *settings: str, **kw: Any) -> Case:
    """A case: the sizes and ``settings``, over the pins of every other key. ``replace``
    maps a pinned key to *its default at 1f4e86f* for this case (a resolved default
    such as δ for another N); what the case changes on purpose goes in ``settings``."""
    replace = kw.pop("replace", None)
    merged: dict[str, str] = {}  # a later setting replaces an earlier one of its key
    private = PRIVATE_SETTINGS if algorithm not in NON_PRIVATE else []
    for item in (*SIZES, *private, *settings):
        merged.pop(_key(item), None)
        merged[_key(item)] = item
    pins = tuple(p for p in _pins(algorithm, replace=replace) if _key(p) not in merged)
    return Case(name, algorithm, pins, tuple(merged.values()), **kw)


#: Every recipe of ``algorithms/recipes.py`` (the 13 of ``dpfl algorithms``), then the
#: features the refactor must keep: calibration from ε, adaptive clipping, the canary
#: audit, fixed and truncated sampling, vectorised groups, a resumed run, image data
#: (digits: normalisation, cnn, zero init), client-side noise, momentum, and Ray.
CASES: list[Case] = [
    *(_case(f"recipe_{name}", name) for name in RECIPE_PINS),
    _case(
        "dp_fedavg_epsilon_target",
        "dp_fedavg",
        "privacy.epsilon=6.0",
        "privacy.noise_multiplier=null",
    ),
    _case(
        "adaptive_clipping",
        "dp_fedavg",
        "privacy.clip_mode=adaptive",
        "privacy.target_quantile=0.7",
        "privacy.clip_lr=0.3",
        "privacy.noise_multiplier=0.8",  # z < 2·σ_b = 0.9, as adaptive clipping needs
        # default (null) at 1f4e86f: expected cohort size / 20 = 0.3 * 30 / 20
        replace={"privacy.clip_count_stddev": "0.45"},
    ),
    _case("audit_canaries_final_model", "dp_fedavg", "eval.audit_canaries=8"),
    _case(
        "audit_canaries_every_round",
        "fedsmp_randk",
        "eval.audit_canaries=8",
        "eval.audit_every_round=true",
    ),
    _case(
        "fixed_sampling",
        "dp_fedavg",
        "sampling.mode=fixed",
        "sampling.cohort_size=8",
    ),
    _case(
        "fixed_sampling_client_noise",
        "dp_fedsam",
        "sampling.mode=fixed",
        "sampling.cohort_size=8",
        "algo.noise_site=client",
    ),
    _case(
        "truncated_poisson",
        "dp_fedavg",
        "sampling.max_cohort=3",  # below the expected cohort q·N = 9: truncation binds
        # the one-round PLD of truncated Poisson costs seconds, less at a larger z
        "privacy.noise_multiplier=3.0",
        replace={"privacy.accountant": "pld"},  # the accountant it resolves to
    ),
    _case(
        "vectorized_groups_dp_fedsam",
        "dp_fedsam",
        "ray.clients_per_worker_batch=3",
        "local.momentum=0.5",
    ),
    _case(
        "vectorized_groups_dp_fed_ls",
        "dp_fed_ls",
        "ray.clients_per_worker_batch=3",
    ),
    _case(
        "digits_cnn_dp_fedavg",
        "dp_fedavg",
        "dataset.name=digits",
        "dataset.num_clients=20",
        "model.name=cnn",
        "local.lr=0.05",
        replace={
            "dataset.normalize": "standardize",  # null = the source's recipe at 1f4e86f
            "dataset.public_eval_clients": "null",  # digits: a fixed held-out split
            "model.memory_format": "channels_last",  # auto: conv model on the CPU
            "privacy.delta": DELTA_20,
        },
    ),
    _case(
        "digits_logreg_dp_fed_ls_zero_init",
        "dp_fed_ls",
        "dataset.name=digits",
        "dataset.num_clients=20",
        "dataset.partition=dirichlet",
        "model.name=logreg",
        "model.init=zeros",
        replace={
            "dataset.normalize": "standardize",
            "dataset.public_eval_clients": "null",
            "privacy.delta": DELTA_20,
            "algo.sigma_ls": "1.0",  # DP-Fed-LS's default for logreg/cnn at 1f4e86f
        },
    ),
    _case(
        "resume_dp2_fedsam",
        "dp2_fedsam",
        "rounds=5",
        kind="resume",
        interrupt_after=2,
    ),
    _case(
        "resume_adaptive_clipping",
        "dp_fedavg",
        "privacy.clip_mode=adaptive",
        "privacy.noise_multiplier=0.8",
        "rounds=5",
        replace={"privacy.clip_count_stddev": "0.45"},
        kind="resume",
        interrupt_after=3,
    ),
    _case(
        "ray_two_workers_dp_fedavg",
        "dp_fedavg",
        "ray.executor=ray",
        "ray.server=driver",
        kind="ray",
        marks=("ray",),
    ),
]


# ----------------------------------------------------------------------------- encoding


def _value(v: Any) -> Any:
    """A row value as JSON, exactly: floats as ``repr`` (round-trips), NaN ``"nan"``."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    if v is None:
        return None
    if isinstance(v, str):
        return v
    return f"<{type(v).__name__}> {v!r}"


def params_sha256(weights: Any) -> str:
    """SHA-256 of the flat parameters as little-endian float64 bytes (exact for float32)."""
    flat = np.ascontiguousarray(np.asarray(weights).reshape(-1), dtype="<f8")
    return hashlib.sha256(flat.tobytes()).hexdigest()


def record(result: Any) -> dict[str, Any]:
    """The golden record of one :class:`engine.simulation.SimulationResult`; its
    ``weights`` (float32, flat) are not written to ``golden.json`` but to
    ``golden_weights.npz`` (:func:`split_weights`)."""
    frame = result.rounds
    columns = {
        str(c): {"dtype": str(frame[c].dtype), "values": [_value(v) for v in frame[c].tolist()]}
        for c in frame.columns
        if c not in EXCLUDED_COLUMNS
    }
    weights = np.asarray(result.weights)
    return {
        "params_sha256": params_sha256(weights),
        "num_params": int(weights.size),
        "final_epsilon": _value(result.final_epsilon),
        "epsilon": [_value(v) for v in frame["epsilon"].tolist()],
        "privacy": {str(k): _value(v) for k, v in sorted(result.privacy.items())},
        "columns": columns,
        "weights": np.ascontiguousarray(weights.reshape(-1), dtype=np.float32),
    }


def split_weights(rec: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
    """(the record without its weights, the weights)."""
    rest = {k: v for k, v in rec.items() if k != "weights"}
    return rest, rec["weights"]


# ------------------------------------------------------------------------------ running


class _Interrupt(Exception):
    """Raised from ``on_round`` to stop a run after a given round (the driver's death)."""


def _simulate(overrides: list[str], **kwargs: Any) -> Any:
    from engine.config import load_config
    from engine.simulation import simulate

    return simulate(load_config(overrides=overrides), **kwargs)


def run_case(case: Case, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run ``case`` (with ``overrides``, default the case's own) and return its record.

    A ``resume`` case returns the record of the resumed run, after checking that the
    uninterrupted run has the same record (AssertionError naming the difference)."""
    overrides = list(case.overrides if overrides is None else overrides)
    if case.kind != "resume":
        return record(_simulate(overrides, write=False))
    with tempfile.TemporaryDirectory(prefix="dpfl-golden-") as tmp:
        whole = record(_simulate([*overrides, f"out={Path(tmp) / 'whole'}"]))
        out = [*overrides, f"out={Path(tmp) / 'resumed'}"]
        saved: dict[str, Any] = {}

        def keep(state: dict, row: dict) -> None:
            saved["state"] = state

        def stop(row: dict, executor: Any) -> None:
            if int(row["round"]) == case.interrupt_after:
                raise _Interrupt

        try:
            _simulate(out, on_checkpoint=keep, on_round=stop)
        except _Interrupt:
            pass
        else:  # pragma: no cover - the run must stop where told
            raise AssertionError(f"{case.name}: the run was not interrupted")
        state = saved["state"]
        assert int(state["row"]["round"]) == case.interrupt_after, state["row"]["round"]
        resumed = record(_simulate(out, resume=state))
    diff = first_difference(whole, resumed)
    assert diff is None, f"{case.name}: resumed run differs from the uninterrupted one: {diff}"
    return resumed


def first_difference(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """A one-line description of the first difference between two records, or None."""
    for key in ("params_sha256", "num_params", "final_epsilon", "epsilon", "privacy"):
        if expected.get(key) != actual.get(key):
            return f"{key}: expected {expected.get(key)!r}, got {actual.get(key)!r}"
    exp_cols, act_cols = expected["columns"], actual["columns"]
    missing = [c for c in exp_cols if c not in act_cols]
    if missing:
        return f"columns missing: {missing}"
    extra = [c for c in act_cols if c not in exp_cols]
    if extra:
        return (
            f"new columns {extra}: regenerate golden.json on purpose, or add a column that is "
            "nondeterministic by nature (wall time) to EXCLUDED_COLUMNS"
        )
    for c, exp in exp_cols.items():
        act = act_cols[c]
        if exp["dtype"] != act["dtype"]:
            return f"column {c!r}: dtype expected {exp['dtype']}, got {act['dtype']}"
        if exp["values"] != act["values"]:
            rows = [
                i
                for i, (a, b) in enumerate(zip(exp["values"], act["values"], strict=False))
                if a != b
            ]
            if len(exp["values"]) != len(act["values"]):
                return f"column {c!r}: {len(exp['values'])} rows expected, got {len(act['values'])}"
            i = rows[0]
            return f"column {c!r} row {i}: expected {exp['values'][i]!r}, got {act['values'][i]!r}"
    return None


# ------------------------------------------------------------------ comparing to tolerance

#: Float columns computed by float32 model arithmetic (training, evaluation, update
#: norms), or decided by it (the clip counts that move C_t under adaptive clipping, the
#: canary audit's statistics): their values round differently on another CPU, whose
#: float kernels (oneDNN/MKL/ATen paths chosen by vendor and ISA) sum in another order.
#: Compared to :data:`RTOL_COLUMNS`. Every other column is exact: ε, δ, σ, the sampling,
#: the accountant and the configuration values come from the accountant's float64
#: arithmetic on public inputs, never from the model, so they are the same everywhere.
TOLERANT_COLUMNS = (
    "test_accuracy",
    "test_loss",
    "train_loss_nonprivate",
    "mean_update_norm_nonprivate",
    "max_clipped_norm_nonprivate",
    "clipped_fraction_nonprivate",
    "personal_accuracy_nonprivate",
    "audit_epsilon_estimate_nonprivate",
    "audit_epsilon_lower_nonprivate",
    "audit_canaries_participated_nonprivate",
    "clip_norm",  # C_t under adaptive clipping: moved by released counts of clipped clients
    "unclipped_fraction_released",  # that released count
    "mia_auc_nonprivate",
)

#: Relative tolerance of every other float: ε (final, per round, planned), δ, σ, the
#: sampling rate and the configuration values. They come from float64 arithmetic on
#: public inputs, never from the model, and agree to 15 digits across CPUs except where
#: the accountant's own float64 kernels round differently: the PLD accountant's FFT
#: convolutions gave a planned ε of 0.8176096079708979 on the machine that froze
#: ``golden.json`` and 0.8176096079671445 (4.6e-12 apart, relative) on another x86-64
#: CPU, same code and libraries. 1e-9 is exact for an accountant's ε (dp-accounting's
#: own calibration works to ~1e-6) while still failing any change of σ, q, T, δ or
#: event, each of which moves ε in the third digit or earlier.
RTOL_ACCOUNTING = 1e-9

#: Relative tolerance of :data:`TOLERANT_COLUMNS`: |a − b| ≤ RTOL_COLUMNS · max(|a|, |b|)
#: (NaN equals NaN). Largest drift measured against ``golden.json`` (frozen on another
#: CPU), on this repository's 2-core AMD EPYC (AVX2) under every setting of
#: ``scripts/golden_portability.py``: 7.7e-6 (``mean_update_norm_nonprivate`` of the
#: high-noise ``truncated_poisson`` case, whose z = 3 noise on a 3-client cohort makes
#: training amplify rounding), 1e-6 for the clipped norms, ≤ 5e-7 for the losses; 1e-4
#: keeps a margin of 13 over the worst. A change of behaviour (other noise, another
#: cohort, another step or learning rate) moves these columns by 1e-3 or more.
RTOL_COLUMNS = 1e-4

#: Final weights: ``|a − b| ≤ ATOL_WEIGHTS + RTOL_WEIGHTS · |b|`` elementwise (numpy's
#: ``allclose``), b the weights frozen in ``golden_weights.npz``. Measured under the
#: settings of ``scripts/golden_portability.py``: at most 2.4e-7 absolute, 0.22 of the
#: bound 1e-6 + 1e-5·|b|; the bound below leaves a margin of about 40. One client's
#: other noise or step moves the weights by ~1e-2.
RTOL_WEIGHTS = 1e-4
ATOL_WEIGHTS = 1e-5


def _close(a: Any, b: Any, rtol: float) -> bool:
    if a == b:
        return True
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if np.isnan(x) and np.isnan(y):
        return True
    return bool(abs(x - y) <= rtol * max(abs(x), abs(y)))


def _rel(a: Any, b: Any) -> float:
    """|a − b| / max(|a|, |b|) of two recorded floats (0 when equal or both NaN)."""
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return 0.0 if a == b else float("inf")
    if x == y or (np.isnan(x) and np.isnan(y)):
        return 0.0
    return abs(x - y) / max(abs(x), abs(y))


def weights_drift(expected: np.ndarray, actual: np.ndarray) -> dict[str, float]:
    """The largest absolute and relative elementwise differences of two weight vectors,
    and the largest ratio of a difference to its :func:`weights_close` bound."""
    e = np.asarray(expected, dtype=np.float64).reshape(-1)
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    if e.shape != a.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "worst_vs_bound": float("inf")}
    diff = np.abs(a - e)
    scale = np.maximum(np.abs(a), np.abs(e))
    rel = np.divide(diff, scale, out=np.zeros_like(diff), where=scale > 0)
    bound = ATOL_WEIGHTS + RTOL_WEIGHTS * np.abs(e)
    return {
        "max_abs": float(diff.max(initial=0.0)),
        "max_rel": float(rel.max(initial=0.0)),
        "worst_vs_bound": float((diff / bound).max(initial=0.0)),
    }


def weights_close(expected: np.ndarray, actual: np.ndarray) -> str | None:
    """None when ``actual`` is within tolerance of ``expected``, else the reason."""
    e, a = np.asarray(expected).reshape(-1), np.asarray(actual).reshape(-1)
    if e.shape != a.shape:
        return f"weights: {e.size} parameters expected, got {a.size}"
    if np.allclose(a, e, rtol=RTOL_WEIGHTS, atol=ATOL_WEIGHTS, equal_nan=False):
        return None
    d = weights_drift(e, a)
    i = int(np.argmax(np.abs(a.astype(np.float64) - e.astype(np.float64))))
    return (
        f"weights differ beyond rtol={RTOL_WEIGHTS:g}, atol={ATOL_WEIGHTS:g}: max abs "
        f"{d['max_abs']:.3g}, max rel {d['max_rel']:.3g} (parameter {i}: expected "
        f"{float(e[i])!r}, got {float(a[i])!r})"
    )


def tolerance_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Every difference between a frozen record and a new one that the tolerances do
    not allow (empty: equal). Exact: the number of parameters, ε (final and per round),
    the privacy summary, column names and dtypes, and every column outside
    :data:`TOLERANT_COLUMNS`; those to :data:`RTOL_COLUMNS`. The weights' hash is not
    compared (bit-identity of float32 training holds on one machine, not across CPUs):
    :func:`weights_close` compares the weights themselves."""
    out: list[str] = []
    for key in ("num_params", "final_epsilon", "epsilon", "privacy"):
        e, a = expected.get(key), actual.get(key)
        if isinstance(e, dict) and isinstance(a, dict):
            same = e.keys() == a.keys() and all(_close(e[k], a[k], RTOL_ACCOUNTING) for k in e)
        elif isinstance(e, list) and isinstance(a, list):
            same = len(e) == len(a) and all(_close(x, y, RTOL_ACCOUNTING) for x, y in zip(e, a))
        else:
            same = _close(e, a, RTOL_ACCOUNTING)
        if not same:
            out.append(f"{key}: expected {e!r}, got {a!r}")
    exp_cols, act_cols = expected["columns"], actual["columns"]
    missing = [c for c in exp_cols if c not in act_cols]
    if missing:
        out.append(f"columns missing: {missing}")
    extra = [c for c in act_cols if c not in exp_cols]
    if extra:
        out.append(
            f"new columns {extra}: regenerate golden.json on purpose, or add a column that "
            "is nondeterministic by nature (wall time) to EXCLUDED_COLUMNS"
        )
    for c, exp in exp_cols.items():
        if c not in act_cols:
            continue
        act = act_cols[c]
        if exp["dtype"] != act["dtype"]:
            out.append(f"column {c!r}: dtype expected {exp['dtype']}, got {act['dtype']}")
            continue
        if len(exp["values"]) != len(act["values"]):
            out.append(
                f"column {c!r}: {len(exp['values'])} rows expected, got {len(act['values'])}"
            )
            continue
        rtol = RTOL_COLUMNS if c in TOLERANT_COLUMNS else RTOL_ACCOUNTING
        for i, (a, b) in enumerate(zip(exp["values"], act["values"])):
            if not _close(a, b, rtol):
                out.append(f"column {c!r} row {i}: expected {a!r}, got {b!r} (rtol {rtol:g})")
                break
    return out


def column_drift(expected: dict[str, Any], actual: dict[str, Any]) -> dict[str, float]:
    """Per column, the largest relative difference between two records' rows."""
    out: dict[str, float] = {}
    for c, exp in expected["columns"].items():
        act = actual["columns"].get(c)
        if act is None or len(act["values"]) != len(exp["values"]):
            out[c] = float("inf")
            continue
        out[c] = max((_rel(a, b) for a, b in zip(exp["values"], act["values"])), default=0.0)
    return out
