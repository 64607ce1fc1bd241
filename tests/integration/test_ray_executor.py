"""The Ray executor (client-worker actors; the server an actor or in the driver) equals
the in-process one."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import load_config
from engine.simulation import simulate

pytestmark = pytest.mark.ray


def _cfg(small_overrides, *extra: str):
    return load_config(
        overrides=[*small_overrides, "privacy.noise_multiplier=0.8", "model.name=mlp", *extra]
    )


@pytest.mark.parametrize("server", ["actor", "driver"])
def test_ray_equals_in_process_bit_for_bit(ray_session, small_overrides, server: str) -> None:
    extra = (
        "ray.num_workers=2",
        "ray.num_cpus_per_worker=0.5",
        "ray.num_gpus_per_worker=0.5",
        "ray.worker_device=cpu",
    )  # fractional-GPU scheduling (a fake GPU in CI, so training is told to stay on the CPU)
    local = simulate(_cfg(small_overrides, *extra), write=False)
    on_ray = simulate(
        _cfg(small_overrides, *extra, "ray.executor=ray", f"ray.server={server}"), write=False
    )
    assert np.array_equal(local.weights, on_ray.weights)
    cols = [
        "epsilon",
        "test_accuracy",
        "realised_cohort_size_nonprivate",
        "clipped_fraction_nonprivate",
    ]
    assert local.rounds[cols].equals(on_ray.rounds[cols])


def test_worker_count_changes_only_float_rounding(ray_session, small_overrides) -> None:
    """Client randomness is keyed by (seed, round, client): which worker trains which
    client changes the summation order only."""
    one = simulate(
        _cfg(small_overrides, "ray.executor=ray", "ray.num_workers=1", "ray.num_cpus_per_worker=1"),
        write=False,
    )
    two = simulate(
        _cfg(small_overrides, "ray.executor=ray", "ray.num_workers=2", "ray.num_cpus_per_worker=1"),
        write=False,
    )
    np.testing.assert_allclose(one.weights, two.weights, rtol=1e-5, atol=1e-6)
    assert list(one.rounds["realised_cohort_size_nonprivate"]) == list(
        two.rounds["realised_cohort_size_nonprivate"]
    )


def test_unschedulable_workers_fail_with_clear_error(
    ray_session, small_overrides, monkeypatch
) -> None:
    from engine.runtime import ray_pool

    monkeypatch.setattr(ray_pool, "ACTOR_START_TIMEOUT_S", 3.0)
    # 1.8 GPUs on a 1-GPU cluster. The GPU is fake (no CUDA), so the worker that is
    # scheduled is told to train on the CPU: under ray.worker_device=auto its constructor
    # would raise, free its 0.9 GPU, and let the second worker start (and raise) too,
    # racing the timeout this test is about.
    cfg = _cfg(
        small_overrides,
        "ray.executor=ray",
        "ray.num_workers=2",
        "ray.num_gpus_per_worker=0.9",
        "ray.worker_device=cpu",
    )
    with pytest.raises(RuntimeError, match=r"ray\.num_workers=2 .* could not all start"):
        simulate(cfg, write=False)


def test_server_placement_follows_ray_server(ray_session, small_overrides) -> None:
    """``auto`` keeps the server in the driver on this one-node Ray (no server actor is
    started); ``actor`` starts one; a bad value is refused naming the key."""
    from engine.config import ConfigError
    from engine.runtime.driver_server import DriverServer, server_in_driver

    assert server_in_driver("auto") and server_in_driver("driver")
    assert not server_in_driver("actor")
    assert not server_in_driver("auto", "ray://head:10001")  # the driver is outside
    seen: dict[str, object] = {}

    def grab(row, executor) -> None:
        seen["server"] = executor.pool.server

    for placement in ("auto", "actor"):
        # one worker and one round: where the server lives is all this run shows
        cfg = _cfg(
            small_overrides,
            "ray.executor=ray",
            f"ray.server={placement}",
            "ray.num_workers=1",
            "rounds=1",
        )
        simulate(cfg, write=False, on_round=grab)
        assert isinstance(seen["server"], DriverServer) == (placement == "auto")
    with pytest.raises(ConfigError, match=r"ray\.server.*'elsewhere'.*auto, actor or driver"):
        _cfg(small_overrides, "ray.server=elsewhere")
