"""Watching a Ray cluster from outside: its Prometheus metrics and its dashboard.

* :func:`discovery_file` finds the Prometheus service-discovery file a Ray node writes in
  its session folder (``<session>/prom_metrics_service_discovery.json``: the metrics
  endpoints of the node's processes); :func:`prometheus_config` writes a Prometheus
  configuration that scrapes them and :func:`start_prometheus` starts a Prometheus
  (Debian's ``prometheus`` package, or any binary) on it, listening on 127.0.0.1 only.
  Nothing is downloaded (Ray's own ``ray metrics launch-prometheus`` downloads one).
  ``scripts/prometheus_local.py`` is the command-line front end.
* :func:`query` asks Prometheus's HTTP API (``/api/v1/query``) and returns its vector.
* :class:`LocalRayHead` starts a local Ray head in a child process (dashboard and
  metrics on given ports, its own temporary folder, node address 127.0.0.1) and stops it
  by that process's id; ``dpfl run``/``tune`` attach to it with
  ``--set ray.address=<gcs address>``. Tests and ``scripts/dashboard_screenshots.py``
  use it so that they never touch another Ray on the machine.
* :func:`dashboard_get` reads the dashboard's HTTP API (``/api/v0/actors``,
  ``/api/jobs/``) with Ray's authentication token when the cluster requires one.

The metrics themselves (what dpfl exports per round) are :mod:`engine.telemetry.metrics`; they
carry only the accountant's ε and public test accuracy, plus operator diagnostics whose
names end in ``_nonprivate``. Watching them releases nothing beyond what the run's own
Parquet rows hold.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The file a Ray node writes in its session folder (ray_constants, Ray >= 2.4x).
DISCOVERY_FILE = "prom_metrics_service_discovery.json"
#: Where a local Ray's newest session lives (Ray's default temporary folder).
DEFAULT_SESSION = Path("/tmp/ray/session_latest")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice; another process may still
    take it before it is used, which callers report as a start failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def discovery_file(session_dir: str | Path = DEFAULT_SESSION) -> Path:
    """The service-discovery file of the Ray session in ``session_dir``; FileNotFoundError
    naming the folder when it has none (no Ray there, or one started without metrics)."""
    path = Path(session_dir) / DISCOVERY_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no Prometheus service-discovery file (is a Ray node running with "
            f"this session folder? `ray start --head` or a running dpfl command makes one)"
        )
    return path


def prometheus_config(sd_file: str | Path, scrape_interval: str = "2s") -> str:
    """A Prometheus configuration (YAML text) scraping every target Ray lists in
    ``sd_file``; Prometheus re-reads the file when Ray rewrites it (new workers)."""
    return (
        "global:\n"
        f"  scrape_interval: {scrape_interval}\n"
        f"  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        "    file_sd_configs:\n"
        f"      - files: ['{Path(sd_file).resolve()}']\n"
        "        refresh_interval: 2s\n"
    )


def find_prometheus(binary: str | None = None) -> str | None:
    """The Prometheus binary: ``binary``, else ``$PROMETHEUS``, else ``prometheus`` on
    the PATH; None when there is none."""
    import shutil

    name = binary or os.environ.get("PROMETHEUS") or "prometheus"
    return shutil.which(name)


def start_prometheus(
    sd_file: str | Path,
    data_dir: str | Path,
    port: int,
    *,
    binary: str | None = None,
    scrape_interval: str = "2s",
    retention: str = "1d",
) -> subprocess.Popen[bytes]:
    """Start Prometheus on 127.0.0.1:``port`` scraping the targets of ``sd_file``, its
    configuration and database in ``data_dir``; its log goes to ``data_dir/prometheus.log``.
    The caller stops it (:func:`stop_process`). Waits until it answers ``/-/ready``."""
    exe = find_prometheus(binary)
    if exe is None:
        raise FileNotFoundError(
            f"prometheus: no such binary ({binary or os.environ.get('PROMETHEUS') or 'PATH'}); "
            "install Debian's `prometheus` package or give --prometheus PATH"
        )
    data = Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    config = data / "prometheus.yml"
    config.write_text(prometheus_config(sd_file, scrape_interval))
    log = open(data / "prometheus.log", "wb")  # noqa: SIM115 - kept open by the child
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={config}",
            f"--storage.tsdb.path={data / 'tsdb'}",
            f"--storage.tsdb.retention.time={retention}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"prometheus exited with status {proc.returncode}; see {data / 'prometheus.log'}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.3)
    stop_process(proc)
    raise RuntimeError(f"prometheus did not become ready on 127.0.0.1:{port} within 30 s")


def query(url: str, promql: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The instant vector of ``promql`` from the Prometheus at ``url``: one
    ``{"metric": {labels}, "value": float}`` per series."""
    full = f"{url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(full, timeout=timeout) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"prometheus query {promql!r} failed: {body}")
    return [{"metric": s["metric"], "value": float(s["value"][1])} for s in body["data"]["result"]]


