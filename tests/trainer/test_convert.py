"""kfvision convert: layouts, archives, labels CSV, image types and modes, bad and hostile input."""

import io
import os
import shutil
import stat
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest
from helpers.imagefiles import class_tree, image_bytes, leftovers, make_archive, write
from PIL import Image

from kfvision.pipelines.cli import main
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.decode import load_rgb
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.errors import DecompressionBombError, InvalidDatasetError, UnsafeArchiveError


def check_output(out: Path, classes, counts=None):
    d = read_image_directory(out, verify="hash")
    assert list(d.classes) == list(classes)
    if counts is not None:
        assert d.class_counts() == counts
    for e in d.images:
        t = load_rgb(out / e.path)
        assert t.shape == (3, e.height, e.width)
    return d


# --- layouts -------------------------------------------------------------------------------------


def _flat_with_csv(root: Path, csv_inside: bool) -> str:
    for i in range(4):
        write(root / "imgs" / f"{i}.png", image_bytes())
    rows = "path,label\nimgs/0.png,cat\n./imgs/1.png,cat\nimgs/2.png,dog\nimgs\\3.png,dog\n"
    csv = write(root / "labels.csv" if csv_inside else root.parent / "labels.csv", rows.encode())
    return "labels.csv" if csv_inside else str(csv)


