"""A training job whose data, model or outputs are `s3://` URIs: no PVC anywhere.

Its pods run the node agent (`contract.STORE_COMMAND`, pipelines/jobs/storenode.py) with the
training flags as they are, URIs included: the agent fetches what the node's ranks read into the
pod's scratch volume (mounted at `contract.SCRATCH_MOUNT`), runs the trainer on those folders
and sends checkpoints and the model back to the store. This module holds what a rendered job
needs for that (the scratch volume, the credentials by reference) and the render-time check that
every `s3://` input is there (`check_store`).

Credentials never travel as values: `--s3-credentials SECRET` gives each key of
`clients/s3.py`'s S3_SECRET_KEYS (the endpoint too) as an env `valueFrom.secretKeyRef`,
optional so that a Secret holding only some of them works; `--service-account NAME` gives the
pods a ServiceAccount for IRSA / workload identity instead (or as well).
"""

from kfvision.pipelines.clients.s3 import S3_SECRET_KEYS, is_s3
from kfvision.pipelines.contract import SCRATCH_MOUNT

# The training flags that may name the store (the node agent replaces them with scratch folders)
STORE_PATHS = ("model", "train", "val", "out", "checkpoint_dir")
SCRATCH_VOLUME = "kfvision-scratch"


def store_uris(train) -> dict:
    """{field: URI} of the `s3://` paths of a TrainConfig, in STORE_PATHS order."""
    found = {name: getattr(train, name) for name in STORE_PATHS}
    return {name: uri for name, uri in found.items() if is_s3(uri)}


def uses_store(train) -> bool:
    """Whether a TrainConfig reads or writes the store (its pods then run the node agent)."""
    return bool(store_uris(train))


def secret_env(secret: str | None) -> list:
    """The env entries of the S3 credentials Secret `secret` (none for None): each key as the
    variable of its name, by reference."""
    if secret is None:
        return []
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key,
                                                          "optional": True}}}
            for key in S3_SECRET_KEYS]


def scratch_volume(size: str | None, storage_class: str | None) -> dict:
    """The pod's scratch volume: an emptyDir (at most `size`), or with `storage_class` a generic
    ephemeral volume of that class and size (a PVC made with the pod and deleted with it: for
    nodes whose own disk is too small). Both are the pod's alone and allowed under the
    restricted Pod Security Standard."""
    if storage_class is None:
        return {"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": size} if size else {}}
    claim = {"accessModes": ["ReadWriteOnce"], "storageClassName": storage_class,
             "resources": {"requests": {"storage": size}}}
    return {"name": SCRATCH_VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}


def scratch_mount() -> dict:
    return {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT}


def check_store(train) -> None:
    """Every `s3://` input of a TrainConfig is there: train and val image directories, the model
    directory, and the bucket of each output (out, checkpoint_dir).

    Raises:
        InvalidDatasetError, InvalidModelDirectoryError: an input is not there (or not whole).
        NoSuchBucketError: an output's bucket does not exist. EndpointUnreachableError,
            EndpointAuthError: the store did not answer, or refused these credentials.
    """
    from kfvision.pipelines.clients import s3, storedirs

    for name, uri in store_uris(train).items():
        if name in ("train", "val"):
            storedirs.image_directory_at(uri)
        elif name == "model":
            storedirs.model_at(uri)
        else:
            s3.check_bucket(uri)
