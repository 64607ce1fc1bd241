"""Random streams derived from (seed, round, client, stream), never the global RNG.

Every random choice in a simulation draws from a generator keyed by what it is for,
so results do not depend on which worker trained which client, in which order, or
how many workers there are. ``numpy.random.SeedSequence`` mixes the key into
independent, well-separated seeds.
"""

from __future__ import annotations

import numpy as np
import torch

# Stream ids: one per kind of randomness.
SAMPLING = 1  # which clients join a round (server)
NOISE = 2  # Gaussian noise added to the aggregate (server)
CLIENT_DATA = 3  # minibatch order of a client's local training
MODEL_INIT = 4  # initial global model
DATA = 5  # dataset generation and partitioning
CLIENT_MASK = 6  # reserved: per-client randomness of transforms
SERVER_PUBLIC = 7  # reserved: public per-round randomness (e.g. rand-k masks)


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
