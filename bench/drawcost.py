"""The cost of keyed draws: cached training crops per second with each image's crop and flip drawn
from its own keyed stream (trainer/data/draws.py, what the trainer does), against torchvision's
`RandomResizedCrop.get_params` + `torch.rand` on the global generator (what it did before), in one
process, on one core, rounds alternating; the ratio is taken within each round.

    python -m bench.drawcost [--rounds 5 --images 300]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.draws import Sample
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.transforms import Normalizer, TrainCrop
from torchvision.transforms import RandomResizedCrop

from bench import BENCH
from bench.jpegset import make_jpeg_set


class GlobalDrawCrop(TrainCrop):
    """The preset as it drew before keyed draws: torchvision's sampling, the global generator."""

    def draw(self, height, width, stream=None):
        box = (0, 0, height, width) if self.scale is None else tuple(RandomResizedCrop.get_params(
            torch.empty(0, height, width), list(self.scale), list(self.ratio)))
        return box, bool(self.flip and torch.rand(1).item() < 0.5)


def rate(ds, keys, batch: int = 64) -> float:
    norm = Normalizer()
    start = time.perf_counter()
    for first in range(0, len(keys), batch):
        norm(torch.stack([ds[k][0] for k in keys[first:first + batch]]))
    return len(keys) / (time.perf_counter() - start)


def compare(folder: Path, size: int, rounds: int) -> str:
    imdir = read_image_directory(folder)
    before = ImageDataset(imdir, GlobalDrawCrop("standard", size), cache=True, pack=False)
    after = ImageDataset(imdir, TrainCrop("standard", size), cache=True, pack=False)
    n, rates = len(before), {"before": [], "after": []}
    for r in range(rounds):
        rates["before"].append(rate(before, list(range(n))))
        rates["after"].append(rate(after, [Sample(i, 1, r) for i in range(n)]))
    ratios = sorted(a / b for a, b in zip(rates["after"], rates["before"]))
    return (f"| {folder.name}, {n} images, {size} px | {statistics.median(rates['before']):.0f} | "
            f"{statistics.median(rates['after']):.0f} | {statistics.median(ratios):.2f}x "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=5, help="rounds")
    p.add_argument("--images", type=int, default=300, help="ImageNet-like JPEGs")
    a = p.parse_args(argv)
    from kfvision.pipelines.flow.demo import write_digits
    from kfvision.trainer.data.convert import convert

    torch.set_num_threads(1)
    digits = BENCH / "draws" / "digits"
    if not digits.exists():
        write_digits(BENCH / "draws" / "raw")
        convert(BENCH / "draws" / "raw" / "train", digits, progress=False)
    jpegs = make_jpeg_set(BENCH / f"draws-jpeg{a.images}", images=a.images)
    print("| cached crops/s, standard | before | after | after / before (range) |")
    print("|---|---|---|---|")
    print(compare(digits, 32, a.rounds))
    print(compare(jpegs, 224, a.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
