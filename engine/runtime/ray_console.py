"""Ray's console output kept in ``ray.log`` of the results folder.

The CLI wraps each command in :func:`quiet_ray`; :func:`engine.simulation.simulate`
does the same when it is called from Python (a script, a notebook) and nothing around
it already does, so that the Python API is as quiet as the command line.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.base.errors import ConfigError
from engine.runtime.switches import LOG_TO_DRIVER_ENV

RAY_LOG = "ray.log"
_ACTIVE = 0  # quiet_ray blocks open in this process


@dataclass
class RayLog:
    """Where the captured output goes when the block ends (``out/ray.log``)."""

    out: Path | None


def console_is_quiet() -> bool:
    """Whether a :func:`quiet_ray` block is open in this process (quiet or, with
    ``verbose``, deliberately not: either way the caller has decided)."""
    return _ACTIVE > 0


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker (a Tune trial's actor): its output already
    goes to Ray's session logs."""
    worker = sys.modules.get("ray._private.worker")
    mode = getattr(getattr(worker, "global_worker", None), "mode", None)
    return mode is not None and mode == getattr(worker, "WORKER_MODE", object())


@contextlib.contextmanager
def quiet_ray(
    out: Path | None, verbose: bool, uses_ray: bool = True, defer: bool = False
) -> Iterator[RayLog]:
    """Send Ray's console output to ``out/ray.log`` (unless ``verbose``).

    Ray writes to the console three ways: Python log records (the ``ray`` logger, e.g.
    its token-authentication notice), C++ log lines written straight to file
    descriptor 2 by the driver's core worker (e.g. ``core_worker.cc ...
    max_restarts``), and workers' output forwarded to the driver. The first is given a
    file handler, the second is caught by pointing fd 2 at the log while Python's
    ``sys.stderr`` (progress bars, warnings, errors) keeps the console, and the third
    is turned off (:data:`LOG_TO_DRIVER_ENV`; workers' output stays in Ray's session
    logs). When ``out`` does not exist yet, the log is kept in a temporary file and
    appended to ``out/ray.log`` when the command ends, if ``out`` then exists; so it is
    with ``defer`` (a resume whose checks run inside), and a command refused with a
    ConfigError then leaves ``out`` untouched. ``out`` may be None, or change while the
    block runs: the yielded :class:`RayLog`'s ``out`` at the end is where the log goes
    (none: it is dropped).
    """
    global _ACTIVE
    sink = RayLog(out)
    if verbose or not uses_ray:  # the caller decided: simulate inside leaves it so
        _ACTIVE += 1
        try:
            yield sink
        finally:
            _ACTIVE -= 1
        return
    import logging
    import tempfile

    import ray  # noqa: F401 - its logger exists before it is redirected

    tmp = None
    refused = False
    if out is not None and out.is_dir() and not defer:
        log = open(out / RAY_LOG, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    else:
        fd, tmp = tempfile.mkstemp(prefix="dpfl-ray-", suffix=".log")
        log = os.fdopen(fd, "w", buffering=1, encoding="utf-8")
    log.write(
        f"# dpfl {' '.join(sys.argv[1:])}: Ray's console output "
        f"(workers' output: Ray's session logs, e.g. /tmp/ray/session_latest/logs)\n"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    console_fd = os.dup(2)
    old_stderr = sys.stderr
    try:
        # A notebook's sys.stderr (ipykernel's OutStream) is not the console's: leave it.
        real = isinstance(sys.stderr, io.TextIOWrapper) and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        real = False  # already redirected (e.g. captured by a test): leave it alone
    os.dup2(log.fileno(), 2)
    if real:
        sys.stderr = open(  # noqa: SIM115
            console_fd,
            "w",
            buffering=1,
            closefd=False,
            encoding=getattr(old_stderr, "encoding", None) or "utf-8",
            errors="backslashreplace",
        )
    # ray.init(configure_logging=False) removes the "ray" logger's handlers, after which
    # Ray's records reach logging.lastResort (the console): both go to the log.
    ray_logger = logging.getLogger("ray")
    handlers, propagate = ray_logger.handlers[:], ray_logger.propagate
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ray_logger.handlers = [handler]
    ray_logger.propagate = False
    last_resort = logging.lastResort
    logging.lastResort = handler
    # The raylet's warnings (e.g. "worker processes were started ...") reach the driver
    # through a thread that prints them, coloured, to sys.stdout whatever log_to_driver
    # says (ray._private.worker.listen_error_messages): they go to the log too.
    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)

    def to_log(data: dict, *_: Any, **__: Any) -> None:
        with contextlib.suppress(ValueError, OSError):  # the log closed under the thread
            for line in data.get("lines", []):
                log.write(f"({data.get('pid', 'ray')}) {line}\n")

    if printer is not None:
        ray_worker.print_to_stdstream = to_log
    # Tune's new output engine prints an experiment box and TensorBoard hints to stdout
    # even at verbose=0; the legacy engine at verbose=0 prints nothing.
    quiet_env = {LOG_TO_DRIVER_ENV: "0", "RAY_AIR_NEW_OUTPUT": "0"}
    env_before = {k: os.environ.get(k) for k in quiet_env}
    os.environ.update(quiet_env)
    _ACTIVE += 1
    try:
        yield sink
    except ConfigError:
        refused = True
        raise
    finally:
        _ACTIVE -= 1
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        ray_logger.handlers = handlers
        ray_logger.propagate = propagate
        logging.lastResort = last_resort
        if printer is not None:
            ray_worker.print_to_stdstream = printer
        sys.stderr.flush()
        os.dup2(console_fd, 2)
        if real:
            sys.stderr = old_stderr
        os.close(console_fd)
        log.close()
        out = sink.out
        if tmp is not None:
            if out is not None and out.is_dir() and not (refused and defer):
                with (
                    open(tmp, encoding="utf-8") as src,
                    open(out / RAY_LOG, "a", encoding="utf-8") as dst,
                ):
                    shutil.copyfileobj(src, dst)
            os.unlink(tmp)
