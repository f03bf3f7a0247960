"""`kfvision deploy render | submit | delete`: the KServe InferenceService of a trained model."""

import argparse
import sys
from pathlib import Path

from kfvision.pipelines.cli.clusterargs import add_command, add_submit, submit_command
from kfvision.pipelines.serve.deploy import DeployConfig
from kfvision.pipelines.serve.deployclient import DeployClient
from kfvision.trainer.options import HelpFormatter, add_flags, options_of

EPILOG = """\
render, then apply (docs/serving.md):
  kfvision deploy render --model pvc://kfvision-data/models/digits-resnet18 --name digits \\
      --image registry.example.com/kfvision-trainer:0.1.0 -o isvc.yaml
  kfvision deploy submit isvc.yaml --wait        # or: kubectl apply -f isvc.yaml
  kfvision deploy delete digits
"""


def _check_kubeflow(uri: str) -> None:
    """Check a model-registry:// URI against the registry at KFVISION_REGISTRY_URL when it
    answers; otherwise say, in one line, that it goes to KServe unchecked."""
    import os

    from kfvision.pipelines.clients.endpoints import EndpointUnreachableError
    from kfvision.pipelines.clients.registry import REGISTRY_TOKEN, REGISTRY_URL, check_kubeflow_uri

    url = os.environ.get(REGISTRY_URL)
    if not url:
        print(f"not checked: {uri} (set {REGISTRY_URL} to check it against the Kubeflow Model "
              "Registry); KServe resolves it", file=sys.stderr)
        return
    try:
        where = check_kubeflow_uri(uri, url=url, token=os.environ.get(REGISTRY_TOKEN))
    except EndpointUnreachableError as e:
        print(f"not checked: {uri} (the Kubeflow Model Registry at {url} does not answer: "
              f"{e}); KServe resolves it", file=sys.stderr)
        return
    print(f"checked: {uri} is in the Kubeflow Model Registry at {url}"
          f"{f' (stored at {where})' if where else ''}", file=sys.stderr)


def _render(args) -> int:
    from kfvision.pipelines.clients.k8s import to_yaml
    from kfvision.pipelines.serve.deploy import build_inference_service

    if args.model.startswith("models:/"):  # MLflow's registry: the version's storage URI
        from kfvision.pipelines.clients.registry import storage_uri

        args.model = storage_uri(args.model)
    elif args.model.startswith("model-registry://"):  # KServe resolves it: checked when we can
        _check_kubeflow(args.model)
    cfg = DeployConfig(**{o.name: getattr(args, o.name) for o in options_of(DeployConfig)})
    text = to_yaml(build_inference_service(cfg))
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        from kfvision.trainer.fileio import atomic_write_bytes

        atomic_write_bytes(args.output, text.encode())
        print(f"wrote InferenceService {args.name} to {args.output}", file=sys.stderr)
    return 0


def _submit(args) -> int:
    import yaml
    from kfvision.pipelines.serve import deployclient

    text = sys.stdin.read() if args.manifest == "-" else Path(args.manifest).read_text()
    isvc = yaml.safe_load(text)
    if not isinstance(isvc, dict) or isvc.get("kind") != deployclient.KIND:
        from kfvision.trainer.errors import InvalidParameterError

        raise InvalidParameterError(f"{args.manifest} is not an InferenceService manifest; "
                                    "write one with `kfvision deploy render`.")
    return submit_command(args, deployclient.connect, isvc)


def _delete(args) -> int:
    from kfvision.pipelines.serve import deployclient

    client = deployclient.connect(args.namespace)
    client.delete(args.name)
    print(f"deleted InferenceService {client.namespace}/{args.name}")
    return 0


def register(subparsers, help: str) -> None:
    """Add `kfvision deploy ...` to the `kfvision` command line's subparsers."""
    d = subparsers.add_parser("deploy", help=help, epilog=EPILOG,
                              description="Deploy a trained model on KServe.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = d.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    r = sub.add_parser("render", formatter_class=HelpFormatter,
                       help="write the InferenceService YAML (serving.kserve.io/v1beta1)")
    add_flags(r, options_of(DeployConfig))
    r.add_argument("-o", "--output", help="output file ('-' or none: standard output)")
    r.set_defaults(func=_render)
    add_submit(sub, DeployClient, _submit, "create (or update) the InferenceService on the "
               "cluster", manifest="InferenceService YAML ('-': standard input)")
    add_command(sub, "delete", _delete, "delete the InferenceService",
                name="InferenceService name")
