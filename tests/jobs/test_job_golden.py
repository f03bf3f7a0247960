"""Golden YAML of `kfvision job render`; the manifests/ folder (RBAC, example job, kustomize).

A changed rendering fails here with a diff; if the change is meant, regenerate and review:
    make golden-jobs      (tests/golden/job-*.yaml)
    make manifests        (manifests/pytorchjob-example.yaml)
"""

import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helpers.golden import GOLDEN_DIR, UPDATE, assert_same_text
from helpers.paths import REPO

from kfvision.pipelines.cli import main

MANIFESTS = REPO / "manifests"
IMAGE = "registry.example.com/kfvision-trainer:0.1.0"
DATA = ["--model", "/data/models/resnet18", "--train", "/data/digits/train", "--val",
        "/data/digits/val", "--out", "/data/models/digits-resnet18"]
GOLDEN = {  # typical configurations: a laptop-sized CPU job, CPU nodes, a multi-node GPU job
    "job-cpu-1node": ["--name", "digits", "--image", IMAGE, *DATA, "--epochs", "15",
                      "--image-size", "32", "--batch-size", "32", "--lr", "0.05",
                      "--augment", "light"],
    "job-cpu-2x2": ["--name", "digits-2x2", "--image", IMAGE, "--nodes", "2",
                    "--procs-per-node", "2", "--cpu", "2", "--memory", "4Gi",
                    "--restart-policy", "OnFailure", "--backoff-limit", "2",
                    "--pvc", "kfvision-data:/data", *DATA, "--image-size", "32"],
    "job-gpu-4x8": ["--name", "imagenet-r50", "--namespace", "team-vision", "--image", IMAGE,
                    "--nodes", "4", "--gpus-per-node", "8", "--cpu", "64", "--memory", "480Gi",
                    "--shm-size", "64Gi", "--node-selector", "nvidia.com/gpu.product=H100",
                    "--toleration", "dedicated=training:NoSchedule", "--pvc",
                    "imagenet:/data", "--active-deadline", "172800", "--ttl", "86400",
                    "--model", "/data/models/resnet50", "--train", "/data/imagenet/train",
                    "--val", "/data/imagenet/val", "--out", "/data/models/imagenet-r50",
                    "--epochs", "90", "--batch-size", "64", "--lr", "0.0005",
                    "--warmup-epochs", "5", "--workers", "8"],
    "job-s3-2x2": ["--name", "r18-s3", "--image", IMAGE, "--nodes", "2", "--procs-per-node",
                   "2", "--cpu", "2", "--memory", "4Gi", "--s3-credentials", "kfvision-s3",
                   "--scratch-size", "20Gi", "--model", "s3://kfv-obj/models/r18", "--train",
                   "s3://kfv-obj/data/train", "--val", "s3://kfv-obj/data/val", "--out",
                   "s3://kfv-obj/runs/r18-1", "--image-size", "32", "--no-check-store"],
}


def render(argv: list, path: Path) -> str:
    assert main(["job", "render", *argv, "-o", str(path)]) == 0
    return path.read_text()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_render(name, tmp_path):
    actual = render(GOLDEN[name], tmp_path / "job.yaml")
    golden = GOLDEN_DIR / f"{name}.yaml"
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(actual)
    assert_same_text(golden, actual, "make golden-jobs")


def test_example_job_in_manifests_is_current(tmp_path):
    """The example's header holds the render command; rendering it again gives the same file."""
    example = MANIFESTS / "pytorchjob-example.yaml"
    command = example.read_text().splitlines()[1]
    assert command.startswith("# kfvision job render ")
    argv = shlex.split(command.removeprefix("# kfvision job render "))
    assert_same_text(example, render(argv, tmp_path / "job.yaml"), "make manifests")


def _docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def test_rbac_objects_pass_kubernetes_own_schemas():
    docs = _docs(MANIFESTS / "rbac.yaml")
    # a Role for the namespace's objects, a ClusterRole for clustertrainingruntimes (cluster-wide)
    assert [d["kind"] for d in docs] == ["Role", "RoleBinding", "ClusterRole",
                                         "ClusterRoleBinding"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    for role, binding in (docs[:2], docs[2:]):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": role["kind"], "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pipeline-runner",
                                        "namespace": docs[0]["metadata"]["namespace"]}]
    assert [r["resources"] for r in docs[2]["rules"]] == [["clustertrainingruntimes"]]


def test_kustomization_ties_the_manifests_together():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert sorted(resources) == sorted(p.name for p in MANIFESTS.glob("*.yaml")
                                       if p.name != "kustomization.yaml")
    namespaces = {d["metadata"].get("namespace") for r in resources
                  for d in _docs(MANIFESTS / r)} - {None}
    assert namespaces <= {kustomization["namespace"]}
