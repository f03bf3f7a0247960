"""`kfvision job render --kind trainjob` and kfvision's runtimes: Kubeflow Trainer v2.3.0's CRD
schemas, its offline-checkable CEL rules and every webhook rule of ../shared/reference/README.md.

Schema tests read the CRDs from ../shared/reference/trainer-v2/ and skip, saying so, without it.
A changed rendering fails with a diff; if it is meant: `make golden-trainjobs` and review.
"""

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.golden import GOLDEN_DIR, UPDATE, assert_same_text
from helpers.k8s_checks import crd_schema, restricted_problems, unknown_fields
from helpers.paths import REPO, SHARED_REFERENCE
from test_job_golden import DATA, IMAGE, render
from test_job_manifest import TRAIN

from kfvision.pipelines.cli import main
from kfvision.pipelines.jobs.config import JobConfig, Toleration, Volume
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.trainjob.build import (
    PERMANENT_CODES,
    RuntimeRef,
    build_runtime,
    build_trainjob,
)
from kfvision.pipelines.jobs.trainjob.rules import runtime_jobs, validate_trainjob, webhook_problems
from kfvision.trainer import exitcodes

TRAINER_V2 = SHARED_REFERENCE / "trainer-v2"
RUNTIMES = REPO / "manifests" / "trainer-v2"
KFV = ["--kind", "trainjob", "--runtime", "kfvision-torch"]
GOLDEN = {  # nodes x processes: 1x1 and 2x2 on CPU, 3x4 and 4x8 on GPUs (one node, many, both)
    "trainjob-cpu-1x1": ["--kind", "trainjob", "--name", "digits", "--image", IMAGE, *DATA,
                         "--epochs", "15", "--image-size", "32", "--batch-size", "32"],
    "trainjob-cpu-2x2": [*KFV, "--name", "digits-2x2", "--image", IMAGE, "--nodes", "2",
                         "--procs-per-node", "2", "--cpu", "2", "--memory", "4Gi",
                         "--pvc", "kfvision-data:/data", *DATA, "--image-size", "32"],
    "trainjob-gpu-3x4": [*KFV, "--runtime-kind", "TrainingRuntime", "--name", "digits-gpu",
                         "--namespace", "team-vision", "--image", IMAGE, "--nodes", "3",
                         "--gpus-per-node", "4", "--pvc", "kfvision-data:/data", *DATA,
                         "--epochs", "30"],
    "trainjob-gpu-4x8": [*KFV, "--name", "imagenet-r50", "--namespace", "team-vision",
                         "--image", IMAGE, "--nodes", "4", "--gpus-per-node", "8", "--cpu", "64",
                         "--memory", "480Gi", "--shm-size", "64Gi", "--node-selector",
                         "nvidia.com/gpu.product=H100", "--toleration",
                         "dedicated=training:NoSchedule", "--pvc", "imagenet:/data",
                         "--active-deadline", "172800", "--model", "/data/models/resnet50",
                         "--train", "/data/imagenet/train", "--val", "/data/imagenet/val",
                         "--out", "/data/models/imagenet-r50", "--epochs", "90",
                         "--batch-size", "64", "--workers", "8"],
    "trainjob-s3-2x2": [*KFV, "--name", "r18-s3", "--image", IMAGE, "--nodes", "2",
                        "--procs-per-node", "2", "--service-account", "kfvision-irsa",
                        "--scratch-size", "200Gi", "--scratch-class", "fast-ssd", "--model",
                        "s3://kfv-obj/models/r18", "--train", "s3://kfv-obj/data/train", "--val",
                        "s3://kfv-obj/data/val", "--out", "s3://kfv-obj/runs/r18-1",
                        "--image-size", "32", "--no-check-store"],
}
RUNTIME_FILES = {"clustertrainingruntime.yaml": dict(kind="ClusterTrainingRuntime"),
                 "trainingruntime.yaml": dict(kind="TrainingRuntime", namespace="kubeflow")}
RUNTIME_HEADER = """\
kfvision's torch runtime for Kubeflow Trainer v2: the stock torch-distributed plus the exit-code
contract of docs/faults.md (1-127 fail the TrainJob, 128+ restart every node, at most 3 times).
Written by `make golden-trainjobs`; `kfvision job render --kind trainjob --runtime kfvision-torch`
references it (add --runtime-kind TrainingRuntime for the namespaced variant)."""


