"""The steps' side of a pipeline compiled with a store (`--data-uri s3://BUCKET/PREFIX`,
kfvision.pipelines.flow.storage): what a step writes goes up to `PREFIX/<run>/<folder>/`, what it
reads comes down onto its own disk for as long as it works on it. No volume is shared.

    convert   converts into a scratch folder, pushes the image directory      -> <run>/train ...
    split     fetches the image directory, splits it, pushes both sides        -> <run>/train, val
    train     pushes the untrained model (-> <run>/untrained), runs the job on the URIs, fetches
              the trained model (<run>/model, the job's --out) into its Model output
    score     fetches the image directory it scores

Each step's KFP artifact still holds what it holds without a store (the manifest and samples.jpg,
the trained model), for lineage and the UI; its metadata `store_uri` says where the directory is
in the store, which is what the next step reads (METADATA_KEY).
"""

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

METADATA_KEY = "store_uri"  # of a Dataset or Model artifact: its directory's prefix in the store
# The run's folders under the store's prefix (storage.run_prefix)
UNTRAINED, TRAINED = "untrained", "model"


@contextmanager
def scratch(prefix: str):
    """A folder of this step's own disk, removed afterwards (also on a failure)."""
    folder = Path(tempfile.mkdtemp(prefix=f"kfvision-{prefix}-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def push_images(folder, uri: str) -> str:
    """Push the image directory `folder` (its images, then its manifest) to `uri`; returns
    `uri`. The prefix belongs to this run: what a failed attempt left there is replaced."""
    from kfvision.pipelines.clients.storepush import push_image_directory

    pushed = push_image_directory(folder, uri, overwrite=True, progress=False)
    print(f"pushed the image directory to {pushed.uri}: {pushed.objects} object(s), "
          f"{pushed.bytes:,} bytes ({pushed.skipped} already there)", flush=True)
    return pushed.uri


def push_untrained(model_dir, uri: str) -> str:
    """Push the untrained model directory to `uri` (the job's --model); returns `uri`."""
    from kfvision.pipelines.clients.storepush import push_model

    pushed = push_model(model_dir, uri, overwrite=True, progress=False)
    print(f"pushed the untrained model to {pushed.uri} ({pushed.objects} file(s))", flush=True)
    return pushed.uri


def job_paths(store: str, run_id: str, train_uri: str, val_uri: str) -> dict:
    """The train step's job paths in the store: its --model (pushed by the step), --train and
    --val (where convert or split pushed them), --out (where the job writes the model)."""
    from kfvision.pipelines.flow.storage import run_prefix

    return {"model": run_prefix(store, run_id, UNTRAINED), "train": train_uri, "val": val_uri,
            "out": run_prefix(store, run_id, TRAINED)}


@contextmanager
def images_at(folder, uri: str = ""):
    """The image directory `folder`, or with `uri` the one in the store, fetched."""
    if not uri:
        yield folder
        return
    with fetched_images(uri) as here:
        yield here


@contextmanager
def fetched_images(uri: str):
    """The image directory at `uri`, fetched onto this step's disk (a version 1 directory:
    its manifest and the images beside it), removed afterwards."""
    from kfvision.pipelines.clients.s3sync import fetch

    with scratch("images") as folder:
        got = fetch(uri, folder, progress=False)
        print(f"fetched the image directory {uri}: {len(got.etags)} object(s)", flush=True)
        yield folder


def fetch_trained(uri: str, out_dir) -> None:
    """The trained model at `uri` (the job's --out) into `out_dir` (the step's Model output),
    without the checkpoints a failed run would resume from."""
    from kfvision.pipelines.clients.s3sync import fetch

    with scratch("model") as folder:
        fetch(uri, folder, progress=False)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for p in sorted(folder.iterdir()):
            if p.name == "checkpoints" or p.name.startswith("."):  # the fetch's own journal
                continue
            shutil.move(str(p), out / p.name)
    print(f"fetched the trained model from {uri} into {out_dir}", flush=True)


def split_in_store(uri: str, train_uri: str, val_uri: str, train_out, val_out, split) -> dict:
    """Split the image directory at `uri` with `split(src, train_out, val_out)` (two manifests
    over its images, steps.data.split_step), and push both sides: to `train_uri`, `val_uri`.
    Returns split's counts."""
    with fetched_images(uri) as whole:
        counts = split(whole, train_out, val_out)
        push_images(train_out, train_uri)
        push_images(val_out, val_uri)
    return counts


def remove(where) -> None:
    """Delete a folder, or every object under an s3:// prefix."""
    from kfvision.pipelines.clients import s3

    if not s3.is_s3(str(where)):
        shutil.rmtree(where, ignore_errors=True)
        return
    bucket, _ = s3.split_uri(str(where))
    s3.delete(bucket, [o.key for o in s3.list_objects(str(where))])
