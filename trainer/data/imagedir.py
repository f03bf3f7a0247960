"""The ImageDirectory format every kfvision step shares, its reader and the class-folder converter.

On disk an image directory is a folder of class sub-folders of images (so
`torchvision.datasets.ImageFolder` reads it too) plus `kfvision-imagedir.json`:

    {"format": "kfvision.image-directory", "version": 1,
     "classes": ["cat", "dog"],                       # sorted; class index = position
     "images": [{"path": "cat/001.jpg", "label": 0,   # label is null in unlabelled directories
                 "bytes": 10234, "sha256": "...", "width": 500, "height": 375}, ...]}

Unlabelled directories (for scoring only) have `"classes": []` and images at any relative path.

A *referenced* image directory (`kfvision convert --in-place`, and every image directory the
pipeline makes) holds only the manifest: its images stay where they are, under the absolute
folder `"images_root"`, and each entry's path is relative to that. The manifest then says
`"version": 2` (a kfvision that reads version 1 only refuses it instead of finding no files).
Splitting one writes two manifests over the same files. Because the files can change under it,
every reader checks what it reads: `read_image_directory` each file's size, the datasets each
image's sha256 as they read its bytes (`check_bytes`), so a changed or missing file is a
ChangedDatasetError naming it, never a silently different model.
"""

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path, PurePath

from kfvision.trainer.errors import ChangedDatasetError, InvalidDatasetError, NotLabeledDatasetError

MANIFEST = "kfvision-imagedir.json"
FORMAT = "kfvision.image-directory"
VERSION = 1  # an image directory that holds its images
REFERENCED_VERSION = 2  # one whose images stay under "images_root"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True, slots=True)  # one per image: 200,000 of them are common
class ImageEntry:
    path: str  # relative to the directory root, '/'-separated
    label: int | None
    bytes: int
    sha256: str
    width: int
    height: int


@dataclass(frozen=True)
class ImageDirectory:
    root: Path  # the folder of the manifest
    classes: tuple[str, ...]
    images: tuple[ImageEntry, ...]
    images_root: Path | None = None  # where the images are, when not in `root` (referenced)
    arrival: Path | None = None  # its files arrive while it is read (trainer/data/arrival.py)

    @property
    def labelled(self) -> bool:
        return bool(self.classes)

    @property
    def referenced(self) -> bool:
        return self.images_root is not None

    @property
    def base(self) -> Path:
        """The folder the images' paths are relative to."""
        return self.root if self.images_root is None else self.images_root

    def file(self, e: ImageEntry) -> Path:
        return self.base / e.path

    def check_bytes(self, e: ImageEntry, data) -> None:
        """Raise ChangedDatasetError unless `data` (the bytes just read of e's file) is what the
        manifest recorded."""
        size = len(data)
        if size != e.bytes:
            raise self.changed(e, f"it has {size} bytes, the manifest says {e.bytes}")
        digest = _sha256(data)
        if digest != e.sha256:
            raise self.changed(e, f"same size, but its sha256 is {digest[:12]}..., the manifest "
                                  f"says {e.sha256[:12]}...")

    def changed(self, e: ImageEntry, what: str) -> ChangedDatasetError:
        return ChangedDatasetError(
            f"{self.file(e)} is missing or has changed since the image directory {self.root} was "
            f"made: {what}. "
            f"Put the original file back, or make the directory again (`kfvision convert`, or a "
            "new pipeline run) so that training sees the images you mean.")

    def class_counts(self) -> dict[str, int]:
        counts = Counter(e.label for e in self.images)
        return {c: counts.get(i, 0) for i, c in enumerate(self.classes)}

    def require_labelled(self, purpose: str) -> "ImageDirectory":
        if not self.labelled:
            raise NotLabeledDatasetError(
                f"{self.root} has no labels, but {purpose} needs labelled images. Give a folder "
                "with one sub-folder per class to `kfvision convert`."
            )
        return self

    def decoded_bytes(self) -> int:
        """RGB bytes of every image decoded at full size (to decide whether to cache)."""
        return sum(e.width * e.height * 3 for e in self.images)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bad(root, what: str) -> InvalidDatasetError:
    return InvalidDatasetError(
        f"{str(root).rstrip('/')}/{MANIFEST}: {what}. Re-create the directory with `kfvision "
        f"convert SRC {root} --overwrite`."
    )


