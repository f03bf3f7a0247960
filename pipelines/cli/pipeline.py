"""`kfvision pipeline compile | submit | run-local` and `kfvision demo`: the KFP pipeline from the
command line.

Every parameter of the `image-classification` pipeline is a flag (`train_source` is
`--train-source`), with the pipeline's own default, so the three commands take the same
arguments as the KFP UI's run form and `kfp run create ... key=value`.
"""

import argparse
from pathlib import Path

from kfvision.trainer.options import HelpFormatter, add_flags

EPILOG = """\
examples:
  kfvision pipeline compile -o pipeline.yaml            # upload in the KFP UI, or:
  kfp run create -e digits -f pipeline.yaml train_source=https://example.com/digits.tar.gz
  kfvision pipeline submit --endpoint http://localhost:8080 --experiment digits \\
      --data-pvc kfvision-data --train-source /kfvision-data/photos --gpus-per-node 1
  kfvision pipeline run-local --train-source photos/ --epochs 3   # this machine, no cluster
See docs/pipeline.md.
"""


def add_parameter_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per pipeline parameter (kfvision.pipelines.flow.params), with the pipeline's
    default."""
    from kfvision.pipelines.flow.params import pipeline_options
    from kfvision.pipelines.flow.pipeline import parameter_defaults

    options = pipeline_options()
    defaults = parameter_defaults()
    add_flags(parser.add_argument_group("pipeline parameters"),
              [options[name] for name in defaults], pipeline=defaults)


def pipeline_arguments(args) -> dict:
    """The pipeline's arguments from parsed flags (only those given or with a default)."""
    from kfvision.pipelines.flow.pipeline import parameter_defaults

    return {n: getattr(args, n) for n in parameter_defaults() if getattr(args, n) is not None}


def add_storage_flags(parser: argparse.ArgumentParser, only: tuple = ()) -> None:
    """The compile-time storage flags (kfvision.pipelines.flow.storage.Storage); `only`: those
    fields alone."""
    from kfvision.pipelines.flow.storage import Storage
    from kfvision.trainer.options import options_of

    add_flags(parser.add_argument_group(
        "storage (compiled in: where a run's data lives on the cluster; docs/pipeline.md, "
        "'Storage')"), [o for o in options_of(Storage) if not only or o.name in only])


def storage_of(args):
    from kfvision.pipelines.flow.storage import Storage
    from kfvision.trainer.options import options_of

    return Storage(**{o.name: getattr(args, o.name) for o in options_of(Storage)})


def _compile(args) -> int:
    from kfvision.pipelines.flow.pipeline import compile_pipeline

    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    compile_pipeline(args.output, image=args.image, storage=storage_of(args))
    print(f"wrote the image-classification pipeline to {args.output}: upload it in the KFP UI, "
          f"or `kfp run create -e EXPERIMENT -f {args.output} train_source=...`")
    return 0


def validate_for_cluster(arguments: dict) -> None:
    """Check a cluster run's arguments here before submitting (sources are not checked: they
    are paths on the cluster's PVC or URLs, not files of this machine)."""
    from kfvision.pipelines.flow.pipeline import parameter_defaults
    from kfvision.pipelines.flow.steps.check import check_parameters

    params = {**parameter_defaults(), **arguments}
    if params["execution_mode"] == "auto":
        params["execution_mode"] = "cluster"  # what auto resolves to inside the cluster's pods
    check_parameters(**params, check_sources=False)


