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

``--trace`` explains the clients whose updates differ by more than 1e-5 of it: for each,
the first step after which the two sides part (both rerun with the client's first k
minibatches only) and, in float64 at the one-by-one side's weights before that step,
the hidden pre-activation nearest zero relative to its layer's largest, at each point
where the step takes a gradient (w; SAM also w + e, PGN w + δ). A value near 1e-7 is a
ReLU input within float32 rounding of the kink: the two float32 sides may then take
opposite sides of it, and that example's whole contribution to the step changes.
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


def _nearest_kink(worker, rule: str, batch: np.ndarray, w: torch.Tensor, public):
    """Smallest |hidden pre-activation| / the layer's largest over the gradient points of
    one step on the minibatch ``batch`` from weights ``w`` (float64; the mlp's layers)."""
    ds = worker.dataset
    x = torch.from_numpy(ds.x_train[batch]).double().reshape(len(batch), -1)
    y = torch.from_numpy(ds.y_train[batch])
    lin = [m for m in worker.model.modules() if isinstance(m, torch.nn.Linear)]

    def forward(flat: torch.Tensor):
        h, zs, at = x, [], 0
        for i, m in enumerate(lin):
            wt = flat[at : at + m.weight.numel()].view(m.weight.shape)
            at += m.weight.numel()
            bias = flat[at : at + m.bias.numel()]
            at += m.bias.numel()
            z = h @ wt.t() + bias
            zs.append(z)
            h = torch.relu(z) if i < len(lin) - 1 else z
        return torch.nn.functional.cross_entropy(h, y), zs[:-1]

    points = [w]
    step = worker.pipeline.step
    if rule == "sam":
        wg = w.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(forward(wg)[0], wg)
        points.append(w + float(step.rho) * g / (g.norm() + 1e-12))
    if rule == "pgn":
        gt = torch.cat([t.reshape(-1) for t in public["g_tilde_list"]]).double()
        points = [w + float(step.rho) * gt / (gt.norm() + 1e-12)]
    return min(float(z.abs().min() / z.abs().max()) for pt in points for z in forward(pt)[1])


def trace(rule: str, clients: int, examples: int, epochs: int, above: float = 1e-5) -> list:
    """(client, relative difference, first step after which the sides part, nearest
    kink at that step) for each client whose updates differ by more than ``above`` of
    the shard's largest update coordinate (module docstring)."""
    import itertools

    before, after, public = workers(rule, clients, examples, epochs)
    g0 = torch.cat([p.detach().reshape(-1) for p in after.params])
    ids = np.arange(clients)
    rb = list(before.trainer.train(g0, 1, ids, public))
    ra = list(after.trainer.train(g0, 1, ids, public))
    scale = max(float((r.local - g0).abs().max()) for r in rb)
    worker = before.trainer  # one by one: a OneByOneTrainer, the class both sides use
    cls, full = type(worker), type(worker).batches
    out = []
    for c in ids:
        gap = float((ra[c].local - rb[c].local).abs().max()) / scale
        if gap <= above:
            continue
        batches = [np.sort(b) for b in full(worker, 1, int(c), worker.spec.steps, epochs)]
        start, part = g0, len(batches)
        try:
            for k in range(1, len(batches) + 1):
                cls.batches = lambda self, rnd, cl, st, ep, k=k: itertools.islice(
                    full(self, rnd, cl, st, ep), k
                )
                b = list(before.trainer.train(g0, 1, [int(c)], public))[0].local
                a = list(after.trainer.train(g0, 1, [int(c)], public))[0].local
                if float((a - b).abs().max()) / scale > above:
                    part = k
                    break
                start = b
        finally:
            cls.batches = full
        kink = _nearest_kink(worker, rule, batches[part - 1], start.double(), public)
        out.append((int(c), gap, part, kink))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument(
        "--trace", action="store_true", help="explain the clients that differ (docstring)"
    )
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
        if args.trace:
            for c, gap, part, kink in trace(rule, args.clients, args.examples, args.epochs):
                print(
                    f"      client {c}: {gap:.1e} apart, from step {part}; nearest ReLU "
                    f"input at that step {kink:.1e} of its layer's largest"
                )
    print(f"load average {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
