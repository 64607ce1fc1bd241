"""OS errors give one line naming the path (a full disk mid-run stops resumable);
a local Ray is never asked for more worker processes than the cores hold; the
console keeps to what the README says (``-q``: no dashboard line; Ray's raylet
warnings in ``ray.log``; the progress bar starts after Ray's start-up lines)."""

from __future__ import annotations

import errno
import json
import pathlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pyarrow.parquet as pq
import pytest

from engine.cli import main
from engine.config import ConfigError, RayConfig

RUN = [
    "dataset.num_clients=30",
    "dataset.synthetic_mean_samples=16",
    "dataset.synthetic_dim=10",
    "sampling.rate=0.3",
    "rounds=4",
    "eval.every=1",
    "ray.executor=local",
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.noise_multiplier=1.0",
]


def _args(out: Path) -> list[str]:
    argv = ["run", "-q", "--out", str(out)]
    for o in RUN:
        argv += ["--set", o]
    return argv


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpfl: error: "), err
    return err[0]


# ----------------------------------------------------------------- OS errors


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "Permission denied"),
    ],
)
def test_out_that_cannot_be_created_is_one_line_naming_it(
    tmp_path, capsys, monkeypatch, code, words
) -> None:
    """A read-only or forbidden --out (simulated: the tests run as root, which no
    permission stops): exit 2, one line naming the folder, nothing created."""
    out = tmp_path / "ro" / "run"
    real = pathlib.Path.mkdir

    def refuse(self, *a, **k):
        if str(self).startswith(str(tmp_path / "ro")):
            raise OSError(code, words, str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    assert main(_args(out)) == 2
    line = _one_line(capsys)
    assert str(out) in line and words in line and "--out" in line
    assert not (tmp_path / "ro").exists()


def _oracle(tmp_path: Path) -> pd.DataFrame:
    assert main(_args(tmp_path / "oracle")) == 0
    return pd.read_parquet(tmp_path / "oracle" / "rounds.parquet")


def _same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    cols = [c for c in want.columns if c != "wall_time_s_nonprivate"]
    assert list(got["round"]) == [1, 2, 3, 4]
    pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)


def test_disk_full_writing_rows_stops_resumable(tmp_path, capsys, monkeypatch) -> None:
    """pyarrow reports a full disk as an OSError without errno or file name: the run
    stops with one line naming rounds.parquet and how to continue, the last complete
    file stays, no partial temporary file is left, and the resume equals an
    uninterrupted run."""
    want = _oracle(tmp_path)
    capsys.readouterr()
    out = tmp_path / "full_disk"
    real = pq.write_table
    writes = {"n": 0}

    def write_table(table, where, *a, **k):
        if str(where).startswith(str(out)):
            writes["n"] += 1
            if writes["n"] == 3:  # round 3's rows
                Path(where).write_bytes(b"PAR1 half")  # a partial write, then the error
                raise OSError("[Errno 28] Error writing bytes to file. Detail: No space left")
        return real(table, where, *a, **k)

    monkeypatch.setattr(pq, "write_table", write_table)
    assert main(_args(out)) == 2
    line = _one_line(capsys)
    assert str(out / "rounds.parquet") in line and "No space left on device" in line
    assert f"dpfl run --resume {out}" in line
    assert len(pd.read_parquet(out / "rounds.parquet")) == 2  # the last complete file
    assert not list(out.glob(".*.tmp"))
    monkeypatch.setattr(pq, "write_table", real)  # space freed
    assert main(["run", "-q", "--resume", str(out)]) == 0
    _same_rows(pd.read_parquet(out / "rounds.parquet"), want)


def test_disk_full_writing_the_checkpoint_stops_resumable(tmp_path, capsys, monkeypatch) -> None:
    want = _oracle(tmp_path)
    capsys.readouterr()
    out = tmp_path / "full_disk"
    real = pathlib.Path.write_bytes
    writes = {"n": 0}

    def write_bytes(self, data):
        if self.name == ".checkpoint.pkl.tmp" and str(self).startswith(str(out)):
            writes["n"] += 1
            if writes["n"] == 2:  # round 2's checkpoint
                real(self, data[:10])
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    assert main(_args(out)) == 2
    line = _one_line(capsys)
    assert str(out / "checkpoint.pkl") in line and "--resume" in line
    assert not (out / ".checkpoint.pkl.tmp").exists()
    assert len(pd.read_parquet(out / "rounds.parquet")) == 1
    monkeypatch.setattr(pathlib.Path, "write_bytes", real)
    assert main(["run", "-q", "--resume", str(out)]) == 0
    _same_rows(pd.read_parquet(out / "rounds.parquet"), want)
    assert json.loads((out / "config.json").read_text())["privacy"]["final_epsilon"] == float(
        want["epsilon"].iloc[-1]
    )


