"""`kfvision job status` and `job list`: a local run's record as it runs (pipelines/jobs/
localstatus.py), and jobs on a cluster (pipelines/jobs/jobstatus.py) against the FAKE API of
tests/helpers/fake_k8s.py (not a cluster: it serves what the test stores and scripts). The other
verbs of the one job protocol (pipelines/jobs/backends.py: logs, follow, watch, delete, wait) on
the same real local run; their cluster side is tests/jobs/test_job_cluster.py's, against the
same fake."""

import json
import subprocess
import sys
import threading
import time

import pytest
from helpers.fake_k8s import (
    JOB,
    LIST_CALLS,
    NS,
    RUNNING,
    T_RUNNING,
    FakeCluster,
    FakeTrainer,
    fake_connect,
    rbac_rules,
)
from test_trainjob_cluster import TJOB
from test_trainjob_local import make_trainjob

from kfvision.pipelines.cli import main
from kfvision.pipelines.jobs import jobclient, localstatus
from kfvision.pipelines.jobs.backends import LocalJobs
from kfvision.pipelines.jobs.progress import PROGRESS_TOTAL, Progress
from kfvision.pipelines.jobs.render import run_local

# node 0 prints its progress, node 1 other numbers that must not count; node 0 holds its first
# epoch until the test has read it ($SEEN exists)
SCRIPT = """
    import os, pathlib, sys, time
    node = os.environ["PET_NODE_RANK"]
    for epoch in (1, 2):
        print(f"epoch={epoch} loss={0.5 / epoch}" if node == "0" else "epoch=9 loss=9",
              flush=True)
        seen, end = pathlib.Path(os.environ["SEEN"]), time.time() + 60
        while node == "0" and epoch == 1 and not seen.exists() and time.time() < end:
            time.sleep(0.05)
    sys.exit(int(os.environ.get("EXIT", "0")))
    """


def _watched(job, log_dir, seen_file) -> list:
    """Run `job` here through run-local's dispatcher; the records read while it ran (`seen_file`
    made once one showed a running job's progress)."""
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            record = localstatus.read(log_dir)
            if record is not None:
                seen.append(record)
                if record["phase"] == "Running" and (record.get("progress") or {}).get("lines"):
                    seen_file.touch()
            time.sleep(0.1)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        run_local(job, log_dir, quiet=True, restart_delay_s=0)
    finally:
        done.set()
        thread.join()
    return seen


