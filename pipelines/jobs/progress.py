"""How far a job has come, from what rank 0 prints: its `name=value` lines (Katib's format) and
Hugging Face Trainer's log dicts and size lines (both read by pipelines/jobs/metriclines.py
progress_pairs) are its metrics; an `epoch` or `step` among them is its position; with the
position's total known, a percentage and the time left.

    epochs=10                      # a total, printed once (or render's --progress-total epochs=10)
    epoch=3 loss=0.412 acc=0.91    # after every epoch (or step=1200 ... every N steps)

A position counts what is done: `epoch=3` is three epochs done, unless the script counts from 0
(its first `epoch` is 0): then `epoch=0` is one done. The time left is the time per unit between
the first and the last position seen, times the units still to go, less the time since the last
line: it shows from the second position line on. `step` is preferred to `epoch` when its total is
known.

Who feeds it: node 0's boot in a pod (pipelines/script/reporter.py: the TrainJob's
status.trainerStatus and the MLflow run), `kfvision job run-local`'s record of a local run
(pipelines/jobs/localstatus.py) and `kfvision job status` of a PyTorchJob (its master's log). Pure:
no I/O, every time given (seconds since the epoch).
"""

import math
import re
from datetime import datetime, timezone

from kfvision.pipelines.jobs import ranktag
from kfvision.pipelines.jobs.metriclines import parse_metrics, progress_pairs
from kfvision.trainer.errors import InvalidParameterError

# Ours, set in the training container by render (--progress-total, --no-progress-reports) and read
# by the boot, run-local and `job status`: the totals as `name=value` pairs, and "off" for a script
# that reports its progress itself (the Kubeflow SDK's update_trainjob_status, its own MLflow
# metrics), so that nothing is reported twice.
PROGRESS_TOTAL = "KFVISION_PROGRESS_TOTAL"
PROGRESS_REPORTS = "KFVISION_PROGRESS_REPORTS"
REPORTS_OFF = "off"
# a position -> the names of its total as scripts print them (Lightning's max_epochs and
# max_steps, Hugging Face's num_train_epochs, ...), the preferred position first
POSITIONS = {"step": ("total_steps", "max_steps", "num_steps", "num_training_steps"),
             "epoch": ("epochs", "num_epochs", "max_epochs", "total_epochs", "num_train_epochs")}
TOTALS = {name: pos for pos, names in POSITIONS.items() for name in names}
# status.trainerStatus of the TrainJob CRD (Kubeflow Trainer v2.3.0, trainjob_types.go Metric):
# at most 256 metrics, names and values of 1 to 64 characters
MAX_METRICS, MAX_TEXT = 256, 64
# what the built-in trainer's reports call the position and total (trainer/trainjob_status.py)
BUILT_IN = {"currentEpoch": "epoch", "totalEpochs": "epochs"}
_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?")


def check_totals(pairs: dict) -> dict:
    """`pairs` ({total name: value}) checked: known names, positive values.

    Raises:
        InvalidParameterError: a name that is no total, or a value that is not above 0.
    """
    for name, value in pairs.items():
        if name not in TOTALS:
            raise InvalidParameterError(f"--progress-total {name}: not a total kfvision reads; "
                                        f"use one of {', '.join(TOTALS)}.")
        if not (math.isfinite(value) and value > 0):
            raise InvalidParameterError(f"--progress-total {name}={value:g}: give a number "
                                        "above 0.")
    return pairs


def totals_of(environ) -> dict:
    """{total name: value} of PROGRESS_TOTAL in `environ` (names that are no total left out)."""
    pairs = parse_metrics(environ.get(PROGRESS_TOTAL) or "")
    return {n: v for n, v in pairs.items() if n in TOTALS and v > 0}


def rank0_text(line: str) -> str | None:
    """What rank 0 printed in a line of rank 0's pod (its `[0/0] ` prefix taken off; an untagged
    line is the pod's own program's, the built-in trainer's), or None for another rank's or the
    pod's own lines (`[0/-] `)."""
    tagged = ranktag.TAGGED.match(line)
    if tagged is None:
        return line
    return line[tagged.end():] if tagged.group(0) == ranktag.tag(0, 0) else None


def _number(value: float):
    return int(value) if float(value).is_integer() else value


def _text(value: float) -> str:
    return f"{value:.6g}"


