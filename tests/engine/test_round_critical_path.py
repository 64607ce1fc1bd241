"""Issue 26: work taken off a round's critical path changes no value, bit for bit.

* the server noise drawn while the round trains (``Server.prepare_noise``) equals the
  noise ``finish_round`` draws itself, and is used once, for its own round only;
* the chunked float64 scale-and-cast of clipping and the chunked float64 accumulation
  of a worker's partial sum equal the one-shot tensor expressions they replace;
* a :class:`engine.telemetry.phases.PhaseTimer` installed on an executor records phases and
  changes no result.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.config import load_config
from engine.privacy import kernels
from engine.privacy.kernels import add_float64_, clip_update
from engine.privacy.mechanism import GaussianMechanism
from engine.privacy.rng import NOISE, Randomness, SeededStream
from engine.simulation import make_executor, prepare
from engine.telemetry.phases import OFF, PhaseTimer, timed


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8).numpy()


@pytest.mark.parametrize("n", [5, kernels._CHUNK, 3 * kernels._CHUNK + 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scale_cast_equals_the_one_shot_expression(n: int, dtype: torch.dtype) -> None:
    """The chunked scale, cast and exact conversion back of clipping equal the one-shot
    expressions, for one factor and for factors applied in turn (the retries)."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.logspace(-30, 3, n)).to(dtype)
    x[::97] = -0.0
    wide, narrow = kernels.ClipScratch().buffers(x)
    for factors in ((0.3,), (1e-7,), (1.0 / 3.0,), (7.5e5,), (0.3, 1.0 / 3.0, 0.999999)):
        want = x.double()
        for f in factors:
            want = want * f
        want = want.to(dtype)
        kernels._scale_round_trip(wide, narrow, x, factors)
        assert np.array_equal(bits(narrow), bits(want))
        assert np.array_equal(bits(wide), bits(want.double()))


@pytest.mark.parametrize("n", [9, 2 * kernels._CHUNK + 5])
def test_add_float64_equals_add_(n: int) -> None:
    g = torch.Generator().manual_seed(1)
    total = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    total[::5] = -0.0
    x = torch.randn(n, generator=g) * 10.0
    x[::7] = -0.0
    want = total.clone()
    want.add_(x)
    add_float64_(total, x)
    assert np.array_equal(bits(total), bits(want))


def test_clip_update_unchanged_on_large_updates() -> None:
    """The chunked path of ``clip_update`` against the former expression, incl. ‖·‖ ≤ C."""
    g = torch.Generator().manual_seed(2)
    for scale in (1e-3, 1.0, 1e3):
        u = torch.randn(3 * kernels._CHUNK + 1, generator=g) * scale
        for c in (0.01, 0.5, 1.0):
            res = clip_update(u, c)
            norm = float(torch.linalg.vector_norm(u, dtype=torch.float64))
            if norm > c:
                first = kernels._first_factor(c, norm, u.dtype)
                ref, after = kernels._cast_within(u.double() * first, u.dtype, c)
                assert np.array_equal(bits(res.update), bits(ref))
                assert res.out_norm == after <= c
            else:
                assert res.update is u


def _former_cast_within(scaled: torch.Tensor, dtype: torch.dtype, clip_norm: float):
    """The retry loop as it was written before the chunked replay: full float64
    temporaries, ``scaled * (C / after) * shrink`` per try (the oracle)."""
    out = scaled.to(dtype)
    after = float(torch.linalg.vector_norm(out, dtype=torch.float64))
    for _ in range(8):
        if after <= clip_norm:
            break
        scaled = scaled * (clip_norm / after) * kernels._shrink(dtype)
        out = scaled.to(dtype)
        after = float(torch.linalg.vector_norm(out, dtype=torch.float64))
    return out, after


