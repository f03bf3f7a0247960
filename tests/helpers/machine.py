"""The machine as a test wants it: another CPU, a disk that fills up, a clock that only moves when
slept on."""

import errno
import shutil
from pathlib import Path

FILLER = "filler.bin"


def fake_cpu(monkeypatch, flags, model: str = "a CPU") -> None:
    """Make the running CPU (kfvision.trainer.fastpath.cpu_info, what every speed choice reads)
    `model` with `flags`, its kernels uncapped (no ONEDNN_MAX_CPU_ISA)."""
    monkeypatch.setattr("kfvision.trainer.fastpath.cpu_info", lambda: (model, frozenset(flags)))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


def fill(folder: Path, leave: int) -> None:
    """Fill the volume of `folder` until `leave` bytes are free (a file `filler.bin`)."""
    todo = max(shutil.disk_usage(folder).free - leave, 0)
    chunk = b"\0" * (1 << 20)
    try:
        with open(folder / FILLER, "ab") as f:
            while todo > 0:
                todo -= f.write(chunk[:todo])
    except OSError as e:  # full a little early (blocks for the file itself): full is the point
        if e.errno != errno.ENOSPC:
            raise


def free_up(folder: Path) -> None:
    (folder / FILLER).unlink()


class FakeClock:
    """A clock that moves only when slept on: `clock()` is the time, `clock.sleep(s)` moves it.
    Waits of any length take no real time (pass `sleep=clock.sleep, clock=clock`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
