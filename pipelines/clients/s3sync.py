"""Fetching and pushing over the object-storage layer (pipelines/clients/s3.py): a
resumable, checked,
parallel fetch of a prefix or an object, a push of a folder, and the model cache.

    fetch("s3://bucket/photos/", dest)          # every object under the prefix, into dest/
    fetch("s3://bucket/photos.tar.gz", dest)    # one object (an archive), into dest/
    push(model_dir, "s3://bucket/models/r18/")  # a folder up, every file under the prefix
    fetch_model("s3://bucket/models/r18/", cache=...)  # a local copy, keyed by the ETags

A fetch is resumable and checked. Each object is downloaded to a hidden temporary name beside its
place (`.kfvision-part-...`: `convert` ignores hidden files, so a half-written file is never taken
for an image) and renamed into place when complete; then its key and ETag are appended to the
journal `dest/.kfvision-s3.jsonl`. A second fetch into the same folder downloads only objects the
journal does not list (nothing, when the first one finished); an object whose ETag differs from
the journal's, or that is gone, is a ChangedDatasetError. Every GET asks for the listed ETag
(`If-Match`), so an object rewritten between the listing and the download is caught too. The
listing is streamed page by page and at most 2 x `max_connections` downloads are in flight, each
streamed to disk in 1 MiB chunks: memory stays flat however many objects there are.

A fetch ends in one of two states. Every object in place with its listed size and ETag (and its
MD5, where the ETag is one), each GET retried under the object-storage layer's retry policy when
throttled, reset, cut short, stalled or answered with another ETag. Or a named error: exit 69
(ObjectTransferError, EndpointUnreachableError) once the policy's budget is spent, exit 4
(OutputError) when the local disk is full, with the journal holding what is in place, so the
same command resumes there.
"""

import contextlib
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from kfvision.pipelines.clients import s3, s3download, s3put
from kfvision.trainer.errors import ChangedDatasetError, InvalidParameterError
from kfvision.trainer.fileio import atomic_write_bytes, disk_errors

JOURNAL = ".kfvision-s3.jsonl"
SCHEME = s3.SCHEME


@dataclass
class Fetched:
    """What `fetch` found and did."""

    uri: str
    path: Path  # the fetched folder (a prefix) or file (one object)
    etags: dict = field(default_factory=dict)  # path relative to the fetch folder -> ETag
    objects: int = 0  # objects at the source
    bytes: int = 0  # their bytes
    fetched_objects: int = 0  # downloaded by this call
    fetched_bytes: int = 0
    listed: int = 0  # keys listed, fetched or not (folder markers, hidden names)

    def summary(self) -> str:
        return (f"{self.uri}: {self.objects} object(s), {self.bytes:,} bytes; downloaded "
                f"{self.fetched_objects} ({self.fetched_bytes:,} bytes) into {self.path}")

    def origin(self) -> dict:
        """What an image directory's manifest records of its source."""
        return {"uri": self.uri, "etags": self.etags}


def _relative(key: str, prefix: str) -> str | None:
    """The local path of `key` under the fetch folder, or None for a key not to fetch: a
    "folder" marker, a hidden name (convert ignores those), or one that would leave the folder."""
    rel = key[len(prefix):]
    parts = PurePosixPath(rel).parts
    if not rel or rel.endswith("/") or not parts:
        return None
    if any(p in ("..", ".") or p.startswith(".") for p in parts) or rel.startswith("/"):
        return None
    return "/".join(parts)


class _Journal:
    """The objects a fetch folder holds: `{"source": uri}` then one `{"path", "etag", "bytes"}`
    line per object, appended once the object is in place (a torn last line is ignored)."""

    def __init__(self, folder: Path, uri: str):
        self.path = folder / JOURNAL
        self.done: dict = {}
        self._lock = threading.Lock()
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            try:
                head = json.loads(lines[0]) if lines else {}
            except ValueError:
                head = {}
            if not isinstance(head, dict) or head.get("source") != uri:
                raise InvalidParameterError(
                    f"{folder} holds a fetch of {head.get('source')!r}, not of {uri}: give a new "
                    "folder, or remove it.")
            for line in lines[1:]:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    d = json.loads(line)
                    self.done[d["path"]] = (d["etag"], d["bytes"])
        else:
            if folder.is_dir() and any(folder.iterdir()):
                raise InvalidParameterError(
                    f"{folder} already holds files but no fetch (no {JOURNAL}): give a new "
                    "folder to fetch into, or an empty one.")
            with disk_errors(self.path):
                folder.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.path, (json.dumps({"source": uri}) + "\n").encode())
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def add(self, rel: str, obj: s3.Obj) -> None:
        with self._lock, disk_errors(self.path):  # a torn last line is ignored when read
            self._f.write(json.dumps({"path": rel, "etag": obj.etag, "bytes": obj.size}) + "\n")
            self._f.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a full disk: the line is lost, the object fetched anew
            self._f.close()


