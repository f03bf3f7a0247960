"""bench.objectstore's contenders, each run as a child process of its own: LitData's conversion
and streaming read (in LitData's venv: it is not one of the project's packages) and our fetch (in
the project's venv). Each prints one JSON line last: the seconds and the CPU seconds (every thread
of the process: time.process_time) of its measured part (imports and interpreter start left out:
torch, which the node fetcher's sampler order needs, is imported before), the images and the
bytes it handled.

    python -m bench.objectstore_children litdata-optimize DATA s3://b/litdata/
    python -m bench.objectstore_children litdata-stream s3://b/litdata/ CACHE [--workers 2]
    python -m bench.objectstore_children litdata-raw DATA s3://b/imagedir/ CACHE
    python -m bench.objectstore_children fetch s3://b/imagedir/ DEST [--fetcher s3sync]
    python -m bench.objectstore_children push DATA s3://b/imagedir/
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

FETCHERS = {"node": "kfvision node fetcher (one node, one rank)",
            "node-64": "kfvision node fetcher, 64 connections",
            "s3sync": "kfvision s3sync.fetch (the whole prefix)"}


def _now() -> tuple:
    return time.perf_counter(), time.process_time()


def _since(start: tuple) -> dict:
    """The seconds and the process's CPU seconds (all its threads) since `start` (_now())."""
    return {"seconds": time.perf_counter() - start[0], "cpu_s": time.process_time() - start[1]}


def node_fetch(uri: str, dest: Path, connections: int | None = None) -> None:
    """The node fetcher (kfvision.pipelines.clients.nodefetch) as the node agent starts it, for a
    one-node, one-rank job of one epoch: the whole image directory, in the sampler's order,
    into dest/data/train/images. No trainer runs: epoch 1 is fetched without waiting for one."""
    from kfvision.pipelines.clients import fetchplan, nodefetch, s3
    from kfvision.pipelines.jobs.storenode import stage_images

    channel = stage_images("train", uri, dest)
    connections = connections or s3.DEFAULT_CONNECTIONS
    channel.list(connections)
    fetcher = nodefetch.NodeFetcher(channel, None, fetchplan.Plan(1, (0,), 0, 1),
                                    dest / "arrival", max_connections=connections).start()
    while len(fetcher.held) < len(channel.paths) and not fetcher.done.is_set():
        time.sleep(0.01)  # it serves late requests until stopped: done once it holds them all
    fetcher.stop()
    if fetcher.error is not None:
        raise fetcher.error


def s3sync_fetch(uri: str, dest: Path) -> None:
    """s3sync.fetch of the prefix: every object under it (the manifest too) into dest."""
    from kfvision.pipelines.clients.s3sync import fetch

    fetch(uri, dest, progress=False)


def _litdata_over_http() -> None:
    """Let LitData's obstore client speak plain http to the loopback server. LitData passes its
    own client options to obstore's S3Store, and those replace the ones obstore reads from the
    environment (AWS_ALLOW_HTTP included): without this its uploads and range GETs stop at
    "HTTP error: builder error" (litdata 0.2.76, obstore 0.12.1). A store on https needs nothing.
    At import: LitData's spawned workers import this module too."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS,
                                          "allow_http": "true"}


if importlib.util.find_spec("litdata") is not None:  # in LitData's venv only
    _litdata_over_http()


def _sample(item: tuple) -> dict:
    """One LitData sample: the JPEG's bytes as they are (LitData's bytes serializer: no decoding,
    no re-encoding) and its label."""
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def litdata_optimize(data: Path, uri: str, workers: int | None) -> dict:
    """`litdata.optimize` of every image of the image directory `data` (its bytes and label)
    into LitData's chunks at `uri`, its defaults otherwise (chunk_bytes is required: 64MB, as
    LitData's README writes it)."""
    import litdata

    from kfvision.trainer.data.imagedir import read_image_directory

    imdir = read_image_directory(data, verify="none")
    inputs = [(str(imdir.file(e)), e.label) for e in imdir.images]
    start = _now()
    litdata.optimize(fn=_sample, inputs=inputs, output_dir=uri, chunk_bytes="64MB",
                     **({"num_workers": workers} if workers else {}))
    took = _since(start)
    return {**took, "images": len(inputs),
            "bytes": sum(e.bytes for e in imdir.images)}


