"""Image directories whose files arrive while training reads them: the trainer's side of a node
fetching its data from object storage (pipelines/jobs/storenode.py fetches; this module waits).

A referenced manifest (version 2) may name an *arrival folder*, `"arrival": "/scratch/arrival"`.
Its images are then written under `images_root` by another process while the ranks read them,
each renamed into place only when whole and checked, so a file that exists is complete. A
reader that finds its file missing waits for it here; the fetcher tells the readers nothing but
through files in the arrival folder, so the trainer needs no storage client:

    arrival/failed          the fetcher stopped: its error line (the reader raises it)
    arrival/alive           touched by the fetcher as it goes (a stall is judged by its time)
    arrival/epoch-<rank>    written by each rank as it starts an epoch (the fetcher's cue to
                            fetch that epoch's images: `begin_epoch`)
    arrival/want-<pid>      a file a reader has been waiting for (the fetcher fetches it next)

The fetcher predicts the sampler's order, but nothing here depends on that being right: a
missing file is waited for and asked for by name.
"""

import os
import time
from pathlib import Path

from kfvision.trainer.errors import DataArrivalError

FAILED = "failed"
ALIVE = "alive"
STALL_S = float(os.environ.get("KFVISION_ARRIVAL_STALL_S", "600"))  # no sign of the fetcher


def epoch_file(arrival: Path, rank: int) -> Path:
    return Path(arrival) / f"epoch-{rank}"


def begin_epoch(arrival: Path, rank: int, epoch: int) -> None:
    """Tell the node's fetcher that `rank` now reads `epoch`'s images."""
    path = epoch_file(arrival, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(str(epoch))
    os.replace(tmp, path)


def read_epochs(arrival: Path) -> dict:
    """{rank: epoch} as the ranks of this node wrote them."""
    out = {}
    for p in Path(arrival).glob("epoch-*"):
        try:
            out[int(p.name[6:])] = int(p.read_text() or 0)
        except (OSError, ValueError):
            continue  # being replaced: read again next time
    return out


def wait_for(path: Path, arrival: Path, shown: str) -> None:
    """Return once `path` exists; ask the fetcher for it if it is long in coming.

    Raises:
        DataArrivalError: the fetcher failed (its message), or showed no sign of life for
            KFVISION_ARRIVAL_STALL_S seconds.
    """
    if path.exists():
        return
    arrival = Path(arrival)
    want = arrival / f"want-{os.getpid()}"
    delay, asked = 0.001, False
    try:
        while not path.exists():
            failed = arrival / FAILED
            if failed.exists():
                raise DataArrivalError(f"{shown} never arrived: the node's fetcher stopped "
                                       f"({failed.read_text().strip()}).")
            if delay >= 0.05 and not asked:  # long in coming: name it, it is fetched next
                want.write_text(str(path))
                asked = True
            try:
                quiet = time.time() - (arrival / ALIVE).stat().st_mtime
            except FileNotFoundError:
                quiet = 0.0
            if quiet > STALL_S:
                raise DataArrivalError(
                    f"waited for {shown}, but the node's fetcher has shown no sign of life for "
                    f"{quiet:.0f} s (its log says why; KFVISION_ARRIVAL_STALL_S sets the wait).")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    finally:
        if asked:
            want.unlink(missing_ok=True)
