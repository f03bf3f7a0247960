"""The one object-storage layer: the `s3://` calls kfvision makes (AWS S3 and what speaks its API:
MinIO, Ceph RGW, SeaweedFS, the pipelines' own artifact store), and one mapping of their failures
onto the named errors. No other module imports boto3 (pipelines/clients/s3sync.py builds fetching,
pushing and the model cache on these calls; pipelines/clients/s3download.py is `download`:
one object into a file, checked; pipelines/clients/s3obstore.py is their
GetObject, on the Rust obstore client, configured from botocore's and failing as botocore does;
pipelines/clients/s3get.py is botocore's request and signature without its per-call work, for
the objects obstore does not take; pipelines/clients/s3put.py is `upload`: one checked PUT, or
parts each checked against its own MD5).

boto3 rather than fsspec/s3fs: boto3 is what AWS documents and what KServe's storage initializer
and Kubeflow Trainer's initializers use, it reads the standard credential chain (environment,
`~/.aws/credentials` and `config`, web identity / IRSA) and `AWS_ENDPOINT_URL` /
`AWS_ENDPOINT_URL_S3` itself, and its errors carry the S3 error code we map below; s3fs would add
aiobotocore (pinned to one botocore) and an async layer for a job a thread pool does.

One mapping of failures, whichever command made the call (docs/cli.md, "Errors"):
    no such bucket                     NoSuchBucketError           2
    no such key, nothing under prefix  NoSuchObjectError           2
    nothing answered, timed out, 5xx   EndpointUnreachableError   69  (clients/endpoints.py)
    a body that broke, came short, or   ObjectTransferError        69
    with the wrong ETag, throttling,
    on every try of the retry budget
    TLS handshake failed               EndpointTLSError           76
    no, wrong or expired credentials,  EndpointAuthError          77
    access denied
    object changed since listed        ChangedDatasetError         2
    any other refusal                  ObjectStoreError            2
Messages name the URI and the endpoint, never a credential.

Retries are ours, not botocore's (its own are switched off): botocore retries a request whose
answer never came, but not a body that breaks while it is read (IncompleteReadError,
ResponseStreamingError, a read timeout mid-body), and a body that comes short or with another
ETag is no error to it at all. Here every call (a whole GET: request, body, size and ETag
check) is one try, and a try that fails in a way another may fix (throttled, 5xx, reset, cut
short, stalled, wrong bytes) is repeated under one `RetryPolicy`: exponential backoff with full
jitter, a bounded number of tries and a bounded total time (docs/data.md, "Object storage").
"""
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kfvision.pipelines.clients.endpoints import (
    EndpointAuthError,
    EndpointTLSError,
    EndpointUnreachableError,
)
from kfvision.trainer.errors import ChangedDatasetError, InvalidParameterError, KfvisionError
from kfvision.trainer.options import option

SCHEME = "s3://"
PART = ".kfvision-part-"
CHUNK = 1 << 20
DEFAULT_CONNECTIONS = 16
AUTH_HINT = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
             "AWS_SESSION_TOKEN, AWS_PROFILE, or the pod's web identity) and that they may read "
             "and write this bucket")
# The keys of an S3 credentials Secret (the pipeline's s3_secret, a job's --s3-credentials), each
# given to a pod as the variable of its name: boto3's standard environment (botocore 1.44.5
# botocore/configprovider.py and credentials.py). The endpoint travels with them, never as a
# plain value in a manifest.
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                  "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")
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


class ObjectTransferError(EndpointUnreachableError):
    """Object storage answered, but every try of the retry budget failed in a way another try
    might fix: throttled (503 SlowDown), a 5xx, a body that broke off, came short, stalled, or
    came with an ETag other than the listed one. Exit 69: running the command again resumes."""


@dataclass(frozen=True)
class RetryPolicy:
    """How every object-storage call is retried (the one place: docs/data.md shows it).

    Try n (0, 1, ...) that fails in a way another may fix is followed, after a random wait in
    [0, min(cap_s, base_s * 2**n)] ("full jitter": clients that failed together do not come
    back together), by try n + 1; at most `attempts` tries, and none that would start more than
    `total_s` after the first. Timeouts apply to each try: connecting, and each read of the
    answer (a body that stalls longer than `read_timeout_s` is a failed try)."""

    attempts: int = 8
    base_s: float = 0.2
    cap_s: float = 10.0
    total_s: float = 60.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def wait(self, n: int) -> float:
        """The backoff before try n + 1 (after try n failed)."""
        return random.uniform(0.0, min(self.cap_s, self.base_s * 2 ** n))  # noqa: S311


_policy = RetryPolicy()


def retry_policy() -> RetryPolicy:
    """The policy every call uses."""
    return _policy


def set_retry_policy(policy: RetryPolicy) -> RetryPolicy:
    """Use `policy` from now on (the clients are made anew: their timeouts come from it);
    returns the one it replaces."""
    global _policy
    old, _policy = _policy, policy
    reset_clients()
    return old


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
_credentials: dict = {}  # max_connections -> the credentials its client signs with
# botocore's data loader, shared by every session this process makes: the S3 model it parsed
# (MBs of JSON, which never change) outlives reset_clients (a client made again: 115 -> 15 ms)
_loader = None
_getters: dict = {}  # (max_connections, bucket) -> s3get.Getter: GetObject without its overhead
_clients_lock = threading.RLock()


