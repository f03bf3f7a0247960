"""`kfvision job submit | logs | delete` against a FAKE Kubernetes API.

Nothing here talks to a cluster: no Kubernetes can run on our machines. `FakeCluster` stands in
for the two client objects kfvision uses (kubernetes' CustomObjectsApi and CoreV1Api), keeps the
jobs of one kind (PyTorchJobs, or TrainJobs: tests/test_trainjob_cluster.py) in a dict, plays a
scripted status sequence, raises the client's real ApiException, and records every (verb,
resource) it serves so the Role in manifests/rbac.yaml can be checked against the calls made.
What it cannot show: that a real API server, Training Operator or Kubeflow Trainer behave as
scripted (docs/jobs.md says what was and was not exercised).
"""

import io
import json

import pytest
import yaml
from conftest import REPO, FakeClock
from kubernetes.client.exceptions import ApiException

from pipelines.cli import main
from pipelines.clients.endpoints import EndpointAuthError
from pipelines.clients.k8s import Api, KubernetesError
from pipelines.jobs import cluster
from pipelines.jobs.cluster import JobClient, job_state, submit
from pipelines.jobs.config import JobConfig
from pipelines.jobs.errors import JobFailedError, JobTimeoutError
from pipelines.jobs.pytorchjob.build import build_pytorchjob
from trainer.config import TrainConfig
from trainer.errors import StorageError

NS = "kubeflow"
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
        return {**self.jobs[name], "status": {"conditions": conditions}}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name,
                                        propagation_policy=None):
        assert (group, version, plural) == self.API
        self._serve("delete", plural)
        if self.jobs.pop(name, None) is None:
            raise ApiException(status=404, reason="Not Found")

    def list_namespaced_pod(self, namespace, label_selector=None, _preload_content=True):
        assert label_selector == f"{self.POD_LABEL}=digits"
        self._serve("list", "pods")
        _, pods = self.script[min(max(self.step - 1, 0), len(self.script) - 1)]
        return FakeResponse(json.dumps({"items": pods}).encode())

    def read_namespaced_pod_log(self, name, namespace, container=None, follow=False,
                                previous=False, tail_lines=None, _preload_content=True):
        assert container == self.CONTAINER
        self._serve("get", "pods/log")
        lines = self.logs.get(name, [])[-tail_lines:] if tail_lines else self.logs.get(name, [])
        return FakeResponse("".join(line + "\n" for line in lines).encode())


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


def test_submit_wait_streams_the_master_log_and_returns_on_success():
    fake = FakeCluster([([cond("Created")], []), RUNNING, RUNNING, SUCCEEDED], logs=MASTER_LOG)
    out = io.StringIO()
    job = submit(client_for(fake, out), JOB, wait=True, poll_s=5)
    text = out.getvalue()
    assert job_state(job)[0] == "Succeeded"
    assert f"created PyTorchJob {NS}/digits" in text
    assert "[master-0] epoch 1 done: val top1 0.5\n[master-0] epoch 2 done: val top1 0.9" in text
    assert text.index("Running") < text.index("Succeeded")
    assert fake.jobs["digits"]["metadata"]["namespace"] == NS


def test_submitting_an_existing_job_re_attaches_instead_of_creating_a_second():
    fake = FakeCluster([RUNNING, SUCCEEDED])
    fake.jobs["digits"] = JOB
    out = io.StringIO()
    submit(client_for(fake, out), JOB, wait=True, poll_s=5)
    assert "already exists: re-attaching" in out.getvalue()
    assert list(fake.jobs) == ["digits"] and fake.calls.count(("create", "pytorchjobs")) == 1


def test_submitting_a_job_that_already_failed_says_so_and_how_to_run_it_again():
    failed = ([cond("Created"), cond("Failed", "1 Worker replica(s) failed.")], [])
    fake = FakeCluster([failed, failed])
    fake.jobs["digits"] = JOB
    out = io.StringIO()
    with pytest.raises(JobFailedError, match="1 Worker replica"):
        submit(client_for(fake, out), JOB, wait=True, logs=False)
    assert (f"PyTorchJob {NS}/digits already exists and has failed: reporting that run"
            in out.getvalue())
    assert f"kfvision job delete digits -n {NS}, then submit" in out.getvalue()
    assert fake.calls.count(("create", "pytorchjobs")) == 1  # the refused create, no other


