"""Where a round's time goes: per phase and per round, through Ray and in one process.

Usage::

    python -m benchmarks.round_phases [--workload cnn resnet18_gn] [--executor ray local]
        [--rounds 4] [--workers 2] [--writes background sync] [--quick]

Runs ``simulate`` (``write=True`` into a temporary folder, so checkpoints and Parquet
rows are timed too) on ``benchmarks/bench.py``'s workloads (``resnet18_gn`` with its
small CPU sizes when no GPU is visible) with an :class:`engine.telemetry.phases.PhaseTimer`
installed on the executor (``Executor.set_timer``); engine code runs unchanged, the
timer only reads the clock. Printed, per round and as the mean of rounds 2..N:

* driver: ``begin_round`` (the server samples the cohort and hands out the weights),
  ``shard_split``, ``dispatch`` (submitting the shards), ``train_wait`` (the driver
  waits for the slowest shard), ``finish_round`` (moving the partial sums to the server,
  ``reduce``, ``noise_draw`` when not drawn ahead, ``server_update``), ``evaluation``
  (or, evaluated beside the next round, ``evaluation_dispatch`` and, inside the next
  round, ``evaluation_wait``: only with ``eval.every`` below the rounds; here the
  workload evaluates the last round, before the run ends),
  ``round_checkpoint_refs`` (Ray's in-memory round checkpoint), ``checkpoint_state``
  (``Checkpoint.take``: the state gathered and copied, on the loop's thread in both
  modes) and, with ``--writes sync`` only, ``checkpoint_file`` and ``parquet_row``;
  ``noise_draw_ahead`` is the server's noise drawn in its own thread (started when the
  previous round's update is made; off the critical path when a core is free) and
  ``noise_wait`` the part of it the round waited for (inside ``server_update``);
* workers (Ray: read from each actor after the round): ``local_training`` (inside the
  trainer) and ``partial_sum`` (the rest of the shard: differences, clipping, the
  float64 sum and its hand-over), and ``idle`` = ``train_wait`` − the worker's shard;
* ``other`` = the round's wall time (between two rounds' ends) − the driver's
  phases: row assembly, metrics and Ray's bookkeeping.

``--writes`` picks how ``checkpoint.pkl`` and the Parquet row are written (both may be
given; each is one run and one table, the mode in its header and summary lines):

* ``background`` (the default): what ``dpfl run`` does. ``simulate`` gets no
  ``on_round``, so :func:`engine.simulation.callbacks.round_callbacks` makes one
  ``BackgroundWrites``: the checkpoint is taken on the loop's thread
  (``checkpoint_state``), then pickled and written (``checkpoint_file (writer)``) and the
  row appended (``parquet_row (writer)``) by the writer thread ``dpfl-round-writer``
  while the next round runs. Those two are writer-thread time, listed apart, not
  driver phases and not subtracted in ``other``; column r is round r's checkpoint and
  row (written during round r+1, the last one while the run closes; their share is
  how busy the writer is, not time the round waits). ``writer_queue_wait`` is the
  driver's time handing the round to the writer besides ``checkpoint_state``: it grows
  when the writer falls ``BackgroundWrites.PENDING`` rounds behind and the loop blocks.
  The writer competes with the loop for the GIL and the cores, which shows in the
  driver's phases, not in its own rows. The per-round hook is
  ``callbacks.Metrics.on_round`` wrapped for the run (the round's row and executor,
  after the metrics; replayed rows skipped as ``Metrics`` skips them).
* ``sync``: ``simulate(on_round=...)``, as a Tune trial runs (Tune passes ``on_round``):
  the checkpoint file and the row are written on the loop's thread before the round is
  released, so ``checkpoint_file`` and ``parquet_row`` are driver phases on the critical
  path. ``on_round`` only reads the timers here; a Tune report is where it is called in
  a trial (``benchmarks/tune_overhead.py`` measures Tune's cost).

The timer is entered from the loop's thread, the server's noise thread and (background)
the writer thread (``PhaseTimer`` adds and takes under a lock), and the writer
thread's phases are booked to the round they write. The object sizes moved per round are printed
from d: the weights (float32, one object read by every worker), the k partial sums
(float64: the privacy argument's exact summation, see README) and the round checkpoint.
Timings are wall-clock on a possibly shared machine: the load average is printed with
every table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

import engine.simulation.callbacks as sim_callbacks
import engine.simulation.runner as sim
from benchmarks import dpfl_side, workloads
from engine.config import load_config
from engine.results import RoundWriter
from engine.telemetry.phases import PhaseTimer

DRIVER_PHASES = [
    "begin_round",
    "shard_split",
    "dispatch",
    "train_wait",
    "train_shards",
    "finish_round",
    "evaluation",
    "evaluation_dispatch",
    "evaluation_wait",
    "round_checkpoint_refs",
    "checkpoint_state",
]
#: written by the loop's thread (sync: driver phases) or by the writer thread (background)
WRITE_PHASES = ["checkpoint_file", "parquet_row"]
#: background only: handing the round to the writer, besides ``checkpoint_state``
WRITER_HANDOFF = "writer_queue_wait"
WRITER_THREAD = "dpfl-round-writer"  # BackgroundWrites' thread
SERVER_PHASES = [
    "cohort_sampling",
    "noise_draw_ahead",
    "noise_wait",
    "reduce",
    "noise_draw",
    "server_update",
]
WORKER_PHASES = ["local_training", "partial_sum", "idle"]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Recorder:
    """Installs the timer on the run's executor and reads every phase after each round;
    in background mode the writer thread's phases are kept by the round they write."""

    def __init__(self, writes: str = "background") -> None:
        self.writes = writes
        self.driver = DRIVER_PHASES + (WRITE_PHASES if writes == "sync" else [WRITER_HANDOFF])
        self.timer = PhaseTimer()  # thread-safe: the writer thread adds to it too
        self._lock = threading.Lock()
        self.written: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.write_threads: set[str] = set()
        self.executor: Any = None
        self.rounds: list[dict[str, float]] = []
        self.dim = 0
        self.workers = 1
        self.t_last = 0.0

    def make_executor(self, original):
        def wrapped(prep, *a, **k):
            ex = original(prep, *a, **k)
            ex.set_timer(self.timer)
            self.executor = ex
            pool = ex.pool
            server = getattr(pool, "server", None)
            inner = getattr(server, "instance", server)
            self.dim = int(inner.dim()) if hasattr(inner, "dim") and inner else 0
            if not self.dim:  # a server actor
                self.dim = int(pool._ray.get(server.dim.remote()))
            self.workers = len(getattr(pool, "workers", [])) or prep.config.ray.num_workers
            checkpoint = ex.checkpoint

            def timed_checkpoint():
                with self.timer.phase("checkpoint_state"):
                    return checkpoint()

            ex.checkpoint = timed_checkpoint
            self.t_last = time.perf_counter()
            return ex

        return wrapped

    @contextlib.contextmanager
    def write_phase(self, name: str, rnd: int) -> Iterator[None]:
        """A checkpoint file or row write: a driver phase (sync), or the writer
        thread's time for round ``rnd`` (background)."""
        with self._lock:
            self.write_threads.add(threading.current_thread().name)
        if self.writes == "sync":
            with self.timer.phase(name):
                yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.written[rnd][name] += time.perf_counter() - t0

    def attach_writes(self) -> None:
        """After the run (the writer has flushed): each round's writer-thread times."""
        for r in self.rounds:
            for k, v in self.written.get(int(r["round"]), {}).items():
                r[f"{k} (writer)"] = v

    def on_round(self, row: dict, executor: Any) -> None:
        now = time.perf_counter()
        rec = dict(self.timer.take())
        rec["round_wall"] = now - self.t_last
        rec["round"] = int(row["round"])
        if WRITER_HANDOFF in rec:  # BackgroundWrites.on_round: Checkpoint.take, then put
            rec[WRITER_HANDOFF] -= rec.get("checkpoint_state", 0.0)
        pool = executor.pool
        if hasattr(pool, "take_worker_phase_times"):
            per = pool.take_worker_phase_times()
            wait = rec.get("train_wait", 0.0)
            lt = [w.get("local_training", 0.0) for w in per]
            shard = [w.get("worker_shard", 0.0) for w in per]
            rec["local_training"] = max(lt)
            rec["partial_sum"] = max(s - t for s, t in zip(shard, lt))
            rec["idle"] = statistics.mean(max(0.0, wait - s) for s in shard)
        else:  # in process: the worker's timer is the driver's
            rec["partial_sum"] = rec.get("train_shards", 0.0) - rec.get("local_training", 0.0)
        outer = sum(rec.get(k, 0.0) for k in self.driver)
        rec["other"] = rec["round_wall"] - outer
        self.rounds.append(rec)
        self.t_last = time.perf_counter()


