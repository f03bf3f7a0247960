"""A local stand-in for Kubeflow Trainer's status server, shaped like the released one.

Facts from kubeflow/trainer v2.3.0 (the same in v2.2.0 but for hardening of auth and limits):
- `pkg/statusserver/server.go`: HTTPS only; one route, `POST` StatusUrl(ns, name) (`utils.go`),
  every other request 404 "Not found"; a body over 64 KiB is 413 (`middleware.go`); then the
  bearer token is checked (403 "Forbidden"); then the body is decoded with Go's `encoding/json`
  into `UpdateTrainJobStatusRequest` (`pkg/apis/trainer/v1alpha1/trainjob_types.go`): any type
  error is 422 "Invalid payload" (unknown fields are ignored, key names match case-insensitively,
  as Go's decoder does); no `trainerStatus` is 200 without a write; else the status is applied
  (server-side apply, field manager `trainer-status`) and what the API server refuses under the
  CRD's schema is 422 with its message. Success is 200 with the decoded request; every refusal
  is a Kubernetes `Status` object.
- `auth.go`: the token is a projected service-account token for the audience
  TokenAudience(ns, name), checked by OIDC (signature, expiry, audience, namespace). Here: one
  opaque token valid for this one job; with `rotate=True` a new one replaces it in the token file
  after every accepted report and the old one is refused from then on (the kubelet rotates the
  real one within its hour: a client must re-read the file).
- `pkg/runtime/framework/plugins/trainjobstatus/trainjobstatus.go`: the pod finds the URL, the CA
  file and the token file in the three variables of `env()`, the files in one directory.
"""

import datetime
import json
import os
import re
import secrets
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv4Address
from pathlib import Path

import jsonschema
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from helpers.loopback import serve_in_thread
from kfvision.trainer.upstream import (
    TRAINER_CA_CERT_FILE,
    TRAINER_SERVER_CA_CERT,
    TRAINER_SERVER_TOKEN,
    TRAINER_SERVER_URL,
    TRAINER_STATUS_PATH,
    TRAINER_TOKEN_FILE,
)

MAX_BODY = 1 << 16  # maxBodySize, server.go
ROUTE = re.compile("^" + re.escape(TRAINER_STATUS_PATH).replace(r"\{namespace\}", "([^/]+)")
                   .replace(r"\{name\}", "([^/]+)") + "$")
INT32 = (-(2**31), 2**31 - 1)
# Go time.RFC3339 as time.Parse takes it (metav1.Time.UnmarshalJSON)
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
# status.trainerStatus of the TrainJob CRD at v2.3.0 (kubebuilder markers of TrainerStatus and
# Metric; the CEL rule of the CRD, message included)
SCHEMA = {
    "type": "object",
    "properties": {
        "progressPercentage": {"type": "integer", "minimum": 0, "maximum": 100},
        "estimatedRemainingSeconds": {"type": "integer", "minimum": 0},
        "metrics": {"type": "array", "maxItems": 256, "items": {
            "type": "object", "required": ["name", "value"],
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 64},
                           "value": {"type": "string", "minLength": 1, "maxLength": 64}}}},
        "lastUpdatedTime": {"type": "string"},
    },
}
LAST_UPDATED_RULE = "lastUpdatedTime is required when trainerStatus is present"


class Refused(Exception):
    def __init__(self, code: int, message: str, reason: str):
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason


def _self_signed(directory: Path) -> tuple:
    """(CA file, server cert file, server key file): a CA and a server certificate it signs for
    localhost / 127.0.0.1 (the controller's are a CA and a cert for its Service's name)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kfvision test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(IPv4Address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    files = directory / TRAINER_CA_CERT_FILE, directory / "tls.crt", directory / "tls.key"
    files[0].write_bytes(ca.public_bytes(pem))
    files[1].write_bytes(cert.public_bytes(pem))
    files[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return files


def _field(obj: dict, name: str):
    """Go's decoder: an exact key wins, else a case-insensitive one; absent is None."""
    if name in obj:
        return obj[name]
    found = [v for k, v in obj.items() if k.lower() == name.lower()]
    return found[-1] if found else None