LAYOUTS = {
    "class folders": lambda r: (class_tree(r), None),
    "one wrapping folder": lambda r: (class_tree(r / "photos"), None),
    "two wrapping folders": lambda r: (class_tree(r / "a" / "b"), None),
    "nested images in a class": lambda r: (
        write(r / "dog" / "sub" / "deep.png", image_bytes()) and class_tree(r), None),
    "flat + labels CSV": lambda r: (None, _flat_with_csv(r, csv_inside=False)),
    "flat + labels CSV inside the source": lambda r: (None, _flat_with_csv(r, csv_inside=True)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_gives_the_same_classes(tmp_path, layout):
    src = tmp_path / "src"
    src.mkdir()
    _, labels = LAYOUTS[layout](src)
    report = convert(src, tmp_path / "out", labels=labels, progress=False)
    d = check_output(tmp_path / "out", ["cat", "dog"])
    assert sum(report.counts.values()) == len(d.images) == report.images
    assert report.skipped == []


def test_loose_images_make_an_unlabelled_directory(tmp_path):
    for i in range(3):
        write(tmp_path / "src" / f"{i}.jpg", image_bytes("JPEG"))
    report = convert(tmp_path / "src", tmp_path / "out", progress=False)
    d = check_output(tmp_path / "out", [])
    assert not d.labelled and len(d.images) == 3 and "UNLABELLED" in report.summary()


def test_hidden_and_system_files_are_ignored_silently(tmp_path):
    src = class_tree(tmp_path / "src")
    write(src / ".DS_Store", b"x")
    write(src / "cat" / "._cat0.png", b"appledouble")
    write(src / "cat" / "Thumbs.db", b"x")
    write(src / "__MACOSX" / "cat" / "._x.png", b"x")
    write(src / ".git" / "HEAD", b"ref")
    report = convert(src, tmp_path / "out", progress=False)
    assert report.skipped == [] and report.classes == ["cat", "dog"]


# --- archives ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["p.zip", "p.tar", "p.tar.gz", "p.tgz", "p.tar.bz2", "P.ZIP"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_every_archive_type_converts(tmp_path, name, wrapped):
    tree = class_tree(tmp_path / "tree" / ("photos" if wrapped else ""), per_class=2)
    archive = make_archive(tmp_path / "tree", tmp_path / name)
    report = convert(archive, tmp_path / "out", progress=False)
    check_output(tmp_path / "out", ["cat", "dog"], {"cat": 2, "dog": 2})
    assert report.skipped == [] and tree.is_dir()
    assert leftovers(tmp_path) == []


def test_an_archive_of_loose_images_in_one_folder_is_unlabelled(tmp_path):
    for i in range(3):
        write(tmp_path / "tree" / "photos" / f"{i}.png", image_bytes())
    archive = make_archive(tmp_path / "tree", tmp_path / "photos.tar.gz")
    d = check_output(convert(archive, tmp_path / "out", progress=False).out, [])
    assert sorted(e.path for e in d.images) == ["0.png", "1.png", "2.png"]


def test_archive_with_labels_csv_inside(tmp_path):
    _flat_with_csv(tmp_path / "tree" / "set", csv_inside=True)
    archive = make_archive(tmp_path / "tree", tmp_path / "set.zip")
    convert(archive, tmp_path / "out", labels="set/labels.csv", progress=False)
    check_output(tmp_path / "out", ["cat", "dog"], {"cat": 2, "dog": 2})


@pytest.mark.parametrize("name", ["bad.zip", "bad.tar.gz", "bad.tar.bz2"])
def test_a_corrupt_archive_is_a_clear_error(tmp_path, name):
    good = make_archive(class_tree(tmp_path / "tree"), tmp_path / f"good{Path(name).suffix}")
    bad = write(tmp_path / name, good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(InvalidDatasetError, match="bad"):
        convert(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# --- image types and modes -----------------------------------------------------------------------

IMAGE_CASES = [  # (file name, Pillow format, mode)
    ("a.jpg", "JPEG", "RGB"), ("b.JPEG", "JPEG", "L"), ("c.Png", "PNG", "RGBA"),
    ("d.png", "PNG", "P"), ("e.png", "PNG", "I;16"), ("f.png", "PNG", "LA"),
    ("g.ppm", "PPM", "RGB"), ("h.pgm", "PPM", "L"), ("i.BMP", "BMP", "1"),
    ("j.tif", "TIFF", "CMYK"), ("k.TIFF", "TIFF", "I;16"), ("l.webp", "WEBP", "RGB"),
    ("m.jpg", "JPEG", "CMYK"),
]


def test_every_image_type_and_mode_in_any_letter_case_reaches_the_trainer_as_rgb(tmp_path):
    src = tmp_path / "src"
    for name, fmt, mode in IMAGE_CASES:
        for c in ("x", "y"):
            write(src / c / name, image_bytes(fmt, mode, size=(20 + len(name), 12)))
    report = convert(src, tmp_path / "out", progress=False)
    assert report.skipped == []
    d = check_output(tmp_path / "out", ["x", "y"], {"x": len(IMAGE_CASES), "y": len(IMAGE_CASES)})
    for e in d.images:  # copied byte for byte, sizes as decoded
        assert (src / e.path).read_bytes() == (tmp_path / "out" / e.path).read_bytes()
        assert e.width == 20 + len(Path(e.path).name) and e.height == 12


# --- bad files: skipped and reported, or --strict -----------------------------------------------

BAD_FILES = {  # name -> (bytes, reason in the report)
    "truncated.png": (image_bytes("PNG", size=(64, 64))[:200], "cannot be decoded"),
    "empty.jpg": (b"", "is empty (0 bytes)"),
    "text.jpg": (b"this is not an image\n" * 10, "cannot be decoded"),
    "notes.txt": (b"hello", "not an image type"),
    "truncated.jpg": (image_bytes("JPEG", size=(64, 64))[:300], "cannot be decoded"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_file_is_skipped_with_its_path_and_reason(tmp_path, name):
    data, reason = BAD_FILES[name]
    src = class_tree(tmp_path / "src")
    write(src / "dog" / name, data)
    report = convert(src, tmp_path / "out", progress=False)
    assert len(report.skipped) == 1
    where, why = report.skipped[0]
    assert where == f"{src}/dog/{name}" and reason in why
    assert report.counts == {"cat": 3, "dog": 3}
    summary = report.summary()
    assert "skipped 1 file(s)" in summary and name in summary and reason in summary


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_strict_fails_on_a_bad_file_and_leaves_nothing(tmp_path, name):
    src = class_tree(tmp_path / "src")
    write(src / "dog" / name, BAD_FILES[name][0])
    with pytest.raises(InvalidDatasetError, match=f"dog/{name}.*--strict"):
        convert(src, tmp_path / "out", strict=True, progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_loose_files_beside_class_folders_are_reported(tmp_path):
    src = class_tree(tmp_path / "src")
    write(src / "stray.png", image_bytes())
    report = convert(src, tmp_path / "out", progress=False)
    assert report.skipped == [(f"{src}/stray.png", "not inside a class folder")]


def test_symlinks_are_followed_inside_the_source_only(tmp_path):
    src = class_tree(tmp_path / "src")
    secret = write(tmp_path / "elsewhere" / "secret.png", image_bytes())
    os.symlink(secret, src / "cat" / "out.png")
    os.symlink("../dog/dog0.png", src / "cat" / "in.png")
    os.symlink(tmp_path / "elsewhere", src / "dog" / "folder")
    os.symlink("missing.png", src / "dog" / "broken.png")
    report = convert(src, tmp_path / "out", progress=False)
    reasons = dict(report.skipped)
    assert "pointing outside the source" in reasons[f"{src}/cat/out.png"]
    assert reasons[f"{src}/dog/folder"] == "link to a folder (not followed)"
    assert reasons[f"{src}/dog/broken.png"] == "broken symbolic link"
    d = check_output(tmp_path / "out", ["cat", "dog"], {"cat": 4, "dog": 3})
    assert not any((tmp_path / "out" / e.path).is_symlink() for e in d.images)


def test_a_linked_class_folder_is_not_followed(tmp_path):
    src = class_tree(tmp_path / "src")
    class_tree(tmp_path / "outside", classes=("secret",))
    os.symlink(tmp_path / "outside" / "secret", src / "secret")
    report = convert(src, tmp_path / "out", progress=False)
    assert report.classes == ["cat", "dog"]
    assert report.skipped == [(f"{src}/secret", "link to a folder (not followed)")]


# --- hostile archives ----------------------------------------------------------------------------


def _tar(path: Path, members) -> Path:
    """members: (TarInfo settings, bytes or None)."""
    with tarfile.open(path, "w:gz") as tf:
        for c in ("cat", "dog"):
            data = image_bytes()
            info = tarfile.TarInfo(f"{c}/ok.png")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for settings, data in members:
            info = tarfile.TarInfo(settings.pop("name"))
            for k, v in settings.items():
                setattr(info, k, v)
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _zip(path: Path, members) -> Path:
    """members: (name, bytes, unix mode or None)."""
    with zipfile.ZipFile(path, "w") as zf:
        for c in ("cat", "dog"):
            zf.writestr(f"{c}/ok.png", image_bytes())
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            if mode is not None:
                info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


HOSTILE = {
    "tar: ../ path": lambda p: _tar(p / "x.tgz", [({"name": "../evil.png"}, image_bytes())]),
    "tar: deep ../ path": lambda p: _tar(p / "x.tgz",
                                         [({"name": "cat/../../evil.png"}, image_bytes())]),
    "tar: symlink to an absolute path": lambda p: _tar(p / "x.tgz", [(
        {"name": "cat/pw.png", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, None)]),
    "tar: symlink out": lambda p: _tar(p / "x.tgz", [(
        {"name": "cat/up.png", "type": tarfile.SYMTYPE, "linkname": "../../evil.png"}, None)]),
    "tar: hard link out": lambda p: _tar(p / "x.tgz", [(
        {"name": "cat/h.png", "type": tarfile.LNKTYPE, "linkname": "../evil.png"}, None)]),
    "tar: character device": lambda p: _tar(p / "x.tgz", [(
        {"name": "cat/tty", "type": tarfile.CHRTYPE, "devmajor": 5, "devminor": 0}, None)]),
    "tar: fifo": lambda p: _tar(p / "x.tgz", [({"name": "cat/fifo", "type": tarfile.FIFOTYPE},
                                               None)]),
    "zip: ../ path": lambda p: _zip(p / "x.zip", [("../evil.png", image_bytes(), None)]),
    "zip: deep ../ path": lambda p: _zip(p / "x.zip", [("a/../../evil.png", b"x", None)]),
    "zip: windows ..\\ path": lambda p: _zip(p / "x.zip", [("..\\evil.png", b"x", None)]),
    "zip: drive letter": lambda p: _zip(p / "x.zip", [("C:/evil.png", b"x", None)]),
    "zip: symlink out": lambda p: _zip(p / "x.zip", [
        ("cat/up.png", b"../../evil.png", stat.S_IFLNK | 0o777)]),
    "zip: symlink to an absolute path": lambda p: _zip(p / "x.zip", [
        ("cat/pw.png", b"/etc/passwd", stat.S_IFLNK | 0o777)]),
    "zip: character device": lambda p: _zip(p / "x.zip", [("cat/tty", b"", stat.S_IFCHR | 0o600)]),
    "zip: fifo": lambda p: _zip(p / "x.zip", [("cat/fifo", b"", stat.S_IFIFO | 0o600)]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_unsafe_archive_members_refuse_the_archive_and_write_nothing(tmp_path, case):
    work = tmp_path / "work"
    work.mkdir()
    archive = HOSTILE[case](tmp_path)
    with pytest.raises(UnsafeArchiveError, match="member"):
        convert(archive, work / "out", progress=False)
    assert not (work / "out").exists() and leftovers(work) == []
    assert not (tmp_path / "evil.png").exists() and not (work / "evil.png").exists()


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_leading_slashes_are_stripped_and_inside_links_kept(tmp_path, kind):
    # the data filter's rule: "/cat/a.png" is extracted as "cat/a.png"
    if kind == "zip":
        archive = _zip(tmp_path / "x.zip", [("/cat/abs.png", image_bytes(), None),
                                            ("dog/link.png", b"ok.png", stat.S_IFLNK | 0o777)])
    else:
        archive = _tar(tmp_path / "x.tgz", [
            ({"name": "/cat/abs.png"}, image_bytes()),
            ({"name": "dog/link.png", "type": tarfile.SYMTYPE, "linkname": "ok.png"}, None)])
    report = convert(archive, tmp_path / "out", progress=False)
    assert report.counts == {"cat": 2, "dog": 2} and report.skipped == []
    check_output(tmp_path / "out", ["cat", "dog"])


# --- decompression bombs -------------------------------------------------------------------------


def huge_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of width x height, all black: a few kB on disk, huge when decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_small_file_with_huge_dimensions_is_refused(tmp_path):
    src = class_tree(tmp_path / "src")
    bomb = write(src / "dog" / "bomb.png", huge_png(20_000, 20_000))
    assert bomb.stat().st_size < 100_000  # 400 megapixels in a small file
    with pytest.raises(DecompressionBombError, match="bomb.png.*400000000 pixels.*bomb"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_the_pixel_limit_is_pillows_and_refuses_even_without_strict(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 24 * 16 - 1)  # class_tree's images are 24x16
    src = class_tree(tmp_path / "src")
    with pytest.raises(DecompressionBombError, match="24 x 16 = 384 pixels, over the limit of 383"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --- errors about the whole source ---------------------------------------------------------------


def _empty_class(r):
    class_tree(r)
    (r / "bird").mkdir()
    write(r / "bird" / "x.txt", b"x")


SOURCE_ERRORS = {
    "missing source": (lambda r: r.rmdir(), "does not exist"),
    "not an archive": (None, "not an archive"),
    "no images": (lambda r: write(r / "a.txt", b"x"), "no readable images"),
    "empty class": (_empty_class, "bird have no readable images"),
    "single class": (lambda r: class_tree(r, classes=("cat",)), "single class"),
}


@pytest.mark.parametrize("case", list(SOURCE_ERRORS))
def test_source_errors_are_named_and_leave_nothing(tmp_path, case):
    make, match = SOURCE_ERRORS[case]
    src = tmp_path / "src"
    src.mkdir()
    if make is None:
        src = write(tmp_path / "photos.rar", b"Rar!")
    else:
        make(src)
    with pytest.raises(InvalidDatasetError, match=match):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_out_must_be_new_unless_overwrite_and_must_not_overlap_the_source(tmp_path):
    src = class_tree(tmp_path / "src")
    convert(src, tmp_path / "out", progress=False)
    with pytest.raises(InvalidDatasetError, match="already exists"):
        convert(src, tmp_path / "out", progress=False)
    shutil.rmtree(src / "dog")
    class_tree(src, classes=("dog", "eel"))
    convert(src, tmp_path / "out", overwrite=True, progress=False)
    check_output(tmp_path / "out", ["cat", "dog", "eel"])
    with pytest.raises(InvalidDatasetError, match="overlap"):
        convert(src, src / "inside", progress=False)
    assert leftovers(tmp_path) == [] and leftovers(src) == []


# --- labels CSV ----------------------------------------------------------------------------------


def _csv_source(tmp_path, rows: str) -> tuple[Path, Path]:
    for i in range(4):
        write(tmp_path / "src" / f"{i}.png", image_bytes())
    return tmp_path / "src", write(tmp_path / "labels.csv", rows.encode())


def test_labels_csv_without_header_and_with_missing_and_unlisted_files(tmp_path):
    src, csv = _csv_source(tmp_path, "0.png,cat\n1.png,cat\n2.png,dog\nnope.png,dog\n")
    report = convert(src, tmp_path / "out", labels=csv, progress=False)
    assert report.counts == {"cat": 2, "dog": 1}
    assert dict(report.skipped) == {f"{src}/3.png": "not listed in the labels file",
                                    f"{src}/nope.png": "listed in labels.csv but not found"}


LABEL_ERRORS = {
    "two labels for one image": ("path,label\n0.png,cat\n0.png,dog\n", "line 3.*both"),
    "path leaving the source": ("path,label\n../0.png,cat\n", "line 2.*leaves"),
    "absolute path": ("path,label\n/etc/0.png,cat\n", "line 2.*absolute"),
    "label with a slash": ("path,label\n0.png,a/b\n", "line 2.*cannot be a class folder"),
    "empty label": ("path,label\n0.png,\n", "line 2.*cannot be a class folder"),
    "one column": ("0.png\n", "line 1.*expected a path and a label"),
    "empty file": ("", "is empty"),
    "header only": ("image,class\n", "no rows"),
}


@pytest.mark.parametrize("case", list(LABEL_ERRORS))
def test_labels_csv_errors_name_the_line(tmp_path, case):
    rows, match = LABEL_ERRORS[case]
    src, csv = _csv_source(tmp_path, rows)
    with pytest.raises(InvalidDatasetError, match=match):
        convert(src, tmp_path / "out", labels=csv, progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_labels_file(tmp_path):
    src = class_tree(tmp_path / "src")
    with pytest.raises(InvalidDatasetError, match="labels file nope.csv not found"):
        convert(src, tmp_path / "out", labels="nope.csv", progress=False)


# --- command line --------------------------------------------------------------------------------


def test_cli_convert_prints_a_summary_and_errors_without_traceback(tmp_path, capsys):
    src = class_tree(tmp_path / "src")
    write(src / "cat" / "bad.jpg", b"")
    archive = make_archive(src, tmp_path / "photos.tar.gz")
    assert main(["convert", str(archive), str(tmp_path / "out"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "wrote 6 images" in out and "cat" in out and "skipped 1 file(s)" in out
    assert "photos.tar.gz/cat/bad.jpg: is empty (0 bytes)" in out
    assert main(["convert", str(archive), str(tmp_path / "out2"), "--strict", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.jpg" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["p.zip", "p.tar.gz"])
def test_an_archive_larger_than_the_free_disk_is_refused_before_filling_it(tmp_path, name,
                                                                           monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    archive = make_archive(class_tree(tmp_path / "tree"), tmp_path / name)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    with pytest.raises(InvalidDatasetError, match="needs more than.*decompression bomb"):
        convert(archive, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_an_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    import kfvision.trainer.data.convert as convert_module

    calls = []
    real = convert_module.probe_image

    def interrupted(data, where):
        calls.append(where)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(data, where)

    monkeypatch.setattr(convert_module, "probe_image", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(class_tree(tmp_path / "src"), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
