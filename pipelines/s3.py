"""The one object-storage layer: `s3://` sources and models (AWS S3 and what speaks its API:
MinIO, Ceph RGW, SeaweedFS, the pipelines' own artifact store). No other module imports boto3.

    fetch("s3://bucket/photos/", dest)          # every object under the prefix, into dest/
    fetch("s3://bucket/photos.tar.gz", dest)    # one object (an archive), into dest/
    push(model_dir, "s3://bucket/models/r18/")  # a folder up, every file under the prefix
    fetch_model("s3://bucket/models/r18/")      # a local copy in a cache keyed by the ETags

boto3 rather than fsspec/s3fs: boto3 is what AWS documents and what KServe's storage initializer
and Kubeflow Trainer's initializers use, it reads the standard credential chain (environment,
`~/.aws/credentials` and `config`, web identity / IRSA) and `AWS_ENDPOINT_URL` /
`AWS_ENDPOINT_URL_S3` itself, and its errors carry the S3 error code we map below; s3fs would add
aiobotocore (pinned to one botocore) and an async layer for a job a thread pool does.

A fetch is resumable and checked. Each object is downloaded to a hidden temporary name beside its
place (`.kfvision-part-...`: `convert` ignores hidden files, so a half-written file is never taken
for an image) and renamed into place when complete; then its key and ETag are appended to the
journal `dest/.kfvision-s3.jsonl`. A second fetch into the same folder downloads only objects the
journal does not list (nothing, when the first one finished); an object whose ETag differs from
the journal's, or that is gone, is a ChangedDatasetError. Every GET asks for the listed ETag
(`If-Match`), so an object rewritten between the listing and the download is caught too. The
listing is streamed page by page and at most 2 x `max_connections` downloads are in flight, each
streamed to disk in 1 MiB chunks: memory stays flat however many objects there are.

One mapping of failures, whichever command made the call (README, "Errors"):
    no such bucket                     NoSuchBucketError           2
    no such key, nothing under prefix  NoSuchObjectError           2
    nothing answered, timed out, 5xx   EndpointUnreachableError   69  (pipelines/connect.py)
    TLS handshake failed               EndpointTLSError           76
    no, wrong or expired credentials,  EndpointAuthError          77
    access denied
    object changed since listed        ChangedDatasetError         2
    any other refusal                  ObjectStoreError            2
Messages name the URI and the endpoint, never a credential.
"""

import contextlib
import hashlib
import json
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pipelines.connect import EndpointAuthError, EndpointTLSError, EndpointUnreachableError
from trainer.errors import ChangedDatasetError, InvalidParameterError, KfvisionError
from trainer.options import option

SCHEME = "s3://"
JOURNAL = ".kfvision-s3.jsonl"
PART = ".kfvision-part-"
CHUNK = 1 << 20
DEFAULT_CONNECTIONS = 16
AUTH_HINT = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
             "AWS_SESSION_TOKEN, AWS_PROFILE, or the pod's web identity) and that they may read "
             "and write this bucket")
# S3 error codes that mean "these credentials are not good (enough)" (AWS S3 API reference,
# "Error responses"; STS's ExpiredToken* for temporary credentials)
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
               "ExpiredTokenException", "TokenRefreshRequired", "InvalidToken",
               "InvalidClientTokenId", "AllAccessDisabled", "AccountProblem", "Forbidden"}


class ObjectStoreError(KfvisionError):
    """Object storage refused a request for a reason not named below; the message names the URI
    and the S3 error code."""


class NoSuchBucketError(ObjectStoreError):
    """The bucket of an `s3://` URI does not exist (at this endpoint)."""


class NoSuchObjectError(ObjectStoreError):
    """No object at an `s3://` URI, and nothing under it as a prefix."""


