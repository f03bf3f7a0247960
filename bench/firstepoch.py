"""Where the first epoch's time goes: one epoch of `kfvision train`, in this process, under
cProfile (Python functions: the cache fill, model set-up, the steps) and torch.profiler (the
operators, CPU and CUDA: cuDNN's first calls, which search its algorithms, show there).

On an H100 the default's first epoch took 22.5 s against 1.5 s for the next ones, about 20 s of
it with one core busy and the GPU idle (docs/benchmarks.md, "GPU"): this says on which.

    python -m bench.firstepoch --device cuda                       # bench/gpu.sh --quick's set
    python -m bench.firstepoch --device cuda --variant gpu-pipeline
    python -m bench.firstepoch --device cpu --images 48 --arch resnet18 --image-size 32 \\
        --batch-size 8                                              # a smoke run on the CPU

Writes build/bench/firstepoch-<variant>-<device>.txt (the phases, then both profiles' top
entries) and prints the phases. The profilers slow Python down: the phases say where the time
goes, bench/gpu.py's table how long an unprofiled epoch takes.
"""

import argparse
import cProfile
import io
import json
import pstats
import shutil
import sys
import time
from types import SimpleNamespace

import torch

from bench import BENCH, publish
from bench.train import VARIANTS, prepare

# (file suffix, function): the phases of a training, in the order they run
PHASES = [("trainer/inputs.py", "read_inputs", "read and check the image directories"),
          ("trainer/data/datasets.py", "__init__", "ImageDataset: the cache fill and the "
           "validation images decoded up front"),
          ("trainer/model/arch.py", "build_model", "build the model"),
          ("trainer/engine.py", "__init__", "Trainer: model to the device, DDP, optimiser"),
          ("trainer/engine.py", "train_one_epoch", "epoch 1's training steps"),
          ("trainer/engine.py", "evaluate", "validation"),
          ("trainer/train.py", "run", "the whole training (main)")]


def phases(stats: pstats.Stats) -> list:
    """[(what, seconds cumulative)] of PHASES, from cProfile's figures (the largest function of
    that name in that file: ImageDataset's __init__, not EvalShard's)."""
    found = []
    for suffix, name, what in PHASES:
        times = [ct for (path, _, fn), (_, _, _, ct, _) in stats.stats.items()
                 if path.replace("\\", "/").endswith(suffix) and fn == name]
        found.append((what, max(times) if times else 0.0))
    return found


def _operators(prof, device: str) -> str:
    text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if device == "cuda":
        events = prof.key_averages()
        key = next((k for k in ("self_device_time_total", "self_cuda_time_total")
                    if hasattr(events[0], k)), None) if len(events) else None
        if key:
            text += "\n" + events.table(sort_by=key, row_limit=15)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--variant", default="default", choices=tuple(VARIANTS))
    p.add_argument("--images", type=int, default=2560, help="size of the generated JPEG set")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=256)
    a = p.parse_args(argv)
    from kfvision.trainer.model.arch import write_untrained_model
    from kfvision.trainer.train import main as train

    _, train_dir, val_dir = prepare(SimpleNamespace(dataset="jpeg", images=a.images))
    model = BENCH / "models" / a.arch
    if not model.exists():
        write_untrained_model(model, a.arch)
    out = BENCH / "trained" / f"firstepoch-{a.variant}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["--model", str(model), "--train", str(train_dir), "--val", str(val_dir), "--out",
            str(out), "--epochs", "1", "--image-size", str(a.image_size), "--batch-size",
            str(a.batch_size), "--lr", "0.05", "--print-freq", "100000", "--device", a.device,
            *VARIANTS[a.variant]]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if a.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    python = cProfile.Profile()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        python.enable()
        rc = train(argv)
        python.disable()
    wall = time.perf_counter() - start
    if rc:
        raise SystemExit(f"kfvision train exited with {rc}")
    stats = pstats.Stats(python)
    history = json.loads((out / "metrics.json").read_text())["history"]
    rows = ["| phase (cProfile, cumulative) | s |", "|---|---|"]
    rows += [f"| {what} | {seconds:.2f} |" for what, seconds in phases(stats)]
    rows.append(f"| epoch 1 as metrics.json has it (training steps) | "
                f"{history[0]['train_seconds']:.2f} |")
    flags = " ".join(VARIANTS[a.variant]) or "defaults"
    head = (f"First epoch of `kfvision train` ({a.variant}: {flags}), {a.arch} {a.image_size} "
            f"px, batch {a.batch_size}, {a.device}, {a.images} generated JPEGs; {wall:.1f} s "
            "under both profilers.\n\n")
    details = io.StringIO()
    for order, n in (("cumulative", 40), ("tottime", 25)):
        pstats.Stats(python, stream=details).sort_stats(order).print_stats(n)
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / f"firstepoch-{a.variant}-{a.device}.txt").write_text(
        head + "\n".join(rows) + "\n\n" + details.getvalue() + "\n"
        + _operators(prof, a.device) + "\n")
    publish(head + "\n".join(rows), f"firstepoch-{a.variant}-{a.device}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
