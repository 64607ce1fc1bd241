"""Workers per GPU from measured memory (the arithmetic; the probe needs a real GPU)."""

from __future__ import annotations

import pytest

from engine.runtime.resources import GpuMeasurement, measure_worker_gpu, workers_per_gpu

GiB = 2**30


def test_workers_fit_in_free_memory_with_margin() -> None:
    m = GpuMeasurement("test", 80 * GiB, 79 * GiB, 3 * GiB)
    k = workers_per_gpu(m, safety=0.2)
    assert k == 21  # floor(79 * 0.8 / 3)
    assert k * m.worker_peak_bytes <= m.free_bytes * 0.8
    assert (k + 1) * m.worker_peak_bytes > m.free_bytes * 0.8


def test_packing_is_capped_and_a_worker_that_cannot_fit_is_an_error() -> None:
    assert workers_per_gpu(GpuMeasurement("t", GiB, GiB, 1024), 0.0, max_workers=8) == 8
    with pytest.raises(ValueError, match="gpu_memory_safety=0.5"):
        workers_per_gpu(GpuMeasurement("t", 16 * GiB, 10 * GiB, 6 * GiB), 0.5)


@pytest.mark.ray
def test_memory_packing_never_guesses_on_a_gpu_it_cannot_measure(
    ray_session, small_overrides
) -> None:
    """CI's Ray declares one fake GPU: the probe lands on it, finds no CUDA device and
    the executor refuses to start rather than packing workers by a guess."""
    import torch

    from engine.config import load_config
    from engine.simulation import make_executor, prepare

    if torch.cuda.is_available():
        pytest.skip("real GPU: covered by test_probe_measures_a_real_gpu")
    assert ray_session.cluster_resources().get("GPU", 0) >= 1
    cfg = load_config(
        overrides=[*small_overrides, "ray.executor=ray", "ray.gpu_packing=memory", "rounds=1"]
    )
    with pytest.raises(Exception, match="needs a visible CUDA GPU"):
        make_executor(prepare(cfg))


@pytest.mark.gpu
def test_probe_measures_a_real_gpu() -> None:
    m = measure_worker_gpu("cnn", (1, 28, 28), 10, batch_size=10)
    assert 0 < m.worker_peak_bytes < m.free_bytes <= m.total_bytes
    assert workers_per_gpu(m, 0.2) >= 1


# ----------------------------------------------------------- where workers train


def test_worker_device_follows_the_gpu_ray_assigned() -> None:
    """``auto`` trains on the CPU when Ray gave the worker no GPU, ``cpu`` always does,
    and a GPU that was asked for but that torch cannot use is an error naming the key
    and the GPU ids, never a silent CPU fallback."""
    import torch

    from engine.federated.worker_model import resolve_worker_device

    assert resolve_worker_device("auto", gpu_ids=[]) == torch.device("cpu")
    assert resolve_worker_device("cpu", gpu_ids=[0]) == torch.device("cpu")
    with pytest.raises(ValueError, match="ray.worker_device='tpu'"):
        resolve_worker_device("tpu", gpu_ids=[])
    if torch.cuda.is_available():
        assert resolve_worker_device("auto", gpu_ids=[0]) == torch.device("cuda", 0)
        assert resolve_worker_device("cuda", gpu_ids=[]) == torch.device("cuda", 0)
        return
    with pytest.raises(
        RuntimeError, match=r"ray.worker_device=auto: Ray gave this worker GPU ids \[3\]"
    ):
        resolve_worker_device("auto", gpu_ids=[3])
    with pytest.raises(RuntimeError, match="ray.worker_device=cuda: torch.cuda.is_available"):
        resolve_worker_device("cuda", gpu_ids=[])


def test_worker_device_is_validated_in_the_config() -> None:
    from engine.config import ConfigError, load_config

    assert load_config(overrides=[]).ray.worker_device == "auto"
    with pytest.raises(ConfigError, match="ray.worker_device"):
        load_config(overrides=["ray.worker_device=gpu"])


def test_vectorised_groups_are_sized_for_the_workers_gpu_share(monkeypatch) -> None:
    """Four workers sharing a GPU (num_gpus 0.25) must not each size their groups for
    the whole card's free memory."""
    import torch

    from engine.federated.vectorized import _available_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 16 * GiB))
    cuda = torch.device("cuda", 0)
    assert _available_bytes(cuda, 0.25) == 4 * GiB
    assert _available_bytes(cuda, 0.0) == 10 * GiB  # not a Ray worker: what is free
    assert _available_bytes(cuda, 1.0) == 10 * GiB  # a whole GPU: what is free
    assert _available_bytes(cuda, 0.75) == 10 * GiB  # free is less than the share


