"""s3:// sources against a real S3 API server on loopback (moto's, tests/conftest.py): a prefix of
class folders, an archive, a labels CSV, a rerun that downloads nothing, a changed object, a
killed download resumed, and each bad input as one named line with its exit code."""

import io
import json
import tarfile
from pathlib import Path

import pytest

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients import s3, s3download, s3put, s3sync
from kfvision.trainer.data.imagedir import MANIFEST, read_image_directory
from kfvision.trainer.errors import InvalidParameterError


def _convert(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["convert", *map(str, argv), "--quiet"])
    out, err = capsys.readouterr()
    return rc, out, err


def _manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


@pytest.mark.slow  # 3.5-5 s of CPU measured: near the unmarked limit
def test_prefix_of_class_folders_fetched_once_and_referenced(s3_bucket, tiny_digits, tmp_path,
                                                             capsys):
    n = s3_bucket.upload_folder(tiny_digits["raw"] / "train", "digits/train/")
    out = tmp_path / "train"
    rc, text, err = _convert(capsys, s3_bucket.uri("digits/train/"), out)
    assert rc == 0, err
    assert f"downloaded {n} " in text and "wrote 240 images" in text
    doc = _manifest(out)
    assert doc["version"] == 2 and doc["images_root"] == str(tmp_path / "train.fetched")
    assert doc["source"]["uri"] == s3_bucket.uri("digits/train/")
    assert len(doc["source"]["etags"]) == n
    assert len(read_image_directory(out, verify="hash").images) == 240
    # a rerun over the unchanged source downloads nothing
    rc, text, err = _convert(capsys, s3_bucket.uri("digits/train/"), out, "--overwrite")
    assert rc == 0, err
    assert "downloaded 0 (0 bytes)" in text


def test_archive_object(s3_bucket, tiny_digits, tmp_path, capsys):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(tiny_digits["raw"] / "val", arcname="digits")
    s3_bucket.put("archives/digits-val.tar.gz", buf.getvalue())
    out = tmp_path / "val"
    rc, text, err = _convert(capsys, s3_bucket.uri("archives/digits-val.tar.gz"), out,
                             "--extract-to", tmp_path / "place")
    assert rc == 0, err
    doc = _manifest(out)
    assert doc["images_root"] == str(tmp_path / "place" / "images")
    assert doc["source"]["uri"].endswith("digits-val.tar.gz") and doc["source"]["etag"]
    assert len(doc["images"]) == 60
    rc, _, err = _convert(capsys, s3_bucket.uri("archives/digits-val.tar.gz"), out,
                          "--extract-to", tmp_path / "place")  # OUT exists: refused first
    assert rc == 2 and "already exists" in err
    assert read_image_directory(out, verify="hash")  # its extracted images untouched
    rc, text, err = _convert(capsys, s3_bucket.uri("archives/digits-val.tar.gz"), out,
                             "--extract-to", tmp_path / "place", "--overwrite")
    assert rc == 0, err
    assert "downloaded 0 (0 bytes)" in text


def test_flat_images_with_labels_csv_in_s3(s3_bucket, tiny_digits, tmp_path, capsys):
    rows = ["path,label"]
    for p in sorted((tiny_digits["raw"] / "val").rglob("*.png")):
        s3_bucket.put(f"flat/imgs/{p.name}", p.read_bytes())
        rows.append(f"imgs/{p.name},digit{p.parent.name}")
    s3_bucket.put("meta/labels.csv", "\n".join(rows).encode())
    out = tmp_path / "flat"
    rc, text, err = _convert(capsys, s3_bucket.uri("flat/"), out, "--labels",
                             s3_bucket.uri("meta/labels.csv"))
    assert rc == 0, err
    doc = _manifest(out)
    assert doc["classes"] == [f"digit{i}" for i in range(10)] and len(doc["images"]) == 60


