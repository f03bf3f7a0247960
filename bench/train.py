"""Training throughput: `kfvision train` vs a hand-written loop, same data, same run.

Both train the same model on the same images, image size, batch size, augmentation and optimiser;
each runs in its own process, alternating, `--rounds` times. The figure is training images per
second with data loading included, averaged over the epochs after the first (the first pays for
worker start-up, caching and allocator warm-up in both), median over rounds. The ratio is taken
per round (kfvision / the plain loop's best of that round), then the median over rounds; rounds
alternate the order (plain loop first, then kfvision first), so a drift in machine speed
favours neither.

Steady-state rates leave out what a short run pays once: start-up, kfvision's decode into the
cache before epoch 1, and epoch 1's warm-up (cuDNN's choice of algorithms on a GPU). So a second
table gives each contender's whole run: seconds from starting its process to its exit, every
epoch included, and kfvision's validation after each epoch, which the plain loop does not do.

    python -m bench.train --dataset digits                      # 32 px digits, resnet18
    python -m bench.train --dataset jpeg --archs resnet18 resnet50 --image-size 224 \
        --batch-size 16 --images 256 --epochs 2                  # the generated JPEG set
    bash bench/gpu.sh                                            # on a GPU machine (see there)

For the JPEG set on CUDA, kfvision runs twice: with its defaults, and as `gpu-pipeline`
(`--cache off --gpu-decode on`: data too large to cache, its JPEGs decoded and augmented in
batches on the GPU every epoch, trainer/data/devicedata.py); `--variants` picks. `gpu-decode`
is `--gpu-decode on` alone (validation images cached), and `cpu-decode` (`--cache off
--gpu-decode off`: every epoch decodes in the DataLoader workers, the path of data too large to
cache without nvJPEG) the baseline for the GPU pipeline. (`--cache off` alone is not that
baseline: on CUDA, `--gpu-decode auto` turns nvJPEG on for uncached JPEGs.)
`cpu-decode-all-cores` is the same with a DataLoader worker on every core but one.
The JPEG set needs only torch, torchvision, pillow and numpy (the digits need scikit-learn).

Prints a Markdown table of ratios (kfvision / plain loop) and writes it to build/bench/.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torchvision

from bench import processor, publish
from bench.jpegset import make_jpeg_set
from kfvision.trainer.cpus import usable_cpus
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.split import split
from kfvision.trainer.model.arch import write_untrained_model

BENCH = Path("build/bench")
# kfvision runs compared with the plain loop: name -> extra `kfvision.trainer.train` flags
VARIANTS = {"default": (), "gpu-decode": ("--gpu-decode", "on"),
            # data larger than memory: decoded every epoch, on CUDA batched on the GPU (what
            # `--gpu-decode auto` picks there for uncached JPEGs; "on" so that a CPU smoke run
            # takes the same path)
            "gpu-pipeline": ("--cache", "off", "--gpu-decode", "on"),
            "cpu-decode": ("--cache", "off", "--gpu-decode", "off"),
            # every core but the training process's decodes (`--workers auto` stops at 8)
            "cpu-decode-all-cores": ("--cache", "off", "--gpu-decode", "off",
                                     "--workers", str(max(1, usable_cpus() - 1)))}


def prepare(args) -> tuple[Path, Path, Path]:
    """(raw class folders for the plain loop, train image dir, val image dir)."""
    if args.dataset == "digits":
        from kfvision.pipelines.flow.demo import (
            write_digits,  # needs scikit-learn, which GPU images lack
        )

        out = BENCH / "digits"
        if not (out / "data" / "val").exists():
            write_digits(out / "raw")
            for part in ("train", "val"):
                convert(out / "raw" / part, out / "data" / part,
                                      overwrite=True, progress=False)
        return out / "raw" / "train", out / "data" / "train", out / "data" / "val"
    out = BENCH / f"jpeg{args.images}"
    data = make_jpeg_set(out, images=args.images)
    if not (out / "val").exists():
        split(data, out / "train", out / "val", fraction=0.9, seed=1)
    return out / "train", out / "train", out / "val"


def _steady(rates: list) -> float:
    return statistics.mean(rates[1:] if len(rates) > 1 else rates)


def _common(args) -> list:
    return ["--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
            "--epochs", str(args.epochs)]


def _timed(cmd) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    return run, time.perf_counter() - start


def run_plain(arch, args, raw, workers) -> tuple[float, float, float]:
    """(steady-state images/s, whole-run seconds, epoch 1 seconds) of the plain loop."""
    cmd = [sys.executable, "-m", "bench.plain_loop", "--data", str(raw), "--arch", arch,
           "--workers", str(workers), "--augment", args.augment, "--device", args.device,
           *_common(args)]
    run, seconds = _timed(cmd)
    if run.returncode:
        raise SystemExit(f"the plain loop failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return _steady(result["images_per_sec"]), seconds, result["epoch_seconds"][0]


def run_kfvision(arch, args, train, val, variant="default") -> tuple[float, float, float]:
    """(steady-state images/s, whole-run seconds, epoch 1 seconds) of `kfvision train` with
    `variant`'s flags."""
    model = BENCH / "models" / arch
    if not model.exists():
        write_untrained_model(model, arch)
    out = BENCH / "trained" / f"{arch}-{variant}"
    shutil.rmtree(out, ignore_errors=True)  # a crashed run's checkpoints would be resumed
    cmd = [sys.executable, "-m", "kfvision.trainer.train", "--model", str(model), "--train",
           str(train),
           "--val", str(val), "--out", str(out), "--augment", args.augment, "--lr", "0.05",
           "--print-freq", "100000", "--patience", str(args.epochs), "--device", args.device,
           *_common(args), *VARIANTS[variant]]
    run, seconds = _timed(cmd)
    if run.returncode:
        raise SystemExit(f"kfvision train failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    history = json.loads((out / "metrics.json").read_text())["history"]
    return (_steady([h["train_images_per_sec"] for h in history]), seconds,
            history[0]["train_seconds"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--dataset", choices=("digits", "jpeg"), default="digits")
    p.add_argument("--images", type=int, default=256, help="size of the generated JPEG set")
    p.add_argument("--archs", nargs="+", default=["resnet18"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--augment", default=None, help="default: light for digits, else standard")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--plain-workers", type=int, nargs="+", default=[0, 2],
                   help="DataLoader workers tried for the plain loop; its best counts")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=None,
                   help="kfvision runs to compare (default: default, plus gpu-pipeline for the "
                   "JPEG set on cuda)")
    args = p.parse_args(argv)
    args.augment = args.augment or ("light" if args.dataset == "digits" else "standard")
    gpu_jpeg = args.device == "cuda" and args.dataset == "jpeg"
    args.variants = args.variants or (["default", "gpu-pipeline"] if gpu_jpeg else ["default"])
    machine = describe_machine(args.device)
    print(f"{machine} {processor()}", flush=True)
    raw, train, val = prepare(args)
    head = "".join(f" kfvision {v} img/s | ratio |" for v in args.variants)
    rows = [f"| {args.dataset} {args.image_size}px, batch {args.batch_size}, {args.device} "
            f"| plain loop img/s (workers) |{head}", "|---|---|" + "---|---|" * len(args.variants)]
    head = "".join(f" kfvision {v} s | ratio |" for v in args.variants)
    whole = [f"| whole run, {args.epochs} epochs | plain loop s (workers) |{head}",
             "|---|---|" + "---|---|" * len(args.variants)]
    results = {}  # arch -> run -> medians (written beside the table, for bench.gpu)
    for arch in args.archs:
        plain = {w: [] for w in args.plain_workers}  # (img/s, whole-run s) per round
        ours = {v: [] for v in args.variants}
        for r in range(args.rounds):
            runs = [("plain", w) for w in args.plain_workers] + [("ours", v) for v in args.variants]
            for side, key in (runs if r % 2 == 0 else runs[::-1]):  # ABBA: drift favours neither
                if side == "plain":
                    plain[key].append(run_plain(arch, args, raw, key))
                else:
                    ours[key].append(run_kfvision(arch, args, train, val, key))
            print(f"{arch} round {r + 1}: plain {_last(plain)} kfvision {_last(ours)} "
                  "(img/s, whole-run s)", flush=True)
        rows.append(_row(arch, plain, ours, args.rounds, 0, best=max))
        whole.append(_row(arch, plain, ours, args.rounds, 1, best=min))
        results[arch] = {"plain": {w: _medians(x) for w, x in plain.items()},
                         **{v: _medians(x) for v, x in ours.items()}}
    table = "\n".join(rows) + "\n\n" + "\n".join(whole)
    note = (f"\n{args.epochs} epochs x {args.rounds} rounds; img/s (epochs after the first) and "
            "whole-run seconds (process start to exit) are medians over rounds; a ratio is the "
            "median (and range) over rounds of kfvision against the plain loop's best of "
            f"{args.plain_workers} DataLoader workers in the same round, above 1 where kfvision "
            f"is faster. {machine}")
    publish(table + "\n" + note, f"train-{args.dataset}-{args.device}.md")
    (BENCH / f"train-{args.dataset}-{args.device}.json").write_text(json.dumps(results))
    return 0


def _medians(runs: list) -> dict:
    """The medians over rounds of a contender's (images/s, whole-run s, epoch 1 s)."""
    keys = ("images_per_sec", "seconds", "epoch1_seconds")
    return {k: statistics.median(x[i] for x in runs) for i, k in enumerate(keys)}


def _last(runs: dict) -> dict:
    return {k: tuple(round(v, 1) for v in x[-1]) for k, x in runs.items()}


def _row(arch, plain: dict, ours: dict, rounds: int, i: int, best) -> str:
    """A table row of figure `i` of each run (0: images/s, higher is better; 1: seconds, lower
    is better; `best` picks the better of two), each kfvision variant against the plain loop's
    best of the same round."""
    base = {w: statistics.median(x[i] for x in runs) for w, runs in plain.items()}
    best_w = best(base, key=base.get)
    # the ratio pairs each kfvision run with the plain loop's best of the same round (minutes
    # apart): this machine's speed drifts by more than +-10% over a run, rounds cancel it
    per_round = [best(x[r][i] for x in plain.values()) for r in range(rounds)]
    cells = ""
    for runs in ours.values():
        mine = [x[i] for x in runs]
        ratios = sorted((m / b if i == 0 else b / m) for m, b in zip(mine, per_round))
        spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
        cells += f" {statistics.median(mine):.1f} | {statistics.median(ratios):.2f}x{spread} |"
    return f"| {arch} | {base[best_w]:.1f} ({best_w}) |{cells}"


def describe_machine(device: str) -> str:
    """Versions and the GPU, for the result file (publish adds the CPU); fails early when CUDA
    is asked for but absent."""
    versions = f"torch {torch.__version__}, torchvision {torchvision.__version__}"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda, but this torch ({versions}) sees no CUDA device. "
                             "Run the GPU benchmark on a machine with one, or use --device cpu.")
        return f"{torch.cuda.get_device_name()}, {versions}."
    return f"{versions}."


if __name__ == "__main__":
    sys.exit(main())
