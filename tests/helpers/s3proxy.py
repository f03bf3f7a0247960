"""A fault-injecting HTTP proxy for tests: put it in front of the S3 server (moto's, on loopback)
and point AWS_ENDPOINT_URL at it. It forwards each request, and for some it misbehaves as real
object storage and the proxies before it do:

    slowdown    503 with S3's `SlowDown` error body, the request never forwarded
    reset       the answer's headers and half its body, then a TCP reset (RST)
    truncate    the headers (the full Content-Length) and half the body, then a clean close
    stall       the headers and half the body, then nothing for `stall_s`, then a close
    stale_etag  the whole answer, with an ETag header other than the object's
    corrupt     the whole answer, one byte of its body changed (its ETag and checksums as they
                were)

and refuses, as a server does, with no retry to follow (not in KINDS: no try gets further):

    denied        403 with S3's `AccessDenied` error body, the request never forwarded
    precondition  412 with S3's `PreconditionFailed` body (the object changed), never forwarded

Which requests: a `Rule` (methods, the share of them, the kinds, a path pattern, and whether only
a request's first sight), or several (the first that faults a request decides), decided per
request by a seeded draw keyed on (seed, method, path, how many times that method and path were
seen), so the same test meets the same faults in the same places whatever order its threads run
in. `Rule(rate=1.0, methods={"PUT"}, kinds=("stale_etag",), path=PART_1, first=True)` damages
the answer to the first PUT of every multipart upload's part 1, and no part sent again:

    with FaultProxy(upstream, Rule(rate=0.1, methods={"GET"}), seed=7) as proxy:
        ...                 # proxy.url is the endpoint; proxy.faults counts what it did
"""

import http.client
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from helpers.loopback import serve_in_thread

PART_1 = r"[?&]partNumber=1(&|$)"  # a multipart upload's first part (its path names the upload)
KINDS = ("slowdown", "reset", "truncate", "stall", "stale_etag", "corrupt")
REFUSALS = ("denied", "precondition")


def _error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>'
            f"{message}</Message><RequestId>FAULTPROXY</RequestId></Error>").encode()


# kind -> the status, reason and body of the answer sent instead of forwarding the request
_ANSWERED = {"slowdown": (503, "Slow Down", _error("SlowDown", "Please reduce your request rate.")),
             "denied": (403, "Forbidden", _error("AccessDenied", "Access Denied")),
             "precondition": (412, "Precondition Failed", _error(
                 "PreconditionFailed", "At least one of the pre-conditions you specified did "
                 "not hold"))}
# hop-by-hop headers (RFC 9110, section 7.6.1) and the framing the proxy sets itself
_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection",
         "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Rule:
    """Fault `rate` of the requests whose method is in `methods` and whose path (with the query)
    matches `path`, with a kind drawn from `kinds`."""

    rate: float = 0.0
    methods: frozenset = frozenset({"GET"})
    kinds: tuple = KINDS
    path: str = ""  # a regular expression searched in the path; "" matches all
    first: bool = False  # only the first time a method and path are seen (no retry of it)

    def __post_init__(self):
        object.__setattr__(self, "methods", frozenset(self.methods))
        unknown = set(self.kinds) - set(KINDS) - set(REFUSALS)
        assert not unknown, f"unknown fault kinds {unknown}: {KINDS + REFUSALS}"


