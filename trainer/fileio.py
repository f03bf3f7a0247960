"""Atomic file writes: readers see the old file or the whole new one, whenever the writer dies.

Every output kfvision writes (manifests, packs, weights, metrics, checkpoints, reports) goes
through here. A leaf: no torch, nothing of ours, so torch-free commands (evaluate, split,
convert) can use it.
"""

import json
import os
import tempfile
from pathlib import Path


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the node only once the folder is
    finally:
        os.close(fd)


def atomic_write(path, write) -> None:
    """Call write(file) on a temporary file in the same folder, fsync, rename, fsync the folder:
    readers see the old file or the whole new one, whenever the process dies."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write bytes atomically (see atomic_write)."""
    atomic_write(path, lambda f: f.write(data))


def atomic_write_json(path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())
