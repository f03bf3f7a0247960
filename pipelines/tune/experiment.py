"""The Katib Experiment (`kubeflow.org/v1beta1`) of a search: a pure function of a rendered job, the
facts Katib needs about that job's kind, and the search settings.

Each trial is exactly the job `kfvision job render` makes, with `${trialParameters.X}` in place of
the searched flags' values and `--out <out>/${trialParameters.trialName}` (Katib's
`${trialSpec.Name}`), so that trials sharing one volume never overwrite each other. Katib reads the
metric line the trainer prints (trainer/reporting.py) with its StdOut collector.

A job kind plugs in as a TrialKind: PYTORCHJOB (Training Operator v1.9) and TRAINJOB (Kubeflow
Trainer v2, Katib >= v0.19: success on `Complete`, failure on `Failed`, the pod of the JobSet's
`node` job with completion index 0, container `node`, arguments at `spec.trainer.args`).
"""

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kfvision.pipelines.jobs.pytorchjob import rules as pytorchjob_rules
from kfvision.pipelines.jobs.pytorchjob.rules import CONTAINER_NAME, validate_pytorchjob
from kfvision.pipelines.jobs.trainjob import rules as trainjob_rules
from kfvision.pipelines.jobs.trainjob.rules import NODE, validate_trainjob
from kfvision.pipelines.tune.katib_rules import API_VERSION, KIND, validate_experiment
from kfvision.pipelines.tune.space import parse_param
from kfvision.trainer.options import option
from kfvision.trainer.reporting import METRICS, OBJECTIVES

TRIAL_NAME = "trialName"
# what a job is rendered under for a trial template: as long as a trial's name (Katib's
# <experiment>-<8 characters>), since the pods' names grow from it
TRIAL_SUFFIX = "-abcd1234"
GOALS = {"max": "maximize", "min": "minimize"}
# our --algorithm -> Katib's algorithmName (the suggestion services Katib ships)
ALGORITHMS = {"tpe": "tpe", "random": "random", "grid": "grid",
              "bayesian": "bayesianoptimization"}
EARLY_STOPPING = {"median": "medianstop", "none": None}


class TrialKind(NamedTuple):
    """What Katib must be told about a job kind to run it as a trial."""

    success_condition: str
    failure_condition: str
    primary_pod_labels: dict
    primary_container: str
    trainer_args: Callable  # job dict -> the trainer's argument lists in it (edited in place)
    validate: Callable  # (job dict, where) -> job dict; raises InvalidJobError


def _pytorchjob_args(job: dict) -> list:
    return [c.setdefault("args", [])
            for replica in job["spec"]["pytorchReplicaSpecs"].values()
            for c in replica["template"]["spec"]["containers"] if c["name"] == CONTAINER_NAME]


PYTORCHJOB = TrialKind(
    success_condition=f'status.conditions.#(type=="{pytorchjob_rules.SUCCEEDED}")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    primary_pod_labels={pytorchjob_rules.JOB_ROLE_LABEL: "master"},
    primary_container=CONTAINER_NAME,
    trainer_args=_pytorchjob_args,
    validate=validate_pytorchjob)


def _trainjob_args(job: dict) -> list:
    return [job["spec"]["trainer"].setdefault("args", [])]


TRAINJOB = TrialKind(
    success_condition=f'status.conditions.#(type=="{trainjob_rules.COMPLETE}")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    primary_pod_labels={trainjob_rules.REPLICATED_JOB_LABEL: NODE,
                        trainjob_rules.COMPLETION_INDEX: "0"},
    primary_container=NODE,
    trainer_args=_trainjob_args,
    validate=validate_trainjob)
TRIAL_KINDS = {"pytorchjob": PYTORCHJOB, "trainjob": TRAINJOB}


@dataclass(frozen=True)
class Search:
    """The search settings shared by `tune run` and `tune render`, declared once: their flags,
    range checks and docs/tuning.md's table come from these fields."""

    params: tuple = option(help="a searched training flag (or script placeholder)",
                           flag="--param", many=True,
                           parse=parse_param, metavar="NAME=TYPE:SPEC",
                           doc="E.g. lr=double:0.0001:0.1:log, warmup-epochs=int:0:3, "
                           "batch-size=categorical:16,32,64 (the search space, above).")
    objective: str = option("validation-loss", "metric to optimise",
                            choices=tuple(sorted(OBJECTIVES)),
                            doc="The value of the epoch the model directory keeps. With "
                            "--source: any NAME your script prints as NAME=VALUE.")
    goal: str | None = option(None, "max or min: the objective's direction",
                              choices=tuple(GOALS), unset="the metric's own",
                              doc="Needed with --source (kfvision cannot tell your metric's "
                              "direction).")
    algorithm: str = option("tpe", "search algorithm", choices=tuple(sorted(ALGORITHMS)))
    trials: int = option(8, "trials in all", low=1)
    parallel: int = option(1, "trials at once", low=1, doc="At most --trials.")
    max_failed: int = option(3, "failed trials before giving up", low=0)
    early_stopping: str = option("none", "stop trials worse than the median",
                                 choices=tuple(sorted(EARLY_STOPPING)),
                                 doc="median: a trial whose per-epoch objective is worse than "
                                 "the median of the earlier trials at that epoch ends there.")


