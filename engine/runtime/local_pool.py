"""The in-process worker pool: one server and one client worker in this process,
shards trained one after another — the reference the Ray pool must equal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from engine.data.federated import FederatedDataset
from engine.federated.client import ClientWorker, LocalSpec
from engine.federated.server import Server, ServerSpec
from engine.runtime.executors import Executor, round_plan
from engine.telemetry.phases import OFF

_Played = TypeVar("_Played")


def local_executor(
    dataset: FederatedDataset, server_spec: ServerSpec, local_spec: LocalSpec, num_shards: int
) -> Executor:
    """Everything in this process; the reference the Ray executor must equal."""
    pool = InProcessPool(dataset, server_spec, local_spec)
    return Executor(pool, round_plan(dataset, server_spec, local_spec, num_shards))


class RoundsInOrder:
    """What a pool shares whose evaluations run in the round loop's order (none beside
    the next round's training) and which retries nothing: an evaluation "behind" is
    done at once, a round is played once, a checkpoint is read when asked for."""

    retries = 0
    #: nothing runs beside the round loop
    overlaps_evaluation = False

    def evaluate(self, weights: Any, slices: list[tuple[int, int]]) -> list:
        raise NotImplementedError

    def evaluate_behind(self, weights: Any, slices: list[tuple[int, int]]) -> list:
        return self.evaluate(weights, slices)  # in order: now, the sums themselves

    def evaluation_sums(
        self, rnd: int, refs: list, weights: Any, slices: list[tuple[int, int]], recover: bool
    ) -> list | None:
        return refs

    def attempt(self, rnd: int, play: Callable[[], _Played]) -> _Played:
        return play()

    def checkpoint_handle(self) -> None:
        return None  # nothing runs beside the loop: checkpoint() reads the state now


class InProcessPool(RoundsInOrder):
    """One server and one client worker in this process; shards run one after another."""

    def __init__(
        self, dataset: FederatedDataset, server_spec: ServerSpec, local_spec: LocalSpec
    ) -> None:
        self.server = Server(dataset, server_spec)
        self.worker = ClientWorker(dataset, local_spec)
        self.timer: Any = OFF

    def set_timer(self, timer: Any) -> None:
        self.timer = self.server.timer = self.worker.timer = timer

    def begin_round(self, rnd: int) -> tuple[np.ndarray, Any, Any]:
        return self.server.begin_round(rnd)

    def train(
        self,
        rnd: int,
        shards: list[np.ndarray],
        weights: Any,
        public: Any,
        while_training: Callable[[], None] | None = None,
    ) -> list:
        # The round's noise depends on no client data (Server.prefetch_noise): the
        # server draws it in its own thread while the shards train in this one, the
        # same values from the same stream (the previous round already started it,
        # except for the first round); finish_round waits for it and adds it once.
        self.server.prefetch_noise(rnd)
        if while_training is not None:  # nothing trains beside it here: before the shards
            while_training()
        with self.timer.phase("train_shards"):
            return [self.worker.train_shard(weights, rnd, shard, public) for shard in shards]

    def finish_round(self, rnd: int, partials: list) -> dict:
        return self.server.finish_round(rnd, *partials, evaluate=False)

    def current_weights(self) -> np.ndarray:
        return self.server.get_weights()

    def evaluate(self, weights: Any, slices: list[tuple[int, int]]) -> list:
        return [self.worker.evaluate_slice(weights, a, b) for a, b in slices]

    def personal_eval(self, weights: Any, clients: list[np.ndarray]) -> list[tuple[int, int]]:
        return [self.worker.personal_eval(weights, c) for c in clients]

    def weights(self) -> np.ndarray:
        return self.server.get_weights()

    def checkpoint(self, handle: None = None) -> dict:
        return {"server": self.server.state_dict(), "clients": self.worker.client_state()}

    def restore(self, state: dict) -> None:
        self.server.load_state_dict(state["server"])
        self.worker.restore_client_state(state.get("clients", {}))

    def close(self) -> None:
        self.server.close()