def _crd_schema(name: str) -> dict:
    return crd_schema("trainer-v2", f"trainer.kubeflow.org_{name}.yaml")


@pytest.fixture(scope="module")
def trainjob_schema() -> dict:
    return _crd_schema("trainjobs")


def job_of(runtime=None, **kwargs) -> dict:
    return build_trainjob(JobConfig(**{"name": "digits", "train": TRAIN,
                                       "image": "registry.example.com/kfvision:0.1", **kwargs}),
                          runtime or RuntimeRef())


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_render(name, tmp_path, trainjob_schema):
    actual = render(GOLDEN[name], tmp_path / "job.yaml")
    golden = GOLDEN_DIR / f"{name}.yaml"
    if UPDATE:
        golden.write_text(actual)
    assert_same_text(golden, actual, "make golden-trainjobs")
    job = yaml.safe_load(actual)
    jsonschema.validate(job, trainjob_schema)
    assert unknown_fields(job, trainjob_schema) == []
    assert webhook_problems(job) == []


@pytest.mark.parametrize("file", sorted(RUNTIME_FILES))
def test_shipped_runtimes_are_current_and_pass_their_crd(file):
    options = RUNTIME_FILES[file]
    runtime = build_runtime(IMAGE, **options)
    text = "".join(f"# {line}\n" for line in RUNTIME_HEADER.splitlines())
    from kfvision.pipelines.clients.k8s import to_yaml

    text += to_yaml(runtime)
    if UPDATE:
        RUNTIMES.mkdir(exist_ok=True)
        (RUNTIMES / file).write_text(text)
    assert_same_text(RUNTIMES / file, text, "make golden-trainjobs")
    schema = _crd_schema(options["kind"].lower() + "s")
    jsonschema.validate(runtime, schema)
    assert unknown_fields(runtime, schema) == []
    assert runtime_jobs(runtime) == {"node": ("node",)}  # what the torch plugin expects
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {
        "name": "t"}, "spec": rjob["template"]["spec"]}, "1.30", strict=True)


def test_the_runtime_fails_exactly_the_codes_the_exit_code_contract_calls_permanent():
    runtime = build_runtime(IMAGE)
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (rule,) = rjob["template"]["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "In"
    failing = set(rule["onExitCodes"]["values"])
    assert failing == {c for c in range(1, 256) if not exitcodes.is_retryable(c)}
    assert failing == set(PERMANENT_CODES) and 200 not in failing and 137 not in failing
    assert rjob["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    policy = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert [r["action"] for r in policy["rules"]] == ["FailJobSet", "RestartJobSet"]
    assert policy["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]


def test_the_stock_runtime_is_the_reference_one():
    from kfvision.pipelines.jobs.trainjob.local import STOCK

    path = TRAINER_V2 / "torch_distributed.yaml"
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared/reference/trainer-v2/)")
    assert yaml.safe_load(path.read_text()) == STOCK


CONFIGS = {
    "cpu-1x1": dict(),
    "cpu-4x2": dict(nodes=4, procs_per_node=2),
    "gpu-2x4": dict(nodes=2, gpus_per_node=4, node_selector=(("gpu", "a100"),),
                    tolerations=(Toleration("dedicated", "ml", "NoSchedule"),),
                    volumes=(Volume("kfvision-data", "/data"),), cpu="16", memory="64Gi",
                    shm_size="16Gi", active_deadline=86400, namespace="team-a"),
}


def _pod_of_patch(job: dict) -> dict:
    (patch,) = job["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return rjob["template"]["spec"]["template"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_rendered_trainjob_passes_the_crd_and_its_pods_are_restricted(config, trainjob_schema):
    job = job_of(**CONFIGS[config])
    jsonschema.validate(job, trainjob_schema)
    assert unknown_fields(job, trainjob_schema) == []
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == ["python", "-m", "kfvision.trainer.launch", "-m",
                                  "kfvision.trainer.train"]
    assert not any(a.startswith(("--nnodes", "--nproc", "--rdzv", "--master", "--node-rank",
                                 "--standalone")) for a in trainer["args"])
    gpus = CONFIGS[config].get("gpus_per_node", 0)
    assert trainer.get("resourcesPerNode", {}).get("limits") == (
        {"nvidia.com/gpu": gpus} if gpus else None)
    # the pod as the runtime + patch make it (kfvision-torch's pod fields, the patch's)
    template = _pod_of_patch(job)
    pod = {**template["spec"], "automountServiceAccountToken": False,
           "containers": [{**template["spec"]["containers"][0], "image": trainer["image"]}]}
    assert restricted_problems(pod) == []
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                  "metadata": {"name": "t"}, "template": {**template,
                                                                          "spec": pod}},
                                 "1.30", strict=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpus_per_node=2, procs_per_node=4), "--nproc-per-node 4 is more than --gpus-per-node 2"),
    (dict(name="Digits"), "not a DNS-1035 label"),
    (dict(name="a" * 54, nodes=11), "JobSet names its pods"),  # a...-node-0-10: 64
    (dict(restart_policy="OnFailure"), "--restart-policy does not apply to a TrainJob"),
    (dict(backoff_limit=5), "--backoff-limit does not apply"),
    (dict(ttl=60), "--ttl does not apply"),
    (dict(runtime=RuntimeRef("x", "JobSet")), "--runtime-kind 'JobSet'"),
    (dict(runtime=RuntimeRef("Bad_Name")), "--runtime 'Bad_Name'"),
])
def test_render_refuses_what_the_cluster_would(kwargs, message):
    with pytest.raises(InvalidJobError, match=message):
        job_of(**kwargs)


