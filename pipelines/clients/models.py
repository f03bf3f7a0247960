"""Where a trained model is: `resolve_model(uri)` turns any model reference a command takes into a
local path. Score, export, serve, register and the deploy step's local check all call it.

    models/r18-trained               a local folder (or ONNX file): as it is
    s3://bucket/models/r18/          fetched once into the cache, keyed by its ETags (s3sync)
    models:/digits/3, models:/digits@champion
                                     a version in MLflow's registry (MLFLOW_TRACKING_URI), fetched
                                     once into the cache (kfvision.pipelines.clients.registry)
    model-registry://[HOST/]digits/sha256-0123456789abcdef
                                     a version in Kubeflow's Model Registry (KFVISION_REGISTRY_URL):
                                     the storage URI it recorded, read as above when that is
                                     s3:// or a local path
    pvc://, gs://, https://, ...     a ModelURIError that says what to give instead (KServe's
                                     storage initializer reads these on a cluster; `kfvision
                                     deploy render --model URI` passes them on as they are)

Fetched models are kept under one cache root, `cache_root()`.
"""

import os
import re
import sys
from pathlib import Path

from kfvision.pipelines.clients import s3
from kfvision.pipelines.clients.registry import (
    KUBEFLOW_SCHEME,
    MLFLOW_SCHEME,
    REGISTRY_TOKEN,
    REGISTRY_URL,
)
from kfvision.trainer.errors import InvalidParameterError

SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):/")
INSTEAD = ("give a local model directory, an s3:// copy (`kfvision push DIR s3://...`), "
           "models:/NAME/VERSION or model-registry://NAME/VERSION")


class ModelURIError(InvalidParameterError):
    """A model reference this machine cannot read: a scheme only a cluster reads (pvc://, gs://),
    or a registry that is not configured here. The message says what to give instead."""


def cache_root(environ=None) -> Path:
    """Where fetched models are kept: $XDG_CACHE_HOME/kfvision, else ~/.cache/kfvision (a relative
    XDG_CACHE_HOME is ignored, as the XDG Base Directory spec says); `s3/` and `models/` (MLflow
    versions) under it."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kfvision"


def resolve_model(uri, *, environ=None, max_connections: int = s3.DEFAULT_CONNECTIONS,
                  out=None) -> Path:
    """The local path of the model at `uri` (see the module doc for what it may be).

    Args:
        environ: where MLFLOW_TRACKING_URI, KFVISION_REGISTRY_URL and XDG_CACHE_HOME are read
            (default: os.environ). out: where a fetch says where its copy is (standard error).
    Raises:
        ModelURIError: a scheme that cannot be read here, or a registry that is not configured.
        RegistryError: the registry has no such model or version. Endpoint*Error,
        NoSuch*Error: a server or store could not be used or has no such object.
    """
    env = os.environ if environ is None else environ
    out = out or sys.stderr
    text = str(uri)
    scheme = SCHEME.match(text)
    if scheme is None:
        return Path(text)
    if text.startswith(MLFLOW_SCHEME):  # only then is the registry client's mlflow imported
        from kfvision.pipelines.clients import registry

        return registry.fetch_mlflow_version(text, tracking_uri=env.get("MLFLOW_TRACKING_URI"),
                                             cache=cache_root(env) / "models")
    if text.startswith(KUBEFLOW_SCHEME):
        return _from_kubeflow(text, env, max_connections, out)
    if s3.is_s3(text):
        from kfvision.pipelines.clients import s3sync

        cache = cache_root(env) / "s3"
        print(f"model {text}: its local copy in {cache} (fetched once)", file=out, flush=True)
        return s3sync.fetch_model(text, cache=cache, max_connections=max_connections)
    if scheme.group("scheme") == "file":
        return Path(text[len("file://"):] if text.startswith("file://") else text[len("file:"):])
    raise ModelURIError(
        f"model {text}: {scheme.group('scheme')}:// is read by KServe's storage initializer on a "
        f"cluster, not here. Here, {INSTEAD}; to serve it on KServe, `kfvision deploy render "
        f"--model {text}`.")


def _from_kubeflow(uri: str, env, max_connections: int, out) -> Path:
    """A Kubeflow Model Registry version: where its artifact is stored, read from there."""
    from kfvision.pipelines.clients import registry

    url = env.get(REGISTRY_URL)
    if not url:
        raise ModelURIError(
            f"model {uri} is a version in Kubeflow's Model Registry, which is not configured "
            f"here: set {REGISTRY_URL} to its https://HOST[:PORT] (and {REGISTRY_TOKEN} when it "
            f"needs a token), or {INSTEAD}.")
    stored = registry.check_kubeflow_uri(uri, url=url, token=env.get(REGISTRY_TOKEN))
    if not stored:
        raise ModelURIError(f"model {uri} names no version: write model-registry://NAME/VERSION "
                            "(`kfvision register` prints it).")
    if stored.startswith(KUBEFLOW_SCHEME) or not (s3.is_s3(stored) or SCHEME.match(stored) is None
                                                   or stored.startswith("file:")):
        raise ModelURIError(
            f"model {uri} is stored at {stored}, which only KServe reads (on a cluster): run "
            "where that storage is mounted and give its path, or register an s3:// copy "
            "(`kfvision push DIR s3://...`, then `kfvision register --storage-uri s3://...`).")
    print(f"model {uri}: stored at {stored}", file=out, flush=True)
    return resolve_model(stored, environ=env, max_connections=max_connections, out=out)


def local_model(uri: str, max_connections: int, *, onnx_file: bool = False) -> Path:
    """The local path of a command's `--model` (fetched where it is a URI), its files checked
    before torch is imported: a wrong path is said at once, in the loader's words
    (trainer/model/layout.py), not after seconds of imports. `onnx_file`: a file is taken as an
    ONNX export (serve's)."""
    from kfvision.trainer.model.layout import model_kind

    model = resolve_model(uri, max_connections=max_connections)
    if not (onnx_file and model.is_file()):
        model_kind(model)
    return model
