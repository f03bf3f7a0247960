"""`kfvision tune submit | status | delete` against a FAKE Katib API (CustomObjectsApi for
kubeflow.org/v1beta1 experiments and trials): a scripted status sequence, the client's real
ApiException, and every (verb, resource) recorded so the Role in manifests/rbac.yaml can be
checked against the calls made. What it cannot show: that Katib behaves as scripted."""

import io
import json
import sys

import pytest
import yaml
from helpers.fake_k8s import rbac_rules
from helpers.machine import FakeClock
from kfvision.pipelines.cli import main
from kfvision.pipelines.clients.cluster import submit_and_wait
from kfvision.pipelines.clients.endpoints import EndpointError
from kfvision.pipelines.clients.k8s import Api, KubernetesError, WaitTimeoutError
from kfvision.pipelines.jobs.errors import JobFailedError
from kfvision.pipelines.tune import experimentclient
from kfvision.pipelines.tune.experimentclient import ExperimentClient, best_trial, experiment_state
from kubernetes.client.exceptions import ApiException
from test_tune import experiment as rendered
from urllib3.exceptions import MaxRetryError, NewConnectionError

NS = "team"
EXP = rendered()  # a rendered Experiment digits-lr of PyTorchJob trials, namespace team
BEST = {"bestTrialName": "digits-lr-x7k2m9qp",
        "parameterAssignments": [{"name": "lr", "value": "0.0123"},
                                 {"name": "batch-size", "value": "32"}],
        "observation": {"metrics": [{"name": "validation-loss", "min": "0.051", "max": "0.9",
                                     "latest": "0.06"}]}}


def cond(kind, message=""):
    return {"type": kind, "status": "True", "reason": f"Experiment{kind}", "message": message}


RUNNING = {"conditions": [cond("Created"), cond("Running")], "trialsRunning": 2}
SUCCEEDED = {"conditions": [cond("Created"), cond("Succeeded", "max trials reached")],
             "trialsSucceeded": 8, "currentOptimalTrial": BEST}
FAILED = {"conditions": [cond("Failed", "max failed trials reached")], "trialsFailed": 3}


def trial(name, state, params=()):
    job = json.loads(json.dumps(EXP["spec"]["trialTemplate"]["trialSpec"]).replace(
        "${trialParameters.trialName}", name))
    return {"metadata": {"name": name, "labels": {experimentclient.EXPERIMENT_LABEL: "digits-lr"}},
            "spec": {"runSpec": job, "parameterAssignments": [
                {"name": k, "value": v} for k, v in params]},
            "status": {"conditions": [cond(state)]}}


TRIALS = [trial("digits-lr-x7k2m9qp", "Succeeded", [("lr", "0.0123")]),
          trial("digits-lr-aaaa1111", "Failed", [("lr", "0.09")])]


class FakeKatib:
    """A FAKE of CustomObjectsApi for Katib (not a cluster); each get of the Experiment moves
    one step along `script` (a list of statuses)."""

    def __init__(self, script, trials=(), fail=None):
        self.script, self.step, self.trials = script, 0, list(trials)
        self.fail, self.experiments, self.calls = fail or {}, {}, []

    def _serve(self, verb, group, version, plural):
        assert (group, version) == ("kubeflow.org", "v1beta1")
        self.calls.append((verb, plural))
        if (verb, plural) in self.fail:
            raise self.fail[(verb, plural)]

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self._serve("create", group, version, plural)
        if body["metadata"]["name"] in self.experiments:
            raise ApiException(status=409, reason="Conflict")
        self.experiments[body["metadata"]["name"]] = body
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self._serve("get", group, version, plural)
        if plural == "trials":
            return next(t for t in self.trials if t["metadata"]["name"] == name)
        if name not in self.experiments:
            raise ApiException(status=404, reason="Not Found")
        status = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        return {**self.experiments[name], "status": status}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name,
                                        propagation_policy=None):
        self._serve("delete", group, version, plural)
        if self.experiments.pop(name, None) is None:
            raise ApiException(status=404, reason="Not Found")

    def list_namespaced_custom_object(self, group, version, namespace, plural,
                                      label_selector=None):
        self._serve("list", group, version, plural)
        assert label_selector == f"{experimentclient.EXPERIMENT_LABEL}=digits-lr"
        return {"items": self.trials}


def api_for(fake, out=None):
    clock = FakeClock()
    return ExperimentClient(Api(fake, None, NS, out=out or io.StringIO(), sleep=clock.sleep,
                                clock=clock))


