"""An `s3://` source (and `--labels`) made local for `convert`: fetched once into the run's data
place, then converted in place there (the manifest references the fetched copy, and records the
source URI and each object's ETag).

    s3://bucket/photos/         every object under the prefix -> PLACE/ (paths kept)
    s3://bucket/photos.tar.gz   the archive -> PLACE/photos.tar.gz, extracted into PLACE/images/
    --labels s3://bucket/l.csv  -> PLACE/.kfvision-labels/l.csv (a labels file inside an s3://
                                   prefix source comes with it: `--labels l.csv`)

PLACE keeps what was fetched: running again over an unchanged source downloads nothing (an
archive is extracted again from the local copy); an object changed since is a
ChangedDatasetError (kfvision.pipelines.clients.s3sync).
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

from kfvision.pipelines.clients import s3, s3sync
from kfvision.trainer.errors import InvalidDatasetError

LABELS_FOLDER = ".kfvision-labels"  # hidden: convert never takes it for images
EXTRACTED = "images"


@dataclass(frozen=True)
class LocalSource:
    """What `kfvision.trainer.data.convert.convert` gets for a source."""

    src: Path  # the fetched folder, or archive
    labels: str | None
    origin: dict | None  # recorded in the manifest: {"uri", "etags"} or {"uri", "etag"}
    extract_to: Path | None  # an archive's extraction folder (must not exist yet)
    summary: str = ""


def default_place(out) -> Path:
    """Where `kfvision convert` keeps an s3:// source's objects: beside OUT, `OUT.fetched/`."""
    out = Path(out)
    return out.parent / f"{out.name}.fetched"


def fetch_source(source: str, place, *, labels: str | None = None,
                 max_connections: int = s3.DEFAULT_CONNECTIONS,
                 progress: bool | None = None) -> LocalSource:
    """Fetch `source` (and `labels`, where they are s3:// URIs) into `place` (see the module doc).

    Raises:
        InvalidDatasetError: an s3:// object that is not an archive kfvision reads. The errors of
            kfvision.pipelines.clients.s3sync.fetch.
    """
    from kfvision.trainer.data.archive import archive_kind

    place = Path(place)
    summaries: list = []
    if not s3.is_s3(source):
        return LocalSource(Path(source), _labels(labels, place, max_connections, summaries),
                           None, None, "\n".join(summaries))
    got = s3sync.fetch(source, place, max_connections=max_connections, progress=progress)
    summaries.append(got.summary())
    labels = _labels(labels, place, max_connections, summaries)  # after: place is the source's
    if got.path.is_dir():
        return LocalSource(got.path, labels, got.origin(), None, "\n".join(summaries))
    if archive_kind(got.path) is None:
        raise InvalidDatasetError(
            f"{source} is one object but not an archive kfvision reads (.zip, .tar, .tar.gz, "
            ".tgz, .tar.bz2): give a prefix of class folders (s3://BUCKET/PREFIX/) or one of "
            "those archives.")
    images = place / EXTRACTED  # extracted again from the local copy on every run
    shutil.rmtree(images, ignore_errors=True)
    return LocalSource(got.path, labels, {"uri": source, "etag": got.etags[got.path.name]},
                       images, "\n".join(summaries))


def _labels(labels: str | None, place: Path, max_connections: int, summaries: list):
    """`labels` as a local path: an s3:// CSV fetched into place/.kfvision-labels/."""
    if not (labels and s3.is_s3(labels)):
        return labels
    got = s3sync.fetch(labels, place / LABELS_FOLDER, max_connections=max_connections,
                       progress=False)
    summaries.append(got.summary())
    return str(got.path)