def direction(search: Search) -> str:
    """`maximize` or `minimize`: --goal's, else the built-in metric's own."""
    return GOALS[search.goal] if search.goal else OBJECTIVES[search.objective]


class Template(NamedTuple):
    """What a trial runs, as a trial template: the built-in trainer (TRAINER) or a user's script
    (pipelines/tune/script.py SCRIPT)."""

    spec: Callable  # (job dict, TrialKind, params) -> trialSpec
    describe: Callable  # Param -> its trialParameters[].description
    metrics: Callable  # Search -> additionalMetricNames


def param_ref(name: str) -> str:
    """How a trial template names trial parameter `name`."""
    return "${trialParameters." + name + "}"


def _set_flag(args: list, flag: str, value: str) -> None:
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]


def trial_spec(job: dict, kind: TrialKind, params) -> dict:
    """`job` as Katib's trial template: no name or namespace (Katib sets them), the searched
    flags and the output folder as trial parameters."""
    spec = copy.deepcopy(job)
    for key in ("name", "namespace"):
        spec["metadata"].pop(key, None)
    for args in kind.trainer_args(spec):
        for p in params:
            _set_flag(args, "--" + p.name, param_ref(p.name))
        out = args[args.index("--out") + 1].rstrip("/")
        args[args.index("--out") + 1] = f"{out}/{param_ref(TRIAL_NAME)}"
    return spec


TRAINER = Template(
    spec=trial_spec, describe=lambda p: f"--{p.name} of the trainer",
    metrics=lambda search: [m for m in METRICS if m not in (search.objective, "epoch", "lr")])


def build_experiment(job: dict, kind: TrialKind, search: Search, name: str,
                     namespace: str | None = None, template: Template = TRAINER) -> dict:
    """The Experiment searching `search` over trials that are `job` (a rendered job of `kind`,
    running what `template` says).

    Raises:
        InvalidJobError: a rule of Katib's validating webhook is broken (the message lists all).
    """
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    trial_params = [{"name": p.name, "description": template.describe(p),
                     "reference": p.name} for p in search.params]
    trial_params.append({"name": TRIAL_NAME, "description": "the trial's own output folder",
                         "reference": "${trialSpec.Name}"})
    spec = {
        "objective": {"type": direction(search),
                      "objectiveMetricName": search.objective,
                      "additionalMetricNames": template.metrics(search)},
        "algorithm": {"algorithmName": ALGORITHMS[search.algorithm]},
        "parallelTrialCount": search.parallel,
        "maxTrialCount": search.trials,
        "maxFailedTrialCount": search.max_failed,
        "metricsCollectorSpec": {"collector": {"kind": "StdOut"}},
        "parameters": [p.katib() for p in search.params],
        "trialTemplate": {
            "primaryContainerName": kind.primary_container,
            "primaryPodLabels": dict(kind.primary_pod_labels),
            "successCondition": kind.success_condition,
            "failureCondition": kind.failure_condition,
            "trialParameters": trial_params,
            "trialSpec": template.spec(job, kind, search.params),
        },
    }
    if EARLY_STOPPING[search.early_stopping]:
        spec["earlyStopping"] = {"algorithmName": EARLY_STOPPING[search.early_stopping]}
    experiment = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}
    validate_experiment(experiment)
    example = substituted_trial(experiment, f"{name}{TRIAL_SUFFIX}")
    kind.validate(example, f"a trial of experiment {name!r}")
    return experiment


def substituted_trial(experiment: dict, trial_name: str) -> dict:
    """The trial spec as Katib would create it: every trial parameter replaced (searched ones by
    their feasible space's first value) and the trial's name set."""
    template = experiment["spec"]["trialTemplate"]
    first = {p["name"]: (p["feasibleSpace"].get("list") or [p["feasibleSpace"].get("min")])[0]
             for p in experiment["spec"]["parameters"]}
    text = json.dumps(template["trialSpec"])
    for tp in template["trialParameters"]:
        value = trial_name if tp["reference"] == "${trialSpec.Name}" else first[tp["reference"]]
        text = text.replace(param_ref(tp["name"]), str(value))
    job = json.loads(text)
    job["metadata"]["name"] = trial_name
    return job
