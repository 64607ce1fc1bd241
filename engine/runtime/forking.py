"""How dpfl starts processes of its own on one machine (the process runner's trial
processes, the process executor's client workers), without Ray.

Forked from this process when that is safe: it has only its main Python thread, Ray is
not running in it, and each child trains on one thread; then a child starts in
milliseconds with everything already imported, sharing its pages (the data set
included) with this process. This process may still hold native thread pools (torch's
OpenMP pool once an operation ran on two threads, OpenBLAS's, jemalloc's): a forked
child that entered an OpenMP region of more than one thread would wait for pool
threads it does not have (measured: an element-wise torch operation on 2M values hangs
there). So every child runs :func:`pin_threads` first, before any torch operation: on
one thread torch runs no OpenMP region, and OpenBLAS and jemalloc re-initialise after a
fork themselves.

Otherwise (a notebook with Ray up, a child of several threads, a thread already
running here) from ``multiprocessing``'s fork server, which imports the given modules
once, in a fresh interpreter, and forks the children from there.
Imports nothing of dpfl."""

from __future__ import annotations


def forkserver_context(preload: tuple[str, ...]):
    """``multiprocessing``'s forkserver context, importing ``preload`` once."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def fork_is_safe(threads: int) -> bool:
    """Whether children may be forked from this process (module docstring)."""
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
    """A child's first step: its torch threads, set before any torch operation runs in
    it (module docstring: a forked child must not enter the parent's OpenMP pool)."""
    import torch

    torch.set_num_threads(max(1, int(threads)))


def process_context(threads: int, preload: tuple[str, ...], start_method: str | None = None):
    """The ``multiprocessing`` context of the children: ``fork`` where
    :func:`fork_is_safe`, else the fork server (importing ``preload``); ``start_method``
    forces one."""
    import multiprocessing

    method = start_method or ("fork" if fork_is_safe(threads) else "forkserver")
    if method == "forkserver":
        return forkserver_context(preload)
    return multiprocessing.get_context(method)
