"""Starting Ray: :func:`ensure_ray`, the one place dpfl starts or attaches to Ray, and
:func:`start_ray_early`, which begins that start in a background thread so that it
overlaps the driver's own start (importing torch, calibrating σ, building the data
and the model) instead of following it.

This module imports neither torch nor Ray at import time: ``dpfl run`` calls
:func:`start_ray_early` before it imports the engine's heavy modules.

Why the starting thread never ends. A local ``ray.init`` starts Ray's GCS and raylet
as child processes that share the starter's fate: Linux delivers their "parent died"
signal when the *thread* that forked them exits, not the process. A thread that ran
``ray.init`` and returned would take the cluster down with it (measured: actors then
fail with "Failed to connect to GCS"). The starter therefore waits, as a daemon thread,
until the process exits; Ray's processes are stopped by ``ray.shutdown()`` as before.

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

What changes with an early start: nothing in the run. Ray is started with the same
arguments; the driver's SIGTERM handler that Ray sets only from the main thread
(``sys.exit``, so that ``atexit`` shuts Ray down) is set here from the main thread
instead; a run that fails its checks after the early start shuts that Ray down
(:func:`abandon_early_ray`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
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


class _NotMainThreadNote(logging.Filter):
    """Drops Ray's warning that a non-main thread cannot set the SIGTERM handler (this
    module sets the same handler from the main thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in str(record.msg)


class _EarlyStart:
    """One ``ray.init`` running in a daemon thread that then waits for the process's end."""

    def __init__(self, ray_cfg, kwargs: dict) -> None:
        self.ray_cfg = ray_cfg
        self.kwargs = kwargs
        self.done = threading.Event()
        self.context: Any = None
        self.error: BaseException | None = None
        self._forever = threading.Event()  # never set: see the module docstring
        self.thread = threading.Thread(target=self._start, name="dpfl-ray-start", daemon=True)

    def _start(self) -> None:
        import ray  # noqa: F401 - imported before the "ray.init start" mark, as bench.py times it

        worker_log = logging.getLogger("ray._private.worker")
        note = _NotMainThreadNote()
        worker_log.addFilter(note)
        try:
            timeline.mark("ray.init start")
            self.context = _init_ray(self.kwargs)
            timeline.mark("ray.init done")
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
        finally:
            worker_log.removeFilter(note)
            self.done.set()
        if self.error is None:
            self._forever.wait()

    def result(self) -> Any:
        """Wait for the start; its context, or the start's error raised here."""
        self.done.wait()
        if self.error is not None:
            address = _attached(self.kwargs)
            if address and isinstance(self.error, ConnectionError | RuntimeError | ValueError):
                raise _attach_error(self.ray_cfg, address, self.error) from None
            raise self.error
        return self.context


_early: _EarlyStart | None = None


def start_ray_early(ray_cfg, include_dashboard: bool | None = None) -> bool:
    """Begin :func:`ensure_ray`'s start of Ray in a background thread; True if begun.

    The next :func:`ensure_ray` waits for it and owns the Ray it started (returns True,
    as if it had started Ray itself). Nothing is begun when Ray is already up or an
    early start is pending. The fit checks run here, in the caller's thread, so a
    configuration that cannot fit is refused before anything starts. Must be called
    from the main thread (it sets the driver's SIGTERM handler as Ray would)."""
    global _early
    import ray

    if _early is not None or ray.is_initialized():
        return False
    kwargs = _init_kwargs(ray_cfg, include_dashboard, 0.0)
    if threading.current_thread() is threading.main_thread():
        # Ray sets this handler only when ray.init runs in the main thread: SIGTERM
        # exits through sys.exit, so atexit's ray.shutdown stops Ray's processes.
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))
    _early = _EarlyStart(ray_cfg, kwargs)
    _early.thread.start()
    return True


def abandon_early_ray() -> None:
    """Shut down a Ray that :func:`start_ray_early` began and no :func:`ensure_ray`
    took (a run that failed its checks after the start); no-op otherwise."""
    global _early
    early, _early = _early, None
    if early is None:
        return
    import ray

    early.done.wait()
    if early.error is None and ray.is_initialized():
        ray.shutdown()


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
    unreachable cluster is a ConfigError naming the address. A start begun by
    :func:`start_ray_early` is waited for and counts as this call's.
    """
    global _early
    import ray

    if _early is not None:
        early, _early = _early, None
        _announce(early.result())
        _note_start(early.kwargs)
        return True
    if ray.is_initialized():
        if not (ray_cfg.address or os.environ.get("RAY_ADDRESS")):  # a Ray of this machine
            from engine.runtime.resources import check_processes

            check_processes(ray_cfg, float(ray.cluster_resources().get("CPU", 0.0)))
        return False
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
