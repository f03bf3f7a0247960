"""What every step shares: ending on a named error instead of a traceback, where it runs
(local or cluster), the key its job name derives from, and the accuracy gate of the register and
deploy steps."""

import json
from pathlib import Path

from kfvision.pipelines.flow.params import (
    EXECUTION_MODES,
    parameter_name,
)
from kfvision.trainer.errors import EvaluationError, InvalidParameterError, check_choice, ref

# step -> (what it does, what it did), as the gate's reason says them
GATED = {"register": ("registering", "registered"), "deploy": ("deploying", "deployed")}


def run(step, *args, **kwargs):
    """Call `step`; a kfvision error ends the process with one line saying what to fix (and the
    error's exit code) instead of a traceback, in the step's log and the pipeline's. Options
    are named as the pipeline's parameters."""
    import sys

    from kfvision.trainer.errors import KfvisionError
    from kfvision.trainer.exitcodes import error_line
    from kfvision.trainer.heap import freeze_at_exit

    # A quick exit once torch is imported: docs/benchmarks.md#start-and-exit-of-kfvisions-programs
    freeze_at_exit()
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


def accuracy_gate(evaluation_dir, min_accuracy: float, *,
                  step: str) -> tuple[bool, float | None, str]:
    """(pass?, the accuracy, why) of the register or deploy `step`: it passes when the evaluated
    accuracy (`evaluation_dir`/metrics.json, the evaluate step's) reaches `min_accuracy`. An
    evaluation without an accuracy (the images had no labels) does not pass.

    Raises:
        EvaluationError: the metrics cannot be read.
    """
    doing, done = GATED[step]
    path = Path(evaluation_dir) / "metrics.json"
    try:
        accuracy = json.loads(path.read_text(encoding="utf-8")).get("accuracy")
    except (OSError, ValueError, AttributeError) as e:
        raise EvaluationError(f"{path}: the evaluation cannot be read ({e}); the evaluate "
                              "step's log says why.") from e
    minimum = f"{step}_min_accuracy {min_accuracy:.4f}"
    if accuracy is None:
        return False, None, f"not {done}: no evaluated accuracy (the images have no labels)"
    if accuracy < min_accuracy:
        return False, accuracy, f"not {done}: accuracy {accuracy:.4f} is below {minimum}"
    return True, accuracy, f"{doing}: accuracy {accuracy:.4f} >= {minimum}"
