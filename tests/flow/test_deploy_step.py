"""The pipeline's deploy step without KFP: the accuracy gate, the local serve-and-check on a real
trained model, and the cluster path against a fake of the Kubernetes API."""

import json

import pytest
import yaml
from helpers.fake_kserve import NOT_READY, READY, FakeKServe, client_for

from kfvision.pipelines.flow.params import parameter_name
from kfvision.pipelines.flow.pipeline import parameter_defaults
from kfvision.pipelines.flow.steps import deploy as step
from kfvision.pipelines.flow.steps.check import check_parameters
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.use.evaluate import evaluate
from kfvision.trainer.use.score import score


@pytest.fixture(scope="module")
def evaluation(trained_tiny, tiny_digits, tmp_path_factory):
    """The evaluate step's folder for the tiny model on the tiny validation images."""
    tmp = tmp_path_factory.mktemp("evaluation")
    score(trained_tiny, tiny_digits["val"], tmp / "scored.csv", progress=False)
    evaluate(tmp / "scored.csv", tmp / "evaluation")
    return tmp / "evaluation"


def accuracy_of(evaluation) -> float:
    return json.loads((evaluation / "metrics.json").read_text())["accuracy"]


@pytest.mark.parametrize("mode", ["local", "cluster"])
def test_below_the_bar_nothing_is_served_or_deployed_and_the_step_says_why(
        trained_tiny, tiny_digits, evaluation, tmp_path, capsys, mode):
    bar = accuracy_of(evaluation) + 0.01

    def connect(out=None):
        raise AssertionError("the cluster was contacted")

    figures = step.deploy_step(trained_tiny, tiny_digits["val"], evaluation, tmp_path / "d",
                               name="digits", min_accuracy=bar, mode=mode, image="img:1",
                               pvc_name="data", run_key="r", connect=connect)
    assert figures["deployed"] == 0
    assert f"below deploy_min_accuracy {bar:.4f}" in figures["reason"]
    assert figures["reason"] in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["figures.json"]


def test_on_a_cluster_the_model_goes_to_the_pvc_and_the_inferenceservice_waits_for_ready(
        trained_tiny, tiny_digits, evaluation, tmp_path, monkeypatch, capsys):
    mount = tmp_path / "pvc"
    mount.mkdir()
    monkeypatch.setattr(step, "DATA_MOUNT", str(mount))
    monkeypatch.setattr(step, "is_mount", lambda path: path == str(mount))
    fake = FakeKServe([NOT_READY, READY])
    figures = step.deploy_step(trained_tiny, tiny_digits["val"], evaluation, tmp_path / "d",
                               name="digits", min_accuracy=0.0, mode="cluster", image="img:1",
                               pvc_name="data", run_key="run-7",
                               connect=lambda out=None: client_for(fake, out))
    target, uri = step.pvc_model_uri("data", "digits", "run-7")
    assert figures["deployed"] == 1 and figures["storage_uri"] == uri
    assert uri.startswith("pvc://data/kfvision-models/digits/run-")
    assert figures["url"] == "http://digits.kubeflow.example.com"
    assert (target / "metrics.json").is_file()  # the trained model, on the PVC
    isvc = yaml.safe_load((tmp_path / "d" / "inferenceservice.yaml").read_text())
    assert fake.objects["digits"]["spec"] == isvc["spec"]
    container = isvc["spec"]["predictor"]["containers"][0]
    assert container["image"] == "img:1"
    assert [c for c in fake.calls if c[0] == "create"] == [("create", "inferenceservices")]
    assert "ready at http://digits" in capsys.readouterr().out


def test_on_a_cluster_without_the_pvc_the_step_says_so(trained_tiny, tiny_digits, evaluation,
                                                       tmp_path, monkeypatch):
    from kfvision.trainer.errors import StorageError

    monkeypatch.setattr(step, "DATA_MOUNT", str(tmp_path))  # a folder, not a mount
    with pytest.raises(StorageError, match="is not mounted in this step.*pvc_name"):
        step.deploy_step(trained_tiny, tiny_digits["val"], evaluation, tmp_path / "d",
                         name="digits", min_accuracy=0.0, mode="cluster", image="img:1",
                         pvc_name="data", run_key="r")


@pytest.mark.parametrize("over, message", [
    ({"deploy_min_accuracy": 1.5}, "deploy_min_accuracy = 1.5 is out of range"),
    ({"deploy": True, "deploy_name": "Digits_1"}, "deploy_name = 'Digits_1' is not valid"),
    ({"registry": "hub"}, "registry = 'hub'"),
])
def test_bad_deploy_parameters_are_refused_before_anything_runs(tiny_digits, over, message):
    params = {**parameter_defaults(), "train_source": str(tiny_digits["raw"] / "train"),
              "execution_mode": "local", **over}
    with pytest.raises(InvalidParameterError) as e:
        check_parameters(**params)
    assert message in e.value.named(parameter_name)  # as the step's log names it
    check_parameters(**{**params, "deploy": False, "deploy_min_accuracy": 0.5,
                              "registry": "kubeflow"})


