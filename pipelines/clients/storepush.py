"""Image directories and models into object storage, laid out as the object-storage-only jobs
read them (docs/data.md, "Image directories and models in object storage"):

    push_image_directory("data/train", "s3://b/data/train")  # images, pack, then the manifest
    push_model("models/r18", "s3://b/models/r18")            # every file, spec.json last

An image directory at `s3://B/P/` is every image at `P/<entry.path>`, the pack files when it has an
up-to-date pack, and `P/kfvision-imagedir.json` as a VERSION 1 manifest (paths relative to P, no
"images_root": a referenced directory is pushed with its images). The manifest goes up last: its
presence means the upload is complete. A model directory is every file under the prefix (not its
checkpoints/ nor hidden files), `spec.json` last (`model.json` just before it).

A push is resumable: the prefix is listed first, and an object already there with the file's size
and ETag (the MD5 the upload would give it) is not sent again, so a push that stopped (retry budget
spent, killed) resumes where it was and a second push of the same directory sends nothing. A
prefix that holds another directory (its last file there but not all of ours) or objects that are
not ours is refused unless `overwrite`; then the old last file is deleted first (readers never see
a mix as complete) and the objects that are not ours before the new last file goes up.
"""

import json
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from kfvision.pipelines.clients import s3, s3put
from kfvision.trainer.errors import InvalidModelDirectoryError


@dataclass(frozen=True)
class Pushed:
    """What a push left in the store, and what it sent."""

    uri: str  # the prefix, ending in "/"
    what: str  # "image directory" or "model directory"
    objects: int  # objects of the directory now under the prefix
    bytes: int  # their bytes
    skipped: int  # of them, already there (not sent again)
    deleted: int = 0  # objects that were not ours, deleted (overwrite)

    def summary(self) -> str:
        sent = self.objects - self.skipped
        return (f"pushed the {self.what} to {self.uri}: {self.objects} object(s), "
                f"{self.bytes:,} bytes; {sent} uploaded, {self.skipped} already there"
                + (f", {self.deleted} old object(s) deleted" if self.deleted else ""))


def _prefix(uri: str) -> tuple[str, str]:
    bucket, key = s3.split_uri(uri)
    return bucket, key if not key or key.endswith("/") else key + "/"


def push_image_directory(folder, uri: str, *, max_connections: int = s3.DEFAULT_CONNECTIONS,
                         progress: bool | None = None, overwrite: bool = False) -> Pushed:
    """Push the image directory at `folder` (version 1, or a referenced version 2) to the prefix
    `uri`: its images, its pack when up to date, then its manifest as version 1.

    Raises:
        InvalidDatasetError, ChangedDatasetError: `folder` is no (valid) image directory.
        ObjectStoreError: the prefix holds another directory or other objects (no `overwrite`).
        NoSuchBucketError, ObjectTransferError, EndpointUnreachableError, EndpointAuthError
        (kfvision.pipelines.clients.s3): as every object-storage call.
    """
    from kfvision.trainer.data.imagedir import MANIFEST, VERSION, read_image_directory

    imdir = read_image_directory(folder)
    files = [(imdir.file(e), e.path) for e in imdir.images]
    files += [(imdir.root / name, name) for name in _pack_files(imdir)]
    doc = json.loads((imdir.root / MANIFEST).read_text(encoding="utf-8"))
    doc["version"] = VERSION
    doc.pop("images_root", None)
    with tempfile.TemporaryDirectory(prefix="kfvision-push-") as tmp:
        manifest = Path(tmp) / MANIFEST
        manifest.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        return _push(files + [(manifest, MANIFEST)], 1, uri, "image directory",
                     max_connections, progress, overwrite)


def _pack_files(imdir) -> tuple[str, ...]:
    """The pack's file names when `imdir` has a pack that fits its manifest, else ()."""
    from kfvision.trainer.data.imagedir import MANIFEST

    if not any(imdir.root.glob("kfvision-pack.*")):  # no pack: torch not imported for nothing
        return ()
    import warnings

    from kfvision.trainer.data.pack import INDEX, PIXELS, StalePackWarning, open_pack

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", StalePackWarning)
        pack = open_pack(imdir)
    if pack is None:
        for w in seen:  # said once more, as what it means here
            warnings.warn(f"not pushing the pack: {w.message}", StalePackWarning, stacklevel=3)
        return ()
    assert MANIFEST not in (INDEX, PIXELS)
    return (PIXELS, INDEX)


