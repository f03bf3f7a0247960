"""`kfvision job run-local` of a TrainJob: the torch plugin's environment, the runtime's failure
policy, logs per node; and a 2 x 2 CPU TrainJob that trains the digits as the same PyTorchJob.

Most tests swap `trainer.command` for a few lines of Python (fast, no torch); the `distributed`
test runs the real trainer through torchrun, as the rendered TrainJob says.
"""

import json
import textwrap
from urllib.parse import urlsplit

import pytest
from helpers.runs import render_job

from kfvision.pipelines.jobs.config import JobConfig
from kfvision.pipelines.jobs.errors import InvalidJobError, JobFailedError
from kfvision.pipelines.jobs.trainjob.build import RuntimeRef, build_runtime, build_trainjob
from kfvision.pipelines.jobs.trainjob.local import (
    STOCK,
    FailurePolicy,
    StatusEndpoint,
    run_local,
    status_env,
    torch_env,
)
from kfvision.trainer.config import TrainConfig

TRAIN = TrainConfig(model="/m", train="/t", val="/v", out="/o")


def make_trainjob(nodes=2, nproc=1, runtime="kfvision-torch", script="", name="t", **extra):
    """A rendered TrainJob whose nodes run `python -c script` instead of torchrun."""
    job = build_trainjob(JobConfig(name=name, image="local", train=TRAIN, nodes=nodes,
                                   procs_per_node=nproc, **extra), RuntimeRef(runtime))
    job["spec"]["trainer"].update(command=["python", "-c", textwrap.dedent(script)], args=[])
    return job


@pytest.mark.parametrize("trainer,index,expected", [
    ({"numNodes": 3, "numProcPerNode": 4}, 2,
     {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "2",
      "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}),
    ({"numNodes": 2, "resourcesPerNode": {"limits": {"nvidia.com/gpu": 8}}}, 0,
     {"PET_NPROC_PER_NODE": "auto", "PET_NNODES": "2"}),  # GPUs and no numProcPerNode: auto
    ({"resourcesPerNode": {"requests": {"cpu": "2500m"}}}, 0,
     {"PET_NPROC_PER_NODE": "3", "PET_NNODES": "1"}),  # the CPU count, rounded up
    ({}, 0, {"PET_NPROC_PER_NODE": "1"}),  # at least 1
    # v2.3.0 getNumCPUPerNode: the request wins over the limit; the limit when no request
    ({"resourcesPerNode": {"requests": {"cpu": "2"}, "limits": {"cpu": "6"}}}, 0,
     {"PET_NPROC_PER_NODE": "2"}),
    ({"resourcesPerNode": {"requests": {"cpu": "0"}, "limits": {"cpu": "1500m"}}}, 0,
     {"PET_NPROC_PER_NODE": "2"}),
    # GetNumGPUPerNode: any resource named *gpu*, requests first, then limits; 0 GPUs is CPU
    ({"resourcesPerNode": {"requests": {"amd.com/GPU": 1}}}, 0, {"PET_NPROC_PER_NODE": "auto"}),
    ({"resourcesPerNode": {"requests": {"nvidia.com/gpu": 0, "cpu": "4"},
                           "limits": {"nvidia.com/gpu": 2}}}, 0, {"PET_NPROC_PER_NODE": "auto"}),
    ({"resourcesPerNode": {"limits": {"nvidia.com/gpu": 0, "cpu": "3"}}}, 0,
     {"PET_NPROC_PER_NODE": "3"}),
    # numProcPerNode is taken as it is, GPUs or not
    ({"numProcPerNode": 2, "resourcesPerNode": {"limits": {"nvidia.com/gpu": 8}}}, 0,
     {"PET_NPROC_PER_NODE": "2"}),
])
def test_torch_env_is_the_plugins(trainer, index, expected):
    env = torch_env({"metadata": {"name": "job"}, "spec": {"trainer": trainer}}, index)
    assert {k: env[k] for k in expected} == expected
    assert set(env) == {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                        "PET_MASTER_PORT"}  # no RANK, WORLD_SIZE or MASTER_ADDR


RUNTIME_8_CPUS = {"spec": {"mlPolicy": {"numNodes": 3, "torch": {}}, "template": {"spec": {
    "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
        "containers": [{"name": "node", "resources": {"requests": {"cpu": "8"}}}]}}}}}]}}}}