@pytest.mark.slow
def test_the_registered_version_is_what_is_served_locally_and_on_a_cluster(
        mlflow_server, trained_tiny, tiny_digits, evaluation, tmp_path, monkeypatch, capsys):
    """Locally the step serves the registered version (the trained model) and the served labels
    are the scored ones, over v1 and v2; on a cluster, what KServe can read."""
    from kfvision.pipelines.flow.steps.register import register_step

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    got = register_step(trained_tiny, evaluation, name="served-version", min_accuracy=0.0,
                        environ={"MLFLOW_TRACKING_URI": mlflow_server},
                        out_dir=tmp_path / "registration")
    assert json.loads((tmp_path / "registration" / "registration.json").read_text()) == got
    figures = step.deploy_step(trained_tiny, tiny_digits["val"], evaluation, tmp_path / "d",
                               name="digits", min_accuracy=0.0, mode="local",
                               registration_dir=tmp_path / "registration")
    assert figures["registered_model"] == got["uri"] == "models:/served-version/1"
    assert figures["deployed"] == 1 and figures["where"] == "local"
    assert figures["images"] == figures["v1_labels_equal_scored"] == 60
    assert figures["v2_labels_equal_scored"] == 60 and figures["v1_images_per_s"] > 0
    assert figures["accuracy"] == accuracy_of(evaluation)
    assert json.loads((tmp_path / "d" / "figures.json").read_text()) == figures
    assert (tmp_path / "d" / "server.log").stat().st_size > 0
    cached = tmp_path / "cache" / "kfvision" / "models" / "served-version" / "1"
    assert (cached / "model.json").is_file()
    out = capsys.readouterr().out
    assert "serving the registered version models:/served-version/1" in out
    assert "served 60 images locally over v1 and v2" in out

    # on a cluster: this server keeps artifacts itself (mlflow-artifacts:/), which KServe cannot
    # read, so the trained model goes to the PVC as without register, and the step says why
    mount = tmp_path / "pvc"
    mount.mkdir()
    monkeypatch.setattr(step, "DATA_MOUNT", str(mount))
    monkeypatch.setattr(step, "is_mount", lambda path: path == str(mount))
    figures = step.deploy_step(trained_tiny, tiny_digits["val"], evaluation, tmp_path / "c",
                               name="digits", min_accuracy=0.0, mode="cluster", image="img:1",
                               pvc_name="data", run_key="run-7",
                               registration_dir=tmp_path / "registration",
                               connect=lambda out=None: client_for(FakeKServe([READY]), out))
    assert figures["storage_uri"].startswith("pvc://data/") and figures["deployed"] == 1
    assert "serving the trained model, not models:/served-version/1" in capsys.readouterr().out


@pytest.mark.parametrize("registration, served", [
    ({"registered": True, "uri": "model-registry://digits/sha256-0123456789abcdef"},
     "model-registry://digits/sha256-0123456789abcdef"),
    ({"registered": False, "reason": "not registered: register_name is empty"}, None),
])
def test_on_a_cluster_a_model_registry_version_is_served_as_it_is(
        trained_tiny, tiny_digits, evaluation, tmp_path, monkeypatch, registration, served):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "registration.json").write_text(json.dumps(registration))
    mount = tmp_path / "pvc"
    mount.mkdir()
    monkeypatch.setattr(step, "DATA_MOUNT", str(mount))
    monkeypatch.setattr(step, "is_mount", lambda path: path == str(mount))
    fake = FakeKServe([READY])
    figures = step.deploy_step(trained_tiny, tiny_digits["val"], evaluation, tmp_path / "d",
                               name="digits", min_accuracy=0.0, mode="cluster", image="img:1",
                               pvc_name="data", run_key="run-7", registration_dir=tmp_path / "r",
                               connect=lambda out=None: client_for(fake, out))
    if served:  # KServe's Model Registry storage initializer resolves it: nothing on the PVC
        assert figures["storage_uri"] == served and not any(mount.iterdir())
        assert figures["registered_model"] == served
    else:  # register skipped: as without it
        assert figures["storage_uri"].startswith("pvc://data/")
        assert "registered_model" not in figures


@pytest.mark.parametrize("metrics", [{"accuracy": None}, {"rows": 60}])
def test_an_evaluation_without_accuracy_is_neither_registered_nor_deployed(
        metrics, trained_tiny, tiny_digits, tmp_path):
    """Unlabelled evaluation images give no accuracy: both steps say so and succeed, through the
    one gate they share (the register step's own copy once raised TypeError here)."""
    from kfvision.pipelines.flow.steps.register import register_step

    evaluation = tmp_path / "evaluation"
    evaluation.mkdir()
    (evaluation / "metrics.json").write_text(json.dumps(metrics))
    got = register_step(trained_tiny, evaluation, name="digits", min_accuracy=0.0,
                        environ={"MLFLOW_TRACKING_URI": "http://127.0.0.1:1"})
    assert not got["registered"] and "not registered: no evaluated accuracy" in got["reason"]

    def no_cluster(out=None):
        raise AssertionError("the gate failed: nothing may connect")

    for mode in ("local", "cluster"):
        figures = step.deploy_step(trained_tiny, tiny_digits["val"], evaluation, tmp_path / mode,
                                   name="digits", min_accuracy=0.0, mode=mode, image="img:1",
                                   pvc_name="data", run_key="r", connect=no_cluster)
        assert figures["deployed"] == 0 and figures["accuracy"] is None
        assert "not deployed: no evaluated accuracy" in figures["reason"]
