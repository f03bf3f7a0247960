"""The data steps: convert a source (folder, archive, http(s) URL, s3://) into an image
directory, and split it."""

import shutil
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from kfvision.pipelines.clients.s3 import is_s3
from kfvision.pipelines.flow.storage import new_folder
from kfvision.trainer.errors import InvalidDatasetError

URL_SCHEMES = ("http", "https")


def _fetch(url: str, dest: Path) -> Path:
    """Download an http(s) source into dest/, keeping its file name (the archive type)."""
    name = Path(urllib.parse.urlparse(url).path).name or "download"
    target = dest / name
    try:
        with urllib.request.urlopen(url, timeout=60) as r, target.open("wb") as f:  # noqa: S310
            shutil.copyfileobj(r, f, length=1 << 20)
    except OSError as e:  # URLError and HTTPError are OSErrors
        raise InvalidDatasetError(f"cannot download {url} ({e}); check the URL and that this "
                                  "step can reach it.") from e
    return target


def convert_step(source: str, out, labels: str = "", place: Path | None = None,
                 store_uri: str = "") -> dict:
    """Convert a folder, archive, http(s) URL or s3:// URI of images into an image directory at
    `out`, copying no image that is already where the job can read it (see
    kfvision.pipelines.flow.storage).

    A folder is referenced where it is (`out` holds the manifest). An archive, downloaded or
    not, is extracted once: into a new folder of `place` (the run's data place, on a cluster),
    and referenced there; with no place (a local run), into `out` itself. A download goes to
    `place` too (a pod's own disk may be small), and is deleted once extracted. An s3:// source
    is fetched into `place/s3-<hash of the URI>` (locally beside `out`), where a retried step
    finds what its first attempt fetched and downloads only the rest
    (kfvision.pipelines.clients.datasource). `out` also gets `samples.jpg`, a few images of each
    class, for the KFP UI.

    With `store_uri` (a pipeline compiled with --data-uri: kfvision.pipelines.flow.steps.store)
    the images go to that prefix of object storage: extracted or fetched into a scratch folder
    of this step when there is no `place`, pushed, and the scratch folder removed; `out` keeps
    the manifest and samples.jpg.

    Returns {"images", "classes", "skipped", "bytes", "images_root", "summary"} for the step's
    log and artifact metadata ("store_uri" too with a store).
    """
    if store_uri:
        from kfvision.pipelines.flow.steps.store import METADATA_KEY, push_images, scratch

        with scratch("convert") as tmp:
            result = convert_step(source, out, labels, place or tmp)
            push_images(out, store_uri)
        return {**result, "images_root": store_uri, METADATA_KEY: store_uri}
    from kfvision.trainer.data.convert import convert
    from kfvision.trainer.use.preview import write_samples

    if is_s3(source) or is_s3(labels):
        report = _convert_s3(source, out, labels, place)
    else:
        report = _convert_local_or_url(source, out, labels, place, convert)
    imdir = write_samples(out)
    return {"images": report.images, "classes": len(report.classes),
            "skipped": len(report.skipped), "bytes": sum(e.bytes for e in imdir.images),
            "images_root": str(imdir.base), "summary": report.summary()}


def _convert_local_or_url(source: str, out, labels: str, place, convert):
    with tempfile.TemporaryDirectory(prefix="kfvision-source-") as tmp:
        src = Path(source)
        if urllib.parse.urlparse(source).scheme in URL_SCHEMES:
            print(f"downloading {source}", flush=True)
            src = _fetch(source, new_folder(place, "download-") if place else Path(tmp))
        extract_to = new_folder(place, "source-") / "images" if place and src.is_file() else None
        try:
            return convert(src, out, labels=labels or None, progress=False,
                           in_place=src.is_dir() or extract_to is not None,
                           extract_to=extract_to)
        finally:
            if src != Path(source):  # our download: extracted (or failed) now
                shutil.rmtree(src.parent, ignore_errors=True)


def _convert_s3(source: str, out, labels: str, place):
    import hashlib

    from kfvision.pipelines.clients.datasource import fetch_source
    from kfvision.trainer.data.convert import convert

    key = hashlib.sha256(f"{source}\n{labels}".encode()).hexdigest()[:16]
    here = (place or Path(out).parent) / f"s3-{key}"
    print(f"fetching {source} into {here}", flush=True)
    local = fetch_source(source, here, labels=labels or None, progress=False)
    print(local.summary, flush=True)
    in_place = is_s3(source) or local.src.is_dir()
    return convert(local.src, out, labels=local.labels, progress=False, in_place=in_place,
                   extract_to=local.extract_to, origin=local.origin)


def split_step(data, train_out, val_out, fraction: float, random_seed: int, *,
               store_uris: tuple = ()) -> dict:
    """Split an image directory (stratified) into two manifests over its images (no copies),
    each with its samples.jpg; returns the image counts of both sides.

    `store_uris`: (the input's, train's, validation's) prefixes in object storage, for a
    pipeline compiled with --data-uri: the input is fetched from the store instead of read at
    `data`, and both sides pushed (kfvision.pipelines.flow.steps.store.split_in_store)."""
    if store_uris:
        from kfvision.pipelines.flow.steps.store import split_in_store

        return split_in_store(*store_uris, train_out, val_out, lambda src, a, b: split_step(
            src, a, b, fraction, random_seed))
    from kfvision.trainer.data.split import split
    from kfvision.trainer.use.preview import write_samples

    counts = split(data, train_out, val_out, fraction=fraction, seed=random_seed, in_place=True)
    for side in (train_out, val_out):
        write_samples(side)
    return {"train_images": sum(counts["first"].values()),
            "validation_images": sum(counts["second"].values())}
