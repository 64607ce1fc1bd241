"""A new method from outside the package (issue 46): this module registers a toy server
step (server Adam on the privatized average) and a toy participation scheme (fixed-size
cohorts, each round a block, round-robin, of a fresh shuffle of the population), names
them in a ``recipe:`` section and runs ``dpfl run``'s code on Ray and in process.

* Their effect is checked exactly against an independent computation: a third toy, a
  client transform, makes every client's update 0, so the release of round t is the
  mechanism's draw over the public denominator, read here from the same seeded stream
  the server draws from; numpy's Adam on those releases gives the final model bit for bit, and the
  clients that took part (their personal heads, kept one per client that trained) are
  exactly the union of the toy's cohorts computed here from the rounds' streams.
* Their ε is dp-accounting's for the event the participation declares (fixed-size
  sampling without replacement), from a fresh accountant.
* A scheme whose draw does not follow the sampling it states (one that states Poisson
  but draws fixed-size cohorts; one that reuses a single permutation in blocks, i.e.
  shuffling, while stating independent fixed-size draws) is refused when the run is
  built, by sampling its draw.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import dp_accounting
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from algorithms import registry
from algorithms.server_step import Aggregate, ServerStep, ServerStepPiece, StepContext
from algorithms.spec import Key, PieceSpec
from engine.cli import main
from engine.config import ConfigError, load_config
from engine.federated.worker_model import flatten_params, init_process_model, personal_mask
from engine.privacy import rng as rngs
from engine.privacy.sampling import FixedSampling, PoissonSampling
from engine.simulation import prepare

# ------------------------------------------------------------------- the toys


@dataclass(frozen=True)
class ToyAdam(ServerStepPiece):
    """Server Adam on the privatized average (post-processing of the release)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3
    name: ClassVar[str] = "toy_adam"

    def start(self, ctx: StepContext) -> ServerStep:
        return ToyAdamRun(self)