def run(
    w, ds, executor: str, workers: int, gpu: bool, writes: str, overrides: list[str] | None = None
) -> tuple[Recorder, float, Any]:
    """One timed ``simulate`` of workload ``w`` (or of ``overrides``, then ``w`` is
    unused and ``ds`` may be None: the run builds its data); the recorder, the wall
    time and the result."""
    overrides = list(overrides or dpfl_side.dpfl_overrides(w, workers, None, gpu))
    overrides = [o for o in overrides if not o.startswith("ray.executor=")]
    overrides.append(f"ray.executor={executor}")
    if gpu and executor == "local":  # in process on the GPU too: the same device
        overrides.append("ray.worker_device=cuda")
    rec = Recorder(writes)
    original_make, original_save = sim.make_executor, sim_callbacks.save_checkpoint
    original_append = RoundWriter.append
    original_metrics = sim_callbacks.Metrics.on_round
    original_handoff = sim_callbacks.BackgroundWrites.on_round

    def save(out_dir, state):
        with rec.write_phase("checkpoint_file", int(state["row"]["round"])):
            original_save(out_dir, state)

    def append(self, row):
        with rec.write_phase("parquet_row", int(row["round"])):
            return original_append(self, row)

    def metrics_on_round(self, row, state):  # the loop's thread, after the handoff
        original_metrics(self, row, state)
        if not state.replayed:  # as Metrics skips them
            rec.on_round(row, state.executor)

    def handoff(self, row, state):
        with rec.timer.phase(WRITER_HANDOFF):
            original_handoff(self, row, state)

    sim.make_executor = rec.make_executor(original_make)
    sim_callbacks.save_checkpoint = save
    RoundWriter.append = append  # type: ignore[method-assign]
    if writes == "background":  # dpfl run's path: no on_round, so BackgroundWrites
        sim_callbacks.Metrics.on_round = metrics_on_round  # type: ignore[method-assign]
        sim_callbacks.BackgroundWrites.on_round = handoff  # type: ignore[method-assign]
        on_round = None
    else:
        on_round = rec.on_round
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(overrides=[*overrides, f"out={tmp}/run"])
            t0 = time.perf_counter()
            result = sim.simulate(cfg, dataset=ds, write=True, on_round=on_round, run_name="phases")
            wall = time.perf_counter() - t0
    finally:
        sim.make_executor = original_make
        sim_callbacks.save_checkpoint = original_save
        RoundWriter.append = original_append  # type: ignore[method-assign]
        sim_callbacks.Metrics.on_round = original_metrics  # type: ignore[method-assign]
        sim_callbacks.BackgroundWrites.on_round = original_handoff  # type: ignore[method-assign]
    rec.attach_writes()
    want = {WRITER_THREAD} if writes == "background" else {threading.current_thread().name}
    if rec.write_threads != want:  # the mode is not the path that ran
        raise RuntimeError(f"--writes {writes}: written by {rec.write_threads}, not {want}")
    return rec, wall, result


