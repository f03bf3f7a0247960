"""Convert to Image Directory: a folder or archive of images -> kfvision's ImageDirectory.

    kfvision convert photos/ data/all                      # class folders (maybe under one wrapper)
    kfvision convert photos.tar.gz data/all                # .zip .tar .tar.gz .tgz .tar.bz2
    kfvision convert flat/ data/all --labels labels.csv    # flat images + path,label CSV
    kfvision convert loose/ data/unlabelled                # no classes: for scoring only

Images are copied byte for byte (never re-encoded). Each is decoded once, through the Pillow decode
the trainer's `load_rgb` falls back on (trainer/data/rgb.py: without torch, which a conversion
never imports), so whatever lands in the output is known to reach the model as RGB.
Unreadable files are skipped and reported (or fail the run with strict); an image above Pillow's
pixel limit fails the run (DecompressionBombError). Everything is written to a staging folder
beside OUT and renamed into place at the end: on any failure nothing is left at OUT.

    kfvision convert /data/photos data/all --in-place     # OUT holds the manifest only

`in_place` copies nothing: OUT's manifest references the images where they are (a referenced
image directory, see kfvision.trainer.data.imagedir). An archive is then extracted once, into
`extract_to`, and referenced there. The source may change while it is read: every file's size
and modification time are taken before it is read and again at the end, and the source is
listed again, so a file changed, added or removed meanwhile fails the conversion (a
ChangedDatasetError naming it) instead of recording a mix of old and new.
"""

import gc
import hashlib
import io
import multiprocessing
import os
import shutil
import tempfile
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

from kfvision.trainer.data.archive import archive_kind, extract_archive
from kfvision.trainer.data.imagedir import IMAGE_EXTENSIONS, ImageEntry, write_manifest
from kfvision.trainer.data.rgb import pil_rgb
from kfvision.trainer.data.sources import plan_source, relative_path
from kfvision.trainer.errors import ChangedDatasetError, DecompressionBombError, InvalidDatasetError
from kfvision.trainer.fileio import disk_errors, full_disk_error
from kfvision.trainer.progressbar import progress_bar
from PIL import Image

UNLABELLED_NOTE = "no class folders and no labels: an UNLABELLED image directory (scoring only)"


@dataclass
class ConvertReport:
    """What a conversion wrote and what it skipped (and why), for the end-of-run summary."""

    out: Path
    classes: list[str]
    counts: dict[str, int]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (source path, reason)
    images: int = 0

    def summary(self, limit: int = 20) -> str:
        lines = [f"wrote {self.images} images to {self.out}"]
        if self.classes:
            lines.append(f"{len(self.classes)} classes:")
            lines += [f"  {c:<24} {n:>7}" for c, n in self.counts.items()]
        else:
            lines.append(UNLABELLED_NOTE)
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} file(s):")
            reasons = Counter(why for _, why in self.skipped).most_common()
            width = len(str(reasons[0][1]))
            lines += [f"  {n:>{width}} x {why}" for why, n in reasons]
            lines += [f"  {p}: {why}" for p, why in self.skipped[:limit]]
            if len(self.skipped) > limit:
                lines.append(f"  ... and {len(self.skipped) - limit} more")
        return "\n".join(lines)


def probe_image(data: bytes, where: str = "image") -> tuple[int, int]:
    """Decode an image fully, as the trainer will; return (width, height).

    Raises:
        ValueError: empty, not an image, truncated, or not convertible to RGB (skippable).
        DecompressionBombError: more pixels than PIL.Image.MAX_IMAGE_PIXELS (never skipped).
    """
    if not data:
        raise ValueError("is empty (0 bytes)")
    limit = Image.MAX_IMAGE_PIXELS  # read now: a caller (or test) may have changed it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we raise instead
            with Image.open(io.BytesIO(data)) as im:
                size = im.size
    except Image.DecompressionBombError as e:  # Pillow refuses > 2x its limit itself
        raise _bomb(where, f"Pillow refused it ({e})", limit) from e
    except Exception as e:  # Pillow raises many types on malformed files; the reason is kept
        raise ValueError(f"cannot be decoded as an image ({type(e).__name__}: {e})") from e
    if limit and size[0] * size[1] > limit:
        raise _bomb(where, f"{size[0]} x {size[1]} = {size[0] * size[1]:,} pixels", limit)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            pil_rgb(io.BytesIO(data))
    except Exception as e:  # truncated data, unsupported mode, decoder errors
        raise ValueError(f"cannot be decoded as an image ({type(e).__name__}: {e})") from e
    return size