def local_script_source(arguments: dict, store: str | None):
    """The snapshot of the script_source folder of this machine that `submit` must upload to
    `store` (no step of a cluster run can see this machine), packed as the train step packs it
    and its entry and requirements looked for; or None: no script, an s3:// URI, or a path that
    is not a folder here or is on the data PVC (the cluster's to read).

    Raises:
        InvalidParameterError: such a folder without `store`; `store` with no such folder; an
            entry or requirements file that is not in the folder.
    """
    from kfvision.pipelines.clients.s3 import is_s3
    from kfvision.pipelines.flow.storage import DATA_MOUNT
    from kfvision.trainer.errors import InvalidParameterError, ref

    source = arguments.get("script_source") or ""
    on_pvc = source == DATA_MOUNT or source.startswith(DATA_MOUNT + "/")
    local = bool(source) and not is_s3(source) and not on_pvc and Path(source).is_dir()
    if local and not store:
        raise InvalidParameterError(
            f"{ref('script_source')} {source} is a folder of this machine, which no step of a "
            "cluster run can read: add --source-store s3://BUCKET/PREFIX to upload it (packed, "
            f"as PREFIX/<sha256>.tar.gz), or give a folder on the data PVC ({DATA_MOUNT}/...).")
    if store and not local:
        what = f"{ref('script_source')} {source!r} is not one" if source else \
            f"no {ref('script_source')} is given"
        raise InvalidParameterError(f"--source-store uploads a {ref('script_source')} folder of "
                                    f"this machine, and {what}: leave --source-store out.")
    if not local:
        return None
    from kfvision.pipelines.flow.pipeline import parameter_defaults
    from kfvision.pipelines.flow.steps.check import check_script

    return check_script({**parameter_defaults(), **arguments}, exists=True)


def upload_script_source(arguments: dict, snap, store: str) -> str:
    """Upload the snapshot `snap` of script_source's folder to `store` as PREFIX/<sha256>.tar.gz
    (unless that object is there); script_source becomes its URI. Returns the line that says
    so."""
    from kfvision.pipelines.script.assemble import ship
    from kfvision.pipelines.script.manifest import choose_transport

    transport = choose_transport(snap, store, None)
    done = ship(snap, transport, None)
    line = (f"script_source {arguments['script_source']}: {len(snap.files)} files, "
            f"{snap.size / 2**20:.2f} MiB packed, {done}")
    arguments["script_source"] = transport.where
    return line


HEALTHZ = "/apis/v2beta1/healthz"  # what kfp.Client asks first, too
CHECK_ENDPOINT = ("the endpoint's address, and that the port-forward to it is running "
                  "(kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80)")
CHECK_AUTH = ("a multi-user Kubeflow needs a token: --token, --token-file (e.g. a service "
              "account token) or --cookies (the authservice session cookie of a browser login)")


def _read_token(path: str | None) -> str | None:
    if not path:
        return None
    from kfvision.trainer.errors import InvalidParameterError

    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise InvalidParameterError(f"cannot read --token-file {path}: {e.strerror or e}") from e


def _submit(args) -> int:
    import tempfile
    import warnings

    import kfp
    from kfvision.pipelines.clients.endpoints import probe, talking_to
    from kfvision.pipelines.flow.pipeline import compile_pipeline

    arguments = pipeline_arguments(args)
    validate_for_cluster(arguments)
    storage = storage_of(args).validate()
    storage.check_arguments(arguments)
    if storage.data_pvc and not arguments.get("pvc_name"):  # the flags' default is the
        arguments["pvc_name"] = storage.data_pvc  # uncompiled one: ''; the run mounts this
    script = local_script_source(arguments, args.source_store)
    token = args.token or _read_token(args.token_file)
    warnings.filterwarnings("ignore", message="This client only works with Kubeflow Pipeline",
                            category=FutureWarning)  # kfp's note on every start; we need v2 too
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if args.cookies:
        headers["Cookie"] = args.cookies
    probe(args.endpoint, HEALTHZ, "the KFP API", CHECK_ENDPOINT, CHECK_AUTH,
          headers=headers, cafile=args.ssl_ca_cert)
    if script:  # uploaded once the endpoint answers, before the run that reads it
        print(upload_script_source(arguments, script, args.source_store), flush=True)
    with talking_to(args.endpoint, "the KFP API", check=CHECK_ENDPOINT, auth_check=CHECK_AUTH), \
            tempfile.TemporaryDirectory(prefix="kfvision-pipeline-") as tmp:
        client = kfp.Client(host=args.endpoint, namespace=args.namespace, existing_token=token,
                            cookies=args.cookies, ssl_ca_cert=args.ssl_ca_cert)
        package = Path(tmp) / "pipeline.yaml"
        compile_pipeline(package, storage=storage)
        run = client.create_run_from_pipeline_package(
            str(package), arguments=arguments, run_name=args.run_name,
            experiment_name=args.experiment, namespace=args.namespace)
    url = f"{args.endpoint.rstrip('/')}/#/runs/details/{run.run_id}"
    print(f"submitted run {run.run_id} to {args.endpoint} (experiment {args.experiment}): {url}",
          flush=True)
    if args.wait:
        from kfvision.pipelines.flow.runwait import wait_run

        with talking_to(args.endpoint, "the KFP API", check=CHECK_ENDPOINT,
                        auth_check=CHECK_AUTH):
            wait_run(client, run.run_id, url, timeout_s=args.timeout, poll_s=args.poll,
                     say=lambda line: print(line, flush=True))
        print(f"run {run.run_id} succeeded: {url}")
    return 0


