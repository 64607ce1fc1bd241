"""Remembered noise calibrations: equal to a fresh search, never trusted without the
accountant's check, keyed by every input."""

from __future__ import annotations

import json

import pytest

from engine.privacy import calibration_store as store
from engine.privacy.accounting import PLD_REPORT_DISCRETIZATION, SamplingSpec, compute_epsilon
from engine.privacy.resolve import _search_noise_multiplier, calibrate_noise_multiplier

SPEC = SamplingSpec("poisson", 1000, rate=0.1)
TARGET, DELTA, ROUNDS = 3.0, 1e-4, 12


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    store.forget_in_process()
    yield tmp_path / "calibration"
    store.forget_in_process()


def _files(folder):
    return sorted(folder.glob("*.json")) if folder.exists() else []


def test_remembered_answer_equals_a_fresh_search(fresh_store) -> None:
    oracle = _search_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS, "rdp", 1e-4)
    first = calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS)
    (entry,) = _files(fresh_store)
    store.forget_in_process()  # the next call reads the disk
    again = calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS)
    assert first == oracle and again == oracle  # bit for bit
    assert json.loads(entry.read_text())["noise_multiplier"] == oracle
    assert compute_epsilon(again, SPEC, ROUNDS, DELTA) <= TARGET


def test_a_remembered_z_that_misses_the_target_is_never_used(fresh_store) -> None:
    honest = calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS)
    (entry,) = _files(fresh_store)
    stored = json.loads(entry.read_text())
    weak = 0.5 * honest  # too little noise: epsilon far above the target
    assert compute_epsilon(weak, SPEC, ROUNDS, DELTA) > TARGET
    entry.write_text(json.dumps({"key": stored["key"], "noise_multiplier": weak}))
    store.forget_in_process()
    z = calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS)
    assert z == honest
    assert compute_epsilon(z, SPEC, ROUNDS, DELTA, "rdp", PLD_REPORT_DISCRETIZATION) <= TARGET
    # ... and the corrected answer replaced the bad one.
    assert json.loads(entry.read_text())["noise_multiplier"] == honest


def test_an_entry_is_read_only_under_its_own_key(fresh_store) -> None:
    z12 = calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS)
    (entry,) = _files(fresh_store)
    key13 = store.calibration_key(rounds=13)
    assert key13 != json.loads(entry.read_text())["key"]
    # A file whose stored key differs from the one asked for is ignored, even at its name.
    entry.write_text(json.dumps({"key": key13, "noise_multiplier": 99.0}))
    store.forget_in_process()
    assert calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS) == z12
    # Every input is part of the key: other rounds, delta or rate give other answers.
    z13 = calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS + 1)
    z_delta = calibrate_noise_multiplier(TARGET, DELTA / 10, SPEC, ROUNDS)
    z_rate = calibrate_noise_multiplier(TARGET, DELTA, SamplingSpec("poisson", 1000, 0.2), ROUNDS)
    assert z13 > z12 and z_delta > z12 and z_rate > z12
    assert len(_files(fresh_store)) == 4


def test_off_keeps_nothing_on_disk_and_unwritable_is_harmless(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DPFL_CACHE_DIR", "off")
    store.forget_in_process()
    assert store.store_dir() is None
    z = calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder would go")
    monkeypatch.setenv("DPFL_CACHE_DIR", str(blocker))
    store.forget_in_process()
    assert calibrate_noise_multiplier(TARGET, DELTA, SPEC, ROUNDS) == z
    assert blocker.read_text() == "a file where the folder would go"
    store.forget_in_process()


@pytest.mark.parametrize(
    "spec",
    [
        SamplingSpec("poisson", 1000, rate=0.1),
        SamplingSpec("poisson", 50_000, rate=0.003),
        SamplingSpec("fixed", 200, cohort_size=20),
    ],
    ids=["poisson", "poisson-small-q", "fixed"],
)
def test_remembered_one_round_rdp_gives_the_library_epsilon_bit_for_bit(spec) -> None:
    """compute_epsilon and EpsilonTracker reuse one round's RDP curve (kept per
    process); the oracle is a fresh dp-accounting accountant composing the rounds."""
    from engine.privacy.accounting import EpsilonTracker, make_accountant, round_event

    for z in (0.7, 1.3):
        tracker = EpsilonTracker(z, spec, DELTA, "rdp")
        for rounds in (1, 7, 300):
            acc = make_accountant("rdp", spec)
            acc.compose(round_event(z, spec), rounds)
            oracle = float(acc.get_epsilon(DELTA))
            assert compute_epsilon(z, spec, rounds, DELTA) == oracle
            assert compute_epsilon(z, spec, rounds, DELTA) == oracle  # remembered
            assert tracker.epsilon(rounds) == oracle
