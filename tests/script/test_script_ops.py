"""A user's script's job after it ran: its logs from every pod with `[node/rank]` prefixes (here
and on a cluster), its MLflow run, and `kfvision job download` of its outputs.

The cluster side runs against tests/jobs/test_job_cluster.py's FAKE Kubernetes API (no cluster can
run here): it shows which calls are made and what is printed from what the API returns, not that a
real API server or kubelet return it so."""

import json

import pytest
from helpers.fake_k8s import (
    JOB,
    RUNNING,
    SUCCEEDED,
    FakeCluster,
    FakeResponse,
    cond,
    fake_connect,
    pod,
    rbac_rules,
)
from test_script import render, tree

from kfvision.pipelines.cli import main
from kfvision.pipelines.jobs import jobclient, ranktag
from kfvision.pipelines.jobs.podlogs import time_key
from kfvision.pipelines.script.jobmodel import JOB_RECORD

# --- logs ---


class TimedFake(FakeCluster):
    """The FAKE API, answering `timestamps=True` as the kubelet does: `RFC3339 line`."""

    def __init__(self, *a, stamps=None, **kw):
        super().__init__(*a, **kw)
        self.stamps = stamps or {}

    def read_namespaced_pod_log(self, name, namespace, container=None, follow=False,
                                previous=False, tail_lines=None, timestamps=False,
                                _preload_content=True):
        resp = super().read_namespaced_pod_log(name, namespace, container, follow, previous,
                                               tail_lines, _preload_content)
        if not timestamps:
            return resp
        lines = resp.data.decode().splitlines()
        stamps = self.stamps[name][-len(lines):] if lines else []
        return FakeResponse("".join(f"{t} {line}\n" for t, line in zip(stamps, lines,
                                                                         strict=True)).encode())


LOGS = {"digits-master-0": ["[0/-] [kfvision script] ready in 0.4 s", "[0/0] epoch 1 loss 0.3",
                            "[0/1] epoch 1 loss 0.4"],
        "digits-worker-0": ["[1/2] epoch 1 loss 0.5", "a line of the built-in trainer"],
        "digits-worker-1": []}
# the kubelet's RFC 3339 times drop a fraction's trailing zeros: .5 comes after .25
STAMPS = {"digits-master-0": ["2026-01-01T10:00:00.1Z", "2026-01-01T10:00:00.25Z",
                              "2026-01-01T10:00:01Z"],
          "digits-worker-0": ["2026-01-01T10:00:00.5Z", "2026-01-01T10:00:00.7Z"]}


def test_the_prefix_is_one_format():
    assert ranktag.tag(1, 3) == "[1/3] " and ranktag.tag(0) == "[0/-] "
    assert ranktag.tagged("[1/3] x", 0) == "[1/3] x"
    assert ranktag.tagged("[kfvision script] x", 2) == "[2/-] [kfvision script] x"
    assert ranktag.torchrun_template(1) == "[1/${rank}] "
    assert time_key("2026-01-01T10:00:00.5Z") > time_key("2026-01-01T10:00:00.25Z")


def test_logs_all_interleaves_every_pod_by_time_with_node_and_rank(monkeypatch, capsys):
    fake = TimedFake([RUNNING], logs=LOGS, stamps=STAMPS)
    fake.jobs["digits"] = JOB
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "logs", "digits", "--all"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[0/-] [kfvision script] ready in 0.4 s", "[0/0] epoch 1 loss 0.3",
        "[1/2] epoch 1 loss 0.5", "[1/-] a line of the built-in trainer",
        "[0/1] epoch 1 loss 0.4"]
    assert set(fake.calls) <= rbac_rules()
    assert main(["job", "logs", "digits", "--all", "--replica", "master-0"]) == 2
    assert "drop --replica" in capsys.readouterr().err