def test_other_os_errors_keep_their_traceback(monkeypatch) -> None:
    """Only file-system errors a user fixes become one line; dpfl's own bugs do not."""
    import engine.cli.dispatch as cli

    args = SimpleNamespace(command="run")
    assert cli._os_error(OSError(errno.ECONNREFUSED, "refused"), args) is None
    assert cli._os_error(OSError(errno.EACCES, "Permission denied"), args) is None  # no path
    line = cli._os_error(OSError(errno.EACCES, "Permission denied", "/x/y"), args)
    assert line is not None and line.startswith("/x/y: Permission denied")


# ------------------------------------------------------------- resources


def _ray(**kw) -> RayConfig:
    return RayConfig(**kw)


def test_local_fit_says_what_fits() -> None:
    from engine.runtime.resources import check_local_fit

    check_local_fit(_ray(num_workers=2), cores=2)  # the default
    check_local_fit(_ray(num_workers=3), extra_cpus=0.5, cores=2)  # 3.5 <= 2 x 2
    check_local_fit(_ray(num_workers=4, num_cpus_per_worker=0.5), cores=2)
    with pytest.raises(ConfigError, match=r"^ray\.num_workers=1000 .* at most 4 workers of 1 CPU"):
        check_local_fit(_ray(num_workers=1000), cores=2)
    with pytest.raises(ConfigError, match=r"at most 3 workers of 1 CPU fit"):
        check_local_fit(_ray(num_workers=4), extra_cpus=0.5, cores=2)
    # CPU shares cannot buy processes: 1000 workers of 0.001 CPU are 1000 processes
    with pytest.raises(ConfigError, match=r"ray\.num_workers=1000"):
        check_local_fit(_ray(num_workers=1000, num_cpus_per_worker=0.001), cores=2)
    with pytest.raises(ConfigError, match=r"not one worker of 8 CPU fits"):
        check_local_fit(_ray(num_workers=1, num_cpus_per_worker=8), cores=2)
    with pytest.raises(ConfigError, match=r"needs 2 GPUs, but this machine has 1: at most 1"):
        check_local_fit(_ray(num_workers=2, num_gpus_per_worker=1), cores=2, gpus=1)
    check_local_fit(_ray(num_workers=2, num_gpus_per_worker=0.5), cores=2, gpus=1)


def test_a_running_ray_is_not_given_unbounded_processes() -> None:
    from engine.runtime.resources import check_processes

    check_processes(_ray(num_workers=4, num_cpus_per_worker=0.01), cluster_cpus=2)
    with pytest.raises(ConfigError, match=r"ray\.num_workers=5: .* at most 4 worker processes"):
        check_processes(_ray(num_workers=5, num_cpus_per_worker=0.01), cluster_cpus=2)


def test_ensure_ray_refuses_before_starting_ray(monkeypatch) -> None:
    import ray

    from engine.runtime import executors

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process

    def no_init(**_):
        raise AssertionError("ray.init called for a configuration that cannot fit")

    monkeypatch.setattr(ray, "init", no_init)
    with pytest.raises(ConfigError, match="ray.num_workers=100000"):
        executors.ensure_ray(_ray(num_workers=100000))


# ----------------------------------------------------------------- console


@pytest.mark.parametrize("quiet", [True, False])
def test_dashboard_line_only_without_q(monkeypatch, capsys, quiet) -> None:
    import ray

    from engine.runtime import executors

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    monkeypatch.setattr(ray, "init", lambda **_: SimpleNamespace(dashboard_url="127.0.0.1:8265"))
    if quiet:
        monkeypatch.setenv(executors.QUIET_ENV, "1")
    else:
        monkeypatch.delenv(executors.QUIET_ENV, raising=False)
    assert executors.ensure_ray(_ray(num_workers=1))
    err = capsys.readouterr().err
    assert ("Ray dashboard: http://127.0.0.1:8265" in err) is not quiet


