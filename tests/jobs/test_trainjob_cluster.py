"""`kfvision job submit | logs | delete` of TrainJobs, and API discovery, against a FAKE API.

The fake of tests/jobs/test_job_cluster.py (not a cluster: two small client objects), serving
`trainer.kubeflow.org/v1alpha1` TrainJobs, JobSet pod labels (`jobset.sigs.k8s.io/jobset-name`,
`batch.kubernetes.io/job-completion-index`), container `node`, TrainJob conditions (`Complete`,
`Failed`) and the runtimes a TrainJob references. It cannot show that Kubeflow Trainer, JobSet
and the kubelet behave as scripted.
"""

import io

import pytest
import yaml
from helpers.fake_k8s import (
    JOB,
    LIST_CALLS,
    NS,
    RUNNING,
    SOURCE_CALLS,
    SUCCEEDED,
    T_RUNNING,
    FakeCluster,
    FakeTrainer,
    client_for,
    fake_connect,
    node,
    rbac_rules,
)
from kfvision.pipelines.cli import main
from kfvision.pipelines.clients.k8s import Api, KubernetesError
from kfvision.pipelines.flow.steps import train as train_step
from kfvision.pipelines.jobs import jobclient
from kfvision.pipelines.jobs.config import JobConfig
from kfvision.pipelines.jobs.errors import InvalidJobError, JobFailedError, JobTimeoutError
from kfvision.pipelines.jobs.jobclient import job_state, submit
from kfvision.pipelines.jobs.kinds import PYTORCHJOB, TRAINJOB, pick_kind, served_kinds
from kfvision.pipelines.jobs.trainjob.build import RuntimeRef, build_trainjob
from kfvision.trainer.config import TrainConfig
from kubernetes.client.exceptions import ApiException

CFG = JobConfig(name="digits", image="i", nodes=3,
                train=TrainConfig(model="/m", train="/t", val="/v", out="/o"))
TJOB = build_trainjob(CFG, RuntimeRef("kfvision-torch"))


def cond(kind, reason="", message=""):
    return {"type": kind, "status": "True", "reason": reason, "message": message}


T_COMPLETE = ([cond("Complete", "JobSetCompleted", "jobset completed successfully")],
              [node(0, "Succeeded", {"terminated": {"exitCode": 0}})])
NODE_LOG = {"digits-node-0-0-x7k2p": ["epoch 1 done: val top1 0.5", "epoch 2 done: val top1 0.9"]}


def trainer_client(fake, out=None):
    return client_for(fake, out, kind=TRAINJOB)


def test_submit_waits_on_complete_streaming_node_0s_log():
    fake = FakeTrainer([T_RUNNING, T_RUNNING, T_COMPLETE], logs=NODE_LOG)
    out = io.StringIO()
    job = submit(trainer_client(fake, out), TJOB, wait=True, poll_s=5)
    text = out.getvalue()
    assert job_state(job)[0] == "Complete"
    assert f"created TrainJob {NS}/digits" in text
    assert f"TrainJob {NS}/digits: Running" in text and text.index("Running") < text.index(
        "Complete")
    assert "[node-0-0] epoch 1 done: val top1 0.5\n[node-0-0] epoch 2 done: val top1 0.9" in text
    assert ("get", "clustertrainingruntimes") in fake.calls  # the runtime was checked first


def test_submitting_an_existing_trainjob_re_attaches():
    fake = FakeTrainer([T_RUNNING, T_COMPLETE])
    fake.jobs["digits"] = TJOB
    out = io.StringIO()
    submit(trainer_client(fake, out), TJOB, wait=True, poll_s=5, logs=False)
    assert "already exists: re-attaching" in out.getvalue()
    assert fake.calls.count(("create", "trainjobs")) == 1


