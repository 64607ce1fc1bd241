"""Public callbacks (issue 46): a user callback receives the round's public row and the
released model, may add public columns and may stop the run; early stopping on a public
metric stops exactly where its rule, applied to an uninterrupted run's rows, says, and
the stopped run is that run's prefix (rows and model), in process and on Ray (where the
stop arrives while the next round trains); callbacks load from YAML import paths."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml

from engine.cli import main
from engine.config import ConfigError, load_config
from engine.simulation import simulate
from engine.simulation.callbacks import Callback, EarlyStopping, RoundEnd

BASE = [
    "dataset.num_clients=30",
    "dataset.synthetic_mean_samples=16",
    "dataset.synthetic_dim=10",
    "sampling.rate=0.3",
    "eval.every=1",
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.noise_multiplier=1.0",
    "privacy.epsilon=null",
    "ray.num_workers=2",
]
LOCAL = [*BASE, "ray.executor=local"]
PATIENCE, MIN_DELTA, ROUNDS = 2, 0.02, 14


def expected_stop(accuracy: list[float]) -> int:
    """The round the rule stops after, applied here to an uninterrupted run's column:
    the first time the accuracy has not beaten its best by more than MIN_DELTA in
    PATIENCE evaluations in a row."""
    best, waited = -math.inf, 0
    for t, a in enumerate(accuracy, start=1):
        if a - best > MIN_DELTA:
            best, waited = a, 0
        else:
            waited += 1
        if waited >= PATIENCE:
            return t
    return len(accuracy)


class Spy(Callback):
    """Records what a callback receives and adds one public column."""

    def __init__(self) -> None:
        self.seen: list[RoundEnd] = []
        self.last_weights: np.ndarray | None = None

    def on_round_end(self, end: RoundEnd) -> None:
        self.seen.append(end)
        self.last_weights = end.weights
        end.add_columns(spy_round_squared=end.round**2)


def make_stopper() -> EarlyStopping:
    """The factory the YAML test names by import path."""
    return EarlyStopping("test_accuracy", patience=PATIENCE, min_delta=MIN_DELTA)


@pytest.fixture(scope="module")
def uninterrupted() -> pd.DataFrame:
    return simulate(load_config(overrides=[*LOCAL, f"rounds={ROUNDS}"]), write=False).rounds


def test_early_stopping_stops_where_its_rule_says(uninterrupted, tmp_path) -> None:
    k = expected_stop(list(uninterrupted["test_accuracy"]))
    assert k < ROUNDS  # the rule triggers within the run (it would else test nothing)
    stopper = make_stopper()
    config = load_config(overrides=[*LOCAL, f"rounds={ROUNDS}", f"out={tmp_path / 'run'}"])
    stopped = simulate(config, callbacks=[stopper])
    assert stopper.stopped_at == k and len(stopped.rounds) == k
    prefix = simulate(load_config(overrides=[*LOCAL, f"rounds={k}"]), write=False)
    assert np.array_equal(stopped.weights, prefix.weights)  # round k's model, released
    cols = ["epsilon", "test_accuracy", "train_loss_nonprivate"]
    pd.testing.assert_frame_equal(stopped.rounds[cols], uninterrupted[cols].iloc[:k])
    best = uninterrupted["test_accuracy"].iloc[:k].cummax()
    assert list(stopped.rounds["early_stopping_best"]) == list(best)  # its public column
    on_disk = pd.read_parquet(tmp_path / "run" / "rounds.parquet")
    assert list(on_disk["round"]) == list(range(1, k + 1))
    assert "early_stopping_best" in on_disk
    assert stopped.privacy["stopped_after_round"] == k
    assert stopped.privacy["final_epsilon"] == uninterrupted["epsilon"].iloc[k - 1]


@pytest.mark.ray
def test_early_stopping_on_ray_while_the_next_round_trains(uninterrupted, ray_session) -> None:
    """On Ray round t is released beside round t+1's training: the stop arrives with
    round t+1 under way, which is finished and not released; the run's model is round
    t's."""
    k = expected_stop(list(uninterrupted["test_accuracy"]))
    config = load_config(overrides=[*BASE, f"rounds={ROUNDS}", "ray.overlap_evaluation=true"])
    stopped = simulate(config, write=False, callbacks=[make_stopper()])
    prefix = simulate(load_config(overrides=[*LOCAL, f"rounds={k}"]), write=False)
    assert len(stopped.rounds) == k
    assert np.array_equal(stopped.weights, prefix.weights)


