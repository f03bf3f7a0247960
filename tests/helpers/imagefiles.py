"""Image files, class trees and archives made at test time (shared by the data tests)."""

import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

RNG = np.random.default_rng(0)


def image_bytes(fmt="PNG", mode="RGB", size=(24, 16)) -> bytes:
    """A small real image of `mode` encoded as `fmt`."""
    rgb = Image.fromarray(RNG.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8), "RGB")
    if mode == "I;16":
        im = Image.fromarray(RNG.integers(0, 65535, (size[1], size[0]), dtype=np.uint16))
    elif mode == "P":
        im = rgb.convert("P", palette=Image.Palette.ADAPTIVE)
    else:
        im = rgb.convert(mode)
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def class_tree(root: Path, per_class=3, classes=("cat", "dog")) -> Path:
    for c in classes:
        for i in range(per_class):
            write(root / c / f"{c}{i}.png", image_bytes())
    return root


def leftovers(parent: Path) -> list:
    """Staging folders convert may have left behind (it must leave none)."""
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


def make_archive(src: Path, path: Path) -> Path:
    """Archive every file under src (relative names) as path's type says."""
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if path.name.lower().endswith(".zip"):
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for f in files:
                zf.write(f, f.relative_to(src).as_posix())
        return path
    mode = {".tar": "w", ".gz": "w:gz", ".tgz": "w:gz", ".bz2": "w:bz2"}[path.suffix.lower()]
    with tarfile.open(path, mode) as tf:
        for f in files:
            tf.add(f, f.relative_to(src).as_posix())
    return path
