"""The whole pipeline on this machine with KFP's local runner: same results as the library path,
the deploy step serving the model, no image copied (the byte meter of tests/helpers/meter.py, as
tests/flow/test_data_movement.py weighs the cluster branch), and bad parameters stop it before
any heavy work."""

import csv
import json
import subprocess
import sys
import warnings

import pytest
import yaml
from helpers.meter import image_bytes, local_run_meter
from helpers.paths import REPO
from helpers.runs import train_argv

from kfvision.pipelines.flow.localrun import find, run_local_pipeline, summary
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.errors import InvalidParameterError

SETTINGS = {"epochs": 3, "image_size": 32, "batch_size": 16, "learning_rate": 0.05,
            "augment": "none", "print_frequency": 100, "fraction": 0.8, "random_seed": 1}


def outputs_of(run, task: str) -> dict:
    """{output name: artifact dict} from a local task's executor_output.json."""
    doc = json.loads((run.root / task / "executor_output.json").read_text())
    return {k: v["artifacts"][0] for k, v in doc.get("artifacts", {}).items()}


def library_path(source, tmp) -> dict:
    """What the pipeline does, with the library calls `kfvision convert/split/model/train/score/
    evaluate` make: convert the source -> split -> resnet18 -> train -> score the source (the
    test source) -> evaluate."""
    from kfvision.trainer.data.convert import convert
    from kfvision.trainer.data.split import split
    from kfvision.trainer.model.arch import write_untrained_model
    from kfvision.trainer.train import main
    from kfvision.trainer.use.evaluate import evaluate
    from kfvision.trainer.use.score import score

    convert(source, tmp / "all", progress=False)
    split(tmp / "all", tmp / "train", tmp / "val", fraction=SETTINGS["fraction"],
          seed=SETTINGS["random_seed"])
    write_untrained_model(tmp / "model", "resnet18")
    data = {"train": tmp / "train", "val": tmp / "val"}
    opts = {"epochs": 3, "image_size": 32, "batch_size": 16, "lr": 0.05, "augment": "none",
            "print_freq": 100, "seed": 1}
    assert main(train_argv(tmp / "model", data, tmp / "trained", **opts)) == 0
    convert(source, tmp / "test", progress=False)
    score(tmp / "trained", tmp / "test", tmp / "scored.csv", progress=False)
    return {"trained": json.loads((tmp / "trained" / "metrics.json").read_text()),
            "evaluation": evaluate(tmp / "scored.csv", tmp / "eval"),
            "scored": tmp / "scored.csv"}


