"""Downloads, the GET counterpart of pipelines/clients/s3put.py's uploads: one listed object into
a file, through a hidden part file (s3.PART) renamed into place once its size, ETag and (where
the ETag is one) MD5 are checked, so a file at the object's name is always whole; the listed
ETag is asked for (If-Match: an object rewritten since it was listed is ChangedDatasetError);
every try under s3's retry policy and named errors (s3.retried).

Two ways in, one set of checks:
- `download`, from a thread (s3sync's pool, the model cache, a checkpoint restored);
- `download_async`, from an asyncio loop: the node fetcher's (pipelines/clients/nodefetch.py),
  which keeps its GETs in flight from one thread, each awaiting obstore's get_async (the
  request, its connection and body in obstore's Rust runtime) while the loop does the Python
  work of the others: a thread per GET cost more client CPU per image in handing the
  interpreter's lock between threads than the GET itself (docs/data.md, "Requests in flight").
  What obstore does not take (s3obstore's `takes`: an ETag that is no MD5, a key it cannot name,
  a redirected bucket) is `download` in the loop's executor, botocore's GET as before.
"""

import asyncio
import contextlib
import hashlib
import os
import uuid
from pathlib import Path

from kfvision.pipelines.clients import s3
from kfvision.trainer.errors import ChangedDatasetError
from kfvision.trainer.fileio import disk_errors

WHOLE = 1 << 20  # a body this small is read in one await, a larger one in s3.CHUNK chunks


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


async def download_async(obj: s3.Obj, bucket: str, target: Path,
                         max_connections: int = s3.DEFAULT_CONNECTIONS, on_bytes=None) -> int:
    """`download` awaited in an asyncio loop (obstore's GET; what it does not take, `download`
    in the loop's executor). The same checks, retries and errors."""
    uri, tmp = _places(obj, bucket, target)
    with s3.mapped(uri, "download"):
        _, store = s3.getters(bucket, max_connections)
    if store is None or not store.takes(obj.key, obj.etag):
        return await _in_thread(obj, bucket, target, max_connections, on_bytes)

    async def attempt() -> int | None:
        r = await store.get_object_async(obj.key, f'"{obj.etag}"')
        if r is None:  # the bucket redirected: botocore's GET from now on
            return None
        md5 = _md5_of(obj, r)
        written = 0
        if obj.size <= WHOLE:
            data = await r["Body"].read_async()
            with disk_errors(target, obj.size), open(tmp, "wb") as f:
                written = f.write(data)
            if md5 is not None:
                md5.update(data)
        else:
            with disk_errors(target, obj.size), open(tmp, "wb") as f:
                async for chunk in r["Body"].iter_chunks_async(s3.CHUNK):
                    written += f.write(chunk)
                    if md5 is not None:
                        md5.update(chunk)
        if _bad_md5(obj, written, md5) and not await asyncio.get_running_loop().run_in_executor(
                None, _encrypted, r, uri, obj):
            raise s3.BadBody(_bad_md5(obj, written, md5))
        with disk_errors(target, obj.size):
            os.replace(tmp, target)
        if on_bytes:  # a progress bar: counted once the object is whole
            on_bytes(written)
        return written

    with _cleaned(tmp, uri):
        got = await s3.retried_async(uri, "download", attempt)
    return (got if got is not None
            else await _in_thread(obj, bucket, target, max_connections, on_bytes))


def run(coroutine):
    """asyncio.run(coroutine), in a thread of its own where this one already runs a loop (a
    notebook's): s3sync's fetch of a prefix, called from anywhere."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _in_thread(obj: s3.Obj, bucket: str, target: Path, max_connections: int,
                     on_bytes) -> int:
    return await asyncio.get_running_loop().run_in_executor(None, download, obj, bucket, target,
                                                            max_connections, on_bytes)


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
