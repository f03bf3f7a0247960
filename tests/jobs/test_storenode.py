"""The node agent (pipelines/jobs/storenode.py) and its fetcher (pipelines/clients/nodefetch.py):
a 2 x 2 job whose data, model and outputs are s3:// URIs on a real S3 API server (moto's, on
loopback), each node a process of its own with the `PET_*` variables a pod gets and a scratch
folder of its own, against the same job reading the folders."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import JOB_FLAGS
from kfvision.pipelines.clients import nodefetch
from kfvision.pipelines.clients.endpoints import free_port

FLAGS = JOB_FLAGS


def test_the_fetchers_order_is_the_samplers():
    """rank_order is what the trainer's loaders draw: DistributedSampler per rank, and the
    seeded RandomSampler of one process (a fresh iterator each epoch, as with no workers)."""
    import torch
    from kfvision.trainer.data.datasets import make_loader

    data = torch.utils.data.TensorDataset(torch.arange(37))
    for world, rank in ((1, 0), (4, 0), (4, 3)):
        loader, sampler = make_loader(data, batch_size=5, workers=0, shuffle=True, seed=7,
                                      rank=rank, world_size=world)
        for epoch in (1, 2, 3):
            if sampler is not None:
                sampler.set_epoch(epoch)
            seen = [int(i) for (batch,) in loader for i in batch]
            assert seen == nodefetch.rank_order(37, world, rank, 7, epoch), (world, rank, epoch)
    assert nodefetch.node_order([[1, 2, 3], [4, 5]]) == [1, 4, 2, 5, 3]
    assert nodefetch.eval_share(10, 4, (2, 3)) == [2, 3, 6, 7]


def _upload(bucket, micro_digits, resnet18_dir) -> dict:
    bucket.upload_folder(micro_digits["train"], "data/train/")
    bucket.upload_folder(micro_digits["val"], "data/val/")
    bucket.upload_folder(resnet18_dir, "models/r18/")
    return {"train": bucket.uri("data/train"), "val": bucket.uri("data/val"),
            "model": bucket.uri("models/r18")}


def _nodes(root: Path, flags: list, *, nodes=2, nproc=2, kill_on=None) -> list:
    """Run the agent as `nodes` pods of `nproc` processes; `kill_on`: SIGKILL every node's
    process group once node 0's output has this text. Returns [(rc, output)] per node."""
    port = free_port()
    procs = []
    for i in range(nodes):
        env = {**os.environ, "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc),
               "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": "127.0.0.1",
               "PET_MASTER_PORT": str(port), "KFVISION_SCRATCH": str(root / f"node-{i}"),
               "PYTHONUNBUFFERED": "1"}
        log = open(root / f"node-{i}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "kfvision.pipelines.jobs.storenode", *flags], env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    deadline = time.monotonic() + 600
    while kill_on and time.monotonic() < deadline:
        if kill_on in (root / "node-0.log").read_text():
            for p, _ in procs:
                os.killpg(p.pid, signal.SIGKILL)
            break
        if all(p.poll() is not None for p, _ in procs):
            break
        time.sleep(0.05)
    out = []
    for i, (p, log) in enumerate(procs):
        p.wait(timeout=600)
        log.close()
        out.append((p.returncode, (root / f"node-{i}.log").read_text()))
    return out


def _local_run(tmp_path, micro_digits, resnet18_dir) -> Path:
    """The same 2 x 2 job on the folders (rendered, run by `kfvision job run-local`)."""
    from kfvision.pipelines.cli import main

    out, job = tmp_path / "local-model", tmp_path / "local.yaml"
    assert main(["job", "render", "--name", "local", "--image", "local", "--nodes", "2",
                 "--procs-per-node", "2", "--model", str(resnet18_dir), "--train",
                 str(micro_digits["train"]), "--val", str(micro_digits["val"]), "--out",
                 str(out), *FLAGS, "-o", str(job)]) == 0
    assert main(["job", "run-local", str(job), "--quiet", "--log-dir",
                 str(tmp_path / "local-logs")]) == 0
    return out


def _fetched(bucket, key: str, into: Path) -> Path:
    from kfvision.pipelines.clients import s3sync

    s3sync.fetch(bucket.uri(key), into, progress=False)
    return into


@pytest.mark.distributed
@pytest.mark.slow
def test_a_2x2_job_on_object_storage_alone_trains_the_same_model(tmp_path, s3_bucket,
                                                                  micro_digits, resnet18_dir,
                                                                  pytorchjob_2x2):
    """Same weights, bit for bit, as the job on the folders; each node fetched its ranks' share
    in epoch 1 and never an image twice; the model and no checkpoint are left in the store."""
    uris = _upload(s3_bucket, micro_digits, resnet18_dir)
    flags = ["--model", uris["model"], "--train", uris["train"], "--val", uris["val"],
             "--out", s3_bucket.uri("runs/r18-1"), *FLAGS]
    results = _nodes(tmp_path, flags)
    for rc, text in results:
        assert rc == 0, text[-4000:]
    model = _fetched(s3_bucket, "runs/r18-1/", tmp_path / "s3-model")
    local = pytorchjob_2x2["out"]
    assert (model / "weights.pt").read_bytes() == (local / "weights.pt").read_bytes()
    ours, theirs = (json.loads((m / "metrics.json").read_text()) for m in (model, local))
    assert ours["status"] == "completed"
    assert [h["val_loss"] for h in ours["history"]] == [h["val_loss"] for h in theirs["history"]]
    keys = [o["Key"] for o in s3_bucket.client.list_objects_v2(
        Bucket=s3_bucket.name, Prefix="runs/r18-1/").get("Contents", [])]
    assert not [k for k in keys if "/checkpoints/" in k], keys
    n_train = len(json.loads((micro_digits["train"] / "kfvision-imagedir.json").read_text())
                  ["images"])
    for i in range(2):
        s = json.loads((tmp_path / f"node-{i}" / "fetch-summary.json").read_text())
        share = s["share"]["train"][0]
        assert share == n_train // 2  # 40 images, 4 ranks, 2 a node
        assert s["fetched"]["1"]["train"][0] <= share + 1  # its share and one read ahead
        assert s["fetched"]["1"]["val"] == s["share"]["val"]
        assert sum(by["train"][0] for by in s["fetched"].values()) <= n_train  # none twice
        assert s["error"] is None
