"""s3rver (the npm registry's S3 server on Node, `make s3rver`) for bench/objectstore.py, in its own
process on loopback (bench/s3rver.js: it counts what it serves, as bench/s3server.py does for
moto).

    proc, url = start(work)     # its objects under work/s3rver-data, the bucket made
    counts(url)                 # {"requests": ..., "object_bytes": ..., "busy_s": ...}

Why it, for speed: it keeps connections open (moto's werkzeug server sends `Connection: close` on
every answer and spends about 6.5 ms of CPU per GET here: it measures itself, not the reader).
Checked against what our readers ask of S3: PUT ETags are MD5s, ListObjectsV2 (with Node's legacy
OpenSSL provider: its continuation tokens are DES-encrypted, which OpenSSL 3 leaves out, so a
second page fails with InternalError without it), HEAD, ranged GET and multipart upload answer as
S3 does. What it cannot check: it IGNORES If-Match (a GET with another ETag succeeds), and it
injects no faults: the correctness and fault tests stay on moto (tests/conftest.py,
tests/helpers/s3proxy.py). Credentials: it checks SigV4 against its own key, S3RVER / S3RVER.
"""

import subprocess
import time
from pathlib import Path

from bench.s3server import counts  # noqa: F401 (the same counting endpoint)

MODULES = Path("build/s3rver/node_modules")
KEY = "S3RVER"


def start(work: Path, bucket: str) -> tuple[subprocess.Popen, str]:
    """The server in its own process on a free port, `bucket` made, once it answers: (process,
    URL); its log is work/s3rver.log."""
    if not (MODULES / "s3rver").is_dir():
        raise SystemExit(f"{MODULES / 's3rver'} is not there: `make s3rver` installs it.")
    data = work / "s3rver-data"
    data.mkdir(parents=True, exist_ok=True)
    log = (work / "s3rver.log").open("w")
    proc = subprocess.Popen(["node", "--openssl-legacy-provider", "bench/s3rver.js", str(data),
                             bucket], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                            text=True)
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise SystemExit(f"s3rver did not start: see {work / 's3rver.log'}")
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            counts(url)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"s3rver did not answer: see {work / 's3rver.log'}")
