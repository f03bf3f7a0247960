"""The bytes each node fetches over a run from s3://: a PyTorchJob of `--nodes` nodes x 1 process
under `kfvision job run-local`, its data in moto's S3 server on loopback (bench/s3server.py, via
bench.objectstore's Store), the digits (PNGs) at 32 px; per node, its node agent's
fetch-summary.json (pipelines/clients/nodefetch.py) epoch by epoch, against its share of an
epoch and the dataset.

The sampler deals the images out afresh every epoch, so "at most its share" holds per epoch:
over E epochs a node of N draws about 1 - (1 - 1/N)^E of the dataset, each image fetched once
(the scratch folder keeps what it fetched). The table gives both, measured and that expectation.

    python -m bench.nodebytes [--nodes 4 --epochs 5 --per-class 60]
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from kfvision.pipelines.contract import SCRATCH_MOUNT
from kfvision.pipelines.jobs.storenode import SUMMARY

from bench.objectstore import Store

BUCKET = "nodebytes"


def _data(work: Path, per_class: int) -> dict:
    from kfvision.pipelines.flow.demo import write_digits
    from kfvision.trainer.data.convert import convert
    from kfvision.trainer.model.arch import write_untrained_model

    write_digits(work / "raw", limit=per_class)
    for part in ("train", "val"):
        convert(work / "raw" / part, work / part, progress=False)
    write_untrained_model(work / "model", "resnet18")
    return {"train": work / "train", "val": work / "val", "model": work / "model"}


def _upload(store: Store, local: dict) -> dict:
    import boto3

    boto3.client("s3", endpoint_url=store.url, region_name="us-east-1",
                 aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(
        Bucket=BUCKET)
    cmd = [sys.executable, "-m", "kfvision.pipelines.cli", "push"]
    uris = {}
    for name, folder in local.items():
        uris[name] = f"s3://{BUCKET}/{name}/"
        subprocess.run([*cmd, str(folder), uris[name]], env=store.env, check=True,
                       capture_output=True, text=True)
    return uris


def run(args) -> dict:
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    local = _data(args.work, args.per_class)
    store = Store(args.work)
    try:
        uris = _upload(store, local)
        manifest, logs = args.work / "job.yaml", args.work / "logs"
        cli = [sys.executable, "-m", "kfvision.pipelines.cli", "job"]
        subprocess.run([*cli, "render", "--name", "nodebytes", "--image", "local", "--nodes",
                        str(args.nodes), "--nproc-per-node", "1", "--model", uris["model"],
                        "--train", uris["train"], "--val", uris["val"], "--out",
                        f"s3://{BUCKET}/out/", "--epochs", str(args.epochs), "--image-size",
                        "32", "--batch-size", "8", "--print-freq", "1000", "-o", str(manifest)],
                       env=store.env, check=True, capture_output=True, text=True)
        job = subprocess.run([*cli, "run-local", str(manifest), "--log-dir", str(logs),
                              "--quiet"], env=store.env, capture_output=True, text=True)
        if job.returncode:
            raise SystemExit(f"the job failed ({job.returncode}):\n{job.stderr[-3000:]}")
    finally:
        store.close()
    summaries = sorted((logs / "pods").glob(f"*/{SCRATCH_MOUNT.lstrip('/')}/{SUMMARY}"))
    return {"nodes": args.nodes, "epochs": args.epochs,
            "summaries": {p.parent.parent.name:
                          json.loads(p.read_text()) for p in summaries}}


def table(result: dict) -> str:
    n, epochs = result["nodes"], result["epochs"]
    expected = 1 - (1 - 1 / n) ** epochs
    listed = ", ".join(map(str, range(1, epochs + 1)))
    rows = [f"| node | training images (kB) fetched in epoch {listed} | over the run | its share "
            "of an epoch | the dataset | run / dataset |",
            "|---|---|---|---|---|---|"]
    for node, s in result["summaries"].items():
        fetched = [s["fetched"].get(str(e), {}).get("train", [0, 0]) for e in range(1, epochs + 1)]
        images, size = sum(f[0] for f in fetched), sum(f[1] for f in fetched)
        (share_n, share_b), (all_n, all_b) = s["share"]["train"], s["dataset"]["train"]
        rows.append(f"| {node} | {', '.join(f'{o} ({b / 1e3:.1f})' for o, b in fetched)} | "
                    f"{images} ({size / 1e3:.1f}) | {share_n} ({share_b / 1e3:.1f}) | "
                    f"{all_n} ({all_b / 1e3:.1f}) | {size / all_b:.2f} |")
    rows.append(f"\nExpected share of the dataset over {epochs} epochs for 1 node of {n}: "
                f"1 - (1 - 1/{n})^{epochs} = {expected:.2f}.")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--nodes", type=int, default=4, help="nodes (1 process each)")
    p.add_argument("--epochs", type=int, default=5, help="epochs")
    p.add_argument("--per-class", type=int, default=60, help="digits per class (80%% train)")
    p.add_argument("--work", type=Path, default=Path("build/bench-nodebytes"), help="work folder")
    args = p.parse_args(argv)
    result = run(args)
    (args.work / "result.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
