"""Training throughput on the digits data: `kfvision train` vs a hand-written loop, same run.

Both train resnet18 (and whatever --archs names) on the same images, image size, batch size,
augmentation and optimiser; each runs in its own process, alternating, `--rounds` times. The
figure is training images per second with data loading included, averaged over the epochs after
the first (the first pays for worker start-up, caching and allocator warm-up in both).

    python -m bench.digits [--epochs 3 --rounds 2 --batch-size 32 --image-size 32]

Prints a Markdown table of ratios (kfvision / plain loop) and writes it to build/bench/.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from pipelines.demo import write_digits
from trainer.imagedir import convert_class_folders
from trainer.models import write_untrained_model

OUT = Path("build/bench/digits")


def prepare() -> Path:
    if not (OUT / "data" / "val").exists():
        write_digits(OUT / "raw")
        for split in ("train", "val"):
            convert_class_folders(OUT / "raw" / split, OUT / "data" / split, overwrite=True,
                                  progress=False)
    return OUT


def _steady(rates: list) -> float:
    return statistics.mean(rates[1:] if len(rates) > 1 else rates)


def run_plain(arch, args, workers) -> float:
    cmd = [sys.executable, "-m", "bench.plain_loop", "--data", str(OUT / "raw" / "train"),
           "--arch", arch, "--image-size", str(args.image_size), "--batch-size",
           str(args.batch_size), "--epochs", str(args.epochs), "--workers", str(workers),
           "--augment", "light"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return _steady(json.loads(out.strip().splitlines()[-1])["images_per_sec"])


def run_kfvision(arch, args) -> float:
    model = OUT / "models" / arch
    if not model.exists():
        write_untrained_model(model, arch)
    trained = OUT / "trained" / arch
    cmd = [sys.executable, "-m", "trainer.train", "--model", str(model), "--train",
           str(OUT / "data" / "train"), "--val", str(OUT / "data" / "val"), "--out", str(trained),
           "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
           "--epochs", str(args.epochs), "--augment", "light", "--lr", "0.05",
           "--print-freq", "1000", "--patience", str(args.epochs)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    history = json.loads((trained / "metrics.json").read_text())["history"]
    return _steady([h["train_images_per_sec"] for h in history])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", nargs="+", default=["resnet18"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--plain-workers", type=int, nargs="+", default=[0, 2],
                   help="DataLoader workers tried for the plain loop; its best counts")
    args = p.parse_args(argv)
    prepare()
    rows = ["| model | plain loop img/s (workers) | kfvision img/s | ratio |",
            "|---|---|---|---|"]
    for arch in args.archs:
        plain = {w: [] for w in args.plain_workers}
        ours = []
        for r in range(args.rounds):
            for w in args.plain_workers:
                plain[w].append(run_plain(arch, args, w))
            ours.append(run_kfvision(arch, args))
            print(f"{arch} round {r + 1}: plain {({w: round(v[-1]) for w, v in plain.items()})}"
                  f" kfvision {ours[-1]:.0f} img/s", flush=True)
        best_w = max(plain, key=lambda w: statistics.median(plain[w]))
        base, mine = statistics.median(plain[best_w]), statistics.median(ours)
        rows.append(f"| {arch} | {base:.0f} ({best_w}) | {mine:.0f} | {mine / base:.2f}x |")
    table = "\n".join(rows)
    note = (f"\ndigits, {args.image_size}x{args.image_size}, batch {args.batch_size}, "
            f"{args.epochs} epochs x {args.rounds} rounds, CPU, medians; the plain loop's best "
            f"worker count of {args.plain_workers} counts.")
    print("\n" + table + note)
    (OUT / "results.md").write_text(table + "\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
