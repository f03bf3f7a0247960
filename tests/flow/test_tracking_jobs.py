"""The train step forwards the MLflow variables it received (KFP 2.17 injects them into a task's
container) into the job's training container, both kinds, locally and on a cluster: what the
manifest carries, and a TrainJob run locally that logs into the task's run on a real server (the
one run of the local path's TrainJob: what the step returns and keeps is checked there too)."""

import pytest
import yaml
from helpers.runs import pipeline_job_settings, pipeline_train_options

from kfvision.pipelines.flow.steps import train as train_step
from kfvision.pipelines.flow.steps.train import job_config
from kfvision.pipelines.jobs.kinds import PYTORCHJOB, TRAINJOB
from kfvision.pipelines.jobs.mlflowenv import tracking_env
from kfvision.pipelines.jobs.render import render_job
from kfvision.trainer.config import TrainConfig

KFP_ENV = {"MLFLOW_TRACKING_URI": "https://mlflow.kubeflow:5000", "MLFLOW_RUN_ID": "abc123",
           "MLFLOW_EXPERIMENT_ID": "4", "MLFLOW_TRACKING_AUTH": "kubernetes",
           "MLFLOW_TRACKING_TOKEN": "s3cret", "HOME": "/home/x"}


_settings = pipeline_job_settings


def test_nothing_is_forwarded_without_a_tracking_uri():
    assert tracking_env({"HOME": "/x", "MLFLOW_RUN_ID": "r"}, kind="TrainJob",
                                   name="j", run_id="r1", local=True) == ()


def test_credentials_go_into_local_processes_only(capsys):
    local = dict(tracking_env(KFP_ENV, kind="TrainJob", name="j", run_id="r1",
                                         local=True))
    assert local["MLFLOW_TRACKING_TOKEN"] == "s3cret" and "HOME" not in local
    assert (local["KFVISION_JOB_KIND"], local["KFVISION_JOB_NAME"],
            local["KFVISION_PIPELINE_RUN"]) == ("TrainJob", "j", "r1")
    cluster = dict(tracking_env(KFP_ENV, kind="PyTorchJob", name="j", run_id="r1",
                                           local=False))
    assert "MLFLOW_TRACKING_TOKEN" not in cluster
    assert cluster["MLFLOW_RUN_ID"] == "abc123" and cluster["MLFLOW_TRACKING_AUTH"] == "kubernetes"
    assert "MLFLOW_TRACKING_TOKEN not written into the job" in capsys.readouterr().out


@pytest.mark.parametrize("kind", [PYTORCHJOB, TRAINJOB])
def test_the_rendered_job_carries_the_variables_in_its_training_container(kind):
    cfg = TrainConfig(model="/m", train="/t", val="/v", out="/o")
    env = tracking_env(KFP_ENV, kind=kind.kind, name="j", run_id="r1", local=False)
    job = render_job(job_config(cfg, run_id="r1/train", env=env, **_settings()), kind,
                     "torch-distributed")
    if kind is TRAINJOB:
        container_env = job["spec"]["trainer"]["env"]
        assert container_env[0]["name"] == "PYTHONUNBUFFERED"
    else:
        (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"]
        container_env = container["env"]
    got = {e["name"]: e["value"] for e in container_env}
    assert got["MLFLOW_RUN_ID"] == "abc123" and got["KFVISION_JOB_KIND"] == kind.kind
    no_env = render_job(job_config(cfg, run_id="r1/train", **_settings()), kind,
                        "torch-distributed")
    assert "MLFLOW" not in yaml.safe_dump(no_env)  # untouched where MLflow is not configured


@pytest.mark.slow
@pytest.mark.distributed
def test_a_local_trainjob_logs_into_the_tasks_run(mlflow_server, tmp_path, tiny_digits,
                                                  resnet18_dir, monkeypatch):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    given = client.create_run(client.create_experiment(f"steps-{tmp_path.name}")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_RUN_ID", given)  # what KFP's driver hands the task
    summary = train_step.train_step(
        resnet18_dir, tiny_digits["train"], tiny_digits["val"], tmp_path / "trained",
        tmp_path / "job.yaml", options=pipeline_train_options(
            epochs=2, batch_size=16, warmup_epochs=0, learning_rate=0.05, random_seed=1,
            patience=3, print_frequency=100, image_size=32, augment="none"),
        settings=_settings(), run_key="run-1/train", mode="local", kind="trainjob")
    # the local path ran the TrainJob it was asked for, and kept its model and manifest
    assert summary["epochs_run"] == 2 and (tmp_path / "trained" / "weights.pt").is_file()
    assert train_step.job_summary(tmp_path / "job.yaml") == {
        "kind": "TrainJob", "name": yaml.safe_load((tmp_path / "job.yaml").read_text())[
            "metadata"]["name"], "nodes": 1, "procs_per_node": 1}
    run = client.get_run(given)
    assert sorted(m.step for m in client.get_metric_history(given, "val_loss")) == [1, 2]
    assert run.data.tags["kfvision.job_kind"] == "TrainJob"
    assert run.data.tags["kfvision.pipeline_run"] == "run-1"


def test_the_loss_chart_has_a_log_axis_so_every_epoch_can_be_read():
    """The demo's first validation loss (53.3) once flattened epochs 2-15 into the bottom line."""
    from kfvision.pipelines.flow.pages import line_chart

    losses = [53.3, 0.9, 0.4, 0.2, 0.1]
    page = line_chart("loss", [1, 2, 3, 4, 5], {"val": losses}, log=True)
    assert "loss (log scale)" in page and ">53.3<" in page and ">0.1<" in page
    ys = [float(p.split(",")[1]) for p in page.split('points="')[1].split('"')[0].split()]
    assert ys[1] - ys[4] < -50  # epochs 2 and 5 stand apart by more than 50 of 172 pixels
    linear = line_chart("loss", [1, 2], {"val": [float("nan"), 1.0]}, log=True)
    assert "log scale" not in linear  # a NaN loss keeps the linear axis
