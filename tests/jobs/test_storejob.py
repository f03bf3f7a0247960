"""Jobs whose data, model and outputs are s3:// URIs (pipelines/jobs/storejob.py), both kinds: no
PVC, the node agent's command with the URIs as given, a scratch volume (emptyDir or a generic
ephemeral volume), credentials by reference only; the upstream checks (CRD schema, webhook and
CEL rules, the restricted Pod Security Standard, Kubernetes' own pod schema) pass; `job render`
checks the store first, against a real S3 API server (moto's); run-local lays the scratch out
under the pod's folder and stands this machine's AWS_* in for the Secret's keys.

The node agent itself (pipelines/jobs/storenode.py) is not run here."""

import re

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.k8s_checks import crd_schema, job_pods, restricted_problems, unknown_fields
from kfvision.pipelines.cli import main
from kfvision.pipelines.clients.s3 import S3_SECRET_KEYS
from kfvision.pipelines.contract import POD_ROOT, SCRATCH_MOUNT, STORE_COMMAND
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.procs import pod_env
from kfvision.pipelines.jobs.volumes import materialize, trainjob_pod

IMAGE = "registry.example.com/kfvision-trainer:0.1.0"
KINDS = {"pytorchjob": ["--kind", "pytorchjob"],
         "trainjob": ["--kind", "trainjob", "--runtime", "kfvision-torch"]}
SCRATCH = {"emptydir": ["--scratch-size", "50Gi"],
           "ephemeral": ["--scratch-size", "200Gi", "--scratch-class", "fast-ssd"]}


def store_paths(bucket: str = "kfv-obj") -> list:
    return ["--model", f"s3://{bucket}/models/r18", "--train", f"s3://{bucket}/data/train",
            "--val", f"s3://{bucket}/data/val", "--out", f"s3://{bucket}/runs/r18-1"]


def render(tmp_path, *argv) -> dict:
    path = tmp_path / "job.yaml"
    assert main(["job", "render", "--name", "r18", "--image", IMAGE, "--nodes", "2",
                 "--nproc-per-node", "2", *argv, "-o", str(path)]) == 0
    return yaml.safe_load(path.read_text())


def trainer_container(job: dict) -> dict:
    """The training container as the pods run it (a TrainJob's trainer fields merged in)."""
    pod = job_pods(job)[0]
    container = dict(pod["containers"][0])
    if job["kind"] == "TrainJob":
        trainer = job["spec"]["trainer"]
        container.update(image=trainer["image"], command=trainer["command"],
                         args=trainer["args"], env=trainer["env"])
    return container


def schema_of(kind: str) -> dict:
    if kind == "pytorchjob":
        return crd_schema("kubeflow.org_pytorchjobs.yaml")
    return crd_schema("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml")


@pytest.mark.parametrize("scratch", sorted(SCRATCH))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_s3_job_passes_the_upstream_checks_with_no_pvc(tmp_path, kind, scratch):
    job = render(tmp_path, *KINDS[kind], *SCRATCH[scratch], *store_paths(), "--s3-credentials",
                 "kfv-s3", "--service-account", "kfv-irsa", "--no-check-store")
    schema = schema_of(kind)
    jsonschema.validate(job, schema)  # and render ran the webhook's (and CEL) rules
    assert unknown_fields(job, schema) == []
    container = trainer_container(job)
    assert container["command"] == list(STORE_COMMAND)
    assert container["args"][:8] == store_paths()  # the URIs as given: no s3:/ path
    for pod in job_pods(job):
        assert restricted_problems(pod) == []
        assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
        assert pod["serviceAccountName"] == "kfv-irsa"
        (volume,) = [v for v in pod["volumes"] if v["name"] == "kfvision-scratch"]
        if scratch == "emptydir":
            assert volume["emptyDir"] == {"sizeLimit": "50Gi"}
        else:
            assert volume["ephemeral"]["volumeClaimTemplate"]["spec"] == {
                "accessModes": ["ReadWriteOnce"], "storageClassName": "fast-ssd",
                "resources": {"requests": {"storage": "200Gi"}}}
        assert {"name": "kfvision-scratch", "mountPath": SCRATCH_MOUNT} in \
            pod["containers"][0]["volumeMounts"]
        template = {"metadata": {"name": "t"}, "spec": {
            **pod, "containers": [{**pod["containers"][0], "image": IMAGE}]}}
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": "t"}, "template": template},
                                     "1.30", strict=True)
    secrets = [e for e in container["env"] if "valueFrom" in e]
    assert secrets == [{"name": k, "valueFrom": {"secretKeyRef": {
        "name": "kfv-s3", "key": k, "optional": True}}} for k in S3_SECRET_KEYS]
    assert not any(e["name"].startswith("AWS_") and "value" in e for e in container["env"])


