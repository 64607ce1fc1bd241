"""Local training of a dense model under each step rule: the trainer dpfl picks now
against the one it picked before SAM, ASAM, PGN and BLUR had a dense form.

Usage::

    python -m benchmarks.local_step_rules [--clients 50] [--examples 50] [--epochs 2]
        [--repeats 3] [--rules sgd sam asam pgn blur] [--quick]

The workload is the leaderboard's shape (``experiments/leaderboard/fashion_mnist.yaml``):
the ``mlp`` (199,210 parameters) on 28×28 inputs with 10 classes, clients of 50
examples, minibatches of 10, as one worker's shard of a round (``--clients``), in one
torch thread. The inputs are generated (a fixed seed): a step's cost does not depend
on the pixel values.

*Before*: what :func:`engine.federated.vectorized.choose_trainer` picked for the rule
before this change (SAM, ASAM, PGN and BLUR had no dense form, so the automatic choice fell
to one client at a time through autograd, the vmap groups having measured slower for a
model of this size); plain SGD had the dense trainer already and is the control.
*After*: the automatic choice now (:class:`engine.federated.dense_training.DenseSGDTrainer`
for all five). Each side trains the same clients from the same global model (PGN: the
same public g̃); the two alternate, ``--repeats`` times, and the best wall time of each
is printed with its time per client step and the ratio after / before. The last column
is the largest difference of a client's update between the two sides, relative to the
largest update coordinate: float32 rounding (the tests hold it under 1e-4).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

RULES = {
    "sgd": ("dp_fedavg", {}),
    "sam": ("dp_fedsam", {"rho": 0.3, "asam": False}),
    "asam": ("dp_fedsam", {"rho": 0.5, "asam": True}),
    "pgn": ("dp_fedpgn", {"beta": 0.5, "rho": 0.2}),
    "blur": ("dp_fedavg_blur", {"blur_lambda": 0.8}),  # C = 0.5: clients leave the ball
}


def load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def workers(rule: str, clients: int, examples: int, epochs: int):
    """(before, after) workers of the same shard, and the round's public state."""
    import engine.federated.vectorized as vz
    from algorithms import build_pipeline
    from engine.config import AlgoConfig
    from engine.data.federated import FederatedDataset
    from engine.federated.client import ClientWorker, LocalSpec

    g = np.random.default_rng(0)
    n = clients * examples
    x = g.normal(size=(n, 1, 28, 28)).astype(np.float32)
    y = g.integers(0, 10, n).astype(np.int64)
    train = [np.arange(i * examples, (i + 1) * examples) for i in range(clients)]
    empty = [np.zeros(0, np.int64)] * clients
    ds = FederatedDataset("shape", x, y, train, empty, x[:4], y[:4], 10, (1, 28, 28))
    algorithm, algo = RULES[rule]

    def make() -> ClientWorker:
        pipeline = build_pipeline(algorithm, AlgoConfig(**algo), 0.5, 1.0, "mlp")
        spec = LocalSpec(
            seed=3, model_name="mlp", epochs=epochs, batch_size=10, lr=0.05, lr_decay=1.0,
            momentum=0.0, weight_decay=0.0, denominator=float(clients), pipeline=pipeline,
        )  # fmt: skip
        return ClientWorker(ds, spec)

    after = make()
    real = vz.dense_sgd_reason
    if rule != "sgd":  # the rule had no dense form: the choice made before
        vz.dense_sgd_reason = lambda base: "no dense form"
    try:
        before = make()
    finally:
        vz.dense_sgd_reason = real
    public: dict = {}
    if algorithm == "dp_fedpgn":
        gen = torch.Generator().manual_seed(1)
        public = {"g_tilde_list": [torch.randn(p.shape, generator=gen) * 0.1 for p in after.params]}
    return before, after, public


def measure(rule: str, clients: int, examples: int, epochs: int, repeats: int) -> dict:
    before, after, public = workers(rule, clients, examples, epochs)
    g0 = torch.cat([p.detach().reshape(-1) for p in after.params])
    ids = np.arange(clients)
    results, best = {}, {"before": np.inf, "after": np.inf}
    for side, w in (("before", before), ("after", after)):  # warm: a deferred choice decides
        results[side] = list(w.trainer.train(g0, 0, ids, public))
    for _ in range(repeats):
        for side, w in (("before", before), ("after", after)):
            t = time.perf_counter()
            results[side] = list(w.trainer.train(g0, 1, ids, public))
            best[side] = min(best[side], time.perf_counter() - t)
    steps = sum(r.steps for r in results["after"])
    scale = max(float((r.local - g0).abs().max()) for r in results["before"])
    diff = max(
        float(((a.local - g0) - (b.local - g0)).abs().max())
        for a, b in zip(results["after"], results["before"])
    )
    return {
        "rule": rule,
        "before_s": best["before"],
        "after_s": best["after"],
        "steps": steps,
        "ratio": best["after"] / best["before"],
        "rel_diff": diff / scale,
        "before_trainer": before.vectorized_note,
        "after_trainer": after.vectorized_note,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.examples, args.epochs, args.repeats = 6, 20, 1, 1
    torch.set_num_threads(1)
    print(
        f"one worker's shard: {args.clients} clients x {args.examples} examples, B = 10, "
        f"{args.epochs} epoch(s), the mlp, 1 thread; best of {args.repeats}; "
        f"load average {load()}"
    )
    print(
        f"{'rule':<5} {'before s':>9} {'after s':>8} {'ms/step before':>15} "
        f"{'ms/step after':>14} {'after/before':>13} {'max rel diff':>13}"
    )
    for rule in args.rules:
        r = measure(rule, args.clients, args.examples, args.epochs, args.repeats)
        ms = 1e3 / r["steps"]
        print(
            f"{rule:<5} {r['before_s']:>9.3f} {r['after_s']:>8.3f} {r['before_s'] * ms:>15.2f} "
            f"{r['after_s'] * ms:>14.2f} {r['ratio']:>13.2f} {r['rel_diff']:>13.1e}"
        )
        print(f"      before: {r['before_trainer']}; after: {r['after_trainer']}")
    print(f"load average {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
