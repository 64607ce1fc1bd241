"""The server in the driver process (``ray.server``): :func:`server_in_driver`
decides where the Ray pool keeps the server, and :class:`DriverServer` runs a
:class:`engine.federated.server.Server` here behind an actor handle's interface."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from engine.data.federated import FederatedDataset
from engine.federated.server import Server, ServerSpec


def server_in_driver(choice: str, address: str | None = None) -> bool:
    """Where :class:`RayWorkerPool` keeps the server (``ray.server``).

    ``actor``: its own actor. ``driver``: this process, called like an actor
    (:class:`DriverServer`). ``auto``: the driver when the Ray cluster has one live
    node (a laptop or a single machine), where it saves a process that would import
    torch and the accountant again while the workers start — about 1.9 s of the time
    to the first round on 2 cores (``benchmarks/startup_eval.py``); an actor on a
    multi-node cluster, and through Ray Client (``ray://`` addresses: the driver is
    then outside the cluster). Results are bit-identical either way (tested)."""
    if choice != "auto":
        return choice == "driver"
    return single_machine(address)


def single_machine(address: str | None = None) -> bool:
    """Whether this driver and every process of the Ray cluster share one machine: one
    live node, not reached through Ray Client (``ray://``: the driver is outside)."""
    address = address or os.environ.get("RAY_ADDRESS") or ""
    if address.startswith("ray://"):
        return False
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


class _DriverMethod:
    """One :class:`Server` method called like an actor method: ``.remote(*args)`` runs
    it now in this process and returns object references to what it returned."""

    def __init__(self, ray, fn: Callable, num_returns: int = 1) -> None:
        self._ray, self._fn, self._num_returns = ray, fn, num_returns

    def options(self, num_returns: int = 1, **_: Any) -> _DriverMethod:
        return _DriverMethod(self._ray, self._fn, num_returns)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ray = self._ray

        def arrive(a: Any) -> Any:
            # As an actor's argument would: a reference resolved, a value copied through
            # the object store (so the server never aliases the caller's arrays).
            return ray.get(a if isinstance(a, ray.ObjectRef) else ray.put(a))

        out = self._fn(*map(arrive, args), **{k: arrive(v) for k, v in kwargs.items()})
        if self._num_returns == 1:
            return ray.put(out)
        return [ray.put(o) for o in out]


class DriverServer:
    """A :class:`Server` in the driver process behind an actor handle's interface.

    The server's work is the same either way; only the process differs. It cannot be
    lost on its own (it dies with the driver), so ``max_restarts`` concerns only the
    client workers, and its round checkpoint is a reference like an actor's."""

    def __init__(self, ray, dataset: FederatedDataset, spec: ServerSpec) -> None:
        self._ray = ray
        self.instance = Server(dataset, spec)

    def __getattr__(self, name: str) -> _DriverMethod:
        if name.startswith("__") and name != "__ray_ready__":
            raise AttributeError(name)
        if name == "__ray_ready__":
            return _DriverMethod(self._ray, lambda: True)
        return _DriverMethod(self._ray, getattr(self.instance, name))
