"""Uploads (models, checkpoints, pushes, outputs): a file of up to SINGLE_PUT bytes in one PUT
whose answered ETag must be its MD5; a larger one in parts, each checked (below). On the calls of
pipelines/clients/s3.py, its retry policy and its named errors.

By hand rather than boto3's transfer manager (`upload_file`), because that one trusts every
answer: it keeps whatever ETag an UploadPart answer carries and sends it back in
CompleteMultipartUpload, so one damaged answer (a proxy's, a flaky network's) fails the whole
upload at its very end ("InvalidPart ... the specified entity tag might not have matched"), after
every byte went up, with no retry. Here:

- each part is one PUT with its Content-MD5 (the server refuses a body damaged on the way) whose
  answered ETag must be that MD5 (where the store's ETags are MD5s: s3.is_md5): a part whose
  answer is wrong or lost is sent again, under the retry policy (s3.retried), on its own;
- CompleteMultipartUpload names each part by the MD5 we computed, not by what an answer said;
  should the store still refuse the parts (InvalidPart, InvalidPartOrder, NoSuchUpload), or
  answer an ETag other than the parts' (the MD5 of their MD5s, "-" and their count), the upload
  is aborted and made again from the start, up to RESTARTS times;
- a failure the budget does not fix aborts the upload (best effort), so no parts are left
  behind, and is raised as s3.retried names it.

The part size is the one boto3's transfer manager picks (its 8 MiB, grown to keep within S3's
10,000 parts), so an object's ETag is still what local_etag computes of the file.
"""

import base64
import contextlib
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kfvision.pipelines.clients import s3

SINGLE_PUT = 8 << 20  # files up to this size go up in one PUT whose ETag is checked
RESTARTS = 3  # whole uploads made again after the store refused the parts at completion
_REFUSED_PARTS = {"InvalidPart", "InvalidPartOrder", "NoSuchUpload"}


def upload(path: Path, bucket: str, key: str,
           max_connections: int = s3.DEFAULT_CONNECTIONS) -> None:
    """Upload the file `path` to `key`, retried under the policy. Up to SINGLE_PUT bytes: one PUT
    with its Content-MD5 (the server refuses a damaged body) whose answered ETag must be that
    MD5; larger: in parts, each checked against its own MD5 and sent again where its answer is
    wrong (the module doc), then its size and ETag checked with a HEAD."""
    uri = f"{s3.SCHEME}{bucket}/{key}"
    path = Path(path)
    size = path.stat().st_size
    if size > SINGLE_PUT:
        etag = upload_parts(path, bucket, key, max_connections)
        got = s3.head(uri)
        if got is None or got.size != size or (etag and got.etag != etag):
            raise s3.ObjectTransferError(f"{uri} holds {got and got.size} bytes (ETag "
                                      f"{got and got.etag}) after its upload, not the {size} of "
                                      f"{path} (ETag {etag}): push again.", s3.known_endpoint())
        return
    data = path.read_bytes()
    digest = hashlib.md5(data, usedforsecurity=False)

    def attempt() -> None:
        r = s3.client(max_connections).put_object(
            Bucket=bucket, Key=key, Body=data,
            ContentMD5=base64.b64encode(digest.digest()).decode())
        etag = r["ETag"].strip('"')
        if s3.is_md5(etag, r) and etag != digest.hexdigest():
            raise s3.BadBody(f"an answer with ETag {etag}, not the MD5 {digest.hexdigest()} of "
                           "what was sent")

    s3.retried(uri, "write", attempt)


def local_etag(path: Path) -> str:
    """The ETag `upload(path)` gives its object where the store's ETags are MD5s (a single PUT:
    the file's MD5; in parts: the MD5 of the parts' MD5s, "-" and their count, with the part
    size boto3's transfer manager picks), so a push can skip an object that is already there."""
    path = Path(path)
    size = path.stat().st_size
    if size <= SINGLE_PUT:
        return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()
    part = part_size(size)
    digests = []
    with open(path, "rb") as f:
        while chunk := f.read(part):
            digests.append(hashlib.md5(chunk, usedforsecurity=False).digest())
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def part_size(size: int) -> int:
    """The part size of a file of `size` bytes (boto3's transfer manager's, local_etag's)."""
    from boto3.s3.transfer import TransferConfig
    from s3transfer.utils import ChunksizeAdjuster

    return ChunksizeAdjuster().adjust_chunksize(TransferConfig().multipart_chunksize, size)


