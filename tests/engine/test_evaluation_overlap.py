"""Round t's evaluation beside round t+1's training (``ray.overlap_evaluation``):
the same rows, checkpoints and model as evaluating before the next round, rows
released in order, each with the state after its own round; a worker lost during a
held evaluation re-evaluates its slice."""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import pytest

from engine.config import load_config
from engine.runtime import ray_pool
from engine.runtime.executors import Executor, RoundPlan
from engine.simulation import simulate
from engine.telemetry.phases import OFF

# ------------------------------------------------------------ the executor's order


class _FakePool:
    """A pool that overlaps evaluation, recording the order of what the executor asks.

    Its "state" is the number of rounds finished; a checkpoint handle captures it, and
    an evaluation's sums encode the round whose weights they scored."""

    overlaps_evaluation = True
    timer = OFF
    retries = 0

    def __init__(self, lose_in_hook: set[int] = frozenset()) -> None:
        self.events: list[tuple[str, int]] = []
        self.finished = 0
        self.lose_in_hook = set(lose_in_hook)  # rounds whose evaluation a lost worker delays

    def begin_round(self, rnd):
        self.events.append(("begin", rnd))
        return np.arange(4), ("w", rnd), None

    def train(self, rnd, shards, weights, public, while_training=None):
        self.events.append(("dispatch", rnd))
        if while_training is not None:
            while_training()
        self.events.append(("trained", rnd))
        return [None]

    def finish_round(self, rnd, partials):
        self.finished = rnd + 1
        return {"round": rnd + 1, "test_accuracy": math.nan, "test_loss": math.nan}

    def current_weights(self):
        return ("w", self.finished)

    def evaluate(self, weights, slices):
        self.events.append(("evaluate", weights[1]))
        return [(weights[1], 0.0, 100)]

    def evaluate_behind(self, weights, slices):
        self.events.append(("evaluate_behind", weights[1]))
        return [weights[1]]

    def evaluation_sums(self, rnd, refs, weights, slices, recover):
        if not recover and rnd in self.lose_in_hook:
            self.lose_in_hook.discard(rnd)
            self.events.append(("evaluation_lost", rnd))
            return None
        self.events.append(("evaluation_in", rnd))
        return [(refs[0], 0.0, 100)]

    def attempt(self, rnd, play):
        return play()

    def checkpoint_handle(self):
        return self.finished

    def checkpoint(self, handle=None):
        return {"finished": self.finished if handle is None else handle}


def _plan(rounds: int, every: int = 1) -> RoundPlan:
    return RoundPlan(
        num_shards=1,
        costs=None,
        test_slices=[(0, 100)],
        eval_every=every,
        rounds=rounds,
        personal_clients=None,
    )


def _run(pool: _FakePool, rounds: int, every: int = 1) -> list[tuple[int, float, dict]]:
    released: list[tuple[int, float, dict]] = []

    def release(row: dict, checkpoint) -> None:
        pool.events.append(("released", row["round"]))
        released.append((row["round"], row["test_accuracy"], checkpoint()))

    Executor(pool, _plan(rounds, every)).run_rounds(0, rounds, release)
    return released


def test_rows_are_released_in_order_beside_the_next_round_with_their_own_state() -> None:
    pool = _FakePool()
    released = _run(pool, rounds=3)
    # every row, in order, scored on its own round's weights (accuracy = round / 100),
    # with the checkpoint of the state right after its round
    assert [(r, a, c["finished"]) for r, a, c in released] == [
        (1, 0.01, 1),
        (2, 0.02, 2),
        (3, 0.03, 3),
    ]
    ev = pool.events
    # round 1's evaluation starts before round 2 begins and is released while round 2
    # trains: after its dispatch, before the wait for its shards
    assert ev.index(("evaluate_behind", 1)) < ev.index(("begin", 1))
    assert ev.index(("dispatch", 1)) < ev.index(("released", 1)) < ev.index(("trained", 1))
    assert ev.index(("dispatch", 2)) < ev.index(("released", 2)) < ev.index(("trained", 2))
    # the last round is evaluated before run_rounds returns, not behind anything
    assert ("evaluate", 3) in ev and ("evaluate_behind", 3) not in ev
    assert ev[-1] == ("released", 3)


