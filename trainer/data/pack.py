"""The pack: an image directory's images decoded once and kept as raw pixels (opt-in).

    kfvision pack data/train                 # add (or refresh) the pack of an image directory
    kfvision convert photos/ data/all --pack # convert, then pack

When the training images do not fit in memory they are decoded again every epoch, and decoding is
the limit: libjpeg-turbo's entropy decoding is most of what a training crop costs
(docs/benchmarks.md). A pack trades disk for that time:

    kfvision-pack.rgb    uint8 RGB pixels of every manifest image, each height x width x 3
                         (row-major, channels last), concatenated in manifest order; exactly what
                         `kfvision.trainer.data.decode.load_rgb` returns
    kfvision-pack.json   {"format": "kfvision.image-pack", "version": 1,
                          "images_sha256": "...",   # of the manifest's (path, sha256) list
                          "pixels": "kfvision-pack.rgb", "bytes": 677000000,
                          "images": [[offset, height, width], ...]}   # manifest order

It costs width x height x 3 bytes per image: 5-8x the JPEG files at quality 90 (more at lower
quality; a 500x375 JPEG of 90 KB is 560 KB of pixels). `ImageDataset` reads a pack through a
memory map, so an image costs a page-cache read instead of a decode. A pack whose
`images_sha256` does not match the manifest (images added, removed or changed since packing) is
ignored with a `StalePackWarning`; readers that do not know packs never look at these files.
"""

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from kfvision.trainer.data.decode import decode_file
from kfvision.trainer.data.imagedir import ImageDirectory, read_image_directory
from kfvision.trainer.errors import InvalidDatasetError, OutputError
from kfvision.trainer.fileio import atomic_write, atomic_write_bytes
from kfvision.trainer.progressbar import progress_bar

PIXELS = "kfvision-pack.rgb"
INDEX = "kfvision-pack.json"
FORMAT = "kfvision.image-pack"
VERSION = 1


class StalePackWarning(UserWarning):
    """An image directory's pack does not match its manifest; the images are decoded instead."""


def images_digest(imdir: ImageDirectory) -> str:
    """sha256 of the manifest's image list (path and content hash of each image, in order)."""
    h = hashlib.sha256()
    for e in imdir.images:
        h.update(f"{e.path}\0{e.sha256}\n".encode())
    return h.hexdigest()


class Pack:
    """The pixels of a pack: `pack[i]` is image i as a uint8 CHW tensor, a view of the file.

    The view is channels-last strided (as `decode_jpeg` returns it, and as torch's uint8 resize
    wants it): nothing is copied until a transform makes its crop. The file is mapped on first use
    in each process, so DataLoader workers map their own.
    """

    def __init__(self, path: Path, entries: np.ndarray):
        self.path = path
        self.entries = entries  # int64 [n, 3]: offset, height, width
        self._pixels, self._pid = None, None

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._pid != os.getpid():
            # Copy-on-write: the array is writable (torch warns on read-only ones) but nothing
            # ever reaches the file; pages are shared with the page cache until written.
            self._pixels = np.memmap(self.path, dtype=np.uint8, mode="c").view(np.ndarray)
            self._pid = os.getpid()
        offset, h, w = (int(v) for v in self.entries[i])
        hwc = self._pixels[offset:offset + h * w * 3].reshape(h, w, 3)
        return torch.from_numpy(hwc).permute(2, 0, 1)

    def __getstate__(self):
        return {**self.__dict__, "_pixels": None, "_pid": None}


