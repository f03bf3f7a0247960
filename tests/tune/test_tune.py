"""Hyperparameter tuning: the metric line and TensorBoard files of a real run, the search space,
the Katib Experiment (Katib's webhook rules, the CRD schemas, the substituted trial), and
`kfvision tune run` on the digits, killed and continued."""

import csv
import json

import jsonschema
import pytest
import yaml
from helpers.k8s_checks import crd_schema
from helpers.runs import train_argv

from kfvision.pipelines.cli import main as cli
from kfvision.pipelines.jobs.config import JobConfig
from kfvision.pipelines.jobs.pytorchjob.build import build_pytorchjob
from kfvision.pipelines.jobs.pytorchjob.rules import webhook_problems
from kfvision.pipelines.jobs.trainjob.rules import validate_trainjob
from kfvision.pipelines.tune.experiment import (
    PYTORCHJOB,
    Search,
    build_experiment,
    substituted_trial,
)
from kfvision.pipelines.tune.katib_rules import experiment_problems
from kfvision.pipelines.tune.space import check_space, parse_param
from kfvision.pipelines.tune.study import check_search, parse_metrics
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.reporting import METRICS, metric_line

BASE = TrainConfig("/data/m", "/data/t", "/data/v", "/data/out", epochs=3, image_size=32)


# --- the metric line -----------------------------------------------------------------------------


RECORD = {"epoch": 3, "lr": 0.05, "train_loss": 0.41234567, "train_top1": 0.9, "val_loss": 1e-05,
          "val_top1": 0.951, "val_top5": 1.0, "train_images_per_sec": 100.0}


def test_the_metric_line_is_read_by_katibs_default_filter_as_written():
    line = metric_line(RECORD)
    assert line.startswith("epoch=3 train-loss=0.412346 ")
    assert parse_metrics(f"12:00:00 {line}") == {name: pytest.approx(RECORD[key], rel=1e-5)
                                                 for name, key in METRICS.items()}


@pytest.mark.slow  # 3.5-5 s of CPU measured: near the unmarked limit
def test_a_real_run_prints_the_line_after_every_validation_and_writes_tensorboard(
        tmp_path, tiny_digits, resnet18_dir, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kfvision.trainer.train import main

    out, board = tmp_path / "model", tmp_path / "tb"
    assert main(train_argv(resnet18_dir, tiny_digits, out, epochs=2, image_size=32,
                           batch_size=16, lr=0.05, augment="none", print_freq=100,
                           tensorboard=board)) == 0
    lines = [parse_metrics(s) for s in capsys.readouterr().out.splitlines()
             if "validation-loss=" in s]
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert [m["epoch"] for m in lines] == [1, 2]
    for m, h in zip(lines, history, strict=True):
        assert m["validation-loss"] == pytest.approx(h["val_loss"], rel=1e-5)
        assert m["validation-top1"] == pytest.approx(h["val_top1"], rel=1e-5)
    events = EventAccumulator(str(board))
    events.Reload()
    scalars = events.Scalars("validation-loss")
    assert [s.step for s in scalars] == [1, 2]
    assert [s.value for s in scalars] == pytest.approx([h["val_loss"] for h in history])
    assert {"train-loss", "validation-top1", "validation-top5"} <= set(events.Tags()["scalars"])


# --- the search space ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, katib", [
    ("lr=double:0.0001:0.1:log", {"parameterType": "double", "feasibleSpace": {
        "min": "0.0001", "max": "0.1", "distribution": "logUniform"}}),
    ("warmup-epochs=int:0:2", {"parameterType": "int", "feasibleSpace": {
        "min": "0", "max": "2", "distribution": "uniform"}}),
    ("batch-size=categorical:16,32,64", {"parameterType": "categorical",
                                         "feasibleSpace": {"list": ["16", "32", "64"]}}),
    ("momentum=double:0.8:0.99", {"parameterType": "double", "feasibleSpace": {
        "min": "0.8", "max": "0.99", "distribution": "uniform"}}),
    ("augment=categorical:light,none", {"parameterType": "categorical",
                                        "feasibleSpace": {"list": ["light", "none"]}}),
])
def test_params_follow_katibs_types(text, katib):
    p = parse_param(text)
    check_space([p], BASE)
    assert p.katib() == {"name": text.partition("=")[0], **katib}


