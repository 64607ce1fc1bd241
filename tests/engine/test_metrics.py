"""Dashboard metrics: the values recorded per round and their tags."""

from __future__ import annotations

import math

import pytest

from engine.telemetry.metrics import RunMetrics, round_metrics


def test_round_metrics_values() -> None:
    row = {
        "epsilon": 1.25,
        "test_accuracy": 0.5,
        "realised_cohort_size_nonprivate": 30,
        "clipped_fraction_nonprivate": 0.2,
    }
    m = round_metrics(row, 1.5)
    assert m == {
        "seconds_per_round_nonprivate": 1.5,
        "epsilon_spent": 1.25,
        "test_accuracy": 0.5,
        "client_updates_per_second_nonprivate": 20.0,
        "clipped_fraction_nonprivate": 0.2,
    }


def test_unknown_values_are_omitted_not_nan() -> None:
    m = round_metrics({"epsilon": math.inf, "test_accuracy": math.nan}, 2.0)
    assert m == {"seconds_per_round_nonprivate": 2.0}


@pytest.mark.ray
def test_metrics_recorded_through_ray_with_run_tags(
    ray_session, small_overrides, monkeypatch
) -> None:
    """A run on Ray records one set of values per round; ε is the accountant's."""
    from engine.config import load_config
    from engine.simulation import simulate

    seen: list[dict] = []
    original = RunMetrics.record

    def spy(self, row, seconds):
        values = original(self, row, seconds)
        assert self.enabled and self.tags["run"] == "metrics-test"
        seen.append(values)
        return values

    monkeypatch.setattr(RunMetrics, "record", spy)
    cfg = load_config(
        overrides=[*small_overrides, "privacy.noise_multiplier=1.0", "ray.executor=ray"]
    )
    res = simulate(cfg, write=False, run_name="metrics-test")
    assert len(seen) == cfg.rounds
    assert [s["epsilon_spent"] for s in seen] == list(res.rounds["epsilon"])
    for s, n in zip(seen, res.rounds["realised_cohort_size_nonprivate"]):
        assert s["client_updates_per_second_nonprivate"] == pytest.approx(
            n / s["seconds_per_round_nonprivate"]
        )
