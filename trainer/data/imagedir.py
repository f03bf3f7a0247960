"""The ImageDirectory format every kfvision step shares, its reader and the class-folder converter.

On disk an image directory is a folder of class sub-folders of images (so
`torchvision.datasets.ImageFolder` reads it too) plus `kfvision-imagedir.json`:

    {"format": "kfvision.image-directory", "version": 1,
     "classes": ["cat", "dog"],                       # sorted; class index = position
     "images": [{"path": "cat/001.jpg", "label": 0,   # label is null in unlabelled directories
                 "bytes": 10234, "sha256": "...", "width": 500, "height": 375}, ...]}

Unlabelled directories (for scoring only) have `"classes": []` and images at any relative path.
"""

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.errors import InvalidDatasetError, NotLabeledDatasetError

MANIFEST = "kfvision-imagedir.json"
FORMAT = "kfvision.image-directory"
VERSION = 1
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class ImageEntry:
    path: str  # relative to the directory root, '/'-separated
    label: int | None
    bytes: int
    sha256: str
    width: int
    height: int


@dataclass(frozen=True)
class ImageDirectory:
    root: Path
    classes: tuple[str, ...]
    images: tuple[ImageEntry, ...]

    @property
    def labelled(self) -> bool:
        return bool(self.classes)

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


def _bad(root: Path, what: str) -> InvalidDatasetError:
    return InvalidDatasetError(
        f"{root / MANIFEST}: {what}. Re-create the directory with `kfvision convert SRC {root}`."
    )


def _parse_manifest(root: Path, doc) -> ImageDirectory:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(root, f"not a kfvision image directory manifest (format must be {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise _bad(root, f"version {doc.get('version')!r} is not supported (this is {VERSION})")
    classes = doc.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) and c for c in classes):
        raise _bad(root, "field 'classes' must be a list of non-empty names")
    if classes != sorted(set(classes)):
        raise _bad(root, "field 'classes' must be sorted and without duplicates")
    try:
        images = tuple(ImageEntry(**e) for e in doc["images"])
    except (KeyError, TypeError) as e:
        raise _bad(root, f"field 'images' is malformed ({e})") from e
    for e in images:
        if classes and not (isinstance(e.label, int) and 0 <= e.label < len(classes)):
            raise _bad(root, f"image {e.path!r} has label {e.label!r}, not 0..{len(classes) - 1}")
        if not classes and e.label is not None:
            raise _bad(root, f"image {e.path!r} has a label but the directory has no classes")
        if Path(e.path).is_absolute() or ".." in Path(e.path).parts:
            raise _bad(root, f"image path {e.path!r} must stay inside the directory")
    return ImageDirectory(root, tuple(classes), images)


def read_image_directory(root, *, verify: str = "size") -> ImageDirectory:
    """Read and validate an image directory.

    Args:
        root: the directory.
        verify: "size" checks every image file exists with the recorded size (cheap);
            "hash" also checks its sha256 (reads every byte); "none" trusts the manifest.
    Raises:
        InvalidDatasetError: no manifest, malformed manifest, missing/changed image, no images,
            or a class without images.
    """
    root = Path(root)
    if not root.is_dir():
        raise InvalidDatasetError(f"{root} is not a folder. Give an image directory made by "
                                  "`kfvision convert`.")
    path = root / MANIFEST
    if not path.is_file():
        raise InvalidDatasetError(
            f"{root} is not a kfvision image directory (no {MANIFEST}). Make one with "
            f"`kfvision convert SRC {root}`."
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
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
    if verify != "none":
        for e in imdir.images:
            f = root / e.path
            if not f.is_file() or f.stat().st_size != e.bytes:
                raise InvalidDatasetError(
                    f"{f} is missing or has changed since {root} was made (expected {e.bytes} "
                    f"bytes). Re-create the directory with `kfvision convert`."
                )
            if verify == "hash" and _sha256(f.read_bytes()) != e.sha256:
                raise InvalidDatasetError(f"{f} is corrupt: its sha256 differs from the manifest.")
    return imdir


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


# --- writing (the converter itself lives in trainer.data.convert) -----------------------------


def write_manifest(root: Path, classes, images) -> None:
    """Write the manifest of the image directory at `root` (classes sorted, images in order)."""
    doc = {"format": FORMAT, "version": VERSION, "classes": list(classes),
           "images": [asdict(e) for e in images]}
    (root / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
