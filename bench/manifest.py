"""Scale of the manifest path: convert, split and open for training a referenced image directory.

For each size N (`--images`) a folder of N small images is generated (16x16 to 32x32, PNG and
JPEG, 10 class folders; every file's bytes distinct), then each phase runs in a fresh Python
process, so that its peak memory is its own:

- convert: `convert(src, all, in_place=True)`: every image read, hashed and fully decoded, only
  the manifest written (what the pipeline does);
- split: `split(all, train, val, fraction=0.9, in_place=True)`: two manifests over the same files;
- open for training: `read_image_directory(train)` (each file's size checked) and
  `ImageDataset(imdir, transform=None, pack=False)`, which decodes nothing yet.

Seconds are those of the call alone (not the interpreter's start or imports); the page cache is
warm (the files were just written). CPU seconds (user + system, the pool's workers included)
are the work done, which other load on the machine changes far less than the wall-clock time.
Memory: the phase process's peak resident set (VmHWM), imports included, with what it held
before the call; and the peak proportional set size (PSS, sampled every 0.5 s) of it and the
processes it started (convert's pool), where a page they share counts once in all: the memory
the phase takes. (PSS also splits a library's pages with other processes that map it, e.g.
torch's with other Python processes, so it reads lower while those run.) Microseconds per image
show whether the time grows linearly with N. Generating the images is not measured.

    python -m bench.manifest --images 20000 200000 [--work build/bench-manifest] [--keep]

The table is printed and written to build/bench/manifest-cpu.md.
"""

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from bench import publish

CLASSES = 10
PHASES = ("convert", "split", "open")
SHOWN = {"convert": "convert (in place)", "split": "split (in place, 0.9)",
         "open": "open for training"}


# --- generating the images ----------------------------------------------------------------------


def _base_images(rng: np.random.Generator, per_class: int = 6) -> list[list[tuple[str, bytes]]]:
    """Per class, a few encoded images (suffix, bytes) of different sizes and formats."""
    out = []
    for c in range(CLASSES):
        encoded = []
        for k in range(per_class):
            w, h = (int(s) for s in rng.integers(16, 33, 2))
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8) // 2 + 12 * c
            buf = io.BytesIO()
            fmt = ("PNG", ".png") if k % 2 else ("JPEG", ".jpg")
            Image.fromarray(pixels).save(buf, fmt[0])
            encoded.append((fmt[1], buf.getvalue()))
        out.append(encoded)
    return out


def _unique(suffix: str, data: bytes, i: int) -> bytes:
    """`data` with a comment holding `i` (a JPEG COM segment, a PNG tEXt chunk): a valid image
    whose bytes, and sha256, no other file shares."""
    note = f"kfvision bench image {i}".encode()
    if suffix == ".jpg":  # right after the start-of-image marker
        return data[:2] + b"\xff\xfe" + (len(note) + 2).to_bytes(2, "big") + note + data[2:]
    chunk = b"tEXt" + b"Comment\0" + note  # after the signature (8 bytes) and IHDR (25)
    return (data[:33] + (len(chunk) - 4).to_bytes(4, "big") + chunk
            + zlib.crc32(chunk).to_bytes(4, "big") + data[33:])


