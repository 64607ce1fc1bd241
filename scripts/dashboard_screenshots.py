"""Screenshots of the Ray dashboard while a dpfl run and a dpfl tune sweep are going.

::

    python scripts/dashboard_screenshots.py [--out docs/dashboard] [--rounds 400]
                                            [--settle 8] [--chromium PATH]

Starts a local Ray head of its own (:class:`cluster.monitoring.LocalRayHead`: free
ports, dashboard on 127.0.0.1), a ``dpfl run`` (two client-worker actors and a server
actor) and a 4-trial ``dpfl tune`` attached to it, then drives headless Chromium
through the Chrome DevTools protocol (the browser's own ``--remote-debugging-port``,
on 127.0.0.1; the websocket client is aiohttp, which Ray's dashboard already needs)
over the pages a user opens: the jobs list, the actors list, the run's server actor,
the sweep's job, the metrics page; where a ``prometheus`` binary is installed, also a
Prometheus (:func:`cluster.monitoring.start_prometheus`) and its graph of
``ray_dpfl_epsilon_spent`` and table of ``ray_dpfl_rounds_completed_total`` (which run,
which round, ε spent: what the dashboard alone cannot show without Grafana).
Ray's token authentication (on by default for a new local cluster since Ray 2.5x) is
passed as the dashboard's own cookie, as a user's
browser holds it after entering the token. Everything it started is stopped by
process id at the end; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster import monitoring  # noqa: E402

RUN_KEYS = [
    "dataset.num_clients=200",
    "dataset.synthetic_mean_samples=20",
    "dataset.synthetic_dim=12",
    "ray.executor=ray",
    "ray.num_workers=2",
    "ray.num_cpus_per_worker=0.5",
    "ray.server=actor",
    "eval.every=1",
]


class Browser:
    """Headless Chromium driven over the DevTools protocol, one page."""

    def __init__(self, binary: str, width: int = 1500, height: int = 1000) -> None:
        self.port = monitoring.free_port()
        self.profile = tempfile.mkdtemp(prefix="dpfl-chromium-")
        args = [
            binary,
            "--headless=new",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            "--remote-debugging-address=127.0.0.1",
            f"--remote-debugging-port={self.port}",
            f"--user-data-dir={self.profile}",
            "about:blank",
        ]
        if os.geteuid() == 0:  # Chromium refuses to run as root with its sandbox
            args.insert(1, "--no-sandbox")
        # Its own session: the launcher script and the browser's children are one group.
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.msg_id = 0

    def page_ws(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                url = f"http://127.0.0.1:{self.port}/json/list"
                with urllib.request.urlopen(url, timeout=2) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError("chromium's DevTools endpoint did not answer")

    async def call(self, ws: Any, method: str, **params: Any) -> dict[str, Any]:
        self.msg_id += 1
        mid = self.msg_id
        await ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = await ws.receive_json()
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group we started, by its id
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)


async def shoot(
    browser: Browser, base: str, pages: list[tuple[str, str]], out: Path, settle: float
) -> list[Path]:
    """Open each (file name, URL fragment) and save a PNG after ``settle`` seconds."""
    import aiohttp

    written = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(browser.page_ws(), max_msg_size=0) as ws:
            await browser.call(ws, "Network.enable")
            token = monitoring.auth_token()
            if token:
                await browser.call(
                    ws,
                    "Network.setCookie",
                    name="ray-authentication-token",
                    value=token,
                    url=base,
                    httpOnly=True,
                )
            for name, fragment in pages:
                await browser.call(ws, "Page.navigate", url=f"{base}/{fragment}")
                await asyncio.sleep(settle)
                shot = await browser.call(ws, "Page.captureScreenshot", format="png")
                path = out / f"{name}.png"
                path.write_bytes(base64.b64decode(shot["data"]))
                written.append(path)
                print(f"wrote {path}", flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "dashboard"), help="folder of PNGs")
    p.add_argument("--rounds", type=int, default=400, help="rounds of the watched run")
    p.add_argument("--settle", type=float, default=8.0, help="seconds a page gets to render")
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    p.add_argument(
        "--prometheus-wait", type=float, default=40.0, help="seconds of scraping before its shots"
    )
    args = p.parse_args(argv)
    if shutil.which(args.chromium) is None:
        print(f"dashboard_screenshots: error: no browser {args.chromium!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dpfl-shots-"))
    procs: list[subprocess.Popen[bytes]] = []
    browser = None
    with monitoring.LocalRayHead(num_cpus=4) as head:
        env = {**os.environ, **head.client_env(), "PYTHONPATH": str(ROOT)}
        address = ["--set", f"ray.address={head.gcs_address}"]
        sets = [a for k in RUN_KEYS for a in ("--set", k)]
        prom = None
        port = monitoring.free_port()
        try:
            if monitoring.find_prometheus() is not None:  # scraping from the start
                sd = monitoring.discovery_file(head.session_dir)
                prom = monitoring.start_prometheus(sd, work / "prom", port, scrape_interval="1s")
            run_out = work / "demo-run"
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "engine.cli", "run", "-q", "--out", str(run_out)]
                    + [*sets, "--set", f"rounds={args.rounds}", *address],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "engine.cli", "tune", "--algorithms", "dp_fedavg"]
                    + ["--epsilons", "4", "--num-samples", "4", "--smoke-test"]
                    + ["--set", "rounds=60", "--out", str(work / "sweep"), *address],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            prefix = monitoring_run_label(run_out)
            server = f"{prefix}:server"
            deadline = time.monotonic() + 240
            actors: dict[str, Any] = {}
            while time.monotonic() < deadline:
                body = monitoring.dashboard_get(head.dashboard_url, "/api/v0/actors?limit=1000")
                actors = {a.get("name"): a for a in body["data"]["result"]["result"]}
                tune_jobs = [
                    j
                    for j in monitoring.dashboard_get(head.dashboard_url, "/api/jobs/")
                    if "tune" in j.get("entrypoint", "") and j.get("status") == "RUNNING"
                ]
                trials = [a for a in actors.values() if "ImplicitFunc" in str(a.get("class_name"))]
                if actors.get(server, {}).get("state") == "ALIVE" and tune_jobs and trials:
                    break
                time.sleep(2)
            else:
                raise RuntimeError(f"the run's actors did not come up: {sorted(map(str, actors))}")
            tune_job = tune_jobs[0]
            pages = [
                ("jobs", "#/jobs"),
                ("actors", "#/actors"),
                ("server_actor", f"#/actors/{actors[server]['actor_id']}"),
                ("sweep_job", f"#/jobs/{tune_job['job_id']}"),
                ("metrics", "#/metrics"),
            ]
            browser = Browser(args.chromium)
            asyncio.run(shoot(browser, head.dashboard_url, pages, out, args.settle))
            if prom is not None:
                time.sleep(args.prometheus_wait)  # let it collect a stretch of rounds
                graph = "graph?g0.tab={tab}&g0.range_input=2m&g0.expr={expr}"
                queries = [
                    (
                        "prometheus_epsilon",
                        graph.format(
                            tab=0, expr="max by (run, trial, algorithm) (ray_dpfl_epsilon_spent)"
                        ),
                    ),
                    (
                        "prometheus_rounds",
                        graph.format(
                            tab=1,
                            expr="max by (run, trial, algorithm) (ray_dpfl_rounds_completed_total)",
                        ),
                    ),
                ]
                queries = [(n, q.replace(" ", "%20")) for n, q in queries]
                base = f"http://127.0.0.1:{port}"
                asyncio.run(shoot(browser, base, queries, out, args.settle))
        finally:
            if browser is not None:
                browser.close()
            if prom is not None:
                monitoring.stop_process(prom)
            for proc in procs:
                monitoring.stop_process(proc)
            shutil.rmtree(work, ignore_errors=True)
    return 0


def monitoring_run_label(out: Path) -> str:
    from engine.telemetry.metrics import run_label

    return run_label(out)


if __name__ == "__main__":
    sys.exit(main())