class FaultProxy:
    """The proxy, on a free loopback port, while in a `with` block (or between start and stop).

    Args:
        upstream: the server's http:// URL.
        rule: which requests to fault, a Rule or a tuple of them (`rule` may be replaced while
            it runs).
        seed: fixes which requests are faulted and with what.
        stall_s: how long a stalled answer says nothing (longer than the client's read timeout).
    """

    def __init__(self, upstream: str, rule: Rule | tuple = Rule(), seed: int = 0,
                 stall_s: float = 2.0):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port or 80)
        self.rule, self.seed, self.stall_s = rule, seed, stall_s
        self.faults: Counter = Counter()  # kind -> how many
        self.by_rule: Counter = Counter()  # the rule's index (in a tuple of rules) -> faults
        self.requests: Counter = Counter()  # method -> how many
        self.clients: Counter = Counter()  # (method, the User-Agent's product) -> how many
        self.tokens: Counter = Counter()  # (the User-Agent's product, X-Amz-Security-Token)
        self._seen: Counter = Counter()
        self._lock = threading.Lock()
        self._server = None
        self._local = threading.local()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        serve_in_thread(self._server, "s3proxy")
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def decide(self, method: str, path: str) -> str | None:
        """The fault for this request, or None (counts it either way)."""
        rules = self.rule if isinstance(self.rule, tuple) else (self.rule,)
        with self._lock:
            self.requests[method] += 1
            n = self._seen[method, path]
            self._seen[method, path] += 1
        for i, rule in enumerate(rules):
            if method not in rule.methods or (rule.path and not re.search(rule.path, path)) \
                    or (rule.first and n > 0):
                continue
            salt = f"{self.seed}" if i == 0 else f"{self.seed}:{i}"  # the first: as before
            draw = random.Random(f"{salt}:{method}:{path}:{n}")  # noqa: S311
            if draw.random() >= rule.rate:
                continue
            kind = draw.choice(rule.kinds)
            with self._lock:
                self.faults[kind] += 1
                self.by_rule[i] += 1
            return kind
        return None

    def forward(self, method: str, path: str, headers: list, body: bytes):
        """(status, reason, headers, body) of the upstream server's answer."""
        conn = getattr(self._local, "conn", None)
        for again in (False, True):
            if conn is None:
                conn = http.client.HTTPConnection(*self.upstream, timeout=60)
                self._local.conn = conn
            try:
                conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    conn.putheader(k, v)
                conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                r = conn.getresponse()
                data = r.read()
                return r.status, r.reason, r.getheaders(), data
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = self._local.conn = None
                if again:
                    raise
        raise AssertionError("unreachable")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's pool expects
    owner: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        owner, method = self.owner, self.command
        body = self._body()
        product = self.headers.get("User-Agent", "").split("/")[0]
        with owner._lock:  # which client asked: Boto3 (botocore), object_store (obstore)
            owner.clients[method, product] += 1
            owner.tokens[product, self.headers.get("X-Amz-Security-Token")] += 1
        kind = owner.decide(method, self.path)
        if kind in _ANSWERED:
            status, reason, text = _ANSWERED[kind]
            self.send_response(status, reason)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text if method != "HEAD" else b"")
            return
        headers = [(k, v) for k, v in self.headers.items()
                   if k.lower() not in _DROP and k.lower() != "expect"]
        status, reason, answer, data = owner.forward(method, self.path, headers, body)
        if kind in ("reset", "truncate", "stall") and (method == "HEAD" or not data):
            self._lost(kind)  # no body to break: the answer is lost as a whole
            return
        if kind == "corrupt" and data:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
        length = next((v for k, v in answer if k.lower() == "content-length"), None)
        length = int(length) if method == "HEAD" and length is not None else len(data)
        self.send_response(status, reason)
        for k, v in answer:
            if k.lower() in _DROP or k.lower() in ("server", "date"):
                continue
            if kind == "stale_etag" and k.lower() == "etag":
                v = '"' + "0" * (32 - len(str(status))) + str(status) + '"'  # not an object's
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if kind in ("reset", "truncate", "stall"):
            self.wfile.write(data[:len(data) // 2])
            self._lost(kind)
            return
        if method != "HEAD":
            self.wfile.write(data)

    def _lost(self, kind: str) -> None:
        self.wfile.flush()
        if kind == "stall":
            time.sleep(self.owner.stall_s)
        if kind == "reset":  # SO_LINGER 0: close() sends RST, not FIN
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
        self.close_connection = True

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815
