"""Run the `image-classification` pipeline on this machine with KFP's local runner.

    from kfvision.pipelines.flow.localrun import run_local_pipeline
    run = run_local_pipeline({"train_source": "photos/", "epochs": 3}, "build/pipeline")
    print(run.artifacts["train-pytorch-model"]["trained_model"])

Every component runs as a subprocess of this Python (kfp.local.SubprocessRunner(use_venv=False):
kfvision and its dependencies are installed here, nothing is pip-installed), its artifacts under
`<out>/image-classification-<timestamp>/<task>/<output>`. The train step sees no Kubernetes and
runs its job as local processes (with job_kind auto a PyTorchJob,
kfvision.pipelines.jobs.pytorchjob.local; with trainjob a TrainJob,
kfvision.pipelines.jobs.trainjob.local). The pipeline runs without a KFP workspace
(kfvision.pipelines.flow.storage.LOCAL): kfp.local deletes its workspace folder when the run ends,
and the image directories a run leaves behind reference their images, so a source folder is
referenced where it is and an archive is extracted into the convert step's own output. With
`data_uri` (`kfvision pipeline run-local --data-uri s3://...`) it is the pipeline compiled with
that store: the steps and the job pass everything through object storage, as on a cluster
without shared volumes.

kfp 2.17's local runner runs dsl.If/dsl.Else and merges *parameters* of dsl.OneOf, but refuses a
dsl.OneOf of *artifacts* ("Expected 1 artifact in ArtifactSelectorSpec", in
kfp/local/orchestrator/orchestrator_utils.py), which the KFP backend supports.
support_oneof_artifacts() gives its DAG-output lookup the rule it already applies to parameters:
the one branch that ran gives the value. Nothing else of kfp.local is changed.
"""

import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from kfvision.trainer.errors import KfvisionError

OUTPUT_FILE = "executor_output.json"


class PipelineFailedError(KfvisionError):
    """A step of a local pipeline run failed (its log above says why)."""

    exit_code = 1


@dataclass
class LocalPipelineRun:
    """Where a local run put everything: {task: {output name: path}}, and how long it took."""

    root: Path
    seconds: float
    artifacts: dict = field(default_factory=dict)


def _oneof_artifacts(cls, dag_outputs_spec, io_store) -> dict:
    outputs = {}
    for key, spec in dag_outputs_spec.artifacts.items():
        found = []
        for selector in spec.artifact_selectors:
            try:
                found.append(io_store.get_task_output(selector.producer_subtask,
                                                      selector.output_artifact_key))
            except ValueError:  # that branch did not run (kfp's own rule for parameters)
                continue
        if len(found) != 1:
            raise ValueError(f"dsl.OneOf output {key!r}: {len(found)} branches produced it; "
                             "expected exactly 1.")
        outputs[key] = found[0]
    return outputs


def support_oneof_artifacts() -> None:
    """Let kfp.local resolve a dsl.OneOf of artifacts (see the module docstring)."""
    from kfp.local.orchestrator import orchestrator_utils

    utils = orchestrator_utils.OrchestratorUtils
    if getattr(utils.get_dag_output_artifacts, "__func__", None) is not _oneof_artifacts:
        utils.get_dag_output_artifacts = classmethod(_oneof_artifacts)


def task_artifacts(run_dir: Path) -> dict:
    """{task folder: {output name: path}} of a local run folder."""
    out = {}
    for task in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        outputs = {p.name: p for p in sorted(task.iterdir()) if p.name != OUTPUT_FILE}
        if outputs:
            out[task.name] = outputs
    return out


def local_arguments(arguments: dict) -> dict:
    """`arguments` with execution_mode auto made local: a local run trains locally, even inside
    a pod (a Kubeflow notebook) where auto would pick the cluster."""
    arguments = dict(arguments)
    if arguments.get("execution_mode", "auto") == "auto":
        arguments["execution_mode"] = "local"
    return arguments


