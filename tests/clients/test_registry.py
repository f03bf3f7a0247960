"""`kfvision register` into MLflow's registry (a real `mlflow server` on loopback) and using a
registered model as `models:/NAME/VERSION`: idempotent by content, named errors, the same labels
as the directory."""

import csv
import json

import pytest

from kfvision.pipelines.cli import main as cli
from kfvision.pipelines.clients import registry
from kfvision.pipelines.clients.endpoints import EndpointUnreachableError, free_port
from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError


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
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(EndpointUnreachableError):
        registry.register_mlflow(trained_tiny, "x",
                                 tracking_uri=f"http://127.0.0.1:{free_port()}")


def test_not_a_model_directory_and_bad_uris_are_named(tmp_path):
    with pytest.raises(InvalidModelDirectoryError):
        registry.describe_model(tmp_path)
    with pytest.raises(InvalidParameterError, match="models:/NAME/VERSION"):
        registry.fetch_mlflow_version("models:/digits", tracking_uri="http://127.0.0.1:1",
                                      cache=tmp_path)


def test_kubeflow_registry_gets_model_version_and_artifact_once(fake_registry, trained_tiny,
                                                                capsys):
    argv = ["register", "--model", str(trained_tiny), "--name", "digits", "--registry",
            "kubeflow", "--registry-url", fake_registry.url, "--storage-uri",
            "pvc://kfvision-data/models/digits", "--author", "ci"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "registered: digits version sha256-" in out and "model-registry://digits/" in out
    assert cli(argv) == 0
    assert "already registered (same content)" in capsys.readouterr().out
    assert all(path is not None for _, path in fake_registry.calls)  # every call is in the spec
    (model,) = fake_registry.of("RegisteredModel")
    (version,) = fake_registry.of("ModelVersion")
    (artifact,) = fake_registry.of("ModelArtifact")
    assert version["registeredModelId"] == model["id"]
    assert version["name"] == "sha256-" + registry.content_hash(trained_tiny)[:16]
    assert artifact["uri"] == "pvc://kfvision-data/models/digits"
    assert (artifact["modelFormatName"], artifact["modelFormatVersion"]) == ("kfvision", "1")
    props = version["customProperties"]
    assert props["image_size"]["int_value"] == "32" and "val_top1" in props


def test_kubeflow_registry_needs_a_storage_uri_kserve_can_read(trained_tiny):
    with pytest.raises(InvalidParameterError, match="s3://BUCKET/PATH or pvc://CLAIM/PATH"):
        registry.register_kubeflow(trained_tiny, "d", storage_uri=str(trained_tiny),
                                   url="http://127.0.0.1:1", author="ci")


def test_deploy_render_takes_registered_versions(mlflow_server, monkeypatch, capsys):
    """models:/ becomes the version's storage URI; model-registry:// goes to KServe as it is."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    client.create_registered_model("deployed")
    s3 = client.create_model_version("deployed", "s3://models/digits").version
    run = client.create_run(client.create_experiment("deployed")).info
    local = client.create_model_version("deployed", f"{run.artifact_uri}/m",
                                        run_id=run.run_id).version  # mlflow-artifacts:/...
    base = ["deploy", "render", "--name", "digits", "--image", "registry.example.com/kfv:1"]
    for model, uri in ((f"models:/deployed/{s3}", "s3://models/digits"),
                       ("model-registry://digits/sha256-0123", "model-registry://digits/sha256-0123")):
        assert cli([*base, "--model", model]) == 0
        assert f"value: {uri}" in capsys.readouterr().out
    assert cli([*base, "--model", f"models:/deployed/{local}"]) == 2
    assert "RegistryError" in capsys.readouterr().err


def _evaluation(tmp_path, accuracy: float):
    """An evaluate-model step's output folder: metrics.json with this accuracy."""
    evaluation = tmp_path / "evaluation"
    evaluation.mkdir()
    (evaluation / "metrics.json").write_text(json.dumps({"accuracy": accuracy}))
    return evaluation


def test_the_register_step_gates_on_accuracy_and_mlflow_then_registers_once(
        mlflow_server, trained_tiny, tmp_path, capsys):
    from kfvision.pipelines.flow.steps.register import register_step

    evaluation = _evaluation(tmp_path, accuracy=0.5)
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": "steps"}
    low = register_step(trained_tiny, evaluation, name="gated", min_accuracy=0.9, environ=env)
    assert not low["registered"] and "below register_min_accuracy" in low["reason"]
    unnamed = register_step(trained_tiny, evaluation, name="", min_accuracy=0.0, environ=env)
    assert not unnamed["registered"] and "register_name is empty" in unnamed["reason"]
    off = register_step(trained_tiny, evaluation, name="gated", min_accuracy=0.0, environ={})
    assert not off["registered"] and "MLFLOW_TRACKING_URI is not set" in off["reason"]
    first = register_step(trained_tiny, evaluation, name="gated", min_accuracy=0.4, environ=env,
                          pipeline_run="run-1")
    again = register_step(trained_tiny, evaluation, name="gated", min_accuracy=0.4, environ=env)
    assert first["registered"] and first["version"] == again["version"] == "1"
    assert "already registered (same content): models:/gated/1" in capsys.readouterr().out


def test_the_register_step_registers_into_the_kubeflow_registry_with_registry_kubeflow(
        fake_registry, trained_tiny, tmp_path, capsys):
    from kfvision.pipelines.flow.steps.register import register_step

    evaluation = _evaluation(tmp_path, accuracy=0.5)
    env = {"KFVISION_REGISTRY_URL": fake_registry.url}
    no_uri = register_step(trained_tiny, evaluation, name="digits", min_accuracy=0.0,
                           environ=env, registry="kubeflow")
    assert not no_uri["registered"] and "model_uri" in no_uri["reason"]
    got = register_step(trained_tiny, evaluation, name="digits", min_accuracy=0.0, environ=env,
                        registry="kubeflow", storage_uri="s3://models/digits/",
                        pipeline_run="run-1", out_dir=tmp_path / "r")
    version = "sha256-" + registry.content_hash(trained_tiny)[:16]
    assert got["uri"] == f"model-registry://digits/{version}" and got["registered"]
    (artifact,) = fake_registry.of("ModelArtifact")
    assert artifact["uri"] == "s3://models/digits/"
    assert json.loads((tmp_path / "r" / "registration.json").read_text()) == got
    with pytest.raises(InvalidParameterError, match="--registry 'hub' is not one of"):
        register_step(trained_tiny, evaluation, name="digits", min_accuracy=0.0, environ=env,
                      registry="hub")


def test_deploy_render_checks_model_registry_uris_when_the_registry_answers(
        fake_registry, trained_tiny, monkeypatch, capsys):
    """Against the fake of the Kubeflow Model Registry: a version it holds is checked, one it
    lacks is a RegistryError; with no registry URL, or none answering, it goes out unchecked."""
    got = registry.register_kubeflow(trained_tiny, "digits", storage_uri="s3://models/digits/",
                                     url=fake_registry.url, author="ci")
    base = ["deploy", "render", "--name", "digits", "--image", "registry.example.com/kfv:1",
            "--model"]
    there = f"model-registry://digits/{got['version']}"
    for url, model, code, said in (
            (fake_registry.url, there, 0, f"checked: {there} is in the Kubeflow Model Registry"),
            (fake_registry.url, "model-registry://digits/sha256-none", 2, "RegistryError"),
            (None, there, 0, f"not checked: {there} (set KFVISION_REGISTRY_URL"),
            (f"http://127.0.0.1:{free_port()}", there, 0, "does not answer")):
        if url:
            monkeypatch.setenv("KFVISION_REGISTRY_URL", url)
        else:
            monkeypatch.delenv("KFVISION_REGISTRY_URL", raising=False)
        assert cli([*base, model]) == code, model
        out = capsys.readouterr()
        assert said in out.err, out.err
        if code == 0:
            assert f"value: {there}" in out.out  # passed to KServe as it is
