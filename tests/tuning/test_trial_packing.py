"""``tune.trials_per_gpu``: several trials share one GPU (issue 26), with Ray's fake GPUs.

The arithmetic (:func:`tuning.plan.pack_trials_per_gpu`) and what it is for: with
the packed shares, exactly ``trials_per_gpu`` trials' placement groups fit on one GPU at
once and one more does not, on a Ray instance that declares one (fake) GPU.
"""

from __future__ import annotations

import pytest

from engine.config import ConfigError, load_config
from tuning.plan import TRIALS_PER_GPU, pack_trials_per_gpu, trial_bundles


def cfg(*overrides: str):
    return load_config(overrides=list(overrides))


def test_shares_split_over_a_trials_workers() -> None:
    ray_ex = cfg("ray.executor=ray", "ray.num_workers=2")
    assert pack_trials_per_gpu(ray_ex, 4, 1.0).ray.num_gpus_per_worker == pytest.approx(1 / 8)
    local = cfg("ray.executor=local", "ray.num_workers=2")
    assert pack_trials_per_gpu(local, 3, 8.0).ray.num_gpus_per_worker == pytest.approx(1 / 3)
    assert TRIALS_PER_GPU >= 1


@pytest.mark.parametrize(
    "overrides",
    [
        ["ray.num_gpus_per_worker=0.5"],  # an explicit share wins
        ["ray.worker_device=cpu"],
        ["ray.gpu_packing=memory"],
    ],
)
def test_left_alone(overrides: list[str]) -> None:
    c = cfg(*overrides)
    assert pack_trials_per_gpu(c, 4, 1.0) is c


def test_no_gpu_no_change() -> None:
    c = cfg()
    assert pack_trials_per_gpu(c, 4, 0.0) is c


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True])
def test_bad_value_names_the_key(bad) -> None:
    with pytest.raises(ConfigError, match=r"tune\.trials_per_gpu="):
        pack_trials_per_gpu(cfg(), bad, 1.0)


@pytest.mark.parametrize(("executor", "per_gpu"), [("ray", 4), ("local", 3)])
def test_packed_trials_fit_one_fake_gpu(ray_session, executor: str, per_gpu: int) -> None:
    """``per_gpu`` trials' placement groups are placed together on the one GPU; one more
    waits (CPU shares are kept small so that only the GPU limits)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    ray = ray_session
    c = cfg(f"ray.executor={executor}", "ray.num_workers=2", "ray.num_cpus_per_worker=0.05")
    packed = pack_trials_per_gpu(c, per_gpu, float(ray.cluster_resources().get("GPU", 0)))
    bundles = trial_bundles(packed.ray, 0.05)
    assert sum(b.get("GPU", 0.0) for b in bundles) == pytest.approx(1 / per_gpu)
    groups = [placement_group(bundles) for _ in range(per_gpu + 1)]
    try:
        # Generous waits: on a loaded 2-core CI machine placing a group took over 30 s.
        assert all(g.wait(timeout_seconds=120) for g in groups[:per_gpu])
        # Feasible only once a trial ends: the GPU is fully held by the others.
        assert not groups[per_gpu].wait(timeout_seconds=1)
        assert ray.available_resources().get("GPU", 0.0) < 1e-3
        remove_placement_group(groups[0])
        assert groups[per_gpu].wait(timeout_seconds=120)
    finally:
        for g in groups:
            try:
                remove_placement_group(g)
            except Exception:  # noqa: BLE001 - already removed
                pass


def test_an_in_process_trial_sizes_its_groups_for_its_share(small_overrides) -> None:
    """A ``local`` trial (the in-process executor in the trial's process) passes its GPU
    share to its worker, so vectorised groups are sized for 1/trials_per_gpu of the card
    (``engine.federated.vectorized._available_bytes``), not for the whole card."""
    from engine.simulation import make_executor, prepare

    c = cfg(*small_overrides, "ray.executor=local")
    packed = pack_trials_per_gpu(c, 4, 1.0)
    assert make_executor(prepare(packed)).pool.worker.spec.gpu_share == pytest.approx(0.25)
    assert make_executor(prepare(c)).pool.worker.spec.gpu_share == 0.0
