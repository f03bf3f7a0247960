"""Progress into a TrainJob's status.trainerStatus (trainer/trainjob_status.py).

The status endpoint of Kubeflow Trainer's control plane is stood in for by a small HTTP server in
this file that records what it is sent and answers with a chosen status; it is not the trainer's
endpoint (no TLS, no token review). The payload is checked against the TrainJob CRD's schema.
"""

import json
import logging
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, HTTPServer

import jsonschema
import pytest
import yaml
from conftest import SHARED_REFERENCE, train_argv

from trainer.trainjob_status import URL, StatusReporter, trainer_status

HISTORY = [{"epoch": e, "lr": 0.01, "train_loss": 2.0 / e, "train_top1": 0.3 * e,
            "val_loss": 1.5 / e, "val_top1": 0.25 * e, "val_top5": 0.9} for e in (1, 2, 3)]


class StatusEndpoint:
    """Records POSTs (path, Authorization, JSON body); answers `status`."""

    def __init__(self, status=200):
        self.requests, self.status = [], status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, self.headers.get("Authorization"), body))
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = (f"http://127.0.0.1:{self.server.server_port}/apis/trainer.kubeflow.org/"
                    "v1alpha1/namespaces/team-a/trainjobs/digits/status")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    ep = StatusEndpoint()
    yield ep
    ep.close()


def test_the_payload_is_what_the_trainjob_crd_declares():
    path = SHARED_REFERENCE / "trainer-v2" / "trainer.kubeflow.org_trainjobs.yaml"
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared/reference/trainer-v2/)")
    schema = yaml.safe_load(path.read_text())["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]["properties"]["status"]["properties"]["trainerStatus"]
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    status = trainer_status(HISTORY[:2], 5, 30.0, when)
    jsonschema.validate(status, schema)
    assert "lastUpdatedTime" in status  # the CRD's CEL rule: has(self.lastUpdatedTime)
    assert status["progressPercentage"] == 40 and status["estimatedRemainingSeconds"] == 90
    metrics = {m["name"]: m["value"] for m in status["metrics"]}
    assert metrics["currentEpoch"] == "2" and metrics["totalEpochs"] == "5"
    assert metrics["val_top1"] == "0.5" and status["lastUpdatedTime"] == "2026-01-02T03:04:05Z"


def test_each_epoch_is_posted_with_the_token(endpoint, tmp_path):
    (tmp_path / "token").write_text("s3cr3t\n")
    ticks = iter([10.0, 30.0, 50.0])  # epochs of 10 s, 20 s, 20 s
    reporter = StatusReporter.from_env(3, {URL: endpoint.url, "KUBEFLOW_TRAINER_STATUS_TOKEN":
                                           str(tmp_path / "token")})
    reporter.clock, reporter.last = lambda: next(ticks), (0.0, 0)
    for n in (1, 2, 3):
        reporter.epoch_done(HISTORY[:n])
    assert [r[0] for r in endpoint.requests] == [
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/digits/status"] * 3
    assert {r[1] for r in endpoint.requests} == {"Bearer s3cr3t"}
    statuses = [r[2]["trainerStatus"] for r in endpoint.requests]
    assert [s["progressPercentage"] for s in statuses] == [33, 67, 100]
    assert [s.get("estimatedRemainingSeconds") for s in statuses] == [20, 20, 0]


def test_a_resumed_runs_first_report_has_no_estimate(endpoint):
    reporter = StatusReporter.from_env(3, {URL: endpoint.url})
    reporter.epoch_done(HISTORY[:2])  # the history of the checkpoint, at once
    assert "estimatedRemainingSeconds" not in endpoint.requests[0][2]["trainerStatus"]


@pytest.mark.parametrize("status", [403, 404, 401, 500])
def test_a_refused_report_is_one_log_line_and_the_last_try(status, caplog):
    ep = StatusEndpoint(status)
    try:
        reporter = StatusReporter.from_env(3, {URL: ep.url})
        with caplog.at_level(logging.INFO, logger="trainer"):
            for n in (1, 2, 3):
                reporter.epoch_done(HISTORY[:n])  # never raises
    finally:
        ep.close()
    assert len(ep.requests) == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"HTTP {status}" in line and "not reporting again" in line


def test_no_endpoint_is_no_report_and_one_line_only_inside_a_pod(caplog):
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert StatusReporter.from_env(3, {}) is None
        assert caplog.records == []
        assert StatusReporter.from_env(3, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "TrainJobStatus feature gate" in line


def test_an_unreachable_endpoint_never_fails_training(caplog):
    reporter = StatusReporter.from_env(3, {URL: "http://127.0.0.1:9/status"})  # discard port
    with caplog.at_level(logging.INFO, logger="trainer"):
        reporter.epoch_done(HISTORY[:1])
        reporter.epoch_done(HISTORY[:2])
    assert len(caplog.records) == 1 and not reporter.enabled


@pytest.mark.slow
def test_training_reports_every_epoch_to_the_endpoint(endpoint, monkeypatch, tmp_path,
                                                      tiny_digits, resnet18_dir):
    from trainer.train import main

    monkeypatch.setenv(URL, endpoint.url)
    assert main(train_argv(resnet18_dir, tiny_digits, tmp_path / "out", epochs=2, image_size=32,
                           batch_size=16, lr=0.05, augment="none", print_freq=100)) == 0
    statuses = [r[2]["trainerStatus"] for r in endpoint.requests]
    assert [s["progressPercentage"] for s in statuses] == [50, 100]
    final = json.loads((tmp_path / "out" / "metrics.json").read_text())["final"]
    metrics = {m["name"]: m["value"] for m in statuses[-1]["metrics"]}
    assert metrics["currentEpoch"] == "2" and float(metrics["val_top1"]) == pytest.approx(
        final["val_top1"], rel=1e-5)