def test_changed_object_is_a_changed_dataset_error(s3_bucket, tiny_digits, tmp_path, capsys):
    s3_bucket.upload_folder(tiny_digits["raw"] / "val", "v/")
    out = tmp_path / "val"
    assert _convert(capsys, s3_bucket.uri("v/"), out)[0] == 0
    first = sorted((tiny_digits["raw"] / "val" / "3").iterdir())[0]
    s3_bucket.put(f"v/3/{first.name}", (tiny_digits["raw"] / "val" / "4").iterdir().__next__()
                  .read_bytes())
    rc, _, err = _convert(capsys, s3_bucket.uri("v/"), out, "--overwrite")
    assert rc == 2
    assert err.startswith("error: ChangedDatasetError: ") and f"v/3/{first.name}" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert read_image_directory(out)  # the previous output is untouched


def test_killed_download_resumes_with_only_what_is_missing(s3_bucket, tiny_digits, tmp_path,
                                                           monkeypatch, capsys):
    n = s3_bucket.upload_folder(tiny_digits["raw"] / "val", "v/")
    place, real, done = tmp_path / "place", s3download.download, []

    def killed_after_20(obj, bucket, target, *args, **kwargs):
        if len(done) >= 20:  # a half-written temporary file, then the process dies
            (target.parent / f"{s3.PART}dead-{target.name}").write_bytes(b"\x89PNG half")
            raise KeyboardInterrupt
        done.append(obj.key)
        return real(obj, bucket, target, *args, **kwargs)

    monkeypatch.setattr(s3download, "download", killed_after_20)
    with pytest.raises(KeyboardInterrupt):
        s3sync.fetch(s3_bucket.uri("v/"), place, max_connections=1, progress=False)
    assert list(place.rglob(f"{s3.PART}*"))
    monkeypatch.setattr(s3download, "download", real)
    got = s3sync.fetch(s3_bucket.uri("v/"), place, max_connections=4, progress=False)
    assert (got.objects, got.fetched_objects) == (n, n - 20)
    assert not list(place.rglob(f"{s3.PART}*"))
    assert _convert(capsys, s3_bucket.uri("v/"), tmp_path / "val", "--extract-to", place)[0] == 0
    assert len(_manifest(tmp_path / "val")["images"]) == n


def test_not_an_image_is_skipped_and_listed(s3_bucket, tiny_digits, tmp_path, capsys):
    s3_bucket.upload_folder(tiny_digits["raw"] / "val", "v/")
    s3_bucket.put("v/3/notes.png", b"this is text, not a PNG")
    rc, text, err = _convert(capsys, s3_bucket.uri("v/"), tmp_path / "val")
    assert rc == 0, err
    assert f"{s3_bucket.uri('v/3/notes.png')}: cannot be decoded as an image" in text


@pytest.mark.parametrize("source, name", [
    ("s3://no-such-bucket-kfv/digits/", "NoSuchBucketError"),
    ("{bucket}/nothing-here/", "NoSuchObjectError"),
    ("{bucket}/no-such.tar.gz", "NoSuchObjectError"),
    ("{bucket}/loose.txt", "InvalidDatasetError"),
    ("{bucket}/onlyfiles/", "InvalidDatasetError"),
])
def test_bad_sources_are_one_named_line(s3_bucket, tmp_path, capsys, source, name):
    s3_bucket.put("loose.txt", b"text")
    s3_bucket.put("onlyfiles/readme.md", b"no images")
    out = tmp_path / "out"
    rc, _, err = _convert(capsys, source.format(bucket=s3_bucket.uri().rstrip("/")), out)
    assert rc == 2 and err.startswith(f"error: {name}: ") and err.count("\n") == 1, err
    assert not out.exists()


def test_prefix_with_no_class_folders_is_unlabelled(s3_bucket, tiny_digits, tmp_path, capsys):
    for p in sorted((tiny_digits["raw"] / "val" / "1").iterdir()):
        s3_bucket.put(f"loose/{p.name}", p.read_bytes())
    rc, text, err = _convert(capsys, s3_bucket.uri("loose/"), tmp_path / "u")
    assert rc == 0, err
    assert "UNLABELLED" in text and _manifest(tmp_path / "u")["classes"] == []


