"""The register step: after evaluation, the trained model as a version in MLflow's registry.

    gate   only when the evaluated accuracy reaches register_min_accuracy; otherwise the step says
           why and succeeds (the deploy step's gate:
           kfvision.pipelines.flow.steps.common.accuracy_gate).
    where  registry mlflow: MLflow at MLFLOW_TRACKING_URI: Kubeflow Pipelines 2.17 with MLflow
           configured injects it (the model goes into the task's nested run, MLFLOW_RUN_ID);
           locally `make demo` sets its SQLite store. registry kubeflow: Kubeflow's Model
           Registry at KFVISION_REGISTRY_URL (token KFVISION_REGISTRY_TOKEN), recording
           model_uri (the s3:// copy the train step pushed) as where KServe reads the model.
           Without them the step says so and succeeds.

Registering is idempotent by content (kfvision.pipelines.clients.registry): a retried step finds its
version. The step always runs (register_name '' is one of its reasons not to register) and writes
what it did to `registration.json` in its output folder: the deploy step serves the registered
version when there is one (kfvision.pipelines.flow.steps.deploy).
"""

import json
import os
import sys
from pathlib import Path

from kfvision.pipelines.clients.registry import REGISTRY_TOKEN, REGISTRY_URL
from kfvision.pipelines.flow.steps.common import accuracy_gate

RECORD = "registration.json"  # in the step's output folder; the deploy step reads it


def register_step(model_dir, evaluation_dir, *, name: str, min_accuracy: float,
                  pipeline_run: str = "", environ=None, out=None, out_dir=None,
                  registry: str = "mlflow", storage_uri: str = "") -> dict:
    """Gate, then register; returns {"registered", "reason" | "name", "version", "source",
    "uri"} (uri: models:/NAME/VERSION or model-registry://NAME/VERSION), also written to
    `out_dir`/registration.json. `storage_uri`: registry kubeflow's record of where KServe reads
    the model."""
    got = _register(model_dir, evaluation_dir, name=name, min_accuracy=min_accuracy,
                    pipeline_run=pipeline_run, environ=environ, out=out or sys.stdout,
                    registry=registry, storage_uri=storage_uri)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / RECORD).write_text(json.dumps(got, indent=2) + "\n", encoding="utf-8")
    return got


def read_registration(out_dir) -> dict:
    """What the register step wrote into `out_dir` ({"registered": False} when nothing)."""
    path = Path(out_dir) / RECORD if out_dir else None
    if path is None or not path.is_file():
        return {"registered": False}
    return json.loads(path.read_text(encoding="utf-8"))


def _register(model_dir, evaluation_dir, *, name, min_accuracy, pipeline_run, environ,
              out, registry="mlflow", storage_uri="") -> dict:
    from kfvision.pipelines.clients import registry as registries

    registries.check_registry(registry)
    env = os.environ if environ is None else environ
    if not name:
        reason = "not registered: register_name is empty"
        print(reason, file=out, flush=True)
        return {"registered": False, "reason": reason}
    ok, _, reason = accuracy_gate(evaluation_dir, min_accuracy, step="register")
    print(reason, file=out, flush=True)
    if not ok:
        return {"registered": False, "reason": reason}
    if registry == "kubeflow":
        return _register_kubeflow(model_dir, name, env, pipeline_run, storage_uri, out)
    if not env.get("MLFLOW_TRACKING_URI"):
        reason = ("not registered: no MLflow here (MLFLOW_TRACKING_URI is not set; KFP 2.17 sets "
                  "it where MLflow is configured, docs/tracking.md)")
        print(reason, file=out, flush=True)
        return {"registered": False, "reason": reason}
    got = registries.register_mlflow(
        model_dir, name, description=f"kfvision pipeline run {pipeline_run}".strip(),
        tracking_uri=env["MLFLOW_TRACKING_URI"], run_id=env.get("MLFLOW_RUN_ID") or None,
        experiment=env.get("MLFLOW_EXPERIMENT_NAME") or "kfvision")
    state = "registered" if got["created"] else "already registered (same content)"
    print(f"{state}: models:/{got['name']}/{got['version']} (source {got['source']})", file=out,
          flush=True)
    return {"registered": True, "name": got["name"], "version": str(got["version"]),
            "source": got["source"], "uri": f"models:/{got['name']}/{got['version']}"}


def _register_kubeflow(model_dir, name, env, pipeline_run, storage_uri, out) -> dict:
    from kfvision.pipelines.clients import registry

    if not env.get(REGISTRY_URL) or not storage_uri:
        reason = (f"not registered: the Kubeflow Model Registry needs {REGISTRY_URL} (its "
                  "https://HOST[:PORT]) in the step's environment and model_uri (the s3:// copy "
                  "KServe reads)")
        print(reason, file=out, flush=True)
        return {"registered": False, "reason": reason}
    got = registry.register_kubeflow(
        model_dir, name, storage_uri=storage_uri, url=env[REGISTRY_URL], author="kfvision",
        description=f"kfvision pipeline run {pipeline_run}".strip(),
        token=env.get(REGISTRY_TOKEN) or None, pipeline_run=pipeline_run)
    uri = f"model-registry://{got['name']}/{got['version']}"
    state = "registered" if got["created"] else "already registered (same content)"
    print(f"{state}: {uri} (storage {storage_uri})", file=out, flush=True)
    return {"registered": True, "name": got["name"], "version": got["version"],
            "source": storage_uri, "uri": uri}
