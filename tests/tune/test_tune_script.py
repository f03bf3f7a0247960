"""Tuning a user's own script (docs/scripts.md, "Tuning a script"): placeholders in its arguments,
the objective read from its own stdout as Katib's StdOut collector reads it, a local search over
a small numpy script on scikit-learn's digits, and the Katib Experiment of both job kinds checked
against the Katib v0.19 CRD and validator rules and the trial against the job kind's checks."""

import csv
import json
import sys

import jsonschema
import pytest
import yaml
from helpers.fake_k8s import rbac_rules
from helpers.k8s_checks import crd_schema
from kubernetes.client.exceptions import ApiException
from test_tune_cluster import SUCCEEDED, FakeKatib, api_for

from kfvision.pipelines import contract
from kfvision.pipelines.cli import main
from kfvision.pipelines.jobs.pytorchjob.rules import webhook_problems
from kfvision.pipelines.jobs.trainjob.rules import validate_trainjob
from kfvision.pipelines.script.snapshot import pack
from kfvision.pipelines.tune import experimentclient
from kfvision.pipelines.tune.experiment import Search, substituted_trial
from kfvision.pipelines.tune.katib_rules import experiment_problems
from kfvision.pipelines.tune.script import check_placeholders, fill, objective_of
from kfvision.pipelines.tune.space import parse_param
from kfvision.trainer.errors import InvalidParameterError

