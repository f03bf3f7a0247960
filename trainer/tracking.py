"""Run tracking in MLflow: rank 0 logs the run when a tracking server is given; the one module of
kfvision that talks to MLflow's tracking API (pipelines/clients/registry.py, the model registries'
client,
classifies MLflow's failures through `failure` here).

    kfvision train ... --tracking-uri http://127.0.0.1:5000 [--experiment NAME]
    MLFLOW_TRACKING_URI=http://mlflow:5000 torchrun ... -m kfvision.trainer.train ...   # the same

What is logged: the resolved configuration as parameters; every epoch's history record (train and
validation loss, top-1, validation top-5, learning rate, images/s) as metrics with step = epoch;
tags for the world size, device, precision and, where the pipeline's train step says so, the job
kind and name and the pipeline run; at the end `metrics.json`, `config.yaml` and the trained model
directory as artifacts (`model/`).

Which run: `MLFLOW_RUN_ID` (Kubeflow Pipelines 2.17 gives every task a nested run and the train
step forwards it into the job's pods), else the run id kept in the newest checkpoint (a resumed
run continues the same run), else a new run in the experiment of `MLFLOW_EXPERIMENT_ID`, or
`--experiment`, or `MLFLOW_EXPERIMENT_NAME`, or `kfvision`. No epoch is logged twice: on start
the run's logged epochs are read back, and only later ones are sent (a resumed run reports its
checkpoint's history again).

Tracking never fails training: the first failure (nothing answers, TLS, refused credentials, a
server error) is reported as one warning line that names it, and tracking stays off for the rest
of the run; `metrics.json` is the record of truth. `mlflow` (the `mlflow-skinny` client is enough)
is imported only here and only when tracking is on.
"""

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from kfvision.trainer import upstream

log = logging.getLogger("trainer")

DEFAULT_EXPERIMENT = "kfvision"
RUN_ID_KEY = "mlflow_run_id"  # the checkpoint field that keeps the run id
ARTIFACTS = ("metrics.json", "config.yaml")
SKIP_IN_MODEL = ("checkpoints",)  # never uploaded as part of the model directory
# history record key -> MLflow metric name (one name per curve in the MLflow UI)
METRICS = {"train_loss": "train_loss", "train_top1": "train_top1", "val_loss": "val_loss",
           "val_top1": "val_top1", "val_top5": "val_top5", "lr": "lr",
           "train_images_per_sec": "train_images_per_sec"}
# mlflow v3.17.2 mlflow/utils/validation.py MAX_METRICS_PER_BATCH: the most one log_batch takes
BATCH = 1000
# our own variables the pipeline's train step sets in the job's pods (tags of the run)
JOB_NAME = "KFVISION_JOB_NAME"  # also set by every script job (pipelines/script/job.py)
JOB_TAGS = {"KFVISION_JOB_KIND": "kfvision.job_kind", JOB_NAME: "kfvision.job_name",
            "KFVISION_PIPELINE_RUN": "kfvision.pipeline_run"}
# the client's retries and timeout here (see trainer/upstream.py): seconds against a dead server
HTTP_DEFAULTS = {upstream.MLFLOW_HTTP_REQUEST_MAX_RETRIES: "2",
                 upstream.MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR: "1",
                 upstream.MLFLOW_HTTP_REQUEST_TIMEOUT: "15"}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def failure(exc: BaseException) -> str:
    """What kind of failure an MLflow call raised: "unreachable" (nothing answered, or not in
    time: retrying may help), "tls" (the TLS handshake), "auth" (credentials refused), "missing"
    (no such run, experiment or model) or "refused" (the server answered with another error)."""
    for e in _chain(exc):
        name = type(e).__name__
        if "SSLError" in name or "CertificateError" in name:
            return "tls"
        if name in ("ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout",
                    "MaxRetryError", "NewConnectionError", "ConnectionRefusedError"):
            return "unreachable"
        code = getattr(e, "error_code", None)
        if code in ("UNAUTHENTICATED", "PERMISSION_DENIED", "CUSTOMER_UNAUTHORIZED"):
            return "auth"
        if code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
            return "missing"
    text = str(exc)
    if "SSL" in text or "CERTIFICATE" in text:
        return "tls"
    if "Max retries exceeded" in text or "Connection refused" in text or "timeout" in text:
        return "unreachable"
    return "refused"