def client(max_connections: int = DEFAULT_CONNECTIONS):
    """An S3 client with `max_connections` pooled connections (one per setting and process;
    clients are thread-safe, sessions are not). botocore's own, as boto3 makes it (the same
    credential chain and configuration) without importing boto3: 30 ms of a fetch's start."""
    global _loader
    with _clients_lock:
        if max_connections not in _clients:
            with mapped("s3://", "connect to"):
                import botocore.session
                from botocore.config import Config

                session = botocore.session.get_session()
                if _loader is None:
                    _loader = session.get_component("data_loader")
                session.register_component("data_loader", _loader)
                session.get_component("response_parser_factory").set_parser_defaults(
                    timestamp_parser=_timestamp)
                # botocore's own retries off: `retried` does them all, under one policy
                _clients[max_connections] = session.create_client("s3", config=Config(
                    max_pool_connections=max_connections,
                    connect_timeout=_policy.connect_timeout_s,
                    read_timeout=_policy.read_timeout_s,
                    retries={"total_max_attempts": 1, "mode": "standard"}))
                _credentials[max_connections] = session.get_credentials()  # the client's own
        return _clients[max_connections]


def _timestamp(text: str):
    """A timestamp of an answer (a listing's LastModified, per object) as botocore parses it, a
    UTC datetime: ISO 8601 by the standard library (dateutil took 24 us each), any other form by
    botocore."""
    from datetime import datetime

    if isinstance(text, str) and len(text) >= 20 and text[10:11] == "T" and text[-1] == "Z":
        with contextlib.suppress(ValueError):  # "Z" is ISO to Python 3.11 on
            return datetime.fromisoformat(text)
    from botocore.utils import parse_timestamp

    return parse_timestamp(text)


def getters(bucket: str, max_connections: int):
    """The GetObject of `bucket` that skips botocore's per-call work (pipelines/clients/
    s3get.py), made once per client and bucket (its first call asks botocore for a template),
    and the obstore store made from it (pipelines/clients/s3obstore.py; None where obstore
    cannot make botocore's request)."""
    with _clients_lock:
        if (max_connections, bucket) not in _getters:
            from kfvision.pipelines.clients.s3get import Getter
            from kfvision.pipelines.clients.s3obstore import Store

            c, creds = client(max_connections), _credentials[max_connections]
            getter = Getter(c, bucket, creds)
            _getters[max_connections, bucket] = getter, Store.make(
                c, bucket, getter.template, creds, _policy, max_connections)
        return _getters[max_connections, bucket]


def reset_clients() -> None:
    """Forget the clients made so far (after the environment's endpoint or credentials changed:
    tests), and any backoff a throttled call asked of the process."""
    global _throttled_until
    _throttled_until = 0.0
    with _clients_lock:
        _clients.clear()
        _credentials.clear()
        _getters.clear()


def _error(e: Exception, uri: str, doing: str) -> KfvisionError | None:
    """The named error of a boto3/botocore failure while `doing` `uri`, or None."""
    from botocore import exceptions as bx

    where = known_endpoint()
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


# S3 error codes that ask the client to slow down or try again (AWS S3 API reference, "Error
# responses"; botocore's retryhandler.py lists the same for its own retries)
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
                    "RequestThrottled", "RequestLimitExceeded", "TooManyRequestsException",
                    "RequestTimeout", "RequestTimeoutException", "InternalError",
                    "ServiceUnavailable", "BadDigest", "IncompleteBody"}


_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
                   "RequestThrottled", "RequestLimitExceeded", "TooManyRequestsException"}
_throttled_until = 0.0  # time.monotonic() before which no try starts: the store said slow down


def _throttling(e: BaseException) -> bool:
    """Whether `e` is the store asking to slow down (503 SlowDown, 429, Throttling...)."""
    from botocore.exceptions import ClientError

    if not isinstance(e, ClientError):
        return False
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(e.response.get("Error", {}).get("Code", "")) in _THROTTLE_CODES or status == 429


def _pause_while_throttled() -> None:
    """Wait out the backoff of a throttled call of this process, whichever thread made it."""
    left = _throttled_until - time.monotonic()
    if left > 0:
        time.sleep(left)


class BadBody(Exception):
    """A GET or PUT whose answer came but is not the object: short, or another ETag or MD5."""


