"""The node agent: a pod's entry point when the job's data, model or outputs are `s3://` URIs, so
that a multi-node job needs object storage and nothing else (no ReadWriteMany volume).

    python -m kfvision.pipelines.jobs.storenode <the training flags, as kfvision.trainer.train
                                                 takes them; any of --train --val --model --out
                                                 --checkpoint-dir an s3:// URI>

On each node (pod) it
1. fetches the untrained model (small) into the scratch disk, and the two image directories'
   manifests, written there as referenced manifests whose images *arrive*
   (trainer/data/arrival.py);
2. starts the node's fetcher (pipelines/clients/nodefetch.py): the images this node's ranks read,
   in their samplers' order, each once;
3. on the node of rank 0, puts the store's checkpoints where the trainer looks for them (so a new
   pod resumes as one with a PVC does) and uploads each new one while training goes on;
4. runs the usual launch (`python -m kfvision.trainer.launch -m kfvision.trainer.train`) with the
   URIs replaced by scratch folders; a fetch that fails stops it, with the fetch's error and exit
   code;
5. afterwards (node of rank 0) pushes the model folder to --out, also after a failure (its
   metrics.json says so, and the best epoch's weights are kept), and removes the store's
   checkpoints once the completed model is there.

The scratch disk is the pod's own (an emptyDir, or a generic ephemeral volume: `kfvision job
render --scratch-size/--scratch-class`), at contract.SCRATCH_MOUNT or $KFVISION_SCRATCH:

    model/        the untrained model          data/train/  data/val/   manifests + images
    arrival/      the fetcher's notes          checkpoints/ the trainer's, mirrored to the store
    out/          the trained model folder     fetch-summary.json  what this node fetched
                                               (as each epoch begins, and at the end)
"""

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kfvision.pipelines import contract
from kfvision.pipelines.clients import (
    fetchplan,
    nodefetch,
    s3,
    s3download,
    s3put,
    s3sync,
    storedirs,
)
from kfvision.pipelines.jobs.storejob import STORE_PATHS
from kfvision.pipelines.jobs.trainjob.rules import PET_NAMES
from kfvision.trainer.errors import KfvisionError
from kfvision.trainer.exitcodes import error_line

log = logging.getLogger("kfvision")
NNODES, NPROC, NODE_RANK = PET_NAMES[:3]
SUMMARY = "fetch-summary.json"
CHECKPOINTS = "checkpoints/"  # under --out when --checkpoint-dir is not given


def _say(text: str) -> None:
    print(f"[storenode] {text}", flush=True)


def prefix(uri: str) -> str:
    return uri if uri.endswith("/") else uri + "/"


def rewrite(argv: list, values: dict) -> list:
    """`argv` with the value of each flag in `values` (field name -> new value) replaced, in both
    spellings (`--flag value`, `--flag=value`); a flag not in argv is appended."""
    out, seen, i = [], set(), 0
    flags = {"--" + k.replace("_", "-"): k for k in values}
    while i < len(argv):
        a = argv[i]
        name, eq, _ = a.partition("=")
        if name in flags:
            seen.add(flags[name])
            out += [name, str(values[flags[name]])]
            i += 1 if eq else 2
            continue
        out.append(a)
        i += 1
    for k, v in values.items():
        if k not in seen:
            out += ["--" + k.replace("_", "-"), str(v)]
    return out


def node_identity() -> tuple:
    """(nodes, processes per node, this node's rank) from the `PET_*` variables both job kinds
    inject (../shared/reference/README.md); one node, one process without them."""
    nnodes = int(os.environ.get(NNODES, "1").split(":")[-1])  # MIN:MAX: the most
    nproc = os.environ.get(NPROC, "1")
    if not nproc.isdigit():  # "auto", "gpu", "cpu": torchrun's own reading of it
        from torch.distributed.run import determine_local_world_size

        nproc = determine_local_world_size(nproc)
    return nnodes, int(nproc), int(os.environ.get(NODE_RANK, "0"))


def stage_images(name: str, uri: str, scratch: Path) -> fetchplan.Channel:
    """The local manifest of the image directory at `uri`, its images to arrive under
    scratch/data/NAME/images; the Channel the fetcher fills."""
    from kfvision.trainer.data.imagedir import write_manifest

    root = scratch / "data" / name
    store = storedirs.image_directory_at(uri)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    write_manifest(root, store.classes, store.images, images_root=images.absolute(),
                   source={"uri": prefix(uri)}, arrival=(scratch / "arrival").absolute())
    return fetchplan.Channel(name, prefix(uri), [e.path for e in store.images],
                             [e.bytes for e in store.images], images)


