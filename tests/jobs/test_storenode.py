"""The node agent (pipelines/jobs/storenode.py) and its fetcher (pipelines/clients/nodefetch.py):
a 2 x 2 job whose data, model and outputs are s3:// URIs on a real S3 API server (moto's, on
loopback), each node a process of its own with the `PET_*` variables a pod gets and a scratch
folder of its own, against the same job reading the folders."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import kill_with_env
from helpers.runs import JOB_FLAGS

from kfvision.pipelines.clients import fetchplan, nodefetch
from kfvision.pipelines.clients.endpoints import free_port

FLAGS = JOB_FLAGS


def test_the_fetchers_order_is_the_samplers():
    """rank_order is what the trainer's loaders draw, for one process or several."""
    from kfvision.trainer.data.datasets import make_loader
    from kfvision.trainer.data.draws import split_key

    class Indices(list):  # what the dataset was asked for, as the trainer's datasets read it
        def __getitem__(self, item):
            return (split_key(item)[0],)

    data = Indices(range(37))
    for world, rank in ((1, 0), (4, 0), (4, 3)):
        loader, sampler = make_loader(data, batch_size=5, workers=0, shuffle=True, seed=7,
                                      rank=rank, world_size=world)
        for epoch in (1, 2, 3):
            sampler.set_epoch(epoch)
            seen = [int(i) for (batch,) in loader for i in batch]
            assert seen == fetchplan.rank_order(37, world, rank, 7, epoch), (world, rank, epoch)
    assert fetchplan.node_order([[1, 2, 3], [4, 5]]) == [1, 4, 2, 5, 3]
    assert fetchplan.eval_share(10, 4, (2, 3)) == [2, 3, 6, 7]


def _upload(bucket, micro_digits, resnet18_dir) -> dict:
    bucket.upload_folder(micro_digits["train"], "data/train/")
    bucket.upload_folder(micro_digits["val"], "data/val/")
    bucket.upload_folder(resnet18_dir, "models/r18/")
    return {"train": bucket.uri("data/train"), "val": bucket.uri("data/val"),
            "model": bucket.uri("models/r18")}


