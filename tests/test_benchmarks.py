"""benchmarks.bench: its plain reference loop is independent yet draws the engine's
streams, and a ``--quick`` run measures both sides and reports consistent numbers."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from benchmarks import measure, reference_loop, streams, w1, workloads
from engine.federated.local_training import client_batches
from engine.federated.server import sample_cohort
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec
from tests.benchmark_scripts import benchmark_command, load_benchmark

REPO = Path(__file__).resolve().parent.parent
#: the plain loop's modules: what they may import from dpfl is checked below
PLAIN_LOOP = ["reference_loop.py", "streams.py", "workloads.py", "measure.py"]

# Engine modules the benchmark may import: data containers/generators, the model zoo
# (architecture and initialisation only), and config + simulate to run the dpfl side.
ALLOWED_ENGINE_IMPORTS = {
    "engine.config",
    "engine.data",
    "engine.data.federated",
    "engine.models",
    "engine.simulation",
}

# Both sides use the same initial model, cohorts, minibatch order and noise draws, so
# they differ only by floating-point rounding: the engine's clipping (it scales the
# peak-normalised update and, when the float32 cast lands a few ulps above C, shrinks
# it by a further 1e-6 so that ||update|| <= C holds exactly) against the plain loop's
# Δ·C/||Δ|| — with the engine's clip copied into the plain loop the two quick runs are
# bit-identical. Over the four rounds such rounding can flip a near-tie (a max-pool or
# ReLU decision) and then compounds: the final weights' relative difference, measured
# on seeds 0-3 with the noise streams before and after the block streams of
# engine/privacy/rng.py, ranged from 7e-7 to 2.1e-3 (1.5e-5 to 2.1e-3 before, 7e-7 to
# 2.1e-3 after), and the accuracies by at most 0.0075. A real divergence (a different
# batch order or noise draw) moves the weights by O(1) relative and the accuracy by
# several points: 1e-2 on the weights is 5x the largest flip measured, and 0.01 on the
# accuracy (4 of 400 test examples) allows a few borderline predictions.
QUICK_ACCURACY_TOLERANCE = 0.01
QUICK_WEIGHTS_TOLERANCE = 1e-2


def test_plain_loop_imports_no_engine_training_code() -> None:
    imported: set[str] = set()
    for name in PLAIN_LOOP:
        tree = ast.parse((REPO / "benchmarks" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
    ours = {m for m in imported if m.split(".")[0] in ("engine", "algorithms", "tuning")}
    assert ours <= ALLOWED_ENGINE_IMPORTS, ours - ALLOWED_ENGINE_IMPORTS
    assert "benchmarks.dpfl_side" not in imported  # the dpfl side stays out of the loop


def test_reimplemented_streams_match_the_engine() -> None:
    bench = streams
    for key in [(1, 0), (2, 7), (3, 4, 11), (4,), (5,)]:
        assert bench.derive_seed(3, *key) == rngs.derive_seed(3, *key)
    spec = SamplingSpec(mode="poisson", num_clients=300, rate=0.1)
    for rnd in range(5):
        assert np.array_equal(bench.poisson_cohort(300, 0.1, 3, rnd), sample_cohort(spec, 3, rnd))
    # Minibatch order: the engine's client_batches (indices sorted within a batch, as
    # engine.federated.worker_model.batch_to_tensors does) on a stub holding only what it reads.
    idx = np.arange(100, 123, dtype=np.int64)
    stub = SimpleNamespace(client_train={5: idx})
    engine_batches = [np.sort(b) for b in client_batches(stub, 3, 4, 2, 5, None, 2)]
    ours = list(bench.minibatches(idx, 4, 2, 3, 2, 5))
    assert len(ours) == len(engine_batches) == 2 * math.ceil(len(idx) / 4)
    for a, b in zip(ours, engine_batches):
        assert np.array_equal(a, b)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.benchmark
def test_quick_benchmark_runs_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        # The plain loop's layout, so that the two sides differ only by the clip's
        # rounding (model.memory_format=auto would add the kernels' rounding).
        benchmark_command(
            "bench.py", "--quick", "--memory-format", "contiguous", "--json", str(out)
        ),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    plain, dpfl = rep["plain"], rep["dpfl"]
    assert rep["errors"] == [] and rep["exit_status"] == 0

    # Timings are positive and the ratios are what they claim to be.
    for side in (plain, dpfl):
        assert side["wall_s"] > 0 and side["round_loop_s"] > 0
        assert side["round_loop_s"] <= side["wall_s"]
        assert side["updates_per_s"] == pytest.approx(side["client_updates"] / side["wall_s"])
    assert rep["ratio"] == pytest.approx(dpfl["wall_s"] / plain["wall_s"], rel=1e-9)
    assert rep["round_loop_ratio"] == pytest.approx(
        dpfl["round_loop_s"] / plain["round_loop_s"], rel=1e-9
    )
    assert rep["ray_startup_s"] > 0
    assert [t["target"] for t in rep["targets"]] == [0.75, 0.6]  # cnn: both targets
    for target in rep["targets"]:
        assert target["ratio"] == rep["ratio"]
        assert target["status"] == ("PASS" if rep["ratio"] <= target["target"] else "MISS")
    assert "memory format contiguous" in rep["targets"][1]["name"]

    # Same work on both sides, and the two results agree.
    assert plain["client_updates"] == dpfl["client_updates"] > 0
    for side in (plain, dpfl):
        assert 0.0 <= side["test_accuracy"] <= 1.0
    assert abs(rep["accuracy_diff"]) <= QUICK_ACCURACY_TOLERANCE
    assert rep["accuracy_diff"] == pytest.approx(dpfl["test_accuracy"] - plain["test_accuracy"])
    assert rep["final_weights_rel_diff"] <= QUICK_WEIGHTS_TOLERANCE

    # ε comes from dpfl's accountant only; the plain loop claims none.
    assert "epsilon" not in plain
    assert math.isfinite(dpfl["epsilon"]) and dpfl["epsilon"] > 0
    plain_lines = [ln for ln in proc.stdout.splitlines() if "plain:" in ln]
    assert plain_lines and not any("epsilon" in ln for ln in plain_lines)
    assert "not accounted" in proc.stdout

    # Peak memory of the driver and of every actor of the run: 2 workers, plus the
    # server where it is an actor (ray.server=auto puts it in the driver on one node).
    names = set(dpfl["peak_rss_mb"])
    assert dpfl["server_placement"] in ("driver", "actor")
    server = {"bench0:server"} if dpfl["server_placement"] == "actor" else set()
    assert names == {"driver", "bench0:client-worker-0", "bench0:client-worker-1"} | server
    assert all(v is not None and v > 0 for v in dpfl["peak_rss_mb"].values())
    assert len(set(dpfl["pids"].values())) == len(dpfl["pids"])  # distinct processes
    assert all(v is not None and v > 0 for v in plain["peak_rss_mb"].values())
    assert rep["hardware"]["torch"] and rep["hardware"]["ray"] and rep["hardware"]["cores"] >= 1


def _load_scaling() -> ModuleType:
    return load_benchmark("gpu_scaling.py")


def test_gpu_scaling_counts_steady_clients_per_second_after_round_one() -> None:
    """Round 1 (CUDA start-up) is left out: rounds 2..R of a cumulative wall clock."""
    import pandas as pd

    scaling = _load_scaling()
    rows = pd.DataFrame(
        {"wall_time_s_nonprivate": [4.0, 6.0, 9.0], "realised_cohort_size_nonprivate": [50, 4, 6]}
    )
    rate, first, n = scaling.steady_rate(rows)
    assert (rate, first, n) == (10 / 5.0, 4.0, 10)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.benchmark
def test_gpu_scaling_sweep_runs_on_the_cpu(tmp_path: Path) -> None:
    """The sweep's smoke run (no GPU here): every configuration trains, its workers
    report where they trained, and ε is the same for every packing (σ, sampling and
    rounds do not depend on it)."""
    out = tmp_path / "scaling.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    cmd = benchmark_command("gpu_scaling.py", "--quick", "--device", "cpu", "--workloads", "cnn")
    cmd += ["--groups", "1", "--rounds", "2", "--cpus-per-worker", "0.5", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["workers_per_gpu"], r["workers"]) for r in results] == [(1, 1), (2, 2)]
    for r in results:
        assert r["devices"] == ["cpu"] * r["workers"]
        assert r["gpu_peak_mb"] == []
        assert r["steady_updates"] > 0 and r["clients_per_s"] > 0
    assert len({r["epsilon"] for r in results}) == 1
    assert f"{results[0]['epsilon']:.4f}" in proc.stdout


@pytest.mark.slow
@pytest.mark.benchmark
def test_gpu_vectorized_groups_reproduce_one_by_one_on_the_cpu(tmp_path: Path) -> None:
    """The vectorised-vs-one-by-one benchmark's smoke run (CPU): every group size
    takes the same number of local steps as one-by-one training and its summed
    clipped update agrees to float32 rounding (the GPU run prints the same columns)."""
    out = tmp_path / "vec.json"
    cmd = benchmark_command("gpu_vectorized.py", "--device", "cpu", "--quick", "--groups", "1,4,8")
    cmd += ["--cohort", "8", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["group"] for r in results] == [1, 4, 8]
    assert len({r["steps"] for r in results}) == 1
    assert results[0]["rel_diff_vs_one_by_one"] == 0.0
    for r in results[1:]:
        assert r["note"] == f"ray.clients_per_worker_batch={r['group']}"
        assert r["rel_diff_vs_one_by_one"] < 1e-4
        assert r["clients_per_s"] > 0


# --------------------------------------------------------------------------- tight floor
def _reference_dp_fedavg(w, ds) -> np.ndarray:
    """An independent, deliberately plain DP-FedAvg loop (a fresh model per client,
    torch.optim.SGD, clip by Δ·min(1, C/‖Δ‖) in float64, noise in logical order): the
    oracle the tight floor must reproduce to float rounding."""
    import torch
    from torch import nn

    torch.set_num_threads(1)

    def fresh() -> nn.Module:
        from engine.models import build_model

        gen = streams.torch_stream(w.seed, streams.MODEL_INIT)
        return build_model(w.model, ds.input_shape, ds.num_classes, gen)

    model = fresh()
    global_w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    for rnd in range(w.rounds):
        total = torch.zeros_like(global_w)
        for c in streams.poisson_cohort(w.num_clients, w.rate, w.seed, rnd):
            local = fresh()
            offset = 0
            with torch.no_grad():
                for p in local.parameters():
                    p.copy_(global_w[offset : offset + p.numel()].view_as(p).float())
                    offset += p.numel()
            opt = torch.optim.SGD(local.parameters(), lr=w.lr)
            batches = streams.minibatches(
                ds.client_train[c], w.batch_size, w.epochs, w.seed, rnd, int(c)
            )
            for b in batches:
                x, y = torch.from_numpy(ds.x_train[b]), torch.from_numpy(ds.y_train[b])
                opt.zero_grad()
                nn.functional.cross_entropy(local(x), y).backward()
                opt.step()
            new = torch.cat([p.detach().reshape(-1) for p in local.parameters()]).double()
            delta = new - global_w.float().double()
            norm = float(delta.norm())
            total += delta * min(1.0, w.clip_norm / norm)
        noise = torch.from_numpy(streams.block_normals(w.seed, (streams.NOISE, rnd), len(global_w)))
        total += noise * (w.noise_multiplier * w.clip_norm)
        global_w = (global_w.float() + (total / (w.rate * w.num_clients)).float()).double()
    return global_w.float().numpy()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_tight_floor_reproduces_a_plain_reference_loop(layout: str) -> None:
    """The tight floor (flat views, one add_ per step, flat clip) computes DP-FedAvg:
    its final model equals an independent straightforward loop's to float rounding,
    in either memory layout, and its step counts add up."""
    import dataclasses

    import torch

    w = dataclasses.replace(
        workloads.quick_variant(workloads.WORKLOADS["cnn"]),
        num_clients=40,
        mean_samples=12,
        rate=0.2,
        rounds=2,
        input_shape=(1, 8, 8),
        test_size=50,
    )
    ds = workloads.make_dataset(w)
    got = reference_loop.run_plain(w, ds, torch.device("cpu"), layout, record_rounds=1)
    want = _reference_dp_fedavg(w, ds)
    assert got["layout"] == layout
    rel = np.linalg.norm(got["_weights"] - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel
    assert got["steps"] == sum(got["round_steps"]) > 0
    assert len(got["_batches"]) == got["round_steps"][0]  # round 1's, for the minimal loop
    assert 0 < got["train_s"] < got["wall_s"]
    assert got["outside_training_s"] == pytest.approx(got["wall_s"] - got["train_s"])
    wall, cpu = reference_loop.minimal_loop(w, ds, got["_batches"], torch.device("cpu"), layout)
    assert wall > 0 and cpu > 0 and 0 < got["train_cpu_s"]


def test_flat_model_views_keep_each_parameter_layout() -> None:
    """Parameters become views of one flat vector with their own strides
    (channels_last stays channels_last), ``logical`` maps flat positions to the
    model's logical parameter order, and an in-place step on the parameters moves
    the flat vector."""
    import torch

    from engine.models import build_model

    model = build_model("cnn", (1, 12, 12), 10, torch.Generator().manual_seed(0))
    model = model.to(memory_format=torch.channels_last)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    conv = next(p for p in model.parameters() if p.dim() == 4)
    fm = reference_loop.FlatModel(model, torch.device("cpu"))
    assert conv.is_contiguous(memory_format=torch.channels_last)
    for p in fm.params:
        assert p.untyped_storage().data_ptr() == fm.flat.untyped_storage().data_ptr()
    assert torch.equal(fm.logical_weights(), before)
    assert torch.equal(before[fm.logical], fm.flat)  # flat[j] is logical entry logical[j]
    x = torch.randn(3, 1, 12, 12)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2]))
    grads = torch.autograd.grad(loss, fm.params)
    with torch.no_grad():
        torch._foreach_add_(fm.params, grads, alpha=-0.1)
    assert not torch.equal(fm.flat, before[fm.logical])
    assert torch.equal(fm.logical_weights()[fm.logical], fm.flat)


def test_w1_files_are_read_by_the_engine(tmp_path: Path) -> None:
    """W1's MNIST-format files round-trip through the engine's reader: every client
    holds 34-35 examples (all trained on) and the test set has the asked size."""
    import dataclasses

    from engine.config import load_config
    from engine.data import build_dataset
    from engine.privacy import rng as rngs

    w = dataclasses.replace(w1.W1, num_clients=20, test_size=30)
    root = w1.write_w1_files(w, tmp_path, n_train=20 * 34 + 10)
    cfg = load_config(overrides=w1.w1_overrides(w, root, 2, "auto"))
    assert cfg.dataset.client_test_fraction == 0
    ds = build_dataset(cfg.dataset, rngs.numpy_rng(0, rngs.DATA))
    assert sorted(set(ds.client_sizes().tolist())) == [34, 35]
    assert len(ds.y_test) == 30 and ds.x_train.shape[1:] == (1, 28, 28)
    assert sum(len(t) for t in ds.client_test) == 0


def test_run_memory_finds_every_descendant_and_its_peak() -> None:
    """run_memory.py's sampler sees processes below the one it runs (a grandchild
    here) and reads each one's peak RSS; the driver is named as such."""
    import subprocess
    import time

    rm = load_benchmark("run_memory.py")
    sleeper = "import time; time.sleep(30)"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {sleeper!r}])"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        found: list[int] = []
        for _ in range(100):
            found = rm.descendants(child.pid)
            if len(found) >= 2:
                break
            time.sleep(0.05)
        assert found[0] == child.pid and len(found) >= 2  # the child and its child
        status = rm.status_kb(found[1])
        assert status["VmHWM"] >= status["RssAnon"] > 0
        assert rm.name_of(child.pid, child.pid) == "driver (dpfl run)"
    finally:
        for pid in reversed(rm.descendants(child.pid)):
            os.kill(pid, 9)
        child.wait()


