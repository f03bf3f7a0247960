"""The pipeline's step functions without KFP: parameter checks, sources, the train step's cluster
path against a fake Kubernetes API, and the pages the KFP UI shows."""

import http.server
import json
import shutil
import types
import zipfile
from pathlib import Path

import pytest
import yaml
from helpers.loopback import serve_in_thread
from helpers.runs import pipeline_job_settings, pipeline_train_options

from kfvision.pipelines.clients.k8s import Api, KubernetesError
from kfvision.pipelines.flow.pages import curves_html, evaluation_html
from kfvision.pipelines.flow.params import job_options
from kfvision.pipelines.flow.pipeline import parameter_defaults
from kfvision.pipelines.flow.steps import train as train_step
from kfvision.pipelines.flow.steps.check import check_parameters
from kfvision.pipelines.flow.steps.common import resolve_mode, run, unique_run_key
from kfvision.pipelines.flow.steps.data import convert_step
from kfvision.pipelines.jobs.kinds import PYTORCHJOB, TRAINJOB
from kfvision.trainer.errors import InvalidDatasetError, InvalidParameterError


def params(source, **over) -> dict:
    """Every check_parameters argument: the pipeline's defaults, a real source, `over`."""
    return {**parameter_defaults(), "train_source": str(source), "execution_mode": "local",
            **over}


def test_check_parameters_returns_the_model_family(tiny_digits):
    raw = tiny_digits["raw"]
    assert check_parameters(**params(raw / "train")) == "resnet"
    assert check_parameters(**params(raw / "train", model_name="densenet169",
                                           validation_source=str(raw / "val"))) == "densenet"


def test_the_check_step_runs_without_torch(tiny_digits):
    """The pipeline's first step checks every parameter before any heavy work: it imports neither
    torch nor torchvision (2.5 s of a step that otherwise takes 0.1 s)."""
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from kfvision.pipelines.flow.steps.check import check_parameters\n"
            "print(check_parameters(**json.loads(sys.argv[1])))\n"
            "print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(params(tiny_digits["raw"]))],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["resnet", "[]"]


@pytest.mark.parametrize("over, message", [
    ({"model_name": "resnet19"}, "not one of torchvision's 80 classification models "
                                 "(closest: resnet18"),
    ({"epochs": 0}, "1 <= epochs"),
    ({"learning_rate": -1.0}, "learning_rate = -1.0 is out of range: it must be 0 < "
                              "learning_rate <= 10"),
    ({"warmup_epochs": 9}, "warmup_epochs = 9 is out of range: it must be 0 <= warmup_epochs "
                           "<= 5 (5: epochs)"),
    ({"print_frequency": 0}, "1 <= print_frequency"),
    ({"augment": "heavy"}, "augment = 'heavy' is not valid; choose one of: standard, strong, "
                           "light, none"),
    ({"fraction": 1.0}, "0 < fraction < 1"),
    ({"execution_mode": "cloud"}, "execution_mode = 'cloud' is not valid; choose one of: auto, "
                                  "local, cluster"),
    ({"gpus_per_node": 2, "procs_per_node": 4}, "procs_per_node 4 is more than gpus_per_node 2"),
    ({"node_selector": "gpu"}, "node_selector item 'gpu' is not KEY=VALUE"),
    ({"tolerations": "nvidia.com/gpu:Sometimes"}, "is not one of NoSchedule"),
    ({"cpu_per_node": "lots"}, "cpu_per_node 'lots' is not a Kubernetes quantity"),
    ({"shm_size": "big"}, "shm_size 'big' is not a Kubernetes quantity"),
    ({"timeout_seconds": -5}, "timeout_seconds = -5 is out of range"),
    ({"nodes": 0}, "1 <= nodes"),
    ({"image": "has space"}, "image 'has space' is not an image reference"),
    ({"execution_mode": "cluster", "pvc_name": "Bad_Name"},
     "pvc_name claim 'Bad_Name' is not a DNS-1123 subdomain"),
])
def test_bad_parameters_are_refused_naming_the_parameter(tiny_digits, capsys, over, message):
    """The check step's log names the pipeline's parameters, never the trainer's fields or
    flags (learning_rate, not lr or --lr)."""
    with pytest.raises(SystemExit) as e:
        run(check_parameters, **params(tiny_digits["raw"] / "train", **over))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and message in err, err
    assert "--" not in err


