"""The public callback interface of a run: :class:`Callback`, what it receives at the end
of every round (:class:`RoundEnd`), and :class:`EarlyStopping`, one example.

dpfl's own per-round side effects (the checkpoint, the Parquet row, the dashboard's
metrics, Tune's report, the progress bar: :mod:`engine.simulation.callbacks`) are
callbacks on this interface. A user adds theirs from the Python API
(``simulate(config, callbacks=[...])``) or from YAML, by import path::

    callbacks: ["my_package.stopping:make_stopper"]   # module:name, called with no argument

**What a callback receives** (:class:`RoundEnd`), and nothing else:

* ``row``: the round's row without its non-public columns (those ending in
  ``_nonprivate``: diagnostics computed from clients' raw updates, the realised cohort
  size, wall-clock time, ...) — the round number, ε spent so far, test accuracy and loss
  on the public evaluation set, the privacy parameters, hyperparameters;
* ``weights``: the released global model after the round (a read-only float32 copy);
* ``round``, ``rounds`` (planned), ``replayed`` (a row released again on resume).

It never sees a client's update, a cohort, the noise, the server's or the clients'
state: everything it receives is a release or public, so whatever it computes is
post-processing and costs no privacy. For the same reason it may only:

* add public columns to the row (:meth:`RoundEnd.add_columns`): new names, not ending
  in ``_nonprivate``, scalar values; they are written to ``rounds.parquet`` with the row;
* stop the run after this round (:meth:`RoundEnd.stop`): the rounds released so far are
  the run, ε is the accountant's for them (a decision on public values is
  post-processing: the stopping rule costs nothing).

User callbacks run after the round's checkpoint is written, before its row is released
(so that a resumed run never computes a round a callback saw again) and, for a row
released again on resume, again (``replayed``): a callback that adds columns adds them
again.
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from engine.base.errors import ConfigError

#: The suffix of every non-public column (README: Results).
NONPRIVATE = "_nonprivate"


class Callback:
    """A per-round hook of a run. Override what you need."""

    def on_round_end(self, end: RoundEnd) -> None:
        """Called once per released round (and once for a row replayed on resume)."""

    def on_end(self) -> None:
        """Called once when the run ends (also after a failure)."""


class RoundEnd:
    """What a callback receives at the end of a round: public values only (module
    docstring), and the two things it may do."""

    def __init__(
        self,
        row: Mapping[str, Any],
        weights: Callable[[], np.ndarray],
        rounds: int,
        replayed: bool,
        add: Callable[[dict[str, Any]], None],
        stop: Callable[[str], None],
    ) -> None:
        public = {k: v for k, v in row.items() if not str(k).endswith(NONPRIVATE)}
        self.row: Mapping[str, Any] = MappingProxyType(public)
        self.round = int(row["round"])
        self.rounds = int(rounds)
        self.replayed = bool(replayed)
        self._weights, self._add, self._stop = weights, add, stop

    @property
    def weights(self) -> np.ndarray:
        """The released global model after this round, flat float32, read-only."""
        w = np.array(self._weights(), dtype=np.float32)
        w.flags.writeable = False
        return w

    def add_columns(self, **columns: Any) -> None:
        """Add public columns to this round's row (new names, scalar values)."""
        for name, value in columns.items():
            if name.endswith(NONPRIVATE) or name in self.row:
                raise ValueError(
                    f"callback column {name!r}: a new public column may not end in "
                    f"{NONPRIVATE} nor replace one of the row's"
                )
            if not isinstance(value, (bool, int, float, str, type(None), np.number)):
                raise ValueError(f"callback column {name!r}: {value!r} is not a scalar")
        self._add(dict(columns))
        self.row = MappingProxyType({**self.row, **columns})

    def stop(self, reason: str) -> None:
        """Stop the run after this round (its row is released; no later round is)."""
        self._stop(str(reason))


class EarlyStopping(Callback):
    """Stop when the public ``metric`` has not improved by more than ``min_delta`` for
    ``patience`` evaluations (rows where it is NaN, not evaluated, are skipped). Adds
    ``early_stopping_best``, the best value so far, to every evaluated row."""

    def __init__(
        self,
        metric: str = "test_accuracy",
        patience: int = 3,
        mode: str = "max",
        min_delta: float = 0.0,
    ) -> None:
        if metric.endswith(NONPRIVATE):
            raise ValueError(
                f"EarlyStopping(metric={metric!r}): a stopping rule on a non-public column "
                "would make the rounds released depend on private data"
            )
        if mode not in ("max", "min") or patience < 1 or min_delta < 0:
            raise ValueError("EarlyStopping: mode max or min, patience >= 1, min_delta >= 0")
        self.metric, self.patience, self.mode, self.min_delta = metric, patience, mode, min_delta
        self.best = -math.inf if mode == "max" else math.inf
        self.waited = 0
        self.stopped_at: int | None = None

    def on_round_end(self, end: RoundEnd) -> None:
        value = end.row.get(self.metric)
        if value is None or not math.isfinite(float(value)):
            return  # not evaluated this round
        value = float(value)
        gain = value - self.best if self.mode == "max" else self.best - value
        if gain > self.min_delta:
            self.best, self.waited = value, 0
        else:
            self.waited += 1
        end.add_columns(early_stopping_best=self.best)
        if self.waited >= self.patience:
            self.stopped_at = end.round
            end.stop(f"{self.metric} did not improve for {self.patience} evaluations")


def load_callbacks(paths: tuple[str, ...] | list[str]) -> list[Callback]:
    """The callbacks named by import paths (``module:name``, or ``module.name``): a class
    or a function is called with no argument, an instance is copied (a fresh one per
    run). ConfigError naming ``callbacks[i]`` when one cannot be loaded."""
    out: list[Callback] = []
    for i, path in enumerate(paths):
        key = f"callbacks[{i}]={path!r}"
        module, sep, name = path.partition(":")
        if not sep:
            module, _, name = path.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"{key}: cannot import it ({e})") from None
        made = obj() if isinstance(obj, type) or (callable(obj) and not _is_callback(obj)) else obj
        if not _is_callback(made):
            raise ConfigError(f"{key}: {made!r} has no on_round_end(end) method")
        out.append(made if made is not obj else copy.deepcopy(obj))
    return out


def _is_callback(obj: Any) -> bool:
    return callable(getattr(obj, "on_round_end", None)) and not isinstance(obj, type)