def stop_process(proc: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """SIGTERM ``proc`` (this process's child, by its id), SIGKILL after ``grace`` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def auth_token() -> str | None:
    """Ray's authentication token (``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH``,
    else ``~/.ray/auth_token``), None when there is none. Ray >= 2.5x turns token
    authentication on for a new local cluster; its dashboard then wants the token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def dashboard_get(dashboard_url: str, path: str, timeout: float = 10.0) -> Any:
    """GET ``path`` of the dashboard's HTTP API as JSON, with the authentication token
    (as a bearer header) when there is one."""
    headers = {}
    token = auth_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"{dashboard_url.rstrip('/')}{path}", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def actor_names(dashboard_url: str) -> dict[str, str]:
    """Name -> state of every named actor the dashboard lists (``/api/v0/actors``)."""
    body = dashboard_get(dashboard_url, "/api/v0/actors?limit=10000&detail=false")
    rows = body["data"]["result"]["result"]
    return {r["name"]: r["state"] for r in rows if r.get("name")}


_HEAD = """
import json, sys
import ray
ctx = ray.init(address="local", num_cpus={num_cpus}, include_dashboard=True,
               dashboard_host="127.0.0.1", dashboard_port={dashboard_port},
               _metrics_export_port={metrics_port}, _node_ip_address="127.0.0.1",
               _temp_dir={temp_dir!r}, object_store_memory={object_store},
               configure_logging=False, log_to_driver=False)
node = ray._private.worker.global_worker.node
print(json.dumps({{"gcs_address": ctx.address_info["gcs_address"],
                  "session_dir": node.get_session_dir_path()}}), flush=True)
sys.stdin.read()  # until the parent closes our stdin (or signals us)
ray.shutdown()
"""


