"""The same trainer under torchrun: 2 CPU processes (gloo) on this machine."""

import json
import subprocess
import sys
import uuid

import pytest
import torch
from helpers.paths import REPO
from helpers.runs import train_argv

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

OPTIONS = {"epochs": 2, "image_size": 32, "batch_size": 8, "lr": 0.02, "augment": "light",
           "print_freq": 5, "seed": 3}


def _torchrun(argv, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "kfvision.trainer.train", *argv]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)


@pytest.fixture(scope="module")
def torchrun_2(tmp_path_factory, resnet18_dir, micro_digits) -> dict:
    """The trainer under plain torchrun, 2 processes, once a module: {"run", "out"}."""
    out = tmp_path_factory.mktemp("torchrun_2") / "a"
    return {"run": _torchrun(train_argv(resnet18_dir, micro_digits, out, **OPTIONS)), "out": out}


def test_two_processes_keep_identical_weights_and_write_one_model(torchrun_2, micro_digits):
    run, out = torchrun_2["run"], torchrun_2["out"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "weights identical on all 2 rank(s)" in run.stdout
    # only rank 0 logs and writes: one set of files, no leftovers of a second writer
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml", "metrics.json", "model.json", "spec.json", "weights.pt"]
    assert run.stdout.count("done: best epoch") == 1
    m = json.loads((out / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["status"] == "completed"
    assert m["history"][0]["lr"] == pytest.approx(OPTIONS["lr"] * 2)  # lr x world size
    # each rank saw half of each epoch's images; the metrics cover all of them once
    n_train = len(json.loads((micro_digits["train"] / "kfvision-imagedir.json").read_text())
                  ["images"])
    assert m["history"][0]["train_images_per_sec"] * m["history"][0]["train_seconds"] == \
        pytest.approx(n_train, rel=1e-6)


def _can_rename_host() -> bool:
    try:
        return subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


RESOLVABLE = "host name resolves"


@pytest.fixture(scope="module")
def kfvision_train_2(tmp_path_factory, resnet18_dir, micro_digits, request) -> dict:
    """`kfvision train --nproc-per-node 2` with torchrun_2's options, once a module: {"run",
    "out", "renamed", "tracking", "experiment"}. Where `unshare --uts` is allowed, in a host of
    its own whose name is not in its /etc/hosts, as in a container; its MLflow run on the
    session's server (tracking None where mlflow is not installed): one run for the three tests
    below."""
    out = tmp_path_factory.mktemp("kfvision_train_2") / "b"
    try:
        tracking = request.getfixturevalue("mlflow_server")
    except pytest.skip.Exception:
        tracking = None
    experiment = f"test-distributed-{uuid.uuid4().hex[:8]}"
    options = {**OPTIONS, **({"tracking_uri": tracking, "experiment": experiment} if tracking
                             else {})}
    argv = ["train", "--nproc-per-node", "2",
            *map(str, train_argv(resnet18_dir, micro_digits, out, **options))]
    renamed = _can_rename_host()
    if renamed:
        script = ('hostname kfvision-test-unresolvable && { ! getent hosts "$(hostname)" || '
                  f'echo "{RESOLVABLE}" >&2; }} && exec "$0" -m kfvision.pipelines.cli "$@"')
        cmd = ["unshare", "--uts", "sh", "-c", script, sys.executable, *argv]
    else:
        cmd = [sys.executable, "-m", "kfvision.pipelines.cli", *argv]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)
    return {"run": run, "out": out, "renamed": renamed, "tracking": tracking,
            "experiment": experiment}


def test_same_seed_and_world_size_give_the_same_model(torchrun_2, kfvision_train_2):
    """A second run, started the other way (`kfvision train --nproc-per-node 2`, its MLflow run
    on a server), against the plain torchrun one: neither the launcher nor the tracking is part
    of what decides the model."""
    for run in (torchrun_2["run"], kfvision_train_2["run"]):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    a, b = (torch.load(out / "weights.pt", weights_only=True)
            for out in (torchrun_2["out"], kfvision_train_2["out"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not _can_rename_host(), reason="needs `unshare --uts` (root, util-linux) to "
                    "give the test its own host name")
def test_several_processes_on_one_machine_meet_on_loopback(kfvision_train_2):
    # A container whose host name is not in its /etc/hosts: torchrun's default rendezvous would
    # hand the processes that name and wait out its timeout (300 s); kfvision uses loopback.
    run = kfvision_train_2["run"]
    assert kfvision_train_2["renamed"] and RESOLVABLE not in run.stderr, run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "weights identical on all 2 rank(s)" in run.stdout


def test_two_processes_log_each_epoch_once_from_rank_0(kfvision_train_2):
    """Two processes, one MLflow run: rank 0's, each epoch once."""
    from mlflow.tracking import MlflowClient

    if kfvision_train_2["tracking"] is None:
        pytest.skip("mlflow server not installed (pip install -e '.[test]')")
    run = kfvision_train_2["run"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    client = MlflowClient(tracking_uri=kfvision_train_2["tracking"])
    exp = client.get_experiment_by_name(kfvision_train_2["experiment"])
    (logged,) = client.search_runs([exp.experiment_id])
    assert logged.data.tags["kfvision.world_size"] == "2"
    steps = sorted(m.step for m in client.get_metric_history(logged.info.run_id, "val_loss"))
    assert steps == list(range(1, OPTIONS["epochs"] + 1))
