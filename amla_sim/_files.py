"""Files written so that a kill, a full disk or a second writer never leaves a half-written one behind."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["atomic_write", "atomic_savez", "write_all"]


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through a private temporary file in the same folder, fsync'd, then renamed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        write_all(fd, data.encode() if isinstance(data, str) else data, path)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_all(fd: int, data: bytes, path: Path) -> None:
    """os.write until every byte is written (a short write is continued, never ignored)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - os.write raises rather than return 0 on a regular file
            raise OSError(f"{path}: write made no progress")
        view = view[n:]


def atomic_savez(path: str | Path, **arrays: np.ndarray) -> None:
    """``np.savez_compressed`` through :func:`atomic_write`: the file is whole, or it is not there."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write(Path(path), buf.getvalue())
