"""kfvision's `--recipe torchvision` against torchvision's own references/classification/train.py.

Both train the same model from random initialisation (no weights can be downloaded here; on a
machine with network the same comparison takes pretrained weights: kfvision's `model
--pretrained`, the reference's `--weights`) on the same images, with the same image size, batch,
epochs, learning rate, weight decay and seed, each with its own implementation of the recipe
(SGD, cosine decay, label smoothing 0.1, mixup 0.2, cutmix 1.0, TrivialAugment, random erasing
0.1, no weight decay on norms, biases and embeddings, an EMA of the weights). The data: `digits`
(scikit-learn's 1,797 8 x 8 handwritten digits as PNG class folders, 80% of each class for
training, scaled up to the image size by each side's own resize; a model learns them far above
chance in a few epochs from random initialisation) or `jpeg` (bench/jpegset.py's generated JPEGs).

The EMA is the same on both sides: updated after every step with `--ema-decay` (kfvision's
`--ema-decay`; the reference's `--model-ema-steps 1` and the `--model-ema-decay` its adjustment
for batch and epochs turns into that decay: `reference_ema_decay`). Its defaults (every 32 steps,
0.99998, tuned for 600 ImageNet epochs) and kfvision's recipe default (0.9998 a step) both keep the
EMA at the initial weights over a few hundred steps.

Figures per run: top-1 on the validation images after the last epoch, of the weights and of
their EMA (each side validates both); kfvision's output (the better of the two by validation
loss, at the best epoch) as well. Training images/s: images over the seconds of the training
epochs, validation excluded, data loading included. Runs alternate (reference first, then
kfvision first, ...; seeds outermost, so a stopped run has every model at its first seeds), so a
drift of the machine's speed favours neither; the table shows means over seeds and the images/s
ratio per seed (median, range), and the load average around the runs.

torchvision's reference scripts are not part of its wheel and are never committed here: they are
copied at run time from a git clone of pytorch/vision into build/torchvision-references/<rev>/,
at the tag of constraints.txt's torchvision pin unless `--rev` says otherwise:

    git clone --bare --filter=blob:none https://github.com/pytorch/vision build/vision.git
    python -m bench.reference --vision-git build/vision.git          # ResNet-18, RegNetY-400MF
    python -m bench.reference --vision-git build/vision.git --archs resnet50 mobilenet_v3_large
    python -m bench.reference --report build/bench/reference-cpu.json    # its table again

(or put train.py, presets.py, transforms.py, utils.py and sampler.py into the folder yourself).
Prints a Markdown table and writes it to build/bench/reference-cpu.md.
"""

import argparse
import json
import os
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


def reference_ema_decay(decay: float, batch_size: int, epochs: int) -> float:
    """The reference's `--model-ema-decay` that, updated every step (`--model-ema-steps 1`), gives
    an EMA of `decay` a step: its train.py takes alpha = (1 - decay) * batch * steps / epochs."""
    return 1.0 - (1.0 - decay) * epochs / batch_size


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
    last = {suffix: acc for suffix, acc in top1[-2:]}  # the last epoch's model ("") and EMA
    return {"top1": max(last.values()), "top1_model": last[""], "top1_ema": last.get("EMA"),
            "images_per_sec": sum(images) / sum(seconds)}


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
            "--norm-weight-decay", "0.0", "--bias-weight-decay", "0.0",
            "--transformer-embedding-decay", "0.0",  # kfvision's groups: trainer/recipes.py
            "--label-smoothing", "0.1", "--mixup-alpha", "0.2",
            "--cutmix-alpha", "1.0", "--lr-scheduler", "cosineannealinglr",
            "--auto-augment", "ta_wide", "--random-erase", "0.1", "--model-ema",
            "--model-ema-steps", "1", "--model-ema-decay",
            repr(reference_ema_decay(a.ema_decay, a.batch_size, a.epochs)),
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
                    "--weight-decay", str(a.weight_decay), "--ema-decay", str(a.ema_decay),
                    "--seed", str(seed), "--patience", str(a.epochs), "--print-freq", "100000"])
    metrics = json.loads((out / "metrics.json").read_text())
    last = metrics["history"][-1]
    return {"top1": metrics["final"]["val_top1"], "top1_model": last["val_top1_model"],
            "top1_ema": last["val_top1_ema"],
            "images_per_sec": metrics["final"]["train_images_per_sec"], "seconds": wall}


