"""The server: owns the global model, draws cohorts, privatises, accounts, evaluates.

One round is the same code for every recipe (:meth:`Server.finish_round`); what differs
between methods is in three objects the recipe's pipeline and plan hand it:

* the **participation** (:class:`engine.privacy.participation.Participation`) draws the
  round's cohort from the round's sampling stream (or, in release mode, the OS
  CSPRNG) and states the sampling the accountant assumes;
* the **mechanism** (:class:`engine.privacy.mechanism.GaussianMechanism`, bound from
  the recipe's privatizer) owns C_t, the noise std, the round's draw and the DpEvent,
  with its noise scheme; the server only sums the clipped updates and takes the draw;
* the **server step** (:mod:`algorithms.server_step`) turns the aggregate (clipped
  sum, draw, public denominator, server transforms) into the new model, and may hold
  public state for the next round and add public row columns.

Privacy (docs/algorithms.md §0–1): the server receives only sums of clipped updates
(sensitivity C per client), the noise is the mechanism's, the denominator is public
(q·N or m, never the realised cohort size, which is private under Poisson sampling),
and the accountant composes the mechanism's own event (its noise scheme's, under the
run's participation) for the rounds completed: the ε recorded for round t is the
cumulative ε after t rounds, computed by dp-accounting.

FedAvg (non-private) skips clipping and noise and divides by the realised cohort.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algorithms.pieces.steps import round_lr
from algorithms.server_step import Aggregate, StepContext
from engine.data.federated import FederatedDataset
from engine.federated.client import PartialSum, reduce_partials
from engine.federated.evaluation import evaluate as evaluate_model
from engine.federated.evaluation import membership_inference_auc
from engine.federated.worker_model import (
    flatten_params,
    init_process_model,
    load_flat_,
    personal_mask,
)
from engine.privacy import rng as rngs
from engine.privacy.accounting import EpsilonTracker
from engine.privacy.mechanism import GaussianMechanism
from engine.privacy.participation import Participation
from engine.privacy.sampling import poisson_by_count, poisson_by_gaps  # noqa: F401 - tests
from engine.telemetry.phases import OFF


@dataclass(frozen=True)
class ServerSpec:
    seed: int
    model_name: str
    pipeline: Any  # algorithms.pipeline.Pipeline, built once per run (simulate.prepare)
    server_lr: float
    delta: float
    accountant: str
    sampling: Participation  # draws cohorts; states the sampling the accountant assumes
    eval_every: int
    rounds: int
    num_threads: int = 1
    local_lr: float = 0.1
    lr_decay: float = 1.0
    steps: int | None = None  # public K, when every client runs exactly K steps
    membership_inference: bool = False
    secure: bool = False  # release mode: cohorts and noise from the OS CSPRNG
    audit: Any = None  # engine.privacy.audit.AuditSpec (eval.audit_canaries > 0)
    model_init: str = "default"  # model.init: default | zeros


def sample_cohort(
    spec: Participation, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
) -> np.ndarray:
    """The sorted client ids of round ``rnd``: the participation's draw from the round's
    own sampling stream, or with ``secure`` from the OS CSPRNG (release mode; ``seed``
    unused, nothing kept). ``on_demand`` (an on-demand population) draws the same law in
    O(cohort) (:func:`engine.privacy.sampling.poisson_by_count`)."""
    return spec.draw(seed, rnd, secure, on_demand)


class Server:
    """Global model, noise, accounting and evaluation (a Ray actor or in process)."""

    def __init__(self, dataset: FederatedDataset, spec: ServerSpec) -> None:
        self.dataset = dataset
        self.spec = spec
        # dataset.materialize=false: O(cohort) Poisson draws (sample_cohort); a
        # materialised population keeps its one-uniform-per-client cohorts.
        self.on_demand = dataset.meta.get("materialize", True) is False
        self.model = init_process_model(
            spec.seed, spec.model_name, dataset, spec.num_threads, model_init=spec.model_init
        )
        self.weights = flatten_params(self.model)  # float32 (d,)
        self.shapes = [tuple(p.shape) for p in self.model.parameters() if p.requires_grad]
        self.pipeline = spec.pipeline
        self.privatizer = spec.pipeline.privatizer
        #: the server's own mechanism: C_0 and C_t, z and z_Δ, the noise's randomness
        #: (seeded or secure) and the DpEvent; None for a non-private recipe
        self.mechanism: GaussianMechanism | None = (
            self.privatizer.mechanism.bind(rngs.Randomness(spec.seed, spec.secure))
            if self.privatizer is not None
            else None
        )
        self.head_mask = (
            personal_mask(self.model, self.pipeline.personal.layers)
            if self.pipeline.personal is not None
            else None
        )
        priv = self.privatizer
        self.tracker = (  # the mechanism that noises is the one accounted
            EpsilonTracker(
                priv.noise_multiplier,
                spec.sampling,
                spec.delta,
                spec.accountant,
                event=priv.dp_event(spec.sampling),
                noise=priv.mechanism.scheme,
            )
            if priv is not None
            else None
        )
        #: the recipe's server step for this run (algorithms.server_step)
        self.step = self.pipeline.server_step.start(
            StepContext(
                server_lr=spec.server_lr,
                local_lr=spec.local_lr,
                lr_decay=spec.lr_decay,
                steps=spec.steps,
                sampling=spec.sampling,
                shapes=self.shapes,
                dim=self.dim(),
            )
        )
        self.rounds_done = 0
        self.audit = None
        if spec.audit is not None:
            from engine.privacy.audit_correlated import make_audit  # any participation

            assert self.mechanism is not None  # an audit needs a private recipe
            audit = spec.audit
            self.audit = make_audit(
                audit, self.weights, self.mechanism, spec.sampling, self.pipeline.server_step
            )
        #: (round, C_t, noise or the Future of its draw): drawn ahead by
        #: :meth:`prepare_noise` or :meth:`prefetch_noise`, used once by finish_round
        self._noise: tuple[int, float, torch.Tensor | Future] | None = None
        #: the one thread that draws noise ahead (created by the first prefetch)
        self._noise_thread: ThreadPoolExecutor | None = None
        #: False: no draw in the background (tests compare the two; values are equal)
        self.draw_ahead = True
        self.timer = OFF  # engine.telemetry.phases: a benchmark's PhaseTimer, else records nothing

    def dim(self) -> int:
        return int(self.weights.numel())

    def state_dict(self) -> dict:
        """Everything that evolves across rounds. RNG streams are keyed by (seed, round)
        and ε is a function of the rounds done, so this is the whole server state."""
        return {
            "weights": self.weights.numpy().copy(),
            "rounds_done": self.rounds_done,
            "clip_norm": self.clip_norm,  # C_t (the mechanism's), inf for a non-private run
            "audit": None if self.audit is None else self.audit.state_dict(),
            "step": self.step.state_dict(),  # the server step's own state
        }

    def load_state_dict(self, state: dict) -> None:
        self.weights = torch.from_numpy(np.array(state["weights"], dtype=np.float32))
        self._noise = None  # a draw made ahead for the state being replaced is dropped
        self.rounds_done = int(state["rounds_done"])
        if self.mechanism is not None:
            self.mechanism.load_state_dict(state)
        if self.audit is not None and state.get("audit") is not None:
            self.audit.load_state_dict(state["audit"])
        if "step" in state:
            self.step.load_state_dict(state["step"])
        else:  # a checkpoint written before server steps held their state: same layouts
            self.step.load_state_dict(state.get("correlated") or {"g_tilde": state.get("g_tilde")})

    def get_weights(self) -> np.ndarray:
        return self.weights.numpy().copy()

    def begin_round(self, rnd: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """Draw round ``rnd``'s cohort; return (cohort, global weights, public state: the
        server step's public vectors, C_t under adaptive clipping)."""
        if rnd != self.rounds_done:
            raise RuntimeError(f"round {rnd} requested but {self.rounds_done} rounds are done")
        public: dict = {
            name: None if v is None else v.numpy() for name, v in self.step.public().items()
        }
        with self.timer.phase("cohort_sampling"):
            cohort = sample_cohort(
                self.spec.sampling, self.spec.seed, rnd, self.spec.secure, self.on_demand
            )
        if self.mechanism is not None:  # C_t under adaptive clipping: clients clip with it
            public.update(self.mechanism.public_state())
        return cohort, self.weights.numpy(), public

    def noise_support(self, rnd: int) -> torch.Tensor | None:
        """Where server noise goes: every released coordinate (not personal heads), or
        only the round's public rand-k mask. ``None`` means all coordinates."""

        def randk_mask() -> torch.Tensor:
            rk = self.pipeline.randk
            assert rk is not None  # public_mask implies a rand-k transform (Pipeline checks)
            return rk.mask(self.dim(), rngs.torch_gen(self.spec.seed, rngs.SERVER_PUBLIC, rnd))

        return self.pipeline.noise_support(self.head_mask, randk_mask)

    @property
    def clip_norm(self) -> float:
        """C_t, the clip norm of the coming round (the mechanism's: C_0 under fixed
        clipping, moved by released counts under adaptive clipping); inf without privacy."""
        return self.mechanism.clip_t if self.mechanism is not None else math.inf

    def _draw_noise(self, rnd: int) -> torch.Tensor:
        """Round ``rnd``'s server noise on its support, from the mechanism (std z_Δ·C_t;
        the round's seeded stream or, in release mode, the OS CSPRNG)."""
        assert self.mechanism is not None  # only private recipes add server noise
        return self.mechanism.server_noise(self.dim(), rnd, self.noise_support(rnd))

    def prepare_noise(self, rnd: int) -> None:
        """Draw round ``rnd``'s server noise now, after :meth:`begin_round` and while the
        round's clients train (the executor calls it then), so that
        :meth:`finish_round` only adds it. The noise depends on no client data: only on
        z, the round's public C_t, its stream and its public support, all fixed when the
        round begins; the values are those :meth:`finish_round` would draw itself
        (bit-identical), and it is still added exactly once, to this round's sum.
        Nothing to do when :meth:`prefetch_noise` already started this round's draw."""
        if self.mechanism is None or rnd != self.rounds_done or self._drawing(rnd):
            return
        with self.timer.phase("noise_draw_ahead"):
            self._noise = (rnd, self.mechanism.clip_t, self._draw_noise(rnd))

    def prefetch_noise(self, rnd: int) -> None:
        """Start drawing round ``rnd``'s noise in the server's own thread and return at
        once (torch releases the GIL while it fills the vector). :meth:`finish_round`
        calls it for round t+1 as soon as round t's update is made, so the draw overlaps
        the checkpoint, the row, evaluation and round t+1's training; executors call it
        when a round's shards are dispatched (the first round's draw). The same values
        as :meth:`prepare_noise` (C_{t+1} is fixed when round t ends, also under
        adaptive clipping), used once; a draw for another round or C_t is ignored.
        In release mode (``privacy.secure_noise``) the executor's call draws in the
        calling thread (:meth:`prepare_noise`) and finish_round starts none, so the OS
        entropy is read in one fixed order, never interleaved with the cohort's."""
        mech = self.mechanism
        if self.spec.secure:
            self.prepare_noise(rnd)
            return
        if mech is None or not self.draw_ahead or rnd != self.rounds_done:
            return
        if rnd >= self.spec.rounds or self._drawing(rnd):
            return
        if self._noise_thread is None:
            self._noise_thread = ThreadPoolExecutor(1, thread_name_prefix="dpfl-noise")
        timer = self.timer

        def draw() -> torch.Tensor:
            with timer.phase("noise_draw_ahead"):
                return self._draw_noise(rnd)

        self._noise = (rnd, mech.clip_t, self._noise_thread.submit(draw))

    def _drawing(self, rnd: int) -> bool:
        """Whether round ``rnd``'s noise (for the current C_t) is drawn or being drawn."""
        held, mech = self._noise, self.mechanism
        return held is not None and mech is not None and held[:2] == (rnd, mech.clip_t)

    def close(self) -> None:
        """Stop the noise thread (a draw in progress is finished and dropped)."""
        if self._noise_thread is not None:
            self._noise_thread.shutdown(wait=True, cancel_futures=True)
            self._noise_thread = None
        self._noise = None

    def finish_round(self, rnd: int, *partials: PartialSum, evaluate: bool = True) -> dict:
        """Aggregate the shards' partial sums, privatise, post-process, update, account.

        With ``evaluate=False`` the executor evaluates the new model itself (spread
        over the workers) and fills ``test_accuracy``/``test_loss``.
        """
        spec, pipe = self.spec, self.pipeline
        before = self.weights
        with self.timer.phase("reduce"):
            total = reduce_partials(list(partials), self.dim())
        summed = torch.from_numpy(total.update_sum)
        mech = self.mechanism
        clip_t = self.clip_norm  # C_t bounded this round's sensitivity; size noise with it
        if self.audit is not None:  # canary clients' clipped updates join the sum
            summed = summed + self.audit.canary_sum(rnd, clip_t, self.noise_support(rnd))
        t_update = time.perf_counter()
        noise = None
        if mech is not None:
            ahead, self._noise = self._noise, None
            if ahead is not None and ahead[:2] == (rnd, clip_t):
                held = ahead[2]
                if isinstance(held, Future):
                    with self.timer.phase("noise_wait"):
                        held = held.result()
                noise = held
            else:
                with self.timer.phase("noise_draw"):
                    noise = self._draw_noise(rnd)
        lr = round_lr(spec.local_lr, spec.lr_decay, rnd)  # public: the clients' step size
        context = {"shapes": self.shapes, "steps": spec.steps, "lr": lr, **self.step.public()}
        aggregate = Aggregate(
            summed,
            noise,
            mech,
            spec.sampling.denominator,
            total.num_clients,
            pipe.server_transforms,
            context,
        )
        self.weights = self.step.update(rnd, self.weights, aggregate)
        self.timer.add("server_update", time.perf_counter() - t_update)  # noise_draw included
        self.rounds_done = rnd + 1
        n = total.num_clients
        extra: dict = {}
        if mech is not None and mech.adaptive is not None:
            # Only real clients report b_i (canaries do not). The row's ``clip_norm`` is
            # the C_t used in this round; it and b̃ are public (derived from releases).
            extra = mech.release_count(rnd, total.num_clients, total.num_clipped)
        if self.audit is not None:
            extra.update(self.audit.observe_round(rnd, before, self.weights, spec.rounds))
        extra.update(self.step.row(rnd))  # the server step's public columns
        if not spec.secure:  # C_{t+1} is set: the next draw overlaps what follows
            self.prefetch_noise(rnd + 1)
        row: dict = {
            "round": rnd + 1,
            "cohort_size": spec.sampling.denominator,
            "realised_cohort_size_nonprivate": n,
            "epsilon": self.tracker.epsilon(rnd + 1) if self.tracker else math.inf,
            "mean_update_norm_nonprivate": total.norm_sum / n if n else math.nan,
            "clipped_fraction_nonprivate": total.num_clipped / n if n else math.nan,
            "nonfinite_updates_nonprivate": total.num_nonfinite,
            "train_loss_nonprivate": (
                total.loss_sum / total.num_steps if total.num_steps else math.nan
            ),
            "max_clipped_norm_nonprivate": total.max_clipped_norm,
            **extra,
        }
        acc, loss, mia = math.nan, math.nan, math.nan
        if self.is_eval_round(rnd):
            load_flat_(self.model, self.weights)
            if evaluate:
                acc, loss = evaluate_model(self.model, self.dataset.x_test, self.dataset.y_test)
            if spec.membership_inference and rnd + 1 == spec.rounds:
                mia = membership_inference_auc(self.model, self.dataset, spec.seed)
        row["test_accuracy"], row["test_loss"] = acc, loss
        if spec.membership_inference:
            row["mia_auc_nonprivate"] = mia
        return row

    def is_eval_round(self, rnd: int) -> bool:
        return is_eval_round(rnd, self.spec.eval_every, self.spec.rounds)


def is_eval_round(rnd: int, every: int, rounds: int) -> bool:
    """Round ``rnd`` (0-based) is evaluated every ``every`` rounds and at the end."""
    return (rnd + 1) % every == 0 or rnd + 1 == rounds
