"""Least privilege: the PyTorchJob pods meet the Kubernetes "restricted" Pod Security Standard,
the RBAC has no wildcards, and no manifest carries a secret value.

The checker below follows https://kubernetes.io/docs/concepts/security/pod-security-standards/
(v1.30: the Baseline controls, then the Restricted ones). No admission controller can run here,
so the negative cases show that the checker refuses what the API server would.
"""

import copy
from pathlib import Path

import pytest
import yaml
from helpers.k8s_checks import restricted_problems
from helpers.paths import REPO
from test_job_manifest import CONFIGS, job_of


def _pods(job: dict) -> list:
    return [s["template"]["spec"] for s in job["spec"]["pytorchReplicaSpecs"].values()]


EXAMPLE = yaml.safe_load((REPO / "manifests" / "pytorchjob-example.yaml").read_text())


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_rendered_pod_meets_the_restricted_pod_security_standard(config):
    for pod in _pods(job_of(**CONFIGS[config])):
        assert restricted_problems(pod) == []
        (c,) = pod["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True  # beyond "restricted"
        assert pod["automountServiceAccountToken"] is False


def test_the_example_manifest_meets_it_too():
    for pod in _pods(EXAMPLE):
        assert restricted_problems(pod) == []


def _container(pod):
    return pod["containers"][0]


@pytest.mark.parametrize("break_it, problem", [
    (lambda p: p.update(hostNetwork=True), "hostNetwork"),  # what RDMA/InfiniBand setups ask
    (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
    (lambda p: _container(p)["securityContext"].update(privileged=True), "privileged"),
    (lambda p: _container(p)["securityContext"].update(capabilities={"drop": ["ALL"],
                                                                     "add": ["IPC_LOCK"]}),
     "adds capabilities"),
    (lambda p: _container(p)["securityContext"].pop("allowPrivilegeEscalation"),
     "allowPrivilegeEscalation"),
    (lambda p: p["securityContext"].pop("runAsNonRoot"), "may run as root"),
    (lambda p: p["securityContext"].update(runAsUser=0), "uid 0"),
    (lambda p: p["securityContext"].pop("seccompProfile"), "seccomp"),
    (lambda p: _container(p)["ports"][0].update(hostPort=23456), "hostPort"),
])
def test_the_checker_refuses_what_the_api_server_would(break_it, problem):
    pod = copy.deepcopy(_pods(job_of(**CONFIGS["gpu-2x4"]))[0])
    break_it(pod)
    assert any(problem in p for p in restricted_problems(pod))


def _documents(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_rbac_has_no_wildcards_and_no_access_to_secrets():
    rbac = _documents(REPO / "manifests" / "rbac.yaml")
    assert {d["kind"] for d in rbac} == {"Role", "RoleBinding", "ClusterRole",
                                         "ClusterRoleBinding"}
    # cluster-wide only what is cluster-scoped, and only reading it
    (cluster_role,) = [d for d in rbac if d["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == [{"apiGroups": ["trainer.kubeflow.org"],
                                      "resources": ["clustertrainingruntimes"], "verbs": ["get"]}]
    for rule in [r for d in rbac if d["kind"].endswith("Role") for r in d["rules"]]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key] and not any("*" in v for v in rule[key])
        assert "secrets" not in rule["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


SECRET_WORDS = ("password", "passwd", "token", "secret", "apikey", "api_key", "access_key",
                "credential", "private_key")


def _env_values(doc, found):
    if isinstance(doc, dict):
        if "name" in doc and "value" in doc and isinstance(doc["value"], str):
            found.append((doc["name"], doc["value"]))
        for v in doc.values():
            _env_values(v, found)
    elif isinstance(doc, list):
        for v in doc:
            _env_values(v, found)
    return found


@pytest.mark.parametrize("path", sorted(
    [*(REPO / "manifests").glob("**/*.yaml"), *(REPO / "tests" / "golden").glob("*job-*.yaml")]),
    ids=lambda p: p.name)
def test_no_manifest_holds_a_secret_value(path):
    for doc in _documents(path):
        assert doc.get("kind") != "Secret", f"{path} defines a Secret: reference one instead"
        for name, _ in _env_values(doc, []):  # valueFrom.secretKeyRef is the way
            assert not any(w in name.lower() for w in SECRET_WORDS), f"{path}: env {name}"