def test_logs_all_follow_waits_through_pending_then_streams_every_pod(monkeypatch, capsys):
    pending = ([cond("Created")], [])
    starting = ([cond("Created")], [pod("master-0", "Pending", {"waiting": {
        "reason": "ContainerCreating"}})])
    fake = TimedFake([pending, pending, starting, RUNNING, SUCCEEDED], logs=LOGS)
    fake.jobs["digits"] = JOB
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "logs", "digits", "--all", "--follow"]) == 0
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == sorted([
        "[0/-] [kfvision script] ready in 0.4 s", "[0/0] epoch 1 loss 0.3",
        "[0/1] epoch 1 loss 0.4", "[1/2] epoch 1 loss 0.5",
        "[1/-] a line of the built-in trainer"])
    assert "PyTorchJob kubeflow/digits: Created" in err
    assert err.index("Created") < err.index("Running") < err.index("Succeeded")
    # without --all, --follow waits for rank 0's pod as well, and prints its lines as they are
    fake = TimedFake([pending, RUNNING, SUCCEEDED], logs=LOGS)
    fake.jobs["digits"] = JOB
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "logs", "digits", "--follow"]) == 0
    assert capsys.readouterr().out.splitlines() == LOGS["digits-master-0"]


def test_logs_all_of_a_job_with_no_pod_yet_says_to_follow(monkeypatch, capsys):
    fake = TimedFake([([cond("Created")], [])])
    fake.jobs["digits"] = JOB
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "logs", "digits", "--all"]) == 2
    assert "has no running pod (yet)" in capsys.readouterr().err


PRINT_RANK = ("import os, sys\n"
              "print('hello from', os.environ['RANK'], flush=True)\n"
              "print('warning from', os.environ['RANK'], file=sys.stderr, flush=True)\n")


