"""What every step shares: ending on a named error instead of a traceback, where it runs
(local or cluster), and the key its job name derives from."""


from pipelines.params import (
    EXECUTION_MODES,
    parameter_name,
)
from trainer.errors import InvalidParameterError, check_choice, ref


def run(step, *args, **kwargs):
    """Call `step`; a kfvision error ends the process with one line saying what to fix (and the
    error's exit code) instead of a traceback, in the step's log and the pipeline's. Options
    are named as the pipeline's parameters."""
    import sys

    from trainer.errors import KfvisionError
    from trainer.exitcodes import error_line

    try:
        return step(*args, **kwargs)
    except KfvisionError as e:
        text = e.named(parameter_name) if isinstance(e, InvalidParameterError) else str(e)
        print(error_line(e, text), file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def resolve_mode(mode: str, environ=None) -> str:
    """'local' or 'cluster'. auto: cluster inside a Kubernetes pod (the KFP backend runs every
    step in one, and Kubernetes sets KUBERNETES_SERVICE_HOST in each), local anywhere else."""
    import os

    check_choice(ref("execution_mode"), mode, EXECUTION_MODES)
    if mode != "auto":
        return mode
    env = os.environ if environ is None else environ
    return "cluster" if env.get("KUBERNETES_SERVICE_HOST") else "local"


def unique_run_key(run_id: str, task_name: str) -> str:
    """What the PyTorchJob's name is derived from: stable across retries of one task of one run,
    different for two runs (or two train tasks of one run)."""
    return f"{run_id}/{task_name}"
