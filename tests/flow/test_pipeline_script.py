"""The pipeline trains with your own script (script_source): its parameters in the compiled
pipeline, the job the train step emits (both kinds, the upstream checks of
tests/script/test_script.py) on the cluster path (a fake Kubernetes API: none can run here; the job
it submits is run as local processes, as the cluster's pods would run it), the whole pipeline with
KFP's local runner on a SageMaker-style script, and bad input stopping it with a named error."""

import json
import shutil
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.k8s_checks import crd_schema as _crd
from helpers.k8s_checks import job_pods as _pods
from helpers.k8s_checks import restricted_problems, unknown_fields
from helpers.paths import REPO
from kfvision.pipelines import contract
from kfvision.pipelines.flow.localrun import find, run_local_pipeline, summary
from kfvision.pipelines.flow.params import SCRIPT_OPTIONS, pipeline_options
from kfvision.pipelines.flow.pipeline import compile_pipeline, parameter_defaults
from kfvision.pipelines.flow.steps import train as train_step
from kfvision.pipelines.flow.steps.check import check_parameters
from kfvision.pipelines.flow.steps.common import run
from kfvision.pipelines.flow.steps.trainscript import (
    CHANNELS,
    parse_args,
    parse_entry,
    script_train_step,
)
from kfvision.pipelines.jobs.errors import InvalidJobError, JobFailedError
from kfvision.pipelines.jobs.kinds import PYTORCHJOB, TRAINJOB
from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError
from test_pipeline_steps import FakeJobs, _job_settings

SAGEMAKER = REPO / "tests" / "script" / "styles" / "sagemaker_style"


def script(source, entry="train.py", args="--epochs 1 --lr 0.2", launcher="python",
           requirements="") -> dict:
    return {"script_source": str(source), "script_entry": entry, "script_args": args,
            "script_requirements": requirements, "script_launcher": launcher}


@pytest.fixture(autouse=True)
def _env_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv(contract.ENV_CACHE, str(tmp_path_factory.getbasetemp() / "envs"))


def test_the_script_parameters_are_declared_once_and_reach_the_train_step(tmp_path):
    names = [o.param for o in SCRIPT_OPTIONS]
    assert names == ["script_source", "script_entry", "script_args", "script_requirements",
                     "script_launcher"]
    assert {n: parameter_defaults()[n] for n in names} == {
        n: pipeline_options()[n].default for n in names}
    assert parameter_defaults()["script_source"] == ""  # the built-in trainer by default
    compile_pipeline(tmp_path / "p.yaml")
    spec = next(yaml.safe_load_all((tmp_path / "p.yaml").read_text()))
    task = spec["root"]["dag"]["tasks"]["train-pytorch-model"]["inputs"]["parameters"]
    check = spec["root"]["dag"]["tasks"]["check-parameters"]["inputs"]["parameters"]
    for name in names:  # run-time parameters, handed on as they are
        assert task[name] == check[name] == {"componentInputParameter": name}
        assert spec["root"]["inputDefinitions"]["parameters"][name]["isOptional"]


@pytest.mark.parametrize("text, expected", [
    ("train.py", {"entry": "train.py", "module": None}),
    (" -m pkg.train ", {"entry": None, "module": "pkg.train"}),
])
def test_the_entry_is_a_file_or_a_module(text, expected):
    assert parse_entry(text) == expected


def test_the_arguments_are_one_string_split_as_a_shell_would():
    assert parse_args("--epochs 3 --name 'a b' --empty ''") == (
        "--epochs", "3", "--name", "a b", "--empty", "")
    with pytest.raises(InvalidParameterError, match="close its quotes"):
        parse_args("--name 'a b")


@pytest.mark.parametrize("over, message", [
    ({"script_entry": "train.py"}, "script_entry is set, but script_source is empty"),
    ({"script_source": "SRC", "script_entry": ""}, "script_entry = '' is not a script"),
    ({"script_source": "SRC", "script_entry": "missing.py"},
     "script_entry missing.py is not in script_source"),
    ({"script_source": "SRC", "script_requirements": "nope.txt"},
     "script_requirements nope.txt is not in script_source"),
    ({"script_source": "s3://b/src.zip"}, "is not a packed source"),
    ({"script_source": "SRC", "script_launcher": "python", "procs_per_node": 2},
     "runs one process per pod"),
    ({"script_source": "SRC", "script_launcher": "mpirun"}, "script_launcher"),
])
def test_bad_script_parameters_are_refused_before_anything_runs(micro_digits, over, message):
    params = {**parameter_defaults(), "train_source": str(micro_digits["raw"] / "train"),
              "script_entry": "train.py"}
    params.update({k: str(SAGEMAKER) if v == "SRC" else v for k, v in over.items()})
    with pytest.raises(InvalidParameterError) as e:
        check_parameters(**params)
    assert message in e.value.named(lambda f: f)


