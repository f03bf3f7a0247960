"""A user's own script through kfvision, against the same script started by hand, in one run.

Three figures (their goals in brackets):

- wall time of `kfvision job run-local` of the rendered 2 x 2 PyTorchJob (2 pods, 2 processes
  each) against two `torchrun --nnodes 2 --nproc-per-node 2` started by hand on the same script
  with the same arguments and the same interpreter and requirements (its cached environment),
  rounds alternating [overhead at most max(10 %, 5 s)]; the script is tests/script/styles/
  torchrun_ddp/train.py (DDP over gloo, a linear classifier on scikit-learn's digits as PNG class
  folders; it imports a requirement, `inflection`, that the image lacks);
- packing a tree of `--files` small files [2,000 files under 1 s];
- a second run's environment setup with the requirements cached: `ensure_env` alone, and the
  boot's whole preparation (unpack + environment) as its "ready in" line reports it [under 2 s].

    python -m bench.script [--rounds 3] [--epochs 3] [--files 2000] [--work build/bench-script]

The table is printed and written to build/bench/script-cpu.md.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kfvision.pipelines.clients.endpoints import free_port
from kfvision.pipelines.contract import ENV_CACHE
from kfvision.pipelines.script.env import ensure_env
from kfvision.pipelines.script.requirements import read
from kfvision.pipelines.script.snapshot import pack
from kfvision.trainer.fastpath import describe_cpu

from bench import publish

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "script" / "styles" / "torchrun_ddp"


def prepare(work: Path) -> Path:
    from kfvision.pipelines.flow.demo import (
        write_digits,  # scikit-learn's digits as PNG class folders
    )

    data = work / "digits"
    if not (data / "train").is_dir():
        write_digits(data, limit=60)
    return data / "train"


def hand_torchrun(python: Path, script_args: list, env: dict, work: Path) -> float:
    """Two torchrun (node 0 and 1) on a copy of the script, its folders given as the boot would
    give them (the script writes its checkpoint and model there)."""
    src = work / "hand"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(SCRIPT, src / "src")
    # the folders as the boot gives them; no GPU visible, as in a pod that asked for none
    env = {**env, "KFVISION_CHECKPOINT_DIR": str(src / "ckpt"), "KFVISION_MODEL_DIR":
           str(src / "model"), "CUDA_VISIBLE_DEVICES": ""}
    (src / "ckpt").mkdir()
    port = free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([str(python), "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc-per-node", "2", "--node-rank", str(rank),
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "train.py", *script_args], cwd=src / "src", env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for rank in (0, 1)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"the hand-started torchrun failed: {codes}")
    return time.monotonic() - start


def run_local(manifest: Path, logs: Path, env: dict) -> tuple:
    """(wall seconds, the boot's 'ready in' seconds of the Master)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "job", "run-local",
                           str(manifest), "--log-dir", str(logs), "--quiet"], env=env,
                          capture_output=True, text=True)
    took = time.monotonic() - start
    if proc.returncode:
        raise SystemExit(f"run-local failed:\n{proc.stderr}")
    ready = re.search(r"ready in ([0-9.]+) s", (logs / "master-0.log").read_text())
    return took, float(ready.group(1))


def make_tree(root: Path, files: int) -> Path:
    if root.exists():
        shutil.rmtree(root)
    for i in range(files):
        path = root / f"pkg{i % 40:02d}" / f"mod{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# module {i}\n" + f"VALUE_{i} = {i}\n" * 60)
    return root


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each measurement")
    p.add_argument("--epochs", type=int, default=3, help="epochs the script trains")
    p.add_argument("--files", type=int, default=2000, help="files in the packed tree")
    p.add_argument("--work", default="build/bench-script", help="scratch folder")
    args = p.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, ENV_CACHE: str(work / "envs"), "PYTHONPATH": str(REPO)}
    os.environ[ENV_CACHE] = env[ENV_CACHE]
    data = prepare(work)
    script_args = ["--data", str(data), "--epochs", str(args.epochs), "--tag", "Bench"]
    manifest = work / "job.yaml"
    subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "job", "render", "--name",
                    "bench",
                    "--image", "local", "--nodes", "2", "--nproc-per-node", "2", "--source",
                    str(SCRIPT), "--entry", "train.py", "-o", str(manifest), "--", *script_args],
                   env=env, check=True, capture_output=True)
    python = ensure_env(read(SCRIPT / "requirements.txt", SCRIPT), work / "envs",
                        "requirements.txt", say=lambda s: None)
    run_local(manifest, work / "logs", env)  # warm-up: the page cache, the environment
    hand, ours, ready, loads = [], [], [], []
    for i in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate who goes first
            if which == 0:
                hand.append(hand_torchrun(python, script_args, env, work))
            else:
                took, boot_ready = run_local(manifest, work / "logs", env)
                ours.append(took)
                ready.append(boot_ready)
    tree = make_tree(work / "tree", args.files)
    packing, snap = [], None
    for _ in range(args.rounds):
        t = time.monotonic()
        snap = pack(tree)
        packing.append(time.monotonic() - t)
    cached = []
    for _ in range(args.rounds):
        t = time.monotonic()
        ensure_env(read(SCRIPT / "requirements.txt", SCRIPT), work / "envs", "requirements.txt",
                   say=lambda s: None)
        cached.append(time.monotonic() - t)
    h, o = statistics.median(hand), statistics.median(ours)
    goal = max(0.10 * h, 5.0)
    rows = [
        ("torchrun by hand, 2 x 2 (median)", f"{h:.2f} s", ", ".join(f"{x:.2f}" for x in hand)),
        ("kfvision job run-local, 2 x 2 (median)", f"{o:.2f} s",
         ", ".join(f"{x:.2f}" for x in ours)),
        ("overhead", f"{o - h:+.2f} s ({(o - h) / h:+.0%})",
         f"goal: at most {goal:.1f} s, {'met' if o - h <= goal else 'NOT met'}"),
        (f"pack {args.files} files ({snap.size:,} bytes)", f"{statistics.median(packing):.3f} s",
         "goal: under 1 s, " + ("met" if statistics.median(packing) < 1 else "NOT met")),
        ("cached requirements: ensure_env", f"{statistics.median(cached) * 1000:.1f} ms",
         "goal: under 2 s, " + ("met" if statistics.median(cached) < 2 else "NOT met")),
        ("cached: the boot's whole preparation (unpack + env), Master",
         f"{statistics.median(ready):.2f} s",
         ", ".join(f"{x:.2f}" for x in ready)),
    ]
    text = "\n".join([f"{describe_cpu()}; Python {sys.version.split()[0]}; {args.rounds} "
                      f"round(s) (order alternating), {args.epochs} epoch(s) of "
                      f"{SCRIPT.name}/train.py; load average at each round's start: "
                      f"{', '.join(f'{x:.1f}' for x in loads)}", "",
                      "| measurement | value | rounds / goal |", "|---|---|---|",
                      *(f"| {a} | {b} | {c} |" for a, b, c in rows)])
    publish(text, "script-cpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