def stage_model(uri: str, scratch: Path, max_connections: int) -> Path:
    """The untrained model at `uri`, fetched into scratch/model.

    Raises:
        InvalidModelDirectoryError: no model directory at `uri` (storedirs.model_at).
    """
    storedirs.model_at(uri)
    dest = scratch / "model"
    s3sync.fetch(prefix(uri), dest, max_connections=max_connections, progress=False)
    return dest


class CheckpointMirror:
    """Keeps the store's checkpoint prefix equal to the trainer's checkpoint folder, from a
    thread: each new (whole: the trainer renames it into place) file uploaded, then the files the
    trainer rotated away deleted, so the store always holds a complete newest checkpoint."""

    def __init__(self, folder: Path, uri: str, max_connections: int):
        self.folder, self.uri = folder, prefix(uri)
        self.bucket, self.key = s3.split_uri(self.uri)
        self.max_connections = max_connections
        self.sent: dict = {}  # name -> (size, mtime) uploaded
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpoints", daemon=True)

    def restore(self) -> int:
        """Put the store's checkpoints into the folder (a new pod's empty scratch disk); returns
        how many."""
        self.folder.mkdir(parents=True, exist_ok=True)
        n = 0
        for obj in s3.list_objects(self.uri, self.max_connections):
            name = obj.key[len(self.key):]
            if "/" in name or not name.endswith(".pt"):
                continue
            target = self.folder / name
            if not (target.exists() and target.stat().st_size == obj.size):
                s3download.download(obj, self.bucket, target, self.max_connections)
            st = target.stat()
            self.sent[name] = (st.st_size, st.st_mtime_ns)
            n += 1
        return n

    def start(self) -> "CheckpointMirror":
        self._thread.start()
        return self

    def sync(self) -> None:
        """Upload what is new, then delete what the trainer removed (not when the folder is
        gone as a whole: the completed run removes it; the store's copy goes after the model)."""
        if not self.folder.is_dir():
            return
        here = {}
        for p in self.folder.iterdir():
            if p.is_file() and p.suffix == ".pt" and not p.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    here[p.name] = (st.st_size, st.st_mtime_ns)
        for name, sig in sorted(here.items()):
            if self.sent.get(name) != sig:
                with contextlib.suppress(FileNotFoundError):  # rotated away meanwhile
                    s3put.upload(self.folder / name, self.bucket, self.key + name,
                              self.max_connections)
                    self.sent[name] = sig
        gone = sorted(set(self.sent) - set(here))
        if gone and self.folder.is_dir():
            s3.delete(self.bucket, [self.key + n for n in gone])
            for n in gone:
                self.sent.pop(n)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.sync()
            except BaseException as e:  # noqa: BLE001 (reported by stop(); training goes on)
                self.error = e
                log.warning("checkpoint upload to %s failed (retried next time): %s", self.uri, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sync()

    def clear(self) -> None:
        s3.delete(self.bucket, [o.key for o in s3.list_objects(self.uri, self.max_connections)])


def _stage(cfg, uris: dict, scratch: Path, max_connections: int) -> tuple:
    """Fetch the model, the manifests; start the fetcher. Returns (local flag values, fetcher)."""
    nnodes, nproc, node_rank = node_identity()
    local, fetcher = {}, None
    if "model" in uris:
        local["model"] = stage_model(uris["model"], scratch, max_connections)
    channels = {k: stage_images(k, uris[k], scratch) for k in ("train", "val") if k in uris}
    for k, ch in channels.items():
        ch.list(max_connections)
        local[k] = ch.folder.parent
    if channels:
        need = sum(sum(ch.sizes) for ch in channels.values())
        fetchplan.check_room(scratch, need)
        ranks = tuple(range(node_rank * nproc, (node_rank + 1) * nproc))
        plan = fetchplan.Plan(nnodes * nproc, ranks, cfg.seed, cfg.epochs)
        train = channels.get("train")
        if train is None:  # only val from the store: it is then the one the plan walks
            train, channels["val"] = channels.pop("val"), None
        fetcher = nodefetch.NodeFetcher(train, channels.get("val"), plan, scratch / "arrival",
                                        max_connections=max_connections).start()
        _say(f"node {node_rank} of {nnodes} ({nproc} process(es)): fetching its ranks' images "
             f"of {', '.join(ch.uri for ch in channels.values() if ch)} into {scratch}, in "
             "their samplers' order")
    if "out" in uris:
        local["out"] = scratch / "out"
    return local, fetcher


def push_model(folder: Path, uri: str, max_connections: int) -> None:
    """The model folder's files to `uri`, metrics.json last (what says how the run ended);
    nothing else under `uri` is touched (the checkpoints a failed run resumes from stay)."""
    bucket, key = s3.split_uri(uri)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name == "metrics.json")
    for p in files:
        s3put.upload(p, bucket, key + p.relative_to(folder).as_posix(), max_connections)


