"""A damaged sweep folder: ``dpfl tune --resume`` either finishes the sweep equal to an
uninterrupted one or refuses with one line naming the file, never exit 0 with rows
missing.

A sweep of two 3-round trials (``--runner driver``, in-process executor: no Ray) is
stopped by raising from ``tuning.trial.write_round`` during trial 2 (trial 1 complete,
its rows compacted into its own file; trial 2 with one round file and a checkpoint),
and a finished sweep is kept too. Each file is truncated, deleted or replaced with
garbage and the sweep resumed; the oracle is the uninterrupted sweep.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

import tuning.trial as trial_module
from engine.cli import main
from tuning.report import load_rounds

FLAGS = ["tune", "--smoke-test", "--runner", "driver", "--num-samples", "2"]
FLAGS += ["--set", "rounds=3", "--set", "ray.executor=local"]
CELL = "rounds/algorithm=dp_fedavg/epsilon_budget=4"
TIMING = ("wall_time_s_nonprivate",)


class Crash(BaseException):
    """A driver that dies (no handler in dpfl catches a BaseException)."""


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _tune(out: Path, *extra: str) -> int:
    return main([*FLAGS, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweeps")
    assert _tune(root / "full") == 0
    original = trial_module.write_round
    calls = {"n": 0}

    def dying(*args, **kwargs):  # trial 2's round 2: after its checkpoint, before its row
        calls["n"] += 1
        if calls["n"] == 4:
            raise Crash
        return original(*args, **kwargs)

    trial_module.write_round = dying
    try:
        with pytest.raises(Crash):
            _tune(root / "stopped")
    finally:
        trial_module.write_round = original
    return {"full": root / "full", "stopped": root / "stopped"}


def _files(folder: Path) -> dict[str, Path]:
    """The sweep's files by role (trial ids are fixed by the driver runner)."""
    cell = folder / CELL
    done = sorted(p for p in cell.glob("*.parquet") if "-round" not in p.name)
    running = sorted(cell.glob("*-round*.parquet"))
    ckpt = folder / "trial_checkpoints"
    return {
        "runner": folder / "tune" / "runner.txt",
        "experiment": folder / "tune" / "experiment.json",
        "finished trial's file": done[0],
        "finished trial's checkpoint": ckpt / f"{done[0].stem}.pkl",
        "running trial's round file": running[0] if running else folder / "none",
        "running trial's checkpoint": ckpt / f"{running[0].name.split('-round')[0]}.pkl"
        if running
        else folder / "none",
        "trials table": folder / "trials.parquet",
    }


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        path.unlink()
    else:
        path.write_bytes(b"\x00garbage\xff" * 37)


#: (state, file, damage) -> "same" (the sweep finishes equal to the oracle) or
#: "refused" (one line naming the file). What each case loses decides it: a file
#: whose content a resume needs and cannot rebuild is refused; a file it rebuilds or
#: no longer needs is not.
EXPECTED = {
    ("stopped", "runner", "truncate"): "refused",
    ("stopped", "runner", "delete"): "same",  # no Tune state: the given runner
    ("stopped", "runner", "garbage"): "refused",
    ("stopped", "experiment", "truncate"): "refused",
    ("stopped", "experiment", "delete"): "same",  # the flags are given again
    ("stopped", "experiment", "garbage"): "refused",
    ("stopped", "finished trial's file", "truncate"): "refused",
    ("stopped", "finished trial's file", "delete"): "refused",  # its rows are gone
    ("stopped", "finished trial's file", "garbage"): "refused",
    ("stopped", "finished trial's checkpoint", "truncate"): "same",  # never read again
    ("stopped", "finished trial's checkpoint", "delete"): "same",
    ("stopped", "finished trial's checkpoint", "garbage"): "same",
    ("stopped", "running trial's round file", "truncate"): "refused",
    ("stopped", "running trial's round file", "delete"): "refused",  # round 1 lost
    ("stopped", "running trial's round file", "garbage"): "refused",
    ("stopped", "running trial's checkpoint", "truncate"): "refused",
    ("stopped", "running trial's checkpoint", "delete"): "refused",  # would recompute
    ("stopped", "running trial's checkpoint", "garbage"): "refused",
    ("full", "trials table", "truncate"): "same",  # rebuilt from the rows
    ("full", "trials table", "delete"): "same",
    ("full", "trials table", "garbage"): "same",
    ("full", "finished trial's file", "delete"): "refused",
}