def _changed(uri: str, what: str, folder: Path) -> ChangedDatasetError:
    return ChangedDatasetError(
        f"{uri} {what} since it was fetched into {folder}. Use the data as it was (point "
        "the source at an unchanged copy), or fetch anew: remove that folder (or give another) "
        "and run again.")


def remove_stale_parts(folder: Path) -> None:
    """Remove temporary files a killed fetch left behind."""
    for d, _, files in os.walk(folder):
        for name in files:
            if name.startswith(s3.PART):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))


def fetch(uri: str, dest, *, max_connections: int = s3.DEFAULT_CONNECTIONS,
          progress: bool | None = None) -> Fetched:
    """Fetch `uri` into the folder `dest` once: an object (`s3://b/photos.tar.gz`: into
    dest/photos.tar.gz) or every object under a prefix (`s3://b/photos/`, or a key with no object
    that is a prefix: into dest/, keeping the paths below the prefix). Resumes a fetch that was
    killed; downloads nothing when `dest` already holds it all.

    Args:
        max_connections: downloads at once (and the client's connection pool).
        progress: a progress bar (None: only on a terminal).
    Returns:
        a Fetched: the local path, each object's ETag, what was downloaded.
    Raises:
        NoSuchBucketError, NoSuchObjectError (nothing there), ChangedDatasetError (an object
        changed since `dest` got it), EndpointUnreachableError, EndpointTLSError,
        EndpointAuthError, ObjectStoreError (kfvision.pipelines.clients.s3).
    """
    from kfvision.trainer.options import options_of

    options_of(s3.S3Options)[0].check(max_connections)
    bucket, key = s3.split_uri(uri)
    dest = Path(dest)
    one = s3.head(uri) if key and not key.endswith("/") else None
    if one is not None:
        name = PurePosixPath(key).name
        objects, prefix = iter([one]), key[:len(key) - len(name)]
        result = Fetched(uri, dest / name)
    else:
        prefix = key if not key or key.endswith("/") else key + "/"
        objects = s3.list_objects(f"{SCHEME}{bucket}/{prefix}", max_connections)
        result = Fetched(uri, dest)
    journal = _Journal(dest, uri)
    try:
        remove_stale_parts(dest)
        _download_all(objects, bucket, prefix, dest, journal, result, max_connections, progress)
    finally:
        journal.close()
    gone = set(journal.done) - set(result.etags)
    if gone:
        raise _changed(f"{SCHEME}{bucket}/{prefix}{sorted(gone)[0]}",
                       f"was removed ({len(gone)} object(s) gone)", dest)
    if not result.objects:
        if not result.listed:
            raise s3.NoSuchObjectError(f"nothing under {SCHEME}{bucket}/{prefix} at "
                                       f"{s3.endpoint()} (an empty prefix, or no such key): "
                                       "check the path.")
        raise s3.NoSuchObjectError(f"{uri} holds only folder markers or hidden objects, nothing "
                                   "to use.")
    return result


