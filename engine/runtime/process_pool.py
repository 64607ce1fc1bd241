"""The process worker pool (``ray.executor=processes``): client workers in processes
forked from this one, the server in this process, and no Ray at all.

A single machine's run then pays none of Ray's start: no GCS, raylet, dashboard or
agents, no object store, no worker processes that import torch and dpfl afresh. Each
client worker is forked once, after the data set is built, so it starts with every
module imported and the data set's pages shared with this process; where forking is
not safe (:mod:`engine.runtime.forking`) the workers come from a fork server instead.

The computation is :class:`engine.runtime.local_pool.InProcessPool`'s, spread over
processes exactly as the Ray pool spreads it over actors: the same shards
(:func:`engine.federated.client.shard_cohort`), each trained by one
:class:`engine.federated.client.ClientWorker` into one partial sum, reduced by the
server in shard order; client randomness is keyed by (seed, round, client) and a
client with state always lands on the same worker. Hence the models are the in-process
executor's bit for bit (tested). The round's noise is drawn by the server's thread in
this process while the shards train, from the same stream.

The O(d) vectors of a round do not cross the pipes: the global weights (float32) and
each worker's partial sum (float64) live in one shared mapping (:class:`SharedRound`, a
file in ``/dev/shm`` mapped by every process and unlinked once they all have), written
by the driver and the workers in turn; a pipe carries only the call, the shard, the
public state and the small numbers of each partial sum. Sending them through the pipes
cost a pickle, a copy through 64 KiB pipe buffers and an unpickle per vector (about
27 MB a round for the ``cnn``), on cores the workers were training on.

Privacy: nothing changes. Weights, public state and partial sums cross a pipe or a
shared mapping between processes of this machine instead of Ray's object store; the
server alone adds the
noise and accounts. A worker that dies is not restarted: the run stops with
:class:`engine.runtime.executors.WorkerLostError`, the rounds released so far are
intact, and ``dpfl run --resume`` continues from the last checkpoint (the Ray executor
is the one that retries lost shards).
"""

from __future__ import annotations

import mmap
import os
import signal
import tempfile
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from engine.data.federated import FederatedDataset
from engine.federated.client import ClientWorker, LocalSpec, PartialSum, owner_shard
from engine.federated.server import Server, ServerSpec
from engine.runtime.executors import Executor, WorkerLostError, round_plan
from engine.runtime.forking import pin_threads, process_context
from engine.runtime.local_pool import RoundsInOrder
from engine.telemetry import timeline
from engine.telemetry.phases import OFF

_Played = TypeVar("_Played")
#: What a fork server imports once before it forks a client worker (used only where a
#: fork of this process is not safe).
PRELOAD = ("torch", "engine.federated.client", "engine.federated.vectorized")
#: Seconds a client worker may take to build its model and answer.
START_TIMEOUT_S = 300.0
_OK, _ERROR = "ok", "error"
#: what a shared-slot answer carries in place of its sum
_IN_SLOT = np.zeros(0)