def _clipped_samples(dtype: torch.dtype):
    """(update, C, its float64 norm) for 24 updates of 3 chunks and more, scales 1e-2 to
    1e2, at C = 0.01 and 0.5, where the update is above C (it gets clipped)."""
    g = torch.Generator().manual_seed(3)
    for i in range(24):
        n = 3 * kernels._CHUNK + i
        u = (torch.randn(n, generator=g) * 10.0 ** (i % 5 - 2)).to(dtype)
        for c in (0.01, 0.5):
            norm = float(torch.linalg.vector_norm(u, dtype=torch.float64))
            if norm > c:
                yield u, c, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_clip_equals_the_whole_vector_loop_and_needs_no_retry(dtype: torch.dtype) -> None:
    """A clipped update is scaled by C/‖x‖ less two eps of its dtype
    (``kernels._first_factor``): the chunked clip (``_clip_narrow``) gives the
    whole-vector loop's values bit for bit, every result is within C, and the margin
    leaves no cast above C (without it, measured here, a sizeable share of the casts
    landed above C and needed a second try), while the clipped norm stays within
    three eps of C."""
    above_without_margin = clipped = 0
    eps = torch.finfo(dtype).eps
    for u, c, norm in _clipped_samples(dtype):
        clipped += 1
        plain = (u.double() * (c / norm)).to(dtype)
        above_without_margin += float(torch.linalg.vector_norm(plain, dtype=torch.float64)) > c
        first = kernels._first_factor(c, norm, dtype)
        assert first < c / norm
        once = (u.double() * first).to(dtype)
        assert float(torch.linalg.vector_norm(once, dtype=torch.float64)) <= c
        want, after = _former_cast_within(u.double() * first, dtype, c)
        res = clip_update(u, c)
        assert np.array_equal(bits(res.update), bits(want))
        assert res.out_norm == after <= c
        assert after >= c * (1.0 - 3.0 * eps)
    assert clipped >= 20 and above_without_margin >= 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_clip_retries_replayed_in_chunks_equal_the_former_loop(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry loop (for casts the margin does not cover): with the margin removed,
    casts land above C, and the chunked replay from the input gives the former loop's
    values bit for bit, every result within C (also float16 and bfloat16, whose
    rounding a 1e-6 shrink could not undo)."""
    monkeypatch.setattr(kernels, "_first_factor", lambda c, norm, _dtype: c / norm)
    retried = 0
    for u, c, norm in _clipped_samples(dtype):
        first = (u.double() * (c / norm)).to(dtype)
        retried += float(torch.linalg.vector_norm(first, dtype=torch.float64)) > c
        want, after = _former_cast_within(u.double() * (c / norm), dtype, c)
        res = clip_update(u, c)
        assert np.array_equal(bits(res.update), bits(want))
        assert res.out_norm == after <= c
    assert retried >= 5


def test_noise_drawn_ahead_is_the_same_noise() -> None:
    d = 1000
    support = (torch.arange(d) % 3 == 0).double()
    for z in (0.0, 1.3):
        mech = GaussianMechanism(0.7, z).bind(Randomness(0))
        s = torch.randn(d, dtype=torch.float64)
        ahead = mech.server_noise(d, 5, support)  # drawn while the round trained
        given = mech.privatize(s, ahead, 11.0)
        drawn_at_finish = mech.privatize(s, mech.server_noise(d, 5, support), 11.0)
        assert np.array_equal(bits(given), bits(drawn_at_finish))
        reference = torch.from_numpy(SeededStream(0, (NOISE, 5)).standard_normal(d))
        expected = (s + reference * (z * 0.7) * support) / 11.0
        assert np.array_equal(bits(given), bits(expected))


def _pool(overrides: list[str]):
    cfg = load_config(overrides=overrides)
    return make_executor(prepare(cfg)).pool


def _train_here(pool, rnd: int, cohort, w, public) -> list:
    """The shard trained without the pool (whose ``train`` draws the noise ahead)."""
    return [pool.worker.train_shard(w, rnd, cohort, public)]


def test_server_uses_noise_drawn_ahead_once_and_only_for_its_round(small_overrides) -> None:
    """Rounds with ``prepare_noise`` equal rounds without it, bit for bit; noise drawn for
    another round (or another C_t) is never used, and a used draw is gone."""
    ov = [*small_overrides, "privacy.epsilon=null", "privacy.noise_multiplier=1.0"]
    plain, ahead = _pool(ov), _pool(ov)
    plain.server.draw_ahead = ahead.server.draw_ahead = False  # only prepare_noise here
    for rnd in range(3):
        rows = []
        for pool, draw in ((plain, False), (ahead, True)):
            cohort, w, public = pool.begin_round(rnd)
            if draw:
                pool.server.prepare_noise(rnd)
                pool.server.prepare_noise(rnd + 5)  # not this round: ignored
                assert pool.server._noise is not None and pool.server._noise[0] == rnd
            assert (pool.server._noise is not None) == draw
            partials = _train_here(pool, rnd, cohort, w, public)
            rows.append(pool.finish_round(rnd, partials))
            assert pool.server._noise is None
        assert np.array_equal(plain.server.get_weights(), ahead.server.get_weights())
        assert rows[0]["epsilon"] == rows[1]["epsilon"]
    # a stale draw (another clip norm) is ignored: the round draws its own
    cohort, w, public = ahead.begin_round(3)
    ahead.server.prepare_noise(3)
    rnd_, _c, noise = ahead.server._noise
    ahead.server._noise = (rnd_, _c * 2, torch.zeros_like(noise))
    cohort_p, w_p, public_p = plain.begin_round(3)
    a = ahead.finish_round(3, _train_here(ahead, 3, cohort, w, public))
    b = plain.finish_round(3, _train_here(plain, 3, cohort_p, w_p, public_p))
    assert np.array_equal(plain.server.get_weights(), ahead.server.get_weights())
    assert a["epsilon"] == b["epsilon"]


def test_noise_is_drawn_in_the_background_one_round_ahead(small_overrides) -> None:
    """``finish_round`` of round t starts round t+1's draw in the server's thread (and
    ``InProcessPool.train`` starts round 0's): the draw held equals what finish_round
    would draw itself, and the rounds equal rounds drawn at finish_round bit for bit,
    also under adaptive clipping (C_{t+1} is fixed when round t ends) and after a
    restore, which drops a draw made for the replaced state."""
    from concurrent.futures import Future

    for extra in ([], ["privacy.clip_mode=adaptive", "privacy.clip_count_stddev=5"]):
        ov = [*small_overrides, "privacy.epsilon=null", "privacy.noise_multiplier=1.0", *extra]
        plain, threaded = _pool(ov), _pool(ov)
        plain.server.draw_ahead = False
        for rnd in range(3):
            cohort, w, public = threaded.begin_round(rnd)
            partials = threaded.train(rnd, [cohort], w, public)
            held = threaded.server._noise
            assert held is not None and held[0] == rnd and isinstance(held[2], Future)
            assert held[1] == threaded.server.mechanism.clip_t
            expected = plain.server._draw_noise(rnd)  # what finish_round would draw itself
            assert np.array_equal(bits(held[2].result()), bits(expected))
            row = threaded.finish_round(rnd, partials)
            nxt = threaded.server._noise
            if rnd + 1 < threaded.server.spec.rounds:  # started for the next round
                assert nxt is not None and nxt[0] == rnd + 1
            else:  # none after the last round
                assert nxt is None
            cohort_p, w_p, public_p = plain.begin_round(rnd)
            row_p = plain.finish_round(rnd, _train_here(plain, rnd, cohort_p, w_p, public_p))
            assert plain.server._noise is None
            assert np.array_equal(plain.server.get_weights(), threaded.server.get_weights())
            assert row.get("clip_norm") == row_p.get("clip_norm")
        threaded.restore(plain.checkpoint())
        assert threaded.server._noise is None
        threaded.close()
        assert threaded.server._noise_thread is None


@pytest.mark.parametrize("n", [7, kernels._CHUNK, 3 * kernels._CHUNK + 17])
def test_noisy_mean_step_equals_privatize_then_update(n: int) -> None:
    """The fused DP-FedAvg server step against privatize() and the plain update, bit
    for bit, on random data with signed zeros, for several denominators and rates."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, generator=g)
    w[::11] = -0.0
    s = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-20, 2, n).double()
    s[::13] = -0.0
    noise = torch.randn(n, generator=g, dtype=torch.float64) * 3.7
    noise[::17] = 0.0
    for denominator, lr in ((11.0, 1.0), (2.5, 0.37), (1e4, 3.0), (1.0 / 3.0, 1e-3)):
        avg = GaussianMechanism.privatize(s, noise, denominator)
        want = w + (lr * avg).to(torch.float32)
        got = GaussianMechanism.privatized_step(w, s, noise, denominator, lr)
        assert got.dtype == torch.float32 and got.shape == w.shape
        assert np.array_equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="denominator=0"):
        GaussianMechanism.privatized_step(w, s, noise, 0, 1.0)


