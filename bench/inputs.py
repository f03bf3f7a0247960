"""Input-pipeline throughput: decoded + augmented training crops per second, one process.

kfvision's training dataset (uint8 crops; normalisation on whole batches, counted here) against
torchvision's usual `ImageFolder` + PIL `RandomResizedCrop` / flip / `ToTensor` / `Normalize`, on
the generated JPEG set, alternating, `--rounds` times. No DataLoader workers: this is the work one
worker process does. The packed row reads a copy of the set with a pack (`kfvision pack`: raw
pixels, no decoding), served from the page cache here.

    python -m bench.inputs [--images 1000 --size 224 --rounds 3]
"""

import argparse
import os
import shutil
import statistics
import sys
import time

import torch
import torchvision
from torchvision import transforms

from bench.jpegset import make_jpeg_set
from trainer.data import ImageDataset, Normalizer, train_transform
from trainer.imagedir import read_image_directory
from trainer.pack import write_pack

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def baseline_dataset(raw, size):
    tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    return torchvision.datasets.ImageFolder(str(raw), transform=tf)


def rate(dataset, n: int, batch: int = 16, normalize=None) -> float:
    """Items per second over the first n items, batched and (optionally) normalised."""
    start = time.perf_counter()
    for first in range(0, n, batch):
        items = [dataset[i][0] for i in range(first, min(first + batch, n))]
        x = torch.stack(items)
        if normalize is not None:
            normalize(x)
    return n / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="build/bench/jpeg")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # one data-loading process = one core
    data = make_jpeg_set(a.out, images=a.images)
    imdir = read_image_directory(data)
    packed = data.parent / "packed"  # a copy: other benchmarks read `data` without a pack
    if not packed.exists():
        shutil.rmtree(packed.with_name("packed.tmp"), ignore_errors=True)
        os.replace(shutil.copytree(data, packed.with_name("packed.tmp")), packed)
    write_pack(packed, progress=False)  # nothing written when it is up to date
    datasets = {
        "torchvision ImageFolder + PIL transforms": (baseline_dataset(f"{a.out}/raw", a.size),
                                                     None),
        "kfvision, streaming (decode every epoch)": (
            ImageDataset(imdir, train_transform("standard", a.size), pack=False), Normalizer()),
        "kfvision, packed (convert --pack)": (
            ImageDataset(read_image_directory(packed), train_transform("standard", a.size)),
            Normalizer()),
        "kfvision, cached (data fits in memory: epochs after the first)": (
            ImageDataset(imdir, train_transform("standard", a.size), cache=True), Normalizer()),
    }
    n = min(a.images, len(imdir.images))
    results = {name: [] for name in datasets}
    for _ in range(a.rounds):
        for name, (ds, norm) in datasets.items():
            torch.manual_seed(0)
            results[name].append(rate(ds, n, normalize=norm))
    rows = [f"| input pipeline ({a.size}px training crops, 1 core, {n} JPEGs) | crops/s | ratio |",
            "|---|---|---|"]
    base = statistics.median(next(iter(results.values())))
    for name, rates in results.items():
        r = statistics.median(rates)
        rows.append(f"| {name} | {r:.0f} | {r / base:.2f}x |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