def dataset(a) -> tuple[Path, Path]:
    """(the reference's data path, kfvision's): each with train/ and val/, written once; the
    digits as PNG class folders (the reference's ImageFolder) and as kfvision image
    directories of the same files (`convert`)."""
    if a.data == "digits":
        from kfvision.pipelines.flow.demo import write_digits  # needs scikit-learn
        from kfvision.trainer.data.convert import convert

        out = BENCH / "ref-digits"
        if not (out / "imagedirs" / "val").exists():
            write_digits(out / "raw", val_fraction=0.2, seed=1)
            for part in ("train", "val"):
                convert(out / "raw" / part, out / "imagedirs" / part, overwrite=True,
                        progress=False)
        return out / "raw", out / "imagedirs"
    from bench.jpegset import make_jpeg_set
    from kfvision.trainer.data.split import split

    out = BENCH / f"ref{a.images}"
    data = make_jpeg_set(out / "set", images=a.images)
    if not (out / "val").exists():
        split(data, out / "train", out / "val", fraction=a.train_share, seed=1)
    return out, out


def compare(folder: Path, a) -> dict:
    """{arch: {"reference": [runs], "kfvision": [runs]}}, seeds outermost, sides alternating."""
    (data, imagedirs), runs, turn = dataset(a), {}, int(a.kfvision_first)
    for seed in a.seeds:
        for arch in a.archs:
            sides = runs.setdefault(arch, {"reference": [], "kfvision": []})
            order = ("reference", "kfvision") if turn % 2 == 0 else ("kfvision", "reference")
            turn += 1
            for name in order:
                load = os.getloadavg()[0]
                run = (reference_run(folder, arch, data, seed, a) if name == "reference"
                       else kfvision_run(arch, imagedirs, seed, a))
                sides[name].append({**run, "seed": seed, "first": name == order[0],
                                    "load": [load, os.getloadavg()[0]]})
                print(f"{arch} seed {seed} {name}: {sides[name][-1]}", flush=True)
            (BENCH / f"reference-cpu{a.tag}.json").write_text(json.dumps(
                {"settings": settings(a), "runs": runs}))  # kept as it goes
    return runs


def settings(a) -> dict:
    """What a run's results depend on besides the seed: `merged` refuses results that differ in
    any of it (the generated set's size and split only for `--data jpeg`: the digits have one)."""
    keys = ["data", "image_size", "batch_size", "epochs", "lr", "weight_decay", "ema_decay",
            "workers", "rev"] + (["images", "train_share"] if a.data == "jpeg" else [])
    return {k: getattr(a, k) for k in keys}


def merged(saved: list) -> dict:
    """Several `compare` results of the same settings (e.g. seeds run side by side) as one."""
    runs = {}
    for one in saved:
        if one["settings"] != saved[0]["settings"]:
            raise SystemExit(f"results of other settings: {one['settings']} against "
                             f"{saved[0]['settings']}")
        for arch, sides in one["runs"].items():
            into = runs.setdefault(arch, {"reference": [], "kfvision": []})
            for name in into:
                into[name] += sides[name]
    return {"settings": saved[0]["settings"], "runs": runs}


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def report(saved: dict) -> str:
    """The Markdown table (means over seeds) and a line per run of `compare`'s results."""
    s, rows = saved["settings"], []
    head = (f"| {s['data']}, {s['image_size']} px, {s['epochs']} epochs, batch {s['batch_size']},"
            " random init | seeds | reference top-1 weights / EMA | kfvision top-1 weights / EMA "
            "(output) | gap weights / EMA (points) | reference img/s | kfvision img/s "
            "| ratio per seed (range) | ratio, same position |")
    rows += [head, "|---" * 9 + "|"]
    lines = []
    for arch, sides in saved["runs"].items():
        by_seed = [{r["seed"]: r for r in sides[name]} for name in ("reference", "kfvision")]
        seeds = sorted(set(by_seed[0]) & set(by_seed[1]))  # a seed run on both sides
        if not seeds:
            continue
        ref, ours = ([side[seed] for seed in seeds] for side in by_seed)
        rows.append(_row(arch, ref, ours))
        for r, o in zip(ref, ours):
            lines.append(f"- {arch} seed {r['seed']} ({'reference' if r['first'] else 'kfvision'}"
                         f" first): reference {_pct(r['top1_model'])} / {_pct(r['top1_ema'])}, "
                         f"{r['images_per_sec']:.1f} img/s, {r['seconds']:.0f} s; kfvision "
                         f"{_pct(o['top1_model'])} / {_pct(o['top1_ema'])} "
                         f"({_pct(o['top1'])}), {o['images_per_sec']:.1f} img/s, "
                         f"{o['seconds']:.0f} s; load average {r['load'][0]:.1f}-"
                         f"{max(r['load'][1], o['load'][1]):.1f}")
    note = (f"\nMeans over seeds; torchvision's references/classification at {s['rev']}; every "
            f"run from random initialisation; lr {s['lr']}, weight decay {s['weight_decay']}, "
            f"EMA {s['ema_decay']} a step on both sides; a ratio is kfvision's images/s over the "
            "reference's for the same seed (median, range).")
    return "\n".join(rows) + "\n" + note + "\n\n" + "\n".join(lines)


