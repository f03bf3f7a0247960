"""What each step of the `image-classification` pipeline does, as ordinary functions.

The KFP components in `pipelines/components.py` are thin shells over these: each component
imports one function from here, calls it with its inputs' local paths and parameters, and logs
what it returns. So everything here runs (and is tested) without KFP. Which option each
parameter is, and its name (those of the Azure ML designer modules kfvision stands in for), is
in pipelines/params.py.
"""

import shutil
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from pipelines.jobs.config import JobConfig, Volume, job_name
from pipelines.params import (
    EXECUTION_MODES,
    JOB_KINDS,
    job_options,
    job_settings,
    parameter_name,
    pipeline_options,
    train_options,
)
from pipelines.s3 import is_s3, split_uri
from pipelines.storage import DATA_MOUNT, new_folder
from trainer.config import TrainConfig
from trainer.errors import InvalidDatasetError, InvalidParameterError, check_choice, ref

JOB_PREFIX = "kfvision-train"
URL_SCHEMES = ("http", "https")
REMOTE_SCHEMES = (*URL_SCHEMES, "s3")  # sources no step needs a path for


def run(step, *args, **kwargs):
    """Call `step`; a kfvision error ends the process with one line saying what to fix (and the
    error's exit code) instead of a traceback, in the step's log and the pipeline's. Options
    are named as the pipeline's parameters."""
    import sys

    from trainer.errors import KfvisionError
    from trainer.exitcodes import error_line

    try:
        return step(*args, **kwargs)
    except KfvisionError as e:
        text = e.named(parameter_name) if isinstance(e, InvalidParameterError) else str(e)
        print(error_line(e, text), file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def job_config(cfg: TrainConfig, *, run_id: str, volumes: tuple = (), env: tuple = (),
               **settings) -> JobConfig:
    """The job of a pipeline run (settings: params.job_settings); validated. (`kfvision job
    render`'s flags give theirs through pipelines.cli.job.job_config_from_args.)

    The job name derives from the run (see pipelines.jobs.config.job_name), so a retried step
    finds its own job again. `volumes`: the PVCs (pipelines.jobs.config.Volume) mounted in
    every pod, none in a local run; `env`: ((name, value), ...) for the training container
    (pipelines.train_step.tracking_env).
    """
    return JobConfig(name=job_name(JOB_PREFIX, run_id), train=cfg, **job_options(**settings),
                     volumes=tuple(volumes), env=tuple(env)).validate()


def resolve_mode(mode: str, environ=None) -> str:
    """'local' or 'cluster'. auto: cluster inside a Kubernetes pod (the KFP backend runs every
    step in one, and Kubernetes sets KUBERNETES_SERVICE_HOST in each), local anywhere else."""
    import os

    check_choice(ref("execution_mode"), mode, EXECUTION_MODES)
    if mode != "auto":
        return mode
    env = os.environ if environ is None else environ
    return "cluster" if env.get("KUBERNETES_SERVICE_HOST") else "local"


def _check_source(name: str, source: str, required: bool, exists: bool) -> None:
    if not source:
        if required:
            raise InvalidParameterError(f"{ref(name)} is empty: give a folder or archive of "
                                        "labelled images (a path this step can read, an "
                                        "http(s) URL or an s3:// URI).")
        return
    if urllib.parse.urlparse(source).scheme.lower() in REMOTE_SCHEMES or not exists:
        return
    if not Path(source).exists():
        raise InvalidDatasetError(
            f"{name} {source} does not exist as this step sees it. Locally give a path on this "
            f"machine; on a cluster an http(s) URL, an s3:// URI, or a path on the data PVC "
            f"(mounted at "
            f"{DATA_MOUNT} when the pipeline is compiled with --data-pvc NAME).")


def job_kinds(job_kind: str, mode: str) -> tuple:
    """The JobKinds `job_kind` may mean in `mode` (local or cluster): auto on a cluster is the
    one the cluster serves (known only there), auto locally a PyTorchJob, as before TrainJobs."""
    from pipelines.jobs.kinds import KINDS, PYTORCHJOB

    check_choice(ref("job_kind"), job_kind, JOB_KINDS)
    if job_kind != "auto":
        return (next(k for k in KINDS.values() if k.kind.lower() == job_kind),)
    return tuple(KINDS.values()) if mode == "cluster" else (PYTORCHJOB,)


def render_job(cfg: JobConfig, kind, runtime: str) -> dict:
    """The job of `kind` (a JobKind) for `cfg`; a TrainJob references the ClusterTrainingRuntime
    `runtime`."""
    from pipelines.jobs.kinds import TRAINJOB

    if kind is TRAINJOB:
        from pipelines.jobs.trainjob.build import Runtime, build_trainjob

        return build_trainjob(cfg, Runtime(runtime).validate())
    from pipelines.jobs.pytorchjob.build import build_pytorchjob

    return build_pytorchjob(cfg)


def check_parameters(*, check_sources: bool = True, **params) -> str:
    """Validate every pipeline parameter before any heavy work; return the model family.

    `params`: every parameter of the pipeline (pipelines.params), by name. check_sources:
    whether the sources must exist here (not when checking a cluster run from outside the
    cluster).
    Raises:
        InvalidParameterError: a value out of range or not one of the choices (the message names
            the parameter and the valid values). InvalidDatasetError: a source that is not there.
    """
    from trainer.model.arch import family_of

    family = family_of(params["model_name"])
    for name in ("train_source", "validation_source", "test_source"):
        _check_source(name, params[name], required=name == "train_source", exists=check_sources)
    fraction = params["fraction"]
    try:
        if not params["validation_source"] and not 0 < fraction < 1:
            raise InvalidParameterError(
                f"{ref('fraction')} = {fraction} is out of range: it must be 0 < "
                f"{ref('fraction')} < 1 (the share of each class kept for training when no "
                f"{ref('validation_source')} is given, e.g. 0.9).")
        mode = resolve_mode(params["execution_mode"])
        cfg = TrainConfig(model="model", train="train", val="val", out="out",
                          **train_options(**params)).validate()
        pvc = params["pvc_name"] if mode == "cluster" else ""
        jobs = job_config(cfg, run_id="check", volumes=(Volume(pvc, DATA_MOUNT),) if pvc else (),
                          **job_settings(**params))
        for kind in job_kinds(params["job_kind"], mode):  # auto on a cluster: either may run
            render_job(jobs, kind, params["trainer_runtime"])
        check_deploy(params)
        pipeline_options()["registry"].check(params.get("registry", "mlflow"))
        check_model_uri(params.get("model_uri", ""))
        if mode == "cluster" and check_sources:  # in a cluster step: what it has mounted
            import os

            from pipelines.storage import check_data_pvc_use

            check_data_pvc_use(params, os.path.ismount(DATA_MOUNT))
    except InvalidParameterError as e:  # named as the pipeline's parameters, not the fields
        raise e.renamed(parameter_name) from e
    return family


def check_model_uri(model_uri: str) -> None:
    """model_uri is '' or an s3:// prefix with a bucket."""
    if not model_uri:
        return
    if not is_s3(model_uri):
        raise InvalidParameterError(f"{ref('model_uri')} = {model_uri!r} is not an s3:// URI: "
                                    "give s3://BUCKET/PREFIX/ (or '' for none).")
    split_uri(model_uri)


def check_deploy(params: dict) -> None:
    """The deploy parameters: the accuracy bar in range; the name a valid InferenceService name
    (checked only when deploying)."""
    from pipelines.params import PipelineInputs
    from pipelines.serve.deploy import DeployConfig
    from trainer.options import options_of

    for name in ("deploy_min_accuracy", "register_min_accuracy"):
        bar = next(o for o in options_of(PipelineInputs) if o.name == name)
        bar.check(params[name])
    if params["register_name"]:
        from pipelines.registry import check_name

        check_name(params["register_name"])
    if params["deploy"]:
        try:
            DeployConfig(name=params["deploy_name"], model="pvc://x", image="x",
                         service_account=params.get("deploy_service_account") or None).check()
        except InvalidParameterError as e:  # named as the pipeline names it: deploy_name
            pipeline = {o.name: o.param for o in options_of(DeployConfig)}
            raise e.renamed(lambda f: pipeline.get(f) or f) from e


def _fetch(url: str, dest: Path) -> Path:
    """Download an http(s) source into dest/, keeping its file name (the archive type)."""
    name = Path(urllib.parse.urlparse(url).path).name or "download"
    target = dest / name
    try:
        with urllib.request.urlopen(url, timeout=60) as r, target.open("wb") as f:  # noqa: S310
            shutil.copyfileobj(r, f, length=1 << 20)
    except OSError as e:  # URLError and HTTPError are OSErrors
        raise InvalidDatasetError(f"cannot download {url} ({e}); check the URL and that this "
                                  "step can reach it.") from e
    return target


def convert_step(source: str, out, labels: str = "", place: Path | None = None) -> dict:
    """Convert a folder, archive, http(s) URL or s3:// URI of images into an image directory at
    `out`, copying no image that is already where the job can read it (see pipelines.storage).

    A folder is referenced where it is (`out` holds the manifest). An archive, downloaded or
    not, is extracted once: into a new folder of `place` (the run's data place, on a cluster),
    and referenced there; with no place (a local run), into `out` itself. A download goes to
    `place` too (a pod's own disk may be small), and is deleted once extracted. An s3:// source
    is fetched into `place/s3-<hash of the URI>` (locally beside `out`), where a retried step
    finds what its first attempt fetched and downloads only the rest (pipelines.datasource).
    `out` also gets `samples.jpg`, a few images of each class, for the KFP UI.

    Returns {"images", "classes", "skipped", "bytes", "images_root", "summary"} for the step's
    log and artifact metadata.
    """
    from trainer.data.convert import convert
    from trainer.data.preview import write_samples

    if is_s3(source) or is_s3(labels):
        report = _convert_s3(source, out, labels, place)
    else:
        report = _convert_local_or_url(source, out, labels, place, convert)
    imdir = write_samples(out)
    return {"images": report.images, "classes": len(report.classes),
            "skipped": len(report.skipped), "bytes": sum(e.bytes for e in imdir.images),
            "images_root": str(imdir.base), "summary": report.summary()}


def _convert_local_or_url(source: str, out, labels: str, place, convert):
    with tempfile.TemporaryDirectory(prefix="kfvision-source-") as tmp:
        src = Path(source)
        if urllib.parse.urlparse(source).scheme in URL_SCHEMES:
            print(f"downloading {source}", flush=True)
            src = _fetch(source, new_folder(place, "download-") if place else Path(tmp))
        extract_to = new_folder(place, "source-") / "images" if place and src.is_file() else None
        try:
            return convert(src, out, labels=labels or None, progress=False,
                           in_place=src.is_dir() or extract_to is not None,
                           extract_to=extract_to)
        finally:
            if src != Path(source):  # our download: extracted (or failed) now
                shutil.rmtree(src.parent, ignore_errors=True)


def _convert_s3(source: str, out, labels: str, place):
    import hashlib

    from pipelines.datasource import fetch_source
    from trainer.data.convert import convert

    key = hashlib.sha256(f"{source}\n{labels}".encode()).hexdigest()[:16]
    here = (place or Path(out).parent) / f"s3-{key}"
    print(f"fetching {source} into {here}", flush=True)
    local = fetch_source(source, here, labels=labels or None, progress=False)
    print(local.summary, flush=True)
    in_place = is_s3(source) or local.src.is_dir()
    return convert(local.src, out, labels=local.labels, progress=False, in_place=in_place,
                   extract_to=local.extract_to, origin=local.origin)


def push_model_step(model_dir, model_uri: str) -> dict:
    """Upload the trained model directory to `model_uri` (s3://, replacing what is there; its
    checkpoints stay behind), for KServe and `--model s3://...`; returns {"model_uri", "files"}."""
    from pipelines.s3sync import push

    keys = push(model_dir, model_uri, skip=("checkpoints",), last="model.json", overwrite=True)
    print(f"pushed {len(keys)} file(s) of the trained model to {model_uri}", flush=True)
    return {"model_uri": model_uri, "files": len(keys)}


def split_step(data, train_out, val_out, fraction: float, random_seed: int) -> dict:
    """Split an image directory (stratified) into two manifests over its images (no copies),
    each with its samples.jpg; returns the image counts of both sides."""
    from trainer.data.preview import write_samples
    from trainer.data.split import split

    counts = split(data, train_out, val_out, fraction=fraction, seed=random_seed, in_place=True)
    for side in (train_out, val_out):
        write_samples(side)
    return {"train_images": sum(counts["first"].values()),
            "validation_images": sum(counts["second"].values())}


def model_step(out, model_name: str, pretrained: bool, zero_init_residual: bool = False,
               memory_efficient: bool = False) -> dict:
    """Write an untrained model directory; returns its spec as a dict."""
    from trainer.model.arch import write_untrained_model

    spec = write_untrained_model(out, model_name, pretrained=pretrained,
                                 zero_init_residual=zero_init_residual,
                                 memory_efficient=memory_efficient)
    return {"arch": spec.arch, "family": spec.family, "pretrained": spec.pretrained}


def score_step(model, data, out_csv) -> dict:
    """Score an image directory with a trained model into a CSV; returns rows and top-1."""
    from trainer.use.score import score

    return score(model, data, out_csv, progress=False)


def evaluate_step(scored_csv, out_dir) -> dict:
    """metrics.json, report.md and confusion_matrix.png of a scored CSV; returns the metrics."""
    from trainer.use.evaluate import evaluate

    return evaluate(scored_csv, out_dir)


def unique_run_key(run_id: str, task_name: str) -> str:
    """What the PyTorchJob's name is derived from: stable across retries of one task of one run,
    different for two runs (or two train tasks of one run)."""
    return f"{run_id}/{task_name}"
