"""The check step: every pipeline parameter validated before any heavy work."""

import urllib.parse
import urllib.request
from pathlib import Path

from kfvision.pipelines.clients.s3 import is_s3, split_uri
from kfvision.pipelines.flow.params import (
    job_settings,
    parameter_ref,
    pipeline_options,
    train_options,
)
from kfvision.pipelines.flow.steps.common import resolve_mode
from kfvision.pipelines.flow.steps.data import URL_SCHEMES
from kfvision.pipelines.flow.steps.train import job_config, job_kinds
from kfvision.pipelines.flow.storage import DATA_MOUNT
from kfvision.pipelines.jobs.config import Volume
from kfvision.pipelines.jobs.render import render_job
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import InvalidDatasetError, InvalidParameterError, ref
from kfvision.trainer.model.spec import model_family

REMOTE_SCHEMES = (*URL_SCHEMES, "s3")  # sources no step needs a path for


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


def check_parameters(*, check_sources: bool = True, store: str = "", **params) -> str:
    """Validate every pipeline parameter before any heavy work; return the model family.

    `params`: every parameter of the pipeline (kfvision.pipelines.flow.params), by name.
    check_sources: whether the sources must exist here (not when checking a cluster run from outside
    the cluster). store: the pipeline's --data-uri ('' for none).
    Raises:
        InvalidParameterError: a value out of range or not one of the choices (the message names
            the parameter and the valid values). InvalidDatasetError: a source that is not there.
    """
    family = model_family(params["model_name"])
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
        check_script(params, exists=check_sources)
        check_deploy(params)
        pipeline_options()["registry"].check(params.get("registry", "mlflow"))
        check_model_uri(params.get("model_uri", ""))
        if mode == "cluster" and check_sources:  # in a cluster step: what it has mounted
            import os

            from kfvision.pipelines.flow.storage import check_data_pvc_use

            check_data_pvc_use(params, os.path.ismount(DATA_MOUNT), has_store=bool(store))
    except InvalidParameterError as e:  # named as the pipeline's parameters, not the fields
        raise type(e)(e.named(parameter_ref)) from e
    return family


def check_script(params: dict, *, exists: bool):
    """The script parameters: none without script_source; with it, an entry of the source (a
    folder here is packed as the train step packs it, and its entry looked for), arguments a
    shell could split, a known launcher running one process per pod under python. Returns the
    folder's snapshot (kfvision.pipelines.script.snapshot.Snapshot) when it packed one, else None.

    Raises:
        InvalidParameterError (InvalidJobError): which parameter is wrong, and what to give.
    """
    from kfvision.pipelines.flow.steps.trainscript import parse_args, parse_entry

    source = params["script_source"]
    pipeline_options()["script_launcher"].check(params["script_launcher"])
    if not source:
        given = [n for n in ("script_entry", "script_args", "script_requirements") if params[n]]
        if given:
            raise InvalidParameterError(f"{ref(given[0])} is set, but {ref('script_source')} is "
                                        "empty: give your script's source, or leave "
                                        f"{ref(given[0])} empty for the built-in trainer.")
        return
    entry = parse_entry(params["script_entry"])
    parse_args(params["script_args"])
    if params["script_launcher"] == "python" and params["procs_per_node"] > 1:
        raise InvalidParameterError(f"{ref('script_launcher')} python runs one process per pod, "
                                    f"not {ref('procs_per_node')} {params['procs_per_node']}; "
                                    "use torchrun for several.")
    if is_s3(source):
        split_uri(source)
        if not source.endswith(".tar.gz"):
            raise InvalidParameterError(f"{ref('script_source')} = {source!r} is not a packed "
                                        "source: give s3://BUCKET/KEY.tar.gz (kfvision job render "
                                        "--source DIR --source-store s3://... uploads one).")
        return
    if not exists:
        return
    if not Path(source).is_dir():
        raise InvalidParameterError(
            f"{ref('script_source')} {source} is not a folder as this step sees it: locally a "
            "folder of this machine; on a cluster an s3:// URI, or a folder on the data PVC "
            f"(mounted at {DATA_MOUNT}) or the run's workspace.")
    from kfvision.pipelines.flow.steps.trainscript import PARAMETERS
    from kfvision.pipelines.script.entry import resolve
    from kfvision.pipelines.script.snapshot import pack

    snap = pack(source)
    resolve(snap.files, source=source, name=PARAMETERS,
            requirements=params["script_requirements"] or None, **entry)
    return snap


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
    from kfvision.pipelines.flow.params import PipelineInputs
    from kfvision.pipelines.serve.deploy import DeployConfig
    from kfvision.trainer.options import options_of

    for name in ("deploy_min_accuracy", "register_min_accuracy"):
        bar = next(o for o in options_of(PipelineInputs) if o.name == name)
        bar.check(params[name])
    if params["register_name"]:
        from kfvision.pipelines.clients.registry import check_name

        check_name(params["register_name"])
    if params["deploy"]:
        try:
            DeployConfig(name=params["deploy_name"], model="pvc://x", image="x",
                         service_account=params.get("deploy_service_account") or None).check()
        except InvalidParameterError as e:  # named as the pipeline names it: deploy_name
            pipeline = {o.name: o.param for o in options_of(DeployConfig)}
            raise e.renamed(lambda f: pipeline.get(f) or f) from e
