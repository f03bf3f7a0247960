"""Model registries: MLflow's and Kubeflow's Model Registry ("Kubeflow Hub"). The one module of
pipelines/ that talks to them (mlflow and model_registry are imported here only, and lazily); it
maps their failures onto the named errors of kfvision.pipelines.clients.endpoints once, classifying
MLflow's through
kfvision.trainer.tracking.failure (the trainer's tracking client).

    kfvision register --model models/digits --name digits                  # MLflow
    kfvision register --model models/digits --name digits --registry kubeflow \\
        --storage-uri pvc://kfvision-data/models/digits --registry-url https://hub.example:443
    kfvision score --model models:/digits/1 ...                            # fetched once, cached

Registering is idempotent by content: the sha256 of the model directory's files is a tag of the
MLflow version (a version with the same hash is returned, not made again) and, in the Kubeflow
registry, the version's name (`sha256-<first 16 hex>`).
"""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from kfvision.pipelines.clients.endpoints import (
    EndpointAuthError,
    EndpointTLSError,
    EndpointUnreachableError,
)
from kfvision.pipelines.contract import read_provenance
from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError, KfvisionError
from kfvision.trainer.model.layout import is_trained_model, read_trained_model

REGISTRIES = ("mlflow", "kubeflow")
REGISTRY_URL = "KFVISION_REGISTRY_URL"  # ours: the Kubeflow Model Registry, https://HOST[:PORT]
REGISTRY_TOKEN = "KFVISION_REGISTRY_TOKEN"  # ours: its bearer token
MLFLOW_SCHEME = "models:/"  # models:/NAME/VERSION, models:/NAME@ALIAS (MLflow's own URIs)
KUBEFLOW_SCHEME = "model-registry://"  # KServe's Model Registry storage initializer reads these
FORMAT = "kfvision"  # the model format name in the Kubeflow registry
HASH_TAG = "kfvision.content_sha256"
SKIP = ("checkpoints",)  # never part of a registered model
# MLflow: a registered model's name; we also keep it DNS-friendly for KServe and Kubeflow
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))$")
METRICS = ("val_top1", "val_top5", "val_loss", "train_images_per_sec")


class RegistryError(KfvisionError):
    """The registry refused a request (a model or version that does not exist, a conflict)."""


def check_name(name: str) -> str:
    if not NAME.fullmatch(name or ""):
        raise InvalidParameterError(
            f"--name {name!r} is not a model name: 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit.")
    return name


def check_registry(registry: str) -> str:
    if registry not in REGISTRIES:
        raise InvalidParameterError(f"--registry {registry!r} is not one of: "
                                    f"{', '.join(REGISTRIES)}.")
    return registry