def run_local_pipeline(arguments: dict, out, data_uri: str = "") -> LocalPipelineRun:
    """Validate `arguments`, then run the whole pipeline locally; artifacts go under `out`;
    `data_uri`: the store the steps and the job pass everything through ('' for none).

    Raises:
        InvalidParameterError, InvalidDatasetError: bad arguments (nothing has run).
        PipelineFailedError: a step failed.
    """
    from kfp import local

    from kfvision.pipelines.flow.pipeline import PIPELINE_NAME, build_pipeline, parameter_defaults
    from kfvision.pipelines.flow.steps.check import check_parameters
    from kfvision.pipelines.flow.storage import LOCAL, check_data_pvc_use, check_store_uri

    arguments = local_arguments(arguments)
    params = {**parameter_defaults(), **arguments}
    check_parameters(**params)
    storage = LOCAL
    if data_uri:
        storage = replace(LOCAL, data_uri=check_store_uri(data_uri))
        check_data_pvc_use({"script_source": params["script_source"]}, True, has_store=True)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in out.iterdir()}
    support_oneof_artifacts()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(out),
               raise_on_error=True)
    start = time.monotonic()
    with warnings.catch_warnings():
        # The image parameter stands in for a container image kfp.local does not use, and
        # resource requests have no local effect: both are said once, in docs/pipeline.md.
        warnings.filterwarnings("ignore", message="You may be attemping", category=RuntimeWarning)
        warnings.filterwarnings("ignore", message=".*no effect in the current local runner")
        try:
            build_pipeline(storage)(**arguments)
        except RuntimeError as e:  # kfp.local's "finished with status FAILURE. Inner task ..."
            raise PipelineFailedError(f"the local pipeline run failed: {e} The failing step's "
                                      f"log is above; its outputs are under {out}.") from e
    runs = sorted(p for p in out.iterdir() if p.is_dir() and p.name not in before
                  and p.name.startswith(PIPELINE_NAME))
    if not runs:
        raise PipelineFailedError(f"the local run wrote no run folder under {out}.")
    return LocalPipelineRun(runs[-1], time.monotonic() - start, task_artifacts(runs[-1]))


def find(run: LocalPipelineRun, task_prefix: str, output: str) -> Path:
    """The path of `output` of the (one) task whose folder starts with `task_prefix`."""
    hits = [o[output] for t, o in run.artifacts.items()
            if t.startswith(task_prefix) and output in o]
    if len(hits) != 1:
        raise PipelineFailedError(f"{run.root}: expected one {task_prefix} task with output "
                                  f"{output!r}, found {len(hits)}.")
    return hits[0]


def _deploy_lines(run: LocalPipelineRun) -> list:
    """The deploy step's figures (none when the run had deploy off)."""
    import json

    if not any(t.startswith("deploy-model") for t in run.artifacts):
        return []
    f = json.loads((find(run, "deploy-model", "deployment") / "figures.json")
                   .read_text(encoding="utf-8"))
    if not f["deployed"]:
        return [f"  deploy      {f['reason']}"]
    return [f"  deploy      served locally by `kfvision serve`: {f['images']} images over v1 "
            f"({f['v1_images_per_s']:.0f} images/s) and v2 ({f['v2_images_per_s']:.0f} "
            f"images/s), labels equal the scored ones; server ready in "
            f"{f['server_start_s']:.1f} s"]


def _training_line(trained: Path) -> str:
    """The built-in trainer's figures, or what your script was (its model folder's
    kfvision-source.json, pipelines/contract.py)."""
    import json
    import shlex

    from kfvision.pipelines.contract import PROVENANCE

    if (trained / PROVENANCE).is_file():
        ran = json.loads((trained / PROVENANCE).read_text(encoding="utf-8"))
        return (f"  training    your script {shlex.join([ran['entry'], *ran['args']])} (source "
                f"sha256 {ran['source_sha256'][:12]})")
    metrics = json.loads((trained / "metrics.json").read_text(encoding="utf-8"))
    final = metrics["final"]
    return (f"  training    best epoch {metrics['best_epoch']} of {metrics['epochs_run']}: "
            f"validation top-1 {final['val_top1']:.4f}, top-5 {final['val_top5']:.4f}, loss "
            f"{final['val_loss']:.4f}, {final['train_images_per_sec']:.0f} train images/s")


def summary(run: LocalPipelineRun) -> str:
    """The evaluation's headline figures and where every artifact of a local run is."""
    import json

    evaluation = json.loads((find(run, "evaluate-model", "evaluation") / "metrics.json")
                            .read_text(encoding="utf-8"))
    lines = [f"pipeline finished in {run.seconds:.0f} s; outputs in {run.root}",
             _training_line(find(run, "train-pytorch-model", "trained_model")),
             f"  evaluation  {evaluation['rows']} images: accuracy {evaluation['accuracy']:.4f}, "
             f"top-{evaluation['top_k']} {evaluation['top5_accuracy']:.4f}, macro F1 "
             f"{evaluation['macro_avg']['f1']:.4f}", *_deploy_lines(run), "artifacts"]
    for task, outputs in run.artifacts.items():
        for name, path in outputs.items():
            lines.append(f"  {task + ' / ' + name:<46} {path}")
    return "\n".join(lines)
