"""The dataset crosses storage once: the byte meter (tests/helpers/meter.py) over the cluster
branch, for a source already on a volume and for an http(s) archive. The local pipeline run's
meter is read from tests/flow/test_pipeline_local.py's run (one local run for both).

docs/pipeline.md ("Data movement") has the figures, before and after, and the command that
prints them: `python -m pytest tests/flow/test_data_movement.py tests/flow/test_pipeline_local.py
-s`.
"""

import http.server
import shutil
import tarfile
from pathlib import Path

import pytest
from helpers.loopback import serve_in_thread
from helpers.meter import ClusterBranch, Meter, files, image_bytes
from helpers.runs import pipeline_job_settings, pipeline_train_options

from kfvision.pipelines.clients.k8s import KubernetesError
from kfvision.pipelines.flow.steps import data as data_steps
from kfvision.pipelines.flow.steps import train as train_step
from kfvision.pipelines.flow.steps.data import convert_step, split_step
from kfvision.pipelines.flow.steps.model import model_step
from kfvision.pipelines.flow.steps.use import evaluate_step, score_step
from kfvision.pipelines.flow.storage import data_place
from kfvision.pipelines.jobs import jobclient
from kfvision.pipelines.jobs.kinds import PYTORCHJOB
from kfvision.pipelines.jobs.pytorchjob.local import run_local

pytestmark = pytest.mark.slow
OPTIONS = pipeline_train_options(epochs=1, batch_size=16, warmup_epochs=0, learning_rate=0.01,
                        random_seed=1, patience=3, print_frequency=10, image_size=32,
                        augment="none")


class FakeAPI:
    """A FAKE Kubernetes API (no API server can run here): only what the train step asks. No
    job of that name yet; this step's pod mounts the workspace PVC `run-1-kfp-workspace`."""

    namespace, kind, api = "ns", PYTORCHJOB, None

    def __init__(self, workspace):
        self.claims = {str(workspace): "run-1-kfp-workspace"} if workspace else {}

    def get(self, name):
        raise KubernetesError(f"get PyTorchJob ns/{name} failed: HTTP 404", 404)

    def own_claims(self, pod):
        return self.claims

    def access_modes(self, claim):
        return ["ReadWriteMany"]

    def say(self, line):
        pass


def cluster_run(tmp_path, monkeypatch, source: str, *, pvc: Path | None, workspace: bool,
                dataset_bytes: int, downloads=()) -> Meter:
    """convert -> split -> model -> train (its job run as local processes) -> score ->
    evaluate, as on a cluster; returns the meter."""
    ws = tmp_path / "kfp-workspace" if workspace else None
    if ws:
        ws.mkdir()
    mount = pvc or tmp_path / "no-pvc"
    meter = Meter(dataset_bytes)
    branch = ClusterBranch(tmp_path / "run", meter, pvc=pvc, workspace=ws)
    monkeypatch.setattr(train_step, "DATA_MOUNT", str(mount))
    monkeypatch.setattr(train_step, "is_mount", lambda p: pvc is not None and p == str(pvc))
    monkeypatch.setattr(jobclient, "connect", lambda out=None, kind=None, namespace=None:
                        FakeAPI(ws))

    def submit(client, job, *, wait, poll_s, logs):
        branch.look()  # the job's staged inputs, as the job starts
        run_local(job, tmp_path / "job-logs", quiet=True)
        branch.look()  # its output, before the step copies it out and deletes the staging
        return job

    monkeypatch.setattr(jobclient, "submit", submit)
    place = data_place(str(ws) if ws else "", "run-1", cluster=True,
                       mounted=lambda p: pvc is not None, data_mount=str(mount))
    _, conv = branch.run("convert", convert_step, {}, ("image_directory",), source,
                         place=place)
    # what the step downloaded (into its data place; deleted again once extracted)
    meter.steps["convert"]["download"] += sum(size for _, size in downloads)
    _, split = branch.run("split", split_step, conv, ("train", "validation"),
                          fraction=0.75, random_seed=1)
    _, model = branch.run("model", model_step, {}, ("model",),
                          model_name="resnet18", pretrained=False)
    settings = pipeline_job_settings()
    summary, trained = branch.run(
        "train", train_step.train_step, {**model, **split}, ("trained_model", "job"),
        options=OPTIONS, settings=settings, run_key="run-1/train-pytorch-model", mode="cluster",
        pvc_name="data" if pvc else "", kind="pytorchjob", workspace=str(ws) if ws else "")
    assert summary["epochs_run"] == 1
    _, scored = branch.run("score", score_step,
                           {"model": trained["trained_model"], "data": split["validation"]},
                           ("scored",))
    branch.run("evaluate", evaluate_step, scored, ("evaluation",))
    return meter


@pytest.mark.parametrize("workspace", [True, False], ids=["workspace+pvc", "pvc-only"])
def test_a_source_on_a_pvc_crosses_storage_at_most_1_1_times_on_a_cluster(
        tmp_path, monkeypatch, photos, workspace):
    pvc = tmp_path / "pvc"
    shutil.copytree(photos, pvc / "photos")
    meter = cluster_run(tmp_path, monkeypatch, str(pvc / "photos"), pvc=pvc,
                        workspace=workspace, dataset_bytes=image_bytes(photos))
    print("\n" + meter.table(f"cluster branch, a folder on the data PVC, "
                             f"{'with' if workspace else 'without'} a workspace"))
    assert meter.total("images") == 0  # no image is ever copied
    assert meter.moved() <= 1.1
    assert meter.total("download") == 0
    assert meter.total("model") > 0  # the model is: staged, trained, copied out
    # what the store keeps of the data: manifests and pictures, no images
    assert not [p for p in files(tmp_path / "run" / "artifact-store")
                if p.suffix == ".jpg" and p.name != "samples.jpg"]


def test_an_https_archive_is_downloaded_once_and_extracted_once_into_the_workspace(
        tmp_path, monkeypatch, photos):
    www = tmp_path / "www"
    www.mkdir()
    with tarfile.open(www / "photos.tar.gz", "w:gz") as tar:
        tar.add(photos, arcname="photos")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serve_in_thread(server)
    downloads = []

    def fetch(url, dest, fetch=data_steps._fetch):  # the download is deleted once extracted
        path = fetch(url, dest)
        downloads.append((path, path.stat().st_size))
        return path

    monkeypatch.setattr(data_steps, "_fetch", fetch)
    try:
        meter = cluster_run(tmp_path, monkeypatch,
                            f"http://127.0.0.1:{server.server_port}/photos.tar.gz", pvc=None,
                            workspace=True, dataset_bytes=image_bytes(photos),
                            downloads=downloads)
    finally:
        server.shutdown()
    print("\n" + meter.table("cluster branch, an https archive, the workspace only"))
    assert len(downloads) == 1 and not downloads[0][0].exists()  # deleted once extracted
    assert meter.total("download") == (www / "photos.tar.gz").stat().st_size
    assert meter.steps["convert"]["images"] == image_bytes(photos)  # extracted once
    assert meter.total("images") == image_bytes(photos)  # and never copied again
    assert meter.moved() <= 1.1
    extracted = tmp_path / "kfp-workspace" / "kfvision"
    assert len([p for p in files(extracted) if p.suffix == ".jpg"]) == 96
