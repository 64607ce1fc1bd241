"""How the process runner (:mod:`tuning.trial_pool`) starts its trial processes: forked
from this process where that is safe, else from a fork server that imports
:data:`PRELOAD` once (:mod:`engine.runtime.forking` says when, and why every trial
process runs :func:`pin_threads` first). Imports nothing of dpfl at import time."""

from __future__ import annotations

from engine.runtime.forking import fork_is_safe, pin_threads, process_context

__all__ = ["PRELOAD", "fork_is_safe", "forkserver_context", "pin_threads", "pool_context"]

#: Modules the fork server imports once, before it forks any trial process: what a
#: trial needs from its first round (about 2 s of one core for torch and dpfl).
PRELOAD = ("torch", "engine.simulation", "engine.federated.vectorized", "tuning.trial")


def forkserver_context():
    """``multiprocessing``'s forkserver context with :data:`PRELOAD` set."""
    from engine.runtime.forking import forkserver_context as context

    return context(PRELOAD)


def pool_context(threads: int, start_method: str | None = None):
    """The ``multiprocessing`` context of the trial processes: ``fork`` where
    :func:`fork_is_safe`, else the fork server; ``start_method`` forces one."""
    return process_context(threads, PRELOAD, start_method)
