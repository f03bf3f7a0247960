"""A reproducible ImageNet-like JPEG image directory, generated (no download).

Images are about 500x375 (sizes and orientation vary), JPEG quality 90, with ImageNet-like file
sizes (tens to a few hundred KB): a smooth random colour field, class-specific shapes and a
texture layer, so the decoder does realistic work and a model can learn the classes.
`--photo` makes 12-megapixel images instead (4032x3024, a phone camera's; 3-5 MB each), the same
content drawn at that size.

    python -m bench.jpegset OUT [--images 2000 --classes 10 --seed 0] [--photo]
"""

import argparse
import io
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from kfvision.trainer.data.convert import convert

PHOTO = (4032, 3024)


def _image(rng: np.random.Generator, label: int, n_classes: int,
           size: tuple | None = None) -> Image.Image:
    w, h = size or (int(rng.integers(400, 601)), int(rng.integers(300, 451)))
    if rng.random() < 0.25:
        w, h = h, w  # some portrait images
    zoom = w / 500  # shapes scale with the image
    base = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    hue = np.array([255 * (label / n_classes), 255 * (1 - label / n_classes), 128])
    field = Image.fromarray(((base * 0.6) + hue * 0.4).astype(np.uint8)).resize(
        (w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(field)
    for _ in range(3 + label % 4):  # the class shows in its shapes' kind, count and colour
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        r = int(rng.integers(20, 120) * zoom)
        colour = tuple(int(c) for c in (rng.integers(0, 256, 3) // 2 + hue // 2))
        box = (x - r, y - r, x + r, y + r)
        (draw.ellipse if label % 2 else draw.rectangle)(box, fill=colour)
    texture = rng.normal(0, 18 / zoom**0.5, (h, w, 1)).astype(np.float32)  # finer when larger
    img = np.asarray(field.filter(ImageFilter.GaussianBlur(zoom)), dtype=np.float32) + texture
    return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def _write(job) -> None:
    """Image i of the set: its own generator, seeded by (seed, i), so that the images are the
    same whichever process makes them."""
    out, i, classes, seed, size = job
    label = i % classes
    folder = out / "raw" / f"class_{label:02d}"
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    _image(np.random.default_rng([seed, i]), label, classes, size).save(buf, "JPEG", quality=90)
    (folder / f"img_{i:05d}.jpg").write_bytes(buf.getvalue())


def make_jpeg_set(out, images: int = 2000, classes: int = 10, seed: int = 0,
                  size: tuple | None = None) -> Path:
    """Write OUT/raw/<class>/*.jpg and convert it into the image directory OUT/data.

    `size`: every image that big (e.g. PHOTO) instead of about 500x375. Generated on every usable
    core (5,000 images took 2 minutes on one: on a lent GPU machine, device time).
    """
    out = Path(out)
    if (out / "data").exists():
        return out / "data"
    jobs = [(out, i, classes, seed, size) for i in range(images)]
    processes = min(len(os.sched_getaffinity(0)), max(1, images // 64))
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            list(pool.map(_write, jobs, chunksize=16))
    else:
        for job in jobs:
            _write(job)
    convert(out / "raw", out / "data", progress=False)
    return out / "data"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--photo", action="store_true", help="12-megapixel images (4032x3024)")
    a = p.parse_args(argv)
    data = make_jpeg_set(a.out, a.images, a.classes, a.seed, PHOTO if a.photo else None)
    sizes = [f.stat().st_size for f in (Path(a.out) / "raw").rglob("*.jpg")]
    print(f"{data}: {len(sizes)} JPEGs, median {np.median(sizes) / 1024:.0f} KB, "
          f"total {sum(sizes) / 2**20:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
