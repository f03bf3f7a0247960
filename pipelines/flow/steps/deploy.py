"""The deploy step: after evaluation, put the model behind KServe's protocols if it is good enough.

    gate    both modes deploy only when the evaluated accuracy reaches deploy_min_accuracy
            (kfvision.pipelines.flow.steps.common.accuracy_gate, the register step's too); otherwise
            the step says why and succeeds.
    cluster the trained model is copied onto the data PVC (`<mount>/kfvision-models/<name>/<run>`),
            the InferenceService serving `pvc://<pvc_name>/...` is rendered
            (kfvision.pipelines.serve.deploy), applied and waited for until Ready
            (kfvision.pipelines.serve.deployclient).
    local   (run-local, `make demo`) the validation images are scored (as `kfvision score`
            does), `kfvision serve` runs on a free port, the same images go through the v1 and
            v2 protocols and the served labels must equal the scored ones
            (kfvision.pipelines.serve.selfcheck.serve_and_check); the server is stopped again.

registered  when the register step registered the model (its `registration` folder says so),
            the step serves that version: on a cluster its storage URI (an MLflow version's
            source when KServe can read it, or `model-registry://NAME/VERSION` as it is), locally
            the version fetched from its registry (kfvision.pipelines.clients.models.resolve_model).
            Otherwise, and where the registered copy cannot be served, the trained model, as
            when register is off; the step says which.

Everything the step decided and measured is returned (the component logs it as Metrics) and
written, with the InferenceService YAML or the server's log, into the step's `deployment` folder.
"""

import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from kfvision.pipelines.flow.steps.common import accuracy_gate, resolve_mode
from kfvision.pipelines.flow.storage import DATA_MOUNT, is_mount
from kfvision.pipelines.serve.selfcheck import serve_and_check
from kfvision.trainer.errors import StorageError
from kfvision.trainer.fileio import disk_errors

MODELS = "kfvision-models"  # on the data PVC: the models InferenceServices serve
READY_TIMEOUT_S = 900.0
FIGURES = "figures.json"


def deploy_step(model_dir, val_dir, evaluation_dir, out_dir, *, name: str,
                min_accuracy: float, mode: str = "auto", image: str = "", pvc_name: str = "",
                run_key: str = "", connect=None, out=None, model_uri: str = "",
                service_account: str = "", registration_dir=None, environ=None,
                val_uri: str = "") -> dict:
    """Gate, then deploy on the cluster or serve-and-check locally; returns the figures.

    `evaluation_dir`: the evaluate step's folder (its metrics.json gives the accuracy, on the
    test images when the run had some); `val_dir`: the validation images the local check scores
    (as `kfvision score` does) and serves. `connect`: makes the
    kfvision.pipelines.serve.deployclient DeployClient (tests pass a fake). Figures: `deployed`
    (1 or 0), `accuracy`, `reason`, and what the deployment measured. `model_uri`: where the
    train step pushed the model (s3://): then KServe fetches it from there (as
    `service_account`), and no PVC is needed.
    `registration_dir`: the register step's folder; a registered version is what is served.
    `val_uri`: the validation images are in the store there (a pipeline compiled with
    --data-uri), fetched for the local check.
    """
    out = out or sys.stdout
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ok, accuracy, reason = accuracy_gate(evaluation_dir, min_accuracy, step="deploy")
    print(reason, file=out, flush=True)
    figures = {"deployed": 0, "accuracy": accuracy, "reason": reason}
    cluster = resolve_mode(mode) == "cluster"
    if ok and cluster:  # built and validated once, before the registry or the cluster is asked
        isvc_cfg, copy_to = deploy_config(name, image, pvc_name, run_key, model_uri,
                                          service_account)
    if ok:
        served = registered_model(registration_dir, cluster=cluster, environ=environ, out=out)
        model_dir = served.pop("model_dir", model_dir)
        registered_uri = served.pop("storage_uri", None)
        figures.update(served)
    if ok and cluster:
        figures.update(_deploy_on_cluster(model_dir, out_dir, isvc_cfg, copy_to, registered_uri,
                                          pvc_name, connect, out))
    elif ok:
        from kfvision.pipelines.flow.steps.store import images_at
        from kfvision.trainer.use.score import score

        with images_at(val_dir, val_uri) as val_dir:
            score(model_dir, val_dir, out_dir / "scored.csv", progress=False)
            figures.update(serve_and_check(model_dir, val_dir, out_dir / "scored.csv",
                                           out_dir / "server.log", name=name), deployed=1,
                           where="local")
        print(f"served {figures['images']} images locally over v1 and v2: labels equal the "
              f"scored ones ({figures['v1_images_per_s']:.1f} and "
              f"{figures['v2_images_per_s']:.1f} images/s)", file=out, flush=True)
    (out_dir / FIGURES).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return figures


