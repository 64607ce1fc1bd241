"""Random streams derived from (seed, round, client, stream), never the global RNG.

Every random choice in a simulation draws from a generator keyed by what it is for,
so results do not depend on which worker trained which client, in which order, or
how many workers there are. ``numpy.random.SeedSequence`` mixes the key into
independent, well-separated seeds.

The privacy mechanism's Gaussian noise comes from :class:`SeededStream`: the values of
stream (seed, *key) are cut into blocks of :data:`NORMAL_BLOCK`, and block j is drawn
by its own PCG64 generator seeded with ``SeedSequence(seed, spawn_key=(len(key), *key,
j))`` (numpy's documented way to make independent parallel streams). Blocks are drawn
in parallel threads and the values do not depend on how many threads drew them. It
replaced torch's CPU generator for the noise because (a) torch's Mersenne Twister
draws 11M float64 values in ~0.34 s on one core, on the critical path of an
11M-parameter round on a GPU, and (b) torch seeds that generator with the low 32 bits
of the seed only, so of the ~10⁵ noise streams of a long run with client-side noise,
two would coincide with probability ~0.7 (birthday bound); SeedSequence keeps all
128 bits of the key's entropy (docs/architecture.md, "Noise streams").

Two modes (``privacy.secure_noise``), recorded as ``randomness`` in every row and in
``config.json``:

* ``seeded-simulation`` (default): the cohort and the noise also come from the seeded
  streams, so a run is reproducible, and anyone holding the seed (it is written to
  ``config.json``) can regenerate the noise and subtract it from a released model. The
  reported ε then describes a deployment that runs the same mechanism with fresh
  secret randomness, not the simulation's own outputs.
* ``secure`` (release mode): the cohort and the Gaussian noise come from
  :class:`SecureRandom`, the operating system's CSPRNG, with no seed and no state
  kept or written; two runs with the same seed differ. The seed still drives what
  is public or inside a client's own computation (data generation and partition,
  model initialisation, minibatch order, the public rand-k masks), which the DP
  argument does not need to be secret.
"""

from __future__ import annotations

import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

SEEDED_SIMULATION = "seeded-simulation"
SECURE = "secure"

# Stream ids: one per kind of randomness.
SAMPLING = 1  # which clients join a round (server)
NOISE = 2  # Gaussian noise added to the aggregate (server)
CLIENT_DATA = 3  # minibatch order of a client's local training
MODEL_INIT = 4  # initial global model
DATA = 5  # dataset generation and partitioning
CLIENT_MASK = 6  # reserved: per-client randomness of transforms
SERVER_PUBLIC = 7  # reserved: public per-round randomness (e.g. rand-k masks)
CLIP_COUNT = 8  # noise of adaptive clipping's released count (server)
AUDIT = 9  # canary directions and canary participation (engine.privacy.audit)
TRIAL_SEED = 10  # dpfl tune: run seed of trial k of (algorithm, ε) (tuning.trial)
TUNING_COUNT = 11  # dpfl tune: the random number of trials K (tuning.experiment)
LEADERBOARD = 12  # dpfl leaderboard: paired draws and run seeds (tuning.leaderboard.draws)


def derive_seed(seed: int, *key: int) -> int:
    """A 63-bit seed from the run seed and an integer key path."""
    ss = np.random.SeedSequence([int(seed), *[int(k) for k in key]])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *key))


def torch_gen(seed: int, *key: int, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *key))
    return g


#: values per block of a :class:`SeededStream`'s Gaussian draw (2 MiB of float64). Part
#: of what the stream's values are: changing it changes every seeded run's noise.
NORMAL_BLOCK = 2**18


def _noise_threads() -> int:
    """At most 8, at most the machine's cores, and at most ``OMP_NUM_THREADS`` where it
    is set (Ray sets it to the CPUs a task or actor holds, at least 1: a one-CPU Tune
    trial, or the server actor of ``ray.server=actor`` and clusters, draws with one
    thread; the server in the driver, ``ray.server=auto`` on one node, is not capped)."""
    cores = os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        cores = min(cores, int(omp))
    return max(1, min(8, cores))


#: threads that draw the blocks of one large Gaussian draw (the values do not depend
#: on it; :func:`_noise_threads`)
NOISE_THREADS = _noise_threads()