def test_cpu_until_mark_counts_descendants_up_to_the_mark(tmp_path: Path) -> None:
    """The benchmarks' CPU breakdown to a timeline mark: a grandchild's busy loop before the
    mark is counted (by role), what runs after the mark is not, and the total never
    exceeds what the machine's cores did over the same span."""
    timeline = tmp_path / "timeline.jsonl"
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    code = (
        "import json, subprocess, sys, time\n"
        f"subprocess.run([sys.executable, '-c', {busy!r}])\n"
        "mark = time.time()\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.8: pass\n"  # after the mark: not counted
        f"open({str(timeline)!r}, 'w').write(json.dumps(['rounds start', mark]) + '\\n')\n"
    )
    t0, t1, rc, _tail, usage = measure.cpu_until_mark(
        [sys.executable, "-c", code], dict(os.environ), timeline, "rounds start", every_s=0.02
    )
    assert rc == 0 and usage["samples"] > 0
    assert 0 < usage["span_s"] <= t1 - t0
    assert usage["by_role"]["other"] >= 0.5  # the grandchild (a python -c)
    assert usage["by_role"].get("driver", 0.0) < 0.5  # the child's own loop came after
    assert usage["total_cpu_s"] <= usage["machine_busy_core_s"] + 0.1
    # stop_title: sampling ends at the first sample whose command lines contain it
    # (the grandchild's, whose code names process_time), long before the mark
    timeline.unlink()
    *_, early = measure.cpu_until_mark(
        [sys.executable, "-c", code],
        dict(os.environ),
        timeline,
        "rounds start",
        every_s=0.02,
        stop_title="process_time",
    )
    assert 0 < early["samples"] < usage["samples"] / 2