def content_hash(model_dir: Path) -> str:
    """sha256 over the model directory's files (relative paths and bytes, sorted), or over a
    file's name and bytes."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    files = [model_dir] if model_dir.is_file() else sorted(model_dir.rglob("*"))
    for p in files:
        rel = p.relative_to(model_dir) if p != model_dir else Path(p.name)
        if p.is_file() and rel.parts[0] not in SKIP:
            h.update(rel.as_posix().encode() + b"\0")
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def describe_model(model_dir) -> dict:
    """What a registry records of a model directory (`kfvision train`'s, or a training script's:
    trainer/model/scripted.py): classes, image size, final metrics, format version, and a
    script's model format. Raises InvalidModelDirectoryError for anything else."""
    model_dir = Path(model_dir)
    if not is_trained_model(model_dir):  # a script's, or none: its loader says which
        return _describe_script_model(model_dir)
    info, _ = read_trained_model(model_dir)
    try:
        metrics = json.loads((model_dir / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidModelDirectoryError(
            f"{model_dir} is not a whole trained model directory (metrics.json: {e}); "
            "register what `kfvision train` wrote.") from e
    final = metrics.get("final", {})
    return {"classes": info["classes"], "image_size": info["image_size"],
            "format_version": str(info.get("version", 1)),
            "metrics": {k: final[k] for k in METRICS if k in final}}


def _describe_script_model(model_dir: Path) -> dict:
    """A script's model directory, loaded once so that only one kfvision serves is registered
    (torch is imported for it only); its metrics.json is optional."""
    from kfvision.trainer.model.trained import load_model

    _, info = load_model(model_dir)
    try:
        final = json.loads((model_dir / "metrics.json").read_text(encoding="utf-8"))["final"]
    except (OSError, ValueError, KeyError, TypeError):
        final = {}
    final = final if isinstance(final, dict) else {}
    return {"classes": info["classes"], "image_size": info["image_size"], "format_version": "1",
            "model_format": info.get("model_format"),
            "metrics": {k: final[k] for k in METRICS if isinstance(final.get(k), (int, float))}}


def _endpoint_error(exc: Exception, endpoint: str, what: str) -> KfvisionError:
    from kfvision.trainer.tracking import WHAT_TO_CHECK, failure

    kind = failure(exc)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    message = f"{what} at {endpoint}: {WHAT_TO_CHECK[kind]} ({first})"
    if kind == "unreachable":
        return EndpointUnreachableError(message, endpoint)
    if kind == "tls":
        return EndpointTLSError(message, endpoint)
    if kind == "auth":
        return EndpointAuthError(message, endpoint)
    return RegistryError(message)


def _mlflow_client(tracking_uri: str | None):
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise InvalidParameterError("no MLflow server: give --tracking-uri or set "
                                    "MLFLOW_TRACKING_URI (docs/tracking.md).")
    return MlflowClient(tracking_uri=uri, registry_uri=uri), uri


def register_mlflow(model_dir, name: str, *, description: str = "",
                    tracking_uri: str | None = None, run_id: str | None = None,
                    experiment: str = "kfvision", about: dict | None = None,
                    tags: dict | None = None, artifact_path: str = "model") -> dict:
    """Register `model_dir` as a version of `name` in MLflow's registry (once per content).

    The directory is uploaded as the artifacts (`model/`) of `run_id` (the training run; for a
    script job's model folder, by default the run its kfvision-source.json names on the same
    server) or of a new run in `experiment`; the version's source is that folder, its tags the
    metrics, classes, image size, content hash, source run and a script's snapshot sha256.
    `about` (pipelines/script/jobmodel.py: a file or folder a job wrote, not servable) stands
    for describe_model's; `tags` are added to the version's; `artifact_path` is where in the
    run the files go. Returns {"name", "version",
    "source", "run_id", "created"}.
    """
    model_dir, name = Path(model_dir), check_name(name)
    about = describe_model(model_dir) if about is None else about
    digest = content_hash(model_dir)
    made = read_provenance(model_dir)  # a script job's model folder: its run and snapshot
    about["source_sha256"] = made.get("source_sha256")
    client, uri = _mlflow_client(tracking_uri)
    if run_id is None and made.get("mlflow_tracking_uri") == uri:
        run_id = made.get("mlflow_run_id")  # the version links to the script's own run
    try:
        for v in client.search_model_versions(f"name='{name}'"):
            if v.tags.get(HASH_TAG) == digest:
                return {"name": name, "version": v.version, "source": v.source,
                        "run_id": v.run_id, "created": False}
        try:
            client.get_registered_model(name)
        except Exception as e:  # noqa: BLE001 - classified: only "missing" means create it
            from kfvision.trainer.tracking import failure

            if failure(e) != "missing":
                raise
            client.create_registered_model(name, description=description or None)
        if run_id is None:
            exp = client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
            run_id = client.create_run(exp_id, run_name=f"register {name}").info.run_id
            client.set_terminated(run_id)
        if model_dir.is_file():
            client.log_artifact(run_id, str(model_dir), artifact_path)
        else:
            client.log_artifacts(run_id, str(model_dir), artifact_path)
        source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + artifact_path
        tags = {**(tags or {}), HASH_TAG: digest, "kfvision.run_id": run_id,
                **({"kfvision.classes": json.dumps(about["classes"]),
                    "kfvision.image_size": str(about["image_size"])}
                   if about.get("classes") else {}),
                **({"kfvision.model_format": about["model_format"]}
                   if about.get("model_format") else {}),
                **({"kfvision.source_sha256": about["source_sha256"]}
                   if about.get("source_sha256") else {}),
                **{f"kfvision.{k}": f"{v:.6g}" for k, v in about["metrics"].items()}}
        v = client.create_model_version(name, source, run_id=run_id, tags=tags,
                                        description=description or None)
    except KfvisionError:
        raise
    except Exception as e:  # noqa: BLE001 - one mapping of MLflow's failures, with the cause
        raise _endpoint_error(e, uri, f"registering {name} in MLflow") from e
    return {"name": name, "version": v.version, "source": source, "run_id": run_id,
            "created": True}


def register_kubeflow(model_dir, name: str, *, storage_uri: str, url: str, author: str,
                      description: str = "", token: str | None = None,
                      pipeline_run: str = "", about: dict | None = None,
                      tags: dict | None = None) -> dict:
    """Register `model_dir` (stored for KServe at `storage_uri`, s3:// or pvc://) in Kubeflow's
    Model Registry at `url` (https://HOST[:PORT] or http://...): RegisteredModel, ModelVersion
    `sha256-<16 hex>` and ModelArtifact, with the format, classes and metrics as custom
    properties (`about` and `tags` as register_mlflow takes them). A version of that name is
    returned as it is."""
    model_dir, name = Path(model_dir), check_name(name)
    if not re.match(r"^(s3|pvc|gs|https?)://", storage_uri or ""):
        raise InvalidParameterError(
            f"--storage-uri {storage_uri!r}: the Kubeflow registry records where KServe reads "
            "the model: give an s3://BUCKET/PATH or pvc://CLAIM/PATH URI of this directory.")
    about = describe_model(model_dir) if about is None else about
    about["source_sha256"] = read_provenance(model_dir).get("source_sha256")
    version = f"sha256-{content_hash(model_dir)[:16]}"
    m = re.match(r"^(https?)://([^/:]+)(?::(\d+))?/?$", url or "")
    if not m:
        raise InvalidParameterError(f"--registry-url {url!r} is not http(s)://HOST[:PORT].")
    secure = m.group(1) == "https"
    port = int(m.group(3) or (443 if secure else 80))
    try:
        from model_registry import ModelRegistry

        registry = ModelRegistry(f"{m.group(1)}://{m.group(2)}", port=port, author=author,
                                 is_secure=secure, user_token=token)
        found = (registry.get_model_version(name, version)
                 if registry.get_registered_model(name) is not None else None)
        if found is not None:
            return {"name": name, "version": version, "id": found.id, "created": False}
        metadata = {**(tags or {}), **{k: float(v) for k, v in about["metrics"].items()},
                    **({"classes": json.dumps(about["classes"]),
                        "image_size": about["image_size"]} if about.get("classes") else {})}
        if about.get("model_format"):  # a script's model directory: which file serves
            metadata["model_format"] = about["model_format"]
        if about.get("source_sha256"):  # a script's model folder: the snapshot it came from
            metadata["source_sha256"] = about["source_sha256"]
        if pipeline_run:
            metadata["pipeline_run"] = pipeline_run
        registered = registry.register_model(
            name, storage_uri, model_format_name=FORMAT,
            model_format_version=about["format_version"], version=version,
            version_description=description or None, description=description or None,
            metadata=metadata)
    except KfvisionError:
        raise
    except Exception as e:  # noqa: BLE001 - one mapping of the client's failures, with the cause
        raise _endpoint_error(e, url, f"registering {name} in the Kubeflow Model Registry") from e
    return {"name": name, "version": version, "id": registered.id, "created": True}


# model-registry://NAME, NAME/VERSION or HOST/NAME/VERSION (two parts read as NAME/VERSION)
KUBEFLOW_URI = re.compile(r"^model-registry://(?:[^/]+/(?=[^/]+/))?(?P<name>[^/]+)"
                          r"(?:/(?P<version>[^/]+))?$")


def _kubeflow_client(url: str, author: str, token: str | None):
    m = re.match(r"^(https?)://([^/:]+)(?::(\d+))?/?$", url or "")
    if not m:
        raise InvalidParameterError(f"registry URL {url!r} is not http(s)://HOST[:PORT].")
    secure = m.group(1) == "https"
    from model_registry import ModelRegistry

    return ModelRegistry(f"{m.group(1)}://{m.group(2)}",
                         port=int(m.group(3) or (443 if secure else 80)), author=author,
                         is_secure=secure, user_token=token)


def check_kubeflow_uri(uri: str, *, url: str, token: str | None = None) -> str:
    """Check that `model-registry://[HOST/]NAME[/VERSION]` names a model (and version) in the
    Kubeflow Model Registry at `url`; returns the version's storage URI ('' without a version).
    Raises RegistryError when it is not there, Endpoint*Error when the registry cannot be
    used."""
    m = KUBEFLOW_URI.fullmatch(uri)
    if not m:
        raise InvalidParameterError(f"--model {uri!r}: write model-registry://NAME/VERSION.")
    name, version = m.group("name"), m.group("version")
    try:
        registry = _kubeflow_client(url, "kfvision", token)
        if registry.get_registered_model(name) is None:
            raise RegistryError(f"{uri}: no model {name!r} in the Kubeflow Model Registry at "
                                f"{url}; `kfvision register --registry kubeflow` makes one.")
        if version is None:
            return ""
        if registry.get_model_version(name, version) is None:
            raise RegistryError(f"{uri}: model {name!r} has no version {version!r} in the "
                                f"Kubeflow Model Registry at {url}.")
        artifact = registry.get_model_artifact(name, version)
        return getattr(artifact, "uri", "") or ""
    except KfvisionError:
        raise
    except Exception as e:  # noqa: BLE001 - one mapping of the client's failures, with the cause
        raise _endpoint_error(e, url, f"looking up {uri}") from e


def fetch_mlflow_version(uri: str, *, tracking_uri: str | None, cache: Path) -> Path:
    """The local copy of the MLflow version `models:/NAME/VERSION` (or `models:/NAME@ALIAS`):
    fetched once into `cache`/NAME/VERSION and reused
    (kfvision.pipelines.clients.models.resolve_model is what commands call). Raises
    InvalidParameterError for a malformed URI, RegistryError for an unknown model or version,
    Endpoint*Error when the server cannot be used."""
    text = str(uri)
    m = MODELS_URI.fullmatch(text)
    if not m:
        raise InvalidParameterError(f"--model {text!r}: write models:/NAME/VERSION or "
                                    "models:/NAME@ALIAS.")
    client, server = _mlflow_client(tracking_uri)
    name = m.group("name")
    try:
        v = (client.get_model_version(name, m.group("version")) if m.group("version") else
             client.get_model_version_by_alias(name, m.group("alias")))
        target = Path(cache) / name / str(v.version)
        if target.is_dir():  # renamed into place whole (below): a script's model has no model.json
            return target
        from mlflow.artifacts import download_artifacts

        tmp = target.with_name(f".{target.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted fetch left
        tmp.mkdir(parents=True)
        download_artifacts(artifact_uri=v.source, dst_path=str(tmp), tracking_uri=server)
        got = tmp / Path(v.source.rstrip("/")).name
        got.rename(target)  # whole or not at all: a reader never sees half a model
        tmp.rmdir()
        return target
    except KfvisionError:
        raise
    except Exception as e:  # noqa: BLE001 - one mapping of MLflow's failures, with the cause
        raise _endpoint_error(e, server, f"fetching {text}") from e


def storage_uri(uri: str, *, tracking_uri: str | None = None) -> str:
    """Where KServe reads the MLflow version `models:/NAME/VERSION` (or @ALIAS) from: its source,
    when that is storage KServe's initializer reads (s3://, gs://, https://, pvc://). Raises
    RegistryError for a source only MLflow can read (mlflow-artifacts:/, a local path)."""
    m = MODELS_URI.fullmatch(uri)
    if not m:
        raise InvalidParameterError(f"--model {uri!r}: write models:/NAME/VERSION or "
                                    "models:/NAME@ALIAS.")
    client, server = _mlflow_client(tracking_uri)
    try:
        v = (client.get_model_version(m.group("name"), m.group("version")) if m.group("version")
             else client.get_model_version_by_alias(m.group("name"), m.group("alias")))
    except Exception as e:  # noqa: BLE001 - one mapping of MLflow's failures, with the cause
        raise _endpoint_error(e, server, f"looking up {uri}") from e
    if not re.match(r"^(s3|gs|pvc|https?)://", v.source):
        raise RegistryError(
            f"{uri} is stored at {v.source}, which KServe's storage initializer cannot read. "
            "Give the MLflow server an artifact store on S3 (--artifacts-destination s3://...) "
            "and register again, or deploy the model directory's pvc:// or s3:// URI.")
    return v.source


def local_store(folder, experiment: str = "kfvision-demo") -> dict:
    """A local MLflow store (SQLite) under `folder`, with the experiment's artifacts beside it:
    {"uri", "experiment", "ui"} (ui: the command that opens the MLflow UI on it)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        if client.get_experiment_by_name(experiment) is None:
            client.create_experiment(experiment,
                                     artifact_location=(folder / "artifacts").as_uri())
    except Exception as e:  # noqa: BLE001 - one mapping of MLflow's failures, with the cause
        raise _endpoint_error(e, uri, "opening the local MLflow store") from e
    return {"uri": uri, "experiment": experiment,
            "ui": f"mlflow ui --backend-store-uri {uri} --port 5000"}
