"""Watching runs the way a user does: Prometheus scraping a local Ray, and the dashboard's
own HTTP API (:mod:`cluster.monitoring`).

A local Ray head of our own (:class:`cluster.monitoring.LocalRayHead`: free ports, its
own temporary folder) serves ``dpfl run`` and ``dpfl tune`` processes that attach to it,
exactly as a user's commands attach with ``--set ray.address=...``. The Prometheus test
needs the ``prometheus`` binary (Debian's package) and is skipped without it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from cluster import monitoring

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: Ray's metrics pipeline, sped up for the test: workers report every second
#: (default 10 s), Prometheus scrapes every second.
FAST_METRICS = {"RAY_metrics_report_interval_ms": "1000"}
RUN_KEYS = [
    "dataset.num_clients=40",
    "dataset.synthetic_mean_samples=20",
    "dataset.synthetic_dim=12",
    "ray.executor=ray",
    "ray.num_workers=1",
    "ray.num_cpus_per_worker=1",
    "eval.every=1",
    "local.batch_size=8",
]


@pytest.fixture(scope="module")
def head():
    with monitoring.LocalRayHead(num_cpus=3, env=FAST_METRICS) as h:
        yield h


def _dpfl(head: monitoring.LocalRayHead, *args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli", *args, "--set", f"ray.address={head.gcs_address}"]


def _env(head: monitoring.LocalRayHead) -> dict[str, str]:
    return {**os.environ, **head.client_env(), **FAST_METRICS, "PYTHONPATH": str(ROOT)}


def _sets(keys: list[str]) -> list[str]:
    return [a for k in keys for a in ("--set", k)]


def _wait_for(check, timeout: float, what: str):
    """Poll ``check()`` (4 times a second) until it returns a truthy value (returned) or
    ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last})")


def _series(url: str, metric: str, **labels: str) -> dict[tuple[str, str], float]:
    """(run, trial) -> the last value of ``metric`` seen in the last 10 minutes (series of
    finished processes included: Prometheus marks them stale, ``last_over_time`` keeps
    their last sample)."""
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    out: dict[tuple[str, str], float] = {}
    for s in monitoring.query(url, f"last_over_time({metric}{{{sel}}}[10m])"):
        key = (s["metric"].get("run", ""), s["metric"].get("trial", ""))
        out[key] = max(out.get(key, float("-inf")), s["value"])
    return out