def _row(arch: str, ref: list, ours: list) -> str:
    def mean(runs, k):
        values = [r[k] for r in runs if r.get(k) is not None]
        return statistics.mean(values) if values else None

    def gap(k):
        m, n = mean(ours, k), mean(ref, k)
        return "-" if m is None or n is None else f"{100 * (m - n):+.1f}"

    ratios = sorted(o["images_per_sec"] / r["images_per_sec"] for r, o in zip(ref, ours))
    return (f"| {arch} | {len(ref)} | {_pct(mean(ref, 'top1_model'))} / "
            f"{_pct(mean(ref, 'top1_ema'))} | {_pct(mean(ours, 'top1_model'))} / "
            f"{_pct(mean(ours, 'top1_ema'))} ({_pct(mean(ours, 'top1'))}) "
            f"| {gap('top1_model')} / {gap('top1_ema')} "
            f"| {mean(ref, 'images_per_sec'):.1f} | {mean(ours, 'images_per_sec'):.1f} "
            f"| {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) "
            f"| {same_position(ref, ours)} |")


def same_position(ref: list, ours: list) -> str:
    """kfvision's images/s over the reference's among runs that ran in the same position of their
    pair (first, second): a machine whose load falls while the pairs run (side by side, the first
    runs share it with more) slows every first run alike. The geometric mean of the two."""
    by = {}
    for first in (True, False):
        r = [x["images_per_sec"] for x in ref if x["first"] == first]
        o = [x["images_per_sec"] for x in ours if x["first"] == first]
        if r and o:
            by["first" if first else "second"] = statistics.mean(o) / statistics.mean(r)
    if not by:
        return "-"
    both = statistics.geometric_mean(by.values())
    return f"{both:.2f}x (" + ", ".join(f"{k} {v:.2f}x" for k, v in by.items()) + ")"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--vision-git", type=Path, help="a clone of pytorch/vision (bare is enough)")
    p.add_argument("--rev", help="its tag or commit (default: constraints.txt's torchvision)")
    p.add_argument("--archs", nargs="+", default=["resnet18", "regnet_y_400mf"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--data", choices=("digits", "jpeg"), default="digits")
    p.add_argument("--images", type=int, default=400, help="jpeg: size of the generated set")
    p.add_argument("--train-share", type=float, default=0.6, help="jpeg: of each class, to train")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--ema-decay", type=float, default=0.98, help="a step, on both sides")
    p.add_argument("--workers", type=int, default=2, help="the reference's DataLoader workers")
    p.add_argument("--tag", default="", help="added to the result files' names")
    p.add_argument("--kfvision-first", action="store_true",
                   help="start with kfvision's run (to pair with a run started with the reference)")
    p.add_argument("--report", type=Path, nargs="+",
                   help="only the table of these results (.json, runs of the same settings)")
    p.add_argument("--one-reference", help=argparse.SUPPRESS)  # the reference's own process
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    a, rest = p.parse_known_args(argv)
    if a.one_reference:
        print(json.dumps(run_reference_here(a.one_reference, a.seed, rest[1:])))
        return 0
    if a.report:
        publish(report(merged([json.loads(f.read_text()) for f in a.report])),
                f"reference-cpu{a.tag}.md")
        return 0
    a.rev = a.rev or pinned_tag()
    runs = compare(references(a.rev, a.vision_git), a)
    publish(report({"settings": settings(a), "runs": runs}), f"reference-cpu{a.tag}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
