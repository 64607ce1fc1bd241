"""Example arrays in shared memory, sent to other processes by reference.

A materialised synthetic population is generated straight into :class:`SharedRows`:
growable arrays backed by a Linux ``memfd`` (an anonymous shared-memory file, freed
when its last descriptor and mapping are gone, so nothing is left behind if a process
dies). While :func:`by_reference` is on, pickling a
:class:`~engine.data.federated.FederatedDataset` sends such arrays as
:class:`SharedView` handles (process id, descriptor, a random token, offset, shape,
dtype): a process on the same machine opens ``/proc/<pid>/fd/<fd>`` (checking the token
in the file's name) and maps it read-only; the process that owns the segment gets views
of its own mapping back. So the examples exist once on the machine: not once in the
driver's heap and again in Ray's object store, which ``ray.put`` would copy them into
(issue 30: the driver of a 10^6-client run held both, 2.43 × the data).

Only :class:`engine.runtime.ray_pool.RayWorkerPool` turns :func:`by_reference` on,
around its ``ray.put`` and only on a one-node cluster (the handle means nothing on
another machine, and is refused there: the token does not match). Any other pickle
(a file, a Tune trial) copies the values as before. Where ``os.memfd_create`` does not
exist the arrays are ordinary heap arrays.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE
_state = threading.local()


def available() -> bool:
    """Whether shared segments can be made here (Linux ``memfd_create``)."""
    return hasattr(os, "memfd_create")


class _Segment(mmap.mmap):
    """One memfd's mapping; ``fd``/``token``/``owner`` say how others reach it."""

    fd: int
    token: str
    owner: int


#: this process's live segments (its own and those it attached to), by token
_LIVE: weakref.WeakValueDictionary[str, _Segment] = weakref.WeakValueDictionary()