def _int32(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not INT32[0] <= value <= INT32[1]:
        raise ValueError(f"cannot unmarshal {value!r} into an int32")
    return value


def _string(value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"cannot unmarshal {value!r} into a string")
    return value


def decode(body: bytes) -> dict | None:
    """The `trainerStatus` of an UpdateTrainJobStatusRequest, as Go's `json.Decoder.Decode` reads
    it (the first JSON value; only the fields the type declares); None when absent or null.
    Raises ValueError where Go's decoder returns an error."""
    request, _ = json.JSONDecoder().raw_decode(body.decode("utf-8").lstrip(" \t\r\n"))
    if request is None:
        return None
    if not isinstance(request, dict):
        raise ValueError("cannot unmarshal into UpdateTrainJobStatusRequest")
    raw = _field(request, "trainerStatus")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("cannot unmarshal into TrainerStatus")
    status = {}
    for key in ("progressPercentage", "estimatedRemainingSeconds"):
        value = _int32(_field(raw, key))
        if value is not None:
            status[key] = value
    metrics = _field(raw, "metrics")
    if metrics is not None:
        if not isinstance(metrics, list):
            raise ValueError("cannot unmarshal into []Metric")
        status["metrics"] = []
        for m in metrics:
            m = {} if m is None else m
            if not isinstance(m, dict):
                raise ValueError("cannot unmarshal into Metric")
            status["metrics"].append({"name": _string(_field(m, "name")),
                                      "value": _string(_field(m, "value"))})
    when = _field(raw, "lastUpdatedTime")
    if when is not None:
        if not isinstance(when, str) or not RFC3339.match(when):
            raise ValueError(f"parsing time {when!r} as RFC3339")
        datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))  # a real date
        status["lastUpdatedTime"] = when
    return status


class StatusServer:
    """The status endpoint of one TrainJob (`namespace`/`name`) on a free loopback port.

    `reports`: the trainerStatus of every accepted report, in order; `requests`: (method, path,
    HTTP code) of every request; `trainer_status`: the TrainJob's status.trainerStatus now;
    `outages`: set it to fail that many writes with 500 (the API server away)."""

    def __init__(self, directory: Path, namespace: str = "team-a", name: str = "digits",
                 rotate: bool = False):
        self.directory, self.namespace, self.name, self.rotate = directory, namespace, name, rotate
        self.reports, self.requests, self.trainer_status = [], [], None
        self.tokens_used = []
        self.outages = 0  # the next this many writes fail as an API server that is away does
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_file, cert, key = _self_signed(directory)
        self.token_file = directory / TRAINER_TOKEN_FILE
        self._new_token()
        self._lock = threading.Lock()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_port}" + TRAINER_STATUS_PATH.format(
            namespace=namespace, name=name)
        self._thread = serve_in_thread(self.server)

    def env(self) -> dict:
        """The variables the controller's trainjobstatus plugin sets in a trainer container."""
        return {TRAINER_SERVER_URL: self.url, TRAINER_SERVER_CA_CERT: str(self.ca_file),
                TRAINER_SERVER_TOKEN: str(self.token_file)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _new_token(self) -> None:
        self.token = secrets.token_urlsafe(24)
        tmp = self.token_file.with_name(".token.tmp")
        tmp.write_text(self.token + "\n")
        os.replace(tmp, self.token_file)  # atomic, as the kubelet swaps the projected files

    def handle(self, method: str, path: str, headers, body: bytes) -> tuple:
        """(HTTP code, JSON reply) for one request, in upstream's order of checks."""
        try:
            if len(body) > MAX_BODY:
                raise Refused(413, "Payload too large", "RequestEntityTooLarge")
            route = ROUTE.match(path)
            if method != "POST" or not route:
                raise Refused(404, "Not found", "NotFound")
            parts = (headers.get("Authorization") or "").split()
            if not (len(parts) == 2 and parts[0].lower() == "bearer" and parts[1] == self.token
                    and route.groups() == (self.namespace, self.name)):
                raise Refused(403, "Forbidden", "Forbidden")
            try:
                status = decode(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise Refused(422, "Invalid payload", "Invalid") from e
            if status is None:
                return 200, {}
            self._apply(status)
        except Refused as e:
            return e.code, {"metadata": {}, "status": "Failure", "message": e.message,
                            "reason": e.reason, "code": e.code}
        self.reports.append(status)
        self.tokens_used.append(self.token)
        if self.rotate:
            self._new_token()
        return 200, {"trainerStatus": status}

    def _apply(self, status: dict) -> None:
        """What the API server does with the apply: validate, then replace the fields."""
        if self.outages:
            self.outages -= 1
            raise Refused(500, "Internal error", "InternalError")
        where = f'TrainJob.trainer.kubeflow.org "{self.name}" is invalid: '
        if "lastUpdatedTime" not in status:
            raise Refused(422, where + "status.trainerStatus: Invalid value: \"object\": "
                          + LAST_UPDATED_RULE, "Invalid")
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft7Validator(SCHEMA).iter_errors(status))
        if error is not None:
            field = ".".join(["status.trainerStatus", *map(str, error.absolute_path)])
            raise Refused(422, f"{where}{field}: Invalid value: {error.message}", "Invalid")
        self.trainer_status = status

    def _handler(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer._lock:
                    code, reply = outer.handle(self.command, self.path, self.headers, body)
                    outer.requests.append((self.command, self.path, code))
                data = json.dumps(reply).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET = do_PUT = do_PATCH = _any

            def log_message(self, *args):
                pass

        return Handler
