"""``dpfl submit`` without a cluster: input checks, address handling, runtime env, and
log following / exit status against a stand-in Jobs client."""

from __future__ import annotations

import io
import json
import shlex
import socket
import time
from pathlib import Path

import pytest

from engine.cli import main
from engine.cli.submit import (
    DEFAULT_ADDRESS,
    follow,
    prepare_entrypoint,
    resolve_address,
    runtime_env,
)
from engine.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fails(capsys, argv: list[str], *needles: str) -> str:
    """``dpfl ARGV`` exits 2 with exactly one stderr line containing every needle."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert captured.out == ""
    return lines[0]


def test_no_entrypoint(capsys) -> None:
    _fails(capsys, ["submit"], "no entrypoint")
    _fails(capsys, ["submit", "--"], "no entrypoint")


def test_entrypoint_must_be_dpfl_or_python(capsys) -> None:
    _fails(capsys, ["submit", "--", "bash", "-c", "rm -rf /"], "bash -c 'rm -rf /'", "dpfl")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--num-samples", "x"], ["invalid int value: 'x'", "--num-samples"]),
        (["--search", "grid"], ["invalid choice: 'grid'"]),
        (["--bogus"], ["unrecognized arguments: --bogus"]),
        (["--out", "/tmp/exp", "--set", "ray.num_workerz=1"], ["ray.num_workerz"]),
        (["--out", "/tmp/exp", "--set", "privacy.clip_norm=0"], ["privacy.clip_norm=0"]),
        (["--out", "/tmp/exp", "--algorithms", "nope"], ["--algorithms='nope'"]),
        (["--out", "/tmp/exp", "--epsilons", "1,a"], ["--epsilons='1,a'"]),
        (["--out", "/tmp/exp", "--config", "missing.yaml"], ["--config='missing.yaml'"]),
        (["--out", "results/tune"], ["--out='results/tune'", "absolute"]),
        ([], ["--out=None", "absolute"]),  # tune's default is relative
    ],
)
def test_bad_tune_arguments_fail_before_contacting_a_cluster(capsys, args, needles) -> None:
    # The address is never reached: the entrypoint is checked first.
    argv = ["submit", "--address", "http://127.0.0.1:9", "--working-dir", str(ROOT)]
    _fails(capsys, [*argv, "--", "dpfl", "tune", *args], *needles)


def test_other_commands_are_checked_too(capsys) -> None:
    _fails(capsys, ["submit", "--", "dpfl", "run"], "--set out=None", "absolute")
    _fails(capsys, ["submit", "--", "dpfl", "compare", "--out", "rel"], "--out='rel'")
    _fails(capsys, ["submit", "--", "dpfl", "run", "--out", "rel"], "--out='rel'")
    _fails(capsys, ["submit", "--", "dpfl", "submit", "--", "dpfl", "algorithms"], "submit")
    _fails(capsys, ["submit", "--", "dpfl", "tune", "--help"], "help")


def test_unreachable_address_fails_fast(capsys) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.perf_counter()
    _fails(capsys, ["submit", "--address", url, "--", "dpfl", "algorithms"], f"--address={url!r}")
    assert time.perf_counter() - t0 < 10


def test_address_must_be_the_dashboard_url(capsys) -> None:
    _fails(capsys, ["submit", "--address", "ray://h:10001", "--", "dpfl", "algorithms"], "ray://")


def test_working_dir_must_exist(capsys, tmp_path) -> None:
    missing = str(tmp_path / "nope")
    _fails(capsys, ["submit", "--working-dir", missing, "--", "dpfl", "algorithms"], missing)


def test_address_resolution(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_address(None) == DEFAULT_ADDRESS
    assert resolve_address("10.0.0.5:8265") == "http://10.0.0.5:8265"
    assert resolve_address("https://ray.example.org/") == "https://ray.example.org"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert resolve_address(None) == "http://head:8265"
    assert resolve_address("http://other:8265") == "http://other:8265"  # the flag wins
    with pytest.raises(ConfigError, match="RAY_ADDRESS='ray://h:1'"):
        monkeypatch.setenv("RAY_ADDRESS", "ray://h:1")
        resolve_address(None)


def test_dpfl_entrypoint_runs_the_uploaded_code_and_attaches_to_the_cluster() -> None:
    argv = ["--", "dpfl", "tune", "--smoke-test", "--out", "/shared/exp dir", "-s", "rounds=3"]
    command = prepare_entrypoint(argv, ROOT)
    assert shlex.split(command) == [
        "python",
        "-m",
        "engine.cli",
        "tune",
        "--smoke-test",
        "--out",
        "/shared/exp dir",
        "-s",
        "rounds=3",
        "--set",
        "ray.address=auto",
    ]
    own = prepare_entrypoint(
        ["dpfl", "run", "--set", "out=/x", "--set", "ray.address=h:6379"], ROOT
    )
    assert "auto" not in own  # an explicit ray.address is kept as given
    assert prepare_entrypoint(["dpfl", "algorithms"], ROOT) == "python -m engine.cli algorithms"
    assert prepare_entrypoint(["python3", "-c", "print(1)"], ROOT) == "python3 -c 'print(1)'"


def test_runtime_env(tmp_path) -> None:
    env = runtime_env(ROOT)
    assert env["working_dir"] == str(ROOT)
    assert {".git", "results", "build", "*.egg-info", "__pycache__", ".pytest_cache"} <= set(
        env["excludes"]
    )
    assert "pip" not in env
    json.dumps(env)  # what the Jobs API sends
    packages = runtime_env(ROOT, install_deps=True)["pip"]["packages"]
    assert any(p.startswith("torch") for p in packages)
    assert any(p.startswith("dp-accounting") for p in packages)
    assert not any(p.startswith("ray") for p in packages)  # the cluster's Ray stays
    with pytest.raises(ConfigError, match="pyproject.toml"):
        runtime_env(tmp_path, install_deps=True)


class FakeStatus:
    def __init__(self, value: str) -> None:
        self.value = value

    def is_terminal(self) -> bool:
        return self.value in ("SUCCEEDED", "FAILED", "STOPPED")


class FakeClient:
    """The part of JobSubmissionClient that :func:`follow` uses."""

    def __init__(
        self, chunks: list[str], final: str, interrupt: bool = False, drop_after: int = -1
    ) -> None:
        self.chunks, self.final, self.interrupt = chunks, final, interrupt
        self.drop_after = drop_after
        self.stopped = False

    async def tail_job_logs(self, job_id: str):
        for i, chunk in enumerate(self.chunks):
            if i == self.drop_after:
                raise RuntimeError("connection closed unexpectedly")
            yield chunk
        if self.interrupt:
            raise KeyboardInterrupt

    def get_job_logs(self, job_id: str) -> str:
        return "".join(self.chunks)

    def get_job_status(self, job_id: str) -> FakeStatus:
        return FakeStatus("STOPPED" if self.stopped else self.final)

    def stop_job(self, job_id: str) -> bool:
        self.stopped = True
        return True

    def get_job_info(self, job_id: str):
        class Info:
            message = "Job entrypoint command failed with exit code 1"

        return Info()


@pytest.mark.parametrize("final, code", [("SUCCEEDED", 0), ("FAILED", 1), ("STOPPED", 1)])
def test_follow_streams_logs_and_maps_the_final_status(final: str, code: int) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert follow(FakeClient(["round 1\n", "round 2\n"], final), "job1", out, err) == code
    assert out.getvalue() == "round 1\nround 2\n"
    assert f"job job1 {final}" in err.getvalue()
    assert ("exit code 1" in err.getvalue()) == (final != "SUCCEEDED")


def test_ctrl_c_stops_the_job() -> None:
    client = FakeClient(["round 1\n"], "RUNNING", interrupt=True)
    err = io.StringIO()
    assert follow(client, "job1", io.StringIO(), err) == 1
    assert client.stopped
    assert "stopping job job1" in err.getvalue() and "STOPPED" in err.getvalue()


def test_a_dropped_log_stream_falls_back_to_polling_without_repeating() -> None:
    out, err = io.StringIO(), io.StringIO()
    client = FakeClient(["a\n", "b\n", "c\n"], "SUCCEEDED", drop_after=1)
    assert follow(client, "job1", out, err) == 0
    assert out.getvalue() == "a\nb\nc\n"
    assert "polling instead" in err.getvalue()