def _bomb(where: str, what: str, limit) -> DecompressionBombError:
    return DecompressionBombError(
        f"{where}: {what}, over the limit of {limit:,} pixels (PIL.Image.MAX_IMAGE_PIXELS); "
        "refused as a possible decompression bomb. Remove the file or downscale it below the "
        "limit."
    )


def convert(src, out, *, labels=None, strict: bool = False, overwrite: bool = False,
            progress: bool | None = None, in_place: bool = False,
            extract_to=None, origin: dict | None = None) -> ConvertReport:
    """Convert a folder or archive of images into an ImageDirectory at `out`.

    Args:
        src: a folder, or a .zip/.tar/.tar.gz/.tgz/.tar.bz2 file. Class folders may sit under one
            wrapping folder; loose images with no `labels` make an unlabelled directory.
        out: the image directory to write; must not exist unless `overwrite`.
        labels: a CSV of path,label (paths relative to `src`, or to the archive's root).
        strict: fail on the first skippable file instead of skipping it.
        progress: a progress bar (None: only when attached to a terminal).
        in_place: write only the manifest, referencing the images where they are.
        extract_to: with `in_place` and an archive, the new folder it is extracted into (where
            its images then stay; removed again if the conversion fails).
        origin: where `src` was fetched from, as plain data recorded in the manifest's `source`
            (`{"uri": ..., "etags": {path: ETag}}`); reports then name files by `origin["uri"]`.
    Returns:
        the ConvertReport (per-class counts, skipped files with reasons).
    Raises:
        InvalidDatasetError: bad source or labels, no images, an empty or single class, or a bad
            file with `strict`. UnsafeArchiveError, DecompressionBombError: refused input.
            ChangedDatasetError: (in_place) the source changed while it was read.
    """
    src, out = Path(src), Path(out)
    _check_paths(src, out, overwrite)
    extract_to = _check_extract_to(src, in_place, extract_to)
    out.parent.mkdir(parents=True, exist_ok=True)
    with disk_errors(out):
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    done, plan = False, None
    try:
        root, archived = Path(os.path.abspath(src)), src.is_file()
        if archived:
            root = extract_to or staging / "extracted"
            root.mkdir(parents=True)
            extract_archive(src, root, progress)
        shown = origin["uri"].rstrip("/") if origin else str(src)
        plan = plan_source(root, shown=shown, archive=archived, labels=labels)
        report = ConvertReport(out, list(plan.classes), {c: 0 for c in plan.classes})
        for where, why in plan.skipped:
            _skip(report, where, why, strict)
        if in_place:
            (staging / "imagedir").mkdir()
            entries, mtimes = _reference_images(plan, root, report, strict=strict,
                                                progress=progress)
            _check_converted(src, report)
            listed = [item.file for item in plan.items]
            plan.items.clear()  # all read: let 200,000 Items (~50 MiB) go before listing again
            _check_unchanged(listed, root, entries, mtimes, shown, archived, labels)
            write_manifest(staging / "imagedir", plan.classes, entries, images_root=root,
                           source=origin)
        else:
            entries = _copy_images(plan, staging / "imagedir", report, strict=strict,
                                   move=archived, progress=progress)
            _check_converted(src, report)
            write_manifest(staging / "imagedir", plan.classes, entries, source=origin)
        _publish(staging / "imagedir", out, staging)
        done = True
    except Exception as e:
        # decided before the staging folder is removed (it fills the volume); a copy needs
        # about the bytes of the images it copies
        err = full_disk_error(e, out, None if plan is None or in_place else _bytes_of(plan))
        if err is None:
            raise
        raise err from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if extract_to is not None and not done:
            shutil.rmtree(extract_to, ignore_errors=True)
    return report


def _bytes_of(plan) -> int | None:
    """The bytes of the files `plan` would copy (for a full disk's message)."""
    try:
        return sum(os.path.getsize(item.file) for item in plan.items) or None
    except OSError:
        return None


