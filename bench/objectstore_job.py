"""bench.objectstore's job part: the built-in trainer as a 2-node x 1-process PyTorchJob under
`kfvision job run-local`, reading s3:// (the node agent fetches into each node's scratch folder)
against the same job reading the local image directory.

The model: resnet18 at 64 px (`--image-size`), batch 64. At 224 px an epoch of 20,000 images
takes over ten minutes on 2 cores (about 30 images/s, docs/benchmarks.md "Training: the JPEG
set"); at 64 px the convolutions cost a twelfth, so the epoch takes minutes and the per-image
input work (reading and decoding a 500 x 375 JPEG) is a large share of it: the input path is what
is compared, and a heavier model would hide it. `--print-freq 1`: every step logs a line, so
the first one is seen.

Measured per job: epoch 1's `train_images_per_sec` (metrics.json's history), seconds from the
run-local's start to the first step line of the Master's log, the object bytes the server
served until the end of epoch 1 and over the run (both nodes together; per node from the node
agent's summary, see node_summary), and the peak size of each node's scratch folder (sampled
every 0.5 s).
"""

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from kfvision.pipelines.contract import SCRATCH_MOUNT
from kfvision.pipelines.jobs.storenode import SUMMARY

FIRST_STEP = re.compile(r"epoch 1 \[\s*1/")
EPOCH_1_DONE = re.compile(r"epoch 1 done:")
TRAIN_FLAGS = ["--batch-size", "64", "--print-freq", "1"]  # and --image-size (64 by default)


def node_summary(scratch: Path) -> dict | None:
    """What the node agent says its node fetched (its SUMMARY file in the scratch folder:
    [objects, bytes] by the ranks' epoch and channel): bytes in epoch 1, over the run, and epoch
    1's share of this node's ranks; None where there is no summary (the local job)."""
    path = scratch / SUMMARY
    if not path.exists():
        return None
    s = json.loads(path.read_text())
    by_epoch = {int(e): sum(row[1] for row in chans.values()) for e, chans in s["fetched"].items()}
    return {"epoch_1_bytes": by_epoch.get(1, 0), "run_bytes": sum(by_epoch.values()),
            "share_bytes": sum(row[1] for row in s["share"].values())}


def _folder_size(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        with contextlib.suppress(OSError):  # the agent removes files as it goes
            total += p.stat().st_size if p.is_file() else 0
    return total


class Watch(threading.Thread):
    """Samples a running job every 0.5 s: when the Master's log shows the first step and the
    end of epoch 1 (the server's counts then), and each node's scratch folder's peak size."""

    def __init__(self, logs: Path, store, start: float):
        super().__init__(daemon=True)
        self.logs, self.store, self.start_t = logs, store, start
        self.first_step_s = None
        self.epoch_1 = None
        self.peak: dict = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.sample()

    def sample(self) -> None:
        master = self.logs / "master-0.log"
        text = master.read_text(errors="replace") if master.exists() else ""
        if self.first_step_s is None and FIRST_STEP.search(text):
            self.first_step_s = time.monotonic() - self.start_t
        if self.epoch_1 is None and EPOCH_1_DONE.search(text):
            self.epoch_1 = self.store.usage()
        for scratch in (self.logs / "pods").glob(f"*/{SCRATCH_MOUNT.lstrip('/')}"):
            node = scratch.parent.name
            self.peak[node] = max(self.peak.get(node, 0), _folder_size(scratch))


def run_job(name: str, manifest: Path, logs: Path, store, out) -> dict:
    """Run one rendered job under run-local to its end, watched; what it measured."""
    before = store.usage()
    start = time.monotonic()
    watch = Watch(logs, store, start)
    watch.start()
    proc = subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "job", "run-local",
                           str(manifest), "--log-dir", str(logs), "--quiet"], env=store.env,
                          capture_output=True, text=True)
    seconds = time.monotonic() - start
    watch.stop.set()
    watch.join()
    watch.sample()
    if proc.returncode:
        raise SystemExit(f"the {name} job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    after = store.usage()
    metrics = _metrics(store, out)
    epoch_1 = watch.epoch_1 or after
    return {"seconds": seconds, "first_step_s": watch.first_step_s,
            "epoch_1_images_per_s": metrics["history"][0]["train_images_per_sec"],
            "history": [h["train_images_per_sec"] for h in metrics["history"]],
            "served_epoch_1": epoch_1["object_bytes"] - before["object_bytes"],
            "served_run": after["object_bytes"] - before["object_bytes"],
            "server_cpu_s": after["server_cpu_s"] - before["server_cpu_s"],
            "peak_scratch": watch.peak,
            "per_node": {node: node_summary(logs / "pods" / node / SCRATCH_MOUNT.lstrip("/"))
                         for node in watch.peak}}


def _metrics(store, out) -> dict:
    if isinstance(out, Path):
        return json.loads((out / "metrics.json").read_text())
    import boto3

    bucket, _, key = out[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=store.url, region_name="us-east-1",
                          aws_access_key_id=store.env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=store.env["AWS_SECRET_ACCESS_KEY"])
    return json.loads(client.get_object(Bucket=bucket, Key=key + "metrics.json")["Body"].read())


def _render(name: str, paths: dict, args, manifest: Path, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "job", "render", "--name",
                    name, "--image", "local", "--nodes", "2", "--nproc-per-node", "1",
                    *(a for k, v in paths.items() for a in (f"--{k}", str(v))),
                    "--epochs", str(args.epochs), "--image-size", str(args.image_size),
                    *TRAIN_FLAGS, *shlex.split(args.job_flags), "-o", str(manifest)],
                   env=env, check=True, capture_output=True, text=True)


