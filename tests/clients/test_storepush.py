"""Image directories and models into object storage (pipelines/clients/storepush.py), against
the loopback moto server (tests/conftest.py): the layout in the store, the manifest last and as
version 1, a resumed push sending only what is missing, refusals, and a flaky store
(tests/helpers/s3proxy.py)."""

import dataclasses
import json
import shutil

import pytest
from helpers.s3proxy import FaultProxy, Rule
from kfvision.pipelines.clients import s3, s3put, s3sync, storepush
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory
from kfvision.trainer.errors import InvalidDatasetError, InvalidModelDirectoryError


@pytest.fixture
def uploads(monkeypatch) -> list:
    """The keys s3put.upload is asked to write, in the order it finishes them."""
    done, real = [], s3put.upload

    def upload(path, bucket, key, max_connections=s3.DEFAULT_CONNECTIONS):
        real(path, bucket, key, max_connections)
        done.append(key)

    monkeypatch.setattr(s3put, "upload", upload)
    return done


def _fetched(uri: str, folder):
    """The image directory at `uri`, fetched into `folder` and read (every sha256 checked)."""
    s3sync.fetch(uri, folder, progress=False)
    return read_image_directory(folder, verify="hash")


def _same_directory(got, want) -> None:
    assert got.classes == want.classes and got.images == want.images
    for e in want.images:
        assert got.file(e).read_bytes() == want.file(e).read_bytes()


def test_round_trip_manifest_last(s3_bucket, micro_digits, tmp_path, uploads):
    uri = s3_bucket.uri("data/train")  # no trailing "/": the same prefix
    pushed = storepush.push_image_directory(micro_digits["train"], uri, progress=False)
    want = read_image_directory(micro_digits["train"])
    assert (pushed.objects, pushed.skipped) == (len(want.images) + 1, 0)
    assert pushed.bytes > sum(e.bytes for e in want.images)  # and the manifest
    assert uploads[-1] == f"data/train/{MANIFEST}" and len(uploads) == pushed.objects
    _same_directory(_fetched(uri + "/", tmp_path / "back"), want)


def test_a_referenced_directory_goes_up_as_version_1(s3_bucket, micro_digits, tmp_path):
    ref = tmp_path / "ref"
    convert(micro_digits["raw"] / "train", ref, in_place=True, progress=False)
    local = read_image_directory(ref)
    assert local.referenced and not any(ref.glob("*/"))  # the manifest only
    storepush.push_image_directory(ref, s3_bucket.uri("ref/"), progress=False)
    doc = json.loads(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"ref/{MANIFEST}")
                     ["Body"].read())
    assert doc["version"] == 1 and "images_root" not in doc
    assert doc["classes"] == list(local.classes)
    back = _fetched(s3_bucket.uri("ref/"), tmp_path / "back")
    assert not back.referenced
    _same_directory(back, local)


def test_a_resumed_push_sends_only_what_is_missing(s3_bucket, micro_digits, uploads):
    uri = s3_bucket.uri("d/")
    first = storepush.push_image_directory(micro_digits["train"], uri, progress=False)
    gone = sorted(uploads)[:3] + [f"d/{MANIFEST}"]  # as a push stopped before its end left it
    s3_bucket.client.delete_objects(Bucket=s3_bucket.name,
                                    Delete={"Objects": [{"Key": k} for k in gone]})
    uploads.clear()
    again = storepush.push_image_directory(micro_digits["train"], uri, progress=False)
    assert sorted(uploads) == sorted(gone) and uploads[-1] == f"d/{MANIFEST}"
    assert (again.objects, again.skipped) == (first.objects, first.objects - len(gone))
    uploads.clear()
    assert storepush.push_image_directory(micro_digits["train"], uri).skipped == first.objects
    assert uploads == []


def test_another_directory_under_the_prefix_is_refused_unless_overwrite(
        s3_bucket, micro_digits, tiny_digits, uploads):
    uri = s3_bucket.uri("d/")
    storepush.push_image_directory(micro_digits["train"], uri, progress=False)
    with pytest.raises(s3.ObjectStoreError, match="already holds another image directory"):
        storepush.push_image_directory(micro_digits["val"], uri, progress=False)
    pushed = storepush.push_image_directory(micro_digits["val"], uri, progress=False,
                                            overwrite=True)
    assert pushed.deleted > 0  # the train images the val directory does not have
    keys = {o.key[2:] for o in s3.list_objects(uri)}
    val = read_image_directory(micro_digits["val"])
    assert keys == {e.path for e in val.images} | {MANIFEST}


def test_other_objects_without_a_manifest_are_refused(s3_bucket, micro_digits):
    s3_bucket.put("d/notes.txt", b"not an image directory's")
    with pytest.raises(s3.ObjectStoreError, match=r"1 object\(s\) that are not .*notes.txt"):
        storepush.push_image_directory(micro_digits["train"], s3_bucket.uri("d/"))