def _nodes(root: Path, flags: list, *, nodes=2, nproc=2, kill_on=None, env=None) -> list:
    """Run the agent as `nodes` pods of `nproc` processes, each with a scratch folder of its own
    under `root`; `kill_on(node 0's output)`: SIGKILL every node's processes once it is true.
    Returns [(rc, output)] per node."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for i in range(nodes):
        env = {**os.environ, **(env or {}), "PET_NNODES": str(nodes),
               "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(i),
               "PET_MASTER_ADDR": "127.0.0.1",
               "PET_MASTER_PORT": str(port), "KFVISION_SCRATCH": str(root / f"node-{i}"),
               "PYTHONUNBUFFERED": "1"}
        log = open(root / f"node-{i}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "kfvision.pipelines.jobs.storenode", *flags], env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    deadline = time.monotonic() + 600
    while kill_on and time.monotonic() < deadline:
        if kill_on((root / "node-0.log").read_text()):
            for i in range(nodes):  # the agent, the launcher (a session of its own), trainers
                kill_with_env(KFVISION_SCRATCH=str(root / f"node-{i}"))
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


def _fetched(bucket, key: str, into: Path) -> Path:
    from kfvision.pipelines.clients import s3sync

    s3sync.fetch(bucket.uri(key), into, progress=False)
    return into


@pytest.mark.distributed
@pytest.mark.slow
def test_a_2x2_job_on_object_storage_alone_trains_the_same_model(tmp_path, s3_bucket,
                                                                  micro_digits, resnet18_dir,
                                                                  pytorchjob_2x2):
    """Same weights, bit for bit, as the job on the folders, every loading option at its default
    (there: cached, no workers; here: uncached, a worker a process); each node fetched its ranks'
    share in epoch 1 and never an image twice; the model and no checkpoint are left in the
    store."""
    from kfvision.pipelines.cli import main

    uris = _upload(s3_bucket, micro_digits, resnet18_dir)
    job, logs = tmp_path / "job.yaml", tmp_path / "logs"
    assert main(["job", "render", "--name", "r18", "--image", "local", "--nodes", "2",
                 "--nproc-per-node", "2", "--model", uris["model"], "--train", uris["train"],
                 "--val", uris["val"], "--out", s3_bucket.uri("runs/r18-1"), *FLAGS,
                 "-o", str(job)]) == 0
    assert "PersistentVolumeClaim" not in job.read_text() and "claimName" not in job.read_text()
    assert main(["job", "run-local", str(job), "--quiet", "--log-dir", str(logs)]) == 0
    model = _fetched(s3_bucket, "runs/r18-1/", tmp_path / "s3-model")
    local = pytorchjob_2x2["out"]
    assert (model / "weights.pt").read_bytes() == (local / "weights.pt").read_bytes()
    ours, theirs = (json.loads((m / "metrics.json").read_text()) for m in (model, local))
    assert ours["status"] == "completed"
    assert (ours["fast_path"]["cache"], theirs["fast_path"]["cache"]) == (False, True)
    assert ours["fast_path"]["workers"] >= 1 and theirs["fast_path"]["workers"] == 0
    assert [h["val_loss"] for h in ours["history"]] == [h["val_loss"] for h in theirs["history"]]
    keys = [o["Key"] for o in s3_bucket.client.list_objects_v2(
        Bucket=s3_bucket.name, Prefix="runs/r18-1/").get("Contents", [])]
    assert not [k for k in keys if "/checkpoints/" in k], keys
    n_train = len(json.loads((micro_digits["train"] / "kfvision-imagedir.json").read_text())
                  ["images"])
    summaries = sorted(logs.rglob("kfvision-scratch/fetch-summary.json"))  # each pod's
    assert len(summaries) == 2
    for path in summaries:
        s = json.loads(path.read_text())
        share = s["share"]["train"][0]
        assert share == n_train // 2  # 40 images, 4 ranks, 2 a node
        assert s["fetched"]["1"]["train"][0] <= share + 1  # its share and one read ahead
        assert s["fetched"]["1"]["val"] == s["share"]["val"]
        assert sum(by["train"][0] for by in s["fetched"].values()) <= n_train  # none twice
        assert s["error"] is None


def _keys(bucket, prefix: str) -> list:
    return [o["Key"] for o in bucket.client.list_objects_v2(
        Bucket=bucket.name, Prefix=prefix).get("Contents", [])]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_job_killed_mid_epoch_resumes_on_new_pods_from_the_stores_checkpoint(
        tmp_path, s3_bucket, micro_digits, resnet18_dir, pytorchjob_2x2):
    """Every process SIGKILLed in epoch 2, once epoch 1's checkpoint is in the store; the job
    started again on new pods (empty scratch disks) resumes from it and ends with the same
    weights as the unbroken job on folders. The store is flaky meanwhile: 10% of its GETs and
    PUTs fail (reset, cut short, 503 SlowDown, wrong ETag, a flipped byte), retried; and the
    first answer to every multipart upload's part 1 (checkpoints, the model: larger than
    s3put.SINGLE_PUT) carries a wrong ETag, on every run: that part is sent again."""
    from helpers.s3proxy import PART_1, FaultProxy, Rule

    uris = _upload(s3_bucket, micro_digits, resnet18_dir)
    flags = ["--model", uris["model"], "--train", uris["train"], "--val", uris["val"],
             "--out", s3_bucket.uri("runs/resumed"), *FLAGS]

    def epoch_1_is_in_the_store(log: str) -> bool:
        return "epoch 2 [" in log and "runs/resumed/checkpoints/epoch-0001.pt" in _keys(
            s3_bucket, "runs/resumed/checkpoints/")

    rule = (Rule(rate=1.0, methods={"PUT"}, kinds=("stale_etag",), path=PART_1, first=True),
            Rule(rate=0.1, methods={"GET", "PUT"},
                 kinds=("slowdown", "reset", "truncate", "stale_etag", "corrupt")))
    with FaultProxy(s3_bucket.endpoint, rule, seed=3) as proxy:
        env = {"AWS_ENDPOINT_URL": proxy.url}
        first = _nodes(tmp_path / "pods-1", flags, kill_on=epoch_1_is_in_the_store, env=env)
        assert [rc for rc, _ in first] == [-signal.SIGKILL] * 2, first[0][1][-3000:]
        second = _nodes(tmp_path / "pods-2", flags, env=env)
    for rc, text in second:
        assert rc == 0, text[-4000:]
    assert proxy.by_rule[1] > 0, proxy.faults
    assert proxy.by_rule[0] >= 2, proxy.by_rule  # every multipart upload's part 1, once
    assert proxy.clients["GET", "object_store"] > 0, proxy.clients  # the images: obstore's GETs
    log = second[0][1]
    assert "checkpoint(s) from s3://" in log and "resuming from" in log, log[-3000:]
    model = _fetched(s3_bucket, "runs/resumed/", tmp_path / "model")
    baseline = pytorchjob_2x2["out"] / "weights.pt"
    assert (model / "weights.pt").read_bytes() == baseline.read_bytes()
    assert not [k for k in _keys(s3_bucket, "runs/resumed/") if "/checkpoints/" in k]


def test_a_full_scratch_disk_says_how_much_room_the_node_needs(tmp_path, s3_bucket, tmpfs,
                                                               micro_digits):
    """Before fetching, when the disk is too small for the dataset; and while fetching, when it
    fills up anyway (here: the check skipped), the fetcher stops with the same named error and
    the readers are told."""
    from kfvision.pipelines.jobs.storenode import stage_images
    from kfvision.trainer.data.arrival import FAILED

    s3_bucket.upload_folder(micro_digits["train"], "data/train/")
    with pytest.raises(nodefetch.ScratchFullError, match=r"--scratch-size"):
        nodefetch.check_room(tmp_path, 1 << 60)
    scratch = tmpfs("64k")
    channel = stage_images("train", s3_bucket.uri("data/train"), scratch)
    channel.list(4)
    plan = fetchplan.Plan(world_size=1, ranks=(0,), seed=1, epochs=1)
    fetcher = nodefetch.NodeFetcher(channel, None, plan, scratch / "arrival",
                                    max_connections=4).start()
    assert fetcher.done.wait(60)
    assert isinstance(fetcher.error, nodefetch.ScratchFullError), fetcher.error
    assert "holds up to the whole dataset" in str(fetcher.error)
    assert "ScratchFullError" in (scratch / "arrival" / FAILED).read_text()


def test_a_restarted_node_fetches_again_and_never_reads_a_part_file(tmp_path, s3_bucket,
                                                                    micro_digits):
    """A fetch killed mid-object leaves a hidden part file, never a file at the image's name:
    the next fetcher into the same disk removes it and fetches that image whole; into an empty
    one (a new pod), everything again. Each image read back has its manifest's sha256."""
    from kfvision.pipelines.jobs.storenode import stage_images
    from kfvision.trainer.data.imagedir import read_image_directory

    s3_bucket.upload_folder(micro_digits["train"], "data/train/")
    scratch = tmp_path / "scratch"
    channel = stage_images("train", s3_bucket.uri("data/train"), scratch)
    channel.list(4)
    first = channel.folder / channel.paths[0]
    first.parent.mkdir(parents=True, exist_ok=True)
    part = first.parent / f".kfvision-part-dead-{first.name}"
    part.write_bytes(b"half an image")
    plan = fetchplan.Plan(world_size=1, ranks=(0,), seed=1, epochs=1)
    fetcher = nodefetch.NodeFetcher(channel, None, plan, scratch / "arrival").start()
    deadline = time.monotonic() + 60
    while len(fetcher.held) < len(channel.paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    fetcher.stop()
    assert fetcher.error is None and len(fetcher.held) == len(channel.paths)
    assert not part.exists()
    imdir = read_image_directory(scratch / "data" / "train")
    from kfvision.trainer.data.imagedir import check_files

    check_files(imdir, hash=True)  # every image whole, its sha256 the manifest's


def test_a_stalled_small_get_is_asked_again_and_does_not_hold_the_node_up(tmp_path, s3_bucket,
                                                                          micro_digits,
                                                                          monkeypatch):
    """The first GET of one image mid-epoch stalls (its headers and half its body, then
    nothing: a try would end at the read timeout, 10 s here): the fetcher asks again beside it
    once it has run far longer than its peers, and holds every image well before that."""
    from helpers.s3proxy import FaultProxy, Rule

    from kfvision.pipelines.clients import s3
    from kfvision.pipelines.jobs.storenode import stage_images

    s3_bucket.upload_folder(micro_digits["train"], "data/train/")
    channel = stage_images("train", s3_bucket.uri("data/train"), tmp_path / "scratch")
    channel.list(4)
    n = len(channel.paths)
    plan = fetchplan.Plan(world_size=1, ranks=(0,), seed=1, epochs=1)
    late = channel.paths[fetchplan.rank_order(n, 1, 0, 1, 1)[n // 2]]  # its peers timed first
    rule = Rule(rate=1.0, methods={"GET"}, kinds=("stall",), first=True,
                path=re.escape(f"/data/train/{late}") + "$")
    with FaultProxy(s3_bucket.endpoint, rule, stall_s=20.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3.reset_clients()
        start = time.monotonic()
        fetcher = nodefetch.NodeFetcher(channel, None, plan, tmp_path / "arrival",
                                        max_connections=4, hedge_after=0.5).start()
        while len(fetcher.held) < n and time.monotonic() - start < 30:
            time.sleep(0.05)
        took = time.monotonic() - start
        fetcher.stop(timeout=1)
        summary = fetcher.summary()
    s3.reset_clients()
    assert proxy.faults == {"stall": 1}
    assert fetcher.error is None and len(fetcher.held) == n, summary
    assert summary["hedged"]["gets"] >= 1 and took < 8, (took, summary)
