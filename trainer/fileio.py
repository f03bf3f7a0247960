"""Atomic file writes: readers see the old file or the whole new one, whenever the writer dies.
And one mapping of a full disk onto a named error, for every write kfvision makes.

Every output kfvision writes (manifests, packs, weights, metrics, checkpoints, reports) goes
through here; writes that stream elsewhere (convert's copies, score's table, an export, a fetch)
wrap themselves in `disk_errors`. Nearly a leaf: no torch, nothing of ours but
kfvision.trainer.errors (itself a leaf), so torch-free commands (evaluate, split, convert) can use
it.
"""

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

from kfvision.trainer.errors import OutputError

FULL = (errno.ENOSPC, errno.EDQUOT)
# torch's zip writer (PytorchStreamWriter) reports a failed write without its errno
_FULL_MARKERS = ("no space left on device", "disk quota exceeded", "file write failed")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _full_errno(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT, when `exc` or what caused it is a full volume; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def _free(path: Path) -> int | None:
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(folder).free
    return None


def full_disk_error(exc: BaseException, path, need: int | None = None) -> OutputError | None:
    """The OutputError of `exc` when it is a write that found the volume holding `path` full (or
    over quota), naming the path, the space free and `need` (bytes, when known); else None."""
    path = Path(path)
    code = _full_errno(exc)
    free = _free(path)
    if code is None and not isinstance(exc, OSError):
        text = str(exc).lower()
        if any(m in text for m in _FULL_MARKERS) and free is not None and free < 1 << 20:
            code = errno.ENOSPC  # torch says only "file write failed"; the volume says why
    if code is None:
        return None
    room = "" if free is None else f"{_mib(free)} free"
    if need:
        room += f"{', ' if room else ''}about {_mib(need)} needed"
    return OutputError(
        f"the volume holding {path} is full ({os.strerror(code)}){': ' + room if room else ''}. "
        "Free some space or write somewhere else, then run again: nothing half-written was left "
        "under that name, and what was there before is intact.")


@contextlib.contextmanager
def disk_errors(path, need: int | None = None):
    """Turn a full volume met inside the block (while writing `path`) into OutputError."""
    try:
        yield
    except OutputError:
        raise
    except Exception as e:
        err = full_disk_error(e, path, need)
        if err is None:
            raise
        raise err from e


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the node only once the folder is
    finally:
        os.close(fd)


def atomic_write(path, write, need: int | None = None) -> None:
    """Call write(file) on a temporary file in the same folder, fsync, rename, fsync the folder:
    readers see the old file or the whole new one, whenever the process dies. A full volume is
    an OutputError naming `path` (and `need`, the bytes it takes, when given).
    """
    path = Path(path)
    with disk_errors(path, need):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            # decided while the half-written file still fills the volume, then removed
            err = full_disk_error(e, path, need) if isinstance(e, Exception) else None
            Path(tmp).unlink(missing_ok=True)
            if err is not None:
                raise err from e
            raise
        _fsync_dir(path.parent)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write bytes atomically (see atomic_write)."""
    atomic_write(path, lambda f: f.write(data), len(data))


def atomic_write_json(path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())
