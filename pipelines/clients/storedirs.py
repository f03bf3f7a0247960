"""Read-only questions about what is in the object store: is there an image directory, a model
directory, at an `s3://` URI? Asked by `kfvision job render` before it writes a job that reads
them, and by the node agent before it fetches.

What lives in the store (written by `kfvision push` / `kfvision convert SRC s3://...`):
- an image directory at `s3://B/P`: `P/kfvision-imagedir.json` (a version 1 manifest, paths
  relative to P) and every image at `P/<entry.path>`. The manifest goes up last, so its presence
  means the upload is complete;
- a model directory at `s3://B/M`: every file under `M/`, `spec.json` last.

Only the manifest and the spec are read (and the weights a spec names are looked for): the
trainer's own parsers check them (trainer/data/imagedir.py, trainer/model/spec.py), so a
directory that passes here is one the trainer would read.
"""

import tempfile
from pathlib import Path

from kfvision.pipelines.clients import s3, s3download
from kfvision.trainer.data.imagedir import MANIFEST, VERSION, ImageDirectory, parse_manifest
from kfvision.trainer.errors import InvalidDatasetError, InvalidModelDirectoryError
from kfvision.trainer.model.spec import SPEC_FILE, ModelSpec, parse_model_spec

PUSH_HINT = "push one with `kfvision push DIR {uri}` or `kfvision convert SRC {uri}`"
MODEL_HINT = ("make one with `kfvision model resnet DIR --name resnet18` (or densenet) and push it "
              "with `kfvision push DIR {uri}`")


def _folder(uri: str) -> str:
    """`uri` as a folder: no trailing '/' (a key under it is uri + '/' + name)."""
    bucket, key = s3.split_uri(uri)
    return f"{s3.SCHEME}{bucket}/{key.strip('/')}".rstrip("/")


def _get(uri: str) -> bytes | None:
    """The bytes of the object at `uri`, or None when there is none (NoSuchBucketError when the
    bucket is not there). Through s3download.download: its size, ETag and MD5 checks and retries."""
    obj = s3.head(uri)
    if obj is None:
        return None
    bucket, _ = s3.split_uri(uri)
    with tempfile.TemporaryDirectory(prefix="kfvision-storedirs-") as tmp:
        target = Path(tmp) / "object"
        s3download.download(obj, bucket, target)
        return target.read_bytes()


def image_directory_at(uri: str) -> ImageDirectory:
    """The image directory at `uri` (its manifest parsed and checked; no image is read). Its
    `root` is the URI (text), and its images are at `<root>/<entry.path>`.

    Raises:
        InvalidDatasetError: no manifest there (not pushed, or still being pushed), a malformed
            one, or a referenced (version 2) one, whose images are on some machine's disk.
        NoSuchBucketError, EndpointUnreachableError, EndpointAuthError: as pipelines/clients/s3.py
            maps them.
    """
    root = _folder(uri)
    data = _get(f"{root}/{MANIFEST}")
    if data is None:
        raise InvalidDatasetError(
            f"{root} is not an image directory in the store (no {root}/{MANIFEST}; it is "
            f"written last, so an upload still running has none yet): "
            f"{PUSH_HINT.format(uri=root)}.")
    imdir = parse_manifest(data, root)
    if imdir.referenced:
        raise InvalidDatasetError(
            f"{root}/{MANIFEST} is a referenced image directory (version 2: its images are "
            f"under {imdir.images_root} on the machine that made it), which no pod can read; "
            f"{PUSH_HINT.format(uri=root)} (a version {VERSION} directory with its images).")
    return imdir


def model_at(uri: str) -> ModelSpec:
    """The spec of the (untrained or trained) model directory at `uri`, checked as
    trainer/model/spec.py checks a folder's, the weights it names included (looked for, not read).

    Raises:
        InvalidModelDirectoryError: no spec.json there, a malformed one, or missing weights.
        NoSuchBucketError, EndpointUnreachableError, EndpointAuthError: as pipelines/clients/s3.py
            maps them.
    """
    root = _folder(uri)
    where = f"{root}/{SPEC_FILE}"
    data = _get(where)
    if data is None:
        raise InvalidModelDirectoryError(
            f"{root} is not a model directory in the store (no {where}; it is written last, so "
            f"an upload still running has none yet): {MODEL_HINT.format(uri=root)}.")
    spec = parse_model_spec(data, where)
    if spec.weights and s3.head(f"{root}/{spec.weights}") is None:
        raise InvalidModelDirectoryError(
            f"{where} names weights {spec.weights!r} but {root}/{spec.weights} is missing: "
            f"push the whole model directory again (`kfvision push DIR {root}`).")
    return spec
