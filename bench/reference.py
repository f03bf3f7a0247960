"""kfvision's `--recipe torchvision` against torchvision's own references/classification/train.py.

Both train the same model from random initialisation (no weights can be downloaded here; on a
machine with network the same comparison takes pretrained weights: kfvision's `model
--pretrained`, the reference's `--weights`) on the same generated JPEGs (bench/jpegset.py, split
once), with the same image size, batch, epochs, learning rate, weight decay and seed, each with
its own implementation of the recipe (SGD, cosine decay, label smoothing 0.1, mixup 0.2, cutmix
1.0, TrivialAugment, random erasing 0.1, no weight decay on norms, an EMA of the weights). The
reference's EMA keeps its own defaults (updated every 32 steps, decay 0.99998 adjusted for the
batch and epochs); kfvision's is the recipe's (every step, 0.9998).

Figures per run: top-1 on the validation images (kfvision: its output weights, the better of the
weights and their EMA by validation loss; the reference: the better top-1 of its model and its
EMA after the last epoch, which favours it) and training images/s (images over the seconds of
the training epochs, validation excluded; data loading included). Runs alternate (reference,
kfvision, then kfvision, reference), so a drift of the machine's speed favours neither; the
table shows means over seeds and the images/s ratio per seed.

torchvision's reference scripts are not part of its wheel and are never committed here: they are
copied at run time from a git clone of pytorch/vision into build/torchvision-references/<rev>/,
at the tag of constraints.txt's torchvision pin unless `--rev` says otherwise:

    git clone --bare --filter=blob:none https://github.com/pytorch/vision build/vision.git
    python -m bench.reference --vision-git build/vision.git              # ResNet-50, MobileNetV3
    python -m bench.reference --vision-git build/vision.git --archs resnet50 \\
        --image-size 64 --images 400 --epochs 2 --seeds 1 2 3

(or put train.py, presets.py, transforms.py, utils.py and sampler.py into the folder yourself).
Prints a Markdown table and writes it to build/bench/reference-cpu.md.
"""

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import BENCH, publish

FILES = ("train.py", "presets.py", "transforms.py", "utils.py", "sampler.py")
REFERENCES = Path("build/torchvision-references")


def pinned_tag(constraints: Path = Path("constraints.txt")) -> str:
    """The pytorch/vision tag of the torchvision pinned in constraints.txt ("v0.29.1")."""
    m = re.search(r"^torchvision==([0-9.]+)", constraints.read_text(), re.M)
    if not m:
        raise SystemExit(f"{constraints} pins no torchvision version")
    return f"v{m.group(1)}"


def references(rev: str, vision_git: Path | None) -> Path:
    """The folder holding torchvision's references/classification scripts at `rev`: copied out of
    `vision_git` (a clone of pytorch/vision) unless already there."""
    dest = REFERENCES / rev
    if all((dest / f).exists() for f in FILES):
        return dest
    if vision_git is None:
        raise SystemExit(
            f"torchvision's reference scripts at {rev} are not in {dest}/. Clone pytorch/vision "
            "(git clone --bare --filter=blob:none https://github.com/pytorch/vision "
            "build/vision.git) and pass --vision-git build/vision.git, or copy "
            f"references/classification/{{{','.join(FILES)}}} at {rev} into {dest}/.")
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        show = subprocess.run(["git", "--git-dir", str(vision_git), "show",
                               f"{rev}:references/classification/{f}"], capture_output=True)
        if show.returncode:
            raise SystemExit(f"git show {rev}:references/classification/{f} in {vision_git} "
                             f"failed: {show.stderr.decode().strip()}")
        (dest / f).write_bytes(show.stdout)
    return dest


def run_reference_here(folder: str, seed: int, argv: list) -> dict:
    """Run the reference's main() in this process, seeded, timing its training epochs and
    keeping what its evaluations return (its own code unchanged; only wrapped)."""
    sys.path.insert(0, folder)
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # the reference has no seed flag; its samplers draw from this
    import train  # the reference's train.py

    seconds, images, top1 = [], [], []
    one_epoch, evaluate = train.train_one_epoch, train.evaluate

    def timed_epoch(*args, **kwargs):
        start = time.perf_counter()
        one_epoch(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        images.append(len(args[3].dataset))  # (model, criterion, optimizer, data_loader, ...)

    def kept_evaluate(*args, **kwargs):
        acc = evaluate(*args, **kwargs)
        top1.append((kwargs.get("log_suffix", ""), acc / 100))
        return acc

    train.train_one_epoch, train.evaluate = timed_epoch, kept_evaluate
    train.main(train.get_args_parser().parse_args(argv))
    last = {suffix: acc for suffix, acc in top1[-2:]}  # the last epoch's model (and EMA)
    return {"top1": max(last.values()), "images_per_sec": sum(images) / sum(seconds),
            "top1_by_weights": last}


def _run(cmd: list) -> tuple[str, float]:
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{run.stdout[-2000:]}"
                         f"{run.stderr[-3000:]}")
    return run.stdout, time.perf_counter() - start


