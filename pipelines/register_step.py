"""The register step: after evaluation, the trained model as a version in MLflow's registry.

    gate   only when the evaluated accuracy reaches register_min_accuracy; otherwise the step says
           why and succeeds (as the deploy step does).
    where  MLflow at MLFLOW_TRACKING_URI: Kubeflow Pipelines 2.17 with MLflow configured injects
           it (the model goes into the task's nested run, MLFLOW_RUN_ID); locally `make demo`
           sets its SQLite store. Without it the step says so and succeeds.

Registering is idempotent by content (pipelines.registry): a retried step finds its version.
"""

import json
import os
import sys
from pathlib import Path

from trainer.errors import InvalidModelDirectoryError


def register_step(model_dir, evaluation_dir, *, name: str, min_accuracy: float,
                  pipeline_run: str = "", environ=None, out=None) -> dict:
    """Gate, then register; returns {"registered", "reason" | "name", "version", "source"}."""
    from pipelines import registry

    out, env = out or sys.stdout, os.environ if environ is None else environ
    path = Path(evaluation_dir) / "metrics.json"
    try:
        accuracy = json.loads(path.read_text(encoding="utf-8"))["accuracy"]
    except (OSError, ValueError, KeyError) as e:
        raise InvalidModelDirectoryError(f"{path}: the evaluation's accuracy cannot be read "
                                         f"({e}).") from e
    if accuracy < min_accuracy:
        reason = (f"not registered: accuracy {accuracy:.4f} is below register_min_accuracy "
                  f"{min_accuracy:.4f}")
        print(reason, file=out, flush=True)
        return {"registered": False, "reason": reason}
    if not env.get("MLFLOW_TRACKING_URI"):
        reason = ("not registered: no MLflow here (MLFLOW_TRACKING_URI is not set; KFP 2.17 sets "
                  "it where MLflow is configured, docs/tracking.md)")
        print(reason, file=out, flush=True)
        return {"registered": False, "reason": reason}
    got = registry.register_mlflow(
        model_dir, name, description=f"kfvision pipeline run {pipeline_run}".strip(),
        tracking_uri=env["MLFLOW_TRACKING_URI"], run_id=env.get("MLFLOW_RUN_ID") or None,
        experiment=env.get("MLFLOW_EXPERIMENT_NAME") or "kfvision")
    state = "registered" if got["created"] else "already registered (same content)"
    print(f"{state}: models:/{got['name']}/{got['version']} (source {got['source']})", file=out,
          flush=True)
    return {"registered": True, "name": got["name"], "version": str(got["version"]),
            "source": got["source"]}