def _transient(e: BaseException) -> bool:
    """Whether another try may succeed where this one failed with `e`."""
    import http.client

    from botocore import exceptions as bx
    from urllib3.exceptions import ProtocolError
    from urllib3.exceptions import TimeoutError as Urllib3Timeout

    if isinstance(e, BadBody):
        return True
    if isinstance(e, bx.ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _TRANSIENT_CODES or status == 429 or (isinstance(status, int)
                                                             and status >= 500)
    if isinstance(e, bx.SSLError):  # a certificate does not get better by asking again
        return False
    return isinstance(e, (bx.HTTPClientError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                          bx.IncompleteReadError, bx.ResponseStreamingError,
                          bx.FlexibleChecksumError, ProtocolError,
                          Urllib3Timeout, http.client.HTTPException, ConnectionError,
                          TimeoutError))


def _what_failed(e: BaseException) -> str:
    """A few words on a failed try, for the error after the last one."""
    from botocore import exceptions as bx

    if isinstance(e, BadBody):
        return str(e)
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(err.get("Code", ""))
        return f"HTTP {status}" + (f" {code}" if code and code != str(status) else "")
    if isinstance(e, bx.ReadTimeoutError):
        return f"no answer within the read timeout ({_policy.read_timeout_s:g} s)"
    return f"{type(e).__name__}: {str(e).rstrip('.')}"


def retried(uri: str, doing: str, attempt):
    """attempt() under the retry policy; its failures, and the last of a spent budget, as named
    errors (the module doc's table). Throttling slows the whole process: after a 503 SlowDown
    (or 429, Throttling) no call of any thread starts a try until that call's backoff is over,
    so many requests in flight back off together rather than each asking again at once."""
    policy, start = _policy, time.monotonic()
    with mapped(uri, doing):
        for n in range(policy.attempts):
            try:
                _pause_while_throttled()
                return attempt()
            except Exception as e:
                time.sleep(_after_failure(e, n, policy, start, uri, doing))
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover


def _after_failure(e: Exception, n: int, policy: RetryPolicy, start: float, uri: str,
                   doing: str) -> float:
    """The wait before the try after try `n` failed with `e`; raises `e` (not one another try
    may fix) or the named error of a spent budget."""
    from botocore import exceptions as bx

    global _throttled_until
    if isinstance(e, KfvisionError) or not _transient(e):
        raise e
    wait = policy.wait(n)
    spent = time.monotonic() - start
    if n + 1 >= policy.attempts or spent + wait > policy.total_s:
        tries = f"{n + 1} tr{'y' if n == 0 else 'ies'} over {spent:.1f} s"
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
            err = _error(e, uri, doing)
            raise type(err)(f"{err} ({tries})", err.endpoint) from e
        raise ObjectTransferError(
            f"cannot {doing} {uri}: {_what_failed(e)}, on the last of {tries} (the retry "
            "budget: docs/data.md, 'Object storage'). Running the same command again resumes: "
            "what is done is kept.", known_endpoint()) from e
    if _throttling(e):
        _throttled_until = max(_throttled_until, time.monotonic() + wait)
    return wait


def known_endpoint() -> str:
    """The endpoint of the clients made so far, for messages (none made: "the S3 endpoint")."""
    made = list(_clients.values())
    return made[0].meta.endpoint_url if made else "the S3 endpoint"


def head(uri: str) -> Obj | None:
    """The object at `uri`, or None when there is none (the bucket must exist)."""
    from botocore.exceptions import ClientError

    bucket, key = split_uri(uri)

    def attempt():
        try:
            return client().head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
            return None

    r = retried(uri, "read", attempt)
    if r is None:
        check_bucket(uri)
        return None
    return Obj(key, r["ContentLength"], r["ETag"].strip('"'))


def check_bucket(uri: str) -> None:
    """NoSuchBucketError unless the bucket of `uri` exists (a HEAD answers 404 with no code)."""
    bucket, _ = split_uri(uri)
    try:
        retried(uri, "read", lambda: client().head_bucket(Bucket=bucket))
    except NoSuchObjectError as e:
        raise NoSuchBucketError(f"no bucket {bucket!r} at {endpoint()} (for {uri}): check the "
                                "name and the endpoint (AWS_ENDPOINT_URL).") from e


def list_objects(uri: str, max_connections: int = DEFAULT_CONNECTIONS) -> Iterator[Obj]:
    """The objects under the prefix of `uri`, page by page (1,000 at a time), in key order; each
    page is one call under the retry policy."""
    bucket, prefix = split_uri(uri)
    args = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = retried(uri, "list", lambda a=dict(args): client(max_connections)
                       .list_objects_v2(**a))
        for o in page.get("Contents", ()):
            yield Obj(o["Key"], o["Size"], o["ETag"].strip('"'))
        if not page.get("IsTruncated"):
            return
        args["ContinuationToken"] = page["NextContinuationToken"]


def is_md5(etag: str, answer: dict) -> bool:
    """Whether `etag` is the MD5 of the object's bytes: a single-part upload not encrypted with
    KMS or a customer key (AWS S3 user guide, "Checking object integrity": those ETags are not)."""
    return (len(etag) == 32 and "-" not in etag
            and answer.get("ServerSideEncryption") not in ("aws:kms", "aws:kms:dsse")
            and not answer.get("SSECustomerAlgorithm"))


def delete(bucket: str, keys: list) -> None:
    """Delete `keys` (best effort: used to clean up; a failure is not raised)."""
    with contextlib.suppress(KfvisionError):
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            retried(f"{SCHEME}{bucket}/", "delete from",
                    lambda b=batch: client().delete_objects(Bucket=bucket, Delete=b))