class ToyAdamRun(ServerStep):
    def __init__(self, piece: ToyAdam) -> None:
        self.p = piece
        self.t = 0
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, rnd: int, weights: torch.Tensor, agg: Aggregate) -> torch.Tensor:
        g = agg.release()  # the noisy mean, float64
        p = self.p
        self.t += 1
        self.m = (1 - p.beta1) * g if self.m is None else p.beta1 * self.m + (1 - p.beta1) * g
        g2 = g * g
        self.v = (1 - p.beta2) * g2 if self.v is None else p.beta2 * self.v + (1 - p.beta2) * g2
        m_hat = self.m / (1 - p.beta1**self.t)
        v_hat = self.v / (1 - p.beta2**self.t)
        return weights + (p.lr * m_hat / (torch.sqrt(v_hat) + p.eps)).to(weights.dtype)

    def row(self, rnd: int) -> dict[str, Any]:
        return {"toy_adam_steps": self.t}

    def state_dict(self) -> dict[str, Any]:
        arr = {
            k: None if v is None else v.numpy().copy() for k, v in (("m", self.m), ("v", self.v))
        }
        return {"t": self.t, **arr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = int(state["t"])
        for k in ("m", "v"):
            setattr(self, k, None if state[k] is None else torch.from_numpy(state[k]))


def toy_cohort(seed: int, rnd: int, n: int, m: int) -> np.ndarray:
    """Round ``rnd``'s cohort: a fresh permutation of the clients from the round's own
    stream, cut into ⌊n/m⌋ blocks, block ``rnd`` mod ⌊n/m⌋. Each round's permutation is
    new, so every block is a uniform m-subset independent of other rounds: fixed-size
    sampling without replacement, the statement the toy declares."""
    order = rngs.Randomness(seed, False).cohort_stream(rnd).permutation(n)
    block = rnd % (n // m)
    return np.sort(order[block * m : (block + 1) * m]).astype(np.int64)


@dataclass(frozen=True)
class ToyBlocks(FixedSampling):
    """Fixed cohorts drawn round-robin from shuffled blocks, accounted as fixed sampling."""

    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        return toy_cohort(seed, rnd, self.num_clients, self.cohort_size)


@dataclass(frozen=True)
class ReusedBlocks(FixedSampling):
    """Shuffles once and deals blocks round-robin: consecutive cohorts are disjoint, so
    its rounds are not independent draws (shuffling): fixed-size accounting would not hold."""

    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        m = self.cohort_size
        order = rngs.Randomness(seed, False).cohort_stream(0).permutation(self.num_clients)
        block = rnd % (self.num_clients // m)  # one permutation for every round
        return np.sort(order[block * m : (block + 1) * m]).astype(np.int64)


@dataclass(frozen=True)
class Liar(PoissonSampling):
    """States Poisson sampling but draws cohorts of one fixed size."""

    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        m = round(self.rate * self.num_clients)
        return toy_cohort(seed, rnd, self.num_clients, m)


@dataclass(frozen=True)
class SendsNothing:
    """A client transform for the exact check: every client's update becomes 0, so the
    release of a round is the mechanism's draw over the public denominator."""

    public_mask = False

    def apply(self, delta: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return torch.zeros_like(delta)


ADAM_LR = Key("toy_adam_lr", float | None, None, "toy: server Adam's step (null: 0.05)")
SPECS = (
    PieceSpec(
        "toy_adam",
        "server_step",
        f"{__name__}:ToyAdam",
        lambda cls, a, ctx: cls(0.05 if a.toy_adam_lr is None else a.toy_adam_lr),
        keys=(ADAM_LR,),
        report=lambda s, p: {"toy_adam_lr": s.lr},
    ),
    PieceSpec("toy_zero", "client_transform", f"{__name__}:SendsNothing", lambda c, a, x: c()),
    PieceSpec(
        "toy_blocks",
        "participation",
        f"{__name__}:ToyBlocks",
        lambda cls, a, ctx: cls(ctx.num_clients, ctx.sampling.cohort_size),
    ),
    PieceSpec(
        "toy_reused_blocks",
        "participation",
        f"{__name__}:ReusedBlocks",
        lambda cls, a, ctx: cls(ctx.num_clients, ctx.sampling.cohort_size),
    ),
    PieceSpec(
        "toy_liar",
        "participation",
        f"{__name__}:Liar",
        lambda cls, a, ctx: cls(ctx.num_clients, ctx.sampling.rate),
    ),
)


@pytest.fixture
def toys() -> Iterator[None]:
    for spec in SPECS:
        registry.register(spec)
    try:
        yield
    finally:
        for spec in SPECS:
            registry.unregister(spec.name)


# --------------------------------------------------------------------- the run

SEED, N, M, ROUNDS, Z, C, LR = 5, 24, 6, 5, 1.3, 0.7, 0.2
DELTA = 1e-4
RUN = {
    "algorithm": "custom",
    "seed": SEED,
    "rounds": ROUNDS,
    "recipe": {
        "step": "sgd",
        "personal": True,
        "client_transforms": ["toy_zero"],
        "server_step": "toy_adam",
    },
    "algo": {"toy_adam_lr": LR},
    "dataset": {"num_clients": N, "synthetic_mean_samples": 12, "synthetic_dim": 8},
    "model": {"name": "mlp"},
    "sampling": {"mode": "fixed", "cohort_size": M},
    "local": {"epochs": 1, "batch_size": 8},
    "privacy": {"epsilon": None, "noise_multiplier": Z, "clip_norm": C, "delta": DELTA},
    "eval": {"every": ROUNDS},
    "ray": {"num_workers": 2, "num_cpus_per_worker": 1, "clients_per_worker_batch": 1},
}


def dpfl_run(tmp: Path, executor: str, participation: str = "toy_blocks") -> Path:
    """``dpfl run --config FILE --executor EXECUTOR`` of the toy recipe; its folder."""
    tree = {**RUN, "recipe": {**RUN["recipe"], "participation": participation}}
    path = tmp / f"{executor}.yaml"
    path.write_text(yaml.safe_dump(tree))
    out = tmp / executor
    argv = ["run", "-q", "--config", str(path), "--executor", executor, "--out", str(out)]
    assert main(argv) == 0
    return out


def independent_model() -> np.ndarray:
    """The final model computed here: numpy's Adam (the toy's formula) on the releases
    (0 + z·C·ξ_t)/m, ξ_t the round's noise stream on the released (non-head)
    coordinates, from the model's seeded initialisation."""
    model = init_process_model(
        SEED, "mlp", prepare(load_config(overrides=_as_overrides())).dataset, 1
    )
    w = flatten_params(model).numpy().copy()
    support = (~personal_mask(model, 1).numpy()).astype(np.float64)
    m = v = None
    for t in range(ROUNDS):
        xi = rngs.SeededStream(SEED, (rngs.NOISE, t)).standard_normal(w.size)
        xi *= Z * C / math.sqrt(1.0)
        g = (0.0 + xi * support) / float(M)
        m = (1 - 0.9) * g if m is None else 0.9 * m + (1 - 0.9) * g
        v = (1 - 0.99) * (g * g) if v is None else 0.99 * v + (1 - 0.99) * (g * g)
        m_hat, v_hat = m / (1 - 0.9 ** (t + 1)), v / (1 - 0.99 ** (t + 1))
        w = w + (LR * m_hat / (np.sqrt(v_hat) + 1e-3)).astype(np.float32)
    return w


def _as_overrides() -> list[str]:
    return [
        "algorithm=custom",
        f"seed={SEED}",
        "recipe.personal=true",
        f"dataset.num_clients={N}",
        "dataset.synthetic_mean_samples=12",
        "dataset.synthetic_dim=8",
        "sampling.mode=fixed",
        f"sampling.cohort_size={M}",
        "privacy.epsilon=null",
        f"privacy.noise_multiplier={Z}",
    ]


def union(cohort: Any) -> set[int]:
    return set(np.concatenate([cohort(t) for t in range(ROUNDS)]).tolist())


def check_run(out: Path) -> np.ndarray:
    """The run's effects and ε against the independent computations; its final model."""
    saved = pickle.loads((out / "checkpoint.pkl").read_bytes())
    weights = np.asarray(saved["server"]["weights"])
    assert np.array_equal(weights, independent_model())  # bit for bit
    took_part = set(saved["clients"])  # one personal head per client that trained
    assert took_part == set(
        np.concatenate([toy_cohort(SEED, t, N, M) for t in range(ROUNDS)]).tolist()
    )
    fixed = FixedSampling(N, M)  # the statement, drawn its own way: another set of clients
    assert took_part != set(np.concatenate([fixed.draw(SEED, t) for t in range(ROUNDS)]).tolist())
    rows = pd.read_parquet(out / "rounds.parquet")
    assert rows["sampling"].iloc[-1] == "fixed_without_replacement"
    assert list(rows["toy_adam_steps"]) == list(range(1, ROUNDS + 1))
    assert rows["toy_adam_lr"].iloc[-1] == LR
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        N, M, dp_accounting.GaussianDpEvent(Z / 2.0)
    )  # replace-one sensitivity 2C: the Gaussian of z/2 (engine.privacy.sampling)
    acc.compose(event, ROUNDS)
    assert rows["epsilon"].iloc[-1] == acc.get_epsilon(DELTA)
    return weights


@pytest.mark.filterwarnings("ignore:sampling.mode=fixed is accounted:UserWarning")
def test_toy_server_step_and_participation_in_process(toys, tmp_path) -> None:
    check_run(dpfl_run(tmp_path, "local"))


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore:sampling.mode=fixed is accounted:UserWarning")
def test_toy_server_step_and_participation_on_ray(toys, ray_session, tmp_path) -> None:
    on_ray = check_run(dpfl_run(tmp_path, "ray"))
    assert np.array_equal(on_ray, check_run(dpfl_run(tmp_path, "local")))


@pytest.mark.parametrize(
    "name, why",
    [
        ("toy_liar", "cohort size variance"),
        ("toy_reused_blocks", "consecutive cohorts share"),
    ],
)
def test_a_scheme_that_does_not_draw_what_it_states_is_refused(toys, name, why) -> None:
    over = [*_as_overrides(), f"recipe.participation={name}", "sampling.mode=poisson"]
    if name == "toy_reused_blocks":
        over[-1] = "sampling.mode=fixed"
    with pytest.raises(ConfigError, match=why):
        prepare(load_config(overrides=over))
