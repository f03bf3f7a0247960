"""The folders a script writes beside itself, at the end of a job: those given with `--collect`
are copied into ./outputs (so they travel with the outputs: `--output-uri`, `job download`),
the others are named with their size, with how to collect them, since they stay in the pod.

    before = entries(cwd)                      # before the script runs
    kept = collect(cwd, ("vit-tiny-shapes",), outputs, say)
    left = made(cwd, before, outputs)          # [("runs", 4, 1_400_000), ...]
    say_left(left, say)  # "runs/: 4 files, 1.4 MB, left in the pod; --collect runs ..."
"""

import shutil
from pathlib import Path, PurePosixPath

from kfvision.pipelines.script.snapshot import InvalidSourceError

SHOWN = 5  # folders named one by one


def check_collect(folder: str) -> str:
    """A --collect value: a relative folder, no '..'.

    Raises:
        InvalidSourceError: it is absolute or leaves the working folder.
    """
    parts = PurePosixPath(folder.strip()).parts
    if not parts or parts[0] == "/" or ".." in parts:
        raise InvalidSourceError(f"--collect {folder!r}: give a folder relative to where the "
                                 "script runs (its --output_dir, say), without '..'.")
    return "/".join(parts)


def entries(cwd: Path) -> set:
    """The names in the script's working folder now."""
    return {p.name for p in Path(cwd).iterdir()}


def _size(folder: Path) -> tuple:
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    return len(files), sum(p.stat().st_size for p in files)


def human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def collect(cwd: Path, folders, outputs: Path, say) -> list:
    """Copy each of `folders` (relative to `cwd`) into `outputs`; the ones copied."""
    kept = []
    for folder in folders:
        found = Path(cwd) / folder
        if not found.is_dir():
            say(f"--collect {folder}: the script wrote no such folder in {cwd}")
            continue
        shutil.copytree(found, Path(outputs) / folder, dirs_exist_ok=True)
        files, size = _size(found)
        say(f"collected {folder}/ into outputs/{folder}/ ({files} files, {human(size)})")
        kept.append(folder)
    return kept


def made(cwd: Path, before: set, outputs: Path, collected=()) -> list:
    """[(name, files, bytes)] of the folders in `cwd` that were not there `before` and are not
    collected (the outputs folder and `collected` left out), biggest first."""
    found = []
    for p in Path(cwd).iterdir():
        if p.name in before or p.name in collected or not p.is_dir() or p.is_symlink() or \
                p.resolve() == Path(outputs).resolve():
            continue
        found.append((p.name, *_size(p)))
    return sorted(found, key=lambda x: (-x[2], x[0]))


def say_left(left: list, say) -> None:
    """Name the folders left in the pod, and how to keep them."""
    for name, files, size in left[:SHOWN]:
        say(f"{name}/: {files} files, {human(size)}, left in the pod (not collected)")
    if len(left) > SHOWN:
        say(f"... and {len(left) - SHOWN} more folder(s) left in the pod")
    if left:
        name = left[0][0]
        say(f"to keep them, render with --collect {name} (repeatable), or have the script "
            f"write under ./outputs (for a Trainer: --output_dir outputs/{name})")
