"""What the executor-equality tests share (Ray actors and forked workers against the
in-process executor): a tiny config of two workers, and one recipe per kind of state
or machinery that crosses the process boundary differently — the plain private and
non-private paths, a personal head kept in the workers, a server step with state
(PGN's g̃, with smoothing), correlated noise (tree and banded), a public per-round mask
and a server-side top-k. Every recipe runs in process in the golden and reference
tests, and the client pieces run the same code in a worker."""

from __future__ import annotations

TINY = [
    "dataset.num_clients=24",
    "dataset.synthetic_mean_samples=12",
    "dataset.synthetic_dim=8",
    "sampling.rate=0.4",
    "rounds=2",
    "eval.every=1",
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.noise_multiplier=1.0",
    "ray.num_workers=2",
    "ray.num_cpus_per_worker=1",
]

CROSS_PROCESS_RECIPES = [
    "fedavg",
    "dp_fedavg",
    "dp2_fedsam",
    "dp_fedpgn_ls",
    "dp_ftrl",
    "dp_bandmf",
    "fedsmp_randk",
    "dp_fedsam_topk",
]