def test_an_emptydir_without_a_size_and_no_credentials_is_the_default(tmp_path):
    job = render(tmp_path, *store_paths(), "--no-check-store")
    pod = job_pods(job)[0]
    assert {"name": "kfvision-scratch", "emptyDir": {}} in pod["volumes"]
    assert "serviceAccountName" not in pod
    assert not any(e["name"].startswith("AWS_") for e in pod["containers"][0]["env"])  # HOME's


@pytest.mark.parametrize("argv,message", [
    (["--scratch-class", "fast-ssd"], "--scratch-class fast-ssd needs --scratch-size: .* add "
                                      "e.g. --scratch-size 100Gi"),
    (["--scratch-size", "lots"], "--scratch-size 'lots' is not a Kubernetes quantity"),
    (["--s3-credentials", "Bad_Secret"], "--s3-credentials 'Bad_Secret' is not a DNS-1123"),
    (["--service-account", "sa_1"], "--service-account 'sa_1' is not a DNS-1123"),
    (["--scratch-class", "Fast", "--scratch-size", "1Gi"], "--scratch-class 'Fast' is not"),
])
def test_render_refuses_bad_store_options_by_name(tmp_path, capsys, argv, message):
    assert main(["job", "render", "--name", "r18", "--image", IMAGE, *argv, *store_paths(),
                 "--no-check-store", "-o", str(tmp_path / "job.yaml")]) == 2
    assert re.search("InvalidJobError: " + message, capsys.readouterr().err)
    assert not (tmp_path / "job.yaml").exists()


def test_a_scratch_volume_needs_an_s3_path(tmp_path, capsys):
    assert main(["job", "render", "--name", "r18", "--image", IMAGE, "--scratch-size", "1Gi",
                 "--model", "/d/m", "--train", "/d/t", "--val", "/d/v", "--out", "/d/o",
                 "--pvc", "data:/d"]) == 2
    assert re.search("--scratch-size is for a job whose .* s3:// URI", capsys.readouterr().err)


def test_one_s3_path_is_enough_and_local_paths_stay_as_given(tmp_path):
    job = render(tmp_path, "--pvc", "data:/data", "--model", "/data/m", "--train", "/data/t",
                 "--val", "/data/v", "--out", "s3://kfv-obj/runs/1", "--no-check-store")
    container = trainer_container(job)
    assert container["command"] == list(STORE_COMMAND)
    assert container["args"][:8] == ["--model", "/data/m", "--train", "/data/t", "--val",
                                     "/data/v", "--out", "s3://kfv-obj/runs/1"]


# --- render-time checks of the store, against moto's S3 server --------------------------------

