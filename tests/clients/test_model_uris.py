"""Every model reference in every command that takes one: a directory, `s3://`, `models:/` (a real
`mlflow server`) and `model-registry://` (the fake of Kubeflow's Model Registry in
test_registry.py, its versions stored on s3://) become the same local model through one reader,
kfvision.pipelines.clients.models.resolve_model; what cannot be read here is a named error that says
what
to do."""

import csv
import json

import pytest

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients import registry
from kfvision.pipelines.clients.models import ModelURIError, cache_root, resolve_model

COMMANDS = ("score", "export", "serve", "register")


@pytest.fixture
def references(trained_tiny, s3_bucket, mlflow_server, fake_registry,  # noqa: F811
               monkeypatch, tmp_path):
    """{scheme: a reference to trained_tiny}, the environment set so that each can be read."""
    uri = s3_bucket.uri(f"{tmp_path.name}/models/digits/")  # parametrized tests share a bucket
    assert main(["push", str(trained_tiny), uri]) == 0
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("KFVISION_REGISTRY_URL", fake_registry.url)
    mlflow = registry.register_mlflow(trained_tiny, "uris")
    kubeflow = registry.register_kubeflow(trained_tiny, "digits", storage_uri=uri,
                                          url=fake_registry.url, author="ci")
    return {"directory": str(trained_tiny), "s3": uri,
            "models": f"models:/uris/{mlflow['version']}",
            "model-registry": f"model-registry://digits/{kubeflow['version']}"}


def _files(model) -> dict:
    """What makes a trained model: its weights and model.json (a fetched copy also holds the
    fetch's journal)."""
    return {f: (model / f).read_bytes() for f in ("weights.pt", "model.json", "spec.json")}


def _argv(command: str, model: str, tmp_path, data=None) -> list:
    return {"score": ["score", "--model", model, "--data", str(data or tmp_path), "--out",
                      str(tmp_path / "scored.csv")],
            "export": ["export", "--model", model, "--out", str(tmp_path / "m.onnx")],
            "serve": ["serve", "--model", model],
            "register": ["register", "--model", model, "--name", "again"]}[command]


def _capture(command: str, monkeypatch) -> list:
    """Replace what `command` does with the model by a recorder: [(model path, name), ...]."""
    got = []
    if command == "score":
        import kfvision.trainer.use.score as target

        def fake(model, *a, **k):
            got.append((model, None))
            return {"rows": 0, "accuracy": None}
        name = "score"
    elif command == "export":
        import kfvision.trainer.use.export as target

        def fake(model, *a, **k):
            got.append((model, None))
            return {"image_size": 32, "classes": []}
        name = "export"
    elif command == "serve":
        import kfvision.pipelines.serve.server as target

        def fake(model, *, name=None, **k):
            got.append((model, name))
        name = "serve"
    else:
        target, name = registry, "register_mlflow"

        def fake(model, model_name, **k):
            got.append((model, model_name))
            return {"name": model_name, "version": "1", "created": True}
    monkeypatch.setattr(target, name, fake)
    return got


@pytest.mark.slow  # 3.5-5 s of CPU measured: near the unmarked limit
@pytest.mark.parametrize("command", COMMANDS)
def test_every_scheme_gives_the_same_model_to_every_command(command, references, trained_tiny,
                                                            tiny_digits, tmp_path, monkeypatch):
    got = _capture(command, monkeypatch)
    for scheme, model in references.items():  # score reads its --data's manifest first
        assert main(_argv(command, model, tmp_path, tiny_digits["val"])) == 0, scheme
    assert [_files(path) for path, _ in got] == [_files(trained_tiny)] * len(references)
    if command == "serve":  # named after the reference, not after a cache folder
        assert [name for _, name in got] == [None, "digits", "uris", "digits"]


