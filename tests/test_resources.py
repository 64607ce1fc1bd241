"""Workers per GPU from measured memory (the arithmetic; the probe needs a real GPU)."""

from __future__ import annotations

import pytest

from engine.resources import GpuMeasurement, measure_worker_gpu, workers_per_gpu

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
    from engine.simulate import make_executor, prepare

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