WHAT_TO_CHECK = {
    "unreachable": "nothing answered: check the URI and that the server runs",
    "tls": "the TLS handshake failed: check the certificate (MLFLOW_TRACKING_SERVER_CERT_PATH)",
    "auth": "the server refused the credentials: check MLFLOW_TRACKING_TOKEN or "
            "MLFLOW_TRACKING_USERNAME/PASSWORD (or MLFLOW_TRACKING_AUTH)",
    "missing": "the run or experiment does not exist there",
    "refused": "the server answered with an error",
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


@dataclass
class Tracker:
    """Rank 0's MLflow run. Build it with `from_env` (None when tracking is off); every method
    swallows MLflow's failures after reporting the first one (then `off` is True).

    Args:
        uri: the tracking server (or a local store such as sqlite:///path/mlflow.db).
        run_id: the run to log into (MLFLOW_RUN_ID), or None.
        experiment_id, experiment: where a new run goes (id first, then the name).
        tags: our tags of the run (world size, device, job ...).
    """

    uri: str
    run_id: str | None = None
    experiment_id: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    tags: dict = field(default_factory=dict)
    off: bool = False
    created: bool = False  # we made the run, so we close it
    logged_epochs: int = 0  # the last epoch the run holds
    goes_on: str = "Training goes on without tracking; metrics.json keeps every epoch."
    _client: object = None

    @classmethod
    def from_env(cls, cfg, environ=None) -> "Tracker | None":
        """The tracker of a run with `cfg` (TrainConfig; None: from the environment alone), or
        None without a tracking URI (neither --tracking-uri nor MLFLOW_TRACKING_URI): then
        mlflow is never imported."""
        env = os.environ if environ is None else environ
        uri = (cfg and cfg.tracking_uri) or env.get(upstream.MLFLOW_TRACKING_URI)
        if not uri:
            return None
        experiment = ((cfg and cfg.experiment) or env.get(upstream.MLFLOW_EXPERIMENT_NAME)
                      or DEFAULT_EXPERIMENT)
        tags = {tag: env[var] for var, tag in JOB_TAGS.items() if env.get(var)}
        return cls(uri=uri, run_id=env.get(upstream.MLFLOW_RUN_ID) or None,
                   experiment_id=env.get(upstream.MLFLOW_EXPERIMENT_ID) or None,
                   experiment=experiment, tags=tags)

    def _failed(self, doing: str, exc: Exception) -> None:
        kind = failure(exc)
        log.warning("WARNING: MLflowTrackingError: %s at %s failed (%s: %s; %s). %s", doing,
                    self.uri, kind, _first_line(exc), WHAT_TO_CHECK[kind], self.goes_on)
        self.off = True

    def _guard(self, doing: str, fn):
        if self.off:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - tracking must never fail training; reported once
            self._failed(doing, e)
            return None

    def start(self, params: dict, saved_run_id: str | None = None) -> str | None:
        """Open the run (MLFLOW_RUN_ID, else `saved_run_id` from the checkpoint, else a new one),
        log `params` not yet in it, and read back its last logged epoch. Returns the run id."""
        return self._guard("starting the run", lambda: self._start(params, saved_run_id))

    def _connect(self):
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)  # read by the client at each request
        from mlflow.tracking import MlflowClient  # only here: commands without tracking skip it

        self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def _start(self, params: dict, saved_run_id: str | None) -> str:
        client = self._connect()
        if self.run_id is None and saved_run_id:
            try:
                client.update_run(saved_run_id, status="RUNNING")
                self.run_id, self.created = saved_run_id, True
            except Exception as e:  # noqa: BLE001 - classified: only "missing" is handled here
                if failure(e) != "missing":
                    raise
                log.info("MLflow: the checkpoint's run %s is not at %s; starting a new run",
                         saved_run_id, self.uri)
        if self.run_id is None:
            exp = self.experiment_id or self._experiment_id(client)
            run = client.create_run(exp, run_name=self.tags.get("kfvision.job_name"))
            self.run_id, self.created = run.info.run_id, True
        run = client.get_run(self.run_id)
        have = run.data.params
        new = {k: _param(v) for k, v in params.items() if k not in have}
        changed = sorted(k for k, v in params.items() if k in have and have[k] != _param(v))
        if changed:  # MLflow's parameters cannot change; a resumed run may move paths
            log.info("MLflow run %s keeps its first values of %s", self.run_id, ", ".join(changed))
        from mlflow.entities import Param, RunTag

        client.log_batch(self.run_id, params=[Param(k, v) for k, v in new.items()],
                         tags=[RunTag(k, str(v)) for k, v in self.tags.items()])
        steps = [m.step for m in client.get_metric_history(self.run_id, "val_loss")]
        self.logged_epochs = max(steps, default=0)
        log.info("MLflow: logging to run %s at %s%s", self.run_id, self.uri,
                 f" (epochs 1-{self.logged_epochs} already there)" if self.logged_epochs else "")
        return self.run_id

    def _experiment_id(self, client) -> str:
        found = client.get_experiment_by_name(self.experiment)
        return found.experiment_id if found else client.create_experiment(self.experiment)

    def log_epochs(self, history: list) -> None:
        """Log the records of `history` after the last epoch the run holds, one batch each."""
        for record in history:
            if record["epoch"] > self.logged_epochs:
                if self._guard(f"logging epoch {record['epoch']}",
                               lambda r=record: self._log_epoch(r)) is None:
                    return
                self.logged_epochs = record["epoch"]

    def _log_epoch(self, record: dict) -> bool:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, float(record[key]), now, record["epoch"])
                   for key, name in METRICS.items() if key in record]
        self._client.log_batch(self.run_id, metrics=metrics)
        return True

    def log_points(self, points: list) -> bool:
        """Log metric points (name, value, step, time in ms), in batches of MLflow's limit
        (a user's script's printed metrics: pipelines/script/reporter.py). Whether they went."""
        def send():
            from mlflow.entities import Metric

            for i in range(0, len(points), BATCH):
                self._client.log_batch(self.run_id, metrics=[
                    Metric(n, float(v), int(ms), int(step))
                    for n, v, step, ms in points[i:i + BATCH]])
            return True
        return bool(points) and self._guard("logging the script's metrics", send) is not None

    def set_tags(self, tags: dict) -> bool:
        """Set tags of the run (MLFLOW_RUN_ID's; a user's script's Azure `run.tag`); whether
        they went."""
        def send():
            from mlflow.entities import RunTag

            client = self._client or self._connect()
            client.log_batch(self.run_id, tags=[RunTag(str(k), _param(v))
                                                for k, v in tags.items()])
            return True
        return bool(tags) and self.run_id is not None and \
            self._guard("setting the script's tags", send) is not None

    def log_model(self, out: Path) -> None:
        """Upload `metrics.json`, `config.yaml` and the model directory (`model/`)."""
        def upload():
            for name in ARTIFACTS:
                if (out / name).exists():
                    self._client.log_artifact(self.run_id, str(out / name))
            for p in sorted(out.iterdir()):
                if p.name in SKIP_IN_MODEL:
                    continue
                if p.is_dir():
                    self._client.log_artifacts(self.run_id, str(p), f"model/{p.name}")
                else:
                    self._client.log_artifact(self.run_id, str(p), "model")
        self._guard("uploading the model", upload)

    def log_folders(self, folders: dict) -> None:
        """Upload each {artifact path: folder} that holds files (a user's script's outputs)."""
        def upload():
            for path, folder in folders.items():
                if any(Path(folder).iterdir()):
                    self._client.log_artifacts(self.run_id, str(folder), path)
        self._guard("uploading the outputs", upload)

    def finish(self, ok: bool) -> None:
        """Close a run this tracker opened (KFP closes its own nested runs)."""
        if self.created:
            self._guard("closing the run", lambda: self._client.set_terminated(
                self.run_id, status="FINISHED" if ok else "FAILED"))


