"""A user's script's progress and metrics, reported from its pod with no change to the script:
node 0's boot hands every line rank 0 prints to a `Reporter` (pipelines/script/boot.py), which
reads its `name=value` pairs (pipelines/jobs/progress.py) and sends them

- into the TrainJob's `status.trainerStatus`, through the client the built-in trainer uses
  (trainer/trainjob_status.py: the status endpoint Kubeflow Trainer's TrainJobStatus feature gate
  gives the pod, a rotating token, failures logged once and never fatal), at most once every
  EVERY_S (the Kubeflow SDK's update_trainjob_status throttles to the same) and once at the end;
- into the script's MLflow run (the one node 0's boot opened, pipelines/script/track.py), each
  pair a point whose step is the line's `step`, else its `epoch`, else (no position, or one that
  came as a fraction: Trainer's epoch) the count of metric lines so far, so that the MLflow UI
  draws each name as a curve.

Lines are read by the relay thread and sent by a thread of its own, so that a slow status
endpoint or tracking server never holds the script's output up. `KFVISION_PROGRESS_REPORTS=off`
(render's --no-progress-reports) turns both off, for a script that reports itself.
"""

import math
import threading
import time

from kfvision.pipelines.jobs.progress import (
    POSITIONS,
    PROGRESS_REPORTS,
    REPORTS_OFF,
    TOTALS,
    Progress,
    rank0_text,
    totals_of,
)
from kfvision.pipelines.script import track
from kfvision.trainer.trainjob_status import StatusReporter

EVERY_S = 5.0  # between two reports (the Kubeflow SDK throttles its own to one per 5 s)


def _mlflow_name(name: str) -> bool:
    """Whether MLflow takes `name` (mlflow v3.17.2 mlflow/utils/validation.py
    validate_param_and_metric_name): Katib's names may hold `|`, MLflow's may not."""
    return "|" not in name


class Reporter:
    """Rank 0's printed progress into the TrainJob's status and the MLflow run (module
    docstring): `line(text)` for every line the pod prints, `close()` after the script."""

    def __init__(self, status: StatusReporter | None, tracker, totals: dict,
                 every_s: float = EVERY_S, clock=time.time):
        self.status, self.tracker, self.every_s, self.clock = status, tracker, every_s, clock
        self.progress = Progress(totals)
        self.points, self.changed = [], False  # MLflow points not sent; a status not sent
        self.count = 0  # metric lines so far: the step of a line without a position
        self.fractional = False  # whether a position came as a fraction
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self.thread.start()

    @classmethod
    def from_env(cls, environ, tracker, say) -> "Reporter | None":
        """A reporter for node 0's pod, or None when there is nowhere to report (no status
        endpoint, no MLflow run) or the job says KFVISION_PROGRESS_REPORTS=off."""
        if environ.get(PROGRESS_REPORTS) == REPORTS_OFF:
            say(f"progress: not reported by kfvision ({PROGRESS_REPORTS}={REPORTS_OFF}: the "
                "script reports its own)")
            return None
        track.route_logs(say)  # the status client's lines, as the boot's own
        status = StatusReporter.from_env(None, environ)
        if status is None and (tracker is None or tracker.off):
            return None
        return cls(status, tracker, totals_of(environ))

    def line(self, tagged: str) -> None:
        """One line of the pod's output, with its `[node/rank] ` prefix."""
        text = rank0_text(tagged)
        if text is None:
            return
        now = self.clock()
        with self.lock:
            pairs = self.progress.feed(text, now)
            if not pairs:
                return
            self.changed = True
            step = next((pairs[p] for p in POSITIONS if p in pairs and math.isfinite(pairs[p])),
                        None)
            # a fractional position (Trainer's `epoch`: 0.3333) is no step: the line's count,
            # from then on, keeps the points in order
            self.fractional = self.fractional or (step is not None and not step.is_integer())
            step = self.count if step is None or self.fractional else step
            self.count += 1
            self.points += [(n, v, int(step), int(now * 1000)) for n, v in pairs.items()
                            if n not in TOTALS and math.isfinite(v) and _mlflow_name(n)]

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            self.flush()

    def flush(self) -> None:
        """Send what came since the last report."""
        with self.lock:
            points, self.points = self.points, []
            status = self.progress.trainer_status(self.clock()) if self.changed else None
            self.changed = False
        if status is not None and self.status is not None:
            self.status.send(status)
        if points and self.tracker is not None:
            self.tracker.log_points(points)

    def close(self) -> None:
        """Stop the thread, then send the last of it."""
        self.stop.set()
        self.thread.join(timeout=2 * self.every_s)
        self.flush()
