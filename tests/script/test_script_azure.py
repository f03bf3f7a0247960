"""Scripts written for Azure ML v1, unchanged: its `Run` (pipelines/script/azurerun.py) and
Horovod's `horovod.torch` (hvd.py, hvdopt.py), which kfvision provides where the script's
environment lacks them (bridges.py), and `kfvision register` of what a job wrote (jobmodel.py).

One 2 x 2 local job of tests/script/styles/azure_horovod (Azure's Horovod MNIST sample's style:
Run.get_context(), run.log, log_list, tag, upload_file, register_model, DistributedOptimizer,
broadcast_parameters), with its Horovod checks against DDP run by every rank inside the same
launch, is shared by the tests that read it; the rest runs in this process."""

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from helpers.jobstatus import local_status
from helpers.paths import REPO
from kfvision.pipelines import contract
from kfvision.pipelines.cli import main
from kfvision.pipelines.jobs.metriclines import parse_metrics
from kfvision.pipelines.script import bridges, jobmodel
from kfvision.pipelines.script.azurerun import Run

STYLE = REPO / "tests" / "script" / "styles" / "azure_horovod"
CHECKS = ("world", "broadcast_parameters", "equals_ddp", "backward_passes_per_step",
          "predivide_and_fp16", "missing_grad_is_zeros", "broadcast_optimizer_state",
          "collectives", "not_provided_is_named")


def _tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# --- which stand-in a script gets (in process) ---

@pytest.mark.parametrize("files,pythonpath,added,says", [
    ({"train.py": "from azureml.core.run import Run\n"}, False, ["azure"],
     ["azureml: no azureml-core in the script's environment: kfvision's Run stands in"]),
    ({"train.py": "import horovod.torch as hvd\nfrom azureml.core import Run\n"}, False,
     ["azure", "horovod"], ["azureml: no azureml-core", "horovod: no horovod"]),
    ({"train.py": "import torch\n"}, False, [], []),
    ({"train.py": "from azureml.core import Run\n", "azureml/core/__init__.py": ""}, False, [],
     ["azureml: the script's environment has azureml-core of its own: its run.log reaches "
      "nothing outside Azure"]),
    ({"train.py": "import horovod.torch as hvd\n"}, True, [],
     ["horovod: the script's environment has horovod of its own"]),
])
def test_a_stand_in_only_where_the_scripts_environment_lacks_the_package(
        tmp_path, files, pythonpath, added, says):
    src = _tree(tmp_path / "src", files)
    env = {}
    if pythonpath:  # a Horovod of the user's, on their PYTHONPATH
        env["PYTHONPATH"] = str(_tree(tmp_path / "site", {"horovod/torch/__init__.py": ""}))
    add, lines = bridges.plan(src, Path(sys.executable), env)
    assert add == [str(bridges.SHIMS / name) for name in added]
    assert len(lines) == len(says) and all(line.startswith(s) for line, s in zip(lines, says))
    bridges.apply(env, add)
    if add:  # after the user's own entries
        assert env["PYTHONPATH"].split(os.pathsep)[-len(add):] == add
    import importlib.util

    for name in ("azureml", "horovod"):  # kfvision's own processes never find the stand-ins
        assert importlib.util.find_spec(name) is None


# --- Azure's Run in one process ---

