"""The node agent (pipelines/jobs/storenode.py) and its fetcher (pipelines/clients/nodefetch.py):
a 2 x 2 job whose data, model and outputs are s3:// URIs on a real S3 API server (moto's, on
loopback), run by `kfvision job run-local` (each pod a scratch volume of its own under the run's
log folder), against the same job reading the folders; and the fetcher alone, in this process."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import kill_with_env, with_env
from helpers.runs import JOB_FLAGS

from kfvision.pipelines.clients import fetchplan, nodefetch
from kfvision.pipelines.jobs import storenode

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


def _fetched(bucket, key: str, into: Path) -> Path:
    from kfvision.pipelines.clients import s3sync

    s3sync.fetch(bucket.uri(key), into, progress=False)
    return into


def _keys(bucket, prefix: str) -> list:
    return [o["Key"] for o in bucket.client.list_objects_v2(
        Bucket=bucket.name, Prefix=prefix).get("Contents", [])]


def _summaries(logs: Path) -> list:
    """Each pod's fetch-summary.json (its scratch volume is under the run's log folder)."""
    return [json.loads(p.read_text())
            for p in sorted(logs.rglob(f"kfvision-scratch/{storenode.SUMMARY}"))]


MARK = "KFVISION_STORENODE_TEST"  # the killed run's processes, found by their environment


@pytest.mark.distributed
@pytest.mark.slow
def test_a_2x2_job_on_object_storage_alone_killed_mid_epoch_resumes_on_new_pods_the_same(
        tmp_path, s3_bucket, micro_digits, resnet18_dir, pytorchjob_2x2, monkeypatch):
    """`kfvision job render` and `job run-local`, data, model and outputs in the store: every
    process SIGKILLed in epoch 2, once epoch 1's checkpoint is in the store; the job run again
    on new pods (empty scratch volumes) resumes from it and ends with the same weights, bit for
    bit, as the unbroken job on folders, every loading option at its default (there: cached, no
    workers; here: uncached, a worker a process). Each node fetched its ranks' share in epoch
    1 and never an image twice; the model and no checkpoint are left in the store. The store is
    flaky meanwhile: 10% of its GETs and PUTs fail (reset, cut short, 503 SlowDown, wrong ETag,
    a flipped byte), retried; and the first answer to every multipart upload's part 1
    (checkpoints, the model: larger than s3put.SINGLE_PUT) carries a wrong ETag, on every run:
    that part is sent again. (One job for both claims: each run is six torch processes.)"""
    from helpers.s3proxy import PART_1, FaultProxy, Rule

    from kfvision.pipelines.cli import main
    from kfvision.pipelines.clients import s3

    uris = _upload(s3_bucket, micro_digits, resnet18_dir)
    out = "runs/r18"
    job = tmp_path / "job.yaml"
    assert main(["job", "render", "--name", "r18", "--image", "local", "--nodes", "2",
                 "--nproc-per-node", "2", "--model", uris["model"], "--train", uris["train"],
                 "--val", uris["val"], "--out", s3_bucket.uri(out), *FLAGS,
                 "-o", str(job)]) == 0
    assert "PersistentVolumeClaim" not in job.read_text() and "claimName" not in job.read_text()
    first, second = tmp_path / "logs-1", tmp_path / "logs-2"

    def epoch_1_is_in_the_store() -> bool:  # and each node's summary of epoch 1 is written
        master = first / "master-0.log"
        return (master.is_file() and "epoch 2 [" in master.read_text(errors="replace")
                and f"{out}/checkpoints/epoch-0001.pt" in _keys(s3_bucket, f"{out}/checkpoints/")
                and [s["epoch"] >= 2 for s in _summaries(first)] == [True, True])

    rule = (Rule(rate=1.0, methods={"PUT"}, kinds=("stale_etag",), path=PART_1, first=True),
            Rule(rate=0.1, methods={"GET", "PUT"},
                 kinds=("slowdown", "reset", "truncate", "stale_etag", "corrupt")))
    with FaultProxy(s3_bucket.endpoint, rule, seed=3) as proxy:
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, MARK: "1"}  # the pods inherit it
        run = subprocess.Popen([sys.executable, "-m", "kfvision.pipelines.cli", "job",
                                "run-local", str(job), "--quiet", "--log-dir", str(first)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not epoch_1_is_in_the_store() and run.poll() is None:
            assert time.monotonic() < deadline, "epoch 2 never began with epoch 1 in the store"
            time.sleep(0.05)
        killed = kill_with_env(**{MARK: "1"})  # run-local, its pods' agents, launchers, trainers
        log = run.communicate(timeout=60)[0].decode(errors="replace")
        assert run.returncode == -signal.SIGKILL, log[-3000:]
        assert len(killed) >= 1 + 2 * 3, killed  # run-local, and each pod's agent, launcher, ranks
        deadline = time.monotonic() + 10
        while with_env(**{MARK: "1"}):  # none left to write into the store (one forked meanwhile)
            assert time.monotonic() < deadline, with_env(**{MARK: "1"})
            kill_with_env(**{MARK: "1"})
            time.sleep(0.1)
        with monkeypatch.context() as patch:  # run-local's pods inherit this process's
            patch.setenv("AWS_ENDPOINT_URL", proxy.url)
            assert main(["job", "run-local", str(job), "--quiet", "--log-dir", str(second)]) == 0
    s3.reset_clients()
    assert proxy.by_rule[1] > 0, proxy.faults
    assert proxy.by_rule[0] >= 2, proxy.by_rule  # every multipart upload's part 1, once
    assert proxy.clients["GET", "object_store"] > 0, proxy.clients  # the images: obstore's GETs
    log = (second / "master-0.log").read_text()
    assert "checkpoint(s) from s3://" in log and "resuming from" in log, log[-3000:]
    model = _fetched(s3_bucket, f"{out}/", tmp_path / "s3-model")
    local = pytorchjob_2x2["out"]
    assert (model / "weights.pt").read_bytes() == (local / "weights.pt").read_bytes()
    ours, theirs = (json.loads((m / "metrics.json").read_text()) for m in (model, local))
    assert ours["status"] == "completed"
    assert (ours["fast_path"]["cache"], theirs["fast_path"]["cache"]) == (False, True)
    assert ours["fast_path"]["workers"] >= 1 and theirs["fast_path"]["workers"] == 0
    assert [h["val_loss"] for h in ours["history"]] == [h["val_loss"] for h in theirs["history"]]
    assert not [k for k in _keys(s3_bucket, f"{out}/") if "/checkpoints/" in k]
    n_train = len(json.loads((micro_digits["train"] / "kfvision-imagedir.json").read_text())
                  ["images"])
    killed, again = _summaries(first), _summaries(second)
    assert len(killed) == len(again) == 2
    for s in killed:  # written as epoch 2 began
        share = s["share"]["train"][0]
        assert share == n_train // 2  # 40 images, 4 ranks, 2 a node
        assert s["fetched"]["1"]["train"][0] <= share + 1  # its share and one read ahead
        assert s["fetched"]["1"]["val"] == s["share"]["val"]
    for s in killed + again:
        assert sum(by["train"][0] for by in s["fetched"].values()) <= n_train  # none twice
        assert s["error"] is None


def test_a_full_scratch_disk_says_how_much_room_the_node_needs(tmp_path, s3_bucket, tmpfs,
                                                               micro_digits):
    """Before fetching, when the disk is too small for the dataset; and while fetching, when it
    fills up anyway (here: the check skipped), the fetcher stops with the same named error and
    the readers are told."""
    from kfvision.pipelines.jobs.storenode import stage_images
    from kfvision.trainer.data.arrival import FAILED

    s3_bucket.upload_folder(micro_digits["train"], "data/train/")
    with pytest.raises(fetchplan.ScratchFullError, match=r"--scratch-size"):
        fetchplan.check_room(tmp_path, 1 << 60)
    scratch = tmpfs("64k")
    channel = stage_images("train", s3_bucket.uri("data/train"), scratch)
    channel.list(4)
    plan = fetchplan.Plan(world_size=1, ranks=(0,), seed=1, epochs=1)
    fetcher = nodefetch.NodeFetcher(channel, None, plan, scratch / "arrival",
                                    max_connections=4).start()
    assert fetcher.done.wait(60)
    assert isinstance(fetcher.error, fetchplan.ScratchFullError), fetcher.error
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
