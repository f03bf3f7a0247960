"""Progress into a TrainJob's status.trainerStatus (trainer/trainjob_status.py).

The status endpoint is tests/helpers/statusserver.py: HTTPS with its own CA, a bearer token that
rotates, and the route, decoding, status codes and replies of Kubeflow Trainer v2.3.0's
pkg/statusserver. The first tests check that stand-in against upstream's behaviour; the rest drive
the reporter, and a real `kfvision train` given only the variables the controller injects, against
it.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from datetime import datetime, timezone
from urllib.parse import urlsplit

import jsonschema
import pytest
from helpers.k8s_checks import crd_schema
from helpers.paths import REPO
from helpers.runs import train_argv
from helpers.statusserver import SCHEMA, StatusServer

from kfvision.trainer.trainjob_status import StatusReporter, trainer_status
from kfvision.trainer.upstream import TRAINER_SERVER_URL

HISTORY = [{"epoch": e, "lr": 0.01, "train_loss": 2.0 / e, "train_top1": 0.3 * e,
            "val_loss": 1.5 / e, "val_top1": 0.25 * e, "val_top5": 0.9} for e in (1, 2, 3)]
WHEN = "2026-01-02T03:04:05Z"


@pytest.fixture
def server(tmp_path):
    srv = StatusServer(tmp_path / "kubeflow-trainer")
    yield srv
    srv.close()


def test_the_payload_is_what_the_trainjob_crd_declares():
    schema = crd_schema("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml")["properties"][
        "status"]["properties"]["trainerStatus"]
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    status = trainer_status(HISTORY[:2], 5, 30.0, when)
    jsonschema.validate(status, schema)
    assert "lastUpdatedTime" in status  # the CRD's CEL rule: has(self.lastUpdatedTime)
    assert status["progressPercentage"] == 40 and status["estimatedRemainingSeconds"] == 90
    metrics = {m["name"]: m["value"] for m in status["metrics"]}
    assert metrics["currentEpoch"] == "2" and metrics["totalEpochs"] == "5"
    assert metrics["val_top1"] == "0.5" and status["lastUpdatedTime"] == "2026-01-02T03:04:05Z"


def test_the_stand_ins_schema_is_the_crds():
    crd = crd_schema("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml")["properties"][
        "status"]["properties"]["trainerStatus"]
    keys = ("type", "minimum", "maximum", "maxItems", "minLength", "maxLength", "required")

    def bounds(schema):
        out = {k: v for k, v in schema.items() if k in keys}
        for name, sub in schema.get("properties", {}).items():
            out[name] = bounds(sub)
        if "items" in schema:
            out["items"] = bounds(schema["items"])
        return out

    assert bounds(SCHEMA) == bounds(crd)


def _post(server, body, token=None, path=None, method="POST"):
    """(HTTP code, reply) of one request as the stand-in answers it."""
    token = server.token if token is None else token
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, reply = server.handle(method, path or urlsplit(server.url).path,
                                {"Authorization": f"Bearer {token}"}, data)
    return code, reply


GOOD = {"trainerStatus": {"progressPercentage": 40, "metrics": [{"name": "loss", "value": "0.5"}],
                          "lastUpdatedTime": WHEN}}


@pytest.mark.parametrize(("body", "code", "message"), [
    (GOOD, 200, None),
    ({"trainerStatus": {**GOOD["trainerStatus"], "unknown": 1}, "other": 2}, 200, None),
    ({}, 200, None),  # no trainerStatus: nothing written
    (b"invalid payload", 422, "Invalid payload"),
    (b"", 422, "Invalid payload"),
    ({"trainerStatus": {"metrics": [{"name": "loss", "value": 0.5}], "lastUpdatedTime": WHEN}},
     422, "Invalid payload"),  # a metric value must be a JSON string
    ({"trainerStatus": {"progressPercentage": 33.3, "lastUpdatedTime": WHEN}}, 422,
     "Invalid payload"),
    ({"trainerStatus": {"progressPercentage": 40, "lastUpdatedTime": "yesterday"}}, 422,
     "Invalid payload"),
    ({"trainerStatus": {"progressPercentage": 101, "lastUpdatedTime": WHEN}}, 422,
     "status.trainerStatus.progressPercentage"),
    ({"trainerStatus": {"progressPercentage": 40}}, 422, "lastUpdatedTime is required"),
    ({"trainerStatus": {"metrics": [{"name": "loss", "value": "x" * 65}],
                        "lastUpdatedTime": WHEN}}, 422, "status.trainerStatus.metrics.0.value"),
])
def test_the_stand_in_decodes_and_validates_as_upstream(server, body, code, message):
    got, reply = _post(server, body)
    assert got == code
    if message is None:  # the reply is the request as decoded; only a trainerStatus is written
        assert reply == ({"trainerStatus": server.trainer_status} if server.reports else {})
    else:
        assert reply["status"] == "Failure" and reply["code"] == code
        assert message in reply["message"]


def test_the_stand_in_refuses_as_upstream(server):
    path = urlsplit(server.url).path
    assert _post(server, GOOD, token="wrong")[0] == 403
    assert _post(server, GOOD, path=path.replace("/digits/", "/other/"))[0] == 403
    assert _post(server, GOOD, method="GET")[0] == 404
    assert _post(server, GOOD, path=path + "/x")[0] == 404
    big = {"trainerStatus": {"metrics": [{"name": "m", "value": "0.5"}] * 4000}}
    assert _post(server, big)[1]["reason"] == "RequestEntityTooLarge"
    assert server.reports == [] and server.trainer_status is None


def test_each_epoch_is_posted_over_https_with_the_rotating_token(tmp_path):
    server = StatusServer(tmp_path / "kubeflow-trainer", rotate=True)
    try:
        ticks = iter([10.0, 30.0, 50.0])  # epochs of 10 s, 20 s, 20 s
        reporter = StatusReporter.from_env(3, server.env())
        reporter.clock, reporter.last = lambda: next(ticks), (0.0, 0)
        for n in (1, 2, 3):
            reporter.epoch_done(HISTORY[:n])
    finally:
        server.close()
    assert [r[2] for r in server.requests] == [200] * 3 and reporter.enabled
    assert len(set(server.tokens_used)) == 3  # the token file was read again for every report
    assert [s["progressPercentage"] for s in server.reports] == [33, 67, 100]
    assert [s.get("estimatedRemainingSeconds") for s in server.reports] == [20, 20, 0]
    assert server.trainer_status == server.reports[-1]


def test_a_resumed_runs_first_report_has_no_estimate(server):
    reporter = StatusReporter.from_env(3, server.env())
    reporter.epoch_done(HISTORY[:2])  # the history of the checkpoint, at once
    assert "estimatedRemainingSeconds" not in server.reports[0]


def test_a_garbled_answer_never_fails_training(caplog):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def answer():
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"not http at all\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        port = listener.getsockname()[1]
        reporter = StatusReporter.from_env(3, {TRAINER_SERVER_URL: f"http://127.0.0.1:{port}/s"})
        with caplog.at_level(logging.INFO, logger="trainer"):
            reporter.epoch_done(HISTORY[:1])  # never raises
    assert not reporter.enabled and "not reporting again" in caplog.records[0].getMessage()


@pytest.mark.parametrize(("change", "why"), [
    ("token", "HTTP 403: Forbidden"),
    ("path", "HTTP 404: Not found"),
    ("ca", "CERTIFICATE_VERIFY_FAILED"),  # not the endpoint's CA: no trust
    ("token-file", "No such file"),
])
def test_a_refused_report_is_one_log_line_and_the_last_try(server, change, why, caplog):
    env = server.env()
    token_file = env["KUBEFLOW_TRAINER_SERVER_TOKEN"]
    if change == "token":
        server.token = "rotated-away"
    elif change == "path":
        env[TRAINER_SERVER_URL] += "es"
    elif change == "ca":
        del env["KUBEFLOW_TRAINER_SERVER_CA_CERT"]
    else:
        os.remove(token_file)
    reporter = StatusReporter.from_env(3, env)
    with caplog.at_level(logging.INFO, logger="trainer"):
        for n in (1, 2, 3):
            reporter.epoch_done(HISTORY[:n])  # never raises
    assert len(server.requests) == (0 if change in ("ca", "token-file") else 1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert why in line and "not reporting again" in line


def test_no_endpoint_is_no_report_and_one_line_only_inside_a_pod(caplog):
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert StatusReporter.from_env(3, {}) is None
        # the names of the KEP-2779 draft were never released: they are not read
        assert StatusReporter.from_env(3, {"KUBEFLOW_TRAINER_STATUS_URL": "https://x/"}) is None
        assert caplog.records == []
        assert StatusReporter.from_env(3, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "TrainJobStatus feature gate" in line and TRAINER_SERVER_URL in line


def test_an_unreachable_endpoint_never_fails_training(caplog):
    reporter = StatusReporter.from_env(4, {TRAINER_SERVER_URL: "https://127.0.0.1:9/status"})
    with caplog.at_level(logging.INFO, logger="trainer"):
        for n in (1, 2, 3, 4):
            reporter.epoch_done((HISTORY * 2)[:n])  # never raises
    first, last = [r.getMessage() for r in caplog.records]  # tried 3 times, then given up
    assert "trying again" in first and "not reporting again" in last and not reporter.enabled


def test_a_server_error_is_tried_again_at_the_next_epoch(server, caplog):
    server.outages = 1  # e.g. the API server behind the controller restarting
    reporter = StatusReporter.from_env(3, server.env())
    with caplog.at_level(logging.INFO, logger="trainer"):
        for n in (1, 2, 3):
            reporter.epoch_done(HISTORY[:n])
    assert [r[2] for r in server.requests] == [500, 200, 200] and reporter.enabled
    assert server.trainer_status["progressPercentage"] == 100
    (line,) = [r.getMessage() for r in caplog.records]
    assert "HTTP 500: Internal error" in line and "trying again" in line


def test_server_errors_in_a_row_end_reporting(server, caplog):
    server.outages = 3
    reporter = StatusReporter.from_env(3, server.env())
    with caplog.at_level(logging.INFO, logger="trainer"):
        for n in (1, 2, 3):
            reporter.epoch_done(HISTORY[:n])
    assert [r[2] for r in server.requests] == [500] * 3 and not reporter.enabled
    assert len(caplog.records) == 2 and "not reporting again" in caplog.records[1].getMessage()


@pytest.mark.slow
def test_kfvision_train_reports_every_epoch_to_the_status_server(tmp_path, micro_digits,
                                                                 resnet18_dir):
    """A real `kfvision train`, given only what the controller injects, against the stand-in
    whose token rotates after every report (on the micro digits: one report an epoch is what is
    checked, not what the model learns)."""
    server = StatusServer(tmp_path / "kubeflow-trainer", rotate=True)
    env = {**os.environ, **server.env(), "PYTHONPATH": str(REPO)}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "kfvision.pipelines.cli", "train",
             *train_argv(resnet18_dir, micro_digits, tmp_path / "out", epochs=3, image_size=32,
                         batch_size=16, lr=0.05, augment="none", print_freq=100)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.close()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "progress:" not in run.stderr  # nothing refused
    assert [r[2] for r in server.requests] == [200] * 3
    assert len(set(server.tokens_used)) == 3
    assert [s["progressPercentage"] for s in server.reports] == [33, 67, 100]
    final = json.loads((tmp_path / "out" / "metrics.json").read_text())["final"]
    metrics = {m["name"]: m["value"] for m in server.trainer_status["metrics"]}
    assert all(isinstance(v, str) for v in metrics.values())
    assert metrics["currentEpoch"] == "3" and metrics["totalEpochs"] == "3"
    assert float(metrics["val_top1"]) == pytest.approx(final["val_top1"], rel=1e-5)


# The local TrainJob runner with the TrainJobStatus gate on (the variables the controller
# injects, rank 0's report every epoch under a rotating token) is checked on the 2 x 2 TrainJob
# that tests/jobs/test_trainjob_local.py runs anyway, beside its figures against the PyTorchJob's.
