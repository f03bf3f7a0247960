"""GetObject without botocore's per-call machinery: a fetch's GET (pipelines/clients/
s3download.py) for what obstore does not take (pipelines/clients/s3obstore.py: an object whose
ETag is no MD5, a key its paths cannot name, a redirected bucket), and the template obstore's
store is made from (its URL and signing region: botocore's endpoint rules, run once).

botocore's `get_object` spends about 90% of a small object's client CPU on work that is the same
for every key of a bucket: the endpoint rules (S3's take the key as a parameter, so they run per
call), the user-agent string, parameter validation and serialization, and the parsing of every
answer header (dateutil on Last-Modified). Here that work is done once per bucket: one real
`get_object` of a key that does not exist is stopped just before it is sent, and the request
botocore built (its URL, headers and the signing scope of its Authorization) becomes a template.
Each object's request is then that template with its key and If-Match, signed with SigV4 by
`SigV4` below (the headers botocore's `S3SigV4Auth` writes, at a tenth of its CPU: botocore's
signer rebuilds its header dictionaries and derives its key per request; the client's
credentials, refreshed as botocore refreshes them; tests/clients/test_s3get.py compares the two) and
sent through the client's own HTTP session (its pool, timeouts, proxies and CA bundle; its mapping
of urllib3's failures onto botocore's exceptions). The answer comes back as `get_object`'s would for
what `download` reads (ETag, encryption, the body as a StreamingBody whose flexible checksum is
checked as botocore checks it), and a refusal as the ClientError botocore would raise, so the
layer maps it as before.

A request the template cannot make goes through `get_object` instead: a client that does not
sign with SigV4 (SigV4a, S3 Express sessions, an unsigned client) gets no template; a bucket that
answers with a redirect (another region) switches to `get_object` for good, which follows it.
"""

import hashlib
import hmac
import http.client
import re
import time
import uuid
from urllib.parse import urlsplit

from botocore.auth import SIGNED_HEADERS_BLACKLIST
from botocore.awsrequest import AWSPreparedRequest
from botocore.exceptions import ClientError
from botocore.httpchecksum import handle_checksum_body, resolve_response_checksum_algorithms
from botocore.response import StreamingBody
from botocore.utils import percent_encode

# headers botocore sets per request or per signature: each request gets its own
_PER_REQUEST = {"authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token",
                "if-match", "amz-sdk-invocation-id", "content-length"}
# answers that mean "ask elsewhere": botocore's S3 region redirector follows them
REDIRECT_STATUS = {301, 307}
REDIRECT_CODES = {"PermanentRedirect", "AuthorizationHeaderMalformed", "TemporaryRedirect"}
_SCOPE = re.compile(r"^AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request,")


class _Built(Exception):
    """Carries the request botocore built out of its send, unsent."""

    def __init__(self, request):
        super().__init__("a GetObject template, not sent")
        self.request = request


class Getter:
    """GetObject for the keys of one bucket, from a template botocore built once."""

    def __init__(self, client, bucket: str, credentials):
        self._client, self._bucket, self._credentials = client, bucket, credentials
        # the client's pool: private in botocore, so a botocore without it gets no template
        self._session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        self._op = client.meta.service_model.operation_model("GetObject")
        request = {"context": {}}
        resolve_response_checksum_algorithms(request, self._op, {"ChecksumMode": "ENABLED"})
        self._checksum_context = request["context"]
        self._redirected = False
        self.template = self._template()  # None: every request through get_object

    def _template(self) -> tuple | None:
        if self._session is None:
            return None
        key = f"kfvision-template-{uuid.uuid4().hex}"
        quoted = percent_encode(key, safe="/~")

        def stop(request, **_):
            if quoted in request.url:
                raise _Built(request)

        # a unique id per Getter: no other thread's call is stopped, nor this handler kept
        events, uid = self._client.meta.events, f"kfvision-template-{id(self)}"
        events.register_first("before-send.s3.GetObject", stop, unique_id=uid)
        built = None
        try:
            self._client.get_object(Bucket=self._bucket, Key=key, IfMatch='"0"',
                                    ChecksumMode="ENABLED")
        except _Built as b:
            built = b.request
        finally:
            events.unregister("before-send.s3.GetObject", unique_id=uid)
        if built is None:  # another handler answered it: leave every request to botocore
            return None
        headers = {k: v.decode() if isinstance(v, bytes) else v
                   for k, v in built.headers.items()}
        scope = _SCOPE.match(headers.get("Authorization", ""))
        headers = {k: v for k, v in headers.items() if k.lower() not in _PER_REQUEST}
        if scope is None or any(k.lower() == "x-amz-s3session-token" for k in headers):
            return None
        url = built.url
        at = url.find(quoted)
        if at < 0:  # the key is not in the URL as we would write it: botocore writes each
            return None
        region, service = scope.groups()
        self._signer = SigV4(region, service)
        return url[:at], url[at + len(quoted):], headers, region, service

    def get_object(self, key: str, if_match: str) -> dict:
        """What `client.get_object(Bucket=..., Key=key, IfMatch=if_match, ChecksumMode=
        "ENABLED")` answers, as far as `download` reads it: ETag, ServerSideEncryption,
        SSECustomerAlgorithm, Body (a StreamingBody). Raises what get_object raises."""
        if self.template is None or self._redirected:
            return self._client.get_object(Bucket=self._bucket, Key=key, IfMatch=if_match,
                                           ChecksumMode="ENABLED")
        head, tail, headers, region, service = self.template
        url = head + percent_encode(key, safe="/~") + tail
        headers = self._signer.sign(url, {**headers, "If-Match": if_match},
                                    self._credentials.get_frozen_credentials())
        answer = self._session.send(AWSPreparedRequest("GET", url, headers, None, True))
        status, got = answer.status_code, answer.headers
        if status >= 300:
            body = answer.raw.read()
            code = _tag(body, "Code") or str(status)
            if status in REDIRECT_STATUS or code in REDIRECT_CODES:
                self._redirected = True  # another region: botocore follows it
                return self.get_object(key, if_match)
            raise ClientError({"Error": {"Code": code, "Message": _tag(body, "Message")
                                         or http.client.responses.get(status, "")},
                               "ResponseMetadata": {"HTTPStatusCode": status,
                                                    "HTTPHeaders": dict(got)}}, "GetObject")
        parsed = {"headers": got, "body": None, "context": {}}
        handle_checksum_body(answer, parsed, dict(self._checksum_context), self._op)
        return {"ETag": got.get("ETag", ""),
                "ServerSideEncryption": got.get("x-amz-server-side-encryption"),
                "SSECustomerAlgorithm": got.get("x-amz-server-side-encryption-customer-algorithm"),
                "Body": parsed["body"] or StreamingBody(answer.raw, got.get("content-length"))}