IMAGE = "registry.example.com/kfvision:0.1"
# Softmax regression on the digits by plain gradient descent: too small a step learns little in
# 2 epochs, a big one learns it; prints `accuracy=` after every epoch, as a Katib user's would.
TRAIN = """\
import argparse, os
import numpy as np
from sklearn.datasets import load_digits

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, required=True)
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()
x, y = load_digits(return_X_y=True)
x, order = x / 16.0, np.random.default_rng(0).permutation(len(y))
x, y = x[order], y[order]
w, onehot = np.zeros((64, 10)), np.eye(10)[y[:1200]]
for epoch in range(1, args.epochs + 1):
    for _ in range(20):
        z = x[:1200] @ w
        e = np.exp(z - z.max(1, keepdims=True))
        w -= args.lr * x[:1200].T @ (e / e.sum(1, keepdims=True) - onehot) / 1200
    print(f"epoch={epoch} accuracy={((x[1200:] @ w).argmax(1) == y[1200:]).mean():.4f}")
os.makedirs(os.environ["KFVISION_MODEL_DIR"], exist_ok=True)
np.save(os.path.join(os.environ["KFVISION_MODEL_DIR"], "w.npy"), w)
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv(contract.ENV_CACHE, str(tmp_path_factory.getbasetemp() / "envs"))


def source(tmp_path, text: str = TRAIN):
    src = tmp_path / "proj"
    src.mkdir()
    (src / "train.py").write_text(text)
    return src


def search(*params, objective="accuracy", goal="max") -> Search:
    return Search(tuple(parse_param(p) for p in params), objective=objective, goal=goal)


# --- placeholders and the objective --------------------------------------------------------------


def test_placeholders_are_filled_anywhere_in_an_argument():
    params = [parse_param("lr=double:0.001:1:log"), parse_param("opt=categorical:sgd,adam")]
    args = ("--lr", "{lr}", "--optimizer={opt}", "{'json': 1}", "--tag", "lr{lr}-{opt}")
    check_placeholders(args, params)
    assert fill(args, {"lr": 0.01, "opt": "adam"}) == (
        "--lr", "0.01", "--optimizer=adam", "{'json': 1}", "--tag", "lr0.01-adam")


@pytest.mark.parametrize("args, params, message", [
    (["--lr", "{lr}", "--wd", "{wd}"], ["lr=double:0.001:1"],
     r"the script argument '\{wd\}' names \{wd\}, which no --param searches \(searched: lr\)"),
    (["--lr", "{lr}"], ["lr=double:0.001:1", "wd=double:0.0:0.1"],
     r"--param wd is searched but no script argument uses it: write \{wd\}"),
    (["--lr", "0.1"], ["lr=double:0.001:1"], "--param lr is searched but no script argument"),
    (["{lr}"], ["lr=double:0.001:1", "lr=int:1:3"], "--param lr is given twice"),
])
def test_a_placeholder_and_a_parameter_must_name_each_other(args, params, message):
    with pytest.raises(InvalidParameterError, match=message):
        check_placeholders(args, [parse_param(p) for p in params])


# Katib v0.19.0 DefaultFilter's own examples (const.go), a rank's tagged line, spaces around '=',
# and what it does not take: another metric whose name ends the same, a value that is no number.
LINES = ["accuracy=.98", "[0/0] epoch=1 accuracy=0.5 loss=0.3", "accuracy = 0.25",
         "Score=-7.53e-05 accuracy=1E0", "val_accuracy=2.0", "accuracy=n/a"]


@pytest.mark.parametrize("goal, value", [("max", 1.0), ("min", 0.25)])
def test_the_objective_is_what_katib_records_by_its_default_strategy(goal, value):
    assert objective_of(LINES, search("lr=double:0.1:1", goal=goal)) == value
    assert objective_of(["loss=0.3", "epoch 1 done"], search("lr=double:0.1:1")) is None


# --- bad input: one named line, before anything runs ---------------------------------------------


LR = ["--param", "lr=double:0.001:1"]


@pytest.mark.parametrize("argv, message", [
    ([*LR, "--goal", "max", "--", "--lr", "{learning_rate}"],
     "InvalidParameterError: the script argument '{learning_rate}' names {learning_rate}, "
     "which no --param searches"),
    ([*LR, "--param", "momentum=double:0.1:0.9", "--goal", "max", "--", "--lr", "{lr}"],
     "InvalidParameterError: --param momentum is searched but no script argument uses it"),
    ([*LR, "--", "--lr", "{lr}"],
     "InvalidParameterError: --goal max or --goal min: with --source, say whether"),
    ([*LR, "--goal", "max", "--objective", "val acc", "--", "--lr", "{lr}"],
     "InvalidParameterError: --objective 'val acc': Katib's StdOut collector cannot read it"),
    ([*LR, "--goal", "max", "--early-stopping", "median", "--", "--lr", "{lr}"],
     "InvalidParameterError: --early-stopping median does not stop a script's trial"),
    ([*LR, "--goal", "max", "--epochs", "3", "--", "--lr", "{lr}"],
     "InvalidJobError: --epochs is a flag of the built-in trainer"),
])
def test_bad_input_is_one_named_line_and_runs_nothing(tmp_path, capsys, argv, message):
    src, out = source(tmp_path), tmp_path / "tuning"
    code = main(["tune", "run", "--source", str(src), "--entry", "train.py", "--out", str(out),
                 "--objective", "accuracy", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {message}"), err
    assert not out.exists()


# --- on this machine -----------------------------------------------------------------------------


def _rows(out) -> list:
    with open(out / "trials.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _tune(tmp_path, src, *argv) -> int:
    return main(["tune", "run", "--source", str(src), "--entry", "train.py", "--launcher",
                 "python", "--out", str(tmp_path / "tuning"), "--objective", "accuracy", "--goal",
                 "max", *argv])


@pytest.mark.slow
def test_tune_run_finds_the_better_learning_rate(tmp_path, capsys):
    src, out = source(tmp_path), tmp_path / "tuning"
    assert _tune(tmp_path, src, "--param", "lr=categorical:0.001,0.05,2", "--algorithm", "grid",
                 "--trials", "3", "--", "--lr={lr}", "--epochs", "2") == 0
    rows = _rows(out)
    assert sorted(r["lr"] for r in rows) == ["0.001", "0.05", "2"]
    assert {r["state"] for r in rows} == {"COMPLETE"}
    for r in rows:  # each trial's value: the highest accuracy line in node 0's log
        log = (out / "trials" / f"trial-{int(r['number']):04d}" / "master-0.log").read_text()
        printed = [float(w.split("=")[1]) for w in log.split() if w.startswith("accuracy=")]
        assert len(printed) == 2 and float(r["objective"]) == max(printed)
    by_lr = {r["lr"]: float(r["objective"]) for r in rows}
    assert by_lr["2"] > by_lr["0.05"] > by_lr["0.001"]
    study = json.loads((out / "study.json").read_text())
    assert study["direction"] == "maximize" and study["best"]["params"] == {"lr": "2"}
    assert (out / "best" / "model" / "w.npy").is_file()
    assert json.loads((out / "best" / "model" / "kfvision-source.json").read_text())[
        "args"] == ["--lr=2", "--epochs", "2"]
    assert "best trial" in capsys.readouterr().out


def test_a_trial_that_prints_no_objective_fails_and_the_search_goes_on(tmp_path, capsys):
    src = source(tmp_path, "import sys\nif sys.argv[2] == 'loud':\n    print('accuracy=0.5')\n")
    assert _tune(tmp_path, src, "--param", "mode=categorical:quiet,loud", "--algorithm", "grid",
                 "--trials", "2", "--", "--mode", "{mode}") == 0
    rows = {r["mode"]: r for r in _rows(tmp_path / "tuning")}
    assert rows["quiet"]["state"] == "FAIL" and rows["loud"]["state"] == "COMPLETE"
    quiet = f"trial-{int(rows['quiet']['number']):04d}"
    err = capsys.readouterr().err
    assert (f"the script printed no accuracy=VALUE line (Katib would record it as unavailable); "
            f"see {tmp_path / 'tuning' / 'trials' / quiet / 'master-0.log'}") in err
    assert _tune(tmp_path, src, "--param", "mode=categorical:quiet", "--algorithm", "grid",
                 "--trials", "1", "--max-failed", "0", "--", "--mode", "{mode}") == 2  # another
    assert "holds a study of another search" in capsys.readouterr().err  # search: refused


# --- on a cluster: the Experiment ----------------------------------------------------------------




def _render(tmp_path, *argv) -> list:
    path = tmp_path / "exp.yaml"
    assert main(["tune", "render", "--name", "digits-lr", "--namespace", "team", "--image",
                 IMAGE, "--nodes", "2", "--pvc", "runs:/mnt/runs", "--source",
                 str(source(tmp_path)), "--entry", "train.py", "--output-uri", "pvc://runs/out",
                 "--param", "lr=double:0.001:2:log", "--param", "epochs=int:1:3",
                 "--objective", "accuracy", "--goal", "max", "--trials", "4", *argv,
                 "-o", str(path), "--", "--lr={lr}", "--epochs", "{epochs}"]) == 0
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_tune_render_of_each_kind_passes_katib_and_the_trial_passes_the_job_checks(tmp_path,
                                                                                   kind):
    config_map, exp = _render(tmp_path, "--kind", kind)
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["namespace"] == "team"
    assert experiment_problems(exp) == []
    jsonschema.validate(exp, crd_schema("katib", "kubeflow.org_experiments.yaml"))
    spec = exp["spec"]
    assert spec["metricsCollectorSpec"] == {"collector": {"kind": "StdOut"}}
    assert spec["objective"] == {"type": "maximize", "objectiveMetricName": "accuracy",
                                 "additionalMetricNames": []}
    trial = substituted_trial(exp, "digits-lr-x7k2m9qp")
    if kind == "pytorchjob":
        assert webhook_problems(trial) == []
        jsonschema.validate(trial, crd_schema("kubeflow.org_pytorchjobs.yaml"))
        pods = [r["template"]["spec"] for r in trial["spec"]["pytorchReplicaSpecs"].values()]
        arg_lists = [p["containers"][0]["args"] for p in pods]
        hosts = "digits-lr-x7k2m9qp-master-0,digits-lr-x7k2m9qp-worker-0"
    else:
        assert validate_trainjob(trial, "the trial") == trial
        jsonschema.validate(trial, crd_schema("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml"))
        pods = [trial["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
        arg_lists = [trial["spec"]["trainer"]["args"]]
        hosts = "digits-lr-x7k2m9qp-node-0-0,digits-lr-x7k2m9qp-node-0-1"
    for pod in pods:  # the source ConfigMap beside the Experiment is the one the pods mount
        assert {"name": "kfvision-source", "configMap": {
            "name": config_map["metadata"]["name"]}} in pod["volumes"]
    for args in arg_lists:  # the trial's values in the script's arguments, its own folders
        assert args[args.index("--") + 1:] == ["--lr=0.001", "--epochs", "1"]
        assert args[args.index("--hosts") + 1] == hosts
        assert args[args.index("--state") + 1] == "/mnt/runs/kfvision/digits-lr-x7k2m9qp"
        assert args[args.index("--output-uri") + 1] == "/mnt/runs/out/digits-lr-x7k2m9qp"
    assert trial["metadata"]["annotations"]["kfvision.dev/output-uri"] == \
        "pvc://runs/out/digits-lr-x7k2m9qp"


def test_tune_render_of_a_script_refuses_a_name_too_long_for_its_trials(tmp_path, capsys):
    assert main(["tune", "render", "--name", "x" * 41, "--image", IMAGE, "--source",
                 str(source(tmp_path)), "--entry", "train.py", "--param", "lr=double:0.01:1",
                 "--objective", "accuracy", "--goal", "max", "--", "--lr", "{lr}"]) == 2
    assert "at most 40 characters" in capsys.readouterr().err


class FakeCore:
    """A FAKE of CoreV1Api's two ConfigMap calls (not a cluster)."""

    def __init__(self, calls):
        self.calls, self.config_maps = calls, {}

    def create_namespaced_config_map(self, namespace, body, _preload_content=True):
        self.calls.append(("create", "configmaps"))
        if body["metadata"]["name"] in self.config_maps:
            raise ApiException(status=409, reason="Conflict")
        self.config_maps[body["metadata"]["name"]] = body
        return type("Response", (), {"data": json.dumps(body).encode()})()

    def read_namespaced_config_map(self, name, namespace, _preload_content=True):
        self.calls.append(("get", "configmaps"))
        return type("Response", (), {"data": json.dumps(self.config_maps[name]).encode()})()


