"""The train step: render the job, run it here or on the cluster, keep the trained model.

The job is a TrainJob (Kubeflow Trainer v2) or a PyTorchJob (Training Operator v1.9): parameter
`job_kind`; auto asks the cluster which of the two it serves (TrainJob first) and, outside a
cluster, runs a PyTorchJob as before TrainJobs.

    local   (kfvision pipeline run-local, or any run outside Kubernetes): the job runs as local
            processes with the platform's exact environment
            (kfvision.pipelines.jobs.pytorchjob.local, kfvision.pipelines.jobs.trainjob.local),
            reading the step's input paths and writing straight into its Model output.
    cluster (a KFP step in a Kubernetes pod): the job's pods cannot see the step's local artifact
            paths, so the inputs are staged in the run's data place
            (kfvision.pipelines.flow.storage: the KFP workspace, else the data PVC),
            `<place>/jobs/<job>/{model,train,val}`: the untrained model and the two image
            directories' manifests, whose images are already on a volume the job mounts too, at the
            same path (the step's own workspace and data PVC claims, read from its pod). No image is
            copied. The job is submitted through the Kubernetes API
            (kfvision.pipelines.jobs.jobclient.submit: create or re-attach, wait, stream the
            Master's log), and the trained model is copied from the volume into the step's Model
            output, so lineage and the KFP UI keep working.
    store   (a pipeline compiled with --data-uri, either of the above): nothing is staged and no
            volume mounted. The untrained model is pushed to the store and the job's --model,
            --train, --val and --out are the store's URIs, so its pods run the node agent
            (kfvision.pipelines.jobs.storenode) on their own scratch disks, with any number of
            nodes; the trained model is fetched from --out into the Model output.

The job name derives from the KFP run id and task name: a retried step finds its job again. A job
that is still running or has succeeded is re-attached to; one that failed is deleted and created
anew (a retry should train again, not report the old failure).
"""

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import yaml
from kfvision.pipelines.clients.k8s import to_yaml
from kfvision.pipelines.flow.params import JOB_KINDS, job_options
from kfvision.pipelines.flow.steps.common import resolve_mode
from kfvision.pipelines.flow.storage import DATA_MOUNT, data_place, is_mount
from kfvision.pipelines.jobs.config import JobConfig, Volume, job_name
from kfvision.pipelines.jobs.mlflowenv import tracking_env
from kfvision.pipelines.jobs.render import render_job
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import (
    InvalidModelDirectoryError,
    InvalidParameterError,
    StorageError,
    check_choice,
    ref,
)
from kfvision.trainer.fileio import disk_errors

JOB_PREFIX = "kfvision-train"


def job_config(cfg: TrainConfig, *, run_id: str, volumes: tuple = (), env: tuple = (),
               s3_secret: str = "", **settings) -> JobConfig:
    """The job of a pipeline run (settings: params.job_settings); validated. (`kfvision job
    render`'s flags give theirs through kfvision.pipelines.jobs.fromflags.job_config_from_args.)

    The job name derives from the run (see kfvision.pipelines.jobs.config.job_name), so a retried
    step finds its own job again. `volumes`: the PVCs (kfvision.pipelines.jobs.config.Volume)
    mounted in every pod, none in a local run; `env`: ((name, value), ...) for the training
    container (kfvision.pipelines.jobs.mlflowenv.tracking_env); `s3_secret`: the Secret whose
    AWS_* keys the pods of a job on s3:// paths get, by reference.
    """
    store = {"s3_credentials": s3_secret} if s3_secret else {}
    return JobConfig(name=job_name(JOB_PREFIX, run_id), train=cfg, **job_options(**settings),
                     volumes=tuple(volumes), env=tuple(env), **store).validate()


def job_kinds(job_kind: str, mode: str) -> tuple:
    """The JobKinds `job_kind` may mean in `mode` (local or cluster): auto on a cluster is the
    one the cluster serves (known only there), auto locally a PyTorchJob, as before TrainJobs."""
    from kfvision.pipelines.jobs.kinds import KINDS, PYTORCHJOB, named

    check_choice(ref("job_kind"), job_kind, JOB_KINDS)
    if job_kind != "auto":
        return (named(job_kind),)
    return tuple(KINDS.values()) if mode == "cluster" else (PYTORCHJOB,)