def test_the_runtime_gives_what_the_trainjob_leaves_out():
    """torch.go: no trainer.numNodes -> the runtime's mlPolicy.numNodes; no resourcesPerNode ->
    the runtime's node container's resources."""
    bare = {"metadata": {"name": "job"}, "spec": {"trainer": {}}}
    env = torch_env(bare, 0, runtime=RUNTIME_8_CPUS)
    assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("3", "8")
    own = {"metadata": {"name": "job"}, "spec": {"trainer": {
        "numNodes": 2, "resourcesPerNode": {"requests": {"cpu": "2"}}}}}
    env = torch_env(own, 0, runtime=RUNTIME_8_CPUS)
    assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("2", "2")


@pytest.mark.parametrize("extra,nproc", [
    ({"cpu": "8"}, "1"),  # a CPU job of 8 cores: one process, not the plugin's 8
    ({"gpus_per_node": 4}, "4"),  # one process per GPU, not "auto"
    ({"gpus_per_node": 4, "procs_per_node": 2}, "2"),
    ({"procs_per_node": 3, "cpu": "8"}, "3"),
])
def test_render_writes_numprocpernode_so_the_plugin_takes_ours(extra, nproc):
    """Without numProcPerNode the torch plugin runs one process per CPU of resourcesPerNode, or
    `auto` (one per GPU torchrun sees) with GPUs: render always writes it, for CPU and GPU jobs
    alike, so the processes per node are those of --procs-per-node (else one per GPU, else 1)."""
    job = build_trainjob(JobConfig(name="t", image="i", train=TRAIN, nodes=2, **extra),
                         RuntimeRef("kfvision-torch"))
    assert str(job["spec"]["trainer"]["numProcPerNode"]) == nproc
    assert torch_env(job, 1)["PET_NPROC_PER_NODE"] == nproc
    del job["spec"]["trainer"]["numProcPerNode"]  # what the plugin would have done instead
    assert torch_env(job, 1)["PET_NPROC_PER_NODE"] == ("auto" if "gpus_per_node" in extra
                                                       else extra.get("cpu", "1"))


