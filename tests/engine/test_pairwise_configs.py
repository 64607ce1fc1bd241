"""Valid configurations run; invalid ones are refused before any work (issue 47, item 6).

All pairs of ten dimensions (recipe × model × data × partition × sampling × executor ×
on-demand population × adaptive clipping × canary audit × secure noise), 3 rounds each,
through ``dpfl run`` in process. The rows come from a covering array built here
(:func:`covering_array`, a seeded greedy AETG-style generator): every pair of values
that can appear in a valid configuration appears in a row that runs, and every pair
that cannot appears in a row that is refused.

Which combinations are invalid is this test's own oracle (:func:`expected_refusal`,
each rule with its reason), written from the documented constraints, not from the
engine's answers: a valid row must exit 0 with 3 rounds and a finite ε (for a private
recipe); an invalid row must exit 2 with one line naming a key of an applicable rule,
no traceback, and no folder written. A crash, an unexpected refusal or an unnoticed
invalid combination all fail.

Executor ``ray``: the row passes the checks ``prepare`` and ``dpfl run`` make for Ray
only (the device, Ray's start settings, the workers' fit: no Ray is started) and runs
in process, where Ray adds nothing to what is checked here (the Ray and in-process
executors give bit-identical rounds: ``tests/integration/test_ray_executor.py``).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from engine.cli import main
from engine.config import load_config

Row = dict[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]

FACTORS: dict[str, list[Any]] = {
    "algorithm": [
        "fedavg",
        "fedsam",
        "dp_fedavg",
        "dp_fedavg_blur",
        "dp_fedavg_blur_lus",
        "fedsmp_randk",
        "fedsmp_topk",
        "dp_fed_ls",
        "dp_fedsam",
        "dp_fedsam_topk",
        "dp2_fedsam",
        "dp_fedpgn",
        "dp_fedpgn_ls",
        "dp_ftrl",
        "dp_bandmf",
    ],
    "model": ["logreg", "mlp", "cnn", "char_lstm"],
    "data": ["synthetic", "digits"],
    "partition": ["iid", "dirichlet", "natural"],
    "sampling": ["poisson", "fixed"],
    "executor": ["local", "ray"],
    "on_demand": [False, True],
    "adaptive": [False, True],
    "audit": [False, True],
    "secure": [False, True],
}
NON_PRIVATE = ("fedavg", "fedsam")
#: Small enough for 3 rounds in a fraction of a second (the digits keep their 1,797 images).
BASE = [
    "rounds=3",
    "dataset.num_clients=20",
    "dataset.synthetic_dim=12",
    "dataset.synthetic_mean_samples=8",
    "local.steps=2",
    "local.batch_size=16",
    "eval.every=3",
]


def overrides(row: Row) -> list[str]:
    """The ``--set`` values of a row (the executor is given separately)."""
    out = [
        *BASE,
        f"algorithm={row['algorithm']}",
        f"model.name={row['model']}",
        f"dataset.name={row['data']}",
        f"dataset.partition={row['partition']}",
    ]
    if row["sampling"] == "fixed":
        out += ["sampling.mode=fixed", "sampling.cohort_size=5"]
    else:
        out += ["sampling.rate=0.3"]
    if row["on_demand"]:
        out.append("dataset.materialize=false")
    if row["adaptive"]:  # a count noise that this small a cohort's budget allows
        out += ["privacy.clip_mode=adaptive", "privacy.clip_count_stddev=2"]
    if row["audit"]:
        out.append("eval.audit_canaries=3")
    if row["secure"]:
        out.append("privacy.secure_noise=true")
    return out


def expected_refusal(row: Row) -> list[list[str]]:
    """The rules a row breaks, each as the words its one-line refusal must hold (empty:
    a valid row). The reasons are the documented constraints:"""
    broken: list[list[str]] = []
    private = row["algorithm"] not in NON_PRIVATE
    if row["on_demand"] and not (row["data"] == "synthetic" and row["partition"] == "natural"):
        broken.append(["dataset.materialize"])  # on-demand clients: synthetic natural only
    if row["data"] == "digits" and row["partition"] == "natural":
        broken.append(["dataset.partition"])  # the digits have no natural clients
    if not private:  # a non-private recipe would silently ignore these privacy keys
        for key, on in (
            ("privacy.clip_mode", row["adaptive"]),
            ("eval.audit_canaries", row["audit"]),
            ("privacy.secure_noise", row["secure"]),
        ):
            if on:
                broken.append([key, "not private"])
    if row["model"] == "cnn" and row["data"] == "synthetic":
        broken.append(["model.name='cnn'"])  # a convolution needs images, not features
    if row["model"] == "char_lstm":
        broken.append(["model.name='char_lstm'"])  # token ids; both sources give floats
    if row["algorithm"] == "dp2_fedsam" and row["model"] == "logreg":
        broken.append(["algorithm=dp2_fedsam", "model.name=logreg"])  # all head, no body
    if row["algorithm"] in ("dp_ftrl", "dp_bandmf"):  # correlated noise
        if row["secure"]:
            broken.append(["privacy.secure_noise", row["algorithm"]])  # its noise state is kept
        if row["adaptive"]:
            broken.append(["privacy.clip_mode", "correlated noise"])  # count not accounted
    return broken


def _pairs(row: Row, names: list[str]) -> set[Pair]:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}


def covering_array(
    factors: dict[str, list[Any]],
    targets: set[Pair],
    allowed: Callable[[Row], bool],
    seed: int = 0,
    tries: int = 24,
) -> tuple[list[Row], set[Pair]]:
    """Rows, each ``allowed``, together holding every pair of ``targets``; and the
    target pairs that no allowed row was found to hold.

    Greedy (AETG): each new row starts from an uncovered pair and gives every other
    factor the value that covers most uncovered pairs with the values chosen so far
    (ties broken by a seeded draw); of ``tries`` such rows that are allowed, the one
    covering most is kept. A pair none of them could hold is tried again with random
    completions, then declared impossible."""
    rng = random.Random(seed)
    names = list(factors)
    order = {n: i for i, n in enumerate(names)}

    def key(f: str, v: Any, g: str, w: Any) -> Pair:
        return ((f, v), (g, w)) if order[f] < order[g] else ((g, w), (f, v))

    uncovered = set(targets)
    rows: list[Row] = []
    impossible: set[Pair] = set()
    while uncovered - impossible:
        todo = sorted(uncovered - impossible, key=repr)
        best: Row | None = None
        best_gain = -1
        for _ in range(tries):
            (fa, va), (fb, vb) = rng.choice(todo)
            row: Row = {fa: va, fb: vb}
            rest = [n for n in names if n not in row]
            rng.shuffle(rest)
            for f in rest:
                values = list(factors[f])
                rng.shuffle(values)
                row[f] = max(
                    values, key=lambda v: sum(key(f, v, g, w) in uncovered for g, w in row.items())
                )
            row = {n: row[n] for n in names}
            gain = len(_pairs(row, names) & uncovered)
            if allowed(row) and gain > best_gain:
                best, best_gain = row, gain
        if best is None:
            pair = todo[0]
            for _ in range(400):
                row = {n: rng.choice(factors[n]) for n in names}
                row.update(dict(pair))
                if allowed(row):
                    best = row
                    break
            if best is None:
                impossible.add(pair)
                continue
        rows.append(best)
        uncovered -= _pairs(best, names)
    return rows, impossible


def all_pairs(factors: dict[str, list[Any]]) -> set[Pair]:
    names = list(factors)
    return {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
    }


def plan_rows(seed: int = 0) -> tuple[list[Row], list[Row], set[Pair]]:
    """(valid rows covering every pair a valid row can hold, invalid rows covering every
    other pair, the pairs no valid row can hold)."""
    every = all_pairs(FACTORS)
    valid, invalid_pairs = covering_array(FACTORS, every, lambda r: not expected_refusal(r), seed)
    refused, never = covering_array(
        FACTORS, invalid_pairs, lambda r: bool(expected_refusal(r)), seed
    )
    assert not never  # every pair appears in some row
    return valid, refused, invalid_pairs


def test_covering_array_covers_every_pair() -> None:
    """The generator's own check: the rows hold every pair of every two factors (an
    independent count over all rows), valid rows only valid combinations."""
    valid, refused, invalid_pairs = plan_rows()
    names = list(FACTORS)
    held = set().union(*(_pairs(r, names) for r in valid + refused))
    assert held == all_pairs(FACTORS)
    assert all(not expected_refusal(r) for r in valid)
    assert all(expected_refusal(r) for r in refused)
    runnable = set().union(*(_pairs(r, names) for r in valid))
    assert runnable == all_pairs(FACTORS) - invalid_pairs  # each valid pair runs somewhere
    # small: the valid array is within a third of the lower bound (largest two factors)
    assert len(valid) <= 1.34 * len(FACTORS["algorithm"]) * len(FACTORS["model"])


VALID, REFUSED, _ = plan_rows()


def _run(row: Row, tmp_path: Path, capsys) -> tuple[int, list[str], Path]:
    out = tmp_path / "run"
    argv = ["run", "-q", "--executor", "local", "--out", str(out)]
    for o in overrides(row):
        argv += ["--set", o]
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as e:
        status = int(e.code or 0)
    err = capsys.readouterr().err.strip().splitlines()
    return status, [line for line in err if not line.startswith("dpfl: warning: ")], out


@pytest.mark.parametrize("index", range(len(VALID)), ids=[f"valid{i}" for i in range(len(VALID))])
def test_valid_combination_runs(index: int, tmp_path: Path, capsys) -> None:
    row = VALID[index]
    if row["executor"] == "ray":  # what prepare and dpfl run check for Ray only
        from engine.cli.common import check_resources
        from engine.simulation.validation import check_environment

        on_ray = load_config(overrides=[*overrides(row), "ray.executor=ray"])
        check_environment(on_ray)  # the device, Ray's start settings (no Ray started)
        check_resources(on_ray)
    status, err, out = _run(row, tmp_path, capsys)
    assert status == 0 and err == [], (json.dumps(row), err)
    rows = pd.read_parquet(out / "rounds.parquet")
    assert list(rows["round"]) == [1, 2, 3], json.dumps(row)
    if row["algorithm"] not in NON_PRIVATE:
        eps = list(rows["epsilon"])
        assert all(math.isfinite(e) and e > 0 for e in eps) and eps == sorted(eps)
        want = "secure" if row["secure"] else "seeded"
        assert all(want in str(r) for r in rows["randomness"]), json.dumps(row)


@pytest.mark.parametrize(
    "index", range(len(REFUSED)), ids=[f"refused{i}" for i in range(len(REFUSED))]
)
def test_invalid_combination_is_refused_in_one_line(index: int, tmp_path: Path, capsys) -> None:
    row = REFUSED[index]
    status, err, out = _run(row, tmp_path, capsys)
    assert status == 2, (json.dumps(row), err)
    assert len(err) == 1 and err[0].startswith("dpfl: error: "), (json.dumps(row), err)
    assert any(all(w in err[0] for w in words) for words in expected_refusal(row)), (
        json.dumps(row),
        err[0],
    )
    assert not out.exists() and not any(tmp_path.iterdir())  # nothing written
