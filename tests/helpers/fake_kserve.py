"""A FAKE of the Kubernetes API for InferenceServices (no cluster can run here): a stand-in for
CustomObjectsApi that keeps InferenceServices in a dict, plays a script of status conditions, and
records every (verb, resource), so manifests/rbac-deploy.yaml can be checked against the calls
actually made."""

import json

from kfvision.pipelines.clients.k8s import Api
from kfvision.pipelines.serve import deployclient
from kfvision.pipelines.serve.deploy import DeployConfig, build_inference_service
from kubernetes.client.exceptions import ApiException

from helpers.machine import FakeClock

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
    return deployclient.DeployClient(Api(fake, None, "kubeflow", out=out, sleep=clock.sleep,
                                    clock=clock))
