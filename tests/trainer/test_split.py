"""kfvision split: stratified, reproducible, both sides with every class, atomic."""

import shutil

import pytest
from helpers.imagefiles import class_tree, leftovers

from kfvision.pipelines.cli import main
from kfvision.trainer.data.imagedir import check_same_classes, read_image_directory
from kfvision.trainer.data.split import split
from kfvision.trainer.errors import InvalidDatasetError, InvalidParameterError


def paths(d) -> set:
    return {e.path for e in read_image_directory(d, verify="hash").images}


@pytest.mark.parametrize("fraction", [0.9, 0.5, 0.75, 0.1])
def test_each_class_is_split_by_the_fraction(tiny_digits, tmp_path, fraction):
    src = read_image_directory(tiny_digits["train"])  # 24 images per class
    counts = split(src.root, tmp_path / "a", tmp_path / "b", fraction=fraction, seed=1)
    a, b = read_image_directory(tmp_path / "a"), read_image_directory(tmp_path / "b")
    check_same_classes(a, b)
    want = {c: min(max(round(fraction * n), 1), n - 1) for c, n in src.class_counts().items()}
    assert a.class_counts() == want == counts["first"]
    assert b.class_counts() == {c: n - want[c] for c, n in src.class_counts().items()}
    assert paths(tmp_path / "a").isdisjoint(paths(tmp_path / "b"))
    assert paths(tmp_path / "a") | paths(tmp_path / "b") == {e.path for e in src.images}


def test_same_seed_same_split_other_seed_other_split(tiny_digits, tmp_path):
    for name, seed in (("x", 1), ("y", 1), ("z", 2)):
        split(tiny_digits["train"], tmp_path / name / "a", tmp_path / name / "b", seed=seed)
    assert paths(tmp_path / "x" / "a") == paths(tmp_path / "y" / "a")
    assert paths(tmp_path / "x" / "a") != paths(tmp_path / "z" / "a")


def test_adding_images_does_not_move_the_others(tmp_path):
    from kfvision.trainer.data.convert import convert

    src = class_tree(tmp_path / "src", per_class=20)
    convert(src, tmp_path / "d1", progress=False)
    split(tmp_path / "d1", tmp_path / "a1", tmp_path / "b1", fraction=0.5)
    class_tree(tmp_path / "more", per_class=4)
    for f in (tmp_path / "more").rglob("*.png"):
        shutil.copy(f, src / f.parent.name / f"new_{f.name}")
    convert(src, tmp_path / "d2", progress=False)
    split(tmp_path / "d2", tmp_path / "a2", tmp_path / "b2", fraction=0.5)
    old_in_b2 = {p for p in paths(tmp_path / "b2") if "new_" not in p}
    moved = paths(tmp_path / "a1") & old_in_b2
    assert len(moved) <= 2  # at most the rounding step of each class, not a reshuffle


def test_unlabelled_directories_split_as_one_group(tmp_path):
    from kfvision.trainer.data.convert import convert

    for f in class_tree(tmp_path / "tree", per_class=5, classes=("x",)).rglob("*.png"):
        shutil.move(f, tmp_path / "tree")
    shutil.rmtree(tmp_path / "tree" / "x")
    convert(tmp_path / "tree", tmp_path / "u", progress=False)
    counts = split(tmp_path / "u", tmp_path / "a", tmp_path / "b", fraction=0.6)
    assert counts == {"first": {"(unlabelled)": 3}, "second": {"(unlabelled)": 2}}
    assert not read_image_directory(tmp_path / "a").labelled


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5, float("nan")])
def test_fraction_must_be_between_0_and_1(tiny_digits, tmp_path, fraction):
    with pytest.raises(InvalidParameterError, match="0 < fraction < 1"):
        split(tiny_digits["train"], tmp_path / "a", tmp_path / "b", fraction=fraction)


def test_a_class_with_one_image_cannot_be_split_and_nothing_is_written(tmp_path):
    from kfvision.trainer.data.convert import convert

    src = class_tree(tmp_path / "src", per_class=3)
    for f in list((src / "dog").iterdir())[1:]:
        f.unlink()
    convert(src, tmp_path / "d", progress=False)
    with pytest.raises(InvalidDatasetError, match="class 'dog' has 1 image"):
        split(tmp_path / "d", tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert leftovers(tmp_path) == []


def test_outputs_must_be_new_and_separate(tiny_digits, tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(InvalidDatasetError, match="already exists"):
        split(tiny_digits["train"], tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "b").exists()
    split(tiny_digits["train"], tmp_path / "a", tmp_path / "b", overwrite=True)
    assert read_image_directory(tmp_path / "a").labelled
    with pytest.raises(InvalidDatasetError, match="overlap"):
        split(tiny_digits["train"], tmp_path / "c", tmp_path / "c" / "d")
    with pytest.raises(InvalidDatasetError, match="overlaps the input"):
        split(tiny_digits["train"], tiny_digits["train"] / "x", tmp_path / "e")


def test_input_must_be_an_image_directory(tmp_path):
    with pytest.raises(InvalidDatasetError, match="not a folder"):
        split(tmp_path / "nope", tmp_path / "a", tmp_path / "b")


def test_cli_split(tiny_digits, tmp_path, capsys):
    argv = ["split", str(tiny_digits["train"]), str(tmp_path / "t"), str(tmp_path / "v"),
            "--fraction", "0.75", "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"wrote 180 images to {tmp_path / 't'}" in out and "0: 18" in out
    assert f"wrote 60 images to {tmp_path / 'v'}" in out
    assert main(argv) == 2 and "already exists" in capsys.readouterr().err
