"""dpfl tune on 2 cores: the smoke experiment, and interrupt-then-resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from engine.privacy.accounting import SamplingSpec, compute_epsilon, default_delta
from engine.privacy.resolve import calibrate_noise_multiplier
from tuning.report import load_rounds, load_trials, write_report

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# One epsilon: the resume logic is the same for every cell, and each extra cell cost
# ~60 s of the suite's time (ε cells and their trial seeds: tests/tuning/test_trial_seeds.py).
ALGS, EPS, SAMPLES = ["dp_fedavg", "fedsmp_randk"], [8.0], 2


def smoke_sweep(out: Path, num_samples: int, **kwargs) -> pd.DataFrame:
    """``run_tune`` on one cell (dp_fedavg at ε = 4), smoke-test sizes; the trials table."""
    from tuning.experiment import run_tune

    return run_tune(
        None, ["dp_fedavg"], [4.0], num_samples=num_samples, out=out, smoke_test=True, **kwargs
    )


@pytest.fixture(scope="module")
def tune_sweep_of_three(ray_session, tmp_path_factory) -> tuple[Path, pd.DataFrame]:
    """A Ray Tune sweep of trials 0-2 (``tune.trial_executor=auto``: in-process trials,
    one worker) and its trials table, shared by the tests that compare other ways of
    running the same trials with it. Trial k's hyperparameters and seed depend on k
    only, not on how many trials the sweep has."""
    out = tmp_path_factory.mktemp("tune3") / "tune"
    return out, smoke_sweep(out, 3, runner="tune")


def rows_on_disk(out: Path) -> int:
    """Rows in OUT/rounds while a sweep runs: one file per round, or one per trial once
    it ended (tuning.rounds.compact_trial); a file compacted away while listed is retried."""
    import pyarrow.parquet as pq

    for _ in range(50):
        try:
            files = list((out / "rounds").rglob("*.parquet")) if out.exists() else []
            return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        except FileNotFoundError:
            continue
    raise AssertionError("OUT/rounds kept changing under the reader")


def _kill_by_environment(marker: str, timeout: float) -> int:
    """SIGKILL every process whose environment holds ``marker``, until none is left or
    ``timeout`` passes; returns how many are left (zombies, already dead, not counted)."""
    needle = marker.encode() + b"\0"
    deadline = time.time() + timeout
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if needle not in Path(f"/proc/{pid}/environ").read_bytes() + b"\0":
                    continue
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
                os.kill(int(pid), signal.SIGKILL)
                alive.append(pid)
            except (OSError, IndexError):
                continue  # gone, or not ours to read
        if not alive or time.time() > deadline:
            return len(alive)
        time.sleep(0.1)


def check_experiment(out: Path, rounds: int) -> pd.DataFrame:
    df = load_rounds(out)
    trials = load_trials(out)
    n_trials = len(ALGS) * len(EPS) * SAMPLES
    assert len(trials) == n_trials and trials["trial_id"].is_unique
    assert (trials["status"] == "TERMINATED").all()
    assert len(df) == n_trials * rounds  # exactly the expected rows
    assert not df.duplicated(["trial_id", "round"]).any()
    assert (
        df.groupby("trial_id")["round"].apply(sorted).map(list)
        == [list(range(1, rounds + 1))] * n_trials
    ).all()
    spec = SamplingSpec("poisson", 60, rate=0.1)
    delta = default_delta(60)
    for (_, eps), g in df.groupby(["algorithm", "epsilon_budget"]):
        z = calibrate_noise_multiplier(eps, delta, spec, rounds)
        assert (g["noise_multiplier"] == z).all()
        final = g[g["round"] == rounds]["epsilon"]
        assert (final <= eps).all()
        assert final.to_numpy() == pytest.approx(compute_epsilon(z, spec, rounds, delta))
    assert {"clip_norm", "lr", "epochs", "keep_fraction", "trial_id"} <= set(df.columns)
    return df


def test_interrupted_tune_resumes_to_the_expected_dataset(tmp_path) -> None:
    """``dpfl tune`` on ALGS x EPS x SAMPLES, killed mid-sweep, then ``--resume``: the
    experiment holds exactly the expected rows (none twice) and is the dataset a smoke
    sweep writes: its own seed per trial, every trial released, a report with its
    plots. (One sweep for both: a separate uninterrupted smoke sweep of the same cells
    took another ~70 s; every trial that finishes before the kill, and every one the
    resume runs, is an uninterrupted trial.)"""
    out = tmp_path / "exp"
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "tune",
        "--smoke-test",
        "--algorithms",
        ",".join(ALGS),
        "--epsilons",
        ",".join(f"{e:g}" for e in EPS),
        "--num-samples",
        str(SAMPLES),
        "--set",
        "rounds=6",  # 24 rows: room to interrupt between the 5th and the last
        "--runner",
        "tune",  # Tune's interruption and restore (the process runner's: test_trial_pool)
        "--out",
        str(out),
    ]
    # A private Ray temp dir marks the interrupted run's Ray processes, so they (and only
    # they) can be stopped after the interruption.
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": ray_tmp}
    proc = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if rows_on_disk(out) >= 5:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "finished before it could be interrupted"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    subprocess.run(["pkill", "-9", "-f", ray_tmp], capture_output=True)
    # Ray renames its workers' process titles (``ray::ImplicitFunc``), so a trial process
    # can outlive the pkill and go on compacting its round files while they are read:
    # find every process of the interrupted run by the RAY_TMPDIR in its environment
    # (only processes this test started carry it) and wait until none is left.
    assert _kill_by_environment(f"RAY_TMPDIR={ray_tmp}", timeout=30.0) == 0
    interrupted = len(load_rounds(out))  # released rows, each once
    assert 5 <= interrupted < len(ALGS) * len(EPS) * SAMPLES * 6
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    df = check_experiment(out, rounds=6)
    assert set(df["algorithm"]) == set(ALGS)
    # every trial has its own seed (its own noise and cohorts), recorded in rows and table
    trials = load_trials(out)
    assert trials["trial_seed"].is_unique and (trials["trial_seed"] != 0).all()
    assert (df.groupby("trial_id")["trial_seed"].nunique() == 1).all()
    assert (df["data_seed"] == 0).all()
    assert trials["released"].all() and (trials["tuning_privacy"] == "compose").all()
    text = write_report(out)
    assert "epsilon_with_tuning" in text
    assert f"composition of {SAMPLES} trials (RDP)" in text
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 1000
    assert (out / "accuracy_vs_round.png").stat().st_size > 1000
    # quiet by default: neither Ray's core-worker/token lines nor Tune's status box reach
    # the console; they are kept in OUT/ray.log
    assert "core_worker" not in done.stderr and "token" not in done.stderr.lower()
    for marker in ("Trial status", "TensorBoard", "\u256d"):
        assert marker not in done.stdout, (marker, done.stdout[-2000:])
    assert (out / "ray.log").read_text().startswith("# dpfl tune")


def test_papernot_steinke_tune_runs_the_drawn_number_and_releases_one(ray_session, tmp_path):
    import json

    out = tmp_path / "exp"
    smoke_sweep(out, 2, tuning_privacy="truncated_negative_binomial", tnb_shape=1.0)
    draws = json.loads((out / "unreleased" / "tuning_draws.json").read_text())
    k = draws["num_trials"]["dp_fedavg-eps4"]
    trials = load_trials(out)
    assert len(trials) == k >= 1
    assert trials["released"].sum() == 1
    best = trials.loc[trials["final_test_accuracy"].idxmax(), "trial_id"]
    assert trials.loc[trials["released"], "trial_id"].item() == best
    text = write_report(out)
    assert "Papernot-Steinke truncated negative binomial(eta 1, mean 2)" in text
    others = set(trials["trial_id"]) - {best}
    assert best in text and not any(t in text for t in others)


def test_in_process_trials_equal_actor_trials(ray_session, tune_sweep_of_three, tmp_path) -> None:
    """``tune.trial_executor=local`` runs each trial's simulation inside its Tune
    process (no client-worker actors, one bundle per trial); the trials are the same
    trials (same sampled hyperparameters and seeds) and give bit-identical rows to
    actor trials. ``auto`` picks local for one worker (the shared sweep's trials 0-1 are
    the local side)."""
    import json

    from engine.config import ConfigError, RayConfig
    from tuning.plan import trial_bundles, trial_executor

    frames = {}
    smoke_sweep(tmp_path / "ray", 2, trial_executor_choice="ray")
    for where, out in (("ray", tmp_path / "ray"), ("local", tune_sweep_of_three[0])):
        df = load_rounds(out)
        df = df[df["trial_index"] < 2].sort_values(["trial_index", "round"])
        frames[where] = df.reset_index(drop=True)
    record = json.loads((tune_sweep_of_three[0] / "tune" / "experiment.json").read_text())
    assert record["config"]["ray"]["executor"] == "local"  # what auto chose
    cols = ["trial_index", "trial_seed", "round", "lr", "clip_norm", "epsilon", "test_accuracy"]
    pd.testing.assert_frame_equal(frames["ray"][cols], frames["local"][cols])
    assert len(frames["local"]) == 2 * 2  # 2 trials x 2 smoke rounds

    one, three = RayConfig(num_workers=1), RayConfig(num_workers=3, num_cpus_per_worker=1)
    one_cpu = RayConfig(num_workers=1, num_cpus_per_worker=1)
    assert trial_executor("auto", one) == "local" and trial_executor("auto", three) == "ray"
    assert trial_executor("ray", one) == "ray"
    with pytest.raises(ConfigError, match=r"^tune\.trial_executor='actors'"):
        trial_executor("actors", one)
    local = trial_bundles(RayConfig(executor="local", num_workers=3, num_cpus_per_worker=1), 0.5)
    actors = trial_bundles(three, 0.5)
    # a local trial does the head's work and one worker's at a time: it reserves what
    # an actor trial of one worker reserves
    assert local == [{"CPU": 1.5}] and sum(b["CPU"] for b in actors) == 3.5
    assert local == [{"CPU": sum(b["CPU"] for b in trial_bundles(one_cpu, 0.5))}]


def test_driver_runner_runs_the_same_trials_as_tune_and_resumes(
    ray_session, tune_sweep_of_three, tmp_path, monkeypatch
) -> None:
    """``runner=driver`` runs the cell's trials one after another in this process,
    without Ray Tune: the same trials (sampled hyperparameters, seeds) with the same
    rows and trials table columns as under Tune. A resume leaves finished trials alone
    and re-runs only the one whose results were lost, to the same rows."""
    import tuning.trial
    from engine.config import ConfigError

    def sweep(out, **kwargs):
        return smoke_sweep(out, 3, **kwargs)

    def rows(out) -> pd.DataFrame:
        cols = ["trial_index", "trial_seed", "round", "lr", "clip_norm", "epsilon"]
        df = load_rounds(out).sort_values(["trial_index", "round"])
        return df[[*cols, "test_accuracy"]].reset_index(drop=True)

    tune_out, tune_table = tune_sweep_of_three
    tables = {"tune": tune_table, "driver": sweep(tmp_path / "driver", runner="driver")}
    expected = rows(tune_out)
    pd.testing.assert_frame_equal(rows(tmp_path / "driver"), expected)
    assert list(tables["driver"].columns) == list(tables["tune"].columns)
    assert (tables["driver"]["status"] == "TERMINATED").all() and len(tables["driver"]) == 3

    out = tmp_path / "driver"
    folder = out / "rounds" / "algorithm=dp_fedavg" / "epsilon_budget=4"
    files = sorted(folder.glob("*.parquet"))
    assert len(files) == 3  # one compacted file per trial
    kept = {f: f.stat().st_mtime_ns for f in files}
    lost = files[1]
    lost.unlink()  # trial 1's rows and checkpoint are gone: it runs again
    (out / "trial_checkpoints" / f"{lost.stem}.pkl").unlink()
    again = sweep(out, resume=True, runner="driver")
    assert (again["status"] == "TERMINATED").all() and len(again) == 3
    assert all(f.stat().st_mtime_ns == kept[f] for f in files if f != lost)  # untouched
    pd.testing.assert_frame_equal(rows(out), expected)

    # A failure after a trial's last checkpoint, in the write of its file: the runner's
    # clean-up folds its round files, and its last row is only in the checkpoint. A
    # resume sees the file lacks the last round, releases that row from the checkpoint
    # (nothing recomputed) and folds it in.
    real = tuning.trial.compact_trial

    def crash(*args, **kwargs):
        if len(args) + len(kwargs) <= 4:  # compact_cell's clean-up of leftover rounds
            return real(*args, **kwargs)
        raise OSError("simulated failure writing the trial's file")

    with monkeypatch.context() as m:
        m.setattr(tuning.trial, "compact_trial", crash)
        failed = sweep(tmp_path / "crash", runner="driver")
    assert (failed["status"] == "ERROR").all()
    again = sweep(tmp_path / "crash", resume=True, runner="driver")
    assert (again["status"] == "TERMINATED").all()
    pd.testing.assert_frame_equal(rows(tmp_path / "crash"), expected)

    # one runner per experiment: its trials are named by the runner that started it
    with pytest.raises(ConfigError, match=r"^--runner tune: .* ran with --runner driver"):
        sweep(out, resume=True, runner="tune")
    # the default (auto) continues with the runner the experiment started with
    assert (sweep(out, resume=True)["status"] == "TERMINATED").all()
    with pytest.raises(ConfigError, match=r"^--runner driver: .* ran with --runner tune"):
        sweep(tune_out, resume=True, runner="driver")
    with pytest.raises(ConfigError, match=r"tune\.runner=driver .* --scheduler fifo"):
        sweep(tmp_path / "x", scheduler="asha", runner="driver")
    with pytest.raises(ConfigError, match=r"^tune\.runner='elsewhere'"):
        sweep(tmp_path / "y", runner="elsewhere")


def test_asha_stopped_trials_keep_every_reported_round(ray_session, tmp_path) -> None:
    """ASHA stops trials at their reports (at a rung, or at the last round, max_t), and
    Tune does not wait for the rest of a stopped trial's function. A round is reported
    only once its row is on disk, so every reported round of every trial is a row; the
    rows of each trial are rounds 1..k without a gap (k can exceed the reports: a
    stopped trial's thread may finish its next round before it ends), and the trials
    table says k."""
    import json

    out = tmp_path / "asha"
    table = smoke_sweep(out, 6, scheduler="asha", overrides=["rounds=4"])
    rows = load_rounds(out)
    reported: dict[str, int] = {}
    for path in (out / "tune").glob("*/*/result.json"):
        lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
        if lines:
            reported[lines[-1]["trial_id"]] = len(lines)
    assert len(reported) == 6 == len(table)
    for trial_id, n in reported.items():
        mine = list(rows.loc[rows["trial_id"] == trial_id, "round"])
        assert len(mine) >= n and mine == list(range(1, len(mine) + 1)), (trial_id, n, mine)
        done = table.loc[table["trial_id"] == trial_id, "rounds_done"]
        assert list(done) == [len(mine)]
