"""`kfvision register`: a trained model directory as a version in MLflow's registry or in
Kubeflow's Model Registry (pipelines/clients/registry.py; docs/tracking.md); any other file or
folder a job wrote as a version marked not servable (pipelines/script/jobmodel.py)."""

import os

from kfvision.pipelines.clients import registry
from kfvision.trainer.options import HelpFormatter


def _register(args) -> int:
    from kfvision.pipelines.clients.models import resolve_model

    registry.check_name(args.name)
    kind = registry.check_registry(args.registry)
    if kind == "kubeflow" and not args.registry_url:
        from kfvision.trainer.errors import InvalidParameterError

        raise InvalidParameterError("--registry kubeflow needs --registry-url "
                                    "(https://HOST[:PORT] of the Model Registry).")
    env = {**os.environ, **({"MLFLOW_TRACKING_URI": args.tracking_uri} if args.tracking_uri
                            else {})}
    model = resolve_model(args.model, environ=env)  # a registered or pushed model: its copy
    from kfvision.pipelines.script import jobmodel

    kubeflow = {} if kind == "mlflow" else {
        "storage_uri": args.storage_uri, "url": args.registry_url,
        "author": args.author or os.environ.get("USER", "kfvision"),
        "token": os.environ.get(registry.REGISTRY_TOKEN)}
    got = jobmodel.register(model, args.name, job=args.job, registry_kind=kind,
                            description=args.description, tracking_uri=args.tracking_uri,
                            run_id=args.run_id, **kubeflow)
    if kind == "mlflow":
        where = f"MLflow at {args.tracking_uri or os.environ.get('MLFLOW_TRACKING_URI')}"
        uri = f"models:/{got['name']}/{got['version']}"
    else:
        where = f"the Kubeflow Model Registry at {args.registry_url}"
        uri = f"model-registry://{got['name']}/{got['version']}"
    state = "registered" if got["created"] else "already registered (same content)"
    job = f" from job {got['job']}" if got["job"] else ""
    print(f"{state}: {args.name} version {got['version']}{job} in {where}; use it as {uri}")
    if not got["servable"]:
        print(f"not servable: {got['why']}. {jobmodel.serve_needs(model)}")
    return 0


def register(sub, help: str) -> None:
    r = sub.add_parser("register", help=help, formatter_class=HelpFormatter)
    r.add_argument("--model", required=True, help="model directory, its s3://, models:/ or "
                   "model-registry:// URI, or a file or folder a job wrote")
    r.add_argument("--name", required=True, help="registered model name")
    r.add_argument("--registry", default=registry.REGISTRIES[0],
                   help=f"one of {', '.join(registry.REGISTRIES)} "
                   f"(default: {registry.REGISTRIES[0]})")
    r.add_argument("--description", default="", help="description of the version")
    r.add_argument("--tracking-uri", help="MLflow server (default: MLFLOW_TRACKING_URI)")
    r.add_argument("--job", help="the job the model came from (default: what `kfvision job "
                   "download` recorded)")
    r.add_argument("--run-id", help="MLflow run the model came from (default: the script job's "
                   "run, else a new one)")
    r.add_argument("--registry-url", help="Kubeflow Model Registry: https://HOST[:PORT] "
                   "(token: KFVISION_REGISTRY_TOKEN)")
    r.add_argument("--storage-uri", help="Kubeflow Model Registry: where KServe reads this "
                   "model (s3://BUCKET/PATH or pvc://CLAIM/PATH)")
    r.add_argument("--author", help="Kubeflow Model Registry: author (default: $USER)")
    r.set_defaults(func=_register)
