"""`kfvision deploy render`: the KServe InferenceService that serves a trained model."""

import argparse
import sys

from pipelines.serve.deploy import DeployConfig

EPILOG = """\
render, then apply (docs/serving.md):
  kfvision deploy render --model pvc://kfvision-data/models/digits-resnet18 --name digits \\
      --image registry.example.com/kfvision-trainer:0.1.0 -o isvc.yaml
  kubectl apply -f isvc.yaml && kubectl wait --for=condition=Ready inferenceservice/digits
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


def register(subparsers, help: str) -> None:
    """Add `kfvision deploy ...` to the `kfvision` command line's subparsers."""
    d = subparsers.add_parser("deploy", help=help, epilog=EPILOG,
                              description="Deploy a trained model on KServe.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = d.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    d0 = DeployConfig("x", "pvc://x", "x")
    r = sub.add_parser("render", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
