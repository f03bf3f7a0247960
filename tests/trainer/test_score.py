"""kfvision score: the table's columns and values."""

import csv

import pytest

from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.errors import InvalidDatasetError, InvalidModelDirectoryError
from kfvision.trainer.use.score import score


def test_scored_table_has_one_row_per_image_and_a_probability_per_class(trained_tiny,
                                                                         tiny_digits, tmp_path):
    out = tmp_path / "scored.csv"
    result = score(trained_tiny, tiny_digits["val"], out, progress=False)
    rows = list(csv.DictReader(out.open()))
    imdir = read_image_directory(tiny_digits["val"])
    classes = list(imdir.classes)
    assert list(rows[0]) == (["image", "label", "scored_label"]
                             + [f"scored_probability_{c}" for c in classes])
    assert [r["image"] for r in rows] == [e.path for e in imdir.images]
    assert result["rows"] == len(rows) == len(imdir.images)
    for r in rows:
        probs = [float(r[f"scored_probability_{c}"]) for c in classes]
        assert sum(probs) == pytest.approx(1.0, abs=1e-4)
        assert r["scored_label"] == classes[max(range(len(probs)), key=probs.__getitem__)]
        assert r["label"] == r["image"].split("/")[0]
    hits = sum(r["label"] == r["scored_label"] for r in rows)
    assert result["accuracy"] == pytest.approx(hits / len(rows))


def test_unlabelled_directory_is_scored_without_a_label_column(trained_tiny, tiny_digits,
                                                               tmp_path):
    from kfvision.trainer.data.convert import convert

    loose = tmp_path / "loose"
    loose.mkdir()
    for f in sorted((tiny_digits["raw"] / "val" / "3").iterdir())[:4]:
        (loose / f.name).write_bytes(f.read_bytes())
    convert(loose, tmp_path / "unlabelled", progress=False)
    out = tmp_path / "scored.csv"
    result = score(trained_tiny, tmp_path / "unlabelled", out, progress=False)
    rows = list(csv.DictReader(out.open()))
    assert "label" not in rows[0] and len(rows) == 4 and result["accuracy"] is None


def test_score_refuses_data_with_other_classes(trained_tiny, tmp_path, tiny_digits):
    from kfvision.trainer.data.convert import convert

    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for f in sorted((tiny_digits["raw"] / "val" / "1").iterdir())[:2]:
            (src / c / f.name).write_bytes(f.read_bytes())
    convert(src, tmp_path / "other", progress=False)
    with pytest.raises(InvalidDatasetError, match="trained on"):
        score(trained_tiny, tmp_path / "other", tmp_path / "x.csv", progress=False)
    assert not (tmp_path / "x.csv").exists()


def test_score_refuses_an_untrained_model_directory(resnet18_dir, tiny_digits, tmp_path):
    with pytest.raises(InvalidModelDirectoryError, match="not a trained model directory but an "
                       rf"untrained one .* `kfvision train --model {resnet18_dir} --train TRAIN"):
        score(resnet18_dir, tiny_digits["val"], tmp_path / "x.csv", progress=False)


def test_dct_scaling_scores_large_jpegs_as_the_full_decode_does(trained_tiny, digits_640,
                                                               tmp_path):
    # 640 px JPEGs: the model's 32 px resize lets libjpeg decode them at 1/8
    tables = {}
    for dct in (True, False):
        score(trained_tiny, digits_640, tmp_path / f"{dct}.csv", progress=False,
              dct_scaling=dct)
        tables[dct] = list(csv.DictReader((tmp_path / f"{dct}.csv").open()))
    probs = {dct: [[float(v) for k, v in r.items() if k.startswith("scored_probability_")]
                   for r in rows] for dct, rows in tables.items()}
    assert [r["image"] for r in tables[True]] == [r["image"] for r in tables[False]]
    assert probs[True] != probs[False]  # the decode did change
    worst = max(abs(a - b) for pa, pb in zip(probs[True], probs[False]) for a, b in zip(pa, pb))
    same = sum(a["scored_label"] == b["scored_label"] for a, b in zip(*tables.values()))
    assert worst < 0.1 and same >= 0.95 * len(tables[True]), (worst, same)