def test_an_entry_missing_from_the_source_stops_the_local_pipeline_before_it_starts(
        micro_digits, tmp_path):
    with pytest.raises(InvalidJobError, match="--script-entry tran.py is not in "
                       "--script-source"):
        run_local_pipeline({"train_source": str(micro_digits["raw"] / "train"),
                            **script(SAGEMAKER, entry="tran.py")}, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing ran


def _run_emitted_job(monkeypatch, kind):
    """A fake cluster's submit that runs the emitted job as local processes, as the cluster's
    pods would (same paths: the stage is on the "PVC")."""
    from kfvision.pipelines.jobs import jobclient
    from kfvision.pipelines.jobs.pytorchjob import local as pytorchjob_local
    from kfvision.pipelines.jobs.trainjob import local as trainjob_local

    seen = {}

    def submit(client, job, *, wait, poll_s, logs):
        assert wait and logs and client.kind.kind == job["kind"]
        seen["job"] = job
        local = trainjob_local if job["kind"] == "TrainJob" else pytorchjob_local
        local.run_local(job, Path(client.logs), source="the fake cluster")
        return job

    monkeypatch.setattr(jobclient, "submit", submit)
    return seen


@pytest.mark.distributed
@pytest.mark.parametrize("job_kind, kind, crd", [
    ("pytorchjob", PYTORCHJOB, ("kubeflow.org_pytorchjobs.yaml",)),
    ("trainjob", TRAINJOB, ("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml")),
])
def test_the_cluster_path_emits_the_script_job_and_keeps_its_model(
        tmp_path, monkeypatch, micro_digits, job_kind, kind, crd):
    from kfvision.pipelines.jobs import jobclient

    mount = tmp_path / "pvc"
    mount.mkdir()
    monkeypatch.setattr(train_step, "DATA_MOUNT", str(mount))
    monkeypatch.setattr(train_step, "is_mount", lambda path: path == str(mount))
    fake = FakeJobs([None], kind, (kind,))
    fake.logs = tmp_path / "pods"
    monkeypatch.setattr(jobclient, "connect", lambda namespace=None, out=None, kind=kind: fake)
    seen = _run_emitted_job(monkeypatch, job_kind)
    summary = script_train_step(
        micro_digits["train"], micro_digits["val"], tmp_path / "trained", tmp_path / "job.yaml",
        script=script(SAGEMAKER, args="--epochs 1 --lr 0.2 --num-gpus 0"),
        settings=_job_settings(), run_key="run-1/train", mode="cluster", pvc_name="data",
        kind=job_kind, runtime="kfvision-torch")
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert job == seen["job"] and job["kind"] == kind.kind
    schema = _crd(*crd)
    jsonschema.validate(job, schema)
    assert unknown_fields(job, schema) == []
    for pod in _pods(job):
        assert restricted_problems(pod) == []
        assert {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "data"}} in pod["volumes"]
        assert not [v for v in pod["volumes"] if "configMap" in v]  # no ConfigMap to create
        if kind is PYTORCHJOB:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": "p"}, "spec": pod}, "1.30", strict=True)
    args = (job["spec"]["trainer"] if kind is TRAINJOB else _pods(job)[0]["containers"][0])[
        "args"]
    name = job["metadata"]["name"]
    stage = mount / "kfvision-runs" / "run-1" / "jobs" / name  # the run's folder on the PVC
    flags = dict(zip(args[:args.index("--")][::2], args[1:args.index("--")][::2]))
    assert flags["--snapshot"] == f"{stage}/source/{flags['--sha256']}.tar.gz"
    assert flags["--output-uri"] == f"{stage}/result"
    assert [a for a in args if a.startswith(tuple(f"{c}=" for c in CHANNELS))] == [
        f"{c}={stage}/channels/{c}" for c in CHANNELS]
    assert args[args.index("--") + 1:] == ["--epochs", "1", "--lr", "0.2", "--num-gpus", "0"]
    assert name == train_step.job_name(train_step.JOB_PREFIX, "run-1/train")
    # the script's model folder is the step's Model output; the stage is gone
    assert {"model.pt", "classes.txt", contract.PROVENANCE} <= {
        p.name for p in (tmp_path / "trained").iterdir()}
    assert summary["layout"] == "ok" and summary["script"]["source_sha256"] == flags["--sha256"]
    assert not stage.exists()


def _local(tmp_path, source, micro_digits, **over) -> dict:
    return script_train_step(micro_digits["train"], micro_digits["val"], tmp_path / "trained",
                             tmp_path / "job.yaml", script=script(source, **over),
                             settings=_job_settings(), run_key="r/t", mode="local")


