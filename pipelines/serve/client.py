"""A `kfvision serve` process on a free loopback port, and a small HTTP client for it (stdlib only).

What the tests, the benchmark and a local check of a served model share: start the server, wait
until `/v2/health/ready`, send v1 or v2 requests, stop it.
"""

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kfvision.pipelines.clients.endpoints import free_ports


def request(url: str, body: bytes | None = None, content_type: str = "application/json",
            timeout: float = 60, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET (no body) or POST."""
    req = urllib.request.Request(url, data=body, method="GET" if body is None else "POST",
                                 headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def v1_body(files: list[bytes]) -> bytes:
    return json.dumps({"instances": [{"image": {"b64": base64.b64encode(f).decode()}}
                                     for f in files]}).encode()


def v2_body(files: list[bytes]) -> bytes:
    return json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(files)],
                                   "data": [base64.b64encode(f).decode() for f in files]}]}
                      ).encode()


class Server:
    """`python -m kfvision.pipelines.cli serve ARGS` on free ports until `stop()`: REST at `url`,
    gRPC at `grpc_target`, once ready."""

    def __init__(self, args: list, log: Path, timeout: float = 120):
        self.port, self.grpc_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.log = Path(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kfvision.pipelines.cli", "serve", *map(str, args),
                 "--http-port", str(self.port), "--grpc-port", str(self.grpc_port)], env=env,
                stdout=out,
                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                if request(self.url + "/v2/health/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not ready in {timeout} s:\n{self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
