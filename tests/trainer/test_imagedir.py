"""Reading image directories: the manifest contract and each named error."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.decode import load_rgb
from kfvision.trainer.data.imagedir import MANIFEST, check_same_classes, read_image_directory
from kfvision.trainer.data.transforms import eval_transform, train_transform
from kfvision.trainer.errors import ChangedDatasetError, InvalidDatasetError, NotLabeledDatasetError


@pytest.fixture
def imdir(tiny_digits, tmp_path):
    """A private copy of the tiny validation directory that a test may damage."""
    return shutil.copytree(tiny_digits["val"], tmp_path / "val")


def _edit_manifest(root, edit):
    doc = json.loads((root / MANIFEST).read_text())
    edit(doc)
    (root / MANIFEST).write_text(json.dumps(doc))


def test_reads_classes_and_images(tiny_digits):
    d = read_image_directory(tiny_digits["train"], verify="hash")
    assert d.classes == tuple(str(i) for i in range(10))
    assert d.labelled and len(d.images) == 240
    assert d.class_counts() == {str(i): 24 for i in range(10)}
    for e in d.images[:5]:
        assert e.path.split("/")[0] == d.classes[e.label]
        assert (e.width, e.height) == (8, 8)


def test_is_readable_by_torchvision_imagefolder(tiny_digits):
    from torchvision.datasets import ImageFolder

    d = read_image_directory(tiny_digits["train"])
    folder = ImageFolder(str(tiny_digits["train"]))
    assert tuple(folder.classes) == d.classes
    assert len(folder) == len(d.images)


def _drop_manifest(root):
    (root / MANIFEST).unlink()


def _bad_json(root):
    (root / MANIFEST).write_text("{not json")


def _wrong_format(root):
    _edit_manifest(root, lambda d: d.update(format="something-else"))


def _wrong_version(root):
    _edit_manifest(root, lambda d: d.update(version=99))


def _unsorted_classes(root):
    _edit_manifest(root, lambda d: d.update(classes=list(reversed(d["classes"]))))


def _label_out_of_range(root):
    _edit_manifest(root, lambda d: d["images"][0].update(label=42))


def _path_escapes(root):
    _edit_manifest(root, lambda d: d["images"][0].update(path="../../etc/passwd"))


def _missing_image(root):
    (root / json.loads((root / MANIFEST).read_text())["images"][0]["path"]).unlink()


def _changed_image(root):
    f = root / json.loads((root / MANIFEST).read_text())["images"][0]["path"]
    f.write_bytes(f.read_bytes() + b"extra")


def _empty_class(root):
    def edit(doc):
        doc["images"] = [e for e in doc["images"] if e["label"] != 3]
    _edit_manifest(root, edit)


def _no_images(root):
    _edit_manifest(root, lambda d: d.update(images=[]))


def _malformed_entry(root):
    _edit_manifest(root, lambda d: d["images"][0].pop("sha256"))


@pytest.mark.parametrize("damage, message", [
    (_drop_manifest, "not a kfvision image directory"),
    (_bad_json, "not valid JSON"),
    (_wrong_format, "format must be"),
    (_wrong_version, "version 99"),
    (_unsorted_classes, "sorted"),
    (_label_out_of_range, "label 42"),
    (_path_escapes, "inside the directory"),
    (_missing_image, "missing or has changed"),
    (_changed_image, "missing or has changed"),
    (_empty_class, "class(es) 3 have no images"),
    (_no_images, "holds no images"),
    (_malformed_entry, "malformed"),
])
def test_each_damage_gives_a_named_error_that_says_what_to_do(imdir, damage, message):
    damage(imdir)
    with pytest.raises(InvalidDatasetError) as err:
        read_image_directory(imdir)
    assert message in str(err.value)
    assert "kfvision convert" in str(err.value) or "Add images" in str(err.value)


def test_a_folder_of_images_given_as_an_image_directory_gets_the_convert_command(tmp_path):
    """The common mistake: the source folder (class folders of images) given where its image
    directory belongs. The error names the command that makes one of it; a folder without
    images gets the general advice (never `convert SRC` into a folder that already exists)."""
    source = tmp_path / "photos"
    (source / "cats").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(source / "cats" / "a.JPG")
    with pytest.raises(InvalidDatasetError) as err:
        read_image_directory(source)
    assert ("holds images but is not a kfvision image directory" in str(err.value)
            and f"`kfvision convert {source} {tmp_path / 'photos-imagedir'}`" in str(err.value))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidDatasetError, match="holds no images. Give the OUT folder of a "
                                                  r"`kfvision convert SRC OUT`"):
        read_image_directory(tmp_path / "empty")


def test_hash_verification_catches_same_size_corruption(imdir):
    f = imdir / json.loads((imdir / MANIFEST).read_text())["images"][0]["path"]
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    read_image_directory(imdir)  # same size: the cheap check passes
    with pytest.raises(ChangedDatasetError, match="same size, but its sha256"):
        read_image_directory(imdir, verify="hash")


def test_not_a_folder(tmp_path):
    with pytest.raises(InvalidDatasetError, match="not a folder"):
        read_image_directory(tmp_path / "nope")


def test_unlabelled_directory_cannot_train(tmp_path, tiny_digits):
    from kfvision.trainer.data.convert import convert

    loose = tmp_path / "loose"
    loose.mkdir()
    for f in sorted((tiny_digits["raw"] / "val" / "5").iterdir())[:3]:
        shutil.copy(f, loose)
    convert(loose, tmp_path / "u", progress=False)
    d = read_image_directory(tmp_path / "u")
    assert not d.labelled and all(e.label is None for e in d.images)
    with pytest.raises(NotLabeledDatasetError, match="needs labelled images"):
        d.require_labelled("training")


def test_categories_that_differ_are_named(tiny_digits, tmp_path):
    train = read_image_directory(tiny_digits["train"])
    other = tmp_path / "other"
    shutil.copytree(tiny_digits["val"], other)
    _edit_manifest(other, lambda d: d.update(classes=d["classes"][:-1] + ["ten"]))
    with pytest.raises(InvalidDatasetError,
                       match="only in training .*: 9; only in validation .*ten"):
        check_same_classes(train, read_image_directory(other, verify="none"))


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "I;16", "1", "LA"])
def test_every_image_mode_reaches_the_trainer_as_rgb(tmp_path, mode):
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8), "RGB")
    if mode == "I;16":
        im = Image.fromarray(rng.integers(0, 65535, (20, 30), dtype=np.uint16))
    elif mode == "P":
        im = rgb.convert("P")
    else:
        im = rgb.convert(mode)
    path = tmp_path / ("x.tif" if mode in ("CMYK", "I;16") else "x.png")
    im.save(path)
    t = load_rgb(path)
    assert t.dtype == torch.uint8 and t.shape == (3, 20, 30)


@pytest.mark.parametrize("augment", ["standard", "light", "none"])
def test_dataset_yields_uint8_crops_of_the_image_size(tiny_digits, augment):
    d = read_image_directory(tiny_digits["val"])
    for cache in (False, True):
        ds = ImageDataset(d, train_transform(augment, 48), cache=cache)
        x, y = ds[0]
        assert x.dtype == torch.uint8 and x.shape == (3, 48, 48) and y == d.images[0].label
    ev = ImageDataset(d, eval_transform(augment, 48), precompute=True)
    plain = ImageDataset(d, eval_transform(augment, 48))
    assert torch.equal(ev[3][0], plain[3][0])  # precomputed eval crops are the same crops


def test_an_image_damaged_after_conversion_is_a_named_error(imdir):
    entry = json.loads((imdir / MANIFEST).read_text())["images"][0]
    f = imdir / entry["path"]
    f.write_bytes(b"\0" * f.stat().st_size)  # same size: the cheap manifest check passes
    ds = ImageDataset(read_image_directory(imdir), eval_transform("none", 32))
    with pytest.raises(InvalidDatasetError, match="can no longer be decoded.*kfvision convert"):
        ds[0]
