"""`kfvision pipeline submit` against a fake kfp.Client (no KFP backend can run here; a loopback
server answers the health check submit makes first), and the flags every command shares. The
fake's get_run plays the states a run passes through, for `--wait`."""

import http.server
import types
from pathlib import Path

import pytest
import yaml
from helpers.loopback import serve_in_thread

from kfvision.pipelines import cli
from kfvision.pipelines.flow.pipeline import parameter_defaults


class FakeClient:
    """Records what `kfvision pipeline submit` asks of kfp.Client."""

    made = []

    def __init__(self, host=None, namespace=None, existing_token=None, cookies=None,
                 ssl_ca_cert=None):
        self.host, self.namespace, self.calls = host, namespace, []
        self.token = existing_token
        FakeClient.made.append(self)

    def create_run_from_pipeline_package(self, path, arguments, run_name, experiment_name,
                                         namespace):
        with open(path, encoding="utf-8") as f:
            spec = next(yaml.safe_load_all(f))
        pvc = spec["root"]["inputDefinitions"]["parameters"]["pvc_name"].get("defaultValue")
        self.calls.append({"pipeline": spec["pipelineInfo"]["name"], "arguments": arguments,
                           "pvc_default": pvc,
                           "run_name": run_name, "experiment": experiment_name,
                           "namespace": namespace})
        return types.SimpleNamespace(run_id="run-123")

    states = []  # what get_run answers, one after the other (the last one stays)

    def get_run(self, run_id):
        state = FakeClient.states.pop(0) if len(FakeClient.states) > 1 else FakeClient.states[0]
        self.calls.append({"get_run": run_id})
        return types.SimpleNamespace(run_id=run_id, state=state, error=types.SimpleNamespace(
            message="task train-pytorch-model failed") if state == "FAILED" else None)


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/apis/v2beta1/healthz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_kfp(monkeypatch):
    import kfp

    FakeClient.made = []
    monkeypatch.setattr(kfp, "Client", FakeClient)
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Healthy)
    serve_in_thread(srv)
    FakeClient.endpoint = f"http://127.0.0.1:{srv.server_address[1]}"
    yield FakeClient
    srv.shutdown()


def test_submit_compiles_and_starts_a_run_with_the_given_parameters(fake_kfp, capsys):
    rc = cli.main(["pipeline", "submit", "--endpoint", fake_kfp.endpoint, "--token", "t0k",
                   "--experiment", "digits", "--namespace", "team-a", "--data-pvc", "photos",
                   "--train-source", "/kfvision-data/digits/train.tar.gz", "--epochs", "15",
                   "--gpus-per-node", "2", "--node-selector", "pool=gpu", "--pretrained"])
    assert rc == 0
    (client,) = fake_kfp.made
    assert (client.host, client.namespace, client.token) == (fake_kfp.endpoint, "team-a", "t0k")
    (call,) = client.calls
    assert call["pipeline"] == "image-classification" and call["experiment"] == "digits"
    args = call["arguments"]
    assert set(args) == set(parameter_defaults())  # every parameter, defaults included
    assert args["epochs"] == 15 and args["gpus_per_node"] == 2 and args["pretrained"] is True
    assert args["train_source"] == "/kfvision-data/digits/train.tar.gz"
    assert f"{fake_kfp.endpoint}/#/runs/details/run-123" in capsys.readouterr().out
    assert call["pvc_default"] == args["pvc_name"] == "photos"  # compiled in, and the run's


def test_submit_with_a_store_needs_no_volume_and_deploys_from_it(fake_kfp, capsys):
    rc = cli.main(["pipeline", "submit", "--endpoint", fake_kfp.endpoint, "--workspace-size",
                   "", "--data-uri", "s3://bkt/kfvision", "--train-source", "s3://bkt/photos/",
                   "--nodes", "4", "--deploy"])
    assert rc == 0, capsys.readouterr().err
    (client,) = fake_kfp.made
    assert client.calls[0]["arguments"]["nodes"] == 4


@pytest.mark.parametrize("action, flags, message", [
    ("submit", ["--data-uri", "bkt/kfvision"], "--data-uri 'bkt/kfvision' is not an s3:// URI"),
    ("submit", ["--data-uri", "s3://bkt/k", "--script-source", "s3://bkt/s.tar.gz",
                "--script-entry", "train.py"], "script_source with a pipeline compiled with "
     "--data-uri"),
    ("run-local", ["--data-uri", "bkt/kfvision"], "--data-uri 'bkt/kfvision' is not an s3://"),
])
def test_a_bad_store_is_refused_before_anything_runs(fake_kfp, capsys, tmp_path, action, flags,
                                                     message):
    argv = ["pipeline", action, "--train-source", "s3://bkt/photos/", *flags]
    argv += ["--endpoint", fake_kfp.endpoint] if action == "submit" else [
        "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2 and fake_kfp.made == []
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--train-source", "/kfvision-data/x"], "train_source '/kfvision-data/x' is a path, but "
                                             "the pipeline is compiled without a data PVC"),
    (["--pvc-name", "data"], "add --data-pvc data"),
    (["--deploy"], "deploy on a cluster copies the model onto the data PVC"),
    (["--workspace-size", ""], "needs --data-pvc NAME"),
])
def test_submit_refuses_what_the_compiled_storage_cannot_do(fake_kfp, capsys, flags, message):
    args = ["--train-source", "https://example.com/photos.tgz", *flags]
    rc = cli.main(["pipeline", "submit", "--endpoint", fake_kfp.endpoint, *args])
    assert rc == 2 and fake_kfp.made == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--model-name", "resnet19"], "(closest: resnet18"),
    (["--gpus-per-node", "1", "--procs-per-node", "2"], "--nproc-per-node 2 is more than"),
    (["--pvc-name", "Data_PVC"], "--pvc-name claim 'Data_PVC' is not a DNS-1123 subdomain"),
    (["--learning-rate", "0"], "0 < --lr <= 10"),  # the option's own flag, as in train
    (["--lr", "0"], "0 < --lr <= 10"),
])
def test_submit_refuses_bad_parameters_before_contacting_the_endpoint(fake_kfp, capsys, flags,
                                                                      message):
    rc = cli.main(["pipeline", "submit", "--endpoint", fake_kfp.endpoint,
                   "--data-pvc", "data", "--train-source", "/kfvision-data/x.tar.gz", *flags])
    assert rc == 2 and fake_kfp.made == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("action", ["compile", "submit", "run-local"])