def litdata_stream(uri: str, cache: Path, workers: int | None) -> dict:
    """Read every sample of LitData's dataset at `uri` through StreamingDataset and
    StreamingDataLoader (their defaults; `workers` loader processes where given), into the fresh
    cache folder `cache`; the image bytes are counted, never decoded."""
    from litdata import StreamingDataLoader, StreamingDataset

    start = _now()
    dataset = StreamingDataset(uri, cache_dir=str(cache))
    loader = StreamingDataLoader(dataset, **({"num_workers": workers} if workers else {}))
    images = size = 0
    for batch in loader:
        for data in batch["image"]:
            images += 1
            size += len(data)
    return {**_since(start), "images": images, "bytes": size}


def litdata_raw(data: Path, uri: str, cache: Path, batch: int = 64, files: bool = False) -> dict:
    """Read every image of the image directory at `uri` with LitData's per-file reader,
    StreamingRawDataset (one GET per file, its asyncio downloads: up to 128 in flight in one
    process by its own rule), through a torch DataLoader in random order (batch `batch`, no
    worker process: as the node fetcher reads, one process), the bytes counted, not decoded;
    with `files`, each image also written to a file under `cache` (its cache_files).
    Its file list is given from the manifest (an indexer of ours): its own lists the prefix
    through s3fs, which neither venv has, and stores the list zstd-compressed."""
    from litdata.raw.dataset import StreamingRawDataset
    from litdata.raw.indexer import BaseIndexer, FileMetadata
    from torch.utils.data import DataLoader

    from kfvision.trainer.data.imagedir import read_image_directory

    imdir = read_image_directory(data, verify="none")
    files = [FileMetadata(uri + imdir.file(e).relative_to(data).as_posix(), e.bytes)
             for e in imdir.images]

    class Manifest(BaseIndexer):
        def discover_files(self, input_dir, storage_options):
            return files

        def build_or_load_index(self, *args, **kwargs):
            return files

    start = _now()
    dataset = StreamingRawDataset(uri, cache_dir=str(cache), indexer=Manifest(),
                                  cache_files=files)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, collate_fn=list)
    images = size = 0
    for items in loader:
        images += len(items)
        size += sum(map(len, items))
    return {**_since(start), "images": images, "bytes": size}


def fetch(uri: str, dest: Path, fetcher: str) -> dict:
    """Our fetch (FETCHERS) of the image directory at `uri` into the empty folder `dest`."""
    import torch  # noqa: F401 (the node agent's, once: not a cost of reading)

    from kfvision.pipelines.clients import nodefetch, s3sync  # noqa: F401

    start = _now()
    {"node": node_fetch, "node-64": lambda u, d: node_fetch(u, d, 64),
     "s3sync": s3sync_fetch}[fetcher](uri, dest)
    took = _since(start)
    files = [p for p in dest.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return {**took, "images": sum(p.suffix == ".jpg" for p in files),
            "bytes": sum(p.stat().st_size for p in files if p.suffix == ".jpg")}


def push(data: Path, uri: str) -> dict:
    """The image directory `data` up to `uri` as `kfvision push` sends it, its manifest last."""
    from kfvision.pipelines.clients.storepush import push_image_directory
    from kfvision.trainer.data.imagedir import read_image_directory

    imdir = read_image_directory(data, verify="none")
    start = _now()
    push_image_directory(data, uri, progress=False)
    return {**_since(start), "images": len(imdir.images),
            "bytes": sum(e.bytes for e in imdir.images)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("litdata-optimize")
    o.add_argument("data", type=Path)
    o.add_argument("uri")
    o.add_argument("--workers", type=int, help="optimize's num_workers (default: its own)")
    s = sub.add_parser("litdata-stream")
    s.add_argument("uri")
    s.add_argument("cache", type=Path)
    s.add_argument("--workers", type=int, help="the loader's num_workers (default: its own)")
    r = sub.add_parser("litdata-raw")
    r.add_argument("data", type=Path)
    r.add_argument("uri")
    r.add_argument("cache", type=Path)
    r.add_argument("--files", action="store_true", help="write each file (its cache_files)")
    f = sub.add_parser("fetch")
    f.add_argument("uri")
    f.add_argument("dest", type=Path)
    f.add_argument("--fetcher", choices=FETCHERS, default="node", help="which of ours")
    u = sub.add_parser("push")
    u.add_argument("data", type=Path)
    u.add_argument("uri")
    a = p.parse_args(argv)
    if a.what == "push":
        result = push(a.data, a.uri)
    elif a.what == "litdata-optimize":
        result = litdata_optimize(a.data, a.uri, a.workers)
    elif a.what == "litdata-stream":
        result = litdata_stream(a.uri, a.cache, a.workers)
    elif a.what == "litdata-raw":
        result = litdata_raw(a.data, a.uri, a.cache, files=a.files)
    else:
        result = fetch(a.uri, a.dest, a.fetcher)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