@pytest.mark.slow
def test_local_pipeline_reaches_the_same_accuracy_as_the_library_path(photos, tmp_path):
    """A folder of JPEG photos as the training and the test source (96 images, 4 classes)."""
    run = run_local_pipeline({"train_source": str(photos), "test_source": str(photos),
                              **SETTINGS, "deploy": True, "deploy_name": "digits"},
                             tmp_path / "pipeline")
    ref = library_path(photos, tmp_path / "library")
    trained = json.loads((find(run, "train-pytorch-model", "trained_model") / "metrics.json")
                         .read_text())
    assert trained["epochs_run"] == ref["trained"]["epochs_run"] == 3
    for key in ("val_top1", "val_top5", "val_loss"):  # CPU, same seed, same world size
        assert trained["final"][key] == pytest.approx(ref["trained"]["final"][key], abs=1e-6)
    evaluation = json.loads((find(run, "evaluate-model", "evaluation") / "metrics.json")
                            .read_text())
    assert evaluation["accuracy"] == ref["evaluation"]["accuracy"]
    assert evaluation["confusion_matrix"] == ref["evaluation"]["confusion_matrix"]
    rows = list(csv.reader(find(run, "score-image-model", "scored").open()))
    assert len(rows) == 97 and rows == list(csv.reader(ref["scored"].open()))

    # What the KFP UI shows: metrics, confusion matrix, curves, report, the job (locally, auto
    # is a PyTorchJob).
    train_out = outputs_of(run, "train-pytorch-model")
    assert train_out["metrics"]["metadata"]["val_top1"] == pytest.approx(
        trained["final"]["val_top1"], abs=1e-6)
    assert train_out["job"]["metadata"]["nodes"] == 1
    assert "<svg" in find(run, "train-pytorch-model", "curves").read_text()
    job = yaml.safe_load(find(run, "train-pytorch-model", "job").read_text())
    assert job["kind"] == "PyTorchJob" and job["metadata"]["name"].startswith("kfvision-train-")
    eval_out = outputs_of(run, "evaluate-model")
    cm = eval_out["confusion_matrix"]["metadata"]["confusionMatrix"]
    assert [r["row"] for r in cm["rows"]] == [[float(v) for v in row]
                                               for row in evaluation["confusion_matrix"]]
    assert eval_out["metrics"]["metadata"]["accuracy"] == pytest.approx(evaluation["accuracy"])
    assert "| class | precision |" in find(run, "evaluate-model", "report").read_text()
    assert "data:image/png;base64," in find(run, "evaluate-model", "page").read_text()
    assert "split-image-directory" in run.artifacts  # no validation source: the split branch
    # deploy on: the trained model served locally, its labels on the validation images (the
    # split's) equal to the scored ones, over v1 and v2; the figures are the step's Metrics.
    deployed = json.loads((find(run, "deploy-model", "deployment") / "figures.json").read_text())
    validation = read_image_directory(find(run, "split-image-directory", "validation"))
    train = read_image_directory(find(run, "split-image-directory", "train"))
    # the split's manifests reference the source's images: no step copies one (a test source,
    # the deploy step and the pictures the steps draw included)
    assert validation.referenced and train.referenced and train.base == photos
    meter = local_run_meter(run.root, image_bytes(photos))
    print("\n" + meter.table("local run (kfvision pipeline run-local), a folder source, with a "
                            "test source and deploy"))
    assert meter.total("images") == 0 and meter.moved() <= 1.1
    n = len(validation.images)
    assert deployed["deployed"] == 1 and deployed["accuracy"] == evaluation["accuracy"]
    assert deployed["v1_labels_equal_scored"] == deployed["v2_labels_equal_scored"] == n > 0
    shown = outputs_of(run, "deploy-model")["metrics"]["metadata"]
    assert shown["v1_labels_equal_scored"] == n and shown["deployed"] == 1
    text = summary(run)
    assert f"accuracy {evaluation['accuracy']:.4f}" in text and str(run.root) in text
    assert f"deploy      served locally by `kfvision serve`: {n} images over v1" in text


@pytest.mark.parametrize("given, expected", [({}, "local"), ({"execution_mode": "auto"}, "local"),
                                             ({"execution_mode": "cluster"}, "cluster")])
def test_a_local_run_trains_locally_unless_told_otherwise(given, expected):
    from kfvision.pipelines.flow.localrun import local_arguments

    assert local_arguments({"train_source": "x", **given})["execution_mode"] == expected


def test_bad_parameters_fail_before_the_runner_starts(tiny_digits, tmp_path):
    with pytest.raises(InvalidParameterError, match="0 < --lr <= 10"):
        run_local_pipeline({"train_source": str(tiny_digits["raw"] / "train"),
                            "learning_rate": 0.0}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_pipelines_first_step_refuses_bad_parameters_before_any_other_runs(tiny_digits,
                                                                               tmp_path):
    # The KFP UI and `kfp run create` skip kfvision's own check: check-parameters does it.
    from kfp import local

    from kfvision.pipelines.flow.localrun import support_oneof_artifacts
    from kfvision.pipelines.flow.pipeline import build_pipeline
    from kfvision.pipelines.flow.storage import LOCAL

    support_oneof_artifacts()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="check-parameters"):
        warnings.simplefilter("ignore")  # kfp.local's notes on the image and resources
        build_pipeline(LOCAL)(train_source=str(tiny_digits["raw"] / "train"),
                              model_name="resnet19")
    ran = {p.name for p in tmp_path.glob("*/*") if p.is_dir()}
    assert ran <= {"check-parameters"}  # nothing converted, built or trained


@pytest.mark.process
def test_run_local_command_reports_a_bad_source_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "pipeline", "run-local",
                          "--train-source", str(tmp_path / "nowhere"), "--out",
                          str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("error: InvalidDatasetError: train_source ")
    assert "Traceback" not in run.stderr
