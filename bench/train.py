"""Training throughput: `kfvision train` vs a hand-written loop, same data, same run.

Both train the same model on the same images, image size, batch size, augmentation and optimiser;
each runs in its own process, alternating, `--rounds` times. The figure is training images per
second with data loading included, averaged over the epochs after the first (the first pays for
worker start-up, caching and allocator warm-up in both), median over rounds.

    python -m bench.train --dataset digits                      # 32 px digits, resnet18
    python -m bench.train --dataset jpeg --archs resnet18 resnet50 --image-size 224 \
        --batch-size 16 --images 256 --epochs 2                  # the generated JPEG set
    python -m bench.train --dataset jpeg --device cuda --archs resnet50 --images 5000 \
        --batch-size 256 --image-size 224 --epochs 3             # on a GPU machine

Prints a Markdown table of ratios (kfvision / plain loop) and writes it to build/bench/.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.jpegset import make_jpeg_set
from pipelines.demo import write_digits
from trainer.imagedir import convert_class_folders
from trainer.models import write_untrained_model
from trainer.split import split

BENCH = Path("build/bench")


def prepare(args) -> tuple[Path, Path, Path]:
    """(raw class folders for the plain loop, train image dir, val image dir)."""
    if args.dataset == "digits":
        out = BENCH / "digits"
        if not (out / "data" / "val").exists():
            write_digits(out / "raw")
            for part in ("train", "val"):
                convert_class_folders(out / "raw" / part, out / "data" / part,
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


def run_plain(arch, args, raw, workers) -> float:
    cmd = [sys.executable, "-m", "bench.plain_loop", "--data", str(raw), "--arch", arch,
           "--workers", str(workers), "--augment", args.augment, "--device", args.device,
           *_common(args)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return _steady(json.loads(out.strip().splitlines()[-1])["images_per_sec"])


def run_kfvision(arch, args, train, val, extra=()) -> float:
    model = BENCH / "models" / arch
    if not model.exists():
        write_untrained_model(model, arch)
    out = BENCH / "trained" / arch
    cmd = [sys.executable, "-m", "trainer.train", "--model", str(model), "--train", str(train),
           "--val", str(val), "--out", str(out), "--augment", args.augment, "--lr", "0.05",
           "--print-freq", "100000", "--patience", str(args.epochs), "--device", args.device,
           *_common(args), *extra]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"kfvision train failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    history = json.loads((out / "metrics.json").read_text())["history"]
    return _steady([h["train_images_per_sec"] for h in history])


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
    args = p.parse_args(argv)
    args.augment = args.augment or ("light" if args.dataset == "digits" else "standard")
    raw, train, val = prepare(args)
    rows = [f"| {args.dataset} {args.image_size}px, batch {args.batch_size}, {args.device} "
            "| plain loop img/s (workers) | kfvision img/s | ratio |", "|---|---|---|---|"]
    for arch in args.archs:
        plain = {w: [] for w in args.plain_workers}
        ours = []
        for r in range(args.rounds):
            for w in args.plain_workers:
                plain[w].append(run_plain(arch, args, raw, w))
            ours.append(run_kfvision(arch, args, train, val))
            print(f"{arch} round {r + 1}: plain {({w: round(v[-1], 1) for w, v in plain.items()})}"
                  f" kfvision {ours[-1]:.1f} img/s", flush=True)
        best_w = max(plain, key=lambda w: statistics.median(plain[w]))
        base, mine = statistics.median(plain[best_w]), statistics.median(ours)
        rows.append(f"| {arch} | {base:.1f} ({best_w}) | {mine:.1f} | {mine / base:.2f}x |")
    table = "\n".join(rows)
    note = (f"\n{args.epochs} epochs x {args.rounds} rounds, medians; the plain loop's best of "
            f"{args.plain_workers} DataLoader workers counts.")
    print("\n" + table + note)
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / f"train-{args.dataset}-{args.device}.md").write_text(table + "\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