def test_a_failed_job_is_an_error_naming_the_replica_its_reason_and_last_log_lines():
    failed = ([cond("Created"), cond("Running"),
               cond("Failed", "PyTorchJob digits is failed because 1 Worker replica(s) failed.")],
              [pod("master-0"), pod("worker-0"),
               pod("worker-1", "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}})])
    logs = {"digits-worker-1": [f"line {i}" for i in range(50)] + ["error: out of memory"]}
    fake = FakeCluster([RUNNING, failed], logs=logs)
    with pytest.raises(JobFailedError) as e:
        submit(client_for(fake), JOB, wait=True, logs=False)
    message = str(e.value)
    assert "1 Worker replica(s) failed" in message
    assert "worker-1 (pod digits-worker-1) exited with code 1, reason Error" in message
    assert message.rstrip().endswith("error: out of memory") and "line 30" not in message
    assert "worker-0" not in message


def test_a_restarted_replica_reports_its_previous_container():
    failed = ([cond("Failed", "backoff limit")],
              [pod("master-0", last={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                   restarts=3)])
    fake = FakeCluster([failed], logs={"digits-master-0": ["loading"]})
    fake.jobs["digits"] = JOB
    with pytest.raises(JobFailedError, match="master-0 .* exited with code 137, reason OOMKilled"):
        client_for(fake).wait("digits", logs=False)


@pytest.mark.parametrize("keep", [False, True])
def test_timeout_is_honoured_and_deletes_the_job_unless_kept(keep):
    pending = ([cond("Created")], [pod("master-0", "Pending", state={"waiting": {}}, conditions=[
        {"type": "PodScheduled", "status": "False",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}])])
    fake = FakeCluster([pending])
    with pytest.raises(JobTimeoutError) as e:
        submit(client_for(fake), JOB, wait=True, timeout_s=60, poll_s=10,
               keep_on_timeout=keep)
    assert "did not finish within 60 s" in str(e.value)
    assert "master-0 is Pending (0/3 nodes are available" in str(e.value)
    assert ("digits" in fake.jobs) == keep
    assert fake.step == 7  # polled every 10 s for 60 s, then gave up


@pytest.mark.parametrize("status,verb,words", [
    (403, "create", ["create PyTorchJob kubeflow/digits failed: HTTP 403", "manifests/rbac.yaml"]),
    (404, "create", ["HTTP 404", "pytorchjobs.kubeflow.org", "Training Operator v1.9"]),
    (500, "get", ["get PyTorchJob kubeflow/digits failed: HTTP 500: etcd is down"]),
])
def test_kubernetes_errors_name_kind_namespace_and_name(status, verb, words):
    error = ApiException(status=status, reason="Nope")
    error.body = json.dumps({"message": "etcd is down"}) if status == 500 else None
    fake = FakeCluster([RUNNING], fail={(verb, "pytorchjobs"): error})
    with pytest.raises(KubernetesError) as e:
        submit(client_for(fake), JOB, wait=True)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert e.value.__cause__ is error and e.value.status == status


def test_refused_credentials_are_an_auth_error_exit_77():
    """401: the README's EndpointAuthError (77), from jobs, Experiments and InferenceServices
    alike (pipelines/clients/k8s.py maps it once)."""
    error = ApiException(status=401, reason="Unauthorized")
    fake = FakeCluster([RUNNING], fail={("create", "pytorchjobs"): error})
    with pytest.raises(EndpointAuthError) as e:
        submit(client_for(fake), JOB, wait=True)
    assert "create PyTorchJob kubeflow/digits failed: HTTP 401" in str(e.value)
    assert "credentials" in str(e.value) and e.value.exit_code == 77


@pytest.mark.parametrize("conditions,state", [
    ([], "Pending"),
    ([cond("Created"), cond("Running")], "Running"),
    ([cond("Running"), cond("Restarting")], "Restarting"),
    ([cond("Running"), {**cond("Running"), "status": "False"}, cond("Failed")], "Failed"),
    ([cond("Succeeded"), cond("Running")], "Succeeded"),
])
def test_job_state_reads_the_conditions(conditions, state):
    assert job_state({"status": {"conditions": conditions}})[0] == state


def _rbac_rules(*jobs) -> set:
    """(verb, resource) the Role grants; with `jobs`, only those job resources (and core)."""
    roles = [d for d in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text())
             if d["kind"] in ("Role", "ClusterRole")]
    return {(verb, resource) for role in roles for rule in role["rules"]
            for resource in rule["resources"] for verb in rule["verbs"]
            if not jobs or resource in jobs or rule["apiGroups"] == [""]}


def test_the_role_grants_exactly_the_calls_the_train_step_makes(tmp_path, monkeypatch, capsys):
    fake = FakeCluster([RUNNING, SUCCEEDED], logs=MASTER_LOG)
    monkeypatch.setattr(cluster, "connect", fake_connect(fake))
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(JOB))
    assert main(["job", "submit", str(manifest), "--wait", "--poll", "1"]) == 0
    assert main(["job", "logs", "digits", "--tail", "1"]) == 0
    assert capsys.readouterr().out.endswith("epoch 2 done: val top1 0.9\n")
    assert main(["job", "logs", "digits", "--follow"]) == 0
    assert main(["job", "delete", "digits"]) == 0
    assert "deleted PyTorchJob kubeflow/digits" in capsys.readouterr().out
    failed = ([cond("Failed")], [pod("worker-0", "Failed", {"terminated": {"exitCode": 1}})])
    fake.script, fake.step = [failed], 0
    assert main(["job", "submit", str(manifest), "--wait"]) == 1
    assert "worker-0 (pod digits-worker-0) exited with code 1" in capsys.readouterr().err
    fake.script, fake.step = [RUNNING], 0
    assert main(["job", "submit", str(manifest), "--wait", "--timeout", "5"]) == 124
    # logs and delete look for a TrainJob of that name first (tests/test_trainjob_cluster.py
    # checks the Role against the calls of both kinds together)
    assert set(fake.calls) == (_rbac_rules("pytorchjobs") - WORKSPACE_CALLS - SOURCE_CALLS) | {
        ("get", "trainjobs")}


def test_the_train_step_gives_the_job_the_workspace_claim_of_its_own_pod(monkeypatch):
    from pipelines.jobs.config import Volume
    from pipelines.steps import train as train_step
    from trainer.errors import InvalidParameterError

    fake = FakeCluster([RUNNING])
    client = client_for(fake)
    monkeypatch.setenv("HOSTNAME", "image-classification-x7k2p-system-container-impl-1")
    assert train_step.job_volumes(client, "/kfp-workspace", "", nodes=1) == (
        Volume("run-x7k2p-kfp-workspace", "/kfp-workspace"),)
    assert fake.calls == [("get", "pods")]  # one node: the access mode does not matter
    assert train_step.job_volumes(client, "/kfp-workspace", "", nodes=2)[0].claim == \
        "run-x7k2p-kfp-workspace"
    fake.workspace_modes = ["ReadWriteOnce"]
    with pytest.raises(InvalidParameterError, match="nodes = 2.*ReadWriteOnce.*"
                                                    "--workspace-access ReadWriteMany"):
        train_step.job_volumes(client, "/kfp-workspace", "", nodes=2)
    assert set(fake.calls) == WORKSPACE_CALLS <= _rbac_rules()
    with pytest.raises(StorageError, match="mounts no PVC at /elsewhere"):
        train_step.job_volumes(client, "/elsewhere", "", nodes=1)


def test_logs_of_a_replica_without_a_pod_and_namespace_conflicts_are_clear(tmp_path,
                                                                           monkeypatch, capsys):
    fake = FakeCluster([([cond("Created")], [])])
    fake.jobs["digits"] = JOB
    monkeypatch.setattr(cluster, "connect", fake_connect(fake))
    assert main(["job", "logs", "digits", "--replica", "worker-7"]) == 2
    assert "has no pod for replica worker-7" in capsys.readouterr().err
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump({**JOB, "metadata": {**JOB["metadata"],
                                                            "namespace": "team-a"}}))
    assert main(["job", "submit", str(manifest), "-n", "team-b"]) == 2
    assert "differs from the manifest's metadata.namespace team-a" in capsys.readouterr().err
