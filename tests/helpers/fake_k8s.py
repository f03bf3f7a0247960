"""A FAKE of the Kubernetes API for jobs (no cluster can run here): `FakeCluster` stands in for
the two client objects kfvision uses (kubernetes' CustomObjectsApi and CoreV1Api), keeps the jobs
of one kind in a dict, plays a scripted status sequence, raises the client's real ApiException,
and records every (verb, resource) it serves, so the Role in manifests/rbac.yaml can be checked
against the calls made (`rbac_rules`)."""

import io
import json

import yaml
from kfvision.pipelines.clients.k8s import Api
from kfvision.pipelines.jobs.config import JobConfig
from kfvision.pipelines.jobs.jobclient import JobClient
from kfvision.pipelines.jobs.pytorchjob.build import build_pytorchjob
from kfvision.trainer.config import TrainConfig
from kubernetes.client.exceptions import ApiException

from helpers.machine import FakeClock
from helpers.paths import REPO

NS = "kubeflow"
STAMP = "2026-01-02T03:04:05.000000001Z"  # the kubelet's time of a log line given without one
JOB = build_pytorchjob(JobConfig(name="digits", image="i", nodes=3,
                                 train=TrainConfig(model="/m", train="/t", val="/v", out="/o")))


def cond(kind, message=""):
    return {"type": kind, "status": "True", "reason": f"PyTorchJob{kind}", "message": message}


def pod(replica, phase="Running", state=None, last=None, restarts=0, conditions=()):
    rtype, index = replica.split("-")
    status = {"name": "pytorch", "restartCount": restarts,
              "state": state or {"running": {"startedAt": "now"}}}
    if last:
        status["lastState"] = last
    return {"metadata": {"name": f"digits-{replica}", "uid": f"uid-{replica}",
                         "labels": {"training.kubeflow.org/job-name": "digits",
                                    "training.kubeflow.org/replica-type": rtype,
                                    "training.kubeflow.org/replica-index": index}},
            "status": {"phase": phase, "containerStatuses": [status],
                       "conditions": list(conditions)}}


class FakeResponse:
    """What the client returns with _preload_content=False: .data, .stream(), .release_conn()."""

    def __init__(self, data: bytes):
        self.data = data

    def stream(self, amt=None, decode_content=False):
        for i in range(0, len(self.data), 7):  # odd-sized chunks: lines split across them
            yield self.data[i:i + 7]

    def release_conn(self):
        pass


# A KFP task's pod as the backend makes it (volume names as its driver gives them)
STEP_POD = {"spec": {
    "volumes": [{"name": "kfp-workspace",
                 "persistentVolumeClaim": {"claimName": "run-x7k2p-kfp-workspace"}},
                {"name": "kfp-launcher", "emptyDir": {}}],
    "containers": [{"name": "main", "volumeMounts": [
        {"name": "kfp-workspace", "mountPath": "/kfp-workspace"},
        {"name": "kfp-launcher", "mountPath": "/kfp-launcher"}]}]}}
WORKSPACE_CALLS = {("get", "pods"), ("get", "persistentvolumeclaims")}  # the train step's
SOURCE_CALLS = {("create", "configmaps"), ("get", "configmaps")}  # a script's snapshot (tune)
LIST_CALLS = {("list", "pytorchjobs"), ("list", "trainjobs")}  # `job list` (tests/jobs/
# test_jobstatus.py)


