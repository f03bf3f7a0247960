"""The one object-storage layer: the `s3://` calls kfvision makes (AWS S3 and what speaks its API:
MinIO, Ceph RGW, SeaweedFS, the pipelines' own artifact store), and one mapping of their failures
onto the named errors. No other module imports boto3 (pipelines/clients/s3sync.py builds fetching,
pushing and the model cache on these calls).

boto3 rather than fsspec/s3fs: boto3 is what AWS documents and what KServe's storage initializer
and Kubeflow Trainer's initializers use, it reads the standard credential chain (environment,
`~/.aws/credentials` and `config`, web identity / IRSA) and `AWS_ENDPOINT_URL` /
`AWS_ENDPOINT_URL_S3` itself, and its errors carry the S3 error code we map below; s3fs would add
aiobotocore (pinned to one botocore) and an async layer for a job a thread pool does.

One mapping of failures, whichever command made the call (README, "Errors"):
    no such bucket                     NoSuchBucketError           2
    no such key, nothing under prefix  NoSuchObjectError           2
    nothing answered, timed out, 5xx   EndpointUnreachableError   69  (clients/endpoints.py)
    TLS handshake failed               EndpointTLSError           76
    no, wrong or expired credentials,  EndpointAuthError          77
    access denied
    object changed since listed        ChangedDatasetError         2
    any other refusal                  ObjectStoreError            2
Messages name the URI and the endpoint, never a credential.
"""
import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipelines.clients.endpoints import (
    EndpointAuthError,
    EndpointTLSError,
    EndpointUnreachableError,
)
from trainer.errors import ChangedDatasetError, InvalidParameterError, KfvisionError
from trainer.options import option

SCHEME = "s3://"
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
        DEFAULT_CONNECTIONS, "s3:// transfers at once", doc="Downloads and uploads to or "
        "from s3:// at once, and the connections kept open to the endpoint.", low=1, high=256)


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
    except NoSuchObjectError as e:  # listed a moment ago
        raise ChangedDatasetError(f"{uri} was removed while it was being fetched; fetch again "
                                  "once nothing writes to the source.") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return written


def upload(path: Path, bucket: str, key: str,
           max_connections: int = DEFAULT_CONNECTIONS) -> None:
    """Upload the file `path` to `key` (multipart for large files, as boto3 decides)."""
    with mapped(f"{SCHEME}{bucket}/{key}", "write"):
        client(max_connections).upload_file(str(path), bucket, key)


def delete(bucket: str, keys: list) -> None:
    """Delete `keys` (best effort: used to clean up; a failure is not raised)."""
    with contextlib.suppress(KfvisionError), mapped(f"{SCHEME}{bucket}/", "delete from"):
        for i in range(0, len(keys), 1000):
            client().delete_objects(Bucket=bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