def test_rounds_without_evaluation_are_released_at_once_and_in_order() -> None:
    pool = _FakePool()
    released = _run(pool, rounds=5, every=2)
    assert [r for r, _, _ in released] == [1, 2, 3, 4, 5]
    acc = {r: a for r, a, _ in released}
    assert math.isnan(acc[1]) and math.isnan(acc[3])
    assert (acc[2], acc[4], acc[5]) == (0.02, 0.04, 0.05)
    assert [c["finished"] for _, _, c in released] == [1, 2, 3, 4, 5]
    ev = pool.events
    # round 3 (no evaluation) waits for round 2's row, held while round 3 trained
    assert ev.index(("released", 2)) < ev.index(("released", 3))
    assert ev.index(("dispatch", 2)) < ev.index(("released", 2))


def test_an_evaluation_a_lost_worker_delayed_is_completed_after_the_round() -> None:
    pool = _FakePool(lose_in_hook={0})
    released = _run(pool, rounds=3)
    assert [(r, a, c["finished"]) for r, a, c in released] == [
        (1, 0.01, 1),
        (2, 0.02, 2),
        (3, 0.03, 3),
    ]
    ev = pool.events
    # not released beside round 2 (its sums were lost) but right after round 2's
    # recovery, still before round 2's own row and before round 3 begins
    assert ev.index(("evaluation_lost", 0)) < ev.index(("trained", 1))
    assert ev.index(("trained", 1)) < ev.index(("released", 1)) < ev.index(("released", 2))
    assert ev.index(("released", 1)) < ev.index(("begin", 2))


# ----------------------------------------------- a lost slice evaluated again (Ray)


class _Lost(Exception):
    pass


def test_evaluation_sums_evaluates_a_lost_slice_again_on_the_restarted_worker(
    monkeypatch,
) -> None:
    """``RayWorkerPool.evaluation_sums`` with a fake Ray: a slice whose worker died is
    submitted again once the worker is back; without ``recover`` it gives None; a
    worker that keeps dying stops the run naming the round and the slice."""
    pytest.importorskip("ray")
    import ray.exceptions

    monkeypatch.setattr(ray.exceptions, "RayActorError", _Lost)
    submitted: list[tuple[int, int, int]] = []

    class _Method:
        def __init__(self, worker: int) -> None:
            self.worker = worker

        def options(self, **_: Any):
            return self

        def remote(self, weights, a, b):
            submitted.append((self.worker, a, b))
            return ("ok", a, b)

    class _Worker:
        def __init__(self, i: int) -> None:
            self.evaluate_slice_apart = _Method(i)

    class _Ray:
        def __init__(self, failing: int) -> None:
            self.failing = failing

        def get(self, ref):
            if ref[0] == "lost" or (ref[0] == "ok" and self.failing > 0 and ref[1] == 5):
                if ref[0] == "ok":
                    self.failing -= 1
                raise _Lost
            return (ref[2] - ref[1], 0.0, ref[2] - ref[1])

    pool = ray_pool.RayWorkerPool.__new__(ray_pool.RayWorkerPool)
    pool.workers = [_Worker(0), _Worker(1)]
    pool.max_restarts = 2
    pool.run_name = "t"
    restarted: list[str] = []
    pool._await_restart = lambda actor, what, rnd: restarted.append(what)  # type: ignore[method-assign]
    slices = [(0, 5), (5, 10)]
    refs = [("ok", 0, 5), ("lost", 5, 10)]

    pool._ray = _Ray(failing=0)
    assert pool.evaluation_sums(3, refs, "w", slices, recover=False) is None
    assert submitted == [] and restarted == []

    assert pool.evaluation_sums(3, refs, "w", slices, recover=True) == [
        (5, 0.0, 5),
        (5, 0.0, 5),
    ]
    assert submitted == [(1, 5, 10)] and restarted == ["t:client-worker-1"]

    submitted.clear()
    pool._ray = _Ray(failing=10)  # the restarted worker dies again every time
    with pytest.raises(ray_pool.WorkerLostError, match=r"round 4: .*test slice \(5, 10\)"):
        pool.evaluation_sums(3, refs, "w", slices, recover=True)
    assert len(submitted) == pool.max_restarts + 1


# ------------------------------------------------------------------- on real Ray

RUN = [
    "dataset.num_clients=40",
    "dataset.synthetic_mean_samples=20",
    "dataset.synthetic_dim=12",
    "sampling.rate=0.25",
    "rounds=4",
    "eval.every=1",
    "local.epochs=1",
    "local.batch_size=8",
    "model.name=mlp",
    "privacy.noise_multiplier=0.8",
    "ray.num_workers=2",
    "ray.num_cpus_per_worker=0.5",
]