def test_q_sets_the_quiet_switch_only_while_the_command_runs(monkeypatch) -> None:
    import engine.cli.dispatch as cli
    from engine.runtime.switches import QUIET_ENV

    monkeypatch.delenv(QUIET_ENV, raising=False)
    seen = {}
    monkeypatch.setitem(
        cli.HANDLERS, "run", lambda args: seen.setdefault("v", cli.os.environ.get(QUIET_ENV)) and 0
    )
    main(["run", "-q"])
    assert seen["v"] == "1" and QUIET_ENV not in cli.os.environ


def test_progress_bar_starts_after_the_executor(monkeypatch) -> None:
    """Ray's start-up lines (the dashboard address) are printed while the executor is
    built: the bar is created after it, so they never land on the bar's line."""
    import tqdm.auto

    import engine.simulation.runner as sim
    from engine.config import load_config

    events: list[str] = []
    real_make = sim.make_executor

    def make(*a, **k):
        events.append("executor")
        return real_make(*a, **k)

    class Bar(tqdm.auto.tqdm):
        def __init__(self, *a, **k):
            events.append("bar")
            super().__init__(*a, **{**k, "file": sys.stdout})

    monkeypatch.setattr(sim, "make_executor", make)
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    sim.simulate(load_config(overrides=[*RUN, "rounds=1"]), progress=True, write=False)
    assert events == ["executor", "bar"]


def test_raylet_warnings_go_to_ray_log(tmp_path, capsys) -> None:
    """The raylet's warnings reach the driver through Ray's error-listener thread, which
    prints them to stdout whatever log_to_driver says: under dpfl they land in ray.log."""
    import ray._private.worker as ray_worker

    from engine.cli.common import quiet_ray

    before = ray_worker.print_to_stdstream
    with quiet_ray(tmp_path, verbose=False):
        ray_worker.print_to_stdstream(
            {"lines": ["WARNING: 89 worker processes have been started"], "pid": "raylet"},
            ignore_prefix=False,
        )
    assert ray_worker.print_to_stdstream is before  # restored
    captured = capsys.readouterr()
    assert "worker processes" not in captured.out + captured.err
    assert "(raylet) WARNING: 89 worker processes" in (tmp_path / "ray.log").read_text()


def test_no_colour_reset_written_to_a_terminal_at_exit(tmp_path) -> None:
    """Importing Ray's CLI logger registers colorama's exit hook, which wrote a stray
    ``ESC[0m`` to the terminal after dpfl's last line."""
    import os
    import subprocess

    code = (
        "import sys, ray.autoscaler._private.cli_logger\n"
        "from engine.cli import main\n"
        "sys.exit(main(['algorithms']))\n"
    )
    primary, secondary = os.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            stdout=secondary,
            stderr=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],
            timeout=120,
        )
        os.close(secondary)
        chunks = []
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the child's side is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(primary)
    out = b"".join(chunks)
    assert proc.returncode == 0, proc.stderr
    assert b"dp_fedavg" in out  # the terminal did receive the command's output
    assert b"\x1b[0m" not in out


def test_a_local_start_never_attaches_to_another_cluster(monkeypatch) -> None:
    """Without ``ray.address`` and ``$RAY_ADDRESS`` dpfl starts its own Ray: ``ray.init``
    gets ``address="local"``, so the cluster a ``ray start`` left recorded in
    /tmp/ray/ray_current_cluster (alive or dead) is neither joined nor, with the CPU
    count dpfl passes, a ValueError; with an address, that address is passed."""
    import ray

    from engine.runtime import executors

    seen: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw) or SimpleNamespace())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert executors.ensure_ray(_ray(num_workers=1))
    assert seen[-1]["address"] == "local" and seen[-1]["num_cpus"] >= 1
    assert executors.ensure_ray(_ray(num_workers=1, address="10.0.0.1:6379"))
    assert seen[-1]["address"] == "10.0.0.1:6379" and "num_cpus" not in seen[-1]
