"""Hostile inputs, one table: each must end in its named error or a reported skip, leave the
input as it was, and leave no half-written output. The test prints how many it tried.

The table holds one or two of each kind of hostile input (archives, image files, labels CSVs,
image directories, model folders, parameters); the variants (15 unsafe archive members,
every bad-file type, labels-CSV errors, damaged image directories and model folders, every
parameter range) are in test_convert.py, test_imagedir.py, test_models.py and test_train.py.
Every error here is a KfvisionError, so the command line exits 2: permanent under a PyTorchJob's
ExitCode restart policy (docs/faults.md).
"""

import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import NamedTuple

import torch
from helpers.imagefiles import class_tree, image_bytes, make_archive, write
from test_convert import _tar, _zip, huge_png

from kfvision.trainer.config import TrainConfig
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory
from kfvision.trainer.distributed import DistContext
from kfvision.trainer.errors import (
    DecompressionBombError,
    InvalidDatasetError,
    InvalidModelDirectoryError,
    InvalidParameterError,
    KfvisionError,
    NotLabeledDatasetError,
    UnsafeArchiveError,
)
from kfvision.trainer.train import run
from kfvision.trainer.use.score import score

ALONE = DistContext(0, 0, 1, 1, torch.device("cpu"))


class Case(NamedTuple):
    """`make(inp, fx)` writes the hostile input under `inp` and returns the action to try;
    the action writes only to `out`. Expect an error of `error` matching `match`, or (error None)
    a report whose skips include `match` (no match: nothing skipped)."""

    make: object
    error: type | None
    match: str | None


def _convert(src, out, **kw):
    return lambda: convert(src, out, progress=False, **kw)


def _source(inp: Path, extra: dict, classes=("cat", "dog")) -> Path:
    src = class_tree(inp / "src", classes=classes)
    for rel, data in extra.items():
        write(src / rel, data)
    return src


def _bad_file(name, data, **kw):
    return lambda inp, out, fx: _convert(_source(inp, {f"dog/{name}": data}), out, **kw)


def _bytes_named(inp: Path, out: Path, fx, folder: bytes, name: bytes):
    src = class_tree(inp / "src")
    os.makedirs(os.fsencode(src) + b"/" + folder, exist_ok=True)
    for n in (name, b"ok.png"):
        with open(os.fsencode(src) + b"/" + folder + b"/" + n, "wb") as f:
            f.write(image_bytes())
    return _convert(src, out)


def _labels(rows: str):
    def make(inp, out, fx):
        for i in range(4):
            write(inp / "src" / f"{i}.png", image_bytes())
        csv = write(inp / "labels.csv", rows.encode())
        return _convert(inp / "src", out, labels=csv)
    return make


def _same_name(inp, out, fx):
    src = _source(inp, {"cat/x.png": image_bytes(), "dog/x.png": image_bytes()})
    action = _convert(src, out)

    def act():
        report = action()
        assert {"cat/x.png", "dog/x.png"} <= {e.path for e in read_image_directory(out).images}
        return report
    return act


def _link_out(inp, out, fx):
    src = class_tree(inp / "src")
    os.symlink(write(inp / "elsewhere" / "secret.png", image_bytes()), src / "cat" / "out.png")
    return _convert(src, out)


def _train(fx, out, train=None, val=None, model=None, **options):
    cfg = TrainConfig(model=str(model or fx["model"]), train=str(train or fx["data"]["train"]),
                      val=str(val or fx["data"]["val"]), out=str(out),
                      **{"epochs": 1, "image_size": 32, **options})
    return lambda: run(cfg.validate(), ALONE)


def _no_class_folders(inp, out, fx):
    loose = inp / "loose"  # an archive of loose images is an unlabelled image directory...
    for i in range(3):
        write(loose / f"{i}.png", image_bytes())
    archive = make_archive(loose, inp / "loose.zip")
    imgs = inp / "converted"
    convert(archive, imgs, progress=False)
    return _train(fx, out, train=imgs)  # ...which cannot train


def _other_categories(inp, out, fx):
    val = shutil.copytree(fx["data"]["val"], inp / "val")
    doc = json.loads((val / MANIFEST).read_text())
    doc["classes"][-1] = "nine"
    (val / MANIFEST).write_text(json.dumps(doc))
    return _train(fx, out, val=val)


def _scoring_classes_differ(inp, out, fx):
    src = inp / "src"
    for c in ("a", "b"):
        for f in sorted((fx["data"]["raw"] / "val" / "1").iterdir())[:2]:
            write(src / c / f.name, f.read_bytes())
    convert(src, inp / "other", progress=False)
    return lambda: score(fx["trained"], inp / "other", out, progress=False)