JOBS = "jobs"  # the jobs' folders in the run's data place
STAGED_MARK = ".staged"


def train_step(model_dir, train_dir, val_dir, out_dir, job_yaml, *, options: dict,
               settings: dict, run_key: str, mode: str = "auto", pvc_name: str = "",
               kind: str = "auto", runtime: str = "torch-distributed", workspace: str = "",
               store: dict | None = None, s3_secret: str = "", out=None) -> dict:
    """Train as a TrainJob or PyTorchJob and leave the trained model directory at `out_dir`.

    Args:
        model_dir, train_dir, val_dir: the untrained model and image directories (local paths).
        out_dir: where the trained model directory goes (the step's Model output path).
        job_yaml: where the rendered PyTorchJob is written (the step's job artifact).
        options: training options (params.train_options); settings: the job settings
            (params.job_settings: image, nodes, ...); run_key: what the job name derives from.
        mode: auto, local or cluster (steps.resolve_mode); pvc_name: the data PVC (cluster).
        kind: auto, trainjob or pytorchjob (steps.job_kinds); runtime: a TrainJob's runtime.
        workspace: the run's KFP workspace as the step sees it ('' for none).
        store: {"model", "train", "val", "out"}: the job's s3:// URIs (a pipeline compiled with
            --data-uri; train and val already there, model pushed here, out fetched from);
            s3_secret: the Secret the job's pods on a cluster read the store with.
    Returns:
        the trained model's metrics.json (history, best_epoch, final figures).
    Raises:
        InvalidParameterError: bad options or settings. JobFailedError: the job failed.
        KubernetesError: the cluster refused a request.
    """
    out = out or sys.stdout
    mode = resolve_mode(mode)
    kinds = job_kinds(kind, mode)
    run_id = run_key.partition("/")[0]  # steps.unique_run_key: the run's folder, as convert's
    name = job_name(JOB_PREFIX, run_key)  # the run key alone: a retried step finds its job
    if store:  # the job reads and writes the store; nothing is staged, no volume shared
        paths = dict(store)
    elif mode == "cluster":  # the job reads copies staged where its pods see them
        stage = staging_folder(workspace, run_id) / name
        paths = {"model": stage / "model", "train": stage / "train", "val": stage / "val",
                 "out": stage / "trained"}
    else:
        paths = {"model": model_dir, "train": train_dir, "val": val_dir, "out": out_dir}
    cfg = TrainConfig(**{k: str(v) for k, v in paths.items()}, **options).validate()
    # built and validated once, before connecting anywhere; a cluster adds what only it knows
    volumes = data_volumes(pvc_name) if mode == "cluster" and not store else ()
    job = job_config(cfg, run_id=run_key, volumes=volumes, s3_secret=s3_secret if store and
                     mode == "cluster" else "", **settings)
    if store:
        from kfvision.pipelines.flow.steps.store import push_untrained

        push_untrained(model_dir, store["model"])
    if mode == "cluster" and store:
        return _train_from_store(job, kinds, store["out"], out_dir, job_yaml, runtime, run_id,
                                 out)
    if mode == "cluster":
        return _train_on_cluster(job, kinds, stage, model_dir, train_dir, val_dir, out_dir,
                                 job_yaml, pvc_name, runtime, workspace, run_id, out)
    (job_kind,) = kinds
    env = tracking_env(os.environ, kind=job_kind.kind, name=name, run_id=run_id, local=True)
    job = render(replace(job, env=env), job_yaml, job_kind, runtime)
    from kfvision.pipelines.jobs.render import run_local

    what = job_kind.kind
    with tempfile.TemporaryDirectory(prefix=f"{name}-logs-") as logs:
        print(f"running {what} {name} on this machine (kfvision job run-local)", file=out,
              flush=True)
        result = run_local(job, logs, source=f"{what} {name}", out=out)
    print(f"{what} {name} succeeded in {result.seconds:.1f} s", file=out, flush=True)
    if store:
        from kfvision.pipelines.flow.steps.store import fetch_trained

        fetch_trained(store["out"], out_dir)
    return read_metrics(out_dir)