@pytest.mark.parametrize("params, message", [
    (["colour=double:0:1"], "not a training option that can be searched; valid: lr, "),
    (["epochs=double:1:3"], "--epochs takes int values, not double; use int:MIN:MAX"),
    (["lr=double:0.1:0.01"], "min 0.1 must be less than max 0.01"),
    (["lr=double:0.1:0.1"], "must be less than max"),
    (["batch-size=categorical:"], "NAME=TYPE:SPEC"),
    (["batch-size=categorical:,"], "the categorical list is empty"),
    (["lr=double:0:0.1:log"], "a log range must be above 0"),
    (["lr=float:0.1:1"], "type 'float' is not one of double, int, categorical"),
    (["lr"], "is not NAME=TYPE:SPEC"),
    (["batch-size=categorical:16,x"], "'x' is not of type int"),
    (["lr=double:0.001:20"], "its end 20.0 is not a valid value: --lr = 20.0 is out of range"),
    (["warmup-epochs=int:0:5"], "5 is out of range"),  # above --epochs 3
    (["lr=double:0.01:0.1", "lr=categorical:0.1"], "--param lr is given twice"),
])
def test_bad_params_are_refused_before_anything_runs(params, message):
    with pytest.raises(InvalidParameterError, match=message.replace("(", r"\(")):
        check_space([parse_param(t) for t in params], BASE)


@pytest.mark.parametrize("settings, message", [
    ({"trials": 2, "parallel": 3}, "--parallel 3 is more than --trials 2"),
    ({"params": ()}, "at least one --param"),
    ({"algorithm": "grid"}, "grid needs a finite space"),
    ({"trials": 0}, "it must be 1 <= --trials"),
    ({"max_failed": -1}, "it must be 0 <= --max-failed"),
    ({"objective": "accuracy"}, "--objective = 'accuracy' is not valid"),
])
def test_bad_search_settings_are_refused(settings, message):
    with pytest.raises(InvalidParameterError, match=message):
        check_search(Search(**{"params": (parse_param("lr=double:0.01:0.1"),), **settings}))


# --- the Katib Experiment ------------------------------------------------------------------------


def experiment(nodes=1, **search) -> dict:
    job = build_pytorchjob(JobConfig(name="digits-lr-abcd1234", image="registry.example.com/k:1",
                                     train=BASE, nodes=nodes, namespace="team"))
    params = (parse_param("lr=double:0.0001:0.1:log"), parse_param("batch-size=categorical:16,32"))
    return build_experiment(job, PYTORCHJOB, Search(params, **search), "digits-lr", "team")


@pytest.mark.parametrize("nodes, search", [
    (1, {}), (3, {"objective": "validation-top1", "algorithm": "random", "trials": 12,
                  "parallel": 3, "early_stopping": "median"}),
    (2, {"algorithm": "bayesian", "max_failed": 0})])
def test_the_experiment_passes_katibs_rules_and_the_crd(nodes, search):
    exp = experiment(nodes, **search)
    assert experiment_problems(exp) == []
    jsonschema.validate(exp, crd_schema("katib", "kubeflow.org_experiments.yaml"))
    spec, template = exp["spec"], exp["spec"]["trialTemplate"]
    assert spec["metricsCollectorSpec"] == {"collector": {"kind": "StdOut"}}
    assert spec["objective"]["objectiveMetricName"] == search.get("objective", "validation-loss")
    assert spec["objective"]["objectiveMetricName"] not in spec["objective"][
        "additionalMetricNames"]
    assert template["primaryContainerName"] == "pytorch"
    assert template["primaryPodLabels"] == {"training.kubeflow.org/job-role": "master"}
    assert ("earlyStopping" in spec) == (search.get("early_stopping") == "median")
    trial = substituted_trial(exp, "digits-lr-x7k2m9qp")
    jsonschema.validate(trial, crd_schema("kubeflow.org_pytorchjobs.yaml"))
    assert webhook_problems(trial) == []
    for replica in trial["spec"]["pytorchReplicaSpecs"].values():
        args = replica["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--out") + 1] == "/data/out/digits-lr-x7k2m9qp"  # a folder each
        assert args[args.index("--lr") + 1] == "0.0001"
        assert args[args.index("--batch-size") + 1] == "16"


