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

The CPU's choices, each alone from eager fp32 NCHW (bench/families.py compares them per family):

- `plain`: the plain loop's step (bench/plain_loop.py): torch's default SGD, NCHW, fp32;
- `bf16`: bf16 autocast with channels-last (the pair `--amp bf16` turns on); `bf16-nchw` without;
- `conv-gemm`: one-pixel convolutions as one matrix multiply (trainer/model/convgemm.py);
- `compile-nchw`: `torch.compile` of the model, NCHW.

Variants join with "+": `bf16+conv-gemm` is what `auto` trains with at 224 px on a CPU with bf16.

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

# what each variant turns on (module docstring); bf16 autocast is always on for CUDA
CHOICES = {"nchw": set(), "channels-last": {"channels_last"},
           "channels-last-nosearch": {"channels_last", "nosearch"},
           "graphs": {"channels_last", "graphs"}, "compile": {"channels_last", "compile"},
           "compile-graphs": {"channels_last", "compile_graphs"},
           "plain": {"plain"}, "bf16": {"bf16", "channels_last"}, "bf16-nchw": {"bf16"},
           "conv-gemm": {"conv_gemm"}, "compile-nchw": {"compile"}}
VARIANTS = tuple(CHOICES)
CUDA_ONLY = ("graphs", "compile-graphs")


def choices_of(variant: str) -> set:
    """What `variant` turns on: one of CHOICES, or several joined by "+" ("bf16+conv-gemm")."""
    parts = variant.split("+")
    unknown = [v for v in parts if v not in CHOICES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(CHOICES)}"
                                          " (join several with +)")
    return set().union(*(CHOICES[v] for v in parts))


def _variant(text: str) -> str:
    choices_of(text)
    return text


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant: str, a) -> dict:
    """{"first_step_s", "images_per_sec", "warmup_s"} of one variant, in this process."""
    from kfvision.trainer.engine import make_sgd
    from kfvision.trainer.model.convgemm import (
        train_only_live_taps,
        use_gemm_for_single_pixel_outputs,
    )

    choices = choices_of(variant)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = "nosearch" not in choices
    layout = torch.channels_last if "channels_last" in choices else torch.contiguous_format
    model = __import__("torchvision").models.get_model(a.arch, num_classes=1000)
    model = model.to(device, memory_format=layout).train()
    live = 0
    if "conv_gemm" in choices:  # as the Trainer does (trainer/engine.py)
        use_gemm_for_single_pixel_outputs(model)
        live = train_only_live_taps(model, a.image_size)
    if "plain" in choices:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    else:
        opt = make_sgd(model, lr=0.1, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, device=device, generator=g)
    x = x.contiguous(memory_format=layout)
    y = torch.randint(0, 1000, (a.batch_size,), device=device, generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    net = model
    if choices & {"compile", "compile_graphs"}:
        net = torch.compile(model, mode="reduce-overhead" if "compile_graphs" in choices else None)
    amp = cuda or "bf16" in choices
    graphs = "graphs" in choices

    def step():
        # cache off: autocast's cast weights must not outlive a CUDA graph's capture
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp, cache_enabled=False):
            loss = loss_fn(net(x).float(), y)
        opt.zero_grad(set_to_none=not graphs)  # a graph keeps its gradient buffers
        loss.backward()
        opt.step()

    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    run = step
    if graphs:
        run = _captured(step, device)
    for _ in range(a.warmup):
        run()
    _sync(device)
    warmup = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(a.steps):
        run()
    _sync(device)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    # images per second of this process's CPU time: on a shared machine, with one thread, the
    # step's own cost whatever the other jobs take of the cores (wall time measures them too)
    return {"first_step_s": first, "warmup_s": warmup,
            "images_per_sec": a.steps * a.batch_size / seconds,
            "images_per_cpu_sec": a.steps * a.batch_size / cpu, "live_taps_convs": live,
            "one_pixel_convs": _one_pixel_convs(model, a.image_size, device)}


def _one_pixel_convs(model, image_size: int, device) -> int:
    """How many of the model's convolutions have a one-pixel output at `image_size` (what
    conv-gemm changes; 0: the choice is a no-op for this model at this size)."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.shape[-2:] == (1, 1)))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, 3, image_size, image_size, device=device))
    finally:
        for h in hooks:
            h.remove()
        model.train()
    return sum(seen)


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
           str(a.batch_size), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--threads", str(a.threads)]
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
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--variants", nargs="+", type=_variant, default=list(VARIANTS),
                   help=f"of {', '.join(VARIANTS)}, or several joined by +")
    p.add_argument("--variant-timeout", type=int, default=600,
                   help="seconds a variant's process may take")
    p.add_argument("--one", type=_variant, help=argparse.SUPPRESS)  # a variant's own process
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
