"""Downloads, the GET counterpart of pipelines/clients/s3put.py's uploads: one listed object into
a file, through a hidden part file (s3.PART) renamed into place once its size, ETag and (where
the ETag is one) MD5 are checked, so a file at the object's name is always whole; the listed
ETag is asked for (If-Match: an object rewritten since it was listed is ChangedDatasetError);
every try under s3's retry policy and named errors (s3.retried). Its GET is obstore's
(pipelines/clients/s3obstore.py) where obstore checks what botocore would, botocore's
(pipelines/clients/s3get.py) for the rest.

Called from threads: s3sync's pool, the node fetcher's (pipelines/clients/nodefetch.py), the
model cache. An asyncio loop on obstore's get_async was built and measured in their place and
not kept (docs/data.md, "Requests in flight, and which client").
"""

import contextlib
import hashlib
import os
import uuid
from pathlib import Path

from kfvision.pipelines.clients import s3
from kfvision.trainer.errors import ChangedDatasetError
from kfvision.trainer.fileio import disk_errors


def download(obj: s3.Obj, bucket: str, target: Path,
             max_connections: int = s3.DEFAULT_CONNECTIONS, on_bytes=None) -> int:
    """Download `obj` (as listed: its ETag is asked for) to `target`, through a hidden temporary
    file renamed into place once its size, ETag and (where the ETag is one) MD5 are checked;
    retried under the policy. Returns the bytes written.

    Raises:
        ChangedDatasetError: the object changed or went since it was listed. ObjectTransferError:
            no try of the budget brought it whole. OutputError: the local disk is full.
    """
    uri, tmp = _places(obj, bucket, target)

    def attempt() -> int:
        written = 0
        try:
            getter, store = s3.getters(bucket, max_connections)
            r = None
            if store is not None and store.takes(obj.key, obj.etag):
                r = store.get_object(obj.key, f'"{obj.etag}"')  # None: redirected
            r = r or getter.get_object(obj.key, f'"{obj.etag}"')
            md5 = _md5_of(obj, r)
            with disk_errors(target, obj.size), open(tmp, "wb") as f:
                for chunk in r["Body"].iter_chunks(s3.CHUNK):
                    f.write(chunk)
                    written += len(chunk)
                    if md5 is not None:
                        md5.update(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
            if _bad_md5(obj, written, md5) and not _encrypted(r, uri, obj):
                raise s3.BadBody(_bad_md5(obj, written, md5))
        except BaseException:
            if on_bytes and written:
                on_bytes(-written)  # the progress bar counts this try's bytes again
            raise
        with disk_errors(target, obj.size):
            os.replace(tmp, target)
        return written

    with _cleaned(tmp, uri):
        return s3.retried(uri, "download", attempt)


def _places(obj: s3.Obj, bucket: str, target: Path) -> tuple[str, Path]:
    """The object's URI (for messages) and the hidden part file beside `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return (f"{s3.SCHEME}{bucket}/{obj.key}",
            target.parent / f"{s3.PART}{uuid.uuid4().hex[:8]}-{target.name}")


@contextlib.contextmanager
def _cleaned(tmp: Path, uri: str):
    """A failed download leaves no part file (a whole one was renamed: no unlink per object);
    an object gone since it was listed is ChangedDatasetError."""
    try:
        try:
            yield
        except s3.NoSuchObjectError as e:  # listed a moment ago
            raise ChangedDatasetError(f"{uri} was removed while it was being fetched; fetch "
                                      "again once nothing writes to the source.") from e
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _md5_of(obj: s3.Obj, answer: dict):
    """A fresh MD5 where the answer's ETag is one (checked to be the listed ETag first: a stale
    cache or proxy answers with another; the server itself checked If-Match), else None."""
    etag = answer["ETag"].strip('"')
    if etag != obj.etag:
        raise s3.BadBody(f"an answer with ETag {etag}, not the listed {obj.etag}")
    return hashlib.md5(usedforsecurity=False) if s3.is_md5(etag, answer) else None


def _bad_md5(obj: s3.Obj, written: int, md5) -> str:
    """A body of the wrong size raised; one whose MD5 is not the ETag said ('' when it is, or
    when the ETag is no MD5): the caller asks whether the object is encrypted."""
    if written != obj.size:
        raise s3.BadBody(f"a body of {written} bytes, not {obj.size}")
    if md5 is not None and md5.hexdigest() != obj.etag:
        return f"a body whose MD5 {md5.hexdigest()} is not its ETag {obj.etag}"
    return ""


def _encrypted(answer: dict, uri: str, obj: s3.Obj) -> bool:
    """Whether an answer whose encryption headers were not known (obstore's) is of an object
    encrypted with KMS or a customer key, whose ETag is no MD5: asked by HEAD."""
    if not answer.get("Unsure"):
        return False
    bucket, key = s3.split_uri(uri)
    head = s3.client().head_object(Bucket=bucket, Key=key, IfMatch=f'"{obj.etag}"')
    return not s3.is_md5(obj.etag, head)