def test_pipeline_help(action, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["pipeline", action, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: kfvision pipeline " + action in out
    if action != "compile":
        for flag in ("--train-source", "--lr LEARNING_RATE, --learning-rate LEARNING_RATE",
                     "--gpus-per-node", "--pvc-name", "(default: 0.001)"):
            assert flag in out


SCRIPT = Path(__file__).parents[1] / "script" / "styles" / "torchrun_ddp"


def test_submit_uploads_a_script_folder_of_this_machine_and_the_run_gets_its_uri(
        fake_kfp, capsys, s3_bucket, tmp_path):
    """The pipeline's pods cannot see this machine: a --script-source folder here is packed as the
    train step packs it and uploaded once to --source-store (a real S3 API: moto on loopback);
    the run's script_source is that object, which the train step reads back to the same bytes."""
    from kfvision.pipelines.flow.steps.trainscript import snapshot
    from kfvision.pipelines.script.snapshot import pack

    argv = ["pipeline", "submit", "--endpoint", fake_kfp.endpoint, "--train-source",
            "https://example.com/photos.tgz", "--script-source", str(SCRIPT), "--script-entry",
            "train.py", "--source-store", s3_bucket.uri("src/")]
    snap = pack(SCRIPT)
    uri = s3_bucket.uri(f"src/{snap.sha256}.tar.gz")
    assert cli.main(argv) == 0
    (call,) = fake_kfp.made[0].calls
    assert call["arguments"]["script_source"] == uri
    assert call["arguments"]["script_entry"] == "train.py"
    out = capsys.readouterr().out
    assert f"script_source {SCRIPT}: {len(snap.files)} files" in out and f"uploaded to {uri}" in out
    assert snapshot(uri, tmp_path).data == snap.data  # what the train step will run
    assert cli.main(argv) == 0  # a second run of the same code uploads nothing
    assert f"at {uri} (already there)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--script-source", str(SCRIPT), "--script-entry", "train.py"],
     f"--script-source {SCRIPT} is a folder of this machine, which no step of a cluster run can "
     "read: add --source-store s3://BUCKET/PREFIX"),
    (["--source-store", "s3://b/src"], "no --script-source is given: leave --source-store out"),
    (["--script-source", "s3://b/src/x.tar.gz", "--script-entry", "train.py", "--source-store",
      "s3://b/src"], "--script-source 's3://b/src/x.tar.gz' is not one"),
    (["--script-source", str(SCRIPT), "--script-entry", "trian.py", "--source-store",
      "s3://b/src"], "trian.py"),  # looked for before anything is uploaded
])
def test_submit_refuses_a_script_folder_it_cannot_ship_before_contacting_anything(
        fake_kfp, capsys, flags, message):
    rc = cli.main(["pipeline", "submit", "--endpoint", fake_kfp.endpoint, "--train-source",
                   "https://example.com/photos.tgz", *flags])
    assert rc == 2 and fake_kfp.made == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("states, rc, said", [
    (["PENDING", "RUNNING", "RUNNING", "SUCCEEDED"], 0, "run run-123 succeeded: "),
    (["RUNNING", "FAILED"], 1, "PipelineRunFailedError: run run-123 ended FAILED: task "
                               "train-pytorch-model failed; its steps and logs: "),
    (["RUNNING"], 124, "WaitTimeoutError: run run-123 is still RUNNING after 0.05 s; it goes on"),
])
def test_submit_wait_follows_the_run_until_it_ends(fake_kfp, capsys, states, rc, said):
    fake_kfp.states = list(states)
    argv = ["pipeline", "submit", "--endpoint", fake_kfp.endpoint, "--data-pvc", "photos",
            "--train-source", "/kfvision-data/digits/train.tar.gz", "--wait", "--poll", "0.01"]
    assert cli.main(argv + (["--timeout", "0.05"] if rc == 124 else [])) == rc
    out = capsys.readouterr()
    assert said in out.out + out.err
    assert [line for line in out.out.splitlines() if line.startswith("run run-123: ")] == [
        f"run run-123: {s}" for s in dict.fromkeys(states)]

