"""A job that loses processes and resumes ends bit for bit where an unbroken run ends (on CPU),
tried as a user would: `kfvision job render` and `kfvision job run-local` in a subprocess, and a
SIGKILL from outside the project's own fault drill, to processes found by their environment
(/proc/PID/environ; a training process the launcher forked, by its name: trainer/forked.py), at a
step of epoch 2 of 3 and again, after the resume, at a step of epoch 3 (one drill per kind: each
resume is its own case, and a resumed job is resumed again).
2 nodes x 2 processes: with 2 processes a sum of
two gradients is the same in either order, so only 3 or more show a reduction done in another order
(DDP buckets a new wrapper's first backward differently from every later one: see
trainer/distributed.py, wrap_model, and tests/trainer/test_gloo_group.py, which shows it in
three processes).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.paths import REPO
from helpers.procs import with_env
from helpers.runs import JOB_FLAGS, weight_differences

from kfvision.trainer.forked import local_rank_of

TIMING = ("train_seconds", "train_images_per_sec")
MARK = "KFVISION_RESUME_TEST"  # set in every pod of a test job: how its processes are found


def _cli(*args, check=True) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", *map(str, args)],
                         cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert not check or run.returncode == 0, run.stdout + run.stderr
    return run


def _render(root: Path, data: dict, model: Path, name: str, kind: str) -> Path:
    """The job's manifest, with MARK=name in the environment of every pod."""
    manifest = root / f"{name}.yaml"
    # each fault restarts both pods: 2 restarts of a PyTorchJob's replicas together per fault (a
    # TrainJob's runtime counts the restarts of the whole job)
    backoff = ["--backoff-limit", str(2 * len(FAULTS[kind]))] if kind == "pytorchjob" else []
    _cli("job", "render", "--kind", kind, "--name", name, "--image", "local", "--model", model,
         "--train", data["train"], "--val", data["val"], "--out", root / name, "--nodes", "2",
         "--procs-per-node", "2", *JOB_FLAGS, *backoff,
         "-o", manifest)
    doc = yaml.safe_load(manifest.read_text())

    def mark(node):  # a container (PyTorchJob) or spec.trainer (TrainJob): what has a command
        if isinstance(node, dict):
            if "command" in node:
                node.setdefault("env", []).append({"name": MARK, "value": name})
            for v in node.values():
                mark(v)
        elif isinstance(node, list):
            for v in node:
                mark(v)

    mark(doc)
    manifest.write_text(yaml.safe_dump(doc))
    return manifest


def _parent(pid: str) -> str:
    try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def find_processes(job: str, node: int, local_rank: int | None) -> list:
    """Pids of `job`'s pod of node rank `node` (the launcher and its processes), or only of its
    training process of `local_rank` (not the DataLoader workers under it, which inherit it)."""
    pod = with_env(**{MARK: job, "PET_NODE_RANK": str(node)})
    if local_rank is None:
        return [int(p) for p in pod]
    return [int(p) for p in pod if local_rank_of(int(p)) == local_rank
            and (not _parent(p) or local_rank_of(int(_parent(p))) is None)]