@pytest.mark.skipif(
    monitoring.find_prometheus() is None,
    reason="needs the prometheus binary (Debian package `prometheus`, or $PROMETHEUS)",
)
def test_prometheus_sees_what_the_parquet_rows_hold(head, tmp_path: Path) -> None:
    """A short ``dpfl run`` and a 2-trial ``dpfl tune``: Prometheus, pointed at the Ray
    session's service-discovery file, holds per (run, trial) the rounds written and the
    last ε and test accuracy of the Parquet rows, tagged with run, trial and algorithm;
    the Grafana dashboard's queries find those series."""
    sd = monitoring.discovery_file(head.session_dir)
    port = monitoring.free_port()
    prom = monitoring.start_prometheus(sd, tmp_path / "prom", port, scrape_interval="1s")
    url = f"http://127.0.0.1:{port}"
    try:
        run_out = tmp_path / "run"
        run = subprocess.run(
            _dpfl(head, "run", "-q", "--out", str(run_out), *_sets([*RUN_KEYS, "rounds=4"])),
            env=_env(head),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        tune_out = tmp_path / "tune"
        tune = subprocess.run(
            _dpfl(
                head,
                "tune",
                "--algorithms",
                "dp_fedavg",
                "--epsilons",
                "4",
                "--num-samples",
                "2",
                "--smoke-test",
                "--out",
                str(tune_out),
            ),
            env=_env(head),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert tune.returncode == 0, tune.stderr[-2000:]

        rows = pd.read_parquet(run_out / "rounds.parquet")
        from tuning.report import load_rounds

        trial_rows = load_rounds(tune_out)
        expected_rounds = {"run": len(rows)}
        expected_rounds.update(trial_rows.groupby("trial_id").size().to_dict())

        ours = {f"dpfl-{run_out.name}", *trial_rows["trial_id"]}

        def mine(series: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
            """This test's series (the head may also hold other tests' runs)."""
            return {k: v for k, v in series.items() if k[0] in ours or k[1] in ours}

        def counted() -> dict[tuple[str, str], float] | None:
            got = mine(_series(url, "ray_dpfl_rounds_completed_total"))
            by_trial = {t or "run": v for (_, t), v in got.items()}
            return got if by_trial == expected_rounds else None

        rounds = _wait_for(counted, 60, f"ray_dpfl_rounds_completed_total = {expected_rounds}")
        eps = mine(_series(url, "ray_dpfl_epsilon_spent"))
        acc = mine(_series(url, "ray_dpfl_test_accuracy"))
        algos = {
            (s["metric"].get("run", ""), s["metric"].get("trial", "")): s["metric"]["algorithm"]
            for s in monitoring.query(url, "last_over_time(ray_dpfl_epsilon_spent[10m])")
        }
        # The run: one (run, trial="") series whose run tag names the results folder.
        (run_key,) = [k for k in rounds if k[1] == ""]
        assert run_out.name in run_key[0]
        assert rounds[run_key] == len(rows)
        assert eps[run_key] == pytest.approx(float(rows["epsilon"].iloc[-1]), rel=1e-12)
        assert acc[run_key] == pytest.approx(float(rows["test_accuracy"].iloc[-1]), rel=1e-12)
        assert algos[run_key] == "dp_fedavg"
        # The sweep: one series per trial, tagged by its trial id; run = Tune's trial name.
        trial_keys = {k[1]: k for k in rounds if k[1]}
        assert set(trial_keys) == set(trial_rows["trial_id"]) and len(trial_keys) == 2
        for tid, g in trial_rows.groupby("trial_id"):
            key = trial_keys[tid]
            assert tid in key[0]  # the run tag is the trial's name, which holds its id
            assert rounds[key] == len(g)
            assert eps[key] == pytest.approx(float(g["epsilon"].iloc[-1]), rel=1e-12)
            assert acc[key] == pytest.approx(float(g["test_accuracy"].iloc[-1]), rel=1e-12)
            assert algos[key] == "dp_fedavg"
        # The Grafana dashboard's queries (variables set to "All") find every series.
        for panel in monitoring.grafana_dashboard()["panels"]:
            expr = panel["targets"][0]["expr"]
            inner = expr[expr.index("(ray_dpfl") + 1 : -1]
            for var, every in (("$SessionName", ".+"), ("$Run", ".*"), ("$Algorithm", ".*")):
                inner = inner.replace(var, every)
            found = monitoring.query(url, f"last_over_time({inner}[10m])")
            keys = {(s["metric"].get("run", ""), s["metric"].get("trial", "")) for s in found}
            assert set(mine(dict.fromkeys(keys, 0.0))) == set(rounds), panel
        print("queried Prometheus vs Parquet:")
        for key in sorted(rounds):
            tid = key[1]
            ref = rows if not tid else trial_rows[trial_rows["trial_id"] == tid]
            print(
                f"  run={key[0]} trial={tid or '-'}: rounds {rounds[key]:g} vs {len(ref)}; "
                f"epsilon {eps[key]!r} vs {float(ref['epsilon'].iloc[-1])!r}; "
                f"test_accuracy {acc[key]!r} vs {float(ref['test_accuracy'].iloc[-1])!r}"
            )
    finally:
        monitoring.stop_process(prom)


def test_dashboard_lists_the_runs_actors_by_name_while_it_runs(head, tmp_path: Path) -> None:
    """While a ``dpfl run`` on Ray is going, the dashboard's own API (what its Actors and
    Jobs pages show) lists its workers and server, named after its results folder, and
    the driver's job with the command line."""
    out = tmp_path / "watched"
    keys = [*RUN_KEYS, "ray.num_workers=2", "ray.server=actor", "rounds=400"]
    keys = [k for k in keys if k != "ray.num_workers=1"]
    log = open(tmp_path / "run.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        _dpfl(head, "run", "-q", "--out", str(out), *_sets(keys)),
        env=_env(head),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prefix = f"dpfl-{out.name}"
    wanted = {f"{prefix}:client-worker-0", f"{prefix}:client-worker-1", f"{prefix}:server"}
    try:

        def alive() -> dict[str, str] | None:
            if proc.poll() is not None:
                raise AssertionError(f"the run ended first: {(tmp_path / 'run.log').read_text()}")
            names = monitoring.actor_names(head.dashboard_url)
            return names if all(names.get(n) == "ALIVE" for n in wanted) else None

        names = _wait_for(alive, 180, f"actors {sorted(wanted)} ALIVE")
        assert wanted <= set(names)
        jobs = monitoring.dashboard_get(head.dashboard_url, "/api/jobs/")
        running = [j for j in jobs if j.get("status") == "RUNNING" and str(out) in j["entrypoint"]]
        assert len(running) == 1, jobs
    finally:
        monitoring.stop_process(proc)
        log.close()


@pytest.mark.skipif(
    os.environ.get("RAY_AUTH_MODE", "token") != "token", reason="the head runs without tokens"
)
def test_attaching_without_the_auth_mode_names_it(head, tmp_path: Path) -> None:
    """Ray turns token authentication on for a new cluster; a command attaching without
    ``RAY_AUTH_MODE=token`` is refused, and dpfl's one-line error says what to set."""
    env = {k: v for k, v in _env(head).items() if k != "RAY_AUTH_MODE"}
    # Ray retries a refused attach for its GCS wait (about 20 attempts, 1 s apart) before
    # it raises; 3 attempts give the same refusal (each is refused for the missing token).
    env["RAY_gcs_server_port_wait_time_s"] = "3"
    out = tmp_path / "refused"
    r = subprocess.run(
        _dpfl(head, "run", "-q", "--out", str(out), *_sets([*RUN_KEYS, "rounds=2"])),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("dpfl: error: ")]
    assert head.gcs_address in line and "RAY_AUTH_MODE=token" in line
