"""Synthetic(α, β): the LEAF / FedProx federated benchmark generator (Li et al. 2020).

For client k: u_k ~ N(0, α), B_k ~ N(0, β); W_k ~ N(u_k, 1) of shape (C, d) and
b_k ~ N(u_k, 1) of shape (C,); v_k ~ N(B_k, 1) of shape (d,); features
x ~ N(v_k, Σ) with Σ = diag(j^-1.2); label y = argmax(W_k x + b_k). α controls how
much the clients' models differ, β how much their features differ. The number of
examples per client is log-normal (heavy-tailed, as in LEAF), at least 4.

``model="per_client"`` is that generator as published. Its labelling rules are
independent across clients (u_k adds the same offset to every class score, so it
cancels in the argmax), so nothing a model learns carries over to clients it never
saw: accuracy on held-out *public* clients stays at chance. ``model="shared"`` (dpfl's
default) draws one W_0, b_0 ~ N(0, 1) from the generator's own stream and gives client
k W_k = W_0 + u_k, b_k = b_0 + u_k (the same form with the per-entry draws shared):
one labelling rule for the population and the public clients, while features stay
non-IID through β and client sizes stay heavy-tailed.

Privacy (docs: README, "Privacy"): client k's examples depend only on the generator's
seed and k (each client draws from its own stream), and features are standardised with
the generating distribution's own constants — feature j has mean 0 and variance
β + 1 + j^-1.2 under the generator, so x_j is divided by sqrt(β + 1 + j^-1.2) — never
with statistics of the generated data. Adding, removing or changing one client
therefore leaves every other client's examples bit-identical.

Speed (same numbers, fewer Python steps): client k's stream is numpy's
``default_rng(SeedSequence(seed, spawn_key=(0, k)))``; :func:`_pcg64_states` computes
the PCG64 states SeedSequence would give for a whole chunk of clients at once (the
same 32-bit hash, in numpy; tested equal to numpy's), one reused generator is set to
each state, and all of a client's normals after its size are drawn in one
``standard_normal`` call (numpy's ``normal(loc, scale)`` is ``loc + scale * z`` of the
same stream, so this is the same arithmetic). Everything else (means, features,
labels, scaling) is done per chunk of clients; only the per-client label matmul stays
per client, with the same operands and layout as before, so the BLAS call is the same.
The pooled arrays grow in place (``ndarray.resize``, or a shared-memory file lengthened
and remapped: :mod:`engine.data.shared`), so the peak is the data's own size plus a
chunk, not a list of per-client arrays plus their concatenation.

:func:`engine.data.build_dataset` asks for ``dataset.public_eval_clients`` extra clients
(``public_clients``) and holds them out as the public evaluation set: clients drawn
from the same generator that never train and are not part of the population.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.data import shared as shared_memory
from engine.data.shared import HeapRows, SharedRows
from engine.data.sources import PooledData


def feature_scale(dim: int, beta: float) -> np.ndarray:
    """Standard deviation of each feature under the generator (public constants).

    x_j = B_k + (v_kj - B_k) + (x_j - v_kj) with independent N(0, β), N(0, 1) and
    N(0, j^-1.2) terms, so Var(x_j) = β + 1 + j^-1.2 and E[x_j] = 0.
    """
    cov_diag = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2)
    return np.sqrt(beta + 1.0 + cov_diag)


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx) and PCG64's multiplier
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_MASK32 = 0xFFFFFFFF
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645
_MASK128 = (1 << 128) - 1
_POOL = 4


def _words32(n: int) -> list[int]:
    """SeedSequence's coercion of a non-negative int to 32-bit words (little end first)."""
    out = [] if n else [0]
    while n > 0:
        out.append(n & _MASK32)
        n >>= 32
    return out


