"""Failures to talk to a server (the KFP API, the Kubernetes API, a model server) as one line.

A port-forward that is not running, a typo in the endpoint, an expired token or a self-signed
certificate otherwise end in a page of urllib3 traceback. Here they become a named error that
says which endpoint, what went wrong and what to check, with an exit code that tells a script
whether running the command again can help (trainer/exitcodes.py has the table):

    EndpointUnreachableError  69  nothing answered, or it timed out: retrying may help
    EndpointTLSError          76  the TLS handshake failed (certificate): fix it first
    EndpointAuthError         77  the server refused the credentials: fix them first
"""

import contextlib
import socket
import ssl

from kfvision.trainer.errors import KfvisionError
from kfvision.trainer.exitcodes import EXIT_AUTH, EXIT_TLS, EXIT_UNAVAILABLE


def free_ports(n: int) -> list[int]:
    """n different TCP ports nothing listens on now, on the loopback interface (for a local
    server to take, or for an endpoint that is sure not to answer)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One TCP port nothing listens on now (loopback)."""
    return free_ports(1)[0]


class EndpointError(KfvisionError):
    """A server could not be used; `endpoint` names it."""

    def __init__(self, message: str, endpoint: str):
        super().__init__(message)
        self.endpoint = endpoint


class EndpointUnreachableError(EndpointError):
    """Nothing answered at the endpoint, or it did not answer in time: retrying may help."""

    exit_code = EXIT_UNAVAILABLE


class EndpointTLSError(EndpointError):
    """The TLS handshake with the endpoint failed (certificate not trusted, wrong host name)."""

    exit_code = EXIT_TLS


class EndpointAuthError(EndpointError):
    """The endpoint answered 401 or 403: the credentials are missing, expired or not allowed."""

    exit_code = EXIT_AUTH


def _chain(exc: BaseException):
    """exc, then what caused it (`__cause__`/`__context__`, urllib3's `reason`), once each."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "reason", None)
        if not isinstance(exc, BaseException):
            exc = None


def _is_tls(exc: BaseException) -> bool:
    try:
        from urllib3.exceptions import SSLError as Urllib3SSLError
    except ImportError:  # pragma: no cover - urllib3 comes with kfp and kubernetes
        Urllib3SSLError = ()  # noqa: N806
    return isinstance(exc, (ssl.SSLError, ssl.CertificateError, *(
        (Urllib3SSLError,) if Urllib3SSLError else ())))


def _is_unreachable(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror, socket.timeout)):
        return True
    try:
        from urllib3.exceptions import NewConnectionError, ProtocolError
        from urllib3.exceptions import TimeoutError as UTimeout
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, (NewConnectionError, ProtocolError, UTimeout))


def endpoint_error(exc: BaseException, endpoint: str, what: str, check: str,
                   auth_check: str) -> EndpointError | None:
    """The EndpointError for `exc` raised while talking to `endpoint`, or None when `exc` is not a
    connection, TLS or authentication failure (then the caller lets it through).

    Args:
        what: the server, e.g. "the KFP API".
        check: what to check when nothing answers (a port-forward, the kubeconfig context).
        auth_check: what to check when the credentials are refused (a token option).
    """
    for e in _chain(exc):
        status = getattr(e, "status", None) or getattr(e, "code", None)
        if status in (401, 403):
            return EndpointAuthError(
                f"{what} at {endpoint} refused the request (HTTP {status}): {auth_check}",
                endpoint)
        if _is_tls(e):
            return EndpointTLSError(
                f"TLS with {what} at {endpoint} failed ({e}): trust its certificate authority "
                "(--ssl-ca-cert FILE) or use the endpoint's http:// address inside the cluster.",
                endpoint)
    for e in _chain(exc):
        if _is_unreachable(e):
            return EndpointUnreachableError(
                f"cannot reach {what} at {endpoint} ({type(e).__name__}: {e}). Check {check}; "
                "running the command again may help once it answers.", endpoint)
    return None


def probe(endpoint: str, path: str, what: str, check: str, auth_check: str, *,
          headers: dict | None = None, cafile: str | None = None, timeout: float = 10.0) -> None:
    """GET `endpoint` + `path` once and raise the EndpointError of a failure (any answer but
    401/403 passes): a quick, quiet first contact before a client library that would retry a dead or
    refusing endpoint for half a minute with a traceback per attempt (kfp.Client does)."""
    import urllib.error
    import urllib.request

    url = endpoint.rstrip("/") + path
    context = ssl.create_default_context(cafile=cafile) if url.startswith("https") else None
    request = urllib.request.Request(url, headers=headers or {})
    with talking_to(endpoint, what, check, auth_check):
        try:
            urllib.request.urlopen(request, timeout=timeout, context=context).close()  # noqa: S310
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise
        except urllib.error.URLError as e:  # the reason is the socket or TLS error itself
            raise e.reason if isinstance(e.reason, BaseException) else e from e


@contextlib.contextmanager
def talking_to(endpoint: str, what: str, check: str, auth_check: str):
    """Turn connection, TLS and authentication failures inside the block into EndpointErrors."""
    try:
        yield
    except KfvisionError:
        raise
    except Exception as e:
        err = endpoint_error(e, endpoint, what, check, auth_check)
        if err is None:
            raise
        raise err from e