@dataclass
class LocalRayHead:
    """A local Ray head in a child process of this one, on free (or given) ports.

    ``with LocalRayHead() as head:`` starts it and waits until it has written its
    address; leaving the block closes its stdin (``ray.shutdown()`` there), then
    SIGTERMs and SIGKILLs it by process id if it lingers. Ray's own processes are tied
    to that child's life. Its temporary folder is its own, so ``session_dir`` is this
    head's session, never another Ray's ``/tmp/ray/session_latest``."""

    num_cpus: int = 3
    dashboard_port: int = 0
    metrics_port: int = 0
    object_store_mb: int = 100
    env: dict[str, str] = field(default_factory=dict)
    gcs_address: str = ""
    session_dir: str = ""
    temp_dir: str = ""
    proc: subprocess.Popen[str] | None = None

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def client_env(self) -> dict[str, str]:
        """Environment for a process that attaches to this head (``dpfl run --set
        ray.address=...``): the head's authentication mode, spelled out. Ray 2.5x turns
        token authentication on for a new local cluster, and a driver that attaches
        without ``RAY_AUTH_MODE=token`` is refused (the token is ``~/.ray/auth_token``)."""
        return {
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
        }

    def start(self, timeout: float = 120.0) -> LocalRayHead:
        self.dashboard_port = self.dashboard_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        # Short path: Ray's unix sockets live under it (108-byte limit).
        self.temp_dir = tempfile.mkdtemp(prefix="dpfl-ray-", dir="/tmp")
        code = _HEAD.format(
            num_cpus=self.num_cpus,
            dashboard_port=self.dashboard_port,
            metrics_port=self.metrics_port,
            temp_dir=self.temp_dir,
            object_store=self.object_store_mb * 2**20,
        )
        env = {**os.environ, **self.client_env(), **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(Path(self.temp_dir) / "head.log", "w"),  # noqa: SIM115
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.stop()
            raise RuntimeError(f"Ray head did not start within {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            log = (Path(self.temp_dir) / "head.log").read_text()[-2000:]
            raise RuntimeError(f"Ray head failed to start: {log}")
        info = json.loads(line)
        self.gcs_address = info["gcs_address"]
        self.session_dir = info["session_dir"]
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)
        self.proc = None
        if self.temp_dir:
            import shutil

            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayHead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Grafana units of dpfl's series (:data:`engine.telemetry.metrics.DESCRIPTIONS` says
#: them in words).
_GRAFANA_UNITS = {
    "rounds_completed": "none",
    "epsilon_spent": "none",
    "test_accuracy": "percentunit",
    "client_updates_per_second_nonprivate": "short",
    "seconds_per_round_nonprivate": "s",
    "clipped_fraction_nonprivate": "percentunit",
}
GRAFANA_DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dpfl_grafana_dashboard.json"


def grafana_dashboard() -> dict[str, Any]:
    """A Grafana dashboard (JSON model, the schema of Ray's own generated dashboards:
    a ``datasource`` variable and a ``SessionName`` filter) with one time-series panel
    per dpfl series, filtered by ``run`` and ``algorithm``, one line per (run, trial).
    Shipped as ``cluster/grafana/dpfl_grafana_dashboard.json`` (a test keeps the file
    equal to this); untested against a Grafana, which these machines do not have."""
    from engine.telemetry.metrics import DESCRIPTIONS

    def variable(name: str, label: str, query: str, all_value: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": "${datasource}",
            "definition": query,
            "query": {"query": query, "refId": f"{name}-query"},
            "includeAll": True,
            "allValue": all_value,
            "multi": True,
            "refresh": 2,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0,
            "sort": 1,
        }

    sel = 'SessionName=~"$SessionName",run=~"$Run",algorithm=~"$Algorithm"'
    rounds = 'ray_dpfl_rounds_completed_total{SessionName=~"$SessionName"}'
    panels = []
    for i, (name, text) in enumerate(DESCRIPTIONS.items()):
        metric = f"ray_dpfl_{name}" + ("_total" if name == "rounds_completed" else "")
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": name,
                "description": text,
                "datasource": "${datasource}",
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": _GRAFANA_UNITS[name]}, "overrides": []},
                "options": {"legend": {"displayMode": "table", "placement": "bottom"}},
                "targets": [
                    {
                        "expr": f"max by (run, trial, algorithm) ({metric}{{{sel}}})",
                        "legendFormat": "{{run}} {{trial}} ({{algorithm}})",
                        "refId": "A",
                    }
                ],
            }
        )
    return {
        "title": "dpfl runs and sweeps",
        "uid": "dpfl",
        "description": "dpfl's per-round series (README, Dashboard metrics). epsilon_spent is "
        "the accountant's, per run or trial alone (tuning excluded); *_nonprivate series are "
        "operator diagnostics computed from private data, never a released result.",
        "tags": ["dpfl", "ray"],
        "editable": True,
        "schemaVersion": 27,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "hide": 2,
                    "current": {"selected": False},
                },
                variable(
                    "SessionName",
                    "Ray session",
                    "label_values(ray_dpfl_rounds_completed_total, SessionName)",
                    ".+",
                ),
                variable(
                    "Run",
                    "run",
                    f"label_values({rounds}, run)",
                    ".*",
                ),
                variable(
                    "Algorithm",
                    "algorithm",
                    f"label_values({rounds}, algorithm)",
                    ".*",
                ),
            ]
        },
        "panels": panels,
    }