def registered_model(registration_dir, *, cluster: bool, environ=None, out=None) -> dict:
    """What to serve of the register step's version: {"registered_model": URI} with
    "storage_uri" (cluster) or "model_dir" (local, fetched once into the cache); {} when nothing
    was registered. A version that cannot be served here is said in one line, and the trained
    model is served instead (no "storage_uri" / "model_dir")."""
    from kfvision.pipelines.clients import registry
    from kfvision.pipelines.clients.models import ModelURIError, resolve_model
    from kfvision.pipelines.flow.steps.register import read_registration

    got = read_registration(registration_dir)
    uri = got.get("uri") if got.get("registered") else None
    if not uri:
        return {}
    env = os.environ if environ is None else environ
    served = {"registered_model": uri}
    try:
        if cluster and uri.startswith(registry.KUBEFLOW_SCHEME):
            served["storage_uri"] = uri  # KServe's Model Registry storage initializer reads it
        elif cluster:
            served["storage_uri"] = registry.storage_uri(
                uri, tracking_uri=env.get("MLFLOW_TRACKING_URI"))
        else:
            served["model_dir"] = resolve_model(uri, environ=env, out=out)
    except (registry.RegistryError, ModelURIError) as e:
        # stored where only KServe or MLflow reads it, or no registry is configured here
        print(f"serving the trained model, not {uri}: {e}", file=out, flush=True)
        return served
    print(f"serving the registered version {uri}", file=out, flush=True)
    return served


def pvc_model_uri(pvc_name: str, name: str, run_key: str) -> tuple[Path, str]:
    """(where the step copies the model, the storage URI KServe fetches it from)."""
    from kfvision.pipelines.jobs.config import job_name

    rel = f"{MODELS}/{name}/{job_name('run', run_key)}"
    return Path(DATA_MOUNT) / rel, f"pvc://{pvc_name}/{rel}"


def deploy_config(name: str, image: str, pvc_name: str, run_key: str, model_uri: str = "",
                  service_account: str = "") -> tuple:
    """(the InferenceService's DeployConfig, checked; where this step copies the model first, or
    None). It serves `model_uri` (where the train step pushed the model), else a copy this step
    makes on the data PVC."""
    from kfvision.pipelines.serve.deploy import DeployConfig

    target, uri = (None, model_uri) if model_uri else pvc_model_uri(pvc_name, name, run_key)
    cfg = DeployConfig(name=name, model=uri, image=image, service_account=service_account or None)
    return cfg.check(), target


def _deploy_on_cluster(model_dir, out_dir: Path, cfg, copy_to: Path | None,
                       registered_uri: str | None, pvc_name, connect, out) -> dict:
    """Serve `cfg.model` (the model copied to `copy_to` first, when given), or the registered
    version's `registered_uri` (a storage URI its registry recorded) instead."""
    from kfvision.pipelines.clients.k8s import to_yaml
    from kfvision.pipelines.serve import deployclient
    from kfvision.pipelines.serve.deploy import build_inference_service

    if registered_uri:
        cfg = replace(cfg, model=registered_uri)
    elif copy_to is not None:  # not pushed by the train step: copy it onto the PVC
        if not is_mount(DATA_MOUNT):
            raise StorageError(
                f"{DATA_MOUNT} is not mounted in this step: on a cluster the deploy step copies "
                f"the model onto the PVC {pvc_name!r} (pipeline parameter pvc_name) for KServe "
                "to serve, unless model_uri names an s3:// place for it.")
        with disk_errors(copy_to):
            shutil.copytree(model_dir, copy_to, dirs_exist_ok=True)
    isvc = build_inference_service(cfg)
    (out_dir / "inferenceservice.yaml").write_text(to_yaml(isvc), encoding="utf-8")
    client = (connect or deployclient.connect)(out=out)
    print(f"{client.apply(isvc)} InferenceService {client.namespace}/{cfg.name} serving "
          f"{cfg.model}", file=out, flush=True)
    ready = client.wait_ready(cfg.name, READY_TIMEOUT_S)
    return {"deployed": 1, "where": "cluster", "storage_uri": cfg.model,
            "url": (ready.get("status") or {}).get("url", "")}
