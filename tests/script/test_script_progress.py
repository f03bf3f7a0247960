"""A user's script's printed progress reported from its pod (pipelines/script/reporter.py): into
a TrainJob's status.trainerStatus through the stand-in of Kubeflow Trainer's status server
(tests/helpers/statusserver.py: HTTPS, its own CA, a token that rotates), with render's flags,
and seen through `kfvision job status` while the job runs."""

import json
import threading
import time
from urllib.parse import urlsplit

import pytest
from helpers.fake_k8s import NS, T_RUNNING, FakeTrainer, fake_connect
from helpers.statusserver import SCHEMA, StatusServer
from jsonschema import validate
from test_script import render, tree

from kfvision.pipelines.cli import main
from kfvision.pipelines.jobs import jobclient
from kfvision.pipelines.jobs.kinds import read_manifest
from kfvision.pipelines.jobs.progress import PROGRESS_REPORTS, PROGRESS_TOTAL
from kfvision.pipelines.jobs.trainjob.local import StatusEndpoint, run_local
from kfvision.pipelines.script.reporter import Reporter

# a plain script: a total, then an epoch every 1.5 s (the boot reports at most every 5 s: one
# report while it runs, three epochs in, and the last)
SCRIPT = """\
import time
print("epochs=4", flush=True)
for epoch in range(4):
    time.sleep(1.5)
    print(f"epoch={epoch} loss={1 / (epoch + 1):.4f} acc|top1={epoch / 4}", flush=True)
"""


@pytest.fixture
def server(tmp_path):
    srv = StatusServer(tmp_path / "kubeflow-trainer", namespace="default", name="demo",
                       rotate=True)
    yield srv
    srv.close()


def test_the_reporter_posts_rank_zeros_progress_with_the_rotating_token(server):
    said = []
    reporter = Reporter.from_env({**server.env(), PROGRESS_TOTAL: "epochs=4"}, None, said.append)
    try:
        for line in ("[0/-] [kfvision script] ready", "[1/2] epoch=3 loss=9", "[0/0] epoch=1",
                     "[0/0] epoch=2 loss=0.5"):
            reporter.line(line)
        reporter.flush()
        reporter.flush()  # nothing new: nothing posted
        reporter.line("[0/0] epoch=3 loss=0.25")
    finally:
        reporter.close()
    assert [r[2] for r in server.requests] == [200, 200] and said == []
    assert len(set(server.tokens_used)) == 2
    for status in server.reports:
        validate(status, SCHEMA)
    assert [s["progressPercentage"] for s in server.reports] == [50, 75]
    assert {m["name"]: m["value"] for m in server.trainer_status["metrics"]} == {
        "epoch": "3", "loss": "0.25", "epochs": "4"}


def test_reports_off_and_nowhere_to_report_make_no_reporter(server):
    said = []
    assert Reporter.from_env({**server.env(), PROGRESS_REPORTS: "off"}, None, said.append) is None
    assert said == ["progress: not reported by kfvision (KFVISION_PROGRESS_REPORTS=off: the "
                    "script reports its own)"]
    assert Reporter.from_env({}, None, said.append) is None  # no endpoint, no MLflow run


def test_render_carries_the_flags_as_the_jobs_variables(tmp_path, capsys):
    tree(tmp_path / "proj", {"train.py": SCRIPT})
    docs = render(tmp_path, "--source", str(tmp_path / "proj"), "--entry", "train.py",
                  "--progress-total", "epochs=10", "--progress-total", "max_steps=2e3",
                  "--no-progress-reports", [])
    env = {e["name"]: e["value"] for e in docs[-1]["spec"]["pytorchReplicaSpecs"]["Master"][
        "template"]["spec"]["containers"][0]["env"]}
    assert env[PROGRESS_TOTAL] == "epochs=10 max_steps=2000" and env[PROGRESS_REPORTS] == "off"
    for bad, why in (("epoch=10", "not a total kfvision reads"), ("epochs=ten", "not a number"),
                     ("epochs=0", "above 0")):
        assert main(["job", "render", "--name", "x", "--image", "i", "--source",
                     str(tmp_path / "proj"), "--entry", "train.py", "--progress-total",
                     bad]) == 2
        assert why in capsys.readouterr().err
    assert main(["job", "render", "--name", "x", "--image", "i", "--model", "m", "--train", "t",
                 "--val", "v", "--out", "o", "--no-progress-reports"]) == 2
    assert "--no-progress-reports and script arguments need --source" in capsys.readouterr().err


@pytest.mark.distributed
def test_a_trainjob_scripts_progress_is_in_its_status_while_it_runs(tmp_path, server,
                                                                     monkeypatch, capsys):
    """The TrainJobStatus gate on (run-local gives the nodes the stand-in's variables): node
    0's boot posts what rank 0 prints, and `job status -n` shows it from status.trainerStatus
    while the job runs (the FAKE API's TrainJob carries what the stand-in holds)."""
    tree(tmp_path / "proj", {"train.py": SCRIPT})
    render(tmp_path, "--kind", "trainjob", "--runtime", "kfvision-torch", "--nodes", "2",
           "--launcher", "python", "--source", str(tmp_path / "proj"), "--entry", "train.py", [])
    job, config_maps = read_manifest(tmp_path / "job.yaml")
    fake = FakeTrainer([T_RUNNING])
    fake.jobs["demo"] = {**json.loads(json.dumps(job)), "status": {}}
    original = fake.get_namespaced_custom_object

    def with_status(*args):  # the TrainJob as the status server left it
        fake.jobs["demo"]["status"] = {"trainerStatus": server.trainer_status}
        return original(*args)

    fake.get_namespaced_custom_object = with_status
    monkeypatch.setattr(jobclient, "connect", fake_connect(fake))
    views, done = [], threading.Event()

    def watch():
        from kfvision.pipelines.jobs.jobclient import attach
        from kfvision.pipelines.jobs.jobstatus import cluster_status

        while not done.is_set():
            views.append(cluster_status(attach(jobclient.connect(NS), "demo"), "demo",
                                        time.time()))
            time.sleep(0.3)

    thread = threading.Thread(target=watch)
    thread.start()
    base = "{0.scheme}://{0.netloc}".format(urlsplit(server.url))
    try:
        run_local(job, tmp_path / "logs", quiet=True, restart_delay_s=0, config_maps=config_maps,
                  status=StatusEndpoint(base, server.directory))
    finally:
        done.set()
        thread.join()
    during = [v["progress"] for v in views if v["source"] == "status.trainerStatus"]
    assert during and during[0]["percent"] < 100 and during[0]["metrics"]["loss"] > 0
    assert server.reports[-1]["progressPercentage"] == 100
    assert all(r[2] == 200 for r in server.requests) and len(set(server.tokens_used)) >= 2
    names = [m["name"] for m in server.trainer_status["metrics"]]
    assert names == ["epoch", "loss", "acc|top1", "epochs"]  # Katib's names: `|` may be in one
    assert main(["job", "status", "demo", "-n", NS]) == 0
    out = capsys.readouterr().out
    assert "progress  [####################] 100%  epoch 3 of 4" in out
    assert "metrics   epoch=3 loss=0.25 acc|top1=0.75" in out
    assert "(read from status.trainerStatus)" in out