def model_last_files(folder) -> tuple[str, ...]:
    """The files of the model directory `folder` that go up last, in order: `model.json` (a
    trained one) and `spec.json`; a training script's model directory (no spec.json): its
    network file.

    Raises:
        InvalidModelDirectoryError: none of these, saying what to give.
    """
    from kfvision.trainer.model.layout import MODEL_FILE
    from kfvision.trainer.model.scripted import has_script_model, read_script_model
    from kfvision.trainer.model.spec import SPEC_FILE

    folder = Path(folder)
    if (folder / SPEC_FILE).is_file():
        return tuple(n for n in (MODEL_FILE, SPEC_FILE) if (folder / n).is_file())
    if has_script_model(folder):  # no network, no model: it goes last
        return (read_script_model(folder).path.name,)
    raise InvalidModelDirectoryError(
        f"{folder} is not a model directory (no {SPEC_FILE}, nor a training script's model.pt2, "
        "model.pt or model.onnx): give the --out of `kfvision train` or of `kfvision model`, "
        "the model directory your script wrote, or an image directory (kfvision-imagedir.json, "
        "made by `kfvision convert`).")


def push_model(folder, uri: str, *, max_connections: int = s3.DEFAULT_CONNECTIONS,
               progress: bool | None = None, overwrite: bool = False) -> Pushed:
    """Push the model directory at `folder` (untrained: spec.json and maybe weights; trained:
    what `kfvision train` writes; or a script's) to the prefix `uri`, `spec.json` last; its
    checkpoints/ and hidden files stay local.

    Raises:
        InvalidModelDirectoryError: `folder` is no model directory. The rest as
        push_image_directory.
    """
    folder = Path(folder)
    last = model_last_files(folder)
    files = sorted((p, p.relative_to(folder).as_posix()) for p in folder.rglob("*")
                   if p.is_file() and not _local_only(p.relative_to(folder).parts))
    files = ([f for f in files if f[1] not in last]
             + [(folder / name, name) for name in last])
    return _push(files, len(last), uri, "model directory", max_connections, progress, overwrite)


def _local_only(parts: tuple) -> bool:
    return parts[0] == "checkpoints" or any(p.startswith(".") for p in parts)


def _same(path: Path, there: s3.Obj | None) -> bool:
    """Whether `there` (listed) already holds the bytes of `path`."""
    return (there is not None and there.size == path.stat().st_size
            and there.etag == s3put.local_etag(path))


def _push(files: list, n_last: int, uri: str, what: str, max_connections: int,
          progress: bool | None, overwrite: bool) -> Pushed:
    """Upload `files` ((path, key below the prefix), the last `n_last` of them in order after
    all others) to `uri`, resuming: see the module doc."""
    from kfvision.trainer.options import options_of

    options_of(s3.S3Options)[0].check(max_connections)
    bucket, prefix = _prefix(uri)
    where = f"{s3.SCHEME}{bucket}/{prefix}"
    there = {o.key[len(prefix):]: o for o in s3.list_objects(where, max_connections)}
    keys = [k for _, k in files]
    with ThreadPoolExecutor(max_connections, thread_name_prefix="kfvision-s3") as pool:
        same = list(pool.map(lambda f: _same(f[0], there.get(f[1])), files))
    todo = [f for f, s in zip(files, same, strict=True) if not s]
    marker = keys[-1]
    others = sorted(set(there) - set(keys))
    stale_marker = marker in there and bool(todo)
    if (stale_marker or (others and marker not in there)) and not overwrite:
        held = (f"another {what} (its {marker} differs from this one's, or its files do)"
                if stale_marker else f"{len(others)} object(s) that are not this {what}'s "
                f"(first: {others[0]})")
        raise s3.ObjectStoreError(f"{where} already holds {held}: give a new prefix, or "
                                  "replace what is there (--overwrite).")
    if stale_marker:  # from now until the new one is up, the prefix holds no complete directory
        s3.delete(bucket, [prefix + marker])
        todo = [f for f in todo if f[1] != marker] + files[-1:]
    deleted = others if overwrite else []
    final = [f for f in todo if f[1] in keys[-n_last:]]
    body = [f for f in todo if f not in final]
    _upload_all(body, final, bucket, prefix, max_connections, progress,
                before_final=lambda: s3.delete(bucket, [prefix + k for k in deleted]))
    sizes = [p.stat().st_size for p, _ in files]
    return Pushed(where, what, len(files), sum(sizes), len(files) - len(todo), len(deleted))


def _upload_all(body: list, final: list, bucket: str, prefix: str, max_connections: int,
                progress: bool | None, before_final) -> None:
    """Upload `body` in parallel, call before_final(), then `final` one by one in order."""
    from kfvision.trainer.progressbar import progress_bar

    bar = progress_bar(None, "push", "B", progress,
                       total=sum(p.stat().st_size for p, _ in body + final))
    update = getattr(bar, "update", None)
    if update is not None:
        bar.unit_scale = True
    lock = threading.Lock()

    def up(path: Path, key: str) -> None:
        s3put.upload(path, bucket, prefix + key, max_connections)
        if update is not None:
            with lock:
                update(path.stat().st_size)

    try:
        with ThreadPoolExecutor(max_connections, thread_name_prefix="kfvision-s3") as pool:
            futures = [pool.submit(up, p, k) for p, k in body]
            try:
                for f in as_completed(futures):
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        before_final()
        for path, key in final:
            up(path, key)
    finally:
        if hasattr(bar, "close"):
            bar.close()