def _assert_same_as_oracle(folder: Path, oracle: Path) -> None:
    got, want = load_rounds(folder), load_rounds(oracle)
    cols = [c for c in want.columns if c not in TIMING]
    assert len(got) == len(want) == 6  # 2 trials x 3 rounds: none lost, none twice
    pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)
    t_got = pd.read_parquet(folder / "trials.parquet")
    t_want = pd.read_parquet(oracle / "trials.parquet")
    tcols = [c for c in t_want.columns if c not in TIMING]
    pd.testing.assert_frame_equal(t_got[tcols], t_want[tcols], check_exact=True)
    assert (t_got["status"] == "TERMINATED").all()


@pytest.mark.parametrize(("state", "role", "how"), list(EXPECTED))
def test_damaged_sweep_file(sweeps, tmp_path, capsys, state, role, how) -> None:
    folder = tmp_path / state
    shutil.copytree(sweeps[state], folder)
    path = _files(folder)[role]
    assert path.exists(), path
    _damage(path, how)
    before = _tree(folder)
    capsys.readouterr()
    rc = _tune(folder, "--resume")
    err = capsys.readouterr().err.strip().splitlines()
    if EXPECTED[(state, role, how)] == "same":
        assert rc == 0, err
        _assert_same_as_oracle(folder, sweeps["full"])
    else:
        assert rc == 2, err
        assert len(err) == 1 and err[0].startswith("dpfl: error: --resume --out "), err
        # the damaged file, or (deleted) the trial's files where its rows should be
        named = str(path) if how != "delete" or "trial" not in role else str(path.parent)
        assert named in err[0] and "nothing was changed" in err[0], err
        if how == "delete" and "trial" in role:
            assert path.name.split("-round")[0].removesuffix(".parquet") in err[0]
        assert _tree(folder) == before  # no byte written


def test_intact_stopped_sweep_resumes_equal_to_uninterrupted(sweeps, tmp_path) -> None:
    folder = tmp_path / "stopped"
    shutil.copytree(sweeps["stopped"], folder)
    assert not (folder / "trials.parquet").exists()  # stopped mid-sweep
    assert len(load_rounds(folder)) == 4  # trial 1's three rows, trial 2's first
    assert _tune(folder, "--resume") == 0
    _assert_same_as_oracle(folder, sweeps["full"])


def test_resume_with_another_config_is_refused(sweeps, tmp_path, capsys) -> None:
    folder = tmp_path / "stopped"
    shutil.copytree(sweeps["stopped"], folder)
    before = _tree(folder)
    capsys.readouterr()
    assert _tune(folder, "--resume", "--set", "local.lr=0.5") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "local.lr=0.5" in err[0] and "experiment.json" in err[0]
    assert _tree(folder) == before


def test_full_disk_stops_the_sweep_resumable(sweeps, tmp_path, capsys, monkeypatch) -> None:
    """pyarrow reports a full disk without errno or file name: the sweep stops (no
    trial marked failed and the next one tried) with one line naming the file, leaves
    no partial file, and the resumed sweep equals the uninterrupted one."""
    import pyarrow.parquet as pq

    out = tmp_path / "disk"
    real = pq.write_table
    calls = {"n": 0}

    def full(table, where, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:  # trial 2's first row
            Path(where).write_bytes(b"PAR1 half")
            raise OSError("[Errno 28] Error writing bytes to file. Detail: No space left")
        return real(table, where, *a, **k)

    monkeypatch.setattr(pq, "write_table", full)
    capsys.readouterr()
    assert _tune(out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dpfl: error: {out / CELL}"), err
    assert "No space left on device" in err[0] and "dpfl tune --resume" in err[0]
    assert not [p for p in out.rglob(".*") if p.is_file() and p.name.endswith(".tmp")]
    monkeypatch.setattr(pq, "write_table", real)  # space freed
    assert _tune(out, "--resume") == 0
    _assert_same_as_oracle(out, sweeps["full"])