def is_s3(uri) -> bool:
    """Whether `uri` is an `s3://` URI (any letter case of the scheme)."""
    return isinstance(uri, str) and uri[:len(SCHEME)].lower() == SCHEME


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, key) of `s3://bucket/key`; the key may be '' or end with '/' (a prefix)."""
    if not is_s3(uri):
        raise InvalidParameterError(f"{uri!r} is not an s3:// URI (s3://BUCKET/KEY).")
    bucket, _, key = uri[len(SCHEME):].partition("/")
    if not bucket:
        raise InvalidParameterError(f"{uri!r} names no bucket: write s3://BUCKET/KEY.")
    return bucket, key


def endpoint() -> str:
    """The endpoint boto3 talks to, for messages: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (or a
    profile's endpoint_url), else AWS's own."""
    return client().meta.endpoint_url


@dataclass(frozen=True)
class S3Options:
    """The options of every command that reads or writes `s3://` (declared once, here)."""

    max_connections: int = option(
        DEFAULT_CONNECTIONS, "downloads (and uploads) to or from s3:// at once, and the "
        "connections kept open to the endpoint", low=1, high=256)


@dataclass(frozen=True, slots=True)
class Obj:
    key: str
    size: int
    etag: str


_clients: dict = {}
_clients_lock = threading.RLock()


def client(max_connections: int = DEFAULT_CONNECTIONS):
    """A boto3 S3 client with `max_connections` pooled connections (one per setting and
    process; boto3 clients are thread-safe, sessions are not)."""
    with _clients_lock:
        if max_connections not in _clients:
            with mapped("s3://", "connect to"):
                import boto3
                from botocore.config import Config

                _clients[max_connections] = boto3.session.Session().client("s3", config=Config(
                    max_pool_connections=max_connections, connect_timeout=10, read_timeout=60,
                    retries={"max_attempts": 3, "mode": "standard"}))
        return _clients[max_connections]


def reset_clients() -> None:
    """Forget the clients made so far (after the environment's endpoint or credentials changed:
    tests)."""
    with _clients_lock:
        _clients.clear()


def _error(e: Exception, uri: str, doing: str) -> KfvisionError | None:
    """The named error of a boto3/botocore failure while `doing` `uri`, or None."""
    from botocore import exceptions as bx

    made = list(_clients.values())
    where = made[0].meta.endpoint_url if made else "the S3 endpoint"
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError,
                      bx.CredentialRetrievalError)):
        return EndpointAuthError(f"cannot {doing} {uri}: no usable AWS credentials ({e}); "
                                 f"{AUTH_HINT}.", where)
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return NoSuchBucketError(f"no bucket {split_uri(uri)[0]!r} at {where} (for {uri}): "
                                     "check the name and the endpoint (AWS_ENDPOINT_URL).")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return NoSuchObjectError(f"no object {uri} at {where}: check the key.")
        if code in _AUTH_CODES or status in (401, 403):
            return EndpointAuthError(f"{where} refused to {doing} {uri} ({code or status}: "
                                     f"{err.get('Message', '')}); {AUTH_HINT}.", where)
        if code == "PreconditionFailed" or status == 412:
            return ChangedDatasetError(f"{uri} changed while it was being fetched (its ETag is "
                                       "no longer the listed one); fetch again once nothing "
                                       "writes to it.")
        if isinstance(status, int) and status >= 500:
            return EndpointUnreachableError(f"{where} failed to {doing} {uri} (HTTP {status} "
                                            f"{code}); running the command again may help.", where)
        return ObjectStoreError(f"{where} refused to {doing} {uri} ({code or status}: "
                                f"{err.get('Message', '')}).")
    if isinstance(e, bx.SSLError):
        return EndpointTLSError(f"TLS with {where} failed ({e}): trust its certificate authority "
                                "(AWS_CA_BUNDLE) or use its http:// address.", where)
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionClosedError,
                      bx.ConnectTimeoutError, bx.ReadTimeoutError,
                      bx.ResponseStreamingError)):
        return EndpointUnreachableError(
            f"cannot {doing} {uri}: nothing answered at {where} ({type(e).__name__}). Check "
            "AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and that the server runs; running the "
            "command again may help once it answers.", where)
    if isinstance(e, bx.ParamValidationError):
        return InvalidParameterError(f"{uri} is not a valid S3 location ({e}).")
    if isinstance(e, (bx.NoRegionError, bx.ProfileNotFound, bx.InvalidConfigError)):
        return InvalidParameterError(f"cannot {doing} {uri}: the AWS configuration is not usable "
                                     f"({e}); check AWS_PROFILE, AWS_REGION and ~/.aws/config.")
    return None


@contextlib.contextmanager
def mapped(uri: str, doing: str):
    """Turn boto3/botocore failures inside the block into named errors (the module doc's table)."""
    try:
        yield
    except KfvisionError:
        raise
    except Exception as e:
        err = _error(e, uri, doing)
        if err is None:
            raise
        raise err from e


def head(uri: str) -> Obj | None:
    """The object at `uri`, or None when there is none (the bucket must exist)."""
    from botocore.exceptions import ClientError

    bucket, key = split_uri(uri)
    with mapped(uri, "read"):
        try:
            r = client().head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
            r = None
    if r is None:
        check_bucket(uri)
        return None
    return Obj(key, r["ContentLength"], r["ETag"].strip('"'))


def check_bucket(uri: str) -> None:
    """NoSuchBucketError unless the bucket of `uri` exists (a HEAD answers 404 with no code)."""
    bucket, _ = split_uri(uri)
    try:
        with mapped(uri, "read"):
            client().head_bucket(Bucket=bucket)
    except NoSuchObjectError as e:
        raise NoSuchBucketError(f"no bucket {bucket!r} at {endpoint()} (for {uri}): check the "
                                "name and the endpoint (AWS_ENDPOINT_URL).") from e


def list_objects(uri: str, max_connections: int = DEFAULT_CONNECTIONS) -> Iterator[Obj]:
    """The objects under the prefix of `uri`, page by page (1,000 at a time), in key order."""
    bucket, prefix = split_uri(uri)
    with mapped(uri, "list"):
        pages = client(max_connections).get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", ()):
                yield Obj(o["Key"], o["Size"], o["ETag"].strip('"'))


def download(obj: Obj, bucket: str, target: Path, max_connections: int = DEFAULT_CONNECTIONS,
             on_bytes=None) -> int:
    """Download `obj` (as listed: its ETag is asked for) to `target`, through a hidden temporary
    file renamed into place when complete; returns the bytes written."""
    uri = f"{SCHEME}{bucket}/{obj.key}"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{PART}{uuid.uuid4().hex[:8]}-{target.name}"
    written = 0
    try:
        with mapped(uri, "download"):
            body = client(max_connections).get_object(Bucket=bucket, Key=obj.key,
                                                       IfMatch=f'"{obj.etag}"')["Body"]
            with open(tmp, "wb") as f:
                for chunk in body.iter_chunks(CHUNK):
                    f.write(chunk)
                    written += len(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return written


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
            head = json.loads(lines[0]) if lines else {}
            if head.get("source") != uri:
                raise InvalidParameterError(
                    f"{folder} holds a fetch of {head.get('source')!r}, not of {uri}: give a new "
                    "folder, or remove it.")
            for line in lines[1:]:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    d = json.loads(line)
                    self.done[d["path"]] = (d["etag"], d["bytes"])
        else:
            folder.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"source": uri}) + "\n", encoding="utf-8")
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def add(self, rel: str, obj: Obj) -> None:
        with self._lock:
            self._f.write(json.dumps({"path": rel, "etag": obj.etag, "bytes": obj.size}) + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def _changed(uri: str, what: str, folder: Path) -> ChangedDatasetError:
    return ChangedDatasetError(
        f"{uri} {what} since it was fetched into {folder}. Use the data as it was (point "
        "the source at an unchanged copy), or fetch anew: remove that folder (or give another) "
        "and run again.")


def _stale_parts(folder: Path) -> None:
    """Remove temporary files a killed fetch left behind."""
    for d, _, files in os.walk(folder):
        for name in files:
            if name.startswith(PART):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))