@pytest.mark.benchmark
def test_eval_overlap_benchmark_compares_bit_identical_runs(tmp_path: Path) -> None:
    """Its smoke run: the overlapped run is the overlapped path (the pool says so),
    equals the unoverlapped one bit for bit, and both evaluated every round."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    cmd = benchmark_command("eval_overlap.py", "--quick", "--workers", "1", "--pairs", "1")
    cmd += ["--rounds", "3"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "workers 1 pair 1: same weights and rows: True" in proc.stdout
    assert "all pairs bit-identical: True" in proc.stdout
    for mode in ("off", "on "):
        line = next(x for x in proc.stdout.splitlines() if f"overlap {mode}:" in x)
        evaluation = float(line.split("evaluation ")[1].split(" s")[0])
        waited = float(line.split("behind ")[1].split(" s")[0])
        # both evaluate on the loop's path (on: the last round only); only the
        # overlapped run waits for sums computed beside a round
        assert evaluation > 0 and (waited > 0) == (mode == "on ")


@pytest.mark.parametrize("rule", ["sgd", "sam", "asam", "pgn", "blur"])
def test_step_rule_benchmark_compares_the_old_and_new_trainer_on_one_shard(rule: str) -> None:
    """benchmarks/local_step_rules.py: its *before* side is the trainer chosen before SAM,
    ASAM, PGN and BLUR had a dense form (one by one through autograd; SGD: the dense trainer,
    the control), its *after* side the dense trainer; both train the same shard to the
    same updates (float32 rounding), which the printed ratio relies on."""
    bench = load_benchmark("local_step_rules.py")
    r = bench.measure(rule, 4, 20, 1, 1)
    assert r["after_trainer"].startswith("dense ")
    if rule == "sgd":
        assert r["before_trainer"] == r["after_trainer"]
    else:
        assert r["before_trainer"].startswith("automatic: one by one")
    assert r["steps"] == 4 * 2  # 20 examples in batches of 10, one epoch
    assert r["rel_diff"] < 1e-4 and r["before_s"] > 0 and r["after_s"] > 0


def test_step_rule_trace_reads_the_pre_activations_the_model_computes() -> None:
    """benchmarks/local_step_rules.py --trace: the nearest ReLU input it reports for a step
    equals the one read off the model's own Linear outputs (forward hooks) at the same
    weights, so the flat-weight unpacking is the model's; and a shard whose two sides
    agree has nothing to explain."""
    import copy

    import numpy as np
    import torch

    bench = load_benchmark("local_step_rules.py")
    before, _, public = bench.workers("sgd", 3, 20, 1)
    worker = before.trainer.base if hasattr(before.trainer, "base") else before.trainer
    w = torch.cat([p.detach().reshape(-1) for p in worker.params]) * 1.3
    batch = np.arange(10)
    got = bench._nearest_kink(worker, "sgd", batch, w.double(), public)
    model = copy.deepcopy(worker.model).double()  # the trace computes in float64
    torch.nn.utils.vector_to_parameters(w.double(), model.parameters())
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outs.append(o)) for m in lin[:-1]]
    try:
        x = torch.from_numpy(worker.dataset.x_train[batch]).double()
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    want = min(float(z.abs().min() / z.abs().max()) for z in outs)
    assert got == pytest.approx(want, rel=1e-9) and 0 < got < 1
    assert bench.trace("sam", 4, 20, 1) == []
