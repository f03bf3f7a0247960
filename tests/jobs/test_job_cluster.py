"""`kfvision job submit | logs | delete` against a FAKE Kubernetes API.

Nothing here talks to a cluster: no Kubernetes can run on our machines. `FakeCluster` stands in
for the two client objects kfvision uses (kubernetes' CustomObjectsApi and CoreV1Api), keeps the
jobs of one kind (PyTorchJobs, or TrainJobs: tests/jobs/test_trainjob_cluster.py) in a dict, plays a
scripted status sequence, raises the client's real ApiException, and records every (verb,
resource) it serves so the Role in manifests/rbac.yaml can be checked against the calls made.
What it cannot show: that a real API server, Training Operator or Kubeflow Trainer behave as
scripted (docs/jobs.md says what was and was not exercised).
"""

import io
import json

import pytest
import yaml
from helpers.fake_k8s import (
    JOB,
    LIST_CALLS,
    MASTER_LOG,
    NS,
    RUNNING,
    SOURCE_CALLS,
    SUCCEEDED,
    WORKSPACE_CALLS,
    FakeCluster,
    client_for,
    cond,
    fake_connect,
    pod,
    rbac_rules,
)
from kfvision.pipelines.cli import main
from kfvision.pipelines.clients.endpoints import EndpointAuthError
from kfvision.pipelines.clients.k8s import KubernetesError
from kfvision.pipelines.jobs import jobclient
from kfvision.pipelines.jobs.errors import JobFailedError, JobTimeoutError
from kfvision.pipelines.jobs.jobclient import job_state, submit
from kfvision.trainer.errors import StorageError
from kubernetes.client.exceptions import ApiException


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


def test_the_role_grants_exactly_the_calls_the_train_step_makes(tmp_path, monkeypatch, capsys):
    fake = FakeCluster([RUNNING, SUCCEEDED], logs=MASTER_LOG)
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
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
    # logs and delete look for a TrainJob of that name first (tests/jobs/test_trainjob_cluster.py
    # checks the Role against the calls of both kinds together)
    assert set(fake.calls) == (rbac_rules("pytorchjobs") - WORKSPACE_CALLS - SOURCE_CALLS
                               - LIST_CALLS) | {("get", "trainjobs")}


def test_the_train_step_gives_the_job_the_workspace_claim_of_its_own_pod(monkeypatch):
    from kfvision.pipelines.flow.steps import train as train_step
    from kfvision.pipelines.jobs.config import Volume
    from kfvision.trainer.errors import InvalidParameterError

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
    assert set(fake.calls) == WORKSPACE_CALLS <= rbac_rules()
    with pytest.raises(StorageError, match="mounts no PVC at /elsewhere"):
        train_step.job_volumes(client, "/elsewhere", "", nodes=1)


def test_logs_of_a_replica_without_a_pod_and_namespace_conflicts_are_clear(tmp_path,
                                                                           monkeypatch, capsys):
    fake = FakeCluster([([cond("Created")], [])])
    fake.jobs["digits"] = JOB
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "logs", "digits", "--replica", "worker-7"]) == 2
    assert "has no pod for replica worker-7" in capsys.readouterr().err
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump({**JOB, "metadata": {**JOB["metadata"],
                                                            "namespace": "team-a"}}))
    assert main(["job", "submit", str(manifest), "-n", "team-b"]) == 2
    assert "differs from the manifest's metadata.namespace team-a" in capsys.readouterr().err


def test_a_failed_jobs_report_names_the_first_failure_from_the_launchers_records():
    from kfvision.trainer.failures import ExitRecord

    def record(rank, kind, at, code):
        return "[kfvision launch] " + ExitRecord(rank, rank // 2, rank % 2, 100 + rank, kind,
                                                 1_800_000_000 + at, 30 + at, code).line()

    failed = ([cond("Failed", "PyTorchJob digits is failed because 1 Worker replica(s) failed.")],
              [pod("master-0", "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}}),
               pod("worker-0", "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}})])
    # the Master's ranks lost their peer in the same second as the Worker's rank 3 failed
    logs = {"digits-master-0": [record(0, "lost a peer", 0.71, 1),
                                record(1, "stopped", 0.72, 143)],
            "digits-worker-0": [record(3, "failed", 0.40, 1), record(2, "stopped", 0.45, 143)]}
    fake = FakeCluster([failed], logs=logs)
    fake.jobs["digits"] = JOB
    with pytest.raises(JobFailedError) as e:
        client_for(fake).wait("digits", logs=False)
    message = str(e.value)
    assert message.count("[kfvision launch] rank 3 ") == 1  # each pod's own lines, once
    assert message.splitlines()[1] == (
        "  rank 3 on node 1 exited with 1 (unexpected error: permanent) after 30.4 s, the first "
        "failure of the job; following: rank 0 on node 0 (+0.31 s, lost a peer); stopped: rank 2 "
        "on node 1, rank 1 on node 0")