def test_the_status_variables_only_with_the_gate_and_the_trainer_label(tmp_path):
    """trainjobstatus.go: the three variables go into the pod set labelled as the trainer's
    ancestor, and only with the TrainJobStatus gate on (a status endpoint given here)."""
    job = make_trainjob(nodes=1)
    status = StatusEndpoint("https://127.0.0.1:10443", tmp_path)
    assert status_env(job, STOCK, None) == {}
    unlabelled = json.loads(json.dumps(STOCK))
    unlabelled["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["metadata"] = {}
    assert status_env(job, unlabelled, status) == {}
    assert status_env(job, STOCK, status) == {
        "KUBEFLOW_TRAINER_SERVER_URL": "https://127.0.0.1:10443/apis/trainer.kubeflow.org/"
                                       "v1alpha1/namespaces/default/trainjobs/t/status",
        "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(tmp_path / "ca.crt"),
        "KUBEFLOW_TRAINER_SERVER_TOKEN": str(tmp_path / "token")}


def test_each_node_gets_the_plugins_env_and_nothing_inherited(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "5")  # as if we ran inside another launcher
    monkeypatch.setenv("PET_NNODES", "9")
    job = make_trainjob(nodes=3, nproc=2, script=f"""
        import json, os
        json.dump(dict(os.environ), open(r"{tmp_path}/" + os.environ["PET_NODE_RANK"] + ".json",
                                         "w"))
        print("hello from", os.environ["PET_NODE_RANK"])
        """)
    result = run_local(job, tmp_path / "logs", restart_delay_s=0)
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [e["PET_NODE_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["PET_MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["PET_MASTER_PORT"] for e in envs}) == 1
    assert {e["PET_NNODES"] for e in envs} == {"3"} and {e["PET_NPROC_PER_NODE"] for e in envs} \
        == {"2"}
    assert all("RANK" not in e and "WORLD_SIZE" not in e and "MASTER_ADDR" not in e
               and e["PYTHONUNBUFFERED"] == "1" and e["CUDA_VISIBLE_DEVICES"] == "" for e in envs)
    assert "[node-0-2] hello from 2" in capsys.readouterr().out
    assert (tmp_path / "logs" / "node-0-1.log").read_text() == "hello from 1\n"
    assert result.restarts == 0 and result.exit_codes == {f"node-0-{i}": 0 for i in range(3)}


@pytest.mark.parametrize("runtime,codes,restarts,node0_restarts,error", [
    # kfvision-torch: 1-127 fail the TrainJob at once; 128+ restart every node, 3 times at most
    ("kfvision-torch", [2], 0, 0, r"Job failed \(PodFailurePolicy\)"),
    ("kfvision-torch", [1], 0, 0, "fails the TrainJob"),
    ("kfvision-torch", [137, 200], 2, 2, None),
    ("kfvision-torch", [137] * 4, 3, 3, "maxRestarts 3 reached"),
    # the stock runtime: the failed node restarts alone, whatever the code, 6 times
    ("torch-distributed", [2, 137], 2, 0, None),
    ("torch-distributed", [2] * 7, 6, 0, "BackoffLimitExceeded"),
])
def test_the_runtimes_failure_policy_decides_what_is_restarted(
        tmp_path, flaky_replicas, runtime, codes, restarts, node0_restarts, error):
    job = make_trainjob(runtime=runtime, script=flaky_replicas(codes))
    if error is None:
        result = run_local(job, tmp_path / "logs", quiet=True, restart_delay_s=0)
        assert result.restarts == restarts
    else:
        with pytest.raises(JobFailedError, match=error) as info:
            run_local(job, tmp_path / "logs", quiet=True, restart_delay_s=0)
        assert f"node-0-1 exited with code {codes[restarts]}" in str(info.value)
        assert "failing with" in str(info.value)  # the node's last log lines
    logs = tmp_path / "logs"
    assert (logs / "node-0-1.log").read_text().count("--- restart") == restarts
    assert (logs / "node-0-0.log").read_text().count("--- restart") == node0_restarts


def test_the_policies_read_from_the_runtimes():
    kfv, stock = FailurePolicy.of(build_runtime("i")), FailurePolicy.of(STOCK)
    assert (kfv.pod_restart, kfv.backoff_limit, kfv.max_restarts) == ("Never", 0, 3)
    assert kfv.fail_codes == frozenset(range(1, 128))
    assert kfv.action("PodFailurePolicy") == "FailJobSet"
    assert kfv.action("BackoffLimitExceeded") == "RestartJobSet"
    assert (stock.pod_restart, stock.backoff_limit, stock.max_restarts) == ("OnFailure", 6, 0)
    assert stock.fail_codes == frozenset() and stock.action("PodFailurePolicy") == "RestartJobSet"


def test_active_deadline_fails_the_trainjob(tmp_path):
    job = make_trainjob(nodes=1, script="import time; time.sleep(60)", active_deadline=1)
    with pytest.raises(JobFailedError, match="DeadlineExceeded"):
        run_local(job, tmp_path / "logs", quiet=True)


@pytest.mark.parametrize("change,message", [
    (lambda j: j["spec"]["runtimeRef"].update(name="my-runtime"), "not a runtime run-local knows"),
    (lambda j: j["spec"]["trainer"].pop("command"), "has no command"),
    (lambda j: j["spec"]["trainer"]["env"].append({"name": "PET_NODE_RANK", "value": "1"}),
     "sets PET_NODE_RANK"),
    (lambda j: j["spec"]["trainer"]["env"].append(
        {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}), "valueFrom"),
    (lambda j: j["spec"]["trainer"].update(command=["no-such-program-here"]), "not on PATH"),
])
def test_run_local_refuses_what_it_cannot_run_faithfully(tmp_path, change, message):
    job = make_trainjob(script="pass")
    change(job)
    with pytest.raises(InvalidJobError, match=message):
        run_local(job, tmp_path / "logs", quiet=True)


@pytest.mark.distributed
def test_a_2x2_trainjob_trains_the_digits_like_the_same_pytorchjob_and_reports_each_epoch(
        tmp_path, micro_digits, resnet18_dir, pytorchjob_2x2):
    """The 2 x 2 job of helpers.runs, rendered as a TrainJob on kfvision's runtime (whose node
    job carries the trainer ancestor label) and run by the local runner with the TrainJobStatus
    gate on (helpers/statusserver.py stands in for the controller's server): the nodes get the
    variables trainjobstatus.go injects, rank 0 alone reports every epoch, re-reading the token
    that rotates after each report, and the model's figures are the PyTorchJob's."""
    import yaml
    from helpers.statusserver import StatusServer  # a server's certificate: made only here

    manifest = render_job(tmp_path, micro_digits, resnet18_dir, kind="trainjob")
    job = yaml.safe_load(manifest.read_text())
    server = StatusServer(tmp_path / "kubeflow-trainer", namespace="default",
                          name=job["metadata"]["name"], rotate=True)
    base = "{0.scheme}://{0.netloc}".format(urlsplit(server.url))
    try:
        run_local(job, tmp_path / "logs", quiet=True, restart_delay_s=0,
                  status=StatusEndpoint(base, server.directory))
    finally:
        server.close()
    assert [r[2] for r in server.requests] == [200] * 3  # one report an epoch, rank 0 only
    assert [s["progressPercentage"] for s in server.reports] == [33, 67, 100]
    assert len(set(server.tokens_used)) == 3
    trainjob = json.loads((tmp_path / f"model-{manifest.stem}" / "metrics.json").read_text())
    pytorchjob = pytorchjob_2x2["metrics"]
    assert pytorchjob_2x2["rc"] == 0
    assert trainjob["status"] == pytorchjob["status"] == "completed"
    assert trainjob["world_size"] == pytorchjob["world_size"] == 4
    for key in ("val_loss", "val_top1", "val_top5"):
        assert trainjob["final"][key] == pytorchjob["final"][key], key
    assert (tmp_path / "logs" / "node-0-1.log").exists()


KILLED_ONCE = """
    import os, pathlib, sys, time
    d = pathlib.Path(r"{tmp}")
    if os.environ["PET_NODE_RANK"] == "0":
        while not (d / "done").exists():
            time.sleep(0.05)
        sys.exit(0)
    runs = d / "runs"
    n = int(runs.read_text()) if runs.exists() else 0
    runs.write_text(str(n + 1))
    if n == 0:
        print("node 1 ready", flush=True)
        time.sleep(60)
    (d / "done").touch()
"""


def test_a_killed_node_restarts_every_node_under_kfvision_torch(tmp_path):
    import signal

    from kfvision.pipelines.jobs.faults import Fault

    job = make_trainjob(script=KILLED_ONCE.format(tmp=tmp_path))
    result = run_local(job, tmp_path / "logs", quiet=True, restart_delay_s=0,
                                faults=[Fault("node-0-1", "node 1 ready", signal.SIGKILL)])
    assert result.restarts == 1 and "SIGKILL to every process of node-0-1" in result.faults[0]
    assert "exit code 137: Job failed (BackoffLimitExceeded), JobSet RestartJobSet 1/3" in (
        tmp_path / "logs" / "node-0-0.log").read_text()