@pytest.mark.distributed
def test_a_script_that_exits_1_fails_the_step_with_the_named_error_once(tmp_path, micro_digits,
                                                                        capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("import sys\nprint('giving up', flush=True)\nsys.exit(1)\n")
    with pytest.raises(SystemExit) as e:
        run(_local, tmp_path, src, micro_digits)
    assert e.value.code == 1
    out, err = capsys.readouterr()
    first, *tail = err.splitlines()  # the named line, then the job's last log lines
    assert first.startswith("error: JobFailedError: job kfvision-train-") and \
        "rank 0 on node 0 exited with 1" in first and "the first failure of the job" in first
    assert any("giving up" in line for line in tail)
    assert out.count("giving up") == 1  # exit 1 is permanent: not retried
    with pytest.raises(JobFailedError):
        _local(tmp_path, src, micro_digits)


@pytest.mark.distributed
def test_a_model_folder_kfvision_cannot_read_is_kept_and_score_says_what_to_write(
        tmp_path, micro_digits, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(
        "import os, torch\n"
        "torch.save(torch.nn.Linear(2, 2).state_dict(), os.environ['SM_MODEL_DIR'] + '/m.pth')\n")
    got = _local(tmp_path, src, micro_digits)
    assert got["layout"].startswith(f"{tmp_path / 'trained'} is not a trained model directory")
    assert "warning: the model folder your script wrote cannot be scored" in capsys.readouterr(
    ).out
    assert (tmp_path / "trained" / "m.pth").is_file()  # kept: the user can still fetch it
    from kfvision.pipelines.flow.steps.use import score_step

    with pytest.raises(InvalidModelDirectoryError, match="model.pt2, model.pt, model.onnx with "
                       "classes.txt"):
        score_step(tmp_path / "trained", micro_digits["val"], tmp_path / "scored.csv")
    (src / "train.py").write_text("print('saved nothing')\n")
    shutil.rmtree(tmp_path / "trained")
    with pytest.raises(InvalidModelDirectoryError, match="wrote nothing into its model folder"):
        _local(tmp_path, src, micro_digits)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_local_pipeline_trains_a_sagemaker_style_script_and_scores_its_model(
        micro_digits, tmp_path):
    run_ = run_local_pipeline({"train_source": str(micro_digits["raw"] / "train"),
                               "validation_source": str(micro_digits["raw"] / "val"),
                               **script(SAGEMAKER, args="--epochs 2 --lr 0.2",
                                        launcher="torchrun")}, tmp_path / "out")
    trained = find(run_, "train-pytorch-model", "trained_model")
    assert (trained / "model.pt").is_file()
    assert (trained / "classes.txt").read_text().split() == [str(d) for d in range(10)]
    ran = json.loads((trained / contract.PROVENANCE).read_text())
    assert ran["entry"] == "train.py" and ran["args"] == ["--epochs", "2", "--lr", "0.2"]
    job = yaml.safe_load(find(run_, "train-pytorch-model", "job").read_text())
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-I", "-u", "-m", "kfvision.pipelines.script.boot"]
    assert "train.py" in container["args"] and "torchrun" in container["args"]
    scored = find(run_, "score-image-model", "scored").read_text().splitlines()
    assert len(scored) == 1 + 10  # the 10 validation digits, scored by the script's model
    evaluation = json.loads((find(run_, "evaluate-model", "evaluation") / "metrics.json")
                            .read_text())
    assert evaluation["rows"] == 10 and evaluation["accuracy"] is not None
    assert "your script train.py --epochs 2 --lr 0.2" in summary(run_)
    assert "Trained by your script" in find(run_, "train-pytorch-model", "curves").read_text()


def test_an_s3_source_is_a_packed_snapshot_checked_against_its_name(s3_bucket, tmp_path):
    from kfvision.pipelines.flow.steps.trainscript import snapshot
    from kfvision.pipelines.script.snapshot import InvalidSourceError, pack

    packed = pack(SAGEMAKER)
    s3_bucket.put(f"src/{packed.sha256}.tar.gz", packed.data)
    got = snapshot(s3_bucket.uri(f"src/{packed.sha256}.tar.gz"), tmp_path)
    assert (got.sha256, got.files, got.data) == (packed.sha256, packed.files, packed.data)
    s3_bucket.put(f"src/{'0' * 64}.tar.gz", packed.data)  # a name its bytes do not match
    with pytest.raises(InvalidSourceError, match="changed after it was uploaded"):
        snapshot(s3_bucket.uri(f"src/{'0' * 64}.tar.gz"), tmp_path)
    with pytest.raises(InvalidSourceError, match="is not there"):
        snapshot(s3_bucket.uri("src/missing.tar.gz"), tmp_path)