def process_executor(
    dataset: FederatedDataset, server_spec: ServerSpec, local_spec: LocalSpec, num_workers: int
) -> Executor:
    """Client workers in ``num_workers`` processes, the server here (module docstring)."""
    pool = ProcessPool(dataset, server_spec, local_spec, num_workers)
    return Executor(pool, round_plan(dataset, server_spec, local_spec, num_workers))


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-int(nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE


class SharedRound:
    """A round's O(d) vectors shared by the driver and its ``k`` workers: the global
    weights (float32, written by the driver before it dispatches a round) and one
    float64 partial-sum slot per worker (written by that worker while it trains, read
    by the driver's reduction before the next dispatch). One file mapped by every
    process: created by the driver, opened by each worker (:meth:`attach`), unlinked by
    the driver once all have it mapped, so nothing is left behind however the run ends
    after that. Calls alternate (dispatch, train, reduce), so no two processes write
    one region at once."""

    def __init__(self, dim: int, num_workers: int, path: str | None = None) -> None:
        self.dim, self.num_workers = int(dim), int(num_workers)
        # each vector starts on a page of its own (aligned, and no two processes
        # write one page)
        self.stride = [_pages(4 * self.dim), _pages(8 * self.dim)]
        size = max(1, self.stride[0] + self.stride[1] * self.num_workers)
        if path is None:
            where = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="dpfl-round-", dir=where)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        self.path: str | None = path
        try:
            self.buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.weights = np.frombuffer(self.buffer, np.float32, self.dim, 0)
        base, step = self.stride
        self.partials = [
            np.frombuffer(self.buffer, np.float64, self.dim, base + step * i)
            for i in range(self.num_workers)
        ]

    @classmethod
    def attach(cls, path: str, dim: int, num_workers: int) -> SharedRound:
        """A worker's view of the driver's mapping (the file must still exist)."""
        return cls(dim, num_workers, path)

    def unlink(self) -> None:
        """Remove the file (mappings stay valid); the driver's, once workers attached."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def serve(conn: Any, dataset: FederatedDataset, spec: LocalSpec) -> None:
    """A client worker's process: pin its threads, build its
    :class:`ClientWorker`, then answer ``(method, args)`` calls in order until told to
    stop (None), its pipe closes, or the process that started it is gone. Ctrl-C is the
    driver's to handle (it stops the workers), so a worker ignores SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_threads(spec.num_threads)
    # the driver, or the fork server it started: once it is gone this process is
    # handed to another parent, and nothing will call it again
    parent = os.getppid()
    try:
        worker = ClientWorker(dataset, spec)
        conn.send((_OK, worker.ping()))
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send((_ERROR, traceback.format_exc()))
        return
    shared: SharedRound | None = None
    slot = 0

    def attach_shared(path: str, dim: int, num_workers: int, index: int) -> bool:
        nonlocal shared, slot
        shared, slot = SharedRound.attach(path, dim, num_workers), int(index)
        return True

    def train_shared(rnd: int, clients: np.ndarray, public: dict | None) -> PartialSum:
        """``train_shard`` on the shared weights into this worker's shared slot; the
        answer carries everything but the sum (the driver reads it from the slot)."""
        assert shared is not None
        partial = worker.train_shard(shared.weights, rnd, clients, public, shared.partials[slot])
        partial.update_sum = _IN_SLOT
        return partial

    local_calls: dict[str, Callable[..., Any]] = {
        "attach_shared": attach_shared,
        "train_shared": train_shared,
    }
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent:  # the driver (or its fork server) died
                return
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return
        if call is None:
            return
        name, args = call
        try:
            method = local_calls.get(name) or getattr(worker, name)
            conn.send((_OK, method(*args)))
        except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
            conn.send((_ERROR, traceback.format_exc()))


class WorkerFailedError(RuntimeError):
    """A client worker's call raised: its traceback, from the worker's process."""


