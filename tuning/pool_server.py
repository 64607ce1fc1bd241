"""How the process runner (:mod:`tuning.trial_pool`) starts its trial processes.

Forked from this process when that is safe: it has only its main Python thread, Ray is
not running in it, and each trial trains on one thread; then a trial process starts in
milliseconds with everything already imported, sharing its pages with this process.
This process may still hold native thread pools (torch's OpenMP pool once an operation
ran on two threads, OpenBLAS's, jemalloc's): a forked child that entered an OpenMP
region of more than one thread would wait for pool threads it does not have (measured:
an element-wise torch operation on 2M values hangs there). So every trial process runs
:func:`pin_threads` first, before any torch operation: on one thread torch runs no
OpenMP region, and OpenBLAS and jemalloc re-initialise after a fork themselves.

Otherwise (a notebook with Ray up, a trial of several threads) from
``multiprocessing``'s fork server, which imports :data:`PRELOAD` once, in a fresh
interpreter, and forks the processes from there.
Imports nothing of dpfl."""

from __future__ import annotations

#: Modules the fork server imports once, before it forks any trial process: what a
#: trial needs from its first round (about 2 s of one core for torch and dpfl).
PRELOAD = ("torch", "engine.simulation", "engine.federated.vectorized", "tuning.trial")


def forkserver_context():
    """``multiprocessing``'s forkserver context with :data:`PRELOAD` set."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def fork_is_safe(threads: int) -> bool:
    """Whether trial processes may be forked from this process (module docstring)."""
    import multiprocessing
    import sys
    import threading

    ray = sys.modules.get("ray")
    return (
        threads == 1
        and threading.active_count() == 1
        and not (ray is not None and ray.is_initialized())
        and "fork" in multiprocessing.get_all_start_methods()
    )


def pin_threads(threads: int) -> None:
    """A trial process's initializer: its torch threads, set before any torch operation
    runs in it (module docstring: a forked child must not enter the parent's OpenMP
    pool)."""
    import torch

    torch.set_num_threads(max(1, int(threads)))


def pool_context(threads: int, start_method: str | None = None):
    """The ``multiprocessing`` context of the trial processes: ``fork`` where
    :func:`fork_is_safe`, else the fork server; ``start_method`` forces one."""
    import multiprocessing

    method = start_method or ("fork" if fork_is_safe(threads) else "forkserver")
    if method == "forkserver":
        return forkserver_context()
    return multiprocessing.get_context(method)
