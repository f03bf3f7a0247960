"""Split Image Directory: one image directory -> two (train, validation), stratified by class.

    kfvision split data/all data/train data/val --fraction 0.9 --seed 1

Within each class, images are ordered by sha256(f"{seed}:{path}") and the first
round(fraction * n) go to the first output. The order depends only on the seed and each image's
own path: the split is the same on every machine and library version, and adding images to a
class does not move the images already there from one side to the other. Every class keeps at
least one image on each side, so both outputs have the same class list (what training needs).
Unlabelled directories are split the same way, as one group.

`in_place` (what the pipeline does) writes two manifests over the input's files instead of two
copies of them (see kfvision.trainer.data.imagedir: referenced image directories): nothing but the
manifests is written, whatever the size of the dataset.
"""

import hashlib
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from kfvision.trainer.data.imagedir import ImageDirectory, read_image_directory, write_manifest
from kfvision.trainer.errors import InvalidDatasetError, InvalidParameterError
from kfvision.trainer.fileio import disk_errors


def _order_key(seed: int, path: str) -> str:
    return hashlib.sha256(f"{seed}:{path}".encode()).hexdigest()


def split_indices(imdir: ImageDirectory, fraction: float, seed: int) -> tuple[list, list]:
    """(first, second): image indices of each side, each in the input's order.

    Raises:
        InvalidDatasetError: a class with fewer than two images (it cannot be on both sides).
    """
    groups = defaultdict(list)
    for i, e in enumerate(imdir.images):
        groups[e.label].append(i)
    first, second = [], []
    for label, idx in groups.items():
        if len(idx) < 2:
            name = imdir.classes[label] if label is not None else "(unlabelled)"
            raise InvalidDatasetError(
                f"{imdir.root}: class {name!r} has {len(idx)} image; splitting needs at least two "
                "per class (one for each side). Add images to it or remove the class."
            )
        idx = sorted(idx, key=lambda i: _order_key(seed, imdir.images[i].path))
        n_first = min(max(round(fraction * len(idx)), 1), len(idx) - 1)
        first += idx[:n_first]
        second += idx[n_first:]
    return sorted(first), sorted(second)


def _write_side(imdir: ImageDirectory, indices: list, dest: Path, in_place: bool) -> dict:
    entries = [imdir.images[i] for i in indices]
    dest.mkdir(parents=True)
    if in_place:
        write_manifest(dest, imdir.classes, entries, images_root=imdir.base.absolute())
    else:
        for e in entries:
            target = dest / e.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(imdir.file(e), target)
        write_manifest(dest, imdir.classes, entries)
    counts = defaultdict(int)
    for e in entries:
        counts[imdir.classes[e.label] if e.label is not None else "(unlabelled)"] += 1
    return dict(counts)


def split(src, first_out, second_out, *, fraction: float = 0.9, seed: int = 1,
          overwrite: bool = False, in_place: bool = False) -> dict:
    """Write two image directories with `fraction` of each class in the first.

    Args:
        src: an image directory (labelled or not).
        first_out, second_out: the outputs (the designer's "first" and "second" datasets: train
            and validation); must not exist unless overwrite.
        fraction: share of each class in the first output, 0 < fraction < 1 (default 0.9).
        seed: fixes which images go where.
        in_place: the outputs reference the input's image files instead of copying them.
    Returns:
        {"first": {class: count}, "second": {class: count}}
    Raises:
        InvalidParameterError: fraction out of range. InvalidDatasetError: bad input directory,
            a class with one image, or outputs that exist or overlap the input.
    """
    if not 0 < fraction < 1:
        raise InvalidParameterError(
            f"fraction = {fraction} is out of range: it must be 0 < fraction < 1 (the share of "
            "each class that goes to the first output, e.g. 0.9)."
        )
    imdir = read_image_directory(src)
    outs = [Path(first_out), Path(second_out)]
    _check_outputs(Path(src), outs, overwrite)
    first, second = split_indices(imdir, fraction, seed)
    stagings = []
    try:
        counts = {}
        for side, out, indices in (("first", outs[0], first), ("second", outs[1], second)):
            out.parent.mkdir(parents=True, exist_ok=True)
            stagings.append(Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)))
            with disk_errors(out):
                counts[side] = _write_side(imdir, indices, stagings[-1] / "imagedir", in_place)
        for out, staging in zip(outs, stagings):  # both complete: now put them in place
            if out.exists():
                os.replace(out, staging / "previous")
            os.replace(staging / "imagedir", out)
    finally:
        for staging in stagings:
            shutil.rmtree(staging, ignore_errors=True)
    return counts


def _check_outputs(src: Path, outs: list, overwrite: bool) -> None:
    a, b = (o.resolve() for o in outs)
    s = src.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise InvalidDatasetError(f"the two outputs {outs[0]} and {outs[1]} overlap; give two "
                                  "separate folders.")
    for o, r in zip(outs, (a, b)):
        if r == s or s in r.parents or r in s.parents:
            raise InvalidDatasetError(f"output {o} overlaps the input {src}; write elsewhere.")
        if o.exists() and not overwrite:
            raise InvalidDatasetError(f"{o} already exists; choose a new path or pass "
                                      "--overwrite.")