def test_submit_wait_prints_the_best_trials_parameters_objective_and_model():
    out = io.StringIO()
    fake = FakeKatib([RUNNING, RUNNING, SUCCEEDED], TRIALS)
    submit_and_wait(api_for(fake, out), EXP, wait=True, poll_s=1)
    text = out.getvalue()
    assert "created Experiment team/digits-lr" in text
    assert text.count("Running: 2 running of 8 trials") == 1  # a line per change only
    assert ("best trial digits-lr-x7k2m9qp: validation-loss 0.051 with --lr 0.0123 "
            "--batch-size 32") in text  # min: the objective minimizes
    assert "its model: /data/out/digits-lr-x7k2m9qp" in text


def test_submitting_an_existing_experiment_re_attaches():
    fake = FakeKatib([SUCCEEDED])
    fake.experiments["digits-lr"] = EXP
    out = io.StringIO()
    submit_and_wait(api_for(fake, out), EXP)
    assert "re-attached to existing Experiment team/digits-lr" in out.getvalue()
    assert fake.calls == [("create", "experiments"), ("get", "experiments")]


def test_a_failed_experiment_names_its_failed_trials():
    fake = FakeKatib([FAILED], TRIALS)
    with pytest.raises(JobFailedError, match="team/digits-lr failed: max failed trials reached. "
                       "Failed trials: digits-lr-aaaa1111"):
        submit_and_wait(api_for(fake), EXP, wait=True)


def test_timeout_stops_waiting_and_leaves_the_experiment():
    fake = FakeKatib([RUNNING])
    with pytest.raises(WaitTimeoutError, match="kfvision tune delete digits-lr -n team"):
        submit_and_wait(api_for(fake), EXP, wait=True, timeout_s=5, poll_s=1)
    assert "digits-lr" in fake.experiments


@pytest.mark.parametrize("error, verb, words", [
    (ApiException(status=403, reason="Forbidden"), "create",
     ["create Experiment team/digits-lr failed: HTTP 403", "manifests/rbac.yaml"]),
    (ApiException(status=404, reason="Not Found"), "create",
     ["create Experiment team/digits-lr failed: HTTP 404", "katib-standalone"])])
def test_kubernetes_errors_name_kind_namespace_and_name(error, verb, words):
    fake = FakeKatib([RUNNING], fail={(verb, "experiments"): error})
    with pytest.raises(KubernetesError) as e:
        submit_and_wait(api_for(fake), EXP)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_an_unreachable_api_server_is_an_endpoint_error():
    down = MaxRetryError(None, "/apis", NewConnectionError(None, "Connection refused"))
    fake = FakeKatib([RUNNING], fail={("get", "experiments"): down})
    with pytest.raises(EndpointError):
        api_for(fake).get("digits-lr")


@pytest.mark.parametrize("status, state", [
    ({}, "Pending"), (RUNNING, "Running"), (SUCCEEDED, "Succeeded"), (FAILED, "Failed")])
def test_experiment_state_reads_the_conditions(status, state):
    assert experiment_state({"status": status})[0] == state


def test_best_trial_follows_the_objective_direction_and_is_none_before_metrics():
    maximize = {"spec": {"objective": {"type": "maximize", "objectiveMetricName":
                                       "validation-loss"}}, "status": {"currentOptimalTrial": BEST}}
    assert best_trial(maximize)[3] == "0.9"
    assert best_trial({"spec": EXP["spec"], "status": {}}) is None


def test_the_role_grants_exactly_the_calls_tune_makes(tmp_path, monkeypatch, capsys):
    fake = FakeKatib([RUNNING, SUCCEEDED], TRIALS)
    monkeypatch.setattr(experimentclient, "client",
                        lambda namespace=None, out=None: api_for(fake, sys.stdout))
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(EXP))
    assert main(["tune", "submit", str(path), "--wait", "--poll", "1"]) == 0
    assert main(["tune", "status", "digits-lr"]) == 0
    out = capsys.readouterr().out
    assert "digits-lr-aaaa1111  Failed  lr=0.09" in out
    assert main(["tune", "delete", "digits-lr"]) == 0
    assert "deleted Experiment team/digits-lr" in capsys.readouterr().out
    assert main(["tune", "status", "digits-lr"]) == 4
    assert "get Experiment team/digits-lr failed: HTTP 404" in capsys.readouterr().err
    fake.script, fake.step = [FAILED], 0
    assert main(["tune", "submit", str(path), "--wait"]) == 1
    katib = {(v, r) for v, r in rbac_rules() if r in ("experiments", "trials")}
    assert set(fake.calls) == katib
    assert main(["tune", "submit", str(path), "-n", "other"]) == 2  # differs from the YAML's
