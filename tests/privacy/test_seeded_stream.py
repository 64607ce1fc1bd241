"""The seeded noise stream (engine.privacy.rng.SeededStream): blocks of PCG64 values,
the same for any number of threads, with the full seed's entropy (docs/architecture.md,
"Noise streams")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.privacy import rng as rngs
from engine.privacy.kernels import gaussian_noise

B = rngs.NORMAL_BLOCK


def oracle(seed: int, key: tuple[int, ...], n: int) -> np.ndarray:
    """The stream's definition restated block by block, with no threads."""
    parts = []
    for j in range(-(-n // B)):
        ss = np.random.SeedSequence(seed, spawn_key=(len(key), *key, j))
        parts.append(np.random.Generator(np.random.PCG64(ss)).standard_normal(B))
    return np.concatenate(parts)[:n] if parts else np.empty(0)


@pytest.mark.parametrize("n", [0, 1, 1000, B, B + 1, 3 * B + 12_345])
def test_values_are_the_blocks_definition_for_any_thread_count(n: int) -> None:
    stream = rngs.SeededStream(11, (rngs.NOISE, 4))
    expected = oracle(11, (rngs.NOISE, 4), n)
    for threads in (1, 2, 3, 8):
        got = stream.standard_normal(n, threads=threads)
        assert got.dtype == np.float64 and got.shape == (n,)
        assert np.array_equal(got, expected), threads


def test_a_shorter_draw_is_a_prefix_of_a_longer_one() -> None:
    stream = rngs.SeededStream(5, (rngs.NOISE, 0))
    long = stream.standard_normal(2 * B + 77)
    assert np.array_equal(stream.standard_normal(B + 3), long[: B + 3])


def test_keys_of_different_length_and_seeds_2_pow_32_apart_differ() -> None:
    # torch's CPU generator keeps only a seed's low 32 bits: these two collide there
    g1, g2 = rngs.torch_gen(0, rngs.NOISE, 0), rngs.torch_gen(0, rngs.NOISE, 0)
    g2.manual_seed(g1.initial_seed() + 2**32)
    assert torch.equal(torch.randn(8, generator=g1), torch.randn(8, generator=g2))
    seed = 123
    draws = [
        rngs.SeededStream(seed, (rngs.NOISE, 5)).standard_normal(8),
        rngs.SeededStream(seed + 2**32, (rngs.NOISE, 5)).standard_normal(8),
        rngs.SeededStream(seed, (rngs.NOISE, 5, 0)).standard_normal(8),
        rngs.SeededStream(seed, (rngs.NOISE, 5, 1)).standard_normal(8),
        rngs.SeededStream(seed, (rngs.NOISE, 6)).standard_normal(8),
    ]
    for i in range(len(draws)):
        for j in range(i):
            assert not np.array_equal(draws[i], draws[j]), (i, j)


def test_blocks_are_standard_normal_and_uncorrelated() -> None:
    x = rngs.SeededStream(2, (rngs.NOISE, 9)).standard_normal(4 * B)
    n = x.size
    assert abs(x.mean()) < 5 / np.sqrt(n)
    assert abs(x.var() - 1.0) < 5 * np.sqrt(2 / n)
    blocks = x.reshape(4, B)
    for i in range(4):
        for j in range(i):
            corr = float(np.corrcoef(blocks[i], blocks[j])[0, 1])
            assert abs(corr) < 5 / np.sqrt(B), (i, j, corr)
    # lag-1 correlation inside the stream, across block edges too
    assert abs(float(np.corrcoef(x[:-1], x[1:])[0, 1])) < 5 / np.sqrt(n)


def test_gaussian_noise_scales_the_streams_values_exactly() -> None:
    stream = rngs.SeededStream(8, (rngs.CLIP_COUNT, 3))
    base = torch.from_numpy(stream.standard_normal(B + 5))
    assert torch.equal(gaussian_noise(B + 5, 0.37, stream), base * 0.37)
    assert torch.equal(gaussian_noise(B + 5, 0.37, stream, torch.float32), (base * 0.37).float())
    assert torch.equal(gaussian_noise(7, 0.0, stream), torch.zeros(7, dtype=torch.float64))
    with pytest.raises(ValueError, match="n=-1"):
        stream.standard_normal(-1)


def test_thread_count_follows_the_cpus_ray_gives_a_process(monkeypatch) -> None:
    monkeypatch.setattr(rngs.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rngs._noise_threads() == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a one-CPU Ray task
    assert rngs._noise_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rngs._noise_threads() == 3
    monkeypatch.setattr(rngs.os, "cpu_count", lambda: 2)
    assert rngs._noise_threads() == 2


def test_a_forked_child_draws_with_threads_after_its_parent_did() -> None:
    import multiprocessing

    stream = rngs.SeededStream(4, (rngs.NOISE, 2))
    parent = stream.standard_normal(3 * B, threads=3)  # the parent drew with threads first
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply_async(_draw_in_child, (3 * B,)).get(timeout=60)
    assert np.array_equal(child, parent)


def _draw_in_child(n: int) -> np.ndarray:
    return rngs.SeededStream(4, (rngs.NOISE, 2)).standard_normal(n, threads=3)


def test_no_drawing_thread_outlives_a_draw() -> None:
    """`dpfl` exits without the interpreter's teardown only when no non-daemon thread
    is left (engine.cli.dispatch.console_main): a draw leaves none behind."""
    import threading

    rngs.SeededStream(6, (rngs.NOISE, 1)).standard_normal(3 * B, threads=3)
    left = [t.name for t in threading.enumerate() if t.name.startswith("dpfl-noise-block")]
    assert left == []