def fetch(uri: str, dest, *, max_connections: int = DEFAULT_CONNECTIONS,
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
        EndpointAuthError, ObjectStoreError.
    """
    from trainer.options import options_of

    options_of(S3Options)[0].check(max_connections)
    bucket, key = split_uri(uri)
    dest = Path(dest)
    one = head(uri) if key and not key.endswith("/") else None
    if one is not None:
        name = PurePosixPath(key).name
        objects, prefix = iter([one]), key[:len(key) - len(name)]
        result = Fetched(uri, dest / name)
    else:
        prefix = key if not key or key.endswith("/") else key + "/"
        objects = list_objects(f"{SCHEME}{bucket}/{prefix}", max_connections)
        result = Fetched(uri, dest)
    journal = _Journal(dest, uri)
    try:
        _stale_parts(dest)
        _download_all(objects, bucket, prefix, dest, journal, result, max_connections, progress)
    finally:
        journal.close()
    gone = set(journal.done) - set(result.etags)
    if gone:
        raise _changed(f"{SCHEME}{bucket}/{prefix}{sorted(gone)[0]}",
                       f"was removed ({len(gone)} object(s) gone)", dest)
    if not result.objects:
        if not result.listed:
            raise NoSuchObjectError(f"nothing under {SCHEME}{bucket}/{prefix} at {endpoint()} "
                                    "(an empty prefix, or no such key): check the path.")
        raise NoSuchObjectError(f"{uri} holds only folder markers or hidden objects, nothing "
                                "to use.")
    return result


def _download_all(objects, bucket: str, prefix: str, dest: Path, journal: _Journal,
                  result: Fetched, max_connections: int, progress) -> None:
    """Download what `journal` does not hold yet, `max_connections` at a time."""
    from trainer.progress import progress_bar

    bar = progress_bar(None, "fetch", "B", progress)
    update = getattr(bar, "update", None)
    if update is not None:
        bar.unit_scale = True
    count_lock = threading.Lock()

    def one(obj: Obj, rel: str) -> None:
        n = download(obj, bucket, dest / rel, max_connections, on_bytes=update)
        journal.add(rel, obj)
        with count_lock:
            result.fetched_objects += 1
            result.fetched_bytes += n

    pending: set = set()
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
                if len(pending) >= 2 * max_connections:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        f.result()
                pending.add(pool.submit(one, obj, rel))
            for f in pending:
                f.result()
        except BaseException:
            for f in pending:
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


def push(folder, uri: str, *, max_connections: int = DEFAULT_CONNECTIONS, skip=(),
         last: str | None = None, overwrite: bool = False) -> list[str]:
    """Upload every file under `folder` to the prefix `uri` (keeping the paths below it; not
    those under a top-level folder named in `skip`), the file `last` after all others; returns
    the keys written. A prefix that holds objects is refused unless `overwrite` (then the old
    objects not written again are deleted at the end). On a failure the objects written so far
    are deleted again, so nothing half-written stays at `uri`."""
    folder = Path(folder)
    bucket, key = split_uri(uri)
    prefix = key if not key or key.endswith("/") else key + "/"
    old = [o.key for o in list_objects(f"{SCHEME}{bucket}/{prefix}")]
    if old and not overwrite:
        raise ObjectStoreError(f"{SCHEME}{bucket}/{prefix} already holds {len(old)} object(s): "
                               "give a new prefix, or replace them (--overwrite).")
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and p.relative_to(folder).parts[0] not in skip)
    rest = [p for p in files if p.relative_to(folder).as_posix() != last]
    final = [p for p in files if p not in rest]
    written: list[str] = []
    lock = threading.Lock()

    def up(path: Path) -> None:
        k = prefix + path.relative_to(folder).as_posix()
        with mapped(f"{SCHEME}{bucket}/{k}", "write"):
            client(max_connections).upload_file(str(path), bucket, k)
        with lock:
            written.append(k)

    try:
        for batch in (rest, final):
            with ThreadPoolExecutor(max_connections, thread_name_prefix="kfvision-s3") as pool:
                for f in [pool.submit(up, p) for p in batch]:
                    f.result()
    except BaseException:
        _delete(bucket, written)
        raise
    _delete(bucket, sorted(set(old) - set(written)))
    return sorted(written)


def _delete(bucket: str, keys: list) -> None:
    with contextlib.suppress(KfvisionError), mapped(f"{SCHEME}{bucket}/", "delete from"):
        for i in range(0, len(keys), 1000):
            client().delete_objects(Bucket=bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})


def cache_root(environ=None) -> Path:
    """Where fetched models are kept: $XDG_CACHE_HOME/kfvision/s3 (~/.cache/kfvision/s3)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kfvision" / "s3"


def fetch_model(uri: str, *, cache: Path | None = None,
                max_connections: int = DEFAULT_CONNECTIONS) -> Path:
    """The local copy of the model at `uri`: a prefix (a model directory) or one object (an
    ONNX export). Fetched once into `cache` (default `cache_root()`), in a folder keyed by its
    objects' keys and ETags: the same model again costs one request, a changed one gets a new
    folder."""
    bucket, key = split_uri(uri)
    one = head(uri) if key and not key.endswith("/") else None
    if one is not None:
        source, listed = uri, [(one.key, one.etag)]
    else:
        prefix = key if not key or key.endswith("/") else key + "/"
        source = f"{SCHEME}{bucket}/{prefix}"
        listed = sorted((o.key, o.etag) for o in list_objects(source))
        if not listed:
            raise NoSuchObjectError(f"no model at {uri} ({endpoint()}): check the path (upload "
                                    "one with `kfvision push DIR URI`).")
    digest = hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16]
    root = (cache or cache_root()) / bucket / key.strip("/").replace("/", "__")
    final = root / digest
    name = PurePosixPath(key).name if one is not None else ""
    if not (final / JOURNAL).exists():
        tmp = root / f".{digest}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            fetch(source, tmp, max_connections=max_connections, progress=False)
            if not final.exists():  # else another process got there first: the same objects
                os.replace(tmp, final)
        finally:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
    return final / name if name else final
