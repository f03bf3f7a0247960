"""The GetObject of pipelines/clients/s3download.py's downloads on obstore, the Python binding of
the Rust `object_store` crate (LitData's client): a GET's request, signature, connection and body
in Rust, outside the interpreter's lock and at less client CPU per GET than botocore's
(docs/benchmarks.md, "Training from object storage"): a node's fetcher spends its CPU on these
GETs.

What it talks to, and how, is botocore's, never a second configuration: the store is made from
the GET botocore built for the bucket (pipelines/clients/s3get.py's template: its URL gives the
endpoint and the addressing style, its signature the region), signed with the credentials object
of botocore's client (the standard chain: environment, profiles, web identity / IRSA; refreshed
as botocore refreshes it), with the client's CA bundle (AWS_CA_BUNDLE, a profile's ca_bundle)
and the proxy botocore would take for the endpoint (HTTP(S)_PROXY, NO_PROXY), and the retry
policy's timeouts (obstore also reads AWS_* variables of its own; what is given here wins).
obstore's own retries are off: every try is one of `retried`'s, under the one
RetryPolicy, and its failures come back as the botocore exceptions the layer already maps (an
answer with a status as a ClientError with the S3 error code of its body, a connection that
failed as EndpointConnectionError, a TLS failure as SSLError, a stalled read as ReadTimeoutError,
a body that broke off as ResponseStreamingError), so the named errors and which failures are
tried again stay in one place.

Where obstore cannot do what botocore's GET does, the GET stays botocore's (`takes` says no):
- an object whose ETag is not an MD5 (a multipart upload's): botocore checks its flexible
  checksum (x-amz-checksum-*), which obstore does not read;
- a key obstore's paths cannot name (an empty segment, `.` or `..`, a leading or trailing `/`);
- a bucket without a SigV4 template (unsigned, SigV4a, S3 Express) or answering with a redirect
  (another region: botocore follows it).
obstore does not hand back the answer's encryption headers, so an MD5 that does not match the
ETag is settled by a HEAD (s3download.py): the object's ETag is an MD5 unless it is
encrypted with KMS or a customer key.
"""

import datetime
import re
from urllib.parse import urlsplit

from botocore import exceptions as bx

from kfvision.pipelines.clients.s3get import REDIRECT_CODES, REDIRECT_STATUS

# no overall time limit on a request (botocore has none): a stall is the read timeout's
_NO_LIMIT = "365d"
_STATUS = re.compile(r"status code: (\d{3})")
# reqwest's connect failures in obstore's debug text (0.12.1): `kind: Connect`, never the
# `kind: ConnectionReset` of an io error inside a body
_CONNECT = re.compile(r"kind: Connect\b")
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_REFRESH = datetime.timedelta(minutes=5)  # credentials that expire are asked for this often


class Store:
    """GET of one bucket's objects through obstore, configured from botocore's client."""

    def __init__(self, store, url: str, provider=None):
        self._store, self.url, self._provider = store, url, provider
        self.redirected = False  # the bucket answered "ask elsewhere": botocore follows it

    @classmethod
    def make(cls, client, bucket: str, template, credentials, policy, max_connections: int):
        """The store for `bucket`, or None where obstore cannot make botocore's request."""
        if template is None or credentials is None:
            return None
        head, _, _, region, service = template
        if service != "s3":
            return None
        config = _addressing(head, bucket)
        if config is None:
            return None
        options = {"allow_http": urlsplit(head).scheme == "http",
                   "connect_timeout": datetime.timedelta(seconds=policy.connect_timeout_s),
                   "read_timeout": datetime.timedelta(seconds=policy.read_timeout_s),
                   "timeout": _NO_LIMIT, "pool_max_idle_per_host": str(max_connections)}
        tls = _tls_and_proxy(client, head)
        if tls is None:
            return None
        options.update(tls)
        from obstore.store import S3Store

        provider = _Provider(credentials)
        store = S3Store(bucket, config={**config, "region": region},
                        client_options=options, retry_config={"max_retries": 0},
                        credential_provider=provider)
        return cls(store, head, provider)

    def takes(self, key: str, etag: str) -> bool:
        """Whether this GET checks all botocore's would for `key` (see the module doc)."""
        return (not self.redirected and bool(_MD5.match(etag))
                and all(part not in ("", ".", "..") for part in key.split("/")))

    def get_object(self, key: str, if_match: str) -> dict | None:
        """What `download` reads of a GetObject's answer: ETag, Body (read by `iter_chunks`),
        and Unsure (the encryption headers are not known: a mismatched MD5 asks by HEAD); None
        when the bucket answered with a redirect (from then on, `takes` says no). Raises what
        botocore would (see the module doc)."""
        import obstore

        try:
            answer = obstore.get(self._store, key, options={"if_match": if_match})
        except Exception as e:  # noqa: BLE001 (each one mapped, or raised as it is)
            return self._refused(e)
        return {"ETag": answer.meta.get("e_tag") or "", "Unsure": True,
                "Body": _Body(answer, self)}

    def _refused(self, e: Exception) -> None:
        """None for a redirect (marking the store redirected), else `e` raised as botocore's."""
        err = self.botocore(e)
        if isinstance(err, bx.ClientError) and (
                err.response["ResponseMetadata"]["HTTPStatusCode"] in REDIRECT_STATUS
                or err.response["Error"]["Code"] in REDIRECT_CODES):
            self.redirected = True
            return None
        raise err from e

    def botocore(self, e: Exception) -> Exception:
        """`e` (obstore's) as the botocore exception of the same failure (the module doc)."""
        text = str(e)
        status = _STATUS.search(text)
        if status:
            code = _tag(text, "Code") or status.group(1)
            return bx.ClientError({"Error": {"Code": code, "Message": _tag(text, "Message")},
                                   "ResponseMetadata": {"HTTPStatusCode": int(status.group(1))}},
                                  "GetObject")
        if isinstance(e, (ValueError, TypeError)):  # a path or option it refused: a bug of ours
            return e
        failure = self._provider and self._provider.failure
        if failure is not None:  # the credentials could not be had
            self._provider.failure = None
            return failure
        detail = _first_line(text)
        if _CONNECT.search(text):  # not `kind: ConnectionReset`, a body cut short (retried)
            if "tcp connect error" in text or "dns error" in text:
                return bx.EndpointConnectionError(endpoint_url=self.url, error=detail)
            if "timed out" in text.lower() or "TimedOut" in text:
                return bx.ConnectTimeoutError(endpoint_url=self.url, error=detail)
            return bx.SSLError(endpoint_url=self.url, error=detail)
        if "kind: Timeout" in text:
            return bx.ReadTimeoutError(endpoint_url=self.url, error=detail)
        return bx.ResponseStreamingError(error=detail)