def _check_extract_to(src: Path, in_place: bool, extract_to) -> Path | None:
    """The absolute folder an archive is extracted into for an in-place conversion (None for a
    folder source, or when not in place)."""
    if not (in_place and src.is_file()):
        return None
    if extract_to is None:
        raise InvalidDatasetError(
            f"source {src} is an archive: converting it in place needs a folder to extract it "
            "into, where its images then stay (--extract-to DIR).")
    extract_to = Path(os.path.abspath(extract_to))
    if extract_to.exists():
        raise InvalidDatasetError(f"{extract_to} already exists; give a new folder to extract "
                                  f"{src} into.")
    return extract_to


def _check_paths(src: Path, out: Path, overwrite: bool) -> None:
    if not src.exists():
        raise InvalidDatasetError(f"source {src} does not exist. Give a folder or an archive.")
    if src.is_file() and archive_kind(src) is None:
        raise InvalidDatasetError(
            f"source {src} is a file but not an archive kfvision reads (.zip, .tar, .tar.gz, "
            ".tgz, .tar.bz2). Give a folder or one of those archives."
        )
    if out.exists() and not overwrite:
        raise InvalidDatasetError(f"{out} already exists; choose a new path or pass --overwrite.")
    if out.exists() and not out.is_dir():
        raise InvalidDatasetError(f"{out} exists and is not a folder; choose another path.")
    s, o = src.resolve(), out.resolve()
    if s == o or s in o.parents or o in s.parents:
        raise InvalidDatasetError(
            f"output {out} and source {src} overlap; write the image directory somewhere else."
        )


def _skip(report: ConvertReport, where: str, why: str, strict: bool) -> None:
    if strict:
        raise InvalidDatasetError(
            f"{where}: {why} (--strict). Remove or fix the file, or convert without --strict to "
            "skip it."
        )
    report.skipped.append((where, why))


def _copy_images(plan, dest: Path, report: ConvertReport, *, strict: bool, move: bool,
                 progress) -> list[ImageEntry]:
    entries = []
    dest.mkdir()
    index = {c: i for i, c in enumerate(plan.classes)}
    with _examined(plan.items, progress, keep_data=True) as examined:
        for item, (_, why, data, length, digest, size) in examined:
            if why:
                _skip(report, item.shown, why, strict)
                continue
            target = dest / item.rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if move and not os.path.islink(item.file):  # our own extracted copy: rename
                os.replace(item.file, target)
            else:
                target.write_bytes(data)
            label = None if item.label is None else index[item.label]
            entries.append(ImageEntry(item.rel, label, length, digest, *size))
            if item.label is not None:
                report.counts[item.label] += 1
    report.images = len(entries)
    return entries


def _reference_images(plan, root: Path, report: ConvertReport, *, strict: bool,
                      progress) -> tuple[list[ImageEntry], list[int]]:
    """The entries of the readable images, read where they are (paths relative to `root`), and
    each one's mtime_ns before it was read."""
    entries, mtimes = [], []
    index = {c: i for i, c in enumerate(plan.classes)}
    with _examined(plan.items, progress) as examined:
        for item, (before, why, _, length, digest, size) in examined:
            if why:
                _skip(report, item.shown, why, strict)
                continue
            if before is None or length != before[0]:
                raise _changed(item.shown, "it had " + (
                    "no size" if before is None else f"{before[0]} bytes")
                    + f" when convert started reading it and {length} when it finished")
            label = None if item.label is None else index[item.label]
            entries.append(ImageEntry(relative_path(item.file, root), label, length, digest,
                                      *size))
            mtimes.append(before[1])
            if item.label is not None:
                report.counts[item.label] += 1
    report.images = len(entries)
    return entries, mtimes


def _check_unchanged(listed: list, root: Path, entries, mtimes, shown: str, archived: bool,
                     labels) -> None:
    """The source as it is now is the one that was read: same files (`listed`: those of its
    plan), same sizes and times (`mtimes`: each entry's before it was read)."""
    base = str(root)
    for e, mtime_ns in zip(entries, mtimes):
        try:
            st = os.stat(os.path.join(base, e.path))
        except OSError as err:
            raise _changed(f"{shown}/{e.path}", f"it was removed ({err.strerror})") from err
        if (st.st_size, st.st_mtime_ns) != (e.bytes, mtime_ns):
            raise _changed(f"{shown}/{e.path}", f"{e.bytes} -> {st.st_size} bytes, modified "
                                                "again after it was read")
    now = [i.file for i in plan_source(root, shown=shown, archive=archived, labels=labels).items]
    if now == listed:  # the same plan lists the same files in the same order
        return
    before, now = set(listed), set(now)
    for what, files in (("added", now - before), ("removed", before - now)):
        if files:
            first = relative_path(sorted(files, key=Path)[0], root)
            raise _changed(f"{shown}/{first}", f"{len(files)} file(s) were {what} (this one "
                                               "among them)")


