"""Run twice in a fresh local Ray: uninterrupted, then with one client-worker SIGKILLed
mid-round (found through Ray's state API). Writes the outcomes as JSON to
``OUT_DIR/result.json``.

The outcomes go to a file, not to stdout: Ray's driver thread that relays raylet errors
(``(raylet) A worker died ...``) prints to stdout too, and a print from one thread can
land between another thread's text and its newline, so a stdout line is no reliable
carrier. Used by ``test_fault_tolerance.py`` as a subprocess: the state API needs the
dashboard, which the test session's shared Ray instance runs without.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import ray

from engine.config import load_config, replace
from engine.simulation import simulate

KILL_AFTER_ROUND = 2
# Short: round 2's row is released beside round 3's training, so the kill lands in
# round 3 (0.6 s let a quiet machine finish rounds 3-5 first: kills 1, retries 0).
KILL_DELAY_S = 0.1


def config(algorithm: str, restarts: int, server: str = "auto"):
    """``server``: ``ray.server``. The runs without a server kill keep ``auto`` (the
    server in the driver on this one-node Ray); killing the server needs an actor, so
    that run also shows the two placements give the same run."""
    return load_config(
        overrides=[
            f"algorithm={algorithm}",
            "dataset.num_clients=40",
            # 100 examples a client (was 300): a round of dp_fedavg costs ~2.7 s of CPU
            # instead of ~7 s (2 workers on 2 cores: ~1.3 s), still twice the 0.6 s
            # before the kill, and rounds 3-5 leave it ~4 s to land in.
            "dataset.synthetic_mean_samples=100",
            "dataset.synthetic_dim=60",
            "sampling.rate=0.5",
            "rounds=5",
            "eval.every=1",
            "model.name=mlp",
            "local.epochs=3",
            "local.batch_size=4",
            "local.lr=0.05",
            "privacy.noise_multiplier=0.8",
            "ray.executor=ray",
            "ray.num_workers=2",
            "ray.num_cpus_per_worker=1",
            f"ray.max_worker_restarts={restarts}",
            f"ray.server={server}",
        ]
    )


def worker_pid(name: str, address: str) -> int:
    """The process id of the live actor ``name``, from Ray's state API."""
    from ray.util.state import list_actors

    for _ in range(50):
        alive = list_actors(
            address=address, filters=[("name", "=", name), ("state", "=", "ALIVE")], detail=True
        )
        if alive:
            return int(alive[0].pid)
        time.sleep(0.1)
    raise RuntimeError(f"no ALIVE actor named {name}")


def run(
    algorithm: str, restarts: int, kills: int, target: str, name: str, address: str, out: str
) -> dict:
    """One run; ``kills`` times, KILL_DELAY_S into the round after round 2, SIGKILL the actor
    ``target`` (``client-worker-1`` or ``server``). Results go to ``out``."""
    killed: list[dict] = []
    stats: dict = {}

    scheduled: list[int] = []

    def kill_later(row, executor) -> None:
        stats["executor"] = executor
        if row["round"] < KILL_AFTER_ROUND - 1 or len(scheduled) >= kills:
            return
        # Looked up a round ahead: the state API can take seconds, and a lookup made
        # after round 2 let a quiet machine finish the run before the kill landed.
        if "pid" not in stats:
            stats["pid"] = worker_pid(f"{name}:{target}", address)
        if row["round"] < KILL_AFTER_ROUND:
            return
        pid = stats.pop("pid")
        scheduled.append(pid)

        def kill() -> None:
            os.kill(pid, signal.SIGKILL)
            killed.append({"round": row["round"] + 1, "pid": pid})

        threading.Timer(KILL_DELAY_S, kill).start()
        time.sleep(0.01)

    outcome: dict = {"error": None}
    t0 = time.perf_counter()
    try:
        server = "actor" if target == "server" else "auto"
        cfg = replace(config(algorithm, restarts, server), out=out)
        result = simulate(cfg, run_name=name, on_round=kill_later)
        outcome["weights"] = result.weights.tolist()
        outcome["rows"] = result.rounds.drop(columns="wall_time_s_nonprivate").to_dict("list")
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome["error"] = f"{type(e).__name__}: {e}"
    ex = stats.get("executor")
    outcome.update(
        kills=len(killed),
        retries=getattr(getattr(ex, "pool", None), "retries", None),
        retry_seconds=getattr(getattr(ex, "pool", None), "retry_seconds", None),
        seconds=time.perf_counter() - t0,
    )
    return outcome


def main() -> None:
    """argv: OUT_DIR algorithm:restarts:kills:target ... — outcomes to OUT_DIR/result.json."""
    ctx = ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=True,
        configure_logging=False,
        log_to_driver=False,
    )
    address = f"http://{ctx.dashboard_url}"
    results = {}
    out_dir = sys.argv[1]
    for k, spec in enumerate(sys.argv[2:]):
        algorithm, restarts, kills, target = spec.split(":")
        out = f"{out_dir}/run{k}"
        results[spec] = run(algorithm, int(restarts), int(kills), target, f"run{k}", address, out)
    written = f"{out_dir}/result.json.partial"
    with open(written, "w") as f:
        json.dump(results, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(written, f"{out_dir}/result.json")  # the file exists only when complete
    ray.shutdown()


if __name__ == "__main__":
    main()
