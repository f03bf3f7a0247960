"""The pack (raw pixels beside an image directory): exact pixels, same training, stale packs
ignored with a warning, the two commands that write it."""

import json
import pickle
import shutil
import warnings

import pytest
import torch
from helpers.imagefiles import image_bytes, write
from helpers.runs import train_argv
from kfvision.pipelines.cli import main as kfvision
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.decode import load_rgb
from kfvision.trainer.data.draws import Sample
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory, write_manifest
from kfvision.trainer.data.pack import INDEX, PIXELS, StalePackWarning, write_pack
from kfvision.trainer.data.transforms import eval_transform, train_transform
from kfvision.trainer.errors import InvalidDatasetError, OutputError
from kfvision.trainer.train import main as train_main

# (file, format, mode): every way an image reaches load_rgb (libjpeg-turbo or Pillow + conversion)
IMAGES = [("cat/rgb.jpg", "JPEG", "RGB"), ("cat/gray.jpg", "JPEG", "L"),
          ("cat/cmyk.jpg", "JPEG", "CMYK"), ("dog/rgb.png", "PNG", "RGB"),
          ("dog/gray.png", "PNG", "L"), ("dog/rgba.png", "PNG", "RGBA"),
          ("dog/deep.png", "PNG", "I;16"), ("dog/palette.png", "PNG", "P")]


@pytest.fixture
def mixed(tmp_path):
    """An image directory (not packed) holding every kind of image in IMAGES."""
    for i, (name, fmt, mode) in enumerate(IMAGES):
        write(tmp_path / "src" / name, image_bytes(fmt, mode, size=(23 + i, 17)))
    convert(tmp_path / "src", tmp_path / "data", progress=False)
    return tmp_path / "data"


def test_the_pack_holds_exactly_the_pixels_load_rgb_decodes(mixed):
    report = write_pack(mixed, progress=False)
    assert report.written and report.images == len(IMAGES)
    assert report.pixel_bytes == (mixed / PIXELS).stat().st_size
    imdir = read_image_directory(mixed)
    ds = ImageDataset(imdir, None)
    assert ds.pack is not None
    for i, e in enumerate(imdir.images):
        img = ds[i][0]
        assert torch.equal(img, load_rgb(mixed / e.path)), e.path
        assert img.permute(1, 2, 0).is_contiguous()  # a channels-last view of the file, no copy
    again = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker gets: its own map
    assert again.pack._pixels is None and torch.equal(again[3][0], ds[3][0])
    assert not write_pack(mixed, progress=False).written  # up to date: nothing rewritten


def _train(tmp_path, name, data, model, **options):
    out = tmp_path / name
    argv = train_argv(model, data, out, epochs=1, image_size=32, batch_size=16, lr=0.05,
                      augment="light", print_freq=1000, workers=0, **options)
    assert train_main(argv) == 0
    return torch.load(out / "weights.pt", weights_only=True)


def test_training_from_the_pack_gives_the_identical_model(tmp_path, tiny_digits, resnet18_dir,
                                                         monkeypatch):
    packed = {s: shutil.copytree(tiny_digits[s], tmp_path / s) for s in ("train", "val")}
    for d in packed.values():
        write_pack(d, progress=False)
    plain = _train(tmp_path, "plain", tiny_digits, resnet18_dir, cache="off")

    def no_decoding(path):
        raise AssertionError(f"{path} was decoded although the pack was there")

    monkeypatch.setattr("kfvision.trainer.data.decode.load_rgb", no_decoding)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StalePackWarning)
        from_pack = _train(tmp_path, "packed", packed, resnet18_dir, cache="off")
    assert all(torch.equal(plain[k], from_pack[k]) for k in plain)


@pytest.mark.parametrize("augment", ["standard", "none"])
def test_a_cache_filled_from_the_pack_holds_the_same_crops_in_its_own_memory(mixed, augment):
    imdir = read_image_directory(mixed)
    plain = ImageDataset(imdir, train_transform(augment, 24), cache=True, pack=False)
    write_pack(mixed, progress=False)
    packed = ImageDataset(imdir, train_transform(augment, 24), cache=True)
    evals = [ImageDataset(imdir, eval_transform(augment, 24), precompute=True, pack=p)
             for p in (False, True)]
    packed.pack[0]  # maps the file in this process
    start = packed.pack._pixels.ctypes.data
    mapped = range(start, start + packed.pack._pixels.nbytes)
    for i in range(len(imdir.images)):
        assert torch.equal(plain[Sample(i, 1, 2)][0], packed[Sample(i, 1, 2)][0])
        assert torch.equal(evals[0][i][0], evals[1][i][0])
        for kept in (packed.images[i], evals[1].images[i]):  # not views of the mapped file
            assert kept.untyped_storage().data_ptr() not in mapped


