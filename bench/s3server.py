"""moto's S3 server for bench/s3.py, in its own process on loopback, behind a counter of what it
serves: the requests it answers and the body bytes of its answers to object GETs, read at
COUNTS; each answer `latency_ms` late (0: loopback's own).

    proc, url = start(work, latency_ms=20)    # python -m bench.s3server PORT LATENCY_MS
    counts(url)                               # {"requests": ..., "object_bytes": ...}

moto's server (werkzeug) closes the connection after every answer, so every client opens one per
request alike. gevent's WSGI server keeps them open, but answered a sequential GET in twice
werkzeug's time under moto, so it is not used.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

COUNTS = "/__bench__/counts"  # the counting server's own path: what it served so far


class _Counted:
    """A WSGI app that counts the requests `app` answers and the body bytes of its answers to
    GETs of an object (a path-style /bucket/key: what every contender sends to an IP address),
    each answer `latency_s` late."""

    def __init__(self, app, latency_s: float = 0.0):
        self.app, self.lock, self.latency_s = app, threading.Lock(), latency_s
        self.counts = {"requests": 0, "object_bytes": 0}

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == COUNTS:
            with self.lock:
                body = json.dumps(self.counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        with self.lock:
            self.counts["requests"] += 1
        time.sleep(self.latency_s)  # a first-byte latency, as a remote store has
        answer = self.app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET" or "/" not in path.strip("/"):
            return answer
        return self._counting(answer)

    def _counting(self, answer):
        try:
            for chunk in answer:
                with self.lock:
                    self.counts["object_bytes"] += len(chunk)
                yield chunk
        finally:
            if hasattr(answer, "close"):
                answer.close()


def serve(port: int, latency_s: float) -> None:
    """Serve moto's S3 on 127.0.0.1:`port`, counted, until killed (moto's own server does
    the same, uncounted)."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    run_simple("127.0.0.1", port, _Counted(DomainDispatcherApplication(create_backend_app),
                                           latency_s),
               threaded=True, request_handler=MotoRequestHandler)


def start(work: Path, latency_ms: float = 0) -> tuple[subprocess.Popen, str]:
    """The server in its own process on a free port, once it answers: (process, URL); its log
    is work/moto.log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (work / "moto.log").open("w")
    # its stdin is a pipe from this process: the server ends when it reads EOF, so it dies with
    # the bench even when that is killed (SIGKILL runs no `finally`) rather than serving on
    proc = subprocess.Popen([sys.executable, "-m", "bench.s3server", str(port), str(latency_ms),
                             "--until-stdin-closes"], stdin=subprocess.PIPE, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            counts(url)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"moto's server did not start: see {work / 'moto.log'}")


def counts(url: str) -> dict:
    """What the server at `url` has served so far."""
    with urllib.request.urlopen(url + COUNTS, timeout=5) as r:
        return json.load(r)


def _exit_at_eof() -> None:
    sys.stdin.buffer.read()  # returns at EOF: the starting process has closed its end, or died
    os._exit(0)


if __name__ == "__main__":
    if "--until-stdin-closes" in sys.argv[3:]:
        threading.Thread(target=_exit_at_eof, daemon=True).start()
    serve(int(sys.argv[1]), float(sys.argv[2]) / 1000)