def _read_index(imdir: ImageDirectory, index: Path) -> tuple[np.ndarray | None, str | None]:
    """(entries [n, 3], None) of the pack at `index` when it fits `imdir`, else (None, why not)."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            return None, f"is not a kfvision pack index (format must be {FORMAT!r})"
        if doc.get("version") != VERSION:
            return None, f"has version {doc.get('version')!r}, this kfvision reads {VERSION}"
        if doc.get("images_sha256") != images_digest(imdir):
            return None, "was made for other images (the manifest changed since it was packed)"
        entries = np.asarray(doc["images"], dtype=np.int64).reshape(-1, 3)
        total = int(doc["bytes"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        return None, f"cannot be read ({type(e).__name__}: {e})"
    if len(entries) != len(imdir.images):
        return None, f"lists {len(entries)} images, the manifest {len(imdir.images)}"
    ends = entries[:, 0] + entries[:, 1] * entries[:, 2] * 3
    if (entries < 0).any() or entries[0, 0] != 0 or (ends[:-1] != entries[1:, 0]).any():
        return None, "has offsets that do not follow one another"
    pixels = index.parent / PIXELS
    size = pixels.stat().st_size if pixels.is_file() else None
    if size != total or ends[-1] != total:
        return None, f"needs {PIXELS} of {total} bytes, found {'none' if size is None else size}"
    return entries, None


def open_pack(imdir: ImageDirectory) -> Pack | None:
    """The pack of `imdir` when it has one that matches its manifest, else None.

    A pack that is there but does not match is ignored with a StalePackWarning naming the
    command that rebuilds it: never pixels of other images.
    """
    index = imdir.root / INDEX
    if not index.is_file():
        return None
    entries, why = _read_index(imdir, index)
    if why is not None:
        warnings.warn(
            f"{index} {why}; ignoring the pack and decoding the image files instead (slower). "
            f"Rebuild it with `kfvision pack {imdir.root}`, or delete {INDEX} and {PIXELS}.",
            StalePackWarning, stacklevel=2)
        return None
    return Pack(imdir.root / PIXELS, entries)


@dataclass(frozen=True)
class PackReport:
    root: Path
    images: int
    pixel_bytes: int  # size of kfvision-pack.rgb
    file_bytes: int  # size of the image files
    written: bool  # False: an up-to-date pack was already there

    def summary(self) -> str:
        what = (f"packed {self.images} images of {self.root}" if self.written else
                f"the pack of {self.root} is up to date ({self.images} images; --force rewrites "
                "it)")
        return (f"{what}: {self.pixel_bytes / 2**20:,.0f} MiB of pixels in {PIXELS}, "
                f"{self.pixel_bytes / max(self.file_bytes, 1):.1f}x the "
                f"{self.file_bytes / 2**20:,.0f} MiB of image files")


def write_pack(root, *, force: bool = False, progress: bool | None = None) -> PackReport:
    """Decode every image of the image directory at `root` into its pack (see the module doc).

    Each file is checked against its manifest sha256 as it is decoded, so the pack holds the
    pixels of exactly the images the manifest names. Both files are written atomically (a
    temporary file renamed into place); the old index is removed first, so a run that dies
    half-way leaves no pack rather than a wrong one.

    Args:
        root: an image directory (made by `kfvision convert`).
        force: rewrite a pack that is already up to date.
        progress: a progress bar (None: only when attached to a terminal).
    Raises:
        InvalidDatasetError: not an image directory, or an image changed since it was made.
        OutputError: not enough free disk for the pixels (checked first), or the disk filled.
    """
    imdir = read_image_directory(root)
    root, index = imdir.root, imdir.root / INDEX
    need = imdir.decoded_bytes()
    files = sum(e.bytes for e in imdir.images)
    if not force and index.is_file() and _read_index(imdir, index)[1] is None:
        return PackReport(root, len(imdir.images), need, files, written=False)
    free = shutil.disk_usage(root).free
    if need > free:
        raise OutputError(
            f"packing {root} needs {need / 2**30:.1f} GiB for {PIXELS} (width x height x 3 bytes "
            f"per image) but {free / 2**30:.1f} GiB is free there. Free some space, or train "
            "without a pack (the images are then decoded every epoch).")
    index.unlink(missing_ok=True)
    entries = []

    def write(f) -> None:
        offset = 0
        for i in progress_bar(range(len(imdir.images)), "pack", "img", progress):
            data = _read_unchanged(imdir, imdir.images[i])  # the bytes checked are those decoded
            hwc = decode_file(imdir.file(imdir.images[i]), data).permute(1, 2, 0).numpy()
            f.write(np.ascontiguousarray(hwc).data)
            entries.append([offset, hwc.shape[0], hwc.shape[1]])
            offset += hwc.nbytes

    atomic_write(root / PIXELS, write, need)
    total = sum(h * w * 3 for _, h, w in entries)
    doc = {"format": FORMAT, "version": VERSION, "images_sha256": images_digest(imdir),
           "pixels": PIXELS, "bytes": total, "images": entries}
    atomic_write_bytes(index, (json.dumps(doc, separators=(",", ":")) + "\n").encode())
    return PackReport(root, len(entries), total, files, written=True)


def _read_unchanged(imdir: ImageDirectory, entry) -> torch.Tensor:
    """The bytes of the file the manifest `entry` names (uint8 tensor), checked against its
    sha256."""
    root, path = imdir.root, imdir.file(entry)
    try:
        data = bytearray(path.read_bytes())
    except OSError as e:
        raise InvalidDatasetError(
            f"{path} can no longer be read ({e.strerror or e}); nothing was packed. Re-create "
            f"{root} with `kfvision convert`, then pack it.") from e
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise InvalidDatasetError(
            f"{path} has changed since {root} was made (its sha256 differs from the manifest); "
            "nothing was packed. Re-create the directory with `kfvision convert`, then pack it.")
    return torch.frombuffer(data, dtype=torch.uint8)