def run_jobs(args, store, train: Path, val: Path, train_uri: str) -> dict:
    """The local-folder job, then the s3:// one."""
    from kfvision.pipelines.clients.s3sync import push
    from kfvision.trainer.data.imagedir import MANIFEST

    work = args.work / "job"
    model = work / "model"
    subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "model", "resnet",
                    str(model), "--name", "resnet18"], check=True, capture_output=True)
    local = {"train": train, "val": val, "model": model, "out": work / "out-local"}
    _render("bench-local", local, args, work / "local.yaml", store.env)
    jobs = {"local": run_job("bench-local", work / "local.yaml", work / "logs-local", store,
                             local["out"])}
    bucket = train_uri.split("/")[2]
    remote = {"train": train_uri, "val": f"s3://{bucket}/val/",
              "model": f"s3://{bucket}/models/r18/", "out": f"s3://{bucket}/runs/bench-s3/"}
    saved = dict(os.environ)
    os.environ.update(store.env)  # push runs here, against the bench's server
    try:
        push(val, remote["val"], last=MANIFEST)
        push(model, remote["model"], last="spec.json")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _render("bench-s3", remote, args, work / "s3.yaml", store.env)
    jobs["s3"] = run_job("bench-s3", work / "s3.yaml", work / "logs-s3", store, remote["out"])
    return jobs


def job_table(jobs: dict) -> str:
    rows = ["| job, 2 nodes x 1 process | epoch-1 images/s (later epochs) | x local | first "
            "step s | served in epoch 1 / over the run, MB | per node: epoch 1 / run, MB | "
            "peak scratch per node, MB | server CPU s | whole job s |",
            "|---|---|---|---|---|---|---|---|---|"]
    local = jobs["local"]["epoch_1_images_per_s"]
    for name, j in jobs.items():
        per_node = ", ".join(f"{n}: {s['epoch_1_bytes'] / 1e6:.0f} / {s['run_bytes'] / 1e6:.0f}"
                             f" (share {s['share_bytes'] / 1e6:.0f})" if s else f"{n}: n/a"
                             for n, s in j["per_node"].items()) or "-"
        peak = ", ".join(f"{n}: {b / 1e6:.0f}" for n, b in j["peak_scratch"].items()) or "-"
        first = "-" if j["first_step_s"] is None else f"{j['first_step_s']:.1f}"
        rows.append(
            f"| {name} | {j['epoch_1_images_per_s']:.1f} "
            f"({', '.join(f'{x:.1f}' for x in j['history'][1:])}) | "
            f"{j['epoch_1_images_per_s'] / local:.2f}x | {first} | "
            f"{j['served_epoch_1'] / 1e6:.0f} / {j['served_run'] / 1e6:.0f} | {per_node} | {peak} "
            f"| {j['server_cpu_s']:.1f} | {j['seconds']:.0f} |")
    rows.append("\nGoal: the s3:// job's epoch-1 throughput >= 0.9x the local folder's.")
    return "\n".join(rows)
