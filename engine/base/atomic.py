"""Atomic file writes, the one way dpfl replaces a file: write a temporary file
beside it, then ``os.replace`` it into place, so a reader (or a run resumed after a
crash) sees the old file or the new one, never a partial one.

A leaf room (it imports nothing of dpfl), so that every room may use it: the results
writer, the checkpoint, the client-state store, the privacy caches and Tune's files.

    with atomic_write(out / "config.json") as tmp:
        tmp.write_text(text)

No ``fsync``: the files are replaced atomically against a crash of the process, not
against a power cut of the machine (as dpfl has always written them).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_write", "temporary_path", "writing"]


def temporary_path(path: str | os.PathLike[str], *, suffix: str = "", unique: bool = False) -> Path:
    """The temporary file :func:`atomic_write` writes ``path`` through: hidden, in the
    same folder (so ``os.replace`` never crosses file systems), ``.NAME.tmp`` plus
    ``suffix`` (``".npy"``: ``np.save`` adds none); with ``unique``, ``.NAME.PID.tmp``,
    for files that concurrent processes may write at the same time (shared caches)."""
    p = Path(path)
    pid = f".{os.getpid()}" if unique else ""
    return p.with_name(f".{p.name}{pid}.tmp{suffix}")


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], *, suffix: str = "", unique: bool = False
) -> Iterator[Path]:
    """Yield the temporary path (:func:`temporary_path`) to write ``path``'s new
    contents to; when the block ends, ``os.replace`` moves it to ``path``.

    If the block raises, the temporary file is removed and ``path`` is left as it was.
    An OSError (a full disk, a read-only or forbidden folder), in the block or in the
    replace, is raised again as one OSError naming ``path`` (see :func:`writing`).
    The folder must exist.
    """
    target = Path(path)
    tmp = temporary_path(target, suffix=suffix, unique=unique)
    with writing(target, tmp):
        try:
            yield tmp
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Write ``path`` (through ``tmp``, then ``os.replace``): an OSError (a full disk,
    a read-only or forbidden folder) is raised again as an OSError naming ``path``,
    with its errno (pyarrow's errors carry it only in their text), after the partial
    ``tmp`` is removed; the previous ``path`` is left as it was."""
    try:
        yield
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        code = e.errno
        if code is None:
            found = re.search(r"\[Errno (\d+)\]", str(e)) or re.search(
                r"errno[ =:]+(\d+)", str(e), re.IGNORECASE
            )
            code = int(found.group(1)) if found else None
        reason = os.strerror(code) if code else (str(e).splitlines()[0] if str(e) else "error")
        err = OSError(code or _errno.EIO, reason, str(path))
        raise err from e
