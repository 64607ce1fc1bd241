"""Starting Ray: :func:`ensure_ray`, the one place dpfl starts or attaches to Ray, and
:func:`check_ray_start`, which checks beforehand what ``ray.init`` would refuse or hang
on (its resource minima, an address nothing answers at).

A run starts Ray only once it is validated (:func:`engine.simulation.prepare`, which
calls :func:`check_ray_start`): a run that cannot work is refused in one line before
any Ray process exists. (Until issue 47 ``dpfl run`` began Ray's start in a background
thread before it imported the engine, so that the start overlapped the checks and the
data; every refusal then waited for that start and its shutdown, 14–16 s.)

This module imports neither torch nor Ray at import time.

Stopping Ray. A run that started Ray stops it when it closes (:func:`release_ray`:
``ray.shutdown()``), except in the ``dpfl`` executable, which calls
:func:`stop_ray_at_exit` first: its Ray is then left up when the run closes, and once
the command has returned (its results on disk) :func:`hand_off_at_exit` gives Ray's
processes to a detached helper (:mod:`engine.runtime.reaper`) and the process exits
without waiting for them (1.2–1.8 s on 2 cores).

Asking for the new node. Every ``ray.init`` goes through :func:`_init_ray`, which lets
a local start ask for its node only once the GCS has it (:func:`_node_poll`): Ray's
own wait retries once a second, and left ``ray.init`` idle for 0.5–1 s after the
raylet had registered.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any

from engine.base.errors import ConfigError
from engine.runtime.switches import LOG_TO_DRIVER_ENV, QUIET_ENV
from engine.telemetry import timeline


def _init_kwargs(ray_cfg, include_dashboard: bool | None, extra_cpus: float) -> dict:
    """``ray.init``'s arguments for this config (checks a local fit first)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # The CLI sets DPFL_RAY_LOG_TO_DRIVER=0 unless --verbose: workers' output then stays
    # in Ray's session logs instead of the console.
    log_to_driver = os.environ.get(LOG_TO_DRIVER_ENV, "1") != "0"
    kwargs: dict = {"log_to_driver": log_to_driver, "configure_logging": False}
    # Inside a Ray job (dpfl submit) Ray sets RAY_ADDRESS: attach, never start a new one.
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        kwargs["address"] = address
    else:
        from engine.runtime.resources import check_local_fit

        check_local_fit(ray_cfg, extra_cpus)  # no unbounded worker processes
        # "local": always a new instance. Without an address Ray would attach to the
        # cluster last started by `ray start` on this machine (its address is kept in
        # /tmp/ray/ray_current_cluster, also after that cluster died) and refuse the
        # CPU count with a ValueError; attaching is what ray.address is for.
        kwargs["address"] = "local"
        need = ray_cfg.num_workers * ray_cfg.num_cpus_per_worker + extra_cpus
        kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(need))
        if include_dashboard is not None:
            kwargs["include_dashboard"] = include_dashboard
        if ray_cfg.object_store_memory_mb:
            kwargs["object_store_memory"] = ray_cfg.object_store_memory_mb * 2**20
    return kwargs


def _attached(kwargs: dict) -> str | None:
    """The cluster address ``ray.init`` attaches to; None when it starts a local one."""
    address = kwargs.get("address")
    return None if address == "local" else address


def _attach_error(ray_cfg, address: str, e: BaseException) -> ConfigError:
    key = "ray.address" if ray_cfg.address else "$RAY_ADDRESS"
    # Ray >= 2.5x turns token authentication on for a new cluster; a driver
    # attaching without RAY_AUTH_MODE=token is refused with a bare ConnectionError.
    auth = not os.environ.get("RAY_AUTH_MODE") and os.path.isfile(
        os.path.expanduser("~/.ray/auth_token")
    )
    return ConfigError(
        f"{key}={address!r}: cannot attach to a Ray cluster "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        + ("; if it uses token authentication, set RAY_AUTH_MODE=token" if auth else "")
    )


#: How long :func:`check_ray_start` waits for a cluster's address to accept a connection.
CONNECT_TIMEOUT_S = 5.0
#: Ray's smallest object store (``ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES``).
OBJECT_STORE_MINIMUM_BYTES = 75 * 2**20