def _run_local(args) -> int:
    from kfvision.pipelines.flow.localrun import run_local_pipeline, summary

    run = run_local_pipeline(pipeline_arguments(args), args.out, data_uri=args.data_uri)
    print(summary(run))
    return 0


def _demo(args) -> int:
    from kfvision.pipelines.flow.demo import run_demo

    return run_demo(args.out, epochs=args.epochs)


def register_demo(subparsers, help: str) -> None:
    """Add `kfvision demo` (cheap: the pipeline is imported when it runs)."""
    d = subparsers.add_parser("demo", help=help, formatter_class=HelpFormatter)
    d.add_argument("--out", default="build/demo", help="working folder (replaced)")
    d.add_argument("--epochs", type=int, default=15, help="training epochs")
    d.set_defaults(func=_demo)


def register(subparsers, help: str) -> None:
    """Add `kfvision pipeline ...` to the `kfvision` command line's subparsers."""
    from kfvision.pipelines.cli.clusterargs import TARGET, add_cluster_flags
    from kfvision.pipelines.flow.components import DEFAULT_IMAGE

    p = subparsers.add_parser(
        "pipeline", help=help,
        description="The image-classification KFP v2 pipeline: convert -> split -> model -> "
        "train (a TrainJob or PyTorchJob: job_kind) -> score -> evaluate -> register "
        "(register_name) -> deploy (deploy).", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="pipeline_command", required=True, metavar="ACTION")
    fmt = HelpFormatter
    c = sub.add_parser("compile", formatter_class=fmt,
                       help="write the pipeline's IR YAML (for the KFP UI or kfp run create)")
    c.add_argument("-o", "--output", default="pipeline.yaml", help="YAML file to write")
    c.add_argument("--image", help="default of the pipeline's image parameter (default: "
                   f"{DEFAULT_IMAGE})")
    add_storage_flags(c)
    c.set_defaults(func=_compile)
    s = sub.add_parser("submit", formatter_class=fmt,
                       help="compile and start a run on a KFP endpoint (kfp.Client)")
    s.add_argument("--endpoint", required=True, help="KFP API endpoint, e.g. "
                   "http://localhost:8080 (kubectl port-forward svc/ml-pipeline-ui)")
    s.add_argument("--experiment", default="kfvision", help="experiment (created if missing)")
    s.add_argument("--run-name", help="run name (default: pipeline name and time)")
    add_cluster_flags(s, (*TARGET, "wait", "timeout", "poll"))  # -n: a profile's namespace
    auth = s.add_mutually_exclusive_group()
    auth.add_argument("--token", help="bearer token for a multi-user Kubeflow (kfp.Client's "
                      "existing_token)")
    auth.add_argument("--token-file", metavar="FILE", help="read the bearer token from FILE, e.g. "
                      "a projected service account token")
    s.add_argument("--cookies", help="cookie header for a Kubeflow behind an auth proxy, e.g. "
                   "'authservice_session=...'")
    s.add_argument("--ssl-ca-cert", metavar="FILE", help="certificate authority that signed the "
                   "endpoint's TLS certificate")
    s.add_argument("--source-store", metavar="S3_URI", help="upload a --script-source folder of "
                   "this machine here (s3://BUCKET/PREFIX), as PREFIX/<sha256>.tar.gz")
    add_storage_flags(s)
    add_parameter_flags(s)
    s.set_defaults(func=_submit)
    r = sub.add_parser("run-local", formatter_class=fmt, help="run the whole pipeline on this "
                       "machine (KFP's local runner; training as local processes)")
    r.add_argument("--out", default="build/pipeline", help="folder for every step's outputs")
    add_storage_flags(r, only=("data_uri",))
    add_parameter_flags(r)
    r.set_defaults(func=_run_local)

