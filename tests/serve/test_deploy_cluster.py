"""kfvision deploy submit | delete against a FAKE of the Kubernetes API (no cluster can run here):
a stand-in for CustomObjectsApi that keeps InferenceServices in a dict, plays a script of status
conditions, and records every (verb, resource) so manifests/rbac-deploy.yaml can be checked
against the calls actually made."""


import kubernetes_validate
import pytest
import yaml
from helpers.fake_kserve import ISVC, NOT_READY, READY, FakeKServe, client_for
from helpers.paths import REPO
from kfvision.pipelines.cli import main
from kfvision.pipelines.clients.cluster import submit_and_wait
from kfvision.pipelines.clients.k8s import KubernetesError, WaitTimeoutError
from kfvision.pipelines.serve import deployclient
from kubernetes.client.exceptions import ApiException


@pytest.mark.parametrize("conditions, ready, words", [
    (READY, True, "ready at http://digits"),
    (NOT_READY, False, "Revision is not ready"),
    ([], False, "no status yet"),
])
def test_ready_state_reads_the_ready_condition(conditions, ready, words):
    got = deployclient.ready_state({"status": {"conditions": conditions,
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
    got = deployclient.ready_state({"status": status})
    assert got[0] is ready and words in got[1]


def test_submit_creates_then_updates_and_waits_until_ready(capsys):
    import sys

    fake = FakeKServe([NOT_READY, NOT_READY, READY])
    client = client_for(fake, out=sys.stdout)
    assert client.submit(ISVC)["metadata"]["namespace"] == "kubeflow"
    assert fake.objects["digits"]["metadata"]["namespace"] == "kubeflow"
    assert client.apply(ISVC) == "updated"  # what the pipeline's deploy step says
    assert client.wait("digits", timeout_s=60, poll_s=1)["metadata"]["name"] == "digits"
    out = capsys.readouterr().out
    assert "created InferenceService kubeflow/digits" in out
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


def test_waiting_past_the_timeout_says_why_and_leaves_it():
    fake = FakeKServe([NOT_READY])
    client = client_for(fake)
    with pytest.raises(WaitTimeoutError, match="not Ready after 10 s .Revision is not ready.; "
                       "it is left as it is") as e:
        submit_and_wait(client, ISVC, wait=True, timeout_s=10, poll_s=1)
    assert "kfvision deploy delete digits -n kubeflow removes it" in str(e.value)
    assert "digits" in fake.objects and ("delete", "inferenceservices") not in fake.calls


def _role_rules() -> set:
    role = next(yaml.safe_load_all((REPO / "manifests" / "rbac-deploy.yaml").read_text()))
    return {(verb, resource) for rule in role["rules"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def test_cli_submit_wait_delete_and_the_role_grants_exactly_those_calls(tmp_path, monkeypatch,
                                                                       capsys):
    fake = FakeKServe([NOT_READY, READY])
    monkeypatch.setattr(deployclient, "connect", lambda namespace=None, out=None: client_for(fake))
    manifest = tmp_path / "isvc.yaml"
    manifest.write_text(yaml.safe_dump(ISVC))
    assert main(["deploy", "submit", str(manifest), "--wait", "--poll", "1"]) == 0
    assert main(["deploy", "submit", str(manifest)]) == 0
    assert main(["deploy", "delete", "digits"]) == 0
    out = capsys.readouterr().out
    assert "created InferenceService kubeflow/digits" in out
    assert "updated InferenceService kubeflow/digits" in out
    assert "deleted InferenceService kubeflow/digits" in out
    fake.script, fake.step = [NOT_READY], 0  # no limit unless --timeout; then it is left
    assert main(["deploy", "submit", str(manifest), "--wait", "--timeout", "3"]) == 124
    assert "it is left as it is" in capsys.readouterr().err and "digits" in fake.objects
    assert set(fake.calls) == _role_rules()
    manifest.write_text(yaml.safe_dump({**ISVC, "metadata": {**ISVC["metadata"],
                                                             "namespace": "team-a"}}))
    assert main(["deploy", "submit", str(manifest), "-n", "team-b"]) == 2
    assert "differs from the manifest's metadata.namespace team-a" in capsys.readouterr().err
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
