"""`kfvision push DIR s3://...` (an image directory or a model directory) and `kfvision convert
SRC s3://OUT`, end to end against the loopback moto server (tests/conftest.py)."""

import json

import pytest

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients import s3, s3sync
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory


def _manifest(bucket, key: str) -> dict:
    return json.loads(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())


def test_push_says_which_kind_it_pushed(s3_bucket, micro_digits, resnet18_dir, capsys):
    assert main(["push", str(micro_digits["val"]), s3_bucket.uri("data/val"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "pushed the image directory to s3://" in out and "--train/--val" in out
    assert main(["push", str(resnet18_dir), s3_bucket.uri("models/r18/")]) == 0
    assert "pushed the model directory to" in capsys.readouterr().out
    assert main(["push", str(resnet18_dir), s3_bucket.uri("models/r18/")]) == 0  # nothing sent
    assert "0 uploaded" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["folder", "s3"])
def test_convert_into_object_storage(s3_bucket, micro_digits, tmp_path, monkeypatch, capsys,
                                     source):
    monkeypatch.chdir(tmp_path)  # where an s3:// string made a Path would leave "s3:/..."
    src = str(micro_digits["raw"] / "train")
    if source == "s3":
        s3_bucket.upload_folder(micro_digits["raw"] / "train", "raw/train/")
        src = s3_bucket.uri("raw/train/")
    work = tmp_path / "work"
    assert main(["convert", src, s3_bucket.uri("data/train"), "--work", str(work),
                 "--quiet"]) == 0
    assert "pushed the image directory" in capsys.readouterr().out
    assert list(work.iterdir()) == []  # the staging is gone
    assert not (tmp_path / "s3:").exists()
    doc = _manifest(s3_bucket, f"data/train/{MANIFEST}")
    assert doc["version"] == 1 and "images_root" not in doc
    s3sync.fetch(s3_bucket.uri("data/train/"), tmp_path / "back", progress=False)
    back = read_image_directory(tmp_path / "back", verify="hash")
    assert back.classes == read_image_directory(micro_digits["train"]).classes
    assert len(back.images) == len(read_image_directory(micro_digits["train"]).images)


def test_convert_into_a_prefix_that_holds_another_needs_overwrite(s3_bucket, micro_digits,
                                                                  capsys):
    uri = s3_bucket.uri("d/")
    assert main(["push", str(micro_digits["val"]), uri, "--quiet"]) == 0
    src = str(micro_digits["raw"] / "train")
    assert main(["convert", src, uri, "--quiet"]) == 2
    assert "ObjectStoreError" in capsys.readouterr().err
    assert main(["convert", src, uri, "--quiet", "--overwrite"]) == 0


@pytest.mark.parametrize("argv, code, error", [
    (["push", "{empty}", "s3://{bucket}/m/"], 2, "InvalidModelDirectoryError"),
    (["push", "{val}", "s3://nowhere/d/"], 2, "NoSuchBucketError"),
    (["push", "{val}", "{empty}"], 2, "InvalidParameterError"),
    (["convert", "{raw}", "s3://nowhere/d/", "--quiet"], 2, "NoSuchBucketError"),
])
def test_errors_are_one_line_with_their_exit_code(s3_bucket, micro_digits, tmp_path, capsys,
                                                  argv, code, error):
    given = {"empty": str(tmp_path), "bucket": s3_bucket.name, "val": str(micro_digits["val"]),
             "raw": str(micro_digits["raw"] / "train")}
    assert main([a.format(**given) for a in argv]) == code
    err = capsys.readouterr().err
    assert f"error: {error}: " in err and "Traceback" not in err
    assert not any(o.key for o in s3.list_objects(s3_bucket.uri()))
