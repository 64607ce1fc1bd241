"""Issue 30: a local ``ray.init`` asks for its new node as soon as the GCS has it.

Ray's own ``get_node`` retries once a second until the raylet has registered, so a
start idled up to a second with both cores free. ``engine.runtime.ray_start`` wraps it
for a local start: the wrapper polls the GCS's node table every ``NODE_POLL_S`` and
calls Ray's function once the node is there.

* with fakes: the original is called exactly once, after the table became non-empty,
  and the polls were spaced ``NODE_POLL_S``; any failure of the poll falls back to the
  original's own wait;
* with a real local Ray: when Ray's ``get_node`` is called, the node table already
  holds the node (so its first attempt succeeds), and Ray's function is restored after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.runtime import ray_start

REPO = Path(__file__).resolve().parents[2]


class FakeState:
    """``GlobalState`` whose node table is empty for the first ``empty`` reads."""

    def __init__(self, empty: int, log: list) -> None:
        self.empty, self.log = empty, log

    def _initialize_global_state(self, options) -> None:
        self.log.append(("init", options))

    def node_table(self) -> list:
        self.log.append(("table", time.monotonic()))
        if self.empty > 0:
            self.empty -= 1
            return []
        return [{"NodeID": "ab", "Alive": True}]

    def disconnect(self) -> None:
        self.log.append(("disconnect", None))


def _fake_ray(monkeypatch: pytest.MonkeyPatch, make_state) -> None:
    import ray._private.services as services
    import ray._private.state as state_mod

    monkeypatch.setattr(state_mod, "GlobalState", make_state)
    monkeypatch.setattr(services, "_get_gcs_client_options", lambda address: f"opts:{address}")


def test_the_original_is_called_once_after_the_node_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list = []
    _fake_ray(monkeypatch, lambda: FakeState(empty=3, log=log))

    def original(address: str, node_id: str) -> dict:
        log.append(("original", (address, node_id)))
        return {"node_id": node_id}

    assert ray_start._node_poll(original)("gcs:1", "ab") == {"node_id": "ab"}
    kinds = [k for k, _ in log]
    assert kinds == ["init", "table", "table", "table", "table", "disconnect", "original"]
    assert log[0] == ("init", "opts:gcs:1") and log[-1] == ("original", ("gcs:1", "ab"))
    reads = [t for k, t in log if k == "table"]
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    assert min(gaps) >= ray_start.NODE_POLL_S  # polled, not spun


def test_a_failing_poll_falls_back_to_the_original(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(FakeState):
        def node_table(self) -> list:
            raise RuntimeError("another Ray version")

    log: list = []
    _fake_ray(monkeypatch, lambda: Broken(empty=0, log=log))
    calls: list = []
    assert ray_start._node_poll(lambda a, n: calls.append((a, n)) or "info")("g", "n") == "info"
    assert calls == [("g", "n")] and ("disconnect", None) in log


@pytest.mark.ray
def test_a_real_local_start_asks_for_a_registered_node() -> None:
    """In a fresh process (Ray started here must not leak into other tests)."""
    code = """
import ray, ray._private.services as services
from ray._private.state import GlobalState
from engine.runtime import ray_start
seen = []
def recording(address, node_id):
    state = GlobalState()
    state._initialize_global_state(services._get_gcs_client_options(address))
    seen.append([n["NodeID"] for n in state.node_table()])
    state.disconnect()
    return original(address, node_id)
original = services.get_node
services.get_node = recording
ray_start._init_ray(dict(address="local", num_cpus=1, include_dashboard=False,
                            configure_logging=False, log_to_driver=False))
node = ray.get_runtime_context().get_node_id()
ray.shutdown()
print("SEEN", seen, "NODE", node, "RESTORED", services.get_node is recording)
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("SEEN")), "")
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    node = line.split("NODE ")[1].split()[0]
    assert line == f"SEEN [['{node}']] NODE {node} RESTORED True"
