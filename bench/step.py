"""The training step's ceiling: images/s of the step alone, on batches already on the device.

No input pipeline: one random normalised batch and its labels are made on the device once and
trained on again and again, with what `kfvision train` steps with (bf16 autocast on CUDA, its
fused SGD, cross-entropy on float32 logits). Whatever a run with data reaches is measured against
this. Each variant runs in a process of its own, so that its first step pays for what a fresh
training pays (cuDNN's search of its algorithms, torch.compile's compilation):

- `nchw`: eager, NCHW;
- `channels-last`: eager, NHWC (what kfvision picks on CUDA);
- `channels-last-nosearch`: the same with `cudnn.benchmark` off (kfvision turns it on): its first
  step against `channels-last`'s is what cuDNN's search costs a run;
- `graphs`: channels-last, the whole step (forward, backward, SGD) captured once as a CUDA graph
  and replayed: no launch overhead (the learning rate is fixed in the graph);
- `compile`: channels-last, `torch.compile` of the model (inductor's default mode);
- `compile-graphs`: `torch.compile(mode="reduce-overhead")`: compiled, with CUDA graphs.

    python -m bench.step --device cuda                                   # ResNet-50, 224 px, 256
    python -m bench.step --device cpu --arch resnet18 --image-size 32 --batch-size 8 --steps 2 \\
        --variants nchw channels-last                                    # a smoke run on the CPU

Prints a Markdown table and writes it (and the figures as JSON) to build/bench/.
"""

import argparse
import json
import subprocess
import sys
import time

import torch

from bench import BENCH, publish

VARIANTS = ("nchw", "channels-last", "channels-last-nosearch", "graphs", "compile",
            "compile-graphs")
CUDA_ONLY = ("graphs", "compile-graphs")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant: str, a) -> dict:
    """{"first_step_s", "images_per_sec", "warmup_s"} of one variant, in this process."""
    from kfvision.trainer.engine import make_sgd

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = variant != "channels-last-nosearch"
    layout = torch.contiguous_format if variant == "nchw" else torch.channels_last
    model = __import__("torchvision").models.get_model(a.arch, num_classes=1000)
    model = model.to(device, memory_format=layout).train()
    opt = make_sgd(model, lr=0.1, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, device=device, generator=g)
    x = x.contiguous(memory_format=layout)
    y = torch.randint(0, 1000, (a.batch_size,), device=device, generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    net = model
    if variant.startswith("compile"):
        net = torch.compile(model, mode="reduce-overhead" if variant == "compile-graphs" else None)

    def step():
        # cache off: autocast's cast weights must not outlive a CUDA graph's capture
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda, cache_enabled=False):
            loss = loss_fn(net(x).float(), y)
        opt.zero_grad(set_to_none=variant != "graphs")  # a graph keeps its gradient buffers
        loss.backward()
        opt.step()

    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    run = step
    if variant == "graphs":
        run = _captured(step, device)
    for _ in range(a.warmup):
        run()
    _sync(device)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(a.steps):
        run()
    _sync(device)
    seconds = time.perf_counter() - start
    return {"first_step_s": first, "warmup_s": warmup,
            "images_per_sec": a.steps * a.batch_size / seconds}


def _captured(step, device: torch.device):
    """`step` captured as a CUDA graph (after warm-up steps on a side stream, as PyTorch's
    "whole-network capture" recipe does); returns the graph's replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _one(variant: str, a) -> dict:
    """`measure` in a process of its own (a fresh cuDNN and compiler state)."""
    cmd = [sys.executable, "-m", "bench.step", "--one", variant, "--device", a.device,
           "--arch", a.arch, "--image-size", str(a.image_size), "--batch-size",
           str(a.batch_size), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=a.variant_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"not done in {a.variant_timeout} s (--variant-timeout)"}
    if run.returncode:
        return {"error": (run.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def rate(images_per_sec: float) -> str:
    """Images/s as a table shows them: whole on a GPU, one decimal below 100 (a CPU's smoke)."""
    return f"{images_per_sec:.0f}" if images_per_sec >= 100 else f"{images_per_sec:.1f}"


def table(results: dict, a) -> tuple[str, dict]:
    """(Markdown table, the best variant's figures with its name) of `results`."""
    rates = {v: r["images_per_sec"] for v, r in results.items() if "images_per_sec" in r}
    best = max(rates, key=rates.get) if rates else None
    rows = [f"| step only: {a.arch} {a.image_size} px, batch {a.batch_size}, {a.device}"
            f"{', bf16' if a.device == 'cuda' else ', fp32'} | img/s | of the best | first step s "
            "| first step + warm-up s |", "|---|---|---|---|---|"]
    for v, r in results.items():
        if "error" in r:
            rows.append(f"| {v} | failed: {r['error']} | | | |")
            continue
        share = r["images_per_sec"] / rates[best]
        rows.append(f"| {v} | {rate(r['images_per_sec'])} | {share:.0%} "
                    f"| {r['first_step_s']:.1f} | {r['warmup_s']:.1f} |")
    return "\n".join(rows), ({"variant": best, **results[best]} if best else {})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=50, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the first")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--variant-timeout", type=int, default=600,
                   help="seconds a variant's process may take")
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a variant's own process
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a)))
        return 0
    results, note = {}, (f"\n{a.steps} timed steps after {a.warmup} untimed ones, each variant "
                         "in its own process; `first step` includes cuDNN's algorithm search "
                         "and torch.compile's compilation where the variant has them.")
    for v in a.variants:
        if a.device != "cuda" and v in CUDA_ONLY:
            continue
        results[v] = _one(v, a)
        print(f"{v}: {results[v]}", flush=True)
        # kept after every variant: a run stopped by a time limit keeps what it measured
        text, best = table(results, a)
        BENCH.mkdir(parents=True, exist_ok=True)
        (BENCH / f"step-{a.device}.md").write_text(text + "\n" + note + "\n")
        (BENCH / f"step-{a.device}.json").write_text(json.dumps({"best": best, "all": results}))
    text, best = table(results, a)
    publish(text + "\n" + note, f"step-{a.device}.md")
    return 0 if best else 1

if __name__ == "__main__":
    sys.exit(main())