def test_phase_timer_records_and_changes_nothing(small_overrides) -> None:
    ov = [*small_overrides, "privacy.epsilon=null", "privacy.noise_multiplier=1.0"]
    cfg = load_config(overrides=ov)
    quiet, timed_ex = make_executor(prepare(cfg)), make_executor(prepare(cfg))
    timer = PhaseTimer()
    timed_ex.set_timer(timer)
    seen: list[dict[str, float]] = []
    for rnd in range(cfg.rounds):
        a, b = quiet.run_round(rnd), timed_ex.run_round(rnd)
        assert a.keys() == b.keys()
        for k in a:
            nan = isinstance(a[k], float) and math.isnan(a[k])
            assert (nan and math.isnan(b[k])) or a[k] == b[k], k
        seen.append(timer.take())
    assert np.array_equal(quiet.weights(), timed_ex.weights())
    for phases in seen:
        for name in ("begin_round", "train_shards", "local_training", "reduce", "finish_round"):
            assert phases[name] >= 0.0
        assert phases["train_shards"] >= phases["local_training"]
    assert timer.take() == {}  # take() clears


def test_timed_passes_items_through_and_is_identity_when_off() -> None:
    items = [1, 2, 3]
    assert timed(items, OFF, "x") is items
    t = PhaseTimer()
    assert list(timed(iter(items), t, "x")) == items
    assert set(t.take()) == {"x"}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_clip_and_add_equals_clip_then_add(dtype: torch.dtype, threads: int) -> None:
    """The worker's one-pass clip-and-accumulate (``clip_and_add_``, a float64 image
    of the update in a reused scratch) against ``clip_update`` then ``add_float64_``:
    the same clipped values, norms and float64 sums bit for bit, with one scratch
    reused across updates of different norms, clipped, unclipped (C finite and
    infinite), retried and non-finite ones; both paths are exercised."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(4)
        n = 3 * kernels._CHUNK + 11
        scratch = kernels.ClipScratch()
        got_total = torch.randn(n, generator=g, dtype=torch.float64)
        got_total[::13] = -0.0
        want_total = got_total.clone()
        clipped = unclipped = retried = 0
        for i in range(40):
            u = (torch.randn(n, generator=g) * 10.0 ** (i % 6 - 3)).to(dtype)
            u[::101] = -0.0
            if i == 7:
                u[5] = math.nan
            c = (0.01, 0.5, math.inf)[i % 3]
            want = clip_update(u, c)
            add_float64_(want_total, want.update)
            got = kernels.clip_and_add_(got_total, u, c, scratch)
            assert np.array_equal(bits(got.update), bits(want.update))
            assert (got.norm, got.clipped, got.nonfinite) == (
                want.norm,
                want.clipped,
                want.nonfinite,
            )
            assert got.out_norm == want.out_norm or (
                math.isnan(got.out_norm) and math.isnan(want.out_norm)
            )
            assert np.array_equal(bits(got_total), bits(want_total))
            clipped += want.clipped
            unclipped += not want.clipped and not want.nonfinite
            if want.clipped:
                first = (u.double() * (c / want.norm)).to(dtype)
                retried += float(torch.linalg.vector_norm(first, dtype=torch.float64)) > c
        assert clipped >= 10 and unclipped >= 10 and retried >= 2
    finally:
        torch.set_num_threads(before)