@pytest.fixture
def filled(s3_bucket, micro_digits, resnet18_dir):
    """The bucket with train, val and an untrained model pushed as the design lays them out."""
    s3_bucket.upload_folder(micro_digits["train"], "data/train/")
    s3_bucket.upload_folder(micro_digits["val"], "data/val/")
    s3_bucket.upload_folder(resnet18_dir, "models/r18/")
    return s3_bucket


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_render_checks_the_store_and_writes_no_secret(tmp_path, capsys, filled, kind):
    job = render(tmp_path, *KINDS[kind], *store_paths(filled.name), "--s3-credentials",
                 "kfv-s3")
    assert trainer_container(job)["command"] == list(STORE_COMMAND)
    said = capsys.readouterr()
    text = (tmp_path / "job.yaml").read_text()
    for secret in ("test-secret-never-shown", "testing", filled.endpoint):
        assert secret not in text and secret not in said.out + said.err


@pytest.mark.parametrize("missing,error,code", [
    ("data/train", "is not an image directory in the store", 2),
    ("data/val", "is not an image directory in the store", 2),
    ("models/r18", "is not a model directory in the store", 2),
])
def test_render_refuses_a_missing_input_before_writing(tmp_path, capsys, filled, missing, error,
                                                       code):
    gone = [o["Key"] for o in filled.client.list_objects_v2(
        Bucket=filled.name, Prefix=missing + "/")["Contents"]]
    filled.client.delete_objects(Bucket=filled.name,
                                 Delete={"Objects": [{"Key": k} for k in gone]})
    out = tmp_path / "job.yaml"
    argv = ["job", "render", "--name", "r18", "--image", IMAGE, *store_paths(filled.name),
            "-o", str(out)]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert error in err and f"s3://{filled.name}/{missing}" in err
    assert "kfvision push DIR" in err
    assert not out.exists()
    assert main([*argv[:-2], "--no-check-store", "-o", str(out)]) == 0  # trusted as given


def test_render_refuses_an_output_bucket_that_is_not_there(tmp_path, capsys, filled):
    argv = ["job", "render", "--name", "r18", "--image", IMAGE, *store_paths(filled.name)[:6],
            "--out", "s3://no-such-bucket-here/runs/1", "-o", str(tmp_path / "job.yaml")]
    assert main(argv) == 2
    assert "no bucket 'no-such-bucket-here'" in capsys.readouterr().err
    assert not (tmp_path / "job.yaml").exists()


# --- run-local: the scratch under the pod's folder, the Secret's keys from this machine ------

@pytest.mark.parametrize("scratch", sorted(SCRATCH))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_run_local_lays_the_scratch_out_under_the_pod_root(tmp_path, kind, scratch):
    job = render(tmp_path, *KINDS[kind], *SCRATCH[scratch], *store_paths(), "--no-check-store")
    if kind == "trainjob":
        volumes, mounts = trainjob_pod(job)
    else:
        pod = job_pods(job)[0]
        volumes, mounts = pod["volumes"], pod["containers"][0]["volumeMounts"]
    root = tmp_path / "pods" / "node-0"
    assert materialize(volumes, mounts, {}, root) == {POD_ROOT: str(root.absolute())}
    assert (root / SCRATCH_MOUNT.lstrip("/")).is_dir()
    # the scratch, and HOME's volume (/kfvision/home: pipelines/jobs/home.py)
    assert sorted(p.name for p in root.iterdir()) == ["kfvision", SCRATCH_MOUNT.lstrip("/")]


def test_run_local_stands_this_machines_aws_variables_in_for_the_secret(tmp_path, monkeypatch):
    job = render(tmp_path, "--s3-credentials", "kfv-s3", *store_paths(), "--no-check-store")
    container = trainer_container(job)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mine")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    env = pod_env(container, "job.yaml")
    assert env["AWS_ACCESS_KEY_ID"] == "mine"
    assert "AWS_SESSION_TOKEN" not in env  # optional and not set here: left unset, as a pod would
    container["env"] = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "s", "key": "t"}}}]
    monkeypatch.delenv("TOKEN", raising=False)
    with pytest.raises(InvalidJobError, match="key 't' of Secret 's'.* set TOKEN here"):
        pod_env(container, "job.yaml")
    monkeypatch.setenv("TOKEN", "here")
    assert pod_env(container, "job.yaml")["TOKEN"] == "here"
