"""Where a training step's time goes on this CPU, against the ceiling of its fp32 FMA units.

For each model at 224 px on generated ImageNet-size JPEGs (bench/jpegset.py): seconds per batch
of decoding + augmenting (kfvision's training transform, JPEGs decoded at the crop's scale, one
core: what a loader worker spends), of the forward pass with the loss, the backward pass and the
optimiser step (kfvision's fused SGD), all in the precision and layout `--amp auto` picks on
this CPU, with torch on every usable core; then a real epoch through the DataLoader kfvision
uses when the data is not cached (one worker fewer than the cores), split into the time the
step waited for its batch (the loader stall) and the step itself. The ceiling is the images per
second the cores' fp32 FMA peak allows for the model's training FLOPs (3 x the forward's,
counted by torch.utils.flop_counter), at the clock /proc/cpuinfo reports.

    python -m bench.profile --archs resnet18 resnet50 --images 64 --batch-size 16 --steps 3
"""

import argparse
import statistics
import time

import torch

from bench import BENCH, publish
from bench.jpegset import make_jpeg_set

# fp32 FLOPs per cycle per core: 2 FMA pipes x 8 lanes x 2 = 32 with AVX2 (Zen 3, Intel since
# Haswell) and on Zen 4, whose AVX-512 runs on the same 256-bit pipes; 2 x 16 x 2 = 64 with two
# 512-bit FMA units (Sapphire Rapids, the AMX Xeons; also some AVX-512 Xeons, not told apart)
FLOPS_PER_CYCLE = {"AMX": 64}


def _clock_ghz() -> float:
    with open("/proc/cpuinfo") as f:
        mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    return max(mhz) / 1000 if mhz else 0.0


def _timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(arch: str, data, a) -> dict:
    from kfvision.trainer.data.datasets import ImageDataset, make_loader
    from kfvision.trainer.data.imagedir import read_image_directory
    from kfvision.trainer.data.transforms import (
        IMAGENET_MEAN,
        IMAGENET_STD,
        Normalizer,
        train_transform,
    )
    from kfvision.trainer.engine import make_sgd
    from kfvision.trainer.fastpath import cpu_bf16_decision

    bf16, _ = cpu_bf16_decision(224)
    layout = torch.channels_last if bf16 else torch.contiguous_format
    ds = ImageDataset(read_image_directory(data), train_transform("standard", 224),
                      dct_scaling=True)
    n = a.batch_size
    torch.set_num_threads(1)  # a loader worker's share
    decode = _timed(lambda: [ds[i % len(ds)] for i in range(n)], a.steps)
    torch.set_num_threads(a.threads)
    model = __import__("torchvision").models.get_model(arch, num_classes=10)
    model = model.to(memory_format=layout).train()
    opt = make_sgd(model, lr=0.01, momentum=0.9, weight_decay=1e-4)
    norm = Normalizer(IMAGENET_MEAN, IMAGENET_STD)
    x = norm(torch.stack([ds[i % len(ds)][0] for i in range(n)]), layout)
    y = torch.arange(n) % 10
    loss_fn = torch.nn.CrossEntropyLoss()
    parts = {"forward": [], "backward": [], "optimizer": []}
    for i in range(a.steps + 1):  # the first step builds the kernels: left out
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x).float(), y)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i:
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v)
    fwd, bwd, step = (statistics.median(parts[k]) for k in parts)
    # a real epoch: the loader's worker decodes while the step runs on the same cores
    loader, _ = make_loader(ds, batch_size=n, workers=max(1, a.threads - 1), shuffle=True,
                            seed=1)
    waited = stepped = 0.0
    images = 0
    start = time.perf_counter()
    for images_, labels in loader:
        got = time.perf_counter()
        waited += got - start
        x = norm(images_, layout)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x).float(), labels % 10)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        images += len(labels)
        start = time.perf_counter()
        stepped += start - got
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model.eval()(norm(torch.stack([ds[0][0]]), layout))
    train_flops = 3 * counter.get_total_flops()
    return {"arch": arch, "precision": "bf16" if bf16 else "fp32", "decode": decode,
            "forward": fwd, "backward": bwd, "optimizer": step, "waited": waited,
            "stepped": stepped, "images": images, "train_gflop": train_flops / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", nargs="+", default=["resnet18", "resnet50"])
    p.add_argument("--images", type=int, default=64, help="size of the generated JPEG set")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed repetitions of each part")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args(argv)
    from kfvision.trainer.fastpath import cpu_features

    data = make_jpeg_set(BENCH / f"jpeg{a.images}", images=a.images)
    cpu = cpu_features()
    ghz = _clock_ghz()
    peak = cpu.cores * ghz * FLOPS_PER_CYCLE.get(cpu.kind, 32)  # GFLOP/s
    rows = ["| model | precision | decode + augment, 1 core | forward | backward | optimizer | "
            "step img/s | epoch: loader stall / step | epoch img/s | training GFLOP/img | "
            "fp32 FMA ceiling img/s | step / ceiling |", "|---|---|" + "---|" * 10]
    for arch in a.archs:
        r = profile(arch, data, a)
        step = r["forward"] + r["backward"] + r["optimizer"]
        ceiling = peak / r["train_gflop"]
        total = r["waited"] + r["stepped"]
        rows.append(
            f"| {arch} | {r['precision']} | {r['decode']:.2f} s | {r['forward']:.2f} s | "
            f"{r['backward']:.2f} s | {r['optimizer']:.3f} s | {a.batch_size / step:.1f} | "
            f"{r['waited']:.1f} s / {r['stepped']:.1f} s ({r['waited'] / total:.0%} waiting) | "
            f"{r['images'] / total:.1f} | {r['train_gflop']:.1f} | {ceiling:.1f} | "
            f"{a.batch_size / step / ceiling:.0%} |")
        print(rows[-1], flush=True)
    note = (f"\nSeconds per batch of {a.batch_size} at 224 px (medians of {a.steps}); torch on "
            f"{a.threads} threads; one epoch of {a.images} generated ImageNet-size JPEGs through "
            f"a DataLoader with {max(1, a.threads - 1)} worker(s). Ceiling: {cpu.cores} cores x "
            f"{ghz:.2f} GHz x {FLOPS_PER_CYCLE.get(cpu.kind, 32)} fp32 FLOP/cycle = {peak:.0f} "
            "GFLOP/s, over 3 x the forward's FLOPs per image.")
    publish("\n".join(rows) + "\n" + note, "profile-cpu.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
