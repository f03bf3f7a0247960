"""Named errors of the job commands (a refused or failed API call: pipelines/clients/k8s.py). Each
message says what went wrong, where, and what to do.

Exit codes stay in 1-127 so that a PyTorchJob with `restartPolicy: ExitCode` treats them as
permanent failures (see ../shared/reference/README.md), like the trainer's own errors.
"""

from kfvision.pipelines.clients.k8s import WaitTimeoutError
from kfvision.trainer.errors import InvalidParameterError, KfvisionError


class InvalidJobError(InvalidParameterError):
    """A job configuration or PyTorchJob manifest breaks a rule of the CRD or its webhook."""


class JobFailedError(KfvisionError):
    """The job ran and failed (a replica failed past its restart policy, or a deadline passed)."""

    exit_code = 1


class JobTimeoutError(WaitTimeoutError):
    """Waiting for the job took longer than the caller allowed."""


class JobOutputsError(KfvisionError):
    """A job's outputs cannot be fetched: no such job or file, or the job has not succeeded."""