def report(name: str, rec: Recorder, wall: float) -> None:
    rows = rec.rounds
    writer = [f"{k} (writer)" for k in WRITE_PHASES] if rec.writes == "background" else []
    order = [*rec.driver, *SERVER_PHASES, *WORKER_PHASES, *writer, "other", "round_wall"]
    keys = [k for k in order if any(k in r for r in rows)]
    print(
        f"\n-- {name}: writes {rec.writes}; d = {rec.dim:,}, workers = {rec.workers}; "
        f"load average {load()}"
    )
    if writer:
        print(
            f"(writer) rows: time in the writer thread {WRITER_THREAD}, overlapping the next "
            "round; column r = round r's writes; not driver phases, not subtracted in other"
        )
    head = f"{'phase (s)':26s}" + "".join(f"{'r' + str(i + 1):>8s}" for i in range(len(rows)))
    print(head + f"{'mean 2..':>9s}{'share':>7s}")
    steady = rows[1:] or rows
    wall_mean = statistics.mean(r["round_wall"] for r in steady)
    for k in keys:
        vals = [r.get(k, 0.0) for r in rows]
        m = statistics.mean(r.get(k, 0.0) for r in steady)
        cells = "".join(f"{v:8.3f}" for v in vals)
        print(f"{k:26s}{cells}{m:9.3f}{m / wall_mean:7.1%}")
    d, k = rec.dim, rec.workers
    print(
        f"objects per round: weights {d * 4 / 2**20:.1f} MiB (float32, read by {k} workers); "
        f"partial sums {k} x {d * 8 / 2**20:.1f} MiB (float64); round checkpoint "
        f"{d * 4 / 2**20:.1f} MiB; noise {d * 8 / 2**20:.1f} MiB (float64, in the server)"
    )
    train = statistics.mean(r.get("local_training", 0.0) for r in steady)
    print(
        f"{name} [writes {rec.writes}]: round {wall_mean:.3f} s, client training "
        f"(slowest worker) {train:.3f} s, "
        f"outside training {1 - train / wall_mean:.1%}; simulate wall {wall:.2f} s; "
        f"load average {load()}"
    )