def test_the_pack_goes_up_when_it_is_up_to_date(s3_bucket, micro_digits, tmp_path):
    from kfvision.trainer.data.pack import INDEX, PIXELS, StalePackWarning, write_pack

    folder = tmp_path / "train"
    shutil.copytree(micro_digits["train"], folder)
    write_pack(folder, progress=False)
    storepush.push_image_directory(folder, s3_bucket.uri("p/"), progress=False)
    keys = {o.key for o in s3.list_objects(s3_bucket.uri("p/"))}
    assert {f"p/{PIXELS}", f"p/{INDEX}"} <= keys
    (folder / INDEX).write_text("{}")  # stale: ignored, and said
    with pytest.warns(StalePackWarning, match="not pushing the pack"):
        storepush.push_image_directory(folder, s3_bucket.uri("q/"), progress=False)
    assert not any("kfvision-pack" in o.key for o in s3.list_objects(s3_bucket.uri("q/")))


def test_a_model_goes_up_spec_last_without_checkpoints(s3_bucket, resnet18_dir, tmp_path,
                                                       uploads):
    model = tmp_path / "m"
    shutil.copytree(resnet18_dir, model)
    (model / "model.json").write_text("{}")
    (model / "checkpoints").mkdir()
    (model / "checkpoints" / "last.pt").write_bytes(b"x")
    (model / "metrics.json").write_text("{}")
    pushed = storepush.push_model(model, s3_bucket.uri("models/r18"), progress=False)
    assert uploads[-2:] == ["models/r18/model.json", "models/r18/spec.json"]
    assert sorted(uploads) == sorted(f"models/r18/{p.name}" for p in model.iterdir()
                                     if p.is_file())
    assert pushed.objects == len(uploads) and pushed.what == "model directory"


def test_what_is_not_a_directory_of_either_kind(s3_bucket, tmp_path):
    with pytest.raises(InvalidModelDirectoryError, match="no spec.json.*kfvision model"):
        storepush.push_model(tmp_path, s3_bucket.uri("m/"))
    with pytest.raises(InvalidDatasetError, match="not a kfvision image directory"):
        storepush.push_image_directory(tmp_path, s3_bucket.uri("m/"))


def test_no_such_bucket(s3_bucket, micro_digits):
    with pytest.raises(s3.NoSuchBucketError, match="no bucket 'nowhere'"):
        storepush.push_image_directory(micro_digits["train"], "s3://nowhere/d/")


def test_a_large_file_in_parts_is_skipped_when_already_there(s3_bucket, tmp_path, uploads):
    """A file over the single-PUT size goes up in parts; its ETag is then the parts' (MD5 of
    MD5s), which local_etag computes the same."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "spec.json").write_text("{}")
    (model / "weights.pt").write_bytes(bytes(range(256)) * ((s3put.SINGLE_PUT + 4096) // 256))
    storepush.push_model(model, s3_bucket.uri("big/"), progress=False)
    listed = {o.key: o.etag for o in s3.list_objects(s3_bucket.uri("big/"))}
    assert "-" in listed["big/weights.pt"]
    assert listed["big/weights.pt"] == s3put.local_etag(model / "weights.pt")
    uploads.clear()
    assert storepush.push_model(model, s3_bucket.uri("big/")).skipped == 2 and uploads == []


def test_a_flaky_store_then_a_rerun_completes_it(s3_bucket, micro_digits, tmp_path,
                                                 monkeypatch):
    from helpers.s3bucket import FAST_RETRIES

    with FaultProxy(s3_bucket.endpoint, seed=1, stall_s=1.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3.set_retry_policy(dataclasses.replace(FAST_RETRIES, attempts=2))
        try:
            uri = s3_bucket.uri("flaky/")
            proxy.rule = Rule(rate=1.0, methods={"PUT"}, kinds=("reset",), path=r"/flaky/3/")
            with pytest.raises(s3.ObjectTransferError):
                storepush.push_image_directory(micro_digits["train"], uri, progress=False)
            keys = {o.key for o in s3.list_objects(uri)}
            assert keys and f"flaky/{MANIFEST}" not in keys  # not complete: no manifest
            proxy.rule = Rule(rate=0.3, methods={"PUT"}, kinds=("slowdown", "truncate"))
            s3.set_retry_policy(FAST_RETRIES)
            again = storepush.push_image_directory(micro_digits["train"], uri, progress=False)
            assert again.skipped >= len(keys) - 1
            assert proxy.faults["slowdown"] + proxy.faults["truncate"] > 0, proxy.faults
        finally:
            s3.set_retry_policy(FAST_RETRIES)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket.endpoint)  # the server itself again
    s3.reset_clients()
    _same_directory(_fetched(uri, tmp_path / "back"), read_image_directory(micro_digits["train"]))
