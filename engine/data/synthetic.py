"""Synthetic(α, β): the LEAF / FedProx federated benchmark generator (Li et al. 2020).

For client k: u_k ~ N(0, α), B_k ~ N(0, β); W_k ~ N(u_k, 1) of shape (C, d) and
b_k ~ N(u_k, 1) of shape (C,); v_k ~ N(B_k, 1) of shape (d,); features
x ~ N(v_k, Σ) with Σ = diag(j^-1.2); label y = argmax(W_k x + b_k). α controls how
much the clients' models differ, β how much their features differ. The number of
examples per client is log-normal (heavy-tailed, as in LEAF), at least 4.

It has no separate test set: :func:`engine.data.build_dataset` uses the union of the
clients' held-out splits as the global test set (as LEAF splits each user's data).
"""

from __future__ import annotations

import numpy as np

from engine.data.sources import PooledData


def generate_synthetic(
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    dim: int = 60,
    num_classes: int = 10,
    mean_samples: int = 60,
) -> PooledData:
    """Generate Synthetic(α, β); ``groups`` holds each example's (natural) client."""
    if num_clients < 1:
        raise ValueError(f"dataset.num_clients={num_clients} must be >= 1")
    sizes = rng.lognormal(np.log(mean_samples), 0.5, num_clients).astype(np.int64)
    sizes = np.clip(sizes, 4, 20 * mean_samples)
    cov_diag = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2)
    xs, ys, owners = [], [], []
    for k in range(num_clients):
        u_k = rng.normal(0.0, np.sqrt(alpha))
        b_mean = rng.normal(0.0, np.sqrt(beta))
        w = rng.normal(u_k, 1.0, (num_classes, dim))
        b = rng.normal(u_k, 1.0, num_classes)
        v = rng.normal(b_mean, 1.0, dim)
        x = rng.normal(v, np.sqrt(cov_diag), (sizes[k], dim))
        y = np.argmax(x @ w.T + b, axis=1)
        xs.append(x.astype(np.float32))
        ys.append(y.astype(np.int64))
        owners.append(np.full(sizes[k], k, dtype=np.int64))
    x_all = np.concatenate(xs)
    # Standardise features with statistics of the whole population (public recipe).
    mu, sd = x_all.mean(0), x_all.std(0) + 1e-6
    x_all = ((x_all - mu) / sd).astype(np.float32)
    return PooledData(
        x_train=x_all,
        y_train=np.concatenate(ys),
        x_test=np.zeros((0, dim), np.float32),
        y_test=np.zeros(0, np.int64),
        num_classes=num_classes,
        input_shape=(dim,),
        groups=np.concatenate(owners),
    )