class ProcessPool(RoundsInOrder):
    """Client workers in forked processes, the server in this process (module
    docstring); what :func:`engine.runtime.executors.play_round` calls. A lost worker
    is not restarted; evaluations run in the round loop's order."""

    def __init__(
        self,
        dataset: FederatedDataset,
        server_spec: ServerSpec,
        local_spec: LocalSpec,
        num_workers: int,
    ) -> None:
        self.personal = local_spec.pipeline.personal is not None
        self.timer: Any = OFF
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        self.server: Server | None = None
        self.shared: SharedRound | None = None
        # The workers first: forking is safe only while this process runs no thread
        # (the server starts its noise thread later, at its first round).
        ctx = process_context(local_spec.num_threads, PRELOAD)
        try:
            for i in range(num_workers):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(
                    target=serve,
                    args=(theirs, dataset, local_spec),
                    name=f"dpfl-client-worker-{i}",
                    daemon=True,
                )
                p.start()
                theirs.close()  # the worker's end: only the worker holds it now
                self.conns.append(mine)
                self.processes.append(p)
            self.server = Server(dataset, server_spec)
            dims = [self._receive(i, "starting", None, START_TIMEOUT_S) for i in range(num_workers)]
            self.shared = SharedRound(dims[0], num_workers)
            try:
                self._call_all(
                    "attach_shared",
                    [(self.shared.path, dims[0], num_workers, i) for i in range(num_workers)],
                    None,
                )
            finally:
                self.shared.unlink()
        except BaseException:
            self.close()
            raise
        timeline.mark("workers ready")

    # ------------------------------------------------------------------ plumbing
    def _send(self, i: int, name: str, *args: Any) -> None:
        try:
            self.conns[i].send((name, args))
        except (BrokenPipeError, OSError) as e:
            raise self._lost(i, name, None) from e

    def _receive(self, i: int, name: str, rnd: int | None, timeout: float | None = None) -> Any:
        conn, process = self.conns[i], self.processes[i]
        try:
            if timeout is not None and not conn.poll(timeout):
                raise self._lost(i, name, rnd, f"no answer within {timeout:.0f} s")
            status, value = conn.recv()
        except (EOFError, OSError) as e:
            process.join(1.0)
            raise self._lost(i, name, rnd) from e
        if status == _ERROR:
            raise WorkerFailedError(f"{process.name} ({name}) raised:\n{value}")
        return value

    def _receive_all(self, name: str, n: int, rnd: int | None) -> list:
        """Workers 0..n-1's answers to ``name``, in order. Every answer is read before
        an error is raised (the first), so no answer is left in a pipe for a later
        call to take as its own."""
        answers: list = []
        first: BaseException | None = None
        for i in range(n):
            try:
                answers.append(self._receive(i, name, rnd))
            except (WorkerFailedError, WorkerLostError) as e:
                first = first or e
                answers.append(None)
        if first is not None:
            raise first
        return answers

    def _lost(self, i: int, name: str, rnd: int | None, why: str = "") -> WorkerLostError:
        p = self.processes[i]
        how = why or f"exit code {p.exitcode}"
        where = f"round {rnd + 1}: " if rnd is not None else ""
        intact = f" The {rnd} completed rounds are intact." if rnd is not None else ""
        return WorkerLostError(
            f"{where}{p.name} (pid {p.pid}) died during {name} ({how}); "
            f"ray.executor=processes does not restart workers, stopping.{intact}"
        )

    def _call_all(self, name: str, per_worker: list[tuple], rnd: int | None) -> list:
        """``name(*args)`` on worker i for each i, all at once; their answers in order."""
        for i, args in enumerate(per_worker):
            self._send(i, name, *args)
        return self._receive_all(name, len(per_worker), rnd)

    def _spread(self, name: str, items: list, prefix: tuple, rnd: int | None) -> list:
        """``name(*prefix, *item)`` for each item, item j on worker j mod k, in rounds of
        one item per worker; the answers in the items' order."""
        k = len(self.conns)
        out: list = []
        for start in range(0, len(items), k):
            batch = items[start : start + k]
            out += self._call_all(name, [(*prefix, *item) for item in batch], rnd)
        return out

    # ------------------------------------------------------ what play_round calls
    def set_timer(self, timer: Any) -> None:
        """The driver's and the server's phases go to ``timer`` (workers time nothing)."""
        self.timer = timer
        assert self.server is not None
        self.server.timer = timer

    def begin_round(self, rnd: int) -> tuple[np.ndarray, Any, Any]:
        assert self.server is not None
        return self.server.begin_round(rnd)

    def train(
        self,
        rnd: int,
        shards: list[np.ndarray],
        weights: Any,
        public: Any,
        while_training: Callable[[], None] | None = None,
    ) -> list:
        """Every shard's partial sum; shard i trains on worker i. The round's noise is
        drawn here while they train (it depends on no client data)."""
        assert self.server is not None and self.shared is not None
        with self.timer.phase("dispatch"):
            np.copyto(self.shared.weights, np.asarray(weights), casting="same_kind")
            for i, shard in enumerate(shards):
                self._send(i, "train_shared", rnd, shard, public)
        self.server.prefetch_noise(rnd)
        if while_training is not None:
            while_training()
        with self.timer.phase("train_wait"):
            partials = self._receive_all("train_shard", len(shards), rnd)
        for i, partial in enumerate(partials):
            # a view of worker i's slot: read by finish_round's reduction, which copies
            # nothing it keeps, before the next round's dispatch writes it again
            partial.update_sum = self.shared.partials[i]
        return partials

    def finish_round(self, rnd: int, partials: list) -> dict:
        assert self.server is not None
        return self.server.finish_round(rnd, *partials, evaluate=False)

    def current_weights(self) -> np.ndarray:
        assert self.server is not None
        return self.server.get_weights()

    def evaluate(self, weights: Any, slices: list[tuple[int, int]]) -> list:
        return self._spread("evaluate_slice", list(slices), (weights,), None)

    def personal_eval(self, weights: Any, clients: list[np.ndarray]) -> list[tuple[int, int]]:
        return self._spread("personal_eval", [(c,) for c in clients], (weights,), None)

    def weights(self) -> np.ndarray:
        return self.current_weights()

    def checkpoint(self, handle: None = None) -> dict:
        """Server state plus every worker's per-client state (personal heads only)."""
        assert self.server is not None
        clients: dict = {}
        if self.personal:
            for part in self._call_all("client_state", [()] * len(self.conns), None):
                clients.update(part)
        return {"server": self.server.state_dict(), "clients": clients}

    def restore(self, state: dict) -> None:
        """Each client's state to the worker that trains it (sticky shards)."""
        assert self.server is not None
        self.server.load_state_dict(state["server"])
        clients = state.get("clients", {})
        k = len(self.conns)
        owners = owner_shard(np.fromiter(clients, np.int64, len(clients)), k)
        parts = [
            ({c: v for (c, v), o in zip(clients.items(), owners) if o == i},) for i in range(k)
        ]
        self._call_all("restore_client_state", parts, None)

    def close(self) -> None:
        """Stop the workers (asked, then terminated after a grace period) and the
        server's noise thread."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.processes:
            p.join(5.0)
            if p.is_alive():
                p.terminate()
                p.join(5.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.processes = [], []
        if self.shared is not None:
            self.shared.unlink()
            self.shared = None
        if self.server is not None:
            self.server.close()
            self.server = None