def _same(a: Any, b: Any) -> bool:
    """Deep equality of checkpoints (dicts, lists, arrays, floats with NaN)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or hasattr(a, "numpy"):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def _recorded(*extra: str) -> tuple[Any, list[dict], list[int | None]]:
    """A run with its per-round checkpoints, and for each released row the latest
    round the server had begun (None in process)."""
    checkpoints: list[dict] = []
    begun_at_release: list[int | None] = []
    begun: list[int] = []
    from engine.runtime import executors

    real = executors.play_round

    def play(pool, rnd, plan, **kw):
        original = pool.begin_round

        def begin(r):
            begun.append(r)
            return original(r)

        pool.begin_round = begin
        try:
            return real(pool, rnd, plan, **kw)
        finally:
            del pool.begin_round

    def on_checkpoint(state: dict, row: dict) -> None:
        state = pickle.loads(pickle.dumps(state))
        del state["row"]["wall_time_s_nonprivate"]  # timing: differs between any two runs
        checkpoints.append(state)

    def on_round(row: dict, executor) -> None:
        begun_at_release.append(begun[-1] if begun else None)

    executors.play_round = play
    try:
        result = simulate(
            load_config(overrides=[*RUN, *extra]),
            write=False,
            on_round=on_round,
            on_checkpoint=on_checkpoint,
        )
    finally:
        executors.play_round = real
    return result, checkpoints, begun_at_release


@pytest.mark.ray
def test_overlapped_run_equals_the_unoverlapped_and_the_in_process_run(ray_session) -> None:
    local, local_ckpts, _ = _recorded("ray.executor=local")
    off, off_ckpts, off_begun = _recorded("ray.executor=ray", "ray.overlap_evaluation=false")
    on, on_ckpts, on_begun = _recorded("ray.executor=ray")
    timing = ["wall_time_s_nonprivate"]
    for other, ckpts in ((off, off_ckpts), (local, local_ckpts)):
        assert np.array_equal(on.weights, other.weights)
        assert on.rounds.drop(columns=timing).equals(other.rounds.drop(columns=timing))
        assert len(on_ckpts) == len(ckpts) == 4
        for mine, theirs in zip(on_ckpts, ckpts):
            assert _same(mine, theirs)
    # every row evaluated (eval.every=1), on rounds that differ: the checkpoints are not
    # all one state
    assert on.rounds["test_accuracy"].notna().all()
    assert not _same(on_ckpts[0]["server"], on_ckpts[1]["server"])
    # rows 1-3 were released once the next round had begun (beside its training); the
    # last after the loop. Without the overlap each row before its next round begins.
    assert on_begun == [1, 2, 3, 3]
    assert off_begun == [0, 1, 2, 3]


@pytest.mark.ray
def test_an_evaluation_runs_while_the_same_worker_trains(ray_session) -> None:
    """On one worker actor, an evaluation submitted after a long shard finishes
    first: it runs in the second thread, not after the shard."""
    from engine.simulation.preparation import make_executor, prepare

    cfg = load_config(
        overrides=[
            *RUN,
            "ray.executor=ray",
            "ray.num_workers=1",
            "ray.num_cpus_per_worker=1",
            "dataset.synthetic_mean_samples=200",
            "local.epochs=2",
            "local.batch_size=2",
        ]
    )
    prep = prepare(cfg)
    ex = make_executor(prep, run_name="overlap-probe")
    try:
        pool = ex.pool
        assert pool.overlaps_evaluation
        ray = pool._ray
        cohort, weights, public = pool.begin_round(0)
        worker = pool.workers[0]
        shard = worker.train_shard_counted.options(num_returns=2).remote(
            weights, 0, np.arange(40), public
        )[1]
        (evaluation,) = pool.evaluate_behind(weights, [(0, len(prep.dataset.y_test))])
        ready, _ = ray.wait([evaluation], timeout=120)
        assert ready, "the evaluation did not finish"
        shard_done, _ = ray.wait([shard], timeout=0)
        assert not shard_done, "the evaluation waited for the shard"
        assert ray.get(shard) == 40
        # the same sums as the training model's own evaluation
        assert ray.get(evaluation) == ray.get(worker.evaluate_slice.remote(weights, 0, 10**9))
    finally:
        ex.close()
