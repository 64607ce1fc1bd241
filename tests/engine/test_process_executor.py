"""``ray.executor=processes``: client workers forked on this machine, no Ray.

A recipe's rows and final model equal the in-process executor's bit for bit (the
same shards, the same reduction order, the same streams; one recipe per kind of
state); a resume from a checkpoint restores each client's state to the worker that
trains it; a worker that raises or dies stops the run with an error naming it; no Ray
module is imported and no worker outlives the run."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from algorithms import RECIPES
from engine.config import ConfigError, load_config
from engine.runtime.executors import WorkerLostError
from engine.runtime.process_pool import WorkerFailedError
from engine.simulation import simulate
from tests.cross_process import CROSS_PROCESS_RECIPES, TINY
from tests.live_rows import released_rounds

#: what differs between two runs of one computation: the clock
TIMES = {"wall_time_s_nonprivate"}


def _run(name: str, executor: str, *extra: str, **kwargs):
    config = load_config(overrides=[*TINY, f"algorithm={name}", f"ray.executor={executor}", *extra])
    return simulate(config, write=False, **kwargs)


def _assert_same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    cols = [c for c in a.columns if c not in TIMES]
    assert set(cols) == set(b.columns) - TIMES
    pd.testing.assert_frame_equal(a[cols], b[cols], check_exact=True)


FORKED = CROSS_PROCESS_RECIPES


def test_the_chosen_recipes_exist() -> None:
    assert set(FORKED) <= set(RECIPES)


@pytest.mark.parametrize("name", FORKED)
def test_recipe_equals_the_in_process_executor(name: str) -> None:
    forked = _run(name, "processes")
    local = _run(name, "local")
    assert len(forked.rounds) == 2
    assert np.array_equal(forked.weights, local.weights)
    _assert_same_rows(forked.rounds, local.rounds)


def test_workers_from_a_fork_server_equal_the_in_process_executor(monkeypatch) -> None:
    """Where forking this process is not safe (a thread running, Ray up) the workers
    come from a fork server: the same rows, and a worker idle between calls (here
    1.5 s after each round) keeps waiting for the driver, not for the fork server
    that is its parent."""
    import time

    from engine.runtime import forking

    monkeypatch.setattr(forking, "fork_is_safe", lambda threads: False)
    name = "dp2_fedsam"  # client state in the workers
    served = _run(name, "processes", on_round=lambda row, ex: time.sleep(1.5))
    local = _run(name, "local")
    assert np.array_equal(served.weights, local.weights)
    _assert_same_rows(served.rounds, local.rounds)


def test_three_workers_split_the_cohort_like_three_in_process_shards() -> None:
    forked = _run("dp_fedavg", "processes", "ray.num_workers=3")
    local = _run("dp_fedavg", "local", "ray.num_workers=3")
    assert np.array_equal(forked.weights, local.weights)
    _assert_same_rows(forked.rounds, local.rounds)


def test_resume_restores_each_clients_state_to_its_worker() -> None:
    """dp2_fedsam keeps a personal head per client in the worker that trains it: a
    run resumed from round 2's checkpoint (its heads spread back over the workers by
    owner) equals the uninterrupted run, personal accuracy included."""
    taken: dict[int, dict] = {}

    def keep(state: dict, row: dict) -> None:
        taken[int(row["round"])] = copy.deepcopy(state)

    extra = ("rounds=4", "dataset.client_test_fraction=0.25")
    full = _run("dp2_fedsam", "processes", *extra, on_checkpoint=keep)
    heads = taken[2]["clients"]
    assert len(heads) > 0  # the checkpoint holds client state from both workers
    resumed = _run("dp2_fedsam", "processes", *extra, resume=taken[2])
    assert np.array_equal(resumed.weights, full.weights)
    tail = full.rounds[full.rounds["round"] > 2].reset_index(drop=True)
    _assert_same_rows(resumed.rounds[resumed.rounds["round"] > 2].reset_index(drop=True), tail)
    assert resumed.rounds["personal_accuracy_nonprivate"].notna().any()


def _pool(*extra: str):
    from engine.simulation import prepare
    from engine.simulation.preparation import make_executor

    config = load_config(overrides=[*TINY, "ray.executor=processes", *extra])
    return make_executor(prepare(config)).pool


def test_a_worker_that_raises_reports_its_traceback_and_the_pool_goes_on() -> None:
    """A worker's call that raises (here a shard naming a client that does not exist)
    comes back as WorkerFailedError with the worker's own traceback; the worker
    answers the next call. (Provoked through the input, not a patch, so it holds
    whether the workers were forked or came from a fork server.)"""
    pool = _pool()
    try:
        cohort, weights, public = pool.begin_round(0)
        bad = [np.array([10**9]), np.array([], dtype=np.int64)]
        with pytest.raises(WorkerFailedError) as err:
            pool.train(0, bad, weights, public)
        text = str(err.value)
        assert "dpfl-client-worker-0 (train_shard) raised" in text and "Traceback" in text
        shards = [cohort[::2], cohort[1::2]]
        partials = pool.train(0, shards, weights, public)  # both workers still answer
        assert sum(p.num_clients for p in partials) == len(cohort)
    finally:
        pool.close()


def test_a_killed_worker_stops_the_run_naming_it_and_the_intact_rounds() -> None:
    pids: list[int] = []

    def kill_after_round_one(row: dict, executor) -> None:
        if row["round"] == 1:
            pids.extend(p.pid for p in executor.pool.processes)
            os.kill(executor.pool.processes[1].pid, signal.SIGKILL)

    with pytest.raises(WorkerLostError) as err:
        _run("dp_fedavg", "processes", "rounds=3", on_round=kill_after_round_one)
    text = str(err.value)
    assert "round 2: dpfl-client-worker-1" in text and "The 1 completed rounds are intact" in text
    for pid in pids:  # closed: none of the run's workers is left
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for this purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def test_no_ray_and_no_worker_left_after_a_run() -> None:
    """In a fresh interpreter: a run on forked workers imports no Ray module, and its
    workers have exited when simulate returns."""
    code = (
        "import sys, multiprocessing as mp\n"
        "from engine.config import load_config\n"
        "from engine.simulation import simulate\n"
        f"c = load_config(overrides={[*TINY, 'ray.executor=processes']!r})\n"
        "r = simulate(c, write=False)\n"
        "print(len(r.rounds), sorted(m for m in sys.modules if m == 'ray' or "
        "m.startswith('ray.')), len(mp.active_children()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split("\n")[-2] == "2 [] 0"


def test_an_unknown_executor_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="ray.executor.*ray, processes, local"):
        load_config(overrides=["ray.executor=threads"])


def test_ctrl_c_stops_the_run_and_every_worker(tmp_path) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C) after the first round:
    the driver stops, the workers (which leave SIGINT to the driver) are stopped by it,
    and no process of the group is left; the rounds released so far stay on disk."""
    import time

    out = tmp_path / "run"
    args = [sys.executable, "-m", "engine.cli", "run", "-q", "--executor", "processes"]
    for o in [*TINY, "rounds=400", "dataset.synthetic_mean_samples=60", f"out={out}"]:
        args += ["--set", o]
    # A terminal's child has SIGINT's default action; a background job of a
    # non-interactive shell (``.ci/run ... &``) hands SIG_IGN down to every process
    # it starts, and a process that ignores SIGINT is not interrupted by it.
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if released_rounds(out / "rounds.parquet") >= 1:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    group = proc.pid  # its own session: the group id is its pid
    members = [p for p in _group(group) if p != proc.pid]
    assert len(members) == 2  # the two forked workers
    os.killpg(group, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # 130 and one line (dispatch): a dropped raise of the interrupt (engine.runtime.
    # interrupt) is raised again before the next round, so the run never goes on to 0
    assert proc.returncode == 130, err.decode()
    assert "interrupted" in err.decode()
    assert "Traceback" not in err.decode()  # neither the driver nor a worker printed one
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in members):
        time.sleep(0.1)
    assert not any(_alive(p) for p in members)
    assert 1 <= len(pd.read_parquet(out / "rounds.parquet")) < 400


def _group(pgid: int) -> list[int]:
    """The pids of the process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(entry))
    return pids


def test_the_shared_round_mapping_leaves_no_file_and_carries_the_sums() -> None:
    """The weights and partial sums travel through one shared mapping, whose file is
    gone once the workers have mapped it; a round's partials read from it sum to
    the shard's clients and hold finite sums of clipped updates (each of norm <= C)."""
    import glob

    before = set(glob.glob("/dev/shm/dpfl-round-*"))
    pool = _pool()
    try:
        assert pool.shared is not None and pool.shared.path is None
        assert set(glob.glob("/dev/shm/dpfl-round-*")) == before
        cohort, weights, public = pool.begin_round(0)
        shards = [cohort[::2], cohort[1::2]]
        partials = pool.train(0, shards, weights, public)
        for shard, partial, slot in zip(shards, partials, pool.shared.partials):
            assert partial.num_clients == len(shard)
            assert partial.update_sum is slot
            assert (len(shard) == 0) == (not np.any(slot))  # written by its worker
            clip = pool.server.clip_norm
            assert np.linalg.norm(partial.update_sum) <= len(shard) * clip * (1 + 1e-9)
    finally:
        pool.close()
