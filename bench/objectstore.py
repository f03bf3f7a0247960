"""Training from object storage only: reading an image directory from an S3 API server, LitData's
way against ours, on the same server and the same JPEG bytes, in one run.

The store is an S3 server in its own process on loopback, started by the bench: by default s3rver
(the npm registry's, on Node: bench/s3rver.py and .js; `make s3rver`), which keeps connections open
as S3 does; with `--server moto`, moto's (bench/s3server.py), which closes every connection and
spends about 6.5 ms of CPU per GET: it measures itself more than the reader. Both count the
requests and object bytes they serve; s3rver also the requests in flight over time. The server's
CPU time (user + system, from /proc/PID/stat before and after) is reported beside each figure: on
this machine it shares the cores with the reader, so a reader that makes the server work harder
pays for it twice. What s3rver cannot check, and the fault tests on moto do: it ignores If-Match
(the node fetcher asks for the listed ETag; here the server does not hold it to that) and injects
no faults (tests/helpers/s3proxy.py does, in front of moto).

The data: N generated JPEGs of ImageNet size (500 x 375, a quarter of them portrait; quality 90;
smooth fields, shapes and texture: they compress like photos, about 95 KB each; bench/jpegset.py)
in 5 classes, converted into an image directory (images inside; `kfvision convert`'s convert())
and cached in build/bench/objectstore-jpegs-N/, then pushed under s3://bench/imagedir/ as
`kfvision push` does (storepush.push_image_directory: the manifest last). Measured, each in a
child process of its own:

1. LitData, chunked: `litdata.optimize` of the same bytes + labels into its 64 MB chunks under
   s3://bench/litdata/ (its conversion time, reported apart); then StreamingDataset +
   StreamingDataLoader over that s3:// prefix into a fresh cache folder, the bytes counted, not
   decoded: with its defaults (batch size 1, no worker process), and (reader `litdata-2`) with 2
   workers.
   LitData, per file (`litdata-raw`): StreamingRawDataset over s3://bench/imagedir/, one GET per
   image (its asyncio downloads, up to 128 in flight), in a shuffled DataLoader of batch 64,
   the bytes kept in memory (its default); `litdata-raw-files`: the same with `cache_files=True`,
   each image also written to a file, as the node fetcher writes each to the node's disk.
2. Our fetch of s3://bench/imagedir/ into an empty folder: the node fetcher alone (as the node
   agent starts it, for one node, one rank, one epoch; `node-64`: 64 connections, the default
   16) and s3sync.fetch of the whole prefix (bench/objectstore_children.py).
3. With --job: the 2-node x 1-process built-in job under `kfvision job run-local`, on s3:// against
   the same job on the local folder (bench/objectstore_job.py).

Rates are images over the seconds of the measured part (the child's own clock: the interpreter
and its imports left out; the process's whole time is reported too).

LitData is not one of the project's packages: it lives in its own venv that sees the project's
packages through a .pth, so the project's pinned environment is left as it is (`make
litdata-venv` makes it):

    python3 -m venv build/litdata-venv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > build/litdata-venv/lib/python3.11/site-packages/_project_venv.pth
    build/litdata-venv/bin/python -m pip install -c constraints.txt litdata==0.2.76

    python -m bench.objectstore [--images 20000] [--rounds 1] [--server s3rver|moto]
        [--readers litdata litdata-raw node] [--job] [--epochs 2]

Writes build/bench/objectstore.json; prints the table and keeps it in
build/bench/objectstore-cpu.md.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench
from bench import publish
from bench.objectstore_children import FETCHERS

BUCKET = "bench"
CLASSES = 5
SIZE = (500, 375)  # ImageNet's most common size
LITDATA_PYTHON = Path("build/litdata-venv/bin/python")
IMAGES, LITDATA = f"s3://{BUCKET}/imagedir/", f"s3://{BUCKET}/litdata/"
READERS = ("litdata", "litdata-raw", "litdata-raw-files", "litdata-2", "node", "node-64",
           "s3sync")  # every read, in round order
DEFAULT_READERS = ("litdata", "litdata-raw", "node")
NAMES = {"litdata": "LitData chunked stream (its defaults)",
         "litdata-2": "LitData chunked stream, 2 workers",
         "litdata-raw": "LitData StreamingRawDataset (per file)",
         "litdata-raw-files": "LitData StreamingRawDataset, each file written (cache_files)",
         **FETCHERS, "push": "upload: kfvision push (setup)",
         "optimize": "LitData optimize (conversion)"}


def dataset(n: int, seed: int = 0, name: str = "objectstore-jpegs") -> Path:
    """The image directory of n JPEGs, generated and converted once, then reused."""
    from bench.jpegset import make_jpeg_set

    out = bench.BENCH / (f"{name}-{n}" + ("" if seed == 0 else f"-seed{seed}"))
    data = make_jpeg_set(out, n, CLASSES, seed, size=SIZE)
    shutil.rmtree(out / "raw", ignore_errors=True)  # the converted copy is what is read
    return data


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (every thread's: /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Store:
    """The S3 server (s3rver or moto): its process, URL, and the environment a client of it
    needs."""

    def __init__(self, work: Path, server: str = "s3rver"):
        self.server = server
        if server == "s3rver":
            from bench import s3rver

            self.proc, self.url = s3rver.start(work, BUCKET)
            key = s3rver.KEY
        else:
            from bench.s3server import start

            self.proc, self.url = start(work)
            key = "bench"
        self.env = {**os.environ, "AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": key,
                    "AWS_SECRET_ACCESS_KEY": key, "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_REGION": "us-east-1", "PYTHONPATH": str(Path.cwd())}

    def usage(self) -> dict:
        """What the server has done so far: CPU seconds, requests, object bytes served."""
        from bench.s3server import counts

        return {"busy_s": 0.0, "server_cpu_s": cpu_seconds(self.proc.pid), **counts(self.url)}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def measure(store: Store, cmd: list, log: Path) -> dict:
    """Run a child to its end: its JSON result, its process seconds and CPU (its whole tree's),
    and what the server did meanwhile."""
    before, children = store.usage(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, env=store.env, stdout=subprocess.PIPE, stderr=out, text=True)
    wall = time.perf_counter() - start
    after, done = store.usage(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                         f"{log.read_text()[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "process_s": wall,
            "client_cpu_s": (done.ru_utime + done.ru_stime) - (children.ru_utime
                                                              + children.ru_stime),
            **{k: after[k] - before[k] for k in after}}


def _children(python, *args) -> list:
    return [str(python), "-m", "bench.objectstore_children", *map(str, args)]


def run_reads(args, store: Store, data: Path, work: Path) -> dict:
    """Upload, LitData's conversion, then each reader `args.rounds` times, the order alternating
    from round to round; {part: [results]}."""
    runs: dict = {}
    runs["push"] = [measure(store, _children(sys.executable, "push", data, IMAGES),
                            work / "push.log")]
    if {"litdata", "litdata-2"} & set(args.readers):
        runs["optimize"] = [measure(store, _children(args.litdata_python, "litdata-optimize",
                                                     data, LITDATA), work / "optimize.log")]
    readers = [r for r in READERS if r in args.readers]
    for r in range(args.rounds):
        for reader in (readers if r % 2 == 0 else readers[::-1]):
            dest = work / f"{reader}-{r}"
            shutil.rmtree(dest, ignore_errors=True)
            if reader in FETCHERS:
                cmd = _children(sys.executable, "fetch", IMAGES, dest, "--fetcher", reader)
            elif reader.startswith("litdata-raw"):
                cmd = _children(args.litdata_python, "litdata-raw", data, IMAGES, dest,
                                *(["--files"] if reader == "litdata-raw-files" else []))
            else:
                cmd = _children(args.litdata_python, "litdata-stream", LITDATA, dest,
                                *(["--workers", "2"] if reader == "litdata-2" else []))
            runs.setdefault(reader, []).append(measure(store, cmd, work / f"{reader}.log"))
            shutil.rmtree(dest)
        print(f"round {r + 1}/{args.rounds} done (load {_load()})", flush=True)
    return runs


def _load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def _median(values: list) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summarise(runs: dict, n: int, dataset_bytes: int) -> dict:
    """Per part: medians over its rounds, and the check that it read every image's bytes."""
    out = {}
    for part, rs in runs.items():
        for r in rs:
            if (r["images"], r["bytes"]) != (n, dataset_bytes):
                raise SystemExit(f"{NAMES[part]} handled {r['images']} images, {r['bytes']} "
                                 f"bytes: not the {n} images, {dataset_bytes} bytes of the set")
        out[part] = {k: _median([r[k] for r in rs]) for k in rs[0]}
        out[part]["images_per_s"] = _median([n / r["seconds"] for r in rs])
        out[part]["rounds"] = len(rs)
        out[part]["per_round_images_per_s"] = [n / r["seconds"] for r in rs]
    return out


def paired(parts: dict, ours: str, theirs: str) -> list:
    """Round by round, `ours`' images/s over `theirs`' in the same round (the two ran one after
    the other: on a machine whose load moves, a ratio within a round is steadier than one of
    medians)."""
    a = parts.get(ours, {}).get("per_round_images_per_s", [])
    b = parts.get(theirs, {}).get("per_round_images_per_s", [])
    return [x / y for x, y in zip(a, b, strict=False)]


def table(parts: dict, n: int, dataset_bytes: int) -> str:
    """Per part: images/s and its ratio to each LitData reader; GETs (requests) a second and the
    mean requests in flight at the server (s3rver: its integral of them over the part's measured
    seconds); the server's CPU per request; the client's CPU per image; bytes served against
    the node's share (one node, one rank: the whole set)."""
    chunked = parts.get("litdata", {}).get("images_per_s")
    raw = parts.get("litdata-raw", {}).get("images_per_s")
    rows = ["| what | seconds (process) | images/s | x LitData chunked | x LitData per file | "
            "GETs/s | in flight | server CPU ms/request | client CPU ms/image | bytes served / "
            "node's share |", "|---|---|---|---|---|---|---|---|---|---|"]
    for part, p in parts.items():
        reader = part in READERS
        x = [f"{p['images_per_s'] / b:.2f}x" if reader and b else "-" for b in (chunked, raw)]
        flight = f"{p['busy_s'] / p['seconds']:.1f}" if p["busy_s"] else "-"
        rows.append(
            f"| {NAMES[part]} | {p['seconds']:.1f} ({p['process_s']:.1f}) | "
            f"{p['images_per_s']:,.0f} | {x[0]} | {x[1]} | {p['requests'] / p['seconds']:,.0f} | "
            f"{flight} | {1000 * p['server_cpu_s'] / max(p['requests'], 1):.2f} | "
            f"{1000 * p['cpu_s'] / n:.2f} | {p['object_bytes'] / dataset_bytes:.2f} |")
    if "node" in parts:
        ours = parts["node"]["images_per_s"]
        for name, key, best, goal in (("LitData per file", "litdata-raw", raw, 1.0),
                                      ("LitData chunked", "litdata", chunked, 0.5)):
            if best:
                rounds = ", ".join(f"{x:.2f}x" for x in paired(parts, "node", key))
                rows.append(f"\nGoal: the node fetcher >= {goal:g}x {name}: "
                            f"{'met' if ours >= goal * best else 'NOT met'} ({ours:,.0f} against "
                            f"{best:,.0f} images/s: {ours / best:.2f}x; round by round "
                            f"{rounds}).")
    for other in ("litdata-raw-files", "node-64"):
        if other in parts and "litdata-raw" in parts:
            rounds = ", ".join(f"{x:.2f}x" for x in paired(parts, other, "litdata-raw"))
            rows.append(f"\n{NAMES[other]} x LitData per file, round by round: {rounds}.")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--images", type=int, default=20000, help="JPEGs in the set")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the reads, order alternating")
    p.add_argument("--server", choices=("s3rver", "moto"), default="s3rver",
                   help="the S3 server: s3rver keeps connections open, moto closes each")
    p.add_argument("--readers", nargs="+", choices=READERS, default=DEFAULT_READERS,
                   help="the reads compared")
    p.add_argument("--job", action="store_true", help="also the 2-node job, s3:// and local")
    p.add_argument("--epochs", type=int, default=2, help="the job's epochs")
    p.add_argument("--image-size", type=int, default=64, help="the job's training image size")
    p.add_argument("--job-flags", default="", help="more trainer flags for both jobs, one "
                   "string (e.g. \"--cache off --workers 1\": the s3:// job's loader for both)")
    p.add_argument("--litdata-python", type=Path, default=LITDATA_PYTHON,
                   help="the interpreter of LitData's venv")
    p.add_argument("--work", type=Path, default=Path("build/bench-objectstore"),
                   help="scratch folder (emptied)")
    args = p.parse_args(argv)
    if any(r.startswith("litdata") for r in args.readers) and not args.litdata_python.exists():
        raise SystemExit(f"{args.litdata_python} does not exist: make LitData's venv first "
                         "(`make litdata-venv`; see `python -m bench.objectstore`'s docstring).")
    data = dataset(args.images)
    from kfvision.trainer.data.imagedir import read_image_directory

    imdir = read_image_directory(data, verify="none")
    dataset_bytes = sum(e.bytes for e in imdir.images)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    load = _load()
    store = Store(args.work, args.server)
    try:
        if args.server == "moto":  # s3rver makes its bucket as it starts
            import boto3

            boto3.client("s3", endpoint_url=store.url, region_name="us-east-1",
                         aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(
                Bucket=BUCKET)
        parts = summarise(run_reads(args, store, data, args.work), args.images, dataset_bytes)
        report(args, parts, None, dataset_bytes, load)  # kept, should the job part fail
        if args.job:
            from bench.objectstore_job import run_jobs

            job = run_jobs(args, store, data, dataset(max(args.images // 20, 50), seed=1),
                           IMAGES)
            report(args, parts, job, dataset_bytes, load)
    finally:
        store.close()
    return 0


def report(args, parts: dict, job: dict | None, dataset_bytes: int, load: str) -> None:
    """Print the tables and keep them, and the JSON record."""
    cmd = (f"python -m bench.objectstore --images {args.images} --rounds {args.rounds} "
           f"--server {args.server} --readers {' '.join(args.readers)}"
           + (f" --job --epochs {args.epochs} --image-size {args.image_size}" if args.job
              else "") + (f" --job-flags \"{args.job_flags}\"" if args.job_flags else ""))
    head = (f"{args.images:,} JPEGs ({dataset_bytes / 1e6:.0f} MB, "
            f"{dataset_bytes / args.images / 1e3:.0f} KB each), {CLASSES} classes, "
            f"{args.server} on loopback, {os.cpu_count()} logical CPUs; `{cmd}`; load average "
            f"(1/5/15 min) {load} before, {_load()} after")
    text = f"{head}\n\n{table(parts, args.images, dataset_bytes)}"
    if job is not None:
        from bench.objectstore_job import job_table

        text += "\n\n" + job_table(job)
    publish(text, "objectstore-cpu.md")
    record = {"command": cmd, "images": args.images, "dataset_bytes": dataset_bytes,
              "processor": bench.processor(), "parts": parts, "job": job}
    (bench.BENCH / "objectstore.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