@pytest.mark.distributed
def test_a_local_run_records_rank_zeros_progress_as_it_runs(tmp_path, capsys):
    job = make_trainjob(nodes=2, script=SCRIPT, name="demo")
    job["spec"]["trainer"]["env"] = [{"name": PROGRESS_TOTAL, "value": "epochs=2"},
                                     {"name": "SEEN", "value": str(tmp_path / "seen")}]
    seen = _watched(job, tmp_path / "demo", tmp_path / "seen")
    running = [r["progress"] for r in seen if r["phase"] == "Running" and r["progress"]["lines"]]
    assert running and running[0]["metrics"] == {"epoch": 1, "loss": 0.5}
    assert (running[0]["done"], running[0]["total"], running[0]["percent"]) == (1, 2, 50)
    assert all(p["metrics"]["loss"] != 9 for p in running)  # node 1's lines do not count
    assert main(["job", "status", "demo", "--log-dir", str(tmp_path / "demo")]) == 0
    text = capsys.readouterr().out
    assert "demo: TrainJob, local run in" in text and "phase     Succeeded after" in text
    assert "shape     2 node(s) x 1 process(es)" in text
    assert "progress  [####################] 100%  2 of 2 epochs done" in text
    assert "metrics   epoch=2 loss=0.25" in text
    job["spec"]["trainer"]["env"].append({"name": "EXIT", "value": "3"})
    job["metadata"]["name"] = "failing"
    with pytest.raises(Exception, match="job failing failed"):
        run_local(job, tmp_path / "failing", quiet=True, restart_delay_s=0)
    assert main(["job", "list", "--log-root", str(tmp_path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["NAME", "KIND", "WHERE", "PHASE", "NODES", "PROGRESS", "LEFT"]
    assert [r.split()[:5] for r in rows[1:]] == [["failing", "TrainJob", "local", "Failed",
                                                  "2x1"], ["demo", "TrainJob", "local",
                                                           "Succeeded", "2x1"]]
    # the verbs a job on the cluster answers, on the same local run (pipelines/jobs/backends.py)
    demo = ["--log-dir", str(tmp_path / "demo")]
    assert main(["job", "logs", "demo", *demo]) == 0  # rank 0's: node-0-0
    out = capsys.readouterr().out
    assert "epoch=2 loss=0.25" in out and "epoch=9" not in out
    assert main(["job", "logs", "demo", "--all", "--tail", "2", *demo]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[0/-] epoch=2 loss=0.25" in lines and "[1/-] epoch=9 loss=9" in lines
    assert len(lines) == 4  # two of each node's
    assert main(["job", "logs", "demo", "--replica", "node-0-1", "-f", *demo]) == 0
    followed = capsys.readouterr()
    assert "epoch=9 loss=9" in followed.out and "0.25" not in followed.out
    assert f"job demo (local run in {tmp_path / 'demo'}): Succeeded" in followed.err
    assert main(["job", "logs", "demo", "--previous", *demo]) == 2
    assert "a local run's log holds every restart in one file" in capsys.readouterr().err
    assert main(["job", "status", "demo", "--watch", *demo]) == 0  # it has ended: drawn once
    assert capsys.readouterr().out.count("phase     Succeeded") == 1
    assert main(["job", "delete", "demo", *demo]) == 0
    assert f"deleted TrainJob demo (its local run in {tmp_path / 'demo'})" in \
        capsys.readouterr().out
    assert not (tmp_path / "demo").exists()
    assert main(["job", "list", "--log-root", str(tmp_path)]) == 0
    assert [r.split()[0] for r in capsys.readouterr().out.splitlines()[1:]] == ["failing"]
    assert LocalJobs(root=tmp_path).wait("failing", timeout_s=0)["phase"] == "Failed"


def test_a_record_whose_run_local_is_gone_reads_as_stopped(tmp_path, capsys):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    record = {"name": "x", "kind": "PyTorchJob", "nodes": 1, "procs": "1", "phase": "Running",
              "started": time.time() - 5, "pid": int(gone), "message": "",
              "written": time.time(), "progress": {"metrics": {}, "lines": 0}}
    (tmp_path / "status.json").write_text(json.dumps(record))
    assert main(["job", "status", "x", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"phase     Stopped for 5 s: its run-local process ({gone}) is gone" in out
    assert "progress  none printed yet: rank 0's `name=value` lines show here" in out


def test_a_pytorchjobs_progress_is_read_from_rank_zeros_log(monkeypatch, capsys):
    fake = FakeCluster([RUNNING])
    fake.jobs["digits"] = JOB
    fake.logs = {"digits-master-0": [
        ("2026-01-02T03:04:05Z", "[0/-] [kfvision script] ready in 0.1 s"),
        ("2026-01-02T03:04:06Z", "[0/0] epochs=4"),
        ("2026-01-02T03:04:10Z", "[0/0] epoch=1 loss=0.5"),
        ("2026-01-02T03:04:10Z", "[1/2] epoch=1 loss=9"),
        ("2026-01-02T03:04:20Z", "[0/0] epoch=2 loss=0.25")]}
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "status", "digits", "-n", NS]) == 0
    out = capsys.readouterr().out
    assert f"digits: PyTorchJob, namespace {NS}" in out and "phase     Running" in out
    assert "shape     3 node(s) x 1 process(es)" in out
    assert "progress  [##########----------]  50%  2 of 4 epochs done" in out
    assert "metrics   epoch=2 loss=0.25" in out and "(read from the log of master-0)" in out
    assert set(fake.calls) <= rbac_rules()


def test_a_trainjobs_progress_is_its_trainer_status_else_its_log(monkeypatch, capsys):
    now = time.time()
    progress = Progress({"total_steps": 10})
    progress.feed("step=4 loss=0.5", now - 10)
    job = json.loads(json.dumps(TJOB))
    job["status"] = {"trainerStatus": progress.trainer_status(now)}
    fake = FakeTrainer([T_RUNNING], logs={"digits-node-0-0-x7k2p": ["[0/0] step=1"]})
    fake.jobs["digits"] = job
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "status", "digits", "-n", NS, "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert (view["kind"], view["phase"], view["nodes"]) == ("TrainJob", "Running", 3)
    assert view["source"] == "status.trainerStatus"
    assert (view["progress"]["percent"], view["progress"]["value"]) == (40, 4)
    del job["status"]  # the TrainJobStatus gate off: nothing reported
    assert main(["job", "status", "digits", "-n", NS, "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["source"] == "the log of node-0-0" and view["progress"]["value"] == 1


def test_job_list_shows_the_jobs_kfvision_rendered_of_both_kinds(monkeypatch, capsys):
    fake = FakeCluster([RUNNING])
    progress = Progress({"epochs": 4})
    progress.feed("epoch=1", time.time())
    trainjob = {**json.loads(json.dumps(TJOB)), "status": {
        "trainerStatus": progress.trainer_status(time.time())}}
    trainjob["metadata"]["name"] = "tj"
    foreign = json.loads(json.dumps(JOB))
    foreign["metadata"].update(name="not-ours", labels={})
    fake.jobs = {"digits": JOB, "tj": trainjob, "not-ours": foreign}
    fake.served = {("kubeflow.org", "v1"): ["pytorchjobs"],
                   ("trainer.kubeflow.org", "v1alpha1"): ["trainjobs"]}
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "list", "-n", NS]) == 0
    rows = [r.split() for r in capsys.readouterr().out.splitlines()]
    assert rows[1:] == [["digits", "PyTorchJob", NS, "Running", "3x1", "-", "-"],
                        ["tj", "TrainJob", NS, "Running", "3x1", "25%", "-"]]
    # a running PyTorchJob's progress, as `job status` reads it: rank 0's log
    fake.logs = {"digits-master-0": [("2026-01-02T03:04:06Z", "[0/0] epochs=4"),
                                     ("2026-01-02T03:04:10Z", "[0/0] epoch=1 loss=0.5")]}
    assert main(["job", "list", "-n", NS]) == 0
    rows = [r.split() for r in capsys.readouterr().out.splitlines()]
    assert rows[1][:6] == ["digits", "PyTorchJob", NS, "Running", "3x1", "25%"]
    assert LIST_CALLS <= set(fake.calls) <= rbac_rules()  # manifests/rbac.yaml grants them


def test_no_local_run_and_no_cluster_is_one_named_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["job", "status", "nope"]) == 2
    err = capsys.readouterr().err
    assert "InvalidJobError: no job nope in build/jobs/nope (a local run), nor on the cluster: " \
           "no Kubernetes configuration" in err
