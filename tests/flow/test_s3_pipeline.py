"""The pipeline and s3://: the S3 Secret goes to exactly the steps that talk to S3, no secret
value is compiled in, and the deploy step serves an s3:// model without a PVC. The whole local
pipeline from an s3:// source to an s3:// model: tests/flow/test_store_pipeline.py (one run)."""

import json

import pytest
import yaml
from helpers.fake_kserve import READY, FakeKServe, client_for

from kfvision.pipelines.clients.s3 import S3_SECRET_KEYS
from kfvision.pipelines.flow.pipeline import compile_pipeline
from kfvision.pipelines.flow.steps import deploy as step
from kfvision.pipelines.flow.storage import Storage, check_data_pvc_use
from kfvision.trainer.errors import InvalidParameterError

S3_STEPS = ("convert-to-image-directory", "train-pytorch-model")


def test_the_s3_secret_goes_to_the_convert_and_train_steps_only(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "compiled-secret-marker")
    path = tmp_path / "p.yaml"
    compile_pipeline(path, storage=Storage(s3_credentials="kfvision-s3"))
    text = path.read_text()
    assert "compiled-secret-marker" not in text
    spec, platform = yaml.safe_load_all(text)
    assert spec["root"]["inputDefinitions"]["parameters"]["s3_secret"]["defaultValue"] == \
        "kfvision-s3"
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    with_secret = {name for name, e in executors.items() if "secretAsEnv" in e}
    assert with_secret and all(n.removeprefix("exec-").startswith(S3_STEPS)
                               for n in with_secret)
    assert {n for n in executors if n.removeprefix("exec-").startswith(S3_STEPS)} == with_secret
    for name in with_secret:
        (env,) = executors[name]["secretAsEnv"]
        assert env["optional"] is True
        assert [m["secretKey"] for m in env["keyToEnv"]] == list(S3_SECRET_KEYS)
        assert env["secretNameParameter"]["componentInputParameter"].endswith("s3_secret")


def test_without_s3_credentials_no_step_gets_a_secret(tmp_path):
    path = tmp_path / "p.yaml"
    compile_pipeline(path)
    assert "secretAsEnv" not in path.read_text()
    with pytest.raises(InvalidParameterError, match="--s3-credentials"):
        Storage().check_arguments({"s3_secret": "kfvision-s3"})


def test_s3_sources_and_an_s3_model_need_no_data_pvc():
    check_data_pvc_use({"train_source": "s3://bkt/digits/train/", "deploy": True,
                        "model_uri": "s3://bkt/models/digits/"}, has_data_pvc=False)
    with pytest.raises(InvalidParameterError, match="model_uri"):
        check_data_pvc_use({"train_source": "s3://bkt/d/", "deploy": True}, has_data_pvc=False)


def test_on_a_cluster_an_s3_model_is_deployed_from_there(tmp_path, monkeypatch):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "metrics.json").write_text(json.dumps({"accuracy": 0.9}))
    monkeypatch.setattr(step, "is_mount", lambda path: False)  # no data PVC at all
    fake = FakeKServe([READY])
    figures = step.deploy_step(tmp_path / "model", tmp_path / "val", tmp_path / "eval",
                               tmp_path / "d", name="digits", min_accuracy=0.0, mode="cluster",
                               image="img:1", model_uri="s3://bkt/models/digits/",
                               service_account="kfvision-s3",
                               connect=lambda out=None: client_for(fake, out))
    assert figures["deployed"] == 1 and figures["storage_uri"] == "s3://bkt/models/digits/"
    isvc = yaml.safe_load((tmp_path / "d" / "inferenceservice.yaml").read_text())
    assert isvc["spec"]["predictor"]["serviceAccountName"] == "kfvision-s3"
    assert "persistentVolumeClaim" not in yaml.safe_dump(isvc)
