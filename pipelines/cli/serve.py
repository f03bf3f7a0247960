"""`kfvision serve`: a trained model (or its ONNX export) behind KServe's model server."""

import argparse

from pipelines.clients.s3 import S3Options, is_s3
from pipelines.serve.server import DEFAULTS
from trainer.options import add_flags, options_of

EPILOG = """\
serve, then query (docs/serving.md):
  kfvision serve --model models/r18-trained --name digits --http-port 8080
  curl localhost:8080/v2/health/ready
  curl -H 'Content-Type: application/json' localhost:8080/v1/models/digits:predict \\
      -d "{\\"instances\\": [{\\"image\\": {\\"b64\\": \\"$(base64 -w0 cat.jpg)\\"}}]}"
"""


def _serve(args) -> int:
    from pipelines.clients.models import resolve_model
    from pipelines.serve.server import default_name, serve

    name = args.name
    if name is None and is_s3(args.model):  # named after the URI, not the cache's folder
        last = args.model.rstrip("/").rpartition("/")[2]
        name = default_name(last.removesuffix(".onnx"))
    elif name is None and args.model.startswith("models:/"):  # models:/NAME/1: NAME
        name = default_name(args.model[len("models:/"):].split("/")[0].split("@")[0])
    elif name is None and args.model.startswith("model-registry://"):  # [HOST/]NAME/VERSION
        parts = args.model[len("model-registry://"):].split("/")
        name = default_name(parts[-2] if len(parts) > 1 else parts[0])
    model = resolve_model(args.model, max_connections=args.max_connections)
    serve(model, name=name, http_port=args.http_port, grpc_port=args.grpc_port,
          workers=args.workers, model_threads=args.model_threads,
          model_streams=args.model_streams, device=args.device, runtime=args.runtime,
          max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms)
    return 0


def register(subparsers, help: str) -> None:
    """Add `kfvision serve` to the `kfvision` command line's subparsers."""
    s = subparsers.add_parser("serve", help=help, epilog=EPILOG,
                              description="Serve a trained model with KServe's model server: "
                              "the v1 and v2 inference protocols over REST, v2 over gRPC.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", required=True,
                   help="trained model directory, or an ONNX file `kfvision export` wrote (int8 "
                   "too); "
                   "either may be an s3:// URI (fetched once into a cache keyed by its ETags); or "
                   "models:/NAME/VERSION or models:/NAME@ALIAS (MLflow's registry)")
    s.add_argument("--name", help="model name in the URLs (default: from the model's path)")
    s.add_argument("--http-port", type=int, default=DEFAULTS["http_port"],
                   help=f"REST port, all interfaces (default: {DEFAULTS['http_port']})")
    s.add_argument("--grpc-port", type=int, default=DEFAULTS["grpc_port"],
                   help=f"v2 gRPC port, all interfaces (default: {DEFAULTS['grpc_port']})")
    s.add_argument("--workers", type=int,
                   help="threads that decode images (default: the number of CPUs); one process "
                   "holds the model")
    s.add_argument("--model-threads", type=int,
                   help="threads of one forward pass (default: the number of CPUs)")
    s.add_argument("--model-streams", type=int,
                   help="forward passes that may run at once, each on --model-threads threads "
                   "(default: 1); e.g. 4 streams x 4 threads on 16 cores")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model runs (default: cpu)")
    # trainer.use.predict.RUNTIMES, written out: importing it would load torch for --help
    s.add_argument("--runtime", choices=("torch", "onnx", "openvino"),
                   help="torch for a model directory, onnx for an ONNX file, openvino for an int8 "
                   "one (`kfvision export --quantize int8`) (default: by --model)")
    s.add_argument("--max-batch-size", type=int, default=DEFAULTS["max_batch_size"],
                   help="images per forward pass at most, across concurrent requests "
                   f"(default: {DEFAULTS['max_batch_size']})")
    s.add_argument("--batch-wait-ms", type=float, default=DEFAULTS["batch_wait_ms"],
                   help="how long an idle model waits for requests still decoding before it "
                   f"runs a batch (default: {DEFAULTS['batch_wait_ms']})")
    add_flags(s, options_of(S3Options))
    s.set_defaults(func=_serve)