def test_model_registry_scores_like_the_directory(references, trained_tiny, tiny_digits,
                                                  tmp_path, capsys):
    """`kfvision score --model model-registry://digits/VERSION`: the version the Kubeflow Model
    Registry recorded (on s3://), fetched once, scores as its directory does."""
    labels = []
    for name, model in (("dir", str(trained_tiny)), ("kubeflow", references["model-registry"])):
        out = tmp_path / f"{name}.csv"
        assert main(["score", "--model", model, "--data", str(tiny_digits["val"]), "--out",
                     str(out), "--quiet"]) == 0
        labels.append([r["scored_label"] for r in csv.DictReader(out.open())])
    assert labels[0] == labels[1]
    assert f"stored at {references['s3']}" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("model, words", [
    ("model-registry://digits/1", "set KFVISION_REGISTRY_URL"),
    ("pvc://kfvision-data/models/digits", "pvc:// is read by KServe's storage initializer"),
    ("gs://bucket/models/digits", "kfvision deploy render --model gs://"),
])
def test_what_cannot_be_read_here_is_a_model_uri_error_saying_what_to_do(
        command, model, words, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KFVISION_REGISTRY_URL", raising=False)
    _capture(command, monkeypatch)
    assert main(_argv(command, model, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "ModelURIError" in err and words in err, err
    assert "Train one with" not in err and "model-registry:/d" not in err  # the old mangled line


def test_a_version_stored_where_only_kserve_reads_is_a_model_uri_error(
        fake_registry, trained_tiny, monkeypatch):  # noqa: F811
    got = registry.register_kubeflow(trained_tiny, "onpvc", author="ci", url=fake_registry.url,
                                     storage_uri="pvc://kfvision-data/models/digits")
    env = {"KFVISION_REGISTRY_URL": fake_registry.url}
    with pytest.raises(ModelURIError, match="stored at pvc://kfvision-data/models/digits, which "
                       "only KServe reads"):
        resolve_model(f"model-registry://onpvc/{got['version']}", environ=env)
    with pytest.raises(ModelURIError, match="names no version"):
        resolve_model("model-registry://onpvc", environ=env)
    with pytest.raises(registry.RegistryError, match="no version 'sha256-none'"):
        resolve_model("model-registry://onpvc/sha256-none", environ=env)


def test_deploy_passes_storage_uris_on_and_serves_registered_versions_locally(
        references, trained_tiny, tmp_path, monkeypatch, capsys):
    """deploy render: model-registry:// and s3:// go to KServe as they are, a directory is refused
    (KServe cannot read this machine); the deploy step's local check resolves a registered
    version through the same reader."""
    from kfvision.pipelines.flow.steps import deploy as step

    base = ["deploy", "render", "--name", "digits", "--image", "registry.example.com/kfv:1"]
    for model in (references["s3"], references["model-registry"]):
        assert main([*base, "--model", model]) == 0
        assert f"value: {model}" in capsys.readouterr().out
    assert main([*base, "--model", references["directory"]]) == 2
    assert "not a storage URI KServe can fetch" in capsys.readouterr().err
    for scheme in ("models", "model-registry"):
        folder = tmp_path / scheme
        folder.mkdir()
        (folder / "registration.json").write_text(
            json.dumps({"registered": True, "uri": references[scheme]}))
        served = step.registered_model(folder, cluster=False)
        assert _files(served["model_dir"]) == _files(trained_tiny), scheme
        on_cluster = step.registered_model(folder, cluster=True)
        if scheme == "model-registry":  # KServe's storage initializer resolves it there
            assert on_cluster["storage_uri"] == references[scheme]


def test_the_cache_root_follows_xdg_and_ignores_a_relative_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path / "c")}) == tmp_path / "c" / "kfvision"
    for unset in ({}, {"XDG_CACHE_HOME": ""}, {"XDG_CACHE_HOME": "relative/cache"}):
        assert cache_root(unset) == tmp_path / "home" / ".cache" / "kfvision"
