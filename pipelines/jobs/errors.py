"""Named errors of the job commands. Each message says what went wrong, where, and what to do.

Exit codes stay in 1-127 so that a PyTorchJob with `restartPolicy: ExitCode` treats them as
permanent failures (see ../shared/reference/README.md), like the trainer's own errors.
"""

from trainer.errors import InvalidParameterError, KfvisionError


class InvalidJobError(InvalidParameterError):
    """A job configuration or PyTorchJob manifest breaks a rule of the CRD or its webhook."""


class JobFailedError(KfvisionError):
    """The job ran and failed (a replica failed past its restart policy, or a deadline passed)."""

    exit_code = 1


class JobTimeoutError(KfvisionError):
    """Waiting for the job took longer than the caller allowed."""

    exit_code = 124  # what timeout(1) returns


class KubernetesError(KfvisionError):
    """The Kubernetes API refused or failed a request; names kind/namespace/name. `status`: the
    HTTP status when the API server answered (404: no such object), else None."""

    exit_code = 4

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