def _parse_manifest(root: Path, doc) -> ImageDirectory:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(root, f"not a kfvision image directory manifest (format must be {FORMAT!r})")
    if doc.get("version") not in (VERSION, REFERENCED_VERSION):
        raise _bad(root, f"version {doc.get('version')!r} is not supported (this kfvision reads "
                         f"{VERSION} and {REFERENCED_VERSION})")
    classes = doc.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) and c for c in classes):
        raise _bad(root, "field 'classes' must be a list of non-empty names")
    if classes != sorted(set(classes)):
        raise _bad(root, "field 'classes' must be sorted and without duplicates")
    images_root = doc.get("images_root")
    if doc["version"] == REFERENCED_VERSION and not (
            isinstance(images_root, str) and Path(images_root).is_absolute()):
        raise _bad(root, "field 'images_root' must be an absolute folder in a version "
                         f"{REFERENCED_VERSION} manifest")
    if doc["version"] == VERSION and images_root is not None:
        raise _bad(root, f"field 'images_root' needs version {REFERENCED_VERSION}")
    try:
        images = tuple(ImageEntry(**e) for e in doc["images"])
    except (KeyError, TypeError) as e:
        raise _bad(root, f"field 'images' is malformed ({e})") from e
    for e in images:
        if classes and not (isinstance(e.label, int) and 0 <= e.label < len(classes)):
            raise _bad(root, f"image {e.path!r} has label {e.label!r}, not 0..{len(classes) - 1}")
        if not classes and e.label is not None:
            raise _bad(root, f"image {e.path!r} has a label but the directory has no classes")
        path = PurePath(e.path)
        if path.is_absolute() or ".." in path.parts:
            raise _bad(root, f"image path {e.path!r} must stay inside the directory")
    arrival = doc.get("arrival")
    if arrival is not None and (images_root is None or not Path(str(arrival)).is_absolute()):
        raise _bad(root, "field 'arrival' must be an absolute folder, in a manifest with "
                         "'images_root'")
    return ImageDirectory(root, tuple(classes), images,
                          None if images_root is None else Path(images_root),
                          None if arrival is None else Path(arrival))


def _holds_images(root: Path, look_at: int = 1000) -> bool:
    """Whether `root` or one of its folders (a class folder) has an image file, judged by name
    from the first `look_at` entries: a source folder of images rather than an empty one."""
    seen = 0
    try:
        for entry in root.iterdir():
            for f in (entry.iterdir() if entry.is_dir() else (entry,)):
                if f.suffix.lower() in IMAGE_EXTENSIONS:
                    return True
                seen += 1
                if seen >= look_at:
                    return False
    except OSError:  # a folder it may not read: the general advice then
        pass
    return False


