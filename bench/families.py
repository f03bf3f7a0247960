"""The fast path per family: training throughput with each speed choice on and off, at 224 px.

One mid-size model of each family (FAMILY_MODELS) trains with bench/step.py's variants, each in a
process of its own (a fresh allocator and compiler state), on one batch already in memory: the
speed choices act on the training step, and the input pipeline, the same for every family, is
bench/train.py's to measure. The variants of a model:

- `plain`: the plain loop's step (bench/plain_loop.py: torch's default SGD, NCHW, fp32);
- the default: what kfvision's `auto` trains this family with on this CPU (trainer/fastpath.py:
  the CPU's features and FAMILY_CHOICES), e.g. `bf16+conv-gemm` (bf16 autocast, channels-last, one-
  pixel convolutions as GEMM) on a CPU with AVX512_BF16;
- for each choice (bf16 autocast, channels-last, conv-gemm, torch.compile) the default with that
  choice flipped, the others as they are.

A round runs every variant of a model once; rounds alternate the order (A, B, ..., B, A), so a
drift in the machine's speed favours none; torch.compile's variant runs in the first round only (it
compiles for minutes on 2 cores, with a cold compiler cache: TORCHINDUCTOR_CACHE_DIR is a fresh
folder under build/bench/), and its verdict line says after how many training images its faster
steps pay back the compilation (`payback`). A ratio is taken within a round, the table shows its
median (range) over rounds: `default/plain`, and for each choice `on/off` (the variant with it on
over the one with it off). With `--threads 1` and `--clock cpu` (the default) a figure is images
per second of the process's CPU time: on a machine other jobs share, the step's own cost.

    python -m bench.families --threads 1                         # the six families, 224 px
    python -m bench.families --archs swin_t --choices amp conv_gemm --rounds 4 --threads 1

Prints a Markdown table, then what the measurement says each family's `auto` should turn off
(a choice on by default that loses below LOSES, or breaks), beside trainer/fastpath.py's
FAMILY_CHOICES; writes both to build/bench/families-cpu.md.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench import BENCH, publish
from bench.step import _one, rate

# one mid-size model of each family measured (and ResNet-50, the default's origin)
FAMILY_MODELS = {"convnext": "convnext_tiny", "efficientnet": "efficientnet_v2_s",
                 "vision_transformer": "vit_b_16", "swin_transformer": "swin_t",
                 "regnet": "regnet_y_1_6gf", "mobilenetv3": "mobilenet_v3_large",
                 "resnet": "resnet50"}
CHOICES = ("amp", "channels_last", "conv_gemm", "compile")  # FastPath's field names
TIMEOUT = "not done in"  # bench/step.py's error for a variant over --variant-timeout
LOSES = 0.97  # an on/off ratio below this loses (the spread of rounds here is a few percent)


def variant_of(on: dict) -> str:
    """bench/step.py's variant for these choices ({choice: bool})."""
    parts = []
    if on["amp"]:
        parts.append("bf16" if on["channels_last"] else "bf16-nchw")
    elif on["channels_last"]:
        parts.append("channels-last")
    parts += [v for c, v in (("conv_gemm", "conv-gemm"), ("compile", "compile-nchw")) if on[c]]
    return "+".join(parts) or "nchw"


def defaults(family: str, image_size: int) -> dict:
    """{choice: on} of what kfvision's `auto` trains this family with on this CPU."""
    from kfvision.trainer.fastpath import auto_choices

    auto = auto_choices(family, cuda=False, image_size=image_size)
    return {**{c: auto[c][0] for c in ("amp", "channels_last", "conv_gemm")}, "compile": False}


def flips(default: dict, choices=CHOICES) -> dict:
    """{choice: (variant with it on, variant with it off)}, the other choices as by default."""
    return {c: (variant_of({**default, c: True}), variant_of({**default, c: False}))
            for c in choices}