def _changed(where: str, what: str) -> ChangedDatasetError:
    return ChangedDatasetError(
        f"{where} changed while convert was reading the source: {what}. Convert again once "
        "nothing writes to the source any more.")


# Below this many files a pool's start (tens of ms) is not worth it; tests stay in one process.
POOL_MIN_ITEMS = 500
POOL_MAX_WORKERS = 8


@contextmanager
def _examined(items: list, progress, keep_data: bool = False):
    """An iterator of (item, `_examine(item)`) in the items' order, under a progress bar.

    Decoding is most of a conversion's time (a few hundred microseconds an image however
    small): with many items and several cores it runs in a pool of processes, one a core.
    They are forked, so they share what this process imported and see Pillow's pixel limit as
    the caller set it.
    """
    workers = _pool_size(len(items))
    if workers < 2:
        yield ((item, _examine(item.file, item.shown, keep_data)) for item in
               progress_bar(items, "convert", "img", progress))
        return
    # Frozen, this process's objects are left alone by the workers' garbage collections, which
    # would otherwise write to (and so copy) every page of them in each worker.
    gc.freeze()
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            # (file, shown) pairs: pickled 10x faster than Items
            results = pool.imap(partial(_examine_pair, keep_data=keep_data),
                                ((item.file, item.shown) for item in items), chunksize=64)
            yield ((item, next(results))
                   for item in progress_bar(items, "convert", "img", progress))
    finally:
        gc.unfreeze()


def _pool_size(n_items: int) -> int:
    if n_items < POOL_MIN_ITEMS or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cores or 1, POOL_MAX_WORKERS)


def _examine_pair(pair: tuple[str, str], keep_data: bool):
    return _examine(*pair, keep_data)


def _examine(file: str, shown: str, keep_data: bool = False):
    """(size and mtime_ns before reading or None, skip reason or None, the bytes (b"" unless
    `keep_data`), their length, sha256, (width, height)) of a candidate image (an Item's `file`
    and `shown`): read, hashed and fully decoded (`probe_image`)."""
    try:
        st = os.stat(file)
        before = (st.st_size, st.st_mtime_ns)
    except OSError:
        before = None  # _read_item says why
    why, data, size = _read_item(_Candidate(Path(file), shown))
    if why:
        return before, why, b"", 0, "", None
    return (before, None, data if keep_data else b"", len(data),
            hashlib.sha256(data).hexdigest(), size)


class _Candidate(NamedTuple):
    """A file `_read_item` reads (its Path made only then: the plan keeps strings) and how
    reports name it."""

    file: Path
    shown: str


def _read_item(item: _Candidate):
    """(skip reason or None, bytes, (width, height))."""
    if item.file.suffix.lower() not in IMAGE_EXTENSIONS:
        return f"not an image type ({' '.join(IMAGE_EXTENSIONS)})", b"", None
    try:
        data = item.file.read_bytes()
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e.strerror or e})", b"", None
    try:
        return None, data, probe_image(data, item.shown)
    except ValueError as e:
        return str(e), b"", None


def _check_converted(src: Path, report: ConvertReport) -> None:
    if not report.images:
        raise InvalidDatasetError(
            f"{src} has no readable images ({len(report.skipped)} file(s) skipped). Accepted "
            f"types: {', '.join(IMAGE_EXTENSIONS)} (any letter case)."
        )
    empty = [c for c, n in report.counts.items() if n == 0]
    if empty:
        raise InvalidDatasetError(
            f"{src}: class(es) {', '.join(empty)} have no readable images. Add images or "
            "remove the class folders (or their rows in the labels file)."
        )
    if len(report.classes) == 1:
        raise InvalidDatasetError(
            f"{src} has a single class ({report.classes[0]}); a classifier needs at least "
            "two. Add a folder (or label) per class, or give the images loose, without labels, "
            "for an unlabelled directory (scoring only)."
        )


def _publish(tmp: Path, out: Path, staging: Path) -> None:
    """Rename the finished directory into place; an old OUT (overwrite) is moved aside first."""
    if out.exists():
        os.replace(out, staging / "previous")  # removed with the staging folder
    os.replace(tmp, out)