CASES = {
    "truncated JPEG": Case(_bad_file("t.jpg", image_bytes("JPEG", size=(64, 64))[:300]), None,
                           "cannot be decoded"),
    "truncated JPEG, --strict": Case(
        _bad_file("t.jpg", image_bytes("JPEG", size=(64, 64))[:300], strict=True),
        InvalidDatasetError, "--strict"),
    "zero-byte file": Case(_bad_file("e.jpg", b""), None, "is empty"),
    "text file named .jpg": Case(_bad_file("n.jpg", b"not an image\n" * 20), None,
                                 "cannot be decoded"),
    "decompression bomb": Case(_bad_file("bomb.png", huge_png(20_000, 20_000)),
                               DecompressionBombError, "400000000 pixels"),
    "zip slip": Case(lambda inp, out, fx: _convert(
        _zip(inp / "x.zip", [("../evil.png", image_bytes(), None)]), out),
        UnsafeArchiveError, "member"),
    "tar slip": Case(lambda inp, out, fx: _convert(
        _tar(inp / "x.tgz", [({"name": "cat/../../evil.png"}, image_bytes())]), out),
        UnsafeArchiveError, "member"),
    "symlink leaving a tar": Case(lambda inp, out, fx: _convert(_tar(inp / "x.tgz", [(
        {"name": "cat/pw.png", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, None)]), out),
        UnsafeArchiveError, "member"),
    "symlink leaving a zip": Case(lambda inp, out, fx: _convert(_zip(inp / "x.zip", [
        ("cat/up.png", b"../../evil.png", 0o120777)]), out), UnsafeArchiveError, "member"),
    "symlink leaving the source folder": Case(_link_out, None, "pointing outside the source"),
    "archive with no class folders": Case(_no_class_folders, NotLabeledDatasetError,
                                          "no labels"),
    "single class": Case(lambda inp, out, fx: _convert(class_tree(inp / "s", classes=("cat",)),
                                                       out), InvalidDatasetError, "single class"),
    "empty class": Case(lambda inp, out, fx: _convert(
        _source(inp, {"eel/notes.txt": b"x"}), out), InvalidDatasetError, "no readable images"),
    "same file name in two classes": Case(_same_name, None, None),
    "non-UTF-8 file name": Case(lambda inp, out, fx: _bytes_named(inp, out, fx, b"cat",
                                                                  b"caf\xe9.png"),
                                None, "file name is not valid UTF-8"),
    "non-UTF-8 class folder": Case(lambda inp, out, fx: _bytes_named(inp, out, fx, b"d\xf6g",
                                                                     b"0.png"),
                                   None, "class folder name is not valid UTF-8"),
    "labels CSV with a missing row": Case(_labels("0.png,cat\n1.png,cat\n2.png,dog\n"), None,
                                          "not listed in the labels file"),
    "labels CSV with an extra row": Case(_labels("0.png,cat\n1.png,cat\n2.png,dog\n3.png,dog\n"
                                                 "4.png,dog\n"), None, "but not found"),
    "labels CSV path leaving the source": Case(_labels("../0.png,cat\n1.png,dog\n"),
                                               InvalidDatasetError, "leaves"),
    "train and val categories differ": Case(_other_categories, InvalidDatasetError,
                                            "categories differ"),
    "untrained model that is not one": Case(
        lambda inp, out, fx: _train(fx, out, model=fx["data"]["train"]),
        InvalidModelDirectoryError, "kfvision model"),
    "trained model, scoring data of other classes": Case(_scoring_classes_differ,
                                                         InvalidDatasetError, "trained on"),
    "learning rate 0": Case(lambda inp, out, fx: _train(fx, out, lr=0.0), InvalidParameterError,
                            "0 < --lr"),
    "batch size 0": Case(lambda inp, out, fx: _train(fx, out, batch_size=0),
                         InvalidParameterError, "1 <= --batch-size"),
    "image size 8": Case(lambda inp, out, fx: _train(fx, out, image_size=8),
                         InvalidParameterError, "32 <= --image-size"),
}


def _tree_digest(root: Path) -> str:
    """sha256 of every name, link target and file under root (bytes names: any encoding)."""
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(os.fsencode(root))):
        for name in sorted(dirs + files):
            p = os.path.join(d, name)
            h.update(p)
            h.update(os.readlink(p) if os.path.islink(p) else
                     b"dir" if os.path.isdir(p) else Path(os.fsdecode(p)).read_bytes())
    return h.hexdigest()


def _try(case: Case, tmp: Path, fx: dict) -> str:
    """Run one case; '' when it behaved, else what went wrong."""
    inp, out = tmp / "in", tmp / "out" / "result"
    inp.mkdir(parents=True)
    out.parent.mkdir()
    action = case.make(inp, out, fx)
    before = _tree_digest(inp)
    try:
        report = action()
    except KfvisionError as e:
        if case.error is None or not isinstance(e, case.error) or case.match not in str(e):
            return f"raised {type(e).__name__}: {e}"
        if e.exit_code != 2:
            return f"exit code {e.exit_code}, not 2"
        if os.listdir(out.parent):
            return f"left {os.listdir(out.parent)} behind"
        outcome = "ok"
    else:
        if case.error is not None:
            return f"no {case.error.__name__}"
        reasons = " | ".join(why for _, why in report.skipped)
        if (case.match or "") not in reasons or (case.match is None and reasons):
            return f"skipped {reasons!r}"
        read_image_directory(out, verify="hash")  # whole and valid
        if os.listdir(out.parent) != ["result"]:
            return f"left {os.listdir(out.parent)} beside the output"
        outcome = "ok"
    if _tree_digest(inp) != before:
        return "changed its input"
    assert not (tmp / "evil.png").exists() and not (tmp.parent / "evil.png").exists()
    return "" if outcome == "ok" else outcome


def test_every_hostile_input_ends_in_a_named_error_or_a_reported_skip(
        tmp_path, tiny_digits, resnet18_dir, trained_tiny, capsys):
    fx = {"data": tiny_digits, "model": resnet18_dir, "trained": trained_tiny}
    problems, lines = {}, []
    for i, (name, case) in enumerate(CASES.items()):
        problem = _try(case, tmp_path / f"case-{i}", fx)
        if problem:
            problems[name] = problem
        what = f"{case.error.__name__}" if case.error else "skipped" if case.match else "kept"
        lines.append(f"  {'FAIL' if problem else 'ok  '} {name:45} {what}")
    with capsys.disabled():  # the count and the table show in every run, not only on failure
        print(f"\nhostile inputs tried: {len(CASES)}, as expected: {len(CASES) - len(problems)}")
        print("\n".join(lines))
    assert problems == {}
    assert len(CASES) >= 25