def reference_run(folder: Path, arch: str, data: Path, seed: int, a) -> dict:
    argv = ["--data-path", str(data), "--model", arch, "--device", "cpu",
            "-b", str(a.batch_size), "--epochs", str(a.epochs), "-j", str(a.workers),
            "--opt", "sgd", "--lr", str(a.lr), "--wd", str(a.weight_decay),
            "--norm-weight-decay", "0.0", "--label-smoothing", "0.1", "--mixup-alpha", "0.2",
            "--cutmix-alpha", "1.0", "--lr-scheduler", "cosineannealinglr",
            "--auto-augment", "ta_wide", "--random-erase", "0.1", "--model-ema",
            "--train-crop-size", str(a.image_size), "--val-crop-size", str(a.image_size),
            "--val-resize-size", str(int(a.image_size / 0.875)),  # kfvision's eval resize
            "--output-dir", "", "--print-freq", "100000"]
    out, wall = _run([sys.executable, "-m", "bench.reference", "--one-reference", str(folder),
                      "--seed", str(seed), "--", *argv])
    return {**json.loads(out.strip().splitlines()[-1]), "seconds": wall}


def kfvision_run(arch: str, data: Path, seed: int, a) -> dict:
    from kfvision.trainer.model.arch import write_untrained_model

    model = BENCH / "models" / arch
    if not model.exists():
        write_untrained_model(model, arch)
    out = BENCH / "reference-runs" / f"{arch}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    _, wall = _run([sys.executable, "-m", "kfvision.trainer.train", "--model", str(model),
                    "--train", str(data / "train"), "--val", str(data / "val"), "--out", str(out),
                    "--recipe", "torchvision", "--epochs", str(a.epochs), "--batch-size",
                    str(a.batch_size), "--image-size", str(a.image_size), "--lr", str(a.lr),
                    "--weight-decay", str(a.weight_decay), "--seed", str(seed),
                    "--patience", str(a.epochs), "--print-freq", "100000"])
    final = json.loads((out / "metrics.json").read_text())["final"]
    return {"top1": final["val_top1"], "images_per_sec": final["train_images_per_sec"],
            "seconds": wall}


def dataset(a) -> Path:
    """BENCH/refN/{train,val}: the generated JPEGs, split once (class folders both read)."""
    from bench.jpegset import make_jpeg_set
    from kfvision.trainer.data.split import split

    out = BENCH / f"ref{a.images}"
    data = make_jpeg_set(out / "set", images=a.images)
    if not (out / "val").exists():
        split(data, out / "train", out / "val", fraction=a.train_share, seed=1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--vision-git", type=Path, help="a clone of pytorch/vision (bare is enough)")
    p.add_argument("--rev", help="its tag or commit (default: constraints.txt's torchvision)")
    p.add_argument("--archs", nargs="+", default=["resnet50", "mobilenet_v3_large"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--images", type=int, default=400, help="size of the generated JPEG set")
    p.add_argument("--train-share", type=float, default=0.6, help="of each class, for training")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=2, help="the reference's DataLoader workers")
    p.add_argument("--one-reference", help=argparse.SUPPRESS)  # the reference's own process
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    a, rest = p.parse_known_args(argv)
    if a.one_reference:
        print(json.dumps(run_reference_here(a.one_reference, a.seed, rest[1:])))
        return 0
    rev = a.rev or pinned_tag()
    folder = references(rev, a.vision_git)
    data = dataset(a)
    rows = [f"| {a.image_size} px, {a.epochs} epochs, batch {a.batch_size}, from random init "
            "| reference top-1 | kfvision top-1 | gap (points) | reference img/s "
            "| kfvision img/s | ratio (range) |", "|---|---|---|---|---|---|---|"]
    runs = {}
    for arch in a.archs:
        ref, ours = [], []
        for i, seed in enumerate(a.seeds):
            pair = [("reference", ref), ("kfvision", ours)]
            for name, into in (pair if i % 2 == 0 else pair[::-1]):
                into.append(reference_run(folder, arch, data, seed, a) if name == "reference"
                            else kfvision_run(arch, data, seed, a))
            print(f"{arch} seed {seed}: reference {ref[-1]}, kfvision {ours[-1]}", flush=True)
        runs[arch] = {"reference": ref, "kfvision": ours}
        (BENCH / "reference-cpu.json").write_text(json.dumps(runs))  # kept as it goes
        rows.append(_row(arch, ref, ours))
    note = (f"\nMeans over seeds {a.seeds}; torchvision's references/classification at {rev}; "
            f"{a.images} generated JPEGs ({a.train_share:.0%} of each class for training), "
            "every run from random initialisation; a ratio is kfvision's images/s over the "
            "reference's for the same seed (median, range).")
    publish("\n".join(rows) + "\n" + note, "reference-cpu.md")
    return 0


def _row(arch: str, ref: list, ours: list) -> str:
    def mean(runs, k):
        return statistics.mean(r[k] for r in runs)

    ratios = sorted(o["images_per_sec"] / r["images_per_sec"] for r, o in zip(ref, ours))
    gap = 100 * (mean(ours, "top1") - mean(ref, "top1"))
    return (f"| {arch} | {mean(ref, 'top1'):.1%} | {mean(ours, 'top1'):.1%} | {gap:+.1f} "
            f"| {mean(ref, 'images_per_sec'):.1f} | {mean(ours, 'images_per_sec'):.1f} "
            f"| {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")


if __name__ == "__main__":
    sys.exit(main())