@pytest.fixture
def job_env(tmp_path, monkeypatch):
    """A script's process as the boot starts it, without MLflow: outputs, one channel."""
    out = tmp_path / "outputs"
    out.mkdir()
    for name in ("RANK", "WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(contract.OUTPUT_DIR, str(out))
    monkeypatch.setenv(contract.SM_CHANNELS, json.dumps(["train-data"]))
    monkeypatch.setenv(contract.INPUT_PREFIX + "TRAIN_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("KFVISION_JOB_NAME", "fowl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delattr(Run, "_context", raising=False)
    return out


def test_azures_run_calls_by_keyword_map_onto_kfvision(job_env, tmp_path, capsys):
    run = Run.get_context()
    assert Run.get_context() is run and run.id == "fowl" and run.get_status() == "Running"
    run.log(name="Training loss", value=0.5, description="", step=3)
    run.log("acc", True)
    run.log("skipped", float("nan"))
    run.log("text", "not a number")
    run.log_list(name="accuracies", value=[0.1, 0.2], description="")
    run.log_row(name="Y over X", description=None, x=1, y=0.4)
    run.parent.log("best", 0.9)
    lines = capsys.readouterr().out.splitlines()
    assert [parse_metrics(line) for line in lines] == [
        {"step": 3, "Training_loss": 0.5}, {"acc": 1}, {"accuracies": 0.1},
        {"accuracies": 0.2}, {"Y_over_X_x": 1, "Y_over_X_y": 0.4}, {"best": 0.9}]
    assert run.input_datasets["train-data"] == str(tmp_path / "data")
    with pytest.raises(KeyError, match="'val' is not a data channel of this job: it has "
                                       "train-data; give it with `--input val=URI`"):
        run.input_datasets["val"]
    (tmp_path / "model.pt").write_bytes(b"weights")
    run.upload_file(name="outputs/model.pt", path_or_stream="model.pt")
    run.upload_files(names=["a/b.txt"], paths=[str(tmp_path / "model.pt")])
    import io

    run.upload_file("stream.txt", io.BytesIO(b"bytes"))
    run.log_table(name="Y over X", value={"x": [1, 2], "y": [0.6, 0.7]}, description="")
    run.log_image(name="curve", path=str(tmp_path / "model.pt"))
    assert (job_env / "model.pt").read_bytes() == b"weights"
    assert (job_env / "a" / "b.txt").read_bytes() == b"weights"
    assert (job_env / "stream.txt").read_bytes() == b"bytes"
    assert json.loads((job_env / "azureml" / "tables" / "Y_over_X.json").read_text()) == {
        "x": [1, 2], "y": [0.6, 0.7]}
    assert (job_env / "azureml" / "images" / "curve.pt").exists()
    assert run.experiment.name == "kfvision" and run.experiment.workspace.name == "kfvision"
    assert run.get_secret(name="x") is None  # the rest: accepted, nothing done
    run.tag("framework", "horovod")
    run.add_properties({"k": 1})
    assert run.get_tags() == {"framework": "horovod"} and run.properties == {"k": "1"}
    model = run.register_model(model_name="fowl", model_path="outputs/model.pt")
    assert model.version is None and model.name == "fowl"
    assert ("no MLflow server (--tracking-uri), so nothing was registered; after the job: "
            "kfvision job download fowl outputs/model.pt && kfvision register --model model.pt "
            "--name fowl") in capsys.readouterr().err
    run.complete()
    assert run.get_status() == "Completed"


def test_a_file_a_job_wrote_registers_not_servable_naming_its_job(tmp_path, mlflow_server,
                                                                   capsys):
    from mlflow.tracking import MlflowClient

    torch.save({"weight": torch.ones(2)}, tmp_path / "state.pt")
    jobmodel.record_download(tmp_path, tmp_path / "state.pt", job="fowl-17",
                             path="outputs/state.pt", where="a local run")
    argv = ["register", "--model", str(tmp_path / "state.pt"), "--name", "fowl-state",
            "--tracking-uri", mlflow_server]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "registered: fowl-state version 1 from job fowl-17" in out
    assert "not servable: a file, not a model directory. state.pt is not a model directory " \
           "kfvision serves, so `kfvision serve` and `deploy` refuse this version" in out
    assert "Add to your script" not in out
    version = MlflowClient(tracking_uri=mlflow_server).get_model_version("fowl-state", "1")
    assert version.tags[jobmodel.JOB_TAG] == "fowl-17"
    assert version.tags[jobmodel.SERVABLE_TAG] == "false"
    assert main([*argv, "--job", "other"]) == 0  # the same bytes: the same version
    assert "already registered (same content): fowl-state version 1" in capsys.readouterr().out


# --- the 2 x 2 job (one launch) ---

@pytest.fixture(scope="module")
def azure_job(tmp_path_factory, micro_digits, mlflow_server) -> dict:
    """`kfvision job run` of the style 2 x 2 with --verify, its MLflow run on the session's
    server: its folder, log and log folder."""
    root = tmp_path_factory.mktemp("azure_job")
    argv = [sys.executable, "-m", "kfvision.pipelines.cli", "job", "run", "--name", "fowl",
            "--image", "local", "--nodes", "2", "--nproc-per-node", "2", "--source", str(STYLE),
            "--entry", "train.py", "--input", f"digits={micro_digits['train']}",
            "--tracking-uri", mlflow_server, "--log-dir", str(root / "logs"),
            "-o", str(root / "job.yaml"), "--", "--epochs", "2", "--verify"]
    run = subprocess.run(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    log = run.stdout.decode(errors="replace")
    assert run.returncode == 0, log[-6000:]
    return {"root": root, "log": log, "logs": root / "logs"}


@pytest.mark.distributed
@pytest.mark.slow
def test_horovod_semantics_hold_inside_the_job_and_equal_ddps(azure_job):
    log = azure_job["log"]
    assert "azureml: no azureml-core in the script's environment" in log
    assert "horovod: no horovod in the script's environment" in log
    for check in CHECKS:
        assert f"HVDCHECK {check} ok" in log, check
    assert "HVDFAIL" not in log


@pytest.mark.distributed
@pytest.mark.slow
def test_an_azure_script_runs_2x2_its_metrics_in_job_status_and_mlflow(azure_job,
                                                                        mlflow_server, capsys):
    from mlflow.tracking import MlflowClient

    view = local_status("fowl", azure_job["logs"], capsys)
    assert view["phase"] == "Succeeded"
    metrics = view["progress"]["metrics"]
    assert metrics["epoch"] == 2 and metrics["step"] == 2 and 0 <= metrics["accuracies"] <= 1
    assert math.isfinite(metrics["Training_loss"])
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                "tags.`kfvision.job_name` = 'fowl'")  # the job's run
    curve = sorted((m.step, m.value) for m in
                   client.get_metric_history(run.info.run_id, "Training_loss"))
    assert [step for step, _ in curve] == [1, 2]
    assert curve[-1][1] == pytest.approx(metrics["Training_loss"], rel=1e-6)
    assert run.data.tags["framework"] == "horovod"
    assert run.data.tags["experiment"] == "kfvision"
    files = [a.path for a in client.list_artifacts(run.info.run_id, "outputs")]
    assert "outputs/model.pt" in files  # run.upload_file, uploaded with the outputs
    version = client.get_model_version("digits-hvd", "1")
    assert version.tags[jobmodel.JOB_TAG] == "fowl"
    assert version.tags[jobmodel.SERVABLE_TAG] == "false" and version.tags["world"] == "4"
    assert version.run_id == run.info.run_id
    assert "register_model: registered: digits-hvd version 1 from job fowl" in azure_job["log"]


@pytest.mark.distributed
@pytest.mark.slow
def test_what_job_download_fetched_registers_naming_the_job(azure_job, mlflow_server,
                                                            tmp_path, capsys):
    got = tmp_path / "got"
    assert main(["job", "download", "fowl", "outputs/model.pt", "--out", str(got),
                 "--log-dir", str(azure_job["logs"])]) == 0
    with zipfile.ZipFile(got / "model.pt") as z:  # torch.save of the module: a pickle of Net
        (pickled,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        assert b"__main__\nNet" in z.read(pickled)  # loadable only with the script's code
    capsys.readouterr()
    assert main(["register", "--model", str(got / "model.pt"), "--name", "fowl-dl",
                 "--tracking-uri", mlflow_server]) == 0
    assert "registered: fowl-dl version 1 from job fowl" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_the_azure_script_renders_as_both_job_kinds(tmp_path, kind):
    out = tmp_path / "job.yaml"
    assert main(["job", "render", "--name", "fowl", "--image", "registry.example.com/k:1",
                 "--kind", kind, *(["--runtime", "kfvision-torch"] if kind == "trainjob"
                                   else []), "--nodes", "2", "--nproc-per-node", "2",
                 "--source", str(STYLE), "--entry", "train.py", "-o", str(out),
                 "--", "--epochs", "2"]) == 0
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    job = docs[-1]
    containers = ([r["template"]["spec"]["containers"][0]
                   for r in job["spec"]["pytorchReplicaSpecs"].values()]
                  if kind == "pytorchjob" else [job["spec"]["trainer"]])
    for c in containers:
        assert {"name": "KFVISION_JOB_NAME", "value": "fowl"} in c["env"]
        args = c.get("args") or []
        assert args[args.index("--entry") + 1] == "train.py"


def test_a_file_a_job_wrote_registers_in_the_kubeflow_registry_not_servable(tmp_path,
                                                                           fake_registry,
                                                                           capsys):
    """The FAKE Kubeflow Model Registry (tests/helpers/fake_registry.py: its OpenAPI routes)."""
    torch.save({"weight": torch.ones(2)}, tmp_path / "state.pt")
    assert main(["register", "--model", str(tmp_path / "state.pt"), "--name", "fowl-state",
                 "--registry", "kubeflow", "--registry-url", fake_registry.url,
                 "--storage-uri", "s3://bucket/runs/fowl/outputs/state.pt", "--author", "ci",
                 "--job", "fowl-17"]) == 0
    out = capsys.readouterr().out
    assert "from job fowl-17" in out and "not servable: a file, not a model directory" in out
    (version,) = fake_registry.of("ModelVersion")
    props = version["customProperties"]
    assert props[jobmodel.JOB_TAG]["string_value"] == "fowl-17"
    assert props[jobmodel.SERVABLE_TAG]["string_value"] == "false"
    assert "classes" not in props