EVALUATION = ("report.md", "metrics.json", "confusion_matrix.png")  # `kfvision evaluate` wrote


def log_evaluation(out_dir, metrics: dict, *, tracking_uri: str | None = None,
                   run_id: str | None = None, experiment: str | None = None,
                   environ=None) -> str | None:
    """Log what `kfvision evaluate` wrote into `out_dir` into a run: its scalar metrics
    (`eval_accuracy`, `eval_top5_accuracy`, `eval_macro_f1`, ...) and report.md, metrics.json
    and confusion_matrix.png as artifacts under `evaluation/`. The run: `run_id`, else
    MLFLOW_RUN_ID, else a new one in the experiment. Nothing without a tracking URI (argument
    or MLFLOW_TRACKING_URI). Never raises for MLflow: one warning line names the failure.
    Returns the run id logged into, or None."""
    env = os.environ if environ is None else environ
    uri = tracking_uri or env.get(upstream.MLFLOW_TRACKING_URI)
    if not uri:
        return None
    tracker = Tracker(uri=uri, run_id=run_id or env.get(upstream.MLFLOW_RUN_ID) or None,
                      experiment_id=env.get(upstream.MLFLOW_EXPERIMENT_ID) or None,
                      experiment=(experiment or env.get(upstream.MLFLOW_EXPERIMENT_NAME)
                                  or DEFAULT_EXPERIMENT),
                      goes_on="The evaluation is written; it is not in MLflow.")
    scalars = {f"eval_{k}": float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for avg in ("macro_avg", "weighted_avg"):
        scalars.update({f"eval_{avg.split('_')[0]}_{k}": float(v)
                        for k, v in (metrics.get(avg) or {}).items() if k != "support"})

    def log():
        client = tracker._connect()
        if tracker.run_id is None:
            run = client.create_run(tracker.experiment_id or tracker._experiment_id(client),
                                    run_name="evaluate")
            tracker.run_id, tracker.created = run.info.run_id, True
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        client.log_batch(tracker.run_id, metrics=[Metric(k, v, now, 0)
                                                  for k, v in sorted(scalars.items())])
        for name in EVALUATION:
            if (Path(out_dir) / name).exists():
                client.log_artifact(tracker.run_id, str(Path(out_dir) / name), "evaluation")
        return tracker.run_id

    got = tracker._guard("logging the evaluation", log)
    tracker.finish(got is not None)
    return got


def _param(value) -> str:
    return "" if value is None else str(value)[:6000]  # MLflow's limit on a value's length
