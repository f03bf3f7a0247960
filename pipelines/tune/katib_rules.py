"""The rules of Katib's validating webhook for Experiments (kubeflow/katib v0.19
`pkg/webhook/v1beta1/experiment/validator/validator.go`) that can be checked without a cluster,
plus the name limit that keeps trial and pod names valid. A broken rule is named with its field,
as the webhook would name it, so `kubectl apply` never is the first to say so.
"""

import json
import re

from kfvision.pipelines.jobs.errors import InvalidJobError

# Katib's names, from kubeflow/katib tag v0.19.0 (docs/upstream.md lists them with their files):
# pkg/apis/controller/experiments/v1beta1/ (group, version, kinds), pkg/controller.v1beta1/consts/
# const.go (LabelExperimentName: the label on an Experiment's trials).
GROUP, VERSION = "kubeflow.org", "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND, TRIAL_KIND = "Experiment", "Trial"
EXPERIMENT_LABEL = "katib.kubeflow.org/experiment"
MAX_NAME = 40  # Katib names trials <experiment>-<8 random>; the job's pods add their own suffixes
ALGORITHM_NAMES = ("random", "tpe", "multivariate-tpe", "grid", "bayesianoptimization",
                   "hyperband", "cmaes", "sobol", "enas", "darts", "pbt")
EARLY_STOPPING_NAMES = ("medianstop",)
PARAMETER_TYPES = ("int", "double", "categorical", "discrete")
DISTRIBUTIONS = ("uniform", "logUniform", "normal", "logNormal")
# the kinds validateMetricsCollector accepts (v0.19.0 pkg/apis/controller/common/v1beta1/
# common_types.go CollectorKind; "None" is not one: the webhook refuses it)
COLLECTORS = ("StdOut", "File", "TensorFlowEvent", "PrometheusMetric", "Custom", "Push")
# (the StdOut collector's default filter: pipelines/jobs/metriclines.py, which progress shares)
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_PARAM_REF = re.compile(r"\$\{trialParameters\..+?\}")
_META_REF = re.compile(r"\$\{trialSpec\.(.+?)\}")
_META_KEYS = ("Name", "Namespace", "Kind", "APIVersion", "Labels", "Annotations")


def _counts(spec: dict) -> list:
    problems = []
    most, failed, parallel = (spec.get(k) for k in ("maxTrialCount", "maxFailedTrialCount",
                                                     "parallelTrialCount"))
    if failed is not None and failed < 0:
        problems.append("spec.maxFailedTrialCount: should not be less than 0")
    for key, value in (("maxTrialCount", most), ("parallelTrialCount", parallel)):
        if value is not None and value <= 0:
            problems.append(f"spec.{key}: must be greater than 0")
    for key, value in (("maxFailedTrialCount", failed), ("parallelTrialCount", parallel)):
        if value is not None and most is not None and value > most:
            problems.append(f"spec.{key}: should be less than or equal to spec.maxTrialCount")
    return problems


def _objective_and_algorithms(spec: dict) -> list:
    problems = []
    obj = spec.get("objective") or {}
    if obj.get("type") not in ("minimize", "maximize"):
        problems.append("spec.objective.type: must be minimize or maximize")
    if not obj.get("objectiveMetricName"):
        problems.append("spec.objective.objectiveMetricName: must be specified")
    if obj.get("objectiveMetricName") in obj.get("additionalMetricNames", []):
        problems.append("spec.objective.additionalMetricNames: should not contain "
                        "spec.objective.objectiveMetricName")
    if (spec.get("algorithm") or {}).get("algorithmName") not in ALGORITHM_NAMES:
        problems.append(f"spec.algorithm.algorithmName: one of {', '.join(ALGORITHM_NAMES)}")
    if "earlyStopping" in spec and \
            spec["earlyStopping"].get("algorithmName") not in EARLY_STOPPING_NAMES:
        problems.append("spec.earlyStopping.algorithmName: must be medianstop")
    if spec.get("metricsCollectorSpec", {}).get("collector", {}).get("kind") not in COLLECTORS:
        problems.append("spec.metricsCollectorSpec.collector.kind: invalid metrics collector kind")
    return problems


