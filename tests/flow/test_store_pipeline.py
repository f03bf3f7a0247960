"""The pipeline with a store (`--data-uri s3://...`) and no shared volume: compiled without any
PVC, valid without a workspace or a data PVC, the train step's job on s3:// paths (so no access
mode to check, any number of nodes), and the whole pipeline with KFP's local runner against a real
S3 API server (moto's, on loopback) with the images and the models in the store."""

import json
from pathlib import Path

import pytest
import yaml
from helpers.runs import pipeline_job_settings, pipeline_train_options

from kfvision.pipelines.clients.s3 import S3_SECRET_KEYS
from kfvision.pipelines.flow.pipeline import compile_pipeline
from kfvision.pipelines.flow.steps import train as train_step
from kfvision.pipelines.flow.storage import Storage, check_data_pvc_use, run_prefix
from kfvision.pipelines.jobs.kinds import PYTORCHJOB
from kfvision.trainer.errors import InvalidParameterError

STORE = Storage(workspace_size="", data_uri="s3://bkt/runs", s3_credentials="kfvision-s3")
S3_STEPS = ("convert-to-image-directory", "split-image-directory", "train-pytorch-model",
            "score-image-model")
OPTIONS = dict(epochs=1, batch_size=8, warmup_epochs=0, learning_rate=0.01, random_seed=1,
               patience=3, print_frequency=10, image_size=32, augment="none")


