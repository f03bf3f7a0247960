"""MLflow for a user's script: node 0's boot opens the run before the script starts, so that
`MLFLOW_RUN_ID` reaches the script and `mlflow.autolog()` or `mlflow.log_metric` lands in it.

Why the boot, and not `kfvision job render`: the boot runs the same way in a pod and under
`job run-local`, so both create the run at the same moment (when the job starts, not when its
YAML was written, which may be applied twice or never); it talks to the tracking server from
where the job runs (the address the pods are given), and a restarted pod finds the run id it
kept in the state folder (on the PVC when there is one) and continues the same run, as the
built-in trainer continues its checkpoint's run. Tracking is on when the pod has
MLFLOW_TRACKING_URI (render's `--tracking-uri`, or the variable when rendering, or `--env`);
a run Kubeflow Pipelines gave (MLFLOW_RUN_ID) is used as it is.

Logged: the script's entry, arguments and launcher (parameters `kfvision.entry`,
`kfvision.script_args`, `kfvision.launcher`), the snapshot's sha256 (tag
`kfvision.source_sha256`) and the job's kind and name (tags); after success the outputs and
model folders as artifacts (`outputs/`, `model/`). Only node 0's processes get MLFLOW_RUN_ID:
log from rank 0, as DDP scripts do.

A tracking server that does not answer is one warning line, never a failed job: the script then
gets a local store in its outputs folder (`outputs/mlruns`, uploaded with the outputs), so its
own MLflow calls do not fail either.
"""

import logging
import shlex
from pathlib import Path

from kfvision.trainer import tracking, upstream

RUN_ID_FILE = "mlflow_run_id"  # in the state folder: a restarted pod continues the run
LOCAL_STORE = "mlruns"  # under the outputs folder, when the server does not answer


class _Say(logging.Handler):
    def __init__(self, say):
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record):
        self.say(record.getMessage())


def route_logs(say) -> None:
    """The trainer's log lines (MLflow's and the TrainJob status client's warnings, which the
    boot uses) through `say`, as the boot's own lines."""
    log = logging.getLogger(tracking.log.name)
    if not any(isinstance(h, _Say) for h in log.handlers):
        log.addHandler(_Say(say))
        log.setLevel(logging.INFO)
        log.propagate = False


def open_run(environ, *, sha256: str, target: str, args: list, launcher: str, state: Path,
             say) -> "tracking.Tracker | None":
    """The script's MLflow run, opened (None without MLFLOW_TRACKING_URI in `environ`). A
    failure leaves the tracker `off` after one warning line through `say`."""
    tracker = tracking.Tracker.from_env(None, environ)
    if tracker is None:
        return None
    route_logs(say)
    tracker.tags["kfvision.source_sha256"] = sha256
    tracker.goes_on = (f"The script runs on; its own MLflow calls go to outputs/{LOCAL_STORE} "
                       "(uploaded with the outputs).")
    saved = state / RUN_ID_FILE
    kept = saved.read_text().strip() if saved.is_file() else None
    params = {"kfvision.entry": target, "kfvision.script_args": shlex.join(args),
              "kfvision.launcher": launcher}
    run_id = tracker.start(params, saved_run_id=kept)
    if run_id:
        state.mkdir(parents=True, exist_ok=True)
        saved.write_text(run_id + "\n")
    return tracker


def script_env(tracker, env: dict, outputs: Path) -> None:
    """Set the script's MLflow variables in `env`: the run's id, or the local store when the
    server did not answer."""
    if tracker is None:
        return
    if tracker.off:
        env[upstream.MLFLOW_TRACKING_URI] = (Path(outputs) / LOCAL_STORE).resolve().as_uri()
        env[upstream.MLFLOW_ALLOW_FILE_STORE] = "true"
        env.pop(upstream.MLFLOW_RUN_ID, None)
        env.pop(upstream.MLFLOW_EXPERIMENT_ID, None)
    else:
        env[upstream.MLFLOW_RUN_ID] = tracker.run_id


def close_run(tracker, ok: bool, folders: dict) -> None:
    """After the script: on success upload `folders` ({artifact path: folder}); close the run
    kfvision opened, FINISHED or FAILED."""
    if tracker is None:
        return
    if ok:
        tracker.log_folders(folders)
    tracker.finish(ok)