def test_a_failed_trainjob_names_the_node_its_reason_and_last_log_lines():
    failed = ([cond("Failed", "JobSetFailed", "jobset failed: FailJobSet: PodFailurePolicy")],
              [node(0), node(1, "Failed", {"terminated": {"exitCode": 2, "reason": "Error"}}),
               node(2)])
    logs = {"digits-node-0-1-x7k2p": [f"line {i}" for i in range(50)]
            + ["error: data/train is not an image directory"]}
    fake = FakeTrainer([T_RUNNING, failed], logs=logs)
    with pytest.raises(JobFailedError) as e:
        submit(trainer_client(fake), TJOB, wait=True, logs=False)
    message = str(e.value)
    assert message.startswith(f"TrainJob {NS}/digits failed: jobset failed: FailJobSet")
    assert "node-0-1 (pod digits-node-0-1-x7k2p) exited with code 2, reason Error" in message
    assert message.rstrip().endswith("not an image directory") and "line 30" not in message
    assert "node-0-2" not in message


@pytest.mark.parametrize("ref,runtimes,words", [
    ({"name": "kfvision-torch"}, (),
     ["references ClusterTrainingRuntime kfvision-torch, which the cluster does not have",
      "kubectl apply -f manifests/trainer-v2/clustertrainingruntime.yaml"]),
    ({"name": "kfvision-torch", "kind": "TrainingRuntime"}, (),
     ["TrainingRuntime kfvision-torch", f"does not have in namespace {NS}",
      f"trainer-v2/trainingruntime.yaml -n {NS}"]),
    ({"name": "torch-distributed"}, (("trainingruntimes", "torch-distributed"),),
     ["ClusterTrainingRuntime torch-distributed", "install Kubeflow Trainer's runtimes"]),
])
def test_a_missing_runtime_is_named_with_how_to_install_it(ref, runtimes, words):
    job = yaml.safe_load(yaml.safe_dump(TJOB))
    job["spec"]["runtimeRef"].update(ref)
    fake = FakeTrainer([T_RUNNING], runtimes=runtimes)
    with pytest.raises(KubernetesError) as e:
        submit(trainer_client(fake), job, wait=True)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert e.value.status == 404 and ("create", "trainjobs") not in fake.calls


def test_without_permission_to_read_runtimes_submit_leaves_the_check_to_the_webhook():
    fake = FakeTrainer([T_COMPLETE], fail={("get", "clustertrainingruntimes"): ApiException(
        status=403, reason="Forbidden")})
    submit(trainer_client(fake), TJOB, wait=True, logs=False)
    assert ("create", "trainjobs") in fake.calls


def test_timeout_deletes_the_trainjob():
    fake = FakeTrainer([([], [node(0, "Pending", {"waiting": {"reason": "ImagePullBackOff",
                                                               "message": "not found"}})])])
    with pytest.raises(JobTimeoutError) as e:
        submit(trainer_client(fake), TJOB, wait=True, timeout_s=30, poll_s=10)
    assert "TrainJob kubeflow/digits did not finish within 30 s" in str(e.value)
    assert "node-0-0 is Pending (ImagePullBackOff: not found)" in str(e.value)
    assert "digits" not in fake.jobs


@pytest.mark.parametrize("status,state", [
    ({}, "Pending"),
    ({"jobsStatus": [{"name": "node", "active": 2}]}, "Running"),
    ({"conditions": [cond("Suspended")]}, "Suspended"),
    ({"conditions": [cond("Complete")]}, "Complete"),
    ({"conditions": [cond("Failed", "DeadlineExceeded")]}, "Failed"),
])
def test_job_state_reads_trainjob_conditions(status, state):
    assert job_state({"status": status})[0] == state


