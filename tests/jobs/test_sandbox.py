"""run-local's stand-in for a pod's filesystem, user and memory (pipelines/jobs/sandbox.py,
memlimit.py) and the HOME every pod gets (home.py). The sandboxed runs themselves are the whole
suite's: every local job runs sandboxed where bwrap is installed; tests/script/
test_script_sandbox.py checks what a script meets there."""

import os
import sys

import pytest
from helpers.paths import REPO
from test_job_local import make_job

from kfvision.pipelines.jobs import sandbox
from kfvision.pipelines.jobs.config import JobConfig
from kfvision.pipelines.jobs.home import CACHE_VARS, HOME_MOUNT
from kfvision.pipelines.jobs.pytorchjob.build import build_pytorchjob
from kfvision.pipelines.jobs.pytorchjob.local import run_local
from kfvision.trainer.config import TrainConfig

TRAIN = TrainConfig(model="/m", train="/t", val="/v", out="/o")


@pytest.mark.parametrize("names,expected", [
    (["/opt", "/", "/usr/lib/x", "/etc/passwd"], []),  # the system: never writable
    ([sys.prefix + "/lib/x", "s3://b/k", "resnet18", "--epochs=3", "0.05"], []),
    (["/tmp/a/b"], []),  # the machine's /tmp: writable when the pod mounts one there
    (["tests/script/model", "--out=tests/jobs", "new/x/y"],
     [REPO / "tests/script", REPO / "tests/jobs"]),
])
def test_the_folders_a_job_names_stand_in_for_its_pvcs(names, expected, monkeypatch):
    if expected and REPO.is_relative_to(sandbox.HOST_TMP):  # a clone under /tmp (CI's): the
        monkeypatch.setattr(sandbox, "HOST_TMP", "/nonexistent-tmp")  # machine's /tmp elsewhere
    assert sandbox.stand_ins(names, REPO) == expected


def test_the_pod_view_takes_user_volumes_and_limits_from_the_manifest():
    job = build_pytorchjob(JobConfig(name="j", image="i", train=TRAIN, nodes=2, shm_size="1Gi"))
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    view = sandbox.pod_view(pod, pod["containers"][0])
    assert (view.uid, view.gid, view.read_only_root, view.tmp) == (1000, 1000, True, True)
    assert (view.shm_bytes, view.memory_limit) == (2**30, None)
    assert sandbox.memory_bytes("512Mi") == 512 * 2**20 and sandbox.memory_bytes("2G") == 2e9


def test_every_pod_gets_a_writable_home_and_the_users_env_wins():
    job = build_pytorchjob(JobConfig(name="j", image="i", train=TRAIN,
                                     env=(("HOME", "/data/me"), ("A", "1"))))
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert len(env) == len(pod["containers"][0]["env"])  # each name once
    assert env["HOME"] == "/data/me" and env["A"] == "1"
    assert {n: v for n, v in env.items() if n in CACHE_VARS and n != "HOME"} == {
        n: f"{HOME_MOUNT}/{sub}" for n, sub in CACHE_VARS.items() if n != "HOME"}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[HOME_MOUNT])
    assert volume == {"name": mounts[HOME_MOUNT], "emptyDir": {}}


def test_without_bwrap_one_line_says_so_and_the_job_runs_with_the_pods_home(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not os.path.exists(os.path.join(p, "bwrap"))))
    monkeypatch.setenv("XDG_CACHE_HOME", "/caller/cache")
    sandbox.probe.cache_clear()
    try:
        job = make_job(nodes=2, script="import os; print('home', os.environ['HOME'], "
                       "os.environ['XDG_CACHE_HOME'])")
        run_local(job, tmp_path / "logs")
    finally:
        sandbox.probe.cache_clear()
    out, err = capsys.readouterr()
    assert err.count("cannot enforce the pod's filesystem") == 1, err
    for pod in ("master-0", "worker-0"):
        home = tmp_path / "logs" / "pods" / pod / HOME_MOUNT.lstrip("/")
        assert f"[{pod}] home {home} {home}/.cache" in out
    said = []
    assert sandbox.choose(False, said.append) is None and said == []  # --no-sandbox: silent


@pytest.mark.skipif(sandbox.probe()[0] is None, reason="no bwrap here")
def test_a_pod_past_its_memory_limit_is_oomkilled(tmp_path, capsys):
    from kfvision.pipelines.jobs.errors import JobFailedError
    from kfvision.pipelines.jobs.memlimit import _parent

    if _parent()[0] is None:
        pytest.skip("no memory cgroup here")
    job = make_job(nodes=1, policy="Never", script="x = bytearray(400 * 2**20)")
    c = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    c["resources"] = {"limits": {"memory": "100Mi"}}
    with pytest.raises(JobFailedError, match="exited with code 137") as e:
        run_local(job, tmp_path / "logs")
    if "OOMKilled" not in capsys.readouterr().out:  # a cgroup we could not make: said so
        pytest.skip("the memory limit is not enforced here")
    assert "OOMKilled" in str(e.value)