def _patch_pod(j):
    return _pod_of_patch(j)["spec"]


BREAKS = [  # (rule of the reference README, how to break it, what the error says)
    ("1 CEL name format", lambda j: j["metadata"].update(name="Bad_Name"), "RFC 1035"),
    ("1 CEL name length", lambda j: j["metadata"].update(name="a" * 64), "no more than 63"),
    ("2 runtimeRef name", lambda j: j["spec"]["runtimeRef"].pop("name"), "runtimeRef.name"),
    ("2 runtimeRef kind", lambda j: j["spec"]["runtimeRef"].update(kind="Runtime"),
     "runtimeRef.kind 'Runtime'"),
    ("3 PET_* env", lambda j: j["spec"]["trainer"]["env"].append(
        {"name": "PET_NNODES", "value": "3"}), "sets PET_NNODES"),
    ("4 manager format", lambda j: j["spec"]["runtimePatches"][0].update(manager="kfvision"),
     "not a domain-prefixed path"),
    ("4 replicated job exists", lambda j: j["spec"]["runtimePatches"][0]["trainingRuntimeSpec"][
        "template"]["spec"]["replicatedJobs"][0].update(name="launcher"),
     "replicated job 'launcher'"),
    ("4 container exists", lambda j: _patch_pod(j)["containers"][0].update(name="trainer"),
     "container 'trainer'"),
    ("4 no env on node", lambda j: _patch_pod(j)["containers"][0].update(
        env=[{"name": "X", "value": "1"}]), "use spec.trainer.env"),
    ("5 managedBy", lambda j: j["spec"].update(managedBy="me"), "managedBy 'me'"),
]


@pytest.mark.parametrize("rule,breaks,message", BREAKS, ids=[b[0] for b in BREAKS])
def test_each_cel_and_webhook_rule_is_checked(rule, breaks, message):
    job = copy.deepcopy(job_of(nodes=2))
    breaks(job)
    with pytest.raises(InvalidJobError, match="refused by Kubeflow Trainer") as e:
        validate_trainjob(job, "job.yaml")
    assert message in str(e.value) and "job.yaml" in str(e.value)


def test_render_command_kinds_and_runtime_flags(tmp_path, capsys):
    base = ["job", "render", "--name", "d", "--image", "i", "--model", "/m", "--train", "/t",
            "--val", "/v", "--out", "/o", "-o", str(tmp_path / "j.yaml")]
    assert main(base) == 0
    assert yaml.safe_load((tmp_path / "j.yaml").read_text())["kind"] == "PyTorchJob"
    assert main([*base, "--kind", "trainjob"]) == 0
    job = yaml.safe_load((tmp_path / "j.yaml").read_text())
    assert job["kind"] == "TrainJob" and job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert "wrote TrainJob d" in capsys.readouterr().err
    assert main([*base, "--runtime", "kfvision-torch"]) == 2
    assert "--runtime and --runtime-kind are for --kind trainjob" in capsys.readouterr().err
