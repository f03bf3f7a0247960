"""`kfvision register` into MLflow's registry (a real `mlflow server` on loopback) and using a
registered model as `models:/NAME/VERSION`: idempotent by content, named errors, the same labels
as the directory."""

import csv
import json

import pytest

from pipelines.cli import main as cli
from pipelines.clients import registry
from pipelines.clients.endpoints import EndpointUnreachableError, free_port
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


# --- Kubeflow Model Registry ------------------------------------------------------------------
# Its server cannot run here (container images only, MySQL or PostgreSQL), so the `model-registry`
# client is tested against a FAKE of the endpoints it calls, written from the REST API spec in
# ../shared/reference/model-registry/ (kubeflow/hub, v1alpha3): every request must match a path
# and method of the spec, bodies are stored and echoed with the server's fields (id, times). The
# released client 0.3.18 calls the paths under /api/model_registry/v1 where the spec has v1alpha3;
# the fake serves the client's prefix and says so here (docs/tracking.md).

SPEC_PREFIX, CLIENT_PREFIX = "/api/model_registry/v1alpha3", "/api/model_registry/v1"


class FakeModelRegistry:
    def __init__(self, spec: dict):
        import http.server
        import itertools
        import re
        import threading
        import urllib.parse

        self.objects, self.calls, ids = {}, [], itertools.count(1)
        routes = []
        for path, ops in spec["paths"].items():
            pattern = re.escape(path.replace(SPEC_PREFIX, CLIENT_PREFIX, 1))
            pattern = re.sub(r"\\\{[^}]+\\\}", "([^/]+)", pattern)
            routes += [(m.upper(), re.compile(pattern + "$"), path) for m in ops
                       if m in ("get", "post", "patch")]
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method):
                url = urllib.parse.urlsplit(self.path)
                for m, rx, spec_path in routes:
                    hit = rx.match(url.path)
                    if m == method and hit:
                        return spec_path, hit.groups(), dict(urllib.parse.parse_qsl(url.query))
                return None, (), {}

            def do_GET(self):
                spec_path, args, query = self._route("GET")
                fake.calls.append(("GET", spec_path))
                kind = {"/registered_model": "RegisteredModel", "/model_version": "ModelVersion",
                        "/model_artifact": "ModelArtifact",
                        "/registered_models": "list"}.get((spec_path or "")[len(SPEC_PREFIX):])
                if kind == "list":
                    items = [o for o in fake.objects.values() if o["_kind"] == "RegisteredModel"]
                    return self._answer(200, {"items": items, "size": len(items),
                                              "pageSize": int(query.get("pageSize", 100)),
                                              "nextPageToken": ""})
                parent = "modelVersionId" if kind == "ModelArtifact" else "registeredModelId"
                for o in fake.objects.values():
                    if (kind and o["_kind"] == kind and o["name"] == query.get("name") and
                            o.get(parent) == query.get("parentResourceId")):
                        return self._answer(200, o)
                self._answer(404, {"code": "404", "message": "not found"})

            def do_POST(self):
                spec_path, args, _ = self._route("POST")
                fake.calls.append(("POST", spec_path))
                if spec_path is None:
                    return self._answer(404, {"code": "404", "message": "no such path in spec"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                kind = {"/registered_models": "RegisteredModel", "/model_versions":
                        "ModelVersion"}.get(spec_path[len(SPEC_PREFIX):], "ModelArtifact")
                if kind == "ModelArtifact":
                    body["modelVersionId"] = args[0]
                obj = {**body, "_kind": kind, "id": str(next(ids)), "state": "LIVE",
                       "createTimeSinceEpoch": "1", "lastUpdateTimeSinceEpoch": "1",
                       "customProperties": body.get("customProperties", {})}
                fake.objects[obj["id"]] = obj
                self._answer(201, obj)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, kind):
        return [o for o in self.objects.values() if o["_kind"] == kind]


@pytest.fixture
def fake_registry():
    import yaml
    from conftest import reference_file

    spec = yaml.safe_load(reference_file("model-registry",
                                         "model-registry-v1alpha3.openapi.yaml").read_text())
    fake = FakeModelRegistry(spec)
    yield fake
    fake.server.shutdown()


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
    from pipelines.steps.register import register_step

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
    from pipelines.steps.register import register_step

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