def test_unreachable_endpoint_is_69(s3_bucket, tmp_path, capsys, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    s3.reset_clients()
    rc, _, err = _convert(capsys, s3_bucket.uri("d/"), tmp_path / "o")
    assert rc == 69 and err.startswith("error: EndpointUnreachableError: "), err
    assert f"127.0.0.1:{port}" in err and err.count("\n") == 1


def test_no_credentials_is_77(s3_bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3.reset_clients()
    rc, _, err = _convert(capsys, s3_bucket.uri("d/"), tmp_path / "o")
    assert rc == 77 and err.startswith("error: EndpointAuthError: "), err


@pytest.mark.parametrize("code, status", [("ExpiredToken", 400), ("AccessDenied", 403),
                                          ("InvalidAccessKeyId", 403)])
def test_refused_credentials_are_77_and_show_no_secret(s3_bucket, tmp_path, capsys, code,
                                                       status):
    from botocore.stub import Stubber

    # moto's server does not check credentials: the server's answer is stubbed, the mapping
    # and the command's one line are real
    stub = Stubber(s3.client())
    stub.add_client_error("list_objects_v2", service_error_code=code, http_status_code=status,
                          service_message="refused")
    with stub:
        rc, _, err = _convert(capsys, s3_bucket.uri("d/"), tmp_path / "o")
    assert rc == 77 and err.startswith("error: EndpointAuthError: ") and code in err, err
    assert "test-secret-never-shown" not in err


def test_one_fetch_folder_one_source(s3_bucket, tiny_digits, tmp_path):
    s3_bucket.upload_folder(tiny_digits["raw"] / "val" / "1", "a/")
    s3sync.fetch(s3_bucket.uri("a/"), tmp_path / "p", progress=False)
    with pytest.raises(InvalidParameterError, match="holds a fetch of"):
        s3sync.fetch(s3_bucket.uri("b/"), tmp_path / "p", progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not ours")
    with pytest.raises(InvalidParameterError, match="already holds files but no fetch"):
        s3sync.fetch(s3_bucket.uri("a/"), tmp_path / "mine", progress=False)


def test_a_file_over_the_single_put_size_goes_up_in_parts_with_the_etag_push_expects(
        s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(s3put, "SINGLE_PUT", 1000)  # one part: a part may be small when it is last
    data = bytes(range(256)) * 20
    (tmp_path / "big.bin").write_bytes(data)
    s3put.upload(tmp_path / "big.bin", s3_bucket.name, "big/big.bin")
    got = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="big/big.bin")
    assert got["Body"].read() == data
    assert got["ETag"].strip('"') == s3put.local_etag(tmp_path / "big.bin")
    assert s3put.local_etag(tmp_path / "big.bin").endswith("-1")


@pytest.mark.parametrize("text", ["2026-11-26T10:07:57.000Z", "2026-11-26T10:07:57Z",
                                  "Thu, 26 Nov 2026 10:07:57 GMT", "2026-11-26T10:07:57+01:00"])
def test_timestamps_parse_as_botocore_parses_them(text):
    from botocore.utils import parse_timestamp

    assert s3._timestamp(text) == parse_timestamp(text)


def test_a_client_made_again_takes_the_new_endpoint_and_keeps_the_parsed_model(monkeypatch):
    """reset_clients forgets the clients (a new endpoint or credentials), not botocore's parsed
    S3 model: the next client answers to the new endpoint and shares the model of the first."""
    for name, value in (("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b"),
                        ("AWS_ENDPOINT_URL", "http://127.0.0.1:1")):
        monkeypatch.setenv(name, value)
    s3.reset_clients()
    first = s3.client()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    s3.reset_clients()
    again = s3.client()
    assert again is not first and again.meta.endpoint_url == "http://127.0.0.1:2"
    model = again.meta.service_model._service_description  # botocore's parsed JSON
    assert model is first.meta.service_model._service_description
    s3.reset_clients()
