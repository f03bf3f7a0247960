"""Training progress pushed into a Kubeflow TrainJob's `status.trainerStatus` (rank 0, per epoch).

With Kubeflow Trainer v2.2+ and its `TrainJobStatus` feature gate, the controller takes progress
reports from the TrainJob's own pods (upstream `docs/user-guides/trainjob-progress.md`, v2.3.0).
Its trainjobstatus plugin gives every trainer container `KUBEFLOW_TRAINER_SERVER_URL` (the job's
status endpoint, `https://kubeflow-trainer-controller-manager.kubeflow-system.svc:10443/apis/...`),
`KUBEFLOW_TRAINER_SERVER_CA_CERT` and `KUBEFLOW_TRAINER_SERVER_TOKEN` (files of a projected
volume: the endpoint's CA and a service-account token for a per-job audience, which the kubelet
rotates: it is read again for every report). A pod POSTs `{"trainerStatus": {...}}` there (the
names: trainer/upstream.py). Then

    kubectl get trainjob NAME -o jsonpath='{.status.trainerStatus}'

shows the progress percentage, the estimated remaining seconds and the last epoch's metrics.

Reporting never fails a run: without the variables (no gate, not a TrainJob) nothing is sent; a
refused report (HTTP 4xx such as 403 for a token it does not accept or 422 for a payload it
cannot take, an untrusted certificate, no token file) is logged once, with the server's reason,
and ends reporting for the run; a failed one (HTTP 5xx, no route, timeout: a controller being
restarted) is logged once and tried again at the next epoch, until MAX_FAILURES in a row end
reporting too. Only the standard library: the image needs nothing more.
"""

import http.client
import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from kfvision.trainer.upstream import (
    KUBERNETES_SERVICE_HOST,
    TRAINER_SERVER_CA_CERT,
    TRAINER_SERVER_TOKEN,
    TRAINER_SERVER_URL,
)

log = logging.getLogger("trainer")

METRICS = ("train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "lr")
TIMEOUT_S = 5.0  # a slow control plane may cost an epoch this much, at most MAX_FAILURES times
MAX_FAILURES = 3  # transient failures in a row before reporting stops for the run


def trainer_status(history: list, epochs: int, seconds_per_epoch: float | None,
                   now: datetime) -> dict:
    """The `trainerStatus` object (as the TrainJob CRD declares it) after the epochs in
    `history` of `epochs`; `seconds_per_epoch` None leaves the estimate out."""
    last, done = history[-1], len(history)
    status = {"progressPercentage": min(100, round(100 * done / epochs))}
    if seconds_per_epoch is not None:
        status["estimatedRemainingSeconds"] = max(0, round(seconds_per_epoch * (epochs - done)))
    status["metrics"] = [{"name": k, "value": f"{last[k]:.6g}"} for k in METRICS if k in last]
    status["metrics"] += [{"name": "currentEpoch", "value": str(last["epoch"])},
                          {"name": "totalEpochs", "value": str(epochs)}]
    status["lastUpdatedTime"] = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return status


class StatusReporter:
    """Rank 0's reports to the TrainJob; call `epoch_done(history)` after every epoch (or, for
    progress made elsewhere, `send(status)`: a user's script's, pipelines/script/reporter.py)."""

    def __init__(self, url: str, token_file: str | None, ca_file: str | None,
                 epochs: int | None, clock=time.monotonic):
        self.url, self.token_file, self.ca_file, self.epochs = url, token_file, ca_file, epochs
        self.clock, self.last = clock, (clock(), 0)  # (time, epochs done) of the last report
        self.enabled, self.failures = True, 0  # failures: transient ones in a row

    @classmethod
    def from_env(cls, epochs: int | None, environ=None) -> "StatusReporter | None":
        """A reporter when the control plane gave the variables (in `environ`, default the
        process's: the one place that reads them), else None (one log line when this runs in a
        pod, where a missing gate is worth knowing about)."""
        environ = os.environ if environ is None else environ
        if not environ.get(TRAINER_SERVER_URL):
            if environ.get(KUBERNETES_SERVICE_HOST):
                log.info("progress: not reported to the TrainJob (%s is not set: not a TrainJob, "
                         "or Kubeflow Trainer runs without the TrainJobStatus feature gate)",
                         TRAINER_SERVER_URL)
            return None
        return cls(environ[TRAINER_SERVER_URL], environ.get(TRAINER_SERVER_TOKEN) or None,
                   environ.get(TRAINER_SERVER_CA_CERT) or None, epochs)

    def epoch_done(self, history: list) -> None:
        """Report the run as of `history`; never raises."""
        if not self.enabled or not history:
            return
        now, (t_prev, n_prev) = self.clock(), self.last
        done = len(history)
        # a resumed run's first report has no epoch timed in this process: no estimate yet
        rate = (now - t_prev) / (done - n_prev) if done > n_prev and (n_prev or done == 1) \
            else None
        self.last = (now, done)
        self.send(trainer_status(history, self.epochs, rate, datetime.now(timezone.utc)))

    def send(self, status: dict) -> None:
        """Post one `trainerStatus` (as the CRD declares it); never raises."""
        if not self.enabled:
            return
        try:
            self._post({"trainerStatus": status})
        # URLError, HTTPError and ssl's errors are OSErrors; a garbled answer is HTTPException
        except (OSError, ValueError, http.client.HTTPException) as e:
            self._failed(e)
        else:
            self.failures = 0

    def _failed(self, e: Exception) -> None:
        why = _http_reason(e) if isinstance(e, urllib.error.HTTPError) else str(e)
        self.failures += 1
        if _transient(e) and self.failures < MAX_FAILURES:
            if self.failures == 1:
                log.info("progress: a report to the TrainJob status endpoint failed (%s); trying "
                         "again at the next report (training goes on)", why)
            return
        self.enabled = False
        log.info("progress: the TrainJob status endpoint %s a report (%s); not reporting again "
                 "in this run (training goes on)",
                 "failed" if _transient(e) else "refused", why)

    def _post(self, body: dict) -> None:
        headers = {"Content-Type": "application/json"}
        if self.token_file:  # the kubelet rotates it (1 h expiry): never cached
            token = Path(self.token_file).read_text(encoding="utf-8").strip()
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        context = (ssl.create_default_context(cafile=self.ca_file)
                   if self.url.startswith("https:") else None)
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as resp:
            resp.read()


def _transient(e: Exception) -> bool:
    """Worth trying again later: the server failed (5xx, 429), or could not be reached in time.
    Not: a refusal (other 4xx), a certificate not trusted, a missing token file, a bad answer."""
    if isinstance(e, urllib.error.HTTPError):
        return e.code >= 500 or e.code == 429
    if isinstance(e, urllib.error.URLError):
        return not isinstance(e.reason, ssl.SSLError)
    return isinstance(e, (TimeoutError, ConnectionError))


def _http_reason(e: urllib.error.HTTPError) -> str:
    """`HTTP 422: <message>`: the status server answers a refusal with a Kubernetes `Status`."""
    try:
        message = json.loads(e.read(4096) or b"{}").get("message")
    except (OSError, ValueError, AttributeError):
        message = None
    return f"HTTP {e.code}: {message}" if message else f"HTTP {e.code}"