def test_tune_submit_creates_the_source_configmap_first_then_the_experiment(
        tmp_path, monkeypatch, capsys):
    katib = FakeKatib([SUCCEEDED])
    client = api_for(katib, sys.stdout)
    client.api.core = FakeCore(katib.calls)
    monkeypatch.setattr(experimentclient, "client", lambda namespace=None, out=None: client)
    _render(tmp_path)
    for _ in range(2):
        assert main(["tune", "submit", str(tmp_path / "exp.yaml")]) == 0
    assert katib.calls == [("create", "configmaps"), ("create", "experiments"),
                           ("create", "configmaps"), ("get", "configmaps"),
                           ("create", "experiments"), ("get", "experiments")]
    assert set(katib.calls) <= rbac_rules()  # manifests/rbac.yaml grants each
    name = f"kfvision-src-{pack(tmp_path / 'proj').sha256}"
    assert katib.experiments["digits-lr"]["spec"]["objective"]["objectiveMetricName"] == \
        "accuracy"
    out = capsys.readouterr().out
    assert f"created ConfigMap team/{name}" in out and f"reusing ConfigMap team/{name}" in out
    trial = {"metadata": {"name": "digits-lr-x7k2m9qp"}, "spec": {"runSpec": substituted_trial(
        katib.experiments["digits-lr"], "digits-lr-x7k2m9qp")}}
    katib.trials = [trial]
    assert client.trial_out("digits-lr-x7k2m9qp") == "pvc://runs/out/digits-lr-x7k2m9qp/model"
    (tmp_path / "two.yaml").write_text("---\n".join([(tmp_path / "exp.yaml").read_text()] * 2))
    assert main(["tune", "submit", str(tmp_path / "two.yaml")]) == 2
    assert "is not one Katib Experiment, after its script's ConfigMap" in \
        capsys.readouterr().err
