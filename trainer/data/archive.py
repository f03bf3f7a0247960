"""Safe extraction of the archives `kfvision convert` accepts: .zip, .tar, .tar.gz/.tgz, .tar.bz2.

Both kinds follow PEP 706's `data` filter rules: leading slashes are stripped; a member that would
land outside the destination (`..`, an absolute path after stripping, a path through a link), a
link pointing outside it (or to an absolute path), and device files, FIFOs and the like are
refused; permissions are reduced to ordinary file permissions. Tar archives get the standard
library's own filter (`filter="data"`); zip archives, which the standard library does not filter
that way, get the same rules here. Unix symlinks stored in a zip are honoured only when they stay
inside the archive.

An unsafe member refuses the whole archive (UnsafeArchiveError): such an archive is broken or
hostile, and partly using it would hide that. Before anything is written, the declared
uncompressed size is checked against the free disk space, so a zip bomb fails fast with a clear
message instead of filling the disk.
"""

import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path

from kfvision.trainer.errors import InvalidDatasetError, UnsafeArchiveError
from kfvision.trainer.fileio import full_disk_error
from kfvision.trainer.progressbar import progress_bar

# suffix (lower case) -> tarfile mode, or "zip"
ARCHIVE_TYPES = {".zip": "zip", ".tar": "r:", ".tar.gz": "r:gz", ".tgz": "r:gz",
                 ".tar.bz2": "r:bz2", ".tbz2": "r:bz2", ".tbz": "r:bz2"}


def archive_kind(path) -> str | None:
    """The tarfile mode ("r:gz", ...) or "zip" for an archive name; None for anything else."""
    name = Path(path).name.lower()
    for suffix in sorted(ARCHIVE_TYPES, key=len, reverse=True):  # ".tar.gz" before ".gz"-less
        if name.endswith(suffix):
            return ARCHIVE_TYPES[suffix]
    return None


def extract_archive(src, dest, progress: bool | None = False) -> None:
    """Extract archive `src` into the existing empty folder `dest`, safely.

    `progress`: a progress bar of extracted members (None: only when attached to a terminal).

    Raises:
        UnsafeArchiveError: a member escapes `dest`, is a link leaving it, or is a device file.
        InvalidDatasetError: unknown type, a corrupt archive, or not enough disk space.
    """
    src, dest = Path(src), Path(dest)
    kind = archive_kind(src)
    if kind is None:
        raise InvalidDatasetError(
            f"{src}: not an archive type kfvision reads ({', '.join(ARCHIVE_TYPES)}). Give a "
            "folder or one of those archives."
        )
    if not src.is_file():
        raise InvalidDatasetError(f"{src} does not exist or is not a file.")
    try:
        if kind == "zip":
            _extract_zip(src, dest, progress)
        else:
            _extract_tar(src, dest, kind, progress)
    except (tarfile.ReadError, tarfile.CompressionError, zipfile.BadZipFile, zlib.error,
            EOFError) as e:
        raise InvalidDatasetError(
            f"{src} is not a readable {src.suffix} archive ({type(e).__name__}: {e}). Check the "
            "file is complete (re-download or re-create it)."
        ) from e
    except OSError as e:  # gzip.BadGzipFile, a truncated bz2 stream, or the disk itself
        full = full_disk_error(e, dest)
        if full is not None:
            raise full from e
        raise InvalidDatasetError(f"{src}: extraction failed ({type(e).__name__}: {e}).") from e


def _free_space_guard(src: Path, dest: Path):
    """A callable adding a member's size to a running total; raises once it exceeds free space."""
    free = shutil.disk_usage(dest).free
    total = 0

    def add(size: int, name: str) -> None:
        nonlocal total
        total += max(size, 0)
        if total > free:
            raise InvalidDatasetError(
                f"{src}: extracting it needs more than the {free / 2**30:.1f} GiB free at {dest} "
                f"(reached at member {name!r}; a decompression bomb?). Free disk space or "
                "extract a smaller archive."
            )

    return add


def _extract_tar(src: Path, dest: Path, mode: str, progress) -> None:
    if not hasattr(tarfile, "data_filter"):  # Python < 3.10.12 / 3.11.4
        raise InvalidDatasetError(
            f"{src}: this Python has no safe tar extraction (PEP 706). Use Python >= 3.11.4, or "
            "extract the archive yourself and convert the folder."
        )
    add = _free_space_guard(src, dest)

    def members(tar):
        # streams: a .tar.gz is decompressed once
        for m in progress_bar(tar, "extract", "file", progress):
            add(m.size if m.isfile() else 0, m.name)
            yield m

    with tarfile.open(src, mode) as tar:
        try:
            tar.extractall(dest, members=members(tar), filter="data")
        except tarfile.FilterError as e:
            raise UnsafeArchiveError(
                f"{src}: member {e.tarinfo.name!r} is refused ({e}). The archive is broken or "
                "unsafe; re-create it with relative paths and no links leaving it."
            ) from e


def _zip_member_target(src: Path, dest: Path, info: zipfile.ZipInfo) -> Path:
    """Where a zip member goes, with the data filter's path rules."""
    name = info.filename.replace("\\", "/").lstrip("/")
    if os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):  # "C:/..." stays absolute
        raise UnsafeArchiveError(f"{src}: member {info.filename!r} has an absolute path. "
                                 "Re-create the archive with relative paths.")
    target = Path(os.path.realpath(dest / name))
    if os.path.commonpath([target, dest]) != str(dest):
        raise UnsafeArchiveError(
            f"{src}: member {info.filename!r} would be written outside the extraction folder "
            "(path traversal). The archive is broken or unsafe; re-create it with relative paths."
        )
    return target


def _zip_link(src: Path, dest: Path, info: zipfile.ZipInfo, zf, target: Path) -> None:
    link = zf.read(info).decode("utf-8", "surrogateescape")
    resolved = os.path.realpath(target.parent / link)
    if os.path.isabs(link) or os.path.commonpath([resolved, dest]) != str(dest):
        raise UnsafeArchiveError(
            f"{src}: member {info.filename!r} is a link to {link!r}, outside the archive. "
            "Re-create the archive without links (or with links that stay inside it)."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(link, target)


def _extract_zip(src: Path, dest: Path, progress) -> None:
    dest = Path(os.path.realpath(dest))
    add = _free_space_guard(src, dest)
    with zipfile.ZipFile(src) as zf:
        infos = zf.infolist()
        for info in infos:  # check every member before writing anything
            _zip_member_target(src, dest, info)
            add(info.file_size, info.filename)
        for info in progress_bar(infos, "extract", "file", progress):
            mode = info.external_attr >> 16  # unix st_mode when made on unix, else 0
            target = _zip_member_target(src, dest, info)  # again: earlier links may redirect
            kind = stat.S_IFMT(mode)
            if info.is_dir() or kind == stat.S_IFDIR:
                target.mkdir(parents=True, exist_ok=True)
            elif kind == stat.S_IFLNK:
                _zip_link(src, dest, info, zf, target)
            elif kind in (0, stat.S_IFREG):
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as fin, open(target, "xb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
            else:
                raise UnsafeArchiveError(
                    f"{src}: member {info.filename!r} is a device file, FIFO or socket "
                    f"(mode {oct(mode)}). Re-create the archive with ordinary files only."
                )