def render(job: JobConfig, job_yaml, kind, runtime: str) -> dict:
    """The manifest of `job` as `kind`, also written to `job_yaml` (the step's job artifact)."""
    job = render_job(job, kind, runtime)
    Path(job_yaml).parent.mkdir(parents=True, exist_ok=True)
    Path(job_yaml).write_text(to_yaml(job, "Rendered by kfvision's train-pytorch-model step; "
                                      "`kubectl apply -f` runs it again."), encoding="utf-8")
    return job


def stage_inputs(stage: Path, inputs: dict) -> None:
    """Copy {"model": dir, ...} to stage/<key>, once: a retried step finds them already there
    (and its job may be reading them), which the marker file tells. An image directory's
    samples.jpg (for the KFP UI) stays behind: the job does not read it."""
    from kfvision.trainer.use.preview import SAMPLES

    if (stage / STAGED_MARK).exists():
        return
    shutil.rmtree(stage, ignore_errors=True)  # a half-finished copy of an interrupted attempt
    with disk_errors(stage):  # a half copy stays unmarked: the next attempt starts it over
        for key, src in inputs.items():
            shutil.copytree(src, stage / key, ignore=shutil.ignore_patterns(SAMPLES))
        (stage / STAGED_MARK).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"), encoding="utf-8")


def staging_folder(workspace: str, run_id: str) -> Path:
    """Where a cluster step stages its job's inputs: `<the run's data place>/jobs`. Raises
    StorageError when the step has neither the workspace nor the data PVC."""
    place = data_place(workspace, run_id, cluster=True, mounted=is_mount, data_mount=DATA_MOUNT)
    if place is None:
        raise StorageError(
            "this step has neither the run's KFP workspace nor the data PVC (at "
            f"{DATA_MOUNT}): on a cluster the job needs one of them to see its data. Compile the "
            "pipeline with a workspace (the default; KFP 2.15+) or with --data-pvc NAME "
            "(docs/pipeline.md, 'Storage'), or run with execution_mode=local.")
    return place / JOBS


def cluster_client(kinds: tuple, out) -> tuple:
    """(a JobClient of the kind to run, that JobKind): of `kinds` (job_kinds), the one the
    cluster serves, TrainJob first."""
    from kfvision.pipelines.jobs.jobclient import connect
    from kfvision.pipelines.jobs.kinds import pick_kind

    client = connect(out=out)
    job_kind = pick_kind(client.api) if len(kinds) > 1 else kinds[0]
    if job_kind is not client.kind:
        client = connect(out=out, kind=job_kind)
    return client, job_kind


def _train_on_cluster(job: JobConfig, kinds: tuple, stage: Path, model_dir, train_dir, val_dir,
                      out_dir, job_yaml, pvc_name, runtime, workspace, run_id, out) -> dict:
    from kfvision.pipelines.jobs.jobclient import submit

    client, job_kind = cluster_client(kinds, out)
    volumes = job_volumes(client, workspace, pvc_name, job.nodes)
    stage_inputs(stage, {"model": model_dir, "train": train_dir, "val": val_dir})
    env = tracking_env(os.environ, kind=job_kind.kind, name=job.name, run_id=run_id,
                       local=False, out=out)
    # the workspace's claim comes from this step's own pod, not from a parameter
    manifest = render(replace(job, volumes=volumes, env=env), job_yaml, job_kind, runtime)
    replace_failed_job(client, job.name, stage / "trained")
    submit(client, manifest, wait=True, poll_s=10.0, logs=True)
    with disk_errors(out_dir):
        shutil.copytree(stage / "trained", out_dir, dirs_exist_ok=True)
    shutil.rmtree(stage, ignore_errors=True)  # the model is in the step's output now
    print(f"copied the trained model into {out_dir}", file=out, flush=True)
    return read_metrics(out_dir)