class _Refused(Exception):
    """The store refused the parts at completion, or completed another object: start over."""


def upload_parts(path: Path, bucket: str, key: str, max_connections: int) -> str:
    """Upload `path` to `key` in parts (see the module doc); returns the object's ETag.

    Raises:
        ObjectTransferError: every try of a part, or every restart, failed. Any other named
            error of s3.retried (access denied, no such bucket, ...).
    """
    uri = f"{s3.SCHEME}{bucket}/{key}"
    size = Path(path).stat().st_size
    step = part_size(size)
    spans = [(n + 1, off, min(step, size - off)) for n, off in enumerate(range(0, size, step))]
    client = s3.client(max_connections)
    last = None
    for _ in range(RESTARTS + 1):
        upload_id = s3.retried(uri, "write", lambda: client.create_multipart_upload(
            Bucket=bucket, Key=key)["UploadId"])
        try:
            with open(path, "rb") as f, ThreadPoolExecutor(
                    min(max_connections, len(spans)), thread_name_prefix="part") as pool:
                parts = list(pool.map(lambda s, u=upload_id: _part(
                    client, f.fileno(), uri, bucket, key, u, *s), spans))
            return _complete(client, uri, bucket, key, upload_id, parts)
        except _Refused as e:
            last = e
            _abort(client, bucket, key, upload_id)
        except BaseException:
            _abort(client, bucket, key, upload_id)
            raise
    raise s3.ObjectTransferError(
        f"cannot write {uri}: the store refused its parts at completion on each of "
        f"{RESTARTS + 1} uploads ({last}). Running the same command again may help.",
        s3.known_endpoint())


def _part(client, fd: int, uri: str, bucket: str, key: str, upload_id: str, number: int,
          offset: int, length: int) -> dict:
    """Part `number` sent and its answer checked (retried under the policy): its entry for
    CompleteMultipartUpload, with the MD5 we computed."""
    data = os.pread(fd, length, offset)
    digest = hashlib.md5(data, usedforsecurity=False)
    md5 = base64.b64encode(digest.digest()).decode()

    def attempt() -> str:
        r = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                               Body=data, ContentMD5=md5)
        etag = r["ETag"].strip('"')
        if s3.is_md5(etag, r) and etag != digest.hexdigest() or not etag:
            raise s3.BadBody(f"part {number}'s answer with ETag {etag!r}, not the MD5 "
                              f"{digest.hexdigest()} of what was sent")
        return etag, s3.is_md5(etag, r)

    etag, checked = s3.retried(f"{uri} (part {number})", "write", attempt)
    return {"PartNumber": number, "ETag": f'"{digest.hexdigest() if checked else etag}"',
            "md5": digest.digest(), "checked": checked}


def _complete(client, uri: str, bucket: str, key: str, upload_id: str, parts: list) -> str:
    """CompleteMultipartUpload of `parts`, retried; _Refused when the store refuses them or the
    object it made is not theirs. Returns the object's ETag."""
    from botocore.exceptions import ClientError

    want = (f"{hashlib.md5(b''.join(p['md5'] for p in parts), usedforsecurity=False).hexdigest()}"
            f"-{len(parts)}")
    listed = [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in parts]

    def attempt():
        try:
            return client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": listed})
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in _REFUSED_PARTS:
                return code
            raise

    r = s3.retried(uri, "write", attempt)
    if isinstance(r, str):
        got = s3.head(uri) if r == "NoSuchUpload" else None  # a retry after an answer was lost
        if got is not None and got.etag == want:
            return want
        raise _Refused(f"{r}")
    etag = r.get("ETag", "").strip('"')
    if all(p["checked"] for p in parts) and etag and etag != want and "-" in etag:
        raise _Refused(f"an object with ETag {etag}, not its parts' {want}")
    return etag


def _abort(client, bucket: str, key: str, upload_id: str) -> None:
    """Abort the upload (best effort: its parts are not left behind to be paid for)."""
    with contextlib.suppress(Exception):
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
