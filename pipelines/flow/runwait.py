"""`kfvision pipeline submit --wait`: follow a run on a KFP endpoint until it ends, saying each
state it passes through, as `job submit --wait` follows a job.

The states are KFP v2's (`V2beta1RuntimeState`): PENDING, RUNNING, CANCELING, PAUSED go on;
SUCCEEDED ends it well (exit 0); FAILED, CANCELED, SKIPPED end it badly (PipelineRunFailedError,
exit 1, with the run's error message); after --timeout the run goes on and the wait ends with
exit 124 (WaitTimeoutError), as every other wait of kfvision. kfp.Client's own
wait_for_run_completion is not used: it says nothing while it waits and raises a bare
TimeoutError.
"""

import time

from kfvision.pipelines.clients.k8s import WaitTimeoutError
from kfvision.trainer.errors import KfvisionError

SUCCEEDED = "SUCCEEDED"
ENDED_BADLY = ("FAILED", "CANCELED", "SKIPPED")


class PipelineRunFailedError(KfvisionError):
    """The pipeline run ended, but not well (failed, canceled, skipped)."""

    exit_code = 1


def wait_run(client, run_id: str, url: str, *, timeout_s: float | None, poll_s: float,
             say=print, clock=time.monotonic, sleep=time.sleep):
    """Poll `client.get_run(run_id)` (a kfp.Client) every `poll_s` s until the run has ended;
    the run once it succeeded. `url`: the run's page, for the messages."""
    start, last = clock(), None
    while True:
        run = client.get_run(run_id)
        state = str(run.state or "PENDING").upper()
        if state != last:
            say(f"run {run_id}: {state}")
            last = state
        if state == SUCCEEDED:
            return run
        if state in ENDED_BADLY:
            error = getattr(run, "error", None)
            why = getattr(error, "message", None) or (str(error) if error else "")
            raise PipelineRunFailedError(f"run {run_id} ended {state}"
                                         + (f": {why}" if why else "")
                                         + f"; its steps and logs: {url}")
        if timeout_s is not None and clock() - start >= timeout_s:
            raise WaitTimeoutError(f"run {run_id} is still {state} after {timeout_s:g} s; it "
                                   f"goes on (see {url}).")
        sleep(poll_s)