class FakeCluster:
    """A FAKE of CustomObjectsApi + CoreV1Api (not a cluster): see the module docstring.

    `script` is a list of (conditions, pods); each get of the job moves one step on.
    """

    API = ("kubeflow.org", "v1", "pytorchjobs")
    POD_LABEL, CONTAINER = "training.kubeflow.org/job-name", "pytorch"

    def __init__(self, script, logs=None, fail=None):
        self.script, self.step, self.logs = script, 0, logs or {}
        self.fail = fail or {}  # (verb, resource) -> ApiException to raise
        self.jobs, self.calls = {}, []
        self.runtimes = set()  # (plural, name) of the (Cluster)TrainingRuntimes it has
        self.served = {}  # (group, version) -> resources, for API discovery
        self.workspace_modes = ["ReadWriteMany"]  # the bound workspace PVC's access modes

    def _serve(self, verb, resource):
        self.calls.append((verb, resource))
        if (verb, resource) in self.fail:
            raise self.fail[(verb, resource)]

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        assert (group, version, plural) == self.API
        self._serve("create", plural)
        name = body["metadata"]["name"]
        if name in self.jobs:
            raise ApiException(status=409, reason="Conflict")
        self.jobs[name] = json.loads(json.dumps(body))
        return self.jobs[name]

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self._serve("get", plural)
        if plural.endswith("runtimes"):
            return self._runtime(plural, name)
        if name not in self.jobs or (group, version, plural) != self.API:
            raise ApiException(status=404, reason="Not Found")
        conditions, _ = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        return self._with_status(self.jobs[name], conditions)

    @staticmethod
    def _with_status(job: dict, conditions: list) -> dict:
        """The stored job with the scripted conditions (and what else its status holds)."""
        return {**job, "status": {**(job.get("status") or {}), "conditions": conditions}}

    def list_namespaced_custom_object(self, group, version, namespace, plural,
                                      label_selector=None):
        """The stored jobs of that resource (of any kind: a test may store both) that carry
        every label of `label_selector`."""
        self._serve("list", plural)
        wanted = dict(p.split("=", 1) for p in (label_selector or "").split(",") if p)
        conditions, _ = self.script[min(self.step, len(self.script) - 1)]
        return {"items": [self._with_status(j, conditions) for j in self.jobs.values()
                          if j["apiVersion"] == f"{group}/{version}"
                          and f"{j['kind'].lower()}s" == plural
                          and wanted.items() <= j["metadata"].get("labels", {}).items()]}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name,
                                        propagation_policy=None):
        assert (group, version, plural) == self.API
        self._serve("delete", plural)
        if self.jobs.pop(name, None) is None:
            raise ApiException(status=404, reason="Not Found")

    def list_namespaced_pod(self, namespace, label_selector=None, _preload_content=True):
        assert label_selector.startswith(f"{self.POD_LABEL}=")
        self._serve("list", "pods")
        if label_selector != f"{self.POD_LABEL}=digits":  # the scripted pods are digits's
            return FakeResponse(b'{"items": []}')
        _, pods = self.script[min(max(self.step - 1, 0), len(self.script) - 1)]
        return FakeResponse(json.dumps({"items": pods}).encode())

    def read_namespaced_pod_log(self, name, namespace, container=None, follow=False,
                                previous=False, tail_lines=None, timestamps=False,
                                _preload_content=True):
        """The lines of `logs[name]`: text, or (kubelet's RFC 3339 time, text); with
        `timestamps`, each line after its time and a space (STAMP for plain ones)."""
        assert container == self.CONTAINER
        self._serve("get", "pods/log")
        lines = self.logs.get(name, [])[-tail_lines:] if tail_lines else self.logs.get(name, [])
        lines = [line if isinstance(line, tuple) else (STAMP, line) for line in lines]
        return FakeResponse("".join((f"{t} {text}" if timestamps else text) + "\n"
                                    for t, text in lines).encode())


    def read_namespaced_pod(self, name, namespace, _preload_content=True):
        """The train step's own pod, in which KFP mounted the run's workspace."""
        self._serve("get", "pods")
        return FakeResponse(json.dumps(STEP_POD).encode())

    def read_namespaced_persistent_volume_claim(self, name, namespace, _preload_content=True):
        self._serve("get", "persistentvolumeclaims")
        pvc = {"spec": {"accessModes": ["ReadWriteMany"]},
               "status": {"accessModes": self.workspace_modes}}
        return FakeResponse(json.dumps(pvc).encode())

    def get_cluster_custom_object(self, group, version, plural, name):
        self._serve("get", plural)
        return self._runtime(plural, name)

    def _runtime(self, plural, name):
        if (plural, name) not in self.runtimes:
            raise ApiException(status=404, reason="Not Found")
        return {"metadata": {"name": name}}

    def get_api_resources(self, group, version, _preload_content=True):
        if (group, version) not in self.served:
            raise ApiException(status=404, reason="Not Found")
        resources = [{"name": r} for r in self.served[(group, version)]]
        return FakeResponse(json.dumps({"resources": resources}).encode())


class FakeTrainer(FakeCluster):
    """The same FAKE API, serving TrainJobs (and kfvision-torch unless told otherwise)."""

    API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
    POD_LABEL, CONTAINER = "jobset.sigs.k8s.io/jobset-name", "node"

    def __init__(self, script, logs=None, fail=None, runtimes=(("clustertrainingruntimes",
                                                                  "kfvision-torch"),)):
        super().__init__(script, logs, fail)
        self.runtimes = set(runtimes)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        job = super().get_namespaced_custom_object(group, version, namespace, plural, name)
        if plural == "trainjobs":  # TrainJob conditions and JobSet jobs, from the script
            conditions = job["status"]["conditions"]
            job["status"]["jobsStatus"] = [{"name": "node", "active": 0 if conditions else 3}]
        return job


def node(i, phase="Running", state=None):
    """A TrainJob's node pod `i` as JobSet labels it."""
    status = {"name": "node", "restartCount": 0,
              "state": state or {"running": {"startedAt": "now"}}}
    return {"metadata": {"name": f"digits-node-0-{i}-x7k2p", "uid": f"uid-{i}",
                         "labels": {"jobset.sigs.k8s.io/jobset-name": "digits",
                                    "jobset.sigs.k8s.io/replicatedjob-name": "node",
                                    "jobset.sigs.k8s.io/job-index": "0",
                                    "batch.kubernetes.io/job-completion-index": str(i)}},
            "status": {"phase": phase, "containerStatuses": [status]}}


T_RUNNING = ([], [node(0), node(1), node(2)])


def fake_connect(fake):
    return lambda namespace=None, out=None, kind=None: client_for(fake, kind=kind)


def client_for(fake, out=None, kind=None) -> JobClient:
    clock = FakeClock()
    api = Api(fake, fake, NS, out=out or io.StringIO(), sleep=clock.sleep, clock=clock)
    return JobClient(api, **({"kind": kind} if kind else {}))


RUNNING = ([cond("Created"), cond("Running")], [pod("master-0"), pod("worker-0"),
                                                  pod("worker-1")])
SUCCEEDED = ([cond("Created"), cond("Running"), cond("Succeeded", "PyTorchJob digits is "
                                                      "successfully completed.")],
             [pod("master-0", "Succeeded", {"terminated": {"exitCode": 0}})])
MASTER_LOG = {"digits-master-0": ["epoch 1 done: val top1 0.5", "epoch 2 done: val top1 0.9"]}


def rbac_rules(*jobs) -> set:
    """(verb, resource) the Role grants; with `jobs`, only those job resources (and core)."""
    roles = [d for d in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text())
             if d["kind"] in ("Role", "ClusterRole")]
    return {(verb, resource) for role in roles for rule in role["rules"]
            for resource in rule["resources"] for verb in rule["verbs"]
            if not jobs or resource in jobs or rule["apiGroups"] == [""]}