@pytest.mark.distributed
def test_run_local_shows_every_line_with_its_node_and_rank(tmp_path, capsys):
    src = tree(tmp_path / "src", {"say.py": PRINT_RANK})
    render(tmp_path, "--nodes", "2", "--nproc-per-node", "2", "--source", str(src), "--entry",
           "say.py", [])
    assert main(["job", "run-local", str(tmp_path / "job.yaml"), "--log-dir",
                 str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for rank in range(4):
        node = rank // 2
        assert f"[{node}/{rank}] hello from {rank}" in lines, out
        assert f"[{node}/{rank}] warning from {rank}" in lines, out
    assert any(line.startswith("[1/-] [kfvision script] ready in") for line in lines)
    # the pod's own log (what kubectl logs shows) carries the same prefixes
    assert "[1/3] hello from 3" in (tmp_path / "logs" / "worker-0.log").read_text()


@pytest.mark.distributed
def test_run_local_with_the_python_launcher_prefixes_the_pods_rank(tmp_path, capsys):
    src = tree(tmp_path / "src", {"say.py": PRINT_RANK})
    render(tmp_path, "--nodes", "2", "--source", str(src), "--entry", "say.py", "--launcher",
           "python", [])
    assert main(["job", "run-local", str(tmp_path / "job.yaml"), "--log-dir",
                 str(tmp_path / "logs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[0/0] hello from 0" in lines and "[1/1] warning from 1" in lines


# --- tracking ---

TRACKED = """\
import json, os, sys
import mlflow
import torch

lr = float(sys.argv[sys.argv.index("--lr") + 1])
mlflow.log_metric("loss", lr / 2)  # MLFLOW_RUN_ID: the run kfvision opened
with open(os.path.join("outputs", "result.txt"), "w") as f:  # Azure's ./outputs
    f.write("lr %s\\n" % lr)
model_dir = os.environ["KFVISION_MODEL_DIR"]
net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2)).eval()
torch.jit.save(torch.jit.script(net), os.path.join(model_dir, "model.pt"))
with open(os.path.join(model_dir, "classes.txt"), "w") as f:
    f.write("cat\\ndog\\n")
with open(os.path.join(model_dir, "kfvision.json"), "w") as f:
    json.dump({"image_size": 8}, f)
"""


LOGS_ONLY = """\
import os
import mlflow

mlflow.log_metric("loss", 0.25)
with open(os.path.join(os.environ["KFVISION_MODEL_DIR"], "weights.txt"), "w") as f:
    f.write("1.0\\n")
"""


def _tracked_run(tmp_path, capsys, uri: str, script: str = TRACKED) -> tuple:
    src = tree(tmp_path / "src", {"train.py": script})
    render(tmp_path, "--source", str(src), "--entry", "train.py", "--launcher", "python",
           "--tracking-uri", uri, "--experiment", "scripts", "--output-uri",
           str(tmp_path / "results"), ["--lr", "0.5"])
    code = main(["job", "run-local", str(tmp_path / "job.yaml"), "--log-dir",
                 str(tmp_path / "logs")])
    captured = capsys.readouterr()
    return src, code, captured.out + captured.err


@pytest.mark.distributed
@pytest.mark.slow
def test_kfvision_opens_the_scripts_mlflow_run_and_register_records_its_snapshot(
        tmp_path, capsys, monkeypatch, mlflow_server):
    from mlflow.tracking import MlflowClient

    from kfvision.pipelines.contract import PROVENANCE
    from kfvision.pipelines.script.snapshot import pack

    src, code, log = _tracked_run(tmp_path, capsys, mlflow_server)
    assert code == 0, log
    sha = pack(src).sha256
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("scripts").experiment_id])
    assert run.data.metrics == {"loss": 0.25}  # the script's own call landed in it
    assert run.data.params == {"kfvision.entry": "train.py", "kfvision.script_args": "--lr 0.5",
                               "kfvision.launcher": "python"}
    assert run.data.tags["kfvision.source_sha256"] == sha
    assert run.data.tags["kfvision.job_name"] == "demo" and run.info.status == "FINISHED"
    uploaded = {a.path for folder in ("outputs", "model")
                for a in client.list_artifacts(run.info.run_id, folder)}
    assert {"outputs/result.txt", "model/model.pt", "model/classes.txt"} <= uploaded
    model = tmp_path / "results" / "model"
    made = json.loads((model / PROVENANCE).read_text())
    assert made == {"source_sha256": sha, "entry": "train.py", "args": ["--lr", "0.5"],
                    "job": "demo", "mlflow_run_id": run.info.run_id,
                    "mlflow_tracking_uri": mlflow_server}
    # the model folder, copied out by --output-uri, registers with its snapshot and run
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    assert main(["register", "--model", str(model), "--name", "script-tracked"]) == 0
    (version,) = client.search_model_versions("name='script-tracked'")
    assert version.tags["kfvision.source_sha256"] == sha
    assert version.run_id == run.info.run_id


@pytest.mark.distributed
def test_a_dead_tracking_server_is_one_warning_and_the_script_logs_into_its_outputs(
        tmp_path, capsys):
    from kfvision.pipelines.clients.endpoints import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    _, code, log = _tracked_run(tmp_path, capsys, dead, LOGS_ONLY)
    assert code == 0, log
    warnings = [line for line in log.splitlines() if "MLflowTrackingError" in line]
    assert len(warnings) == 1, log
    assert warnings[0].startswith(f"[0/-] [kfvision script] WARNING: MLflowTrackingError: "
                                  f"starting the run at {dead} failed (unreachable")
    assert "its own MLflow calls go to outputs/mlruns" in warnings[0]
    assert any((tmp_path / "results" / "outputs" / "mlruns").rglob("loss"))
    made = json.loads((tmp_path / "results" / "model" / "kfvision-source.json").read_text())
    assert "mlflow_run_id" not in made


# --- download ---

KEEPS = """\
import os
with open(os.path.join(os.environ["KFVISION_MODEL_DIR"], "weights.txt"), "w") as f:
    f.write("w\\n")
os.makedirs("outputs/plots", exist_ok=True)
with open("outputs/plots/loss.txt", "w") as f:
    f.write("0.1\\n")
os.makedirs("outputs/empty", exist_ok=True)
os.makedirs("runs", exist_ok=True)  # beside the script: not collected
with open("runs/events.txt", "w") as f:
    f.write("e\\n")
"""


@pytest.mark.distributed
def test_download_a_file_and_a_folder_of_a_local_run(tmp_path, capsys):
    src = tree(tmp_path / "src", {"keep.py": KEEPS})
    render(tmp_path, "--kind", "trainjob", "--source", str(src), "--entry", "keep.py",
           "--launcher", "python", [])
    logs = str(tmp_path / "logs")
    assert main(["job", "run-local", str(tmp_path / "job.yaml"), "--log-dir", logs]) == 0
    got = tmp_path / "got"
    dl = ["job", "download", "demo", "--log-dir", logs, "--out", str(got)]
    assert main([*dl[:3], "model/weights.txt", *dl[3:]]) == 0
    assert (got / "weights.txt").read_text() == "w\n"
    assert "from its local run in" in capsys.readouterr().out
    assert main([*dl[:3], "outputs", *dl[3:]]) == 0
    assert (got / "outputs" / "plots" / "loss.txt").read_text() == "0.1\n"
    assert main([*dl[:3], "outputs/empty", *dl[3:]]) == 0
    said = capsys.readouterr().out
    assert "outputs/empty is empty: the script wrote nothing there. The job kept: " \
        "model/kfvision-source.json, model/weights.txt, outputs/plots/loss.txt." in said
    assert "Left in the pod: runs/; render with --collect runs" in said
    assert main([*dl[:3], "outputs/nope.txt", *dl[3:]]) == 2
    err = capsys.readouterr().err
    assert "JobOutputsError: outputs/nope.txt is not among the outputs" in err
    assert "model/kfvision-source.json, model/weights.txt, outputs/plots/loss.txt" in err
    assert main([*dl[:3], "../etc/passwd", *dl[3:]]) == 2
    assert "must start with one of model/, outputs/" in capsys.readouterr().err


def test_download_from_a_cluster_jobs_output_uri(tmp_path, monkeypatch, capsys, s3_bucket):
    """The job on the FAKE API (tests/jobs/test_job_cluster.py) carries its --output-uri; the files
    come from the test's S3 server."""
    from kfvision.pipelines.script.manifest import OUTPUT_ANNOTATION

    results = tree(tmp_path / "results", {"model/model.pt": "net", "outputs/a/b.txt": "b"})
    s3_bucket.upload_folder(results, "runs/digits/")
    fake = TimedFake([SUCCEEDED])
    fake.jobs["digits"] = {**JOB, "metadata": {**JOB["metadata"], "annotations": {
        OUTPUT_ANNOTATION: s3_bucket.uri("runs/digits")}}}
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    monkeypatch.chdir(tmp_path)  # no local run of it in build/jobs/digits
    got = tmp_path / "got"
    assert main(["job", "download", "digits", "model/model.pt", "--out", str(got)]) == 0
    assert (got / "model.pt").read_text() == "net"
    assert main(["job", "download", "digits", "outputs", "--out", str(got)]) == 0
    assert (got / "outputs" / "a" / "b.txt").read_text() == "b"
    # no temporary folder left; the record of where they came from (`register` reads it)
    assert [p.name for p in got.iterdir() if p.name.startswith(".")] == [JOB_RECORD]
    assert json.loads((got / JOB_RECORD).read_text())["model.pt"]["job"] == "digits"
    assert main(["job", "download", "digits", "model/other.pt"]) == 2
    assert "which hold 2 file(s): model/model.pt, outputs/a/b.txt" in capsys.readouterr().err
    fake.script = [RUNNING]
    assert main(["job", "download", "digits", "model/model.pt"]) == 2
    assert "is Running, not Succeeded" in capsys.readouterr().err
    fake.jobs["digits"] = JOB
    assert main(["job", "download", "digits", "model/model.pt"]) == 2
    assert "has no kfvision.dev/output-uri annotation" in capsys.readouterr().err
    del fake.jobs["digits"]
    assert main(["job", "download", "digits", "model/model.pt"]) == 2
    assert "has no local run in build/jobs/digits" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_render_turns_tracking_on_in_the_pods_without_writing_credentials(tmp_path, monkeypatch,
                                                                          capsys, kind):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "secret-token-never-written")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    src = tree(tmp_path / "src", {"train.py": ""})
    docs = render(tmp_path, "--kind", kind, "--source", str(src), "--entry", "train.py",
                  "--tracking-uri", "http://mlflow:5000", "--experiment", "scripts", "--env",
                  "MLFLOW_EXPERIMENT_NAME=mine", [])
    text = (tmp_path / "job.yaml").read_text()
    assert "secret-token-never-written" not in text
    assert "MLFLOW_TRACKING_TOKEN not written into the job" in capsys.readouterr().err
    job = docs[-1]
    env = (job["spec"]["trainer"]["env"] if kind == "trainjob" else
           job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
               "env"])
    pairs = [(e["name"], e["value"]) for e in env if e["name"].startswith(("MLFLOW", "KFV"))]
    assert ("MLFLOW_TRACKING_URI", "http://mlflow:5000") in pairs
    assert [v for n, v in pairs if n == "MLFLOW_EXPERIMENT_NAME"] == ["mine"]  # --env wins
    assert ("KFVISION_JOB_NAME", "demo") in pairs
    assert main(["job", "render", "--name", "demo", "--image", "i", "--source", str(src),
                 "--entry", "train.py", "--epochs", "3"]) == 2
    assert "--epochs is a flag of the built-in trainer" in capsys.readouterr().err