def check_ray_start(ray_cfg, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """What ``ray.init`` would refuse or hang on, checked before it is called (and before
    a run writes anything); ConfigError naming the key. The keys are checked also when
    this process's Ray is up already (it is then used as it is): a run must not
    silently use another Ray than the one its configuration names, nor keep a value
    that a fresh start would refuse.

    * Attaching (``ray.address``, else ``$RAY_ADDRESS``): the address must be
      ``host:port`` (``ray://host:port`` for Ray Client; ``auto``: the cluster this
      machine started last) and accept a TCP connection within ``timeout_s``
      (``ray.init`` otherwise waits silently for minutes). ``ray.object_store_memory_mb``
      beside ``ray.address`` is refused: the cluster's store is the cluster's.
    * Starting: ``ray.object_store_memory_mb`` within Ray's bounds (at least 75 MiB, at
      most the machine's memory and what ``/dev/shm`` can hold), asked of Ray's own
      check where it has one."""
    ray = sys.modules.get("ray")
    up = ray is not None and ray.is_initialized()
    address = ray_cfg.address or (None if up else os.environ.get("RAY_ADDRESS"))
    if up and address == "auto":  # "the cluster there is": the one this process is in
        address = None
    mb = ray_cfg.object_store_memory_mb
    if address:
        if ray_cfg.address and mb:
            raise ConfigError(
                f"ray.object_store_memory_mb={mb}: sizes the object store of a Ray that dpfl "
                f"starts; the cluster at ray.address={address!r} has its own (drop one key)"
            )
        _check_address(address, "ray.address" if ray_cfg.address else "$RAY_ADDRESS", timeout_s)
    elif mb is not None:
        _check_object_store(int(mb))


def _check_address(address: str, key: str, timeout_s: float) -> None:
    import socket

    target = address.strip()
    if target == "auto":  # as Ray resolves it: $RAY_ADDRESS (set inside a job), else the file
        target = os.environ.get("RAY_ADDRESS", "").strip() or "auto"
    if target == "auto":
        import tempfile

        current = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
        try:
            with open(current, encoding="utf-8") as f:
                target = f.read().strip()
        except OSError:
            target = ""
        if not target:
            raise ConfigError(
                f"{key}=auto: no Ray cluster was started on this machine (ray start --head), "
                "or give its host:port"
            )
    target = target.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if "://" in target or not sep or not host or not port.isdigit():
        raise ConfigError(
            f"{key}={address!r}: expected host:port (e.g. 10.0.0.1:6379) or ray://host:port"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ConfigError(
            f"{key}={address!r}: no Ray cluster answers at {host}:{port} ({why}, waited up "
            f"to {timeout_s:g} s); start it (ray start --head) or correct the address"
        ) from None


def _check_object_store(mb: int) -> None:
    import tempfile

    size = mb * 2**20
    if size < OBJECT_STORE_MINIMUM_BYTES:
        raise ConfigError(
            f"ray.object_store_memory_mb={mb}: Ray's object store needs at least "
            f"{OBJECT_STORE_MINIMUM_BYTES // 2**20} MiB ({OBJECT_STORE_MINIMUM_BYTES:,} bytes); "
            "raise it, or set null for Ray's default"
        )
    try:
        from ray._private.services import determine_plasma_store_config
    except ImportError:  # another Ray's internals: the minimum above still holds
        return
    quiet = logging.getLogger("ray._private.services")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its warning that /tmp stands in for /dev/shm
    try:
        determine_plasma_store_config(size, tempfile.gettempdir())
    except ValueError as e:
        raise ConfigError(f"ray.object_store_memory_mb={mb}: {' '.join(str(e).split())}") from None
    finally:
        quiet.setLevel(level)


#: How often a local start (:func:`_node_poll`) asks the GCS whether its node is there.
NODE_POLL_S = 0.02


def _node_poll(original: Any) -> Any:
    """``ray._private.services.get_node`` for a local start that first waits for the
    node to appear in the GCS's node table, asking every :data:`NODE_POLL_S` s.

    ``ray.init`` asks for its new node 0.1 s after starting the raylet, and the GCS
    call behind ``get_node`` retries once a second until the node has registered;
    the raylet registers only after its dashboard agent is up (about 1 s on 2
    cores), so ``ray.init`` idled 0.5–1 s, both cores free, after the registration
    (measured: registered at 53.48 s, answered at 54.32 s). This wrapper returns
    what the original returns, called once the node is there (it then answers at
    once). A local start has one node, so any node in the table is ours. Anything
    unexpected (another Ray version's internals) falls back to the original."""
    import time

    def get_node(gcs_address: str, node_id: str) -> Any:
        try:
            from ray._private.services import _get_gcs_client_options
            from ray._private.state import GlobalState

            state = GlobalState()
            state._initialize_global_state(_get_gcs_client_options(gcs_address))
            try:
                deadline = time.monotonic() + 30.0
                while not state.node_table() and time.monotonic() < deadline:
                    time.sleep(NODE_POLL_S)
            finally:
                state.disconnect()
        except Exception:  # noqa: BLE001 - the original's own wait still applies
            pass
        return original(gcs_address, node_id)

    return get_node


def _init_ray(kwargs: dict) -> Any:
    """``ray.init(**kwargs)``; for a local start, with :func:`_node_poll` in place of
    Ray's ``get_node`` for the duration of the call."""
    import ray

    services: Any = getattr(getattr(ray, "_private", None), "services", None)
    original = getattr(services, "get_node", None)
    if _attached(kwargs) is not None or services is None or original is None:
        return ray.init(**kwargs)
    services.get_node = _node_poll(original)
    try:
        return ray.init(**kwargs)
    finally:
        services.get_node = original


def _announce(context: Any) -> None:
    url = getattr(context, "dashboard_url", None)
    if url and os.environ.get(QUIET_ENV) != "1":  # dpfl -q: no console line
        print(f"Ray dashboard: http://{url}", file=sys.stderr, flush=True)


_stop_at_exit = False  # the dpfl executable: a Ray this process starts is stopped at exit
_left_for_exit = False  # a run closed and left its Ray up for hand_off_at_exit
_started_local = False  # the Ray this process is connected to is one it started itself


def _note_start(kwargs: dict) -> None:
    """Record whether the ``ray.init`` just made started a local Ray (or attached)."""
    global _started_local
    _started_local = _attached(kwargs) is None


def stop_ray_at_exit() -> None:
    """From now on :func:`release_ray` leaves this process's own Ray up for
    :func:`hand_off_at_exit` (the ``dpfl`` executable, before it runs a command)."""
    global _stop_at_exit
    _stop_at_exit = True


def release_ray(settle_s: float = 0.0) -> None:
    """Stop the local Ray this process started, at the end of its run: ``ray.shutdown()``
    now, or, after :func:`stop_ray_at_exit`, leave it up for :func:`hand_off_at_exit`
    (a later run of the same process uses it). For the Ray :func:`ensure_ray` connected
    to (it returned True); one attached to (``ray.address``) is always disconnected
    now, never left up or handed off. ``settle_s``: a pause before ``ray.shutdown()``
    (the actors just killed), skipped when left up."""
    global _left_for_exit
    import time

    ray = sys.modules.get("ray")  # never imported just to find it down
    if ray is None or not ray.is_initialized():
        return
    if _stop_at_exit and _started_local:
        _left_for_exit = True
        return
    time.sleep(settle_s)
    ray.shutdown()  # a cluster attached to: only this driver disconnects


def hand_off_at_exit() -> bool:
    """When a run left this process's own Ray up (:func:`release_ray`), give its
    processes to a detached :mod:`engine.runtime.reaper` and drop Ray's own exit
    handler (``ray.shutdown``, which would wait for them); True if handed off, and the
    caller must then end the process (``os._exit``) without ``ray.shutdown()``.
    False (nothing done) when no run left its Ray up."""
    import atexit

    ray = sys.modules.get("ray")
    if not _left_for_exit or ray is None or not ray.is_initialized():
        return False
    from engine.runtime import reaper

    reaper.hand_off()
    atexit.unregister(ray.shutdown)
    return True


def ensure_ray(ray_cfg, include_dashboard: bool | None = None, extra_cpus: float = 0.0) -> bool:
    """Start Ray (or attach to ``ray.address``) unless it is running; True if started.

    The one place dpfl initialises Ray (``dpfl run``, ``compare`` and ``tune``). It
    attaches to ``ray.address``, else to ``$RAY_ADDRESS`` (set by Ray inside a job),
    else starts a local instance with at least the CPUs the workers declare plus
    ``extra_cpus`` (a Tune trial's own CPU), so one run or trial always fits (Ray's CPU
    counts are scheduling labels; on a 2-core machine a trial of 2 one-CPU workers and
    its 0.5-CPU head would otherwise wait for resources forever); attaching to an
    unreachable cluster, or settings ``ray.init`` would refuse, are a ConfigError
    naming the key (:func:`check_ray_start`).
    """
    import ray

    if ray.is_initialized():
        check_ray_start(ray_cfg)  # the keys' values (an address given must answer)
        if not (ray_cfg.address or os.environ.get("RAY_ADDRESS")):  # a Ray of this machine
            from engine.runtime.resources import check_processes

            check_processes(ray_cfg, float(ray.cluster_resources().get("CPU", 0.0)))
        return False
    check_ray_start(ray_cfg)  # checked again here for callers that start Ray directly
    kwargs = _init_kwargs(ray_cfg, include_dashboard, extra_cpus)
    address = _attached(kwargs)
    try:
        timeline.mark("ray.init start")
        context = _init_ray(kwargs)
        timeline.mark("ray.init done")
    except (ConnectionError, RuntimeError, ValueError) as e:
        if address:
            raise _attach_error(ray_cfg, address, e) from None
        raise
    _announce(context)
    _note_start(kwargs)
    return True