def _checkpoints(cfg, uris: dict, scratch: Path, max_connections: int):
    """The store's checkpoint prefix mirrored by the node of rank 0 (None: not in the store)."""
    uri = uris.get("checkpoint_dir") or (prefix(uris["out"]) + CHECKPOINTS if "out" in uris
                                         and not cfg.checkpoint_dir else None)
    if uri is None or node_identity()[2] != 0:
        return None
    mirror = CheckpointMirror(scratch / "checkpoints", uri, max_connections)
    n = mirror.restore()
    if n:
        _say(f"{n} checkpoint(s) from {mirror.uri}: training resumes from the newest")
    return mirror.start()


def _run_trainer(argv: list, fetcher, summary: Path) -> int:
    """The usual launch; stopped (its process group) when the fetcher fails. The fetcher's
    summary is written to `summary` each time the node's ranks begin an epoch, so that a node
    killed later leaves what it fetched until then."""
    cmd = [sys.executable, "-m", "kfvision.trainer.launch", "-m", "kfvision.trainer.train", *argv]
    child = subprocess.Popen(cmd, start_new_session=True)

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    written = 0  # the epoch the summary was last written in
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if fetcher is not None and (epoch := fetcher.trainer_epoch()) > written:
            written = epoch
            nodefetch.write_summary(fetcher, summary)
        if fetcher is not None and fetcher.error is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            raise fetcher.error


def _finish(uris: dict, local: dict, fetcher, mirror, rc: int, scratch: Path,
            max_connections: int) -> None:
    if fetcher is not None:
        fetcher.stop()
        nodefetch.write_summary(fetcher, scratch / SUMMARY)
        s = fetcher.summary()
        total = sum(row[1] for by in s["fetched"].values() for row in by.values())
        _say(f"fetched {total:,} bytes; [objects, bytes] by epoch {json.dumps(s['fetched'])}, "
             f"this node's epoch-1 share {json.dumps(s['share'])}, the dataset "
             f"{json.dumps(s['dataset'])}")
    if mirror is not None:
        mirror.stop()
    out = local.get("out")
    if out is not None and node_identity()[2] == 0 and Path(out).is_dir() and any(
            Path(out).iterdir()):
        push_model(Path(out), prefix(uris["out"]), max_connections)
        _say(f"model pushed to {prefix(uris['out'])}")
        if rc == 0 and mirror is not None:
            mirror.clear()  # the model is the result now, as the trainer does on a disk


def run(argv: list) -> int:
    from kfvision.trainer.config import config_from_args, get_args_parser

    cfg = config_from_args(get_args_parser().parse_args(argv))
    uris = {k: getattr(cfg, k) for k in STORE_PATHS if s3.is_s3(getattr(cfg, k) or "")}
    scratch = contract.pod_path(os.environ.get(contract.SCRATCH_ENV, contract.SCRATCH_MOUNT))
    scratch.mkdir(parents=True, exist_ok=True)
    max_connections = int(os.environ.get("KFVISION_S3_CONNECTIONS", s3.DEFAULT_CONNECTIONS))
    local, fetcher = _stage(cfg, uris, scratch, max_connections)
    mirror = _checkpoints(cfg, uris, scratch, max_connections)
    if mirror is not None:
        local["checkpoint_dir"] = mirror.folder
    elif "checkpoint_dir" in uris:  # another node: the trainer writes none here
        local["checkpoint_dir"] = scratch / "checkpoints"
    rc = 1
    try:
        rc = _run_trainer(rewrite(argv, local), fetcher, scratch / SUMMARY)
    finally:
        _finish(uris, local, fetcher, mirror, rc, scratch, max_connections)
    return rc


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run(argv)
    except KfvisionError as e:
        print(error_line(e), file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
