"""Per-client state that persists across rounds and never leaves its worker.

Used for DP²-FedSAM's personal heads. Clients are assigned to workers by
``client % num_workers``, so a client's state is always where the client is trained.
State is held in memory, or — for large populations — as one ``.npy`` file per
client under a directory (``algo.client_state=disk``). :meth:`snapshot` returns a
checkpointable copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.base.atomic import atomic_write


class ClientStateStore:
    """``client id -> float32 vector``, in memory or on disk."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = Path(directory) if directory else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._memory: dict[int, torch.Tensor] = {}

    def _path(self, client: int) -> Path:
        assert self.directory is not None
        return self.directory / f"client-{client}.npy"

    def get(self, client: int) -> torch.Tensor | None:
        if self.directory is None:
            return self._memory.get(client)
        path = self._path(client)
        return torch.from_numpy(np.load(path)) if path.exists() else None

    def put(self, client: int, value: torch.Tensor) -> None:
        if self.directory is None:
            self._memory[client] = value.detach().clone()
            return
        with atomic_write(self._path(client), suffix=".npy") as tmp:
            np.save(tmp, value.detach().cpu().numpy())

    def snapshot(self) -> dict[int, np.ndarray]:
        if self.directory is None:
            return {c: v.numpy().copy() for c, v in self._memory.items()}
        out = {}
        for p in sorted(self.directory.glob("client-*.npy")):
            out[int(p.stem.split("-")[1])] = np.load(p)
        return out

    def restore(self, state: dict[int, np.ndarray]) -> None:
        """Replace the whole store by ``state`` (clients absent from it have no state)."""
        self._memory = {}
        if self.directory is not None:
            for p in self.directory.glob("client-*.npy"):
                p.unlink()
        for c, v in state.items():
            self.put(int(c), torch.from_numpy(np.asarray(v, dtype=np.float32)))