def test_a_pipeline_with_a_store_mounts_no_volume(tmp_path):
    path = tmp_path / "p.yaml"
    compile_pipeline(path, storage=STORE.validate())
    spec, platform = yaml.safe_load_all(path.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert not [n for n, e in executors.items() if "pvcMount" in e]  # no data PVC
    assert "pipelineConfig" not in platform["platforms"]["kubernetes"]  # no workspace
    assert "kfp-workspace" not in path.read_text()
    assert "prepare-workspace" not in json.dumps(spec["root"]["dag"])
    with_secret = {n.removeprefix("exec-") for n, e in executors.items() if "secretAsEnv" in e}
    assert {n.rstrip("-0123456789") for n in with_secret} == set(S3_STEPS)
    for name in with_secret:
        (env,) = executors["exec-" + name]["secretAsEnv"]
        assert [m["secretKey"] for m in env["keyToEnv"]] == list(S3_SECRET_KEYS)
    dags = [spec["root"], *spec["components"].values()]
    stores = {t: task["inputs"]["parameters"]["store"]["runtimeValue"]["constant"]
              for c in dags for t, task in c.get("dag", {}).get("tasks", {}).items()
              if "store" in task.get("inputs", {}).get("parameters", {})}
    assert set(stores.values()) == {"s3://bkt/runs"}
    assert {t.rstrip("-0123456789") for t in stores} == {
        "check-parameters", "convert-to-image-directory", "split-image-directory",
        "train-pytorch-model"}


def test_no_workspace_and_no_data_pvc_is_valid_with_a_store_only():
    Storage(workspace_size="", data_uri="s3://bkt/p").validate()
    with pytest.raises(InvalidParameterError, match="--data-pvc NAME or --data-uri"):
        Storage(workspace_size="").validate()
    with pytest.raises(InvalidParameterError, match="--data-uri 'bkt/p' is not an s3:// URI"):
        Storage(workspace_size="", data_uri="bkt/p").validate()
    assert run_prefix("s3://bkt/p/", "run 1", "train") == "s3://bkt/p/run-1/train/"


def test_with_a_store_deploy_needs_no_model_uri_and_a_script_is_refused():
    deploy = {"train_source": "s3://bkt/d/", "deploy": True}
    check_data_pvc_use(deploy, has_data_pvc=False, has_store=True)
    STORE.check_arguments(deploy)
    with pytest.raises(InvalidParameterError, match="model_uri"):
        check_data_pvc_use(deploy, has_data_pvc=False)
    with pytest.raises(InvalidParameterError, match="script_source with a pipeline compiled "
                       "with --data-uri"):
        STORE.check_arguments({**deploy, "script_source": "s3://bkt/src.tar.gz"})


class FakeJobs:
    """A JobClient stand-in (no API server can run here): the job is new, this step's pod mounts
    the workspace `claims`, whose access mode is ReadWriteOnce."""

    def __init__(self, claims):
        self.kind, self.namespace, self.claims, self.asked = PYTORCHJOB, "ns", claims, []

    def own_claims(self, pod):
        return self.claims

    def access_modes(self, claim):
        self.asked.append(claim)
        return ["ReadWriteOnce"]

    def get(self, name):
        from kfvision.pipelines.clients.k8s import KubernetesError

        raise KubernetesError(f"get PyTorchJob ns/{name} failed: HTTP 404", 404)

    def say(self, line):
        pass


def _settings(nodes: int) -> dict:
    return pipeline_job_settings(nodes=nodes)


def _cluster(monkeypatch, fake, submitted: list):
    from kfvision.pipelines.jobs import jobclient

    monkeypatch.setattr(jobclient, "connect", lambda namespace=None, out=None, kind=None: fake)
    monkeypatch.setattr(jobclient, "submit", lambda client, job, **kw: submitted.append(job))


def test_two_nodes_on_a_read_write_once_workspace_are_refused(tmp_path, monkeypatch,
                                                              tiny_digits, resnet18_dir):
    """The job would mount the workspace on every node: refused before submitting."""
    workspace = tmp_path / "kfp-workspace"
    fake, submitted = FakeJobs({str(workspace): "run-1-kfp-workspace"}), []
    _cluster(monkeypatch, fake, submitted)
    with pytest.raises(InvalidParameterError, match="nodes = 2.*ReadWriteOnce"):
        train_step.train_step(resnet18_dir, tiny_digits["train"], tiny_digits["val"],
                              tmp_path / "out", tmp_path / "job.yaml",
                              options=pipeline_train_options(**OPTIONS), settings=_settings(2),
                              run_key="run-1/train", mode="cluster", kind="pytorchjob",
                              workspace=str(workspace))
    assert fake.asked == ["run-1-kfp-workspace"] and not submitted


def test_two_nodes_through_the_store_need_no_shared_volume(tmp_path, monkeypatch, s3_bucket,
                                                           tiny_digits, resnet18_dir):
    """The same two-node job with a store: nothing mounted, nothing staged, no access mode asked;
    the untrained model pushed, the job on the store's URIs (the node agent), and the model it
    writes to --out fetched into the step's output."""
    from kfvision.pipelines.clients.storepush import push_image_directory, push_model
    from kfvision.pipelines.contract import STORE_COMMAND
    from kfvision.pipelines.flow.steps.store import job_paths

    workspace = tmp_path / "kfp-workspace"
    fake, submitted = FakeJobs({str(workspace): "run-1-kfp-workspace"}), []
    _cluster(monkeypatch, fake, submitted)
    for side in ("train", "val"):
        push_image_directory(tiny_digits[side], s3_bucket.uri(f"runs/run-1/{side}"))
    paths = job_paths(s3_bucket.uri("runs"), "run-1", s3_bucket.uri("runs/run-1/train/"),
                      s3_bucket.uri("runs/run-1/val/"))
    trained = tmp_path / "trained-by-the-job"  # what the job's node 0 would push to --out
    trained.mkdir()
    (trained / "metrics.json").write_text(json.dumps({"final": {"val_top1": 0.5}}))

    def submit(client, job, **kw):
        submitted.append(job)
        push_model(resnet18_dir, paths["out"])  # stands in for the job's pods
        s3_bucket.upload_folder(trained, paths["out"].removeprefix(s3_bucket.uri()))

    from kfvision.pipelines.jobs import jobclient

    monkeypatch.setattr(jobclient, "submit", submit)
    summary = train_step.train_step(
        resnet18_dir, tiny_digits["train"], tiny_digits["val"], tmp_path / "out",
        tmp_path / "job.yaml", options=pipeline_train_options(**OPTIONS),
        settings={**_settings(2), "service_account": "bucket-reader", "scratch_size": "50Gi",
                  "scratch_class": "fast-ssd"},
        run_key="run-1/train", mode="cluster", kind="pytorchjob", workspace=str(workspace),
        store=paths, s3_secret="kfvision-s3")
    assert summary == {"final": {"val_top1": 0.5}} and fake.asked == []
    assert (tmp_path / "out" / "spec.json").is_file()  # the model, in the step's output
    assert not (workspace / "kfvision").exists()  # nothing staged
    (job,) = submitted
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert "persistentVolumeClaim" not in yaml.safe_dump(job)
    (container,) = pod["containers"]
    assert container["command"] == list(STORE_COMMAND)
    flags = dict(zip(container["args"][::2], container["args"][1::2]))
    assert {k: flags["--" + k] for k in paths} == paths
    refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]
            if "valueFrom" in e]
    assert set(refs) == {"kfvision-s3"}
    # the job's account and scratch volume, as `kfvision job render` takes them
    assert pod["serviceAccountName"] == "bucket-reader"
    (scratch,) = [v for v in pod["volumes"] if "ephemeral" in v]
    claim = scratch["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "fast-ssd"
    assert claim["resources"]["requests"]["storage"] == "50Gi"
    from kfvision.pipelines.clients import s3

    keys = {o.key for o in s3.list_objects(paths["model"])}
    assert "runs/run-1/untrained/spec.json" in keys  # the untrained model, pushed first


@pytest.mark.slow
def test_the_local_pipeline_passes_everything_through_the_store(s3_bucket, micro_digits,
                                                                tmp_path):
    """Two nodes, no workspace, no data PVC, an s3:// source and an s3:// --model-uri: the image
    directories and both models are in the store, the job read and wrote them there, score
    scored the store's validation images, and the model at --model-uri is the trained one. (One
    pipeline run for both claims: each local pipeline run starts a process per step.)"""
    from kfvision.pipelines.clients import s3
    from kfvision.pipelines.clients.models import resolve_model
    from kfvision.pipelines.flow.localrun import find, run_local_pipeline
    from kfvision.trainer.data.imagedir import MANIFEST

    s3_bucket.upload_folder(micro_digits["raw"] / "train", "digits/train/")
    store, model_uri = s3_bucket.uri("runs"), s3_bucket.uri("models/digits/")
    run = run_local_pipeline({"train_source": s3_bucket.uri("digits/train/"), "fraction": 0.6,
                              "model_uri": model_uri, "epochs": 1, "image_size": 32,
                              "batch_size": 8, "nodes": 2, "procs_per_node": 1, "augment": "none",
                              "print_frequency": 100},
                             tmp_path / "pipeline", data_uri=store)
    converted = json.loads((find(run, "convert-to-image-directory", "image_directory")
                            / MANIFEST).read_text())
    assert converted["source"]["uri"].startswith(s3_bucket.uri("digits/"))
    assert {"models/digits/model.json", "models/digits/weights.pt"} <= \
        {o.key for o in s3.list_objects(model_uri)}
    trained = find(run, "train-pytorch-model", "trained_model")
    assert (resolve_model(model_uri) / "weights.pt").read_bytes() == \
        (trained / "weights.pt").read_bytes()
    keys = {o.key for o in s3.list_objects(store + "/")}
    (run_id,) = {k.split("/")[1] for k in keys}
    here = f"runs/{run_id}/"
    for folder in ("source", "train", "val"):
        assert here + f"{folder}/{MANIFEST}" in keys
    assert here + "untrained/spec.json" in keys
    assert {here + "model/model.json", here + "model/weights.pt"} <= keys
    assert not [k for k in keys if "/checkpoints/" in k]  # cleared once the model was there
    job = yaml.safe_load(find(run, "train-pytorch-model", "job").read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1  # two nodes
    assert "persistentVolumeClaim" not in yaml.safe_dump(job)
    # the validation artifact's manifest names the split step's scratch folder, gone since:
    # score could only read the images from the store
    val = json.loads((find(run, "split-image-directory", "validation") / MANIFEST).read_text())
    assert not Path(val["images_root"]).exists()
    scored = find(run, "score-image-model", "scored").read_text().splitlines()
    assert len(scored) - 1 == len(val["images"])
    evaluation = json.loads((find(run, "evaluate-model", "evaluation") / "metrics.json")
                            .read_text())
    assert evaluation["rows"] == len(val["images"])
