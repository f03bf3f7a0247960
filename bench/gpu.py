"""The GPU benchmark (`bash bench/gpu.sh`): the training step's ceiling, then ResNet-50 trained on
JPEGs by the plain loop and by kfvision (its defaults, and the batched GPU pipeline with
`--cache off`), each against that ceiling, with each run's whole time.

    bash bench/gpu.sh                      # 5,000 JPEGs, 4 epochs, every step variant
    bash bench/gpu.sh --quick              # one short device call: 2,560 JPEGs, 3 epochs
    bash bench/gpu.sh --device cpu --smoke # tiny, on a CPU: checks that every part runs

The parts: bench/step.py (the step alone on batches already on the device: channels-last,
CUDA graphs and torch.compile as variants), bench/train.py (the runs with data). The summary is
printed and written to build/bench/gpu-<device>.md.
"""

import argparse
import json
import sys

from bench import BENCH, publish
from bench.step import rate

# ResNet-50 at 224 px, batch 256, bf16: what MLPerf Training's ResNet-50 trains
PRESETS = {
    "full": {"images": 5000, "epochs": 4, "arch": "resnet50", "image_size": 224,
             "batch_size": 256, "steps": 50, "warmup": 5, "plain_workers": 8,
             "variant_timeout": 600,
             "step_variants": ["nchw", "channels-last", "channels-last-nosearch", "graphs",
                               "compile", "compile-graphs"],
             "variants": ["default", "gpu-pipeline", "cpu-decode"]},
    # within one short device call (about 4 minutes on an H100): 9 steps an epoch; compile last,
    # and cut off if it compiles for longer than the whole call can spare
    "quick": {"images": 2560, "epochs": 3, "arch": "resnet50", "image_size": 224,
              "batch_size": 256, "steps": 20, "warmup": 3, "plain_workers": 8,
              "variant_timeout": 120,
              "step_variants": ["channels-last", "channels-last-nosearch", "graphs", "compile"],
              "variants": ["default", "gpu-pipeline"]},
    # a check that every part runs, on any machine (`--device cpu`)
    "smoke": {"images": 48, "epochs": 2, "arch": "resnet18", "image_size": 32, "batch_size": 8,
              "steps": 2, "warmup": 1, "plain_workers": 0, "variant_timeout": 600,
              "step_variants": ["nchw", "channels-last"], "variants": ["default", "gpu-pipeline"]},
}
NAMES = {"default": "kfvision, defaults (JPEGs decoded + augmented on the GPU; validation cached)",
         "gpu-pipeline": "kfvision `--cache off`: JPEGs decoded + augmented in batches on the GPU",
         "gpu-decode": "kfvision `--gpu-decode on` (validation cached)",
         "cpu-decode": "kfvision `--cache off --gpu-decode off` (decoded in the workers)",
         "cpu-decode-all-cores": "kfvision `--cache off --gpu-decode off`, a worker a core"}


def summary(step: dict, train: dict, p: dict, device: str) -> str:
    """One table: the step's ceiling, then each run's images/s against it, its whole run and its
    first epoch in seconds."""
    best = step.get("best", {})
    ceiling = best.get("images_per_sec")
    rows = [f"| {p['arch']} {p['image_size']} px, batch {p['batch_size']}, {device} | img/s | "
            "of the step's ceiling | whole run s | epoch 1 s |", "|---|---|---|---|---|"]
    if ceiling:
        rows.append(f"| step only, no input pipeline (best: {best['variant']}) | {rate(ceiling)} "
                    "| 100% | | |")

    def row(name, r):
        share = f"{r['images_per_sec'] / ceiling:.0%}" if ceiling else "-"
        rows.append(f"| {name} | {rate(r['images_per_sec'])} | {share} | {r['seconds']:.1f} | "
                    f"{r['epoch1_seconds']:.1f} |")

    runs = train.get(p["arch"], {})
    for workers, r in runs.get("plain", {}).items():
        row(f"plain loop, ImageFolder + PIL, {workers} workers", r)
    for variant in p["variants"]:
        if variant in runs:
            row(NAMES[variant], runs[variant])
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer images, epochs and steps")
    size.add_argument("--smoke", action="store_true", help="tiny sizes (any device)")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--images", type=int, help="size of the generated JPEG set")
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", nargs="+", help="kfvision runs (bench/train.py's VARIANTS)")
    ap.add_argument("--step-variants", nargs="+", help="bench/step.py's variants")
    ap.add_argument("--skip", nargs="+", choices=("step", "train"), default=[])
    a = ap.parse_args(argv)
    p = dict(PRESETS["quick" if a.quick else "smoke" if a.smoke else "full"])
    for key in ("images", "epochs", "variants", "step_variants"):
        if getattr(a, key) is not None:
            p[key] = getattr(a, key)
    common = ["--device", a.device, "--image-size", str(p["image_size"]), "--batch-size",
              str(p["batch_size"])]
    step, train = {}, {}
    # the runs with data first: the step's variants include torch.compile, the slowest to
    # start, and a time limit on the whole (bench/device_run.sh) then costs a variant at most
    if "train" not in a.skip:
        from bench import train as train_bench

        train_bench.main([*common, "--dataset", "jpeg", "--images", str(p["images"]),
                          "--archs", p["arch"], "--epochs", str(p["epochs"]), "--rounds",
                          str(a.rounds), "--plain-workers", str(p["plain_workers"]),
                          "--augment", "standard", "--variants", *p["variants"]])
        train = json.loads((BENCH / f"train-jpeg-{a.device}.json").read_text())
    if "step" not in a.skip:
        from bench import step as step_bench

        step_bench.main([*common, "--arch", p["arch"], "--steps", str(p["steps"]), "--warmup",
                         str(p["warmup"]), "--variant-timeout", str(p["variant_timeout"]),
                         "--variants", *p["step_variants"]])
        step = json.loads((BENCH / f"step-{a.device}.json").read_text())
    note = (f"\n{p['images']} generated JPEGs (90% trained on), {p['epochs']} epochs, "
            f"{a.rounds} round(s): img/s over the epochs after the first; whole run: process "
            "start to exit (kfvision validates after every epoch, the plain loop does not). "
            "The step's ceiling is bench/step.py's best variant (build/bench/step-*.md).")
    publish(summary(step, train, p, a.device) + "\n" + note, f"gpu-{a.device}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