def test_fraction_does_not_matter_with_a_validation_source(tiny_digits):
    raw = tiny_digits["raw"]
    check_parameters(**params(raw / "train", validation_source=str(raw / "val"),
                                    fraction=0.0))


@pytest.mark.parametrize("field", ["train_source", "validation_source", "test_source"])
def test_a_missing_source_is_refused_before_anything_runs(tiny_digits, tmp_path, field):
    over = {field: str(tmp_path / "nowhere")}
    with pytest.raises(InvalidDatasetError, match=f"{field} .*nowhere does not exist"):
        check_parameters(**params(tiny_digits["raw"] / "train", **over))
    # From outside the cluster (kfvision pipeline submit) sources are paths on the PVC: not here.
    check_parameters(**params(tiny_digits["raw"] / "train", **over), check_sources=False)


def test_an_empty_train_source_is_refused():
    with pytest.raises(InvalidParameterError) as e:
        check_parameters(**params(""))
    assert e.value.named(str).startswith("train_source is empty")
    assert str(e.value).startswith("--train-source is empty")  # kfvision pipeline's flag


@pytest.mark.parametrize("settings, expected", [
    ({"node_selector": ""}, {"node_selector": ()}),
    ({"node_selector": " a=1 , b/c=x ,"}, {"node_selector": (("a", "1"), ("b/c", "x"))}),
    ({"tolerations": "nvidia.com/gpu:NoSchedule, pool=gpu:NoExecute"},
     {"tolerations": (("nvidia.com/gpu", None, "NoSchedule"), ("pool", "gpu", "NoExecute"))}),
    ({"procs_per_node": 0, "cpu_per_node": "", "timeout_seconds": 0},
     {"procs_per_node": None, "cpu": None, "active_deadline": None}),  # KFP has no None
    ({"procs_per_node": 2, "memory_per_node": "8Gi", "timeout_seconds": 60},
     {"procs_per_node": 2, "memory": "8Gi", "active_deadline": 60}),
])
def test_job_parameters_become_job_options(settings, expected):
    got = job_options(**_job_settings(**settings))
    assert {k: got[k] for k in expected} == expected


@pytest.mark.parametrize("mode, env, expected", [
    ("auto", {}, "local"), ("auto", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "cluster"),
    ("local", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "local"), ("cluster", {}, "cluster"),
])
def test_resolve_mode(mode, env, expected):
    assert resolve_mode(mode, env) == expected


_job_settings = pipeline_job_settings


def test_job_names_derive_from_the_run_and_task_not_from_chance():
    from kfvision.trainer.config import TrainConfig

    cfg = TrainConfig(model="m", train="t", val="v", out="o")
    a = train_step.job_config(cfg, run_id=unique_run_key("run-1", "train"), pvc_name=None,
                         **_job_settings())
    again = train_step.job_config(cfg, run_id=unique_run_key("run-1", "train"), pvc_name=None,
                             **_job_settings())
    other = train_step.job_config(cfg, run_id=unique_run_key("run-2", "train"), pvc_name=None,
                             **_job_settings())
    assert a.name == again.name != other.name and a.name.startswith("kfvision-train-")
    assert a.volumes == ()


