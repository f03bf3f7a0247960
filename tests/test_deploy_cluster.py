"""kfvision deploy submit | delete against a FAKE of the Kubernetes API (no cluster can run here):
a stand-in for CustomObjectsApi that keeps InferenceServices in a dict, plays a script of status
conditions, and records every (verb, resource) so manifests/rbac-deploy.yaml can be checked
against the calls actually made."""

import json

import kubernetes_validate
import pytest
import yaml
from conftest import REPO, FakeClock
from kubernetes.client.exceptions import ApiException

from pipelines.cli import main
from pipelines.clients.k8s import Api, KubernetesError, WaitTimeoutError
from pipelines.serve import cluster
from pipelines.serve.deploy import DeployConfig, build_inference_service

ISVC = build_inference_service(DeployConfig("digits", "pvc://data/models/digits", "img:0.1"))
NOT_READY = [{"type": "PredictorReady", "status": "False", "reason": "RevisionMissing"},
             {"type": "Ready", "status": "False", "message": "Revision is not ready"}]
READY = [{"type": "PredictorReady", "status": "True"}, {"type": "Ready", "status": "True"}]


class FakeKServe:
    """A FAKE of CustomObjectsApi for inferenceservices (not a cluster)."""

    def __init__(self, script, fail=None):
        self.script, self.step, self.fail = script, 0, fail or {}
        self.objects, self.calls = {}, []

    def _serve(self, verb, group, version, plural):
        assert (group, version, plural) == ("serving.kserve.io", "v1beta1", "inferenceservices")
        self.calls.append((verb, plural))
        if verb in self.fail:
            raise self.fail[verb]

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self._serve("create", group, version, plural)
        name = body["metadata"]["name"]
        if name in self.objects:
            raise ApiException(status=409, reason="Conflict")
        self.objects[name] = json.loads(json.dumps(body))
        return self.objects[name]

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        self._serve("patch", group, version, plural)
        self.objects[name] = json.loads(json.dumps(body))
        return self.objects[name]

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self._serve("get", group, version, plural)
        if name not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        conditions = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        return {**self.objects[name], "status": {"conditions": conditions,
                                                 "url": "http://digits.kubeflow.example.com"}}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name,
                                        propagation_policy=None):
        self._serve("delete", group, version, plural)
        if self.objects.pop(name, None) is None:
            raise ApiException(status=404, reason="Not Found")


def client_for(fake, out=None):
    clock = FakeClock()
    return cluster.DeployClient(Api(fake, None, "kubeflow", out=out, sleep=clock.sleep,
                                    clock=clock))


@pytest.mark.parametrize("conditions, ready, words", [
    (READY, True, "ready at http://digits"),
    (NOT_READY, False, "Revision is not ready"),
    ([], False, "no status yet"),
])
def test_ready_state_reads_the_ready_condition(conditions, ready, words):
    got = cluster.ready_state({"status": {"conditions": conditions,
                                          "url": "http://digits.kubeflow.example.com"}})
    assert got[0] is ready and words in got[1]


@pytest.mark.parametrize("state, ready, words", [
    ("Loaded", True, "ready at"),
    ("Loading", False, "Ready, but its model is Loading"),
    ("FailedToLoad", False, "model is FailedToLoad: out of memory"),
])
def test_ready_also_needs_the_model_loaded(state, ready, words):
    """KServe v0.20: `Ready` has been seen True with no model loaded; the model's state says."""
    status = {"conditions": READY, "url": "http://digits",
              "modelStatus": {"states": {"activeModelState": state},
                              "lastFailureInfo": {"message": "out of memory"}}}
    got = cluster.ready_state({"status": status})
    assert got[0] is ready and words in got[1]


def test_apply_creates_then_updates_and_waits_until_ready(capsys):
    import sys

    fake = FakeKServe([NOT_READY, NOT_READY, READY])
    client = client_for(fake, out=sys.stdout)
    assert client.apply(ISVC) == "created"
    assert fake.objects["digits"]["metadata"]["namespace"] == "kubeflow"
    assert client.apply(ISVC) == "updated"
    assert client.wait_ready("digits", timeout=60, poll=1)["metadata"]["name"] == "digits"
    out = capsys.readouterr().out
    assert out.count("Revision is not ready") == 1 and "ready at http://digits" in out


@pytest.mark.parametrize("fail, call, words", [
    ({"create": ApiException(status=403, reason="Forbidden")}, "apply",
     ["create InferenceService kubeflow/digits failed: HTTP 403", "rbac-deploy.yaml"]),
    ({"create": ApiException(status=404, reason="Not Found")}, "apply",
     ["install KServe", "inferenceservices.serving.kserve.io"]),
    ({}, "delete", ["delete InferenceService kubeflow/digits failed: HTTP 404"]),
])
def test_api_errors_name_the_object_and_what_to_do(fail, call, words):
    client = client_for(FakeKServe([READY], fail=fail))
    with pytest.raises(KubernetesError) as e:
        client.apply(ISVC) if call == "apply" else client.delete("digits")
    for w in words:
        assert w in str(e.value)


def test_waiting_past_the_timeout_says_why():
    client = client_for(FakeKServe([NOT_READY]))
    client.apply(ISVC)
    with pytest.raises(WaitTimeoutError, match="not Ready after 10 s .Revision is not ready"):
        client.wait_ready("digits", timeout=10, poll=1)


def _role_rules() -> set:
    role = next(yaml.safe_load_all((REPO / "manifests" / "rbac-deploy.yaml").read_text()))
    return {(verb, resource) for rule in role["rules"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def test_cli_submit_wait_delete_and_the_role_grants_exactly_those_calls(tmp_path, monkeypatch,
                                                                       capsys):
    fake = FakeKServe([NOT_READY, READY])
    monkeypatch.setattr(cluster, "connect", lambda namespace=None, out=None: client_for(fake))
    manifest = tmp_path / "isvc.yaml"
    manifest.write_text(yaml.safe_dump(ISVC))
    assert main(["deploy", "submit", str(manifest), "--wait", "--poll", "1"]) == 0
    assert main(["deploy", "submit", str(manifest)]) == 0
    assert main(["deploy", "delete", "digits"]) == 0
    out = capsys.readouterr().out
    assert "created InferenceService kubeflow/digits" in out
    assert "updated InferenceService kubeflow/digits" in out
    assert "deleted InferenceService kubeflow/digits" in out
    assert set(fake.calls) == _role_rules()
    manifest.write_text("kind: PyTorchJob\n")
    assert main(["deploy", "submit", str(manifest)]) == 2
    assert "not an InferenceService" in capsys.readouterr().err


def test_deploy_rbac_passes_kubernetes_own_schemas_and_has_no_wildcards():
    docs = [d for d in yaml.safe_load_all((REPO / "manifests" / "rbac-deploy.yaml").read_text())
            if d]
    assert [d["kind"] for d in docs] == ["Role", "RoleBinding"]
    for d in docs:
        kubernetes_validate.validate(d, "1.30", strict=True)
    for rule in docs[0]["rules"]:
        assert not any("*" in v for key in ("apiGroups", "resources", "verbs")
                       for v in rule[key])