def _tag(body: bytes, name: str) -> str:
    """The text of <name> in an S3 error body ('' when there is none)."""
    m = re.search(rb"<%s>(.*?)</%s>" % (name.encode(), name.encode()), body, re.S)
    return m.group(1).decode("utf-8", "replace") if m else ""


_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNSIGNED = set(SIGNED_HEADERS_BLACKLIST)  # as botocore leaves them out of the signature


class SigV4:
    """AWS Signature Version 4 of a request with no body, the headers as botocore's S3SigV4Auth
    writes them (tests/clients/test_s3get.py compares the two), at a tenth of its CPU: no header
    dictionaries built and searched, and the signing key derived once a day rather than per
    request (AWS's "Signature Version 4 signing process": the key depends on the date, region,
    service and secret only)."""

    def __init__(self, region: str, service: str):
        self.region, self.service = region, service
        self._key: tuple = (None, b"")  # (secret, date) -> the derived signing key

    def sign(self, url: str, headers: dict, credentials, amz_date: str | None = None) -> dict:
        """`headers` with X-Amz-Date, X-Amz-Content-SHA256, X-Amz-Security-Token (where the
        credentials have one) and Authorization added, for a GET of `url` now (or at
        `amz_date`, YYYYMMDDTHHMMSSZ)."""
        amz_date = amz_date or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        headers = {**headers, "X-Amz-Date": amz_date, "X-Amz-Content-SHA256": _EMPTY_SHA256}
        if credentials.token:
            headers["X-Amz-Security-Token"] = credentials.token
        parts = urlsplit(url)
        signed = {k.lower(): " ".join(v.split()) for k, v in headers.items()
                  if k.lower() not in _UNSIGNED}
        signed.setdefault("host", _host(parts))
        names = sorted(signed)
        query = "&".join(sorted(f"{k}={v}" for k, _, v in
                                (p.partition("=") for p in parts.query.split("&")))
                         ) if parts.query else ""
        canonical = "\n".join(("GET", parts.path, query,
                               "".join(f"{n}:{signed[n]}\n" for n in names),
                               ";".join(names), _EMPTY_SHA256))
        scope = f"{amz_date[:8]}/{self.region}/{self.service}/aws4_request"
        to_sign = (f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n"
                   f"{hashlib.sha256(canonical.encode()).hexdigest()}")
        signature = hmac.new(self._signing_key(credentials.secret_key, amz_date[:8]),
                             to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/"
                                    f"{scope}, SignedHeaders={';'.join(names)}, "
                                    f"Signature={signature}")
        return headers

    def _signing_key(self, secret: str, date: str) -> bytes:
        ident, key = self._key
        if ident != (secret, date):  # a new day, or refreshed credentials
            key = f"AWS4{secret}".encode()
            for part in (date, self.region, self.service, "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._key = ((secret, date), key)
        return key


def _host(parts) -> str:
    """The Host header of a URL, as botocore signs it: the port only where it is not the
    scheme's default."""
    default = {"http": 80, "https": 443}.get(parts.scheme)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return host if parts.port in (None, default) else f"{host}:{parts.port}"