class Progress:
    """The metrics and position of one run, fed line by line (`feed`), read with `snapshot`."""

    def __init__(self, totals: dict | None = None):
        self.given = dict(totals or {})  # render's: they win over printed ones
        self.printed, self.metrics = {}, {}  # totals printed; {name: last value}
        self.first, self.last = {}, {}  # position -> (when, value) of its first and last line
        self.zero = {}  # position -> whether the script counts it from 0
        self.updated, self.lines = None, 0  # when the last metric line came; how many came

    def feed(self, text: str, when: float) -> dict:
        """Read one line rank 0 printed at `when`; its pairs ({} when it has none). Of a line
        that a progress bar redraws (`\\r`), the last state."""
        pairs = progress_pairs(text.rsplit("\r", 1)[-1])
        if not pairs:
            return {}
        self.lines, self.updated = self.lines + 1, when
        for name, value in pairs.items():
            if name in TOTALS:
                self.printed[name] = value
                continue
            self.metrics[name] = value
            if name in POSITIONS and math.isfinite(value):
                first = self.first.get(name)
                if first is None or value < self.last[name][1]:  # a run that started over
                    self.first[name] = (when, value)  # (one from 0 still counts from 0)
                    self.zero[name] = self.zero.get(name, False) or value == 0
                self.last[name] = (when, value)
        return pairs

    def done(self, position: str) -> float | None:
        """Units of `position` done, or None when it was never printed."""
        if position not in self.last:
            return None
        return self.last[position][1] + (1 if self.zero[position] else 0)

    def total(self, position: str) -> float | None:
        """The total of `position`: render's, else the last one printed, else None."""
        for source in (self.given, self.printed):
            found = [source[n] for n in POSITIONS[position] if n in source]
            if found:
                return found[0]
        return None

    def position(self) -> str | None:
        """The position the percentage is of: the first of POSITIONS printed with a known
        total, else the first printed, else None."""
        seen = [p for p in POSITIONS if p in self.last]
        with_total = [p for p in seen if self.total(p)]
        return (with_total or seen or [None])[0]

    def remaining_s(self, position: str, now: float) -> float | None:
        """Seconds left at `now`, from the pace between the first and last line of `position`."""
        total, done = self.total(position), self.done(position)
        if total is None or done is None:
            return None
        if done >= total:
            return 0.0
        (t0, v0), (t1, v1) = self.first[position], self.last[position]
        if v1 <= v0:
            return None
        per_unit = (t1 - t0) / (v1 - v0)
        return max(0.0, per_unit * (total - done) - max(0.0, now - t1))

    def snapshot(self, now: float) -> dict:
        """What `kfvision job status` shows (JSON): `metrics` {name: value}, `updated` (when the
        last metric line came), and with a position `position`, `value`, `done`, `total`,
        `percent` and `eta_s` (each None while unknown)."""
        out = {"metrics": {n: _number(v) for n, v in self.metrics.items() if math.isfinite(v)},
               "updated": self.updated, "lines": self.lines}
        position = self.position()
        if position is not None:
            total, done = self.total(position), self.done(position)
            out.update(position=position, value=_number(self.last[position][1]),
                       done=_number(done), total=None if total is None else _number(total),
                       percent=None if not total else min(100, math.floor(100 * done / total)),
                       eta_s=self.remaining_s(position, now))
        return out

    def trainer_status(self, now: float) -> dict:
        """The TrainJob's `trainerStatus` (as the CRD declares it) of the run so far."""
        snap = self.snapshot(now)
        status = {}
        if snap.get("percent") is not None:
            status["progressPercentage"] = snap["percent"]
        if snap.get("eta_s") is not None:
            status["estimatedRemainingSeconds"] = round(snap["eta_s"])
        values = {**self.metrics, **self.printed, **self.given}
        status["metrics"] = [{"name": n, "value": _text(v)} for n, v in values.items()
                             if len(n) <= MAX_TEXT and math.isfinite(v)][:MAX_METRICS]
        status["lastUpdatedTime"] = datetime.fromtimestamp(now, timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        return status


def rfc3339(text: str) -> float | None:
    """Seconds since the epoch of an RFC 3339 time (the kubelet's log stamps, lastUpdatedTime)."""
    m = _RFC3339.fullmatch(text.strip())
    if m is None:
        return None
    whole, fraction, zone = m.groups()
    try:  # Python 3.10's fromisoformat takes neither `Z` nor the kubelet's nanoseconds
        when = datetime.fromisoformat(whole + ("" if zone in (None, "Z") else zone))
    except ValueError:
        return None
    when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    return when.timestamp() + float(fraction or 0)


def from_trainer_status(status: dict, now: float) -> dict:
    """A TrainJob's status.trainerStatus (reported by kfvision, the built-in trainer or the
    script itself) in `snapshot`'s shape."""
    metrics = {}
    for m in status.get("metrics") or []:
        name = BUILT_IN.get(m.get("name"), m.get("name"))
        value = parse_metrics(f"x={m.get('value')}").get("x")
        metrics[name] = m.get("value") if value is None else _number(value)
    updated = rfc3339(status.get("lastUpdatedTime") or "")
    out = {"metrics": {n: v for n, v in metrics.items() if n not in TOTALS},
           "updated": updated, "percent": status.get("progressPercentage")}
    eta = status.get("estimatedRemainingSeconds")
    out["eta_s"] = None if eta is None else max(0.0, eta - max(0.0, now - (updated or now)))
    position = next((p for p in POSITIONS if p in metrics), None)
    if position is not None:
        total = next((metrics[n] for n in POSITIONS[position] if n in metrics), None)
        out.update(position=position, value=metrics[position], total=total)
    return out
