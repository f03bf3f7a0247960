"""`kfvision train` with s3:// data, model and output: the node agent as one node on this
machine, against a real S3 API server (moto's, on loopback); the same model as from folders."""

import pytest
from helpers.runs import train_argv

FLAGS = {"epochs": 1, "image_size": 32, "batch_size": 8, "lr": 0.01, "augment": "light",
         "seed": 3, "workers": 0, "print_freq": 100}


@pytest.mark.slow
def test_kfvision_train_reads_and_writes_the_store(tmp_path, s3_bucket, micro_digits,
                                                   resnet18_dir):
    from kfvision.pipelines.cli import main
    from kfvision.pipelines.clients import s3sync

    s3_bucket.upload_folder(micro_digits["train"], "d/train/")
    s3_bucket.upload_folder(micro_digits["val"], "d/val/")
    s3_bucket.upload_folder(resnet18_dir, "m/r18/")
    store = {"train": s3_bucket.uri("d/train"), "val": s3_bucket.uri("d/val")}
    assert main(["train", *train_argv(s3_bucket.uri("m/r18"), store, s3_bucket.uri("runs/a"),
                                      **FLAGS), "--scratch", str(tmp_path / "scratch")]) == 0
    assert main(["train", *train_argv(resnet18_dir, micro_digits, tmp_path / "local",
                                      **FLAGS)]) == 0
    got = s3sync.fetch(s3_bucket.uri("runs/a/"), tmp_path / "fetched", progress=False).path
    assert (got / "weights.pt").read_bytes() == (tmp_path / "local" / "weights.pt").read_bytes()
    assert (tmp_path / "scratch" / "fetch-summary.json").exists()


def test_kfvision_train_refuses_what_is_not_in_the_store(s3_bucket, resnet18_dir, micro_digits,
                                                         capsys):
    from kfvision.pipelines.cli import main

    s3_bucket.upload_folder(resnet18_dir, "m/r18/")
    store = {"train": s3_bucket.uri("nothing/train"), "val": str(micro_digits["val"])}
    assert main(["train", *train_argv(s3_bucket.uri("m/r18"), store, "/tmp/never", **FLAGS)]) \
        == 2
    err = capsys.readouterr().err
    assert "error: InvalidDatasetError: " in err and "kfvision push" in err, err