def _drop_last_image(root):
    imdir = read_image_directory(root)
    (root / imdir.images[-1].path).unlink()
    write_manifest(root, imdir.classes, imdir.images[:-1])


@pytest.mark.parametrize("damage, why", [
    (_drop_last_image, "was made for other images"),
    (lambda root: (root / PIXELS).write_bytes((root / PIXELS).read_bytes()[:-1]), "bytes, found"),
    (lambda root: (root / PIXELS).unlink(), "found none"),
    (lambda root: (root / INDEX).write_text("{"), "cannot be read"),
])
def test_a_pack_that_no_longer_matches_is_ignored_with_one_warning(mixed, damage, why):
    write_pack(mixed, progress=False)
    damage(mixed)
    imdir = read_image_directory(mixed)
    with pytest.warns(StalePackWarning, match=why) as caught:
        ds = ImageDataset(imdir, None)
    assert len(caught) == 1 and f"kfvision pack {mixed}" in str(caught[0].message)
    assert ds.pack is None
    assert all(torch.equal(ds[i][0], load_rgb(mixed / e.path)) for i, e in enumerate(imdir.images))
    assert write_pack(mixed, progress=False).written  # the command the warning names fixes it
    assert ImageDataset(imdir, None).pack is not None


def test_packing_refuses_an_image_changed_since_conversion(mixed):
    path = mixed / read_image_directory(mixed).images[0].path
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # same size, other bytes: only the sha256 tells
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidDatasetError, match="has changed since"):
        write_pack(mixed, progress=False)
    assert not (mixed / INDEX).exists() and not list(mixed.glob(f".{PIXELS}.*"))


def test_packing_refuses_an_image_deleted_while_it_packs(mixed, monkeypatch):
    path = mixed / read_image_directory(mixed).images[-1].path

    def delete_after_the_first(items, *args):  # the progress bar's loop, with a file going away
        for i in items:
            yield i
            path.unlink(missing_ok=True)

    monkeypatch.setattr("kfvision.trainer.data.pack.progress_bar", delete_after_the_first)
    with pytest.raises(InvalidDatasetError, match=f"{path.name} can no longer be read"):
        write_pack(mixed, progress=False)
    assert not (mixed / INDEX).exists() and not list(mixed.glob(f".{PIXELS}.*"))


def test_packing_refuses_when_the_pixels_do_not_fit_on_the_disk(mixed, monkeypatch):
    monkeypatch.setattr("kfvision.trainer.data.pack.shutil.disk_usage",
                        lambda _: shutil._ntuple_diskusage(
        10**6, 10**6, 100))
    with pytest.raises(OutputError, match="GiB is free there"):
        write_pack(mixed, progress=False)
    assert not (mixed / PIXELS).exists()


def test_convert_pack_and_the_pack_command(tmp_path, capsys):
    for name, fmt, mode in IMAGES[:4]:
        write(tmp_path / "src" / name, image_bytes(fmt, mode))
    assert kfvision(["convert", str(tmp_path / "src"), str(tmp_path / "a"), "--pack",
                     "--quiet"]) == 0
    assert "packed 4 images" in capsys.readouterr().out
    assert ImageDataset(read_image_directory(tmp_path / "a"), None).pack is not None
    assert kfvision(["convert", str(tmp_path / "src"), str(tmp_path / "b"), "--quiet"]) == 0
    assert not (tmp_path / "b" / INDEX).exists()  # opt-in
    assert kfvision(["pack", str(tmp_path / "b"), "--quiet"]) == 0
    assert "packed 4 images" in capsys.readouterr().out
    assert kfvision(["pack", str(tmp_path / "b")]) == 0
    assert "is up to date" in capsys.readouterr().out
    assert json.loads((tmp_path / "b" / INDEX).read_text())["images"][0][0] == 0
    assert kfvision(["pack", str(tmp_path / "src")]) == 2
    assert f"no {MANIFEST}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kfvision(["pack", "--help"])
    assert "DISK COST" in capsys.readouterr().out
