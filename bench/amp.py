"""bf16 autocast + channels_last against fp32 NCHW, per image size: where `--amp auto` turns on.

A bare training step loop (resnet18 by default, random images, the fused SGD step kfvision uses),
no data loading: what the choice of precision and layout changes and nothing else. For each image
size every variant is built once and warmed up, then measured in short turns, back to back, the
order reversing between rounds (ABBA), so a drift in machine speed favours none; each variant's
ratio to the first is taken per round and reported as its median and range.

    python -m bench.amp --sizes 32 64 96 128 224 --rounds 6
    python -m bench.amp --sizes 32 224 --variants fp32 fp32-nhwc fp32-no-gemm

Variants: fp32 (NCHW), bf16 (autocast, channels_last: what `--amp auto` turns on), fp32-nhwc,
bf16-nchw, and fp32-no-gemm (`--conv-gemm off`; the others have it on, the CPU default).
Prints the CPU model and its bf16-relevant flags, what `--amp auto` picks at each size, and a
Markdown table (also written to build/bench/amp-cpu.md).
"""

import argparse
import statistics
import sys
import time

import torch
import torchvision

from bench import publish
from kfvision.trainer.engine import make_sgd
from kfvision.trainer.fastpath import cpu_bf16_decision
from kfvision.trainer.model.convgemm import train_only_live_taps, use_gemm_for_single_pixel_outputs

# name -> (bf16 autocast, channels_last, one-pixel convolutions as GEMM)
VARIANTS = {"fp32": (False, False, True), "bf16": (True, True, True),
            "fp32-nhwc": (False, True, True), "bf16-nchw": (True, False, True),
            "fp32-no-gemm": (False, False, False)}


class Stepper:
    """A variant's model, optimiser and batch, kept between turns (oneDNN keeps its kernels)."""

    def __init__(self, arch, size, batch, variant):
        self.bf16, nhwc, gemm = VARIANTS[variant]
        torch.manual_seed(0)
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        self.model = torchvision.models.get_model(arch, num_classes=10)
        self.model = self.model.to(memory_format=fmt).train()
        if gemm:
            use_gemm_for_single_pixel_outputs(self.model)
            train_only_live_taps(self.model, size)
        self.opt = make_sgd(self.model, lr=0.01, momentum=0.9, weight_decay=1e-4)
        self.x = torch.randn(batch, 3, size, size).contiguous(memory_format=fmt)
        self.y = torch.randint(0, 10, (batch,))

    def step(self):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def rate(self, seconds: float) -> float:
        """Training images per second over whole steps lasting at least `seconds` (2 at least)."""
        start, steps = time.perf_counter(), 0
        while steps < 2 or time.perf_counter() - start < seconds:
            self.step()
            steps += 1
        return steps * len(self.y) / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 96, 128, 224])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=3.0, help="per variant and round")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=["fp32", "bf16"],
                   help="the first is the baseline of the ratios")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    print(machine, flush=True)
    base, others = args.variants[0], args.variants[1:]
    rows = ["| image size | `--amp auto` picks | " + " | ".join(f"{v} img/s" for v in args.variants)
            + "".join(f" | {v} / {base} (range over rounds)" for v in others) + " |",
            "|---|---|" + "---|" * (2 * len(args.variants) - 1)]
    for size in args.sizes:
        steppers = {v: Stepper(args.arch, size, args.batch_size, v) for v in args.variants}
        for s in steppers.values():
            s.rate(args.seconds / 2)  # warm-up: oneDNN builds its kernels on the first steps
        rates = {v: [] for v in args.variants}
        for r in range(args.rounds):
            for v in (args.variants if r % 2 == 0 else args.variants[::-1]):
                rates[v].append(steppers[v].rate(args.seconds))
            print(f"{size} px round {r + 1}: "
                  + ", ".join(f"{v} {x[-1]:.1f}" for v, x in rates.items()) + " img/s", flush=True)
        on, why = cpu_bf16_decision(size)
        cells = "".join(f" {statistics.median(x):.1f} |" for x in rates.values())
        for v in others:
            ratios = sorted(a / b for a, b in zip(rates[v], rates[base]))
            cells += f" **{statistics.median(ratios):.2f}x** ({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
        rows.append(f"| {size} | {'bf16' if on else 'fp32'} ({why}) |{cells}")
    note = (f"\n{args.arch}, batch {args.batch_size}, {args.rounds} rounds of at least "
            f"{args.seconds:g} s per variant after a warm-up, the order reversing every round. "
            f"{machine}")
    table = "\n".join(rows)
    publish(table + "\n" + note, "amp-cpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