def _parameters(params: list) -> list:
    if not params:
        return ["spec.parameters: must be specified"]
    problems = []
    for i, p in enumerate(params):
        where, space = f"spec.parameters[{i}]", p.get("feasibleSpace") or {}
        if p.get("parameterType") not in PARAMETER_TYPES:
            problems.append(f"{where}.parameterType: {p.get('parameterType')} is not supported")
        if space.get("distribution", "uniform") not in DISTRIBUTIONS:
            problems.append(f"{where}.feasibleSpace.distribution: not supported")
        if any(not isinstance(v, str) for k in ("min", "max", "step") if k in space
               for v in [space[k]]) or not all(isinstance(v, str) for v in space.get("list", [])):
            problems.append(f"{where}.feasibleSpace: values must be strings")
        if not space:
            problems.append(f"{where}.feasibleSpace: must be specified")
        elif p.get("parameterType") in ("int", "double"):
            if space.get("list"):
                problems.append(f"{where}.feasibleSpace.list: not supported for this type")
            if not space.get("min") or not space.get("max"):
                problems.append(f"{where}.feasibleSpace.max or min: must be specified")
        elif any(k in space for k in ("min", "max", "step")):
            problems.append(f"{where}.feasibleSpace: .max, .min and .step are not supported for "
                            "categorical or discrete parameters")
    return problems


def _trial_template(spec: dict) -> list:
    t = spec.get("trialTemplate")
    if not t:
        return ["spec.trialTemplate: must be specified"]
    problems = []
    if not t.get("primaryContainerName"):
        problems.append("spec.trialTemplate.primaryContainerName: must be specified")
    if not t.get("successCondition") or not t.get("failureCondition"):
        problems.append("spec.trialTemplate: successCondition and failureCondition must be "
                        "specified")
    if t.get("trialParameters") is None or "trialSpec" not in t:
        return [*problems, "spec.trialTemplate: trialParameters and trialSpec must be specified"]
    names = {p["name"] for p in spec.get("parameters", [])}
    text, seen, refs = json.dumps(t["trialSpec"]), set(), set()
    for i, tp in enumerate(t["trialParameters"]):
        where, name, ref = f"spec.trialTemplate.trialParameters[{i}]", tp.get("name"), \
            tp.get("reference")
        if not name or not ref or "{" in name or "}" in name:
            problems.append(f"{where}: name and reference must be specified, without '{{' '}}'")
            continue
        if name in seen or ref in refs:
            problems.append(f"{where}: name {name} or reference {ref} is duplicated")
            continue
        seen.add(name)
        refs.add(ref)
        meta = _META_REF.fullmatch(ref)
        is_meta = meta is not None and (meta.group(1) in _META_KEYS or
                                        re.fullmatch(r"(Labels|Annotations)\[.+\]",
                                                     meta.group(1)) is not None)
        if not is_meta and ref not in names:
            problems.append(f"{where}.reference: {ref} does not exist in spec.parameters")
        placeholder = "${trialParameters." + name + "}"
        if placeholder not in text:
            problems.append(f"{where}.name: {name} not found in spec.trialTemplate")
        text = text.replace(placeholder, "test-value")
    left = _PARAM_REF.findall(text)
    if left:
        problems.append(f"spec.trialTemplate: {left} not found in trialParameters")
    job = json.loads(text)
    if job.get("metadata", {}).get("name") or job.get("metadata", {}).get("namespace"):
        problems.append("spec.trialTemplate: metadata.name and metadata.namespace must be "
                        "omitted")
    if not job.get("apiVersion") or not job.get("kind"):
        problems.append("spec.trialTemplate: apiVersion and kind must be specified")
    return problems


def experiment_problems(exp: dict) -> list:
    """Every rule `exp` breaks, as `field: what` lines (empty: none)."""
    name, spec = exp.get("metadata", {}).get("name", ""), exp.get("spec", {})
    problems = []
    if not _NAME.fullmatch(name or ""):
        problems.append(f"metadata.name {name!r}: lower-case letters, digits and '-', starting "
                        "with a letter and ending with a letter or digit")
    if len(name or "") > MAX_NAME:
        problems.append(f"metadata.name {name!r}: at most {MAX_NAME} characters (the trials' "
                        "and their pods' names grow from it)")
    return [*problems, *_counts(spec), *_objective_and_algorithms(spec),
            *_parameters(spec.get("parameters")), *_trial_template(spec)]


def validate_experiment(exp: dict, source: str = "the rendered Experiment") -> dict:
    """Raise InvalidJobError listing every rule `exp` breaks; return `exp` otherwise."""
    problems = experiment_problems(exp)
    if problems:
        lines = "\n  - ".join(problems)
        raise InvalidJobError(f"{source} would be refused by Katib's webhook:\n  - {lines}")
    return exp