def measure(arch: str, variants: list, gemm_flip: str, a) -> dict:
    """{variant: [figures of each round]} of `arch`, rounds in alternating order; variants with
    compile in the first round only (it compiles for minutes here); `gemm_flip` (conv-gemm's
    flip of the default) not at all where the first run found no one-pixel convolution (it would
    run the default's step)."""
    runs = {v: [] for v in variants}
    a.arch = arch
    for r in range(a.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            if r and "compile" in v:
                continue
            first = next((x[0] for x in runs.values() if x and "one_pixel_convs" in x[0]), None)
            if v == gemm_flip and first is not None and not first["one_pixel_convs"]:
                runs[v] = [{"error": "no-op (no one-pixel convolution)"}]
                continue
            runs[v].append(_one(v, a))
            print(f"{arch} round {r + 1} {v}: {runs[v][-1]}", flush=True)
    return runs


def _ratio(runs: dict, top: str, base: str, key: str) -> tuple[float, str] | str:
    """(median ratio, its range) of `top` against `base` over rounds, or why there is none."""
    for v in (top, base):  # an error other than the time limit: the variant breaks
        failed = [r["error"] for r in runs[v] if "error" in r and TIMEOUT not in r["error"]]
        if failed:
            return failed[0] if failed[0].startswith("no-op") else f"{v}: {failed[0]}"
    # zip: a first-round-only variant has one; a round where either ran out of time is left out
    ratios = sorted(t[key] / b[key] for t, b in zip(runs[top], runs[base])
                    if "error" not in t and "error" not in b)
    if not ratios:
        return f"{top} or {base} not done in time"
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
    return statistics.median(ratios), spread


def _cell(r) -> str:
    return r if isinstance(r, str) else f"{r[0]:.2f}x{r[1]}"


def verdict(r, on_by_default: bool) -> str | None:
    """Why `auto` should leave a choice off, from its on/off ratio `r`; None where it wins, ties,
    is a no-op, or is not on by default anyway."""
    if not on_by_default:
        return None
    if isinstance(r, str):
        return None if "no-op" in r or "in time" in r else f"breaks: {r}"
    return f"loses: {r[0]:.2f}x" if r[0] < LOSES else None


def payback(runs: dict, on: str, off: str, key: str = "images_per_sec") -> str | None:
    """torch.compile's cost against its gain, from the first round (compile runs in that round
    only): the first step's extra seconds (wall: the compiler's own processes are not this
    process's CPU time), the steady on/off ratio by `key`, and after how many training images the
    faster steps pay the compilation back. None where either did not run."""
    first = [runs.get(v, [{}])[0] for v in (on, off)]
    if any("error" in r or "first_step_s" not in r for r in first):
        return None
    (c, e) = first
    steady = c[key] / e[key]
    extra = c["first_step_s"] - e["first_step_s"]
    saved = 1 / e[key] - 1 / c[key]  # seconds a training image
    back = (f"pays back after {extra / saved:,.0f} images" if steady > 1.02
            else "never pays back (no faster within 2%)")
    return (f"first step {c['first_step_s']:.0f} s compiled against {e['first_step_s']:.1f} s "
            f"eager (+{extra:.0f} s wall), steady on/off {steady:.2f}x ({c[key]:.1f} against "
            f"{e[key]:.1f} {'img/cpu-s' if 'cpu' in key else 'img/s'}): {back}")


def report(arch: str, entry: dict, key: str) -> tuple[str, str]:
    """(table row, verdict line) of one model's measurement: {"default": {choice: on},
    "choices": the flipped choices, "runs": measure's}."""
    from kfvision.trainer.fastpath import FAMILY_CHOICES
    from kfvision.trainer.presets import family_of

    family, default, runs = family_of(arch), entry["default"], entry["runs"]
    dv = variant_of(default)
    plain = [r.get(key) for r in runs["plain"]]
    cells = [rate(statistics.median(plain)) if all(plain) else "failed", dv,
             _cell(_ratio(runs, dv, "plain", key))]
    ratios = {c: _ratio(runs, on, off, key)
              for c, (on, off) in flips(default, entry["choices"]).items()}
    cells += [_cell(ratios[c]) if c in ratios else "not run" for c in CHOICES]
    off = {c: why for c in ratios if (why := verdict(ratios[c], default[c]))}
    compiled = payback(runs, *flips(default)["compile"], key) if "compile" in ratios else None
    return (f"| {family} ({arch}) | " + " | ".join(cells) + " |",
            f"- {family}: the measurement turns off {off or 'nothing'}; FAMILY_CHOICES now: "
            f"{FAMILY_CHOICES.get(family, {}) or 'nothing'}"
            + (f"; torch.compile: {compiled}" if compiled else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--archs", nargs="+", default=[m for f, m in FAMILY_MODELS.items()
                                                  if f != "resnet"])
    p.add_argument("--choices", nargs="+", choices=CHOICES, default=list(CHOICES),
                   help="the choices flipped (compile: minutes of compilation per model here)")
    p.add_argument("--tag", default="", help="added to the result files' names")
    p.add_argument("--report", nargs="+", help="only the tables of these results (.json) files")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="images per second of the process's CPU time (with --threads 1: the "
                   "step's cost, whatever else runs) or of wall time")
    p.add_argument("--variant-timeout", type=int, default=900,
                   help="seconds a variant's process may take")
    a = p.parse_args(argv)
    a.device = "cpu"
    key = "images_per_cpu_sec" if a.clock == "cpu" else "images_per_sec"
    from kfvision.trainer.presets import family_of

    rows = [f"| family (model), {a.image_size} px, batch {a.batch_size} | plain img/{a.clock} s "
            "| kfvision default | default/plain |" + "".join(f" {c} on/off |" for c in CHOICES),
            "|---" * (4 + len(CHOICES)) + "|"]
    results = {}
    if "compile" in a.choices and not a.report:  # a cold compiler cache, as a first run has
        BENCH.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=BENCH)
    if a.report:  # tables of earlier runs' figures
        for f in a.report:
            results.update(json.loads(Path(f).read_text()))
    for arch in ([] if a.report else a.archs):
        default = defaults(family_of(arch), a.image_size)
        pairs = flips(default, a.choices)
        variants = list(dict.fromkeys(["plain", variant_of(default),
                                       *(v for pair in pairs.values() for v in pair)]))
        gemm_flip = next((v for v in pairs.get("conv_gemm", ()) if v != variant_of(default)),
                         None)
        results[arch] = {"default": default, "choices": list(pairs),
                         "runs": measure(arch, variants, gemm_flip, a)}
        BENCH.mkdir(parents=True, exist_ok=True)  # kept as it goes: a stopped run keeps it
        (BENCH / f"families-cpu{a.tag}.json").write_text(json.dumps(results))
    lines = [report(arch, entry, key) for arch, entry in results.items()]
    rows += [r for r, _ in lines]
    verdicts = [v for _, v in lines]
    note = (f"\n{a.steps} timed steps after {a.warmup + 1} untimed ones, {a.threads or 'default'} "
            f"torch thread(s), images per {a.clock} second, {a.rounds} rounds in "
            "alternating order, each variant in its own process; a ratio is taken within a round, "
            f"the table shows its median (range) over rounds; a choice loses below {LOSES}x. "
            "A choice `auto` never turns on (torch.compile) is measured, not decided. bf16 on "
            "a CPU without AMX or AVX512_BF16 is emulated (trainer/fastpath.py never picks it "
            "there).")
    publish("\n".join(rows) + "\n" + note + "\n\n" + "\n".join(verdicts),
            f"families-cpu{a.tag}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