def parse_manifest(data: bytes, root) -> ImageDirectory:
    """The image directory whose manifest holds `data` (its bytes), checked as far as the manifest
    alone allows (format, classes, labels, paths, no class without images); no file is read.

    Args:
        root: where the manifest is (a folder, or an `s3://` URI's text): the directory's root
            and what the messages name.
    Raises:
        InvalidDatasetError: malformed manifest, no images, or a class without images.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(root, f"not valid JSON ({e})") from e
    imdir = _parse_manifest(root, doc)
    if not imdir.images:
        raise InvalidDatasetError(f"{root} holds no images. Add images and convert again.")
    empty = [c for c, n in imdir.class_counts().items() if n == 0]
    if empty:
        raise InvalidDatasetError(
            f"{root}: class(es) {', '.join(empty)} have no images. Add images to them or remove "
            "the class folders, then convert again."
        )
    return imdir


def read_image_directory(root, *, verify: str = "size") -> ImageDirectory:
    """Read and validate an image directory.

    Args:
        root: the directory.
        verify: "size" checks every image file exists with the recorded size (cheap);
            "hash" also checks its sha256 (reads every byte); "none" trusts the manifest.
    Raises:
        InvalidDatasetError: no manifest, malformed manifest, no images, or a class without
            images. ChangedDatasetError: a missing or changed image.
    """
    root = Path(root)
    if not root.is_dir():
        raise InvalidDatasetError(f"{root} is not a folder. Give an image directory made by "
                                  "`kfvision convert`.")
    path = root / MANIFEST
    if not path.is_file():
        if _holds_images(root):  # the source itself, given where its image directory belongs
            out = root.with_name(root.name + "-imagedir")
            raise InvalidDatasetError(
                f"{root} holds images but is not a kfvision image directory (no {MANIFEST}). "
                f"Make one of it with `kfvision convert {root} {out}` (add --in-place to copy "
                f"no image) and give {out} instead.")
        raise InvalidDatasetError(
            f"{root} is not a kfvision image directory (no {MANIFEST}) and holds no images. "
            "Give the OUT folder of a `kfvision convert SRC OUT`, or make one that way.")
    imdir = parse_manifest(path.read_bytes(), root)
    if verify != "none" and imdir.arrival is None:  # arriving files are checked as they are read
        check_files(imdir, hash=verify == "hash")
    return imdir


def check_files(imdir: ImageDirectory, *, hash: bool = False) -> None:
    """Every image file is there with its recorded size (and sha256, `hash`); else a
    ChangedDatasetError naming the first that is not."""
    base = str(imdir.base)
    for e in imdir.images:
        try:
            size = os.stat(os.path.join(base, e.path)).st_size
        except OSError as err:
            raise imdir.changed(e, f"it cannot be read ({err.strerror or err})") from err
        if size != e.bytes:
            raise imdir.changed(e, f"it has {size} bytes, the manifest says {e.bytes}")
        if hash:
            imdir.check_bytes(e, imdir.file(e).read_bytes())


def check_same_classes(train: ImageDirectory, val: ImageDirectory) -> None:
    """Training and validation must use the same class list (the index is the label)."""
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        detail = []
        if only_train:
            detail.append(f"only in training ({train.root}): {', '.join(only_train)}")
        if only_val:
            detail.append(f"only in validation ({val.root}): {', '.join(only_val)}")
        raise InvalidDatasetError(
            "training and validation categories differ: "
            + ("; ".join(detail) or "same names, different order")
            + ". Give both the same class folders (e.g. split one directory with `kfvision split`)."
        )


# --- writing (the converter itself lives in kfvision.trainer.data.convert)
# -----------------------------


def write_manifest(root: Path, classes, images, images_root=None, source=None,
                   arrival=None) -> None:
    """Write the manifest of the image directory at `root` (classes sorted, images in order);
    `images_root`: the absolute folder of the images when they are not in `root`; `source`:
    where they were fetched from (plain JSON data: the URI and each object's ETag); `arrival`:
    the arrival folder of images still being fetched (with `images_root`)."""
    head = {"format": FORMAT, "version": VERSION, "classes": list(classes)}
    if images_root is not None:
        head.update(version=REFERENCED_VERSION, images_root=str(images_root))
    if arrival is not None:
        head["arrival"] = str(arrival)
    if source is not None:
        head["source"] = source
    # One image a line, each through json's C encoder: `indent` would take the pure-Python one
    # (and a dict per image plus the whole text in memory), 4x slower on 200,000 images.
    encode = json.JSONEncoder().encode
    names = [f.name for f in fields(ImageEntry)]  # an ImageEntry's fields are its manifest entry
    with open(root / MANIFEST, "w", encoding="utf-8") as f:
        f.write("{\n" + "".join(f" {encode(k)}: {encode(v)},\n" for k, v in head.items())
                + ' "images": [')
        sep = "\n  "
        for e in images:
            f.write(sep + encode({k: getattr(e, k) for k in names}))
            sep = ",\n  "
        f.write("\n ]\n}\n")
