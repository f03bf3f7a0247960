"""Referenced image directories: a manifest over images that stay where they are (convert and split
--in-place, what the pipeline makes), every reader checking what it reads, and a source changed
while convert reads it."""

import json
import tarfile

import numpy as np
import pytest
from helpers.imagefiles import class_tree
from PIL import Image

from kfvision.pipelines.cli import main
from kfvision.trainer.data import convert as convert_module
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory
from kfvision.trainer.data.split import split
from kfvision.trainer.errors import ChangedDatasetError, InvalidDatasetError
from kfvision.trainer.use.preview import SAMPLES, write_samples


def files_under(d) -> set:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}


def test_in_place_copies_nothing_and_lists_what_a_copy_lists(tmp_path):
    src = class_tree(tmp_path / "src", per_class=6)
    convert(src, tmp_path / "copy", progress=False)
    convert(src, tmp_path / "ref", progress=False, in_place=True)
    assert files_under(tmp_path / "ref") == {MANIFEST}
    doc = json.loads((tmp_path / "ref" / MANIFEST).read_text())
    assert doc["version"] == 2 and doc["images_root"] == str(src.absolute())
    copy, ref = read_image_directory(tmp_path / "copy"), read_image_directory(tmp_path / "ref")
    assert ref.referenced and not copy.referenced and ref.base == src.absolute()
    assert ref.classes == copy.classes
    assert [e.sha256 for e in ref.images] == [e.sha256 for e in copy.images]
    assert all(ref.file(e).is_relative_to(src.absolute()) for e in ref.images)
    one = ImageDataset(ref, None)[3][0]  # a referenced image reads as its copy does
    assert one.equal(ImageDataset(copy, None)[3][0])


def test_split_in_place_writes_two_manifests_over_the_same_files(tmp_path):
    src = class_tree(tmp_path / "src", per_class=8)
    convert(src, tmp_path / "all", progress=False)  # a self-contained input: referenced too
    split(tmp_path / "all", tmp_path / "a", tmp_path / "b", fraction=0.5, in_place=True)
    for side in ("a", "b"):
        assert files_under(tmp_path / side) == {MANIFEST}
        imdir = read_image_directory(tmp_path / side, verify="hash")
        assert imdir.base == (tmp_path / "all").absolute()
    assert main(["split", str(tmp_path / "a"), str(tmp_path / "a1"), str(tmp_path / "a2"),
                 "--in-place"]) == 0  # of a referenced input: the same images again
    assert read_image_directory(tmp_path / "a1").base == (tmp_path / "all").absolute()


def test_an_archive_in_place_is_extracted_once_where_asked(tmp_path):
    src = class_tree(tmp_path / "src", per_class=5)
    with tarfile.open(tmp_path / "photos.tgz", "w:gz") as tar:
        tar.add(src, arcname="photos")
    with pytest.raises(InvalidDatasetError, match="--extract-to DIR"):
        convert(tmp_path / "photos.tgz", tmp_path / "x", in_place=True, progress=False)
    assert main(["convert", str(tmp_path / "photos.tgz"), str(tmp_path / "out"), "--in-place",
                 "--extract-to", str(tmp_path / "images"), "--quiet"]) == 0
    imdir = read_image_directory(tmp_path / "out", verify="hash")
    assert imdir.base == (tmp_path / "images").absolute() and files_under(tmp_path / "out") == {
        MANIFEST}
    assert len(imdir.images) == 10


def test_a_failed_in_place_conversion_leaves_neither_output_nor_extraction(tmp_path):
    empty = tmp_path / "empty" / "a"
    empty.mkdir(parents=True)
    (empty / "notes.txt").write_text("no images")
    with tarfile.open(tmp_path / "bad.tgz", "w:gz") as tar:
        tar.add(empty.parent, arcname="photos")
    with pytest.raises(InvalidDatasetError, match="no readable images"):
        convert(tmp_path / "bad.tgz", tmp_path / "out", in_place=True,
                extract_to=tmp_path / "images", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "images").exists()