def kernels(d: int = 11_173_962, repeats: int = 5) -> None:
    """A worker's per-client O(d) work for an update of d coordinates, the former
    expressions against the current ones (same values, checked here), in one run: CPU
    seconds (``time.process_time``, one torch thread) and their ratio."""
    from engine.privacy import kernels as m

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(d, generator=g) * 1e-2
    factor = 0.5 / m._norm64(u)
    total = torch.zeros(d, dtype=torch.float64)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return min(times)

    wide, narrow = m.ClipScratch().buffers(u)
    pairs = {
        "clip scale-and-cast": (
            lambda: (u.double() * factor).to(torch.float32),
            lambda: m._scale_round_trip(wide, narrow, u, (factor,)),
        ),
        "float64 accumulate": (lambda: total.add_(u), lambda: m.add_float64_(total, u)),
    }
    m._scale_round_trip(wide, narrow, u, (factor,))
    assert torch.equal((u.double() * factor).to(torch.float32), narrow)

    # fedsmp_topk's and LUS's client mask (algorithms.pieces.sparsify.topk_mask) at
    # dp_fedsam_topk's default kept fraction 0.4: the former stable sort of -|u|
    # against the current kthvalue path (the same mask).
    from algorithms.pieces.sparsify import num_kept, sorted_topk_mask, topk_mask

    k = num_kept(d, 0.4)
    pairs["top-k mask (fraction 0.4)"] = (
        lambda: sorted_topk_mask(u.abs(), k),
        lambda: topk_mask(u, k),
    )
    assert torch.equal(sorted_topk_mask(u.abs(), k), topk_mask(u, k))

    # A worker's whole clip-and-sum of one client (engine.federated.client.train_shard):
    # the former whole-vector expressions (before: the norm through vector_norm's own
    # float64 temporary, the scaled cast and its retries through _cast_within, then
    # add_float64_) against clip_and_add_ over a reused float64 image (after), for an
    # update below C and one above it (clipped, cast, re-measured).
    def former(t: torch.Tensor, c: float) -> None:
        norm = m._norm64(u)
        first = m._first_factor(c, norm, u.dtype)
        out = u if norm <= c else m._cast_within(u.double() * first, u.dtype, c)[0]
        m.add_float64_(t, out)

    scratch = m.ClipScratch()
    norm_u = m._norm64(u)
    for label, c in (("unclipped", 2.0 * norm_u), ("clipped", 0.5 * norm_u)):
        pairs[f"clip + float64 sum, {label}"] = (
            lambda c=c: former(total, c),
            lambda c=c: m.clip_and_add_(total, u, c, scratch),
        )
        want, got = total.clone(), total.clone()
        former(want, c)
        m.clip_and_add_(got, u, c, scratch)
        assert torch.equal(want, got)
    norm = best(lambda: m._norm64(u))
    print(f"\n-- per-client kernels, d = {d:,} (CPU s, best of {repeats}); load average {load()}")
    print(f"float64 norm via vector_norm(dtype=float64), the former path: {norm:.4f}")
    for name, (before, after) in pairs.items():
        b, a = best(before), best(after)
        print(f"{name}: before {b:.4f}, after {a:.4f}, ratio {a / b:.2f}; load average {load()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", nargs="+", default=["cnn", "resnet18_gn"])
    ap.add_argument("--executor", nargs="+", default=["ray", "local"], choices=["ray", "local"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument(
        "--writes",
        nargs="+",
        default=["background"],
        choices=["background", "sync"],
        help="checkpoint file and row: in the writer thread (dpfl run's path, the default) "
        "or on the loop's thread before the release (sync: a Tune trial's path)",
    )
    ap.add_argument(
        "--kernels", action="store_true", help="only the per-client kernels, before/after"
    )
    args = ap.parse_args(argv)
    if args.kernels:
        for d in (199_210, 1_663_370, 11_173_962):  # the mlp, the 28x28 cnn, resnet18_gn
            kernels(d)
        return 0
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    cuda = torch.cuda.is_available()
    print(f"== round phases; torch {torch.__version__}, CUDA {cuda}; load average {load()}")
    ray.init(num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False)
    try:
        for name in args.workload:
            w, gpu = workloads.workload_for(name, cuda, args.quick, args.rounds)
            ds = workloads.make_dataset(w)
            for ex in args.executor:
                for writes in args.writes:
                    rec, wall, _ = run(w, ds, ex, args.workers, gpu, writes)
                    report(f"{name} / {ex}", rec, wall)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