@pytest.mark.ray
def test_a_worker_given_a_gpu_that_torch_cannot_use_refuses_to_start(
    ray_session, small_overrides
) -> None:
    """CI's Ray declares one fake GPU: a worker with half of it gets GPU id 0 from Ray,
    torch finds no CUDA device, and the run fails naming ray.worker_device; with
    ``ray.worker_device=cpu`` the same worker trains on the CPU. (One worker: a second
    would only start another process that fails or trains the same way.)"""
    import torch

    from engine.config import load_config
    from engine.simulation import make_executor, prepare

    if torch.cuda.is_available():
        pytest.skip("real GPU: covered by test_gpu_workers_match_cpu_workers")
    base = [
        *small_overrides,
        "ray.executor=ray",
        "ray.num_workers=1",
        "ray.num_gpus_per_worker=0.5",
        "ray.num_cpus_per_worker=0.5",
        "ray.max_worker_restarts=0",
        "rounds=1",
    ]
    with pytest.raises(Exception, match="ray.worker_device=auto: Ray gave this worker GPU ids"):
        make_executor(prepare(load_config(overrides=base)))
    ex = make_executor(prepare(load_config(overrides=[*base, "ray.worker_device=cpu"])))
    try:
        assert ex.pool.worker_devices == ["cpu"]
    finally:
        ex.close()


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["dp_fedavg", "dp_fedsam", "fedsmp_randk", "dp2_fedsam"])
def test_gpu_workers_match_cpu_workers(small_overrides, algorithm) -> None:
    """Same run on cuda and on the CPU: same ε (noise and sampling come from CPU
    streams), final weights equal to float32 rounding; two cuda runs bit-identical."""
    import numpy as np

    from engine.config import load_config
    from engine.simulation import simulate

    def run(device: str):
        cfg = load_config(
            overrides=[*small_overrides, f"algorithm={algorithm}", f"ray.worker_device={device}"]
        )
        return simulate(cfg, write=False)

    cpu, gpu, again = run("cpu"), run("cuda"), run("cuda")
    assert np.array_equal(gpu.weights, again.weights)  # reproducible from the seed
    assert gpu.final_epsilon == cpu.final_epsilon
    assert np.linalg.norm(gpu.weights - cpu.weights) <= 1e-3 * max(
        float(np.linalg.norm(cpu.weights)), 1.0
    )


@pytest.mark.ray
def test_default_gpu_share_spreads_workers_only_over_usable_gpus(ray_session, monkeypatch) -> None:
    """``ray.num_gpus_per_worker=0`` with ``worker_device=auto`` uses the cluster's GPUs
    (1/num_workers of a GPU each, at most 1) only when this process can use CUDA: CI's
    Ray declares one GPU that torch cannot use, and the workers stay on CPUs."""
    import torch

    from engine.config import load_config
    from engine.runtime.resources import default_gpu_share, plan_gpu_share

    assert ray_session.cluster_resources().get("GPU", 0) == 1
    cfg = load_config(overrides=["ray.num_workers=2"]).ray
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_gpu_share(2) == 0.0
    assert plan_gpu_share(cfg, "mlp", None, 8) == (0.0, {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_gpu_share(2) == 0.5
    assert default_gpu_share(1) == 1.0
    assert plan_gpu_share(cfg, "mlp", None, 8)[0] == 0.5
    explicit = load_config(overrides=["ray.num_workers=2", "ray.worker_device=cpu"]).ray
    assert plan_gpu_share(explicit, "mlp", None, 8) == (0.0, {})


@pytest.mark.gpu
@pytest.mark.ray
def test_default_config_trains_on_a_usable_gpu(ray_session, small_overrides) -> None:
    """With a GPU the driver can use, the default ``ray.num_gpus_per_worker=0`` and
    ``worker_device=auto`` put the workers on it (0.5 GPU each for 2 workers)."""
    from engine.config import load_config
    from engine.simulation import make_executor, prepare

    cfg = load_config(
        overrides=[*small_overrides, "ray.executor=ray", "ray.num_cpus_per_worker=0.5"]
    )
    ex = make_executor(prepare(cfg))
    try:
        assert ex.pool.gpu_plan["num_gpus_per_worker"] == 0.5
        assert all(d.startswith("cuda") for d in ex.pool.worker_devices), ex.pool.worker_devices
    finally:
        ex.close()
