"""`kfvision register` into MLflow's registry (a real `mlflow server` on loopback) and using a
registered model as `models:/NAME/VERSION`: idempotent by content, named errors, the same labels
as the directory."""

import csv

import pytest

from pipelines import registry
from pipelines.cli import main as cli
from pipelines.connect import EndpointUnreachableError
from trainer.errors import InvalidModelDirectoryError, InvalidParameterError


def test_registering_twice_makes_one_version(mlflow_server, trained_tiny, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    assert cli(["register", "--model", str(trained_tiny), "--name", "twice"]) == 0
    assert "registered: twice version 1" in capsys.readouterr().out
    assert cli(["register", "--model", str(trained_tiny), "--name", "twice"]) == 0
    assert "already registered (same content): twice version 1" in capsys.readouterr().out
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    (version,) = client.search_model_versions("name='twice'")
    assert version.tags[registry.HASH_TAG] == registry.content_hash(trained_tiny)
    assert version.tags["kfvision.image_size"] == "32"
    assert "kfvision.val_top1" in version.tags and "kfvision.classes" in version.tags


def test_a_registered_model_scores_like_its_directory(mlflow_server, trained_tiny, tiny_digits,
                                                      tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    got = registry.register_mlflow(trained_tiny, "scored")
    uri = f"models:/scored/{got['version']}"
    for model, out in ((str(trained_tiny), "dir.csv"), (uri, "registered.csv"),
                       (uri, "again.csv")):  # the second time from the cache
        assert cli(["score", "--model", model, "--data", str(tiny_digits["val"]), "--out",
                    str(tmp_path / out), "--quiet"]) == 0
    labels = [[r["scored_label"] for r in csv.DictReader((tmp_path / name).open())]
              for name in ("dir.csv", "registered.csv", "again.csv")]
    assert labels[0] == labels[1] == labels[2]
    cached = tmp_path / "cache" / "kfvision" / "models" / "scored" / got["version"]
    assert (cached / "weights.pt").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--name", "bad name!"], "is not a model name"),
    (["--name", "ok", "--registry", "azure"], "is not one of: mlflow, kubeflow"),
    (["--name", "ok", "--registry", "kubeflow"], "needs --registry-url"),
])
def test_bad_names_and_registries_are_named_errors(argv, message, trained_tiny, capsys):
    assert cli(["register", "--model", str(trained_tiny), *argv]) == 2
    err = capsys.readouterr().err
    assert "InvalidParameterError" in err and message in err


def test_an_unreachable_registry_is_exit_69(trained_tiny, monkeypatch, capsys):
    from conftest import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(EndpointUnreachableError):
        registry.register_mlflow(trained_tiny, "x",
                                 tracking_uri=f"http://127.0.0.1:{free_port()}")


def test_not_a_model_directory_and_bad_uris_are_named(tmp_path):
    with pytest.raises(InvalidModelDirectoryError):
        registry.describe_model(tmp_path)
    with pytest.raises(InvalidParameterError, match="models:/NAME/VERSION"):
        registry.resolve_model("models:/digits", tracking_uri="http://127.0.0.1:1")
    assert registry.resolve_model(tmp_path) == tmp_path
