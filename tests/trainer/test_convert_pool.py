"""convert with its pool of processes (many files, several cores): the same output as one
process, and the same refusals."""

import json
import re

import pytest
from helpers.imagefiles import class_tree, image_bytes, leftovers, write
from PIL import Image

import kfvision.trainer.data.convert as convert_module
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory
from kfvision.trainer.errors import ChangedDatasetError, DecompressionBombError, InvalidDatasetError


@pytest.fixture(autouse=True)
def several_cores(whole_machine):
    if convert_module._pool_size(10**6) < 2:
        pytest.skip("needs 2 cores and the fork start method")


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(convert_module, "POOL_MIN_ITEMS", 0)


def source(root):
    class_tree(root, per_class=12)
    write(root / "dog" / "x.jpg", image_bytes("JPEG"))
    write(root / "dog" / "truncated.png", image_bytes("PNG", size=(64, 64))[:200])
    write(root / "cat" / "notes.txt", b"hello")
    write(root / "cat" / "text.jpg", b"not an image\n" * 10)
    return root


def skipped(report):  # Pillow's reasons name a BytesIO by its address
    return [(where, re.sub(r"0x[0-9a-f]+", "0x...", why)) for where, why in report.skipped]


def manifest(out):
    doc = json.loads((out / MANIFEST).read_text())
    doc.pop("images_root", None)
    return doc


@pytest.mark.parametrize("in_place", [False, True])
def test_the_pool_writes_what_one_process_writes(tmp_path, monkeypatch, in_place):
    src = source(tmp_path / "src")
    one = convert(src, tmp_path / "one", in_place=in_place, progress=False)
    monkeypatch.setattr(convert_module, "POOL_MIN_ITEMS", 0)
    pooled = convert(src, tmp_path / "pooled", in_place=in_place, progress=False)
    assert manifest(tmp_path / "pooled") == manifest(tmp_path / "one")
    assert skipped(pooled) == skipped(one) and len(one.skipped) == 3
    assert pooled.counts == one.counts == {"cat": 12, "dog": 13}
    read_image_directory(tmp_path / "pooled", verify="hash")


def test_strict_stops_the_pool_at_the_first_bad_file(tmp_path, pool):
    src = source(tmp_path / "src")
    with pytest.raises(InvalidDatasetError, match="cat/notes.txt.*--strict"):
        convert(src, tmp_path / "out", strict=True, in_place=True, progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_the_pixel_limit_the_caller_set_holds_in_the_workers(tmp_path, pool, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 24 * 16 - 1)  # class_tree's images are 24x16
    with pytest.raises(DecompressionBombError, match="24 x 16 = 384 pixels"):
        convert(class_tree(tmp_path / "src"), tmp_path / "out", in_place=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_file_changed_while_a_worker_reads_it_fails_the_conversion(tmp_path, pool,
                                                                     monkeypatch):
    src = class_tree(tmp_path / "src")
    real = convert_module.probe_image

    def probe_then_append(data, where):  # runs in the (forked) worker
        if where.endswith("dog1.png"):
            with open(where, "ab") as f:
                f.write(b"more")
        return real(data, where)

    monkeypatch.setattr(convert_module, "probe_image", probe_then_append)
    with pytest.raises(ChangedDatasetError, match="dog1.png changed while convert was reading"):
        convert(src, tmp_path / "out", in_place=True, progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_neither_convert_nor_its_pool_imports_torch(tmp_path):
    """Each image is checked by Pillow alone (trainer/data/rgb.py): the parent and each forked
    worker would otherwise take ~700 MiB and 2 s of CPU to import torch. The workers run in a
    process of their own (all cores: `several_cores`), checked image by image."""
    import subprocess
    import sys
    from pathlib import Path

    src = source(tmp_path / "src")
    code = """if True:
        import sys
        import kfvision.trainer.data.convert as c
        c.POOL_MIN_ITEMS = 0
        examine = c._examine
        def checked(*args, **kwargs):
            result = examine(*args, **kwargs)
            assert "torch" not in sys.modules, "a pool worker imported torch"
            return result
        c._examine = checked  # forked: the workers call this one
        assert c._pool_size(10**6) >= 2
        report = c.convert(sys.argv[1], sys.argv[2], progress=False)
        print(report.images, "torch" in sys.modules)
    """
    run = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")],
                         cwd=Path(__file__).parents[1], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.split() == ["25", "False"], run.stdout + run.stderr
