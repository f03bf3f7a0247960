"""Models out to s3:// and back: `kfvision push`, then score/export with `--model s3://...`
(fetched once into a cache keyed by ETag), and the InferenceService `deploy render` writes for
an s3:// model (no PVC; KServe's service account)."""

import csv

import pytest
import yaml

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients import s3, s3download
from kfvision.pipelines.clients.models import resolve_model


def test_model_pushed_then_scored_back_from_the_cache(s3_bucket, trained_tiny, tiny_digits,
                                                      tmp_path, capsys, monkeypatch):
    uri = s3_bucket.uri("models/digits/")
    assert main(["push", str(trained_tiny), uri]) == 0
    keys = {o.key for o in s3.list_objects(uri)}
    assert "models/digits/model.json" in keys and "models/digits/weights.pt" in keys
    assert not any("/checkpoints/" in k for k in keys)
    assert main(["push", str(trained_tiny), uri]) == 0  # a second push sends nothing
    assert "0 uploaded" in capsys.readouterr().out

    local = tmp_path / "local.csv"
    assert main(["score", "--model", str(trained_tiny), "--data", str(tiny_digits["val"]),
                 "--out", str(local), "--quiet"]) == 0
    remote = tmp_path / "remote.csv"
    assert main(["score", "--model", uri, "--data", str(tiny_digits["val"]), "--out",
                 str(remote), "--quiet"]) == 0
    assert list(csv.reader(local.open())) == list(csv.reader(remote.open()))

    def no_download(*a, **k):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(s3download, "download", no_download)  # the cache is keyed by the ETags
    assert resolve_model(uri) == resolve_model(uri.rstrip("/"))
    monkeypatch.undo()
    s3_bucket.put("models/digits/metrics.json", b"{}")  # a changed model: a new cache folder
    assert main(["push", str(trained_tiny), uri]) == 2  # another model there: refused
    assert "already holds another model directory" in capsys.readouterr().err
    assert main(["push", str(trained_tiny), uri, "--overwrite"]) == 0
    assert (resolve_model(uri) / "model.json").is_file()


def test_push_refuses_what_is_not_a_model(s3_bucket, tmp_path, capsys):
    assert main(["push", str(tmp_path), s3_bucket.uri("m/")]) == 2
    assert "InvalidModelDirectoryError" in capsys.readouterr().err


def test_no_model_at_the_uri_is_one_line(s3_bucket, tiny_digits, tmp_path, capsys):
    rc = main(["score", "--model", s3_bucket.uri("models/none/"), "--data",
               str(tiny_digits["val"]), "--out", str(tmp_path / "s.csv"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: NoSuchObjectError: " in err and "Traceback" not in err


@pytest.mark.parametrize("service_account", [None, "kfvision-s3"])
def test_deploy_render_of_an_s3_model_needs_no_pvc(tmp_path, capsys, service_account):
    argv = ["deploy", "render", "--model", "s3://bkt/models/digits/", "--name", "digits",
            "--image", "registry.example.com/kfvision:1"]
    if service_account:
        argv += ["--service-account", service_account]
    assert main(argv) == 0
    isvc = yaml.safe_load(capsys.readouterr().out)
    predictor = isvc["spec"]["predictor"]
    env = {e["name"]: e.get("value") for e in predictor["containers"][0]["env"]}
    assert env["STORAGE_URI"] == "s3://bkt/models/digits/"
    assert "persistentVolumeClaim" not in yaml.safe_dump(isvc)
    assert predictor.get("serviceAccountName") == service_account
