"""The error of a job that `run-local` ran and that failed: every replica brought to its end,
then the job's first failure named from the records of every launcher (trainer/failures.py)."""

import contextlib
import re
import signal
import time

from kfvision.pipelines.jobs import ranktag
from kfvision.pipelines.jobs.errors import JobFailedError
from kfvision.pipelines.jobs.procs import ReplicaProcess, stop_all
from kfvision.pipelines.jobs.signals import STOP
from kfvision.trainer.failures import first_failure, parse

_ERROR_LINE = re.compile(r"(\w*(Error|Exception)|error): ")
_SUMMARY = re.compile(r"\] (FAILED: |exiting with )")
SETTLE_S = 5.0  # how long the other replicas of a failed job may take to end by themselves
_TAIL = 2000  # lines of each replica's log read for its launcher's records


def failure(job_name: str, r: ReplicaProcess, code: int, why: str,
            replicas: list) -> JobFailedError:
    """The error of a job that failed as `r` exited with `code` (`why`: the policy's words),
    naming the job's first failure.

    First every replica is brought to its end. When `r`'s launcher recorded a failure
    (trainer/failures.py), the others get SETTLE_S to end by themselves: their ranks fail from
    the broken collective, and their launchers say when. What still runs then gets SIGTERM on
    its main process alone, as a deleted pod's container does, so that its launcher stops its
    own processes (and lists them as stopped) rather than see them killed under it; stop_all
    takes what is left. Then the records of every launcher are ordered, this attempt's only."""
    if first_failure(r.tail(_TAIL)) is not None:
        _wait_ended(replicas, SETTLE_S)
    for p in replicas:
        if p.proc is not None and p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)
    _wait_ended(replicas, SETTLE_S)
    stop_all(replicas)
    logs = {p.name: p.tail(_TAIL) for p in replicas}
    since = max((p.started_at for p in replicas if p.started_at is not None), default=None)
    verdict = first_failure((line for lines in logs.values() for line in lines), since)
    if verdict is None:
        return _failed(f"job {job_name} failed: {r.name} exited with code {code} ({why}).",
                       r, logs[r.name])
    first = next((p for p in replicas if any(
        (rec := parse(line)) is not None and rec == verdict.first for line in logs[p.name])), r)
    mine = ranktag.tag(verdict.first.node, verdict.first.rank)
    own = [line for line in logs[first.name] if line.startswith(mine)]
    return _failed(f"job {job_name} failed: {verdict.summary('the first failure of the job')}."
                   f"\n  {r.name} exited with code {code} ({why}).", first, logs[first.name],
                   own)


def _wait_ended(replicas: list, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(p.proc is not None and p.proc.poll() is None
                                         for p in replicas):
        STOP.sleep(0.1)


def _failed(head: str, r: ReplicaProcess, lines: list, own=()) -> JobFailedError:
    """JobFailedError: `head`, the cause (the last error line of the first rank's own lines
    `own`, else of `r`'s log), and the last lines of `r`'s log."""
    def errors(of):
        # torchrun ends a failed run with its own summary, and the launchers' summaries say
        # "(unexpected error: permanent)"
        return [line for line in of if _ERROR_LINE.search(line) and "ChildFailedError" not in
                line and not _SUMMARY.search(line) and parse(line) is None]

    found = errors(own) or errors(lines)
    cause = f"\n  cause: {found[-1].strip()}" if found else ""
    tail = "\n".join(f"    {line}" for line in lines[-15:])
    return JobFailedError(f"{head}{cause}\n  last lines of {r.log_path}:\n{tail}")