def _download_all(objects, bucket: str, prefix: str, dest: Path, journal: _Journal,
                  result: Fetched, max_connections: int, progress) -> None:
    """Download what `journal` does not hold yet, `max_connections` at a time."""
    from kfvision.trainer.progressbar import progress_bar

    bar = progress_bar(None, "fetch", "B", progress)
    update = getattr(bar, "update", None)
    if update is not None:
        bar.unit_scale = True
    count_lock = threading.Lock()

    def one(obj: s3.Obj, rel: str) -> None:
        n = s3download.download(obj, bucket, dest / rel, max_connections, on_bytes=update)
        journal.add(rel, obj)
        with count_lock:
            result.fetched_objects += 1
            result.fetched_bytes += n

    # At most 2 x max_connections downloads submitted and not done: a slot is taken before each
    # submit and given back when one ends. (concurrent.futures.wait on the pending set did the
    # same, but takes and gives back every pending future's lock on each call, once per object:
    # threads then wait on each other's locks; docs/benchmarks.md counts them.)
    slots = threading.Semaphore(2 * max_connections)
    pending: set = set()
    failed: list = []

    def ended(f) -> None:
        with count_lock:
            pending.discard(f)
        if not f.cancelled() and f.exception() is not None:
            failed.append(f)
        slots.release()

    with ThreadPoolExecutor(max_connections, thread_name_prefix="kfvision-s3") as pool:
        try:
            for obj in objects:
                result.listed += 1
                rel = _relative(obj.key, prefix)
                if rel is None:
                    continue
                result.objects += 1
                result.bytes += obj.size
                result.etags[rel] = obj.etag
                if update is not None:
                    bar.total = result.bytes
                had = journal.done.get(rel)
                if had is not None and had[0] != obj.etag:
                    raise _changed(f"{SCHEME}{bucket}/{obj.key}", f"changed (ETag {had[0]} -> "
                                   f"{obj.etag})", dest)
                if had is not None and _size(dest / rel) == had[1]:
                    if update is not None:
                        update(obj.size)
                    continue
                slots.acquire()
                if failed:
                    failed[0].result()
                f = pool.submit(one, obj, rel)
                with count_lock:
                    pending.add(f)
                f.add_done_callback(ended)
            for _ in range(2 * max_connections):  # every download ended
                slots.acquire()
            if failed:
                failed[0].result()
        except BaseException:
            with count_lock:
                left = list(pending)
            for f in left:
                f.cancel()
            raise
        finally:
            if hasattr(bar, "close"):
                bar.close()


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def push(folder, uri: str, *, max_connections: int = s3.DEFAULT_CONNECTIONS, skip=(),
         last: str | None = None, overwrite: bool = False) -> list[str]:
    """Upload every file under `folder` to the prefix `uri` (keeping the paths below it; not
    those under a top-level folder named in `skip`), the file `last` after all others; returns
    the keys written. A prefix that holds objects is refused unless `overwrite` (then the old
    objects not written again are deleted at the end). On a failure the objects written so far
    are deleted again, so nothing half-written stays at `uri`."""
    folder = Path(folder)
    bucket, key = s3.split_uri(uri)
    prefix = key if not key or key.endswith("/") else key + "/"
    old = [o.key for o in s3.list_objects(f"{SCHEME}{bucket}/{prefix}")]
    if old and not overwrite:
        raise s3.ObjectStoreError(f"{SCHEME}{bucket}/{prefix} already holds {len(old)} "
                                  "object(s): give a new prefix, or replace them (--overwrite).")
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and p.relative_to(folder).parts[0] not in skip)
    final = [p for p in files if p.relative_to(folder).as_posix() == last]
    rest = [p for p in files if p not in final]  # `final` holds one file at most: linear
    written: list[str] = []
    lock = threading.Lock()

    def up(path: Path) -> None:
        k = prefix + path.relative_to(folder).as_posix()
        s3put.upload(path, bucket, k, max_connections)
        with lock:
            written.append(k)

    try:
        for batch in (rest, final):
            with ThreadPoolExecutor(max_connections, thread_name_prefix="kfvision-s3") as pool:
                for f in [pool.submit(up, p) for p in batch]:
                    f.result()
    except BaseException:
        s3.delete(bucket, written)
        raise
    s3.delete(bucket, sorted(set(old) - set(written)))
    return sorted(written)


def fetch_model(uri: str, *, cache: Path,
                max_connections: int = s3.DEFAULT_CONNECTIONS) -> Path:
    """The local copy of the model at `uri`: a prefix (a model directory) or one object (an
    ONNX export). Fetched once into `cache` (under kfvision.pipelines.clients.models.cache_root), in
    a folder keyed by its objects' keys and ETags: the same model again costs one request, a
    changed one gets a new folder. A fetch that stops (retry budget spent, full disk) resumes on
    the next call."""
    bucket, key = s3.split_uri(uri)
    one = s3.head(uri) if key and not key.endswith("/") else None
    if one is not None:
        source, listed = uri, [(one.key, one.etag)]
    else:
        prefix = key if not key or key.endswith("/") else key + "/"
        source = f"{SCHEME}{bucket}/{prefix}"
        listed = sorted((o.key, o.etag) for o in s3.list_objects(source))
        if not listed:
            raise s3.NoSuchObjectError(f"no model at {uri} ({s3.endpoint()}): check the path "
                                       "(upload one with `kfvision push DIR URI`).")
    digest = hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16]
    root = Path(cache) / bucket / key.strip("/").replace("/", "__")
    final = root / digest
    name = PurePosixPath(key).name if one is not None else ""
    if not (final / JOURNAL).exists():
        _fetch_into_cache(source, root, digest, max_connections)
    return final / name if name else final


def _fetch_into_cache(source: str, root: Path, digest: str, max_connections: int) -> None:
    """Fetch `source` into root/digest: into root/.digest.partial, renamed when whole. The
    partial folder stays after a failure, so the next try resumes it; a lock file keeps two
    processes from fetching into it at once (the second waits, then finds the model there)."""
    import fcntl

    final, partial = root / digest, root / f".{digest}.partial"
    with disk_errors(root):
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{digest}.lock", "a+b")  # noqa: SIM115 (closed below)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / JOURNAL).exists():  # another process got there first: the same objects
            return
        fetch(source, partial, max_connections=max_connections, progress=False)
        with disk_errors(final):
            os.replace(partial, final)