def _pcg64_states(seed: int, stream: int, ks: np.ndarray) -> list[tuple[int, int]]:
    """(state, inc) of ``PCG64(SeedSequence(seed, spawn_key=(stream, k)))`` for each k.

    The SeedSequence pool mixing and ``generate_state(4, uint64)`` are run for all ``ks``
    at once in uint32 arithmetic (wrapping, as numpy's own code does); then PCG64's
    seeding (``pcg64_set_seed``: state 0, inc = 2·seq + 1, step, add, step).
    """
    ks = np.asarray(ks, dtype=np.int64)
    if len(ks) and (ks.min() < 0 or ks.max() > _MASK32):
        raise ValueError("client numbers must be in [0, 2^32)")
    run = _words32(seed)
    run += [0] * (_POOL - len(run))  # spawn keys pad the run entropy to the pool size
    n = len(ks)
    entropy = [np.full(n, w, np.uint32) for w in run + _words32(stream)]
    entropy.append(ks.astype(np.uint32))
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = value * np.uint32(hash_const)
        return value ^ (value >> np.uint32(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r: np.ndarray = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
        return r ^ (r >> np.uint32(16))

    with np.errstate(over="ignore"):
        pool = [hashmix(entropy[i]) for i in range(_POOL)]
        for src in range(_POOL):
            for dst in range(_POOL):
                if src != dst:
                    pool[dst] = mix(pool[dst], hashmix(pool[src]))
        for src in range(_POOL, len(entropy)):
            for dst in range(_POOL):
                pool[dst] = mix(pool[dst], hashmix(entropy[src]))
        hash_const = _INIT_B
        words = []
        for i in range(2 * _POOL):  # generate_state(4, uint64): 8 words, cycling the pool
            value = pool[i % _POOL] ^ np.uint32(hash_const)
            hash_const = (hash_const * _MULT_B) & _MASK32
            value = value * np.uint32(hash_const)
            words.append((value ^ (value >> np.uint32(16))).astype(np.uint64))
    u64 = [(words[2 * i] | (words[2 * i + 1] << np.uint64(32))).tolist() for i in range(4)]
    out = []
    for s0, s1, q0, q1 in zip(*u64):
        inc = (((q0 << 64) | q1) << 1 | 1) & _MASK128
        state = (inc + ((s0 << 64) | s1)) & _MASK128  # step from 0 gives inc, then add
        out.append(((state * _PCG_MULT + inc) & _MASK128, inc))
    return out


@dataclass(frozen=True)
class SyntheticGenerator:
    """Client k's examples of Synthetic(α, β) from (seed, k) alone.

    ``clients(segments)`` generates whole clients, in order; ``client_size`` draws only
    a client's size. ``stream`` 0 is the population, 1 the public clients.
    """

    seed: int
    alpha: float = 1.0
    beta: float = 1.0
    dim: int = 60
    num_classes: int = 10
    mean_samples: int = 60
    model: str = "shared"
    shared: tuple[np.ndarray, np.ndarray] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model not in ("shared", "per_client"):
            raise ValueError(
                f"dataset.synthetic_model={self.model!r}: must be shared or per_client"
            )
        shared = None
        if self.model == "shared":  # one rule, from a stream no client uses
            g0 = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(2, 0)))
            c, d = self.num_classes, self.dim
            shared = (g0.normal(0.0, 1.0, (c, d)), g0.normal(0.0, 1.0, c))
        object.__setattr__(self, "shared", shared)

    @property
    def max_size(self) -> int:
        """The largest client (sizes are clipped to [4, 20 × mean_samples])."""
        return 20 * self.mean_samples

    def _head(self) -> int:
        """Normals drawn before a client's features: u_k, B_k, (W_k, b_k), v_k."""
        c, d = self.num_classes, self.dim
        return 2 + (c * d + c if self.shared is None else 0) + d

    def _size(self, g: np.random.Generator) -> int:
        draw = g.lognormal(math.log(self.mean_samples), 0.5)
        return int(min(max(draw, 4), self.max_size))  # np.clip(draw, 4, max), truncated

    def client_sizes(self, stream: int, ks: np.ndarray) -> np.ndarray:
        """Sizes of clients ``ks`` of ``stream`` (only the first draw of each stream)."""
        bg = np.random.PCG64(0)
        g = np.random.Generator(bg)
        ks = np.asarray(ks, dtype=np.int64)
        out = np.empty(len(ks), np.int64)
        for a in range(0, len(ks), 65536):  # chunks: the states are Python ints
            for j, (state, inc) in enumerate(_pcg64_states(self.seed, stream, ks[a : a + 65536])):
                bg.state = _state_dict(state, inc)
                out[a + j] = self._size(g)
        return out

    def clients(
        self,
        segments: Sequence[tuple[int, np.ndarray]],
        chunk_values: int = 1 << 15,
        shared: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Examples of the clients ``ks`` of each ``(stream, ks)`` in ``segments``, in
        order: float32 features ``(n, dim)``, int64 labels and each client's size.

        ``shared``: the features and labels are written straight into shared memory
        (:class:`engine.data.shared.SharedRows`, where the platform has it), which the
        Ray pool hands to its workers by reference instead of copying into the object
        store; the values are the same either way."""
        d = self.dim
        head = self._head()
        per_client_max = head + self.max_size * d
        capacity = max(chunk_values, 2 * per_client_max)
        buf = np.empty(capacity, np.float64)  # one chunk of raw normals
        work = _Scratch(capacity, head, d, self.num_classes, min(4, self.max_size), self.beta)
        total = sum(len(ks) for _, ks in segments)
        expect = int(total * self.mean_samples * 1.2) + 16  # E[size] = m·e^{1/8} ≈ 1.13 m
        rows_cls = SharedRows if shared and shared_memory.available() else HeapRows
        out = rows_cls(expect, (d,), np.float32, np.int64)
        sizes = np.empty(total, np.int64)
        bg = np.random.PCG64(0)
        g = np.random.Generator(bg)
        done, rows = 0, 0
        for stream, ks in segments:
            ks = np.asarray(ks, dtype=np.int64)
            for a in range(0, len(ks), 65536):
                states = _pcg64_states(self.seed, stream, ks[a : a + 65536])
                used = 0
                starts: list[int] = []
                chunk: list[int] = []
                for state, inc in states:
                    bg.state = _state_dict(state, inc)
                    size = self._size(g)
                    n = head + size * d
                    if used + n > capacity:  # flush the chunk
                        rows = self._finish(buf, starts, chunk, out, rows, work)
                        used, starts, chunk = 0, [], []
                    g.standard_normal(out=buf[used : used + n])
                    starts.append(used)
                    chunk.append(size)
                    used += n
                    sizes[done] = size
                    done += 1
                rows = self._finish(buf, starts, chunk, out, rows, work)
        x, y = out.finish(rows)  # shrink in place (no copy of the data)
        return x, y, sizes

    def _finish(
        self,
        buf: np.ndarray,
        starts: list[int],
        chunk: list[int],
        out: SharedRows | HeapRows,
        rows: int,
        work: _Scratch,
    ) -> int:
        """Turn one chunk's raw normals into examples, appended to ``out`` at ``rows``;
        returns the new number of rows.

        Per client, as ``numpy``'s ``normal(loc, scale)`` computes from its normals z:
        u = 0 + √α·z, B = 0 + √β·z, W = u + z (or W_0 + u), b likewise, v = B + z,
        x = v + √Σ·z; labels argmax(x @ W.T + b); features x / scale as float32.
        The chunk-sized arrays are ``work``'s, written with ``out=``: the same
        operations on the same operands, without a malloc/free (and page faults) each.
        """
        if not chunk:
            return rows
        c, d = self.num_classes, self.dim
        head = self._head()
        size = np.asarray(chunk, dtype=np.int64)
        m, n = len(size), int(size.sum())
        # Clients are packed in buf: client j's head at starts[j] = j·head + (its first
        # row)·d, its rows right after. Row r of client j reads buf[(j + 1)·head + r·d ...].
        h_idx = work.h_idx[: m * head].reshape(m, head)  # buf[start[:, None] + arange(head)]
        np.add(work.arange[None, :head], np.asarray(starts, dtype=np.int64)[:, None], out=h_idx)
        h = work.h[: m * head].reshape(m, head)
        np.take(buf, h_idx, out=h)
        u = 0.0 + math.sqrt(self.alpha) * h[:, 0]
        b_mean = 0.0 + math.sqrt(self.beta) * h[:, 1]
        w = work.w[: m * c * d].reshape(m, c, d)
        b = work.b[: m * c].reshape(m, c)
        if self.shared is None:
            np.add(u[:, None, None], h[:, 2 : 2 + c * d].reshape(m, c, d), out=w)
            np.add(u[:, None], h[:, 2 + c * d : 2 + c * d + c], out=b)
        else:
            np.add(self.shared[0][None], u[:, None, None], out=w)
            np.add(self.shared[1][None], u[:, None], out=b)
        v = b_mean[:, None] + h[:, head - d :]
        owner = np.repeat(work.arange[:m], size)  # (n,): the client of each row
        idx = work.idx[: n * d].reshape(n, d)
        np.add(work.arange[: n * d].reshape(n, d), ((owner + 1) * head)[:, None], out=idx)
        z = work.z[: n * d].reshape(n, d)
        np.take(buf, idx, out=z)
        feats = work.feats[: n * d].reshape(n, d)
        np.multiply(work.cov_sd, z, out=z)
        np.take(v, owner, axis=0, out=feats)  # np.repeat(v, size, axis=0)
        np.add(feats, z, out=feats)
        logits = work.logits[: n * c].reshape(n, c)
        r = 0
        for j, s in enumerate(chunk):  # the same BLAS call per client as before
            logits[r : r + s] = feats[r : r + s] @ w[j].T
            r += s
        brep = work.brep[: n * c].reshape(n, c)
        np.take(b, owner, axis=0, out=brep)  # np.repeat(b, size, axis=0)
        np.add(logits, brep, out=logits)
        out.reserve(rows + n)  # grows in place: pages are remapped, not copied
        x, y = out.views(rows, rows + n)
        np.divide(feats, work.scale, out=feats)
        x[:] = feats
        y[:] = np.argmax(logits, axis=1)
        return rows + n


class _Scratch:
    """The chunk-sized work arrays of one :meth:`SyntheticGenerator.clients` call, reused
    by every chunk. Allocated per chunk, these blocks (above glibc's mmap/trim
    thresholds) went back to the kernel and were faulted in again each time: ~200 page
    faults a chunk, most of set-up's system time at 10^6 clients."""

    def __init__(self, capacity: int, head: int, d: int, c: int, min_size: int, beta: float):
        rows = capacity // d  # a chunk holds Σ (head + size·d) ≤ capacity normals
        clients = capacity // (head + min_size * d)
        self.arange = np.arange(max(rows * d, clients, head), dtype=np.int64)
        self.h_idx = np.empty(clients * head, np.int64)
        self.h = np.empty(clients * head)
        self.w = np.empty(clients * c * d)
        self.b = np.empty(clients * c)
        self.idx = np.empty(rows * d, np.int64)
        self.z = np.empty(rows * d)
        self.feats = np.empty(rows * d)
        self.logits = np.empty(rows * c)
        self.brep = np.empty(rows * c)
        self.cov_sd = np.sqrt(np.power(np.arange(1, d + 1, dtype=np.float64), -1.2))
        self.scale = feature_scale(d, beta)


def _state_dict(state: int, inc: int) -> Any:  # numpy's _PCG64State TypedDict
    return {
        "bit_generator": "PCG64",
        "state": {"state": state, "inc": inc},
        "has_uint32": 0,
        "uinteger": 0,
    }


def generate_synthetic(
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    dim: int = 60,
    num_classes: int = 10,
    mean_samples: int = 60,
    public_clients: int = 0,
    model: str = "shared",
    shared: bool = False,
) -> PooledData:
    """Generate Synthetic(α, β); ``groups`` holds each example's (natural) client.

    ``rng`` is used once, for the seed of the per-client streams: client k draws from
    ``SeedSequence(seed, spawn_key=(0, k))``, so clients 0..K-1 are the same whatever
    ``num_clients`` >= K is. The ``public_clients`` extra clients (groups
    ``num_clients``, ``num_clients + 1``, ...) draw from ``spawn_key=(1, j)``: the same
    generator, streams disjoint from the population's, and the same whatever the
    population is. ``shared``: the arrays are generated in shared memory
    (:meth:`SyntheticGenerator.clients`), same values.
    """
    if num_clients < 1:
        raise ValueError(f"dataset.num_clients={num_clients} must be >= 1")
    if model not in ("shared", "per_client"):
        raise ValueError(f"dataset.synthetic_model={model!r}: must be shared or per_client")
    seed = int(rng.integers(0, 2**63 - 1))
    gen = SyntheticGenerator(seed, alpha, beta, dim, num_classes, mean_samples, model)
    x, y, sizes = gen.clients(
        [(0, np.arange(num_clients)), (1, np.arange(public_clients))], shared=shared
    )
    return PooledData(
        x_train=x,
        y_train=y,
        x_test=np.zeros((0, dim), np.float32),
        y_test=np.zeros(0, np.int64),
        num_classes=num_classes,
        input_shape=(dim,),
        groups=np.repeat(np.arange(num_clients + public_clients, dtype=np.int64), sizes),
    )