class _Body:
    """An answer's body, read as botocore's StreamingBody is (`iter_chunks`)."""

    def __init__(self, answer, store: Store):
        self._answer, self._store = answer, store

    def iter_chunks(self, size: int):
        try:
            yield from self._answer.stream(min_chunk_size=size)
        except Exception as e:  # noqa: BLE001 (mapped as the GET's own failures)
            raise self._store.botocore(e) from e


def _addressing(head: str, bucket: str) -> dict | None:
    """obstore's endpoint and style for botocore's URL of the bucket (`head`, up to the key)."""
    parts = urlsplit(head)
    if head.endswith(f"/{bucket}/"):  # path style: endpoint[/prefix]/bucket/key
        return {"endpoint": head[:-len(bucket) - 2], "virtual_hosted_style_request": False}
    if parts.path == "/" and (parts.hostname or "").startswith(f"{bucket}."):
        return {"endpoint": head.rstrip("/"), "virtual_hosted_style_request": True}
    return None


def _tls_and_proxy(client, url: str) -> dict | None:
    """The CA bundle botocore's client trusts (where one is configured) and the proxy it takes
    for `url`; None where obstore cannot take them (a folder of certificates, a private pool).
    obstore adds the bundle to its roots, where botocore trusts the bundle alone."""
    import os

    from botocore.utils import get_environ_proxies

    out = {}
    # the client's pool (private in botocore; s3get.py's template uses it too)
    verify = getattr(getattr(getattr(client, "_endpoint", None), "http_session", None),
                     "_verify", None)
    if verify is None:
        return None
    if verify is False:  # told not to verify (botocore's verify=False)
        out["allow_invalid_certificates"] = True
    elif isinstance(verify, str) and verify != _certifi():  # AWS_CA_BUNDLE or a profile's
        if not os.path.isfile(verify):
            return None
        with open(verify, "rb") as f:
            out["root_certificate"] = f.read()
    proxies = {**get_environ_proxies(url), **(client.meta.config.proxies or {})}
    proxy = proxies.get(urlsplit(url).scheme)
    if proxy:
        out["proxy_url"] = proxy
    return out


def _certifi() -> str | None:
    try:
        import certifi
    except ImportError:  # pragma: no cover (botocore's dependency)
        return None
    return certifi.where()


class _Provider:
    """obstore's credential callback from botocore's credentials object (obstore's own
    Boto3CredentialProvider does this too, but imports boto3, which this layer leaves out).
    A failure to get them (botocore's CredentialRetrievalError...) is kept for the GET that
    needed them, which raises it: the layer maps it as botocore's own (EndpointAuthError)."""

    def __init__(self, credentials):
        self._credentials, self.failure = credentials, None

    def __call__(self) -> dict:
        try:
            frozen = self._credentials.get_frozen_credentials()  # refreshed when near expiry
        except Exception as e:
            self.failure = e
            raise
        refreshing = getattr(self._credentials, "refresh_needed", None) is not None
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token,
                "expires_at": (datetime.datetime.now(datetime.timezone.utc) + _REFRESH
                               if refreshing else None)}


def _tag(text: str, name: str) -> str:
    m = re.search(rf"<{name}>(.*?)</{name}>", text, re.S)
    return m.group(1) if m else ""


def _first_line(text: str) -> str:
    return text.split("\n\nDebug source:")[0].strip()