def test_the_role_grants_exactly_the_calls_both_kinds_make(tmp_path, monkeypatch, capsys):
    namespaced = build_trainjob(CFG, RuntimeRef("kfvision-torch", "TrainingRuntime"))
    calls = set()
    for fake, job in ((FakeTrainer([T_RUNNING, T_COMPLETE]), TJOB),
                      (FakeTrainer([T_COMPLETE], runtimes=(("trainingruntimes",
                                                            "kfvision-torch"),)), namespaced),
                      (FakeCluster([RUNNING, SUCCEEDED]), JOB)):
        monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
        manifest = tmp_path / "job.yaml"
        manifest.write_text(yaml.safe_dump(job))
        assert main(["job", "submit", str(manifest), "--wait", "--poll", "1"]) == 0
        fake.logs = {**NODE_LOG, "digits-master-0": ["master says hi"]}
        assert main(["job", "logs", "digits", "--tail", "1"]) == 0
        assert capsys.readouterr().out.endswith(("val top1 0.9\n", "master says hi\n"))
        assert main(["job", "delete", "digits"]) == 0
        assert f"deleted {job['kind']} kubeflow/digits" in capsys.readouterr().out
        fake.script, fake.step = [([cond("Failed")], [])], 0
        assert main(["job", "submit", str(manifest), "--wait", "--timeout", "5"]) == 1
        train_step.job_volumes(jobclient.connect(), "/kfp-workspace", "", nodes=2)
        calls |= set(fake.calls)
    katib = {(v, r) for v, r in rbac_rules() if r in ("experiments", "trials")}
    # Katib's: tests/tune/test_tune_cluster.py; a script's ConfigMap: tests/tune/test_tune_script.py
    # (`job list`'s: tests/jobs/test_jobstatus.py)
    assert calls == rbac_rules() - katib - SOURCE_CALLS - LIST_CALLS


def test_logs_and_delete_of_a_name_that_is_no_job_name_both_kinds(monkeypatch, capsys):
    monkeypatch.setattr(jobclient, "connect", fake_connect(FakeTrainer([T_RUNNING])))
    assert main(["job", "delete", "nope"]) == 4
    assert "there is no TrainJob or PyTorchJob nope in namespace kubeflow" in \
        capsys.readouterr().err


def _serving(*resources) -> FakeCluster:
    fake = FakeCluster([RUNNING])
    for group_version, names in resources:
        fake.served[group_version] = names
    return fake


TRAINER = (("trainer.kubeflow.org", "v1alpha1"), ["trainjobs", "trainjobs/status",
                                                  "trainingruntimes", "clustertrainingruntimes"])
OPERATOR = (("kubeflow.org", "v1"), ["pytorchjobs", "pytorchjobs/status", "tfjobs"])
PROFILES_ONLY = (("kubeflow.org", "v1"), ["profiles"])  # Kubeflow's own group, no PyTorchJob


@pytest.mark.parametrize("resources,served", [
    ((TRAINER, OPERATOR), [TRAINJOB, PYTORCHJOB]),
    ((OPERATOR,), [PYTORCHJOB]),
    ((TRAINER, PROFILES_ONLY), [TRAINJOB]),
    ((PROFILES_ONLY,), []),
    ((), []),
])
def test_api_discovery_finds_the_crds_the_cluster_serves(resources, served):
    fake = Api(_serving(*resources), None, NS)
    assert served_kinds(fake) == served
    if served:
        assert pick_kind(fake) is served[0]  # TrainJob preferred
    else:
        with pytest.raises(InvalidJobError) as e:
            pick_kind(fake)
        assert "trainjobs.trainer.kubeflow.org" in str(e.value)
        assert "pytorchjobs.kubeflow.org" in str(e.value)


def test_api_discovery_failing_is_a_kubernetes_error():
    class Refusing(FakeCluster):
        def get_api_resources(self, group, version, _preload_content=True):
            raise ApiException(status=500, reason="Internal Server Error")

    with pytest.raises(KubernetesError, match="API discovery of trainer.kubeflow.org/v1alpha1 "
                       "failed: HTTP 500") as e:
        served_kinds(Api(Refusing([RUNNING]), None, NS))
    assert isinstance(e.value.__cause__, ApiException)


def test_logs_work_with_a_role_that_grants_only_pytorchjobs(monkeypatch, capsys):
    fake = FakeCluster([RUNNING], logs={"digits-master-0": ["hi"]},
                       fail={("get", "trainjobs"): ApiException(status=403, reason="Forbidden")})
    fake.jobs["digits"] = JOB
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    assert main(["job", "logs", "digits"]) == 0
    assert capsys.readouterr().out == "hi\n"
    del fake.jobs["digits"]
    assert main(["job", "delete", "digits"]) == 4  # the refusal, not "no such job"
    assert "get TrainJob kubeflow/digits failed: HTTP 403" in capsys.readouterr().err
