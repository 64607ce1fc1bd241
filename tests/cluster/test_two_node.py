"""``dpfl submit`` against a real two-node Ray cluster on loopback.

The cluster is two ``ray start --block`` processes (a head and a worker node, one CPU
each, each with its own temp dir and ports), started in their own sessions so that
this test stops exactly its own Ray processes and never the Ray that other tests of
the same pytest run use (``ray stop`` would stop every Ray on the machine). The
cluster runs with token authentication, as ``dpfl submit`` users' clusters should.
Everything talks to the cluster through subprocesses and HTTP: this process may hold
its own ``ray.init`` from the ``ray_session`` fixture.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tuning.report import load_rounds, load_trials

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="finds its Ray processes in /proc"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 420.0


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback (held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, command line) for every visible process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            cmdline = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            )
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), cmdline)
    return table


def _own_processes(roots: set[int], marker: str) -> set[int]:
    """The cluster's processes: the ``ray start`` processes, their process groups, every
    descendant (Ray's workers run in their own groups), and anything naming its temp dir."""
    table = _proc_table()
    found = {
        pid
        for pid, (_, pgid, cmd) in table.items()
        if pid != os.getpid() and (pid in roots or pgid in roots or marker in cmd)
    }
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _, _) in table.items():
            if ppid in found and pid not in found and pid != os.getpid():
                found.add(pid)
                grew = True
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class TwoNodeCluster:
    """A head and a worker node started with ``ray start --block`` on 127.0.0.1."""

    root: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        (
            self.gcs_port,
            self.dashboard_port,
            self.client_port,
            *self._node_ports,
        ) = _free_ports(3 + 2 * 6)
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_TMPDIR")
        }
        self.env.update(
            RAY_USAGE_STATS_ENABLED="0",
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            # The job's `python` is this interpreter (where dpfl's dependencies are).
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _node_args(self, index: int, name: str) -> list[str]:
        ports = self._node_ports[6 * index : 6 * index + 6]
        return [
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            "--num-gpus=0",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
            f"--temp-dir={self.root / name}",  # one per node: no shared runtime-env files
            f"--node-manager-port={ports[0]}",
            f"--object-manager-port={ports[1]}",
            f"--metrics-export-port={ports[2]}",
            f"--dashboard-agent-listen-port={ports[3]}",
            f"--dashboard-agent-grpc-port={ports[4]}",
            f"--runtime-env-agent-port={ports[5]}",
        ]

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.root / f"{name}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)

    def get(self, path: str) -> dict:
        request = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def alive_nodes(self) -> list[dict]:
        nodes = self.get("/api/v0/nodes?detail=1&limit=100")["data"]["result"]["result"]
        return [n for n in nodes if n["state"] == "ALIVE"]

    def actors(self) -> list[dict]:
        return self.get("/api/v0/actors?detail=1&limit=1000")["data"]["result"]["result"]

    def _wait(self, what: str, ready) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    logs = "\n".join(p.read_text()[-2000:] for p in sorted(self.root.glob("*.log")))
                    pytest.fail(f"ray start exited with {proc.returncode} before {what}:\n{logs}")
            try:
                if ready():
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        pytest.fail(f"no {what} after {START_TIMEOUT_S:.0f} s")

    def start(self) -> None:
        self._start(
            [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={self.client_port}",
                *self._node_args(0, "h"),
            ],
            "head",
        )
        self._wait("head node", lambda: len(self.alive_nodes()) == 1)
        self._start([f"--address=127.0.0.1:{self.gcs_port}", *self._node_args(1, "w")], "worker")
        self._wait("second node", lambda: len(self.alive_nodes()) == 2)
        self._wait("jobs API", lambda: isinstance(self.get("/api/jobs/"), list))

    def stop(self) -> None:
        """Stop this cluster's processes, and only those: TERM, then KILL after 3 s."""
        pids = _own_processes({p.pid for p in self.procs}, str(self.root))
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.2)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def two_node_cluster() -> Iterator[TwoNodeCluster]:
    # Short and under /tmp: Ray's unix socket paths must stay under ~107 characters.
    cluster = TwoNodeCluster(Path(tempfile.mkdtemp(prefix="rt", dir="/tmp")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_submitted_tune_runs_on_both_nodes(two_node_cluster: TwoNodeCluster, tmp_path) -> None:
    cluster = two_node_cluster
    out = tmp_path / "exp"  # absolute, on this machine's disk: both "nodes" see it
    # Actor trials (a one-worker smoke trial would run in process under auto): this
    # test is about client-worker and server actors spreading over the nodes.
    config = tmp_path / "tune.yaml"
    config.write_text("tune:\n  trial_executor: ray\n")
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "submit",
            "--address",
            cluster.url,
            "--working-dir",
            str(ROOT),
            "--",
            "dpfl",
            "tune",
            "--config",
            str(config),
            "--smoke-test",
            "--algorithms",
            "dp_fedavg",
            "--epsilons",
            "4",
            "--num-samples",
            "2",
            "--out",
            str(out),
        ],
        cwd=tmp_path,  # the job must not depend on where submit runs
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    seconds = time.perf_counter() - t0
    report = f"exit {done.returncode} after {seconds:.0f} s\n{done.stdout[-3000:]}\n"
    report += done.stderr[-3000:]
    assert done.returncode == 0, report
    assert "SUCCEEDED" in done.stderr, report
    assert "dp_fedavg-eps4: 2 trials" in done.stdout, report  # the job's output streamed here

    # Results: 2 trials x 2 smoke rounds, every epsilon within its budget.
    rounds = load_rounds(out)
    trials = load_trials(out)
    assert len(trials) == 2 and (trials["status"] == "TERMINATED").all()
    assert len(rounds) == 4
    assert sorted(rounds.groupby("trial_id")["round"].apply(sorted).map(list)) == [[1, 2]] * 2
    assert (rounds["epsilon"] > 0).all() and (rounds["epsilon"] <= 4.0).all()

    # The cluster had two nodes, and the two trials (1 CPU each, 1 CPU per node) ran
    # their actors on both, with the uploaded working dir as their runtime env.
    nodes = cluster.alive_nodes()
    assert len(nodes) == 2 and sum(n["is_head_node"] for n in nodes) == 1
    work = [a for a in cluster.actors() if a["class_name"] in ("ClientWorker", "Server")]
    assert len(work) == 4, [(a["class_name"], a["node_id"][:8]) for a in work]
    assert {a["node_id"] for a in work} == {n["node_id"] for n in nodes}
    assert all("_ray_pkg_" in a["serialized_runtime_env"] for a in work)