def run_job(manifest: Path, logs: Path, faults=()) -> tuple:
    """`kfvision job run-local manifest`, which must succeed; each fault = (targets, log
    pattern), in turn: SIGKILL the processes of every target (node, local rank or None for the
    whole pod) at once, when a log line written since the previous fault matches. Returns (pids
    killed by each fault, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kfvision.pipelines.cli", "job", "run-local",
                             str(manifest), "--log-dir", str(logs), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, todo, seen = [], list(faults), {}  # seen: each log's length at the last fault
    try:
        while todo and proc.poll() is None:
            targets, pattern = todo[0]
            texts = {p: p.read_text(errors="replace") for p in logs.glob("*.log")}
            if any(re.search(pattern, text[seen.get(p, 0):]) for p, text in texts.items()):
                seen = {p: len(text) for p, text in texts.items()}
                pids = []
                for node, local_rank in targets:  # found first, then killed together
                    found = find_processes(manifest.stem, node, local_rank)
                    assert found, f"no process of node {node} / local rank {local_rank} found"
                    pids += found
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):  # a launcher's child went first
                        os.kill(pid, signal.SIGKILL)
                killed.append(pids)
                todo.pop(0)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:  # the test failed waiting: stop the job as Ctrl-C does, no orphans
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert not todo, f"the job ended before these faults: {todo}"
    return killed, time.monotonic() - start


def _history(out: Path) -> list:
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["status"] == "completed"
    return [{k: v for k, v in h.items() if k not in TIMING} for h in doc["history"]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, micro_digits, resnet18_dir, pytorchjob_2x2) -> dict:
    """The data, and the unbroken 2 x 2 PyTorchJob of helpers.runs.run_job (the same flags) that
    every case must end like."""
    assert pytorchjob_2x2["rc"] == 0
    return {"root": tmp_path_factory.mktemp("resume_exact"), "data": micro_digits,
            "model": resnet18_dir, "out": pytorchjob_2x2["out"]}


# Per kind, faults in one run, each once the previous one's resume is under way: the later one
# hits a job that has already resumed. Each epoch is 3 steps. What each fault kills, as (node,
# local rank or None: the whole pod):
FAULTS = {
    "pytorchjob": [
        ([(1, 0)], r"epoch 2 \[2/3\]"),  # the Worker's local rank 0: its DDP buckets start anew
        # at once: the Master's process (global rank 0, which writes checkpoints) at its first
        # step after one, and the whole Worker pod (both processes and the launcher)
        ([(0, 0), (1, None)], r"epoch 3 \[1/3\]"),
    ],
    "trainjob": [
        ([(1, 0)], r"epoch 2 \[2/3\]"),  # the same in a TrainJob
        ([(0, 0)], r"epoch 3 \[1/3\]"),
    ],
}
# What `make test` runs: the PyTorchJob's drill, which holds every fault. The TrainJob's is
# `stress`: what differs with the kind is what restarts (every node, under the runtime's failure
# policy), and tests/jobs/test_trainjob_local.py::test_a_killed_node_restarts_every_node_under_
# kfvision_torch checks that; the resume itself is the trainer's, the same code in either kind.
KINDS = ["pytorchjob", pytest.param("trainjob", marks=pytest.mark.stress)]
# The logs of node 0's and node 1's pod (a TrainJob's are named as the JobSet's pods: node-0-<node>)
PODS = {"pytorchjob": ("master-0", "worker-0"), "trainjob": ("node-0-0", "node-0-1")}


def _progress(log: str, prefix: str) -> list:
    """The metrics part of each progress line starting with `prefix` (no time, no img/s)."""
    return [line.split("  ")[1:4] for line in log.splitlines() if prefix in line]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", KINDS)
def test_a_job_killed_from_outside_in_epoch_2_and_3_ends_bit_for_bit_as_an_unbroken_one(
        setup, kind):
    name = f"{kind}-killed"
    root = setup["root"]
    manifest = _render(root, setup["data"], setup["model"], name, kind)
    killed, seconds = run_job(manifest, root / f"logs-{name}", faults=FAULTS[kind])
    print(f"{name}: killed pids {killed} ({FAULTS[kind]}); {seconds:.1f} s")
    logs = {p.stem: p.read_text() for p in (root / f"logs-{name}").glob("*.log")}
    first, second = (logs[pod] for pod in PODS[kind])
    # the fault in epoch 2 resumes from epoch 1's end, each one in epoch 3 from epoch 2's
    for epoch, times in ((1, 1), (2, len(FAULTS[kind]) - 1)):
        resumed = f"resuming from {root / name / 'checkpoints' / f'epoch-000{epoch}.pt'}"
        assert first.count(resumed) == times, (epoch, times)
    # the pod whose process was killed exits 137, the other one, which lost its peer, 200
    assert "[kfvision launch] exiting with 137" in second
    assert "[kfvision launch] exiting with 200" in first
    # every pod went down and came back, once for each fault
    assert all(log.count("--- restart") >= len(FAULTS[kind]) for log in logs.values())
    # the work lost is part of an epoch, never a whole one: epoch 1 ran once, and epoch 2's
    # first step, run again after the first fault, gave what it gave before
    assert first.count("epoch 1 done") == 1
    before, again = _progress(first, "epoch 2 [1/3]")
    assert before == again
    doc = json.loads((root / name / "metrics.json").read_text())
    assert doc["resumed_from"] == [1, 2]  # the checkpoints the weights descend from
    a, b = (torch.load(out / "weights.pt", weights_only=True) for out in (setup["out"],
                                                                          root / name))
    differ = weight_differences(a, b)
    # every figure of every epoch, to the last bit, then every tensor of weights.pt
    assert _history(root / name) == _history(setup["out"]), f"weights: {differ or 'equal'}"
    assert differ == "", differ
