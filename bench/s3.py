"""Fetching an s3:// dataset: `pipelines.clients.s3sync.fetch`
against a plain sequential boto3 loop, on the
same S3 API server, in one run.

For each size N (`--images`) N small PNGs (10 class folders, 16x16 to 32x32, every object's bytes
distinct) are put under a prefix of moto's S3 server (`python -m moto.server`, its own process on
loopback; MinIO does not install here). Then each phase runs in a fresh Python process, so that
its peak memory is its own:

- plain loop: `list_objects_v2` pages, then `get_object` and a file write per object, one at a
  time: what a hand-written script does;
- kfvision, first run: `fetch(uri, dest, max_connections=C)` for each C of `--connections`;
- kfvision, rerun: the same call again over the same folder (nothing to download).

Reported per phase: seconds of the call alone (not the interpreter's start or imports), objects/s
and MB/s of dataset bytes, bytes fetched per dataset byte (1.0 the first time, 0 on a rerun),
the ratio to the plain loop's objects/s, and the phase process's peak resident set (VmHWM,
imports included): flat as N grows, since the listing is streamed and each object goes to disk
as it arrives. The server shares the machine's cores with the client, so the figures are a
floor for a real server on its own machine.

    python -m bench.s3 --images 1000 10000 [--connections 4 16] [--work build/bench-s3]

The table is printed and written to build/bench/s3-cpu.md.
"""

import argparse
import io
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from bench import publish

CLASSES = 10
BUCKET = "bench"


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _images(n: int, seed: int = 0):
    """(key below the prefix, PNG bytes) of n distinct small images."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        side = int(rng.integers(16, 33))
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
        yield f"{i % CLASSES}/img_{i:07d}.png", buf.getvalue()


def _fill(client, prefix: str, n: int) -> int:
    """Put n images under prefix (16 at once; not measured); returns their bytes."""
    total = 0
    with ThreadPoolExecutor(16) as pool:
        futures = []
        for key, data in _images(n):
            total += len(data)
            futures.append(pool.submit(client.put_object, Bucket=BUCKET, Key=prefix + key,
                                       Body=data))
        for f in futures:
            f.result()
    return total


# --- the phases, each in its own process ------------------------------------------------------


def _plain_loop(uri: str, dest: Path) -> dict:
    import boto3

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = boto3.client("s3")
    start = time.perf_counter()
    fetched = objects = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            target = dest / o["Key"][len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            data = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            target.write_bytes(data)
            fetched += len(data)
            objects += 1
    return {"seconds": time.perf_counter() - start, "fetched_bytes": fetched, "objects": objects}


def _kfvision(uri: str, dest: Path, connections: int) -> dict:
    from pipelines.clients.s3sync import fetch

    start = time.perf_counter()
    got = fetch(uri, dest, max_connections=connections, progress=False)
    return {"seconds": time.perf_counter() - start, "fetched_bytes": got.fetched_bytes,
            "objects": got.objects}


def _child(args) -> None:
    import boto3  # noqa: F401  (imported before the clock, as the library's own import is)

    import pipelines.clients.s3sync  # noqa: F401

    dest = Path(args.dest)
    result = (_plain_loop(args.uri, dest) if args.phase == "plain" else
              _kfvision(args.uri, dest, args.connections))
    result["peak_rss_mib"] = _peak_rss_mib()
    print(json.dumps(result))


def _run_phase(phase: str, uri: str, dest: Path, env: dict, connections: int = 0) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.s3", "--child", phase, "--uri", uri,
                          "--dest", str(dest), "--connections", str(connections)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"phase {phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the driver -------------------------------------------------------------------------------


def _server(work: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (work / "moto.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's server did not start")


def _row(n: int, name: str, r: dict, dataset_bytes: int, plain_rate: float | None) -> str:
    rate = r["objects"] / r["seconds"] if r["fetched_bytes"] else float("nan")
    mbs = dataset_bytes / r["seconds"] / 1e6 if r["fetched_bytes"] else float("nan")
    ratio = f"{rate / plain_rate:.2f}x" if plain_rate and r["fetched_bytes"] else "-"
    show = (lambda v, f: "-" if v != v else format(v, f))  # noqa: E731 (nan: a rerun)
    return (f"| {n:,} | {name} | {r['seconds']:.2f} | {show(rate, ',.0f')} | {show(mbs, '.1f')} "
            f"| {r['fetched_bytes'] / dataset_bytes:.2f} | {ratio} | {r['peak_rss_mib']:.0f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--connections", type=int, nargs="+", default=[4, 16])
    p.add_argument("--work", default="build/bench-s3")
    p.add_argument("--child", choices=("plain", "kfvision"), help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    p.add_argument("--dest", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.phase, args.connections = args.child, args.connections[0]
        return _child(args)

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    proc, url = _server(work)
    env = {**os.environ, "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                           "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
    rows = []
    try:
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for n in args.images:
            prefix = f"n{n}/"
            dataset = _fill(client, prefix, n)
            uri = f"s3://{BUCKET}/{prefix}"
            plain = _run_phase("plain", uri, work / f"plain-{n}", env)
            plain_rate = plain["objects"] / plain["seconds"]
            rows.append(_row(n, "plain boto3 loop (sequential)", plain, dataset, None))
            for c in args.connections:
                dest = work / f"kfv-{n}-{c}"
                first = _run_phase("kfvision", uri, dest, env, c)
                rows.append(_row(n, f"kfvision fetch, {c} connections", first, dataset,
                                 plain_rate))
                again = _run_phase("kfvision", uri, dest, env, c)
                rows.append(_row(n, f"kfvision fetch again, {c} connections", again, dataset,
                                 plain_rate))
                shutil.rmtree(dest, ignore_errors=True)
            shutil.rmtree(work / f"plain-{n}", ignore_errors=True)
            print(f"{n:,} images ({dataset / 1e6:.1f} MB): done", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    head = ("| images | what | seconds | objects/s | MB/s | bytes fetched per dataset byte "
            "| vs plain loop | peak RSS MiB |\n|---|---|---|---|---|---|---|---|")
    machine = (f"{platform.machine()}, {os.cpu_count()} logical CPUs, Python "
               f"{platform.python_version()}")
    text = (f"s3:// fetch against moto's S3 server on loopback ({machine}); "
            f"`python -m bench.s3 --images {' '.join(map(str, args.images))} --connections "
            f"{' '.join(map(str, args.connections))}`\n\n{head}\n" + "\n".join(rows))
    publish(text, "s3-cpu.md")


if __name__ == "__main__":
    main()