def _broken(change) -> dict:
    exp = experiment()
    change(exp["spec"], exp)
    return exp


BROKEN = {
    "long name": (lambda s, e: e["metadata"].update(name="x" * 41), "at most 40 characters"),
    "bad name": (lambda s, e: e["metadata"].update(name="Digits"), "lower-case letters"),
    "parallel > trials": (lambda s, e: s.update(parallelTrialCount=9, maxTrialCount=4),
                          "parallelTrialCount: should be less than or equal"),
    "failed > trials": (lambda s, e: s.update(maxFailedTrialCount=9, maxTrialCount=4),
                        "maxFailedTrialCount: should be less than or equal"),
    "no trials": (lambda s, e: s.update(maxTrialCount=0), "maxTrialCount: must be greater"),
    "objective twice": (lambda s, e: s["objective"]["additionalMetricNames"].append(
        "validation-loss"), "should not contain"),
    "unknown algorithm": (lambda s, e: s["algorithm"].update(algorithmName="annealing"),
                          "algorithmName: one of"),
    "number not string": (lambda s, e: s["parameters"][0]["feasibleSpace"].update(min=0.0001),
                          "values must be strings"),
    "list on a double": (lambda s, e: s["parameters"][0]["feasibleSpace"].update(list=["1"]),
                         "list: not supported"),
    "min on categorical": (lambda s, e: s["parameters"][1]["feasibleSpace"].update(min="1"),
                           ".min and .step are not supported"),
    "undeclared use": (lambda s, e: s["trialTemplate"]["trialParameters"].pop(0),
                       "not found in trialParameters"),
    "declared, unused": (lambda s, e: s["trialTemplate"]["trialParameters"].append(
        {"name": "seed", "reference": "lr-2"}), "does not exist in spec.parameters"),
    "name in trial": (lambda s, e: s["trialTemplate"]["trialSpec"]["metadata"].update(name="a"),
                      "must be omitted"),
    "no conditions": (lambda s, e: s["trialTemplate"].pop("successCondition"),
                      "successCondition and failureCondition"),
    # Katib v0.19.0 has no "None" collector kind (validator.go: the default case refuses it)
    "collector None": (lambda s, e: s["metricsCollectorSpec"]["collector"].update(kind="None"),
                       "invalid metrics collector kind"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_rule_of_katibs_webhook_is_checked(case):
    change, message = BROKEN[case]
    assert any(message in p for p in experiment_problems(_broken(change))), case


def test_tune_render_writes_the_experiment(tmp_path, capsys):
    out = tmp_path / "exp.yaml"
    assert cli(["tune", "render", "--name", "digits-lr", "--image", "registry.example.com/k:1",
                "--model", "/mnt/runs/m", "--train", "/mnt/runs/t", "--val", "/mnt/runs/v",
                "--out", "/mnt/runs/tune", "--pvc", "runs:/mnt/runs", "--epochs", "3",
                "--param", "lr=double:0.0001:0.1:log", "--param", "warmup-epochs=int:0:2",
                "--trials", "4", "--parallel", "2", "-o", str(out)]) == 0
    exp = yaml.safe_load(out.read_text())
    assert experiment_problems(exp) == [] and exp["spec"]["maxTrialCount"] == 4
    assert cli(["tune", "render", "--name", "x" * 41, "--image", "i:1", "--model", "m", "--train",
                "t", "--val", "v", "--out", "o", "--param", "lr=double:0.01:0.1"]) == 2
    assert "metadata.name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx': at most 40 characters" \
        in capsys.readouterr().err




@pytest.mark.parametrize("kind, runtime", [("pytorchjob", []), ("trainjob", []),
                                           ("trainjob", ["--runtime", "kfvision-torch",
                                                         "--runtime-kind", "TrainingRuntime"])])
def test_tune_render_of_each_kind_passes_katib_and_the_trial_passes_the_job_checks(
        tmp_path, kind, runtime):
    out = tmp_path / "exp.yaml"
    assert cli(["tune", "render", "--kind", kind, *runtime, "--name", "digits-lr", "--namespace",
                "team", "--image", "registry.example.com/k:1", "--nodes", "2",
                "--model", "/mnt/runs/m", "--train", "/mnt/runs/t", "--val", "/mnt/runs/v",
                "--out", "/mnt/runs/tune", "--pvc", "runs:/mnt/runs", "--epochs", "3",
                "--param", "lr=double:0.0001:0.1:log", "--param", "batch-size=categorical:16,32",
                "--trials", "4", "--parallel", "2", "-o", str(out)]) == 0
    exp = yaml.safe_load(out.read_text())
    assert experiment_problems(exp) == []
    jsonschema.validate(exp, crd_schema("katib", "kubeflow.org_experiments.yaml"))
    template = exp["spec"]["trialTemplate"]
    trial = substituted_trial(exp, "digits-lr-x7k2m9qp")
    assert trial["kind"] == {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}[kind]
    if kind == "pytorchjob":
        assert template["successCondition"] == PYTORCHJOB.success_condition
        assert webhook_problems(trial) == []
        arg_lists = [r["template"]["spec"]["containers"][0]["args"]
                     for r in trial["spec"]["pytorchReplicaSpecs"].values()]
    else:
        assert template["primaryContainerName"] == "node"
        assert template["primaryPodLabels"] == {"jobset.sigs.k8s.io/replicatedjob-name": "node",
                                                "batch.kubernetes.io/job-completion-index": "0"}
        assert '"Complete"' in template["successCondition"]
        assert '"Failed"' in template["failureCondition"]
        assert validate_trainjob(trial, "the trial") == trial
        jsonschema.validate(trial, crd_schema("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml"))
        assert trial["spec"]["runtimeRef"]["name"] == (runtime[1] if runtime else
                                                       "torch-distributed")
        arg_lists = [trial["spec"]["trainer"]["args"]]
    for args in arg_lists:
        assert args[args.index("--out") + 1] == "/mnt/runs/tune/digits-lr-x7k2m9qp"
        assert args[args.index("--lr") + 1] == "0.0001"
        assert args[args.index("--batch-size") + 1] == "16"


def test_runtime_flags_without_trainjob_are_refused(capsys):
    assert cli(["tune", "render", "--runtime", "kfvision-torch", "--name", "d", "--image", "i:1",
                "--model", "m", "--train", "t", "--val", "v", "--out", "o",
                "--param", "lr=double:0.01:0.1"]) == 2
    assert "--runtime and --runtime-kind are for --kind trainjob" in capsys.readouterr().err


# --- tune run ------------------------------------------------------------------------------------


def _rows(out) -> list:
    with open(out / "trials.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_tune_run_searches_writes_its_files_and_continues_a_stopped_study(
        tmp_path, tiny_digits, resnet18_dir):
    out = tmp_path / "tune"
    argv = ["tune", "run", *train_argv(resnet18_dir, tiny_digits, out, epochs=1, image_size=32,
                                       batch_size=16, augment="none", print_freq=100),
            "--param", "lr=double:0.01:0.1:log", "--trials", "2", "--parallel", "2"]
    assert cli(argv) == 0
    rows = _rows(out)
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE"]
    study = json.loads((out / "study.json").read_text())
    best = min(rows, key=lambda r: float(r["objective"]))
    assert study["best"]["number"] == int(best["number"])
    assert study["best"]["params"]["lr"] == pytest.approx(float(best["lr"]))
    assert (out / "best" / "weights.pt").exists() and (out / "tuning.png").stat().st_size > 0
    assert cli(argv) == 0 and len(_rows(out)) == 2  # done already: nothing runs again
    assert cli([*argv[:-4], "--trials", "3", "--parallel", "1"]) == 0  # one more trial
    assert [r["number"] for r in _rows(out)] == ["0", "1", "2"]
