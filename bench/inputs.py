"""Input-pipeline throughput: decoded + augmented training crops per second, one process.

kfvision's training dataset (uint8 crops; normalisation on whole batches, counted here) against
torchvision's usual `ImageFolder` + PIL `RandomResizedCrop` / flip / `ToTensor` / `Normalize`, on
two generated JPEG sets: ImageNet-like images (about 500x375) and 12-megapixel photos (4032x3024,
a phone camera's). No DataLoader workers: this is the work one worker process does. Each round
runs every contender once, back to back; a ratio is taken within each round (this machine's speed
drifts over minutes), and the table gives its median and range over rounds.

- streaming: every image decoded every epoch (data too big for memory, no pack); JPEGs are
  decoded at reduced size where the crop allows (`--dct-scaling`, on by default);
- packed: a copy of the set with a pack (`kfvision pack`: raw pixels, no decoding), served from
  the page cache here;
- cached: decoded once, kept in memory (the default when the data fits): the epochs after the
  first;
- whole run: the default for the set as `kfvision train` picks it, over 5 epochs (the default
  number) including the first, which decodes; for the photos, from a cache at full size and
  from one kept at the scale every crop allows (`--dct-scaling`).

    python -m bench.inputs [--images 1000 --photos 24 --size 224 --rounds 3]
"""

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.draws import Sample
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.pack import write_pack
from kfvision.trainer.data.transforms import Normalizer, train_transform
from torchvision import transforms

from bench import BENCH, publish
from bench.jpegset import PHOTO, make_jpeg_set

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
EPOCHS = 5  # kfvision train's default


def baseline_dataset(raw, size):
    tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    return torchvision.datasets.ImageFolder(str(raw), transform=tf)


def rate(dataset, n: int, batch: int = 16, normalize=None) -> float:
    """Items per second over the first n items, batched and (optionally) normalised; kfvision's
    datasets indexed as the trainer's sampler indexes them (a `Sample`: each image's crop drawn
    from its own keyed stream, trainer/data/draws.py)."""
    keyed = isinstance(dataset, ImageDataset)
    start = time.perf_counter()
    for first in range(0, n, batch):
        items = [dataset[Sample(i, 1, 1) if keyed else i][0]
                 for i in range(first, min(first + batch, n))]
        x = torch.stack(items)
        if normalize is not None:
            normalize(x)
    return n / (time.perf_counter() - start)


def whole_run_rate(make_dataset, n: int, epochs: int = EPOCHS) -> float:
    """Crops per second over `epochs` epochs of n images, counting the dataset's set-up (for
    the cache: decoding every image once)."""
    start = time.perf_counter()
    ds = make_dataset()
    for _ in range(epochs):
        rate(ds, n, normalize=Normalizer())
    return epochs * n / (time.perf_counter() - start)


def packed_copy(data: Path) -> Path:
    """A copy of the image directory with an up-to-date pack (other benchmarks read `data`)."""
    packed = data.parent / "packed"
    if not packed.exists():
        shutil.rmtree(packed.with_name("packed.tmp"), ignore_errors=True)
        os.replace(shutil.copytree(data, packed.with_name("packed.tmp")), packed)
    write_pack(packed, progress=False)  # nothing written when it is up to date
    return packed


def measure(contenders: dict, n: int, rounds: int) -> dict:
    """name -> per-round rates; each contender is a function of n giving crops/s."""
    results = {name: [] for name in contenders}
    for r in range(rounds):
        for name, run in contenders.items():
            torch.manual_seed(r)
            results[name].append(run(n))
        print(f"round {r + 1}: " + ", ".join(f"{v[-1]:.0f}" for v in results.values())
              + " crops/s (the table's rows, in order)", flush=True)
    return results


def table(title: str, results: dict) -> str:
    rows = [f"| {title} | crops/s | ratio (range) |", "|---|---|---|"]
    base = next(iter(results.values()))
    for name, rates in results.items():
        ratios = sorted(x / b for x, b in zip(rates, base))
        spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
        rows.append(f"| {name} | {statistics.median(rates):.0f} | "
                    f"{statistics.median(ratios):.2f}x{spread} |")
    return "\n".join(rows)


def imagenet_like(a) -> str:
    data = make_jpeg_set(BENCH / "jpeg", images=a.images)
    imdir = read_image_directory(data)
    packed = read_image_directory(packed_copy(data))
    n = min(a.images, len(imdir.images))
    crop = train_transform("standard", a.size)
    norm = Normalizer()
    base = baseline_dataset(data.parent / "raw", a.size)
    streaming = ImageDataset(imdir, crop, pack=False, dct_scaling=True)
    pack = ImageDataset(packed, crop)
    cached = ImageDataset(imdir, crop, cache=True)
    contenders = {
        "torchvision ImageFolder + PIL transforms": lambda n: rate(base, n),
        "kfvision, streaming (decode every epoch)": lambda n: rate(streaming, n, normalize=norm),
        "kfvision, packed (`kfvision pack`)": lambda n: rate(pack, n, normalize=norm),
        "kfvision, cached (epochs after the first)": lambda n: rate(cached, n, normalize=norm),
        f"kfvision, whole run as `kfvision train` does it (cache; {EPOCHS} epochs, "
        "the first decodes)": lambda n: whole_run_rate(
            lambda: ImageDataset(imdir, crop, cache=True), n),
    }
    return table(f"{a.size}px training crops, 1 core, {n} JPEGs of about 500x375",
                 measure(contenders, n, a.rounds))


def photos(a) -> str:
    data = make_jpeg_set(BENCH / f"photo{a.photos}", images=a.photos, size=PHOTO)
    imdir = read_image_directory(data)
    n = len(imdir.images)
    crop = train_transform("standard", a.size)
    norm = Normalizer()
    base = baseline_dataset(data.parent / "raw", a.size)
    full = ImageDataset(imdir, crop, pack=False, dct_scaling=False)
    scaled = ImageDataset(imdir, crop, pack=False, dct_scaling=True)
    contenders = {
        "torchvision ImageFolder + PIL transforms": lambda n: rate(base, n),
        "kfvision, streaming, full-size decode (`--dct-scaling off`)":
            lambda n: rate(full, n, normalize=norm),
        "kfvision, streaming, decoded at the crop's scale (default)":
            lambda n: rate(scaled, n, normalize=norm),
        f"kfvision, whole run from the cache, full size (`--dct-scaling off`; {EPOCHS} epochs, "
        "the first decodes)": lambda n: whole_run_rate(
            lambda: ImageDataset(imdir, crop, cache=True, pack=False, dct_scaling=False), n),
        f"kfvision, whole run from the cache kept at the scale every crop allows (default; "
        f"{EPOCHS} epochs)": lambda n: whole_run_rate(
            lambda: ImageDataset(imdir, crop, cache=True, pack=False, dct_scaling=True), n),
    }
    return table(f"{a.size}px training crops, 1 core, {n} photos of {PHOTO[0]}x{PHOTO[1]}",
                 measure(contenders, n, a.rounds))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--images", type=int, default=1000, help="ImageNet-like JPEGs (0: skip)")
    p.add_argument("--photos", type=int, default=24, help="12-megapixel JPEGs (0: skip)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # one data-loading process = one core
    tables = [f(a) for f, count in ((imagenet_like, a.images), (photos, a.photos)) if count]
    out = "\n\n".join(tables) + (
        f"\n\nMedians over {a.rounds} rounds; a ratio is taken within each round. "
        f"torch {torch.__version__}, torchvision {torchvision.__version__}.")
    publish(out, "inputs-cpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