def test_convert_step_reads_a_folder_and_an_http_url(tiny_digits, tmp_path):
    got = convert_step(str(tiny_digits["raw"] / "val"), tmp_path / "a")
    assert (got["images"], got["classes"], got["skipped"]) == (60, 10, 0)
    archive = tmp_path / "www" / "val.zip"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as z:
        for f in sorted((tiny_digits["raw"] / "val").rglob("*.png")):
            z.write(f, f.relative_to(tiny_digits["raw"]))
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(archive.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serve_in_thread(server)
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        got = convert_step(f"{url}/val.zip", tmp_path / "b")
        assert (got["images"], got["classes"]) == (60, 10)
        with pytest.raises(InvalidDatasetError, match="cannot download .*missing.zip"):
            convert_step(f"{url}/missing.zip", tmp_path / "c")
    finally:
        server.shutdown()


def test_staging_copies_once_so_a_retry_does_not_touch_a_running_jobs_inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("1")
    stage = tmp_path / "stage"
    train_step.stage_inputs(stage, {"model": src})
    (src / "a.txt").write_text("2")  # a second attempt sees the first copy, not this
    train_step.stage_inputs(stage, {"model": src})
    assert (stage / "model" / "a.txt").read_text() == "1"
    shutil.rmtree(stage)
    (stage / "model").mkdir(parents=True)  # an interrupted copy (no marker): copied again
    train_step.stage_inputs(stage, {"model": src})
    assert (stage / "model" / "a.txt").read_text() == "2"


class FakeJobs:
    """A JobClient stand-in (no API server can run here): the job's state per get(), deletions
    recorded; `served`: the job kinds its API discovery reports."""

    def __init__(self, states, kind=PYTORCHJOB, served=(PYTORCHJOB,), claims=None,
                 modes=("ReadWriteMany",)):
        self.states, self.deleted, self.namespace, self.said = list(states), [], "ns", []
        self.kind, self.api = kind, Api(FakeDiscovery(served), None, "ns")
        self.claims, self.modes = claims or {}, list(modes)  # this step's pod's PVCs

    def own_claims(self, pod):
        return self.claims

    def access_modes(self, claim):
        return self.modes

    def get(self, name):
        state = self.states.pop(0) if self.states else None
        if state is None:
            raise KubernetesError(f"get PyTorchJob ns/{name} failed: HTTP 404: not found. ...",
                                  404)
        return {"status": {"conditions": [{"type": state, "status": "True"}]}}

    def delete(self, name):
        self.deleted.append(name)

    def say(self, line):
        self.said.append(line)


class FakeDiscovery:
    """CustomObjectsApi.get_api_resources for the kinds a cluster serves."""

    def __init__(self, served):
        self.served = served

    def get_api_resources(self, group, version, _preload_content=False):
        from kubernetes.client.exceptions import ApiException

        plurals = [k.plural for k in self.served if (k.group, k.version) == (group, version)]
        if not plurals:
            raise ApiException(status=404, reason="Not Found")
        return types.SimpleNamespace(data=json.dumps(
            {"resources": [{"name": p} for p in plurals]}).encode())


@pytest.mark.parametrize("states, deleted", [
    ([None], []), (["Running"], []), (["Succeeded"], []), (["Failed", "Failed", None], ["j"]),
])
def test_a_failed_job_of_an_earlier_attempt_is_replaced_others_are_reattached(
        tmp_path, states, deleted):
    client = FakeJobs(states)
    train_step.replace_failed_job(client, "j", tmp_path / "trained", poll_s=0)
    assert client.deleted == deleted


def fake_metrics(epochs=2) -> dict:
    history = [{"epoch": e, "lr": 0.1 / e, "train_loss": 2.0 / e, "train_top1": 0.3 * e,
                "train_top5": 0.9, "train_images_per_sec": 100.0, "train_seconds": 1.0,
                "val_loss": 2.5 / e, "val_top1": 0.25 * e, "val_top5": 0.8}
               for e in range(1, epochs + 1)]
    return {"status": "completed", "history": history, "best_epoch": epochs,
            "epochs_run": epochs, "final": {"val_loss": 1.25, "val_top1": 0.5, "val_top5": 0.8,
                                            "train_images_per_sec": 100.0}}


def _pod_and_args(job: dict) -> tuple:
    """(pod spec, training args) of a rendered PyTorchJob or TrainJob."""
    if job["kind"] == "TrainJob":
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        return pod, job["spec"]["trainer"]["args"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return pod, pod["containers"][0]["args"]


@pytest.mark.parametrize("job_kind, served, expected", [
    ("pytorchjob", (TRAINJOB, PYTORCHJOB), PYTORCHJOB),  # asked for: no discovery
    ("auto", (TRAINJOB, PYTORCHJOB), TRAINJOB),  # both served: TrainJob first
    ("auto", (PYTORCHJOB,), PYTORCHJOB),  # a cluster on Training Operator v1.9
])
def test_the_cluster_path_stages_submits_and_copies_the_model_back(
        tmp_path, monkeypatch, tiny_digits, resnet18_dir, job_kind, served, expected):
    from kfvision.pipelines.jobs import jobclient

    mount = tmp_path / "pvc"
    mount.mkdir()
    monkeypatch.setattr(train_step, "DATA_MOUNT", str(mount))
    monkeypatch.setattr(train_step, "is_mount", lambda path: path == str(mount))
    monkeypatch.setattr(jobclient, "connect", lambda namespace=None, out=None, kind=PYTORCHJOB:
                        FakeJobs([None], kind, served))
    seen = {}

    def submit(client, job, *, wait, poll_s, logs):  # the job "runs": writes its --out
        assert client.kind.kind == job["kind"]
        args = _pod_and_args(job)[1]
        flags = dict(zip(args[::2], args[1:][::2]))
        seen.update(flags, staged=sorted(p.name for p in runs.iterdir()))
        out = Path(flags["--out"])
        out.mkdir(parents=True)
        (out / "metrics.json").write_text(json.dumps(fake_metrics()))
        assert wait and logs
        return job

    monkeypatch.setattr(jobclient, "submit", submit)
    settings = _job_settings(gpus_per_node=2, node_selector="pool=gpu")
    runs = mount / "kfvision-runs" / "run-1" / "jobs"  # the run's folder on the data PVC
    summary = train_step.train_step(
        resnet18_dir, tiny_digits["train"], tiny_digits["val"], tmp_path / "trained",
        tmp_path / "job.yaml", options=pipeline_train_options(
            epochs=2, batch_size=8, warmup_epochs=0, learning_rate=0.01, random_seed=1,
            patience=3, print_frequency=10, image_size=32, augment="none"),
        settings=settings, run_key="run-1/train", mode="cluster", pvc_name="data",
        kind=job_kind)
    assert summary["best_epoch"] == 2
    assert (tmp_path / "trained" / "metrics.json").is_file()  # copied into the Model output
    assert not list(runs.iterdir())  # staging removed after the copy
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert job["kind"] == expected.kind
    assert train_step.job_summary(tmp_path / "job.yaml")["kind"] == expected.kind
    name = job["metadata"]["name"]
    assert seen["staged"] == [name]
    for flag, sub in (("--model", "model"), ("--train", "train"), ("--val", "val")):
        assert seen[flag] == str(runs / name / sub)
    pod = _pod_and_args(job)[0]
    assert {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "data"}} in pod["volumes"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    limits = (job["spec"]["trainer"]["resourcesPerNode"] if expected is TRAINJOB
              else pod["containers"][0]["resources"])["limits"]
    assert limits == {"nvidia.com/gpu": 2}


def test_a_cluster_that_serves_neither_kind_is_told_so(tmp_path, monkeypatch, tiny_digits,
                                                        resnet18_dir):
    from kfvision.pipelines.jobs import jobclient

    monkeypatch.setattr(train_step, "DATA_MOUNT", str(tmp_path))
    monkeypatch.setattr(train_step, "is_mount", lambda path: True)
    monkeypatch.setattr(jobclient, "connect", lambda namespace=None, out=None, kind=PYTORCHJOB:
                        FakeJobs([None], kind, served=()))
    with pytest.raises(InvalidParameterError, match="neither trainjobs.trainer.kubeflow.org.*"
                       "nor pytorchjobs.kubeflow.org"):
        train_step.train_step(resnet18_dir, tiny_digits["train"], tiny_digits["val"],
                              tmp_path / "o", tmp_path / "job.yaml", options=pipeline_train_options(
                                  epochs=1, batch_size=8, warmup_epochs=0, learning_rate=0.01,
                                  random_seed=1, patience=3, print_frequency=10, image_size=32,
                                  augment="none"),
                              settings=_job_settings(), run_key="r/t", mode="cluster",
                              pvc_name="data")


def test_the_cluster_path_needs_the_data_pvc(tmp_path, monkeypatch, tiny_digits, resnet18_dir):
    from kfvision.trainer.errors import StorageError

    monkeypatch.setattr(train_step, "DATA_MOUNT", str(tmp_path))  # a folder, not a mount
    with pytest.raises(StorageError, match="neither the run's KFP workspace nor the data PVC"):
        train_step.train_step(resnet18_dir, tiny_digits["train"], tiny_digits["val"],
                              tmp_path / "o", tmp_path / "job.yaml",
                              options=pipeline_train_options(
                                  epochs=1, batch_size=8, warmup_epochs=0, learning_rate=0.01,
                                  random_seed=1, patience=3, print_frequency=10, image_size=32,
                                  augment="none"),
                              settings=_job_settings(), run_key="r/t", mode="cluster",
                              pvc_name="data")


def test_curves_page_has_three_charts_and_the_final_figures():
    page = curves_html(fake_metrics(3))
    assert page.count("<svg") == 3 and page.count("<polyline") == 5
    assert "best epoch 3 of 3: validation top-1 0.5000" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # all inline
    assert curves_html(fake_metrics(1)).count("<circle") == 5  # one epoch still draws


def test_evaluation_page_embeds_the_picture():
    metrics = {"rows": 2, "accuracy": 0.5, "top_k": 2, "top5_accuracy": 1.0,
               "per_class": [{"class": "a<b", "precision": 1.0, "recall": 0.5, "f1": 0.667,
                              "support": 2}]}
    page = evaluation_html(b"\x89PNG", metrics)
    assert "data:image/png;base64,iVBORw==" in page and "a&lt;b" in page


# The local path's TrainJob, run by the train step: tests/flow/test_tracking_jobs.py (one run
# checks what the step returns and writes, and what it logs into the task's MLflow run).


def test_the_run_data_place_is_the_workspace_else_the_data_pvc_else_none(tmp_path):
    from kfvision.pipelines.flow.storage import data_place

    pvc = str(tmp_path / "pvc")
    mounted = lambda path: path == pvc  # noqa: E731
    assert data_place("/kfp-workspace", "run/1", cluster=True, mounted=mounted,
                      data_mount=pvc) == Path("/kfp-workspace/kfvision")
    assert data_place("", "run/1", cluster=True, mounted=mounted, data_mount=pvc) == \
        Path(pvc) / "kfvision-runs" / "run-1"
    assert data_place("", "run/1", cluster=False, mounted=mounted, data_mount=pvc) is None


def test_prepare_workspace_opens_the_kfvision_folder_once(tmp_path):
    import os
    import stat

    from kfvision.pipelines.flow.storage import prepare_workspace

    assert prepare_workspace("") == "no workspace: nothing to prepare"
    if os.geteuid() != 0:
        pytest.skip("the step runs as root (kubernetes.set_security_context); this test too")
    said = prepare_workspace(str(tmp_path))
    assert "mode 0777" in said
    assert stat.S_IMODE((tmp_path / "kfvision").stat().st_mode) == 0o777
    assert "already" in prepare_workspace(str(tmp_path))
