"""kfvision's programs from start to exit, with the heap frozen (trainer/heap.py) and without, in
one run.

The processes torchrun, a job and a pipeline start most: a trainer (`python -m
kfvision.trainer.train`, 1 epoch of 40 digits at 32 px), `kfvision score` of its model (10 images),
and a one-node torchrun job of 2 trainers (`python -m kfvision.trainer.launch --standalone
--nproc-per-node 2`). Each is timed from start to exit and from its last line of output to exit (the
end: what freezing the heap shortens), rounds alternating which goes first. The baseline is the same
command with kfvision.trainer.heap's two functions made no-ops (a sitecustomize on PYTHONPATH), so
that both run the same code otherwise. A last row times the same torchrun job with its trainers
forked from the launcher (its default on a CPU: trainer/forked.py) against the same job with each
trainer exec'd as a new interpreter, as torchrun starts them (`--no-python python -u -m ...`).

    python -m bench.startup [--rounds 5] [--work build/bench-startup]

The table is printed and written to build/bench/startup-cpu.md.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import publish

REPO = Path(__file__).resolve().parent.parent
# what the baseline runs first: kfvision.trainer.heap as if it were not there
NO_FREEZE = ("import kfvision.trainer.heap as heap\n"
             "heap.freeze_imports = heap.freeze_at_exit = lambda: None\n")


def prepare(work: Path) -> dict:
    """40 training and 10 validation digits, converted, and an untrained resnet18."""
    from kfvision.pipelines.flow.demo import write_digits
    from kfvision.trainer.data.convert import convert
    from kfvision.trainer.data.imagedir import MANIFEST
    from kfvision.trainer.model.arch import write_untrained_model
    from kfvision.trainer.model.spec import SPEC_FILE

    paths = {split: work / split for split in ("train", "val")}
    if not all((p / MANIFEST).exists() for p in paths.values()):
        write_digits(work / "raw", limit=5)
        for split, path in paths.items():
            convert(work / "raw" / split, path, progress=False, overwrite=True)
    paths["model"] = work / "resnet18"
    if not (paths["model"] / SPEC_FILE).exists():
        write_untrained_model(paths["model"], "resnet18")
    (work / "no-freeze").mkdir(exist_ok=True)
    (work / "no-freeze" / "sitecustomize.py").write_text(NO_FREEZE)
    return paths


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list, env: dict) -> tuple:
    """(seconds from start to exit, seconds from the last line of output to exit, CPU seconds
    of the process and every process it waited for)."""
    cpu, start = _children_cpu(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    last, lines = start, []
    for line in proc.stdout:
        last = time.monotonic()
        lines.append(line)
    code = proc.wait()
    end = time.monotonic()
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({code}):\n{''.join(lines[-20:])}")
    return end - start, end - last, _children_cpu() - cpu


def commands(paths: dict, work: Path) -> dict:
    train = ["--model", str(paths["model"]), "--train", str(paths["train"]), "--val",
             str(paths["val"]), "--epochs", "1", "--image-size", "32", "--batch-size", "4",
             "--workers", "0"]
    py = sys.executable
    return {
        "trainer (python -m kfvision.trainer.train)": [py, "-m", "kfvision.trainer.train", *train,
                                                       "--out",
                                              str(work / "model")],
        "kfvision score": [py, "-m", "kfvision.pipelines.cli", "score", "--model",
                           str(work / "model"),
                           "--data", str(paths["val"]), "--out", str(work / "scored.csv"),
                           "--quiet"],
        "torchrun job, 1 node x 2 (python -m kfvision.trainer.launch)": [
            py, "-m", "kfvision.trainer.launch", "--standalone", "--nproc-per-node", "2", "-m",
            "kfvision.trainer.train", *train, "--out", str(work / "model-2")],
    }


# Rows whose baseline is another command, heap frozen on both sides: the same torchrun job with
# each trainer exec'd as a new interpreter, as torchrun starts them (`--no-python` running
# `python -u -m kfvision.trainer.train`), against the launcher's default on a CPU, forked
# (trainer/forked.py)
EXECD = "torchrun job, 1 node x 2: trainers forked (baseline: exec'd)"


def execd_launch(paths: dict, work: Path) -> tuple:
    """(baseline argv, kfvision argv) of the EXECD row."""
    forked = commands(paths, work)["torchrun job, 1 node x 2 (python -m kfvision.trainer.launch)"]
    at = forked.index("-m", 3)  # torchrun's -m, before the trainer's module
    return forked[:at] + ["--no-python", sys.executable, "-u"] + forked[at:], forked


def _row(name: str, baseline: tuple, kfvision: tuple, rounds: int, loads: list) -> str:
    """The table's row of `name`: (argv, env) of each side, `rounds` rounds alternating which
    goes first, medians; each round's load average appended to `loads`."""
    got = {"baseline": [], "kfvision": []}
    sides = {"baseline": baseline, "kfvision": kfvision}
    for i in range(rounds):
        loads.append(os.getloadavg()[0])
        for who in (("baseline", "kfvision") if i % 2 == 0 else ("kfvision", "baseline")):
            got[who].append(timed(*sides[who]))
    b, k = ([statistics.median(x[j] for x in got[who]) for j in (0, 1, 2)]
            for who in ("baseline", "kfvision"))
    return (f"| {name} | {b[0]:.2f} / {b[1]:.2f} | {k[0]:.2f} / {k[1]:.2f} | "
            f"{b[0] / k[0]:.2f}x | {b[0] - k[0]:.2f} s | {b[2]:.2f} / {k[2]:.2f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=5, help="rounds of each measurement")
    p.add_argument("--work", default="build/bench-startup", help="scratch folder")
    args = p.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    paths = prepare(work)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    envs = {"baseline": {**env, "PYTHONPATH": str(work / "no-freeze")}, "kfvision": env}
    rows, loads = [], []
    cmds = commands(paths, work)
    timed(cmds["trainer (python -m kfvision.trainer.train)"], env)  # warm-up; score needs its model
    for name, argv_ in cmds.items():
        rows.append(_row(name, (argv_, envs["baseline"]), (argv_, env), args.rounds, loads))
    execd, forked = execd_launch(paths, work)
    rows.append(_row(EXECD, (execd, env), (forked, env), args.rounds, loads))
    text = "\n".join([
        f"Python {sys.version.split()[0]}; {args.rounds} rounds each (order alternating), "
        f"medians; load average at each round's start: {min(loads):.1f} to {max(loads):.1f}", "",
        "| program | baseline: start to exit / last line to exit, s | kfvision, s | whole run, "
        "baseline / kfvision | saved | CPU s, baseline / kfvision |", "|---|---|---|---|---|---|",
        *rows])
    publish(text, "startup-cpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