@pytest.fixture()
def referenced(tmp_path):
    src = class_tree(tmp_path / "src", per_class=4)
    convert(src, tmp_path / "ref", progress=False, in_place=True)
    return read_image_directory(tmp_path / "ref")


def test_a_file_rewritten_with_the_same_size_is_named_when_read(referenced):
    e = referenced.images[2]
    data = bytearray(referenced.file(e).read_bytes())
    data[-3] ^= 0x55
    referenced.file(e).write_bytes(bytes(data))
    read_image_directory(referenced.root)  # same size: opening it cannot tell
    ds = ImageDataset(referenced, None)
    ds[1]  # the others still read
    with pytest.raises(ChangedDatasetError, match=f"{e.path}.*same size, but its sha256"):
        ds[2]


def test_a_changed_file_is_named_when_the_cache_is_filled_on_threads(referenced):
    e = referenced.images[2]
    data = bytearray(referenced.file(e).read_bytes())
    data[-3] ^= 0x55
    referenced.file(e).write_bytes(bytes(data))
    with pytest.raises(ChangedDatasetError, match=f"{e.path}.*same size, but its sha256"):
        ImageDataset(referenced, None, cache=True, threads=2)


def test_a_resized_or_missing_file_is_named_when_the_directory_is_opened(referenced):
    e = referenced.images[0]
    referenced.file(e).write_bytes(referenced.file(e).read_bytes() + b"\0")
    with pytest.raises(ChangedDatasetError, match=f"{e.path}.*it has {e.bytes + 1} bytes, the "
                                                  f"manifest says {e.bytes}"):
        read_image_directory(referenced.root)
    referenced.file(e).unlink()
    with pytest.raises(ChangedDatasetError, match=f"{e.path}.*cannot be read"):
        read_image_directory(referenced.root)
    with pytest.raises(ChangedDatasetError, match=f"{e.path}.*cannot be read"):
        ImageDataset(referenced, None)[0]  # and by a reader that opened it before


def _changing(monkeypatch, change):
    """Make convert's reader run `change(file)` right after it reads the third image."""
    seen, read = [], convert_module._read_item

    def read_item(item):
        got = read(item)
        seen.append(item.file)
        if len(seen) == 3:
            change(item.file)
        return got

    monkeypatch.setattr(convert_module, "_read_item", read_item)


@pytest.mark.parametrize("change, what", [
    (lambda f: f.write_bytes(f.read_bytes() + b"more"), "modified again after it was read"),
    (lambda f: f.unlink(), "it was removed"),
    (lambda f: (f.parent / "late.png").write_bytes(f.read_bytes()), "were added"),
])
def test_a_source_changed_while_convert_reads_it_fails_the_conversion(tmp_path, monkeypatch,
                                                                      change, what):
    src = class_tree(tmp_path / "src", per_class=4)
    _changing(monkeypatch, change)
    with pytest.raises(ChangedDatasetError, match=f"changed while convert was reading the "
                                                  f"source: .*{what}"):
        convert(src, tmp_path / "ref", in_place=True, progress=False)
    assert not (tmp_path / "ref").exists()


def test_manifest_versions_say_whether_images_are_referenced(referenced):
    path = referenced.root / MANIFEST
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "version": 1}))
    with pytest.raises(InvalidDatasetError, match="'images_root' needs version 2"):
        read_image_directory(referenced.root)
    path.write_text(json.dumps({**doc, "images_root": "relative/photos"}))
    with pytest.raises(InvalidDatasetError, match="'images_root' must be an absolute folder"):
        read_image_directory(referenced.root)


def test_samples_picture_shows_each_class(referenced):
    write_samples(referenced.root)
    with Image.open(referenced.root / SAMPLES) as im:
        rows = np.asarray(im.convert("L"))
    # one band of thumbnails per class
    assert im.width > 64 * 4 and rows.shape[0] >= len(referenced.classes) * 64
    assert read_image_directory(referenced.root).images == referenced.images  # still valid
