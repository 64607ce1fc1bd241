"""Synthetic(α, β): the LEAF / FedProx federated benchmark generator (Li et al. 2020).

For client k: u_k ~ N(0, α), B_k ~ N(0, β); W_k ~ N(u_k, 1) of shape (C, d) and
b_k ~ N(u_k, 1) of shape (C,); v_k ~ N(B_k, 1) of shape (d,); features
x ~ N(v_k, Σ) with Σ = diag(j^-1.2); label y = argmax(W_k x + b_k). α controls how
much the clients' models differ, β how much their features differ. The number of
examples per client is log-normal (heavy-tailed, as in LEAF), at least 4.

``model="per_client"`` is that generator as published. Its labelling rules are
independent across clients (u_k adds the same offset to every class score, so it
cancels in the argmax), so nothing a model learns carries over to clients it never
saw: accuracy on held-out *public* clients stays at chance. ``model="shared"`` (dpfl's
default) draws one W_0, b_0 ~ N(0, 1) from the generator's own stream and gives client
k W_k = W_0 + u_k, b_k = b_0 + u_k (the same form with the per-entry draws shared):
one labelling rule for the population and the public clients, while features stay
non-IID through β and client sizes stay heavy-tailed.

Privacy (docs: README, "Privacy"): client k's examples depend only on the generator's
seed and k (each client draws from its own stream), and features are standardised with
the generating distribution's own constants — feature j has mean 0 and variance
β + 1 + j^-1.2 under the generator, so x_j is divided by sqrt(β + 1 + j^-1.2) — never
with statistics of the generated data. Adding, removing or changing one client
therefore leaves every other client's examples bit-identical.

:func:`engine.data.build_dataset` asks for ``dataset.public_eval_clients`` extra clients
(``public_clients``) and holds them out as the public evaluation set: clients drawn
from the same generator that never train and are not part of the population.
"""

from __future__ import annotations

import numpy as np

from engine.data.sources import PooledData


def feature_scale(dim: int, beta: float) -> np.ndarray:
    """Standard deviation of each feature under the generator (public constants).

    x_j = B_k + (v_kj - B_k) + (x_j - v_kj) with independent N(0, β), N(0, 1) and
    N(0, j^-1.2) terms, so Var(x_j) = β + 1 + j^-1.2 and E[x_j] = 0.
    """
    cov_diag = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2)
    return np.sqrt(beta + 1.0 + cov_diag)


def generate_synthetic(
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    dim: int = 60,
    num_classes: int = 10,
    mean_samples: int = 60,
    public_clients: int = 0,
    model: str = "shared",
) -> PooledData:
    """Generate Synthetic(α, β); ``groups`` holds each example's (natural) client.

    ``rng`` is used once, for the seed of the per-client streams: client k draws from
    ``SeedSequence(seed, spawn_key=(0, k))``, so clients 0..K-1 are the same whatever
    ``num_clients`` >= K is. The ``public_clients`` extra clients (groups
    ``num_clients``, ``num_clients + 1``, ...) draw from ``spawn_key=(1, j)``: the same
    generator, streams disjoint from the population's, and the same whatever the
    population is.
    """
    if num_clients < 1:
        raise ValueError(f"dataset.num_clients={num_clients} must be >= 1")
    if model not in ("shared", "per_client"):
        raise ValueError(f"dataset.synthetic_model={model!r}: must be shared or per_client")
    seed = int(rng.integers(0, 2**63 - 1))
    shared = None
    if model == "shared":  # one rule, from a stream no client uses
        g0 = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(2, 0)))
        shared = (g0.normal(0.0, 1.0, (num_classes, dim)), g0.normal(0.0, 1.0, num_classes))
    cov_diag = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2)
    scale = feature_scale(dim, beta)
    xs, ys, owners = [], [], []
    keys = [(0, k) for k in range(num_clients)] + [(1, j) for j in range(public_clients)]
    for k, key in enumerate(keys):
        g = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))
        size = int(np.clip(g.lognormal(np.log(mean_samples), 0.5), 4, 20 * mean_samples))
        u_k = g.normal(0.0, np.sqrt(alpha))
        b_mean = g.normal(0.0, np.sqrt(beta))
        if shared is None:
            w = g.normal(u_k, 1.0, (num_classes, dim))
            b = g.normal(u_k, 1.0, num_classes)
        else:
            w, b = shared[0] + u_k, shared[1] + u_k
        v = g.normal(b_mean, 1.0, dim)
        x = g.normal(v, np.sqrt(cov_diag), (size, dim))
        y = np.argmax(x @ w.T + b, axis=1)
        xs.append((x / scale).astype(np.float32))
        ys.append(y.astype(np.int64))
        owners.append(np.full(size, k, dtype=np.int64))
    return PooledData(
        x_train=np.concatenate(xs),
        y_train=np.concatenate(ys),
        x_test=np.zeros((0, dim), np.float32),
        y_test=np.zeros(0, np.int64),
        num_classes=num_classes,
        input_shape=(dim,),
        groups=np.concatenate(owners),
    )