def generate(src: Path, n: int, seed: int = 0) -> None:
    """N images under src/class_XX/, reused when a complete set of that size is there."""
    done = src / ".complete"  # a hidden file: convert ignores it
    if done.is_file() and done.read_text() == str(n):
        print(f"reusing the {n} images in {src}", flush=True)
        return
    shutil.rmtree(src, ignore_errors=True)
    bases = _base_images(np.random.default_rng(seed))
    for c in range(CLASSES):
        (src / f"class_{c:02d}").mkdir(parents=True)
    start, step = time.perf_counter(), max(n // 10, 1)
    for i in range(n):
        c = i % CLASSES
        suffix, data = bases[c][(i // CLASSES) % len(bases[c])]
        with open(src / f"class_{c:02d}" / f"img_{i:07d}{suffix}", "wb") as f:
            f.write(_unique(suffix, data, i))
        if (i + 1) % step == 0 or i + 1 == n:
            print(f"  generated {i + 1}/{n} images ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    done.write_text(str(n))


# --- one phase, in its own process --------------------------------------------------------------


class TreePss:
    """The peak PSS of this process and its children, sampled in a thread while in the block.

    Reading a process's smaps_rollup takes ~20 ms once torch is imported: samples are 0.5 s
    apart, and the CPU time they take (`cpu_seconds`) is left out of the phase's."""

    def __init__(self, every: float = 0.5):
        self.every, self.peak_mib, self.cpu_seconds = every, 0.0, 0.0
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self):
        while True:
            self.peak_mib = max(self.peak_mib, sum(map(_pss_mib, _tree())))
            self.cpu_seconds = time.thread_time()
            if self._stop.wait(self.every):
                return


def _tree() -> list[int]:
    pids = [os.getpid()]
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            pids += map(int, Path(f"/proc/self/task/{task}/children").read_text().split())
    return pids


def _pss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass  # a worker that ended meanwhile
    return 0.0


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of its children that ended (the pool's)."""
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _peak_mib() -> float:
    """This process's peak resident set (VmHWM): unlike ru_maxrss, not inherited through the
    fork and exec that started it from a larger parent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB


def run_phase(phase: str, work: Path) -> dict:
    """Run `phase` on the directories under `work` here; its seconds and memory."""
    from kfvision.trainer.data.convert import convert
    from kfvision.trainer.data.imagedir import read_image_directory
    from kfvision.trainer.data.split import split

    if phase == "open":
        from kfvision.trainer.data.datasets import ImageDataset
    before, cpu = _peak_mib(), _cpu_seconds()
    with TreePss() as pss:
        start = time.perf_counter()
        if phase == "convert":
            images = convert(work / "src", work / "all", in_place=True, progress=False).images
        elif phase == "split":
            images = sum(sum(c.values()) for c in split(
                work / "all", work / "train", work / "val", fraction=0.9, in_place=True).values())
        else:
            images = len(ImageDataset(read_image_directory(work / "train"), None, pack=False))
        seconds = time.perf_counter() - start
    return {"phase": phase, "images": images, "seconds": seconds,
            "cpu_seconds": _cpu_seconds() - cpu - pss.cpu_seconds,
            "imports_mib": before, "peak_mib": _peak_mib(), "pss_mib": pss.peak_mib}


def measure(n: int, work: Path) -> list[dict]:
    """Generate N images under `work` and run every phase on them, each in a fresh process."""
    generate(work / "src", n)
    for d in ("all", "train", "val"):
        shutil.rmtree(work / d, ignore_errors=True)
    rows = []
    for phase in PHASES:
        done = subprocess.run([sys.executable, "-m", "bench.manifest", "--phase", phase,
                               "--work", str(work)], check=True, stdout=subprocess.PIPE, text=True)
        row = json.loads(done.stdout.splitlines()[-1])
        row["n"] = n
        print(f"  {SHOWN[phase]}: {row['seconds']:.1f} s ({row['cpu_seconds']:.1f} CPU-s), "
              f"peak RSS {row['peak_mib']:.0f} MiB, "
              f"PSS {row['pss_mib']:.0f} MiB", flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| phase | images | seconds | us per image | CPU seconds (with its pool) | "
             "CPU us per image | peak RSS MiB (before the call) | peak PSS MiB, with its pool |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {SHOWN[r['phase']]} | {r['n']:,} | {r['seconds']:.2f} | "
                     f"{r['seconds'] / r['n'] * 1e6:.0f} | {r['cpu_seconds']:.2f} | "
                     f"{r['cpu_seconds'] / r['n'] * 1e6:.0f} | {r['peak_mib']:.0f} "
                     f"({r['imports_mib']:.0f}) | {r['pss_mib']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--images", type=int, nargs="+", default=[20000, 200000],
                   help="the sizes N to measure (default: 20000 200000)")
    p.add_argument("--work", type=Path, default=Path("build/bench-manifest"),
                   help="where the images and image directories are made (default: "
                        "build/bench-manifest)")
    p.add_argument("--keep", action="store_true",
                   help="keep the work folder (the generated images are then reused)")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # one phase's process
    a = p.parse_args(argv)
    if a.phase:
        print(json.dumps(run_phase(a.phase, a.work)))
        return 0
    rows = []
    try:
        for n in a.images:
            print(f"{n} images:", flush=True)
            rows += measure(n, a.work / str(n))
    finally:
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
    out = (table(rows) + f"\n\nPython {sys.version.split()[0]}, "
           f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB.")
    publish(out, "manifest-cpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