def test_a_callback_sees_public_values_only_and_adds_public_columns(tmp_path) -> None:
    spy = Spy()
    res = simulate(load_config(overrides=[*LOCAL, "rounds=3", f"out={tmp_path}"]), callbacks=[spy])
    assert [e.round for e in spy.seen] == [1, 2, 3] and spy.seen[0].rounds == 3
    for end in spy.seen:
        assert not [c for c in end.row if c.endswith("_nonprivate")]
        assert {"epsilon", "test_accuracy", "noise_multiplier"} <= set(end.row)
    nonprivate = {c for c in res.rounds.columns if c.endswith("_nonprivate")}
    assert nonprivate  # the row had them: the callback did not see them
    assert spy.last_weights is not None and np.array_equal(spy.last_weights, res.weights)
    assert not spy.last_weights.flags.writeable
    rows = pd.read_parquet(tmp_path / "rounds.parquet")
    assert list(rows["spy_round_squared"]) == [1, 4, 9]
    end = spy.seen[-1]
    for bad in ({"test_accuracy": 1.0}, {"x_nonprivate": 1.0}, {"arr": np.zeros(2)}):
        with pytest.raises(ValueError, match="callback column"):
            end.add_columns(**bad)


def test_early_stopping_refuses_a_non_public_metric() -> None:
    with pytest.raises(ValueError, match="non-public"):
        EarlyStopping("train_loss_nonprivate")


def test_callbacks_by_import_path_from_yaml(uninterrupted, tmp_path) -> None:
    k = expected_stop(list(uninterrupted["test_accuracy"]))
    path = tmp_path / "run.yaml"
    over = dict(item.split("=", 1) for item in [*LOCAL, f"rounds={ROUNDS}"])
    tree: dict = {}
    for key, value in over.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    tree["callbacks"] = [f"{__name__}:make_stopper"]
    path.write_text(yaml.safe_dump(tree))
    assert main(["run", "-q", "--config", str(path), "--out", str(tmp_path / "r")]) == 0
    rows = pd.read_parquet(tmp_path / "r" / "rounds.parquet")
    assert len(rows) == k and "early_stopping_best" in rows
    with pytest.raises(ConfigError, match=r"^callbacks\[0\]='no_such_module:x': cannot import"):
        simulate(load_config(overrides=[*LOCAL, "callbacks=[no_such_module:x]"]), write=False)


def test_a_replayed_row_reaches_user_callbacks_again(tmp_path) -> None:
    """A crash between a round's checkpoint and its row: on resume the row is released
    from the checkpoint, and a user callback sees it (replayed) and adds its column."""

    class Crash(Exception):
        pass

    saved: dict = {}

    def keep(state: dict, row: dict) -> None:
        saved["state"] = state
        if int(row["round"]) == 2:
            raise Crash  # after round 2's checkpoint, before its row

    out = tmp_path / "run"
    config = load_config(overrides=[*LOCAL, "rounds=3", f"out={out}"])
    with pytest.raises(Crash):
        simulate(config, on_checkpoint=keep)
    spy = Spy()
    simulate(config, resume=saved["state"], callbacks=[spy])
    assert [(e.round, e.replayed) for e in spy.seen] == [(2, True), (3, False)]
    rows = pd.read_parquet(out / "rounds.parquet")
    assert list(rows["round"]) == [1, 2, 3]
    assert list(rows["spy_round_squared"].iloc[1:]) == [4, 9]