@dataclass(frozen=True)
class SeededStream:
    """The seeded noise stream keyed by (seed, *key): i.i.d. N(0, 1) float64 values in
    blocks of :data:`NORMAL_BLOCK`, block j from PCG64 seeded with
    ``SeedSequence(seed, spawn_key=(len(key), *key, j))`` (the key's length first, so
    keys of different lengths never share a block's seed). A draw of n values is the
    first n values of the stream, the same for any ``threads``.

    Simulation mode only: anyone holding the seed regenerates these values (module
    docstring); release mode draws from :class:`SecureRandom` instead."""

    seed: int
    key: tuple[int, ...]

    def block_generator(self, block: int) -> np.random.Generator:
        spawn_key = (len(self.key), *(int(k) for k in self.key), int(block))
        return np.random.Generator(
            np.random.PCG64(np.random.SeedSequence(int(self.seed), spawn_key=spawn_key))
        )

    def standard_normal(self, n: int, threads: int | None = None) -> np.ndarray:
        """The stream's first ``n`` values (float64), blocks drawn by up to ``threads``
        threads (default :data:`NOISE_THREADS`); numpy releases the GIL while it fills."""
        n = int(n)
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        out = np.empty(n, dtype=np.float64)
        blocks = -(-n // NORMAL_BLOCK)

        def fill(first: int, stop: int) -> None:
            for j in range(first, stop):
                self.block_generator(j).standard_normal(
                    out=out[j * NORMAL_BLOCK : min(n, (j + 1) * NORMAL_BLOCK)]
                )

        workers = max(1, min(blocks, NOISE_THREADS if threads is None else int(threads)))
        if workers == 1:
            fill(0, blocks)
            return out
        bounds = [blocks * i // workers for i in range(workers + 1)]
        # Threads of this draw only, joined before it returns: a pool kept between draws
        # would hold non-daemon threads that make `dpfl` wait for the interpreter's
        # teardown (engine.cli.dispatch.console_main) and that a forked child lacks.
        # Starting them costs well under a millisecond a draw.
        with ThreadPoolExecutor(workers, thread_name_prefix="dpfl-noise-block") as pool:
            futures = [pool.submit(fill, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
            for f in futures:
                f.result()
        return out


def randomness_mode(secure: bool) -> str:
    """The ``randomness`` label of a run: ``secure`` or ``seeded-simulation``."""
    return SECURE if secure else SEEDED_SIMULATION


@dataclass(frozen=True)
class Randomness:
    """The run's switch between seeded and secure noise (``privacy.secure_noise``): the
    one place that decides where a draw that hides data comes from.

    ``stream(*key)`` is the :class:`SeededStream` keyed by (seed, *key) in the simulation
    mode, and a fresh :class:`SecureRandom` (OS entropy, nothing recorded, ``key``
    unused) in release mode. The privacy mechanism
    (:class:`engine.privacy.mechanism.GaussianMechanism`) draws every noise value of a
    round from it (the update sum's noise, client-side noise and adaptive clipping's
    count noise), and the server its cohorts (``cohort_stream``)."""

    seed: int
    secure: bool = False

    @property
    def mode(self) -> str:
        return randomness_mode(self.secure)

    def stream(self, *key: int) -> SeededStream | SecureRandom:
        """A noise stream: the seeded one keyed by (seed, *key), or the OS CSPRNG."""
        return SecureRandom() if self.secure else SeededStream(self.seed, tuple(key))

    def cohort_stream(self, rnd: int) -> np.random.Generator | SecureRandom:
        """Round ``rnd``'s sampling stream: numpy's, keyed by (seed, SAMPLING, rnd), or
        the OS CSPRNG (the cohort is then as secret as the noise)."""
        return SecureRandom() if self.secure else numpy_rng(self.seed, SAMPLING, rnd)


class SecureRandom:
    """Draws from the OS CSPRNG (``os.urandom``: Linux ``getrandom(2)``), nothing else.

    It holds no seed or state, so nothing a run writes can regenerate its draws.
    Uniforms are 53-bit: u = (k + ½)·2⁻⁵³ with k uniform on [0, 2⁵³), in (0, 1).
    Gaussians use Box–Muller on such uniforms in float64.

    Limits, stated plainly: this is a floating-point Gaussian, and floating-point
    samplers of continuous distributions are known to leak through the fine
    structure of the values they can and cannot produce (Mironov, CCS 2012, for the
    Laplace mechanism; the same applies to Box–Muller here and to the float32 sum the
    noise is added to). A deployment that must resist such attacks needs a discrete
    Gaussian (Canonne, Kamath, Steinke 2020) with discrete-aware accounting, which
    dpfl does not implement. What this class does guarantee is that the noise and the
    cohort cannot be regenerated from anything recorded (unlike the seeded mode).
    """

    @staticmethod
    def _words(n: int) -> np.ndarray:
        return np.frombuffer(os.urandom(8 * n), dtype=np.uint64)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` uniforms in (0, 1), float64."""
        k = self._words(n) >> np.uint64(11)
        return (k.astype(np.float64) + 0.5) * 2.0**-53

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` i.i.d. N(0, 1) draws, float64 (Box–Muller)."""
        half = (n + 1) // 2
        u = self.uniform(2 * half)
        radius = np.sqrt(-2.0 * np.log(u[:half]))
        angle = 2.0 * np.pi * u[half:]
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]

    def sample(self, population: np.ndarray | int, k: int) -> np.ndarray:
        """``k`` distinct items of ``population`` (or of ``range(population)``) chosen
        uniformly without replacement (``secrets.SystemRandom``), sorted."""
        if isinstance(population, (int, np.integer)):  # O(k): range, never arange(n)
            picked = secrets.SystemRandom().sample(range(int(population)), k)
            return np.sort(np.asarray(picked, dtype=np.int64))
        picked = secrets.SystemRandom().sample(range(len(population)), k)
        return np.sort(np.asarray(population)[np.asarray(picked, dtype=np.int64)]).astype(np.int64)
