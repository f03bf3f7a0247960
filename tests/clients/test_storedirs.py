"""pipelines/clients/storedirs.py against a real S3 API server (moto's, on loopback): the image
and model directories a job reads from the store are found, parsed by the trainer's own parsers,
and a missing or broken one is the named error that says how to push one."""

import json

import pytest

from kfvision.pipelines.clients import storedirs
from kfvision.pipelines.clients.s3 import NoSuchBucketError
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory
from kfvision.trainer.errors import InvalidDatasetError, InvalidModelDirectoryError
from kfvision.trainer.model.spec import SPEC_FILE, read_model_spec


def test_an_image_directory_in_the_store_is_the_one_pushed(s3_bucket, micro_digits):
    s3_bucket.upload_folder(micro_digits["train"], "data/train/")
    local = read_image_directory(micro_digits["train"])
    for uri in (s3_bucket.uri("data/train"), s3_bucket.uri("data/train/")):
        imdir = storedirs.image_directory_at(uri)
        assert imdir.root == s3_bucket.uri("data/train")
        assert (imdir.classes, imdir.images) == (local.classes, local.images)
        assert not imdir.referenced


def test_no_image_directory_says_how_to_push_one(s3_bucket, micro_digits):
    s3_bucket.upload_folder(micro_digits["train"], "data/train/")
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=f"data/train/{MANIFEST}")
    uri = s3_bucket.uri("data/train")
    with pytest.raises(InvalidDatasetError) as e:
        storedirs.image_directory_at(uri)
    assert e.value.exit_code == 2
    assert uri in str(e.value)
    assert f"kfvision push DIR {uri}" in str(e.value)
    assert f"kfvision convert SRC {uri}" in str(e.value)


@pytest.mark.parametrize("doc,message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"format": "kfvision.image-directory", "version": 2, "classes": ["a"],
                 "images_root": "/home/me/imgs",
                 "images": [{"path": "a/1.png", "label": 0, "bytes": 1, "sha256": "x",
                             "width": 1, "height": 1}]}), "referenced image directory"),
    (json.dumps({"format": "kfvision.image-directory", "version": 1, "classes": ["a"],
                 "images": []}), "holds no images"),
])
def test_a_broken_manifest_is_refused_by_the_trainers_parser(s3_bucket, doc, message):
    s3_bucket.put(f"d/{MANIFEST}", doc.encode())
    with pytest.raises(InvalidDatasetError, match=message) as e:
        storedirs.image_directory_at(s3_bucket.uri("d"))
    assert s3_bucket.uri("d") in str(e.value)


def test_a_model_directory_in_the_store_is_the_one_pushed(s3_bucket, resnet18_dir):
    s3_bucket.upload_folder(resnet18_dir, "models/r18/")
    assert storedirs.model_at(s3_bucket.uri("models/r18")) == read_model_spec(resnet18_dir)


def test_no_model_directory_or_its_weights_missing_is_named(s3_bucket, resnet18_dir):
    uri = s3_bucket.uri("models/none")
    with pytest.raises(InvalidModelDirectoryError) as e:
        storedirs.model_at(uri)
    assert uri in str(e.value) and f"kfvision push DIR {uri}" in str(e.value)
    spec = json.loads((resnet18_dir / SPEC_FILE).read_text())
    s3_bucket.put(f"models/w/{SPEC_FILE}", json.dumps({**spec, "weights": "w.pt"}).encode())
    with pytest.raises(InvalidModelDirectoryError, match="names weights 'w.pt'"):
        storedirs.model_at(s3_bucket.uri("models/w"))
    s3_bucket.put(f"models/bad/{SPEC_FILE}", json.dumps({**spec, "arch": "nope"}).encode())
    with pytest.raises(InvalidModelDirectoryError, match="unknown architecture"):
        storedirs.model_at(s3_bucket.uri("models/bad"))


def test_no_bucket_is_its_own_error(s3_bucket):
    with pytest.raises(NoSuchBucketError, match="no bucket 'not-there'"):
        storedirs.image_directory_at("s3://not-there/data/train")