def _train_from_store(job: JobConfig, kinds: tuple, trained_uri: str, out_dir, job_yaml,
                      runtime, run_id, out) -> dict:
    """The cluster path of a job on s3:// paths: no volume, so no access mode to check (any
    number of nodes); the trained model fetched from `trained_uri` into `out_dir`."""
    from kfvision.pipelines.flow.steps.store import fetch_trained
    from kfvision.pipelines.jobs.jobclient import submit

    client, job_kind = cluster_client(kinds, out)
    env = tracking_env(os.environ, kind=job_kind.kind, name=job.name, run_id=run_id,
                       local=False, out=out)
    manifest = render(replace(job, env=env), job_yaml, job_kind, runtime)
    replace_failed_job(client, job.name, trained_uri)
    submit(client, manifest, wait=True, poll_s=10.0, logs=True)
    fetch_trained(trained_uri, out_dir)
    return read_metrics(out_dir)


def data_volumes(pvc_name: str) -> tuple:
    """The data PVC, when this step has it mounted (the job's pods mount it at the same path)."""
    return (Volume(pvc_name, DATA_MOUNT),) if pvc_name and is_mount(DATA_MOUNT) else ()


def job_volumes(client, workspace: str, pvc_name: str, nodes: int) -> tuple:
    """The PVCs the job's pods mount, at the paths this step sees them at: the data PVC (when
    this step has it) and the run's workspace (its claim read from this step's own pod)."""
    volumes = data_volumes(pvc_name)
    if not workspace:
        return volumes
    pod = os.environ.get("HOSTNAME", "")
    claim = client.own_claims(pod).get(workspace)
    if claim is None:
        raise StorageError(
            f"this step's pod {pod!r} mounts no PVC at {workspace}, the run's KFP workspace, so "
            "the job could not see the run's data. Is the KFP backend 2.15 or later?")
    modes = client.access_modes(claim) if nodes > 1 else []
    if nodes > 1 and "ReadWriteMany" not in modes:
        raise InvalidParameterError(
            f"nodes = {nodes}, but the run's workspace (PVC {claim}) is {'/'.join(modes)}: the "
            "job's nodes could not all mount it. Compile the pipeline with --workspace-access "
            "ReadWriteMany (and a storage class that offers it), or train on one node.")
    return (*volumes, Volume(claim, workspace))


def replace_failed_job(client, name: str, partial_out, poll_s: float = 2.0,
                       timeout_s: float = 120.0) -> None:
    """Delete a Failed job of this name (and its partial output: a folder, or an s3:// prefix
    with the checkpoints it would resume from) so submit creates it anew."""
    from kfvision.pipelines.clients.k8s import KubernetesError
    from kfvision.pipelines.jobs.jobclient import job_state

    try:
        job = client.get(name)
    except KubernetesError as e:
        if e.status == 404:
            return  # no job yet: the usual case
        raise
    if job_state(job)[0] != "Failed":
        return
    client.say(f"{client.kind.kind} {client.namespace}/{name} failed in an earlier attempt of "
               "this step: deleting it to train again")
    client.delete(name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client.get(name)
        except KubernetesError as e:
            if e.status == 404:
                from kfvision.pipelines.flow.steps.store import remove

                remove(partial_out)
                return
            raise
        time.sleep(poll_s)
    raise KubernetesError(f"{client.kind.kind} {client.namespace}/{name} was deleted but is "
                          f"still there after {timeout_s:g} s; delete it by hand (kfvision job "
                          f"delete {name}) and retry the step.")


def read_metrics(model_dir) -> dict:
    """The trained model directory's metrics.json."""
    path = Path(model_dir) / "metrics.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidModelDirectoryError(
            f"{path}, the trained model directory's metrics, cannot be read after training "
            f"({e}); the job's log above says why.") from e


def job_summary(job_yaml) -> dict:
    """Kind, name, nodes and processes of a rendered job (for the artifact's metadata)."""
    job = yaml.safe_load(Path(job_yaml).read_text(encoding="utf-8"))
    spec = job["spec"]
    if "trainer" in spec:  # a TrainJob
        nodes, procs = spec["trainer"]["numNodes"], spec["trainer"]["numProcPerNode"]
    else:
        nodes = sum(s.get("replicas", 1) for s in spec["pytorchReplicaSpecs"].values())
        procs = spec["nprocPerNode"]
    return {"kind": job["kind"], "name": job["metadata"]["name"], "nodes": nodes,
            "procs_per_node": procs}
