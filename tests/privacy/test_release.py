"""What a run releases: public K, one release per round, release-mode randomness, δ,
and non-private side channels (issue 13 items 2, 5, 6, 7, 8)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import load_config
from engine.data.federated import FederatedDataset
from engine.simulation import prepare


def _dataset(sizes: list[int], seed: int = 0) -> FederatedDataset:
    """Clients with exactly ``sizes`` training examples (4 features, 2 classes)."""
    g = np.random.default_rng(seed)
    n = sum(sizes)
    x = g.normal(size=(n, 4)).astype(np.float32)
    y = g.integers(0, 2, n).astype(np.int64)
    bounds = np.cumsum([0, *sizes])
    train = [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])]
    test = [np.zeros(0, dtype=np.int64) for _ in sizes]
    return FederatedDataset("synthetic", x, y, train, test, x[:8], y[:8], 2, (4,))


def _pgn_steps(sizes: list[int], *extra: str) -> int | None:
    cfg = load_config(
        overrides=[
            "algorithm=dp_fedpgn",
            f"dataset.num_clients={len(sizes)}",
            "model.name=logreg",
            "local.epochs=1",
            "local.batch_size=16",
            "privacy.noise_multiplier=1.0",
            "ray.executor=local",
            *extra,
        ]
    )
    return prepare(cfg, _dataset(sizes)).steps


# ------------------------------------------------------------------ item 2: public K


def test_pgn_steps_do_not_depend_on_client_data() -> None:
    sizes = [16, 16, 64, 64, 64]
    k = _pgn_steps(sizes)
    assert k is not None and k >= 1
    assert _pgn_steps(sizes[:-1]) == k  # one client removed (the median changes)
    assert _pgn_steps([s * 4 for s in sizes]) == k  # every client larger
    assert _pgn_steps([1] * 5) == k
    assert _pgn_steps(sizes, "local.steps=3") == 3 == _pgn_steps(sizes[:-1], "local.steps=3")


# ------------------------------------------------------------------ item 7: default δ


@pytest.mark.parametrize("n", [10, 1000, 10**5])
def test_default_delta_keeps_n_delta_small(n: int) -> None:
    from engine.simulation import plan_privacy

    cfg = load_config(overrides=[f"dataset.num_clients={n}", "privacy.noise_multiplier=1.0"])
    delta = plan_privacy(cfg).delta
    assert 0 < delta and n * delta <= 0.01  # N^-1.1 gave N·δ = 0.5 at N = 1000


def test_large_delta_warns(small_overrides: list[str], recwarn) -> None:
    from engine.simulation import simulate

    base = [*small_overrides, "rounds=1", "privacy.noise_multiplier=1.0"]
    simulate(load_config(overrides=base), write=False)
    assert not [w for w in recwarn if "N·delta" in str(w.message)]
    with pytest.warns(UserWarning, match=r"privacy.delta=0.001 .*N·delta = 0.04"):
        simulate(load_config(overrides=[*base, "privacy.delta=1e-3"]), write=False)


# ------------------------------------------------------- item 5: one release per round


class Crash(Exception):
    """An injected crash."""


def _tracked_run(monkeypatch, cfg, events: list, crash: tuple[str, int] | None, resume=None):
    """simulate() recording ("computed", r) per finished round and ("released", r) per
    row written; ``crash=("before"|"after", r)`` raises around the write of row r."""
    import engine.simulation.runner as sim
    from engine.results import RoundWriter

    monkeypatch.undo()
    real_make, real_append = sim.make_executor, RoundWriter.append

    def make(*a, **k):
        ex = real_make(*a, **k)
        run_round = ex.run_round

        def counted(rnd: int) -> dict:
            row = run_round(rnd)
            events.append(("computed", rnd + 1))
            return row

        ex.run_round = counted
        return ex

    def append(self, row: dict) -> None:
        if crash == ("before", row["round"]):
            raise Crash("between the checkpoint and the row")
        real_append(self, row)
        events.append(("released", int(row["round"])))
        if crash == ("after", row["round"]):
            raise Crash("between the row and the next checkpoint")

    monkeypatch.setattr(sim, "make_executor", make)
    monkeypatch.setattr(RoundWriter, "append", append)
    return sim.simulate(cfg, resume=resume)


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_released_round_is_never_recomputed(monkeypatch, small_overrides, tmp_path, where):
    import pandas as pd

    from engine.simulation import load_run, simulate

    over = [*small_overrides, "rounds=4", "privacy.noise_multiplier=1.0"]
    full = simulate(load_config(overrides=[*over, f"out={tmp_path}/full"]))
    cfg = load_config(overrides=[*over, f"out={tmp_path}/crashed"])
    events: list = []
    with pytest.raises(Crash):
        _tracked_run(monkeypatch, cfg, events, (where, 2))
    config, state = load_run(tmp_path / "crashed")
    _tracked_run(monkeypatch, config, events, None, resume=state)
    for r in range(1, 5):
        released = events.index(("released", r))
        assert ("computed", r) not in events[released:], events  # never after its release
        assert events.count(("released", r)) == 1, events
    rows = pd.read_parquet(tmp_path / "crashed" / "rounds.parquet")
    assert list(rows["round"]) == [1, 2, 3, 4]
    cols = [c for c in rows.columns if not c.startswith("wall_time_s_nonprivate")]
    pd.testing.assert_frame_equal(rows[cols], full.rounds[cols])


def test_tune_refuses_sparse_checkpoints(tmp_path) -> None:
    from engine.config import ConfigError
    from tuning.plan import read_tune_file

    path = tmp_path / "t.yaml"
    path.write_text("tune:\n  checkpoint_every: 3\n")
    with pytest.raises(ConfigError, match=r"^tune.checkpoint_every=3: must be 1"):
        read_tune_file(str(path))
    path.write_text("tune:\n  checkpoint_every: 1\n")
    assert read_tune_file(str(path))[1] == {"checkpoint_every": 1}


# ------------------------------------------------------------ item 6: release mode


def _run(over: list[str], *extra: str, **kw):
    from engine.simulation import simulate

    return simulate(load_config(overrides=[*over, *extra]), **kw)


FIXED = ("sampling.mode=fixed", "sampling.cohort_size=8")


ALL = ("sampling.mode=fixed", "sampling.cohort_size=40")  # every client: only noise differs


@pytest.mark.parametrize("extra", [(), FIXED, ALL, (*ALL, "algo.noise_site=client")])
def test_secure_runs_differ_seeded_runs_repeat(small_overrides, tmp_path, extra) -> None:
    import json

    import pandas as pd

    over = [*small_overrides, "rounds=2", "privacy.noise_multiplier=1.0", *extra]
    a, b = _run(over, write=False), _run(over, write=False)
    assert np.array_equal(a.weights, b.weights)
    assert (a.rounds["randomness"] == "seeded-simulation").all()
    secure = [*over, "privacy.secure_noise=true"]
    c = _run(secure, f"out={tmp_path}/c")
    d = _run(secure, write=False)
    assert not np.array_equal(c.weights, d.weights)
    assert not np.array_equal(c.weights, a.weights)  # the recorded seed does not give it
    written = pd.read_parquet(tmp_path / "c" / "rounds.parquet")
    assert (written["randomness"] == "secure").all()
    assert json.loads((tmp_path / "c" / "config.json").read_text())["privacy"]["randomness"] == (
        "secure"
    )


def test_secure_randomness_comes_only_from_os_entropy(monkeypatch, small_overrides) -> None:
    """With os.urandom replaced by a fixed stream two secure runs coincide: the OS
    CSPRNG is the only source of their cohorts and noise, and it is never recorded."""
    import engine.privacy.rng as rngs

    over = [*small_overrides, "rounds=2", "privacy.noise_multiplier=1.0"]
    over += ["privacy.secure_noise=true"]

    def fake(seed: int):
        g = np.random.default_rng(seed)
        return lambda n: g.bytes(n)

    monkeypatch.setattr(rngs.os, "urandom", fake(7))
    a = _run(over, write=False)
    monkeypatch.setattr(rngs.os, "urandom", fake(7))
    b = _run(over, write=False)
    monkeypatch.setattr(rngs.os, "urandom", fake(8))
    c = _run(over, write=False)
    assert np.array_equal(a.weights, b.weights)
    assert not np.array_equal(a.weights, c.weights)


def test_secure_samplers_have_the_right_distributions() -> None:
    from scipy import stats

    from engine.federated.server import sample_cohort
    from engine.privacy.accounting import SamplingSpec
    from engine.privacy.rng import SecureRandom

    src = SecureRandom()
    z = src.standard_normal(200_001)
    assert len(z) == 200_001
    assert stats.kstest(z, "norm").pvalue > 1e-4
    assert abs(z.mean()) < 5 / np.sqrt(len(z)) and abs(z.var() - 1) < 0.02
    u = src.uniform(100_000)
    assert 0 < u.min() and u.max() < 1 and stats.kstest(u, "uniform").pvalue > 1e-4
    spec = SamplingSpec("poisson", 1000, rate=0.1)
    sizes = [len(sample_cohort(spec, 0, r, secure=True)) for r in range(200)]
    assert abs(np.mean(sizes) - 100) < 5 * np.sqrt(90 / 200)  # binomial(1000, 0.1)
    fixed = SamplingSpec("fixed", 50, cohort_size=10)
    counts = np.zeros(50)
    for r in range(2000):
        cohort = sample_cohort(fixed, 0, r, secure=True)
        assert len(set(cohort.tolist())) == 10 and cohort.max() < 50
        counts[cohort] += 1
    assert stats.chisquare(counts).pvalue > 1e-4  # every client equally likely
    capped = SamplingSpec("poisson", 200, rate=0.5, max_cohort=20)
    assert all(len(sample_cohort(capped, 0, r, secure=True)) == 20 for r in range(20))
