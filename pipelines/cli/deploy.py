"""`kfvision deploy render | submit | delete`: the KServe InferenceService of a trained model."""

import argparse
import sys
from pathlib import Path

from pipelines.serve.deploy import DeployConfig
from trainer.options import HelpFormatter

EPILOG = """\
render, then apply (docs/serving.md):
  kfvision deploy render --model pvc://kfvision-data/models/digits-resnet18 --name digits \\
      --image registry.example.com/kfvision-trainer:0.1.0 -o isvc.yaml
  kfvision deploy submit isvc.yaml --wait        # or: kubectl apply -f isvc.yaml
  kfvision deploy delete digits
"""


def _render(args) -> int:
    from pipelines.serve.deploy import build_inference_service, to_yaml

    cfg = DeployConfig(name=args.name, model=args.model, image=args.image,
                       namespace=args.namespace, gpus=args.gpus, min_replicas=args.min_replicas,
                       max_replicas=args.max_replicas, cpu=args.cpu, memory=args.memory,
                       max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms)
    text = to_yaml(build_inference_service(cfg))
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        from trainer.fileio import atomic_write_bytes

        atomic_write_bytes(args.output, text.encode())
        print(f"wrote InferenceService {args.name} to {args.output}", file=sys.stderr)
    return 0


def _submit(args) -> int:
    import yaml

    from pipelines.serve import cluster

    text = sys.stdin.read() if args.manifest == "-" else Path(args.manifest).read_text()
    isvc = yaml.safe_load(text)
    if not isinstance(isvc, dict) or isvc.get("kind") != cluster.KIND:
        from trainer.errors import InvalidParameterError

        raise InvalidParameterError(f"{args.manifest} is not an InferenceService manifest; "
                                    "write one with `kfvision deploy render`.")
    client = cluster.connect(args.namespace or isvc["metadata"].get("namespace"))
    name = isvc["metadata"]["name"]
    print(f"{client.apply(isvc)} InferenceService {client.namespace}/{name}")
    if args.wait:
        client.wait_ready(name, args.timeout, args.poll)
    return 0


def _delete(args) -> int:
    from pipelines.serve import cluster

    client = cluster.connect(args.namespace)
    client.delete(args.name)
    print(f"deleted InferenceService {client.namespace}/{args.name}")
    return 0


def register(subparsers, help: str) -> None:
    """Add `kfvision deploy ...` to the `kfvision` command line's subparsers."""
    d = subparsers.add_parser("deploy", help=help, epilog=EPILOG,
                              description="Deploy a trained model on KServe.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = d.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    d0 = DeployConfig("x", "pvc://x", "x")
    r = sub.add_parser("render", formatter_class=HelpFormatter,
                       help="write the InferenceService YAML (serving.kserve.io/v1beta1)")
    r.add_argument("--model", required=True, help="storage URI of the trained model directory: "
                   "pvc://CLAIM/path, s3://..., gs://... (mounted at /mnt/models)")
    r.add_argument("--name", required=True, help="InferenceService name (and model name)")
    r.add_argument("--image", required=True, help="the kfvision image (images/Dockerfile)")
    r.add_argument("--namespace", help="namespace (default: kubectl's)")
    r.add_argument("--gpus", type=int, default=d0.gpus, help="GPUs per replica")
    r.add_argument("--min-replicas", type=int, default=d0.min_replicas,
                   help="replicas at least (0: scale to zero, serverless mode)")
    r.add_argument("--max-replicas", type=int, default=d0.max_replicas, help="replicas at most")
    r.add_argument("--cpu", default=d0.cpu, help="CPU request per replica")
    r.add_argument("--memory", default=d0.memory, help="memory request and limit per replica")
    r.add_argument("--max-batch-size", type=int, help="passed to `kfvision serve`")
    r.add_argument("--batch-wait-ms", type=float, help="passed to `kfvision serve`")
    r.add_argument("-o", "--output", help="output file ('-' or none: standard output)")
    r.set_defaults(func=_render)
    fmt = HelpFormatter
    s = sub.add_parser("submit", formatter_class=fmt,
                       help="create (or update) the InferenceService on the cluster")
    s.add_argument("manifest", help="InferenceService YAML ('-': standard input)")
    s.add_argument("-n", "--namespace", help="namespace (default: the manifest's, else the "
                   "kubeconfig's)")
    s.add_argument("--wait", action="store_true", help="wait until it is Ready")
    s.add_argument("--timeout", type=float, default=600, help="seconds to wait at most")
    s.add_argument("--poll", type=float, default=5, help="seconds between status reads")
    s.set_defaults(func=_submit)
    x = sub.add_parser("delete", formatter_class=fmt, help="delete the InferenceService")
    x.add_argument("name")
    x.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig's)")
    x.set_defaults(func=_delete)
