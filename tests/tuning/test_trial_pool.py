"""The process runner (tuning.trial_pool): the driver runner's trials, in parallel in a
pool of processes started once, with the same rows bit for bit; resume, retries, and
which runner ``auto`` picks."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from engine.config import ConfigError, RayConfig
from tuning.plan import choose_runner
from tuning.report import load_rounds
from tuning.trial_pool import Cell, default_processes, run_cells_in_processes

pytestmark = pytest.mark.slow


def sweep(out: Path, n: int, **kwargs) -> pd.DataFrame:
    from tuning.experiment import run_tune

    return run_tune(
        None, ["dp_fedavg"], [4.0], num_samples=n, out=out, smoke_test=True, **kwargs
    )  # fmt: skip


def rows(out: Path) -> pd.DataFrame:
    cols = ["trial_id", "trial_index", "trial_seed", "round", "lr", "clip_norm", "epsilon"]
    df = load_rounds(out).sort_values(["trial_index", "round"])
    return df[[*cols, "test_accuracy", "train_loss_nonprivate"]].reset_index(drop=True)


@pytest.fixture(scope="module")
def driver_and_processes(tmp_path_factory) -> dict[str, Path]:
    """The same 3-trial smoke sweep by the driver runner and by the process runner
    (``auto``: random search, FIFO, no GPU, no cluster)."""
    root = tmp_path_factory.mktemp("pool")
    sweep(root / "driver", 3, runner="driver")
    table = sweep(root / "processes", 3)
    assert (table["status"] == "TERMINATED").all() and len(table) == 3
    return {"driver": root / "driver", "processes": root / "processes"}


def test_process_runner_rows_equal_the_driver_runners(driver_and_processes) -> None:
    """auto picked the process runner; its rows equal the driver runner's bit for bit
    (the same trials, seeds and in-process executor; only where they ran differs)."""
    out = driver_and_processes["processes"]
    assert (out / "tune" / "runner.txt").read_text().strip() == "processes"
    pd.testing.assert_frame_equal(rows(out), rows(driver_and_processes["driver"]))
    folder = out / "rounds" / "algorithm=dp_fedavg" / "epsilon_budget=4"
    assert len(list(folder.glob("*.parquet"))) == 3  # compacted: one file per trial


def test_process_runner_resumes_only_the_lost_trial(driver_and_processes, tmp_path) -> None:
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(driver_and_processes["processes"], out)
    folder = out / "rounds" / "algorithm=dp_fedavg" / "epsilon_budget=4"
    files = sorted(folder.glob("*.parquet"))
    kept = {f: f.stat().st_mtime_ns for f in files}
    lost = files[2]
    lost.unlink()
    (out / "trial_checkpoints" / f"{lost.stem}.pkl").unlink()
    again = sweep(out, 3, resume=True)  # auto on resume: the runner it started with
    assert (again["status"] == "TERMINATED").all() and len(again) == 3
    assert all(f.stat().st_mtime_ns == kept[f] for f in files if f != lost)
    pd.testing.assert_frame_equal(rows(out), rows(driver_and_processes["driver"]))
    with pytest.raises(ConfigError, match=r"^--runner driver: .* ran with --runner processes"):
        sweep(out, 3, resume=True, runner="driver")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_failing_trial_is_retried_once_then_reported(tmp_path, capsys, start_method) -> None:
    """A trial whose config cannot be built fails in its process: run twice (Tune's
    max_failures=1), then ERROR; the other cell's trial still runs and its rows are
    the driver runner's. Both ways of starting the processes (forked from this process,
    or from a fork server: tuning.pool_server)."""
    from engine.config import load_config
    from tuning.plan import SMOKE
    from tuning.spaces import space_for

    config = load_config(overrides=[f"{k}={v}" for k, v in SMOKE.items()])
    base = config.to_dict()
    base["ray"]["executor"] = "local"  # what run_tune sets for this runner
    space = space_for("dp_fedavg", None, config.recipe)
    bad = {**base, "dataset": {**base["dataset"], "num_clients": -5}}
    cells = [Cell("dp_fedavg", 4.0, 1, bad, {}, space), Cell("dp_fedavg", 8.0, 1, base, {}, space)]
    statuses = run_cells_in_processes(tmp_path, cells, 2, False, 2, start_method)
    assert sorted(statuses.values()) == ["ERROR", "TERMINATED"]
    from tuning.driver import run_cell_in_driver
    from tuning.trial import trial_body

    body = trial_body(base, "dp_fedavg", 8.0, str(tmp_path / "driver"), {}, space)
    run_cell_in_driver(tmp_path / "driver", "dp_fedavg", 8.0, 1, 2, body, False)
    pd.testing.assert_frame_equal(rows(tmp_path), rows(tmp_path / "driver"))
    err = capsys.readouterr().err
    assert "(attempt 1 of 2)" in err and "(attempt 2 of 2)" in err
    assert "dataset.num_clients" in err


def test_auto_runner_and_process_count() -> None:
    local, cluster = RayConfig(), RayConfig(address="ray://head:10001")
    assert choose_runner("auto", "random", "fifo", "auto", local, False) == "processes"
    assert choose_runner("auto", "random", "fifo", "local", local, False) == "processes"
    assert choose_runner("auto", "optuna", "fifo", "auto", local, False) == "tune"
    assert choose_runner("auto", "random", "asha", "auto", local, False) == "tune"
    assert choose_runner("auto", "random", "fifo", "auto", cluster, False) == "tune"
    assert choose_runner("auto", "random", "fifo", "auto", local, True) == "tune"  # a GPU
    assert choose_runner("auto", "random", "fifo", "ray", local, False) == "tune"
    assert choose_runner("driver", "random", "fifo", "auto", local, False) == "driver"
    from tuning.pool_server import fork_is_safe

    assert not fork_is_safe(2)  # an OpenMP pool of two threads is not forked
    # one process per CPU a trial trains on, at most one per trial
    assert default_processes(1.0, 8, cpus=2) == 2
    assert default_processes(0.5, 8, cpus=2) == 2
    assert default_processes(2.0, 8, cpus=8) == 4
    assert default_processes(1.0, 3, cpus=16) == 3
    assert default_processes(4.0, 8, cpus=2) == 1
    assert default_processes(1.0, cpus=16) == 16  # no cap: the leaderboard's runs


def test_process_runner_takes_only_what_it_can_run(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"tune\.runner=processes .* --scheduler fifo"):
        sweep(tmp_path / "a", 2, runner="processes", scheduler="asha")
    with pytest.raises(ConfigError, match=r"^tune\.trial_executor=ray: tune\.runner=processes"):
        sweep(tmp_path / "b", 2, runner="processes", trial_executor_choice="ray")


def _threads_after_a_parallel_op() -> int:
    """In a trial process: an element-wise operation large enough for torch to split it
    over its threads (it would enter OpenMP with more than one)."""
    import torch

    x = torch.randn(2_000_000)
    for _ in range(5):
        x = x * 1.0001 + 0.5
    return torch.get_num_threads()


def test_a_forked_trial_process_never_enters_the_parents_openmp_pool() -> None:
    """This process's OpenMP pool is live (an operation ran on two threads); a trial
    process forked from it sets its threads first (``pin_threads``) and completes a
    parallel-sized operation. Without that a forked child entering OpenMP with two
    threads waits forever for pool threads it does not have (measured: it hangs)."""
    import torch

    from tuning.trial_pool import new_pool, stop_pool

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(400, 400)
        (a @ a).sum()
        torch.randn(2_000_000).mul(2.0).sum()
        pool = new_pool(1, threads=1, start_method="fork")
        try:
            assert pool.submit(_threads_after_a_parallel_op).result(timeout=60) == 1
        finally:
            stop_pool(pool)
    finally:
        torch.set_num_threads(before)