def _new_segment(nbytes: int, label: str) -> _Segment:
    token = secrets.token_hex(8)
    fd = os.memfd_create(f"dpfl-{label}-{token}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, PAGE))
        seg = _Segment(fd, max(nbytes, PAGE))  # MAP_SHARED, read-write
    except BaseException:
        os.close(fd)
        raise
    seg.fd, seg.token, seg.owner = fd, token, os.getpid()
    weakref.finalize(seg, os.close, fd)  # others open /proc/<pid>/fd/<fd> while it lives
    _LIVE[token] = seg
    return seg


def segment_of(a: np.ndarray) -> _Segment | None:
    """The shared segment ``a``'s memory lies in (following views), or None."""
    b: Any = a
    while b is not None:
        if isinstance(b, _Segment):
            return b
        b = b.obj if isinstance(b, memoryview) else getattr(b, "base", None)
    return None


def _address(seg: _Segment) -> int:
    view = np.frombuffer(seg, np.uint8, count=1)
    return int(view.ctypes.data)


class SharedRows:
    """Two row arrays (``x``: ``(rows, *shape)``, ``y``: ``(rows,)``) in shared memory
    that grow without a copy: the memfd is lengthened and the mapping ``mremap``-ed, so
    pages written stay where they are. Write through :meth:`views`; views must be
    dropped before the next :meth:`reserve` (an exported mapping cannot move)."""

    def __init__(self, rows: int, shape: tuple[int, ...], x_dtype: Any, y_dtype: Any) -> None:
        self.shape = tuple(shape)
        self.dx, self.dy = np.dtype(x_dtype), np.dtype(y_dtype)
        self.row_x = self.dx.itemsize * int(np.prod(self.shape, dtype=np.int64))
        self.capacity = max(int(rows), 1)
        self.sx = _new_segment(self.capacity * self.row_x, "x")
        self.sy = _new_segment(self.capacity * self.dy.itemsize, "y")

    def reserve(self, rows: int) -> None:
        """Room for at least ``rows`` rows (grown by at least a quarter)."""
        if rows <= self.capacity:
            return
        self.capacity = max(rows, int(self.capacity * 1.25))
        self.sx.resize(self.capacity * self.row_x)
        self.sy.resize(self.capacity * self.dy.itemsize)

    def views(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Writable views of rows ``start:stop``."""
        n = stop - start
        x = np.ndarray((n, *self.shape), self.dx, buffer=self.sx, offset=start * self.row_x)
        y = np.ndarray((n,), self.dy, buffer=self.sy, offset=start * self.dy.itemsize)
        return x, y

    def finish(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Shrink to ``rows`` (the tail's pages are freed) and return the arrays."""
        self.capacity = max(rows, 1)
        self.sx.resize(self.capacity * self.row_x)
        self.sy.resize(self.capacity * self.dy.itemsize)
        return self.views(0, rows)


def empty(n: int, dtype: Any, shared: bool = True) -> np.ndarray:
    """``np.empty(n, dtype)``, in a shared segment of its own when ``shared`` (and the
    platform has them)."""
    if not (shared and available()):
        return np.empty(n, dtype)
    dt = np.dtype(dtype)
    seg = _new_segment(n * dt.itemsize, "index")
    return np.ndarray((n,), dt, buffer=seg)


class HeapRows:
    """:class:`SharedRows`' interface on ordinary arrays that grow in place
    (``ndarray.resize``: large blocks are remapped by realloc, not copied)."""

    def __init__(self, rows: int, shape: tuple[int, ...], x_dtype: Any, y_dtype: Any) -> None:
        self.capacity = max(int(rows), 1)
        self.x = np.empty((self.capacity, *shape), x_dtype)
        self.y = np.empty(self.capacity, y_dtype)

    def reserve(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        self.capacity = max(rows, int(self.capacity * 1.25))
        self.x.resize((self.capacity, *self.x.shape[1:]), refcheck=False)
        self.y.resize(self.capacity, refcheck=False)

    def views(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[start:stop], self.y[start:stop]

    def finish(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        self.x.resize((rows, *self.x.shape[1:]), refcheck=False)  # shrink in place
        self.y.resize(rows, refcheck=False)
        return self.x, self.y


@dataclass(frozen=True)
class SharedView:
    """A picklable handle to an array in another process's shared segment."""

    pid: int
    fd: int
    token: str
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    def resolve(self) -> np.ndarray:
        """The array, mapped read-only (or a view of this process's own mapping)."""
        seg = _LIVE.get(self.token)
        if seg is None:
            seg = _attach(self.pid, self.fd, self.token, self.nbytes)
        return np.ndarray(
            self.shape, np.dtype(self.dtype), buffer=seg, offset=self.offset, strides=self.strides
        )


def _attach(pid: int, fd: int, token: str, nbytes: int) -> _Segment:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError:
        target = ""
    if f"-{token} " not in target + " ":
        raise RuntimeError(
            f"the example arrays live in shared memory of process {pid} on another "
            f"machine or in a process that has exited ({path} is not its segment): "
            "they can be sent by reference only within one machine"
        )
    f = os.open(path, os.O_RDONLY)
    try:
        seg = _Segment(f, nbytes, prot=mmap.PROT_READ)  # MAP_SHARED: the same pages
    finally:
        os.close(f)  # the mapping keeps the file
    seg.fd, seg.token, seg.owner = -1, token, pid
    _LIVE[token] = seg
    return seg


def reference(a: Any) -> Any:
    """``a`` as a :class:`SharedView` when :func:`by_reference` is on and ``a`` lies in a
    shared segment this process can hand out; otherwise ``a`` itself."""
    if not getattr(_state, "on", False) or not isinstance(a, np.ndarray):
        return a
    seg = segment_of(a)
    if seg is None or seg.fd < 0:  # not shared, or mapped from another process
        return a
    return SharedView(
        seg.owner,
        seg.fd,
        seg.token,
        len(seg),
        int(a.ctypes.data) - _address(seg),
        tuple(a.shape),
        tuple(a.strides),
        a.dtype.str,
    )


def resolve(v: Any) -> Any:
    """The inverse of :func:`reference`."""
    return v.resolve() if isinstance(v, SharedView) else v


@contextlib.contextmanager
def by_reference(on: bool = True) -> Iterator[None]:
    """While on, datasets pickled in this thread send shared arrays as handles."""
    before = getattr(_state, "on", False)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before
